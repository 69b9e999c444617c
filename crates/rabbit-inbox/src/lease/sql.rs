//! The statements of leased processing, built once per schema. Each one that changes a row
//! names the fencing token (and owner) it acts under, so a stale worker's statement matches
//! nothing.

use std::time::Duration;

use sqlx::{PgConnection, PgPool, Row, SqlStr};

use crate::{
    error::StoreError,
    ledger_sql::{
        POISONED, PROCESSED, PROCESSING, RETRYABLE_FAILED, audited, stale_processing, tables,
    },
    privacy::StoredError,
    schema::SchemaName,
    status::InboxStatus,
    store::storable,
};

#[derive(Debug)]
pub(crate) struct LeaseSql {
    take: SqlStr,
    renew: SqlStr,
    lock: SqlStr,
    complete: SqlStr,
    fail: SqlStr,
}

/// The row as a fenced write finds it.
pub(crate) struct LockedRow {
    pub(crate) token: Option<i64>,
    pub(crate) owner: Option<String>,
    pub(crate) status: String,
    pub(crate) txid: i64,
}

impl LockedRow {
    pub(crate) fn is_held_by(&self, token: i64, owner: &str) -> bool {
        self.token == Some(token)
            && self.owner.as_deref() == Some(owner)
            && self.status == InboxStatus::Processing.as_str()
    }
}

/// The fencing condition every write of a lease holder carries.
fn held() -> String {
    format!(
        "consumer_name = $1 AND message_id = $2 AND fencing_token = $3 \
         AND lease_owner = $4 AND status = {PROCESSING}"
    )
}

impl LeaseSql {
    pub(crate) fn new(schema: &SchemaName) -> Self {
        let t = schema.qualify(tables::MESSAGE_INBOX);
        let held = held();
        Self {
            // A new row (inserted by this transaction: $5), a RETRYABLE_FAILED one, or a
            // PROCESSING one whose lease expired (or that has no lease and is older than the
            // stale threshold $6): this worker's now, under the next token.
            take: audited(format!(
                "UPDATE {t} SET status = {PROCESSING}, \
                   processing_attempt = processing_attempt + CASE WHEN $5 THEN 0 ELSE 1 END, \
                   processing_started_at = now(), last_received_at = now(), \
                   lease_owner = $3, lease_expires_at = now() + make_interval(secs => $4), \
                   fencing_token = coalesce(fencing_token, 0) + 1 \
                 WHERE consumer_name = $1 AND message_id = $2 \
                   AND ($5 OR status = {RETRYABLE_FAILED} OR {stale}) \
                 RETURNING processing_attempt, fencing_token",
                stale = stale_processing("$6"),
            )),
            renew: audited(format!(
                "UPDATE {t} SET lease_expires_at = now() + make_interval(secs => $5) WHERE {held}"
            )),
            lock: audited(format!(
                "SELECT fencing_token, lease_owner, status, txid_current() AS txid FROM {t} \
                 WHERE consumer_name = $1 AND message_id = $2 FOR UPDATE"
            )),
            complete: audited(format!(
                "UPDATE {t} SET status = {PROCESSED}, processed_at = now(), \
                   lease_owner = NULL, lease_expires_at = NULL, \
                   payload = CASE WHEN $5 THEN payload ELSE NULL END \
                 WHERE {held}"
            )),
            // The claim counted the attempt already, so the budget is spent when the attempt
            // number reaches it.
            fail: audited(format!(
                "UPDATE {t} SET \
                   status = CASE WHEN $5 = {RETRYABLE_FAILED} AND processing_attempt >= $8 \
                            THEN {POISONED} ELSE $5 END, \
                   first_failed_at = coalesce(first_failed_at, now()), last_failed_at = now(), \
                   last_error_code = $6, last_error_message = $7, last_error_safe = $10, \
                   last_error_sealed = $11, last_error_key_id = $12, \
                   lease_owner = NULL, lease_expires_at = NULL, \
                   payload = CASE WHEN $9 THEN payload ELSE NULL END \
                 WHERE {held} \
                 RETURNING status, processing_attempt"
            )),
        }
    }

    /// Takes the row for `owner` under the next fencing token, if it may be taken; returns the
    /// attempt number and the token. `fresh`: the caller's transaction has just inserted it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn take(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: &str,
        owner: &str,
        ttl: Duration,
        fresh: bool,
        stale_after: Duration,
    ) -> Result<Option<(i32, i64)>, StoreError> {
        Ok(sqlx::query_as(self.take.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_id)
            .bind(owner)
            .bind(ttl.as_secs_f64())
            .bind(fresh)
            .bind(stale_after.as_secs_f64())
            .fetch_optional(conn)
            .await?)
    }

    /// Extends a held lease by `ttl` from now; false when the lease is no longer held.
    pub(crate) async fn renew(
        &self,
        pool: &PgPool,
        consumer: &str,
        message_id: &str,
        token: i64,
        owner: &str,
        ttl: Duration,
    ) -> Result<bool, sqlx::Error> {
        let renewed = sqlx::query(self.renew.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_id)
            .bind(token)
            .bind(owner)
            .bind(ttl.as_secs_f64())
            .execute(pool)
            .await?
            .rows_affected();
        Ok(renewed == 1)
    }

    /// Locks the row (`FOR UPDATE`) in the caller's transaction and reads its lease.
    pub(crate) async fn lock(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<Option<LockedRow>, sqlx::Error> {
        let row = sqlx::query(self.lock.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_id)
            .fetch_optional(conn)
            .await?;
        row.map(|r| {
            Ok(LockedRow {
                token: r.try_get("fencing_token")?,
                owner: r.try_get("lease_owner")?,
                status: r.try_get("status")?,
                txid: r.try_get("txid")?,
            })
        })
        .transpose()
    }

    /// Marks a held row PROCESSED in the caller's transaction; false when it is not held.
    pub(crate) async fn complete(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: &str,
        token: i64,
        owner: &str,
        keep_payload: bool,
    ) -> Result<bool, sqlx::Error> {
        let marked = sqlx::query(self.complete.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_id)
            .bind(token)
            .bind(owner)
            .bind(keep_payload)
            .execute(conn)
            .await?
            .rows_affected();
        Ok(marked == 1)
    }

    /// Records a failure of a held row (RETRYABLE_FAILED, escalated to POISONED when the
    /// budget is spent, or PERMANENT_FAILED) and releases the lease. `None` when the row is
    /// not held.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn fail(
        &self,
        pool: &PgPool,
        consumer: &str,
        message_id: &str,
        token: i64,
        owner: &str,
        status: InboxStatus,
        code: &str,
        error: &StoredError,
        max_attempts: i32,
        keep_payload: bool,
    ) -> Result<Option<(InboxStatus, i32)>, StoreError> {
        let row = sqlx::query(self.fail.clone())
            .persistent(false)
            .bind(consumer)
            .bind(message_id)
            .bind(token)
            .bind(owner)
            .bind(status.as_str())
            .bind(storable(code))
            .bind(&error.message)
            .bind(max_attempts)
            .bind(keep_payload)
            .bind(error.safe.as_deref())
            .bind(error.sealed.as_deref())
            .bind(error.key_id.as_deref())
            .fetch_optional(pool)
            .await?;
        row.map(|r| {
            let status: String = r.try_get("status")?;
            Ok((status.parse()?, r.try_get("processing_attempt")?))
        })
        .transpose()
    }
}
