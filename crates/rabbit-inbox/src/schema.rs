//! The inbox schema: a validated PostgreSQL schema name and the embedded migrations.

use std::{
    fmt,
    time::{Duration, Instant},
};

use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool, migrate::Migrator};

use crate::error::{ConfigError, StoreError};

/// The inbox's migrations. One static serves every schema: the SQL uses unqualified names and
/// [`migrate`] runs it with `search_path` set to the target schema.
pub static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// Name of the migrations table, created inside the inbox schema so the library never touches
/// an application's own `_sqlx_migrations`.
const MIGRATIONS_TABLE: &str = "_rabbit_inbox_migrations";

/// A PostgreSQL schema name that is safe to splice into SQL.
///
/// Configuration text never reaches SQL unvalidated: only lowercase ASCII letters, digits and
/// `_`, starting with a letter or `_`, at most 63 bytes (PostgreSQL's identifier limit).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SchemaName(String);

impl SchemaName {
    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<Self, ConfigError> {
        let name = name.into();
        let mut chars = name.chars();
        let valid_start = chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        let valid_rest = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !valid_start || !valid_rest || name.len() > 63 || name.starts_with("pg_") {
            return Err(ConfigError::InvalidSchemaName(name));
        }
        Ok(Self(name))
    }

    /// The bare name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `"schema"."table"`, for building SQL.
    pub(crate) fn qualify(&self, table: &str) -> String {
        format!("\"{}\".\"{table}\"", self.0)
    }
}

impl Default for SchemaName {
    fn default() -> Self {
        Self("rabbit_inbox".to_owned())
    }
}

impl fmt::Display for SchemaName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How often an instance asks again for a [`SchemaLock`] another instance holds.
const LOCK_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// After how long a wait for a [`SchemaLock`] is logged, once.
const LOCK_WAIT_NOTICE: Duration = Duration::from_secs(10);

/// Exclusive right to change one schema's DDL: a PostgreSQL session advisory lock keyed by the
/// schema name, held on a connection of its own.
///
/// Every instance of a service creates its schema and runs its migrations at start, and a
/// rolling deploy starts several at once. `CREATE SCHEMA IF NOT EXISTS` and `CREATE TABLE IF
/// NOT EXISTS` are not safe against each other (the loser fails on a catalog unique index), so
/// the library's [`migrate`] and an application's own DDL in the same schema run under this
/// lock, one instance after the other.
///
/// The lock is a session lock, not a transaction lock, so the connection stays outside any
/// transaction and can run `CREATE INDEX CONCURRENTLY` (a `-- no-transaction` migration).
/// Waiters poll with `pg_try_advisory_lock` instead of blocking in `pg_advisory_lock`: a
/// concurrent index build waits for every transaction that is running when it starts,
/// including a blocked `pg_advisory_lock` call, which in turn waits for the builder's lock, and
/// PostgreSQL resolves that deadlock by aborting one of them.
///
/// [`release`](Self::release) unlocks and closes the connection. Dropped without it (an error
/// path), the connection is closed and the server releases the lock with the session.
#[derive(Debug)]
pub struct SchemaLock {
    conn: PgConnection,
    key: i64,
}

impl SchemaLock {
    /// Waits until no other session holds the lock of `schema`, then takes it, on a
    /// connection detached from `pool`.
    pub async fn acquire(pool: &PgPool, schema: &SchemaName) -> Result<Self, StoreError> {
        let mut conn = pool.acquire().await?.detach();
        let key = lock_key(schema);
        let started = Instant::now();
        let mut noticed = false;
        loop {
            let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(key)
                .fetch_one(&mut conn)
                .await?;
            if locked {
                return Ok(Self { conn, key });
            }
            if !noticed && started.elapsed() >= LOCK_WAIT_NOTICE {
                noticed = true;
                tracing::warn!(
                    schema = %schema,
                    "still waiting for another instance to finish migrating the schema"
                );
            }
            tokio::time::sleep(LOCK_POLL_INTERVAL).await;
        }
    }

    /// The connection that holds the lock. Session settings made on it (`search_path`) end
    /// with it: it never returns to the pool.
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

/// The advisory lock key of `schema`: the first 8 bytes of a SHA-256 over a fixed prefix and
/// the name, the same in every process and every version.
fn lock_key(schema: &SchemaName) -> i64 {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(format!("rabbit-inbox schema lock\0{schema}"));
    let mut key = [0u8; 8];
    key.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(key)
}

/// Creates `schema` if needed and applies the inbox migrations inside it.
///
/// Safe to call from any number of processes at once: schema creation and migrations run under
/// the schema's [`SchemaLock`].
pub async fn migrate(pool: &PgPool, schema: &SchemaName) -> Result<(), StoreError> {
    let mut lock = SchemaLock::acquire(pool, schema).await?;
    let applied = apply_migrations(lock.connection(), schema).await;
    // Released on both paths; an error of the migration comes first.
    let released = lock.release().await;
    applied?;
    released
}

/// The migrations, on the lock's connection.
async fn apply_migrations(conn: &mut PgConnection, schema: &SchemaName) -> Result<(), StoreError> {
    // The schema name is validated by `SchemaName`.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\"; SET search_path TO \"{schema}\""
    )))
    .execute(&mut *conn)
    .await?;
    let mut migrator = Migrator {
        migrations: MIGRATOR.migrations.clone(),
        ..Migrator::DEFAULT
    };
    migrator.dangerous_set_table_name(schema.qualify(MIGRATIONS_TABLE));
    // The schema lock serializes the migrations. sqlx's own lock is one per database, shared
    // with every other schema and with the application's migrator, and a session blocked on it
    // would deadlock with a concurrent index build.
    migrator.set_locking(false);
    // `run_direct` rather than `run`: `run` over `&mut PgConnection` makes this future not
    // `Send` (sqlx's `Acquire` lifetime limitation), and callers spawn their start-up.
    migrator.run_direct(None, conn, false).await?;
    Ok(())
}

/// Drops `schema` and everything in it. For tests and demos that own their schema. Waits for
/// a migration of the schema in progress to finish.
pub async fn drop_schema(pool: &PgPool, schema: &SchemaName) -> Result<(), StoreError> {
    let mut lock = SchemaLock::acquire(pool, schema).await?;
    let dropped = sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(lock.connection())
    .await;
    let released = lock.release().await;
    dropped?;
    released
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers() {
        for ok in ["rabbit_inbox", "_x", "svc1_inbox", &"a".repeat(63)] {
            assert!(SchemaName::new(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_anything_that_could_escape_an_identifier() {
        for bad in [
            "",
            "Inbox",
            "1abc",
            "a-b",
            "a\"; DROP TABLE x; --",
            "pg_catalog",
            "a b",
            &"a".repeat(64),
        ] {
            assert!(SchemaName::new(bad).is_err(), "{bad:?}");
        }
    }
}
