//! The relay: claims committed outbox rows under a lease, publishes them (mandatory, confirmed),
//! and settles each row under the claim's fencing token.
//!
//! ```text
//! claiming half:  wait for a place in the window -> claim a batch (FOR UPDATE SKIP LOCKED,
//!                 lease, epoch + 1) -> publish it -> hand it over -> claim the next one
//!                 (at once when the batch was full, else on a NOTIFY hint | poll_interval)
//! settling half:  await the batch's confirms -> settle: SENT | charge (back-off, FAILED after
//!                 max) | release (no charge) ; all WHERE epoch = claim's -> free its place
//! ```
//! The halves overlap: while one batch's confirms are on their way and its marks are written,
//! the next batches are claimed and published, at most `window` batches unsettled at a time.
//! Nothing is marked SENT before its own confirm, and the next row of an ordering key is only
//! claimable once the row before it is SENT, so pipelining keeps each key's order.
//! Several relays (processes, or one beside `inboxctl relay`) may run on one outbox: a row is
//! claimed by one of them at a time. A relay that stalls past its lease loses the row to another
//! one and its late marks change nothing; the row may then be published twice, with the same
//! message id, which the downstream inbox dedups.

use std::{
    collections::HashMap,
    future::Future,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};

use futures::FutureExt;
use hdrhistogram::Histogram;
use sqlx::PgPool;
use tokio::{
    sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc},
    time::Instant,
};

use super::{
    amqp::{Headers, outgoing},
    listener::Wakeups,
    store::{Backoff as RetryBackoff, ClaimedRow, OutboxStore, Settlement},
};
use crate::{
    backoff::Backoff,
    broker::{
        ConfirmedLink, ConnectFailed, Exchange, Outstanding, Publication, PublishResult, is_fatal,
    },
    error::{BrokerError, ConfigError, StoreError},
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
    /// Rows claimed and published per batch.
    pub batch_size: usize,
    /// Batches published and not yet settled, at most: how far claiming and publishing may run
    /// ahead of the confirms. 1 is strict rounds (claim, publish, await, mark).
    pub window: usize,
    /// How long a claim keeps other relays off its rows. Must outlast a batch's publishing
    /// (at most `confirm_timeout`) by a good margin, or a slow batch ends in double publishes.
    pub lease: Duration,
    /// Longest wait for a batch's confirms, counted from its claim; unconfirmed rows are
    /// released (not charged).
    pub confirm_timeout: Duration,
    /// LISTEN for the enqueuers' NOTIFY to publish within milliseconds of a commit.
    pub listen: bool,
    /// Longest sleep between claims without a wake-up: the latency bound when LISTEN is off,
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
    /// First delay after the database or the broker failed a claim or a batch; doubles up to
    /// the max.
    pub reconnect_initial_delay: Duration,
    /// Longest such delay.
    pub reconnect_max_delay: Duration,
    /// Exchanges the relay declares before it publishes (idempotent), again on every
    /// reconnect, and again if one is deleted while it runs: the destinations this service
    /// owns. One that exists with another type or durability fails [`Relay::run`] at start.
    pub declared_exchanges: Vec<Exchange>,
    /// Exchanges that must exist before the relay publishes, checked passively (not
    /// declared): destinations another service owns. A missing one fails [`Relay::run`] at
    /// start, naming it.
    pub required_exchanges: Vec<String>,
}

impl RelayConfig {
    /// Defaults for the outbox in `schema`.
    pub fn new(schema: SchemaName) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Self {
            schema,
            name: format!("relay-{}-{}", std::process::id(), &id[..8]),
            batch_size: 256,
            window: 4,
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
            declared_exchanges: Vec::new(),
            required_exchanges: Vec::new(),
        }
    }

    /// The same settings, with `exchange` among the exchanges the relay declares.
    pub fn with_declared_exchange(mut self, exchange: Exchange) -> Self {
        self.declared_exchanges.push(exchange);
        self
    }

    /// The same settings, with `exchange` among the exchanges that must exist at start.
    pub fn with_required_exchange(mut self, exchange: impl Into<String>) -> Self {
        self.required_exchanges.push(exchange.into());
        self
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
        if !(1..=64).contains(&self.window) {
            return invalid("relay.window", "must be 1 to 64 batches");
        }
        if self.confirm_timeout.is_zero()
            || self
                .confirm_timeout
                .checked_mul(2)
                .is_none_or(|twice| self.lease < twice)
        {
            return invalid(
                "relay.lease",
                "must be at least twice confirm_timeout (a batch must be settled well within its lease)",
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
        let names = self
            .declared_exchanges
            .iter()
            .map(|x| (x.name.as_str(), "relay.declared_exchanges"))
            .chain(
                self.required_exchanges
                    .iter()
                    .map(|x| (x.as_str(), "relay.required_exchanges")),
            );
        for (exchange, setting) in names {
            if exchange.is_empty() || exchange.len() > 255 {
                // The default exchange ("") always exists and cannot be declared.
                return invalid(
                    setting,
                    "exchange names must be 1 to 255 bytes (the default exchange needs no entry)",
                );
            }
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
    /// Exchanges in [`RelayConfig::required_exchanges`] do not exist on the broker.
    #[error(
        "the outbox relay's required exchanges do not exist: {}; declare them on the broker, \
         or move them to RelayConfig::declared_exchanges so the relay declares them, and start \
         the relay again",
        .exchanges.iter().map(|x| format!("{x:?}")).collect::<Vec<_>>().join(", ")
    )]
    ExchangesMissing {
        /// The missing exchanges' names.
        exchanges: Vec<String>,
    },
    /// The broker refused to declare an exchange of [`RelayConfig::declared_exchanges`]: it
    /// exists with another type or durability, or the user may not declare it.
    #[error(
        "the broker refused to declare exchange {exchange:?} for the outbox relay ({error}); \
         declare it in RelayConfig::declared_exchanges as it is on the broker (type and \
         durability), or delete it there, or grant the user configure permission on it"
    )]
    ExchangeRefused {
        /// The exchange's name.
        exchange: String,
        /// What the broker said.
        #[source]
        error: BrokerError,
    },
    /// The broker refused the relay's connection or its exchange checks in a way retrying
    /// cannot fix (no permission, invalid TLS settings).
    #[error(
        "the outbox relay cannot use the broker ({0}); fix the user's permissions or the connection settings"
    )]
    Broker(#[source] BrokerError),
}

/// Live counters of one relay. Clone the `Arc` from [`Relay::stats`].
#[derive(Debug)]
pub struct RelayStats {
    batches: AtomicU64,
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
            batches: AtomicU64::new(0),
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
    /// Batches claimed (each of at least one row).
    pub batches: u64,
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
            batches: self.batches.load(Relaxed),
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
    /// The next `batches` batches are published and get their confirms, then leave the rows
    /// unmarked, as a relay dying between the confirm and the mark would: after the lease the
    /// rows are published again, with the same ids.
    pub fn skip_marks(&self, batches: u64) {
        self.skip_marks.fetch_add(batches, Relaxed);
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

/// A claimed batch on its way: published, its confirms outstanding.
struct InFlight {
    rows: Vec<ClaimedRow>,
    outstanding: Outstanding,
    claimed_at: Instant,
    /// Its place in the window, given back once the batch is settled.
    place: OwnedSemaphorePermit,
}

/// What the claiming half got.
enum Claimed {
    Batch(InFlight),
    Nothing,
    /// The broker cannot be reached: nothing was claimed.
    BrokerDown(String),
}

/// What the claiming half does after a claim.
enum AfterClaim {
    /// Claim again at once: more is waiting, or a failure's back-off is over.
    ClaimAgain,
    /// Wait for a commit to claim (a notification or the poll interval).
    AwaitWork,
    /// Shut down, or the settling half is gone.
    Stop,
}

/// The claiming half's pace: its back-off after failures, and when the gauges and retention
/// last ran.
struct ClaimPace {
    backoff: Backoff,
    maintained: Option<Instant>,
}

/// Exchanges found missing at run time, each warned about at most once per back-off period
/// (the rows' retry delays, doubling), not once per message or batch.
struct MissingExchanges {
    initial: Duration,
    max: Duration,
    /// Per exchange: when the next warning is due, and the period after it.
    warned: HashMap<String, (Instant, Duration)>,
}

impl MissingExchanges {
    fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            warned: HashMap::new(),
        }
    }

    /// Whether a warning about `exchange` is due now; if so, the next one is one period away
    /// and the period doubles (up to the max).
    fn warning_due(&mut self, exchange: &str, now: Instant) -> Option<Duration> {
        match self.warned.get_mut(exchange) {
            None => {
                self.warned
                    .insert(exchange.to_owned(), (now + self.initial, self.initial));
                Some(self.initial)
            }
            Some((due, period)) if now >= *due => {
                *period = (*period * 2).min(self.max);
                *due = now + *period;
                Some(*period)
            }
            Some(_) => None,
        }
    }

    /// `exchange` took a publish: whether it had been missing.
    fn found(&mut self, exchange: &str) -> bool {
        self.warned.remove(exchange).is_some()
    }
}

/// What the settling half tells the claiming half.
#[derive(Default)]
struct Feedback {
    /// An ordered row was marked SENT: the next row of its key can be claimed now.
    claimable: Notify,
    /// Every publish of a batch went unconfirmed: the broker is unavailable, back off.
    outage: Mutex<Option<String>>,
    /// A confirm did not come in time: the link is not trusted with the next batch.
    distrust_link: AtomicBool,
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

    /// Publishes until `shutdown` completes; the batches already published are settled first.
    /// Database and broker outages are ridden out with back-off.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), RelayError> {
        let c = &self.config;
        let backoff_bounds = (c.reconnect_initial_delay, c.reconnect_max_delay);
        let wakeups = if c.listen {
            Wakeups::listen(&self.pool, self.store.wakeup_channel(), backoff_bounds)
        } else {
            Wakeups::polling()
        };
        let mut link = ConfirmedLink::new(&self.amqp_url, &c.name, c.declared_exchanges.clone());
        let shutdown = shutdown.fuse();
        let mut shutdown = std::pin::pin!(shutdown);
        if !self.prepare_exchanges(&mut link, &mut shutdown).await? {
            link.close().await;
            return Ok(()); // shut down before the broker was reachable
        }
        let feedback = Feedback::default();
        let (hand_over, settling) = mpsc::unbounded_channel();
        tracing::info!(relay = %c.name, schema = %c.schema, window = c.window, "relaying the outbox");
        tokio::join!(
            self.claim_loop(shutdown, &wakeups, &mut link, hand_over, &feedback),
            self.settle_loop(settling, &feedback),
        );
        // Only now: the settling half needed the connection for the last confirms.
        link.close().await;
        Ok(())
    }

    /// Declares the configured exchanges and checks the required ones, before anything is
    /// claimed. An unreachable broker is waited for (with back-off); a refusal or a missing
    /// exchange ends the relay with an error naming it. `false` when `shutdown` came first.
    async fn prepare_exchanges(
        &self,
        link: &mut ConfirmedLink,
        shutdown: &mut (impl futures::future::FusedFuture<Output = ()> + Unpin),
    ) -> Result<bool, RelayError> {
        let c = &self.config;
        if c.declared_exchanges.is_empty() && c.required_exchanges.is_empty() {
            return Ok(true);
        }
        let backoff = Backoff::new(c.reconnect_initial_delay, c.reconnect_max_delay);
        loop {
            let checked = match link.connect().await {
                Ok(()) => {
                    link.missing(&c.required_exchanges)
                        .await
                        .map_err(|error| ConnectFailed {
                            exchange: None,
                            error,
                        })
                }
                Err(e) => Err(e),
            };
            let failed = match checked {
                Ok(missing) if missing.is_empty() => {
                    tracing::info!(
                        relay = %c.name,
                        declared = c.declared_exchanges.len(),
                        checked = c.required_exchanges.len(),
                        "the outbox relay's exchanges are in place"
                    );
                    return Ok(true);
                }
                Ok(missing) => return Err(RelayError::ExchangesMissing { exchanges: missing }),
                Err(failed) => failed,
            };
            if is_fatal(&failed.error) {
                return Err(match failed.exchange {
                    Some(exchange) => RelayError::ExchangeRefused {
                        exchange,
                        error: failed.error,
                    },
                    None => RelayError::Broker(failed.error),
                });
            }
            let delay = backoff.failed();
            tracing::warn!(error = %failed, retry_in = ?delay, relay = %c.name, "broker unavailable to the outbox relay at start; its exchanges are declared and checked once the broker is back");
            tokio::select! {
                biased;
                () = &mut *shutdown => return Ok(false),
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// The claiming half: claims and publishes batches while the window has room; stops at
    /// `shutdown`, dropping `hand_over` so the settling half drains and ends.
    async fn claim_loop(
        &self,
        shutdown: impl Future<Output = ()>,
        wakeups: &Wakeups,
        link: &mut ConfirmedLink,
        hand_over: mpsc::UnboundedSender<InFlight>,
        feedback: &Feedback,
    ) {
        let c = &self.config;
        let shutdown = shutdown.fuse();
        let mut shutdown = std::pin::pin!(shutdown);
        let window = Arc::new(Semaphore::new(c.window));
        let mut pace = ClaimPace {
            backoff: Backoff::new(c.reconnect_initial_delay, c.reconnect_max_delay),
            maintained: None,
        };
        loop {
            let place = tokio::select! {
                biased;
                () = &mut shutdown => break,
                place = window.clone().acquire_owned() => match place {
                    Ok(place) => place,
                    Err(_) => break, // never closed
                },
            };
            if feedback.distrust_link.swap(false, Relaxed) {
                link.reset();
            }
            let outage = feedback
                .outage
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            let claimed = match outage {
                Some(why) => Ok(Claimed::BrokerDown(why)),
                None => self.claim_and_publish(link, place).await,
            };
            let next = self
                .after_claim(claimed, &hand_over, &window, &mut pace, &mut shutdown)
                .await;
            match next {
                AfterClaim::ClaimAgain => continue,
                AfterClaim::Stop => break,
                AfterClaim::AwaitWork => {}
            }
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = feedback.claimable.notified() => {}
                () = wakeups.wait(c.poll_interval) => {}
            }
        }
    }

    /// Hands a claimed batch over to the settling half, or waits out a failure; keeps the
    /// gauges and retention going either way. Says what the claiming half does next.
    async fn after_claim(
        &self,
        claimed: Result<Claimed, StoreError>,
        hand_over: &mpsc::UnboundedSender<InFlight>,
        window: &Semaphore,
        pace: &mut ClaimPace,
        shutdown: &mut (impl futures::future::FusedFuture<Output = ()> + Unpin),
    ) -> AfterClaim {
        let c = &self.config;
        let delay = match claimed {
            Ok(Claimed::Batch(batch)) => {
                pace.backoff.succeeded();
                let full = batch.rows.len() == c.batch_size;
                if hand_over.send(batch).is_err() {
                    return AfterClaim::Stop; // the settling half is gone: nothing could be marked
                }
                // Also under a steady backlog: the gauges and retention keep their pace.
                self.maintain_if_due(&mut pace.maintained).await;
                if full {
                    return AfterClaim::ClaimAgain; // more is waiting
                }
                // The backlog is drained: before claiming again, let what is in flight be
                // settled. Under a steady stream of small commits the next claim then takes
                // all that arrived meanwhile, one batch instead of one per commit; at idle
                // nothing is in flight and a commit is claimed at once.
                let all = u32::try_from(c.window).unwrap_or(u32::MAX);
                return tokio::select! {
                    biased;
                    () = &mut *shutdown => AfterClaim::Stop,
                    _ = window.acquire_many(all) => AfterClaim::AwaitWork,
                };
            }
            Ok(Claimed::Nothing) => {
                pace.backoff.succeeded();
                self.maintain_if_due(&mut pace.maintained).await;
                return AfterClaim::AwaitWork;
            }
            Ok(Claimed::BrokerDown(why)) => {
                // Rows were not claimed, or were released: wait before trying again. The
                // gauges go on, so the outbox age alert sees the outage.
                self.maintain_if_due(&mut pace.maintained).await;
                let delay = pace.backoff.failed();
                tracing::warn!(error = %why, retry_in = ?delay, relay = %c.name, "broker unavailable to the outbox relay");
                delay
            }
            Err(e) => {
                let delay = pace.backoff.failed();
                tracing::warn!(error = %e, retry_in = ?delay, relay = %c.name, "outbox claim failed");
                delay
            }
        };
        tokio::select! {
            biased;
            () = &mut *shutdown => AfterClaim::Stop,
            () = tokio::time::sleep(delay) => AfterClaim::ClaimAgain,
        }
    }

    /// Connect, claim, publish; the confirms are awaited by the settling half.
    async fn claim_and_publish(
        &self,
        link: &mut ConfirmedLink,
        place: OwnedSemaphorePermit,
    ) -> Result<Claimed, StoreError> {
        let c = &self.config;
        // Connected before claiming, so a broker outage claims (and releases) nothing, and
        // the lease is not spent on connecting.
        if let Err(e) = link.connect().await {
            return Ok(Claimed::BrokerDown(e.to_string()));
        }
        let rows = {
            let mut conn = self.pool.acquire().await?;
            self.store
                .claim(&mut conn, &c.name, c.batch_size, c.lease)
                .await?
        };
        if rows.is_empty() {
            return Ok(Claimed::Nothing);
        }
        let claimed_at = Instant::now();
        self.stats.batches.fetch_add(1, Relaxed);
        self.stats.claimed.fetch_add(rows.len() as u64, Relaxed);
        let publications: Vec<Publication> = rows.iter().map(publication).collect();
        // Publishing and confirms within the confirm timeout (at most half the lease), so the
        // marks land before another relay may take the rows over: what is not confirmed by then
        // is released, not marked.
        let outstanding =
            match tokio::time::timeout_at(claimed_at + c.confirm_timeout, link.send(&publications))
                .await
            {
                Ok(outstanding) => outstanding,
                Err(_) => {
                    link.reset();
                    Outstanding::unconfirmed(
                        publications.len(),
                        &format!("publishing took longer than {:?}", c.confirm_timeout),
                    )
                }
            };
        Ok(Claimed::Batch(InFlight {
            rows,
            outstanding,
            claimed_at,
            place,
        }))
    }

    /// The settling half: per batch, in claim order, awaits the confirms and marks the rows
    /// under their fencing tokens; ends when the claiming half is gone and every batch handed
    /// over is settled.
    async fn settle_loop(
        &self,
        mut settling: mpsc::UnboundedReceiver<InFlight>,
        feedback: &Feedback,
    ) {
        let c = &self.config;
        let retry = RetryBackoff {
            max_attempts: c.max_attempts,
            initial: c.retry_initial_delay,
            max: c.retry_max_delay,
            release_after: c.reconnect_initial_delay,
        };
        let mut missing = MissingExchanges::new(c.retry_initial_delay, c.retry_max_delay);
        while let Some(batch) = settling.recv().await {
            let InFlight {
                rows,
                outstanding,
                claimed_at,
                place,
            } = batch;
            let (results, timed_out) = outstanding.confirmed(claimed_at + c.confirm_timeout).await;
            if timed_out {
                feedback.distrust_link.store(true, Relaxed);
            }
            if results
                .iter()
                .all(|r| matches!(r, PublishResult::Unconfirmed(_)))
            {
                let why = match results.first() {
                    Some(PublishResult::Unconfirmed(why)) => why.clone(),
                    _ => "no publish confirmed".to_owned(),
                };
                *feedback
                    .outage
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(why);
            }
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
                continue;
            }
            let changed = match self.pool.acquire().await {
                Ok(mut conn) => self.store.settle(&mut conn, &settled, retry).await,
                Err(e) => Err(e.into()),
            };
            drop(place);
            match changed {
                Ok(changed) => {
                    self.count(&rows, &settled, &changed, confirmed_after);
                    self.report_missing_exchanges(&mut missing, &rows, &results)
                        .await;
                    let ordered_sent = rows.iter().zip(&settled).any(|(row, (seq, _, how))| {
                        row.ordered && *how == Settlement::Sent && changed.contains(seq)
                    });
                    if ordered_sent {
                        feedback.claimable.notify_one();
                    }
                }
                // The rows stay leased and are published again once the lease ends (same ids,
                // deduped downstream); a database that is gone also fails the next claim, which
                // backs off.
                Err(e) => tracing::warn!(
                    error = %e,
                    rows = rows.len(),
                    relay = %c.name,
                    "outbox rows published but not marked; they are published again after the lease"
                ),
            }
        }
    }

    /// Logs the exchanges this batch found missing, each at most once per back-off period,
    /// with the rows waiting for it and what to do; and the ones that are back.
    async fn report_missing_exchanges(
        &self,
        missing: &mut MissingExchanges,
        rows: &[ClaimedRow],
        results: &[PublishResult],
    ) {
        let c = &self.config;
        let now = Instant::now();
        let mut due = Vec::new();
        for (row, result) in rows.iter().zip(results) {
            match result {
                PublishResult::ExchangeMissing => {
                    if due.iter().all(|(x, _)| x != &row.exchange)
                        && let Some(period) = missing.warning_due(&row.exchange, now)
                    {
                        due.push((row.exchange.clone(), period));
                    }
                }
                PublishResult::Confirmed | PublishResult::Returned(_)
                    if missing.found(&row.exchange) =>
                {
                    tracing::info!(relay = %c.name, exchange = %row.exchange, "the exchange the outbox rows waited for exists now; publishing them");
                }
                _ => {}
            }
        }
        for (exchange, next_warning_in) in due {
            let waiting = match self.pool.acquire().await {
                Ok(mut conn) => self.store.pending_for_exchange(&mut conn, &exchange).await,
                Err(e) => Err(e.into()),
            };
            // Without the database, the batch's own rows are a lower bound.
            let rows_waiting = waiting
                .unwrap_or_else(|_| rows.iter().filter(|r| r.exchange == exchange).count() as i64);
            tracing::warn!(
                relay = %c.name,
                exchange = %exchange,
                rows_waiting,
                next_warning_in = ?next_warning_in,
                "outbox rows wait for exchange {exchange:?}, which does not exist: declare it on \
                 the broker, or add it to RelayConfig::declared_exchanges so the relay declares \
                 it; until then each publish to it is charged an attempt (exchange_missing), and \
                 a row is FAILED after max_attempts"
            );
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rejected(change: impl FnOnce(&mut RelayConfig)) -> Option<&'static str> {
        let mut c = RelayConfig::new(SchemaName::new("relay_test").expect("schema"));
        change(&mut c);
        match c.validate() {
            Err(ConfigError::InvalidSetting { name, .. }) => Some(name),
            _ => None,
        }
    }

    #[test]
    fn the_defaults_are_valid_and_bad_settings_are_named() {
        assert_eq!(rejected(|_| {}), None);
        assert_eq!(rejected(|c| c.window = 0), Some("relay.window"));
        assert_eq!(rejected(|c| c.window = 65), Some("relay.window"));
        assert_eq!(rejected(|c| c.window = 1), None);
        assert_eq!(rejected(|c| c.batch_size = 0), Some("relay.batch_size"));
        assert_eq!(
            rejected(|c| c.confirm_timeout = c.lease),
            Some("relay.lease")
        );
        assert_eq!(
            rejected(|c| c.declared_exchanges.push(Exchange::topic(""))),
            Some("relay.declared_exchanges")
        );
        assert_eq!(
            rejected(|c| c.required_exchanges.push("x".repeat(256))),
            Some("relay.required_exchanges")
        );
        assert_eq!(
            rejected(|c| {
                *c = c
                    .clone()
                    .with_declared_exchange(Exchange::topic("orders"))
                    .with_required_exchange("billing");
            }),
            None
        );
    }

    #[test]
    fn a_missing_exchange_is_warned_about_once_per_doubling_period() {
        let second = Duration::from_secs(1);
        let mut missing = MissingExchanges::new(second, 4 * second);
        let t0 = Instant::now();
        assert_eq!(missing.warning_due("a", t0), Some(second));
        // Not again within the period, whatever the number of rows; another exchange has its own.
        assert_eq!(missing.warning_due("a", t0 + second / 2), None);
        assert_eq!(missing.warning_due("b", t0 + second / 2), Some(second));
        assert_eq!(missing.warning_due("a", t0 + second), Some(2 * second));
        assert_eq!(missing.warning_due("a", t0 + 2 * second), None);
        assert_eq!(missing.warning_due("a", t0 + 3 * second), Some(4 * second));
        assert_eq!(missing.warning_due("a", t0 + 7 * second), Some(4 * second));
        // Back, then missing again: warned at once.
        assert!(missing.found("a"));
        assert!(!missing.found("a"));
        assert_eq!(missing.warning_due("a", t0 + 8 * second), Some(second));
    }
}
