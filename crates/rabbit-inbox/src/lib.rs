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
//! consumer.run(rabbit_inbox::shutdown_signal()).await?;
//! # Ok(()) }
//! ```
//!
//! The root holds the consumer's path: configuration, handlers, the consumer, the outbox and
//! its relay, the [`Runner`] that runs them side by side. The modules hold the rest for those
//! who build on the ledger or the broker directly (the operator crate `inbox-ops` does).
//!
//! Layers point down only (ARCHITECTURE.md): [`status`] (the state machine's words) at the
//! bottom; the envelope, privacy and the ledger ([`store`]) above it; the broker beside the
//! ledger, knowing no [`ConsumerConfig`]; the processor and the consumer runtime above both;
//! background work ([`Relay`], [`InboxSampler`]) beside the runtime, never inside it.

// A function of the core is read in one sitting: at most 80 lines (clippy.toml).
#![warn(clippy::too_many_lines)]

// The state machine's vocabulary.
pub mod status;
// Its words as SQL: the ledger's tables, status sets and shared conditions.
pub mod ledger_sql;

// What the ledger and the broker build on.
pub mod advisory_lock;
mod backoff;
pub mod canonical_json;
mod db_error;
pub mod dedup;
pub mod envelope;
pub mod error;
pub mod health;
mod json_error;
pub mod privacy;
pub mod retention;
pub mod retry;
pub mod roles;
pub mod schema;
mod session_loss;
pub mod stats;
pub mod telemetry;

// The ledger and the broker.
pub mod broker;
pub mod store;
// Per-key order, above the ledger it writes.
pub mod ordering;

// What application code writes, and what runs it.
pub mod config;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod handler;
pub mod lease;
pub mod outbox;
mod processor;
pub mod router;

mod consumer;
#[cfg(feature = "testing")]
pub mod testing;

// Beside the runtime.
mod runner;
mod sampler;

pub use broker::{QueueType, Topology};
pub use config::ConsumerConfig;
pub use consumer::Consumer;
pub use envelope::{Envelope, EnvelopeRules};
pub use error::{BrokerError, ConfigError, ConsumerError, StoreError};
pub use handler::{
    BatchError, BatchHandler, ErrorKind, Handler, HandlerError, InboxMessage, MessageOutbox,
    PerMessage,
};
pub use health::{Health, HealthSnapshot};
pub use lease::{Lease, LeaseConfig, LeaseError, Leased, LeasedHandler};
pub use outbox::{Enqueued, Outbox, OutboxError, OutboxMessage, Relay, RelayConfig};
pub use privacy::PayloadStorage;
pub use retry::RetryPolicy;
pub use router::{Router, RouterError, TypedBatchHandler, TypedHandler, TypedMessage};
pub use runner::{RunError, Runner, Shutdown, TaskResult, shutdown_signal};
pub use sampler::InboxSampler;
pub use schema::{SchemaName, migrate};
pub use status::{InboxStatus, Outcome};
pub use telemetry::TelemetryConfig;
