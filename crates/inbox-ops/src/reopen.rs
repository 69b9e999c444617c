//! Audited reopen and forced replay of one inbox row.
//!
//! Reopening moves a failed row (or one set aside for manual review) to RETRYABLE_FAILED with
//! its attempt count reset, so the next delivery of the message runs the handler with the full
//! retry budget (a fix was deployed; the earlier attempts are kept in the audit details). The row itself stays: its first
//! receipt, failure times, error and hash are the evidence. A PROCESSED row is reopened only
//! as a forced replay, which makes the next delivery apply the effect again.

use serde::Serialize;
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, PgConnection, Row};

use crate::{actor::Actor, audit::audit, error::OpsError, operations::Operations};
use rabbit_inbox::{ledger_sql::RETRYABLE_FAILED, schema::SchemaName, status::InboxStatus};

/// Audit action of a reopened failed row.
pub const REOPEN: &str = "reopen";
/// Audit action of a replay that applies an effect again (a PROCESSED row reopened, or a
/// message whose row retention removed republished).
pub const FORCED_REPLAY: &str = "forced_replay";

/// What [`Operations::reopen`] did.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Reopened {
    /// Dedup key.
    pub message_id: String,
    /// Consumer.
    pub consumer: String,
    /// Status before (now RETRYABLE_FAILED).
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub previous_status: InboxStatus,
    /// Attempts before (now 0).
    pub previous_attempts: i32,
    /// `reopen` or `forced_replay`.
    pub action: &'static str,
    /// The audit row written.
    pub audit_id: i64,
}

/// Reopens one row on `conn`, in the caller's transaction (the row stays locked until it
/// ends). `details` are added to the audit record.
pub(super) async fn reopen_row(
    conn: &mut PgConnection,
    schema: &SchemaName,
    message_id: &str,
    consumer: &str,
    actor: &Actor,
    force_replay: bool,
    details: Value,
) -> Result<Reopened, OpsError> {
    let t = schema.qualify("message_inbox");
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT status, processing_attempt, last_error_code FROM {t} \
         WHERE consumer_name = $1 AND message_id = $2 FOR UPDATE"
    )))
    .persistent(false)
    .bind(consumer)
    .bind(message_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = row else {
        let removed: Option<chrono::DateTime<chrono::Utc>> =
            sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT removed_at FROM {} WHERE consumer_name = $1 AND message_id = $2",
                schema.qualify("inbox_tombstone")
            )))
            .bind(consumer)
            .bind(message_id)
            .fetch_optional(&mut *conn)
            .await?;
        return Err(match removed {
            Some(at) => OpsError::Refused(format!(
                "retention removed the row of {message_id} for {consumer} on {at}; its tombstone \
                 says it was seen, so a replay would apply its effect again. There is no row to \
                 reopen: republish the message and redrive it with --force, giving an actor \
                 and a reason"
            )),
            None => OpsError::NotFound(format!(
                "no inbox row for {message_id} and consumer {consumer}"
            )),
        });
    };
    let status: InboxStatus = row.try_get::<String, _>("status")?.parse()?;
    let attempts: i32 = row.try_get("processing_attempt")?;
    let error_code: Option<String> = row.try_get("last_error_code")?;
    let action = match status {
        InboxStatus::Processing => {
            return Err(OpsError::Refused(format!(
                "{message_id} is being processed (PROCESSING); a stale one is recovered, not \
                 reopened"
            )));
        }
        InboxStatus::Processed if !force_replay => {
            return Err(OpsError::Refused(format!(
                "{message_id} is PROCESSED: reopening it runs its effect a second time; pass \
                 --force-replay if that is intended"
            )));
        }
        InboxStatus::Processed => FORCED_REPLAY,
        InboxStatus::RetryableFailed
        | InboxStatus::PermanentFailed
        | InboxStatus::Poisoned
        | InboxStatus::ManualReview => REOPEN,
        InboxStatus::Held => {
            return Err(OpsError::Refused(format!(
                "{message_id} is HELD behind an earlier message of its ordering key and runs \
                 when its turn comes; see `inboxctl ordering blocked` for what the key waits \
                 for, and resolve or skip that head instead"
            )));
        }
        other => {
            return Err(OpsError::Refused(format!(
                "{message_id} has status {other}, which this version cannot reopen"
            )));
        }
    };
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {t} SET status = {RETRYABLE_FAILED}, processing_attempt = 0, \
           discarded_at = NULL \
         WHERE consumer_name = $1 AND message_id = $2"
    )))
    .persistent(false)
    .bind(consumer)
    .bind(message_id)
    .execute(&mut *conn)
    .await?;
    let mut all = json!({
        "previous_status": status,
        "previous_attempts": attempts,
        "last_error_code": error_code,
    });
    if let (Some(all), Value::Object(extra)) = (all.as_object_mut(), details) {
        all.extend(extra);
    }
    let audit_id = audit(
        conn,
        schema,
        actor,
        action,
        Some(consumer),
        Some(message_id),
        all,
    )
    .await?;
    Ok(Reopened {
        message_id: message_id.to_owned(),
        consumer: consumer.to_owned(),
        previous_status: status,
        previous_attempts: attempts,
        action,
        audit_id,
    })
}

impl Operations {
    /// Reopens a failed row (RETRYABLE_FAILED, PERMANENT_FAILED, POISONED, MANUAL_REVIEW) so
    /// that the next delivery of its message runs the handler again, with the attempt count
    /// reset; audited.
    /// A PROCESSED row is refused unless `force_replay` (audited as `forced_replay`: the next
    /// delivery applies the effect again); a PROCESSING row is refused; a row retention removed
    /// is refused with what its tombstone says. The row is never deleted.
    ///
    /// Reopening changes the row only. A parked message then still has to come back:
    /// `redrive` moves it (its row is already open). A reopened row whose message is nowhere
    /// (a PROCESSED one, long acked) waits for a republish, and counts as a lost retry until
    /// then.
    pub async fn reopen(
        &self,
        message_id: &str,
        consumer: &str,
        actor: &Actor,
        force_replay: bool,
    ) -> Result<Reopened, OpsError> {
        let mut tx = self.pool.begin().await?;
        let reopened = reopen_row(
            &mut tx,
            &self.schema,
            message_id,
            consumer,
            actor,
            force_replay,
            json!({}),
        )
        .await?;
        tx.commit().await?;
        Ok(reopened)
    }
}
