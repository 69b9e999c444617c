//! A worker's lease on a row: its fencing token, the writes made under it, the heartbeat that
//! renews it, and the error when it was lost.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use futures::future::BoxFuture;
use sqlx::{Connection, PgConnection, PgPool};

use super::{config::LeaseConfig, sql::LeaseSql};
use crate::{handler::HandlerError, status::LEASE_LOST};

/// Why a fenced write did not commit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// The row is no longer this lease's: its lease expired and another worker (or recovery)
    /// took it over with a higher fencing token, or it was completed or set aside. Nothing of
    /// the refused write was committed.
    #[error(
        "lease on message {message_id} lost: fencing token {token} is no longer current (the \
         row now has token {current:?}, status {status:?}); the message was taken over and this \
         worker may not commit for it"
    )]
    Lost {
        /// The message.
        message_id: String,
        /// This lease's token.
        token: i64,
        /// The row's token now (`None` if the row is gone).
        current: Option<i64>,
        /// The row's status now.
        status: Option<String>,
    },
    /// The closure failed; its writes were rolled back.
    #[error(transparent)]
    Handler(HandlerError),
    /// The database failed; nothing was committed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl From<LeaseError> for HandlerError {
    fn from(e: LeaseError) -> Self {
        match e {
            lost @ LeaseError::Lost { .. } => HandlerError::retryable(LEASE_LOST, lost.to_string()),
            LeaseError::Handler(e) => e,
            LeaseError::Database(e) => HandlerError::from(e),
        }
    }
}

/// A worker's lease on one inbox row: its fencing token, and the guard through which it writes
/// while the token is current.
#[derive(Debug)]
pub struct Lease {
    pub(super) pool: PgPool,
    pub(super) sql: Arc<LeaseSql>,
    pub(super) consumer: String,
    pub(super) message_id: String,
    pub(super) owner: Arc<str>,
    pub(super) token: i64,
    pub(super) lost: AtomicBool,
}

impl Lease {
    /// The fencing token: grows by one on every claim of the row, so a higher token is always
    /// a later owner. Pass it to external systems that can refuse stale writers.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// This worker's name in `lease_owner`.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Whether a heartbeat has found the lease lost. A cheap early exit for long work; the
    /// fenced writes check the row itself whatever this says.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Relaxed)
    }

    /// Runs `f` in a transaction that commits only while this lease is the row's: the row is
    /// locked (`SELECT .. FOR UPDATE`) and its token and owner checked before `f` runs, so no
    /// takeover can come between the check and the commit. For intermediate writes
    /// (checkpoints a successor can read); the effect belongs in
    /// [`LeasedHandler::commit`](crate::LeasedHandler::commit).
    ///
    /// ```no_run
    /// # async fn step(lease: &rabbit_inbox::Lease) -> Result<(), rabbit_inbox::HandlerError> {
    /// lease
    ///     .fenced(|tx| {
    ///         Box::pin(async move {
    ///             sqlx::query("UPDATE jobs SET step = 2 WHERE id = 7").execute(&mut *tx).await?;
    ///             Ok(())
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn fenced<T, F>(&self, f: F) -> Result<T, LeaseError>
    where
        T: Send,
        F: for<'c> FnOnce(&'c mut PgConnection) -> BoxFuture<'c, Result<T, HandlerError>> + Send,
    {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let result = match self.check(&mut tx).await {
            Ok(_) => f(&mut tx).await.map_err(LeaseError::Handler),
            Err(e) => Err(e),
        };
        match result {
            Ok(value) => {
                tx.commit().await?;
                Ok(value)
            }
            Err(e) => {
                // Now, not lazily: the row stays locked until the rollback.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    /// Locks the row in the caller's transaction and checks that it is still this lease's.
    /// Returns the transaction's id (to check before committing that it is still the same).
    pub(crate) async fn check(&self, tx: &mut PgConnection) -> Result<i64, LeaseError> {
        let row = self.sql.lock(tx, &self.consumer, &self.message_id).await?;
        match row {
            Some(row) if row.is_held_by(self.token, &self.owner) => Ok(row.txid),
            other => {
                self.lost.store(true, Ordering::Relaxed);
                Err(self.lost_error(other.map(|r| (r.token, r.status))))
            }
        }
    }

    pub(super) fn lost_error(&self, row: Option<(Option<i64>, String)>) -> LeaseError {
        let (current, status) = match row {
            Some((token, status)) => (token, Some(status)),
            None => (None, None),
        };
        LeaseError::Lost {
            message_id: self.message_id.clone(),
            token: self.token,
            current,
            status,
        }
    }

    /// Extends the lease every `config.heartbeat`; returns once a renewal finds the lease
    /// gone. A renewal that fails (database unreachable) is retried at the next beat: the
    /// lease may expire meanwhile, and fencing keeps that safe.
    pub(crate) async fn keep_alive(&self, config: LeaseConfig) {
        let mut beat = tokio::time::interval(config.heartbeat);
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        beat.tick().await;
        loop {
            beat.tick().await;
            match self
                .sql
                .renew(
                    &self.pool,
                    &self.consumer,
                    &self.message_id,
                    self.token,
                    &self.owner,
                    config.ttl,
                )
                .await
            {
                Ok(true) => {}
                Ok(false) => {
                    self.lost.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        message_id = %self.message_id,
                        token = self.token,
                        "lease lost: the message was taken over; this worker's writes for it will be refused"
                    );
                    return;
                }
                Err(e) => {
                    tracing::warn!(message_id = %self.message_id, error = %e, "lease heartbeat failed; retrying at the next beat");
                }
            }
        }
    }
}

/// A name for this process's leases: host, process id and a random part, so two consumers in
/// one process (or a restarted one) never share an owner.
pub(crate) fn owner_name(consumer: &str) -> String {
    use std::hash::{BuildHasher, RandomState};
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".into());
    let nonce = RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now()));
    format!(
        "{consumer}@{host}:{}:{:08x}",
        std::process::id(),
        nonce as u32
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_lease_becomes_a_lease_lost_handler_error() {
        let e: HandlerError = LeaseError::Lost {
            message_id: "m".into(),
            token: 1,
            current: Some(2),
            status: Some("PROCESSING".into()),
        }
        .into();
        assert_eq!(e.code(), LEASE_LOST);
        assert!(e.message().contains("token 1"), "{}", e.message());
    }
}
