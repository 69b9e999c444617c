//! The metrics catalog: every metric the library emits is named here once, with its labels.
//!
//! Metrics go through the `metrics` facade; nothing is recorded until the application installs
//! a recorder (e.g. `metrics-exporter-prometheus`, as `inbox-lab consume --metrics-addr` does).
//! Labels are bounded: `consumer` (configured names), `schema` (the outbox's), `outcome`, `reason`, `status`,
//! `result`, `cause` and `policy` (fixed sets below) and `message_type`, folded by `MessageTypeLabels` to the
//! configured known types, the first [`crate::TelemetryConfig::max_message_types`] seen, and
//! [`OTHER_TYPE`].

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, PoisonError},
};

use metrics::{SharedString, Unit};

use crate::{
    envelope::Envelope,
    status::{InboxStatus, Outcome, PendingCopy},
    telemetry::config::TelemetryConfig,
};

/// Deliveries received. Labels: `consumer`.
pub const RECEIVED: &str = "rabbit_inbox_received_total";
/// Durable outcomes of deliveries. Labels: `consumer`, `message_type`, `outcome` (see
/// [`outcome_label`]).
pub const OUTCOMES: &str = "rabbit_inbox_outcomes_total";
/// Deliveries acked as duplicates of a committed effect. Labels: `consumer`, `message_type`,
/// `reason`: `redelivered` (the broker's redelivered flag: a crash or lost connection before
/// the ack), `dead_lettered` (it came back through a retry tier or the broker's dead-lettering
/// after its effect committed), `republished` (a fresh publish of a processed message: an
/// outbox republish, a replay, a producer retry after an unconfirmed publish), `parked` (a copy
/// of a parked message whose copy is already in the parking lot), `retry_pending` (a copy of a
/// message whose retry copy waits in a tier and is not due yet).
pub const DUPLICATES: &str = "rabbit_inbox_duplicates_total";
/// Settlements the broker did not take (the delivery comes back). Labels: `consumer`.
pub const SETTLE_FAILURES: &str = "rabbit_inbox_settle_failures_total";
/// Messages requeued "database unavailable" more than three times in a row. Labels: `consumer`.
pub const REPEATED_REQUEUES: &str = "rabbit_inbox_repeated_requeues_total";
/// Deliveries requeued because the database said the deployment is wrong, not the message
/// (an undefined table, column, function, type or schema; a missing privilege). Labels:
/// `consumer`, `sqlstate` (one of six codes, see docs/reliability.md).
pub const DEPLOYMENT_FAULTS: &str = "rabbit_inbox_deployment_faults_total";
/// PROCESSING rows older than `retry.stale_processing_after` taken over by this consumer.
/// Labels: `consumer`.
pub const STALE_LEASE_RECOVERIES: &str = "rabbit_inbox_stale_lease_recoveries_total";
/// PROCESSED rows deleted (or archived) by retention: the consumer's cleanup timer,
/// `inboxctl cleanup`, the admin API's cleanup and `InboxStore::cleanup_processed_older_than`.
/// Labels: `consumer`.
pub const RETENTION_DELETED: &str = "rabbit_inbox_retention_deleted_total";

/// Sequence gaps of ordered consumers that outlived their timeout, acted on by the release
/// task of the operator crate (`inbox_ops::ReleaseTask`). Labels: `consumer`, `policy`:
/// `keep_holding`, `park_followers` or `release` (what was done with the messages behind the
/// gap).
pub const SEQUENCE_GAPS: &str = "rabbit_inbox_sequence_gaps_total";

/// Lost broker sessions that repeated the loss before them, a sign that one delivery stops
/// the queue. Labels: `consumer`, `cause`: `same_error` (ended with the same error as the
/// previous loss, and lived shorter than `reconnect_max_delay`), `same_delivery` (left a
/// delivery unsettled that the previous loss had left unsettled too; the log names it).
pub const REPEATED_SESSION_LOSSES: &str = "rabbit_inbox_repeated_session_losses_total";
/// The `cause` label of [`REPEATED_SESSION_LOSSES`]: the same error as the previous loss.
pub const SAME_ERROR: &str = "same_error";
/// The `cause` label of [`REPEATED_SESSION_LOSSES`]: the same delivery unsettled.
pub const SAME_DELIVERY: &str = "same_delivery";

/// Receipt to settlement (ack, retry copy, park, requeue). Labels: `consumer`.
pub const DELIVERY_TO_SETTLE: &str = "rabbit_inbox_delivery_to_settle_seconds";
/// From the first receipt of a key by this consumer to the commit of its effect: the handling
/// time on a first attempt, plus the retry waits for a retried message. Labels: `consumer`,
/// `message_type`.
pub const PROCESSING_AGE: &str = "rabbit_inbox_processing_age_seconds";
/// The attempt on which an effect committed (1: first try). Labels: `consumer`, `message_type`.
pub const ATTEMPTS: &str = "rabbit_inbox_attempts";
/// One call of the handler (a batch handler's call, or a per-message handler over its batch)
/// that returned success. Labels: `consumer`.
pub const HANDLER_DURATION: &str = "rabbit_inbox_handler_duration_seconds";
/// BEGIN to COMMIT or ROLLBACK of a batch transaction. Labels: `consumer`, `result`
/// (`committed`, `rolled_back`).
pub const TRANSACTION_DURATION: &str = "rabbit_inbox_transaction_duration_seconds";
/// From the end of a batch's last commit to its settlement with the broker. Labels: `consumer`.
pub const COMMIT_TO_ACK: &str = "rabbit_inbox_commit_to_ack_seconds";

/// Age of the oldest message the inbox holds that should be making progress and is not: a
/// committed PROCESSING row, or a RETRYABLE_FAILED row whose retry delay has passed. Rows
/// waiting in a retry delay do not count. 0 when there is none. Labels: `consumer`. (Sampled.)
pub const OLDEST_UNPROCESSED_AGE: &str = "rabbit_inbox_oldest_unprocessed_age_seconds";
/// Rows that are not PROCESSED, by status. Labels: `consumer`, `status`. (Sampled.)
pub const OPEN_ROWS: &str = "rabbit_inbox_open_rows";
/// Committed PROCESSING rows older than `retry.stale_processing_after`. Labels: `consumer`.
/// (Sampled.)
pub const STALE_PROCESSING_ROWS: &str = "rabbit_inbox_stale_processing_rows";
/// Parked rows (PERMANENT_FAILED and POISONED): the parking lot as the inbox records it.
/// Labels: `consumer`. (Sampled.)
pub const PARKED_ROWS: &str = "rabbit_inbox_parked_rows";
/// Age of the oldest parked row, by its last failure. 0 when there is none. Labels:
/// `consumer`. (Sampled.)
pub const PARKED_OLDEST_AGE: &str = "rabbit_inbox_parked_oldest_age_seconds";
/// How far the retained PROCESSED history reaches beyond the configured replay window
/// (`TelemetryConfig::replay_window`); negative when a duplicate delivered that long after its
/// original would no longer be recognised. Labels: `consumer`. (Sampled.)
pub const DEDUP_WINDOW_HEADROOM: &str = "rabbit_inbox_dedup_window_headroom_seconds";
/// Ordering keys of an ordered consumer that wait: blocked behind a failed or parked head
/// message, or (with sequence numbers) holding later numbers for a missing one. Labels:
/// `consumer`. (Sampled, for consumers with an ordering policy.)
pub const BLOCKED_KEYS: &str = "rabbit_inbox_blocked_keys";
/// Age of the oldest of those waits: since the key blocked, or since its gap began. 0 when no
/// key waits. Labels: `consumer`. (Sampled, for consumers with an ordering policy.)
pub const BLOCKED_OLDEST_AGE: &str = "rabbit_inbox_blocked_oldest_age_seconds";
/// HELD rows: messages recorded and acked that wait for their turn in their key's order.
/// Labels: `consumer`. (Sampled, for consumers with an ordering policy.)
pub const HELD_MESSAGES: &str = "rabbit_inbox_held_messages";
/// Sampler queries that failed (the gauges keep their last value). Labels: `consumer`.
pub const SAMPLER_ERRORS: &str = "rabbit_inbox_sampler_errors_total";

/// Leased work that lost its lease (a successor took over, or the heartbeat was refused)
/// before it could commit. Labels: `consumer`.
pub const LEASES_LOST: &str = "rabbit_inbox_leases_lost_total";

// The outbox is one table per schema, shared by every consumer and web handler that writes to
// it, so its metrics are labelled by `schema`, the relay's unit of work.

/// Outbox rows not yet published (PENDING), the backlog. Labels: `schema`. (Sampled by the
/// relay.)
pub const OUTBOX_PENDING: &str = "rabbit_inbox_outbox_pending";
/// Outbox rows the relay gave up on after `max_attempts` (FAILED; `inboxctl outbox --failed`).
/// Labels: `schema`. (Sampled by the relay.)
pub const OUTBOX_FAILED: &str = "rabbit_inbox_outbox_failed";
/// Age of the oldest PENDING outbox row, by its commit. 0 when there is none. Labels:
/// `schema`. (Sampled by the relay.)
pub const OUTBOX_OLDEST_PENDING_AGE: &str = "rabbit_inbox_outbox_oldest_pending_seconds";
/// Outbox rows published and confirmed by the broker. Labels: `schema`.
pub const OUTBOX_PUBLISHED: &str = "rabbit_inbox_outbox_published_total";
/// One relay round, from its claim to its last confirm. Labels: `schema`.
pub const OUTBOX_PUBLISH_DURATION: &str = "rabbit_inbox_outbox_publish_seconds";
/// Commit of an outbox row to its confirmed publish. Labels: `schema`.
pub const OUTBOX_DELAY: &str = "rabbit_inbox_outbox_delay_seconds";
/// Publishes the broker returned as unroutable (`mandatory`) or refused for a missing exchange;
/// the row is retried. Labels: `schema`.
pub const OUTBOX_RETURNS: &str = "rabbit_inbox_outbox_returns_total";
/// Publishes the broker nacked or did not confirm in time; the row is retried. Labels:
/// `schema`.
pub const OUTBOX_CONFIRM_FAILURES: &str = "rabbit_inbox_outbox_confirm_failures_total";
/// Rows this relay published but could not mark sent because another relay took them over
/// after this one's lease expired (they may go out twice, with the same ids). Labels: `schema`.
pub const OUTBOX_FENCED: &str = "rabbit_inbox_outbox_fenced_total";

/// The `message_type` label of every type beyond the known and first-seen ones.
pub const OTHER_TYPE: &str = "other";

/// The `outcome` label values.
pub const OUTCOME_LABELS: [&str; 9] = [
    "processed",
    "duplicate",
    "retry_scheduled",
    "in_flight_elsewhere",
    "permanent_failed",
    "poisoned",
    "payload_conflict",
    "unrecorded",
    "held",
];

/// The `outcome` label of an outcome.
pub fn outcome_label(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Processed => "processed",
        Outcome::Duplicate | Outcome::CopyPending { .. } => "duplicate",
        Outcome::RetryScheduled { .. } => "retry_scheduled",
        Outcome::InFlightElsewhere => "in_flight_elsewhere",
        Outcome::Parked { code, .. } if code == crate::status::PAYLOAD_CONFLICT => {
            "payload_conflict"
        }
        Outcome::Parked {
            status: InboxStatus::Poisoned,
            ..
        } => "poisoned",
        Outcome::Parked { .. } => "permanent_failed",
        Outcome::Unrecorded { .. } => "unrecorded",
        Outcome::Held => "held",
    }
}

/// The `reason` label of a duplicate delivery: what it duplicates (`outcome`), else how it
/// came (`envelope`).
pub fn duplicate_reason(outcome: &Outcome, envelope: &Envelope) -> &'static str {
    if let Outcome::CopyPending { copy } = outcome {
        match copy {
            PendingCopy::Retry => "retry_pending",
            _ => "parked",
        }
    } else if envelope.death_count > 0 {
        "dead_lettered"
    } else if envelope.redelivered {
        "redelivered"
    } else {
        "republished"
    }
}

/// Describes every metric of the catalog to the installed recorder (units and help texts, for
/// exporters that show them). Call after installing the recorder; the consumer calls it when
/// it starts.
pub fn describe() {
    describe_consumer_counters();
    describe_consumer_timings();
    describe_inbox_gauges();
    describe_ordering_gauges();
    describe_outbox();
}

/// The consumer's counters.
fn describe_consumer_counters() {
    use metrics::describe_counter;
    describe_counter!(RECEIVED, "Deliveries received");
    describe_counter!(OUTCOMES, "Durable outcomes of deliveries");
    describe_counter!(
        DUPLICATES,
        "Deliveries acked as duplicates of a committed effect"
    );
    describe_counter!(SETTLE_FAILURES, "Settlements the broker did not take");
    describe_counter!(
        REPEATED_REQUEUES,
        "Messages requeued more than three times in a row because the database was unavailable"
    );
    describe_counter!(
        DEPLOYMENT_FAULTS,
        "Deliveries requeued because the database refused the deployment (undefined table, column, function, type or schema; missing privilege)"
    );
    describe_counter!(
        STALE_LEASE_RECOVERIES,
        "Stale PROCESSING rows taken over by this consumer"
    );
    describe_counter!(RETENTION_DELETED, "PROCESSED rows deleted by retention");
    describe_counter!(
        SEQUENCE_GAPS,
        "Sequence gaps of ordered consumers that outlived their timeout"
    );
    describe_counter!(
        REPEATED_SESSION_LOSSES,
        "Lost broker sessions that repeated the previous loss's error or unsettled delivery"
    );
    describe_counter!(
        LEASES_LOST,
        "Leased work that lost its lease before it could commit"
    );
}

/// The consumer's histograms: durations, ages, attempts.
fn describe_consumer_timings() {
    use metrics::describe_histogram;
    describe_histogram!(
        DELIVERY_TO_SETTLE,
        Unit::Seconds,
        "Receipt to settlement of a delivery"
    );
    describe_histogram!(
        PROCESSING_AGE,
        Unit::Seconds,
        "First receipt of a key to the commit of its effect"
    );
    describe_histogram!(ATTEMPTS, "Attempt on which an effect committed");
    describe_histogram!(
        HANDLER_DURATION,
        Unit::Seconds,
        "Handler calls that succeeded"
    );
    describe_histogram!(
        TRANSACTION_DURATION,
        Unit::Seconds,
        "Batch transactions, BEGIN to COMMIT or ROLLBACK"
    );
    describe_histogram!(
        COMMIT_TO_ACK,
        Unit::Seconds,
        "End of a batch's last commit to its settlement"
    );
}

/// The inbox gauges the consumer samples, and the sampler's errors.
fn describe_inbox_gauges() {
    use metrics::{describe_counter, describe_gauge};
    describe_gauge!(
        OLDEST_UNPROCESSED_AGE,
        Unit::Seconds,
        "Oldest stuck PROCESSING or overdue RETRYABLE_FAILED row (retry waits excluded)"
    );
    describe_gauge!(OPEN_ROWS, "Rows that are not PROCESSED, by status");
    describe_gauge!(
        STALE_PROCESSING_ROWS,
        "Committed PROCESSING rows older than the stale threshold"
    );
    describe_gauge!(PARKED_ROWS, "PERMANENT_FAILED and POISONED rows");
    describe_gauge!(
        PARKED_OLDEST_AGE,
        Unit::Seconds,
        "Oldest parked row, by its last failure"
    );
    describe_gauge!(
        DEDUP_WINDOW_HEADROOM,
        Unit::Seconds,
        "Retained PROCESSED history beyond the replay window"
    );
    describe_counter!(SAMPLER_ERRORS, "Failed sampler queries");
}

/// The gauges of ordered consumers: keys that wait and the messages held behind them.
fn describe_ordering_gauges() {
    use metrics::describe_gauge;
    describe_gauge!(
        BLOCKED_KEYS,
        "Ordering keys blocked behind a failed head or waiting for a missing sequence number"
    );
    describe_gauge!(
        BLOCKED_OLDEST_AGE,
        Unit::Seconds,
        "Oldest blocked key or sequence gap, since it began"
    );
    describe_gauge!(
        HELD_MESSAGES,
        "HELD rows waiting for their turn in their key's order"
    );
}

/// The outbox relay's metrics.
fn describe_outbox() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_gauge!(OUTBOX_PENDING, "Outbox rows not yet published");
    describe_gauge!(OUTBOX_FAILED, "Outbox rows given up after max_attempts");
    describe_gauge!(
        OUTBOX_OLDEST_PENDING_AGE,
        Unit::Seconds,
        "Oldest unpublished outbox row, by its commit"
    );
    describe_counter!(OUTBOX_PUBLISHED, "Outbox rows published and confirmed");
    describe_histogram!(
        OUTBOX_PUBLISH_DURATION,
        Unit::Seconds,
        "Relay rounds, claim to last confirm"
    );
    describe_histogram!(
        OUTBOX_DELAY,
        Unit::Seconds,
        "Commit of an outbox row to its confirmed publish"
    );
    describe_counter!(OUTBOX_RETURNS, "Outbox publishes returned as unroutable");
    describe_counter!(
        OUTBOX_CONFIRM_FAILURES,
        "Outbox publishes nacked or not confirmed in time"
    );
    describe_counter!(
        OUTBOX_FENCED,
        "Outbox rows taken over by another relay before they were marked sent"
    );
}

/// Folds message types to a bounded set of label values: the configured known types, then the
/// first `max_message_types` other types seen by this process, then [`OTHER_TYPE`]. Configure
/// the known types for labels that are the same on every instance and after restarts.
#[derive(Debug)]
pub(crate) struct MessageTypeLabels {
    known: HashSet<Arc<str>>,
    seen: Mutex<HashSet<Arc<str>>>,
    max_seen: usize,
}

impl MessageTypeLabels {
    pub(crate) fn new(config: &TelemetryConfig) -> Self {
        Self {
            known: config
                .known_message_types
                .iter()
                .map(|t| Arc::from(t.as_str()))
                .collect(),
            seen: Mutex::default(),
            max_seen: config.max_message_types,
        }
    }

    /// The label of each type, under one lock for the whole batch.
    pub(crate) fn fold<'a>(&self, types: impl IntoIterator<Item = &'a str>) -> Vec<SharedString> {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        types
            .into_iter()
            .map(|t| {
                if let Some(known) = self.known.get(t).or_else(|| seen.get(t)) {
                    return SharedString::from_shared(known.clone());
                }
                if seen.len() < self.max_seen {
                    let label: Arc<str> = Arc::from(t);
                    seen.insert(label.clone());
                    return SharedString::from_shared(label);
                }
                SharedString::const_str(OTHER_TYPE)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_types_fold_into_other_past_the_limit() {
        let labels = MessageTypeLabels::new(&TelemetryConfig {
            known_message_types: vec!["OrderPlaced".into()],
            max_message_types: 2,
            ..TelemetryConfig::default()
        });
        let folded = labels.fold(["OrderPlaced", "a", "b", "c", "a", "OrderPlaced", "d"]);
        let folded: Vec<&str> = folded.iter().map(|s| s.as_ref()).collect();
        assert_eq!(
            folded,
            [
                "OrderPlaced",
                "a",
                "b",
                "other",
                "a",
                "OrderPlaced",
                "other"
            ]
        );
    }

    #[test]
    fn every_outcome_has_a_listed_label() {
        let outcomes = [
            Outcome::Processed,
            Outcome::Duplicate,
            Outcome::RetryScheduled {
                attempt: 1,
                code: "x".into(),
            },
            Outcome::InFlightElsewhere,
            Outcome::Parked {
                status: InboxStatus::PermanentFailed,
                code: "x".into(),
                message: String::new(),
                attempt: Some(1),
            },
            Outcome::Parked {
                status: InboxStatus::Poisoned,
                code: "x".into(),
                message: String::new(),
                attempt: Some(1),
            },
            Outcome::Parked {
                status: InboxStatus::Processed,
                code: crate::status::PAYLOAD_CONFLICT.into(),
                message: String::new(),
                attempt: None,
            },
            Outcome::Unrecorded {
                error: String::new(),
            },
            Outcome::Held,
        ];
        let labels: Vec<&str> = outcomes.iter().map(outcome_label).collect();
        assert_eq!(labels, OUTCOME_LABELS);
    }
}
