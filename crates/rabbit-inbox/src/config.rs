//! Consumer configuration: one struct from which the topology, the retry policy and the
//! runtime's batching are derived. Defaults are fast and safe; see the README for each knob's
//! trade-off.

use std::time::Duration;

use crate::{envelope::EnvelopeRules, error::ConfigError, schema::SchemaName};

/// The queues a consumer declares and uses.
///
/// ```text
/// exchange --binding--> queue --reject(requeue=false)--> retry queue (TTL = retry delay)
///                         ^                                   |
///                         +----------- dead-letter -----------+
/// consumer --publish with reason headers, then ack--> parking-lot queue
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// The work queue.
    pub queue: String,
    /// Exchange producers publish to; declared as a durable topic exchange and bound to the
    /// work queue with `binding_keys`. `None`: producers publish to the queue directly.
    pub exchange: Option<String>,
    /// Routing keys bound from `exchange` to the work queue.
    pub binding_keys: Vec<String>,
    /// The delayed-retry queue: messages wait there for the retry delay, then dead-letter back
    /// to the work queue.
    pub retry_queue: String,
    /// Where permanently failed and poisoned messages are kept, with the reason in headers.
    pub parking_queue: String,
    /// Queue type of all three queues.
    pub queue_type: QueueType,
    /// Declare the work queue with `x-single-active-consumer`: of several instances on the
    /// queue, the broker delivers to one at a time and fails over to the next when it goes
    /// away. Keeps one queue's delivery order across instances, at the cost of one active
    /// consumer per queue (scale out with several queues, e.g. a consistent-hash exchange).
    pub single_active_consumer: bool,
}

/// RabbitMQ queue type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QueueType {
    /// Classic durable queues.
    #[default]
    Classic,
    /// Quorum queues (replicated; for clusters).
    Quorum,
}

impl Topology {
    /// A work queue `queue` with `<queue>.retry` and `<queue>.parking-lot`, fed directly.
    pub fn new(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            retry_queue: format!("{queue}.retry"),
            parking_queue: format!("{queue}.parking-lot"),
            queue,
            exchange: None,
            binding_keys: Vec::new(),
            queue_type: QueueType::Classic,
            single_active_consumer: false,
        }
    }

    /// Declare the work queue with a single active consumer (see
    /// [`Topology::single_active_consumer`]).
    pub fn with_single_active_consumer(mut self) -> Self {
        self.single_active_consumer = true;
        self
    }

    /// Also declare `exchange` (topic) and bind the work queue with `binding_keys`.
    pub fn with_exchange(mut self, exchange: impl Into<String>, binding_keys: &[&str]) -> Self {
        self.exchange = Some(exchange.into());
        self.binding_keys = binding_keys.iter().map(|k| (*k).to_owned()).collect();
        self
    }
}

/// Which bodies the inbox keeps (section "payload storage" of the README).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PayloadStorage {
    /// Keep bodies of failed and parked messages only; processed rows keep metadata and hash.
    #[default]
    FailedOnly,
    /// Keep every body.
    Always,
    /// Keep no body (hash and metadata only).
    Never,
}

/// Retry budget and timing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts before a retryable failure becomes POISONED and is parked.
    pub max_attempts: i32,
    /// Time a failed message waits in the retry queue before it comes back.
    pub retry_delay: Duration,
    /// A committed PROCESSING row older than this is taken over as abandoned.
    pub stale_processing_after: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            retry_delay: Duration::from_secs(5),
            stale_processing_after: Duration::from_secs(300),
        }
    }
}

/// Everything a [`crate::Consumer`] needs besides its pool and handler.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// Part of the inbox key: each consumer keeps its own ledger of the same messages.
    pub consumer_name: String,
    /// PostgreSQL schema of the inbox tables.
    pub schema: SchemaName,
    /// Queues.
    pub topology: Topology,
    /// What the consumer accepts and how it derives dedup keys.
    pub envelope: EnvelopeRules,
    /// Retry budget.
    pub retry: RetryPolicy,
    /// Unacked deliveries the broker may push (AMQP prefetch). Bounds memory.
    pub prefetch: u16,
    /// Most deliveries per transaction. 1 gives the textbook one-transaction-per-message mode.
    pub batch_size: usize,
    /// Longest wait for a batch to fill before it is processed anyway; bounds added latency
    /// at low load.
    pub max_batch_delay: Duration,
    /// Transactions in flight at once. Messages are assigned to lanes by aggregate id (else
    /// dedup key), so one aggregate's messages stay in delivery order.
    pub lanes: usize,
    /// Take a transaction-scoped advisory lock per aggregate before running handlers, for
    /// handlers that must not run concurrently for one aggregate across consumer instances.
    pub lock_aggregates: bool,
    /// Which bodies the inbox keeps.
    pub payload_storage: PayloadStorage,
    /// First reconnect delay after losing the broker or the database; doubles up to
    /// `reconnect_max_delay`.
    pub reconnect_initial_delay: Duration,
    /// Longest reconnect delay.
    pub reconnect_max_delay: Duration,
}

impl ConsumerConfig {
    /// Defaults for `consumer_name` consuming `topology`, inbox in schema `rabbit_inbox`.
    pub fn new(consumer_name: impl Into<String>, topology: Topology) -> Self {
        Self {
            consumer_name: consumer_name.into(),
            schema: SchemaName::default(),
            topology,
            envelope: EnvelopeRules::default(),
            retry: RetryPolicy::default(),
            prefetch: 1000,
            batch_size: 200,
            max_batch_delay: Duration::from_millis(5),
            lanes: 2,
            lock_aggregates: false,
            payload_storage: PayloadStorage::FailedOnly,
            reconnect_initial_delay: Duration::from_millis(200),
            reconnect_max_delay: Duration::from_secs(10),
        }
    }

    /// Checks every setting; the consumer calls this before connecting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |name, reason: &str| {
            Err(ConfigError::InvalidSetting {
                name,
                reason: reason.to_owned(),
            })
        };
        if self.consumer_name.trim().is_empty() || self.consumer_name.len() > 255 {
            return invalid("consumer_name", "must be 1 to 255 bytes");
        }
        let t = &self.topology;
        for (name, q) in [
            ("topology.queue", &t.queue),
            ("topology.retry_queue", &t.retry_queue),
            ("topology.parking_queue", &t.parking_queue),
        ] {
            if q.is_empty() || q.len() > 255 || q.starts_with("amq.") {
                return invalid(name, "must be 1 to 255 bytes and not start with 'amq.'");
            }
        }
        if t.queue == t.retry_queue
            || t.queue == t.parking_queue
            || t.retry_queue == t.parking_queue
        {
            return invalid("topology", "work, retry and parking queues must differ");
        }
        if t.exchange
            .as_deref()
            .is_some_and(|e| e.is_empty() || e.len() > 255)
        {
            return invalid("topology.exchange", "must be 1 to 255 bytes");
        }
        if self.retry.max_attempts < 1 {
            return invalid("retry.max_attempts", "must be at least 1");
        }
        if self.retry.retry_delay.is_zero() || self.retry.retry_delay.as_millis() > u32::MAX as u128
        {
            return invalid("retry.retry_delay", "must be between 1 ms and ~49 days");
        }
        if self.prefetch == 0 {
            return invalid("prefetch", "must be at least 1 (0 would mean unbounded)");
        }
        if self.batch_size == 0 || self.batch_size > 10_000 {
            return invalid("batch_size", "must be 1 to 10000");
        }
        if self.lanes == 0 || self.lanes > 256 {
            return invalid("lanes", "must be 1 to 256");
        }
        if self.envelope.max_payload_bytes == 0 {
            return invalid("envelope.max_payload_bytes", "must be at least 1");
        }
        if self.envelope.supported_versions.is_empty() {
            return invalid("envelope.supported_versions", "must not be empty");
        }
        let limits = &self.envelope.field_limits;
        for (name, limit) in [
            ("envelope.field_limits.message_type", limits.message_type),
            (
                "envelope.field_limits.aggregate_type",
                limits.aggregate_type,
            ),
            ("envelope.field_limits.aggregate_id", limits.aggregate_id),
            (
                "envelope.field_limits.correlation_id",
                limits.correlation_id,
            ),
            ("envelope.field_limits.causation_id", limits.causation_id),
            ("envelope.field_limits.tenant_id", limits.tenant_id),
            ("envelope.field_limits.headers", limits.headers),
        ] {
            if limit == 0 {
                return invalid(name, "must be at least 1");
            }
        }
        if limits.aggregate_type.saturating_add(limits.aggregate_id)
            > crate::FieldLimits::MAX_AGGREGATE_BYTES
        {
            return invalid(
                "envelope.field_limits",
                &format!(
                    "aggregate_type + aggregate_id must not exceed {} bytes (one index entry)",
                    crate::FieldLimits::MAX_AGGREGATE_BYTES
                ),
            );
        }
        if limits.traceparent < crate::FieldLimits::TRACEPARENT_V00_LEN {
            return invalid(
                "envelope.field_limits.traceparent",
                &format!(
                    "must be at least {} (a W3C traceparent of version 00)",
                    crate::FieldLimits::TRACEPARENT_V00_LEN
                ),
            );
        }
        if let crate::DedupStrategy::PayloadFields(fields) = &self.envelope.dedup
            && (fields.is_empty() || fields.iter().any(|f| !f.starts_with('/')))
        {
            return invalid(
                "envelope.dedup",
                "payload fields must be non-empty JSON pointers like /order_id",
            );
        }
        if self.reconnect_initial_delay.is_zero()
            || self.reconnect_max_delay < self.reconnect_initial_delay
        {
            return invalid(
                "reconnect",
                "initial delay must be positive and not above the max delay",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let c = ConsumerConfig::new("svc", Topology::new("orders"));
        assert!(c.validate().is_ok());
        assert_eq!(c.topology.retry_queue, "orders.retry");
        assert_eq!(c.topology.parking_queue, "orders.parking-lot");
    }

    #[test]
    fn bad_settings_are_named() {
        let mut c = ConsumerConfig::new("svc", Topology::new("orders"));
        c.lanes = 0;
        let err = c.validate().expect_err("invalid").to_string();
        assert!(err.contains("lanes"), "{err}");

        let mut c = ConsumerConfig::new("svc", Topology::new("orders"));
        c.topology.retry_queue = "orders".into();
        assert!(c.validate().is_err());

        let mut c = ConsumerConfig::new("", Topology::new("orders"));
        assert!(c.validate().is_err());
        c.consumer_name = "svc".into();
        c.envelope.dedup = crate::DedupStrategy::PayloadFields(vec!["order_id".into()]);
        assert!(c.validate().is_err());
    }

    #[test]
    fn field_limits_are_checked() {
        let base = ConsumerConfig::new("svc", Topology::new("orders"));
        let err = |change: &dyn Fn(&mut crate::FieldLimits)| {
            let mut c = base.clone();
            change(&mut c.envelope.field_limits);
            c.validate().err().map(|e| e.to_string())
        };
        assert_eq!(err(&|_| ()), None);
        let zero = err(&|l| l.tenant_id = 0).expect("invalid");
        assert!(zero.contains("field_limits.tenant_id"), "{zero}");
        assert!(err(&|l| l.headers = 0).is_some());
        // One index entry holds both aggregate fields.
        assert!(err(&|l| (l.aggregate_type, l.aggregate_id) = (1200, 1200)).is_none());
        assert!(err(&|l| (l.aggregate_type, l.aggregate_id) = (1200, 1201)).is_some());
        assert!(err(&|l| l.aggregate_id = usize::MAX).is_some());
        assert!(err(&|l| l.traceparent = 54).is_some());
        assert!(err(&|l| l.traceparent = 512).is_none());
    }
}
