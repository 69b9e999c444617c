//! The audit record every mutating operation (and every read of a stored payload) writes: the
//! one writer of `inbox_audit`.
//!
//! Rows go through the `SECURITY DEFINER` function of the action's family
//! ([`rabbit_inbox::roles::AuditWriter`]); the database stamps each with the writing session's role
//! (`db_role`) and its own clock (`occurred_at`), whatever the caller says, and refuses an
//! action the caller's role has no writer for.

use serde_json::Value;
use sqlx::{AssertSqlSafe, PgConnection};

use super::{Actor, OpsError};
use rabbit_inbox::{roles::AuditWriter, schema::SchemaName};

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
