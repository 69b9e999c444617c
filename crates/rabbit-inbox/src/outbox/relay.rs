//! The relay: claims committed outbox rows under a lease, publishes them (mandatory, confirmed),
//! and settles each row under the claim's fencing token.
//!
//! ```text
//! wait (NOTIFY hint | poll_interval) -> claim (FOR UPDATE SKIP LOCKED, lease, epoch + 1)
//!   -> publish all, await confirms -> settle: SENT | charge (back-off, FAILED after max)
//!                                             | release (no charge) ; all WHERE epoch = claim's
//! ```
//! Several relays (processes, or a consumer's in-process relay beside `inboxctl relay`) may run
//! on one outbox: a row is claimed by one of them at a time. A relay that stalls past its lease
//! loses the row to another one and its late marks change nothing; the row may then be
//! published twice, with the same message id, which the downstream inbox dedups.

use std::{
    future::Future,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use futures::FutureExt;
use hdrhistogram::Histogram;
use sqlx::PgPool;
use tokio::time::Instant;

use super::{
    Headers,
    listener::Wakeups,
    outgoing,
    store::{Backoff as RetryBackoff, ClaimedRow, OutboxStore, Settlement},
};
use crate::{
    backoff::Backoff,
    broker::{ConfirmedLink, Publication, PublishResult},
    error::{ConfigError, StoreError},
    schema::SchemaName,
    telemetry::metrics as m,
};

/// Settings of a [`Relay`].
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// Schema of the outbox.
    pub schema: SchemaName,
    /// Lease owner and broker connection name; unique per relay (default: random).
    pub name: String,
    /// Rows claimed and published per round.
    pub batch_size: usize,
    /// How long a claim keeps other relays off its rows. Must outlast a round's publishing
    /// (at most `confirm_timeout`) by a good margin, or a slow round ends in double publishes.
    pub lease: Duration,
    /// Longest wait for a round's confirms; unconfirmed rows are released (not charged).
    pub confirm_timeout: Duration,
    /// LISTEN for the enqueuers' NOTIFY to publish within milliseconds of a commit.
    pub listen: bool,
    /// Longest sleep between rounds without a wake-up: the latency bound when LISTEN is off,
    /// notifications are lost, or rows wait for their retry time.
    pub poll_interval: Duration,
    /// Failed publishes (returned, nacked, exchange missing) before a row is FAILED.
    pub max_attempts: i32,
    /// Back-off after the first failed publish of a row; doubles per failure.
    pub retry_initial_delay: Duration,
    /// Longest back-off between a row's publishes.
    pub retry_max_delay: Duration,
    /// Delete SENT rows confirmed longer ago than this (`None`: keep them).
    pub retention: Option<Duration>,
    /// How often the relay refreshes its gauges and runs the retention.
    pub maintenance_interval: Duration,
    /// First delay after the database or the broker failed a round; doubles up to the max.
    pub reconnect_initial_delay: Duration,
    /// Longest such delay.
    pub reconnect_max_delay: Duration,
}

impl RelayConfig {
    /// Defaults for the outbox in `schema`.
    pub fn new(schema: SchemaName) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Self {
            schema,
            name: format!("relay-{}-{}", std::process::id(), &id[..8]),
            batch_size: 256,
            lease: Duration::from_secs(30),
            confirm_timeout: Duration::from_secs(10),
            listen: true,
            poll_interval: Duration::from_secs(1),
            max_attempts: 20,
            retry_initial_delay: Duration::from_secs(1),
            retry_max_delay: Duration::from_secs(300),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            maintenance_interval: Duration::from_secs(5),
            reconnect_initial_delay: Duration::from_millis(200),
            reconnect_max_delay: Duration::from_secs(10),
        }
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |name, reason: &str| {
            Err(ConfigError::InvalidSetting {
                name,
                reason: reason.to_owned(),
            })
        };
        if self.name.is_empty() || self.name.len() > 255 {
            return invalid("relay.name", "must be 1 to 255 bytes");
        }
        if !(1..=10_000).contains(&self.batch_size) {
            return invalid("relay.batch_size", "must be 1 to 10000");
        }
        if self.confirm_timeout.is_zero()
            || self
                .confirm_timeout
                .checked_mul(2)
                .is_none_or(|twice| self.lease < twice)
        {
            return invalid(
                "relay.lease",
                "must be at least twice confirm_timeout (a round must end well within its lease)",
            );
        }
        if self.poll_interval.is_zero() || self.maintenance_interval.is_zero() {
            return invalid("relay.poll_interval", "intervals must be positive");
        }
        if self.max_attempts < 1 {
            return invalid("relay.max_attempts", "must be at least 1");
        }
        if self.retry_initial_delay.is_zero() || self.retry_max_delay < self.retry_initial_delay {
            return invalid(
                "relay.retry_initial_delay",
                "must be positive and at most retry_max_delay",
            );
        }
        Ok(())
    }
}

/// Why a relay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// Live counters of one relay. Clone the `Arc` from [`Relay::stats`].
#[derive(Debug)]
pub struct RelayStats {
    rounds: AtomicU64,
    claimed: AtomicU64,
    published: AtomicU64,
    returned: AtomicU64,
    confirm_failures: AtomicU64,
    exchange_missing: AtomicU64,
    released: AtomicU64,
    failed: AtomicU64,
    fenced: AtomicU64,
    /// Enqueue-to-confirm delay of published rows in microseconds.
    delay: Mutex<Option<Histogram<u64>>>,
}

impl Default for RelayStats {
    fn default() -> Self {
        Self {
            rounds: AtomicU64::new(0),
            claimed: AtomicU64::new(0),
            published: AtomicU64::new(0),
            returned: AtomicU64::new(0),
            confirm_failures: AtomicU64::new(0),
            exchange_missing: AtomicU64::new(0),
            released: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            fenced: AtomicU64::new(0),
            delay: Mutex::new(Histogram::new_with_bounds(1, 3_600_000_000, 3).ok()),
        }
    }
}

/// A copy of a relay's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RelayStatsSnapshot {
    /// Rounds that claimed at least one row.
    pub rounds: u64,
    /// Rows claimed.
    pub claimed: u64,
    /// Rows confirmed and marked SENT by this relay.
    pub published: u64,
    /// Publishes the broker returned as unroutable.
    pub returned: u64,
    /// Publishes nacked or not confirmed in time.
    pub confirm_failures: u64,
    /// Publishes refused because the exchange does not exist.
    pub exchange_missing: u64,
    /// Rows released without a charge (no confirm, outage).
    pub released: u64,
    /// Rows that became FAILED.
    pub failed: u64,
    /// Rows whose mark was refused: another relay had taken them over.
    pub fenced: u64,
    /// Median enqueue-to-confirm delay of published rows.
    pub delay_p50: Duration,
    /// 99th percentile of the same.
    pub delay_p99: Duration,
}

impl RelayStats {
    /// The counters now.
    pub fn snapshot(&self) -> RelayStatsSnapshot {
        let (p50, p99) = self
            .delay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or((0, 0), |h| {
                (h.value_at_quantile(0.5), h.value_at_quantile(0.99))
            });
        RelayStatsSnapshot {
            rounds: self.rounds.load(Relaxed),
            claimed: self.claimed.load(Relaxed),
            published: self.published.load(Relaxed),
            returned: self.returned.load(Relaxed),
            confirm_failures: self.confirm_failures.load(Relaxed),
            exchange_missing: self.exchange_missing.load(Relaxed),
            released: self.released.load(Relaxed),
            failed: self.failed.load(Relaxed),
            fenced: self.fenced.load(Relaxed),
            delay_p50: Duration::from_micros(p50),
            delay_p99: Duration::from_micros(p99),
        }
    }
}

/// Faults for tests and chaos runs.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Default)]
pub struct RelayFaults {
    skip_marks: AtomicU64,
}

#[cfg(feature = "fault-injection")]
impl RelayFaults {
    /// The next `rounds` rounds publish and get their confirms, then leave the rows unmarked,
    /// as a relay dying between the confirm and the mark would: after the lease the rows are
    /// published again, with the same ids.
    pub fn skip_marks(&self, rounds: u64) {
        self.skip_marks.fetch_add(rounds, Relaxed);
    }

    fn take_skip(&self) -> bool {
        self.skip_marks
            .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Publishes the outbox of one schema; see the module docs.
pub struct Relay {
    amqp_url: String,
    pool: PgPool,
    config: RelayConfig,
    store: OutboxStore,
    stats: Arc<RelayStats>,
    #[cfg(feature = "fault-injection")]
    faults: Arc<RelayFaults>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("name", &self.config.name)
            .field("schema", &self.config.schema)
            .finish_non_exhaustive()
    }
}

/// What one round did.
#[derive(Default)]
struct Round {
    claimed: usize,
    /// An ordered row was marked SENT: the next row of its key can be claimed now.
    ordered_sent: bool,
    /// The broker could not be reached, or every publish of the round went unconfirmed.
    outage: Option<String>,
}

impl Relay {
    /// A relay of `config.schema`'s outbox, publishing to the broker at `amqp_url` (one URL,
    /// or a cluster's addresses separated by commas, tried in order on every reconnect). Run
    /// [`crate::migrate`] first.
    pub fn new(
        amqp_url: impl Into<String>,
        pool: PgPool,
        config: RelayConfig,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let amqp_url = amqp_url.into();
        crate::broker::check_addresses(&amqp_url)?;
        Ok(Self {
            amqp_url,
            pool,
            store: OutboxStore::new(config.schema.clone()),
            config,
            stats: Arc::new(RelayStats::default()),
            #[cfg(feature = "fault-injection")]
            faults: Arc::default(),
        })
    }

    /// Live counters.
    pub fn stats(&self) -> Arc<RelayStats> {
        self.stats.clone()
    }

    /// Faults to inject (tests and chaos runs).
    #[cfg(feature = "fault-injection")]
    pub fn faults(&self) -> Arc<RelayFaults> {
        self.faults.clone()
    }

    /// Publishes until `shutdown` completes; the round in progress finishes first. Database and
    /// broker outages are ridden out with back-off.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), RelayError> {
        let shutdown = shutdown.fuse();
        let mut shutdown = std::pin::pin!(shutdown);
        let c = &self.config;
        let backoff_bounds = (c.reconnect_initial_delay, c.reconnect_max_delay);
        let wakeups = if c.listen {
            Wakeups::listen(&self.pool, self.store.wakeup_channel(), backoff_bounds)
        } else {
            Wakeups::polling()
        };
        let backoff = Backoff::new(backoff_bounds.0, backoff_bounds.1);
        let mut link = ConfirmedLink::new(&self.amqp_url, &c.name);
        let mut maintained = None::<Instant>;
        tracing::info!(relay = %c.name, schema = %c.schema, "relaying the outbox");
        loop {
            if (&mut shutdown).now_or_never().is_some() {
                break;
            }
            match self.round(&mut link).await {
                Ok(Round {
                    outage: Some(why), ..
                }) => {
                    // Rows were not claimed, or were released: wait before trying again. The
                    // gauges go on, so the outbox age alert sees the outage.
                    self.maintain_if_due(&mut maintained).await;
                    let delay = backoff.failed();
                    tracing::warn!(error = %why, retry_in = ?delay, relay = %c.name, "broker unavailable to the outbox relay");
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(delay) => continue,
                    }
                }
                Ok(round) => {
                    backoff.succeeded();
                    // Also under a steady backlog: the gauges and retention keep their pace.
                    self.maintain_if_due(&mut maintained).await;
                    if round.claimed == c.batch_size || round.ordered_sent {
                        continue; // more is waiting, or claimable now
                    }
                }
                Err(e) => {
                    let delay = backoff.failed();
                    tracing::warn!(error = %e, retry_in = ?delay, relay = %c.name, "outbox round failed");
                    tokio::select! {
                        biased;
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(delay) => continue,
                    }
                }
            }
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = wakeups.wait(c.poll_interval) => {}
            }
        }
        link.close().await;
        Ok(())
    }

    /// Connect, claim, publish, settle.
    async fn round(&self, link: &mut ConfirmedLink) -> Result<Round, StoreError> {
        let c = &self.config;
        // Connected before claiming, so a broker outage claims (and releases) nothing, and
        // the lease is not spent on connecting.
        if let Err(e) = link.connect().await {
            return Ok(Round {
                outage: Some(e.to_string()),
                ..Round::default()
            });
        }
        let mut conn = self.pool.acquire().await?;
        let rows = self
            .store
            .claim(&mut conn, &c.name, c.batch_size, c.lease)
            .await?;
        if rows.is_empty() {
            return Ok(Round::default());
        }
        let claimed_at = Instant::now();
        self.stats.rounds.fetch_add(1, Relaxed);
        self.stats.claimed.fetch_add(rows.len() as u64, Relaxed);
        let publications: Vec<Publication> = rows.iter().map(publication).collect();
        // Everything up to the marks within half the lease, so they land before another relay
        // may take the rows over: what is not confirmed by then is released, not marked.
        let budget = c.lease / 2;
        let results =
            match tokio::time::timeout(budget, link.publish_all(&publications, c.confirm_timeout))
                .await
            {
                Ok(results) => results,
                Err(_) => {
                    link.reset();
                    let why = format!("publishing took longer than {budget:?} (half the lease)");
                    publications
                        .iter()
                        .map(|_| PublishResult::Unconfirmed(why.clone()))
                        .collect()
                }
            };
        let outage = results
            .iter()
            .all(|r| matches!(r, PublishResult::Unconfirmed(_)))
            .then(|| match results.first() {
                Some(PublishResult::Unconfirmed(why)) => why.clone(),
                _ => "no publish confirmed".to_owned(),
            });
        let confirmed_after = claimed_at.elapsed();
        let settled: Vec<(i64, i64, Settlement)> = rows
            .iter()
            .zip(&results)
            .map(|(row, result)| (row.seq, row.epoch, self.settlement(row, result)))
            .collect();
        #[cfg(feature = "fault-injection")]
        if self.faults.take_skip() {
            tracing::warn!(
                rows = rows.len(),
                "fault injected: rows published but left unmarked"
            );
            return Ok(Round {
                claimed: rows.len(),
                ..Round::default()
            });
        }
        let retry = RetryBackoff {
            max_attempts: c.max_attempts,
            initial: c.retry_initial_delay,
            max: c.retry_max_delay,
            release_after: c.reconnect_initial_delay,
        };
        let changed = self.store.settle(&mut conn, &settled, retry).await?;
        self.count(&rows, &settled, &changed, confirmed_after);
        let ordered_sent = rows.iter().zip(&settled).any(|(row, (seq, _, how))| {
            row.ordered && *how == Settlement::Sent && changed.contains(seq)
        });
        Ok(Round {
            claimed: rows.len(),
            ordered_sent,
            outage,
        })
    }

    fn settlement(&self, row: &ClaimedRow, result: &PublishResult) -> Settlement {
        let schema = self.config.schema.as_str().to_owned();
        match result {
            PublishResult::Confirmed => Settlement::Sent,
            PublishResult::Returned(reply) => {
                self.stats.returned.fetch_add(1, Relaxed);
                metrics::counter!(m::OUTBOX_RETURNS, "schema" => schema).increment(1);
                Settlement::Charge {
                    code: "returned",
                    error: format!(
                        "unroutable: no queue bound to exchange {:?} for routing key {:?} ({reply})",
                        row.exchange, row.routing_key
                    ),
                }
            }
            PublishResult::Nacked => {
                self.stats.confirm_failures.fetch_add(1, Relaxed);
                metrics::counter!(m::OUTBOX_CONFIRM_FAILURES, "schema" => schema).increment(1);
                Settlement::Charge {
                    code: "nacked",
                    error: "the broker nacked the publish".into(),
                }
            }
            PublishResult::ExchangeMissing => {
                self.stats.exchange_missing.fetch_add(1, Relaxed);
                metrics::counter!(m::OUTBOX_RETURNS, "schema" => schema).increment(1);
                Settlement::Charge {
                    code: "exchange_missing",
                    error: format!("exchange {:?} does not exist", row.exchange),
                }
            }
            PublishResult::Unpublishable(e) => Settlement::GiveUp {
                code: "unpublishable",
                error: e.clone(),
            },
            PublishResult::Unconfirmed(e) => {
                self.stats.confirm_failures.fetch_add(1, Relaxed);
                metrics::counter!(m::OUTBOX_CONFIRM_FAILURES, "schema" => schema).increment(1);
                Settlement::Release {
                    code: "unconfirmed",
                    error: e.clone(),
                }
            }
        }
    }

    fn count(
        &self,
        rows: &[ClaimedRow],
        settled: &[(i64, i64, Settlement)],
        changed: &[i64],
        confirmed_after: Duration,
    ) {
        let schema = self.config.schema.as_str().to_owned();
        let mut published = 0u64;
        let mut released = 0u64;
        let mut fenced = 0u64;
        let mut hist = self
            .stats
            .delay
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (row, (seq, _, how)) in rows.iter().zip(settled) {
            if !changed.contains(seq) {
                fenced += 1;
                continue;
            }
            match how {
                Settlement::Sent => {
                    published += 1;
                    let delay = row.age_secs.max(0.0) + confirmed_after.as_secs_f64();
                    metrics::histogram!(m::OUTBOX_DELAY, "schema" => schema.clone()).record(delay);
                    if let Some(h) = hist.as_mut() {
                        let _ = h.record((delay * 1e6) as u64);
                    }
                }
                Settlement::Release { .. } => released += 1,
                Settlement::Charge { .. } | Settlement::GiveUp { .. } => {}
            }
        }
        drop(hist);
        metrics::histogram!(m::OUTBOX_PUBLISH_DURATION, "schema" => schema.clone())
            .record(confirmed_after.as_secs_f64());
        metrics::counter!(m::OUTBOX_PUBLISHED, "schema" => schema.clone()).increment(published);
        self.stats.published.fetch_add(published, Relaxed);
        self.stats.released.fetch_add(released, Relaxed);
        if fenced > 0 {
            tracing::warn!(
                fenced,
                relay = %self.config.name,
                "outbox rows were taken over by another relay after this one's lease expired; \
                 they may be published twice (same ids, deduped downstream)"
            );
            metrics::counter!(m::OUTBOX_FENCED, "schema" => schema).increment(fenced);
            self.stats.fenced.fetch_add(fenced, Relaxed);
        }
    }

    /// [`Relay::maintain`] once per `maintenance_interval`.
    async fn maintain_if_due(&self, maintained: &mut Option<Instant>) {
        let c = &self.config;
        if maintained.is_none_or(|t| t.elapsed() >= c.maintenance_interval) {
            *maintained = Some(Instant::now());
            if let Err(e) = self.maintain().await {
                tracing::warn!(error = %e, relay = %c.name, "outbox maintenance failed");
            }
        }
    }

    /// Gauges and retention.
    async fn maintain(&self) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await?;
        let summary = self.store.summary(&mut conn).await?;
        let schema = self.config.schema.as_str().to_owned();
        metrics::gauge!(m::OUTBOX_PENDING, "schema" => schema.clone()).set(summary.pending as f64);
        metrics::gauge!(m::OUTBOX_FAILED, "schema" => schema.clone()).set(summary.failed as f64);
        metrics::gauge!(m::OUTBOX_OLDEST_PENDING_AGE, "schema" => schema)
            .set(summary.oldest_pending_secs.unwrap_or(0.0));
        if let Some(retention) = self.config.retention {
            // At most CHUNKS per pass: a large purge (retention just shortened, a relay that
            // was off for a week) is spread over passes instead of holding up publishing.
            const CHUNK: i64 = 5_000;
            const CHUNKS: usize = 20;
            for _ in 0..CHUNKS {
                let deleted = self
                    .store
                    .delete_sent_older_than(&mut conn, retention, CHUNK)
                    .await?;
                if deleted < CHUNK as u64 {
                    break;
                }
            }
        }
        Ok(())
    }
}

fn publication(row: &ClaimedRow) -> Publication {
    let headers = match &row.headers {
        serde_json::Value::Object(map) => map.clone(),
        _ => serde_json::Map::new(),
    };
    Publication {
        exchange: row.exchange.clone(),
        routing_key: row.routing_key.clone(),
        content_type: row.content_type.clone(),
        message: outgoing(
            &row.message_id,
            &row.message_type,
            row.message_version,
            Headers {
                aggregate_type: row.aggregate_type.as_deref(),
                aggregate_id: row.aggregate_id.as_deref(),
                causation_id: row.causation_id.as_deref(),
                traceparent: row.traceparent.as_deref(),
                tracestate: row.tracestate.as_deref(),
                headers: &headers,
            },
            row.correlation_id.as_deref(),
            &row.payload,
        ),
    }
}
