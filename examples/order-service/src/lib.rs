//! # order-service: an example rabbit-inbox consumer
//!
//! Run with: `cargo run -p order-service` (PostgreSQL and RabbitMQ on their default local
//! addresses; override with `DATABASE_URL` and `AMQP_URL`).
//!
//! Its effects make duplicates visible: a payment applied twice doubles `paid_cents` and leaves
//! two `payment_history` rows for one message id. See this crate's README for the queue,
//! message format and tables, so any AMQP client can drive it.

pub mod messages;
mod tables;

use std::time::Duration;

use rabbit_inbox::{
    ConsumerConfig, Handler, HandlerError, InboxMessage, OutboxMessage, RetryPolicy, SchemaName,
    Topology,
};
use serde::Deserialize;
use sqlx::PgConnection;

pub use tables::{Verification, migrate, verify};

/// Consumer name: the second half of the inbox key.
pub const CONSUMER_NAME: &str = "order-service";
/// Exchange producers publish to.
pub const EXCHANGE: &str = "orders";
/// The service's work queue.
pub const QUEUE: &str = "order-service";
/// Topic exchange the service emits its events to (`OrderPaid` with routing key `order.paid`),
/// through its outbox.
pub const EVENTS_EXCHANGE: &str = "order-events";
/// Routing key of `OrderPaid`.
pub const ORDER_PAID_KEY: &str = "order.paid";

/// The service's configuration: queue `order-service` bound to exchange `orders` with `order.#`,
/// inbox and business tables in `schema`.
pub fn config(schema: SchemaName, queue: &str, exchange: &str) -> ConsumerConfig {
    let mut config = ConsumerConfig::new(
        CONSUMER_NAME,
        Topology::new(queue).with_exchange(exchange, &["order.#"]),
    );
    config.schema = schema;
    // Tiered retries (5 attempts): a payment whose order is a second late is retried after
    // 1 s; one whose order is up to ~18 s late still succeeds before it is poisoned. Shorter
    // than the library's default tiers, so demo and chaos runs settle quickly.
    config.retry =
        RetryPolicy::tiered([1, 2, 5, 10].into_iter().map(Duration::from_secs).collect());
    config
}

/// The handler. Amounts are integers in minor units (cents).
#[derive(Debug)]
pub struct OrderHandler {
    schema: SchemaName,
    events_exchange: String,
}

impl OrderHandler {
    /// A handler whose tables live in `schema`, emitting to [`EVENTS_EXCHANGE`].
    pub fn new(schema: SchemaName) -> Self {
        Self {
            schema,
            events_exchange: EVENTS_EXCHANGE.to_owned(),
        }
    }

    /// Emits its events to `exchange` instead.
    pub fn with_events_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.events_exchange = exchange.into();
        self
    }
}

/// `OrderPaid`, emitted once per order when its paid total reaches its total.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct OrderPaid {
    /// The order.
    pub order_id: String,
    /// Its customer.
    pub customer_id: String,
    /// Its total, in cents.
    pub total: i64,
    /// What was paid, in cents (at least the total).
    pub paid: i64,
}

#[derive(Deserialize)]
struct OrderPlaced {
    order_id: String,
    customer_id: String,
    total: i64,
}

#[derive(Deserialize)]
struct PaymentReceived {
    order_id: String,
    amount: i64,
}

#[derive(Deserialize)]
struct OrderCancelled {
    order_id: String,
}

impl Handler for OrderHandler {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let t = tables::Tables::new(&self.schema);
        match msg.message_type() {
            "OrderPlaced" => {
                let m: OrderPlaced = msg.decode()?;
                if m.total < 0 {
                    return Err(HandlerError::permanent(
                        "invalid_amount",
                        "total is negative",
                    ));
                }
                // Another message id for the same order is a logical duplicate: no-op.
                t.insert_order(tx, &m.order_id, &m.customer_id, m.total, msg.message_id())
                    .await?;
                Ok(())
            }
            "PaymentReceived" => {
                let m: PaymentReceived = msg.decode()?;
                if m.amount <= 0 {
                    return Err(HandlerError::permanent(
                        "invalid_amount",
                        "amount must be positive",
                    ));
                }
                match t
                    .add_payment(tx, &m.order_id, m.amount, msg.message_id())
                    .await?
                {
                    Ok(paid) if paid.completed => {
                        // Through the outbox, in this transaction: emitted if and only if the
                        // payment commits, with an id derived from this payment's, so a replay
                        // emits the same id and the shipping inbox drops the copy.
                        let event = OrderPaid {
                            order_id: m.order_id.clone(),
                            customer_id: paid.customer_id,
                            total: paid.total,
                            paid: paid.paid,
                        };
                        let out = OutboxMessage::json(
                            "OrderPaid",
                            &self.events_exchange,
                            ORDER_PAID_KEY,
                            &event,
                        )?
                        .with_aggregate("Order", &m.order_id);
                        msg.outbox(tx).enqueue(out).await?;
                        Ok(())
                    }
                    Ok(_) => Ok(()),
                    Err(tables::Transition::Applied) => Ok(()),
                    // It may arrive before its order: retry until the budget runs out.
                    Err(tables::Transition::NotFound) => Err(HandlerError::retryable(
                        "order_not_found",
                        format!("order {} does not exist (yet)", m.order_id),
                    )),
                    Err(tables::Transition::Refused(status)) => Err(HandlerError::permanent(
                        "invalid_transition",
                        format!("order {} is {status}; payment refused", m.order_id),
                    )),
                }
            }
            "OrderCancelled" => {
                let m: OrderCancelled = msg.decode()?;
                match t.cancel(tx, &m.order_id).await? {
                    tables::Transition::Applied => Ok(()),
                    tables::Transition::NotFound => Err(HandlerError::retryable(
                        "order_not_found",
                        format!("order {} does not exist (yet)", m.order_id),
                    )),
                    tables::Transition::Refused(status) => Err(HandlerError::permanent(
                        "invalid_transition",
                        format!(
                            "order {} is {status}; only PLACED orders can be cancelled",
                            m.order_id
                        ),
                    )),
                }
            }
            other => Err(HandlerError::permanent(
                "unknown_message_type",
                format!("order-service does not handle {other:?}"),
            )),
        }
    }
}
