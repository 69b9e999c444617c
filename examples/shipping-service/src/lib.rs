//! # shipping-service: an example consumer downstream of order-service
//!
//! Run with: `cargo run -p shipping-service` (PostgreSQL and RabbitMQ on their default local
//! addresses; override with `DATABASE_URL` and `AMQP_URL`).
//!
//! It consumes the `OrderPaid` events order-service emits through its outbox and ships each
//! paid order once, with its own inbox. A shipment applied twice would show as two
//! `shipments` rows for one order. See this crate's README for queues, messages and tables.

use std::time::Duration;

use rabbit_inbox::{
    ConsumerConfig, Handler, HandlerError, InboxMessage, RetryPolicy, SchemaName, StoreError,
    Topology, schema::SchemaLock,
};
use serde::Deserialize;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row};

/// Consumer name: the second half of the inbox key.
pub const CONSUMER_NAME: &str = "shipping-service";
/// The service's work queue.
pub const QUEUE: &str = "shipping-service";
/// The exchange order-service emits to (`order_service::EVENTS_EXCHANGE`).
pub const EVENTS_EXCHANGE: &str = "order-events";

/// Queue `queue` bound to `exchange` with `order.paid`; inbox and tables in `schema`.
pub fn config(schema: SchemaName, queue: &str, exchange: &str) -> ConsumerConfig {
    let mut config = ConsumerConfig::new(
        CONSUMER_NAME,
        Topology::new(queue).with_exchange(exchange, &["order.paid"]),
    );
    config.schema = schema;
    config.retry =
        RetryPolicy::tiered([1, 2, 5, 10].into_iter().map(Duration::from_secs).collect());
    config
}

/// Creates the `shipments` table in `schema` (idempotent), under the schema's lock.
pub async fn migrate(pool: &PgPool, schema: &SchemaName) -> Result<(), StoreError> {
    let mut lock = SchemaLock::acquire(pool, schema).await?;
    let created = sqlx::raw_sql(AssertSqlSafe(format!(
        r#"
        CREATE SCHEMA IF NOT EXISTS "{schema}";
        -- Deliberately no unique constraint on order_id: a double shipment must show.
        CREATE TABLE IF NOT EXISTS "{schema}".shipments (
            shipment_id  BIGSERIAL PRIMARY KEY,
            order_id     TEXT NOT NULL,
            customer_id  TEXT NOT NULL,
            total_cents  BIGINT NOT NULL,
            message_id   TEXT NOT NULL,
            causation_id TEXT,
            shipped_at   TIMESTAMPTZ NOT NULL DEFAULT now()
        );
        CREATE INDEX IF NOT EXISTS shipments_order ON "{schema}".shipments (order_id);
        "#
    )))
    .execute(lock.connection())
    .await;
    let released = lock.release().await;
    created?;
    released
}

/// The handler: one shipment per `OrderPaid`.
#[derive(Debug)]
pub struct ShippingHandler {
    schema: SchemaName,
}

impl ShippingHandler {
    /// A handler whose table lives in `schema`.
    pub fn new(schema: SchemaName) -> Self {
        Self { schema }
    }
}

#[derive(Deserialize)]
struct OrderPaid {
    order_id: String,
    customer_id: String,
    total: i64,
}

impl Handler for ShippingHandler {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        if msg.message_type() != "OrderPaid" {
            return Err(HandlerError::permanent(
                "unknown_message_type",
                format!("shipping-service does not handle {:?}", msg.message_type()),
            ));
        }
        let paid: OrderPaid = msg.decode()?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".shipments (order_id, customer_id, total_cents, message_id, causation_id) \
             VALUES ($1, $2, $3, $4, $5)",
            self.schema
        )))
        .bind(&paid.order_id)
        .bind(&paid.customer_id)
        .bind(paid.total)
        .bind(msg.message_id())
        .bind(msg.envelope().causation_id.as_deref())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

/// The chain's exactly-once check: what order-service emitted (its outbox, in
/// `upstream_schema`) against what shipping-service applied (in `shipping_schema`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChainVerification {
    /// `OrderPaid` rows in the upstream outbox.
    pub emitted: i64,
    /// Of those, confirmed by the broker.
    pub sent: i64,
    /// Of those, not yet (PENDING or FAILED).
    pub unsent: i64,
    /// Shipment rows.
    pub shipments: i64,
    /// Orders shipped more than once.
    pub shipped_twice: i64,
    /// Emitted events without a shipment: lost on the way (once everything is sent and
    /// consumed).
    pub not_shipped: i64,
    /// Shipments whose message was never emitted.
    pub shipments_without_event: i64,
    /// Shipments whose message is not PROCESSED in the shipping inbox.
    pub shipments_without_ledger: i64,
    /// PROCESSED `OrderPaid` messages in the shipping inbox without their shipment.
    pub ledger_without_shipment: i64,
}

impl ChainVerification {
    /// Every emitted event shipped exactly once, nothing shipped that was not emitted.
    pub fn exactly_once(&self) -> bool {
        self.shipped_twice == 0
            && self.not_shipped == 0
            && self.shipments_without_event == 0
            && self.shipments_without_ledger == 0
            && self.ledger_without_shipment == 0
    }
}

/// Counts [`ChainVerification`] from the database.
pub async fn verify_chain(
    pool: &PgPool,
    upstream_schema: &SchemaName,
    shipping_schema: &SchemaName,
) -> Result<ChainVerification, sqlx::Error> {
    let sql = format!(
        r#"
        WITH emitted AS (SELECT message_id, status FROM "{u}".outbox WHERE message_type = 'OrderPaid'),
             inbox AS (SELECT message_id, status FROM "{s}".message_inbox WHERE consumer_name = $1)
        SELECT
          (SELECT count(*) FROM emitted) AS emitted,
          (SELECT count(*) FROM emitted WHERE status = 'SENT') AS sent,
          (SELECT count(*) FROM emitted WHERE status <> 'SENT') AS unsent,
          (SELECT count(*) FROM "{s}".shipments) AS shipments,
          (SELECT count(*) FROM (SELECT order_id FROM "{s}".shipments GROUP BY order_id
             HAVING count(*) > 1) d) AS shipped_twice,
          (SELECT count(*) FROM emitted e WHERE NOT EXISTS (
             SELECT 1 FROM "{s}".shipments p WHERE p.message_id = e.message_id)) AS not_shipped,
          (SELECT count(*) FROM "{s}".shipments p WHERE NOT EXISTS (
             SELECT 1 FROM emitted e WHERE e.message_id = p.message_id)) AS shipments_without_event,
          (SELECT count(*) FROM "{s}".shipments p WHERE NOT EXISTS (
             SELECT 1 FROM inbox i WHERE i.message_id = p.message_id AND i.status = 'PROCESSED'))
             AS shipments_without_ledger,
          (SELECT count(*) FROM inbox i WHERE i.status = 'PROCESSED' AND NOT EXISTS (
             SELECT 1 FROM "{s}".shipments p WHERE p.message_id = i.message_id))
             AS ledger_without_shipment
        "#,
        u = upstream_schema,
        s = shipping_schema
    );
    let row = sqlx::query(AssertSqlSafe(sql))
        .bind(CONSUMER_NAME)
        .fetch_one(pool)
        .await?;
    Ok(ChainVerification {
        emitted: row.try_get("emitted")?,
        sent: row.try_get("sent")?,
        unsent: row.try_get("unsent")?,
        shipments: row.try_get("shipments")?,
        shipped_twice: row.try_get("shipped_twice")?,
        not_shipped: row.try_get("not_shipped")?,
        shipments_without_event: row.try_get("shipments_without_event")?,
        shipments_without_ledger: row.try_get("shipments_without_ledger")?,
        ledger_without_shipment: row.try_get("ledger_without_shipment")?,
    })
}
