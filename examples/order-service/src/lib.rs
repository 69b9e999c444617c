//! # order-service: an example rabbit-inbox consumer
//!
//! Run with: `cargo run -p order-service` (PostgreSQL and RabbitMQ on their default local
//! addresses; override with `DATABASE_URL` and `AMQP_URL`).
//!
//! Its effects make duplicates visible: a payment applied twice doubles `paid_cents` and leaves
//! two `payment_history` rows for one message id. Every applied message with a sequence number
//! ([`SEQUENCE_HEADER`]) is journaled, so an ordered consumer's per-order order can be checked
//! ([`ordering`]). See this crate's README for the queue, message format and tables, so any
//! AMQP client can drive it.

pub mod messages;
mod tables;

use std::time::Duration;

use rabbit_inbox::{
    ConsumerConfig, Handler, HandlerError, InboxMessage, OutboxMessage, RetryPolicy, SchemaName,
    Topology,
    ordering::{GapPolicy, OrderingPolicy, SequencePolicy},
};
use serde::Deserialize;
use sqlx::PgConnection;

pub use tables::{StepFault, Verification, clear_step_fault, migrate, set_step_fault, verify};

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
/// Header carrying a message's number in its order's sequence: the service journals every
/// applied message that has one (table `order_journal`), and [`ordering`] orders by it.
pub const SEQUENCE_HEADER: &str = "x-sequence";
/// How long an ordered consumer ([`ordering`]) holds an order's later messages for a missing
/// number before it alerts: far longer than any redelivery takes, so it fires only for a
/// message that is really lost. The held messages keep waiting after the alert.
pub const GAP_TIMEOUT: Duration = Duration::from_secs(600);

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

/// Per-order processing order (set as `config.ordering`): each order's messages, by
/// `x-aggregate-id`, run in the order of their [`SEQUENCE_HEADER`] numbers, from 1, through
/// retries and parking; a missing number holds the later ones (see [`GAP_TIMEOUT`]).
pub fn ordering() -> OrderingPolicy {
    OrderingPolicy::by_aggregate().with_sequence(
        SequencePolicy::header(SEQUENCE_HEADER).on_gap(GAP_TIMEOUT, GapPolicy::KeepHolding),
    )
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

#[derive(Deserialize)]
struct OrderStep {
    order_id: String,
    step: i64,
}

impl Handler for OrderHandler {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let t = tables::Tables::new(&self.schema);
        match msg.message_type() {
            "OrderPlaced" => placed(&t, msg, tx).await?,
            "PaymentReceived" => self.payment(&t, msg, tx).await?,
            "OrderCancelled" => cancelled(&t, msg, tx).await?,
            "OrderStep" => step(&t, msg, tx).await?,
            other => {
                return Err(HandlerError::permanent(
                    "unknown_message_type",
                    format!("order-service does not handle {other:?}"),
                ));
            }
        }
        journal(&t, msg, tx).await
    }
}

impl OrderHandler {
    async fn payment(
        &self,
        t: &tables::Tables,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
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
}

async fn placed(
    t: &tables::Tables,
    msg: &InboxMessage<'_>,
    tx: &mut PgConnection,
) -> Result<(), HandlerError> {
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

async fn cancelled(
    t: &tables::Tables,
    msg: &InboxMessage<'_>,
    tx: &mut PgConnection,
) -> Result<(), HandlerError> {
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

/// A step's effect is its journal row; it meets the failure `order_step_faults` sets for it.
async fn step(
    t: &tables::Tables,
    msg: &InboxMessage<'_>,
    tx: &mut PgConnection,
) -> Result<(), HandlerError> {
    let m: OrderStep = msg.decode()?;
    match t.step_fault(tx, &m.order_id, m.step).await? {
        // Told by the delivery, not by the attempt count: whatever ran before, the copy a
        // retry tier returns carries the broker's `x-death`.
        Some(StepFault::RetryOnce) if msg.envelope().death_count == 0 => {
            Err(HandlerError::retryable(
                "step_not_ready",
                format!(
                    "order {} step {} fails until a retry brings it back (order_step_faults: \
                     retry_once); its retry applies it",
                    m.order_id, m.step
                ),
            ))
        }
        Some(StepFault::Refuse) => Err(HandlerError::permanent(
            "step_refused",
            format!(
                "order {} step {} is refused while order_step_faults lists it; delete that \
                 row, then redrive the message",
                m.order_id, m.step
            ),
        )),
        _ => Ok(()),
    }
}

/// Journals an applied message that carries a sequence number ([`SEQUENCE_HEADER`], an
/// integer or its decimal text) and an aggregate id; others are not journaled.
async fn journal(
    t: &tables::Tables,
    msg: &InboxMessage<'_>,
    tx: &mut PgConnection,
) -> Result<(), HandlerError> {
    let envelope = msg.envelope();
    let sequence = match envelope.headers.get(SEQUENCE_HEADER) {
        Some(serde_json::Value::Number(n)) => n.as_i64(),
        Some(serde_json::Value::String(s)) => s.trim().parse().ok(),
        _ => None,
    };
    if let (Some(aggregate_id), Some(sequence)) = (envelope.aggregate_id.as_deref(), sequence) {
        t.journal(
            tx,
            aggregate_id,
            sequence,
            msg.message_id(),
            msg.message_type(),
        )
        .await?;
    }
    Ok(())
}
