//! Counters of a running consumer, readable while it runs and exported through `metrics`.
//!
//! They describe what this process saw; correctness checks count from the database instead.

use std::{
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use hdrhistogram::Histogram;
use metrics::SharedString;

use crate::{
    envelope::Envelope,
    status::Outcome,
    telemetry::{
        TelemetryConfig,
        metrics::{self as m, MessageTypeLabels},
    },
};

/// Live counters of one [`crate::Consumer`]. Clone the `Arc` from [`crate::Consumer::stats`].
#[derive(Debug)]
pub struct ConsumerStats {
    /// Delivery-to-settlement latency in microseconds (1 µs to 1 hour, 3 significant digits).
    /// (`None` only if the histogram could not be built, which fixed valid bounds rule out.)
    latency: Mutex<Option<Histogram<u64>>>,
    received: AtomicU64,
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    parked: AtomicU64,
    held: AtomicU64,
    unrecorded: AtomicU64,
    settle_failures: AtomicU64,
    settled: AtomicU64,
    sessions: AtomicU64,
    repeated_session_losses: AtomicU64,
    /// The `consumer` label of the exported metrics.
    consumer: SharedString,
    types: MessageTypeLabels,
}

/// A copy of the counters at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Deliveries received.
    pub received: u64,
    /// Effects committed.
    pub processed: u64,
    /// Deliveries acked as duplicates of committed effects.
    pub duplicates: u64,
    /// Deliveries sent to the delayed retry queue.
    pub retried: u64,
    /// Deliveries parked.
    pub parked: u64,
    /// Deliveries held behind an earlier message of their ordering key (ordered consumers),
    /// or acked as copies of held messages whose turn has not come.
    pub held: u64,
    /// Deliveries requeued because nothing durable could be written.
    pub unrecorded: u64,
    /// Settlements the broker did not take (the delivery will come back).
    pub settle_failures: u64,
    /// Broker sessions opened (1 + reconnects).
    pub sessions: u64,
    /// Lost broker sessions that ended with the same error as the loss before, or left a
    /// delivery unsettled that the loss before had left unsettled too.
    pub repeated_session_losses: u64,
    /// Median delivery-to-settlement latency (receipt to ack, reject or park).
    pub latency_p50: Duration,
    /// 99th percentile of the same.
    pub latency_p99: Duration,
    /// Deliveries whose latency was measured.
    pub latency_samples: u64,
}

impl Default for ConsumerStats {
    fn default() -> Self {
        Self::new("", &TelemetryConfig::default())
    }
}

impl ConsumerStats {
    /// Counters of `consumer`, its metrics labelled as `telemetry` says.
    pub(crate) fn new(consumer: &str, telemetry: &TelemetryConfig) -> Self {
        Self {
            latency: Mutex::new(Histogram::new_with_bounds(1, 3_600_000_000, 3).ok()),
            received: AtomicU64::default(),
            processed: AtomicU64::default(),
            duplicates: AtomicU64::default(),
            retried: AtomicU64::default(),
            parked: AtomicU64::default(),
            held: AtomicU64::default(),
            unrecorded: AtomicU64::default(),
            settle_failures: AtomicU64::default(),
            settled: AtomicU64::default(),
            sessions: AtomicU64::default(),
            repeated_session_losses: AtomicU64::default(),
            // Shared, so that each label clone is a reference count, not a copy.
            consumer: SharedString::from_shared(std::sync::Arc::from(consumer)),
            types: MessageTypeLabels::new(telemetry),
        }
    }

    /// The `message_type` labels of these envelopes.
    pub(crate) fn type_labels<'a>(
        &self,
        envelopes: impl IntoIterator<Item = &'a Envelope>,
    ) -> Vec<SharedString> {
        self.types
            .fold(envelopes.into_iter().map(|e| e.message_type.as_str()))
    }

    /// The `consumer` label.
    pub(crate) fn consumer_label(&self) -> &SharedString {
        &self.consumer
    }

    pub(crate) fn record_received(&self, n: u64) {
        self.received.fetch_add(n, Relaxed);
        metrics::counter!(m::RECEIVED, "consumer" => self.consumer.clone()).increment(n);
    }

    /// Counts a batch's outcomes: one metrics update per (type, outcome) and per (type,
    /// duplicate reason) of the batch, not per message.
    pub(crate) fn record_outcomes(&self, outcomes: &[Outcome], envelopes: &[&Envelope]) {
        let types = self.type_labels(envelopes.iter().copied());
        type Groups<'a> = Vec<((&'a SharedString, &'static str), u64)>;
        fn bump<'a>(groups: &mut Groups<'a>, key: (&'a SharedString, &'static str)) {
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => *n += 1,
                None => groups.push((key, 1)),
            }
        }
        let mut by_outcome = Groups::new();
        let mut duplicates = Groups::new();
        for ((outcome, envelope), ty) in outcomes.iter().zip(envelopes).zip(&types) {
            bump(&mut by_outcome, (ty, m::outcome_label(outcome)));
            if matches!(outcome, Outcome::Duplicate | Outcome::CopyPending { .. }) {
                bump(
                    &mut duplicates,
                    (ty, m::duplicate_reason(outcome, envelope)),
                );
            }
        }
        for ((ty, outcome), n) in by_outcome {
            metrics::counter!(m::OUTCOMES, "consumer" => self.consumer.clone(), "message_type" => ty.clone(), "outcome" => outcome)
                .increment(n);
        }
        for ((ty, reason), n) in duplicates {
            metrics::counter!(m::DUPLICATES, "consumer" => self.consumer.clone(), "message_type" => ty.clone(), "reason" => reason)
                .increment(n);
        }

        let mut counts = [0u64; 6];
        for outcome in outcomes {
            counts[match outcome {
                Outcome::Processed => 0,
                Outcome::Duplicate | Outcome::CopyPending { .. } => 1,
                Outcome::RetryScheduled { .. } | Outcome::InFlightElsewhere => 2,
                Outcome::Parked { .. } => 3,
                Outcome::Unrecorded { .. } => 4,
                Outcome::Held => 5,
            }] += 1;
        }
        let kinds = [
            &self.processed,
            &self.duplicates,
            &self.retried,
            &self.parked,
            &self.unrecorded,
            &self.held,
        ];
        for (counter, n) in kinds.into_iter().zip(counts) {
            if n > 0 {
                counter.fetch_add(n, Relaxed);
            }
        }
    }

    pub(crate) fn record_settle_failures(&self, n: u64) {
        self.settle_failures.fetch_add(n, Relaxed);
        metrics::counter!(m::SETTLE_FAILURES, "consumer" => self.consumer.clone()).increment(n);
    }

    /// Records the delivery-to-settlement latency of settled deliveries, under one lock.
    pub(crate) fn record_latencies(&self, latencies: impl IntoIterator<Item = Duration>) {
        let mut guard = self.latency.lock().unwrap_or_else(PoisonError::into_inner);
        let histogram =
            metrics::histogram!(m::DELIVERY_TO_SETTLE, "consumer" => self.consumer.clone());
        let mut n = 0;
        for latency in latencies {
            n += 1;
            if let Some(h) = guard.as_mut() {
                h.saturating_record(
                    u64::try_from(latency.as_micros())
                        .unwrap_or(u64::MAX)
                        .max(1),
                );
            }
            histogram.record(latency.as_secs_f64());
        }
        self.settled.fetch_add(n, Relaxed);
    }

    /// Forgets the latencies recorded so far (e.g. after a warm-up).
    pub fn reset_latency(&self) {
        if let Some(h) = self
            .latency
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            h.reset();
        }
    }

    pub(crate) fn record_session(&self) {
        self.sessions.fetch_add(1, Relaxed);
    }

    /// Counts a lost session that repeated the loss before it.
    pub(crate) fn record_session_loss(&self, repeats: &crate::session_loss::Repeats) {
        let mut repeated = false;
        for cause in repeats.causes() {
            repeated = true;
            metrics::counter!(m::REPEATED_SESSION_LOSSES, "consumer" => self.consumer.clone(), "cause" => cause)
                .increment(1);
        }
        if repeated {
            self.repeated_session_losses.fetch_add(1, Relaxed);
        }
    }

    /// Deliveries settled with the broker (acked, rejected into the retry queue, parked,
    /// requeued). Cheaper than [`ConsumerStats::snapshot`], for polling.
    pub fn settled(&self) -> u64 {
        self.settled.load(Relaxed)
    }

    /// Reads all counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        let (latency_p50, latency_p99, latency_samples) = {
            let h = self.latency.lock().unwrap_or_else(PoisonError::into_inner);
            h.as_ref().map_or((Duration::ZERO, Duration::ZERO, 0), |h| {
                (
                    Duration::from_micros(h.value_at_quantile(0.5)),
                    Duration::from_micros(h.value_at_quantile(0.99)),
                    h.len(),
                )
            })
        };
        StatsSnapshot {
            latency_p50,
            latency_p99,
            latency_samples,
            received: self.received.load(Relaxed),
            processed: self.processed.load(Relaxed),
            duplicates: self.duplicates.load(Relaxed),
            retried: self.retried.load(Relaxed),
            parked: self.parked.load(Relaxed),
            held: self.held.load(Relaxed),
            unrecorded: self.unrecorded.load(Relaxed),
            settle_failures: self.settle_failures.load(Relaxed),
            sessions: self.sessions.load(Relaxed),
            repeated_session_losses: self.repeated_session_losses.load(Relaxed),
        }
    }
}
