//! PostgreSQL session advisory locks held on a connection of their own, and the one way their
//! keys are derived. Used for the schema's DDL ([`crate::schema::SchemaLock`]) and by the
//! operator crate for passes over a parking lot.

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};
use tokio::time::Instant;

use crate::error::StoreError;

/// How often a waiter asks again for a lock another session holds.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// After how long a wait is logged, once.
const WAIT_NOTICE: Duration = Duration::from_secs(10);

/// The advisory lock key of `parts`: the first 8 bytes of a SHA-256 over the parts joined by
/// NUL, the same in every process and every version. The first part names what is locked, so
/// keys of different kinds do not meet.
pub fn key(parts: &[&str]) -> i64 {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(parts.join("\0"));
    let mut key = [0u8; 8];
    key.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(key)
}

/// A session advisory lock on a connection detached from its pool.
///
/// Waiters poll with `pg_try_advisory_lock` instead of blocking in `pg_advisory_lock`: a
/// waiter whose future is dropped leaves no lock request behind, and a concurrent index build
/// (which waits for every running transaction, a blocked `pg_advisory_lock` call included)
/// cannot deadlock with it. [`release`](Self::release) unlocks and closes the connection;
/// dropped without it (an error path), the connection is closed and the server releases the
/// lock with the session.
#[derive(Debug)]
pub struct SessionLock {
    conn: PgConnection,
    key: i64,
}

impl SessionLock {
    /// Takes the lock `key` once no other session holds it. With `patience`, gives up after
    /// that long (`None`). `waiting` is logged once if the wait lasts.
    pub async fn acquire(
        pool: &PgPool,
        key: i64,
        patience: Option<Duration>,
        waiting: impl FnOnce(),
    ) -> Result<Option<Self>, StoreError> {
        let mut conn = pool.acquire().await?.detach();
        let started = Instant::now();
        let mut waiting = Some(waiting);
        loop {
            let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(key)
                .fetch_one(&mut conn)
                .await?;
            if locked {
                return Ok(Some(Self { conn, key }));
            }
            if patience.is_some_and(|p| started.elapsed() >= p) {
                let _ = conn.close().await;
                return Ok(None);
            }
            if started.elapsed() >= WAIT_NOTICE
                && let Some(notice) = waiting.take()
            {
                notice();
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// The connection that holds the lock. Session settings made on it end with it: it never
    /// returns to the pool.
    pub fn connection(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// Unlocks and closes the connection.
    pub async fn release(mut self) -> Result<(), StoreError> {
        let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(self.key)
            .execute(&mut self.conn)
            .await;
        // Closing ends the session, which releases the lock even if the unlock failed.
        let closed = self.conn.close().await;
        unlocked?;
        closed?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_stable_and_kinds_do_not_meet() {
        // The schema lock's key must not change between versions: instances of two versions
        // migrate one after the other during a rolling deploy.
        assert_eq!(
            key(&["rabbit-inbox schema lock", "orders"]),
            key(&["rabbit-inbox schema lock\0orders"])
        );
        assert_ne!(
            key(&["rabbit-inbox schema lock", "orders"]),
            key(&["rabbit-inbox parking lot", "orders"])
        );
    }
}
