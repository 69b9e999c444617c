//! The consumer runtime: connect, dispatch deliveries to lanes, batch, process, settle;
//! reconnect with back-off; drain on shutdown.
//!
//! ```text
//! broker --deliveries--> dispatcher --(lane = hash(aggregate id or key) % lanes)--> lane 0..n
//! lane: collect up to batch_size for at most max_batch_delay -> Processor::process (one
//!       transaction) -> broker::settle each delivery by its durable Outcome
//! ```
//! Lane channels are bounded and prefetch bounds unacked deliveries, so a slow database slows
//! consumption instead of growing memory.

use std::{
    future::Future,
    hash::{DefaultHasher, Hash, Hasher},
    sync::Arc,
    time::Duration,
};

use sqlx::PgPool;
use tokio::{sync::mpsc, task::JoinSet, time::Instant};

use crate::{
    backoff::Backoff,
    broker::{self, PendingDelivery, Session, Settler},
    config::ConsumerConfig,
    envelope::{self, AmqpMessage},
    error::{ConfigError, ConsumerError},
    handler::{BatchHandler, Handler, PerMessage},
    processor::{Outcome, Parsed, Processor},
    stats::ConsumerStats,
};

/// A running consumer of one queue for one handler.
pub struct Consumer<H> {
    amqp_url: String,
    config: ConsumerConfig,
    processor: Arc<Processor<H>>,
    stats: Arc<ConsumerStats>,
    #[cfg(feature = "fault-injection")]
    faults: Arc<crate::fault::FaultPlan>,
}

type Work = (PendingDelivery, Parsed);

enum SessionEnd {
    Shutdown,
    Lost(String),
}

impl<H: Handler> Consumer<PerMessage<H>> {
    /// A consumer of `config.topology.queue` on the broker at `amqp_url`, with the inbox (and
    /// the handler's business tables) in `pool`, running `handler` once per message. Validates
    /// the configuration. Run [`crate::migrate`] first.
    pub fn new(
        amqp_url: impl Into<String>,
        pool: PgPool,
        config: ConsumerConfig,
        handler: H,
    ) -> Result<Self, ConfigError> {
        Consumer::with_batch_handler(amqp_url, pool, config, PerMessage(handler))
    }
}

impl<H: BatchHandler> Consumer<H> {
    /// Like [`Consumer::new`], with a handler that gets each batch's new messages at once, for
    /// set-based business writes.
    pub fn with_batch_handler(
        amqp_url: impl Into<String>,
        pool: PgPool,
        config: ConsumerConfig,
        handler: H,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        // Each lane holds a connection for as long as it runs; with no connection beyond them,
        // whatever else needs one (a handler's own queries, tools sharing the pool) waits for
        // the acquire timeout on every batch.
        let max_connections = pool.options().get_max_connections();
        if max_connections as usize <= config.lanes {
            return Err(ConfigError::InvalidSetting {
                name: "pool",
                reason: format!(
                    "the pool allows {max_connections} connections and the consumer runs {} lanes, \
                     each holding one; allow at least lanes + 1 (set max_connections, or fewer lanes)",
                    config.lanes
                ),
            });
        }
        Ok(Self {
            amqp_url: amqp_url.into(),
            processor: Arc::new(Processor::new(pool, Arc::new(handler), &config)),
            config,
            stats: Arc::new(ConsumerStats::default()),
            #[cfg(feature = "fault-injection")]
            faults: Arc::default(),
        })
    }

    /// Live counters.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// Faults to inject (tests and demos).
    #[cfg(feature = "fault-injection")]
    pub fn faults(&self) -> Arc<crate::fault::FaultPlan> {
        self.faults.clone()
    }

    /// Consumes until `shutdown` completes, then stops taking deliveries, finishes and settles
    /// the ones in hand, and closes the connection. Broker or database outages are ridden out
    /// with reconnects and back-off; only a configuration the broker refuses (e.g. a queue that
    /// exists with other arguments) ends the run with an error.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), ConsumerError> {
        let mut shutdown = std::pin::pin!(shutdown);
        let backoff = Backoff::new(
            self.config.reconnect_initial_delay,
            self.config.reconnect_max_delay,
        );
        loop {
            let opened = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                opened = Session::open(&self.amqp_url, &self.config) => opened,
            };
            let delay = match opened {
                Ok(session) => {
                    self.stats.record_session();
                    tracing::info!(queue = %self.config.topology.queue, consumer = %self.config.consumer_name, "consuming");
                    let began = Instant::now();
                    let SessionEnd::Lost(reason) = self.session(session, &mut shutdown).await
                    else {
                        return Ok(());
                    };
                    // Only a session that lived through the longest back-off resets it: one
                    // that dies right away (a delivery that breaks it, a broker that closes
                    // it) must not make reconnecting a hot loop.
                    if began.elapsed() >= self.config.reconnect_max_delay {
                        backoff.succeeded();
                    }
                    let delay = backoff.failed();
                    tracing::warn!(%reason, retry_in = ?delay, "broker session lost; reconnecting");
                    delay
                }
                Err(e) if broker::is_fatal(&e) => return Err(e.into()),
                Err(e) => {
                    let delay = backoff.failed();
                    tracing::warn!(error = %e, retry_in = ?delay, "cannot open broker session");
                    delay
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => return Ok(()),
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    async fn session(
        &self,
        mut session: Session,
        shutdown: &mut std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> SessionEnd {
        let mut lanes = JoinSet::new();
        let mut senders = Vec::with_capacity(self.config.lanes);
        // A lane that cannot settle signals here: the channel is gone, and lapin does not always
        // end the delivery stream after a close, so the dispatcher must not wait for it.
        let broken = Arc::new(tokio::sync::Notify::new());
        for _ in 0..self.config.lanes {
            // Bounded: when lanes fall behind, the dispatcher waits, and prefetch stops the
            // broker from pushing more.
            let (tx, rx) = mpsc::channel::<Work>(self.config.batch_size);
            senders.push(tx);
            lanes.spawn(lane(
                rx,
                LaneContext {
                    processor: self.processor.clone(),
                    settler: session.settler(),
                    stats: self.stats.clone(),
                    consumer: self.config.consumer_name.clone(),
                    batch_size: self.config.batch_size,
                    max_batch_delay: self.config.max_batch_delay,
                    backoff: (
                        self.config.reconnect_initial_delay,
                        self.config.reconnect_max_delay,
                    ),
                    #[cfg(feature = "fault-injection")]
                    faults: self.faults.clone(),
                    #[cfg(feature = "fault-injection")]
                    connection: session.connection(),
                    broken: broken.clone(),
                },
            ));
        }

        let settler = session.settler();
        let end = loop {
            let next = tokio::select! {
                biased;
                () = shutdown.as_mut() => {
                    session.cancel().await;
                    break SessionEnd::Shutdown;
                }
                () = broken.notified() => {
                    break SessionEnd::Lost("deliveries could not be settled".into());
                }
                // A lane ends only when its channel closes, so an early end is a crash: its
                // deliveries are unsettled and would hold back every later multiple-ack.
                Some(ended) = lanes.join_next() => {
                    let reason = match ended {
                        Err(e) => format!("a lane failed: {e}"),
                        Ok(()) => "a lane stopped".to_owned(),
                    };
                    tracing::error!(%reason, "lane ended while consuming; reconnecting so its deliveries return");
                    break SessionEnd::Lost(reason);
                }
                next = session.next_delivery() => next,
            };
            let (pending, message) = match next {
                Some(Ok(delivery)) => delivery,
                Some(Err(e)) => break SessionEnd::Lost(e.to_string()),
                None => break SessionEnd::Lost("consumer cancelled or connection closed".into()),
            };
            self.stats.record_received(1);
            settler.register(&pending).await;
            let parsed = parse(message, &self.config);
            let lane = lane_of(&parsed, senders.len());
            if senders[lane].send((pending, parsed)).await.is_err() {
                break SessionEnd::Lost("a lane stopped".into());
            }
        };

        // Drain: lanes finish what they hold and settle it.
        drop(senders);
        while let Some(joined) = lanes.join_next().await {
            if let Err(e) = joined {
                tracing::error!(error = %e, "lane task failed");
            }
        }
        if matches!(end, SessionEnd::Shutdown) {
            session.close().await;
        }
        end
    }
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM: the usual shutdown future for [`Consumer::run`].
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                return;
            }
            Err(e) => tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops"),
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

fn parse(message: AmqpMessage, config: &ConsumerConfig) -> Parsed {
    let parsed = envelope::parse(message, &config.envelope);
    if let Err(invalid) = &parsed {
        tracing::warn!(
            code = invalid.reason.code(),
            detail = %invalid.detail,
            inbox_key = %invalid.envelope.message_id,
            "invalid message; it will be recorded and parked"
        );
    }
    parsed
}

/// Lane of a delivery: one aggregate always maps to the same lane, keeping its order.
fn lane_of(parsed: &Parsed, lanes: usize) -> usize {
    let key = match parsed {
        Ok(e) => e.lane_key(),
        Err(invalid) => invalid.envelope.lane_key(),
    };
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    (h.finish() % lanes as u64) as usize
}

struct LaneContext<H> {
    processor: Arc<Processor<H>>,
    settler: Arc<Settler>,
    stats: Arc<ConsumerStats>,
    consumer: String,
    batch_size: usize,
    max_batch_delay: Duration,
    backoff: (Duration, Duration),
    #[cfg(feature = "fault-injection")]
    faults: Arc<crate::fault::FaultPlan>,
    #[cfg(feature = "fault-injection")]
    connection: Arc<broker::ConnectionHandle>,
    broken: Arc<tokio::sync::Notify>,
}

async fn lane<H: BatchHandler>(mut rx: mpsc::Receiver<Work>, ctx: LaneContext<H>) {
    let unrecorded = Backoff::new(ctx.backoff.0, ctx.backoff.1);
    let mut db = ctx.processor.lane_connection();
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        let deadline = Instant::now() + ctx.max_batch_delay;
        while batch.len() < ctx.batch_size {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(work)) => batch.push(work),
                Ok(None) | Err(_) => break,
            }
        }
        let (pendings, parsed): (Vec<PendingDelivery>, Vec<Parsed>) = batch.into_iter().unzip();
        let outcomes = ctx.processor.process(&parsed, &mut db).await;

        // Injected crash between commit and ack: the connection goes, nothing is settled.
        #[cfg(feature = "fault-injection")]
        let crashed = ctx.faults.should_drop_after_commit(&parsed, &outcomes);
        #[cfg(feature = "fault-injection")]
        if crashed {
            broker::drop_connection(&ctx.connection).await;
        }
        #[cfg(not(feature = "fault-injection"))]
        let crashed = false;

        // Nothing durable was written for these: hold them for a back-off before they go back
        // to the queue, so an outage does not become a hot redelivery loop.
        if outcomes
            .iter()
            .any(|o| matches!(o, Outcome::Unrecorded { .. }))
        {
            let delay = unrecorded.failed();
            tracing::warn!(retry_in = ?delay, "database unavailable; requeueing after back-off");
            tokio::time::sleep(delay).await;
        } else {
            unrecorded.succeeded();
        }

        ctx.stats.record_outcomes(&ctx.consumer, &outcomes);
        let unsettled = if crashed {
            // Nothing of this batch is settled, as in a crash.
            ctx.stats.record_settle_failures(outcomes.len() as u64);
            outcomes.len()
        } else {
            let batch = pendings
                .into_iter()
                .zip(&outcomes)
                .zip(&parsed)
                .map(|((pending, outcome), item)| {
                    let envelope = match item {
                        Ok(e) => e,
                        Err(invalid) => &invalid.envelope,
                    };
                    (pending, outcome, envelope)
                })
                .collect();
            ctx.settler.settle_batch(batch, &ctx.stats).await
        };
        if unsettled > 0 {
            tracing::warn!(
                unsettled,
                batch = outcomes.len(),
                "deliveries not settled (channel closed?); the broker will redeliver them and the inbox will recognise them"
            );
            ctx.broken.notify_one();
        }
    }
}
