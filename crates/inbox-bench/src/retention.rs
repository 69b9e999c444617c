//! Retention under load: a large inbox (filled with `generate_series` in a scratch schema),
//! a consumer-like load of claim transactions (new keys and duplicates of rows inside the
//! window) measured first alone, then while `Operations::cleanup` removes the expired rows.
//! Also the plain `DELETE .. WHERE key IN (SELECT .. LIMIT n)` loop for a few batches on the
//! same table, as the baseline the time-sliced passes are compared with.

use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use hdrhistogram::Histogram;
use inbox_ops::{Operations, Progress, retention::CleanupRequest};
use rabbit_inbox::{
    Envelope, EnvelopeRules, RetryPolicy, SchemaName, envelope::AmqpMessage, ledger_sql::PROCESSED,
    retention::RetentionPolicy, store::InboxStore, store::Redelivery,
};
use serde::Serialize;
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use crate::BenchError;

pub(crate) const CONSUMER: &str = "retention-bench";
const DAY_SECS: f64 = 86_400.0;

/// What to measure.
#[derive(Clone, Debug)]
pub struct RetentionBenchOptions {
    /// Rows in the inbox before the run.
    pub rows: u64,
    /// Share of them past the 30-day window.
    pub expired_share: f64,
    /// Rows per cleanup statement.
    pub batch: u32,
    /// Claims per load transaction (a tenth are duplicates of rows inside the window).
    pub load_batch: usize,
    /// Concurrent load transactions.
    pub load_workers: usize,
    /// Length of the load-only baseline.
    pub baseline: Duration,
    /// Batches of the plain `LIMIT` delete loop to time (0 skips it).
    pub naive_batches: u32,
    /// Scratch schema (recreated).
    pub schema: SchemaName,
}

/// The consumer-like load over one phase.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct LoadFigures {
    /// Claim transactions per second.
    pub tx_per_s: f64,
    /// Claims (rows) per second.
    pub claims_per_s: f64,
    /// Transaction latency percentiles and maximum, in milliseconds.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Maximum.
    pub max_ms: f64,
    /// Samples (every 100 ms) in which a load session waited on a lock.
    pub lock_wait_samples: u64,
    /// Samples taken.
    pub samples: u64,
}

/// One way of deleting.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeleteFigures {
    /// Rows removed.
    pub rows: u64,
    /// Statements.
    pub batches: u64,
    /// Wall time, seconds.
    pub secs: f64,
    /// Rows removed per second.
    pub rows_per_s: f64,
    /// Median and slowest batch, milliseconds.
    pub batch_p50_ms: f64,
    /// Slowest batch.
    pub batch_max_ms: f64,
    /// First and last batch, milliseconds: how the cost grows as deleted rows pile up.
    pub first_batch_ms: f64,
    /// Last batch.
    pub last_batch_ms: f64,
}

/// Everything measured.
#[derive(Clone, Debug, Serialize)]
pub struct RetentionBenchResult {
    /// Rows before the run.
    pub rows: u64,
    /// Rows past the window.
    pub expired: u64,
    /// Time to fill, seconds.
    pub fill_secs: f64,
    /// The load alone, before the deletions.
    pub load_alone: LoadFigures,
    /// The load alone again, after them (the machine's drift between the two bounds the
    /// noise of the ratios).
    pub load_alone_after: LoadFigures,
    /// The load while cleanup ran.
    pub load_during_cleanup: LoadFigures,
    /// The load while the plain LIMIT loop ran.
    pub load_during_naive: Option<LoadFigures>,
    /// The plain LIMIT loop, beside the load.
    pub naive: Option<DeleteFigures>,
    /// `Operations::cleanup` (time slices, tombstones), beside the load.
    pub cleanup: DeleteFigures,
    /// Table size before and after, MB (dead tuples stay until vacuum).
    pub table_mb_before: f64,
    /// After.
    pub table_mb_after: f64,
}

/// Fills the scratch schema, measures, drops the schema.
pub async fn run(
    pool: &PgPool,
    options: &RetentionBenchOptions,
    log: impl Fn(&str),
) -> Result<RetentionBenchResult, BenchError> {
    let schema = &options.schema;
    rabbit_inbox::schema::drop_schema(pool, schema).await?;
    rabbit_inbox::migrate(pool, schema).await?;
    let started = Instant::now();
    log(&format!("filling {} rows", options.rows));
    fill(pool, schema, options).await?;
    let fill_secs = started.elapsed().as_secs_f64();
    let expired: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".message_inbox WHERE processed_at < now() - interval '30 days'"
    )))
    .fetch_one(pool)
    .await?;
    let table_mb_before = table_mb(pool, schema).await?;

    log("load alone");
    let load = Load::new(
        pool.clone(),
        schema.clone(),
        LoadShape {
            rows: options.rows,
            expired_share: options.expired_share,
            batch: options.load_batch,
            workers: options.load_workers,
        },
        ClaimPath::Table,
    );
    let load_alone = load.measure_for(options.baseline).await?;

    let (load_during_naive, naive) = if options.naive_batches > 0 {
        log("plain LIMIT delete loop beside the load");
        let (during, figures) = load.measure_while(naive(pool, schema, options)).await?;
        (Some(during), Some(figures?))
    } else {
        (None, None)
    };

    log("cleanup beside the load");
    let ops = Operations::new(pool.clone(), schema.clone());
    let retention = RetentionPolicy {
        batch_size: options.batch,
        scrub_payload_after: None,
        ..RetentionPolicy::default()
    };
    let request = CleanupRequest::new(CONSUMER, retention, RetryPolicy::default());
    let timer = BatchTimer::default();
    let (during, report) = load
        .measure_while(async {
            let began = Instant::now();
            let report = ops.cleanup(&request, &timer).await;
            (report, began.elapsed())
        })
        .await?;
    let (report, elapsed) = (
        report.0.map_err(|e| BenchError::Invalid(e.to_string()))?,
        report.1,
    );
    let cleanup = timer.figures(report.removed_processed, report.batches, elapsed);
    let table_mb_after = table_mb(pool, schema).await?;
    log("load alone again");
    let load_alone_after = load.measure_for(options.baseline).await?;
    rabbit_inbox::schema::drop_schema(pool, schema).await?;
    Ok(RetentionBenchResult {
        rows: options.rows,
        expired: expired.unsigned_abs(),
        fill_secs,
        load_alone,
        load_alone_after,
        load_during_cleanup: during,
        load_during_naive,
        naive,
        cleanup,
        table_mb_before,
        table_mb_after,
    })
}

async fn table_mb(pool: &PgPool, schema: &SchemaName) -> Result<f64, sqlx::Error> {
    let bytes: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT pg_total_relation_size('\"{schema}\".message_inbox')"
    )))
    .fetch_one(pool)
    .await?;
    Ok(bytes as f64 / 1e6)
}

/// `rows` PROCESSED rows in time order over a span whose oldest `expired_share` lies past
/// the 30-day window, in chunks so no statement runs for minutes.
async fn fill(
    pool: &PgPool,
    schema: &SchemaName,
    options: &RetentionBenchOptions,
) -> Result<(), sqlx::Error> {
    let span_days = 30.0 / (1.0 - options.expired_share.clamp(0.0, 0.95));
    let mut conn = pool.acquire().await?;
    insert_processed(
        &mut conn,
        &format!("\"{schema}\".message_inbox"),
        options.rows,
        span_days,
        None,
    )
    .await?;
    drop(conn);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "VACUUM ANALYZE \"{schema}\".message_inbox"
    )))
    .execute(pool)
    .await?;
    if let Err(e) = sqlx::raw_sql("CHECKPOINT").execute(pool).await {
        tracing::warn!("CHECKPOINT after the fill failed: {e}");
    }
    Ok(())
}

/// Inserts PROCESSED rows `r1..=rows` into `table`, oldest first, evenly over the `span_days`
/// up to now, in chunks of a million so no statement runs for minutes. `generation`: an extra
/// `generation` column's value, an SQL expression over the row's time `x.t`.
pub(crate) async fn insert_processed(
    conn: &mut PgConnection,
    table: &str,
    rows: u64,
    span_days: f64,
    generation: Option<&str>,
) -> Result<(), sqlx::Error> {
    let (column, value) = generation.map_or((String::new(), String::new()), |g| {
        (", generation".to_owned(), format!(", {g}"))
    });
    let chunk = 1_000_000u64;
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {table} (message_id, consumer_name, message_type, message_version, \
               status, processing_attempt, first_received_at, processed_at, payload_sha256{column}) \
             SELECT 'r' || g, $1, 'BenchEvent', 1, {PROCESSED}, 1, x.t, x.t, \
               sha256(g::text::bytea){value} \
             FROM generate_series($2::int8, $3::int8) AS g, \
               LATERAL (SELECT now() - make_interval(secs => $5 * (1 - g::float8 / $4))) AS x(t)"
        )))
        .bind(CONSUMER)
        .bind(i64::try_from(done + 1).unwrap_or(i64::MAX))
        .bind(i64::try_from(done + n).unwrap_or(i64::MAX))
        .bind(rows as f64)
        .bind(span_days * DAY_SECS)
        .execute(&mut *conn)
        .await?;
        done += n;
    }
    Ok(())
}

/// The plain loop: `DELETE .. WHERE key IN (SELECT .. WHERE processed_at < cutoff LIMIT n)`
/// (`InboxStore::cleanup_processed_older_than`), timed per batch.
async fn naive(
    pool: &PgPool,
    schema: &SchemaName,
    options: &RetentionBenchOptions,
) -> Result<DeleteFigures, BenchError> {
    let store = InboxStore::new(schema.clone());
    let mut conn = pool.acquire().await?;
    let timer = BatchTimer::default();
    let began = Instant::now();
    let mut rows = 0;
    for _ in 0..options.naive_batches {
        let n = store
            .cleanup_processed_older_than(
                &mut conn,
                CONSUMER,
                Duration::from_secs(30 * 86_400),
                i64::from(options.batch),
            )
            .await?;
        timer.advance(n);
        rows += n;
        if n == 0 {
            break;
        }
    }
    Ok(timer.figures(rows, u64::from(options.naive_batches), began.elapsed()))
}

/// Times every batch a cleanup reports, from its creation on.
struct BatchTimer {
    last: Mutex<Option<Instant>>,
    batches_ms: Mutex<Vec<f64>>,
}

impl Default for BatchTimer {
    fn default() -> Self {
        Self {
            last: Mutex::new(Some(Instant::now())),
            batches_ms: Mutex::default(),
        }
    }
}

impl Progress for BatchTimer {
    fn advance(&self, _n: u64) {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(prev) = *last {
            self.batches_ms
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(now.duration_since(prev).as_secs_f64() * 1e3);
        }
        *last = Some(now);
    }
}

impl BatchTimer {
    fn figures(&self, rows: u64, batches: u64, elapsed: Duration) -> DeleteFigures {
        let ms = self
            .batches_ms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut sorted = ms.clone();
        sorted.sort_by(f64::total_cmp);
        let secs = elapsed.as_secs_f64();
        DeleteFigures {
            rows,
            batches,
            secs,
            rows_per_s: rows as f64 / secs.max(1e-9),
            batch_p50_ms: sorted.get(sorted.len() / 2).copied().unwrap_or_default(),
            batch_max_ms: sorted.last().copied().unwrap_or_default(),
            first_batch_ms: ms.first().copied().unwrap_or_default(),
            last_batch_ms: ms.last().copied().unwrap_or_default(),
        }
    }
}

/// The inbox a load claims in, and the load's size.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LoadShape {
    /// Rows `r1..=rows` filled, oldest first.
    pub(crate) rows: u64,
    /// Share of them past the window: duplicates pick from the rest.
    pub(crate) expired_share: f64,
    /// Claims per transaction.
    pub(crate) batch: usize,
    /// Concurrent transactions.
    pub(crate) workers: usize,
}

/// How a load transaction claims its batch.
#[derive(Clone)]
pub(crate) enum ClaimPath {
    /// The library's claim on today's table.
    Table,
    /// The partitioned ledger's claim ([`crate::ledger_layout`]).
    Generations(Arc<crate::ledger_layout::GenerationClaim>),
}

/// Claim transactions like a consumer's: a batch of new keys plus duplicates of rows inside
/// the window (which lock those rows, as a real duplicate does).
pub(crate) struct Load {
    pool: PgPool,
    schema: SchemaName,
    store: InboxStore,
    shape: LoadShape,
    path: ClaimPath,
    next: Arc<AtomicU64>,
}

impl Load {
    pub(crate) fn new(pool: PgPool, schema: SchemaName, shape: LoadShape, path: ClaimPath) -> Self {
        Self {
            store: InboxStore::new(schema.clone()),
            pool,
            schema,
            shape: LoadShape {
                batch: shape.batch.max(1),
                workers: shape.workers.max(1),
                ..shape
            },
            path,
            next: Arc::new(AtomicU64::new(0)),
        }
    }

    pub(crate) async fn measure_for(&self, length: Duration) -> Result<LoadFigures, BenchError> {
        Ok(self.measure_while(tokio::time::sleep(length)).await?.0)
    }

    /// Runs the load until `work` ends; returns the load's figures and `work`'s output.
    pub(crate) async fn measure_while<T>(
        &self,
        work: impl Future<Output = T>,
    ) -> Result<(LoadFigures, T), BenchError> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = tokio::task::JoinSet::new();
        let shape = self.shape;
        for w in 0..shape.workers {
            let worker = Worker {
                pool: self.pool.clone(),
                store: self.store.clone(),
                path: self.path.clone(),
                batch: shape.batch,
                next: self.next.clone(),
                // Duplicates hit the rows inside the window, which cleanup must leave.
                in_window: (
                    (shape.rows as f64 * shape.expired_share) as u64 + 1,
                    shape.rows.max(1),
                ),
                seed: w as u64,
            };
            let stop = stop.clone();
            workers.spawn(async move { worker.run(&stop).await });
        }
        let sampler = {
            let pool = self.pool.clone();
            let pattern = format!("%\"{}\"%", self.schema);
            let stop = stop.clone();
            tokio::spawn(async move { sample_lock_waits(&pool, &pattern, &stop).await })
        };
        let began = Instant::now();
        let out = work.await;
        let elapsed = began.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        let mut histogram =
            Histogram::<u64>::new(3).map_err(|e| BenchError::Invalid(e.to_string()))?;
        let mut txs = 0u64;
        while let Some(done) = workers.join_next().await {
            let (h, n) = done.map_err(|e| BenchError::Invalid(e.to_string()))??;
            histogram
                .add(h)
                .map_err(|e| BenchError::Invalid(e.to_string()))?;
            txs += n;
        }
        let (lock_wait_samples, samples) = sampler
            .await
            .map_err(|e| BenchError::Invalid(e.to_string()))?;
        let ms = |us: u64| us as f64 / 1e3;
        Ok((
            LoadFigures {
                tx_per_s: txs as f64 / elapsed,
                claims_per_s: (txs * shape.batch as u64) as f64 / elapsed,
                p50_ms: ms(histogram.value_at_quantile(0.5)),
                p99_ms: ms(histogram.value_at_quantile(0.99)),
                max_ms: ms(histogram.max()),
                lock_wait_samples,
                samples,
            },
            out,
        ))
    }
}

/// Every 100 ms: does a session working on the scratch schema wait on a lock?
async fn sample_lock_waits(pool: &PgPool, pattern: &str, stop: &AtomicBool) -> (u64, u64) {
    let (mut waiting, mut samples) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        let n: Result<i64, _> = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND query LIKE $1 AND pid <> pg_backend_pid()",
        )
        .bind(pattern)
        .fetch_one(pool)
        .await;
        samples += 1;
        if n.is_ok_and(|n| n > 0) {
            waiting += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (waiting, samples)
}

struct Worker {
    pool: PgPool,
    store: InboxStore,
    path: ClaimPath,
    batch: usize,
    next: Arc<AtomicU64>,
    in_window: (u64, u64),
    seed: u64,
}

impl Worker {
    async fn run(&self, stop: &AtomicBool) -> Result<(Histogram<u64>, u64), BenchError> {
        let mut histogram =
            Histogram::<u64>::new(3).map_err(|e| BenchError::Invalid(e.to_string()))?;
        let rules = EnvelopeRules::default();
        let mut state = self.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut txs = 0;
        while !stop.load(Ordering::Relaxed) {
            let duplicates = (self.batch / 10).max(1);
            let mut ids: Vec<String> = (0..self.batch - duplicates)
                .map(|_| format!("load-{}", self.next.fetch_add(1, Ordering::Relaxed)))
                .collect();
            let (lo, hi) = self.in_window;
            for _ in 0..duplicates {
                // xorshift: cheap and good enough to spread duplicates over the window.
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ids.push(format!("r{}", lo + state % (hi - lo).max(1)));
            }
            ids.sort();
            ids.dedup();
            let envelopes: Vec<Envelope> = ids
                .iter()
                .map(|id| envelope(id, &rules))
                .collect::<Result<_, _>>()?;
            let refs: Vec<&Envelope> = envelopes.iter().collect();
            let began = Instant::now();
            let mut tx = self.pool.begin().await?;
            let existing: Vec<String> = match &self.path {
                ClaimPath::Table => self
                    .store
                    .try_claim_many_committing(&mut tx, CONSUMER, &refs, false)
                    .await?
                    .iter()
                    .zip(&envelopes)
                    .filter(|(c, _)| matches!(c, rabbit_inbox::store::Claim::Existing(_)))
                    .map(|(_, e)| e.message_id.clone())
                    .collect(),
                ClaimPath::Generations(claim) => claim.claim(&mut tx, CONSUMER, &envelopes).await?,
            };
            let redeliveries: Vec<Redelivery<'_>> = existing
                .iter()
                .map(|id| Redelivery {
                    message_id: id,
                    conflicting_sha256: None,
                    duplicate_of: None,
                })
                .collect();
            self.store
                .note_redeliveries(&mut tx, CONSUMER, &redeliveries)
                .await?;
            tx.commit().await?;
            histogram
                .record(u64::try_from(began.elapsed().as_micros()).unwrap_or(u64::MAX))
                .map_err(|e| BenchError::Invalid(e.to_string()))?;
            txs += 1;
        }
        Ok((histogram, txs))
    }
}

fn envelope(id: &str, rules: &EnvelopeRules) -> Result<Envelope, BenchError> {
    let msg = AmqpMessage {
        message_id: Some(id.to_owned()),
        kind: Some("BenchEvent".into()),
        body: br#"{"n":1}"#.to_vec(),
        ..AmqpMessage::default()
    };
    rabbit_inbox::envelope::parse(msg, rules).map_err(|e| BenchError::Invalid(e.detail))
}

impl RetentionBenchResult {
    /// The figures as a table, with the ratios against the load-alone baseline.
    pub fn render(&self) -> String {
        let l = (&self.load_alone, &self.load_during_cleanup);
        let alone_tx = (self.load_alone.tx_per_s + self.load_alone_after.tx_per_s) / 2.0;
        let alone_p99 = (self.load_alone.p99_ms + self.load_alone_after.p99_ms) / 2.0;
        let mut out = format!(
            "inbox: {} rows ({} past the window), filled in {:.0} s; table {:.0} MB -> {:.0} MB\n\n",
            self.rows, self.expired, self.fill_secs, self.table_mb_before, self.table_mb_after
        );
        out += "load (claim transactions)   tx/s     claims/s  p50 ms  p99 ms  max ms  lock-wait samples\n";
        let mut phases = vec![
            ("alone, before", l.0),
            ("alone, after", &self.load_alone_after),
        ];
        if let Some(n) = &self.load_during_naive {
            phases.push(("during the LIMIT loop", n));
        }
        phases.push(("during cleanup", l.1));
        for (name, f) in phases {
            out += &format!(
                "  {name:<25} {:>7.0}  {:>9.0}  {:>6.1}  {:>6.1}  {:>6.1}  {}/{}\n",
                f.tx_per_s,
                f.claims_per_s,
                f.p50_ms,
                f.p99_ms,
                f.max_ms,
                f.lock_wait_samples,
                f.samples
            );
        }
        out += &format!(
            "  ratio during cleanup/alone (mean of before and after): throughput {:.2}, p99 {:.2}\n\n",
            l.1.tx_per_s / alone_tx.max(1e-9),
            l.1.p99_ms / alone_p99.max(1e-9)
        );
        out += "deletion                    rows      rows/s   batches  batch p50 ms  max ms  first ms  last ms\n";
        let mut rows = vec![("cleanup (time slices)", &self.cleanup)];
        if let Some(n) = &self.naive {
            rows.insert(0, ("plain LIMIT loop", n));
        }
        for (name, d) in rows {
            out += &format!(
                "  {name:<25} {:>8}  {:>8.0}  {:>7}  {:>12.1}  {:>6.1}  {:>8.1}  {:>7.1}\n",
                d.rows,
                d.rows_per_s,
                d.batches,
                d.batch_p50_ms,
                d.batch_max_ms,
                d.first_batch_ms,
                d.last_batch_ms
            );
        }
        out
    }
}
