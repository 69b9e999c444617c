//! The shipped alerting rules (`deploy/prometheus/rabbit-inbox-rules.yml`), evaluated from the
//! ledger instead of the metrics: what the console shows without a Prometheus, and the same
//! names, severities and thresholds as the rules.
//!
//! Evaluated now, once: the rules' `for` durations (how long a condition must hold before
//! Prometheus fires) are not applied, so an alert here can show minutes before Prometheus
//! fires it, and goes as soon as its condition does.
//!
//! Of the rules over the ledger's gauges and counters:
//! - `InboxStaleProcessing`, `InboxOldestUnprocessedAge`: the same SQL as the sampler's gauges
//!   ([`stale_processing`], [`overdue_by`]).
//! - `InboxParkingLotGrowing`: messages parked in the last hour (from `inbox_event`) and still
//!   parked. The rule's `delta` of the parked gauge also subtracts older parked rows that left
//!   the parking lot in the hour (redriven, reopened); this counts only the growth.
//! - `InboxDuplicateSpike`: duplicate deliveries (from `inbox_event`) per consumer; the rule's
//!   split by reason is not kept in the ledger.
//! - `InboxDedupWindowHeadroom`: with the replay window given ([`AlertQuery::replay_window`],
//!   configuration the ledger does not hold), the retained PROCESSED history shorter than the
//!   window while retention removed rows in the last day (tombstones), as the rule says.
//!
//! The rules over counters the ledger does not keep (poison rate, session losses, sampler
//! errors) and over the outbox are not evaluated here.

use std::{collections::BTreeMap, time::Duration};

use serde::Serialize;
use sqlx::Row;

use crate::{
    error::OpsError,
    operations::Operations,
    sql::{OPEN, PARKED_BY_FAILURE, consumers_of, sql},
};
use rabbit_inbox::{
    ledger_sql::{PROCESSED, overdue_by, stale_processing},
    retry::RetryPolicy,
};

/// `InboxStaleProcessing`: PROCESSING rows past the stale threshold (warning).
pub const ALERT_STALE_PROCESSING: &str = "InboxStaleProcessing";
/// `InboxOldestUnprocessedAge`: a row that should be making progress is older than the
/// threshold (critical).
pub const ALERT_OLDEST_UNPROCESSED_AGE: &str = "InboxOldestUnprocessedAge";
/// `InboxParkingLotGrowing`: more than 100 messages parked in the last hour (warning).
pub const ALERT_PARKING_LOT_GROWING: &str = "InboxParkingLotGrowing";
/// `InboxDuplicateSpike`: duplicates over the last 10 minutes at more than 1 per second and
/// three times the rate of the hour before the last (info).
pub const ALERT_DUPLICATE_SPIKE: &str = "InboxDuplicateSpike";

/// `InboxDedupWindowHeadroom`: retention removes rows while the retained history is shorter
/// than the replay window (critical).
pub const ALERT_DEDUP_WINDOW_HEADROOM: &str = "InboxDedupWindowHeadroom";

/// The rule's threshold: parked messages per hour.
const PARKED_PER_HOUR: i64 = 100;
/// The rule's windows and thresholds: duplicates over the last 10 minutes, against the hour
/// before the last one, three times as many per second and more than one per second.
const SPIKE_WINDOW_SECS: f64 = 600.0;
const BASELINE_SECS: f64 = 3600.0;
const SPIKE_FACTOR: f64 = 3.0;
const SPIKE_MIN_RATE: f64 = 1.0;

/// What [`Operations::alerts`] evaluates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AlertQuery {
    /// One consumer, or all.
    pub consumer: Option<String>,
    /// The consumer's `retry.stale_processing_after`: a PROCESSING row whose attempt started
    /// longer ago (or whose lease expired) is stale.
    pub stale_after: Duration,
    /// The consumer's retry delay per attempt: a RETRYABLE_FAILED row is overdue only once its
    /// delay passed.
    pub retry_delays: Vec<Duration>,
    /// `InboxOldestUnprocessedAge` fires when a row has been overdue longer than this.
    pub oldest_unprocessed_after: Duration,
    /// The longest time after which a message may be delivered again (DLQ replays, outbox
    /// republishes); with it, the dedup-window headroom is evaluated too.
    pub replay_window: Option<Duration>,
}

impl Default for AlertQuery {
    /// The rules' thresholds with the default retry policy.
    fn default() -> Self {
        Self {
            consumer: None,
            stale_after: RetryPolicy::default().stale_processing_after,
            retry_delays: RetryPolicy::default().delays,
            oldest_unprocessed_after: Duration::from_secs(900),
            replay_window: None,
        }
    }
}

/// A rule whose condition holds for one consumer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LedgerAlert {
    /// The rule's name ([`ALERT_STALE_PROCESSING`], [`ALERT_OLDEST_UNPROCESSED_AGE`],
    /// [`ALERT_PARKING_LOT_GROWING`], [`ALERT_DUPLICATE_SPIKE`],
    /// [`ALERT_DEDUP_WINDOW_HEADROOM`]).
    pub name: String,
    /// The rule's severity: `critical`, `warning` or `info`.
    pub severity: String,
    /// Consumer.
    pub consumer: String,
    /// One sentence with the figure.
    pub summary: String,
    /// The figure the rule compares: stale rows, seconds overdue, parked messages, or
    /// duplicates per second.
    pub value: f64,
}

impl LedgerAlert {
    fn new(name: &str, severity: &str, consumer: &str, value: f64, summary: String) -> Self {
        Self {
            name: name.into(),
            severity: severity.into(),
            consumer: consumer.into(),
            summary,
            value,
        }
    }
}

impl Operations {
    /// The alerting rules' conditions that hold now, from the ledger (see the module
    /// documentation for how each rule is read): by consumer, then rule name. A consumer with
    /// nothing wrong has none. Two statements: open rows through their partial index, the
    /// last two hours of events through `idx_inbox_event_recent`.
    pub async fn alerts(&self, query: &AlertQuery) -> Result<Vec<LedgerAlert>, OpsError> {
        let t = self.schema.qualify("message_inbox");
        let e = self.schema.qualify("inbox_event");
        let open = sqlx::query(sql(format!(
            "SELECT consumer_name, count(*) FILTER (WHERE {stale}) AS stale, \
               extract(epoch FROM max({overdue}))::float8 AS overdue \
             FROM {t} \
             WHERE status <> {PROCESSED} AND status IN ({OPEN}) \
               AND ($1::text IS NULL OR consumer_name = $1) \
             GROUP BY consumer_name",
            stale = stale_processing("$2"),
            overdue = overdue_by("$3"),
        )))
        .persistent(false)
        .bind(query.consumer.as_deref())
        .bind(query.stale_after.as_secs_f64())
        .bind(
            query
                .retry_delays
                .iter()
                .map(Duration::as_secs_f64)
                .collect::<Vec<_>>(),
        )
        .fetch_all(&self.pool)
        .await?;
        // The consumers with events (one index probe each), then each one's last two hours.
        let events = sqlx::query(sql(format!(
            "WITH RECURSIVE {consumers} \
             SELECT c.consumer_name, \
               (SELECT count(*) FROM {t} m \
                 WHERE m.consumer_name = c.consumer_name \
                   AND m.status IN ({PARKED_BY_FAILURE}) \
                   AND m.message_id IN (SELECT p.message_id FROM {e} p \
                     WHERE p.consumer_name = c.consumer_name \
                       AND p.occurred_at >= now() - make_interval(secs => $2) \
                       AND p.kind = 'failed' \
                       AND p.status IN ({PARKED_BY_FAILURE}))) AS parked, \
               (SELECT coalesce(sum(d.deliveries), 0)::int8 FROM {e} d \
                 WHERE d.consumer_name = c.consumer_name \
                   AND d.occurred_at >= now() - make_interval(secs => $3) \
                   AND d.kind = 'duplicate') AS recent, \
               (SELECT coalesce(sum(d.deliveries), 0)::int8 FROM {e} d \
                 WHERE d.consumer_name = c.consumer_name \
                   AND d.occurred_at >= now() - make_interval(secs => $2 * 2) \
                   AND d.occurred_at < now() - make_interval(secs => $2) \
                   AND d.kind = 'duplicate') AS baseline \
             FROM consumers c",
            consumers = consumers_of("consumers", &e, "", "$1"),
        )))
        .persistent(false)
        .bind(query.consumer.as_deref())
        .bind(BASELINE_SECS)
        .bind(SPIKE_WINDOW_SECS)
        .fetch_all(&self.pool)
        .await?;

        let mut alerts: BTreeMap<(String, &'static str), LedgerAlert> = BTreeMap::new();
        let threshold = query.oldest_unprocessed_after.as_secs_f64();
        for row in &open {
            let consumer: String = row.try_get("consumer_name")?;
            let stale: i64 = row.try_get("stale")?;
            if stale > 0 {
                alerts.insert(
                    (consumer.clone(), ALERT_STALE_PROCESSING),
                    LedgerAlert::new(
                        ALERT_STALE_PROCESSING,
                        "warning",
                        &consumer,
                        stale as f64,
                        format!("{consumer}: {stale} stale PROCESSING rows"),
                    ),
                );
            }
            if let Some(overdue) = row.try_get::<Option<f64>, _>("overdue")?
                && overdue > threshold
            {
                alerts.insert(
                    (consumer.clone(), ALERT_OLDEST_UNPROCESSED_AGE),
                    LedgerAlert::new(
                        ALERT_OLDEST_UNPROCESSED_AGE,
                        "critical",
                        &consumer,
                        overdue,
                        format!(
                            "{consumer}: a message has been stuck for {}",
                            rabbit_inbox::retention::human(Duration::from_secs_f64(overdue))
                        ),
                    ),
                );
            }
        }
        for row in &events {
            let consumer: String = row.try_get("consumer_name")?;
            let parked: i64 = row.try_get("parked")?;
            if parked > PARKED_PER_HOUR {
                alerts.insert(
                    (consumer.clone(), ALERT_PARKING_LOT_GROWING),
                    LedgerAlert::new(
                        ALERT_PARKING_LOT_GROWING,
                        "warning",
                        &consumer,
                        parked as f64,
                        format!("{consumer}: {parked} more parked messages in the last hour"),
                    ),
                );
            }
            let recent = row.try_get::<i64, _>("recent")? as f64 / SPIKE_WINDOW_SECS;
            let baseline = row.try_get::<i64, _>("baseline")? as f64 / BASELINE_SECS;
            if recent > SPIKE_FACTOR * baseline && recent > SPIKE_MIN_RATE {
                alerts.insert(
                    (consumer.clone(), ALERT_DUPLICATE_SPIKE),
                    LedgerAlert::new(
                        ALERT_DUPLICATE_SPIKE,
                        "info",
                        &consumer,
                        recent,
                        format!(
                            "{consumer}: duplicates tripled: {recent:.1} per second over the \
                             last 10 minutes against {baseline:.2} the hour before"
                        ),
                    ),
                );
            }
        }
        if let Some(window) = query.replay_window {
            self.headroom_alerts(query.consumer.as_deref(), window, &mut alerts)
                .await?;
        }
        Ok(alerts.into_values().collect())
    }

    /// `InboxDedupWindowHeadroom` per consumer with processed rows: the history's reach past
    /// `window` (the store's query, as the sampler's gauge), alerting when it is negative and
    /// retention removed rows of the consumer in the last day.
    async fn headroom_alerts(
        &self,
        consumer: Option<&str>,
        window: Duration,
        alerts: &mut BTreeMap<(String, &'static str), LedgerAlert>,
    ) -> Result<(), OpsError> {
        let t = self.schema.qualify("message_inbox");
        let tombstones = self.schema.qualify("inbox_tombstone");
        let consumers: Vec<String> = sqlx::query_scalar(sql(format!(
            "WITH RECURSIVE {consumers} \
             SELECT c.consumer_name FROM consumers c \
             WHERE EXISTS (SELECT FROM {tombstones} d WHERE d.consumer_name = c.consumer_name \
               AND d.removed_at > now() - interval '1 day')",
            consumers = consumers_of("consumers", &t, "", "$1"),
        )))
        .persistent(false)
        .bind(consumer)
        .fetch_all(&self.pool)
        .await?;
        let store = rabbit_inbox::store::InboxStore::new(self.schema.clone());
        let mut conn = self.pool.acquire().await?;
        for consumer in consumers {
            let Some(headroom) = store
                .dedup_window_headroom(&mut conn, &consumer, window)
                .await?
            else {
                continue;
            };
            if headroom < 0.0 {
                alerts.insert(
                    (consumer.clone(), ALERT_DEDUP_WINDOW_HEADROOM),
                    LedgerAlert::new(
                        ALERT_DEDUP_WINDOW_HEADROOM,
                        "critical",
                        &consumer,
                        headroom,
                        format!(
                            "{consumer}: retention deletes processed rows {} short of the \
                             replay window; a message replayed that late runs its effect again",
                            rabbit_inbox::retention::human(Duration::from_secs_f64(-headroom))
                        ),
                    ),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_rules_thresholds() {
        let q = AlertQuery::default();
        assert_eq!(q.oldest_unprocessed_after, Duration::from_secs(900));
        assert_eq!(q.stale_after, RetryPolicy::default().stale_processing_after);
        assert_eq!(q.retry_delays, RetryPolicy::default().delays);
    }
}
