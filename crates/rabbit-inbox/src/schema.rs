//! The inbox schema: a validated PostgreSQL schema name and the embedded migrations.

use std::fmt;

use sqlx::{AssertSqlSafe, Connection, PgPool, migrate::Migrator};

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

/// Creates `schema` if needed and applies the inbox migrations inside it.
///
/// Safe to call from several processes at once: the migrator takes an advisory lock.
pub async fn migrate(pool: &PgPool, schema: &SchemaName) -> Result<(), StoreError> {
    // A dedicated connection, closed afterwards, so the altered search_path never leaks into
    // the pool.
    let mut conn = pool.acquire().await?.detach();
    // The schema name is validated by `SchemaName`.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS \"{schema}\"; SET search_path TO \"{schema}\""
    )))
    .execute(&mut conn)
    .await?;
    let mut migrator = Migrator {
        migrations: MIGRATOR.migrations.clone(),
        ..Migrator::DEFAULT
    };
    migrator.dangerous_set_table_name(schema.qualify(MIGRATIONS_TABLE));
    let result = migrator.run(&mut conn).await;
    let _ = conn.close().await;
    result.map_err(StoreError::Migrate)
}

/// Drops `schema` and everything in it. For tests and demos that own their schema.
pub async fn drop_schema(pool: &PgPool, schema: &SchemaName) -> Result<(), StoreError> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
    )))
    .execute(pool)
    .await?;
    Ok(())
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
