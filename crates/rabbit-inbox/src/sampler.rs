//! [`InboxSampler`]: the gauges that need the database (open, stale and parked rows, oldest
//! unprocessed age, dedup-window headroom, blocked ordering keys and held messages), sampled
//! on a timer by a task that runs beside a consumer (under a [`crate::Runner`]) or in a
//! process that is not one (the admin server): one query per tick over the index of open
//! rows, one over the partial indexes of blocked keys and HELD rows for an ordered consumer,
//! and the headroom every [`HEADROOM_EVERY`] ticks. Several samplers of one consumer write the
//! same values.

use std::{future::Future, time::Duration};

use metrics::{SharedString, gauge};
use sqlx::{PgConnection, PgPool, Row, SqlStr};

use crate::{
    config::ConsumerConfig,
    error::{ConfigError, StoreError},
    ledger_sql::{Statuses, audited, tables},
    retry::RetryPolicy,
    schema::SchemaName,
    status::InboxStatus,
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
    /// The blocked-keys statement, when the consumer may have ordering keys: always unless the
    /// sampler was built from a config without an ordering policy.
    ordering: Option<SqlStr>,
}

impl InboxSampler {
    /// Samples `consumer` of the inbox in `schema` every `interval`, judging staleness and
    /// retry waits by `retry` (the consumer's own policy). `interval` must be longer than zero.
    /// Not knowing whether the consumer has an ordering policy, it samples the ordering gauges
    /// too (all 0 for a consumer without one).
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
            ordering: Some(audited(ordering_sample_sql(&schema))),
            store: InboxStore::new(schema),
            consumer: consumer.into(),
            retry,
            interval,
            replay_window: None,
        })
    }

    /// Samples the consumer `config` describes, every `interval`. The ordering gauges
    /// (blocked keys, held messages) only if `config.ordering` is set.
    pub fn for_consumer(
        pool: PgPool,
        config: &ConsumerConfig,
        interval: Duration,
    ) -> Result<Self, ConfigError> {
        let mut sampler = Self::new(
            pool,
            config.schema.clone(),
            config.consumer_name.clone(),
            config.retry.clone(),
            interval,
        )?;
        if config.ordering.is_none() {
            sampler.ordering = None;
        }
        Ok(sampler)
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
        if let Some(sql) = &self.ordering {
            let ordering = sample_ordering(&mut conn, sql, &self.consumer).await?;
            publish_ordering(consumer, &ordering);
        }
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

/// What the ordering statement found for one consumer.
#[derive(Debug)]
struct OrderingSample {
    blocked_keys: i64,
    blocked_oldest_age: f64,
    held_messages: i64,
}

/// Blocked keys (a head to wait for), keys waiting for a missing sequence number (their first
/// HELD row is past `next_sequence`, no head), the age of the oldest such block, and the HELD
/// rows. Reads only the partial indexes of blocked keys and of HELD rows, and the key rows of
/// keys that hold messages, never the table of every key seen. A block whose start was not
/// recorded ages from the key row's last update.
fn ordering_sample_sql(schema: &SchemaName) -> String {
    const HELD: Statuses = Statuses(&[InboxStatus::Held]);
    let inbox = schema.qualify(tables::MESSAGE_INBOX);
    let keys = schema.qualify(tables::INBOX_ORDER_KEY);
    format!(
        "WITH held AS ( \
           SELECT order_key, min(order_position) AS first_position, count(*) AS n \
           FROM {inbox} WHERE consumer_name = $1 AND status = {HELD} GROUP BY order_key), \
         gaps AS ( \
           SELECT coalesce(k.gap_since, k.updated_at) AS since \
           FROM held h JOIN {keys} k ON k.consumer_name = $1 AND k.order_key = h.order_key \
           WHERE k.head_message_id IS NULL AND h.first_position > k.next_sequence), \
         blocked AS ( \
           SELECT count(*) AS n, min(coalesce(blocked_since, updated_at)) AS since \
           FROM {keys} WHERE consumer_name = $1 AND head_message_id IS NOT NULL) \
         SELECT blocked.n + (SELECT count(*) FROM gaps) AS blocked_keys, \
           extract(epoch FROM now() - least(blocked.since, (SELECT min(since) FROM gaps))) \
             ::float8 AS blocked_oldest_age, \
           (SELECT coalesce(sum(n), 0) FROM held)::int8 AS held_messages \
         FROM blocked"
    )
}

async fn sample_ordering(
    conn: &mut PgConnection,
    sql: &SqlStr,
    consumer: &str,
) -> Result<OrderingSample, StoreError> {
    let row = sqlx::query(sql.clone())
        .persistent(false)
        .bind(consumer)
        .fetch_one(conn)
        .await?;
    Ok(OrderingSample {
        blocked_keys: row.try_get("blocked_keys")?,
        blocked_oldest_age: row
            .try_get::<Option<f64>, _>("blocked_oldest_age")?
            .unwrap_or(0.0)
            .max(0.0),
        held_messages: row.try_get("held_messages")?,
    })
}

fn publish_ordering(consumer: &SharedString, ordering: &OrderingSample) {
    gauge!(m::BLOCKED_KEYS, "consumer" => consumer.clone()).set(ordering.blocked_keys as f64);
    gauge!(m::BLOCKED_OLDEST_AGE, "consumer" => consumer.clone()).set(ordering.blocked_oldest_age);
    gauge!(m::HELD_MESSAGES, "consumer" => consumer.clone()).set(ordering.held_messages as f64);
}
