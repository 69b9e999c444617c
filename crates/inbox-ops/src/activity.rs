//! Activity over time, for the console's charts: per consumer and per time bucket, how many
//! messages were processed (and how long they took from first receipt), how many duplicate
//! deliveries were dropped, how many attempts failed into a retry or into the parking lot, and
//! how many conflicting bodies arrived.
//!
//! Cheap on a large inbox: processed rows are found through the BRIN index on `processed_at`
//! (only the block ranges of the window are read), the rest through `idx_inbox_event_recent`,
//! one consumer at a time (the consumers are enumerated by skipping through the index, not by
//! scanning it). Three statements: the database's clock, processed rows, events.

use std::{collections::BTreeMap, time::Duration};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::Row;

use crate::{
    error::OpsError,
    operations::Operations,
    sql::{consumers_of, sql},
};
use rabbit_inbox::ledger_sql::{PARKED, PROCESSED, RETRYABLE_FAILED};

/// What [`Operations::activity`] reports on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActivityQuery {
    /// One consumer, or all.
    pub consumer: Option<String>,
    /// How far back: [`ActivityQuery::MIN_WINDOW`] to [`ActivityQuery::MAX_WINDOW`].
    pub window: Duration,
    /// The width of a bucket: whole seconds, at least [`ActivityQuery::MIN_BUCKET`], and at
    /// most [`ActivityQuery::MAX_BUCKETS`] of them in the window.
    pub bucket: Duration,
}

impl Default for ActivityQuery {
    /// All consumers, the last hour, by minute.
    fn default() -> Self {
        Self {
            consumer: None,
            window: Duration::from_secs(3600),
            bucket: Duration::from_secs(60),
        }
    }
}

impl ActivityQuery {
    /// The shortest window.
    pub const MIN_WINDOW: Duration = Duration::from_secs(60);
    /// The longest window.
    pub const MAX_WINDOW: Duration = Duration::from_secs(7 * 86_400);
    /// The narrowest bucket.
    pub const MIN_BUCKET: Duration = Duration::from_secs(10);
    /// The most buckets a window may be cut into.
    pub const MAX_BUCKETS: u64 = 1500;

    /// Checks the window and the bucket; [`Operations::activity`] calls it.
    pub fn validate(&self) -> Result<(), OpsError> {
        if !(Self::MIN_WINDOW..=Self::MAX_WINDOW).contains(&self.window) {
            return Err(OpsError::Invalid(format!(
                "the activity window must be 1 minute to 7 days, not {} s",
                self.window.as_secs_f64()
            )));
        }
        if self.bucket < Self::MIN_BUCKET || self.bucket.subsec_nanos() != 0 {
            return Err(OpsError::Invalid(format!(
                "an activity bucket must be a whole number of seconds, at least 10, not {} s",
                self.bucket.as_secs_f64()
            )));
        }
        let buckets = self.window.as_secs().div_ceil(self.bucket.as_secs());
        if buckets > Self::MAX_BUCKETS {
            return Err(OpsError::Invalid(format!(
                "{} s buckets cut a {} s window into {buckets} buckets; at most {} are drawn: \
                 widen the bucket or shorten the window",
                self.bucket.as_secs(),
                self.window.as_secs(),
                Self::MAX_BUCKETS
            )));
        }
        Ok(())
    }
}

/// One time bucket of one consumer.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ActivityBucket {
    /// Start of the bucket (a multiple of the bucket width since the Unix epoch).
    pub at: DateTime<Utc>,
    /// Rows that became PROCESSED in the bucket.
    pub processed: i64,
    /// Duplicate deliveries dropped in the bucket.
    pub duplicates: i64,
    /// Attempts that failed into a retry tier (RETRYABLE_FAILED).
    pub retried: i64,
    /// Attempts that failed into the parking lot (PERMANENT_FAILED, POISONED, MANUAL_REVIEW).
    pub parked: i64,
    /// Copies with a known id and another body.
    pub conflicts: i64,
    /// Median time from first receipt to processing of the rows processed in the bucket, in
    /// milliseconds (retry waits included); `None` without any. Rows resolved by an edited
    /// replacement are counted as processed but left out of the latency.
    pub latency_p50_ms: Option<f64>,
    /// Its 99th percentile.
    pub latency_p99_ms: Option<f64>,
}

impl ActivityBucket {
    fn empty(at: DateTime<Utc>) -> Self {
        Self {
            at,
            processed: 0,
            duplicates: 0,
            retried: 0,
            parked: 0,
            conflicts: 0,
            latency_p50_ms: None,
            latency_p99_ms: None,
        }
    }
}

/// The buckets of one consumer.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ConsumerActivity {
    /// Consumer.
    pub consumer: String,
    /// Every bucket of the report, oldest first, zeros included.
    pub buckets: Vec<ActivityBucket>,
}

/// What [`Operations::activity`] returns.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ActivityReport {
    /// Start of the first bucket: the window's start rounded down to a bucket boundary.
    pub from: DateTime<Utc>,
    /// The database's clock when the report was made; the last bucket holds it (and is still
    /// filling).
    pub to: DateTime<Utc>,
    /// The width of a bucket, in seconds.
    pub bucket_secs: u64,
    /// One series per consumer with any activity in the window or any open row, by name.
    pub consumers: Vec<ConsumerActivity>,
}

impl Operations {
    /// The two statements [`Operations::activity`] reads the ledger with, in order: processed
    /// rows, then events (with the consumers that have open rows). Parameters: `$1` the
    /// first bucket's start (`timestamptz`), `$2` the bucket width in seconds (`int8`), `$3`
    /// the consumer (`text`, NULL for all). Exposed so tests can `EXPLAIN` exactly what runs.
    #[doc(hidden)]
    pub fn activity_statements(&self) -> [String; 2] {
        let t = self.schema.qualify("message_inbox");
        let e = self.schema.qualify("inbox_event");
        let latency = |q: f64| {
            format!(
                "percentile_cont({q}) WITHIN GROUP \
                   (ORDER BY extract(epoch FROM processed_at - first_received_at)::float8) \
                   FILTER (WHERE replaced_by IS NULL) * 1000"
            )
        };
        let processed = format!(
            "SELECT consumer_name, floor(extract(epoch FROM processed_at) / $2::int8)::int8 AS b, \
               count(*) AS processed, {p50} AS p50, {p99} AS p99 \
             FROM {t} \
             WHERE status = {PROCESSED} AND processed_at >= $1 \
               AND ($3::text IS NULL OR consumer_name = $3) \
             GROUP BY 1, 2",
            p50 = latency(0.5),
            p99 = latency(0.99),
        );
        let events = format!(
            "WITH RECURSIVE {event_consumers}, {open_consumers} \
             SELECT c.consumer_name, x.b, x.duplicates, x.retried, x.parked, x.conflicts \
             FROM event_consumers c CROSS JOIN LATERAL ( \
               SELECT floor(extract(epoch FROM e.occurred_at) / $2::int8)::int8 AS b, \
                 coalesce(sum(e.deliveries) FILTER (WHERE e.kind = 'duplicate'), 0)::int8 \
                   AS duplicates, \
                 count(*) FILTER (WHERE e.kind = 'failed' AND e.status = {RETRYABLE_FAILED}) \
                   AS retried, \
                 count(*) FILTER (WHERE e.kind = 'failed' \
                   AND e.status IN ({PARKED})) AS parked, \
                 coalesce(sum(e.deliveries) FILTER (WHERE e.kind = 'conflict'), 0)::int8 \
                   AS conflicts \
               FROM {e} e WHERE e.consumer_name = c.consumer_name AND e.occurred_at >= $1 \
               GROUP BY 1) AS x \
             UNION ALL \
             SELECT consumer_name, NULL::int8, 0::int8, 0::int8, 0::int8, 0::int8 \
             FROM open_consumers",
            event_consumers = consumers_of("event_consumers", &e, "", "$3"),
            // The partial index of open rows holds exactly these.
            open_consumers = consumers_of(
                "open_consumers",
                &t,
                &format!("status <> {PROCESSED} AND"),
                "$3",
            ),
        );
        [processed, events]
    }

    /// Per consumer and per bucket of `query.window`: rows processed and their latency,
    /// duplicate deliveries, failed attempts retried and parked, conflicting bodies. Buckets
    /// are aligned to multiples of the bucket width since the Unix epoch, oldest first, and
    /// every consumer with activity in the window or an open row gets every bucket (zeros
    /// included).
    pub async fn activity(&self, query: &ActivityQuery) -> Result<ActivityReport, OpsError> {
        query.validate()?;
        let width = i64::try_from(query.bucket.as_secs())
            .map_err(|_| OpsError::Invalid("the activity bucket is too wide".into()))?;
        let window = chrono::Duration::from_std(query.window)
            .map_err(|_| OpsError::Invalid("the activity window is too long".into()))?;
        let (to,): (DateTime<Utc>,) = sqlx::query_as("SELECT now()")
            .persistent(false)
            .fetch_one(&self.pool)
            .await?;
        let first = (to - window).timestamp().div_euclid(width);
        let last = to.timestamp().div_euclid(width);
        let start_of = |index: i64| {
            DateTime::from_timestamp(index * width, 0)
                .ok_or_else(|| OpsError::Invalid("the activity window is out of range".into()))
        };
        let from = start_of(first)?;
        let empty = (first..=last)
            .map(|i| start_of(i).map(ActivityBucket::empty))
            .collect::<Result<Vec<_>, _>>()?;

        let [processed_sql, events_sql] = self.activity_statements();
        let processed = sqlx::query(sql(processed_sql))
            .persistent(false)
            .bind(from)
            .bind(width)
            .bind(query.consumer.as_deref())
            .fetch_all(&self.pool)
            .await?;
        let events = sqlx::query(sql(events_sql))
            .persistent(false)
            .bind(from)
            .bind(width)
            .bind(query.consumer.as_deref())
            .fetch_all(&self.pool)
            .await?;

        let mut series: BTreeMap<String, Vec<ActivityBucket>> = BTreeMap::new();
        // The bucket of `index` for `consumer`, if the report has it (a row committed after
        // the clock was read lies past the last bucket); the consumer is in the report anyway.
        fn bucket<'a>(
            series: &'a mut BTreeMap<String, Vec<ActivityBucket>>,
            empty: &[ActivityBucket],
            first: i64,
            consumer: String,
            index: Option<i64>,
        ) -> Option<&'a mut ActivityBucket> {
            let buckets = series.entry(consumer).or_insert_with(|| empty.to_vec());
            let slot = usize::try_from(index?.checked_sub(first)?).ok()?;
            buckets.get_mut(slot)
        }
        for row in &processed {
            let (consumer, index) = (row.try_get("consumer_name")?, row.try_get("b")?);
            if let Some(b) = bucket(&mut series, &empty, first, consumer, index) {
                b.processed = row.try_get("processed")?;
                b.latency_p50_ms = row.try_get("p50")?;
                b.latency_p99_ms = row.try_get("p99")?;
            }
        }
        for row in &events {
            let (consumer, index) = (row.try_get("consumer_name")?, row.try_get("b")?);
            if let Some(b) = bucket(&mut series, &empty, first, consumer, index) {
                b.duplicates = row.try_get("duplicates")?;
                b.retried = row.try_get("retried")?;
                b.parked = row.try_get("parked")?;
                b.conflicts = row.try_get("conflicts")?;
            }
        }
        Ok(ActivityReport {
            from,
            to,
            bucket_secs: query.bucket.as_secs(),
            consumers: series
                .into_iter()
                .map(|(consumer, buckets)| ConsumerActivity { consumer, buckets })
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(window: u64, bucket: u64) -> ActivityQuery {
        ActivityQuery {
            consumer: None,
            window: Duration::from_secs(window),
            bucket: Duration::from_secs(bucket),
        }
    }

    #[test]
    fn the_window_and_the_bucket_are_bounded() {
        assert!(ActivityQuery::default().validate().is_ok());
        assert!(query(60, 10).validate().is_ok());
        assert!(query(7 * 86_400, 7 * 86_400 / 1500 + 1).validate().is_ok());
        assert!(query(59, 10).validate().is_err());
        assert!(query(7 * 86_400 + 1, 3600).validate().is_err());
        assert!(query(3600, 9).validate().is_err());
        let e = query(86_400, 10).validate().expect_err("8640 buckets");
        assert!(e.to_string().contains("at most 1500"), "{e}");
        let fractional = ActivityQuery {
            bucket: Duration::from_millis(10_500),
            ..ActivityQuery::default()
        };
        assert!(fractional.validate().is_err());
    }
}
