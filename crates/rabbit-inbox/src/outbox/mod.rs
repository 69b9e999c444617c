//! The outbox: messages written in the business transaction and published after the commit.
//!
//! - [`Outbox::enqueue`]: from any code that holds a transaction (a web request handler).
//! - [`crate::InboxMessage::outbox`] (the handler's side, in [`crate::handler`]): from an inbox
//!   handler, through the handler's own transaction, with deterministic ids (incoming key,
//!   consumer, position), causation, correlation and trace context taken from the incoming
//!   message.
//! - [`Relay`] (`relay`): publishes committed rows with confirms and `mandatory`, under a lease
//!   with a fencing token; [`OutboxStore`] (`store`) holds its statements and the operator's.
//! - `listener`: the LISTEN side of the wake-up after commit.
//!
//! Architecture invariant: a row is marked SENT only after the broker confirmed it as routed,
//! and only under the fencing token of the claim that published it. A message may therefore
//! be published more than once (a relay dies between the confirm and the mark), never lost;
//! its id does not change, so the downstream inbox dedups it.

mod amqp;
mod ids;
mod listener;
mod relay;
mod store;

use serde::Serialize;
use serde_json::{Map, Value};
use sqlx::PgConnection;

use amqp::{Headers, outgoing};
pub(crate) use ids::child_traceparent;
pub use ids::emitted_message_id;
#[cfg(feature = "fault-injection")]
pub use relay::RelayFaults;
pub use relay::{Relay, RelayConfig, RelayError, RelayStats, RelayStatsSnapshot};
pub use store::{OutboxRecord, OutboxStatus, OutboxStore, OutboxSummary};

use crate::{
    broker::{OutgoingMessage, check_publishable},
    schema::SchemaName,
};
use store::NewRow;

/// Longest id, type, content type, exchange, routing key or ordering key: AMQP carries them as
/// short strings.
const MAX_NAME_BYTES: usize = 255;

/// The largest payload [`Outbox::new`] accepts: RabbitMQ 4's default `max_message_size`
/// (16 MiB). A larger message would make the broker close the relay's channel on every try,
/// holding up the rows behind it, so it is refused when it is written instead.
pub const OUTBOX_MAX_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;

/// A message to write to the outbox.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboxMessage {
    /// AMQP `message-id`. Left `None`, it is derived (handler) or random ([`Outbox::enqueue`]).
    pub message_id: Option<String>,
    /// AMQP `type`.
    pub message_type: String,
    /// `x-message-version` header.
    pub message_version: i32,
    /// Exchange to publish to (`""`: the default exchange, routing key = queue).
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// `x-aggregate-type` header.
    pub aggregate_type: Option<String>,
    /// `x-aggregate-id` header.
    pub aggregate_id: Option<String>,
    /// Messages with the same ordering key are published one after the other, in the commit
    /// order of the transactions that wrote them. `None`: no order (faster).
    pub ordering_key: Option<String>,
    /// AMQP `correlation-id`. From a handler, defaults to the incoming message's.
    pub correlation_id: Option<String>,
    /// `x-causation-id` header. From a handler, defaults to the incoming message's id.
    pub causation_id: Option<String>,
    /// W3C `traceparent` header. From a handler, defaults to a child of the incoming one.
    pub traceparent: Option<String>,
    /// W3C `tracestate` header.
    pub tracestate: Option<String>,
    /// Other application headers.
    pub headers: Map<String, Value>,
    /// AMQP `content-type`.
    pub content_type: String,
    /// Body.
    pub payload: Vec<u8>,
}

impl OutboxMessage {
    /// A message of `message_type` whose body is `body` as JSON, to `routing_key` on `exchange`.
    pub fn json<T: Serialize + ?Sized>(
        message_type: impl Into<String>,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        body: &T,
    ) -> Result<Self, OutboxError> {
        let payload = serde_json::to_vec(body)
            .map_err(|e| OutboxError::Invalid(format!("body is not serializable: {e}")))?;
        Ok(Self {
            message_id: None,
            message_type: message_type.into(),
            message_version: 1,
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            aggregate_type: None,
            aggregate_id: None,
            ordering_key: None,
            correlation_id: None,
            causation_id: None,
            traceparent: None,
            tracestate: None,
            headers: Map::new(),
            content_type: "application/json".into(),
            payload,
        })
    }

    /// Sets the message id.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Sets the aggregate (the downstream consumer's lane and order key).
    pub fn with_aggregate(mut self, kind: impl Into<String>, id: impl Into<String>) -> Self {
        self.aggregate_type = Some(kind.into());
        self.aggregate_id = Some(id.into());
        self
    }

    /// Publishes in order with the other messages of its aggregate (set the aggregate first):
    /// the ordering key is `<aggregate type>/<aggregate id>`.
    pub fn in_aggregate_order(mut self) -> Self {
        self.ordering_key = match (&self.aggregate_type, &self.aggregate_id) {
            (Some(kind), Some(id)) => Some(format!("{kind}/{id}")),
            (None, Some(id)) => Some(id.clone()),
            _ => self.ordering_key,
        };
        self
    }

    /// Publishes in order with the other messages of `key`.
    pub fn with_ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Sets the correlation id.
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }

    /// Sets the W3C trace context.
    pub fn with_trace_context(
        mut self,
        traceparent: impl Into<String>,
        tracestate: Option<String>,
    ) -> Self {
        self.traceparent = Some(traceparent.into());
        self.tracestate = tracestate;
        self
    }

    /// Adds an application header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// What the relay will publish: properties and headers as AMQP carries them.
    pub(crate) fn outgoing(&self, message_id: &str) -> OutgoingMessage {
        outgoing(
            message_id,
            &self.message_type,
            self.message_version,
            Headers {
                aggregate_type: self.aggregate_type.as_deref(),
                aggregate_id: self.aggregate_id.as_deref(),
                causation_id: self.causation_id.as_deref(),
                traceparent: self.traceparent.as_deref(),
                tracestate: self.tracestate.as_deref(),
                headers: &self.headers,
            },
            self.correlation_id.as_deref(),
            &self.payload,
        )
    }

    fn validate(&self, message_id: &str, max_payload_bytes: usize) -> Result<(), OutboxError> {
        if self.payload.len() > max_payload_bytes {
            return Err(OutboxError::Invalid(format!(
                "payload is {} bytes; at most {max_payload_bytes} (Outbox::with_max_payload_bytes, \
                 within the broker's max_message_size)",
                self.payload.len()
            )));
        }
        let names = [
            ("message id", Some(message_id)),
            ("content type", Some(self.content_type.as_str())),
            ("message type", Some(self.message_type.as_str())),
            ("exchange", Some(self.exchange.as_str())),
            ("routing key", Some(self.routing_key.as_str())),
            ("ordering key", self.ordering_key.as_deref()),
        ];
        for (what, value) in names {
            if let Some(v) = value
                && v.len() > MAX_NAME_BYTES
            {
                return Err(OutboxError::Invalid(format!(
                    "{what} is {} bytes long; at most {MAX_NAME_BYTES}",
                    v.len()
                )));
            }
        }
        if message_id.is_empty() || self.message_type.is_empty() {
            return Err(OutboxError::Invalid(
                "message id and type must not be empty".into(),
            ));
        }
        check_publishable(&self.outgoing(message_id))
            .map_err(|e| OutboxError::Invalid(e.to_string()))
    }
}

/// Why a message could not be written to the outbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// The message can never be published (a name over 255 bytes, headers AMQP cannot carry).
    #[error("invalid outbox message: {0}")]
    Invalid(String),
    /// The database failed; the transaction is unusable.
    #[error("outbox database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// The result of an enqueue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Enqueued {
    /// The message's id.
    pub message_id: String,
    /// False when a row with this id existed already (the handler ran again for a replayed
    /// message): nothing new was written, and the downstream inbox dedups the id anyway.
    pub inserted: bool,
}

/// Writes messages to the outbox of one schema, inside the caller's transaction.
#[derive(Clone, Debug)]
pub struct Outbox {
    store: OutboxStore,
    notify: bool,
    max_payload_bytes: usize,
}

impl Outbox {
    /// The outbox in `schema` (created by [`crate::migrate`]); wakes the relays after commit.
    pub fn new(schema: SchemaName) -> Self {
        Self {
            store: OutboxStore::new(schema),
            notify: true,
            max_payload_bytes: OUTBOX_MAX_PAYLOAD_BYTES,
        }
    }

    /// Refuses payloads larger than `bytes` when they are written ([`OUTBOX_MAX_PAYLOAD_BYTES`]
    /// by default). Keep it within the broker's `max_message_size`.
    pub fn with_max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// Whether an enqueue sends the relays a NOTIFY (delivered at commit). On by default: the
    /// relay then publishes within milliseconds. PostgreSQL serializes the commits of
    /// notifying transactions on one lock, so under heavy write load turning it off (the relay
    /// falls back to polling) can raise commit throughput; `inbox-lab bench --modes outbox`
    /// measures both.
    pub fn with_notify(mut self, notify: bool) -> Self {
        self.notify = notify;
        self
    }

    /// The statements behind it (relay, inspection).
    pub fn store(&self) -> &OutboxStore {
        &self.store
    }

    /// Writes `message` in the transaction `tx` belongs to: it is published after that
    /// transaction commits, and never if it rolls back. Without an id it gets a random one.
    /// Without a trace context, and with the `otel` feature, it carries the current span's
    /// (the web request's, say), so the consumer's span joins that trace.
    /// Pass `&mut *tx` of an open transaction: on a connection in autocommit mode the row
    /// commits at once, alone.
    pub async fn enqueue(
        &self,
        tx: &mut PgConnection,
        message: &OutboxMessage,
    ) -> Result<Enqueued, OutboxError> {
        let id = message
            .message_id
            .clone()
            .unwrap_or_else(ids::random_message_id);
        #[cfg(feature = "otel")]
        if message.traceparent.is_none()
            && let Some((traceparent, tracestate)) =
                crate::telemetry::trace::current_trace_context()
        {
            let traced = message.clone().with_trace_context(traceparent, tracestate);
            return self.write(tx, &traced, id).await;
        }
        self.write(tx, message, id).await
    }

    pub(crate) async fn write(
        &self,
        tx: &mut PgConnection,
        m: &OutboxMessage,
        message_id: String,
    ) -> Result<Enqueued, OutboxError> {
        m.validate(&message_id, self.max_payload_bytes)?;
        let row = NewRow {
            message_id: &message_id,
            exchange: &m.exchange,
            routing_key: &m.routing_key,
            message_type: &m.message_type,
            message_version: m.message_version,
            aggregate_type: m.aggregate_type.as_deref(),
            aggregate_id: m.aggregate_id.as_deref(),
            ordering_key: m.ordering_key.as_deref(),
            correlation_id: m.correlation_id.as_deref(),
            causation_id: m.causation_id.as_deref(),
            traceparent: m.traceparent.as_deref(),
            tracestate: m.tracestate.as_deref(),
            headers: &m.headers,
            content_type: &m.content_type,
            payload: &m.payload,
        };
        let inserted = self.store.enqueue(tx, &row, self.notify).await?.is_some();
        Ok(Enqueued {
            message_id,
            inserted,
        })
    }
}
