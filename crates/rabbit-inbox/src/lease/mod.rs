//! Leased processing, for handlers whose work cannot live inside one database transaction
//! (long work, calls to external systems).
//!
//! ```text
//! claim tx:  row -> PROCESSING, lease_owner = me, lease_expires_at = now() + ttl,
//!            fencing_token + 1 (1 for a new row); commit. The delivery stays unacked.
//! work:      LeasedHandler::work, outside any transaction; a heartbeat extends the lease
//!            every `heartbeat` while it runs. Checkpoints go through Lease::fenced.
//! commit tx: lock the row, check token and owner are still mine, LeasedHandler::commit
//!            (the effect), mark PROCESSED; commit. Then ack.
//! ```
//!
//! A worker that stopped heartbeating (paused, partitioned) for longer than the TTL may be
//! taken over: a redelivery, or recovery's republished copy, claims the row again with a
//! higher token. From then on everything the old worker tries (a heartbeat, a fenced write,
//! its completion, its failure record) is refused with [`LeaseError::Lost`], and its delivery
//! is settled by the row as it then is: acked as a duplicate once the successor has processed
//! it, parked if the row is parked, otherwise sent to the first retry tier like any copy of a
//! message in flight elsewhere, to meet the successor's outcome later. It is never acked as
//! processed on its own say-so.
//!
//! **Invariant:** a PROCESSED row and the effect written in its completion transaction commit
//! together and only under the row's current fencing token; a lease that has not expired is
//! never taken over.

mod processor;
mod sql;

use std::{
    future::Future,
    marker::PhantomData,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures::future::BoxFuture;
use sqlx::{Connection, PgConnection, PgPool};

pub(crate) use processor::LeasedProcessor;
use sql::LeaseSql;

use crate::{
    error::ConfigError,
    handler::{HandlerError, InboxMessage},
    status::LEASE_LOST,
};

/// Timing of leased processing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// How long a claim stays the worker's without a heartbeat. A worker silent for longer
    /// may be taken over.
    pub ttl: Duration,
    /// How often the worker extends its lease while the handler runs. At most a third of
    /// `ttl`, so that a live worker renews at least twice before its lease could expire.
    pub heartbeat: Duration,
}

impl Default for LeaseConfig {
    /// 60 s leases, renewed every 10 s.
    fn default() -> Self {
        Self::new(Duration::from_secs(60))
    }
}

impl LeaseConfig {
    /// Leases of `ttl`, renewed every sixth of it.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            heartbeat: ttl / 6,
        }
    }

    /// Checks the timing; [`crate::Consumer::leased`] calls this.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |name, reason: &str| {
            Err(ConfigError::InvalidSetting {
                name,
                reason: reason.to_owned(),
            })
        };
        if self.ttl < Duration::from_millis(100) || self.ttl > Duration::from_secs(86_400) {
            return invalid("lease.ttl", "must be between 100 ms and 24 h");
        }
        if self.heartbeat.is_zero() || self.heartbeat.saturating_mul(3) > self.ttl {
            return invalid(
                "lease.heartbeat",
                "must be positive and at most a third of lease.ttl, so a live worker renews its \
                 lease at least twice before it could expire",
            );
        }
        Ok(())
    }
}

/// The type parameter of a [`crate::Consumer`] in leased mode.
#[derive(Debug)]
pub struct Leased<L>(PhantomData<L>);

/// Application logic in leased mode: long work outside any transaction, then the effect in a
/// short transaction that commits only while the lease is still this worker's.
///
/// The work may run again (after a crash, or when a paused worker's lease was taken over), so
/// external calls in it must be idempotent: use [`InboxMessage::idempotency_key`], and pass
/// [`Lease::token`] to systems that can refuse stale writers. The effect belongs in
/// [`LeasedHandler::commit`]: it commits together with PROCESSED, once.
///
/// ```no_run
/// use rabbit_inbox::{HandlerError, InboxMessage, Lease, LeasedHandler};
/// use sqlx::PgConnection;
///
/// struct Render;
///
/// impl LeasedHandler for Render {
///     type Output = String;
///
///     async fn work(&self, msg: &InboxMessage<'_>, lease: &Lease) -> Result<String, HandlerError> {
///         // A slow external call, keyed by msg.idempotency_key(), fenced by lease.token().
///         Ok(format!("document {} (token {})", msg.message_id(), lease.token()))
///     }
///
///     async fn commit(
///         &self,
///         msg: &InboxMessage<'_>,
///         doc: String,
///         tx: &mut PgConnection,
///     ) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO documents (id, body) VALUES ($1, $2)")
///             .bind(msg.message_id())
///             .bind(doc)
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     }
/// }
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let config = rabbit_inbox::ConsumerConfig::new("renderer", rabbit_inbox::Topology::new("renders"));
/// let lease = rabbit_inbox::LeaseConfig::new(std::time::Duration::from_secs(60));
/// let consumer = rabbit_inbox::Consumer::leased("amqp://127.0.0.1", pool, config, lease, Render)?;
/// consumer.run(rabbit_inbox::shutdown_signal()).await?;
/// # Ok(()) }
/// ```
pub trait LeasedHandler: Send + Sync + 'static {
    /// What the work hands to the commit.
    type Output: Send;

    /// The long part, outside any transaction, while the consumer heartbeats the lease.
    /// Intermediate database writes go through [`Lease::fenced`]; return `Err` to record a
    /// failure (retryable ones go through the retry tiers as in the transactional mode).
    fn work(
        &self,
        msg: &InboxMessage<'_>,
        lease: &Lease,
    ) -> impl Future<Output = Result<Self::Output, HandlerError>> + Send;

    /// The effect, in the completion transaction: the row is locked and the lease checked
    /// before this runs, and PROCESSED is written after it in the same transaction.
    fn commit(
        &self,
        msg: &InboxMessage<'_>,
        output: Self::Output,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

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
    pool: PgPool,
    sql: Arc<LeaseSql>,
    consumer: String,
    message_id: String,
    owner: Arc<str>,
    token: i64,
    lost: AtomicBool,
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
    /// (checkpoints a successor can read); the effect belongs in [`LeasedHandler::commit`].
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

    fn lost_error(&self, row: Option<(Option<i64>, String)>) -> LeaseError {
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
    fn heartbeat_must_be_well_shorter_than_the_ttl() {
        assert!(LeaseConfig::default().validate().is_ok());
        assert!(LeaseConfig::new(Duration::from_secs(1)).validate().is_ok());
        let slow = LeaseConfig {
            ttl: Duration::from_secs(10),
            heartbeat: Duration::from_secs(4),
        };
        let err = slow.validate().expect_err("heartbeat over ttl / 3");
        assert!(err.to_string().contains("lease.heartbeat"), "{err}");
        assert!(
            LeaseConfig::new(Duration::from_millis(10))
                .validate()
                .is_err()
        );
    }

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
