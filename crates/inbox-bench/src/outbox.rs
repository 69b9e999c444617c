//! The outbox benchmark behind `inbox-lab bench --modes outbox`: in one process, on one queue,
//! the same messages go out
//!
//! - through a plain confirmed publisher (the baseline: `Broker::publish_batch`, 512 confirms
//!   in flight, no database);
//! - through the outbox: writer tasks commit transactions that enqueue the messages, an
//!   in-process [`Relay`] publishes them, woken by NOTIFY;
//! - the same with NOTIFY off and the relay polling every 100 ms;
//! - both again at a low rate (one message per transaction, 50 per second), where the relay
//!   is idle between commits and the latency is the wake-up's;
//! - the writers alone, no relay running (their commit rate: what the end-to-end rate can at
//!   most be), then a relay draining what they left: its rate, and the CPU per 1,000 messages
//!   of this process (the relay and the receiving consumer), PostgreSQL and RabbitMQ;
//!
//! each received by one consumer, which records when every message arrived: throughput, and
//! handoff-to-delivery latency (from the publish call, or from the enqueuing commit). Then
//! the commit throughput of small outbox transactions with and without NOTIFY, no relay
//! running: PostgreSQL serializes the commits of notifying transactions on one lock.

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use futures::StreamExt;
use lapin::{
    Connection, ConnectionProperties,
    options::{BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};
use rabbit_inbox::{
    OutboxMessage, Relay, RelayConfig, RetryPolicy, SchemaName, Topology, broker::Broker,
    broker::OutgoingMessage,
};
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgPool};

use crate::{
    BenchError,
    baseline::histogram,
    procfs::{CpuShare, CpuTicks},
};

/// What the outbox benchmark measures.
#[derive(Clone, Debug)]
pub struct OutboxOptions {
    /// Messages per mode.
    pub messages: usize,
    /// Body size in bytes.
    pub payload_size: usize,
    /// Concurrent writer transactions.
    pub writers: usize,
    /// Messages enqueued per writer transaction.
    pub per_transaction: usize,
    /// Repetitions; the table shows medians.
    pub runs: usize,
    /// Schema (recreated).
    pub schema: SchemaName,
    /// Queue name (recreated, deleted at the end).
    pub queue: String,
}

/// One mode's figures.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OutboxMode {
    /// Mode name.
    pub mode: String,
    /// Messages per second, handoff of the first to arrival of the last.
    pub msgs_per_s: f64,
    /// Median handoff-to-delivery latency, milliseconds.
    pub p50_ms: f64,
    /// 99th percentile, milliseconds.
    pub p99_ms: f64,
    /// Messages that arrived more than once.
    pub duplicates: u64,
    /// Messages that did not arrive.
    pub missing: u64,
    /// CPU milliseconds per 1,000 messages (the drain only: nothing else runs meanwhile).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_ms_per_1k: Option<CpuShare>,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct OutboxReport {
    /// Messages per mode.
    pub messages: usize,
    /// Writers and messages per transaction.
    pub writers: usize,
    /// Messages per transaction.
    pub per_transaction: usize,
    /// Medians per mode, the baseline first; "writers alone, no relay" is the commit rate of
    /// the NOTIFY mode's writers with no relay running.
    pub modes: Vec<OutboxMode>,
    /// Commits per second of one-message outbox transactions, NOTIFY on.
    pub commits_per_s_notify: f64,
    /// The same with NOTIFY off.
    pub commits_per_s_quiet: f64,
}

impl OutboxReport {
    /// Every message of every mode arrived exactly once.
    pub fn exactly_once(&self) -> bool {
        self.modes
            .iter()
            .all(|m| m.duplicates == 0 && m.missing == 0)
    }
}

impl fmt::Display for OutboxReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let base = self.modes.first().map_or(0.0, |m| m.msgs_per_s);
        writeln!(
            f,
            "outbox: {} messages per mode, {} writers x {} messages per transaction (medians)",
            self.messages, self.writers, self.per_transaction
        )?;
        writeln!(
            f,
            "{:<32} {:>10} {:>9} {:>9} {:>9} {:>6}",
            "mode", "msgs/s", "vs plain", "p50 ms", "p99 ms", "dup"
        )?;
        for m in &self.modes {
            let (rate, ratio) = if m.msgs_per_s > 0.0 && base > 0.0 {
                (
                    format!("{:.0}", m.msgs_per_s),
                    format!("{:.2}x", m.msgs_per_s / base),
                )
            } else {
                ("-".to_owned(), "-".to_owned())
            };
            writeln!(
                f,
                "{:<32} {:>10} {:>9} {:>9.1} {:>9.1} {:>6}{}{}",
                m.mode,
                rate,
                ratio,
                m.p50_ms,
                m.p99_ms,
                m.duplicates,
                if m.missing > 0 {
                    format!("  MISSING {}", m.missing)
                } else {
                    String::new()
                },
                m.cpu_ms_per_1k.map_or(String::new(), |c| format!(
                    "  cpu ms/1k: this process {:.0} / pg {:.0} / mq {:.0} = {:.0}",
                    c.consumer, c.postgres, c.broker, c.total
                ))
            )?;
        }
        let find = |name: &str| self.modes.iter().find(|m| m.mode == name);
        let relayed = find(NOTIFY_MODE).map_or(0.0, |m| m.msgs_per_s);
        let writers = find(WRITERS_MODE);
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        writeln!(
            f,
            "end to end with NOTIFY: {:.2}x the plain publisher, {:.2}x the writers alone",
            ratio(relayed, base),
            ratio(relayed, writers.map_or(0.0, |w| w.msgs_per_s)),
        )?;
        // What writers and relay at once can reach when the machine's cores are the limit.
        let both = writers
            .and_then(|w| w.cpu_ms_per_1k)
            .zip(find(DRAIN_MODE).and_then(|m| m.cpu_ms_per_1k))
            .map(|(w, r)| w.total + r.total);
        if let Some(both) = both.filter(|b| *b > 0.0) {
            let allowed = crate::procfs::cores() * 1000.0 * 1000.0 / both;
            writeln!(
                f,
                "writers + relay: {both:.0} cpu ms per 1k messages; {:.0} cores allow {allowed:.0} msgs/s; end to end {:.2}x of that",
                crate::procfs::cores(),
                ratio(relayed, allowed)
            )?;
        }
        let ratio = if self.commits_per_s_quiet > 0.0 {
            self.commits_per_s_notify / self.commits_per_s_quiet
        } else {
            0.0
        };
        write!(
            f,
            "commit throughput, 1 message per transaction, {} writers: NOTIFY on {:.0} tx/s, off {:.0} tx/s ({ratio:.2}x)",
            self.writers, self.commits_per_s_notify, self.commits_per_s_quiet
        )
    }
}

/// Arrival times by message id, filled by the receiving consumer.
type Arrivals = Arc<Mutex<HashMap<String, (Instant, u32)>>>;

async fn receive(
    amqp_url: &str,
    queue: &str,
    arrivals: Arrivals,
) -> Result<(Connection, tokio::task::JoinHandle<()>), BenchError> {
    let conn = Connection::connect(
        crate::baseline::first_url(amqp_url),
        ConnectionProperties::default(),
    )
    .await?;
    let channel = conn.create_channel().await?;
    channel.basic_qos(2000, BasicQosOptions::default()).await?;
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let task = tokio::spawn(async move {
        while let Some(Ok(delivery)) = consumer.next().await {
            let now = Instant::now();
            if let Some(id) = delivery.properties.message_id() {
                let mut map = arrivals.lock().unwrap_or_else(PoisonError::into_inner);
                map.entry(id.to_string())
                    .and_modify(|(_, n)| *n += 1)
                    .or_insert((now, 1));
            }
        }
    });
    Ok((conn, task))
}

/// Waits until `n` distinct ids arrived (or 120 s), then a little longer for duplicates.
async fn await_arrivals(arrivals: &Arrivals, n: usize) -> Result<(), BenchError> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let got = arrivals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        if got >= n {
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::Timeout("outbox mode", Duration::from_secs(120)));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn figures(mode: &str, handoffs: &HashMap<String, Instant>, arrivals: &Arrivals) -> OutboxMode {
    let map = arrivals.lock().unwrap_or_else(PoisonError::into_inner);
    let mut h = histogram();
    let (mut first, mut last) = (None::<Instant>, None::<Instant>);
    let (mut duplicates, mut missing) = (0, 0);
    for (id, handoff) in handoffs {
        first = Some(first.map_or(*handoff, |f| f.min(*handoff)));
        match map.get(id) {
            Some((at, n)) => {
                last = Some(last.map_or(*at, |l| l.max(*at)));
                h.saturating_record(
                    at.saturating_duration_since(*handoff).as_micros().max(1) as u64
                );
                duplicates += u64::from(*n - 1);
            }
            None => missing += 1,
        }
    }
    let secs = match (first, last) {
        (Some(f), Some(l)) => l.saturating_duration_since(f).as_secs_f64().max(1e-6),
        _ => f64::INFINITY,
    };
    OutboxMode {
        mode: mode.to_owned(),
        msgs_per_s: handoffs.len() as f64 / secs,
        p50_ms: h.value_at_quantile(0.5) as f64 / 1000.0,
        p99_ms: h.value_at_quantile(0.99) as f64 / 1000.0,
        duplicates,
        missing,
        cpu_ms_per_1k: None,
    }
}

fn body(size: usize, n: usize) -> Vec<u8> {
    let mut s = format!("{{\"n\":{n},\"pad\":\"");
    while s.len() + 2 < size {
        s.push('x');
    }
    s.push_str("\"}");
    s.into_bytes()
}

async fn plain(
    amqp_url: &str,
    o: &OutboxOptions,
    run: usize,
    arrivals: &Arrivals,
) -> Result<OutboxMode, BenchError> {
    let broker = Broker::connect(amqp_url, "inbox-bench plain publisher").await?;
    let messages: Vec<OutgoingMessage> = (0..o.messages)
        .map(|i| OutgoingMessage {
            message_id: Some(format!("plain-{run}-{i}")),
            kind: Some("Bench".into()),
            body: body(o.payload_size, i),
            ..OutgoingMessage::default()
        })
        .collect();
    let mut handoffs = HashMap::with_capacity(o.messages);
    // In slices, so a handoff time is close to its publish call.
    for chunk in messages.chunks(512) {
        let now = Instant::now();
        for m in chunk {
            handoffs.insert(m.message_id.clone().unwrap_or_default(), now);
        }
        let batch: Vec<(&str, &OutgoingMessage)> =
            chunk.iter().map(|m| (o.queue.as_str(), m)).collect();
        broker.publish_batch("", &batch).await?;
    }
    broker.close().await;
    await_arrivals(arrivals, o.messages).await?;
    Ok(figures("plain confirmed publisher", &handoffs, arrivals))
}

/// Writers commit the messages through the outbox; returns each message's commit time.
async fn write(
    pool: &PgPool,
    o: &OutboxOptions,
    prefix: &str,
    notify: bool,
    per_transaction: usize,
) -> Result<HashMap<String, Instant>, BenchError> {
    let outbox = rabbit_inbox::Outbox::new(o.schema.clone()).with_notify(notify);
    let per_writer = o.messages.div_ceil(o.writers);
    let mut tasks = Vec::new();
    for w in 0..o.writers {
        let (pool, outbox, queue, prefix) = (
            pool.clone(),
            outbox.clone(),
            o.queue.clone(),
            prefix.to_owned(),
        );
        let size = o.payload_size;
        let count = per_writer.min(o.messages.saturating_sub(w * per_writer));
        tasks.push(tokio::spawn(async move {
            let mut committed = HashMap::with_capacity(count);
            let ids: Vec<String> = (0..count).map(|i| format!("{prefix}-{w}-{i}")).collect();
            for chunk in ids.chunks(per_transaction.max(1)) {
                let mut tx = pool.begin().await?;
                for (i, id) in chunk.iter().enumerate() {
                    let mut m = OutboxMessage::json("Bench", "", &queue, &serde_json::Value::Null)
                        .map_err(|e| BenchError::Invalid(e.to_string()))?
                        .with_id(id.clone());
                    m.payload = body(size, i);
                    outbox
                        .enqueue(&mut tx, &m)
                        .await
                        .map_err(|e| BenchError::Invalid(e.to_string()))?;
                }
                tx.commit().await?;
                let now = Instant::now();
                for id in chunk {
                    committed.insert(id.clone(), now);
                }
            }
            Ok::<_, BenchError>(committed)
        }));
    }
    let mut all = HashMap::with_capacity(o.messages);
    for t in tasks {
        all.extend(t.await.map_err(|e| BenchError::Invalid(e.to_string()))??);
    }
    Ok(all)
}

/// An in-process relay (retention off: the bench's rows are dropped with its schema).
struct RunningRelay {
    stop: tokio::sync::oneshot::Sender<()>,
    running: tokio::task::JoinHandle<Result<(), rabbit_inbox::outbox::RelayError>>,
}

impl RunningRelay {
    fn start(amqp_url: &str, pool: &PgPool, mut config: RelayConfig) -> Result<Self, BenchError> {
        config.retention = None;
        let relay = Relay::new(amqp_url, pool.clone(), config)?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(relay.run(async move {
            let _ = stopped.await;
        }));
        Ok(Self { stop, running })
    }

    /// Stops it; the batches it published are settled first.
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.running.await;
    }
}

/// How the writers go: as fast as they can, or one message per transaction at a low rate
/// (what an idle relay sees).
#[derive(Clone, Copy, PartialEq)]
enum Pace {
    Flat,
    Idle,
}

/// The end-to-end mode whose rate the goals compare.
const NOTIFY_MODE: &str = "outbox, relay woken by NOTIFY";
/// A relay draining what the writers alone committed.
const DRAIN_MODE: &str = "relay draining their rows";
/// The writers of that mode with no relay running.
const WRITERS_MODE: &str = "writers alone, no relay";

/// Messages of the low-rate run, one per transaction, 20 ms apart.
const IDLE_MESSAGES: usize = 100;

async fn through_outbox(
    amqp_url: &str,
    pool: &PgPool,
    o: &OutboxOptions,
    run: usize,
    notify: bool,
    pace: Pace,
    arrivals: &Arrivals,
) -> Result<OutboxMode, BenchError> {
    let mut config = RelayConfig::new(o.schema.clone());
    config.listen = notify;
    config.poll_interval = if notify {
        Duration::from_secs(1)
    } else {
        Duration::from_millis(100)
    };
    let relay = RunningRelay::start(amqp_url, pool, config)?;
    // Let the relay connect and LISTEN before the first commit.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let prefix = format!("outbox-{run}-{notify}");
    let handoffs = match pace {
        Pace::Flat => write(pool, o, &prefix, notify, o.per_transaction).await?,
        Pace::Idle => {
            let one = OutboxOptions {
                messages: 1,
                writers: 1,
                ..o.clone()
            };
            let mut all = HashMap::new();
            for i in 0..IDLE_MESSAGES {
                all.extend(write(pool, &one, &format!("{prefix}-idle-{i}"), notify, 1).await?);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            all
        }
    };
    await_arrivals(arrivals, handoffs.len()).await?;
    relay.stop().await;
    let mode = match (pace, notify) {
        (Pace::Flat, true) => NOTIFY_MODE,
        (Pace::Flat, false) => "outbox, NOTIFY off, poll 100 ms",
        (Pace::Idle, true) => "outbox at 50 tx/s, NOTIFY",
        (Pace::Idle, false) => "outbox at 50 tx/s, poll 100 ms",
    };
    let mut m = figures(mode, &handoffs, arrivals);
    if pace == Pace::Idle {
        // The rate is the writer's; only the latency says something here.
        m.msgs_per_s = 0.0;
    }
    Ok(m)
}

/// The writers with no relay running (their rate and CPU), then a relay draining their rows:
/// its rate (first commit to last arrival would mix the two, so from the relay's start) and
/// its CPU. Together the two CPU figures say how fast writers and relay can go at once on this
/// machine's cores.
async fn writers_then_drain(
    amqp_url: &str,
    pool: &PgPool,
    o: &OutboxOptions,
    run: usize,
    arrivals: &Arrivals,
) -> Result<(OutboxMode, OutboxMode), BenchError> {
    let cpu_before = CpuTicks::now();
    let started = Instant::now();
    let committed = write(pool, o, &format!("backlog-{run}"), true, o.per_transaction).await?;
    let writers = OutboxMode {
        mode: WRITERS_MODE.to_owned(),
        msgs_per_s: committed.len() as f64 / started.elapsed().as_secs_f64(),
        cpu_ms_per_1k: Some(CpuTicks::now().per_thousand(cpu_before, committed.len())),
        ..OutboxMode::default()
    };
    let cpu_before = CpuTicks::now();
    let relay_started = Instant::now();
    let handoffs: HashMap<String, Instant> = committed
        .keys()
        .map(|id| (id.clone(), relay_started))
        .collect();
    let relay = RunningRelay::start(amqp_url, pool, RelayConfig::new(o.schema.clone()))?;
    await_arrivals(arrivals, handoffs.len()).await?;
    let mut drain = figures(DRAIN_MODE, &handoffs, arrivals);
    // Read before the relay stops; await_arrivals' trailing wait is idle time.
    let cpu = CpuTicks::now().per_thousand(cpu_before, handoffs.len());
    relay.stop().await;
    drain.cpu_ms_per_1k = Some(cpu);
    // The latency from the relay's start says nothing about the relay; the rate does.
    drain.p50_ms = 0.0;
    drain.p99_ms = 0.0;
    Ok((writers, drain))
}

/// Commits per second of one-message transactions (no relay running).
async fn commit_rate(
    pool: &PgPool,
    o: &OutboxOptions,
    run: usize,
    notify: bool,
) -> Result<f64, BenchError> {
    let n = (o.messages / 2).max(o.writers);
    let small = OutboxOptions {
        messages: n,
        ..o.clone()
    };
    let started = Instant::now();
    write(pool, &small, &format!("commit-{run}-{notify}"), notify, 1).await?;
    let rate = n as f64 / started.elapsed().as_secs_f64();
    // Nobody publishes these: gone before a relay runs again.
    sqlx::query(AssertSqlSafe(format!("TRUNCATE \"{}\".outbox", o.schema)))
        .execute(pool)
        .await?;
    Ok(rate)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn median_mode(runs: Vec<OutboxMode>) -> OutboxMode {
    let mode = runs.first().map(|m| m.mode.clone()).unwrap_or_default();
    OutboxMode {
        mode,
        msgs_per_s: median(runs.iter().map(|m| m.msgs_per_s).collect()),
        p50_ms: median(runs.iter().map(|m| m.p50_ms).collect()),
        p99_ms: median(runs.iter().map(|m| m.p99_ms).collect()),
        duplicates: runs.iter().map(|m| m.duplicates).sum(),
        missing: runs.iter().map(|m| m.missing).sum(),
        cpu_ms_per_1k: runs
            .iter()
            .map(|m| m.cpu_ms_per_1k)
            .collect::<Option<Vec<_>>>()
            .map(|cpu| {
                CpuShare::new(
                    median(cpu.iter().map(|c| c.consumer).collect()),
                    median(cpu.iter().map(|c| c.postgres).collect()),
                    median(cpu.iter().map(|c| c.broker).collect()),
                )
            }),
    }
}

/// Runs every mode `o.runs` times, interleaved; `progress` gets a line per run.
pub async fn run(
    amqp_url: &str,
    pool: &PgPool,
    o: &OutboxOptions,
    mut progress: impl FnMut(String),
) -> Result<OutboxReport, BenchError> {
    if o.writers == 0 || o.messages == 0 {
        return Err(BenchError::Invalid(
            "writers and messages must be positive".into(),
        ));
    }
    rabbit_inbox::schema::drop_schema(pool, &o.schema).await?;
    rabbit_inbox::migrate(pool, &o.schema).await?;
    let topology = Topology::new(&o.queue);
    let retry = RetryPolicy::default();
    let broker = Broker::connect(amqp_url, "inbox-bench outbox setup").await?;
    broker.delete(&topology, &retry).await?;
    broker.declare(&topology, &retry).await?;
    let arrivals: Arrivals = Arc::default();
    let (receiver, receiving) = receive(amqp_url, &o.queue, arrivals.clone()).await?;
    let mut runs: Vec<Vec<OutboxMode>> = vec![Vec::new(); 7];
    let (mut with_notify, mut without) = (Vec::new(), Vec::new());
    // The drain (mode 6) is measured with the writers alone (mode 5).
    let mut drained = None;
    for run in 0..o.runs.max(1) {
        // One schema serves every round: each starts from a table vacuumed as autovacuum
        // would leave it, not with the dead versions of the rounds before (a server may run
        // with autovacuum off, as CI machines do).
        sqlx::raw_sql(AssertSqlSafe(format!(
            "VACUUM ANALYZE \"{0}\".outbox, \"{0}\".outbox_stream",
            o.schema
        )))
        .execute(pool)
        .await?;
        for (mode, results) in runs.iter_mut().enumerate() {
            arrivals
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
            let (notify, pace) = match mode {
                1 => (true, Pace::Flat),
                2 => (false, Pace::Flat),
                3 => (true, Pace::Idle),
                _ => (false, Pace::Idle),
            };
            let m = match mode {
                0 => plain(amqp_url, o, run, &arrivals).await?,
                5 => {
                    let (writers, drain) =
                        writers_then_drain(amqp_url, pool, o, run, &arrivals).await?;
                    drained = Some(drain);
                    writers
                }
                6 => match drained.take() {
                    Some(drain) => drain,
                    None => continue,
                },
                _ => through_outbox(amqp_url, pool, o, run, notify, pace, &arrivals).await?,
            };
            progress(format!(
                "run {}: {:<32} {:>8.0} msgs/s, p50 {:.1} ms, p99 {:.1} ms",
                run + 1,
                m.mode,
                m.msgs_per_s,
                m.p50_ms,
                m.p99_ms
            ));
            results.push(m);
        }
        let on = commit_rate(pool, o, run, true).await?;
        let off = commit_rate(pool, o, run, false).await?;
        progress(format!(
            "run {}: commits of one-message transactions: NOTIFY on {on:.0} tx/s, off {off:.0} tx/s",
            run + 1
        ));
        with_notify.push(on);
        without.push(off);
    }
    receiving.abort();
    let _ = receiver.close(200, "done".into()).await;
    broker.delete(&topology, &retry).await?;
    broker.close().await;
    rabbit_inbox::schema::drop_schema(pool, &o.schema).await?;
    Ok(OutboxReport {
        messages: o.messages,
        writers: o.writers,
        per_transaction: o.per_transaction,
        modes: runs.into_iter().map(median_mode).collect(),
        commits_per_s_notify: median(with_notify),
        commits_per_s_quiet: median(without),
    })
}
