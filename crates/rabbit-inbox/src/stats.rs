//! Counters of a running consumer, readable while it runs and exported through `metrics`.
//!
//! They describe what this process saw; correctness checks count from the database instead.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::processor::Outcome;

/// Live counters of one [`crate::Consumer`]. Clone the `Arc` from [`crate::Consumer::stats`].
#[derive(Debug, Default)]
pub struct ConsumerStats {
    received: AtomicU64,
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    parked: AtomicU64,
    unrecorded: AtomicU64,
    settle_failures: AtomicU64,
    sessions: AtomicU64,
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
    /// Deliveries requeued because nothing durable could be written.
    pub unrecorded: u64,
    /// Settlements the broker did not take (the delivery will come back).
    pub settle_failures: u64,
    /// Broker sessions opened (1 + reconnects).
    pub sessions: u64,
}

impl ConsumerStats {
    pub(crate) fn record_received(&self, n: u64) {
        self.received.fetch_add(n, Relaxed);
        metrics::counter!("rabbit_inbox_received_total").increment(n);
    }

    pub(crate) fn record_outcome(&self, consumer: &str, outcome: &Outcome) {
        let (counter, label) = match outcome {
            Outcome::Processed => (&self.processed, "processed"),
            Outcome::Duplicate => (&self.duplicates, "duplicate"),
            Outcome::RetryScheduled { .. } | Outcome::InFlightElsewhere => {
                (&self.retried, "retried")
            }
            Outcome::Parked { .. } => (&self.parked, "parked"),
            Outcome::Unrecorded { .. } => (&self.unrecorded, "unrecorded"),
        };
        counter.fetch_add(1, Relaxed);
        metrics::counter!("rabbit_inbox_outcomes_total", "consumer" => consumer.to_owned(), "outcome" => label)
            .increment(1);
    }

    pub(crate) fn record_settle_failure(&self) {
        self.settle_failures.fetch_add(1, Relaxed);
        metrics::counter!("rabbit_inbox_settle_failures_total").increment(1);
    }

    pub(crate) fn record_session(&self) {
        self.sessions.fetch_add(1, Relaxed);
    }

    /// Reads all counters.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            received: self.received.load(Relaxed),
            processed: self.processed.load(Relaxed),
            duplicates: self.duplicates.load(Relaxed),
            retried: self.retried.load(Relaxed),
            parked: self.parked.load(Relaxed),
            unrecorded: self.unrecorded.load(Relaxed),
            settle_failures: self.settle_failures.load(Relaxed),
            sessions: self.sessions.load(Relaxed),
        }
    }
}
