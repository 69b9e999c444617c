//! The inbox schema: a validated PostgreSQL schema name and the embedded migrations.

use std::{fmt, sync::LazyLock};

use sqlx::{
    AssertSqlSafe, PgConnection, PgPool, SqlSafeStr,
    migrate::{Migration, MigrationType, Migrator},
};

use crate::{
    advisory_lock::{self, SessionLock},
    error::{ConfigError, StoreError},
};

/// The inbox's migrations. One static serves every schema: the SQL uses unqualified names and
/// [`migrate`] runs it with `search_path` set to the target schema.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    Migrator::with_migrations(
        MIGRATION_FILES
            .iter()
            .map(|&(version, name, sql)| migration(version, name, sql))
            .collect(),
    )
});

/// Includes `migrations/<name>.sql` as `(version, name, sql)`.
macro_rules! migration_file {
    ($version:literal, $name:literal) => {
        (
            $version,
            $name,
            include_str!(concat!("../migrations/", $name, ".sql")),
        )
    };
}

/// The files of `migrations/`, by name without `.sql`, in order. Embedded here rather than by
/// `sqlx::migrate!`, which would pull sqlx's compile-time query machinery into every build; a
/// test checks that the list matches the directory.
const MIGRATION_FILES: &[(i64, &str, &str)] = &[
    migration_file!(1, "0001_inbox"),
    migration_file!(2, "0002_lean_indexes"),
    migration_file!(3, "0003_operations"),
    migration_file!(4, "0004_audit_truncate"),
    migration_file!(5, "0005_leases"),
    migration_file!(6, "0006_outbox"),
    migration_file!(7, "0007_retention_privacy"),
    migration_file!(9, "0009_validate_status_check"),
    migration_file!(10, "0010_audit_and_error_privacy"),
    migration_file!(11, "0011_copy_marks"),
    migration_file!(12, "0012_outbox_fillfactor"),
    migration_file!(13, "0013_history_and_replacement"),
    migration_file!(14, "0014_replaced_by_index"),
    migration_file!(15, "0015_correlation_index"),
    migration_file!(16, "0016_scrub_event"),
    migration_file!(17, "0017_ordering"),
    migration_file!(18, "0018_validate_held_status"),
    migration_file!(19, "0019_held_index"),
];

/// The migration in file `<version>_<description>.sql` (`name` without `.sql`), read as `sqlx::migrate!` reads it: the
/// description with `_` as spaces, a simple (up-only) migration, run outside a transaction when
/// its first line is `-- no-transaction`; its checksum is the SQL's SHA-384, as sqlx records it.
fn migration(version: i64, name: &'static str, sql: &'static str) -> Migration {
    let description = name.split_once('_').map_or(name, |(_, d)| d);
    Migration::new(
        version,
        description.replace('_', " ").into(),
        MigrationType::Simple,
        sql.into_sql_str(),
        sql.starts_with("-- no-transaction"),
    )
}

/// Name of the migrations table, created inside the inbox schema so the library never touches
/// an application's own `_sqlx_migrations`.
pub const MIGRATIONS_TABLE: &str = "_rabbit_inbox_migrations";

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
    pub fn qualify(&self, table: &str) -> String {
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
/// transaction and can run `CREATE INDEX CONCURRENTLY` (a `-- no-transaction` migration); see
/// [`SessionLock`] for how it is waited for and released.
#[derive(Debug)]
pub struct SchemaLock(SessionLock);

impl SchemaLock {
    /// Waits until no other session holds the lock of `schema`, then takes it, on a
    /// connection detached from `pool`.
    pub async fn acquire(pool: &PgPool, schema: &SchemaName) -> Result<Self, StoreError> {
        let key = advisory_lock::key(&["rabbit-inbox schema lock", schema.as_str()]);
        let notice = || {
            tracing::warn!(
                schema = %schema,
                "still waiting for another instance to finish migrating the schema"
            );
        };
        match SessionLock::acquire(pool, key, None, notice).await? {
            Some(lock) => Ok(Self(lock)),
            None => Err(StoreError::Corrupt(
                "a lock waited for without limit gave up".into(),
            )),
        }
    }

    /// The connection that holds the lock. Session settings made on it (`search_path`) end
    /// with it: it never returns to the pool.
    pub fn connection(&mut self) -> &mut PgConnection {
        self.0.connection()
    }

    /// Unlocks and closes the connection.
    pub async fn release(self) -> Result<(), StoreError> {
        self.0.release().await
    }
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

/// Drops `schema` and everything in it, for good: the ledger, its history and audit, and any
/// business table kept there. For removing a consumer's schema: tearing down a test or a demo,
/// or decommissioning a consumer. Not part of running a consumer: the consumer runtime never
/// calls it. Waits for a migration of the schema in progress to finish.
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

/// The statements of `sql`, comments removed, upper-cased, whitespace collapsed. A rule
/// check, not a parser: good enough for DDL without dollar-quoted bodies.
fn statements(sql: &str) -> Vec<String> {
    let code: String = sql
        .lines()
        .map(|line| line.split_once("--").map_or(line, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n");
    code.split(';')
        .map(|s| {
            s.split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .to_uppercase()
        })
        .filter(|s| !s.is_empty())
        .collect()
}

/// The indexes the inbox migrations leave in place, by name, in creation order: every index a
/// migration creates, less those a later one drops. What the doctor expects to find.
pub fn migration_indexes() -> Vec<String> {
    fn name_after<'a>(statement: &'a str, prefixes: &[&str], optional: &[&str]) -> Option<&'a str> {
        let mut rest = prefixes
            .iter()
            .find_map(|p| statement.strip_prefix(p))?
            .trim_start();
        for word in optional {
            rest = rest.strip_prefix(word).unwrap_or(rest).trim_start();
        }
        rest.split(|c: char| c.is_whitespace() || c == '(').next()
    }
    let mut indexes: Vec<String> = Vec::new();
    for migration in MIGRATOR.migrations.iter() {
        for statement in statements(migration.sql.as_str()) {
            let created = name_after(
                &statement,
                &["CREATE INDEX ", "CREATE UNIQUE INDEX "],
                &["CONCURRENTLY ", "IF NOT EXISTS "],
            );
            let dropped = name_after(
                &statement,
                &["DROP INDEX "],
                &["CONCURRENTLY ", "IF EXISTS "],
            );
            if let Some(name) = created {
                indexes.push(name.to_lowercase());
            } else if let Some(name) = dropped {
                let name = name.to_lowercase();
                indexes.retain(|i| *i != name);
            }
        }
    }
    indexes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_is_embedded_under_its_version() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .expect("the migrations directory")
            .map(|e| {
                e.expect("a directory entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter_map(|f| f.strip_suffix(".sql").map(str::to_owned))
            .collect();
        on_disk.sort();
        let embedded: Vec<&str> = MIGRATION_FILES.iter().map(|&(_, name, _)| name).collect();
        assert_eq!(embedded, on_disk, "add the new file to MIGRATION_FILES");
        for &(version, name, _) in MIGRATION_FILES {
            let prefix = name.split_once('_').map(|(v, _)| v.parse::<i64>());
            assert_eq!(prefix, Some(Ok(version)), "{name}");
        }
        assert!(
            MIGRATOR.migrations.iter().any(|m| m.no_tx),
            "-- no-transaction is read"
        );
    }

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

    /// Migrations up to this version build or drop indexes inside their transaction, locking
    /// `message_inbox` against writes while they run: fine on the new table they were written
    /// for. Every later one must leave a large, busy table writable.
    const LAST_LOCKING_MIGRATION: i64 = 2;

    /// Why a migration would lock a table that may hold tens of millions of rows, if it does.
    fn locking_violation(sql: &str, no_tx: bool) -> Option<String> {
        let statements = statements(sql);
        // A table created by the same migration is empty: indexing it locks nothing that
        // matters, and CONCURRENTLY cannot run in the transaction that created it.
        let created: Vec<&str> = statements
            .iter()
            .filter_map(|s| s.strip_prefix("CREATE TABLE "))
            .filter_map(|rest| {
                let rest = rest.strip_prefix("IF NOT EXISTS ").unwrap_or(rest);
                rest.split(|c: char| c.is_whitespace() || c == '(').next()
            })
            .collect();
        let indexes_new_table = |statement: &str| {
            statement.split_once(" ON ").is_some_and(|(_, rest)| {
                let rest = rest.strip_prefix("ONLY ").unwrap_or(rest);
                rest.split(|c: char| c.is_whitespace() || c == '(')
                    .next()
                    .is_some_and(|table| created.contains(&table))
            })
        };
        let mut concurrent = false;
        for statement in &statements {
            let index_ddl = [
                "CREATE INDEX",
                "CREATE UNIQUE INDEX",
                "DROP INDEX",
                "REINDEX",
            ]
            .into_iter()
            .find(|prefix| statement.starts_with(prefix));
            if let Some(prefix) = index_ddl {
                if prefix.starts_with("CREATE") && indexes_new_table(statement) {
                    continue;
                }
                if !statement[prefix.len()..]
                    .trim_start()
                    .starts_with("CONCURRENTLY")
                {
                    return Some(format!("{prefix} without CONCURRENTLY: {statement}"));
                }
                concurrent = true;
            }
        }
        if concurrent && !no_tx {
            return Some("CONCURRENTLY needs a `-- no-transaction` migration".to_owned());
        }
        // PostgreSQL runs several statements sent at once in one implicit transaction block,
        // where CONCURRENTLY fails.
        if concurrent && statements.len() > 1 {
            return Some("a CONCURRENTLY migration must hold exactly one statement".to_owned());
        }
        None
    }

    #[test]
    fn later_migrations_change_indexes_concurrently() {
        for migration in MIGRATOR.migrations.iter() {
            if migration.version <= LAST_LOCKING_MIGRATION {
                continue;
            }
            if let Some(violation) = locking_violation(migration.sql.as_str(), migration.no_tx) {
                panic!(
                    "migration {} ({}) would lock its table: {violation}",
                    migration.version, migration.description
                );
            }
        }
    }

    #[test]
    fn locking_rule_tells_locking_from_concurrent_index_changes() {
        let locking = [
            ("CREATE INDEX idx ON message_inbox (tenant_id);", true),
            ("create unique index idx on message_inbox (x)", true),
            ("-- a comment\nDROP INDEX idx_message_inbox_open;", true),
            (
                "CREATE INDEX CONCURRENTLY idx ON message_inbox (tenant_id);",
                false,
            ),
            (
                "CREATE INDEX CONCURRENTLY a ON message_inbox (x);\nCREATE INDEX CONCURRENTLY b ON message_inbox (y);",
                true,
            ),
            (
                "CREATE TABLE outbox (id TEXT);\nCREATE INDEX idx ON message_inbox (id);",
                false,
            ),
        ];
        for (sql, no_tx) in locking {
            assert!(locking_violation(sql, no_tx).is_some(), "{sql}");
        }
        let fine = [
            (
                "-- no-transaction\nCREATE INDEX CONCURRENTLY idx ON message_inbox (tenant_id);",
                true,
            ),
            (
                "-- no-transaction\ndrop index concurrently if exists idx;",
                true,
            ),
            ("ALTER TABLE message_inbox ADD COLUMN note TEXT;", false),
            (
                "CREATE TABLE IF NOT EXISTS outbox (id TEXT);\nCREATE INDEX idx ON outbox (id);",
                false,
            ),
        ];
        for (sql, no_tx) in fine {
            assert_eq!(locking_violation(sql, no_tx), None, "{sql}");
        }
    }

    /// The directive the README tells migration authors to write is the one sqlx obeys.
    #[tokio::test]
    async fn no_transaction_directive_is_sqlx_spelling() {
        let dir = std::env::temp_dir().join(format!("rabbit-inbox-no-tx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::write(
            dir.join("0003_tenant_index.sql"),
            "-- no-transaction\nCREATE INDEX CONCURRENTLY idx ON message_inbox (tenant_id);\n",
        )
        .expect("migration file");
        let migrator = Migrator::new(dir.as_path()).await;
        let _ = std::fs::remove_dir_all(&dir);
        let migrator = migrator.expect("resolves");
        let migration = migrator.migrations.first().expect("one migration");
        assert!(migration.no_tx, "sqlx would run it in a transaction");
        assert_eq!(
            locking_violation(migration.sql.as_str(), migration.no_tx),
            None
        );
    }
}
