//! `inbox-bench`: measures, in one process against the local servers, the broker's ceiling,
//! the textbook inbox recipe, and rabbit-inbox with a per-message and a batch handler, all on
//! the same workload and the same business effect (one history row per message), and checks
//! exactly-once after every run; the library modes also with per-key ordering on, to state its
//! cost. `inbox-lab bench` is its command line.

mod baseline;
pub mod ledger_layout;
pub mod outbox;
mod procfs;
pub mod retention;
pub mod sustained;
mod workload;

use std::{
    fmt,
    time::{Duration, Instant},
};

use rabbit_inbox::{
    Consumer, ConsumerConfig, SchemaName, Topology, broker::Broker, ordering::OrderingPolicy,
    stats::ConsumerStats,
};
use serde::Serialize;
use sqlx::PgPool;

pub use procfs::CpuShare;
use workload::{BatchEffect, History, PerMessageEffect, Workload};

/// Why a benchmark could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// RabbitMQ failed.
    #[error(transparent)]
    Amqp(#[from] lapin::Error),
    /// The library's broker helpers failed.
    #[error(transparent)]
    Broker(#[from] rabbit_inbox::BrokerError),
    /// The inbox store failed.
    #[error(transparent)]
    Store(#[from] rabbit_inbox::StoreError),
    /// PostgreSQL failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The consumer failed.
    #[error(transparent)]
    Consumer(#[from] rabbit_inbox::ConsumerError),
    /// Bad options or configuration.
    #[error(transparent)]
    Config(#[from] rabbit_inbox::ConfigError),
    /// A generated message did not parse.
    #[error("benchmark message is invalid: {0}")]
    Invalid(String),
    /// The broker ended the consumer early.
    #[error("the broker ended the consumer before all messages arrived")]
    StreamEnded,
    /// A run did not finish in time.
    #[error("{0} did not finish within {1:?}")]
    Timeout(&'static str, Duration),
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Deliveries per run.
    pub messages: usize,
    /// Body size in bytes.
    pub payload_size: usize,
    /// Share of deliveries that repeat an earlier message.
    pub duplicate_share: f64,
    /// Share of unique messages the handlers refuse permanently (parked).
    pub failure_share: f64,
    /// Aggregates the messages are spread over: message `seq` carries `x-aggregate-id`
    /// `seq % keys` (0: no aggregate id; the ordered modes need one).
    pub keys: usize,
    /// rabbit-inbox batch size (None: the library default).
    pub batch_size: Option<usize>,
    /// rabbit-inbox lanes (None: the library default).
    pub lanes: Option<usize>,
    /// rabbit-inbox prefetch (None: the library default).
    pub prefetch: Option<u16>,
    /// Prefetch of the broker ceiling.
    pub ceiling_prefetch: u16,
    /// Multiple-ack interval of the broker ceiling.
    pub ceiling_ack_every: usize,
    /// Repetitions; figures are medians.
    pub runs: usize,
    /// Messages per second of the low-load latency run (0: skip it).
    pub low_load_rate: u32,
    /// Duration of the low-load run.
    pub low_load_duration: Duration,
    /// Inbox sizes (rows already present) to measure the batch handler against, besides empty.
    pub prefill: Vec<u64>,
    /// Which of `ceiling`, `textbook`, `per-message`, `batch`, `per-message-late` (failing
    /// messages refused in `handle` rather than `check`), `per-message-ordered`,
    /// `batch-ordered` to run (empty: the first four).
    pub modes: Vec<String>,
    /// PostgreSQL schema used (dropped and recreated for every run).
    pub schema: SchemaName,
    /// Prefix of the queues used (deleted after every run).
    pub queue_prefix: String,
    /// Quorum queues (work, retry tiers and parking lot) for every mode instead of classic
    /// ones, with the library's default delivery limit.
    pub quorum: bool,
}

/// One measured mode.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ModeResult {
    /// Name shown in the table.
    pub mode: String,
    /// Deliveries per second, median of the runs.
    pub msgs_per_s: f64,
    /// Median delivery-to-ack latency, ms.
    pub p50_ms: f64,
    /// 99th percentile delivery-to-ack latency, ms.
    pub p99_ms: f64,
    /// Peak resident memory during the run, MiB.
    pub peak_rss_mb: f64,
    /// Exactly-once check from the database (None where no database is involved).
    pub exactly_once: Option<bool>,
    /// Ordered modes: messages left HELD behind a failed message of their key (median of the
    /// runs; nothing releases them in a benchmark).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<u64>,
    /// Where the CPU went: milliseconds per 1000 messages (median of the runs), PostgreSQL
    /// backends that exited during the run included.
    pub cpu_ms_per_1k: CpuShare,
    /// CPU time of the consumer, PostgreSQL and RabbitMQ over all cores' time during the run
    /// (median): near 1.0 the run is bound by this machine's CPU, well below it by waits
    /// (round trips, fsync, confirms).
    pub cores_busy: f64,
    /// For a run against a prefilled inbox: its size and the paired empty-inbox figure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefilled: Option<Prefilled>,
}

/// A prefilled-inbox measurement compared with the empty inbox measured alongside it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Prefilled {
    /// Rows in the inbox before the run.
    pub rows: u64,
    /// Median msgs/s of the paired empty-inbox runs.
    pub empty_msgs_per_s: f64,
    /// Prefilled msgs/s over empty msgs/s.
    pub ratio_vs_empty: f64,
}

/// What per-key ordering costs a library mode: its ordered figures over those of the same
/// consumer without ordering, measured in the same rounds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct OrderingCost {
    /// Ordered msgs/s over unordered msgs/s.
    pub rate_ratio: f64,
    /// Ordered CPU ms per 1,000 messages (consumer, PostgreSQL and RabbitMQ) over unordered.
    pub cpu_ratio: f64,
    /// Messages the ordered runs left HELD behind a failed message of their key (median).
    pub held: u64,
}

/// All figures of a benchmark.
#[derive(Clone, Debug, Default)]
pub struct BenchReport {
    /// The options' summary line.
    pub setup: String,
    /// Ceiling, textbook, per-message (and ordered), batch (and ordered), then prefilled and
    /// low-load runs.
    pub modes: Vec<ModeResult>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Ceiling,
    Textbook,
    PerMessage,
    /// The per-message handler refusing failing messages in `handle` instead of `check`.
    PerMessageLate,
    PerMessageOrdered,
    Batch,
    BatchOrdered,
}

impl Mode {
    /// In the order they run within a round; an ordered mode right after its twin, so both
    /// meet the same moment of a noisy machine.
    const ALL: [Mode; 7] = [
        Mode::Ceiling,
        Mode::Textbook,
        Mode::PerMessage,
        Mode::PerMessageLate,
        Mode::PerMessageOrdered,
        Mode::Batch,
        Mode::BatchOrdered,
    ];

    fn name(self) -> &'static str {
        match self {
            Mode::Ceiling => "broker ceiling (consume + multiple-ack, no db)",
            Mode::Textbook => "textbook inbox (1 tx + 1 ack per message)",
            Mode::PerMessage => "rabbit-inbox, per-message handler",
            Mode::PerMessageLate => "rabbit-inbox, per-message handler, refusing in handle",
            Mode::PerMessageOrdered => "rabbit-inbox, per-message handler, ordered by aggregate",
            Mode::Batch => "rabbit-inbox, batch handler",
            Mode::BatchOrdered => "rabbit-inbox, batch handler, ordered by aggregate",
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Mode::Ceiling => "ceiling",
            Mode::Textbook => "textbook",
            Mode::PerMessage => "per-message",
            Mode::PerMessageLate => "per-message-late",
            Mode::PerMessageOrdered => "per-message-ordered",
            Mode::Batch => "batch",
            Mode::BatchOrdered => "batch-ordered",
        }
    }

    /// The consumer runs with `OrderingPolicy::by_aggregate()`.
    fn ordered(self) -> bool {
        matches!(self, Mode::PerMessageOrdered | Mode::BatchOrdered)
    }

    /// The same consumer without ordering, for an ordered mode.
    fn unordered_twin(self) -> Option<Mode> {
        match self {
            Mode::PerMessageOrdered => Some(Mode::PerMessage),
            Mode::BatchOrdered => Some(Mode::Batch),
            _ => None,
        }
    }

    /// Measured when `--modes` names none.
    fn default(self) -> bool {
        !self.ordered() && self != Mode::PerMessageLate
    }

    /// The modes `options.modes` names (none named: the four unordered ones).
    fn selected(options: &BenchOptions) -> Result<Vec<Mode>, BenchError> {
        if let Some(unknown) = options
            .modes
            .iter()
            .find(|s| !Mode::ALL.iter().any(|m| m.slug() == s.as_str()))
        {
            return Err(BenchError::Invalid(format!(
                "unknown mode {unknown}: --modes takes ceiling, textbook, per-message, batch, \
                 per-message-late, per-message-ordered and batch-ordered"
            )));
        }
        let modes: Vec<Mode> = Mode::ALL
            .into_iter()
            .filter(|m| {
                if options.modes.is_empty() {
                    m.default()
                } else {
                    options.modes.iter().any(|s| s == m.slug())
                }
            })
            .collect();
        if modes.iter().any(|m| m.ordered()) && options.keys == 0 {
            return Err(BenchError::Invalid(
                "the ordered modes order by aggregate: set --keys above 0".into(),
            ));
        }
        Ok(modes)
    }
}

/// Where a run's inbox lives.
#[derive(Clone, Copy)]
enum Target<'a> {
    /// Recreated empty before the run.
    Fresh(&'a SchemaName),
    /// Kept as it is (a prefilled inbox); only the business table is emptied.
    Kept(&'a SchemaName),
}

struct Run {
    elapsed: Duration,
    cpu: CpuShare,
    p50: Duration,
    p99: Duration,
    peak_rss_mb: f64,
    exactly_once: Option<bool>,
    /// Inbox rows left HELD (ordered modes).
    held: Option<u64>,
}

/// Runs the benchmark. `progress` gets one line per finished run.
pub async fn run(
    amqp_url: &str,
    pool: &PgPool,
    options: &BenchOptions,
    mut progress: impl FnMut(&str),
) -> Result<BenchReport, BenchError> {
    if options.messages < 10 {
        return Err(BenchError::Invalid("use at least 10 messages".into()));
    }
    let modes = Mode::selected(options)?;
    if modes.is_empty() {
        return Err(BenchError::Invalid(
            "--modes names no mode of this benchmark".into(),
        ));
    }
    let broker = Broker::connect(amqp_url, "inbox-bench").await?;
    let mut report = BenchReport {
        setup: setup_line(options),
        modes: Vec::new(),
    };
    let mut all: Vec<(Mode, Vec<Run>)> = modes.into_iter().map(|m| (m, Vec::new())).collect();
    for round in 0..options.runs.max(1) {
        // Interleaved, so drift on a noisy machine hits every mode alike.
        for (mode, runs) in &mut all {
            let workload = Workload::new(
                options.messages,
                options.payload_size,
                options.duplicate_share,
                options.failure_share,
                options.keys,
                round as u64 + 1,
            );
            let target = Target::Fresh(&options.schema);
            let run = run_once(amqp_url, pool, &broker, options, *mode, &workload, target).await?;
            progress(&format!(
                "  run {}: {:<56} {:>9.0} msgs/s{}",
                round + 1,
                mode.name(),
                options.messages as f64 / run.elapsed.as_secs_f64(),
                run.held.map_or(String::new(), |n| format!(", {n} held"))
            ));
            runs.push(run);
        }
    }
    for (mode, runs) in all {
        report
            .modes
            .push(summarize(mode.name().to_owned(), options.messages, runs));
    }

    for &rows in &options.prefill {
        // The prefilled inbox is filled once and kept; every round measures it right after an
        // empty inbox, on fresh message ids, so the ratio compares like with like.
        let filled = SchemaName::new(format!("{}_filled", options.schema))?;
        workload::reset_schema(pool, &filled).await?;
        workload::prefill(pool, &filled, rows).await?;
        let (mut empty_runs, mut filled_runs) = (Vec::new(), Vec::new());
        for round in 0..options.runs.max(1) {
            let workload = Workload::new(
                options.messages,
                options.payload_size,
                options.duplicate_share,
                options.failure_share,
                options.keys,
                0x100 + round as u64,
            );
            let empty = Target::Fresh(&options.schema);
            empty_runs.push(
                run_once(
                    amqp_url,
                    pool,
                    &broker,
                    options,
                    Mode::Batch,
                    &workload,
                    empty,
                )
                .await?,
            );
            let kept = Target::Kept(&filled);
            filled_runs.push(
                run_once(
                    amqp_url,
                    pool,
                    &broker,
                    options,
                    Mode::Batch,
                    &workload,
                    kept,
                )
                .await?,
            );
        }
        rabbit_inbox::schema::drop_schema(pool, &filled).await?;
        let empty = summarize(
            format!("rabbit-inbox, batch handler, empty inbox (paired with {rows})"),
            options.messages,
            empty_runs,
        );
        let mut result = summarize(
            format!("rabbit-inbox, batch handler, inbox holding {rows} rows"),
            options.messages,
            filled_runs,
        );
        result.prefilled = Some(Prefilled {
            rows,
            empty_msgs_per_s: empty.msgs_per_s,
            ratio_vs_empty: if empty.msgs_per_s > 0.0 {
                result.msgs_per_s / empty.msgs_per_s
            } else {
                0.0
            },
        });
        progress(&format!(
            "  {:<58} {:>9.0} msgs/s ({:.2}x the empty inbox's {:.0})",
            result.mode,
            result.msgs_per_s,
            result.prefilled.as_ref().map_or(0.0, |p| p.ratio_vs_empty),
            empty.msgs_per_s
        ));
        report.modes.push(empty);
        report.modes.push(result);
    }

    if options.low_load_rate > 0 {
        let result = low_load(amqp_url, pool, &broker, options).await?;
        progress(&format!(
            "  {:<58} p99 {:.1} ms",
            result.mode, result.p99_ms
        ));
        report.modes.push(result);
    }
    broker.close().await;
    // A prefilled inbox can hold millions of rows: do not leave it behind.
    rabbit_inbox::schema::drop_schema(pool, &options.schema).await?;
    Ok(report)
}

/// The options' summary line.
fn setup_line(options: &BenchOptions) -> String {
    let library = library_config(options);
    format!(
        "{} messages of {} bytes, {:.0}% duplicates, {:.1}% failing, {}; {} queues; \
         rabbit-inbox batch {} x {} lanes, prefetch {}; ceiling prefetch {}, ack every {}; \
         median of {} run(s)",
        options.messages,
        options.payload_size,
        options.duplicate_share * 100.0,
        options.failure_share * 100.0,
        if options.keys > 0 {
            format!("{} aggregates", options.keys)
        } else {
            "no aggregate ids".to_owned()
        },
        if options.quorum { "quorum" } else { "classic" },
        library.batch_size,
        library.lanes,
        library.prefetch,
        options.ceiling_prefetch,
        options.ceiling_ack_every,
        options.runs.max(1)
    )
}

fn library_config(options: &BenchOptions) -> ConsumerConfig {
    let mut config = ConsumerConfig::new(workload::CONSUMER, Topology::new("unused"));
    if let Some(b) = options.batch_size {
        config.batch_size = b;
    }
    if let Some(l) = options.lanes {
        config.lanes = l;
    }
    if let Some(p) = options.prefetch {
        config.prefetch = p;
    }
    config
}

async fn fresh_topology(
    broker: &Broker,
    options: &BenchOptions,
    slug: &str,
) -> Result<Topology, BenchError> {
    // Classic or quorum as the consumer's own configuration declares them; every run takes its
    // topology from here.
    let mut config = library_config(options);
    config.topology = Topology::new(format!("{}-{slug}", options.queue_prefix));
    if options.quorum {
        config.use_quorum_queues(None);
    }
    let (topology, retry) = (config.topology, config.retry);
    broker.delete(&topology, &retry).await?;
    broker.declare(&topology, &retry).await?;
    Ok(topology)
}

async fn run_once(
    amqp_url: &str,
    pool: &PgPool,
    broker: &Broker,
    options: &BenchOptions,
    mode: Mode,
    workload: &Workload,
    target: Target<'_>,
) -> Result<Run, BenchError> {
    let schema = match target {
        Target::Fresh(schema) => {
            workload::reset_schema(pool, schema).await?;
            schema
        }
        Target::Kept(schema) => {
            workload::reset_history(pool, schema).await?;
            schema
        }
    };
    let topology = fresh_topology(broker, options, mode.slug()).await?;
    publish(broker, &topology.queue, workload).await?;
    let count = workload.len();

    procfs::reset_peak();
    let cpu_before = procfs::CpuTicks::now();
    let started = Instant::now();
    let (p50, p99) = match mode {
        Mode::Ceiling => {
            let mut h = baseline::histogram();
            baseline::ceiling(
                amqp_url,
                &topology.queue,
                count,
                options.ceiling_prefetch,
                options.ceiling_ack_every,
                &mut h,
            )
            .await?;
            (h.value_at_quantile(0.5), h.value_at_quantile(0.99))
        }
        Mode::Textbook => {
            let mut h = baseline::histogram();
            let prefetch = library_config(options).prefetch;
            baseline::textbook(
                amqp_url,
                pool,
                schema,
                &topology.queue,
                count,
                prefetch,
                &mut h,
            )
            .await?;
            (h.value_at_quantile(0.5), h.value_at_quantile(0.99))
        }
        Mode::PerMessage
        | Mode::PerMessageLate
        | Mode::PerMessageOrdered
        | Mode::Batch
        | Mode::BatchOrdered => {
            let mut config = library_config(options);
            config.schema = schema.clone();
            config.topology = topology.clone();
            if mode.ordered() {
                config.ordering = Some(OrderingPolicy::by_aggregate());
            }
            let s = library(amqp_url, pool, config, mode, count as u64).await?;
            (
                s.latency_p50.as_micros() as u64,
                s.latency_p99.as_micros() as u64,
            )
        }
    };
    let elapsed = started.elapsed();
    let cpu = procfs::CpuTicks::now().per_thousand(cpu_before, count);
    let peak_rss_mb = procfs::peak_mb();
    let check = match mode {
        Mode::Ceiling => None,
        _ => Some(verified(pool, schema, workload, mode.ordered()).await?),
    };
    broker
        .delete(&topology, &library_config(options).retry)
        .await?;
    Ok(Run {
        elapsed,
        cpu,
        p50: Duration::from_micros(p50),
        p99: Duration::from_micros(p99),
        peak_rss_mb,
        exactly_once: check.map(|c| c.passed()),
        held: check
            .filter(|_| mode.ordered())
            .map(|c| u64::try_from(c.held).unwrap_or_default()),
    })
}

/// Publishes the workload to `queue`, in chunks: a delivery with its headers lives only while
/// it is published.
async fn publish(broker: &Broker, queue: &str, workload: &Workload) -> Result<(), BenchError> {
    let indexes: Vec<usize> = (0..workload.len()).collect();
    for chunk in indexes.chunks(2000) {
        let messages: Vec<_> = chunk.iter().map(|&i| workload.delivery(i)).collect();
        let batch: Vec<(&str, &rabbit_inbox::broker::OutgoingMessage)> =
            messages.iter().map(|m| (queue, m)).collect();
        broker.publish_batch("", &batch).await?;
    }
    Ok(())
}

/// Runs a library mode's consumer over `count` deliveries: per message or batch, with
/// `config` (ordered or not).
async fn library(
    amqp_url: &str,
    pool: &PgPool,
    config: ConsumerConfig,
    mode: Mode,
    count: u64,
) -> Result<rabbit_inbox::stats::StatsSnapshot, BenchError> {
    let timeout = Duration::from_secs(600);
    let history = History::new(&config.schema);
    let stats = match mode {
        Mode::PerMessage | Mode::PerMessageLate | Mode::PerMessageOrdered => {
            let effect = PerMessageEffect {
                history,
                late: mode == Mode::PerMessageLate,
            };
            let c = Consumer::new(amqp_url, pool.clone(), config, effect)?;
            drive(c, count, timeout, mode.name()).await?
        }
        _ => {
            let c =
                Consumer::with_batch_handler(amqp_url, pool.clone(), config, BatchEffect(history))?;
            drive(c, count, timeout, mode.name()).await?
        }
    };
    Ok(stats.snapshot())
}

/// The exactly-once check of a run; a failed one is logged with what went wrong.
async fn verified(
    pool: &PgPool,
    schema: &SchemaName,
    workload: &Workload,
    ordered: bool,
) -> Result<workload::Check, BenchError> {
    let check = workload::check(pool, schema, workload, ordered).await?;
    if !check.passed() {
        tracing::error!(
            "exactly-once check failed in schema {schema}{}: {check}; the counts name the \
             broken rule, and RUST_LOG=rabbit_inbox=debug shows the consumer's decisions",
            if ordered { " (ordered)" } else { "" }
        );
    }
    Ok(check)
}

/// Runs a library consumer until `count` deliveries are settled, then stops it.
async fn drive<H: rabbit_inbox::BatchHandler>(
    consumer: Consumer<H>,
    count: u64,
    timeout: Duration,
    name: &'static str,
) -> Result<std::sync::Arc<ConsumerStats>, BenchError> {
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async {
        let _ = stopped.await;
    }));
    if !settle_then_stop(&stats, task, stop, count, Instant::now() + timeout).await? {
        return Err(BenchError::Timeout(name, timeout));
    }
    Ok(stats)
}

/// Waits until the consumer running in `task` has settled `count` deliveries (or ended, or
/// `deadline` passed), then stops it; whether it got there.
async fn settle_then_stop(
    stats: &ConsumerStats,
    task: tokio::task::JoinHandle<Result<(), rabbit_inbox::ConsumerError>>,
    stop: tokio::sync::oneshot::Sender<()>,
    count: u64,
    deadline: Instant,
) -> Result<bool, BenchError> {
    while stats.settled() < count && !task.is_finished() && Instant::now() <= deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let done = stats.settled() >= count;
    let _ = stop.send(());
    match task.await {
        Ok(result) => result?,
        Err(e) => return Err(BenchError::Invalid(format!("consumer task failed: {e}"))),
    }
    Ok(done)
}

/// The batch handler under a steady low rate: latency when batches do not fill up.
async fn low_load(
    amqp_url: &str,
    pool: &PgPool,
    broker: &Broker,
    options: &BenchOptions,
) -> Result<ModeResult, BenchError> {
    let schema = &options.schema;
    workload::reset_schema(pool, schema).await?;
    let topology = fresh_topology(broker, options, "low-load").await?;
    let count = (f64::from(options.low_load_rate) * options.low_load_duration.as_secs_f64())
        .max(1.0) as usize;
    let workload = Workload::new(count, options.payload_size, 0.0, 0.0, options.keys, 7);
    let mut config = library_config(options);
    config.schema = schema.clone();
    config.topology = topology.clone();
    let consumer = Consumer::with_batch_handler(
        amqp_url,
        pool.clone(),
        config,
        BatchEffect(History::new(schema)),
    )?;
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async {
        let _ = stopped.await;
    }));
    procfs::reset_peak();
    let interval = Duration::from_secs_f64(1.0 / f64::from(options.low_load_rate));
    let mut ticker = tokio::time::interval(interval);
    for index in 0..workload.len() {
        ticker.tick().await;
        broker
            .publish("", &topology.queue, &workload.delivery(index))
            .await?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats.settled() < count as u64 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let _ = stop.send(());
    let _ = task.await;
    let s = stats.snapshot();
    let exactly_once = verified(pool, schema, &workload, false).await?.passed();
    broker
        .delete(&topology, &library_config(options).retry)
        .await?;
    Ok(ModeResult {
        mode: format!(
            "rabbit-inbox, batch handler, steady {} msgs/s",
            options.low_load_rate
        ),
        msgs_per_s: f64::from(options.low_load_rate),
        p50_ms: ms(s.latency_p50),
        p99_ms: ms(s.latency_p99),
        peak_rss_mb: procfs::peak_mb(),
        exactly_once: Some(exactly_once && s.latency_samples >= count as u64),
        held: None,
        cpu_ms_per_1k: CpuShare::default(),
        cores_busy: 0.0,
        prefilled: None,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn summarize(mode: String, messages: usize, runs: Vec<Run>) -> ModeResult {
    ModeResult {
        mode,
        msgs_per_s: median(
            runs.iter()
                .map(|r| messages as f64 / r.elapsed.as_secs_f64())
                .collect(),
        ),
        p50_ms: median(runs.iter().map(|r| ms(r.p50)).collect()),
        p99_ms: median(runs.iter().map(|r| ms(r.p99)).collect()),
        peak_rss_mb: runs.iter().map(|r| r.peak_rss_mb).fold(0.0, f64::max),
        exactly_once: runs
            .iter()
            .map(|r| r.exactly_once)
            .try_fold(true, |acc, e| e.map(|e| acc && e)),
        held: runs
            .iter()
            .map(|r| r.held.map(|n| n as f64))
            .collect::<Option<Vec<f64>>>()
            .map(|held| median(held) as u64),
        cpu_ms_per_1k: CpuShare::new(
            median(runs.iter().map(|r| r.cpu.consumer).collect()),
            median(runs.iter().map(|r| r.cpu.postgres).collect()),
            median(runs.iter().map(|r| r.cpu.broker).collect()),
        ),
        cores_busy: median(
            runs.iter()
                .map(|r| {
                    let cpu_ms = r.cpu.total * messages as f64 / 1000.0;
                    cpu_ms / (ms(r.elapsed) * procfs::cores()).max(f64::MIN_POSITIVE)
                })
                .collect(),
        ),
        prefilled: None,
    }
}

impl BenchReport {
    fn find(&self, prefix: &str) -> Option<&ModeResult> {
        self.modes.iter().find(|m| m.mode == prefix)
    }

    fn rate(&self, mode: Mode) -> f64 {
        self.find(mode.name()).map_or(0.0, |m| m.msgs_per_s)
    }

    /// What ordering costs the ordered mode `ordered`: None unless it and its twin ran.
    fn ordering_cost(&self, ordered: Mode) -> Option<OrderingCost> {
        let with = self.find(ordered.name())?;
        let without = self.find(ordered.unordered_twin()?.name())?;
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        Some(OrderingCost {
            rate_ratio: ratio(with.msgs_per_s, without.msgs_per_s),
            cpu_ratio: ratio(with.cpu_ms_per_1k.total, without.cpu_ms_per_1k.total),
            held: with.held.unwrap_or_default(),
        })
    }

    /// The ordering cost lines, when an ordered mode ran.
    fn write_ordering_cost(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let costs = [Mode::PerMessageOrdered, Mode::BatchOrdered].map(|m| self.ordering_cost(m));
        if costs.iter().all(Option::is_none) {
            return Ok(());
        }
        let [per_message, batch] = costs.map(|c| {
            c.map_or(("-".into(), "-".into(), "-".into()), |c| {
                (
                    format!("{:.2}", c.rate_ratio),
                    format!("{:.2}", c.cpu_ratio),
                    c.held.to_string(),
                )
            })
        });
        writeln!(
            f,
            "ordering cost: per-message {} of unordered rate, batch {}; CPU per 1,000 messages: \
             per-message {} of unordered, batch {}",
            per_message.0, batch.0, per_message.1, batch.1
        )?;
        writeln!(
            f,
            "held behind a failed message of their key (median per run): per-message {}, batch {}",
            per_message.2, batch.2
        )
    }

    /// Whether every database-backed run passed its exactly-once check.
    pub fn exactly_once(&self) -> bool {
        self.modes.iter().all(|m| m.exactly_once != Some(false))
    }

    /// The machine-readable summary (`--json`).
    pub fn json(&self) -> serde_json::Value {
        let ceiling = self.rate(Mode::Ceiling);
        let textbook = self.rate(Mode::Textbook);
        let batch = self.rate(Mode::Batch);
        let per_message = self.rate(Mode::PerMessage);
        let batch_mode = self.find(Mode::Batch.name()).cloned().unwrap_or_default();
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        serde_json::json!({
            "ceiling_msgs_per_s": ceiling,
            "textbook_msgs_per_s": textbook,
            "inbox_msgs_per_s": batch,
            "per_message_msgs_per_s": per_message,
            "ratio_vs_ceiling": ratio(batch, ceiling),
            "ratio_per_message_vs_ceiling": ratio(per_message, ceiling),
            "ratio_vs_textbook": ratio(batch, textbook),
            "p50_ms": batch_mode.p50_ms,
            "p99_ms": batch_mode.p99_ms,
            "peak_rss_mb": self.modes.iter().map(|m| m.peak_rss_mb).fold(0.0, f64::max),
            "exactly_once": self.exactly_once(),
            "prefilled": self.modes.iter().filter_map(|m| m.prefilled.as_ref()).collect::<Vec<_>>(),
            "ordering_cost": {
                "per_message": self.ordering_cost(Mode::PerMessageOrdered),
                "batch": self.ordering_cost(Mode::BatchOrdered),
            },
            "modes": self.modes,
        })
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ceiling = self.rate(Mode::Ceiling);
        let textbook = self.rate(Mode::Textbook);
        writeln!(f, "{}", self.setup)?;
        writeln!(
            f,
            "| {:<62} | {:>9} | {:>10} | {:>11} | {:>7} | {:>7} | {:>8} | {:>12} | {:>29} | {:>10} |",
            "mode",
            "msgs/s",
            "x ceiling",
            "x textbook",
            "p50 ms",
            "p99 ms",
            "peak MiB",
            "exactly-once",
            "cpu ms/1k: app/pg/mq = all",
            "cores busy"
        )?;
        writeln!(
            f,
            "|{}|{}|{}|{}|{}|{}|{}|{}|{}|{}|",
            "-".repeat(64),
            "-".repeat(11),
            "-".repeat(12),
            "-".repeat(13),
            "-".repeat(9),
            "-".repeat(9),
            "-".repeat(10),
            "-".repeat(14),
            "-".repeat(31),
            "-".repeat(12)
        )?;
        for m in &self.modes {
            let ratio = |base: f64| {
                if base > 0.0 {
                    format!("{:.2}", m.msgs_per_s / base)
                } else {
                    "-".into()
                }
            };
            writeln!(
                f,
                "| {:<62} | {:>9.0} | {:>10} | {:>11} | {:>7.2} | {:>7.2} | {:>8.1} | {:>12} | {:>29} | {:>10} |",
                m.mode,
                m.msgs_per_s,
                ratio(ceiling),
                ratio(textbook),
                m.p50_ms,
                m.p99_ms,
                m.peak_rss_mb,
                match m.exactly_once {
                    None => "n/a",
                    Some(true) => "yes",
                    Some(false) => "NO",
                },
                format!(
                    "{:.0} / {:.0} / {:.0} = {:.0}",
                    m.cpu_ms_per_1k.consumer,
                    m.cpu_ms_per_1k.postgres,
                    m.cpu_ms_per_1k.broker,
                    m.cpu_ms_per_1k.total
                ),
                if m.cores_busy > 0.0 {
                    format!("{:.0}%", m.cores_busy * 100.0)
                } else {
                    "-".into()
                }
            )?;
        }
        self.write_ordering_cost(f)
    }
}
