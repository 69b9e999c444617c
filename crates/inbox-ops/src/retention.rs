//! Retention: scrub payloads, then remove (delete or archive) expired rows leaving
//! tombstones, then expire tombstones. In bounded batches, one short statement each, safe
//! beside running consumers; one cleaner at a time per schema and consumer.
//!
//! How a pass finds its rows: the inbox has no B-tree on `processed_at` (the hot path would
//! pay for it on every claim), only a BRIN index, which narrows a *time range* to the block
//! ranges that may hold it. A pass therefore walks time slices `[lo, hi)` up to its cutoff,
//! each batch `LIMIT n FOR UPDATE SKIP LOCKED` within one slice, and widens or narrows the
//! slice to keep batches near `n` rows; `inbox_retention_mark` remembers how far it got, so
//! the next run starts there instead of rescanning the deleted (not yet vacuumed) blocks of
//! earlier runs. Parked rows are found through the partial index of open rows.
//!
//! **Invariant:** only PROCESSED and parked rows are ever removed, each with a tombstone
//! written by the same statement; a row locked by a consumer (a duplicate being noted) is
//! skipped, never waited for.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, PgConnection, SqlSafeStr, SqlStr};

use crate::{
    actor::Actor,
    audit::audit,
    error::OpsError,
    operations::Operations,
    progress::{NoProgress, Progress},
    sql::PARKED_BY_FAILURE,
};
use rabbit_inbox::{
    ConfigError, ConsumerConfig,
    ledger_sql::PROCESSED,
    retention::{RetentionMode, RetentionPolicy},
    retry::RetryPolicy,
    schema::SchemaName,
    telemetry::metrics as m,
};

/// What to clean up, under which policy.
#[derive(Clone, Debug)]
pub struct CleanupRequest {
    /// The consumer whose rows are cleaned.
    pub consumer: String,
    /// The policy.
    pub retention: RetentionPolicy,
    /// The consumer's retry schedule, for the window check.
    pub retry: RetryPolicy,
    /// Count what would be done; change nothing.
    pub dry_run: bool,
    /// Run even though the window check fails; written to `inbox_audit`.
    pub force: Option<Actor>,
}

impl CleanupRequest {
    /// Cleanup of `consumer` under `retention`, its window checked against `retry`.
    pub fn new(
        consumer: impl Into<String>,
        retention: RetentionPolicy,
        retry: RetryPolicy,
    ) -> Self {
        Self {
            consumer: consumer.into(),
            retention,
            retry,
            dry_run: false,
            force: None,
        }
    }
}

/// What a cleanup run did (or, in a dry run, would do).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CleanupReport {
    /// The consumer.
    pub consumer: String,
    /// Nothing was changed.
    pub dry_run: bool,
    /// Delete or archive.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub mode: RetentionMode,
    /// The window check failed and the run was forced.
    pub forced: bool,
    /// The longest redelivery horizon, in seconds.
    pub horizon_secs: u64,
    /// PROCESSED rows whose payload and headers were removed.
    pub scrubbed: u64,
    /// PROCESSED rows removed (tombstones written).
    pub removed_processed: u64,
    /// Parked rows removed (tombstones written).
    pub removed_parked: u64,
    /// Tombstones expired.
    pub tombstones_expired: u64,
    /// Statements run.
    pub batches: u64,
    /// Wall time, in milliseconds.
    pub elapsed_ms: u64,
}

/// Which rows of `message_inbox` a pass scans: one message type, or every type but the ones
/// with their own pass.
#[derive(Clone, Debug)]
struct Types {
    only: Option<String>,
    except: Vec<String>,
}

impl Types {
    /// The mark's name: a pass over another set of types starts afresh.
    fn label(&self) -> String {
        match &self.only {
            Some(t) => format!("type={t}"),
            None => format!("all-except={}", self.except.join(",")),
        }
    }
}

/// The statements, built per run from the validated schema name.
struct Sql {
    /// Batch statements over a `processed_at` slice:
    /// $1 consumer, $2 lo (NULL: open), $3 hi, $4 only type, $5 excluded types, $6 limit.
    scrub: SqlStr,
    remove_processed: SqlStr,
    /// Count over a slice, same $1 to $5.
    count_scrub: SqlStr,
    count_processed: SqlStr,
    /// Oldest candidate below $3 (same $1 to $5, $2 unused but typed).
    min_scrub: SqlStr,
    min_processed: SqlStr,
    /// Parked rows failed before $2; $1 consumer, $3 limit.
    remove_parked: SqlStr,
    count_parked: SqlStr,
    /// Tombstones removed before $2 from slice start $3; $1 consumer, $4 limit.
    expire_tombstones: SqlStr,
    count_tombstones: SqlStr,
    min_tombstones: SqlStr,
    /// Summarizes the BRIN ranges filled since the last vacuum.
    summarize: SqlStr,
    read_mark: SqlStr,
    write_mark: SqlStr,
}

fn sql(text: String) -> SqlStr {
    AssertSqlSafe(text).into_sql_str()
}

/// Rows a PROCESSED pass may touch: its consumer, its slice, its types.
fn processed_slice() -> String {
    format!(
        "consumer_name = $1 AND status = {PROCESSED} \
         AND processed_at >= coalesce($2::timestamptz, '-infinity') AND processed_at < $3 \
         AND ($4::text IS NULL OR message_type = $4) AND message_type <> ALL($5::text[])"
    )
}

/// Parked rows whose last failure is older than $2. `first_received_at` comes first so the
/// partial index of open rows finds them (a row's last failure is never before its receipt).
fn parked_expired() -> String {
    format!(
        "consumer_name = $1 AND status IN ({PARKED_BY_FAILURE}) \
         AND first_received_at < $2 AND coalesce(last_failed_at, first_received_at) < $2"
    )
}

/// A row that still holds something of its message: a body, headers, or an error message that
/// is not only its safe detail (in clear or sealed).
const UNSCRUBBED: &str = "(payload IS NOT NULL OR headers <> '{}'::jsonb \
     OR last_error_sealed IS NOT NULL OR last_error_message IS DISTINCT FROM \
       CASE WHEN last_error_message IS NULL THEN NULL \
       ELSE coalesce(last_error_safe, '[redacted]') END)";

/// What scrubbing leaves of the error message: the safe detail, else a marker.
const SCRUBBED_ERROR: &str = "CASE WHEN last_error_message IS NULL THEN NULL \
     ELSE coalesce(last_error_safe, '[redacted]') END";

impl Sql {
    fn new(schema: &SchemaName) -> Self {
        let t = schema.qualify("message_inbox");
        let tomb = schema.qualify("inbox_tombstone");
        let archive = schema.qualify("inbox_archive");
        let marks = schema.qualify("inbox_retention_mark");
        let (processed_slice, parked_expired) = (processed_slice(), parked_expired());
        // One removal statement, whatever picks the rows: delete them by the row locations
        // the locking select returned (a TID scan, no join to plan), write their tombstones
        // (and in archive mode their archive rows) from what DELETE returned.
        let remove = |victims: String, archive_param: &str| {
            sql(format!(
                "WITH del AS (DELETE FROM {t} AS i WHERE ctid = ANY(ARRAY({victims})) \
                   RETURNING i.*), \
                 tomb AS (INSERT INTO {tomb} AS x (message_id, consumer_name, payload_sha256, \
                     final_status, message_type, first_received_at, processed_at) \
                   SELECT message_id, consumer_name, payload_sha256, status, message_type, \
                     first_received_at, processed_at FROM del \
                   ON CONFLICT (message_id, consumer_name) DO UPDATE SET \
                     payload_sha256 = EXCLUDED.payload_sha256, final_status = EXCLUDED.final_status, \
                     message_type = EXCLUDED.message_type, \
                     first_received_at = EXCLUDED.first_received_at, \
                     processed_at = EXCLUDED.processed_at, removed_at = now()), \
                 arch AS (INSERT INTO {archive} (message_id, consumer_name, message_type, status, \
                     payload_sha256, first_received_at, processed_at, row_data) \
                   SELECT message_id, consumer_name, message_type, status, payload_sha256, \
                     first_received_at, processed_at, to_jsonb(del) FROM del WHERE {archive_param}) \
                 SELECT count(*) FROM del"
            ))
        };
        Sql {
            scrub: sql(format!(
                "UPDATE {t} SET payload = NULL, payload_key_id = NULL, headers = '{{}}'::jsonb, \
                   last_error_message = {SCRUBBED_ERROR}, last_error_sealed = NULL, \
                   last_error_key_id = NULL \
                 WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} \
                   WHERE {processed_slice} AND {UNSCRUBBED} LIMIT $6 FOR UPDATE SKIP LOCKED))"
            )),
            remove_processed: remove(
                format!(
                    "SELECT ctid FROM {t} WHERE {processed_slice} \
                     LIMIT $6 FOR UPDATE SKIP LOCKED"
                ),
                "$7::bool",
            ),
            count_scrub: sql(format!(
                "SELECT count(*) FROM {t} WHERE {processed_slice} AND {UNSCRUBBED}"
            )),
            count_processed: sql(format!("SELECT count(*) FROM {t} WHERE {processed_slice}")),
            min_scrub: sql(format!(
                "SELECT min(processed_at) FROM {t} WHERE {processed_slice} AND {UNSCRUBBED}"
            )),
            min_processed: sql(format!(
                "SELECT min(processed_at) FROM {t} WHERE {processed_slice}"
            )),
            remove_parked: remove(
                format!(
                    "SELECT ctid FROM {t} WHERE {parked_expired} \
                     LIMIT $3 FOR UPDATE SKIP LOCKED"
                ),
                "$4::bool",
            ),
            count_parked: sql(format!("SELECT count(*) FROM {t} WHERE {parked_expired}")),
            expire_tombstones: sql(format!(
                "DELETE FROM {tomb} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {tomb} \
                   WHERE consumer_name = $1 AND removed_at < $2 \
                     AND removed_at >= coalesce($3::timestamptz, '-infinity') \
                   LIMIT $4 FOR UPDATE SKIP LOCKED))"
            )),
            count_tombstones: sql(format!(
                "SELECT count(*) FROM {tomb} WHERE consumer_name = $1 AND removed_at < $2 \
                   AND removed_at >= coalesce($3::timestamptz, '-infinity')"
            )),
            min_tombstones: sql(format!(
                "SELECT min(removed_at) FROM {tomb} WHERE consumer_name = $1 AND removed_at < $2 \
                   AND removed_at >= coalesce($3::timestamptz, '-infinity')"
            )),
            summarize: sql(format!(
                "SELECT brin_summarize_new_values('{}'::regclass)",
                schema
                    .qualify("idx_message_inbox_processed_at")
                    .replace('\'', "''")
            )),
            read_mark: sql(format!(
                "SELECT done_until FROM {marks} WHERE consumer_name = $1 AND pass = $2"
            )),
            write_mark: sql(format!(
                "INSERT INTO {marks} (consumer_name, pass, done_until) VALUES ($1, $2, $3) \
                 ON CONFLICT (consumer_name, pass) DO UPDATE SET done_until = EXCLUDED.done_until, \
                   updated_at = now()"
            )),
        }
    }
}

/// Key of the cleaner's session advisory lock for `schema` and `consumer`: the first 8 bytes
/// of a SHA-256 over a fixed prefix and both names (distinct from the schema lock's keys).
fn lock_key(schema: &SchemaName, consumer: &str) -> i64 {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(format!("rabbit-inbox retention\0{schema}\0{consumer}"));
    let mut key = [0u8; 8];
    key.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(key)
}

/// A time-sliced pass over one table and column.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sliced {
    Scrub,
    Remove,
    Tombstones,
}

/// How often a run summarizes new BRIN ranges. Until a range is summarized (by vacuum, or
/// here) every BRIN scan reads it: on a busy inbox the millions of rows inserted since the
/// last vacuum would be read by every batch.
const SUMMARIZE_EVERY: Duration = Duration::from_secs(20);

/// Smallest and first slice widths.
const MIN_SLICE: Duration = Duration::from_secs(1);
const FIRST_SLICE: Duration = Duration::from_secs(600);

impl Operations {
    /// Runs retention for one consumer: scrub payloads, remove expired rows (tombstones,
    /// archive), expire tombstones. Refused when the policy's dedup window is shorter than the
    /// redelivery horizon (unless forced, which is audited), and when another cleaner of the
    /// same schema and consumer is running.
    pub async fn cleanup(
        &self,
        request: &CleanupRequest,
        progress: &dyn Progress,
    ) -> Result<CleanupReport, OpsError> {
        let started = Instant::now();
        let policy = &request.retention;
        policy
            .validate()
            .map_err(|e| OpsError::Invalid(e.to_string()))?;
        let window = policy.check_window(&request.retry);
        let forced = match (&window, &request.force) {
            (Ok(()), _) => false,
            (Err(e), None) => {
                return Err(OpsError::Refused(format!(
                    "{e}. To run anyway, force it with an actor and a reason (audited)"
                )));
            }
            (Err(_), Some(_)) => true,
        };

        // Its own connection, closed (not pooled) at the end: the session lock goes with it
        // even if this future is dropped midway.
        let mut conn = self.pool.acquire().await?.detach();
        // Custom plans: a generic plan of a slice statement could not use the slice bounds to
        // narrow the BRIN scan.
        sqlx::raw_sql("SET lock_timeout = '5s'; SET plan_cache_mode = force_custom_plan")
            .execute(&mut conn)
            .await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(lock_key(&self.schema, &request.consumer))
            .fetch_one(&mut conn)
            .await?;
        if !locked {
            return Err(OpsError::Refused(format!(
                "another cleanup of {}.{} is running; try again when it is done",
                self.schema, request.consumer
            )));
        }
        let sql = Sql::new(&self.schema);
        let mut run = Run {
            conn: &mut conn,
            schema: &self.schema,
            sql: &sql,
            request,
            progress,
            summarized: Some(Instant::now() - SUMMARIZE_EVERY),
            report: CleanupReport {
                consumer: request.consumer.clone(),
                dry_run: request.dry_run,
                mode: policy.mode,
                forced,
                horizon_secs: policy.redelivery_horizon(&request.retry).as_secs(),
                ..CleanupReport::default()
            },
        };
        if let (Err(e), Some(actor)) = (&window, &request.force)
            && !request.dry_run
        {
            run.audit(
                actor.name(),
                "cleanup_forced",
                actor.reason(),
                actor.ticket(),
                serde_json::json!({ "window": e.to_string() }),
            )
            .await?;
        }
        run.all().await?;
        run.report.elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let r = &run.report;
        if !request.dry_run && r.scrubbed + r.removed_processed + r.removed_parked > 0 {
            let (name, reason, ticket) = match &request.force {
                Some(a) => (a.name(), a.reason(), a.ticket()),
                None => ("retention", "retention policy", None),
            };
            let details = serde_json::to_value(&run.report).unwrap_or_default();
            run.audit(name, "cleanup", reason, ticket, details).await?;
        }
        let report = run.report;
        // Unlocked explicitly; closing the connection would release it as well.
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(lock_key(&self.schema, &request.consumer))
            .execute(&mut conn)
            .await?;
        Ok(report)
    }
}

/// One cleanup run on the lock's connection.
struct Run<'a> {
    conn: &'a mut PgConnection,
    schema: &'a SchemaName,
    sql: &'a Sql,
    request: &'a CleanupRequest,
    progress: &'a dyn Progress,
    report: CleanupReport,
    /// When the BRIN ranges were last summarized; `None` once summarizing is not allowed.
    summarized: Option<Instant>,
}

impl Run<'_> {
    async fn all(&mut self) -> Result<(), OpsError> {
        let policy = self.request.retention.clone();
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut *self.conn)
            .await?;
        let before =
            |d: Duration| now - chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX);
        let overridden: Vec<String> = policy.per_type.keys().cloned().collect();
        let mut passes = vec![(
            Types {
                only: None,
                except: overridden.clone(),
            },
            policy.processed,
            policy.scrub_payload_after,
        )];
        passes.extend(overridden.iter().map(|ty| {
            (
                Types {
                    only: Some(ty.clone()),
                    except: Vec::new(),
                },
                policy.processed_for(ty),
                policy.scrub_for(ty),
            )
        }));
        // Payloads go first (their window is shorter), so removal has less to carry.
        for (types, _, scrub) in &passes {
            if let Some(scrub) = scrub {
                self.report.scrubbed += self.sliced(Sliced::Scrub, types, before(*scrub)).await?;
            }
        }
        for (types, rows, _) in &passes {
            self.report.removed_processed +=
                self.sliced(Sliced::Remove, types, before(*rows)).await?;
        }
        if let Some(parked) = policy.parked {
            self.report.removed_parked = self.parked(before(parked)).await?;
        }
        let all = Types {
            only: None,
            except: Vec::new(),
        };
        self.report.tombstones_expired = self
            .sliced(Sliced::Tombstones, &all, before(policy.tombstones))
            .await?;
        Ok(())
    }

    /// Parked rows through the index of open rows: no slices needed.
    async fn parked(&mut self, cutoff: DateTime<Utc>) -> Result<u64, OpsError> {
        let consumer = &self.request.consumer;
        if self.request.dry_run {
            let n: i64 = sqlx::query_scalar(self.sql.count_parked.clone())
                .bind(consumer)
                .bind(cutoff)
                .fetch_one(&mut *self.conn)
                .await?;
            return Ok(n.unsigned_abs());
        }
        let limit = i64::from(self.request.retention.batch_size);
        let archive = self.request.retention.mode == RetentionMode::Archive;
        let mut total = 0;
        loop {
            let n: i64 = sqlx::query_scalar(self.sql.remove_parked.clone())
                .bind(consumer)
                .bind(cutoff)
                .bind(limit)
                .bind(archive)
                .fetch_one(&mut *self.conn)
                .await?;
            self.report.batches += 1;
            let n = n.unsigned_abs();
            total += n;
            self.progress.advance(n);
            if n < limit.unsigned_abs() {
                return Ok(total);
            }
        }
    }

    /// A pass over `[mark, cutoff)` in time slices sized to about one batch each.
    async fn sliced(
        &mut self,
        kind: Sliced,
        types: &Types,
        cutoff: DateTime<Utc>,
    ) -> Result<u64, OpsError> {
        let pass = format!(
            "{}:{}",
            match kind {
                Sliced::Scrub => "scrub",
                Sliced::Remove => "remove",
                Sliced::Tombstones => "tombstones",
            },
            types.label()
        );
        let consumer = self.request.consumer.clone();
        let mark: Option<DateTime<Utc>> = sqlx::query_scalar(self.sql.read_mark.clone())
            .bind(&consumer)
            .bind(&pass)
            .fetch_optional(&mut *self.conn)
            .await?;
        if self.request.dry_run {
            let n: i64 = self
                .slice_query(kind, SliceQuery::Count, types, mark, cutoff)
                .await?
                .unwrap_or_default();
            return Ok(n.unsigned_abs());
        }
        // Where to begin: the mark, else the oldest candidate (one scan of the blocks below
        // the cutoff, the BRIN index skipping the rest).
        let mut lo = match mark {
            Some(m) if m >= cutoff => return Ok(0),
            Some(m) => m,
            None => {
                let oldest: Option<DateTime<Utc>> = self
                    .slice_query(kind, SliceQuery::Oldest, types, None, cutoff)
                    .await?;
                match oldest {
                    Some(oldest) => oldest,
                    None => {
                        self.save_mark(&pass, cutoff).await?;
                        return Ok(0);
                    }
                }
            }
        };
        let limit = u64::from(self.request.retention.batch_size);
        let mut width = FIRST_SLICE;
        let mut total = 0;
        // Set once a slice keeps rows a consumer held locked (skipped, not waited for): the
        // mark then stays before them, so the next run sees them again.
        let mut held = false;
        while lo < cutoff {
            let hi = (lo + chrono::Duration::from_std(width).unwrap_or(chrono::Duration::MAX))
                .min(cutoff);
            let n = self.batch(kind, types, lo, hi).await?;
            total += n;
            self.progress.advance(n);
            if matches!(kind, Sliced::Remove) {
                // Per batch, so the headroom alert sees a long run while it deletes.
                metrics::counter!(m::RETENTION_DELETED, "consumer" => consumer.clone())
                    .increment(n);
            }
            if n >= limit {
                // The slice holds more than a batch: finish it with narrower ones next time.
                width = (width / 2).max(MIN_SLICE);
                continue;
            }
            if !held {
                let left: i64 = self
                    .slice_query(kind, SliceQuery::Count, types, Some(lo), hi)
                    .await?
                    .unwrap_or_default();
                held = left > 0;
                if !held {
                    self.save_mark(&pass, hi).await?;
                }
            }
            lo = hi;
            if n < limit / 2 {
                width = width.saturating_mul(2);
            }
        }
        Ok(total)
    }

    async fn save_mark(&mut self, pass: &str, done_until: DateTime<Utc>) -> Result<(), OpsError> {
        sqlx::query(self.sql.write_mark.clone())
            .bind(&self.request.consumer)
            .bind(pass)
            .bind(done_until)
            .execute(&mut *self.conn)
            .await?;
        Ok(())
    }

    /// Summarizes the BRIN ranges filled since the last vacuum, every [`SUMMARIZE_EVERY`].
    /// Best effort: only the index's owner may (else autovacuum does it, later), and a
    /// running vacuum holds the lock it needs.
    async fn summarize(&mut self) {
        let Some(last) = self.summarized else { return };
        if last.elapsed() < SUMMARIZE_EVERY {
            return;
        }
        match sqlx::query(self.sql.summarize.clone())
            .execute(&mut *self.conn)
            .await
        {
            Ok(_) => self.summarized = Some(Instant::now()),
            Err(e) => {
                tracing::debug!(error = %e, "cannot summarize the processed_at BRIN index; autovacuum will");
                self.summarized = None;
            }
        }
    }

    /// One batch of a sliced pass: rows changed.
    async fn batch(
        &mut self,
        kind: Sliced,
        types: &Types,
        lo: DateTime<Utc>,
        hi: DateTime<Utc>,
    ) -> Result<u64, OpsError> {
        if kind != Sliced::Tombstones {
            self.summarize().await;
        }
        let limit = i64::from(self.request.retention.batch_size);
        let consumer = &self.request.consumer;
        self.report.batches += 1;
        let n = match kind {
            Sliced::Scrub => sqlx::query(self.sql.scrub.clone())
                .bind(consumer)
                .bind(lo)
                .bind(hi)
                .bind(types.only.as_deref())
                .bind(&types.except)
                .bind(limit)
                .execute(&mut *self.conn)
                .await?
                .rows_affected(),
            Sliced::Remove => sqlx::query_scalar::<_, i64>(self.sql.remove_processed.clone())
                .bind(consumer)
                .bind(lo)
                .bind(hi)
                .bind(types.only.as_deref())
                .bind(&types.except)
                .bind(limit)
                .bind(self.request.retention.mode == RetentionMode::Archive)
                .fetch_one(&mut *self.conn)
                .await?
                .unsigned_abs(),
            Sliced::Tombstones => sqlx::query(self.sql.expire_tombstones.clone())
                .bind(consumer)
                .bind(hi)
                .bind(lo)
                .bind(limit)
                .execute(&mut *self.conn)
                .await?
                .rows_affected(),
        };
        Ok(n)
    }

    /// A count or the oldest candidate of a pass in `[lo, cutoff)`.
    async fn slice_query<T>(
        &mut self,
        kind: Sliced,
        what: SliceQuery,
        types: &Types,
        lo: Option<DateTime<Utc>>,
        cutoff: DateTime<Utc>,
    ) -> Result<Option<T>, OpsError>
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + Unpin,
    {
        let sql = match (kind, what) {
            (Sliced::Scrub, SliceQuery::Count) => &self.sql.count_scrub,
            (Sliced::Scrub, SliceQuery::Oldest) => &self.sql.min_scrub,
            (Sliced::Remove, SliceQuery::Count) => &self.sql.count_processed,
            (Sliced::Remove, SliceQuery::Oldest) => &self.sql.min_processed,
            (Sliced::Tombstones, SliceQuery::Count) => &self.sql.count_tombstones,
            (Sliced::Tombstones, SliceQuery::Oldest) => &self.sql.min_tombstones,
        };
        let consumer = &self.request.consumer;
        let query = sqlx::query_scalar::<_, Option<T>>(sql.clone());
        let query = if kind == Sliced::Tombstones {
            query.bind(consumer).bind(cutoff).bind(lo)
        } else {
            query
                .bind(consumer)
                .bind(lo)
                .bind(cutoff)
                .bind(types.only.as_deref())
                .bind(&types.except)
        };
        Ok(query.fetch_one(&mut *self.conn).await?)
    }

    async fn audit(
        &mut self,
        actor: &str,
        action: &str,
        reason: &str,
        ticket: Option<&str>,
        details: serde_json::Value,
    ) -> Result<(), OpsError> {
        let mut actor = Actor::new(actor, reason)?;
        if let Some(ticket) = ticket {
            actor = actor.with_ticket(ticket)?;
        }
        audit(
            self.conn,
            self.schema,
            &actor,
            action,
            Some(&self.request.consumer),
            None,
            details,
        )
        .await?;
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
enum SliceQuery {
    Count,
    Oldest,
}
/// Retention on a timer beside a consumer (run it under a [`rabbit_inbox::Runner`]): every
/// `retention.interval`, the cleanup `inboxctl cleanup` runs. Instances take turns through the
/// cleaner's advisory lock: one that finds it taken skips that round.
#[derive(Debug)]
pub struct RetentionTask {
    ops: Operations,
    request: CleanupRequest,
    interval: Duration,
}

impl RetentionTask {
    /// Cleans up the rows of the consumer `config` describes under `retention`, whose
    /// `interval` must be set. A dedup window shorter than the consumer's redelivery horizon
    /// is refused, unless `forced_by` accepts it: the task then starts with a warning, and
    /// every cleanup it runs is written to `inbox_audit` under that actor, as a forced
    /// `inboxctl cleanup` is.
    pub fn new(
        pool: sqlx::PgPool,
        config: &ConsumerConfig,
        retention: RetentionPolicy,
        forced_by: Option<Actor>,
    ) -> Result<Self, ConfigError> {
        retention.validate()?;
        let Some(interval) = retention.interval else {
            return Err(ConfigError::InvalidSetting {
                name: "retention.interval",
                reason: "a retention task needs an interval (without one, run inboxctl cleanup)"
                    .into(),
            });
        };
        if let Err(unsafe_window) = retention.check_window(&config.retry) {
            let Some(actor) = &forced_by else {
                return Err(unsafe_window);
            };
            tracing::warn!(
                consumer = %config.consumer_name,
                actor = actor.name(),
                reason = actor.reason(),
                "{unsafe_window}; accepted, every cleanup is audited"
            );
        }
        let mut request =
            CleanupRequest::new(&config.consumer_name, retention, config.retry.clone());
        request.force = forced_by;
        Ok(Self {
            ops: Operations::new(pool, config.schema.clone()),
            request,
            interval,
        })
    }

    /// Cleans up every interval until `shutdown` completes. A failed round is logged and
    /// tried again at the next tick; nothing ends the task but `shutdown`.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => return,
                _ = tick.tick() => {}
            }
            let round = self.ops.cleanup(&self.request, &NoProgress);
            let result = tokio::select! {
                biased;
                () = &mut shutdown => return,
                result = round => result,
            };
            match result {
                Ok(r) => tracing::debug!(
                    scrubbed = r.scrubbed,
                    removed = r.removed_processed + r.removed_parked,
                    tombstones_expired = r.tombstones_expired,
                    "retention ran"
                ),
                Err(OpsError::Refused(why)) => tracing::debug!(%why, "retention skipped"),
                Err(e) => tracing::warn!(error = %e, "retention failed; trying again next round"),
            }
        }
    }
}
