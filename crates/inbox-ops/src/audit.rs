//! The audit record every mutating operation (and every read of a stored payload) writes: the
//! one writer of `inbox_audit`; and its reader, [`Operations::audit_trail`].
//!
//! Rows go through the `SECURITY DEFINER` function of the action's family
//! ([`rabbit_inbox::roles::AuditWriter`]); the database stamps each with the writing session's role
//! (`db_role`) and its own clock (`occurred_at`), whatever the caller says, and refuses an
//! action the caller's role has no writer for.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{AssertSqlSafe, PgConnection, Row, postgres::PgRow};

use crate::{actor::Actor, error::OpsError, operations::Operations, sql::sql};
use rabbit_inbox::{error::StoreError, roles::AuditWriter, schema::SchemaName};

/// Audit action of a stored payload read through the admin server (read or admin token).
pub const PAYLOAD_READ: &str = "payload_read";

/// Writes one `inbox_audit` row on `conn` (inside the caller's transaction, with the change it
/// records) and returns its id. `action` is one of the library's actions (`reopen`,
/// `forced_replay`, `redrive`, `redrive_drop_processed`, `redrive_drop_redriven`,
/// `recover_republish`,
/// `recover_manual_review`, `cleanup`, `cleanup_forced`, [`PAYLOAD_READ`]); another is
/// [`OpsError::Invalid`], and one the connection's role may not record is refused by the
/// database (SQLSTATE 42501).
pub async fn audit(
    conn: &mut PgConnection,
    schema: &SchemaName,
    actor: &Actor,
    action: &str,
    consumer: Option<&str>,
    message_id: Option<&str>,
    details: Value,
) -> Result<i64, OpsError> {
    let writer = AuditWriter::for_action(action)
        .ok_or_else(|| OpsError::Invalid(format!("unknown audit action {action:?}")))?;
    Ok(sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT {}($1, $2, $3, $4, $5, $6, $7)",
        schema.qualify(writer.function())
    )))
    .persistent(false)
    .bind(action)
    .bind(actor.name())
    .bind(consumer)
    .bind(message_id)
    .bind(actor.reason())
    .bind(actor.ticket())
    .bind(details)
    .fetch_one(conn)
    .await?)
}

/// One `inbox_audit` row.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditEntry {
    /// Sequence number.
    pub audit_id: i64,
    /// When.
    pub occurred_at: DateTime<Utc>,
    /// Who.
    pub actor: String,
    /// What (`reopen`, `forced_replay`, `redrive`, ...).
    pub action: String,
    /// Consumer.
    pub consumer_name: Option<String>,
    /// Dedup key.
    pub message_id: Option<String>,
    /// Why.
    pub reason: String,
    /// Ticket.
    pub ticket: Option<String>,
    /// Specifics of the action.
    #[cfg_attr(feature = "openapi", schema(value_type = HashMap<String, serde_json::Value>))]
    pub details: serde_json::Value,
    /// The database role of the session that wrote the row (set by the database, not by the
    /// writer); `None` for rows written before the audit trail recorded it.
    pub db_role: Option<String>,
}

/// Which entries [`Operations::audit_trail`] returns. Empty filters match everything.
#[derive(Clone, Debug)]
pub struct AuditFilter {
    /// Only this actor's entries.
    pub actor: Option<String>,
    /// Only this action.
    pub action: Option<String>,
    /// Only this consumer's.
    pub consumer: Option<String>,
    /// Only entries written at or after.
    pub since: Option<DateTime<Utc>>,
    /// Only the entries of this job: the rows whose details carry it as `job` (a console's
    /// background redrive or discard stamps its id on each row it writes,
    /// [`crate::redrive::RedriveRequest::job`]).
    pub job: Option<String>,
    /// Most entries, 1 to 1000.
    pub limit: u32,
}

impl Default for AuditFilter {
    fn default() -> Self {
        Self {
            actor: None,
            action: None,
            consumer: None,
            since: None,
            job: None,
            limit: 200,
        }
    }
}

impl Operations {
    /// The audit trail, newest first, filtered: what an operator action (a bulk redrive, a
    /// replay) wrote, or what one actor did since an incident began.
    pub async fn audit_trail(&self, filter: &AuditFilter) -> Result<Vec<AuditEntry>, OpsError> {
        if !(1..=1000).contains(&filter.limit) {
            return Err(OpsError::Invalid("limit must be 1 to 1000".into()));
        }
        sqlx::query(sql(format!(
            "SELECT audit_id, occurred_at, actor, action, consumer_name, message_id, reason, \
               ticket, details, db_role FROM {} \
             WHERE ($1::text IS NULL OR actor = $1) AND ($2::text IS NULL OR action = $2) \
               AND ($3::text IS NULL OR consumer_name = $3) \
               AND ($4::timestamptz IS NULL OR occurred_at >= $4) \
               AND ($6::text IS NULL OR details ->> 'job' = $6) \
             ORDER BY audit_id DESC LIMIT $5",
            self.schema.qualify("inbox_audit")
        )))
        .persistent(false)
        .bind(filter.actor.as_deref())
        .bind(filter.action.as_deref())
        .bind(filter.consumer.as_deref())
        .bind(filter.since)
        .bind(i64::from(filter.limit))
        .bind(filter.job.as_deref())
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(audit_from_row)
        .collect::<Result<_, _>>()
        .map_err(OpsError::from)
    }
}

pub(crate) fn audit_from_row(row: &PgRow) -> Result<AuditEntry, StoreError> {
    Ok(AuditEntry {
        audit_id: row.try_get("audit_id")?,
        occurred_at: row.try_get("occurred_at")?,
        actor: row.try_get("actor")?,
        action: row.try_get("action")?,
        consumer_name: row.try_get("consumer_name")?,
        message_id: row.try_get("message_id")?,
        reason: row.try_get("reason")?,
        ticket: row.try_get("ticket")?,
        details: row.try_get("details")?,
        db_role: row.try_get("db_role")?,
    })
}
