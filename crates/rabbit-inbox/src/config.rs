//! [`ConsumerConfig`]: what a consumer needs besides its pool and handler, assembled from the
//! parts' own types (the topology beside the broker code that declares it, the retry policy,
//! the envelope rules, payload privacy, telemetry labels), and checked as a whole before the
//! consumer connects. Defaults are fast and safe; docs/configuration.md gives each knob's
//! trade-off.

use std::time::Duration;

use crate::{
    broker::{QueueType, Topology},
    dedup::DedupStrategy,
    envelope::{EnvelopeRules, FieldLimits, MessageTypes},
    error::ConfigError,
    ordering::{OrderKey, OrderingPolicy},
    privacy::{PayloadPrivacy, PayloadStorage},
    retry::RetryPolicy,
    schema::SchemaName,
    telemetry::TelemetryConfig,
};

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
    /// Per-key order through retries and parking (opt-in; see [`OrderingPolicy`]). `None`:
    /// lanes keep each aggregate's messages in delivery order while nothing fails, and a retry
    /// lets later messages of its aggregate overtake it.
    pub ordering: Option<OrderingPolicy>,
    /// Which bodies the inbox keeps, for types without their own entry in `privacy`.
    pub payload_storage: PayloadStorage,
    /// Per-type storage, redaction and encryption of stored payloads.
    pub privacy: PayloadPrivacy,
    /// First reconnect delay after losing the broker or the database; doubles up to
    /// `reconnect_max_delay`.
    pub reconnect_initial_delay: Duration,
    /// Longest reconnect delay.
    pub reconnect_max_delay: Duration,
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
            ordering: None,
            payload_storage: PayloadStorage::FailedOnly,
            privacy: PayloadPrivacy::default(),
            reconnect_initial_delay: Duration::from_millis(200),
            reconnect_max_delay: Duration::from_secs(10),
            telemetry: TelemetryConfig::default(),
            outbox_notify: true,
        }
    }

    /// Takes in the message types a handler declares (see
    /// [`crate::Handler::message_types`]); the consumer calls this before [`Self::validate`].
    /// Every declared type must be able to reach the handler: a name within
    /// `envelope.field_limits.message_type`, listed versions within
    /// `envelope.supported_versions`. When the handler refuses other types
    /// (`refuses_other_types`), `envelope.accepted_types` becomes its types, or, if set, must
    /// be the same; otherwise a set `envelope.accepted_types` must name only declared types
    /// (an accepted type without a handler would be parked for every message).
    pub fn adopt_message_types(
        &mut self,
        declared: Option<MessageTypes>,
        refuses_other_types: bool,
    ) -> Result<(), ConfigError> {
        let Some(declared) = declared else {
            return Ok(());
        };
        let invalid = |name, reason: String| Err(ConfigError::InvalidSetting { name, reason });
        let rules = &self.envelope;
        for (message_type, _) in declared.iter() {
            if message_type.len() > rules.field_limits.message_type {
                return invalid(
                    "envelope.field_limits.message_type",
                    format!(
                        "the handler takes message type {message_type:?} ({} bytes), longer than \
                         the limit of {}: such messages are refused as field_too_long; raise \
                         the limit or rename the type",
                        message_type.len(),
                        rules.field_limits.message_type
                    ),
                );
            }
        }
        let supported = &rules.supported_versions;
        if let Some((message_type, v)) = declared
            .listed_versions()
            .find(|(_, v)| !supported.contains(v))
        {
            return invalid(
                "envelope.supported_versions",
                format!(
                    "the handler takes {message_type:?} version {v}, outside the supported \
                     versions {}..={}: such messages are refused as unsupported_version; \
                     widen supported_versions or drop the route",
                    supported.start(),
                    supported.end()
                ),
            );
        }
        match &rules.accepted_types {
            None if refuses_other_types => self.envelope.accepted_types = Some(declared),
            None => {}
            Some(accepted) if refuses_other_types && *accepted != declared => {
                return invalid(
                    "envelope.accepted_types",
                    format!(
                        "the consumer accepts {accepted} but the handler takes exactly \
                         {declared}; leave accepted_types unset to take the handler's"
                    ),
                );
            }
            Some(accepted) => {
                let unhandled = accepted.iter().find(|(t, versions)| match versions {
                    None => !declared.iter().any(|(d, dv)| d == *t && dv.is_none()),
                    Some(vs) => vs.iter().any(|v| !declared.contains(t, *v)),
                });
                if let Some((message_type, _)) = unhandled {
                    return invalid(
                        "envelope.accepted_types",
                        format!(
                            "the consumer accepts {message_type:?} (in {accepted}) but the \
                             handler takes only {declared}: those messages would be parked \
                             as unknown_message_type; route the type or stop accepting it"
                        ),
                    );
                }
            }
        }
        Ok(())
    }

    /// Checks every setting; the consumer calls this before connecting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.consumer_name.trim().is_empty() || self.consumer_name.len() > 255 {
            return invalid("consumer_name", "must be 1 to 255 bytes");
        }
        self.validate_queues()?;
        self.validate_retry()?;
        self.validate_flow()?;
        self.validate_envelope()?;
        self.validate_ordering()?;
        if let Some(pointer) = self.privacy.invalid_pointer() {
            return invalid(
                "privacy.redact",
                &format!("{pointer:?} is not a JSON pointer (like /card/number)"),
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

    /// The work, retry and parking queues and the exchange: valid names, distinct queues.
    fn validate_queues(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// The retry budget and delays, and the tier queues they make.
    fn validate_retry(&self) -> Result<(), ConfigError> {
        let t = &self.topology;
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
        Ok(())
    }

    /// The quorum delivery limit, prefetch, batch size and lanes.
    fn validate_flow(&self) -> Result<(), ConfigError> {
        let t = &self.topology;
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
        Ok(())
    }

    /// The ordering policy: a key header and a sequence header to read, intervals to wait.
    fn validate_ordering(&self) -> Result<(), ConfigError> {
        let Some(ordering) = &self.ordering else {
            return Ok(());
        };
        if let OrderKey::Header(name) = &ordering.key
            && name.trim().is_empty()
        {
            return invalid("ordering.key", "the key header's name must not be empty");
        }
        let drops_bodies = self.payload_storage == PayloadStorage::Never
            || self
                .privacy
                .storage
                .values()
                .any(|s| *s == PayloadStorage::Never);
        if drops_bodies {
            return invalid(
                "payload_storage",
                "an ordered consumer keeps a held message's body until it runs (stored as a \
                 failed message's body is, sealed when encryption is on); a storage of `Never` \
                 would leave held messages that cannot run: use FailedOnly or Always, with \
                 encryption if bodies must not be readable at rest",
            );
        }
        if ordering.release_interval.is_zero() || ordering.release_timeout.is_zero() {
            return invalid(
                "ordering.release_interval",
                "the release interval and timeout must be positive",
            );
        }
        if let Some(sequence) = &ordering.sequence {
            if sequence.header.trim().is_empty() {
                return invalid(
                    "ordering.sequence.header",
                    "the sequence header's name must not be empty",
                );
            }
            if sequence.gap_timeout.is_zero() {
                return invalid(
                    "ordering.sequence.gap_timeout",
                    "must be positive: a gap needs time for the missing message to arrive",
                );
            }
        }
        Ok(())
    }

    /// The envelope rules: body size, versions, field limits, dedup fields.
    fn validate_envelope(&self) -> Result<(), ConfigError> {
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
            > FieldLimits::MAX_AGGREGATE_BYTES
        {
            return invalid(
                "envelope.field_limits",
                &format!(
                    "aggregate_type + aggregate_id must not exceed {} bytes (one index entry)",
                    FieldLimits::MAX_AGGREGATE_BYTES
                ),
            );
        }
        if limits.traceparent < FieldLimits::TRACEPARENT_V00_LEN {
            return invalid(
                "envelope.field_limits.traceparent",
                &format!(
                    "must be at least {} (a W3C traceparent of version 00)",
                    FieldLimits::TRACEPARENT_V00_LEN
                ),
            );
        }
        if let DedupStrategy::PayloadFields(fields) = &self.envelope.dedup
            && (fields.is_empty() || fields.iter().any(|f| !f.starts_with('/')))
        {
            return invalid(
                "envelope.dedup",
                "payload fields must be non-empty JSON pointers like /order_id",
            );
        }
        Ok(())
    }
}

/// The error of a setting `name` that is wrong for `reason`.
fn invalid(name: &'static str, reason: &str) -> Result<(), ConfigError> {
    Err(ConfigError::InvalidSetting {
        name,
        reason: reason.to_owned(),
    })
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
        c.ordering = Some(crate::ordering::OrderingPolicy::by_header(" "));
        assert!(c.validate().is_err(), "an empty key header");
        c.ordering = Some(
            crate::ordering::OrderingPolicy::by_aggregate().with_sequence(
                crate::ordering::SequencePolicy::header("x-seq")
                    .on_gap(Duration::ZERO, crate::ordering::GapPolicy::Release),
            ),
        );
        assert!(c.validate().is_err(), "a gap that cannot wait");
        c.ordering = Some(crate::ordering::OrderingPolicy::by_aggregate());
        assert!(c.validate().is_ok());
        c.lanes = 0;
        let err = c.validate().expect_err("invalid").to_string();
        assert!(err.contains("lanes"), "{err}");

        let mut c = ConsumerConfig::new("svc", Topology::new("orders"));
        c.topology.retry_queue = "orders".into();
        assert!(c.validate().is_err());

        let mut c = ConsumerConfig::new("", Topology::new("orders"));
        assert!(c.validate().is_err());
        c.consumer_name = "svc".into();
        c.envelope.dedup = DedupStrategy::PayloadFields(vec!["order_id".into()]);
        assert!(c.validate().is_err());
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
        let err = |change: &dyn Fn(&mut FieldLimits)| {
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

    #[test]
    fn a_handlers_types_must_be_reachable_and_agree_with_the_accepted_ones() {
        let base = ConsumerConfig::new("svc", Topology::new("orders"));
        let types = MessageTypes::new()
            .with_type("OrderPlaced")
            .with_version("OrderShipped", 1);
        let adopt = |accepted: Option<MessageTypes>, declared: MessageTypes, closed: bool| {
            let mut c = base.clone();
            c.envelope.accepted_types = accepted;
            c.adopt_message_types(Some(declared), closed)
                .map(|()| c.envelope.accepted_types)
                .map_err(|e| e.to_string())
        };
        // Open: nothing is narrowed. Closed: the consumer accepts exactly the routes.
        assert_eq!(adopt(None, types.clone(), false), Ok(None));
        assert_eq!(adopt(None, types.clone(), true), Ok(Some(types.clone())));
        assert_eq!(
            adopt(Some(types.clone()), types.clone(), true),
            Ok(Some(types.clone()))
        );
        let narrower = MessageTypes::new().with_type("OrderPlaced");
        let err = adopt(Some(narrower.clone()), types.clone(), true).expect_err("differ");
        assert!(err.contains("envelope.accepted_types"), "{err}");
        // Open: accepting fewer types than routed is a choice; more is a type without handler.
        assert!(adopt(Some(narrower.clone()), types.clone(), false).is_ok());
        let wider = types.clone().with_version("OrderShipped", 2);
        let err = adopt(Some(wider), types.clone(), false).expect_err("unrouted version");
        assert!(err.contains("\"OrderShipped\""), "{err}");
        let err = adopt(
            Some(MessageTypes::new().with_type("OrderShipped")),
            types.clone(),
            false,
        )
        .expect_err("every version accepted, one routed");
        assert!(err.contains("unknown_message_type"), "{err}");
        // Unreachable routes.
        let err = adopt(None, types.clone().with_version("OrderPlaced", 2), false)
            .expect_err("version 2 is unsupported");
        assert!(err.contains("envelope.supported_versions"), "{err}");
        assert!(err.contains("version 2"), "{err}");
        let err = adopt(None, MessageTypes::new().with_type("T".repeat(256)), true)
            .expect_err("too long a type");
        assert!(err.contains("field_limits.message_type"), "{err}");
        // A handler that declares nothing changes nothing.
        let mut c = base.clone();
        c.adopt_message_types(None, true).expect("nothing declared");
        assert_eq!(c.envelope.accepted_types, None);
    }
}
