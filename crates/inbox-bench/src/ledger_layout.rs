//! Retention at 100 million rows while a transaction pins PostgreSQL's xmin horizon: today's
//! ledger (one table; `Operations::cleanup` deletes expired rows in batches) against a ledger
//! partitioned by generation (retention drops a whole partition), under the claim load of
//! [`crate::retention`]. Four phases per layout: the load alone, retention beside it, the same
//! while a REPEATABLE READ transaction holds its snapshot, then the snapshot released and a
//! `VACUUM` (what autovacuum would run) beside the load. Each phase reports the load's rate and
//! p99 (and the rate against the load alone), the rows retention removed, the dead tuples and
//! the ledger's size at its end.
//!
//! The partitioned ledger exists only here, built in the scratch schema from the migrated table
//! (same columns, checks, indexes and triggers; `generation` added to the partition key and the
//! primary key). Its claim is what such a ledger needs to keep dedup across partitions, which
//! PostgreSQL's unique indexes cannot do there: a shared advisory lock that a rotation takes
//! exclusively (so no two claims ever insert into different generations at once), then one
//! `INSERT .. ON CONFLICT` into the current generation, skipping keys any other live generation
//! holds (one primary-key probe per live partition and key). Before a partition is dropped,
//! its rows' tombstones are written, as today's retention writes one per removed row.

use std::{
    fmt::Write as _,
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use inbox_ops::{Operations, Progress, retention::CleanupRequest};
use rabbit_inbox::{
    Envelope, RetryPolicy, SchemaName, ledger_sql::PROCESSED, retention::RetentionPolicy,
};
use serde::Serialize;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

use crate::{
    BenchError,
    retention::{ClaimPath, Load, LoadFigures, LoadShape},
};

const DAY_SECS: f64 = 86_400.0;
const WINDOW_DAYS: f64 = 30.0;
/// The advisory lock claims take shared and a rotation exclusively (per database; the bench
/// runs one partitioned ledger at a time).
const GENERATION_LOCK: i64 = 0x6765_6e65_7261_7469;

/// A ledger layout to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum LedgerLayout {
    /// Today's `message_inbox`: one table, retention deletes rows.
    Table,
    /// Partitioned by generation: retention drops the partition of a generation closed longer
    /// than the window ago.
    Generations,
}

impl FromStr for LedgerLayout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "table" => Ok(Self::Table),
            "generations" => Ok(Self::Generations),
            other => Err(format!(
                "unknown layout {other:?}: expected \"table\" or \"generations\""
            )),
        }
    }
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct LedgerBenchOptions {
    /// Rows in the ledger before the run, PROCESSED, spread over time oldest first.
    pub rows: u64,
    /// Share of them past the 30-day window.
    pub expired_share: f64,
    /// Generations per window (partitioned layout): a generation spans window / this, and at
    /// most this + 2 are live (the window's, the one being filled, one waiting to be dropped).
    pub generations_per_window: u32,
    /// Rows per cleanup statement (table layout).
    pub cleanup_batch: u32,
    /// Claims per load transaction (a tenth duplicates of rows inside the window).
    pub load_batch: usize,
    /// Concurrent load transactions.
    pub load_workers: usize,
    /// Length of the phases before and after the pin.
    pub phase: Duration,
    /// How long the snapshot is held.
    pub pin: Duration,
    /// Layouts, measured one after the other.
    pub layouts: Vec<LedgerLayout>,
    /// Scratch schema (recreated for each layout, dropped at the end).
    pub schema: SchemaName,
}

/// One phase of one layout.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseFigures {
    /// "alone", "retention", "pinned", "after".
    pub name: &'static str,
    /// Seconds.
    pub secs: f64,
    /// The claim load.
    pub load: LoadFigures,
    /// Rows retention removed during the phase (a dropped partition counts its rows).
    pub rows_removed: u64,
    /// Dead tuples in the ledger at the end (statistics).
    pub dead_tuples: i64,
    /// Ledger size with indexes and TOAST at the end, MB.
    pub ledger_mb: f64,
    /// What retention and vacuum did, with their times.
    pub actions: Vec<String>,
}

/// Everything measured for one layout.
#[derive(Clone, Debug, Serialize)]
pub struct LayoutFigures {
    /// Which.
    pub layout: LedgerLayout,
    /// Rows before the run.
    pub rows: u64,
    /// Rows past the window before the run.
    pub expired: u64,
    /// Seconds to fill and index.
    pub fill_secs: f64,
    /// Partitions a claim probes at the start (1 for the table).
    pub partitions: u64,
    /// The phases in order.
    pub phases: Vec<PhaseFigures>,
    /// Keys claimed during the run that another generation also holds: a claim that missed a
    /// live partition (0 unless the partitioned claim is wrong; always 0 for the table).
    pub keys_in_two_generations: i64,
}

/// Everything measured.
#[derive(Clone, Debug, Serialize)]
pub struct LedgerBenchResult {
    /// Per layout, in the order run.
    pub layouts: Vec<LayoutFigures>,
    /// Seconds the snapshot was held.
    pub pin_secs: f64,
}

/// Measures every layout of `options` in turn.
pub async fn run(
    pool: &PgPool,
    options: &LedgerBenchOptions,
    log: impl Fn(&str),
) -> Result<LedgerBenchResult, BenchError> {
    let mut layouts = Vec::new();
    for &layout in &options.layouts {
        let result = run_layout(pool, options, layout, &log).await;
        rabbit_inbox::schema::drop_schema(pool, &options.schema).await?;
        layouts.push(result?);
    }
    Ok(LedgerBenchResult {
        layouts,
        pin_secs: options.pin.as_secs_f64(),
    })
}

async fn run_layout(
    pool: &PgPool,
    options: &LedgerBenchOptions,
    layout: LedgerLayout,
    log: &impl Fn(&str),
) -> Result<LayoutFigures, BenchError> {
    let schema = &options.schema;
    rabbit_inbox::schema::drop_schema(pool, schema).await?;
    rabbit_inbox::migrate(pool, schema).await?;
    let ledger = Ledger::new(schema.clone(), layout, options);
    log(&format!("{layout:?}: filling {} rows", options.rows));
    let started = Instant::now();
    ledger.fill(pool).await?;
    let fill_secs = started.elapsed().as_secs_f64();
    let expired: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".message_inbox \
         WHERE processed_at < now() - make_interval(days => {WINDOW_DAYS})"
    )))
    .fetch_one(pool)
    .await?;
    let partitions = ledger.partitions(pool).await?;

    let path = match layout {
        LedgerLayout::Table => ClaimPath::Table,
        LedgerLayout::Generations => ClaimPath::Generations(Arc::new(GenerationClaim::new(schema))),
    };
    let load = Load::new(
        pool.clone(),
        schema.clone(),
        LoadShape {
            rows: options.rows,
            expired_share: options.expired_share,
            batch: options.load_batch,
            workers: options.load_workers,
        },
        path,
    );
    let removed = Arc::new(AtomicU64::new(0));
    let mut phases = Vec::new();
    log(&format!("{layout:?}: load alone"));
    let began = Instant::now();
    let alone = load.measure_for(options.phase).await?;
    phases.push(
        ledger
            .figures(pool, "alone", began, alone, 0, Vec::new())
            .await?,
    );
    // Today's retention runs through the three phases that follow, as a retention task behind
    // on a large backlog would; the partitioned one acts once per phase.
    let cleanup = (layout == LedgerLayout::Table).then(|| {
        let ops = Operations::new(pool.clone(), schema.clone());
        let request = CleanupRequest::new(
            crate::retention::CONSUMER,
            RetentionPolicy {
                batch_size: options.cleanup_batch,
                scrub_payload_after: None,
                ..RetentionPolicy::default()
            },
            RetryPolicy::default(),
        );
        let counter = RowCounter(removed.clone());
        Background(tokio::spawn(async move {
            ops.cleanup(&request, &counter).await.map(drop)
        }))
    });
    log(&format!("{layout:?}: load beside retention"));
    phases.push(
        ledger
            .phase(pool, &load, "retention", options.phase, &removed, false)
            .await?,
    );
    log(&format!(
        "{layout:?}: the same while a snapshot is held for {:?}",
        options.pin
    ));
    let pin = Pin::take(pool).await?;
    let pinned = ledger
        .phase(pool, &load, "pinned", options.pin, &removed, false)
        .await;
    pin.release().await?;
    phases.push(pinned?);
    log(&format!(
        "{layout:?}: snapshot released, VACUUM beside the load"
    ));
    phases.push(
        ledger
            .phase(pool, &load, "after", options.phase, &removed, true)
            .await?,
    );
    if let Some(cleanup) = cleanup {
        cleanup.stop().await?;
    }
    let keys_in_two_generations = ledger.keys_in_two_generations(pool).await?;
    Ok(LayoutFigures {
        layout,
        rows: options.rows,
        expired: expired.unsigned_abs(),
        fill_secs,
        partitions,
        phases,
        keys_in_two_generations,
    })
}

/// The table layout's cleanup, aborted when dropped (also when a phase fails), so it never
/// outlives its layout's schema.
struct Background(tokio::task::JoinHandle<Result<(), inbox_ops::OpsError>>);

impl Background {
    /// Ends it; an error it ended with (a refused or failed cleanup) is the run's.
    async fn stop(mut self) -> Result<(), BenchError> {
        if !self.0.is_finished() {
            return Ok(());
        }
        (&mut self.0)
            .await
            .map_err(|e| BenchError::Invalid(e.to_string()))?
            .map_err(|e| BenchError::Invalid(format!("cleanup failed: {e}")))
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Counts the rows a cleanup reports.
struct RowCounter(Arc<AtomicU64>);

impl Progress for RowCounter {
    fn advance(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
}

/// A REPEATABLE READ transaction on a connection of its own, holding its first snapshot (and an
/// xid) until released: what a long report or a forgotten session does to the xmin horizon.
struct Pin(PgConnection);

impl Pin {
    async fn take(pool: &PgPool) -> Result<Self, BenchError> {
        let mut conn = pool.acquire().await?.detach();
        sqlx::raw_sql(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; \
             SELECT txid_current(), count(*) FROM pg_class",
        )
        .execute(&mut conn)
        .await?;
        Ok(Self(conn))
    }

    async fn release(mut self) -> Result<(), BenchError> {
        sqlx::raw_sql("COMMIT").execute(&mut self.0).await?;
        self.0.close().await?;
        Ok(())
    }
}

/// One layout's ledger in the scratch schema.
struct Ledger {
    schema: SchemaName,
    layout: LedgerLayout,
    rows: u64,
    span_days: f64,
    /// Days per generation.
    generation_days: f64,
    /// The newest generation of the fill (the load's is the next).
    newest_filled: i64,
}

impl Ledger {
    fn new(schema: SchemaName, layout: LedgerLayout, options: &LedgerBenchOptions) -> Self {
        let span_days = WINDOW_DAYS / (1.0 - options.expired_share.clamp(0.0, 0.95));
        let generation_days = WINDOW_DAYS / f64::from(options.generations_per_window.max(1));
        Self {
            schema,
            layout,
            rows: options.rows,
            span_days,
            generation_days,
            newest_filled: (span_days / generation_days).floor() as i64,
        }
    }

    fn t(&self) -> String {
        format!("\"{}\".message_inbox", self.schema)
    }

    /// Builds the layout, fills it with `generate_series` (heap first, primary key after: a
    /// sorted build instead of 100 million random inserts into a B-tree), and analyzes it.
    async fn fill(&self, pool: &PgPool) -> Result<(), BenchError> {
        let mut conn = pool.acquire().await?.detach();
        sqlx::raw_sql("SET maintenance_work_mem = '1GB'")
            .execute(&mut conn)
            .await?;
        let t = self.t();
        let s = &self.schema;
        // The event table's key refers to the ledger's: drop it around the fill (table layout)
        // or for good (a partitioned ledger's key has the generation in it).
        let foreign_keys: Vec<(String, String)> = sqlx::query_as(
            "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint \
             WHERE contype = 'f' AND confrelid = $1::regclass",
        )
        .bind(&t)
        .fetch_all(&mut conn)
        .await?;
        for (name, _) in &foreign_keys {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "ALTER TABLE \"{s}\".inbox_event DROP CONSTRAINT \"{name}\""
            )))
            .execute(&mut conn)
            .await?;
        }
        let generation = match self.layout {
            LedgerLayout::Table => {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "ALTER TABLE {t} DROP CONSTRAINT message_inbox_pkey"
                )))
                .execute(&mut conn)
                .await?;
                None
            }
            LedgerLayout::Generations => {
                self.partition(&mut conn).await?;
                Some(format!(
                    "{} - floor(extract(epoch FROM now() - x.t) / {})::int8",
                    self.newest_filled,
                    self.generation_days * DAY_SECS
                ))
            }
        };
        crate::retention::insert_processed(
            &mut conn,
            &t,
            self.rows,
            self.span_days,
            generation.as_deref(),
        )
        .await?;
        let key = match self.layout {
            LedgerLayout::Table => "message_id, consumer_name",
            LedgerLayout::Generations => "message_id, consumer_name, generation",
        };
        sqlx::raw_sql(AssertSqlSafe(format!(
            "ALTER TABLE {t} ADD CONSTRAINT message_inbox_pkey PRIMARY KEY ({key})"
        )))
        .execute(&mut conn)
        .await?;
        if self.layout == LedgerLayout::Table {
            for (name, definition) in &foreign_keys {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "ALTER TABLE \"{s}\".inbox_event ADD CONSTRAINT \"{name}\" {definition}"
                )))
                .execute(&mut conn)
                .await?;
            }
        }
        sqlx::raw_sql(AssertSqlSafe(format!("VACUUM ANALYZE {t}")))
            .execute(&mut conn)
            .await?;
        if let Err(e) = sqlx::raw_sql("CHECKPOINT").execute(&mut conn).await {
            tracing::warn!("CHECKPOINT after the fill failed: {e}");
        }
        conn.close().await?;
        Ok(())
    }

    /// Replaces the migrated table by one partitioned by generation with the same columns,
    /// checks, secondary indexes and triggers, one partition per generation of the fill plus
    /// the current one, and the generation register.
    async fn partition(&self, conn: &mut PgConnection) -> Result<(), BenchError> {
        let t = self.t();
        let s = &self.schema;
        let indexes: Vec<String> = sqlx::query_scalar(
            "SELECT pg_get_indexdef(indexrelid) FROM pg_index \
             WHERE indrelid = $1::regclass AND NOT indisprimary",
        )
        .bind(&t)
        .fetch_all(&mut *conn)
        .await?;
        let triggers: Vec<String> = sqlx::query_scalar(
            "SELECT pg_get_triggerdef(oid) FROM pg_trigger \
             WHERE tgrelid = $1::regclass AND NOT tgisinternal",
        )
        .bind(&t)
        .fetch_all(&mut *conn)
        .await?;
        let mut ddl = format!(
            "ALTER TABLE {t} RENAME TO message_inbox_template; \
             CREATE TABLE {t} (LIKE \"{s}\".message_inbox_template INCLUDING DEFAULTS \
               INCLUDING CONSTRAINTS INCLUDING STORAGE, generation int8 NOT NULL) \
               PARTITION BY LIST (generation); \
             DROP TABLE \"{s}\".message_inbox_template; \
             CREATE TABLE \"{s}\".inbox_generation (generation int8 PRIMARY KEY, \
               closed_at timestamptz); "
        );
        for generation in 0..=self.newest_filled + 1 {
            // A generation is closed when its newest row is; the load's is open.
            let age = (self.newest_filled - generation) as f64 * self.generation_days;
            let closed_at = if generation > self.newest_filled {
                "NULL".to_owned()
            } else {
                format!("now() - make_interval(secs => {})", age * DAY_SECS)
            };
            write!(
                ddl,
                "CREATE TABLE \"{s}\".message_inbox_g{generation} PARTITION OF {t} \
                   FOR VALUES IN ({generation}) WITH (fillfactor = 90); \
                 INSERT INTO \"{s}\".inbox_generation VALUES ({generation}, {closed_at}); "
            )
            .ok();
        }
        for statement in indexes.iter().chain(&triggers) {
            ddl += statement;
            ddl += "; ";
        }
        sqlx::raw_sql(AssertSqlSafe(ddl))
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// Rows the run's generations hold whose key another generation holds too.
    async fn keys_in_two_generations(&self, pool: &PgPool) -> Result<i64, BenchError> {
        if self.layout == LedgerLayout::Table {
            return Ok(0);
        }
        let t = self.t();
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {t} n WHERE n.generation > {} AND EXISTS (SELECT 1 FROM {t} o \
               WHERE o.message_id = n.message_id AND o.consumer_name = n.consumer_name \
                 AND o.generation <> n.generation)",
            self.newest_filled
        )))
        .fetch_one(pool)
        .await?)
    }

    /// Partitions a claim probes.
    async fn partitions(&self, pool: &PgPool) -> Result<u64, BenchError> {
        if self.layout == LedgerLayout::Table {
            return Ok(1);
        }
        let n: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_inherits WHERE inhparent = $1::regclass")
                .bind(self.t())
                .fetch_one(pool)
                .await?;
        Ok(n.unsigned_abs())
    }

    /// The load for `length`. With `vacuum_first` a `VACUUM` of the ledger runs first and the
    /// partitioned ledger's retention acts right after it; otherwise that retention acts a third
    /// of the way in.
    async fn phase(
        &self,
        pool: &PgPool,
        load: &Load,
        name: &'static str,
        length: Duration,
        removed: &AtomicU64,
        vacuum_first: bool,
    ) -> Result<PhaseFigures, BenchError> {
        let before = removed.load(Ordering::Relaxed);
        let began = Instant::now();
        let (figures, actions) = load
            .measure_while(async {
                let mut actions = Vec::new();
                if vacuum_first {
                    let vacuum = Instant::now();
                    sqlx::raw_sql(AssertSqlSafe(format!("VACUUM {}", self.t())))
                        .execute(pool)
                        .await?;
                    let secs = vacuum.elapsed().as_secs_f64();
                    let (dead, _) = self.dead_tuples_and_bytes(pool).await?;
                    actions.push(format!("VACUUM {secs:.1} s, {dead} dead tuples just after"));
                } else if self.layout == LedgerLayout::Generations {
                    tokio::time::sleep(length / 3).await;
                }
                if self.layout == LedgerLayout::Generations {
                    actions.extend(self.rotate_and_drop(pool, removed).await?);
                }
                tokio::time::sleep(length.saturating_sub(began.elapsed())).await;
                Ok::<_, BenchError>(actions)
            })
            .await?;
        let actions = actions?;
        self.figures(
            pool,
            name,
            began,
            figures,
            removed.load(Ordering::Relaxed) - before,
            actions,
        )
        .await
    }

    async fn figures(
        &self,
        pool: &PgPool,
        name: &'static str,
        began: Instant,
        load: LoadFigures,
        rows_removed: u64,
        actions: Vec<String>,
    ) -> Result<PhaseFigures, BenchError> {
        let (dead_tuples, bytes) = self.dead_tuples_and_bytes(pool).await?;
        Ok(PhaseFigures {
            name,
            secs: began.elapsed().as_secs_f64(),
            load,
            rows_removed,
            dead_tuples,
            ledger_mb: bytes as f64 / 1e6,
            actions,
        })
    }

    /// Dead tuples (statistics) and bytes of the ledger and its partitions.
    async fn dead_tuples_and_bytes(&self, pool: &PgPool) -> Result<(i64, i64), BenchError> {
        // Statistics reach the shared counters within a second of a transaction's end.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Ok(sqlx::query_as(
            "SELECT coalesce(sum(s.n_dead_tup), 0)::int8, \
               coalesce(sum(pg_total_relation_size(s.relid)), 0)::int8 \
             FROM pg_stat_user_tables s \
             WHERE s.schemaname = $1 AND (s.relname = 'message_inbox' \
               OR s.relname LIKE 'message\\_inbox\\_g%')",
        )
        .bind(self.schema.as_str())
        .fetch_one(pool)
        .await?)
    }

    /// A rotation (a new generation becomes the one claims insert into), then the drop of the
    /// oldest generation closed longer than the window ago, if any. The drop takes the parent's
    /// ACCESS EXCLUSIVE lock, so it waits at most a short `lock_timeout` per try: a waiting
    /// drop would hold up every claim queued behind it.
    async fn rotate_and_drop(
        &self,
        pool: &PgPool,
        removed: &AtomicU64,
    ) -> Result<Vec<String>, BenchError> {
        let t = self.t();
        let s = &self.schema;
        let mut actions = Vec::new();
        let mut conn = pool.acquire().await?.detach();
        let began = Instant::now();
        let next: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT max(generation) + 1 FROM \"{s}\".inbox_generation"
        )))
        .fetch_one(&mut conn)
        .await?;
        // Created apart and attached: ATTACH takes only SHARE UPDATE EXCLUSIVE on the parent,
        // which claims do not conflict with.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE \"{s}\".message_inbox_g{next} (LIKE {t} INCLUDING DEFAULTS \
               INCLUDING CONSTRAINTS INCLUDING STORAGE) WITH (fillfactor = 90); \
             ALTER TABLE \"{s}\".message_inbox_g{next} ADD CHECK (generation = {next}); \
             ALTER TABLE {t} ATTACH PARTITION \"{s}\".message_inbox_g{next} \
               FOR VALUES IN ({next}); \
             BEGIN; SELECT pg_advisory_xact_lock({GENERATION_LOCK}); \
             UPDATE \"{s}\".inbox_generation SET closed_at = now() WHERE closed_at IS NULL; \
             INSERT INTO \"{s}\".inbox_generation VALUES ({next}, NULL); COMMIT"
        )))
        .execute(&mut conn)
        .await?;
        actions.push(format!(
            "rotate to g{next} {:.0} ms",
            began.elapsed().as_secs_f64() * 1e3
        ));
        let expired: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT min(generation) FROM \"{s}\".inbox_generation \
             WHERE closed_at <= now() - make_interval(days => {WINDOW_DAYS})"
        )))
        .fetch_one(&mut conn)
        .await?;
        if let Some(generation) = expired {
            let rows: f32 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT reltuples FROM pg_class \
                 WHERE oid = '\"{s}\".message_inbox_g{generation}'::regclass"
            )))
            .fetch_one(&mut conn)
            .await?;
            let began = Instant::now();
            let statements = self.write_tombstones(&mut conn, generation).await?;
            actions.push(format!(
                "tombstones for g{generation} ({:.1} M rows) {:.0} s, {statements} statements",
                f64::from(rows) / 1e6,
                began.elapsed().as_secs_f64()
            ));
            let began = Instant::now();
            let mut tries = 0;
            loop {
                tries += 1;
                let dropped = sqlx::raw_sql(AssertSqlSafe(format!(
                    "BEGIN; SET LOCAL lock_timeout = '500ms'; \
                     DROP TABLE \"{s}\".message_inbox_g{generation}; \
                     DELETE FROM \"{s}\".inbox_generation WHERE generation = {generation}; \
                     COMMIT"
                )))
                .execute(&mut conn)
                .await;
                match dropped {
                    Ok(_) => break,
                    Err(e) if tries < 20 => {
                        sqlx::raw_sql("ROLLBACK").execute(&mut conn).await.ok();
                        tracing::warn!("dropping generation {generation}: {e}; trying again");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            removed.fetch_add(rows.max(0.0) as u64, Ordering::Relaxed);
            actions.push(format!(
                "drop g{generation} {:.0} ms, {tries} tries",
                began.elapsed().as_secs_f64() * 1e3
            ));
        }
        conn.close().await?;
        Ok(actions)
    }

    /// What today's retention writes per removed row, a tombstone, for a whole generation
    /// before its partition goes: `INSERT .. SELECT` over ranges of its blocks (a TID range
    /// scan each), so no statement runs for minutes.
    async fn write_tombstones(
        &self,
        conn: &mut PgConnection,
        generation: i64,
    ) -> Result<u64, BenchError> {
        const BLOCKS: i64 = 32_768;
        let s = &self.schema;
        let partition = format!("\"{s}\".message_inbox_g{generation}");
        let blocks: i64 = sqlx::query_scalar(
            "SELECT pg_relation_size($1::regclass) / current_setting('block_size')::int8",
        )
        .bind(&partition)
        .fetch_one(&mut *conn)
        .await?;
        let mut statements = 0;
        let mut start = 0;
        while start < blocks {
            let end = start + BLOCKS;
            sqlx::raw_sql(AssertSqlSafe(format!(
                "INSERT INTO \"{s}\".inbox_tombstone AS x (message_id, consumer_name, \
                   payload_sha256, final_status, message_type, first_received_at, processed_at) \
                 SELECT message_id, consumer_name, payload_sha256, status, message_type, \
                   first_received_at, processed_at FROM {partition} \
                 WHERE ctid >= '({start},0)'::tid AND ctid < '({end},0)'::tid \
                 ON CONFLICT (message_id, consumer_name) DO UPDATE SET \
                   payload_sha256 = EXCLUDED.payload_sha256, \
                   final_status = EXCLUDED.final_status, removed_at = now()"
            )))
            .execute(&mut *conn)
            .await?;
            statements += 1;
            start = end;
        }
        Ok(statements)
    }
}

/// The partitioned ledger's claim of a batch, in the caller's transaction.
pub(crate) struct GenerationClaim {
    insert: String,
    lock_existing: String,
}

impl GenerationClaim {
    fn new(schema: &SchemaName) -> Self {
        let t = format!("\"{schema}\".message_inbox");
        Self {
            insert: format!(
                "WITH cur AS (SELECT generation FROM \"{schema}\".inbox_generation \
                   WHERE closed_at IS NULL), \
                 ins AS (INSERT INTO {t} (generation, message_id, consumer_name, message_type, \
                   message_version, status, processing_attempt, processing_started_at, \
                   processed_at, payload_sha256) \
                 SELECT cur.generation, u.id, $1, 'BenchEvent', 1, {PROCESSED}, 1, now(), now(), \
                   u.sha \
                 FROM cur, UNNEST($2::text[], $3::bytea[]) AS u(id, sha) \
                 WHERE NOT EXISTS (SELECT 1 FROM {t} o WHERE o.consumer_name = $1 \
                   AND o.message_id = u.id AND o.generation <> cur.generation) \
                 ON CONFLICT (message_id, consumer_name, generation) DO NOTHING \
                 RETURNING message_id) \
                 SELECT message_id FROM ins"
            ),
            lock_existing: format!(
                "SELECT message_id FROM {t} WHERE consumer_name = $1 AND message_id = ANY($2) \
                 ORDER BY message_id FOR UPDATE"
            ),
        }
    }

    /// Claims `envelopes` (new rows inserted PROCESSED, as the library's committing claim
    /// does); returns the ids that existed, their rows locked.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        envelopes: &[Envelope],
    ) -> Result<Vec<String>, BenchError> {
        // Before the statement that reads the current generation: its snapshot is taken after
        // a rotation that held the lock has committed.
        sqlx::query("SELECT pg_advisory_xact_lock_shared($1)")
            .bind(GENERATION_LOCK)
            .execute(&mut *conn)
            .await?;
        let mut sorted: Vec<&Envelope> = envelopes.iter().collect();
        sorted.sort_by(|a, b| a.message_id.cmp(&b.message_id));
        let ids: Vec<&str> = sorted.iter().map(|e| e.message_id.as_str()).collect();
        let shas: Vec<&[u8]> = sorted.iter().map(|e| e.payload_sha256.as_slice()).collect();
        let inserted: Vec<String> = sqlx::query_scalar(AssertSqlSafe(self.insert.clone()))
            .bind(consumer)
            .bind(&ids)
            .bind(&shas)
            .fetch_all(&mut *conn)
            .await?;
        let existing: Vec<&str> = ids
            .into_iter()
            .filter(|id| !inserted.iter().any(|i| i == id))
            .collect();
        if existing.is_empty() {
            return Ok(Vec::new());
        }
        Ok(
            sqlx::query_scalar(AssertSqlSafe(self.lock_existing.clone()))
                .bind(consumer)
                .bind(&existing)
                .fetch_all(&mut *conn)
                .await?,
        )
    }
}

impl LedgerBenchResult {
    /// The figures as a table per layout, with each phase's rate against the load alone.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for l in &self.layouts {
            writeln!(
                out,
                "{:?}: {} rows ({} past the window), filled and indexed in {:.0} s; \
                 a claim probes {} partition(s); keys in two generations: {}",
                l.layout, l.rows, l.expired, l.fill_secs, l.partitions, l.keys_in_two_generations
            )
            .ok();
            out += "  phase        secs   tx/s  claims/s  x alone  p50 ms  p99 ms  max ms  \
                    removed    dead tuples  ledger MB\n";
            let first = l.phases.first().map(|p| p.load.tx_per_s).unwrap_or(0.0);
            for p in &l.phases {
                writeln!(
                    out,
                    "  {:<10} {:>6.0} {:>6.0} {:>9.0} {:>8.2} {:>7.1} {:>7.1} {:>7.1} {:>10} {:>12} {:>10.0}",
                    p.name,
                    p.secs,
                    p.load.tx_per_s,
                    p.load.claims_per_s,
                    p.load.tx_per_s / first.max(1e-9),
                    p.load.p50_ms,
                    p.load.p99_ms,
                    p.load.max_ms,
                    p.rows_removed,
                    p.dead_tuples,
                    p.ledger_mb
                )
                .ok();
                for action in &p.actions {
                    writeln!(out, "               {action}").ok();
                }
            }
            out += "\n";
        }
        let rate = |layout: LedgerLayout, phase: &str| {
            self.layouts
                .iter()
                .find(|l| l.layout == layout)
                .and_then(|l| l.phases.iter().find(|p| p.name == phase))
                .map(|p| p.load.tx_per_s)
        };
        for phase in ["alone", "retention", "pinned", "after"] {
            if let (Some(g), Some(t)) = (
                rate(LedgerLayout::Generations, phase),
                rate(LedgerLayout::Table, phase),
            ) {
                writeln!(
                    out,
                    "generations vs table, {phase}: rate {:.2}x",
                    g / t.max(1e-9)
                )
                .ok();
            }
        }
        out
    }
}
