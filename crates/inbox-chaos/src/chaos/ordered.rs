//! `inbox-lab chaos --ordered`: per-key order under the same faults. The consumers order each
//! order's messages by `x-sequence` (`consume --ordered`, with the release task beside the
//! consumer); the stream is each order's `OrderStep`s 1..n, interleaved across orders and
//! published in each order's sequence. Some steps fail until a retry returns them, some are
//! refused (parked, blocking their order) and, during the run, fixed and redriven by the run's
//! operator, while consumers are SIGKILLed, connections dropped and PostgreSQL restarted.
//! Then the order service's journal must show every order's steps applied once each, in their
//! order, with nothing held or blocked left.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::Context;
use inbox_ops::{Actor, NoProgress, Operations, redrive::RedriveRequest};
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
/// before the run's operator clears its fault and redrives it.
const REDRIVE_AFTER: Duration = Duration::from_secs(3);

/// How often the operator looks for refused steps to redrive.
const OPERATOR_EVERY: Duration = Duration::from_secs(1);

/// Orders named per failed check of the journal.
const SHOWN: usize = 5;

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
    let mut operator = Operator::new(&pool, &schema, &servers.amqp_url, &config, &stream)?;
    let run = Run {
        pool: &pool,
        servers,
        config: &config,
        unique: stream.unique_keys() as i64,
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
         {} steps fail until retried, {} are refused until redriven",
        stream.messages.len(),
        stream.orders.len(),
        stream.steps,
        stream.duplicates,
        stream.retried.len(),
        stream.refused.len()
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
                .refused
                .iter()
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
            if !acted && w.faults_run == self.plan.len() && tally.settled(self.unique, &depths) {
                w.settled = true;
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
#[derive(Clone, Debug, Default)]
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

    /// Every step processed, nothing held, blocked, failed or queued.
    fn settled(&self, unique: i64, depths: &QueueDepths) -> bool {
        self.processed == unique
            && self.held == 0
            && self.parked == 0
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

/// The run's operator: finds the refused steps once they have been parked a while, makes the
/// fix (clears their fault) and redrives them, as a person would with `inboxctl redrive`.
struct Operator<'a> {
    pool: &'a sqlx::PgPool,
    schema: &'a SchemaName,
    amqp_url: &'a str,
    config: &'a ConsumerConfig,
    /// The refused steps, by message id.
    refused: HashMap<&'a str, &'a Step>,
    ops: Operations,
    actor: Actor,
    last: Option<Instant>,
    /// Refused steps of a redrive that failed, not PROCESSED yet: redriven again, as a
    /// redrive a fault cut short may leave a reopened row's copy in the parking lot.
    pending: HashSet<String>,
    /// Redrives run.
    rounds: usize,
    /// Rounds a fault cut short (tried again at the next round).
    failed_rounds: Vec<String>,
    /// Refused steps found parked without being their order's head.
    not_heads: HashSet<String>,
    /// Parked rows that are not refused steps, with their error code.
    unexpected: BTreeMap<String, String>,
}

impl<'a> Operator<'a> {
    fn new(
        pool: &'a sqlx::PgPool,
        schema: &'a SchemaName,
        amqp_url: &'a str,
        config: &'a ConsumerConfig,
        stream: &'a OrderedStream,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            pool,
            schema,
            amqp_url,
            config,
            refused: stream
                .refused
                .iter()
                .map(|s| (s.message_id.as_str(), s))
                .collect(),
            ops: Operations::new(pool.clone(), schema.clone()),
            actor: Actor::new("inbox-lab chaos", "the refused step's fault is cleared")?,
            last: None,
            pending: HashSet::new(),
            rounds: 0,
            failed_rounds: Vec::new(),
            not_heads: HashSet::new(),
            unexpected: BTreeMap::new(),
        })
    }

    /// A round every [`OPERATOR_EVERY`]; a round a fault cuts short is noted and tried again.
    async fn act(&mut self) {
        if self.last.is_some_and(|t| t.elapsed() < OPERATOR_EVERY) {
            return;
        }
        self.last = Some(Instant::now());
        if let Err(e) = self.round().await {
            self.failed_rounds.push(format!("{e:#}"));
        }
    }

    async fn round(&mut self) -> anyhow::Result<()> {
        let t = self.schema.qualify(tables::MESSAGE_INBOX);
        let k = self.schema.qualify(tables::INBOX_ORDER_KEY);
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT m.message_id, m.status, m.last_error_code, m.status IN ({PARKED}) AS parked, \
               EXISTS (SELECT 1 FROM {k} k WHERE k.consumer_name = $1 \
                 AND k.head_message_id = m.message_id) AS is_head \
             FROM {t} m \
             WHERE m.consumer_name = $1 AND ( \
               (m.status IN ({PARKED}) AND m.last_failed_at < now() - make_interval(secs => $2)) \
               OR (m.message_id = ANY($3) AND m.status <> '{processed}'))",
            processed = InboxStatus::Processed.as_str()
        )))
        .bind(order_service::CONSUMER_NAME)
        .bind(REDRIVE_AFTER.as_secs_f64())
        .bind(self.pending.iter().cloned().collect::<Vec<_>>())
        .fetch_all(self.pool)
        .await?;
        let mut due = Vec::new();
        for row in &rows {
            let id: String = row.try_get("message_id")?;
            let status: String = row.try_get("status")?;
            let Some(step) = self.refused.get(id.as_str()) else {
                let code: Option<String> = row.try_get("last_error_code")?;
                self.unexpected
                    .insert(id, format!("{status} {}", code.unwrap_or_default()));
                continue;
            };
            if row.try_get("parked")? && !row.try_get::<bool, _>("is_head")? {
                self.not_heads.insert(id.clone());
            }
            order_service::clear_step_fault(self.pool, self.schema, &step.order_id, step.step)
                .await?;
            due.push(id);
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
        let redriven = self
            .ops
            .redrive(&lot, &request, Some(&self.actor), &NoProgress)
            .await;
        lot.close().await;
        redriven?;
        self.rounds += 1;
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
    /// Steps never applied.
    missing: Vec<String>,
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
    /// they must be 1..=`steps`, each once, increasing.
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
                .map(|n| format!("{order} step {n}")),
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
            redriven: redriven(pool, schema).await?,
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

    fn checks(
        &self,
        stream: &OrderedStream,
        w: &Watched,
        stop_problems: &[String],
        operator: &Operator<'_>,
        scheduled: usize,
    ) -> Vec<(&'static str, bool)> {
        let refused = ids(&stream.refused);
        let redriven: HashSet<&str> = self.redriven.iter().map(String::as_str).collect();
        let (t, j, d) = (&self.tally, &self.journal, &self.deliveries);
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
                "zero lost: every step PROCESSED",
                t.processed == stream.unique_keys() as i64
                    && t.parked + t.retryable + t.processing == 0,
            ),
            ("no HELD rows left", t.held == 0),
            ("no blocked keys left", t.blocked_keys == 0),
            ("no sequence gap outlived its timeout", t.gaps_reported == 0),
            (
                "work and retry queues and parking lot empty",
                self.depths.work == 0 && self.depths.retry == 0 && self.parking_copies == 0,
            ),
            (
                "parking lot consistent with the inbox",
                self.parking_problems.is_empty(),
            ),
            (
                "every published copy counted on its row (delivery_count)",
                d.short.is_empty(),
            ),
            (
                "every order's steps applied in their order (journal, commit order)",
                j.out_of_order.is_empty(),
            ),
            (
                "every step applied exactly once (journal)",
                j.applied_twice == 0 && j.missing.is_empty() && j.unknown == 0,
            ),
            (
                "every retry_once step failed, then applied on its retry",
                self.failed_with(STEP_NOT_READY) == ids(&stream.retried),
            ),
            (
                "every refused step parked as its order's head, then redriven and applied",
                self.failed_with(STEP_REFUSED) == refused
                    && redriven == refused
                    && operator.not_heads.is_empty(),
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
        let checks = self.checks(stream, w, stop_problems, operator, scheduled);
        self.figures(stream, w, operator, args);
        println!();
        for (name, pass) in &checks {
            println!("  [{}] {name}", if *pass { " ok " } else { "FAIL" });
        }
        let j = &self.journal;
        let listed = [
            ("applied out of order", &j.out_of_order),
            ("never applied", &j.missing),
            ("short of its published copies", &self.deliveries.short),
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
        println!();
        checks.iter().all(|(_, pass)| *pass)
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
            format!("{} of {}", self.redriven.len(), stream.refused.len()),
        );
        line(
            "redrives (cut short by a fault, retried)",
            format!("{} ({})", operator.rounds, operator.failed_rounds.len()),
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
        line("steps never applied", j.missing.len().to_string());
        line(
            "HELD rows / blocked keys left",
            format!("{} / {}", t.held, t.blocked_keys),
        );
    }
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

/// Message ids whose parked row a redrive reopened (the audit trail).
async fn redriven(pool: &sqlx::PgPool, schema: &SchemaName) -> anyhow::Result<HashSet<String>> {
    let ids: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT DISTINCT message_id FROM {} WHERE consumer_name = $1 AND action = $2 \
           AND details ->> 'via' = $3",
        schema.qualify("inbox_audit")
    )))
    .bind(order_service::CONSUMER_NAME)
    .bind(inbox_ops::reopen::REOPEN)
    .bind(inbox_ops::redrive::REDRIVE)
    .fetch_all(pool)
    .await
    .context("reading the audit trail")?;
    Ok(ids.into_iter().collect())
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
        assert_eq!(gap.missing, ["o step 3"]);

        let stranger = judged(&[1, 2, 3, 4, 9]);
        assert_eq!(stranger.unknown, 1);
        assert!(stranger.out_of_order.is_empty());

        let none = judged(&[]);
        assert_eq!(none.missing.len(), 4);
    }
}
