//! Consumer configuration: one struct from which the topology, the retry policy and the
//! runtime's batching are derived. Defaults are fast and safe; see the README for each knob's
//! trade-off.

use std::time::Duration;

use crate::{
    envelope::EnvelopeRules, error::ConfigError, privacy::PayloadPrivacy,
    retention::RetentionPolicy, schema::SchemaName, telemetry::TelemetryConfig,
};

/// The queues a consumer declares and uses.
///
/// ```text
/// exchange --binding--> queue --consumer: publish (confirmed), then ack--> <retry_queue>.<delay>
///                         ^     (one queue per retry tier, TTL = its delay)      |
///                         +------------------- dead-letter ----------------------+
/// queue --broker-side dead-lettering (e.g. x-delivery-limit)--> first retry tier
/// consumer --publish with reason headers (confirmed), then ack--> parking-lot queue
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
    /// Base name of the delayed-retry queues: one queue per delay of
    /// [`RetryPolicy::delays`], named `<retry_queue>.<delay>` (e.g. `orders.retry.5s`, see
    /// [`Topology::retry_tier_queue`]). Messages wait there for the tier's delay, then
    /// dead-letter back to the work queue.
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
    /// `x-delivery-limit` of a quorum work queue: after this many returns to the queue
    /// (requeues, lost sessions) the broker dead-letters the message into the first retry tier.
    /// Must exceed `retry.max_attempts + prefetch` (checked by [`ConsumerConfig::validate`]).
    /// `None` declares no limit: unlimited on RabbitMQ 3.x, while RabbitMQ 4 applies its
    /// default of 20 to quorum queues, so set it explicitly there.
    pub delivery_limit: Option<u32>,
}

/// RabbitMQ queue type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
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
            delivery_limit: None,
        }
    }

    /// The retry queue of the tier with `delay`: `<retry_queue>.<delay>`, the delay written
    /// in the largest whole unit (`200ms`, `5s`, `2m`, `1h`).
    pub fn retry_tier_queue(&self, delay: Duration) -> String {
        format!("{}.{}", self.retry_queue, delay_label(delay))
    }

    /// The retry queues of `retry`'s tiers, in tier order.
    pub fn retry_tier_queues(&self, retry: &RetryPolicy) -> Vec<String> {
        retry
            .delays
            .iter()
            .map(|d| self.retry_tier_queue(*d))
            .collect()
    }

    /// Declare all three queues as quorum queues (replicated across a cluster's nodes), with
    /// at-least-once dead-lettering between them.
    pub fn with_quorum_queues(mut self) -> Self {
        self.queue_type = QueueType::Quorum;
        self
    }

    /// Declare a quorum work queue with `x-delivery-limit` (see [`Topology::delivery_limit`]).
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
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

/// `delay` in its largest whole unit: `200ms`, `5s`, `2m`, `1h`.
fn delay_label(delay: Duration) -> String {
    let ms = delay.as_millis();
    if !ms.is_multiple_of(1000) {
        return format!("{ms}ms");
    }
    let s = ms / 1000;
    if s.is_multiple_of(3600) && s > 0 {
        format!("{}h", s / 3600)
    } else if s.is_multiple_of(60) && s > 0 {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

/// Which bodies the inbox keeps (section "payload storage" of the README).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
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
    /// Retry tiers: after failed attempt `n` a message waits `delays[n - 1]` (the last delay
    /// for every attempt past the list) in that tier's own retry queue, then comes back.
    /// Strictly increasing. One queue per tier, because a per-message TTL in one queue would
    /// hold short delays behind a long one at its head.
    pub delays: Vec<Duration>,
    /// A committed PROCESSING row older than this is taken over as abandoned.
    pub stale_processing_after: Duration,
}

impl Default for RetryPolicy {
    /// 5 attempts; retries after 1 s, 5 s, 30 s, 2 min, 10 min.
    fn default() -> Self {
        Self::tiered(
            [1, 5, 30, 120, 600]
                .into_iter()
                .map(Duration::from_secs)
                .collect(),
        )
    }
}

impl RetryPolicy {
    /// The default budget with tiers `delays`.
    pub fn tiered(delays: Vec<Duration>) -> Self {
        Self {
            max_attempts: 5,
            delays,
            stale_processing_after: Duration::from_secs(300),
        }
    }

    /// The default budget with one retry tier: every retry waits `delay`.
    pub fn fixed(delay: Duration) -> Self {
        Self::tiered(vec![delay])
    }

    /// Index into [`RetryPolicy::delays`] of the tier a message goes to after failed attempt
    /// `attempt` (1-based); clamped to the last tier.
    pub fn tier_of_attempt(&self, attempt: i32) -> usize {
        let n = usize::try_from(attempt.max(1)).unwrap_or(1);
        n.min(self.delays.len()).saturating_sub(1)
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
    /// Which bodies the inbox keeps, for types without their own entry in `privacy`.
    pub payload_storage: PayloadStorage,
    /// Per-type storage, redaction and encryption of stored payloads.
    pub privacy: PayloadPrivacy,
    /// Retention, run by the consumer every `retention.interval` (and by `inboxctl cleanup`);
    /// its dedup window is checked against `retry` at start-up.
    pub retention: Option<RetentionPolicy>,
    /// Who accepted a `retention` whose dedup window fails the check, and why. Without it such
    /// a configuration is refused at start-up; with it the consumer starts (with a warning),
    /// and every cleanup its timer runs is written to `inbox_audit` under this actor, as a
    /// forced `inboxctl cleanup` is.
    pub retention_window_forced_by: Option<crate::ops::Actor>,
    /// First reconnect delay after losing the broker or the database; doubles up to
    /// `reconnect_max_delay`.
    pub reconnect_initial_delay: Duration,
    /// Longest reconnect delay.
    pub reconnect_max_delay: Duration,
    /// Recovery of stale leases and lost retries on a timer inside the consumer (off by
    /// default; `inboxctl recover` runs the same operation by hand).
    pub recovery: Option<crate::ops::RecoveryConfig>,
    /// Metric labels and the sampling of the inbox gauges.
    pub telemetry: TelemetryConfig,
    /// Whether handlers' outbox writes NOTIFY the relays (see [`crate::Outbox::with_notify`]).
    pub outbox_notify: bool,
}

impl ConsumerConfig {
    /// Declares the topology as quorum queues with `delivery_limit`, or by default a limit
    /// that leaves room for the retry budget, the prefetch and 100 redeliveries after lost
    /// sessions (kills, node failures). Set `retry` and `prefetch` first.
    pub fn use_quorum_queues(&mut self, delivery_limit: Option<u32>) {
        let floor = u32::try_from(self.retry.max_attempts)
            .unwrap_or(0)
            .saturating_add(u32::from(self.prefetch));
        let limit = delivery_limit.unwrap_or(floor.saturating_add(100));
        self.topology = self
            .topology
            .clone()
            .with_quorum_queues()
            .with_delivery_limit(limit);
    }

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
            privacy: PayloadPrivacy::default(),
            retention: None,
            retention_window_forced_by: None,
            reconnect_initial_delay: Duration::from_millis(200),
            reconnect_max_delay: Duration::from_secs(10),
            recovery: None,
            telemetry: TelemetryConfig::default(),
            outbox_notify: true,
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
        if self.telemetry.sample_interval == Some(Duration::ZERO) {
            return invalid(
                "telemetry.sample_interval",
                "must be longer than zero (None: no sampling)",
            );
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
        let delays = &self.retry.delays;
        if delays.is_empty() || delays.len() > 32 {
            return invalid("retry.delays", "must list 1 to 32 delays");
        }
        if delays
            .iter()
            .any(|d| d.as_millis() == 0 || d.as_millis() > u128::from(u32::MAX))
        {
            return invalid("retry.delays", "each must be between 1 ms and ~49 days");
        }
        if delays.windows(2).any(|w| w[0] >= w[1]) {
            return invalid(
                "retry.delays",
                "must be strictly increasing (the last tier repeats for later attempts)",
            );
        }
        for tier in t.retry_tier_queues(&self.retry) {
            if tier.len() > 255 || tier == t.queue || tier == t.parking_queue {
                return invalid(
                    "topology.retry_queue",
                    "retry tier queues (<retry_queue>.<delay>) must be at most 255 bytes and differ from the work and parking queues",
                );
            }
        }
        if let Some(limit) = t.delivery_limit {
            if t.queue_type != QueueType::Quorum {
                return invalid("topology.delivery_limit", "applies to quorum queues only");
            }
            // Every return to the work queue counts as a delivery: retries go through the
            // tiers and do not, but a lost session returns up to `prefetch` deliveries at once
            // and each database outage back-off returns its batch. A limit within reach would
            // dead-letter healthy messages into the first tier.
            let floor = i64::from(self.retry.max_attempts) + i64::from(self.prefetch);
            if i64::from(limit) <= floor {
                return invalid(
                    "topology.delivery_limit",
                    "must exceed retry.max_attempts + prefetch",
                );
            }
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
        if let Some(recovery) = &self.recovery {
            recovery.validate()?;
        }
        if let Some(pointer) = self.privacy.invalid_pointer() {
            return invalid(
                "privacy.redact",
                &format!("{pointer:?} is not a JSON pointer (like /card/number)"),
            );
        }
        if let Some(retention) = &self.retention {
            retention.validate()?;
            if let Err(unsafe_window) = retention.check_window(&self.retry) {
                let Some(actor) = &self.retention_window_forced_by else {
                    return Err(unsafe_window);
                };
                tracing::warn!(
                    consumer = %self.consumer_name,
                    actor = actor.name(),
                    reason = actor.reason(),
                    "{unsafe_window}; accepted, every cleanup is audited"
                );
            }
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
        assert_eq!(
            c.topology.retry_tier_queues(&c.retry),
            [
                "orders.retry.1s",
                "orders.retry.5s",
                "orders.retry.30s",
                "orders.retry.2m",
                "orders.retry.10m"
            ]
        );
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
    fn attempts_map_to_tiers_clamped_at_the_last() {
        let r = RetryPolicy::default();
        assert_eq!(r.tier_of_attempt(1), 0);
        assert_eq!(r.tier_of_attempt(2), 1);
        assert_eq!(r.tier_of_attempt(5), 4);
        assert_eq!(r.tier_of_attempt(50), 4);
        assert_eq!(r.tier_of_attempt(0), 0);
        assert_eq!(
            RetryPolicy::fixed(Duration::from_secs(3)).tier_of_attempt(7),
            0
        );
        assert_eq!(delay_label(Duration::from_millis(200)), "200ms");
        assert_eq!(delay_label(Duration::from_millis(1500)), "1500ms");
        assert_eq!(delay_label(Duration::from_secs(90)), "90s");
        assert_eq!(delay_label(Duration::from_secs(7200)), "2h");
    }

    #[test]
    fn retry_tiers_and_delivery_limit_are_checked() {
        let mut c = ConsumerConfig::new("svc", Topology::new("orders"));
        c.retry.delays = vec![];
        assert!(c.validate().is_err());
        c.retry.delays = vec![Duration::from_secs(5), Duration::from_secs(1)];
        assert!(c.validate().is_err(), "decreasing");
        c.retry.delays = vec![Duration::ZERO];
        assert!(c.validate().is_err());

        let mut c = ConsumerConfig::new("svc", Topology::new("orders").with_delivery_limit(500));
        assert!(
            c.validate().is_err(),
            "classic queues have no delivery limit"
        );
        c.topology.queue_type = QueueType::Quorum;
        let err = c.validate().expect_err("500 <= 5 + 1000").to_string();
        assert!(err.contains("delivery_limit"), "{err}");
        c.prefetch = 100;
        assert!(c.validate().is_ok());
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
