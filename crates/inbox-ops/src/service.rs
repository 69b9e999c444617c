//! [`Service`]: a consumer with all of its background work, built in one place and run under
//! one [`Runner`].
//!
//! ```text
//! Service::builder(amqp_url, pool, config).handler(h)   defaults: relay, sampler (15 s),
//!     [.relay(..) .sampler_interval(..) .retention(..)   retention (every 10 min),
//!      .recovery(..) .shutdown_timeout(..)]             recovery (every minute),
//!     .build()?  -- checks the settings and the pool    release (ordered consumers),
//!                                                       migrations on start, 20 s to stop
//! service.health()  -- for the probes, before run; service.task(..) -- a probe server
//! service.run(shutdown).await?  -- migrate, then consumer + relay + sampler + retention
//!                                  + recovery + release
//! ```
//!
//! A consumer with an ordering policy (`ConsumerConfig::ordering`) always gets its
//! [`ReleaseTask`]: without it, the messages its keys hold would never run.

use std::{future::Future, sync::Arc, time::Duration};

use futures::future::BoxFuture;
use sqlx::PgPool;

use rabbit_inbox::{
    BatchHandler, ConfigError, Consumer, ConsumerConfig, Handler, Health, InboxSampler, Relay,
    RelayConfig, RunError, Runner, Shutdown, TaskResult,
    error::ConsumerError,
    lease::{LeaseConfig, LeasedHandler},
    outbox::RelayStats,
    retention::RetentionPolicy,
    stats::ConsumerStats,
};

use crate::{
    recover::{RecoveryConfig, RecoveryTask},
    release::ReleaseTask,
    retention::RetentionTask,
};

/// How often the sampler samples unless told otherwise.
pub const DEFAULT_SAMPLER_INTERVAL: Duration = Duration::from_secs(15);
/// How often retention runs when its policy has no interval of its own.
pub const DEFAULT_RETENTION_INTERVAL: Duration = Duration::from_secs(600);
/// How long the tasks have to stop after the shutdown signal unless told otherwise: below
/// Kubernetes' default grace period (30 s), so that a shutdown that times out is logged before
/// the process is killed.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(20);

/// The pool connections each piece of a [`Service`] may hold at once; what
/// [`ServiceBuilder::build`] checks the pool's `max_connections` against.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct PoolShares {
    /// The consumer's lanes, one connection each for as long as the consumer runs.
    pub lanes: u32,
    /// One beside the lanes, for what else the consumer and its handlers do (lease
    /// heartbeats, queries outside a batch): without it they wait on every batch.
    pub consumer_spare: u32,
    /// The relay: one for claiming and publishing, one for settling (0 without a relay). Its
    /// LISTEN connection is its own, outside the pool.
    pub relay: u32,
    /// The sampler, during a sample (0 without one).
    pub sampler: u32,
    /// Retention, during a round (0 without it).
    pub retention: u32,
    /// Recovery, during a run (0 without it).
    pub recovery: u32,
    /// The release of held messages, during a pass (0 for a consumer without ordering).
    pub release: u32,
}

impl PoolShares {
    /// The connections all of them may hold at once.
    pub fn required(&self) -> u32 {
        self.lanes
            + self.consumer_spare
            + self.relay
            + self.sampler
            + self.retention
            + self.recovery
            + self.release
    }

    fn describe(&self) -> String {
        let mut shares = vec![format!(
            "consumer {} lanes + {} = {}",
            self.lanes,
            self.consumer_spare,
            self.lanes + self.consumer_spare
        )];
        for (name, n) in [
            ("relay", self.relay),
            ("sampler", self.sampler),
            ("retention", self.retention),
            ("recovery", self.recovery),
            ("release", self.release),
        ] {
            if n > 0 {
                shares.push(format!("{name} {n}"));
            }
        }
        shares.join(", ")
    }
}

/// The consumer once built, its handler's type erased.
struct BuiltConsumer {
    health: Health,
    stats: Arc<ConsumerStats>,
    #[cfg(feature = "fault-injection")]
    faults: Arc<rabbit_inbox::fault::FaultPlan>,
    run: Box<dyn FnOnce(Shutdown) -> BoxFuture<'static, Result<(), ConsumerError>> + Send>,
}

impl BuiltConsumer {
    fn of<H: 'static>(consumer: Consumer<H>) -> Self {
        Self {
            health: consumer.health(),
            stats: consumer.stats(),
            #[cfg(feature = "fault-injection")]
            faults: consumer.faults(),
            run: Box::new(move |stop| Box::pin(consumer.run(stop))),
        }
    }
}

type MakeConsumer =
    Box<dyn FnOnce(String, PgPool, ConsumerConfig) -> Result<BuiltConsumer, ConfigError> + Send>;

/// Settings of a [`Service`] before it is built; see [`Service::builder`].
#[must_use = "a builder does nothing until `build` is called"]
pub struct ServiceBuilder {
    amqp_url: String,
    pool: PgPool,
    config: ConsumerConfig,
    consumer: Option<MakeConsumer>,
    relay: Option<RelayConfig>,
    sampler_interval: Option<Duration>,
    retention: Option<RetentionPolicy>,
    recovery: Option<RecoveryConfig>,
    migrate_on_start: bool,
    shutdown_timeout: Duration,
}

impl std::fmt::Debug for ServiceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceBuilder")
            .field("consumer", &self.config.consumer_name)
            .field("handler", &self.consumer.is_some())
            .field("relay", &self.relay)
            .field("sampler_interval", &self.sampler_interval)
            .field("retention", &self.retention)
            .field("recovery", &self.recovery)
            .field("migrate_on_start", &self.migrate_on_start)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .finish_non_exhaustive()
    }
}

impl ServiceBuilder {
    /// Runs `handler` once per message ([`Consumer::new`]).
    pub fn handler<H: Handler>(mut self, handler: H) -> Self {
        self.consumer = Some(Box::new(move |url, pool, config| {
            Consumer::new(url, pool, config, handler).map(BuiltConsumer::of)
        }));
        self
    }

    /// Runs `handler` once per batch ([`Consumer::with_batch_handler`]).
    pub fn batch_handler<H: BatchHandler>(mut self, handler: H) -> Self {
        self.consumer = Some(Box::new(move |url, pool, config| {
            Consumer::with_batch_handler(url, pool, config, handler).map(BuiltConsumer::of)
        }));
        self
    }

    /// Runs `handler` under leases, for work that cannot live inside one transaction
    /// ([`Consumer::leased`]).
    pub fn leased_handler<L: LeasedHandler>(mut self, lease: LeaseConfig, handler: L) -> Self {
        self.consumer = Some(Box::new(move |url, pool, config| {
            Consumer::leased(url, pool, config, lease, handler).map(BuiltConsumer::of)
        }));
        self
    }

    /// Publishes the outbox with these settings (default: on, [`RelayConfig::new`] for the
    /// consumer's schema).
    pub fn relay(mut self, relay: RelayConfig) -> Self {
        self.relay = Some(relay);
        self
    }

    /// No relay: for a service whose handlers never write to the outbox (rows written
    /// anyway would wait for a relay elsewhere, `inboxctl relay`).
    pub fn without_relay(mut self) -> Self {
        self.relay = None;
        self
    }

    /// Samples the gauges every `interval` (default: [`DEFAULT_SAMPLER_INTERVAL`]).
    pub fn sampler_interval(mut self, interval: Duration) -> Self {
        self.sampler_interval = Some(interval);
        self
    }

    /// No sampler: the gauges that need the database are not exported.
    pub fn without_sampler(mut self) -> Self {
        self.sampler_interval = None;
        self
    }

    /// Cleans up under `policy` (default: [`RetentionPolicy::default`], rows kept 30 days),
    /// every `policy.interval`, or every [`DEFAULT_RETENTION_INTERVAL`] if it has none. A
    /// dedup window shorter than the consumer's redelivery horizon is refused at `build`.
    pub fn retention(mut self, policy: RetentionPolicy) -> Self {
        self.retention = Some(policy);
        self
    }

    /// No retention task: the inbox grows until `inboxctl cleanup` runs.
    pub fn without_retention(mut self) -> Self {
        self.retention = None;
        self
    }

    /// Recovers expired leases and lost retries with these settings (default:
    /// [`RecoveryConfig::default`], every minute).
    pub fn recovery(mut self, recovery: RecoveryConfig) -> Self {
        self.recovery = Some(recovery);
        self
    }

    /// No recovery task: expired leases and lost retries wait for `inboxctl recover`.
    pub fn without_recovery(mut self) -> Self {
        self.recovery = None;
        self
    }

    /// Whether `run` applies the inbox migrations first (default: yes). Turn it off when
    /// migrations are a deployment step (`inboxctl migrate`) and the service's role may not
    /// change the schema.
    pub fn migrate_on_start(mut self, migrate: bool) -> Self {
        self.migrate_on_start = migrate;
        self
    }

    /// How long the tasks have to stop after the shutdown signal (default:
    /// [`DEFAULT_SHUTDOWN_TIMEOUT`]); see [`Runner::shutdown_timeout`].
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// The pool connections the pieces as set now may hold at once.
    pub fn pool_shares(&self) -> PoolShares {
        let lanes = u32::try_from(self.config.lanes).unwrap_or(u32::MAX);
        PoolShares {
            lanes,
            consumer_spare: 1,
            relay: if self.relay.is_some() { 2 } else { 0 },
            sampler: u32::from(self.sampler_interval.is_some()),
            retention: u32::from(self.retention.is_some()),
            recovery: u32::from(self.recovery.is_some()),
            release: u32::from(self.config.ordering.is_some()),
        }
    }

    /// Checks every setting and the pool's size, and builds each piece. Nothing touches the
    /// database or the broker yet.
    pub fn build(self) -> Result<Service, ConfigError> {
        let shares = self.pool_shares();
        let max_connections = self.pool.options().get_max_connections();
        if max_connections < shares.required() {
            return Err(ConfigError::PoolTooSmall {
                max_connections,
                required: shares.required(),
                shares: shares.describe(),
            });
        }
        let Some(make_consumer) = self.consumer else {
            return Err(ConfigError::InvalidSetting {
                name: "handler",
                reason: "the service has no handler; give it one with .handler(..), \
                         .batch_handler(..) or .leased_handler(..)"
                    .into(),
            });
        };
        let (amqp_url, pool, config) = (self.amqp_url, self.pool, self.config);
        let consumer = make_consumer(amqp_url.clone(), pool.clone(), config.clone())?;
        let relay = self
            .relay
            .map(|relay| Relay::new(amqp_url.clone(), pool.clone(), relay))
            .transpose()?;
        let retention = self
            .retention
            .map(|mut policy| {
                policy.interval = policy.interval.or(Some(DEFAULT_RETENTION_INTERVAL));
                let horizon = policy.redelivery_horizon(&config.retry);
                RetentionTask::new(pool.clone(), &config, policy, None).map(|task| (task, horizon))
            })
            .transpose()?;
        let sampler = self
            .sampler_interval
            .map(|interval| {
                let sampler = InboxSampler::for_consumer(pool.clone(), &config, interval)?;
                // The headroom gauge: how far the kept history reaches beyond the horizon
                // retention keeps it for.
                Ok::<_, ConfigError>(match &retention {
                    Some((_, horizon)) => sampler.with_replay_window(*horizon),
                    None => sampler,
                })
            })
            .transpose()?;
        let recovery = self
            .recovery
            .map(|recovery| RecoveryTask::new(pool.clone(), amqp_url.clone(), &config, recovery))
            .transpose()?;
        let release = ReleaseTask::for_consumer(pool.clone(), amqp_url.clone(), &config);

        let health = consumer.health.clone();
        let relay_stats = relay.as_ref().map(Relay::stats);
        let mut runner = Runner::new()
            .shutdown_timeout(self.shutdown_timeout)
            .with_health(health.clone())
            .task("consumer", consumer.run);
        if let Some(relay) = relay {
            runner = runner.task("relay", |stop| relay.run(stop));
        }
        if let Some(sampler) = sampler {
            runner = runner.task("sampler", |stop| sampler.run(stop));
        }
        if let Some((retention, _)) = retention {
            runner = runner.task("retention", |stop| retention.run(stop));
        }
        if let Some(recovery) = recovery {
            runner = runner.task("recovery", |stop| recovery.run(stop));
        }
        if let Some(release) = release {
            runner = runner.task("release", |stop| release.run(stop));
        }
        Ok(Service {
            pool,
            config,
            migrate_on_start: self.migrate_on_start,
            runner,
            health,
            stats: consumer.stats,
            relay_stats,
            #[cfg(feature = "fault-injection")]
            faults: consumer.faults,
            shares,
        })
    }
}

/// A consumer with its background work: the outbox relay, the gauges' sampler, retention,
/// recovery and (for an ordered consumer) the release of held messages, run under one
/// [`Runner`] with one shutdown and one [`Health`].
pub struct Service {
    pool: PgPool,
    config: ConsumerConfig,
    migrate_on_start: bool,
    runner: Runner,
    health: Health,
    stats: Arc<ConsumerStats>,
    relay_stats: Option<Arc<RelayStats>>,
    #[cfg(feature = "fault-injection")]
    faults: Arc<rabbit_inbox::fault::FaultPlan>,
    shares: PoolShares,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("consumer", &self.config.consumer_name)
            .field("runner", &self.runner)
            .field("pool_shares", &self.shares)
            .finish_non_exhaustive()
    }
}

impl Service {
    /// A service consuming `config.topology.queue` on the broker at `amqp_url` (one URL, or a
    /// cluster's separated by commas), with the inbox in `pool`. Give it a handler, change
    /// what differs from the defaults, and [`build`](ServiceBuilder::build) it.
    ///
    /// ```no_run
    /// # async fn run(handler: impl rabbit_inbox::Handler) -> anyhow::Result<()> {
    /// use rabbit_inbox::{ConsumerConfig, Topology};
    ///
    /// let pool = sqlx::postgres::PgPoolOptions::new()
    ///     .max_connections(10)
    ///     .connect("postgres://postgres@127.0.0.1/postgres")
    ///     .await?;
    /// let config = ConsumerConfig::new("payment-service", Topology::new("payments"));
    /// let service = inbox_ops::Service::builder("amqp://127.0.0.1:5672/%2f", pool, config)
    ///     .handler(handler)
    ///     .build()?;
    /// service.run(rabbit_inbox::shutdown_signal()).await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(
        amqp_url: impl Into<String>,
        pool: PgPool,
        config: ConsumerConfig,
    ) -> ServiceBuilder {
        let relay = RelayConfig::new(config.schema.clone());
        ServiceBuilder {
            amqp_url: amqp_url.into(),
            pool,
            config,
            consumer: None,
            relay: Some(relay),
            sampler_interval: Some(DEFAULT_SAMPLER_INTERVAL),
            retention: Some(RetentionPolicy::default()),
            recovery: Some(RecoveryConfig::default()),
            migrate_on_start: true,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
        }
    }

    /// The health of the consumer and every task, for liveness and readiness probes (see
    /// [`rabbit_inbox::health`]). Take it before `run`.
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// The consumer's live counters.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// The relay's live counters; `None` without a relay.
    pub fn relay_stats(&self) -> Option<Arc<RelayStats>> {
        self.relay_stats.clone()
    }

    /// The consumer's faults to inject (tests and demos).
    #[cfg(feature = "fault-injection")]
    pub fn faults(&self) -> Arc<rabbit_inbox::fault::FaultPlan> {
        self.faults.clone()
    }

    /// Runs a task of the application beside the others (a probe server given
    /// [`health`](Self::health), say), as [`Runner::task`] does: it stops with them, and its
    /// ending stops them.
    pub fn task<F, Fut>(mut self, name: impl Into<String>, start: F) -> Self
    where
        F: FnOnce(Shutdown) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: TaskResult,
    {
        self.runner = self.runner.task(name, start);
        self
    }

    /// The pool connections each piece may hold at once, as `build` checked them.
    pub fn pool_shares(&self) -> &PoolShares {
        &self.shares
    }

    /// Applies the migrations (unless turned off), then runs every piece until `shutdown`
    /// completes or one of them ends; see [`Runner::run`]. On shutdown the consumer stops
    /// taking deliveries and settles those in hand; what is still running after the shutdown
    /// timeout is abandoned ([`RunError::ShutdownTimedOut`]), and its unsettled deliveries
    /// return to the queue when the process exits, where the inbox recognises those already
    /// processed. A migration that fails is a [`RunError::TaskFailed`] of `migrations`.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
        let mut shutdown = std::pin::pin!(shutdown);
        if self.migrate_on_start {
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                migrated = rabbit_inbox::migrate(&self.pool, &self.config.schema) => {
                    if let Err(e) = migrated {
                        return Err(RunError::TaskFailed {
                            task: "migrations".into(),
                            source: Box::new(e),
                        });
                    }
                }
            }
        }
        self.runner.run(shutdown).await
    }
}
