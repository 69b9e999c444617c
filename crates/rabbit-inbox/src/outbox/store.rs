//! The outbox table in PostgreSQL: enqueue, claim under a lease, settle under the lease's
//! fencing token, inspect, requeue, clean up. Every method takes `&mut PgConnection`, so the
//! caller decides the transaction: `enqueue` must run in the business transaction, the relay's
//! statements run on their own (each one its own short transaction).

use std::{fmt, str::FromStr, sync::Arc, time::Duration};

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{Connection, PgConnection, Row, SqlStr, postgres::PgRow};

use crate::{
    error::StoreError,
    ledger_sql::{audited, tables},
    schema::SchemaName,
};

/// Status of an outbox row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OutboxStatus {
    /// Committed, not yet confirmed by the broker.
    Pending,
    /// Confirmed by the broker (routed to a queue).
    Sent,
    /// Given up after `max_attempts` failed publishes, or unpublishable; waits for an operator
    /// (`inboxctl outbox --requeue-failed`).
    Failed,
}

impl OutboxStatus {
    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            OutboxStatus::Pending => "PENDING",
            OutboxStatus::Sent => "SENT",
            OutboxStatus::Failed => "FAILED",
        }
    }
}

impl fmt::Display for OutboxStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for OutboxStatus {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, StoreError> {
        Ok(match s {
            "PENDING" => OutboxStatus::Pending,
            "SENT" => OutboxStatus::Sent,
            "FAILED" => OutboxStatus::Failed,
            other => {
                return Err(StoreError::Corrupt(format!(
                    "unknown outbox status {other:?}"
                )));
            }
        })
    }
}

/// One outbox row as an operator sees it (without payload and headers).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct OutboxRecord {
    /// Insertion order.
    pub seq: i64,
    /// AMQP `message-id`.
    pub message_id: String,
    /// Status.
    #[serde(serialize_with = "status_text")]
    pub status: OutboxStatus,
    /// AMQP `type`.
    pub message_type: String,
    /// Target exchange (`""`: the default exchange).
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Rows with one ordering key are published in order.
    pub ordering_key: Option<String>,
    /// Position within the ordering key.
    pub stream_position: Option<i64>,
    /// Failed publishes so far.
    pub attempts: i32,
    /// Earliest time of the next publish.
    pub next_attempt_at: DateTime<Utc>,
    /// Relay holding the lease, if any.
    pub lease_owner: Option<String>,
    /// End of that lease.
    pub lease_until: Option<DateTime<Utc>>,
    /// Last error code (`returned`, `nacked`, `exchange_missing`, `unpublishable`, `unconfirmed`).
    pub last_error_code: Option<String>,
    /// Last error text.
    pub last_error: Option<String>,
    /// When the enqueuing transaction wrote it.
    pub enqueued_at: DateTime<Utc>,
    /// When the broker confirmed it.
    pub sent_at: Option<DateTime<Utc>>,
    /// The message being handled when this one was emitted.
    pub causation_id: Option<String>,
    /// Correlation id.
    pub correlation_id: Option<String>,
}

fn status_text<S: serde::Serializer>(status: &OutboxStatus, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(status.as_str())
}

/// Counts for monitoring, read through the partial indexes (cheap however many rows are sent).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct OutboxSummary {
    /// PENDING rows.
    pub pending: i64,
    /// PENDING rows under a relay's lease right now.
    pub leased: i64,
    /// FAILED rows.
    pub failed: i64,
    /// Age of the oldest PENDING row, by the database's clock.
    pub oldest_pending_secs: Option<f64>,
}

/// A row claimed by a relay: everything needed to publish it, and the fencing token.
#[derive(Clone, Debug)]
pub(crate) struct ClaimedRow {
    pub(crate) seq: i64,
    pub(crate) epoch: i64,
    pub(crate) message_id: String,
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) message_type: String,
    pub(crate) message_version: i32,
    pub(crate) aggregate_type: Option<String>,
    pub(crate) aggregate_id: Option<String>,
    pub(crate) correlation_id: Option<String>,
    pub(crate) causation_id: Option<String>,
    pub(crate) traceparent: Option<String>,
    pub(crate) tracestate: Option<String>,
    pub(crate) headers: Value,
    pub(crate) content_type: String,
    pub(crate) payload: Vec<u8>,
    /// Seconds since the row was enqueued, when it was claimed (database clock).
    /// It has an ordering key: the next row of its key waits for this one.
    pub(crate) ordered: bool,
    pub(crate) age_secs: f64,
}

/// How a claimed row ends its lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Settlement {
    /// Confirmed: SENT.
    Sent,
    /// The message's own failure (returned, nacked, exchange missing): one attempt charged,
    /// next try after the doubling back-off; FAILED once `max_attempts` are spent.
    Charge { code: &'static str, error: String },
    /// Not the message's fault (no confirm, connection lost, lease nearly over): back to
    /// PENDING after a short delay, no attempt charged.
    Release { code: &'static str, error: String },
    /// Can never be published: FAILED now.
    GiveUp { code: &'static str, error: String },
}

/// Back-off of charged failures, see [`OutboxStore::settle`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backoff {
    pub(crate) max_attempts: i32,
    pub(crate) initial: Duration,
    pub(crate) max: Duration,
    pub(crate) release_after: Duration,
}

/// Values bound to the enqueue statement.
pub(crate) struct NewRow<'a> {
    pub(crate) message_id: &'a str,
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    pub(crate) message_type: &'a str,
    pub(crate) message_version: i32,
    pub(crate) aggregate_type: Option<&'a str>,
    pub(crate) aggregate_id: Option<&'a str>,
    pub(crate) ordering_key: Option<&'a str>,
    pub(crate) correlation_id: Option<&'a str>,
    pub(crate) causation_id: Option<&'a str>,
    pub(crate) traceparent: Option<&'a str>,
    pub(crate) tracestate: Option<&'a str>,
    pub(crate) headers: &'a serde_json::Map<String, Value>,
    pub(crate) content_type: &'a str,
    pub(crate) payload: &'a [u8],
}

#[derive(Debug)]
struct Sql {
    enqueue: SqlStr,
    claim: SqlStr,
    settle: SqlStr,
    summary: SqlStr,
    list: SqlStr,
    requeue_failed: SqlStr,
    cleanup: SqlStr,
    pending_for_exchange: SqlStr,
}

const RECORD_COLUMNS: &str = "seq, message_id, status, message_type, exchange, routing_key, \
     ordering_key, stream_position, attempts, next_attempt_at, lease_owner, lease_until, \
     last_error_code, last_error, enqueued_at, sent_at, causation_id, correlation_id";

impl Sql {
    fn new(schema: &SchemaName) -> Self {
        let t = schema.qualify(tables::OUTBOX);
        let stream = schema.qualify(tables::OUTBOX_STREAM);
        Sql {
            enqueue: audited(statements::enqueue(&t, &stream)),
            claim: audited(statements::claim(&t)),
            settle: audited(statements::settle(&t)),
            summary: audited(statements::summary(&t)),
            list: audited(statements::list(&t)),
            requeue_failed: audited(statements::requeue_failed(&t)),
            pending_for_exchange: audited(statements::pending_for_exchange(&t)),
            cleanup: audited(statements::cleanup(&t)),
        }
    }
}

/// The text of each of [`Sql`]'s statements, on the qualified outbox table `t` (and `stream`,
/// its ordering keys' last positions).
mod statements {
    use super::RECORD_COLUMNS;

    /// An ordered row takes the next position of its key under the key's row lock,
    /// held until this transaction ends: positions follow commit order per key, and
    /// a rolled-back transaction gives its position back. A row whose id exists (a
    /// replay of the handler) takes no position and is skipped. The NOTIFY is a
    /// hint; PostgreSQL folds identical ones of a transaction into one at commit.
    pub(super) fn enqueue(t: &str, stream: &str) -> String {
        format!(
            "WITH position AS ( \
               INSERT INTO {stream} AS s (ordering_key, last_position) \
               SELECT $8, 1 WHERE $8::text IS NOT NULL \
                 AND NOT EXISTS (SELECT 1 FROM {t} WHERE message_id = $1) \
               ON CONFLICT (ordering_key) DO UPDATE SET last_position = s.last_position + 1 \
               RETURNING last_position), \
             inserted AS ( \
               INSERT INTO {t} (message_id, exchange, routing_key, message_type, \
                 message_version, aggregate_type, aggregate_id, ordering_key, stream_position, \
                 correlation_id, causation_id, traceparent, tracestate, headers, content_type, \
                 payload) \
               SELECT $1, $2, $3, $4, $5, $6, $7, (SELECT $8::text FROM position), \
                 (SELECT last_position FROM position), $9, $10, $11, $12, $13, $14, $15 \
               ON CONFLICT (message_id) DO NOTHING \
               RETURNING seq) \
             SELECT i.seq, (SELECT count(*) FROM (SELECT pg_notify($17, '')) n WHERE $16) \
               AS notified \
             FROM inserted i"
        )
    }

    /// Pending rows whose lease is free; an ordered row only when the nearest earlier
    /// row of its key is SENT (or there is none left), so one key is published one
    /// message at a time, in order. Nearest, not "position - 1": positions can have
    /// gaps (a duplicate id enqueued by two transactions at once takes a position and
    /// then no row), and a row past a gap must still wait for the rows before it. One
    /// backward step on the (ordering_key, stream_position) index; by induction every
    /// earlier row is then SENT too (retention removes only SENT rows).
    /// No read position by seq: a transaction that commits after a later seq is
    /// claimed like any other row, never skipped. SKIP LOCKED and the lease re-check
    /// on a row another relay just claimed keep two relays from claiming one row. The
    /// picked rows are updated by key (`seq = ANY`), not joined: a planner that takes the
    /// table for empty would walk all of it once per picked row.
    pub(super) fn claim(t: &str) -> String {
        format!(
            "WITH picked AS ( \
               SELECT o.seq FROM {t} o \
               WHERE o.status = 'PENDING' AND o.next_attempt_at <= now() \
                 AND (o.lease_until IS NULL OR o.lease_until < now()) \
                 AND (o.ordering_key IS NULL OR coalesce(( \
                   SELECT p.status FROM {t} p WHERE p.ordering_key = o.ordering_key \
                     AND p.stream_position < o.stream_position \
                   ORDER BY p.stream_position DESC LIMIT 1), 'SENT') = 'SENT') \
               ORDER BY o.seq LIMIT $1 \
               FOR UPDATE OF o SKIP LOCKED) \
             UPDATE {t} o SET lease_owner = $2, lease_epoch = o.lease_epoch + 1, \
               lease_until = now() + $3 * interval '1 millisecond' \
             WHERE o.seq = ANY(ARRAY(SELECT seq FROM picked)) \
             RETURNING o.seq, o.lease_epoch, o.message_id, o.exchange, o.routing_key, \
               o.message_type, o.message_version, o.aggregate_type, o.aggregate_id, \
               o.correlation_id, o.causation_id, o.traceparent, o.tracestate, o.headers, \
               o.content_type, o.payload, o.ordering_key IS NOT NULL AS ordered, \
               extract(epoch FROM now() - o.enqueued_at)::float8 AS age_secs"
        )
    }

    /// Only under the claim's fencing token: a relay whose lease expired and was taken
    /// over changes nothing. `o.seq = ANY($1)` makes the rows' lookup by key the plan
    /// whatever the statistics say; joined on the pending rows' index alone, a planner that
    /// has not seen a backlog read all of it for every batch settled.
    pub(super) fn settle(t: &str) -> String {
        format!(
            "UPDATE {t} o SET \
               status = CASE WHEN c.kind = 'sent' THEN 'SENT' \
                 WHEN c.kind = 'give_up' OR (c.kind = 'charge' AND o.attempts + 1 >= $6) \
                   THEN 'FAILED' ELSE 'PENDING' END, \
               sent_at = CASE WHEN c.kind = 'sent' THEN now() END, \
               attempts = o.attempts + CASE WHEN c.kind IN ('charge', 'give_up') THEN 1 ELSE 0 END, \
               next_attempt_at = CASE c.kind \
                 WHEN 'charge' THEN now() + least($8::float8, \
                   $7::float8 * power(2::float8, least(o.attempts, 40))) * interval '1 millisecond' \
                 WHEN 'release' THEN now() + $9::float8 * interval '1 millisecond' \
                 ELSE o.next_attempt_at END, \
               last_error_code = CASE WHEN c.kind = 'sent' THEN o.last_error_code ELSE c.code END, \
               last_error = CASE WHEN c.kind = 'sent' THEN o.last_error ELSE c.error END, \
               lease_owner = NULL, lease_until = NULL \
             FROM UNNEST($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::text[]) \
               AS c(seq, epoch, kind, code, error) \
             WHERE o.seq = ANY($1) AND o.seq = c.seq AND o.lease_epoch = c.epoch \
               AND o.status = 'PENDING' \
             RETURNING o.seq"
        )
    }

    pub(super) fn summary(t: &str) -> String {
        format!(
            "SELECT (SELECT count(*) FROM {t} WHERE status = 'PENDING') AS pending, \
               (SELECT count(*) FROM {t} WHERE status = 'PENDING' AND lease_until > now()) AS leased, \
               (SELECT count(*) FROM {t} WHERE status = 'FAILED') AS failed, \
               (SELECT extract(epoch FROM now() - min(enqueued_at))::float8 FROM {t} \
                 WHERE status = 'PENDING') AS oldest"
        )
    }

    pub(super) fn list(t: &str) -> String {
        format!("SELECT {RECORD_COLUMNS} FROM {t} WHERE status = ANY($1) ORDER BY seq LIMIT $2")
    }

    pub(super) fn requeue_failed(t: &str) -> String {
        format!(
            "UPDATE {t} SET status = 'PENDING', attempts = 0, next_attempt_at = now() \
             WHERE status = 'FAILED' AND ($1::text[] IS NULL OR message_id = ANY($1))"
        )
    }

    pub(super) fn pending_for_exchange(t: &str) -> String {
        format!("SELECT count(*) FROM {t} WHERE status = 'PENDING' AND exchange = $1")
    }

    pub(super) fn cleanup(t: &str) -> String {
        format!(
            "DELETE FROM {t} WHERE seq IN (SELECT seq FROM {t} WHERE status = 'SENT' \
               AND sent_at < now() - $1::float8 * interval '1 millisecond' LIMIT $2)"
        )
    }
}

/// The outbox table of one schema: every statement on it, built once.
#[derive(Clone, Debug)]
pub struct OutboxStore {
    schema: SchemaName,
    channel: Arc<str>,
    sql: Arc<Sql>,
}

/// The relay's own transactions plan with index paths only: an outbox is usually nearly
/// empty when its statements are planned, and a plan made for that reads the whole backlog.
const INDEX_PATHS_ONLY: &str =
    "BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off";

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl OutboxStore {
    /// The outbox in `schema` (created by [`crate::migrate`]).
    pub fn new(schema: SchemaName) -> Self {
        let channel = wakeup_channel(&schema).into();
        let sql = Arc::new(Sql::new(&schema));
        Self {
            schema,
            channel,
            sql,
        }
    }

    /// The schema.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// The LISTEN/NOTIFY channel that wakes the relays of this schema.
    pub fn wakeup_channel(&self) -> &str {
        &self.channel
    }

    /// Inserts a row; `None` when a row with this id exists already (a replay).
    pub(crate) async fn enqueue(
        &self,
        conn: &mut PgConnection,
        row: &NewRow<'_>,
        notify: bool,
    ) -> Result<Option<i64>, sqlx::Error> {
        let headers = Value::Object(row.headers.clone());
        let inserted = sqlx::query(self.sql.enqueue.clone())
            .bind(row.message_id)
            .bind(row.exchange)
            .bind(row.routing_key)
            .bind(row.message_type)
            .bind(row.message_version)
            .bind(row.aggregate_type)
            .bind(row.aggregate_id)
            .bind(row.ordering_key)
            .bind(row.correlation_id)
            .bind(row.causation_id)
            .bind(row.traceparent)
            .bind(row.tracestate)
            .bind(sqlx::types::Json(headers))
            .bind(row.content_type)
            .bind(row.payload)
            .bind(notify)
            .bind(&*self.channel)
            .fetch_optional(conn)
            .await?;
        inserted.map(|r| r.try_get::<i64, _>("seq")).transpose()
    }

    /// Claims up to `limit` publishable rows for `owner` for `lease`, in seq order.
    ///
    /// The claim must walk the pending rows' index in seq order and stop at `limit`. A plan
    /// made for a nearly empty outbox (statistics that predate a backlog, or a plan the
    /// session cached while the relay polled an empty table) fetches every pending row by
    /// bitmap or by a sequential scan and sorts them: each claim then reads the whole
    /// backlog, 3 s per claim of 256 rows behind 100,000. Both are off for this one
    /// statement's transaction ([`INDEX_PATHS_ONLY`]), so the plan is the index walk
    /// whatever the statistics or the cache hold.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<ClaimedRow>, StoreError> {
        let mut tx = conn.begin_with(INDEX_PATHS_ONLY).await?;
        let rows = sqlx::query(self.sql.claim.clone())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(owner)
            .bind(millis(lease))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        let mut claimed = rows
            .iter()
            .map(|r| {
                Ok(ClaimedRow {
                    seq: r.try_get("seq")?,
                    epoch: r.try_get("lease_epoch")?,
                    message_id: r.try_get("message_id")?,
                    exchange: r.try_get("exchange")?,
                    routing_key: r.try_get("routing_key")?,
                    message_type: r.try_get("message_type")?,
                    message_version: r.try_get("message_version")?,
                    aggregate_type: r.try_get("aggregate_type")?,
                    aggregate_id: r.try_get("aggregate_id")?,
                    correlation_id: r.try_get("correlation_id")?,
                    causation_id: r.try_get("causation_id")?,
                    traceparent: r.try_get("traceparent")?,
                    tracestate: r.try_get("tracestate")?,
                    headers: r.try_get::<sqlx::types::Json<Value>, _>("headers")?.0,
                    content_type: r.try_get("content_type")?,
                    payload: r.try_get("payload")?,
                    ordered: r.try_get("ordered")?,
                    age_secs: r.try_get("age_secs")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()?;
        // UPDATE .. RETURNING gives no order; publish in seq order.
        claimed.sort_unstable_by_key(|r| r.seq);
        Ok(claimed)
    }

    /// Ends the leases of `settled` (seq, fencing token, how). Returns the seqs it changed; a
    /// row missing from it was taken over by another relay after its lease expired.
    pub(crate) async fn settle(
        &self,
        conn: &mut PgConnection,
        settled: &[(i64, i64, Settlement)],
        backoff: Backoff,
    ) -> Result<Vec<i64>, StoreError> {
        if settled.is_empty() {
            return Ok(Vec::new());
        }
        let mut seqs = Vec::with_capacity(settled.len());
        let mut epochs = Vec::with_capacity(settled.len());
        let mut kinds = Vec::with_capacity(settled.len());
        let mut codes: Vec<Option<&str>> = Vec::with_capacity(settled.len());
        let mut errors: Vec<Option<&str>> = Vec::with_capacity(settled.len());
        for (seq, epoch, how) in settled {
            seqs.push(*seq);
            epochs.push(*epoch);
            let (kind, code, error) = match how {
                Settlement::Sent => ("sent", None, None),
                Settlement::Charge { code, error } => ("charge", Some(*code), Some(error.as_str())),
                Settlement::Release { code, error } => {
                    ("release", Some(*code), Some(error.as_str()))
                }
                Settlement::GiveUp { code, error } => {
                    ("give_up", Some(*code), Some(error.as_str()))
                }
            };
            kinds.push(kind);
            codes.push(code);
            errors.push(error.map(|e| truncate(e, crate::store::MAX_ERROR_MESSAGE_CHARS)));
        }
        // Its rows by key, whatever the statistics say (see `claim`).
        let mut tx = conn.begin_with(INDEX_PATHS_ONLY).await?;
        let changed = sqlx::query_scalar::<_, i64>(self.sql.settle.clone())
            .bind(&seqs)
            .bind(&epochs)
            .bind(&kinds)
            .bind(&codes)
            .bind(&errors)
            .bind(backoff.max_attempts)
            .bind(millis(backoff.initial))
            .bind(millis(backoff.max))
            .bind(millis(backoff.release_after))
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(changed)
    }

    /// Pending, leased and failed counts, and the oldest pending row's age.
    pub async fn summary(&self, conn: &mut PgConnection) -> Result<OutboxSummary, StoreError> {
        let r = sqlx::query(self.sql.summary.clone())
            .fetch_one(conn)
            .await?;
        Ok(OutboxSummary {
            pending: r.try_get("pending")?,
            leased: r.try_get("leased")?,
            failed: r.try_get("failed")?,
            oldest_pending_secs: r.try_get("oldest")?,
        })
    }

    /// PENDING rows to be published to `exchange`.
    pub(crate) async fn pending_for_exchange(
        &self,
        conn: &mut PgConnection,
        exchange: &str,
    ) -> Result<i64, StoreError> {
        Ok(sqlx::query_scalar(self.sql.pending_for_exchange.clone())
            .bind(exchange)
            .fetch_one(conn)
            .await?)
    }

    /// Rows with one of `statuses`, oldest first, at most `limit`.
    pub async fn list(
        &self,
        conn: &mut PgConnection,
        statuses: &[OutboxStatus],
        limit: i64,
    ) -> Result<Vec<OutboxRecord>, StoreError> {
        let statuses: Vec<&str> = statuses.iter().map(|s| s.as_str()).collect();
        let rows = sqlx::query(self.sql.list.clone())
            .bind(&statuses)
            .bind(limit)
            .fetch_all(conn)
            .await?;
        rows.iter().map(record).collect()
    }

    /// Puts FAILED rows back to PENDING with their attempts reset: all of them, or those with
    /// the given ids. Returns how many. Wakes the relays.
    pub async fn requeue_failed(
        &self,
        conn: &mut PgConnection,
        message_ids: Option<&[String]>,
    ) -> Result<u64, StoreError> {
        let n = sqlx::query(self.sql.requeue_failed.clone())
            .bind(message_ids)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        if n > 0 {
            sqlx::query("SELECT pg_notify($1, '')")
                .bind(&*self.channel)
                .execute(conn)
                .await?;
        }
        Ok(n)
    }

    /// Deletes SENT rows confirmed more than `age` ago, at most `limit` (call again while it
    /// returns `limit`). Keep sent rows as long as the downstream inboxes keep theirs, if a
    /// replay from here must still be deduped there.
    pub async fn delete_sent_older_than(
        &self,
        conn: &mut PgConnection,
        age: Duration,
        limit: i64,
    ) -> Result<u64, StoreError> {
        Ok(sqlx::query(self.sql.cleanup.clone())
            .bind(millis(age))
            .bind(limit)
            .execute(conn)
            .await?
            .rows_affected())
    }
}

fn record(r: &PgRow) -> Result<OutboxRecord, StoreError> {
    Ok(OutboxRecord {
        seq: r.try_get("seq")?,
        message_id: r.try_get("message_id")?,
        status: r.try_get::<&str, _>("status")?.parse()?,
        message_type: r.try_get("message_type")?,
        exchange: r.try_get("exchange")?,
        routing_key: r.try_get("routing_key")?,
        ordering_key: r.try_get("ordering_key")?,
        stream_position: r.try_get("stream_position")?,
        attempts: r.try_get("attempts")?,
        next_attempt_at: r.try_get("next_attempt_at")?,
        lease_owner: r.try_get("lease_owner")?,
        lease_until: r.try_get("lease_until")?,
        last_error_code: r.try_get("last_error_code")?,
        last_error: r.try_get("last_error")?,
        enqueued_at: r.try_get("enqueued_at")?,
        sent_at: r.try_get("sent_at")?,
        causation_id: r.try_get("causation_id")?,
        correlation_id: r.try_get("correlation_id")?,
    })
}

fn truncate(s: &str, max_chars: usize) -> &str {
    s.char_indices().nth(max_chars).map_or(s, |(i, _)| &s[..i])
}

/// The NOTIFY channel of `schema`'s outbox: a channel name is an identifier (at most 63 bytes),
/// so a long schema name is shortened with a hash.
fn wakeup_channel(schema: &SchemaName) -> String {
    let name = format!("{}_outbox", schema.as_str());
    if name.len() <= 63 {
        return name;
    }
    use sha2::{Digest, Sha256};
    let hash = hex::encode(&Sha256::digest(schema.as_str().as_bytes())[..8]);
    format!("{}_{hash}_outbox", &schema.as_str()[..40])
}
