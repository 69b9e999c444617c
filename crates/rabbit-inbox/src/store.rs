//! The inbox ledger in PostgreSQL: claim, find, mark processed or failed, find stale, clean up.
//!
//! Public so that a team with its own consumer loop can use the ledger without our runtime.
//! Every method takes `&mut PgConnection`: pass `&mut *tx` to run it inside the business
//! transaction (claims and `mark_processed` must be), or a pooled connection for the short
//! failure-recording transactions.

use std::{borrow::Cow, sync::Arc, time::Duration};

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row, SqlStr};

use crate::{
    envelope::{Envelope, HEADER_TOO_DEEP, MAX_HEADER_DEPTH},
    error::StoreError,
    ledger_sql::{audited, tables},
    privacy::{
        PayloadPrivacy, PayloadRules, PayloadStorage, Phase, Sealed, StoredError, StoredPayload,
    },
    schema::SchemaName,
    status::{ConfirmedCopy, ConfirmedCopyKind, InboxStatus, PendingCopy},
};

/// Longest error message kept in `last_error_message`, in characters.
pub const MAX_ERROR_MESSAGE_CHARS: usize = 2000;

/// What a row kept of its message, as [`InboxStore::find_payload`] reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct RowPayload {
    /// The stored body, if kept (redacted as configured; sealed when encryption is on).
    pub stored: Option<StoredPayload>,
    /// The message's headers as stored (redacted as configured; sealed when encryption is on,
    /// see [`crate::privacy::open_headers`]).
    pub headers: serde_json::Value,
    /// The dedup hash of the original body.
    pub payload_sha256: Vec<u8>,
}

/// One inbox row (without payload and headers, which [`InboxStore::find_payload`] reads).
#[derive(Clone, Debug, PartialEq)]
pub struct InboxRecord {
    /// Dedup key.
    pub message_id: String,
    /// Consumer.
    pub consumer_name: String,
    /// Message type.
    pub message_type: String,
    /// Message version.
    pub message_version: i32,
    /// Aggregate type.
    pub aggregate_type: Option<String>,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Status.
    pub status: InboxStatus,
    /// Attempts made (successful or failed).
    pub processing_attempt: i32,
    /// Deliveries seen, duplicates included.
    pub delivery_count: i32,
    /// First seen.
    pub first_received_at: DateTime<Utc>,
    /// Last seen.
    pub last_received_at: DateTime<Utc>,
    /// When the current or last attempt started.
    pub processing_started_at: Option<DateTime<Utc>>,
    /// When the effect committed.
    pub processed_at: Option<DateTime<Utc>>,
    /// First failure.
    pub first_failed_at: Option<DateTime<Utc>>,
    /// Last failure.
    pub last_failed_at: Option<DateTime<Utc>>,
    /// SHA-256 of the first body seen under this key.
    pub payload_sha256: Vec<u8>,
    /// Redeliveries whose body differed: a producer bug.
    pub payload_conflicts: i32,
    /// Last error code.
    pub last_error_code: Option<String>,
    /// Last error message (truncated).
    pub last_error_message: Option<String>,
    /// When the parking-lot copy of this (parked) row was confirmed. Later copies of the
    /// message are acked as duplicates while it is set (see [`PendingCopy::Parked`]).
    pub parked_copy_at: Option<DateTime<Utc>>,
    /// Copies acked as duplicates of the parked copy.
    pub parked_duplicates: i32,
    /// The attempt whose retry-tier copy was confirmed (while the row is RETRYABLE_FAILED).
    pub retry_copy_attempt: Option<i32>,
    /// When that retry copy is due back from its tier.
    pub retry_due_at: Option<DateTime<Utc>>,
    /// Copies acked as duplicates while a retry copy was pending.
    pub retry_duplicates: i32,
    /// Ordered consumers: the ordering key of a row that failed or was held.
    pub order_key: Option<String>,
    /// Ordered consumers: a held row's place in its key's order (its sequence number, or
    /// the order it was held in).
    pub order_position: Option<i64>,
}

impl InboxRecord {
    /// Whether a confirmed copy of this row's current state waits in the broker, so that
    /// `delivery` (another copy of the same message) must not be copied or run again: the
    /// parked copy of a parked row, or the retry copy of a RETRYABLE_FAILED row before it is
    /// due. `scheduled_attempt` is the attempt a retry copy names (its
    /// [`crate::status::parking_headers::RETRY_ATTEMPT`] header): the scheduled copy itself runs.
    pub fn pending_copy(
        &self,
        scheduled_attempt: Option<i32>,
        db_now: DateTime<Utc>,
    ) -> Option<PendingCopy> {
        match self.status {
            status if status.is_parked() => self.parked_copy_at.map(|_| PendingCopy::Parked),
            InboxStatus::RetryableFailed => {
                let attempt = self.retry_copy_attempt?;
                let due = self.retry_due_at?;
                (attempt == self.processing_attempt
                    && scheduled_attempt != Some(attempt)
                    && db_now < due)
                    .then_some(PendingCopy::Retry)
            }
            _ => None,
        }
    }
}

/// What claiming a message found.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Claim {
    /// This transaction inserted the row: it owns the first attempt.
    Claimed,
    /// A committed row exists; it is locked (`FOR UPDATE`) until this transaction ends.
    Existing(Box<InboxRecord>),
}

/// A row of the claim statement: an inserted key, or the transaction's id and clock.
type ClaimRow = (Option<String>, Option<i64>, Option<DateTime<Utc>>);

/// A batch's claims with the claiming transaction's id and the database's clock.
#[derive(Clone, Debug)]
pub(crate) struct BatchClaim {
    /// One per envelope, in order.
    pub(crate) claims: Vec<Claim>,
    /// `txid_current()` of the claiming transaction.
    pub(crate) txid: i64,
    /// `now()` of the claiming transaction.
    pub(crate) db_now: DateTime<Utc>,
}

/// A failure to record, see [`InboxStore::record_failure`].
#[derive(Clone, Copy, Debug)]
pub struct Failure<'a> {
    /// `RetryableFailed` (escalated to `Poisoned` when the budget is spent),
    /// `PermanentFailed` or `Poisoned`.
    pub status: InboxStatus,
    /// Stable error code.
    pub code: &'a str,
    /// Error message; truncated to [`MAX_ERROR_MESSAGE_CHARS`]. Stored as the privacy policy
    /// stores the body (in clear, sealed, or withheld).
    pub message: &'a str,
    /// Detail stored as it is whatever the policy ([`crate::HandlerError::with_safe_detail`]);
    /// shown in place of a message that is sealed or withheld.
    pub safe_detail: Option<&'a str>,
    /// Attempt budget: a retryable failure on attempt `max_attempts` becomes `Poisoned`.
    pub max_attempts: i32,
    /// Keep the raw body in the row.
    pub store_payload: bool,
}

/// A row to hold, see [`InboxStore::hold`].
pub(crate) struct HeldRow<'a> {
    pub(crate) envelope: &'a Envelope,
    /// Its ordering key.
    pub(crate) key: &'a str,
    /// Its place in the key's order.
    pub(crate) position: i64,
    /// Claimed by this transaction: its body and headers are stored now.
    pub(crate) fresh: bool,
}

/// How a redelivery of an existing row is noted, see [`InboxStore::note_redeliveries`].
#[derive(Clone, Debug)]
pub struct Redelivery<'a> {
    /// Dedup key.
    pub message_id: &'a str,
    /// Hash of the redelivered body when it differs from the recorded one.
    pub conflicting_sha256: Option<&'a [u8]>,
    /// The confirmed copy this delivery duplicates, if any (counted on the row).
    pub duplicate_of: Option<PendingCopy>,
}

/// PostgreSQL `text` and `jsonb` cannot hold U+0000, and any producer can put one in a header
/// or property: without this the row could never be written and the delivery would be requeued
/// forever. The stored copy shows U+FFFD instead; the envelope a handler sees is unchanged.
/// (Dedup keys never get here with one: control characters make a key malformed.)
pub(crate) fn storable<'a>(text: impl Into<Cow<'a, str>>) -> Cow<'a, str> {
    let text = text.into();
    if text.contains('\0') {
        Cow::Owned(text.replace('\0', "\u{FFFD}"))
    } else {
        text
    }
}

/// The headers as stored: [`storable`] applied to every name and string value, and an array
/// or object nested deeper than [`MAX_HEADER_DEPTH`] (the headers object included)
/// replaced by [`HEADER_TOO_DEEP`], so that a hand-built envelope cannot make the
/// conversion, the JSON encoder or PostgreSQL recurse without bound.
fn storable_headers(headers: &serde_json::Map<String, serde_json::Value>) -> serde_json::Value {
    use serde_json::{Map, Value};
    fn map(m: &Map<String, Value>, level: usize) -> Map<String, Value> {
        m.iter()
            .map(|(k, v)| (storable(k.as_str()).into_owned(), value(v, level + 1)))
            .collect()
    }
    // `level`: the nesting level `v` has if it is an array or object.
    fn value(v: &Value, level: usize) -> Value {
        match v {
            Value::String(s) => Value::String(storable(s.as_str()).into_owned()),
            Value::Array(_) | Value::Object(_) if level > MAX_HEADER_DEPTH => {
                Value::String(HEADER_TOO_DEEP.to_owned())
            }
            Value::Array(items) => {
                Value::Array(items.iter().map(|x| value(x, level + 1)).collect())
            }
            Value::Object(m) => Value::Object(map(m, level)),
            other => other.clone(),
        }
    }
    Value::Object(map(headers, 1))
}

/// The PostgreSQL inbox of one schema.
#[derive(Clone, Debug)]
pub struct InboxStore {
    schema: SchemaName,
    sql: Arc<Sql>,
    /// What of a body is stored; `None`: the body as it came, where the caller asks for it.
    payload: Option<Arc<PayloadRules>>,
}

/// Statements, built once per store. The only spliced text is the schema name, which
/// [`SchemaName`] has validated, and the fragments of [`crate::ledger_sql`]; values are
/// always bound.
///
/// Lookups by key run as unnamed (re-planned) statements: a prepared plan made while the
/// table was small can stay a sequential scan after it has grown to millions of rows.
/// The claim insert has no such choice to make and stays prepared.
#[derive(Debug)]
struct Sql {
    claim: SqlStr,
    lock_existing: SqlStr,
    find: SqlStr,
    find_payload: SqlStr,
    find_stored_payload: SqlStr,
    reclaim: SqlStr,
    note_redeliveries: SqlStr,
    note_confirmed_copies: SqlStr,
    mark_processed: SqlStr,
    record_failure: SqlStr,
    hold: SqlStr,
    find_stale: SqlStr,
    cleanup: SqlStr,
    sample_open: SqlStr,
    oldest_processed: SqlStr,
}

const RECORD_COLUMNS: &str = "message_id, consumer_name, message_type, message_version, \
     aggregate_type, aggregate_id, status, processing_attempt, delivery_count, \
     first_received_at, last_received_at, processing_started_at, processed_at, \
     first_failed_at, last_failed_at, payload_sha256, payload_conflicts, last_error_code, \
     last_error_message, parked_copy_at, parked_duplicates, retry_copy_attempt, retry_due_at, \
     retry_duplicates, order_key, order_position";

impl Sql {
    fn new(schema: &SchemaName) -> Self {
        let t = schema.qualify(tables::MESSAGE_INBOX);
        Sql {
            claim: audited(statements::claim(&t)),
            lock_existing: audited(statements::lock_existing(&t)),
            find: audited(statements::find(&t)),
            find_payload: audited(statements::find_payload(&t)),
            find_stored_payload: audited(statements::find_stored_payload(&t)),
            reclaim: audited(statements::reclaim(&t)),
            note_redeliveries: audited(statements::note_redeliveries(&t)),
            note_confirmed_copies: audited(statements::note_confirmed_copies(&t)),
            mark_processed: audited(statements::mark_processed(&t)),
            record_failure: audited(statements::record_failure(&t)),
            hold: audited(statements::hold(&t)),
            find_stale: audited(statements::find_stale(&t)),
            cleanup: audited(statements::cleanup(&t)),
            sample_open: audited(statements::sample_open(&t)),
            oldest_processed: audited(statements::oldest_processed(&t)),
        }
    }
}

/// The text of each of [`Sql`]'s statements, on the qualified inbox table `t`.
mod statements {
    use super::RECORD_COLUMNS;
    use crate::{
        ledger_sql::{
            CLOSED_TO_FAILURES, PARKED, PERMANENT_FAILED, POISONED, PROCESSED, PROCESSING,
            RETRYABLE_FAILED, Statuses, overdue_by, stale_processing,
        },
        status::InboxStatus,
    };

    /// One multi-row insert claims a whole batch; rows that already exist are left alone and
    /// read (and locked) by [`lock_existing`].
    /// The transaction's id and clock come back with it (one extra row): the id lets the caller
    /// check before COMMIT that its transaction is still the one that claimed (a handler may
    /// have ended or aborted it), the clock judges stale claims by the database's time, not
    /// this host's.
    pub(super) fn claim(t: &str) -> String {
        format!(
            "WITH ins AS (INSERT INTO {t} (message_id, consumer_name, message_type, message_version, \
               aggregate_type, aggregate_id, status, processing_attempt, \
               processing_started_at, processed_at, payload_sha256, payload, headers, \
               correlation_id, causation_id, trace_id, tenant_id, payload_key_id) \
             SELECT u.id, $1, u.ty, u.ver, u.agg_ty, u.agg_id, $14, 1, now(), \
               CASE WHEN $14 = {PROCESSED} THEN now() END, \
               u.sha, u.body, u.headers, u.corr, u.cause, u.trace, u.tenant, u.key_id \
             FROM UNNEST($2::text[], $3::text[], $4::int4[], $5::text[], $6::text[], \
               $7::bytea[], $8::bytea[], $9::jsonb[], $10::text[], $11::text[], \
               $12::text[], $13::text[], $15::text[]) \
               AS u(id, ty, ver, agg_ty, agg_id, sha, body, headers, corr, cause, trace, tenant, \
                    key_id) \
             ON CONFLICT (message_id, consumer_name) DO NOTHING \
             RETURNING message_id) \
             SELECT message_id, NULL::int8 AS txid, NULL::timestamptz AS db_now FROM ins \
             UNION ALL SELECT NULL, txid_current(), now()"
        )
    }

    pub(super) fn lock_existing(t: &str) -> String {
        format!(
            "SELECT {RECORD_COLUMNS} FROM {t} \
             WHERE consumer_name = $1 AND message_id = ANY($2) \
             ORDER BY message_id FOR UPDATE"
        )
    }

    pub(super) fn find(t: &str) -> String {
        format!("SELECT {RECORD_COLUMNS} FROM {t} WHERE consumer_name = $1 AND message_id = $2")
    }

    pub(super) fn find_payload(t: &str) -> String {
        format!(
            "SELECT payload, payload_key_id, headers, payload_sha256 FROM {t} \
             WHERE consumer_name = $1 AND message_id = $2"
        )
    }

    pub(super) fn find_stored_payload(t: &str) -> String {
        format!(
            "SELECT payload, payload_key_id FROM {t} \
             WHERE consumer_name = $1 AND message_id = $2 AND payload IS NOT NULL"
        )
    }

    /// A row claimed by conflict: waiting for its retry, a PROCESSING claim the caller
    /// found stale, or a HELD row whose turn has come.
    pub(super) fn reclaim(t: &str) -> String {
        const RECLAIMABLE: Statuses = Statuses(&[
            InboxStatus::RetryableFailed,
            InboxStatus::Processing,
            InboxStatus::Held,
        ]);
        format!(
            "UPDATE {t} SET status = {PROCESSING}, \
               processing_attempt = processing_attempt + 1, \
               processing_started_at = now(), last_received_at = now() \
             WHERE consumer_name = $1 AND message_id = ANY($2) \
               AND status IN ({RECLAIMABLE}) \
             RETURNING message_id, processing_attempt"
        )
    }

    /// Grouped by key: an UPDATE changes a row once however many input rows match it, and
    /// several copies of one key can be noted together.
    pub(super) fn note_redeliveries(t: &str) -> String {
        format!(
            "UPDATE {t} AS i SET last_received_at = now(), \
               delivery_count = i.delivery_count + u.n, \
               payload_conflicts = i.payload_conflicts + u.conflicts, \
               last_conflict_sha256 = coalesce(u.sha, i.last_conflict_sha256), \
               last_conflict_at = CASE WHEN u.sha IS NULL THEN i.last_conflict_at ELSE now() END, \
               parked_duplicates = i.parked_duplicates + u.parked, \
               retry_duplicates = i.retry_duplicates + u.retry \
             FROM (SELECT id, count(*)::int AS n, count(sha)::int AS conflicts, \
                     (array_agg(sha) FILTER (WHERE sha IS NOT NULL))[1] AS sha, \
                     count(*) FILTER (WHERE dup = 'parked')::int AS parked, \
                     count(*) FILTER (WHERE dup = 'retry')::int AS retry \
                   FROM UNNEST($2::text[], $3::bytea[], $4::text[]) AS x(id, sha, dup) \
                   GROUP BY id) AS u \
             WHERE i.consumer_name = $1 AND i.message_id = u.id"
        )
    }

    /// One UPDATE changes a row once: a key listed twice (two copies made for one attempt) is
    /// marked once. A NULL delay is a parking copy.
    pub(super) fn note_confirmed_copies(t: &str) -> String {
        format!(
            "UPDATE {t} AS i SET \
               parked_copy_at = CASE WHEN u.delay IS NULL THEN now() ELSE i.parked_copy_at END, \
               retry_copy_attempt = CASE WHEN u.delay IS NULL THEN i.retry_copy_attempt \
                                         ELSE u.attempt END, \
               retry_due_at = CASE WHEN u.delay IS NULL THEN i.retry_due_at \
                                   ELSE now() + make_interval(secs => u.delay) END \
             FROM (SELECT DISTINCT ON (id) id, attempt, delay \
                   FROM UNNEST($2::text[], $3::int4[], $4::float8[]) AS x(id, attempt, delay)) AS u \
             WHERE i.consumer_name = $1 AND i.message_id = u.id \
               AND i.processing_attempt = u.attempt \
               AND CASE WHEN u.delay IS NULL \
                        THEN i.status IN ({PARKED}) \
                        ELSE i.status = {RETRYABLE_FAILED} END"
        )
    }

    pub(super) fn mark_processed(t: &str) -> String {
        format!(
            "UPDATE {t} SET status = {PROCESSED}, processed_at = now(), \
               payload = CASE WHEN $3 THEN payload ELSE NULL END, \
               payload_key_id = CASE WHEN $3 THEN payload_key_id ELSE NULL END, \
               headers = CASE WHEN $3 THEN headers ELSE '{{}}'::jsonb END \
             WHERE consumer_name = $1 AND message_id = ANY($2) AND status = {PROCESSING}"
        )
    }

    /// One statement records every kind of failure. It never overwrites a row
    /// [`CLOSED_TO_FAILURES`]: PROCESSED (another copy committed the effect meanwhile: the
    /// failure is moot) or parked (its copy is in the parking lot, and only an explicit,
    /// audited reopen may change it; a racing retryable failure must not revive it).
    /// Many rows at once (keys distinct): a batch's failures are one statement.
    pub(super) fn record_failure(t: &str) -> String {
        format!(
            "INSERT INTO {t} AS i (message_id, consumer_name, message_type, message_version, \
               aggregate_type, aggregate_id, status, processing_attempt, first_failed_at, \
               last_failed_at, payload_sha256, payload, headers, last_error_code, \
               last_error_message, correlation_id, causation_id, trace_id, tenant_id, \
               payload_key_id, last_error_safe, last_error_sealed, last_error_key_id) \
             SELECT u.id, $1, u.ty, u.ver, u.agg_ty, u.agg_id, \
               CASE WHEN u.status = {RETRYABLE_FAILED} AND 1 >= $17 THEN {POISONED} \
                    ELSE u.status END, \
               1, now(), now(), u.sha, u.body, u.headers, u.code, u.msg, u.corr, u.cause, \
               u.trace, u.tenant, u.key_id, u.safe, u.msg_sealed, u.msg_key_id \
             FROM UNNEST($2::text[], $3::text[], $4::int4[], $5::text[], $6::text[], \
               $7::text[], $8::bytea[], $9::bytea[], $10::jsonb[], $11::text[], $12::text[], \
               $13::text[], $14::text[], $15::text[], $16::text[], $18::text[], \
               $19::text[], $20::bytea[], $21::text[]) \
               AS u(id, ty, ver, agg_ty, agg_id, status, sha, body, headers, code, msg, \
                    corr, cause, trace, tenant, key_id, safe, msg_sealed, msg_key_id) \
             ON CONFLICT (message_id, consumer_name) DO UPDATE SET \
               status = CASE WHEN EXCLUDED.status = {RETRYABLE_FAILED} \
                              AND i.processing_attempt + 1 >= $17 \
                         THEN {POISONED} ELSE EXCLUDED.status END, \
               processing_attempt = i.processing_attempt + 1, \
               delivery_count = i.delivery_count + 1, last_received_at = now(), \
               first_failed_at = coalesce(i.first_failed_at, now()), \
               last_failed_at = now(), \
               payload = coalesce(EXCLUDED.payload, i.payload), \
               payload_key_id = CASE WHEN EXCLUDED.payload IS NULL THEN i.payload_key_id \
                                     ELSE EXCLUDED.payload_key_id END, \
               last_error_code = EXCLUDED.last_error_code, \
               last_error_message = EXCLUDED.last_error_message, \
               last_error_safe = EXCLUDED.last_error_safe, \
               last_error_sealed = EXCLUDED.last_error_sealed, \
               last_error_key_id = EXCLUDED.last_error_key_id \
             WHERE i.status NOT IN ({CLOSED_TO_FAILURES}) \
             RETURNING message_id, status, processing_attempt"
        )
    }

    /// Rows to hold: a new row (claimed PROCESSED in this transaction, its effect not run)
    /// gets its body and headers as a failure keeps them, and no attempt (its first run is
    /// attempt 1); an existing row (a retry behind another head) keeps what it has.
    pub(super) fn hold(t: &str) -> String {
        let held = InboxStatus::Held.as_str();
        format!(
            "UPDATE {t} AS i SET status = '{held}', processed_at = NULL, \
               order_key = u.key, order_position = u.pos, released_at = NULL, \
               processing_attempt = CASE WHEN u.fresh THEN 0 ELSE i.processing_attempt END, \
               payload = CASE WHEN u.fresh THEN u.body ELSE i.payload END, \
               payload_key_id = CASE WHEN u.fresh THEN u.key_id ELSE i.payload_key_id END, \
               headers = CASE WHEN u.fresh THEN u.headers ELSE i.headers END \
             FROM UNNEST($2::text[], $3::text[], $4::int8[], $5::bool[], $6::bytea[], \
               $7::text[], $8::jsonb[]) AS u(id, key, pos, fresh, body, key_id, headers) \
             WHERE i.consumer_name = $1 AND i.message_id = u.id"
        )
    }

    pub(super) fn find_stale(t: &str) -> String {
        format!(
            "SELECT {RECORD_COLUMNS} FROM {t} \
             WHERE consumer_name = $1 AND status = {PROCESSING} \
               AND processing_started_at < now() - make_interval(secs => $2) \
             ORDER BY processing_started_at LIMIT $3"
        )
    }

    pub(super) fn cleanup(t: &str) -> String {
        format!(
            "DELETE FROM {t} WHERE (message_id, consumer_name) IN ( \
               SELECT message_id, consumer_name FROM {t} \
               WHERE consumer_name = $1 AND status = {PROCESSED} \
                 AND processed_at < now() - make_interval(secs => $2) \
               LIMIT $3)"
        )
    }

    /// Open rows only: the partial index of open rows finds them, so the cost follows the
    /// (small) number of open rows, not the table. A RETRYABLE_FAILED row counts as
    /// unprocessed only once its retry delay ($3, seconds per attempt, the last for later
    /// attempts) has passed. The parked age is that of the failed rows (MANUAL_REVIEW ones
    /// are set aside by recovery, not by a failure).
    pub(super) fn sample_open(t: &str) -> String {
        const PARKED_BY_FAILURE: Statuses =
            Statuses(&[InboxStatus::PermanentFailed, InboxStatus::Poisoned]);
        format!(
            "SELECT \
               count(*) FILTER (WHERE status = {PROCESSING}) AS processing, \
               count(*) FILTER (WHERE status = {RETRYABLE_FAILED}) AS retryable_failed, \
               count(*) FILTER (WHERE status = {PERMANENT_FAILED}) AS permanent_failed, \
               count(*) FILTER (WHERE status = {POISONED}) AS poisoned, \
               count(*) FILTER (WHERE {stale}) AS stale_processing, \
               extract(epoch FROM now() - min(last_failed_at) \
                 FILTER (WHERE status IN ({PARKED_BY_FAILURE})))::float8 \
                 AS parked_oldest_age, \
               extract(epoch FROM max({overdue}))::float8 AS oldest_unprocessed_age \
             FROM {t} WHERE consumer_name = $1 AND status <> {PROCESSED}",
            stale = stale_processing("$2"),
            overdue = overdue_by("$3"),
        )
    }

    /// Rows older than the window first: the BRIN index on processed_at reads only the old
    /// block ranges. Only when none is older does it look at all processed rows.
    pub(super) fn oldest_processed(t: &str) -> String {
        format!(
            "SELECT coalesce( \
               (SELECT min(processed_at) FROM {t} WHERE consumer_name = $1 \
                  AND processed_at < now() - make_interval(secs => $2)), \
               (SELECT min(processed_at) FROM {t} WHERE consumer_name = $1 \
                  AND processed_at IS NOT NULL)) AS oldest, now() AS db_now"
        )
    }
}

/// What [`InboxStore::sample_open_rows`] found.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpenRowsSample {
    /// Committed PROCESSING rows.
    pub processing: i64,
    /// RETRYABLE_FAILED rows (waiting in a retry tier, or overdue).
    pub retryable_failed: i64,
    /// PERMANENT_FAILED rows (parked).
    pub permanent_failed: i64,
    /// POISONED rows (parked).
    pub poisoned: i64,
    /// PROCESSING rows older than the stale threshold.
    pub stale_processing: i64,
    /// Seconds since the oldest parked row's last failure; `None` without parked rows.
    pub parked_oldest_age: Option<f64>,
    /// Seconds the oldest stuck row has been waiting: a PROCESSING row since it started, an
    /// overdue RETRYABLE_FAILED row since its retry delay ended. 0 when none is stuck.
    pub oldest_unprocessed_age: f64,
}

/// The columns a claim or a failure record writes from its envelopes, one entry per envelope
/// in the statement's order, gathered in one pass over them.
#[derive(Default)]
struct EnvelopeColumns<'a> {
    message_ids: Vec<&'a str>,
    message_types: Vec<Cow<'a, str>>,
    message_versions: Vec<i32>,
    aggregate_types: Vec<Option<Cow<'a, str>>>,
    aggregate_ids: Vec<Option<Cow<'a, str>>>,
    payload_sha256: Vec<&'a [u8]>,
    payloads: Vec<Option<Vec<u8>>>,
    headers: Vec<serde_json::Value>,
    correlation_ids: Vec<Option<Cow<'a, str>>>,
    causation_ids: Vec<Option<Cow<'a, str>>>,
    trace_ids: Vec<Option<Cow<'a, str>>>,
    tenant_ids: Vec<Option<Cow<'a, str>>>,
    payload_key_ids: Vec<Option<String>>,
}

impl<'a> EnvelopeColumns<'a> {
    /// Adds `envelope`: its text [`storable`], its body (if `keep_body` allows one) and
    /// headers as `store` keeps them in `phase`.
    fn push(
        &mut self,
        store: &InboxStore,
        consumer: &str,
        envelope: &'a Envelope,
        phase: Phase,
        keep_body: bool,
    ) {
        let sealed = store.stored_body(consumer, envelope, phase, keep_body);
        self.headers
            .push(store.stored_headers(consumer, envelope, phase, &sealed));
        self.payloads.push(sealed.payload);
        self.payload_key_ids.push(sealed.key_id);
        let text = |value: &'a Option<String>| value.as_deref().map(storable);
        self.message_ids.push(&envelope.message_id);
        self.message_types.push(storable(&envelope.message_type));
        self.message_versions.push(envelope.message_version);
        self.aggregate_types.push(text(&envelope.aggregate_type));
        self.aggregate_ids.push(text(&envelope.aggregate_id));
        self.payload_sha256.push(&envelope.payload_sha256);
        self.correlation_ids.push(text(&envelope.correlation_id));
        self.causation_ids.push(text(&envelope.causation_id));
        self.trace_ids
            .push(trace_id(envelope.traceparent.as_deref()).map(storable));
        self.tenant_ids.push(text(&envelope.tenant_id));
    }
}

/// What a failure record writes beside [`EnvelopeColumns`], one entry per failure.
#[derive(Default)]
struct FailureColumns<'a> {
    statuses: Vec<&'static str>,
    codes: Vec<Cow<'a, str>>,
    messages: Vec<String>,
    safe_details: Vec<Option<String>>,
    sealed_messages: Vec<Option<Vec<u8>>>,
    message_key_ids: Vec<Option<String>>,
}

impl<'a> FailureColumns<'a> {
    fn push(&mut self, failure: &Failure<'a>, error: StoredError) {
        self.statuses.push(failure.status.as_str());
        self.codes.push(storable(failure.code));
        self.messages.push(error.message);
        self.safe_details.push(error.safe);
        self.sealed_messages.push(error.sealed);
        self.message_key_ids.push(error.key_id);
    }
}

/// What the claim statement returned: the keys it inserted, the transaction's id and clock.
struct InsertedRows {
    ids: std::collections::HashSet<String>,
    txid: i64,
    db_now: DateTime<Utc>,
}

impl InsertedRows {
    fn read(rows: Vec<ClaimRow>) -> Result<Self, StoreError> {
        let mut txid = None;
        let mut db_now = None;
        let mut ids = std::collections::HashSet::with_capacity(rows.len());
        for (id, tx, now) in rows {
            match id {
                Some(id) => {
                    ids.insert(id);
                }
                None => {
                    txid = tx;
                    db_now = now;
                }
            }
        }
        let (Some(txid), Some(db_now)) = (txid, db_now) else {
            return Err(StoreError::Corrupt(
                "claim returned no transaction id".into(),
            ));
        };
        Ok(Self { ids, txid, db_now })
    }
}

/// One [`Claim`] per envelope, in order: inserted by the claim, or an `existing` row.
fn claims_in_order(
    envelopes: &[&Envelope],
    inserted: &std::collections::HashSet<String>,
    existing: &[InboxRecord],
) -> Result<Vec<Claim>, StoreError> {
    envelopes
        .iter()
        .map(|e| {
            if inserted.contains(&e.message_id) {
                return Ok(Claim::Claimed);
            }
            existing
                .iter()
                .find(|r| r.message_id == e.message_id)
                .map(|r| Claim::Existing(Box::new(r.clone())))
                // The conflicting row vanished between insert and select (cleanup ran):
                // the caller retries the batch in a new transaction.
                .ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "row {} conflicted on insert but is gone",
                        e.message_id
                    ))
                })
        })
        .collect()
}

fn record_from_row(row: &sqlx::postgres::PgRow) -> Result<InboxRecord, StoreError> {
    let status: String = row.try_get("status")?;
    Ok(InboxRecord {
        message_id: row.try_get("message_id")?,
        consumer_name: row.try_get("consumer_name")?,
        message_type: row.try_get("message_type")?,
        message_version: row.try_get("message_version")?,
        aggregate_type: row.try_get("aggregate_type")?,
        aggregate_id: row.try_get("aggregate_id")?,
        status: status.parse()?,
        processing_attempt: row.try_get("processing_attempt")?,
        delivery_count: row.try_get("delivery_count")?,
        first_received_at: row.try_get("first_received_at")?,
        last_received_at: row.try_get("last_received_at")?,
        processing_started_at: row.try_get("processing_started_at")?,
        processed_at: row.try_get("processed_at")?,
        first_failed_at: row.try_get("first_failed_at")?,
        last_failed_at: row.try_get("last_failed_at")?,
        payload_sha256: row.try_get("payload_sha256")?,
        payload_conflicts: row.try_get("payload_conflicts")?,
        last_error_code: row.try_get("last_error_code")?,
        last_error_message: row.try_get("last_error_message")?,
        parked_copy_at: row.try_get("parked_copy_at")?,
        parked_duplicates: row.try_get("parked_duplicates")?,
        retry_copy_attempt: row.try_get("retry_copy_attempt")?,
        retry_due_at: row.try_get("retry_due_at")?,
        retry_duplicates: row.try_get("retry_duplicates")?,
        order_key: row.try_get("order_key")?,
        order_position: row.try_get("order_position")?,
    })
}

/// The advisory lock key of a row's copy in flight (see [`InboxStore::try_copy_locks`]).
/// Advisory locks are per database, so the key names the schema too: inboxes in other schemas
/// (another service, another tenant) may use the same consumer name and message ids. A
/// collision only makes a copy go round a retry tier once.
pub(crate) fn copy_lock_key(schema: &SchemaName, consumer: &str, message_id: &str) -> i64 {
    crate::advisory_lock::key(&["rabbit-inbox copy", schema.as_str(), consumer, message_id])
}

/// The trace id part of a W3C `traceparent` (`version-traceid-parentid-flags`).
fn trace_id(traceparent: Option<&str>) -> Option<String> {
    traceparent?.split('-').nth(1).map(str::to_owned)
}

pub(crate) fn truncate(s: &str, max_chars: usize) -> &str {
    match s.char_indices().nth(max_chars) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

impl InboxStore {
    /// The inbox in `schema` (see [`crate::migrate`]).
    pub fn new(schema: SchemaName) -> Self {
        let sql = Arc::new(Sql::new(&schema));
        Self {
            schema,
            sql,
            payload: None,
        }
    }

    /// Stores bodies as `default` and `privacy` say (per type: whether, redacted, sealed),
    /// within what each call allows (its `store_payload`).
    pub fn with_privacy(mut self, default: PayloadStorage, privacy: PayloadPrivacy) -> Self {
        self.payload = Some(Arc::new(PayloadRules::new(default, privacy)));
        self
    }

    /// Whether a PROCESSED row of `message_type` keeps its body (always, without privacy
    /// rules: the caller decides).
    pub(crate) fn keeps_processed_payload(&self, message_type: &str) -> bool {
        self.payload
            .as_ref()
            .is_none_or(|r| r.keeps(message_type, Phase::Processed))
    }

    /// What goes into the payload columns for `envelope`, if the caller allows a body at all.
    fn stored_body(
        &self,
        consumer: &str,
        envelope: &Envelope,
        phase: Phase,
        allowed: bool,
    ) -> Sealed {
        if !allowed {
            return Sealed::default();
        }
        match &self.payload {
            None => Sealed {
                payload: Some(envelope.body.clone()),
                key_id: None,
            },
            Some(rules) => rules.seal(consumer, envelope, phase),
        }
    }

    /// The headers column for `envelope`, beside the body `sealed` stored for it: redacted
    /// as configured, and sealed like the body when encryption is on.
    fn stored_headers(
        &self,
        consumer: &str,
        envelope: &Envelope,
        phase: Phase,
        sealed: &Sealed,
    ) -> serde_json::Value {
        match &self.payload {
            None => storable_headers(&envelope.headers),
            Some(rules) => match rules.headers(envelope, phase, sealed) {
                Some(headers) => rules.seal_headers(consumer, envelope, storable_headers(&headers)),
                None => serde_json::Value::Object(serde_json::Map::new()),
            },
        }
    }

    /// The error columns for a failure of `envelope`: the message (truncated) as the privacy
    /// policy stores the body, the safe detail as it is.
    pub(crate) fn stored_error(
        &self,
        consumer: &str,
        envelope: &Envelope,
        message: &str,
        safe_detail: Option<&str>,
    ) -> StoredError {
        let message = truncate(message, MAX_ERROR_MESSAGE_CHARS);
        let safe = safe_detail.map(|s| truncate(s, MAX_ERROR_MESSAGE_CHARS));
        let mut stored = match &self.payload {
            None => StoredError::clear(message, safe),
            Some(rules) => rules.error(consumer, envelope, message, safe),
        };
        stored.message = storable(stored.message).into_owned();
        stored.safe = stored.safe.map(|s| storable(s).into_owned());
        stored
    }

    /// The schema.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// Claims one message; see [`InboxStore::try_claim_many`].
    pub async fn try_claim(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        envelope: &Envelope,
        store_payload: bool,
    ) -> Result<Claim, StoreError> {
        let mut claims = self
            .try_claim_many(conn, consumer, &[envelope], store_payload)
            .await?;
        claims
            .pop()
            .ok_or_else(|| StoreError::Corrupt("claim returned nothing".into()))
    }

    /// Insert-first claim of a batch in the caller's transaction: one multi-row
    /// `INSERT .. ON CONFLICT DO NOTHING`, then the rows that already existed are read and
    /// locked. A concurrent claimer of the same key waits on the primary key until this
    /// transaction ends, so the effect runs once. Returns one [`Claim`] per envelope, in order.
    ///
    /// Keys must be distinct. Claims are made in key order, so two consumers claiming
    /// overlapping batches cannot deadlock on each other.
    pub async fn try_claim_many(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        envelopes: &[&Envelope],
        store_payload: bool,
    ) -> Result<Vec<Claim>, StoreError> {
        Ok(self
            .claim(
                conn,
                consumer,
                envelopes,
                store_payload,
                InboxStatus::Processing,
            )
            .await?
            .claims)
    }

    /// Like [`InboxStore::try_claim_many`], but new rows are inserted already PROCESSED, which
    /// saves the `mark_processed` update (and its index writes) for them. Correct only when the
    /// effect commits in this same transaction and any failure rolls it back: the row is
    /// invisible to everyone else until then, so PROCESSED becomes visible exactly when the
    /// effect does. Existing rows are returned as with `try_claim_many`.
    pub async fn try_claim_many_committing(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        envelopes: &[&Envelope],
        store_payload: bool,
    ) -> Result<Vec<Claim>, StoreError> {
        Ok(self
            .claim_committing(conn, consumer, envelopes, store_payload)
            .await?
            .claims)
    }

    /// [`InboxStore::try_claim_many_committing`] with the claiming transaction's id and the
    /// database clock.
    pub(crate) async fn claim_committing(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        envelopes: &[&Envelope],
        store_payload: bool,
    ) -> Result<BatchClaim, StoreError> {
        self.claim(
            conn,
            consumer,
            envelopes,
            store_payload,
            InboxStatus::Processed,
        )
        .await
    }

    /// Claims `envelopes` (new rows inserted as `status`), reads and locks the rows that
    /// existed, and returns one [`Claim`] per envelope in order.
    async fn claim(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        envelopes: &[&Envelope],
        store_payload: bool,
        status: InboxStatus,
    ) -> Result<BatchClaim, StoreError> {
        let phase = match status {
            InboxStatus::Processed => Phase::Processed,
            _ => Phase::Failed,
        };
        // In key order: see `try_claim_many`.
        let mut sorted = envelopes.to_vec();
        sorted.sort_by(|a, b| a.message_id.cmp(&b.message_id));
        let mut columns = EnvelopeColumns::default();
        for envelope in sorted {
            columns.push(self, consumer, envelope, phase, store_payload);
        }
        let rows: Vec<ClaimRow> = sqlx::query_as(self.sql.claim.clone())
            .bind(consumer)
            .bind(columns.message_ids)
            .bind(columns.message_types)
            .bind(columns.message_versions)
            .bind(columns.aggregate_types)
            .bind(columns.aggregate_ids)
            .bind(columns.payload_sha256)
            .bind(columns.payloads)
            .bind(columns.headers)
            .bind(columns.correlation_ids)
            .bind(columns.causation_ids)
            .bind(columns.trace_ids)
            .bind(columns.tenant_ids)
            .bind(status.as_str())
            .bind(columns.payload_key_ids)
            .fetch_all(&mut *conn)
            .await?;
        let inserted = InsertedRows::read(rows)?;
        let existing_ids: Vec<&str> = envelopes
            .iter()
            .map(|e| e.message_id.as_str())
            .filter(|id| !inserted.ids.contains(*id))
            .collect();
        let existing = if existing_ids.is_empty() {
            Vec::new()
        } else {
            self.lock_rows(conn, consumer, &existing_ids).await?
        };
        Ok(BatchClaim {
            claims: claims_in_order(envelopes, &inserted.ids, &existing)?,
            txid: inserted.txid,
            db_now: inserted.db_now,
        })
    }

    /// Reads and locks (`FOR UPDATE`, in key order) the rows of `message_ids` that exist, in
    /// the caller's transaction.
    pub(crate) async fn lock_rows(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_ids: &[&str],
    ) -> Result<Vec<InboxRecord>, StoreError> {
        sqlx::query(self.sql.lock_existing.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_ids)
            .fetch_all(conn)
            .await?
            .iter()
            .map(record_from_row)
            .collect()
    }

    /// Takes, where no other session holds it, the session-level advisory lock that says "a
    /// copy of this row's current state is on its way to the broker" (see
    /// [`copy_lock_key`]). Returns, per id in order, whether this session holds it now. Taken
    /// in the transaction that decides on the copy, under the row lock, and released by the
    /// lane once the copy is noted on the row ([`crate::processor::LaneConnection`]): a
    /// decider that finds the row parked or retryable without a noted copy and cannot take
    /// the lock knows the copy is in flight elsewhere and does not make a second one.
    pub(crate) async fn try_copy_locks(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_ids: &[&str],
    ) -> Result<Vec<bool>, StoreError> {
        if message_ids.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<i64> = message_ids
            .iter()
            .map(|id| copy_lock_key(&self.schema, consumer, id))
            .collect();
        Ok(sqlx::query_scalar(
            "SELECT pg_try_advisory_lock(k) FROM unnest($1::int8[]) WITH ORDINALITY AS u(k, n) \
             ORDER BY n",
        )
        .persistent(false)
        .bind(keys)
        .fetch_all(conn)
        .await?)
    }

    /// The transaction's current id as PostgreSQL sees it: `None` outside a transaction that
    /// has written (after a `ROLLBACK` or `COMMIT` a handler ran itself), an error when the
    /// transaction is aborted (a failed statement a handler ignored).
    pub(crate) async fn current_txid(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Option<i64>, sqlx::Error> {
        sqlx::query_scalar("SELECT txid_current_if_assigned()")
            .fetch_one(conn)
            .await
    }

    /// Records `rows` HELD behind an earlier message of their ordering key, in the caller's
    /// transaction: a row this transaction claimed (`fresh`) keeps its body and headers as a
    /// failed message's are kept, so the release task can publish it again.
    pub(crate) async fn hold(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        rows: &[HeldRow<'_>],
    ) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        let mut bodies = Vec::with_capacity(rows.len());
        let mut key_ids = Vec::with_capacity(rows.len());
        let mut headers = Vec::with_capacity(rows.len());
        for row in rows {
            let sealed = self.stored_body(consumer, row.envelope, Phase::Failed, row.fresh);
            headers.push(self.stored_headers(consumer, row.envelope, Phase::Failed, &sealed));
            bodies.push(sealed.payload);
            key_ids.push(sealed.key_id);
        }
        sqlx::query(self.sql.hold.clone())
            .bind(consumer)
            .bind(
                rows.iter()
                    .map(|r| r.envelope.message_id.as_str())
                    .collect::<Vec<_>>(),
            )
            .bind(rows.iter().map(|r| r.key).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.position).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.fresh).collect::<Vec<_>>())
            .bind(bodies)
            .bind(key_ids)
            .bind(headers)
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Reads one row.
    pub async fn find(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<InboxRecord>, StoreError> {
        let row = sqlx::query(self.sql.find.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_id)
            .fetch_optional(conn)
            .await?;
        row.as_ref().map(record_from_row).transpose()
    }

    /// Reads what one row kept of its message: the stored body as stored (maybe redacted, maybe
    /// sealed), the headers and the body's dedup hash. `None`: no row.
    pub async fn find_payload(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<RowPayload>, StoreError> {
        let row = sqlx::query(self.sql.find_payload.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_id)
            .fetch_optional(conn)
            .await?;
        row.map(|r| {
            let bytes: Option<Vec<u8>> = r.try_get("payload")?;
            let key_id: Option<String> = r.try_get("payload_key_id")?;
            Ok(RowPayload {
                stored: bytes.map(|bytes| StoredPayload { bytes, key_id }),
                headers: r.try_get("headers")?,
                payload_sha256: r.try_get("payload_sha256")?,
            })
        })
        .transpose()
    }

    /// Reads the stored payload of one row as it is stored (maybe redacted, maybe sealed);
    /// [`crate::privacy::open_payload`] turns it back into the body. `None`: no row, or no
    /// payload kept.
    pub async fn find_stored_payload(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<StoredPayload>, StoreError> {
        let row: Option<(Vec<u8>, Option<String>)> =
            sqlx::query_as(self.sql.find_stored_payload.clone())
                .persistent(false)
                .bind(consumer)
                .bind(message_id)
                .fetch_optional(conn)
                .await?;
        Ok(row.map(|(bytes, key_id)| StoredPayload { bytes, key_id }))
    }

    /// Moves claimed-by-conflict rows (RETRYABLE_FAILED, or stale PROCESSING) back to
    /// PROCESSING with one more attempt, in the caller's transaction. Returns the ids and their
    /// attempt numbers. The delivery itself is counted by [`InboxStore::note_redeliveries`].
    pub async fn mark_processing(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_ids: &[&str],
    ) -> Result<Vec<(String, i32)>, StoreError> {
        Ok(sqlx::query_as(self.sql.reclaim.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_ids)
            .fetch_all(conn)
            .await?)
    }

    /// Notes redeliveries of existing rows (delivery count, last seen, body conflicts).
    pub async fn note_redeliveries(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        redeliveries: &[Redelivery<'_>],
    ) -> Result<(), StoreError> {
        if redeliveries.is_empty() {
            return Ok(());
        }
        sqlx::query(self.sql.note_redeliveries.clone())
            .persistent(false)
            .bind(consumer)
            .bind(
                redeliveries
                    .iter()
                    .map(|r| r.message_id)
                    .collect::<Vec<_>>(),
            )
            .bind(
                redeliveries
                    .iter()
                    .map(|r| r.conflicting_sha256)
                    .collect::<Vec<_>>(),
            )
            .bind(
                redeliveries
                    .iter()
                    .map(|r| {
                        r.duplicate_of.map(|copy| match copy {
                            PendingCopy::Parked => "parked",
                            PendingCopy::Retry => "retry",
                        })
                    })
                    .collect::<Vec<_>>(),
            )
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Notes on their rows the copies the broker confirmed (before the deliveries they were
    /// made from are acked): a parked row's copy is in the parking lot, a retry copy in its
    /// tier until it is due. A mark lands only while the row is still in the state and attempt
    /// the copy was made for; a change of either voids it (a trigger), so a mark never
    /// outlives its copy's reason. Later copies of the message are then acked as duplicates
    /// ([`InboxRecord::pending_copy`]).
    pub async fn note_confirmed_copies(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        copies: &[ConfirmedCopy],
    ) -> Result<u64, StoreError> {
        if copies.is_empty() {
            return Ok(0);
        }
        let (mut ids, mut attempts, mut delays) = (Vec::new(), Vec::new(), Vec::new());
        for copy in copies {
            ids.push(copy.message_id.as_str());
            attempts.push(copy.attempt);
            // NULL delay: a parking copy.
            delays.push(match copy.kind {
                ConfirmedCopyKind::Parked => None,
                ConfirmedCopyKind::Retry(delay) => Some(delay.as_secs_f64()),
            });
        }
        Ok(sqlx::query(self.sql.note_confirmed_copies.clone())
            .persistent(false)
            .bind(consumer)
            .bind(ids)
            .bind(attempts)
            .bind(delays)
            .execute(conn)
            .await?
            .rows_affected())
    }

    /// Marks PROCESSING rows PROCESSED in the caller's (business) transaction and returns how
    /// many it marked. Rows in any other state are left alone: a parked or failed row changes
    /// only through its own path, so a count below `message_ids.len()` means the caller does
    /// not hold those claims. `keep_payload` false drops a body kept from an earlier failure.
    pub async fn mark_processed(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_ids: &[&str],
        keep_payload: bool,
    ) -> Result<u64, StoreError> {
        Ok(sqlx::query(self.sql.mark_processed.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_ids)
            .bind(keep_payload)
            .execute(conn)
            .await?
            .rows_affected())
    }

    /// Records a failure outside the business transaction (which has rolled back, taking any
    /// claim with it): inserts the row, or adds an attempt to it. Returns the recorded status
    /// and attempt count, or `None` when the row is PROCESSED (another copy committed the
    /// effect; the failure is moot) or parked (PERMANENT_FAILED or POISONED, which only an
    /// explicit reopen changes): the row is left as it is.
    pub async fn record_failure(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        envelope: &Envelope,
        failure: Failure<'_>,
    ) -> Result<Option<(InboxStatus, i32)>, StoreError> {
        let mut recorded = self
            .record_failures(conn, consumer, failure.max_attempts, &[(envelope, failure)])
            .await?;
        Ok(recorded.pop().flatten())
    }

    /// [`InboxStore::record_failure`] for many messages in one statement, in order. Keys must
    /// be distinct; `max_attempts` applies to all.
    pub(crate) async fn record_failures(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        max_attempts: i32,
        failures: &[(&Envelope, Failure<'_>)],
    ) -> Result<Vec<Option<(InboxStatus, i32)>>, StoreError> {
        let mut columns = EnvelopeColumns::default();
        let mut failed = FailureColumns::default();
        for (envelope, failure) in failures {
            columns.push(
                self,
                consumer,
                envelope,
                Phase::Failed,
                failure.store_payload,
            );
            let error = self.stored_error(consumer, envelope, failure.message, failure.safe_detail);
            failed.push(failure, error);
        }
        let rows = sqlx::query(self.sql.record_failure.clone())
            .bind(consumer)
            .bind(columns.message_ids)
            .bind(columns.message_types)
            .bind(columns.message_versions)
            .bind(columns.aggregate_types)
            .bind(columns.aggregate_ids)
            .bind(failed.statuses)
            .bind(columns.payload_sha256)
            .bind(columns.payloads)
            .bind(columns.headers)
            .bind(failed.codes)
            .bind(failed.messages)
            .bind(columns.correlation_ids)
            .bind(columns.causation_ids)
            .bind(columns.trace_ids)
            .bind(columns.tenant_ids)
            .bind(max_attempts)
            .bind(columns.payload_key_ids)
            .bind(failed.safe_details)
            .bind(failed.sealed_messages)
            .bind(failed.message_key_ids)
            .fetch_all(conn)
            .await?;
        let mut recorded = std::collections::HashMap::with_capacity(rows.len());
        for row in rows {
            let id: String = row.try_get("message_id")?;
            let status: String = row.try_get("status")?;
            recorded.insert(id, (status.parse()?, row.try_get("processing_attempt")?));
        }
        Ok(failures
            .iter()
            .map(|(e, _)| recorded.get(&e.message_id).copied())
            .collect())
    }

    /// Rows stuck in PROCESSING for longer than `older_than`, oldest first.
    pub async fn find_stale_processing(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        older_than: Duration,
        limit: i64,
    ) -> Result<Vec<InboxRecord>, StoreError> {
        sqlx::query(self.sql.find_stale.clone())
            .persistent(false)
            .bind(consumer)
            .bind(older_than.as_secs_f64())
            .bind(limit)
            .fetch_all(conn)
            .await?
            .iter()
            .map(record_from_row)
            .collect()
    }

    /// Counts the open (not PROCESSED) rows of `consumer` by status, with the age of the
    /// oldest stuck and the oldest parked one, in one query over the index of open rows.
    /// `stale_after` is the stale-PROCESSING threshold, `retry` gives each attempt's delay.
    pub async fn sample_open_rows(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        stale_after: Duration,
        retry: &crate::retry::RetryPolicy,
    ) -> Result<OpenRowsSample, StoreError> {
        let delays: Vec<f64> = retry.delays.iter().map(Duration::as_secs_f64).collect();
        let row = sqlx::query(self.sql.sample_open.clone())
            .persistent(false)
            .bind(consumer)
            .bind(stale_after.as_secs_f64())
            .bind(&delays)
            .fetch_one(conn)
            .await?;
        Ok(OpenRowsSample {
            processing: row.try_get("processing")?,
            retryable_failed: row.try_get("retryable_failed")?,
            permanent_failed: row.try_get("permanent_failed")?,
            poisoned: row.try_get("poisoned")?,
            stale_processing: row.try_get("stale_processing")?,
            parked_oldest_age: row.try_get("parked_oldest_age")?,
            oldest_unprocessed_age: row
                .try_get::<Option<f64>, _>("oldest_unprocessed_age")?
                .unwrap_or(0.0)
                .max(0.0),
        })
    }

    /// Seconds by which the retained PROCESSED history of `consumer` reaches past
    /// `replay_window` (negative: it is shorter than the window); `None` without processed
    /// rows. Cheap while retention keeps the history near the window (the BRIN index reads
    /// only the ranges older than it); a history shorter than the window is read in full.
    pub async fn dedup_window_headroom(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        replay_window: Duration,
    ) -> Result<Option<f64>, StoreError> {
        let row = sqlx::query(self.sql.oldest_processed.clone())
            .persistent(false)
            .bind(consumer)
            .bind(replay_window.as_secs_f64())
            .fetch_one(conn)
            .await?;
        let oldest: Option<DateTime<Utc>> = row.try_get("oldest")?;
        let now: DateTime<Utc> = row.try_get("db_now")?;
        Ok(oldest.map(|oldest| (now - oldest).as_seconds_f64() - replay_window.as_secs_f64()))
    }

    /// Deletes up to `limit` PROCESSED rows older than `older_than`; call in a loop until it
    /// returns 0. Keep `older_than` at least as long as the longest replay window (DLQ replays,
    /// outbox republishes): a deleted row no longer suppresses a duplicate.
    pub async fn cleanup_processed_older_than(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        older_than: Duration,
        limit: i64,
    ) -> Result<u64, StoreError> {
        let deleted = sqlx::query(self.sql.cleanup.clone())
            .persistent(false)
            .bind(consumer)
            .bind(older_than.as_secs_f64())
            .bind(limit)
            .execute(conn)
            .await?
            .rows_affected();
        metrics::counter!(crate::telemetry::metrics::RETENTION_DELETED, "consumer" => consumer.to_owned())
            .increment(deleted);
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_lock_keys_are_per_schema() {
        let (a, b) = (
            SchemaName::new("billing").expect("valid"),
            SchemaName::new("shipping").expect("valid"),
        );
        // Advisory locks are per database: two inboxes with one consumer name must not share
        // a row's copy lock (the other's parked message would send this one round a tier).
        assert_ne!(
            copy_lock_key(&a, "svc", "m1"),
            copy_lock_key(&b, "svc", "m1")
        );
        assert_ne!(
            copy_lock_key(&a, "svc", "m1"),
            copy_lock_key(&a, "svc", "m2")
        );
        assert_eq!(
            copy_lock_key(&a, "svc", "m1"),
            copy_lock_key(&a, "svc", "m1")
        );
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "hé");
        assert_eq!(truncate("abc", 10), "abc");
    }

    #[test]
    fn trace_id_is_the_second_field() {
        assert_eq!(
            trace_id(Some(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            ))
            .as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(trace_id(None), None);
    }
}
