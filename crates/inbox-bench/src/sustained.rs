//! The sustained-rate benchmark: the highest publish rate a library mode keeps up with for a
//! set time, found by probing and then held, beside the mode's drain rate measured in the same
//! run.
//!
//! A rate is *sustained* over a window when
//! - the publisher sent at least 98% of what the rate asks for (below that this machine cannot
//!   publish so fast beside the consumer, and the rate is not the consumer's to claim);
//! - after the first tenth of the window (warm-up), the backlog (published, not yet settled)
//!   never exceeds two seconds of publishing: it does not grow without bound;
//! - at the window's end the backlog is at most one second of publishing.
//!
//! Every window runs a fresh consumer on the run's inbox and queue, so the latency figures
//! cover that window's rate alone; between windows the backlog drains.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use hdrhistogram::Histogram;
use rabbit_inbox::{
    BatchError, BatchHandler, Consumer, Handler, HandlerError, InboxMessage, broker::Broker,
    broker::OutgoingMessage, envelope::AGGREGATE_ID_HEADER, ordering::OrderingPolicy,
    stats::ConsumerStats,
};
use serde::Serialize;
use serde_json::json;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use crate::{
    BenchError, BenchOptions, CpuShare, Mode, Target, fresh_topology, library_config, median,
    procfs, run_once, settle_then_stop,
    workload::{self, BatchEffect, History, PerMessageEffect, Workload},
};

/// What to measure.
#[derive(Clone, Debug)]
pub struct SustainedOptions {
    /// Payload, consumer settings, queue kind, schema and queue names; `modes` names the
    /// library modes to measure (none named: per-message and batch); `messages` is the size of
    /// the drain run; `runs` the repetitions (figures are medians).
    pub bench: BenchOptions,
    /// How long the found rate must hold.
    pub hold: Duration,
    /// Length of each probe of the search.
    pub probe: Duration,
    /// Most probes per search.
    pub probes: usize,
}

/// One mode's figures, medians of the runs.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SustainedResult {
    /// Name shown in the table.
    pub mode: String,
    /// Drain rate (a full queue consumed), msgs/s.
    pub drain_msgs_per_s: f64,
    /// The highest rate held for the whole hold window, msgs/s.
    pub sustained_msgs_per_s: f64,
    /// Each run's sustained rate, in run order (to show the spread).
    pub sustained_runs: Vec<f64>,
    /// Sustained over drain, median of the runs' ratios.
    pub ratio_vs_drain: f64,
    /// Delivery-to-ack latency at the sustained rate, ms.
    pub p50_ms: f64,
    /// 99th percentile of the same, ms.
    pub p99_ms: f64,
    /// Publish-to-handler latency at the sustained rate (queue wait included), ms.
    pub e2e_p50_ms: f64,
    /// 99th percentile of the same, ms.
    pub e2e_p99_ms: f64,
    /// Largest backlog after warm-up in the hold window, messages.
    pub max_backlog: u64,
    /// Messages published in the hold window.
    pub hold_messages: u64,
    /// CPU per 1,000 messages in the hold window (the publisher counts with the consumer).
    pub cpu_ms_per_1k: CpuShare,
    /// Every run's hold window met the criterion (a failed hold is retried 10% lower, twice).
    pub held_every_run: bool,
    /// Runs whose search met the publisher's limit (it fell behind a higher rate while the
    /// consumer kept pace with what it published): their figure is what this machine can
    /// publish and consume at once, a lower bound of the consumer's own.
    pub publisher_bound_runs: usize,
    /// Exactly-once checked from the database after every run.
    pub exactly_once: bool,
}

/// All figures of a sustained-rate benchmark.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SustainedReport {
    /// The options' summary line.
    pub setup: String,
    /// The broker ceiling's drain rate (consume and multiple-ack, no database), msgs/s, median
    /// of one drain run per round: the baseline of the ratios.
    pub ceiling_msgs_per_s: f64,
    /// One entry per mode.
    pub modes: Vec<SustainedResult>,
}

impl SustainedReport {
    /// Whether every run passed its exactly-once check.
    pub fn exactly_once(&self) -> bool {
        self.modes.iter().all(|m| m.exactly_once)
    }
}

/// Runs the benchmark. `progress` gets a line per probe and per hold.
pub async fn run(
    amqp_url: &str,
    pool: &PgPool,
    options: &SustainedOptions,
    mut progress: impl FnMut(&str),
) -> Result<SustainedReport, BenchError> {
    let modes = sustained_modes(&options.bench)?;
    if options.bench.messages < 1000 || options.probes == 0 {
        return Err(BenchError::Invalid(
            "the drain run needs at least 1,000 messages and the search at least one probe".into(),
        ));
    }
    if options.hold < Duration::from_secs(5) || options.probe < Duration::from_secs(2) {
        return Err(BenchError::Invalid(
            "hold at least 5 s and probe at least 2 s: shorter windows measure the warm-up".into(),
        ));
    }
    let broker = Broker::connect(amqp_url, "inbox-bench-sustained").await?;
    let mut runs: Vec<Vec<RunFigures>> = vec![Vec::new(); modes.len()];
    let mut ceiling = Vec::new();
    for round in 0..options.bench.runs.max(1) {
        // The baseline of the round: the broker alone draining the same workload.
        let workload = drain_workload(&options.bench, round);
        let schema = Target::Fresh(&options.bench.schema);
        let run = run_once(
            amqp_url,
            pool,
            &broker,
            &options.bench,
            Mode::Ceiling,
            &workload,
            schema,
        )
        .await?;
        ceiling.push(options.bench.messages as f64 / run.elapsed.as_secs_f64());
        progress(&format!(
            "  run {}: {:<40} drain {:>7.0} msgs/s",
            round + 1,
            "broker ceiling",
            ceiling[round]
        ));
        for (mode, figures) in modes.iter().zip(&mut runs) {
            let previous = figures.last().map(|f| f.sustained);
            let run = one_run(
                amqp_url,
                pool,
                &broker,
                options,
                *mode,
                round,
                previous,
                &mut progress,
            )
            .await?;
            progress(&format!(
                "  run {}: {:<40} drain {:>7.0} msgs/s, sustained {:>7.0} msgs/s ({:.2}x){}",
                round + 1,
                mode.name(),
                run.drain,
                run.sustained,
                run.sustained / run.drain.max(f64::MIN_POSITIVE),
                match (run.window.sustained, run.publisher_bound) {
                    (false, _) => ", hold FAILED",
                    (true, true) => ", bound by the publisher",
                    (true, false) => "",
                }
            ));
            figures.push(run);
        }
    }
    broker.close().await;
    rabbit_inbox::schema::drop_schema(pool, &options.bench.schema).await?;
    Ok(SustainedReport {
        setup: setup_line(options),
        ceiling_msgs_per_s: median(ceiling),
        modes: modes
            .iter()
            .zip(runs)
            .map(|(mode, runs)| summarize(*mode, runs))
            .collect(),
    })
}

/// The library modes `options.modes` names (none: per-message and batch).
fn sustained_modes(options: &BenchOptions) -> Result<Vec<Mode>, BenchError> {
    let library = [
        Mode::PerMessage,
        Mode::Batch,
        Mode::PerMessageOrdered,
        Mode::BatchOrdered,
    ];
    if options.modes.is_empty() {
        return Ok(vec![Mode::PerMessage, Mode::Batch]);
    }
    if options.keys == 0
        && options
            .modes
            .iter()
            .any(|m| m == Mode::PerMessageOrdered.slug() || m == Mode::BatchOrdered.slug())
    {
        return Err(BenchError::Invalid(
            "the ordered modes order by aggregate: set --keys above 0".into(),
        ));
    }
    options
        .modes
        .iter()
        .map(|name| {
            library
                .into_iter()
                .find(|m| m.slug() == name)
                .ok_or_else(|| {
                    BenchError::Invalid(format!(
                        "the sustained-rate benchmark measures the library's consumers: {name} is \
                         not one of per-message, batch, per-message-ordered, batch-ordered"
                    ))
                })
        })
        .collect()
}

fn setup_line(options: &SustainedOptions) -> String {
    let bench = &options.bench;
    let library = library_config(bench);
    format!(
        "drain runs of {} messages of {} bytes; search: up to {} probes of {} s; hold {} s; {} \
         queues; rabbit-inbox batch {} x {} lanes, prefetch {}; median of {} run(s)",
        bench.messages,
        bench.payload_size,
        options.probes,
        options.probe.as_secs(),
        options.hold.as_secs(),
        if bench.quorum { "quorum" } else { "classic" },
        library.batch_size,
        library.lanes,
        library.prefetch,
        bench.runs.max(1)
    )
}

#[derive(Clone)]
struct RunFigures {
    drain: f64,
    /// A rate above the sustained one failed only because the publisher fell behind.
    publisher_bound: bool,
    sustained: f64,
    window: Window,
    exactly_once: bool,
}

/// The drain runs' workload of a round: the same for the ceiling and every mode.
fn drain_workload(bench: &BenchOptions, round: usize) -> Workload {
    Workload::new(
        bench.messages,
        bench.payload_size,
        0.0,
        0.0,
        bench.keys,
        0x5000 + round as u64,
    )
}

/// One run of one mode: the drain run, the search, the hold, the exactly-once check.
#[allow(clippy::too_many_arguments)]
async fn one_run(
    amqp_url: &str,
    pool: &PgPool,
    broker: &Broker,
    options: &SustainedOptions,
    mode: Mode,
    round: usize,
    previous: Option<f64>,
    progress: &mut impl FnMut(&str),
) -> Result<RunFigures, BenchError> {
    let bench = &options.bench;
    let schema = &bench.schema;
    let workload = drain_workload(bench, round);
    let drain_run = run_once(
        amqp_url,
        pool,
        broker,
        bench,
        mode,
        &workload,
        Target::Fresh(schema),
    )
    .await?;
    let drain = bench.messages as f64 / drain_run.elapsed.as_secs_f64();

    workload::reset_schema(pool, schema).await?;
    let topology = fresh_topology(broker, bench, &format!("{}-sustained", mode.slug())).await?;
    let publisher = Broker::connect(amqp_url, "inbox-bench-sustained-publisher").await?;
    let stream = Stream {
        amqp_url,
        pool,
        publisher: &publisher,
        queue: &topology.queue,
        options: bench,
        mode,
        id_prefix: format!("s{round}-{}", mode.slug()),
        keys: bench.keys,
        payload_size: bench.payload_size,
        next_seq: Arc::new(AtomicU64::new(0)),
        clock: Clock::new(),
        topology: topology.clone(),
    };

    // Up by 15% while probes pass, down by 15% while they fail, then one bisection between
    // the last pass and the first fail. A later run starts where the run before it ended.
    let mut rate = previous.unwrap_or(drain * 0.7).max(1.0);
    let mut publisher_bound = false;
    let (mut passed, mut failed): (Option<f64>, Option<f64>) = (None, None);
    for _ in 0..options.probes {
        let w = stream.window(rate, options.probe).await?;
        progress(&format!(
            "    probe {:<36} {}",
            mode.name(),
            w.describe(rate)
        ));
        if w.sustained {
            passed = Some(passed.map_or(rate, |p: f64| p.max(rate)));
        } else {
            failed = Some(failed.map_or(rate, |f: f64| f.min(rate)));
            publisher_bound |= w.publisher_bound();
        }
        rate = match (passed, failed) {
            (Some(p), Some(f)) if f / p <= 1.05 => break,
            (Some(p), Some(f)) => (p + f) / 2.0,
            (Some(p), None) => p * 1.15,
            (None, Some(f)) => f / 1.15,
            (None, None) => unreachable!("a probe either passes or fails"),
        };
        // Past what this machine can publish beside the consumer, probing higher is moot.
        if w.publisher_bound() {
            rate = rate.min(w.achieved() * 0.97);
        }
    }
    // A failed hold is tried again 10% lower, at most twice.
    let mut rate = passed.unwrap_or(rate);
    let mut attempts = 0;
    let hold = loop {
        let hold = stream.window(rate, options.hold).await?;
        progress(&format!(
            "    hold  {:<36} {}",
            mode.name(),
            hold.describe(rate)
        ));
        attempts += 1;
        if hold.sustained || attempts == 3 {
            break hold;
        }
        publisher_bound |= hold.publisher_bound();
        rate = if hold.publisher_bound() {
            (rate * 0.9).min(hold.achieved() * 0.97)
        } else {
            rate * 0.9
        };
    };
    let exactly_once = stream.exactly_once().await?;
    publisher.close().await;
    broker
        .delete(&topology, &library_config(bench).retry)
        .await?;
    Ok(RunFigures {
        drain,
        sustained: if hold.sustained { rate } else { 0.0 },
        publisher_bound,
        window: hold,
        exactly_once,
    })
}

/// The run's message stream: one queue and inbox, message ids numbered across windows.
struct Stream<'a> {
    amqp_url: &'a str,
    pool: &'a PgPool,
    publisher: &'a Broker,
    queue: &'a str,
    options: &'a BenchOptions,
    mode: Mode,
    id_prefix: String,
    keys: usize,
    payload_size: usize,
    next_seq: Arc<AtomicU64>,
    clock: Clock,
    topology: rabbit_inbox::Topology,
}

/// What one window measured.
#[derive(Clone, Debug, Default)]
struct Window {
    duration: Duration,
    published: u64,
    asked: u64,
    max_backlog: u64,
    end_backlog: u64,
    sustained: bool,
    p50_ms: f64,
    p99_ms: f64,
    e2e_p50_ms: f64,
    e2e_p99_ms: f64,
    cpu: CpuShare,
}

impl Window {
    /// What the publisher managed, msgs/s.
    fn achieved(&self) -> f64 {
        self.published as f64 / self.duration.as_secs_f64()
    }

    /// The consumer kept pace with everything published, but the publisher fell behind the
    /// rate: the limit is this machine's publishing beside the consumer, not the consumer.
    fn publisher_bound(&self) -> bool {
        !self.sustained
            && (self.published as f64) < 0.98 * self.asked as f64
            && (self.max_backlog as f64) <= 2.0 * self.achieved()
            && (self.end_backlog as f64) <= self.achieved()
    }

    fn describe(&self, rate: f64) -> String {
        format!(
            "{:>7.0} msgs/s: {} (published {} of {}, backlog max {} / end {}, e2e p99 {:.0} ms)",
            rate,
            if self.sustained {
                "held"
            } else if self.publisher_bound() {
                "NOT held, the publisher fell behind"
            } else {
                "NOT held"
            },
            self.published,
            self.asked,
            self.max_backlog,
            self.end_backlog,
            self.e2e_p99_ms
        )
    }
}

impl Stream<'_> {
    /// Publishes at `rate` for `duration` into a fresh consumer, then lets the backlog drain.
    async fn window(&self, rate: f64, duration: Duration) -> Result<Window, BenchError> {
        self.clock.reset();
        let (consumer_task, stats, stop) = self.start_consumer()?;
        let published = Arc::new(AtomicU64::new(0));
        let cpu_before = procfs::CpuTicks::now();
        let started = Instant::now();
        let publisher = self.publish_at(rate, duration, published.clone());
        let sampler = async {
            let (mut max_backlog, warm_up) = (0, duration / 10);
            while started.elapsed() < duration {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let backlog = published
                    .load(Ordering::Relaxed)
                    .saturating_sub(stats.settled());
                if started.elapsed() > warm_up {
                    max_backlog = max_backlog.max(backlog);
                }
            }
            max_backlog
        };
        let (sent, max_backlog) = tokio::join!(publisher, sampler);
        let sent = sent?;
        let end_backlog = sent.saturating_sub(stats.settled());
        let cpu = procfs::CpuTicks::now().per_thousand(cpu_before, sent as usize);
        // The backlog drains at about the drain rate; a window is never longer than a hold.
        let deadline = Instant::now() + duration * 2 + Duration::from_secs(60);
        if !settle_then_stop(&stats, consumer_task, stop, sent, deadline).await? {
            return Err(BenchError::Timeout(self.mode.name(), deadline - started));
        }
        let asked = (rate * duration.as_secs_f64()) as u64;
        let s = stats.snapshot();
        let (e2e_p50_ms, e2e_p99_ms) = self.clock.quantiles();
        Ok(Window {
            duration,
            published: sent,
            asked,
            max_backlog,
            end_backlog,
            sustained: sent as f64 >= 0.98 * asked as f64
                && (max_backlog as f64) <= 2.0 * rate
                && (end_backlog as f64) <= rate,
            p50_ms: crate::ms(s.latency_p50),
            p99_ms: crate::ms(s.latency_p99),
            e2e_p50_ms,
            e2e_p99_ms,
            cpu,
        })
    }

    /// Publishes on a schedule: every 5 ms, what the rate asks for by then (in batches the
    /// broker confirms), so a slow confirm is caught up instead of lowering the rate.
    async fn publish_at(
        &self,
        rate: f64,
        duration: Duration,
        published: Arc<AtomicU64>,
    ) -> Result<u64, BenchError> {
        let started = Instant::now();
        let mut ticker = tokio::time::interval(Duration::from_millis(5));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut sent = 0u64;
        loop {
            ticker.tick().await;
            let elapsed = started.elapsed().min(duration);
            let due = (rate * elapsed.as_secs_f64()) as u64;
            let count = due.saturating_sub(sent).min(2000);
            if count > 0 {
                let messages: Vec<OutgoingMessage> = (0..count).map(|_| self.next()).collect();
                let batch: Vec<(&str, &OutgoingMessage)> =
                    messages.iter().map(|m| (self.queue, m)).collect();
                self.publisher.publish_batch("", &batch).await?;
                sent += count;
                published.store(sent, Ordering::Relaxed);
            }
            if started.elapsed() >= duration {
                return Ok(sent);
            }
        }
    }

    /// The next message of the stream, stamped with its publish time.
    fn next(&self) -> OutgoingMessage {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}-{seq}", self.id_prefix);
        let sent_us = self.clock.now_us();
        let body = json!({"seq": seq, "id": id, "fail": false, "sent_us": sent_us, "pad": ""});
        let pad = "x".repeat(self.payload_size.saturating_sub(body.to_string().len()));
        let mut message = OutgoingMessage {
            message_id: Some(id.clone()),
            kind: Some("BenchEvent".into()),
            body: json!({"seq": seq, "id": id, "fail": false, "sent_us": sent_us, "pad": pad})
                .to_string()
                .into_bytes(),
            ..OutgoingMessage::default()
        };
        if self.keys > 0 {
            message.headers.insert(
                AGGREGATE_ID_HEADER.into(),
                json!((seq % self.keys as u64).to_string()),
            );
        }
        message
    }

    #[allow(clippy::type_complexity)]
    fn start_consumer(
        &self,
    ) -> Result<
        (
            tokio::task::JoinHandle<Result<(), rabbit_inbox::ConsumerError>>,
            Arc<ConsumerStats>,
            tokio::sync::oneshot::Sender<()>,
        ),
        BenchError,
    > {
        let mut config = library_config(self.options);
        config.schema = self.options.schema.clone();
        config.topology = self.topology.clone();
        if self.mode.ordered() {
            config.ordering = Some(OrderingPolicy::by_aggregate());
        }
        let history = History::new(&config.schema);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stopped = async {
            let _ = stopped.await;
        };
        let clock = self.clock.clone();
        let (task, stats) = match self.mode {
            Mode::PerMessage | Mode::PerMessageLate | Mode::PerMessageOrdered => {
                let effect = PerMessageEffect {
                    history,
                    late: self.mode == Mode::PerMessageLate,
                };
                let handler = Timed(effect, clock);
                let c = Consumer::new(self.amqp_url, self.pool.clone(), config, handler)?;
                let stats = c.stats();
                (tokio::spawn(c.run(stopped)), stats)
            }
            _ => {
                let handler = Timed(BatchEffect(history), clock);
                let c = Consumer::with_batch_handler(
                    self.amqp_url,
                    self.pool.clone(),
                    config,
                    handler,
                )?;
                let stats = c.stats();
                (tokio::spawn(c.run(stopped)), stats)
            }
        };
        Ok((task, stats, stop))
    }

    /// Every message of the run applied exactly once and recorded PROCESSED.
    async fn exactly_once(&self) -> Result<bool, BenchError> {
        let schema = &self.options.schema;
        let (rows, distinct, processed): (i64, i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM \"{schema}\".bench_history), \
                    (SELECT count(DISTINCT message_id) FROM \"{schema}\".bench_history), \
                    (SELECT count(*) FROM \"{schema}\".message_inbox WHERE status = 'PROCESSED')"
        )))
        .fetch_one(self.pool)
        .await?;
        let sent = i64::try_from(self.next_seq.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
        let passed = rows == sent && distinct == sent && processed == sent;
        if !passed {
            tracing::error!(
                "exactly-once check failed in schema {schema}: {sent} published, {rows} effects \
                 ({distinct} distinct), {processed} PROCESSED rows"
            );
        }
        Ok(passed)
    }
}

/// Publish-to-handler latency: the publisher stamps each body with microseconds since the
/// clock's origin; the handler records the difference (both run in this process).
#[derive(Clone)]
struct Clock {
    origin: Instant,
    histogram: Arc<Mutex<Histogram<u64>>>,
}

impl Clock {
    fn new() -> Self {
        Self {
            origin: Instant::now(),
            histogram: Arc::new(Mutex::new(crate::baseline::histogram())),
        }
    }

    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64
    }

    fn reset(&self) {
        self.histogram.lock().expect("histogram lock").reset();
    }

    fn record(&self, msg: &InboxMessage<'_>) {
        if let Some(sent) = msg.envelope().payload["sent_us"].as_u64() {
            let _ = self
                .histogram
                .lock()
                .expect("histogram lock")
                .record(self.now_us().saturating_sub(sent).max(1));
        }
    }

    fn quantiles(&self) -> (f64, f64) {
        let h = self.histogram.lock().expect("histogram lock");
        (
            h.value_at_quantile(0.5) as f64 / 1000.0,
            h.value_at_quantile(0.99) as f64 / 1000.0,
        )
    }
}

/// A benchmark effect that first records the message's publish-to-handler latency.
struct Timed<E>(E, Clock);

impl<E: Handler> Handler for Timed<E> {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        self.1.record(msg);
        self.0.handle(msg, tx).await
    }

    fn check(&self, msg: &InboxMessage<'_>) -> Result<(), HandlerError> {
        self.0.check(msg)
    }
}

impl<E: BatchHandler> BatchHandler for Timed<E> {
    async fn handle_batch(
        &self,
        msgs: &[InboxMessage<'_>],
        tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        for m in msgs {
            self.1.record(m);
        }
        self.0.handle_batch(msgs, tx).await
    }
}

fn summarize(mode: Mode, runs: Vec<RunFigures>) -> SustainedResult {
    let of = |f: fn(&RunFigures) -> f64| median(runs.iter().map(f).collect());
    SustainedResult {
        mode: mode.name().to_owned(),
        drain_msgs_per_s: of(|r| r.drain),
        sustained_msgs_per_s: of(|r| r.sustained),
        sustained_runs: runs.iter().map(|r| r.sustained).collect(),
        ratio_vs_drain: of(|r| r.sustained / r.drain.max(f64::MIN_POSITIVE)),
        p50_ms: of(|r| r.window.p50_ms),
        p99_ms: of(|r| r.window.p99_ms),
        e2e_p50_ms: of(|r| r.window.e2e_p50_ms),
        e2e_p99_ms: of(|r| r.window.e2e_p99_ms),
        max_backlog: of(|r| r.window.max_backlog as f64) as u64,
        hold_messages: of(|r| r.window.published as f64) as u64,
        cpu_ms_per_1k: CpuShare::new(
            of(|r| r.window.cpu.consumer),
            of(|r| r.window.cpu.postgres),
            of(|r| r.window.cpu.broker),
        ),
        held_every_run: runs.iter().all(|r| r.window.sustained),
        publisher_bound_runs: runs.iter().filter(|r| r.publisher_bound).count(),
        exactly_once: runs.iter().all(|r| r.exactly_once),
    }
}

impl std::fmt::Display for SustainedReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.setup)?;
        writeln!(
            f,
            "broker ceiling (consume + multiple-ack, no db), drain: {:.0} msgs/s",
            self.ceiling_msgs_per_s
        )?;
        writeln!(
            f,
            "| {:<40} | {:>8} | {:>10} | {:>8} | {:>9} | {:>15} | {:>15} | {:>11} | {:>25} | {:>5} | {:>5} |",
            "mode",
            "drain/s",
            "sustained/s",
            "x drain",
            "x ceiling",
            "ack p50/p99 ms",
            "e2e p50/p99 ms",
            "max backlog",
            "cpu ms/1k app/pg/mq = all",
            "held",
            "once"
        )?;
        writeln!(f, "|{}|", ["-"; 11].join("|"))?;
        for m in &self.modes {
            writeln!(
                f,
                "| {:<40} | {:>8.0} | {:>10.0} | {:>8.2} | {:>9.2} | {:>15} | {:>15} | {:>11} | {:>25} | {:>5} | {:>5} |",
                m.mode,
                m.drain_msgs_per_s,
                m.sustained_msgs_per_s,
                m.ratio_vs_drain,
                m.sustained_msgs_per_s / self.ceiling_msgs_per_s.max(f64::MIN_POSITIVE),
                format!("{:.1} / {:.1}", m.p50_ms, m.p99_ms),
                format!("{:.1} / {:.1}", m.e2e_p50_ms, m.e2e_p99_ms),
                m.max_backlog,
                format!(
                    "{:.0} / {:.0} / {:.0} = {:.0}",
                    m.cpu_ms_per_1k.consumer,
                    m.cpu_ms_per_1k.postgres,
                    m.cpu_ms_per_1k.broker,
                    m.cpu_ms_per_1k.total
                ),
                if m.held_every_run { "yes" } else { "NO" },
                if m.exactly_once { "yes" } else { "NO" }
            )?;
        }
        for m in &self.modes {
            let runs: Vec<String> = m.sustained_runs.iter().map(|r| format!("{r:.0}")).collect();
            writeln!(
                f,
                "sustained msgs/s by run, {}: {}{}",
                m.mode,
                runs.join(", "),
                match m.publisher_bound_runs {
                    0 => String::new(),
                    n => format!(
                        " ({n} bound by the publisher: it fell behind a higher rate while the \
                         consumer kept pace)"
                    ),
                }
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_named_mode_measures_both_handlers_and_a_baseline_is_refused() {
        let mut options = BenchOptions {
            messages: 1000,
            payload_size: 320,
            duplicate_share: 0.0,
            failure_share: 0.0,
            keys: 0,
            batch_size: None,
            lanes: None,
            prefetch: None,
            ceiling_prefetch: 1000,
            ceiling_ack_every: 250,
            runs: 1,
            low_load_rate: 0,
            low_load_duration: Duration::from_secs(1),
            prefill: Vec::new(),
            modes: Vec::new(),
            schema: rabbit_inbox::SchemaName::new("unused").expect("valid"),
            queue_prefix: "unused".into(),
            quorum: false,
        };
        assert_eq!(
            sustained_modes(&options).expect("defaults"),
            vec![Mode::PerMessage, Mode::Batch]
        );
        options.modes = vec!["ceiling".into()];
        assert!(sustained_modes(&options).is_err());
        // The ordered modes need aggregate ids to order by.
        options.modes = vec!["batch-ordered".into()];
        assert!(sustained_modes(&options).is_err());
        options.keys = 997;
        assert_eq!(
            sustained_modes(&options).expect("named"),
            vec![Mode::BatchOrdered]
        );
    }
}
