//! `inbox-lab chaos --ordered`: per-key order under the same faults. The consumers order each
//! order's messages by `x-sequence` (`consume --ordered`, with the release task beside the
//! consumer); the stream is each order's `OrderStep`s 1..n, interleaved across orders and
//! published in each order's sequence. Some steps fail until a retry returns them, some are
//! refused (parked, blocking their order) and, during the run, fixed and redriven, or skipped,
//! by the run's operator, while consumers are SIGKILLed, connections dropped and PostgreSQL
//! restarted. Then the order service's journal must show every order's steps applied once
//! each, in their order, but for the skipped ones (exactly the audited skips), with nothing
//! held or blocked left.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::Context;
use inbox_ops::{
    Actor, NoProgress, Operations,
    ordering::SKIP_HEAD,
    redrive::{REDRIVE, RedriveRequest},
    reopen::REOPEN,
};
use rabbit_inbox::{
    ConsumerConfig, InboxStatus, SchemaName,
    broker::{Broker, QueueDepths},
    ledger_sql::tables,
};
use rand::{SeedableRng, rngs::StdRng};
use sqlx::{AssertSqlSafe, Row};

use super::{
    ChaosArgs, ConsumerCommand, Deliveries, Fault, Figures, Fleet, ParkingLot, Shaken, isolate,
    read_ledger, schedule,
};
use crate::{
    Servers, clean_slate, publish_all,
    scenario::{OrderedStream, Step, published_copies},
};

/// How long a refused step stays parked (its order blocked, the order's later steps held)
/// before the run's operator clears its fault and redrives it, or skips it.
const REDRIVE_AFTER: Duration = Duration::from_secs(3);

/// How often the operator looks for refused steps to redrive or skip.
const OPERATOR_EVERY: Duration = Duration::from_secs(1);

/// Orders named per failed check of the journal.
const SHOWN: usize = 5;

/// How long the inbox and the queues may stay as they are, every fault run, before the run
/// stops waiting for them to settle: three release timeouts, so a held row whose released copy
/// was lost is published again twice meanwhile.
const STUCK_AFTER: Duration = Duration::from_secs(90);

/// Error code of a step failing until retried (`order_step_faults`: `retry_once`).
const STEP_NOT_READY: &str = "step_not_ready";

/// Error code of a refused step (`order_step_faults`: `refuse`).
const STEP_REFUSED: &str = "step_refused";

/// The statuses of a parked row, as SQL literals.
const PARKED: &str = "'PERMANENT_FAILED', 'POISONED', 'MANUAL_REVIEW'";

/// The ordered run; exit code 1 on a violation of the verdict.
pub(super) async fn run(
    servers: &Servers,
    args: ChaosArgs,
    consumer: &ConsumerCommand,
) -> anyhow::Result<ExitCode> {
    let (servers, drop_connections) = &isolate(servers, &args, None).await?;
    let schema = SchemaName::new(&args.schema)?;
    let exchange = format!("{}.orders", args.queue);
    let mut config = order_service::config(schema.clone(), &args.queue, &exchange);
    config.ordering = Some(order_service::ordering());
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc4a0_5eed);
    let plan = schedule(
        &[
            (args.kills, Fault::KillConsumer),
            (args.connection_drops, Fault::DropConnections),
            (args.postgres_restarts, Fault::RestartPostgres),
        ],
        &mut rng,
    );
    println!(
        "rabbit-inbox chaos, ordered: seed {seed}, {} consumers, {} kills, {} connection drops, \
         {} PostgreSQL restarts",
        args.consumers, args.kills, args.connection_drops, args.postgres_restarts
    );
    println!(
        "replay with: inbox-lab chaos --ordered --messages {} --steps {} --seed {seed}",
        args.messages, args.steps
    );
    let (pool, stream) = publish_stream(servers, &config, &args, seed).await?;
    let log_dir = std::env::temp_dir().join(format!("inbox-chaos-ordered-{seed:016x}"));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    println!("consumer logs in {}", log_dir.display());
    let mut fleet = Fleet {
        servers,
        quorum: false,
        args: &args,
        consumer,
        exchange,
        events_exchange: format!("{}.events", args.queue),
        log_dir,
        instances: Vec::new(),
        started: 0,
    };
    let mut operator = Operator::new(&pool, &schema, &servers.amqp_url, &config, &stream);
    let run = Run {
        pool: &pool,
        servers,
        config: &config,
        unique: stream.unique_keys() as i64,
        skipped: stream.skipped.len() as i64,
        plan,
        drop_connections,
    };
    let watched = run.watch(&mut fleet, &mut operator, &mut rng).await?;
    let stop_problems = fleet.stop().await;
    let verdict = Verdict::read(&run, &stream).await?;
    let ok = verdict.report(
        &stream,
        &watched,
        &stop_problems,
        &operator,
        &args,
        run.plan.len(),
    );
    if ok {
        // Logs are kept only when there is something to look into.
        let _ = std::fs::remove_dir_all(&fleet.log_dir);
        println!("chaos --ordered: OK (seed {seed})");
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "chaos --ordered: FAILED; replay with --seed {seed}; inspect schema {schema}, \
             consumer logs in {}",
            fleet.log_dir.display()
        );
        Ok(ExitCode::FAILURE)
    }
}

/// A clean slate for the run, and its stream generated, its faults set up and published.
async fn publish_stream(
    servers: &Servers,
    config: &ConsumerConfig,
    args: &ChaosArgs,
    seed: u64,
) -> anyhow::Result<(sqlx::PgPool, OrderedStream)> {
    let (pool, broker) = clean_slate(servers, config).await?;
    let steps = usize::try_from(args.steps).context("--steps")?;
    let stream = OrderedStream::generate(args.messages.div_ceil(steps).max(1), args.steps, seed);
    set_faults(&pool, &config.schema, &stream).await?;
    let exchange = config.topology.exchange.as_deref().unwrap_or_default();
    publish_all(&broker, exchange, &stream.messages).await?;
    broker.close().await;
    println!(
        "published {} messages: {} orders of {} steps in x-sequence order, {} exact duplicates; \
         {} steps fail until retried, {} are refused until redriven, {} refused and skipped",
        stream.messages.len(),
        stream.orders.len(),
        stream.steps,
        stream.duplicates,
        stream.retried.len(),
        stream.redriven.len(),
        stream.skipped.len()
    );
    Ok((pool, stream))
}

/// Sets up the failures the stream's steps are to meet, before anything is published.
async fn set_faults(
    pool: &sqlx::PgPool,
    schema: &SchemaName,
    stream: &OrderedStream,
) -> anyhow::Result<()> {
    let faults = stream
        .retried
        .iter()
        .map(|s| (s, order_service::StepFault::RetryOnce))
        .chain(
            stream
                .redriven
                .iter()
                .chain(&stream.skipped)
                .map(|s| (s, order_service::StepFault::Refuse)),
        );
    for (step, fault) in faults {
        order_service::set_step_fault(pool, schema, &step.order_id, step.step, fault)
            .await
            .context("setting up the steps' faults")?;
    }
    Ok(())
}

/// What the run works on while it watches the consumers.
struct Run<'a> {
    pool: &'a sqlx::PgPool,
    servers: &'a Servers,
    config: &'a ConsumerConfig,
    /// Distinct messages of the stream.
    unique: i64,
    /// Of which skipped: parked for good.
    skipped: i64,
    plan: Vec<(f64, Fault)>,
    drop_connections: &'a str,
}

/// How the watch ended.
#[derive(Default)]
struct Watched {
    settled: bool,
    elapsed: Duration,
    figures: Figures,
    /// Faults of the schedule that ran.
    faults_run: usize,
    faults_failed: Vec<String>,
    /// The most HELD rows seen at once.
    peak_held: i64,
    /// Nothing changed for [`STUCK_AFTER`] before it settled.
    stuck: bool,
}

impl Run<'_> {
    /// Runs the fault schedule and the operator until every step is processed, nothing is
    /// held, blocked or queued and every fault has run, or until the deadline.
    async fn watch(
        &self,
        fleet: &mut Fleet<'_>,
        operator: &mut Operator<'_>,
        rng: &mut StdRng,
    ) -> anyhow::Result<Watched> {
        let mut w = Watched::default();
        let mut started_at = Vec::new();
        for _ in 0..fleet.args.consumers {
            let instance = fleet.spawn()?;
            fleet.instances.push(instance);
            started_at.push(Instant::now());
        }
        let began = Instant::now();
        let deadline = began + Duration::from_secs(fleet.args.timeout_secs);
        let mut last_line = Instant::now();
        let mut last_change = (Tally::default(), Instant::now());
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            fleet.reap(&mut w.figures, &mut started_at)?;
            operator.act().await;
            let Some((tally, depths)) = self.progress().await else {
                if Instant::now() > deadline {
                    break;
                }
                continue;
            };
            w.peak_held = w.peak_held.max(tally.held);
            let done = tally.processed as f64 / self.unique as f64;
            let mut acted = false;
            while w.faults_run < self.plan.len() && self.plan[w.faults_run].0 <= done {
                let fault = self.plan[w.faults_run].1;
                w.faults_run += 1;
                acted = true;
                let mut shaken = Shaken {
                    figures: &mut w.figures,
                    cluster: None,
                    rng: &mut *rng,
                    started_at: &mut started_at,
                };
                if let Err(e) = fleet
                    .inflict(fault, &mut shaken, self.drop_connections)
                    .await
                {
                    w.faults_failed.push(format!("{fault:?}: {e:#}"));
                }
            }
            if last_line.elapsed() >= Duration::from_secs(2) {
                tally.show(began, &depths, &w.figures);
                last_line = Instant::now();
            }
            let (processed, parked) = (self.unique - self.skipped, self.skipped);
            let all_run = !acted && w.faults_run == self.plan.len();
            if all_run && tally.settled(processed, parked, &depths) {
                w.settled = true;
                break;
            }
            if tally != last_change.0 || depths.work + depths.retry > 0 || !all_run {
                last_change = (tally, Instant::now());
            } else if last_change.1.elapsed() > STUCK_AFTER {
                w.stuck = true;
                break;
            }
            if Instant::now() > deadline {
                break;
            }
        }
        w.elapsed = began.elapsed();
        Ok(w)
    }

    /// The inbox's counts and the queues' depths; `None` while a server is unreachable.
    async fn progress(&self) -> Option<(Tally, QueueDepths)> {
        let tally = Tally::read(self.pool, &self.config.schema).await.ok()?;
        // A short-lived connection: the fault schedule closes every connection of the run.
        let broker = Broker::connect(&self.servers.amqp_url, "inbox-lab chaos")
            .await
            .ok()?;
        let depths = broker
            .queue_depths(&self.config.topology, &self.config.retry)
            .await
            .ok();
        broker.close().await;
        Some((tally, depths?))
    }
}

/// The ordered consumer's inbox, counted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Tally {
    processed: i64,
    held: i64,
    parked: i64,
    retryable: i64,
    processing: i64,
    /// Rows the release task published again (their `released_at` is kept once processed).
    released: i64,
    /// Keys whose head (a failed or parked message) blocks them.
    blocked_keys: i64,
    /// Keys whose sequence gap outlived its timeout.
    gaps_reported: i64,
}

impl Tally {
    async fn read(pool: &sqlx::PgPool, schema: &SchemaName) -> Result<Self, sqlx::Error> {
        let t = schema.qualify(tables::MESSAGE_INBOX);
        let k = schema.qualify(tables::INBOX_ORDER_KEY);
        let status = |s: InboxStatus| format!("'{}'", s.as_str());
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT \
               count(*) FILTER (WHERE status = {processed}) AS processed, \
               count(*) FILTER (WHERE status = {held}) AS held, \
               count(*) FILTER (WHERE status IN ({PARKED})) AS parked, \
               count(*) FILTER (WHERE status = {retryable}) AS retryable, \
               count(*) FILTER (WHERE status = {processing}) AS processing, \
               count(*) FILTER (WHERE released_at IS NOT NULL) AS released, \
               (SELECT count(*) FROM {k} WHERE consumer_name = $1 \
                  AND head_message_id IS NOT NULL) AS blocked_keys, \
               (SELECT count(*) FROM {k} WHERE consumer_name = $1 \
                  AND gap_reported_at IS NOT NULL) AS gaps_reported \
             FROM {t} WHERE consumer_name = $1",
            processed = status(InboxStatus::Processed),
            held = status(InboxStatus::Held),
            retryable = status(InboxStatus::RetryableFailed),
            processing = status(InboxStatus::Processing),
        )))
        .bind(order_service::CONSUMER_NAME)
        .fetch_one(pool)
        .await?;
        Ok(Self {
            processed: row.try_get("processed")?,
            held: row.try_get("held")?,
            parked: row.try_get("parked")?,
            retryable: row.try_get("retryable")?,
            processing: row.try_get("processing")?,
            released: row.try_get("released")?,
            blocked_keys: row.try_get("blocked_keys")?,
            gaps_reported: row.try_get("gaps_reported")?,
        })
    }

    /// `processed` steps processed and `parked` parked (the skipped ones), nothing held,
    /// blocked, retrying or queued.
    fn settled(&self, processed: i64, parked: i64, depths: &QueueDepths) -> bool {
        self.processed == processed
            && self.held == 0
            && self.parked == parked
            && self.retryable == 0
            && self.processing == 0
            && self.blocked_keys == 0
            && depths.work == 0
            && depths.retry == 0
    }

    fn show(&self, began: Instant, depths: &QueueDepths, figures: &Figures) {
        eprintln!(
            "  {:>5.1} s: {:>6} processed, {:>4} held, {:>3} parked, {:>3} waiting to retry, \
             {:>3} blocked keys, queue {:>6}, {} kills, {} drops, {} pg restarts",
            began.elapsed().as_secs_f64(),
            self.processed,
            self.held,
            self.parked,
            self.retryable,
            self.blocked_keys,
            depths.work,
            figures.kills,
            figures.connection_drops,
            figures.postgres_restarts
        );
    }
}

/// The run's operator: finds the refused steps once they have been parked a while, and
/// either makes the fix (clears their fault) and redrives them, as a person would with
/// `inboxctl redrive`, or lets their order go on without them (`inboxctl ordering skip`).
struct Operator<'a> {
    pool: &'a sqlx::PgPool,
    schema: &'a SchemaName,
    amqp_url: &'a str,
    config: &'a ConsumerConfig,
    /// The refused steps to redrive, by message id.
    to_redrive: HashMap<&'a str, &'a Step>,
    /// The refused steps to skip, by message id.
    to_skip: HashMap<&'a str, &'a Step>,
    ops: Operations,
    last: Option<Instant>,
    /// Refused steps of a redrive that failed, not PROCESSED yet: redriven again, as a
    /// redrive a fault cut short may leave a reopened row's copy in the parking lot.
    pending: HashSet<String>,
    /// Redrives run.
    rounds: usize,
    /// Heads skipped.
    skips: usize,
    /// Redrives and skips a fault cut short (tried again at the next round).
    failed: Vec<String>,
    /// Refused steps found parked without being their order's head.
    not_heads: HashSet<String>,
    /// Parked rows that are not refused steps, with their error code.
    unexpected: BTreeMap<String, String>,
}

/// One parked row the operator looks at.
struct Parked {
    message_id: String,
    /// Parked (not reopened by a redrive that failed).
    parked: bool,
    /// Its order's head.
    is_head: bool,
    /// A skip of it is audited.
    skipped: bool,
    /// Status and last error code, as shown.
    shown: String,
}

impl<'a> Operator<'a> {
    fn new(
        pool: &'a sqlx::PgPool,
        schema: &'a SchemaName,
        amqp_url: &'a str,
        config: &'a ConsumerConfig,
        stream: &'a OrderedStream,
    ) -> Self {
        let by_id = |steps: &'a [Step]| steps.iter().map(|s| (s.message_id.as_str(), s)).collect();
        Self {
            pool,
            schema,
            amqp_url,
            config,
            to_redrive: by_id(&stream.redriven),
            to_skip: by_id(&stream.skipped),
            ops: Operations::new(pool.clone(), schema.clone())
                .with_sequence_header(order_service::SEQUENCE_HEADER),
            last: None,
            pending: HashSet::new(),
            rounds: 0,
            skips: 0,
            failed: Vec::new(),
            not_heads: HashSet::new(),
            unexpected: BTreeMap::new(),
        }
    }

    /// A round every [`OPERATOR_EVERY`]; what a fault cuts short is noted and tried again.
    async fn act(&mut self) {
        if self.last.is_some_and(|t| t.elapsed() < OPERATOR_EVERY) {
            return;
        }
        self.last = Some(Instant::now());
        if let Err(e) = self.round().await {
            self.failed.push(format!("{e:#}"));
        }
    }

    async fn round(&mut self) -> anyhow::Result<()> {
        let mut due = Vec::new();
        for row in self.parked().await? {
            if let Some(step) = self.to_redrive.get(row.message_id.as_str()) {
                if row.parked && !row.is_head {
                    self.not_heads.insert(row.message_id.clone());
                }
                order_service::clear_step_fault(self.pool, self.schema, &step.order_id, step.step)
                    .await?;
                due.push(row.message_id);
            } else if let Some(step) = self.to_skip.get(row.message_id.as_str()) {
                if row.skipped {
                    continue;
                }
                if !row.is_head {
                    self.not_heads.insert(row.message_id.clone());
                    continue;
                }
                if let Err(e) = self.skip(step).await {
                    self.failed.push(format!("{e:#}"));
                }
            } else {
                self.unexpected.insert(row.message_id, row.shown);
            }
        }
        if due.is_empty() {
            return Ok(());
        }
        let redriven = self.redrive(due.clone()).await;
        // A redrive that failed may have reopened a row without moving its copy: the row is
        // no longer parked, so it is named until a redrive of it succeeds.
        self.pending = match redriven {
            Ok(()) => HashSet::new(),
            Err(_) => due.into_iter().collect(),
        };
        redriven
    }

    /// The rows parked for [`REDRIVE_AFTER`] at least, and those of a redrive that failed
    /// that are not PROCESSED yet.
    async fn parked(&self) -> anyhow::Result<Vec<Parked>> {
        let t = self.schema.qualify(tables::MESSAGE_INBOX);
        let k = self.schema.qualify(tables::INBOX_ORDER_KEY);
        let a = self.schema.qualify("inbox_audit");
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT m.message_id, m.status, m.last_error_code, m.status IN ({PARKED}) AS parked, \
               EXISTS (SELECT 1 FROM {k} k WHERE k.consumer_name = $1 \
                 AND k.head_message_id = m.message_id) AS is_head, \
               EXISTS (SELECT 1 FROM {a} a WHERE a.consumer_name = $1 \
                 AND a.message_id = m.message_id AND a.action = $4) AS skipped \
             FROM {t} m \
             WHERE m.consumer_name = $1 AND ( \
               (m.status IN ({PARKED}) AND m.last_failed_at < now() - make_interval(secs => $2)) \
               OR (m.message_id = ANY($3) AND m.status <> '{processed}'))",
            processed = InboxStatus::Processed.as_str()
        )))
        .bind(order_service::CONSUMER_NAME)
        .bind(REDRIVE_AFTER.as_secs_f64())
        .bind(self.pending.iter().cloned().collect::<Vec<_>>())
        .bind(SKIP_HEAD)
        .fetch_all(self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                let status: String = row.try_get("status")?;
                let code: Option<String> = row.try_get("last_error_code")?;
                Ok(Parked {
                    message_id: row.try_get("message_id")?,
                    parked: row.try_get("parked")?,
                    is_head: row.try_get("is_head")?,
                    skipped: row.try_get("skipped")?,
                    shown: format!("{status} {}", code.unwrap_or_default()),
                })
            })
            .collect()
    }

    async fn redrive(&mut self, message_ids: Vec<String>) -> anyhow::Result<()> {
        let topology = &self.config.topology;
        let lot = rabbit_inbox::broker::ParkingLot::connect(
            self.amqp_url,
            &topology.queue,
            &topology.parking_queue,
        )
        .await?;
        let request = RedriveRequest {
            consumer: Some(order_service::CONSUMER_NAME.to_owned()),
            message_ids,
            ..Default::default()
        };
        let actor = Actor::new("inbox-lab chaos", "the refused step's fault is cleared")?;
        let redriven = self
            .ops
            .redrive(&lot, &request, Some(&actor), &NoProgress)
            .await;
        lot.close().await;
        redriven?;
        self.rounds += 1;
        Ok(())
    }

    /// Lets the refused step's order go on without it; the step stays parked.
    async fn skip(&mut self, step: &Step) -> anyhow::Result<()> {
        let actor = Actor::new(
            "inbox-lab chaos",
            "the order goes on without its refused step",
        )?;
        self.ops
            .skip_head(
                &actor,
                order_service::CONSUMER_NAME,
                &step.order_id,
                Some(&step.message_id),
            )
            .await?;
        self.skips += 1;
        Ok(())
    }
}

/// The journal of the order service against the stream.
#[derive(Debug, Default)]
struct Journal {
    rows: usize,
    /// Orders whose steps were applied out of their order, with the numbers as applied.
    out_of_order: Vec<String>,
    /// Steps applied more than once (one count per extra application).
    applied_twice: usize,
    /// Steps never applied: (order, step).
    missing: Vec<(String, i64)>,
    /// Rows for no step of the stream.
    unknown: usize,
}

impl Journal {
    /// Every order's journaled numbers in commit order (the serials of one order follow its
    /// commits: an ordered consumer applies an order's steps one at a time, under its key's
    /// lock).
    async fn read(
        pool: &sqlx::PgPool,
        schema: &SchemaName,
        stream: &OrderedStream,
    ) -> anyhow::Result<Self> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT aggregate_id, sequence_number FROM {} ORDER BY aggregate_id, serial",
            schema.qualify("order_journal")
        )))
        .fetch_all(pool)
        .await
        .context("reading the order journal")?;
        let mut applied: HashMap<String, Vec<i64>> = HashMap::new();
        for row in &rows {
            applied
                .entry(row.try_get("aggregate_id")?)
                .or_default()
                .push(row.try_get("sequence_number")?);
        }
        let mut j = Journal {
            rows: rows.len(),
            ..Default::default()
        };
        for order in &stream.orders {
            let numbers = applied.remove(order).unwrap_or_default();
            j.judge(order, &numbers, stream.steps);
        }
        j.unknown += applied.values().map(Vec::len).sum::<usize>();
        Ok(j)
    }

    /// Judges one order of `steps` steps by the numbers journaled for it, in commit order:
    /// they must be 1..=`steps`, each once, increasing (a skipped step is missing).
    fn judge(&mut self, order: &str, numbers: &[i64], steps: i64) {
        if !numbers.windows(2).all(|w| w[0] < w[1]) {
            self.out_of_order.push(format!("{order}: {numbers:?}"));
        }
        let distinct: HashSet<i64> = numbers.iter().copied().collect();
        self.applied_twice += numbers.len() - distinct.len();
        self.unknown += distinct
            .iter()
            .filter(|n| !(1..=steps).contains(*n))
            .count();
        self.missing.extend(
            (1..=steps)
                .filter(|n| !distinct.contains(n))
                .map(|n| (order.to_owned(), n)),
        );
    }
}

/// The state after the run, from the database and the broker, every consumer stopped.
struct Verdict {
    tally: Tally,
    depths: QueueDepths,
    parking_copies: usize,
    parking_problems: Vec<String>,
    deliveries: Deliveries,
    journal: Journal,
    /// Message ids with a recorded failure, by error code.
    failed: HashMap<String, HashSet<String>>,
    /// Message ids whose row a redrive reopened.
    redriven: HashSet<String>,
    /// Message ids skipped as their key's head (audited `skip_head`).
    skipped: HashSet<String>,
    /// Inbox keys of the parking lot's copies, payload conflicts apart, with their copies.
    parked_copies: HashMap<String, usize>,
    /// Rows not PROCESSED (the first few), with their status and last error code.
    left: Vec<(String, String)>,
}

impl Verdict {
    async fn read(run: &Run<'_>, stream: &OrderedStream) -> anyhow::Result<Self> {
        let (pool, config) = (run.pool, run.config);
        let schema = &config.schema;
        let tally = Tally::read(pool, schema)
            .await
            .context("counting the inbox")?;
        let broker = crate::connect::rabbitmq(&run.servers.amqp_url).await?;
        let depths = broker.queue_depths(&config.topology, &config.retry).await?;
        broker.close().await;
        let parking = ParkingLot::read(&run.servers.amqp_url, &config.topology).await?;
        let check = parking.check(pool, schema, &[]).await?;
        let ledger = read_ledger(pool, schema).await?;
        let published = published_copies(&stream.messages, &config.envelope);
        let mut parking_problems = check.problems;
        if check.without_reason > 0 {
            parking_problems.push(format!(
                "{} copies in the parking lot without a reason",
                check.without_reason
            ));
        }
        Ok(Self {
            tally,
            depths,
            parking_copies: parking.copies.len(),
            parking_problems,
            deliveries: Deliveries::count(&published, &ledger, &parking.copies_by_key()),
            journal: Journal::read(pool, schema, stream).await?,
            failed: failures(pool, schema).await?,
            redriven: audited(pool, schema, REOPEN, Some(REDRIVE)).await?,
            skipped: audited(pool, schema, SKIP_HEAD, None).await?,
            parked_copies: parking.copies_by_key(),
            left: left_over(pool, schema).await?,
        })
    }
}

/// The message ids of `steps`.
fn ids(steps: &[Step]) -> HashSet<&str> {
    steps.iter().map(|s| s.message_id.as_str()).collect()
}

impl Verdict {
    /// The ids with a failure recorded under `code`.
    fn failed_with(&self, code: &str) -> HashSet<&str> {
        self.failed
            .get(code)
            .map(|ids| ids.iter().map(String::as_str).collect())
            .unwrap_or_default()
    }

    /// Failures other than the stream's, by code.
    fn unplanned_failures(&self) -> Vec<(String, usize)> {
        let mut other: Vec<(String, usize)> = self
            .failed
            .iter()
            .filter(|(code, _)| !matches!(code.as_str(), STEP_NOT_READY | STEP_REFUSED))
            .map(|(code, ids)| (code.clone(), ids.len()))
            .collect();
        other.sort();
        other
    }

    /// The run's checks: the faults, the consumers, the inbox and the queues.
    fn checks(
        &self,
        stream: &OrderedStream,
        w: &Watched,
        stop_problems: &[String],
        scheduled: usize,
    ) -> Vec<(&'static str, bool)> {
        let (t, d) = (&self.tally, &self.deliveries);
        let skipped = stream.skipped.len() as i64;
        let lot: HashSet<&str> = self.parked_copies.keys().map(String::as_str).collect();
        vec![
            ("settled before the deadline", w.settled),
            (
                "every fault of the schedule ran",
                w.faults_failed.is_empty() && w.faults_run == scheduled,
            ),
            (
                "every consumer of the first start started",
                w.figures.launch_failures.is_empty(),
            ),
            ("no consumer crashed", w.figures.crashes.is_empty()),
            (
                "every consumer stopped cleanly on SIGTERM",
                stop_problems.is_empty(),
            ),
            (
                "zero lost: every step PROCESSED, but the skipped ones, parked",
                t.processed == stream.unique_keys() as i64 - skipped
                    && t.parked == skipped
                    && t.retryable + t.processing == 0,
            ),
            ("no HELD rows left", t.held == 0),
            ("no blocked keys left", t.blocked_keys == 0),
            ("no sequence gap outlived its timeout", t.gaps_reported == 0),
            (
                "work and retry queues empty",
                self.depths.work == 0 && self.depths.retry == 0,
            ),
            (
                "parking lot: the skipped steps only, consistent with the inbox",
                lot == ids(&stream.skipped)
                    && self.parking_copies == self.parked_copies.values().sum::<usize>()
                    && d.extra_copies.is_empty()
                    && self.parking_problems.is_empty(),
            ),
            (
                "every published copy counted on its row (delivery_count)",
                d.short.is_empty(),
            ),
        ]
    }

    /// The checks of ordering: the journal, the retried, redriven and skipped heads.
    fn ordering_checks(
        &self,
        stream: &OrderedStream,
        operator: &Operator<'_>,
    ) -> Vec<(&'static str, bool)> {
        let j = &self.journal;
        let owned = |steps: &[Step]| -> HashSet<String> {
            steps.iter().map(|s| s.message_id.clone()).collect()
        };
        let skipped_steps: HashSet<(String, i64)> = stream
            .skipped
            .iter()
            .map(|s| (s.order_id.clone(), s.step))
            .collect();
        let missing: HashSet<(String, i64)> = j.missing.iter().cloned().collect();
        let refused: HashSet<&str> = ids(&stream.redriven)
            .union(&ids(&stream.skipped))
            .copied()
            .collect();
        vec![
            (
                "every order's steps applied in their order (journal, commit order)",
                j.out_of_order.is_empty(),
            ),
            (
                "every step applied exactly once, the skipped ones never (journal)",
                j.applied_twice == 0
                    && j.unknown == 0
                    && missing.len() == j.missing.len()
                    && missing == skipped_steps,
            ),
            (
                "every retry_once step failed, then applied on its retry",
                self.failed_with(STEP_NOT_READY) == ids(&stream.retried),
            ),
            (
                "every refused step parked as its order's head",
                self.failed_with(STEP_REFUSED) == refused && operator.not_heads.is_empty(),
            ),
            (
                "the redriven steps: exactly the audited redrives, applied",
                self.redriven == owned(&stream.redriven),
            ),
            (
                "the skipped steps: exactly the audited skip_head rows",
                self.skipped == owned(&stream.skipped),
            ),
            ("no other message parked", operator.unexpected.is_empty()),
        ]
    }

    /// Prints the figures, the checks and what failed; whether every check passed.
    fn report(
        &self,
        stream: &OrderedStream,
        w: &Watched,
        stop_problems: &[String],
        operator: &Operator<'_>,
        args: &ChaosArgs,
        scheduled: usize,
    ) -> bool {
        let mut checks = self.checks(stream, w, stop_problems, scheduled);
        checks.extend(self.ordering_checks(stream, operator));
        self.figures(stream, w, operator, args);
        println!();
        for (name, pass) in &checks {
            println!("  [{}] {name}", if *pass { " ok " } else { "FAIL" });
        }
        self.problems(stream, w, stop_problems, operator);
        println!();
        checks.iter().all(|(_, pass)| *pass)
    }

    /// What the failed checks are about: the steps, rows and consumers concerned.
    fn problems(
        &self,
        stream: &OrderedStream,
        w: &Watched,
        stop_problems: &[String],
        operator: &Operator<'_>,
    ) {
        let j = &self.journal;
        let skipped: HashSet<(&str, i64)> = stream
            .skipped
            .iter()
            .map(|s| (s.order_id.as_str(), s.step))
            .collect();
        let unapplied: Vec<String> = j
            .missing
            .iter()
            .filter(|(order, step)| !skipped.contains(&(order.as_str(), *step)))
            .map(|(order, step)| format!("{order} step {step}"))
            .collect();
        let listed = [
            ("applied out of order", &j.out_of_order),
            ("never applied, not skipped", &unapplied),
            ("short of its published copies", &self.deliveries.short),
            (
                "parked with copies beyond its redeliveries",
                &self.deliveries.extra_copies,
            ),
        ];
        for problem in w
            .faults_failed
            .iter()
            .chain(&w.figures.launch_failures)
            .chain(&w.figures.crashes)
            .chain(stop_problems)
            .chain(&self.parking_problems)
        {
            println!("  - {problem}");
        }
        for (what, rows) in listed {
            for row in rows.iter().take(SHOWN) {
                println!("  - {what}: {row}");
            }
            if rows.len() > SHOWN {
                println!("  - ... and {} more {what}", rows.len() - SHOWN);
            }
        }
        for (id, status) in operator.unexpected.iter().take(SHOWN) {
            println!("  - parked, not a refused step: {id} ({status})");
        }
        for id in operator.not_heads.iter().take(SHOWN) {
            println!("  - refused step parked without blocking its order: {id}");
        }
        if w.stuck {
            println!(
                "  - nothing changed for {} s with every fault run: stopped waiting",
                STUCK_AFTER.as_secs()
            );
        }
        let skipped_ids = ids(&stream.skipped);
        let left = self
            .left
            .iter()
            .filter(|(id, _)| !skipped_ids.contains(id.as_str()));
        for (id, status) in left.take(2 * SHOWN) {
            println!("  - left {status}: {id}");
        }
    }

    fn figures(
        &self,
        stream: &OrderedStream,
        w: &Watched,
        operator: &Operator<'_>,
        args: &ChaosArgs,
    ) {
        let f = &w.figures;
        println!();
        let line = |name: &str, value: String| println!("  {name:<46} {value:>10}");
        line("keys (orders)", stream.orders.len().to_string());
        line("steps per order", stream.steps.to_string());
        line("messages published", stream.messages.len().to_string());
        line("unique messages", stream.unique_keys().to_string());
        line("exact duplicates injected", stream.duplicates.to_string());
        line("consumer processes", args.consumers.to_string());
        line("consumers SIGKILLed", f.kills.to_string());
        line("consumer restarts", f.restarts.to_string());
        line(
            "start-ups refused while a server was down",
            f.startup_failures.to_string(),
        );
        line(
            "broker connection drops (every run connection)",
            f.connection_drops.to_string(),
        );
        line("PostgreSQL restarts", f.postgres_restarts.to_string());
        self.ordering_figures(stream, w, operator);
        line(
            "throughput until settled (msgs/s)",
            format!(
                "{:.0}",
                stream.messages.len() as f64 / w.elapsed.as_secs_f64().max(1e-9)
            ),
        );
        line(
            "time until settled (s)",
            format!("{:.1}", w.elapsed.as_secs_f64()),
        );
    }

    /// What ordering did: holds, retried and redriven heads, and the journal.
    fn ordering_figures(&self, stream: &OrderedStream, w: &Watched, operator: &Operator<'_>) {
        let (t, j) = (&self.tally, &self.journal);
        let line = |name: &str, value: String| println!("  {name:<46} {value:>10}");
        line("held at most at once (sampled)", w.peak_held.to_string());
        line(
            "held rows released by the release task",
            t.released.to_string(),
        );
        line(
            "retried heads (failed once, applied on retry)",
            format!(
                "{} of {}",
                self.failed_with(STEP_NOT_READY).len(),
                stream.retried.len()
            ),
        );
        line(
            "parked heads, redriven during the run",
            format!("{} of {}", self.redriven.len(), stream.redriven.len()),
        );
        line(
            "parked heads, skipped during the run",
            format!("{} of {}", self.skipped.len(), stream.skipped.len()),
        );
        line(
            "redrives / skips (cut short by a fault, retried)",
            format!(
                "{} / {} ({})",
                operator.rounds,
                operator.skips,
                operator.failed.len()
            ),
        );
        let unplanned = self.unplanned_failures();
        line(
            "other failures recorded (retried)",
            if unplanned.is_empty() {
                "0".to_owned()
            } else {
                unplanned
                    .iter()
                    .map(|(code, n)| format!("{n} {code}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        );
        line("journal rows", j.rows.to_string());
        line(
            "orders applied out of order",
            j.out_of_order.len().to_string(),
        );
        line("steps applied twice", j.applied_twice.to_string());
        line(
            "steps never applied (the skipped heads)",
            j.missing.len().to_string(),
        );
        line(
            "HELD rows / blocked keys left",
            format!("{} / {}", t.held, t.blocked_keys),
        );
    }
}

/// The first rows that are not PROCESSED, with their status and last error code.
async fn left_over(
    pool: &sqlx::PgPool,
    schema: &SchemaName,
) -> anyhow::Result<Vec<(String, String)>> {
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT message_id, status, coalesce(last_error_code, '') AS code FROM {} \
         WHERE consumer_name = $1 AND status <> '{}' ORDER BY message_id LIMIT 50",
        schema.qualify(tables::MESSAGE_INBOX),
        InboxStatus::Processed.as_str()
    )))
    .bind(order_service::CONSUMER_NAME)
    .fetch_all(pool)
    .await
    .context("reading the rows left")?;
    rows.iter()
        .map(|r| {
            let status: String = r.try_get("status")?;
            let code: String = r.try_get("code")?;
            Ok((
                r.try_get("message_id")?,
                format!("{status} {code}").trim_end().to_owned(),
            ))
        })
        .collect()
}

/// Message ids with a recorded failed attempt, by error code (the inbox's history).
async fn failures(
    pool: &sqlx::PgPool,
    schema: &SchemaName,
) -> anyhow::Result<HashMap<String, HashSet<String>>> {
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT DISTINCT error_code, message_id FROM {} \
         WHERE consumer_name = $1 AND kind = 'failed'",
        schema.qualify("inbox_event")
    )))
    .bind(order_service::CONSUMER_NAME)
    .fetch_all(pool)
    .await
    .context("reading the inbox's history")?;
    let mut failed: HashMap<String, HashSet<String>> = HashMap::new();
    for row in &rows {
        let code: Option<String> = row.try_get("error_code")?;
        failed
            .entry(code.unwrap_or_default())
            .or_default()
            .insert(row.try_get("message_id")?);
    }
    Ok(failed)
}

/// Message ids with an audited `action` (made `via` that operation, if given).
async fn audited(
    pool: &sqlx::PgPool,
    schema: &SchemaName,
    action: &str,
    via: Option<&str>,
) -> anyhow::Result<HashSet<String>> {
    let ids: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT DISTINCT message_id FROM {} WHERE consumer_name = $1 AND action = $2 \
           AND ($3::text IS NULL OR details ->> 'via' = $3)",
        schema.qualify("inbox_audit")
    )))
    .bind(order_service::CONSUMER_NAME)
    .bind(action)
    .bind(via)
    .fetch_all(pool)
    .await
    .context("reading the audit trail")?;
    Ok(ids.into_iter().filter(|id| !id.is_empty()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judged(numbers: &[i64]) -> Journal {
        let mut j = Journal::default();
        j.judge("o", numbers, 4);
        j
    }

    #[test]
    fn the_journal_wants_every_step_once_in_order() {
        let ok = judged(&[1, 2, 3, 4]);
        assert!(ok.out_of_order.is_empty() && ok.missing.is_empty());
        assert_eq!((ok.applied_twice, ok.unknown), (0, 0));

        let swapped = judged(&[1, 3, 2, 4]);
        assert_eq!(swapped.out_of_order, ["o: [1, 3, 2, 4]"]);
        assert!(swapped.missing.is_empty());

        // A step applied again after the next one: out of order and twice.
        let again = judged(&[1, 2, 3, 2, 4]);
        assert_eq!(again.out_of_order.len(), 1);
        assert_eq!(again.applied_twice, 1);

        let gap = judged(&[1, 2, 4]);
        assert!(gap.out_of_order.is_empty());
        assert_eq!(gap.missing, [("o".to_owned(), 3)]);

        let stranger = judged(&[1, 2, 3, 4, 9]);
        assert_eq!(stranger.unknown, 1);
        assert!(stranger.out_of_order.is_empty());

        let none = judged(&[]);
        assert_eq!(none.missing.len(), 4);
    }
}
