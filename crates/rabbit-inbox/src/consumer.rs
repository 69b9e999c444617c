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
//!
//! Copies of one key are handled in delivery order, one at a time: while a delivery of a key
//! is unsettled, later deliveries of that key go to the same lane ([`KeysInFlight`]), and a
//! lane holds a later copy back until the batch before it is settled (its parking or retry
//! copy confirmed and noted on the row). So the first delivery of a key owns its row, and a
//! later copy finds the first one's copy noted instead of making a second.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    future::Future,
    hash::{DefaultHasher, Hash, Hasher},
    marker::PhantomData,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use sqlx::PgPool;
use tokio::{sync::mpsc, task::JoinSet, time::Instant};

use crate::{
    backoff::Backoff,
    broker::{self, PendingDelivery, Session, SessionSettings, Settler, check_addresses},
    config::ConsumerConfig,
    envelope::{self, AmqpMessage, Envelope, InvalidReason},
    error::{ConfigError, ConsumerError},
    handler::{BatchHandler, Handler, PerMessage},
    health::Health,
    lease::{LeaseConfig, Leased, LeasedHandler, LeasedProcessor},
    ordering::OrderingPolicy,
    processor::{LaneConnection, Parsed, Process, Processor, Refusal},
    session_loss::{DeliverySummary, SessionLosses},
    stats::ConsumerStats,
    status::Outcome,
    telemetry,
};

/// A running consumer of one queue for one handler.
pub struct Consumer<H> {
    amqp_url: String,
    config: ConsumerConfig,
    processor: Arc<dyn Process>,
    stats: Arc<ConsumerStats>,
    health: Health,
    #[cfg(feature = "fault-injection")]
    faults: Arc<crate::fault::FaultPlan>,
    handler: PhantomData<fn() -> H>,
}

impl<H> std::fmt::Debug for Consumer<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("consumer", &self.config.consumer_name)
            .field("queue", &self.config.topology.queue)
            .finish_non_exhaustive()
    }
}

/// A delivery on its way to a lane, with its span (open until it is settled).
type Work = (PendingDelivery, Parsed, tracing::Span);

enum SessionEnd {
    Shutdown,
    /// Lost with this error, leaving these deliveries unsettled.
    Lost(String, Vec<DeliverySummary>),
}

impl<H: Handler> Consumer<PerMessage<H>> {
    /// A consumer of `config.topology.queue` on the broker at `amqp_url`, with the inbox (and
    /// the handler's business tables) in `pool`, running `handler` once per message. On a
    /// cluster, `amqp_url` lists the nodes' URLs separated by commas: each (re)connect takes
    /// the first that accepts (see [`crate::broker::AmqpAddresses`]). Validates the configuration, with the message
    /// types the handler declares (a [`crate::Router`]'s, see
    /// [`ConsumerConfig::adopt_message_types`]). Run [`crate::migrate`] first.
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
    /// set-based business writes. Takes in the message types the handler declares (see
    /// [`ConsumerConfig::adopt_message_types`]).
    pub fn with_batch_handler(
        amqp_url: impl Into<String>,
        pool: PgPool,
        mut config: ConsumerConfig,
        handler: H,
    ) -> Result<Self, ConfigError> {
        // A router's types: unreachable routes fail here, a closed router's unknown types are
        // refused when a delivery is parsed.
        config.adopt_message_types(handler.message_types(), handler.refuses_other_types())?;
        config.validate()?;
        let processor = {
            let (pool, config) = (pool.clone(), config.clone());
            move |stats| -> Arc<dyn Process> {
                Arc::new(Processor::new(pool, Arc::new(handler), &config, stats))
            }
        };
        Self::build(amqp_url.into(), &pool, config, processor)
    }
}

impl<L: LeasedHandler> Consumer<Leased<L>> {
    /// A consumer in leased mode, for handlers whose work cannot live inside one database
    /// transaction (long work, external calls): each claim commits as PROCESSING under a lease
    /// that the consumer heartbeats while `handler` works, and completion commits only while
    /// the lease's fencing token is still the row's (see [`LeasedHandler`]).
    pub fn leased(
        amqp_url: impl Into<String>,
        pool: PgPool,
        config: ConsumerConfig,
        lease: LeaseConfig,
        handler: L,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        lease.validate()?;
        if config.ordering.is_some() {
            // Leased rows commit PROCESSING and complete later, outside the batch transaction
            // that decides a key's order: the two cannot be combined yet.
            return Err(ConfigError::InvalidSetting {
                name: "ordering",
                reason: "ordered processing needs the transactional mode; a leased consumer \
                         cannot keep per-key order: unset `ordering`, or use a transactional \
                         handler"
                    .into(),
            });
        }
        let processor = {
            let (pool, config) = (pool.clone(), config.clone());
            move |stats| -> Arc<dyn Process> {
                Arc::new(LeasedProcessor::new(pool, handler, &config, lease, stats))
            }
        };
        Self::build(amqp_url.into(), &pool, config, processor)
    }
}

impl<H> Consumer<H> {
    fn build(
        amqp_url: String,
        pool: &PgPool,
        config: ConsumerConfig,
        make_processor: impl FnOnce(Arc<ConsumerStats>) -> Arc<dyn Process>,
    ) -> Result<Self, ConfigError> {
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
        check_addresses(&amqp_url)?;
        let stats = Arc::new(ConsumerStats::new(&config.consumer_name, &config.telemetry));
        Ok(Self {
            amqp_url,
            processor: make_processor(stats.clone()),
            config,
            stats,
            health: Health::new(),
            #[cfg(feature = "fault-injection")]
            faults: Arc::default(),
            handler: PhantomData,
        })
    }

    /// Live counters.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        self.stats.clone()
    }

    /// The consumer's health for liveness and readiness probes: its broker session's state,
    /// and the tasks of a [`crate::Runner`] given it ([`crate::Runner::with_health`]).
    pub fn health(&self) -> Health {
        self.health.clone()
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
        telemetry::metrics::describe();
        let backoff = Backoff::new(
            self.config.reconnect_initial_delay,
            self.config.reconnect_max_delay,
        );
        // A session that lived through the longest back-off was healthy, as for the back-off.
        let mut losses = SessionLosses::new(self.config.reconnect_max_delay);
        let settings = session_settings(&self.config);
        loop {
            let opened = tokio::select! {
                biased;
                () = &mut shutdown => {
                    self.health.stopping();
                    return Ok(());
                }
                opened = Session::open(&self.amqp_url, &settings) => opened,
            };
            let delay = match opened {
                Ok(session) => {
                    self.stats.record_session();
                    self.health.consuming();
                    tracing::info!(queue = %self.config.topology.queue, consumer = %self.config.consumer_name, "consuming");
                    let began = Instant::now();
                    let SessionEnd::Lost(reason, unsettled) =
                        self.session(session, &mut shutdown).await
                    else {
                        return Ok(());
                    };
                    self.health.disconnected(Some(reason.clone()));
                    // A delivery the library cannot get past ends every session it reaches;
                    // the same error or the same unsettled delivery again says so.
                    let repeats = losses.lost(&reason, began.elapsed(), &unsettled);
                    self.stats.record_session_loss(&repeats);
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
                Err(e) if broker::is_fatal(&e) => {
                    self.health.disconnected(Some(e.to_string()));
                    return Err(e.into());
                }
                Err(e) => {
                    self.health.disconnected(Some(e.to_string()));
                    let delay = backoff.failed();
                    tracing::warn!(error = %e, retry_in = ?delay, "cannot open broker session");
                    delay
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => {
                    self.health.stopping();
                    return Ok(());
                }
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// One broker session: lanes spawned, deliveries taken in and sent to their lanes until
    /// shutdown or a loss, then the lanes drained.
    async fn session(
        &self,
        mut session: Session,
        shutdown: &mut std::pin::Pin<&mut (impl Future<Output = ()> + Send)>,
    ) -> SessionEnd {
        let mut lanes = self.spawn_lanes(&session);
        let settler = session.settler();
        let mut in_hand = InHand::new(self.config.prefetch);
        // `None`: shut down; else why the session was lost.
        let lost = loop {
            let next = tokio::select! {
                biased;
                () = shutdown.as_mut() => {
                    self.health.draining();
                    session.cancel().await;
                    break None;
                }
                () = lanes.broken.notified() => {
                    break Some("deliveries could not be settled".to_owned());
                }
                // A lane ends only when its channel closes, so an early end is a crash: its
                // deliveries are unsettled and would hold back every later multiple-ack.
                Some(ended) = lanes.tasks.join_next() => {
                    let reason = match ended {
                        Err(e) => format!("a lane failed: {e}"),
                        Ok(()) => "a lane stopped".to_owned(),
                    };
                    tracing::error!(%reason, "lane ended while consuming; reconnecting so its deliveries return");
                    break Some(reason);
                }
                next = session.next_delivery() => next,
            };
            let (pending, message) = match next {
                Some(Ok(delivery)) => delivery,
                Some(Err(e)) => break Some(e.to_string()),
                None => break Some("consumer cancelled or connection closed".to_owned()),
            };
            let parsed = self
                .receive(&pending, message, &settler, &mut in_hand)
                .await;
            // Injected: this delivery ends its session, as a connection error would.
            #[cfg(feature = "fault-injection")]
            if self.faults.should_drop_on_receipt(parsed.key()) {
                broker::drop_connection(&session.connection()).await;
            }
            if !lanes
                .send(pending, parsed, &self.config.consumer_name)
                .await
            {
                break Some("a lane stopped".to_owned());
            }
        };
        self.end_session(session, lanes, &settler, in_hand, lost)
            .await
    }

    /// Spawns the session's lanes, each with a bounded channel.
    fn spawn_lanes(&self, session: &Session) -> Lanes {
        let mut lanes = Lanes {
            tasks: JoinSet::new(),
            senders: Vec::with_capacity(self.config.lanes),
            broken: Arc::new(tokio::sync::Notify::new()),
            keys: Arc::new(KeysInFlight::default()),
            ordering: self.config.ordering.clone(),
        };
        for _ in 0..self.config.lanes {
            // Bounded: when lanes fall behind, the dispatcher waits, and prefetch stops the
            // broker from pushing more.
            let (tx, rx) = mpsc::channel::<Work>(self.config.batch_size);
            lanes.senders.push(tx);
            lanes.tasks.spawn(lane(
                rx,
                LaneContext {
                    processor: self.processor.clone(),
                    settler: session.settler(),
                    stats: self.stats.clone(),
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
                    broken: lanes.broken.clone(),
                    keys: lanes.keys.clone(),
                },
            ));
        }
        lanes
    }

    /// Takes a delivery in: registered with the settler, parsed, and noted in hand.
    async fn receive(
        &self,
        pending: &PendingDelivery,
        message: AmqpMessage,
        settler: &Settler,
        in_hand: &mut InHand,
    ) -> Parsed {
        self.stats.record_received(1);
        settler.register(pending).await;
        let message_id = message.message_id.clone();
        let body_bytes = message.body.len();
        let parsed = parse(message, pending, &self.config);
        let summary = DeliverySummary {
            inbox_key: parsed.envelope.message_id.clone(),
            message_id,
            delivery_tag: pending.tag(),
            redelivered: pending.redelivered(),
            message_type: parsed.envelope.message_type.clone(),
            header_bytes: pending.header_len(),
            body_bytes,
        };
        in_hand.insert(summary, settler).await;
        parsed
    }

    /// Drains the lanes (they finish what they hold and settle it) and says how the session
    /// ended: shut down, its connection closed; or lost, with the deliveries left unsettled.
    async fn end_session(
        &self,
        session: Session,
        lanes: Lanes,
        settler: &Settler,
        in_hand: InHand,
        lost: Option<String>,
    ) -> SessionEnd {
        let Lanes {
            mut tasks, senders, ..
        } = lanes;
        drop(senders);
        while let Some(joined) = tasks.join_next().await {
            if let Err(e) = joined {
                tracing::error!(error = %e, "lane task failed");
            }
        }
        let Some(reason) = lost else {
            session.close().await;
            self.health.disconnected(None);
            return SessionEnd::Shutdown;
        };
        // What the drain could not settle goes back to the broker, which hands it out again.
        let unsettled = settler.unsettled().await;
        SessionEnd::Lost(reason, in_hand.left_unsettled(&unsettled))
    }
}

/// The lanes of a session: their tasks, the channels that feed them, and what they share.
struct Lanes {
    tasks: JoinSet<()>,
    senders: Vec<mpsc::Sender<Work>>,
    /// A lane that cannot settle signals here: the channel is gone, and lapin does not always
    /// end the delivery stream after a close, so the dispatcher must not wait for it.
    broken: Arc<tokio::sync::Notify>,
    keys: Arc<KeysInFlight>,
    /// An ordered consumer's policy: its ordering key is the lane key.
    ordering: Option<OrderingPolicy>,
}

impl Lanes {
    /// The key that picks a delivery's lane: its ordering key when the consumer orders by
    /// one, else the aggregate id, else the dedup key.
    fn order_key<'p>(&self, parsed: &'p Parsed) -> &'p str {
        self.ordering
            .as_ref()
            .and_then(|o| o.key_of(&parsed.envelope).ok().flatten())
            .unwrap_or_else(|| parsed.envelope.lane_key())
    }

    /// Sends a delivery, with its span (open until it is settled), to its lane; `false` when
    /// that lane is gone.
    async fn send(&self, pending: PendingDelivery, parsed: Parsed, consumer: &str) -> bool {
        let span = telemetry::trace::delivery_span(consumer, &parsed.envelope);
        let lane = self.keys.route(parsed.key(), || {
            lane_of(self.order_key(&parsed), self.senders.len())
        });
        self.senders[lane]
            .send((pending, parsed, span))
            .await
            .is_ok()
    }
}

/// Deliveries received and perhaps not settled yet, to name those a lost session leaves
/// unsettled. Pruned against the settler: prefetch bounds the unsettled ones.
struct InHand {
    deliveries: HashMap<u64, DeliverySummary>,
    prune_above: usize,
    prune_at: usize,
}

impl InHand {
    fn new(prefetch: u16) -> Self {
        let prune_above = 2 * usize::from(prefetch).max(512);
        Self {
            deliveries: HashMap::new(),
            prune_above,
            prune_at: prune_above,
        }
    }

    async fn insert(&mut self, delivery: DeliverySummary, settler: &Settler) {
        if self.deliveries.len() >= self.prune_at {
            let unsettled = settler.unsettled().await;
            self.deliveries.retain(|tag, _| unsettled.contains(tag));
            // Amortised: many unsettled at once (lanes × batches) must not prune each time.
            self.prune_at = self.prune_above.max(2 * self.deliveries.len());
        }
        self.deliveries.insert(delivery.delivery_tag, delivery);
    }

    /// The deliveries among `unsettled`, by delivery tag.
    fn left_unsettled(self, unsettled: &BTreeSet<u64>) -> Vec<DeliverySummary> {
        let mut left: Vec<DeliverySummary> = self
            .deliveries
            .into_values()
            .filter(|d| unsettled.contains(&d.delivery_tag))
            .collect();
        left.sort_by_key(|d| d.delivery_tag);
        left
    }
}

/// What the broker side of a session needs of the configuration.
fn session_settings(config: &ConsumerConfig) -> SessionSettings<'_> {
    SessionSettings {
        consumer_name: &config.consumer_name,
        topology: &config.topology,
        retry: &config.retry,
        prefetch: config.prefetch,
        reconnect_initial_delay: config.reconnect_initial_delay,
        reconnect_max_delay: config.reconnect_max_delay,
    }
}

fn parse(message: AmqpMessage, pending: &PendingDelivery, config: &ConsumerConfig) -> Parsed {
    let mut parsed = Parsed::from(envelope::parse(message, &config.envelope));
    if let Some(detail) = pending.too_large_to_copy() {
        refuse_uncopyable(&mut parsed, detail);
    }
    // DEBUG: the WARN comes with its outcome ("message parked", within the consumer's log
    // budget), so a producer sending garbage cannot flood the log.
    if let Some(refusal) = &parsed.refusal {
        tracing::debug!(
            code = refusal.reason.code(),
            detail = %refusal.detail,
            inbox_key = %parsed.envelope.message_id,
            "invalid message; it will be recorded and parked"
        );
    }
    parsed
}

/// A delivery whose header leaves no room in a frame for a copy's `x-inbox-*` headers is
/// refused as `headers_too_large`, under the key it parsed to: a retry copy could not carry
/// its headers, and its parked copy goes without the largest of them. One already invalid for
/// another reason keeps that reason; its detail says this too.
fn refuse_uncopyable(parsed: &mut Parsed, detail: String) {
    match &mut parsed.refusal {
        None => {
            parsed.envelope.payload = serde_json::Value::Null;
            parsed.refusal = Some(Refusal {
                reason: InvalidReason::HeadersTooLarge,
                detail,
            });
        }
        Some(refusal) => refusal.detail = format!("{}; {detail}", refusal.detail),
    }
}

/// Lane of a delivery by its lane key: one aggregate (or ordering key) always maps to the
/// same lane, keeping its order.
fn lane_of(lane_key: &str, lanes: usize) -> usize {
    let mut h = DefaultHasher::new();
    lane_key.hash(&mut h);
    (h.finish() % lanes as u64) as usize
}

/// The lane of each key with a delivery unsettled in this session, and how many: a later
/// delivery of the key goes to that lane, whatever its own lane key says (an invalid copy has
/// no aggregate id, a producer may change it), so that one lane sees every copy of a key in
/// delivery order.
#[derive(Default)]
struct KeysInFlight(Mutex<HashMap<String, (usize, u32)>>);

impl KeysInFlight {
    /// The lane for a delivery of `key`: the lane of its unsettled copies, else `own`.
    fn route(&self, key: &str, own: impl FnOnce() -> usize) -> usize {
        let mut keys = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((lane, n)) = keys.get_mut(key) {
            *n += 1;
            return *lane;
        }
        let lane = own();
        keys.insert(key.to_owned(), (lane, 1));
        lane
    }

    /// Deliveries of `key` dispatched and not settled yet.
    fn count(&self, key: &str) -> u32 {
        let keys = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        keys.get(key).map_or(0, |(_, n)| *n)
    }

    /// The deliveries of these keys are settled (or given back to the broker).
    fn settled<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        for key in keys {
            if let Some((_, n)) = map.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    map.remove(key);
                }
            }
        }
    }
}

/// Keys of a lane whose delivery went back to the queue unrecorded (an outage), with how many
/// later copies of the key this session had received by then. Those copies go back too, so
/// that the broker hands them out again after the first: otherwise a later copy (an invalid
/// one, say) would be recorded while the first waits in the queue, and take its row.
#[derive(Default)]
struct RequeuedKeys(HashMap<String, usize>);

impl RequeuedKeys {
    /// Splits off the deliveries that follow a requeued copy of their key.
    fn take_following(&mut self, batch: Vec<Work>) -> (Vec<Work>, Vec<Work>) {
        if self.0.is_empty() {
            return (batch, Vec::new());
        }
        batch.into_iter().partition(|(_, parsed, _)| {
            let key = parsed.key();
            match self.0.get_mut(key) {
                Some(n) => {
                    *n -= 1;
                    if *n == 0 {
                        self.0.remove(key);
                    }
                    false
                }
                None => true,
            }
        })
    }

    /// Notes the keys `outcomes` requeue and how many of their copies are in flight behind.
    fn note(&mut self, parsed: &[Parsed], outcomes: &[Outcome], keys: &KeysInFlight) {
        for (item, outcome) in parsed.iter().zip(outcomes) {
            if matches!(outcome, Outcome::Unrecorded { .. }) {
                let key = item.key();
                let behind = keys.count(key).saturating_sub(1) as usize;
                if behind > 0 {
                    *self.0.entry(key.to_owned()).or_default() += behind;
                }
            }
        }
    }
}

/// Splits a batch into the first delivery of each key and the later ones, both in delivery
/// order. The later ones wait for the next batch, after this one's settlement.
fn first_copies(batch: Vec<Work>) -> (Vec<Work>, Vec<Work>) {
    let mut seen = HashSet::with_capacity(batch.len());
    batch
        .into_iter()
        .partition(|(_, parsed, _)| seen.insert(parsed.key().to_owned()))
}

struct LaneContext {
    processor: Arc<dyn Process>,
    settler: Arc<Settler>,
    stats: Arc<ConsumerStats>,
    batch_size: usize,
    max_batch_delay: Duration,
    backoff: (Duration, Duration),
    #[cfg(feature = "fault-injection")]
    faults: Arc<crate::fault::FaultPlan>,
    #[cfg(feature = "fault-injection")]
    connection: Arc<broker::ConnectionHandle>,
    broken: Arc<tokio::sync::Notify>,
    keys: Arc<KeysInFlight>,
}

/// A lane: takes batches off its channel, processes each in one go, settles it.
async fn lane(mut rx: mpsc::Receiver<Work>, ctx: LaneContext) {
    let unrecorded = Backoff::new(ctx.backoff.0, ctx.backoff.1);
    let mut db = ctx.processor.lane_connection();
    // Later copies of a key held back from the last batch: they go first in the next one.
    let mut held: Vec<Work> = Vec::new();
    let mut requeued = RequeuedKeys::default();
    loop {
        let Some(batch) = next_batch(&mut rx, std::mem::take(&mut held), &ctx).await else {
            break;
        };
        let (batch, later) = first_copies(batch);
        held = later;
        let (batch, following) = requeued.take_following(batch);
        let done = process(batch, following, &ctx, &mut db, &mut requeued).await;

        // Injected crash between commit and ack: the connection goes, nothing is settled.
        #[cfg(feature = "fault-injection")]
        let crashed = ctx
            .faults
            .should_drop_after_commit(&done.parsed, &done.outcomes);
        #[cfg(feature = "fault-injection")]
        if crashed {
            broker::drop_connection(&ctx.connection).await;
        }
        #[cfg(not(feature = "fault-injection"))]
        let crashed = false;

        back_off_if_unrecorded(&done.outcomes, &unrecorded).await;
        settle(done, crashed, &ctx, &mut db).await;
    }
}

/// The next batch: the copies `held` back, topped up with what the channel has now; else up
/// to `batch_size` deliveries arriving within `max_batch_delay` of the first. `None` once the
/// channel is closed and empty.
async fn next_batch(
    rx: &mut mpsc::Receiver<Work>,
    held: Vec<Work>,
    ctx: &LaneContext,
) -> Option<Vec<Work>> {
    let mut batch = if held.is_empty() {
        vec![rx.recv().await?]
    } else {
        held
    };
    if batch.len() == 1 {
        let deadline = Instant::now() + ctx.max_batch_delay;
        while batch.len() < ctx.batch_size {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(work)) => batch.push(work),
                Ok(None) | Err(_) => break,
            }
        }
    } else {
        // Held copies are old already: take what is there, without waiting.
        while batch.len() < ctx.batch_size {
            match rx.try_recv() {
                Ok(work) => batch.push(work),
                Err(_) => break,
            }
        }
    }
    Some(batch)
}

/// A lane's batch once processed: its deliveries, their spans and outcomes, in order.
struct Processed {
    pendings: Vec<PendingDelivery>,
    parsed: Vec<Parsed>,
    spans: Vec<tracing::Span>,
    outcomes: Vec<Outcome>,
}

impl Processed {
    fn push(&mut self, (pending, parsed, span): Work) {
        self.pendings.push(pending);
        self.parsed.push(parsed);
        self.spans.push(span);
    }
}

/// Processes `batch`; the copies `following` a requeued one go back unrecorded behind it.
async fn process(
    batch: Vec<Work>,
    following: Vec<Work>,
    ctx: &LaneContext,
    db: &mut LaneConnection,
    requeued: &mut RequeuedKeys,
) -> Processed {
    let n = batch.len() + following.len();
    let mut done = Processed {
        pendings: Vec::with_capacity(n),
        parsed: Vec::with_capacity(n),
        spans: Vec::with_capacity(n),
        outcomes: Vec::new(),
    };
    for work in batch {
        done.push(work);
    }
    done.outcomes = ctx.processor.process_batch(&done.parsed, db).await;
    requeued.note(&done.parsed, &done.outcomes, &ctx.keys);
    for work in following {
        done.push(work);
        done.outcomes.push(Outcome::Unrecorded {
            error: "an earlier delivery of this message was requeued; this copy follows it".into(),
        });
    }
    done
}

/// Nothing durable was written for an unrecorded outcome: its batch is held for a back-off
/// before it goes back to the queue, so an outage does not become a hot redelivery loop.
async fn back_off_if_unrecorded(outcomes: &[Outcome], unrecorded: &Backoff) {
    if let Some(error) = outcomes.iter().find_map(|o| match o {
        Outcome::Unrecorded { error } => Some(error),
        _ => None,
    }) {
        let delay = unrecorded.failed();
        tracing::warn!(retry_in = ?delay, %error, "outcomes could not be recorded; requeueing after back-off");
        tokio::time::sleep(delay).await;
    } else {
        unrecorded.succeeded();
    }
}

/// Settles a processed batch with the broker (nothing of it after an injected crash), with
/// its confirmed copies noted on their rows; then lets go of its copy locks, its keys and its
/// spans.
async fn settle(done: Processed, crashed: bool, ctx: &LaneContext, db: &mut LaneConnection) {
    let Processed {
        pendings,
        parsed,
        spans,
        outcomes,
    } = done;
    // After the back-off: commit-to-ack measures the broker's side only.
    let committed = Instant::now();
    let envelopes: Vec<&Envelope> = parsed.iter().map(|p| &p.envelope).collect();
    ctx.stats.record_outcomes(&outcomes, &envelopes);
    for (span, outcome) in spans.iter().zip(&outcomes) {
        telemetry::trace::record_outcome(span, outcome);
    }
    let unsettled = if crashed {
        // Nothing of this batch is settled, as in a crash.
        ctx.stats.record_settle_failures(outcomes.len() as u64);
        outcomes.len()
    } else {
        let batch = pendings
            .into_iter()
            .zip(&outcomes)
            .zip(envelopes)
            .map(|((pending, outcome), envelope)| (pending, outcome, envelope))
            .collect();
        let (store, consumer) = ctx.processor.store();
        let unsettled = ctx
            .settler
            .settle_batch(batch, &ctx.stats, async |copies| {
                // Injected database restart between the copies' confirm and their note.
                #[cfg(feature = "fault-injection")]
                if ctx.faults.should_end_session_before_note(&copies) {
                    db.end_session().await;
                }
                db.note_confirmed_copies(store, consumer, &copies).await;
            })
            .await;
        metrics::histogram!(telemetry::metrics::COMMIT_TO_ACK, "consumer" => ctx.stats.consumer_label().clone())
            .record(committed.elapsed().as_secs_f64());
        unsettled
    };
    // Settled: the copies are noted, so later deliveries of these keys may read the rows.
    db.release_copy_locks().await;
    ctx.keys.settled(parsed.iter().map(Parsed::key));
    ctx.processor.flush_failure_log();
    // The deliveries' spans end here, at their settlement.
    drop(spans);
    if unsettled > 0 {
        tracing::warn!(
            unsettled,
            batch = outcomes.len(),
            "deliveries not settled (channel closed?); the broker will redeliver them and the inbox will recognise them"
        );
        ctx.broken.notify_one();
    }
}
