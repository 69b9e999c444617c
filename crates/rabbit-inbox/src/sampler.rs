//! [`InboxSampler`]: the gauges that need the database (open, stale and parked rows, oldest
//! unprocessed age, dedup-window headroom), sampled on a timer by a task that runs beside a
//! consumer (under a [`crate::Runner`]) or in a process that is not one (the admin server):
//! one query per tick over the index of open rows, and the headroom every [`HEADROOM_EVERY`]
//! ticks. Several samplers of one consumer write the same values.

use std::{future::Future, time::Duration};

use metrics::{SharedString, gauge};
use sqlx::PgPool;

use crate::{
    config::ConsumerConfig,
    error::{ConfigError, StoreError},
    retry::RetryPolicy,
    schema::SchemaName,
    store::{InboxStore, OpenRowsSample},
    telemetry::metrics as m,
};

/// The headroom query may read more than the open rows; it changes slowly.
const HEADROOM_EVERY: u64 = 20;

/// Samples one consumer's inbox gauges into the installed `metrics` recorder.
#[derive(Debug)]
pub struct InboxSampler {
    pool: PgPool,
    store: InboxStore,
    consumer: String,
    retry: RetryPolicy,
    interval: Duration,
    replay_window: Option<Duration>,
}

impl InboxSampler {
    /// Samples `consumer` of the inbox in `schema` every `interval`, judging staleness and
    /// retry waits by `retry` (the consumer's own policy). `interval` must be longer than zero.
    pub fn new(
        pool: PgPool,
        schema: SchemaName,
        consumer: impl Into<String>,
        retry: RetryPolicy,
        interval: Duration,
    ) -> Result<Self, ConfigError> {
        if interval.is_zero() {
            return Err(ConfigError::InvalidSetting {
                name: "sample interval",
                reason: "must be longer than zero".into(),
            });
        }
        Ok(Self {
            pool,
            store: InboxStore::new(schema),
            consumer: consumer.into(),
            retry,
            interval,
            replay_window: None,
        })
    }

    /// Samples the consumer `config` describes, every `interval`.
    pub fn for_consumer(
        pool: PgPool,
        config: &ConsumerConfig,
        interval: Duration,
    ) -> Result<Self, ConfigError> {
        Self::new(
            pool,
            config.schema.clone(),
            config.consumer_name.clone(),
            config.retry.clone(),
            interval,
        )
    }

    /// Also samples how far the retained PROCESSED history reaches beyond `window`, the
    /// longest time after which a message may be delivered again (DLQ replays, outbox
    /// republishes, backfills): `rabbit_inbox_dedup_window_headroom_seconds`.
    pub fn with_replay_window(mut self, window: Duration) -> Self {
        self.replay_window = Some(window);
        self
    }

    /// Samples until `shutdown` completes. A failed sample counts in
    /// `rabbit_inbox_sampler_errors_total` and the gauges keep their last values; nothing
    /// ends the run but `shutdown`.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let consumer = SharedString::from_shared(std::sync::Arc::from(self.consumer.as_str()));
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut shutdown = std::pin::pin!(shutdown);
        for tick in 0u64.. {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                _ = ticks.tick() => {}
            }
            if let Err(e) = self.sample(&consumer, tick % HEADROOM_EVERY == 0).await {
                metrics::counter!(m::SAMPLER_ERRORS, "consumer" => consumer.clone()).increment(1);
                tracing::debug!(error = %e, "inbox gauges not sampled");
            }
        }
    }

    async fn sample(&self, consumer: &SharedString, headroom: bool) -> Result<(), StoreError> {
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
