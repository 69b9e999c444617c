//! The gauges that need the database, sampled by a task of the consumer at
//! [`crate::TelemetryConfig::sample_interval`]: one query per tick over the index of open rows,
//! and the dedup-window headroom every [`HEADROOM_EVERY`] ticks. [`InboxSampler`] runs the same
//! outside a consumer (the admin server samples the consumers it serves).

use std::time::Duration;

use metrics::{SharedString, gauge};
use sqlx::PgPool;

use crate::{
    config::RetryPolicy,
    store::{InboxStore, OpenRowsSample},
    telemetry::metrics as m,
};

/// The headroom query may read more than the open rows; it changes slowly.
const HEADROOM_EVERY: u64 = 20;

pub(crate) struct Sampler {
    pub(crate) pool: PgPool,
    pub(crate) store: InboxStore,
    pub(crate) consumer: String,
    pub(crate) retry: RetryPolicy,
    pub(crate) interval: Duration,
    pub(crate) replay_window: Option<Duration>,
}

/// Samples one consumer's inbox gauges (open, stale and parked rows, oldest unprocessed age,
/// dedup-window headroom) into the installed `metrics` recorder, for a process that is not the
/// consumer: an admin server, a sidecar. Several may sample one consumer; they write the same
/// values.
pub struct InboxSampler(Sampler);

impl InboxSampler {
    /// Samples `consumer` of the inbox in `schema` every `interval`, judging staleness and
    /// retry waits by `retry` (the consumer's own policy).
    pub fn new(
        pool: PgPool,
        schema: crate::SchemaName,
        consumer: impl Into<String>,
        retry: RetryPolicy,
        interval: Duration,
    ) -> Self {
        Self(Sampler {
            pool,
            store: InboxStore::new(schema),
            consumer: consumer.into(),
            retry,
            interval,
            replay_window: None,
        })
    }

    /// Also samples the dedup-window headroom against `window` (see
    /// [`crate::TelemetryConfig::replay_window`]).
    pub fn with_replay_window(mut self, window: Duration) -> Self {
        self.0.replay_window = Some(window);
        self
    }

    /// Samples until the future is dropped; a failed sample counts in
    /// `rabbit_inbox_sampler_errors_total` and the gauges keep their last values.
    pub async fn run(self) {
        self.0.run().await;
    }
}

impl Sampler {
    /// Samples until dropped (the consumer aborts it when it stops).
    pub(crate) async fn run(self) {
        let consumer = SharedString::from_shared(std::sync::Arc::from(self.consumer.as_str()));
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for tick in 0u64.. {
            ticks.tick().await;
            if let Err(e) = self.sample(&consumer, tick % HEADROOM_EVERY == 0).await {
                metrics::counter!(m::SAMPLER_ERRORS, "consumer" => consumer.clone()).increment(1);
                tracing::debug!(error = %e, "inbox gauges not sampled");
            }
        }
    }

    async fn sample(
        &self,
        consumer: &SharedString,
        headroom: bool,
    ) -> Result<(), crate::error::StoreError> {
        let mut conn = self.pool.acquire().await?;
        let open = self
            .store
            .sample_open_rows(
                &mut conn,
                &self.consumer,
                self.retry.stale_processing_after,
                &self.retry,
            )
            .await?;
        publish(consumer, &open);
        if let (true, Some(window)) = (headroom, self.replay_window)
            && let Some(seconds) = self
                .store
                .dedup_window_headroom(&mut conn, &self.consumer, window)
                .await?
        {
            gauge!(m::DEDUP_WINDOW_HEADROOM, "consumer" => consumer.clone()).set(seconds);
        }
        Ok(())
    }
}

fn publish(consumer: &SharedString, open: &OpenRowsSample) {
    for (status, n) in [
        ("PROCESSING", open.processing),
        ("RETRYABLE_FAILED", open.retryable_failed),
        ("PERMANENT_FAILED", open.permanent_failed),
        ("POISONED", open.poisoned),
    ] {
        gauge!(m::OPEN_ROWS, "consumer" => consumer.clone(), "status" => status).set(n as f64);
    }
    gauge!(m::STALE_PROCESSING_ROWS, "consumer" => consumer.clone())
        .set(open.stale_processing as f64);
    gauge!(m::PARKED_ROWS, "consumer" => consumer.clone())
        .set((open.permanent_failed + open.poisoned) as f64);
    gauge!(m::PARKED_OLDEST_AGE, "consumer" => consumer.clone())
        .set(open.parked_oldest_age.unwrap_or(0.0).max(0.0));
    gauge!(m::OLDEST_UNPROCESSED_AGE, "consumer" => consumer.clone())
        .set(open.oldest_unprocessed_age);
}
