//! # rabbit-inbox
//!
//! Exactly-once business effects for RabbitMQ consumers. Each delivery's key
//! `(message_id, consumer_name)` is claimed in a PostgreSQL inbox table inside the same
//! transaction as the business effect, and the delivery is acked only after that transaction
//! commits. Duplicates (redeliveries after a crash, republishes, replays) find the committed
//! row and are acked without running the effect again.
//!
//! ```no_run
//! use rabbit_inbox::{Consumer, ConsumerConfig, Handler, HandlerError, InboxMessage, Topology};
//! use sqlx::PgConnection;
//!
//! struct Greeter;
//!
//! impl Handler for Greeter {
//!     async fn handle(&self, msg: &InboxMessage<'_>, tx: &mut PgConnection) -> Result<(), HandlerError> {
//!         #[derive(serde::Deserialize)]
//!         struct Hello { name: String }
//!         let hello: Hello = msg.decode()?;
//!         sqlx::query("INSERT INTO greetings (name) VALUES ($1)")
//!             .bind(&hello.name)
//!             .execute(&mut *tx)
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
//! let config = ConsumerConfig::new("greeter", Topology::new("greetings"));
//! rabbit_inbox::migrate(&pool, &config.schema).await?;
//! let consumer = Consumer::new("amqp://guest:guest@127.0.0.1:5672/%2f", pool, config, Greeter)?;
//! consumer.run(async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```

mod backoff;
mod broker;
mod canonical_json;
mod config;
mod consumer;
mod db_error;
mod dedup;
mod envelope;
mod error;
#[cfg(feature = "fault-injection")]
mod fault;
mod handler;
mod json_error;
mod lease;
pub mod ops;
mod outbox;
pub mod privacy;
mod processor;
mod retention;
pub mod roles;
mod schema;
mod session_loss;
mod stats;
mod store;
pub mod telemetry;

pub use broker::{
    AmqpAddresses, AmqpTls, Broker, DEFAULT_MANAGEMENT_PORT, DEFAULT_MANAGEMENT_TLS_PORT,
    ManagementClient, ManagementError, OutgoingMessage, ParkedMessage, ParkingLot, QueueDepth,
    QueueDepths, QueueInfo, QueueSetting, Republished, parking_headers,
};
pub use broker::{HEADER_TOO_DEEP, MAX_HEADER_DEPTH};
#[doc(hidden)]
pub use broker::{convert_headers, headers_to_json};
pub use canonical_json::canonical_json;
pub use config::{ConsumerConfig, PayloadStorage, QueueType, RetryPolicy, Topology};
pub use consumer::{Consumer, shutdown_signal};
pub use dedup::{DedupStrategy, MAX_KEY_LEN};
pub use envelope::{
    AGGREGATE_ID_HEADER, AGGREGATE_TYPE_HEADER, AmqpMessage, BodyHash, CAUSATION_HEADER, Envelope,
    EnvelopeRules, FieldLimits, InvalidMessage, InvalidReason, TENANT_HEADER, TRACEPARENT_HEADER,
    TYPE_HEADER, VERSION_HEADER, parse,
};
pub use error::{BrokerError, ConfigError, ConsumerError, StoreError};
#[cfg(feature = "fault-injection")]
pub use fault::{FaultPlan, RedriveFaults, RedriveStep};
pub use handler::{
    BatchError, BatchHandler, ErrorKind, HANDLER_PANICKED, Handler, HandlerError, InboxMessage,
    PerMessage,
};
pub use lease::{LEASE_LOST, Lease, LeaseConfig, LeaseError, Leased, LeasedHandler};
#[cfg(feature = "fault-injection")]
pub use outbox::RelayFaults;
pub use outbox::{
    Enqueued, MessageOutbox, OUTBOX_MAX_PAYLOAD_BYTES, Outbox, OutboxError, OutboxMessage,
    OutboxRecord, OutboxStatus, OutboxStore, OutboxSummary, Relay, RelayConfig, RelayError,
    RelayStats, RelayStatsSnapshot, emitted_message_id,
};
pub use processor::{Outcome, PAYLOAD_CONFLICT, TRANSACTION_ABORTED};
pub use retention::{RetentionMode, RetentionPolicy, TypeRetention};
pub use schema::{MIGRATOR, SchemaLock, SchemaName, drop_schema, migrate};
pub use stats::{ConsumerStats, StatsSnapshot};
pub use store::{
    Claim, Failure, InboxRecord, InboxStatus, InboxStore, MAX_ERROR_MESSAGE_CHARS, OpenRowsSample,
    Redelivery, RowPayload,
};
pub use telemetry::TelemetryConfig;
