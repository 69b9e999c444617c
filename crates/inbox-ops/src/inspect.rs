//! Inspection: what the inbox holds, read-only. `status` (counts and ages per consumer and
//! status), `list` (filtered rows, keyset-paginated), `show` (one message everywhere it is
//! known) and failure groups.
//!
//! Every query is built to stay cheap on a large inbox: open rows (anything not PROCESSED) are
//! found through the partial index `idx_message_inbox_open`, recent PROCESSED rows through the
//! BRIN index on `processed_at`, one message through the primary key. Counting all PROCESSED
//! rows is a scan and happens only when asked for.

use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Row, postgres::PgRow};

use crate::{
    actor::Actor,
    audit::{AuditEntry, PAYLOAD_READ, audit, audit_from_row},
    error::OpsError,
    operations::Operations,
    sql::{consumers_of, sql},
};
use rabbit_inbox::{
    broker::ParkingLot,
    broker::QueueDepth,
    broker::Topology,
    error::StoreError,
    ledger_sql::{PARKED, PROCESSED, RETRYABLE_FAILED, overdue_by, stale_processing},
    privacy::{SEALED_HEADERS, StoredPayload, open_error, open_headers, open_payload},
    retry::RetryPolicy,
    status::InboxStatus,
};

/// Statuses of rows that are not done: the ones `list` shows unless told otherwise.
pub const OPEN_STATUSES: [InboxStatus; 6] = [
    InboxStatus::Processing,
    InboxStatus::RetryableFailed,
    InboxStatus::PermanentFailed,
    InboxStatus::Poisoned,
    InboxStatus::ManualReview,
    InboxStatus::Held,
];

/// The window of the "last hour" counters of [`StatusReport`].
const RECENT: Duration = Duration::from_secs(3600);

/// What [`Operations::status`] reports on.
#[derive(Clone, Debug)]
pub struct StatusQuery {
    /// One consumer, or all.
    pub consumer: Option<String>,
    /// A PROCESSING row whose attempt started longer ago than this counts as stale (a leased
    /// row: once its lease expired).
    pub stale_after: Duration,
    /// The consumer's retry delay per attempt: a RETRYABLE_FAILED row is overdue only once its
    /// delay passed (see [`StatusLine::overdue_age_secs`]).
    pub retry_delays: Vec<Duration>,
    /// Count all PROCESSED rows exactly (a scan of the table; off by default).
    pub count_processed: bool,
}

impl Default for StatusQuery {
    fn default() -> Self {
        Self {
            consumer: None,
            stale_after: RetryPolicy::default().stale_processing_after,
            retry_delays: RetryPolicy::default().delays,
            count_processed: false,
        }
    }
}

/// Counts and ages of one consumer's rows in one status.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StatusLine {
    /// Consumer.
    pub consumer: String,
    /// Status.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub status: InboxStatus,
    /// Rows in this status. For PROCESSED only with [`StatusQuery::count_processed`].
    pub rows: Option<i64>,
    /// First receipt of the oldest row (open statuses only: PROCESSED rows are done).
    pub oldest_received_at: Option<DateTime<Utc>>,
    /// Its age in seconds.
    pub oldest_age_secs: Option<f64>,
    /// PROCESSING and RETRYABLE_FAILED only: how long the most overdue row has been stuck, in
    /// seconds (a committed claim without a live lease since it began; a retry since its delay
    /// passed), as the `rabbit_inbox_oldest_unprocessed_age_seconds` gauge measures it. `None`
    /// when no row is overdue: rows waiting for their retry and live leases are not.
    pub overdue_age_secs: Option<f64>,
    /// PROCESSING rows whose lease expired, or (without a lease) whose attempt started longer
    /// ago than the stale threshold.
    pub stale: i64,
    /// Rows that failed within the last hour (`last_failed_at`). For PROCESSED: rows processed
    /// in the last hour after an earlier failure within it.
    pub failed_last_hour: i64,
    /// Duplicate deliveries within the last hour: copies of a message delivered again and
    /// acked without running the handler (a redelivery of a processed message, a copy of a
    /// parked one), not the deliveries that were attempts (a retry is counted as a delivery on
    /// the row, but it is no duplicate). Read from the ledger's history (`inbox_event` entries
    /// of kind `duplicate`, which the ledger's trigger writes for exactly those deliveries),
    /// not from `delivery_count - processing_attempt`, which a reopen (attempts back to 0)
    /// would turn into duplicates that never came. Counted on the line of the row's current
    /// status; for PROCESSED, duplicates of older messages too.
    pub duplicates_last_hour: i64,
    /// Rows that saw a copy with another body (same id, `payload_conflicts`) within the last
    /// hour, counted like `duplicates_last_hour`.
    pub conflicts_last_hour: i64,
    /// PROCESSED only: rows processed within the last hour.
    pub processed_last_hour: Option<i64>,
}

/// Depths of one work queue's broker queues.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BrokerDepths {
    /// The work queue and its ready messages (`None` if it does not exist).
    #[cfg_attr(feature = "openapi", schema(schema_with = queue_depth_schema))]
    pub work: QueueDepth,
    /// The parking lot and its messages (`None` if it does not exist).
    #[cfg_attr(feature = "openapi", schema(schema_with = queue_depth_schema))]
    pub parking: QueueDepth,
}

/// The JSON shape of the core library's [`QueueDepth`], which has no schema of its own.
#[cfg(feature = "openapi")]
fn queue_depth_schema() -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
    ObjectBuilder::new()
        .property(
            "queue",
            ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some("Queue name.")),
        )
        .required("queue")
        .property(
            "messages",
            ObjectBuilder::new()
                .schema_type(SchemaType::from_iter([Type::Integer, Type::Null]))
                .minimum(Some(0))
                .description(Some(
                    "Ready messages; `null` when the queue does not exist.",
                )),
        )
        .build()
}

/// What [`Operations::status`] returns.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StatusReport {
    /// The database's clock when the report was made (ages are measured against it).
    pub at: DateTime<Utc>,
    /// One line per consumer and status.
    pub lines: Vec<StatusLine>,
    /// The planner's estimate of all rows in the inbox table (`pg_class.reltuples`; -1 before
    /// the first analyze).
    pub estimated_total_rows: i64,
    /// Broker side, when a parking lot was given.
    pub broker: Option<BrokerDepths>,
}

/// Filters and page of [`Operations::list`]. Empty filters match everything.
#[derive(Clone, Debug)]
pub struct ListFilter {
    /// Consumer.
    pub consumer: Option<String>,
    /// Statuses; empty means [`OPEN_STATUSES`] (listing PROCESSED rows scans them).
    pub statuses: Vec<InboxStatus>,
    /// Message type.
    pub message_type: Option<String>,
    /// Last error code.
    pub error_code: Option<String>,
    /// Aggregate type.
    pub aggregate_type: Option<String>,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Tenant.
    pub tenant: Option<String>,
    /// Exactly this message id (dedup key); with every status, for instance, it finds the row
    /// of each consumer that has it.
    pub message_id: Option<String>,
    /// Exactly this correlation id (through its own index).
    pub correlation_id: Option<String>,
    /// First received at or after.
    pub since: Option<DateTime<Utc>>,
    /// First received before.
    pub until: Option<DateTime<Utc>>,
    /// Where the previous page ended ([`ListPage::next_cursor`]).
    pub cursor: Option<String>,
    /// Rows per page, 1 to 1000.
    pub limit: u32,
}

impl Default for ListFilter {
    fn default() -> Self {
        Self {
            consumer: None,
            statuses: Vec::new(),
            message_type: None,
            error_code: None,
            aggregate_type: None,
            aggregate_id: None,
            tenant: None,
            message_id: None,
            correlation_id: None,
            since: None,
            until: None,
            cursor: None,
            limit: 50,
        }
    }
}

/// One row of [`ListPage`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RowSummary {
    /// Dedup key.
    pub message_id: String,
    /// Consumer.
    pub consumer_name: String,
    /// Message type.
    pub message_type: String,
    /// Status.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub status: InboxStatus,
    /// Attempts made.
    pub processing_attempt: i32,
    /// Deliveries seen, duplicates included.
    pub delivery_count: i32,
    /// First seen.
    pub first_received_at: DateTime<Utc>,
    /// Last failure.
    pub last_failed_at: Option<DateTime<Utc>>,
    /// Last error code.
    pub last_error_code: Option<String>,
    /// Aggregate type.
    pub aggregate_type: Option<String>,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Tenant.
    pub tenant_id: Option<String>,
}

/// A page of [`Operations::list`].
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListPage {
    /// Rows, oldest first (by first receipt, then key).
    pub rows: Vec<RowSummary>,
    /// Pass as [`ListFilter::cursor`] for the next page; `None` on the last page.
    pub next_cursor: Option<String>,
}

/// The keyset position a page ends at, sent to clients as an opaque string.
#[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Cursor {
    /// `first_received_at` in microseconds (PostgreSQL's resolution).
    t: i64,
    m: String,
    c: String,
}

impl Cursor {
    fn encode(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
    }

    fn decode(text: &str) -> Result<Self, OpsError> {
        let bad = || OpsError::Invalid(format!("invalid cursor {:?}", text.replace('\0', "")));
        let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(text)
            .map_err(|_| bad())?;
        let cursor: Self = serde_json::from_slice(&json).map_err(|_| bad())?;
        // Where a page ended is a key of the inbox: PostgreSQL's text holds no NUL.
        if cursor.m.contains('\0') || cursor.c.contains('\0') {
            return Err(bad());
        }
        Ok(cursor)
    }

    /// The time the page ended at, refused unless PostgreSQL can hold it (4713 BC to 294276
    /// AD; chrono's own range ends earlier, in 262143).
    fn received_at(&self) -> Result<DateTime<Utc>, OpsError> {
        /// 4713-11-24 BC, 00:00 UTC (the Julian day 0), in microseconds since 1970.
        const POSTGRES_MIN_MICROS: i64 = -210_866_803_200_000_000;
        DateTime::from_timestamp_micros(self.t)
            .filter(|_| self.t >= POSTGRES_MIN_MICROS)
            .ok_or_else(|| {
                OpsError::Invalid(
                    "invalid cursor: its time is outside what the inbox can hold".into(),
                )
            })
    }
}

/// What [`Operations::show`] looks for.
#[derive(Clone, Debug)]
pub struct ShowQuery {
    /// The dedup key.
    pub message_id: String,
    /// One consumer's row, or every consumer's.
    pub consumer: Option<String>,
    /// The consumer's queues and retry tiers, to say where the message is on the broker.
    /// Without them the location names no queue.
    pub topology: Option<(Topology, RetryPolicy)>,
}

/// A stored body, readable: as text when it is UTF-8, else base64; or, when it is encrypted
/// and could not be opened, which key sealed it and why it stayed sealed.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "encoding", content = "data", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Payload {
    /// Valid UTF-8.
    Utf8(String),
    /// Anything else.
    Base64(String),
    /// Encrypted, not opened (no keyring given, key missing or destroyed).
    Sealed {
        /// The key that sealed it.
        key_id: String,
        /// Why it was not opened.
        reason: String,
    },
}

impl Payload {
    /// `bytes` as text if it is UTF-8, else base64.
    pub fn of(bytes: Vec<u8>) -> Self {
        match String::from_utf8(bytes) {
            Ok(text) => Payload::Utf8(text),
            Err(e) => {
                Payload::Base64(base64::engine::general_purpose::STANDARD.encode(e.into_bytes()))
            }
        }
    }
}

/// Where a message is on the broker, inferred from its row's status (each status has exactly
/// one broker action; see ARCHITECTURE.md).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BrokerLocation {
    /// `acked` (gone from the broker), `retry_tier`, `parking_lot`, `manual_review` or `in_flight`.
    pub place: &'static str,
    /// The queue, when known.
    pub queue: Option<String>,
}

impl BrokerLocation {
    fn of(status: InboxStatus, attempt: i32, topology: Option<&(Topology, RetryPolicy)>) -> Self {
        let (place, queue) = match status {
            InboxStatus::Processed => ("acked", None),
            InboxStatus::RetryableFailed => (
                "retry_tier",
                topology.and_then(|(t, r)| {
                    r.delays
                        .get(r.tier_of_attempt(attempt))
                        .map(|d| t.retry_tier_queue(*d))
                }),
            ),
            InboxStatus::PermanentFailed | InboxStatus::Poisoned => (
                "parking_lot",
                topology.map(|(t, _)| t.parking_queue.clone()),
            ),
            // Recovery set it aside: its copy was lost, or one that turns up is parked.
            InboxStatus::ManualReview => (
                "manual_review",
                topology.map(|(t, _)| t.parking_queue.clone()),
            ),
            // Unacked on a consumer, or back in the work queue if that consumer went away.
            InboxStatus::Processing => ("in_flight", topology.map(|(t, _)| t.queue.clone())),
            // Acked and kept in the ledger with its body until its key's turn; the release
            // task publishes it to the work queue then.
            InboxStatus::Held => ("held_in_ledger", None),
            _ => ("unknown", None),
        };
        Self { place, queue }
    }
}

/// Every column of one row, with its payload and where its message is.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RowDetail {
    /// Dedup key.
    pub message_id: String,
    /// Consumer.
    pub consumer_name: String,
    /// Message type.
    pub message_type: String,
    /// Message version.
    pub message_version: i32,
    /// Status.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub status: InboxStatus,
    /// Attempts made.
    pub processing_attempt: i32,
    /// Deliveries seen, duplicates included.
    pub delivery_count: i32,
    /// First seen.
    pub first_received_at: DateTime<Utc>,
    /// Last seen.
    pub last_received_at: DateTime<Utc>,
    /// Current or last attempt started.
    pub processing_started_at: Option<DateTime<Utc>>,
    /// Leased processing: the worker holding (or last holding) the lease.
    pub lease_owner: Option<String>,
    /// Leased processing: when the lease runs out unless renewed (stale after it).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// Leased processing: the fencing token of the current or last lease; each takeover
    /// increments it, and only its holder can commit.
    pub fencing_token: Option<i64>,
    /// Effect committed.
    pub processed_at: Option<DateTime<Utc>>,
    /// First failure.
    pub first_failed_at: Option<DateTime<Utc>>,
    /// Last failure.
    pub last_failed_at: Option<DateTime<Utc>>,
    /// SHA-256 of the first body, hex.
    pub payload_sha256: String,
    /// Copies with another body.
    pub payload_conflicts: i32,
    /// When the last such copy came.
    pub last_conflict_at: Option<DateTime<Utc>>,
    /// When the parked copy was confirmed in the parking lot (later copies are acked as its
    /// duplicates); `None` while none is noted.
    pub parked_copy_at: Option<DateTime<Utc>>,
    /// Copies acked as duplicates of the parked copy.
    pub parked_duplicates: i32,
    /// When the pending retry copy is due back from its tier (RETRYABLE_FAILED with a
    /// confirmed retry copy).
    pub retry_due_at: Option<DateTime<Utc>>,
    /// Copies acked as duplicates of a pending retry.
    pub retry_duplicates: i32,
    /// Last error code.
    pub last_error_code: Option<String>,
    /// Last error message: the handler's message where the privacy policy lets it be read
    /// (in clear, or opened with the keyring), else its safe detail or a marker
    /// ([`rabbit_inbox::privacy::REDACTED`], [`rabbit_inbox::privacy::SEALED`]).
    pub last_error_message: Option<String>,
    /// Why a sealed error message could not be opened (no keyring, key destroyed), if it was.
    pub last_error_sealed: Option<String>,
    /// Aggregate type.
    pub aggregate_type: Option<String>,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Correlation id.
    pub correlation_id: Option<String>,
    /// Causation id.
    pub causation_id: Option<String>,
    /// Trace id.
    pub trace_id: Option<String>,
    /// Tenant.
    pub tenant_id: Option<String>,
    /// Application headers as stored (redacted as configured), opened with the keyring when
    /// sealed; when they cannot be opened, `{"x-inbox-sealed": "<why>"}`.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<HashMap<String, serde_json::Value>>))]
    pub headers: serde_json::Value,
    /// The body, if kept.
    pub payload: Option<Payload>,
    /// Where the message is on the broker.
    pub location: BrokerLocation,
}

/// What is left of a row that retention removed.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Tombstone {
    /// Dedup key.
    pub message_id: String,
    /// Consumer.
    pub consumer_name: String,
    /// SHA-256 of the body, hex.
    pub payload_sha256: String,
    /// Status when removed.
    pub final_status: String,
    /// Message type.
    pub message_type: String,
    /// First seen.
    pub first_received_at: DateTime<Utc>,
    /// Effect committed.
    pub processed_at: Option<DateTime<Utc>>,
    /// Removed by retention.
    pub removed_at: DateTime<Utc>,
}

/// What [`Operations::show`] returns.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ShowReport {
    /// The dedup key asked for.
    pub message_id: String,
    /// One row per consumer that has it.
    pub rows: Vec<RowDetail>,
    /// Tombstones of rows retention removed.
    pub tombstones: Vec<Tombstone>,
    /// Operator actions on it, oldest first.
    pub audit: Vec<AuditEntry>,
}

/// Failed rows with one consumer, status, message type and error code.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FailureGroup {
    /// Consumer.
    pub consumer: String,
    /// RETRYABLE_FAILED, PERMANENT_FAILED, POISONED or MANUAL_REVIEW.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub status: InboxStatus,
    /// Message type.
    pub message_type: String,
    /// Last error code.
    pub error_code: Option<String>,
    /// Rows.
    pub rows: i64,
    /// Earliest first failure.
    pub first_failed_at: Option<DateTime<Utc>>,
    /// Latest failure.
    pub last_failed_at: Option<DateTime<Utc>>,
    /// The most recently failed row's key.
    pub sample_message_id: String,
    /// And its error message.
    pub sample_error: Option<String>,
}

fn status_of(row: &PgRow) -> Result<InboxStatus, OpsError> {
    Ok(row.try_get::<String, _>("status")?.parse()?)
}

impl Operations {
    /// Counts and ages per consumer and status, the stale PROCESSING rows, the last hour's
    /// failures and duplicates, and (given the consumer's parking lot) the broker's depths.
    pub async fn status(
        &self,
        query: &StatusQuery,
        broker: Option<&ParkingLot>,
    ) -> Result<StatusReport, OpsError> {
        let t = self.schema.qualify("message_inbox");
        let recent = RECENT.as_secs_f64();
        // Open rows: the partial index holds exactly these.
        let open = sqlx::query(sql(format!(
            "SELECT consumer_name, status, count(*) AS n, min(first_received_at) AS oldest, \
               extract(epoch FROM now() - min(first_received_at))::float8 AS age, \
               extract(epoch FROM max({overdue}))::float8 AS overdue, \
               count(*) FILTER (WHERE {stale}) AS stale, \
               count(*) FILTER (WHERE last_failed_at > now() - make_interval(secs => $3)) AS failed, \
               count(*) FILTER (WHERE last_conflict_at > now() - make_interval(secs => $3)) AS conflicts \
             FROM {t} WHERE status <> {PROCESSED} AND ($1::text IS NULL OR consumer_name = $1) \
             GROUP BY consumer_name, status ORDER BY consumer_name, status",
            stale = stale_processing("$2"),
            overdue = overdue_by("$4"),
        )))
        .bind(query.consumer.as_deref())
        .bind(query.stale_after.as_secs_f64())
        .bind(recent)
        .bind(
            query
                .retry_delays
                .iter()
                .map(Duration::as_secs_f64)
                .collect::<Vec<_>>(),
        )
        .fetch_all(&self.pool)
        .await?;
        let mut lines = Vec::with_capacity(open.len() + 1);
        for row in &open {
            lines.push(StatusLine {
                consumer: row.try_get("consumer_name")?,
                status: status_of(row)?,
                rows: Some(row.try_get("n")?),
                oldest_received_at: row.try_get("oldest")?,
                oldest_age_secs: row.try_get("age")?,
                overdue_age_secs: row
                    .try_get::<Option<f64>, _>("overdue")?
                    .filter(|secs| *secs > 0.0),
                stale: row.try_get("stale")?,
                failed_last_hour: row.try_get("failed")?,
                duplicates_last_hour: 0,
                conflicts_last_hour: row.try_get("conflicts")?,
                processed_last_hour: None,
            });
        }
        // Recently processed rows: the BRIN index on processed_at finds the recent block
        // ranges without reading the old ones.
        let processed = sqlx::query(sql(format!(
            "SELECT consumer_name, count(*) AS n, \
               count(*) FILTER (WHERE last_failed_at > now() - make_interval(secs => $2)) AS failed, \
               count(*) FILTER (WHERE last_conflict_at > now() - make_interval(secs => $2)) AS conflicts \
             FROM {t} WHERE status = {PROCESSED} AND processed_at > now() - make_interval(secs => $2) \
               AND ($1::text IS NULL OR consumer_name = $1) \
             GROUP BY consumer_name"
        )))
        .bind(query.consumer.as_deref())
        .bind(recent)
        .fetch_all(&self.pool)
        .await?;
        let mut processed_lines: Vec<StatusLine> = processed
            .iter()
            .map(|row| {
                Ok::<_, OpsError>(StatusLine {
                    consumer: row.try_get("consumer_name")?,
                    status: InboxStatus::Processed,
                    rows: None,
                    oldest_received_at: None,
                    oldest_age_secs: None,
                    overdue_age_secs: None,
                    stale: 0,
                    failed_last_hour: row.try_get("failed")?,
                    duplicates_last_hour: 0,
                    conflicts_last_hour: row.try_get("conflicts")?,
                    processed_last_hour: Some(row.try_get("n")?),
                })
            })
            .collect::<Result<_, _>>()?;
        if query.count_processed {
            let counts: Vec<(String, i64)> = sqlx::query_as(sql(format!(
                "SELECT consumer_name, count(*) FROM {t} WHERE status = {PROCESSED} \
                   AND ($1::text IS NULL OR consumer_name = $1) GROUP BY consumer_name"
            )))
            .bind(query.consumer.as_deref())
            .fetch_all(&self.pool)
            .await?;
            for (consumer, n) in counts {
                match processed_lines.iter_mut().find(|l| l.consumer == consumer) {
                    Some(line) => line.rows = Some(n),
                    None => processed_lines.push(StatusLine {
                        consumer,
                        status: InboxStatus::Processed,
                        rows: Some(n),
                        oldest_received_at: None,
                        oldest_age_secs: None,
                        overdue_age_secs: None,
                        stale: 0,
                        failed_last_hour: 0,
                        duplicates_last_hour: 0,
                        conflicts_last_hour: 0,
                        processed_last_hour: Some(0),
                    }),
                }
            }
        }
        lines.extend(processed_lines);
        // Duplicate deliveries, from the history the ledger's trigger writes for each one (a
        // delivery noted against a row that was not claimed for an attempt): read per consumer
        // through the history's (consumer, occurred_at) index, counted on the line of the
        // row's current status.
        let duplicates = sqlx::query(sql(format!(
            "WITH RECURSIVE {event_consumers} \
             SELECT c.consumer_name, i.status, sum(x.deliveries)::int8 AS dups \
             FROM event_consumers c CROSS JOIN LATERAL ( \
               SELECT e.message_id, e.deliveries FROM {e} e \
               WHERE e.consumer_name = c.consumer_name AND e.kind = 'duplicate' \
                 AND e.occurred_at > now() - make_interval(secs => $2)) AS x \
             JOIN {t} i ON i.consumer_name = c.consumer_name AND i.message_id = x.message_id \
             GROUP BY 1, 2",
            e = self.schema.qualify("inbox_event"),
            event_consumers = consumers_of(
                "event_consumers",
                &self.schema.qualify("inbox_event"),
                "",
                "$1"
            ),
        )))
        .persistent(false)
        .bind(query.consumer.as_deref())
        .bind(recent)
        .fetch_all(&self.pool)
        .await?;
        for row in &duplicates {
            let consumer: String = row.try_get("consumer_name")?;
            let status = status_of(row)?;
            let dups: i64 = row.try_get("dups")?;
            match lines
                .iter_mut()
                .find(|l| l.consumer == consumer && l.status == status)
            {
                Some(line) => line.duplicates_last_hour = dups,
                // Duplicates of messages processed before the last hour.
                None => lines.push(StatusLine {
                    consumer,
                    status,
                    rows: None,
                    oldest_received_at: None,
                    oldest_age_secs: None,
                    overdue_age_secs: None,
                    stale: 0,
                    failed_last_hour: 0,
                    duplicates_last_hour: dups,
                    conflicts_last_hour: 0,
                    processed_last_hour: (status == InboxStatus::Processed).then_some(0),
                }),
            }
        }
        lines.sort_by(|a, b| {
            (a.consumer.as_str(), a.status.as_str()).cmp(&(b.consumer.as_str(), b.status.as_str()))
        });
        let (at, estimated_total_rows): (DateTime<Utc>, i64) = sqlx::query_as(
            "SELECT now(), coalesce((SELECT reltuples::int8 FROM pg_class c \
               JOIN pg_namespace n ON n.oid = c.relnamespace \
               WHERE n.nspname = $1 AND c.relname = 'message_inbox'), -1)",
        )
        .bind(self.schema.as_str())
        .fetch_one(&self.pool)
        .await?;
        let broker = match broker {
            Some(lot) => Some(lot.depths().await?),
            None => None,
        };
        Ok(StatusReport {
            at,
            lines,
            estimated_total_rows,
            broker: broker.map(|(work, parking)| BrokerDepths { work, parking }),
        })
    }

    /// Rows matching `filter`, oldest first, one page at a time (keyset pagination on
    /// `(first_received_at, message_id, consumer_name)`: stable under inserts, no OFFSET).
    pub async fn list(&self, filter: &ListFilter) -> Result<ListPage, OpsError> {
        if !(1..=1000).contains(&filter.limit) {
            return Err(OpsError::Invalid("limit must be 1 to 1000".into()));
        }
        let statuses: Vec<&str> = if filter.statuses.is_empty() {
            OPEN_STATUSES.iter().map(|s| s.as_str()).collect()
        } else {
            filter.statuses.iter().map(|s| s.as_str()).collect()
        };
        let cursor = filter.cursor.as_deref().map(Cursor::decode).transpose()?;
        let after = cursor.as_ref().map(Cursor::received_at).transpose()?;
        let t = self.schema.qualify("message_inbox");
        // One statement for every combination of filters: an absent filter is a NULL
        // parameter, and the unnamed statement is planned with the values bound, so the
        // planner drops the NULL conditions and picks the index the rest allows.
        let rows = sqlx::query(sql(format!(
            "SELECT message_id, consumer_name, message_type, status, processing_attempt, \
               delivery_count, first_received_at, last_failed_at, last_error_code, \
               aggregate_type, aggregate_id, tenant_id \
             FROM {t} \
             WHERE status = ANY($1) \
               AND ($2::text IS NULL OR consumer_name = $2) \
               AND ($3::text IS NULL OR message_type = $3) \
               AND ($4::text IS NULL OR last_error_code = $4) \
               AND ($5::text IS NULL OR aggregate_type = $5) \
               AND ($6::text IS NULL OR aggregate_id = $6) \
               AND ($7::text IS NULL OR tenant_id = $7) \
               AND ($8::timestamptz IS NULL OR first_received_at >= $8) \
               AND ($9::timestamptz IS NULL OR first_received_at < $9) \
               AND ($10::timestamptz IS NULL \
                    OR (first_received_at, message_id, consumer_name) > ($10, $11, $12)) \
               AND ($14::text IS NULL OR message_id = $14) \
               AND ($15::text IS NULL OR correlation_id = $15) \
             ORDER BY first_received_at, message_id, consumer_name \
             LIMIT $13"
        )))
        .persistent(false)
        .bind(&statuses)
        .bind(filter.consumer.as_deref())
        .bind(filter.message_type.as_deref())
        .bind(filter.error_code.as_deref())
        .bind(filter.aggregate_type.as_deref())
        .bind(filter.aggregate_id.as_deref())
        .bind(filter.tenant.as_deref())
        .bind(filter.since)
        .bind(filter.until)
        .bind(after)
        .bind(cursor.as_ref().map(|c| c.m.as_str()))
        .bind(cursor.as_ref().map(|c| c.c.as_str()))
        .bind(i64::from(filter.limit) + 1)
        .bind(filter.message_id.as_deref())
        .bind(filter.correlation_id.as_deref())
        .fetch_all(&self.pool)
        .await?;
        let mut rows = rows
            .iter()
            .map(|row| {
                Ok(RowSummary {
                    message_id: row.try_get("message_id")?,
                    consumer_name: row.try_get("consumer_name")?,
                    message_type: row.try_get("message_type")?,
                    status: status_of(row)?,
                    processing_attempt: row.try_get("processing_attempt")?,
                    delivery_count: row.try_get("delivery_count")?,
                    first_received_at: row.try_get("first_received_at")?,
                    last_failed_at: row.try_get("last_failed_at")?,
                    last_error_code: row.try_get("last_error_code")?,
                    aggregate_type: row.try_get("aggregate_type")?,
                    aggregate_id: row.try_get("aggregate_id")?,
                    tenant_id: row.try_get("tenant_id")?,
                })
            })
            .collect::<Result<Vec<_>, OpsError>>()?;
        // One row more than the page was asked for: there is a next page.
        let next_cursor = if rows.len() > filter.limit as usize {
            rows.truncate(filter.limit as usize);
            rows.last().map(|last| {
                Cursor {
                    t: last.first_received_at.timestamp_micros(),
                    m: last.message_id.clone(),
                    c: last.consumer_name.clone(),
                }
                .encode()
            })
        } else {
            None
        };
        Ok(ListPage { rows, next_cursor })
    }

    /// A row's error message, opened with the keyring when it is sealed; otherwise what
    /// `last_error_message` shows, and why the sealed one stays closed.
    fn readable_error(&self, row: &PgRow) -> Result<(Option<String>, Option<String>), OpsError> {
        let shown: Option<String> = row.try_get("last_error_message")?;
        let sealed: Option<Vec<u8>> = row.try_get("last_error_sealed")?;
        let key_id: Option<String> = row.try_get("last_error_key_id")?;
        let (Some(sealed), Some(key_id)) = (sealed, key_id) else {
            return Ok((shown, None));
        };
        let consumer: String = row.try_get("consumer_name")?;
        let message_id: String = row.try_get("message_id")?;
        Ok(
            match open_error(
                self.keyring.as_deref(),
                &sealed,
                &key_id,
                &consumer,
                &message_id,
            ) {
                Ok(message) => (Some(message), None),
                Err(e) => (shown, Some(e.to_string())),
            },
        )
    }

    /// A row's stored headers, opened with the keyring when they are sealed.
    fn readable_headers(&self, row: &PgRow) -> Result<serde_json::Value, OpsError> {
        let stored: serde_json::Value = row.try_get("headers")?;
        let consumer: String = row.try_get("consumer_name")?;
        let message_id: String = row.try_get("message_id")?;
        Ok(
            match open_headers(self.keyring.as_deref(), &stored, &consumer, &message_id) {
                Ok(headers) => headers,
                Err(e) => serde_json::json!({ SEALED_HEADERS: e.to_string() }),
            },
        )
    }

    /// A row's stored payload, opened with the keyring when it is sealed.
    fn readable_payload(&self, row: &PgRow) -> Result<Option<Payload>, OpsError> {
        let Some(bytes) = row.try_get::<Option<Vec<u8>>, _>("payload")? else {
            return Ok(None);
        };
        let stored = StoredPayload {
            bytes,
            key_id: row.try_get("payload_key_id")?,
        };
        let consumer: String = row.try_get("consumer_name")?;
        let message_id: String = row.try_get("message_id")?;
        Ok(Some(
            match open_payload(self.keyring.as_deref(), &stored, &consumer, &message_id) {
                Ok(body) => Payload::of(body),
                Err(e) => Payload::Sealed {
                    key_id: stored.key_id.unwrap_or_default(),
                    reason: e.to_string(),
                },
            },
        ))
    }

    /// One message: its row for every consumer that has it (or one), its payload if kept,
    /// tombstones, the audit trail, and where it is on the broker.
    pub async fn show(&self, query: &ShowQuery) -> Result<ShowReport, OpsError> {
        let t = self.schema.qualify("message_inbox");
        let rows = sqlx::query(sql(format!(
            "SELECT * FROM {t} \
             WHERE message_id = $1 AND ($2::text IS NULL OR consumer_name = $2) \
             ORDER BY consumer_name"
        )))
        .persistent(false)
        .bind(&query.message_id)
        .bind(query.consumer.as_deref())
        .fetch_all(&self.pool)
        .await?;
        let rows = rows
            .iter()
            .map(|row| {
                let status = status_of(row)?;
                let attempt = row.try_get("processing_attempt")?;
                let error = self.readable_error(row)?;
                Ok(RowDetail {
                    message_id: row.try_get("message_id")?,
                    consumer_name: row.try_get("consumer_name")?,
                    message_type: row.try_get("message_type")?,
                    message_version: row.try_get("message_version")?,
                    status,
                    processing_attempt: attempt,
                    delivery_count: row.try_get("delivery_count")?,
                    first_received_at: row.try_get("first_received_at")?,
                    last_received_at: row.try_get("last_received_at")?,
                    processing_started_at: row.try_get("processing_started_at")?,
                    lease_owner: row.try_get("lease_owner")?,
                    lease_expires_at: row.try_get("lease_expires_at")?,
                    fencing_token: row.try_get("fencing_token")?,
                    processed_at: row.try_get("processed_at")?,
                    first_failed_at: row.try_get("first_failed_at")?,
                    last_failed_at: row.try_get("last_failed_at")?,
                    payload_sha256: hex::encode(row.try_get::<Vec<u8>, _>("payload_sha256")?),
                    payload_conflicts: row.try_get("payload_conflicts")?,
                    last_conflict_at: row.try_get("last_conflict_at")?,
                    parked_copy_at: row.try_get("parked_copy_at")?,
                    parked_duplicates: row.try_get("parked_duplicates")?,
                    retry_due_at: row.try_get("retry_due_at")?,
                    retry_duplicates: row.try_get("retry_duplicates")?,
                    last_error_code: row.try_get("last_error_code")?,
                    last_error_message: error.0,
                    last_error_sealed: error.1,
                    aggregate_type: row.try_get("aggregate_type")?,
                    aggregate_id: row.try_get("aggregate_id")?,
                    correlation_id: row.try_get("correlation_id")?,
                    causation_id: row.try_get("causation_id")?,
                    trace_id: row.try_get("trace_id")?,
                    tenant_id: row.try_get("tenant_id")?,
                    headers: self.readable_headers(row)?,
                    payload: self.readable_payload(row)?,
                    location: BrokerLocation::of(status, attempt, query.topology.as_ref()),
                })
            })
            .collect::<Result<Vec<_>, OpsError>>()?;
        let tombstones = sqlx::query(sql(format!(
            "SELECT * FROM {} WHERE message_id = $1 AND ($2::text IS NULL OR consumer_name = $2) \
             ORDER BY consumer_name",
            self.schema.qualify("inbox_tombstone")
        )))
        .persistent(false)
        .bind(&query.message_id)
        .bind(query.consumer.as_deref())
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(tombstone_from_row)
        .collect::<Result<Vec<_>, _>>()?;
        let audit = sqlx::query(sql(format!(
            "SELECT audit_id, occurred_at, actor, action, consumer_name, message_id, reason, \
               ticket, details, db_role FROM {} \
             WHERE message_id = $1 AND ($2::text IS NULL OR consumer_name = $2) \
             ORDER BY audit_id",
            self.schema.qualify("inbox_audit")
        )))
        .persistent(false)
        .bind(&query.message_id)
        .bind(query.consumer.as_deref())
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(audit_from_row)
        .collect::<Result<Vec<_>, _>>()?;
        Ok(ShowReport {
            message_id: query.message_id.clone(),
            rows,
            tombstones,
            audit,
        })
    }

    /// Records that `actor` read the payload, headers and error text of `message_id` for
    /// `consumer` (audit action [`PAYLOAD_READ`]); `details` say what was shown. Call it before
    /// handing the contents out, and withhold them if it fails.
    pub async fn audit_payload_read(
        &self,
        actor: &Actor,
        consumer: &str,
        message_id: &str,
        details: serde_json::Value,
    ) -> Result<i64, OpsError> {
        let mut conn = self.pool.acquire().await?;
        audit(
            &mut conn,
            &self.schema,
            actor,
            PAYLOAD_READ,
            Some(consumer),
            Some(message_id),
            details,
        )
        .await
    }

    /// Failed rows (retrying, permanently failed, poisoned) grouped by consumer, status,
    /// message type and error code, largest group first: what to fix first.
    pub async fn failure_groups(
        &self,
        consumer: Option<&str>,
    ) -> Result<Vec<FailureGroup>, OpsError> {
        let t = self.schema.qualify("message_inbox");
        let rows = sqlx::query(sql(format!(
            "SELECT consumer_name, status, message_type, last_error_code, count(*) AS n, \
               min(first_failed_at) AS first_failed, max(last_failed_at) AS last_failed, \
               (array_agg(message_id ORDER BY last_failed_at DESC NULLS LAST, message_id))[1] AS sample, \
               (array_agg(last_error_message ORDER BY last_failed_at DESC NULLS LAST, message_id))[1] AS sample_error \
             FROM {t} \
             WHERE status IN ({RETRYABLE_FAILED}, {PARKED}) \
               AND ($1::text IS NULL OR consumer_name = $1) \
             GROUP BY consumer_name, status, message_type, last_error_code \
             ORDER BY n DESC, consumer_name, status, message_type, last_error_code"
        )))
        .bind(consumer)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(FailureGroup {
                    consumer: row.try_get("consumer_name")?,
                    status: status_of(row)?,
                    message_type: row.try_get("message_type")?,
                    error_code: row.try_get("last_error_code")?,
                    rows: row.try_get("n")?,
                    first_failed_at: row.try_get("first_failed")?,
                    last_failed_at: row.try_get("last_failed")?,
                    sample_message_id: row.try_get("sample")?,
                    sample_error: row.try_get("sample_error")?,
                })
            })
            .collect()
    }
}

pub(super) fn tombstone_from_row(row: &PgRow) -> Result<Tombstone, StoreError> {
    Ok(Tombstone {
        message_id: row.try_get("message_id")?,
        consumer_name: row.try_get("consumer_name")?,
        payload_sha256: hex::encode(row.try_get::<Vec<u8>, _>("payload_sha256")?),
        final_status: row.try_get("final_status")?,
        message_type: row.try_get("message_type")?,
        first_received_at: row.try_get("first_received_at")?,
        processed_at: row.try_get("processed_at")?,
        removed_at: row.try_get("removed_at")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_round_trips_and_rejects_garbage() {
        let c = Cursor {
            t: 1_700_000_000_123_456,
            m: "order-1".into(),
            c: "svc".into(),
        };
        let text = c.encode();
        assert_eq!(Cursor::decode(&text).ok(), Some(c));
        assert!(Cursor::decode("not a cursor").is_err());
        let far = |t: i64| Cursor {
            t,
            m: "m".into(),
            c: "c".into(),
        };
        assert!(far(-210_866_803_200_000_000).received_at().is_ok());
        assert!(far(-210_866_803_200_000_001).received_at().is_err());
        assert!(far(i64::MAX).received_at().is_err());
        let nul = Cursor {
            t: 0,
            m: "a\0b".into(),
            c: "c".into(),
        };
        assert!(Cursor::decode(&nul.encode()).is_err());
        assert!(
            Cursor::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("{}")).is_err()
        );
    }

    #[test]
    fn payload_is_text_when_utf8() {
        assert_eq!(Payload::of(b"{}".to_vec()), Payload::Utf8("{}".into()));
        assert_eq!(Payload::of(vec![0xff, 0]), Payload::Base64("/wA=".into()));
    }

    #[test]
    fn location_follows_the_status() {
        let topo = (Topology::new("q"), RetryPolicy::default());
        let at = |s, a| BrokerLocation::of(s, a, Some(&topo));
        assert_eq!(at(InboxStatus::Processed, 1).place, "acked");
        assert_eq!(
            at(InboxStatus::RetryableFailed, 2).queue.as_deref(),
            Some("q.retry.5s")
        );
        assert_eq!(
            at(InboxStatus::Poisoned, 5).queue.as_deref(),
            Some("q.parking-lot")
        );
        assert_eq!(
            BrokerLocation::of(InboxStatus::PermanentFailed, 1, None).queue,
            None
        );
    }
}
