//! Schema checks: migrations, primary keys, indexes and the status constraint, read from the
//! catalog.

use std::collections::{BTreeMap, BTreeSet};

use sqlx::{AssertSqlSafe, Row};

use super::{
    check::{Area, Check, Severity},
    check_ids as ids,
};
use crate::{error::OpsError, operations::Operations};
use rabbit_inbox::schema::{MIGRATIONS_TABLE, MIGRATOR, migration_indexes};

impl Operations {
    pub(super) fn migrate_hint(&self) -> String {
        format!(
            "start a consumer of this version (it migrates at start) or run \
             rabbit_inbox::migrate on schema {}",
            self.schema
        )
    }

    pub(super) async fn check_migrations(&self) -> Result<Check, OpsError> {
        let table_exists: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relname = $2)",
        )
        .bind(self.schema.as_str())
        .bind(MIGRATIONS_TABLE)
        .fetch_one(&self.pool)
        .await?;
        if !table_exists {
            return Ok(Check::new(
                ids::MIGRATIONS,
                Area::Schema,
                Severity::Fail,
                format!("schema {} has no inbox migrations applied", self.schema),
            )
            .hint(self.migrate_hint()));
        }
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT version, success, checksum FROM {} ORDER BY version",
            self.schema.qualify(MIGRATIONS_TABLE)
        )))
        .persistent(false)
        .fetch_all(&self.pool)
        .await?;
        let mut applied = BTreeMap::new();
        for r in &rows {
            let version: i64 = r.try_get("version")?;
            let success: bool = r.try_get("success")?;
            let checksum: Vec<u8> = r.try_get("checksum")?;
            applied.insert(version, (success, checksum));
        }
        let known: BTreeMap<i64, &[u8]> = MIGRATOR
            .migrations
            .iter()
            .map(|m| (m.version, m.checksum.as_ref()))
            .collect();
        let missing: Vec<String> = known
            .keys()
            .filter(|v| !applied.contains_key(v))
            .map(i64::to_string)
            .collect();
        let unknown: Vec<String> = applied
            .keys()
            .filter(|v| !known.contains_key(v))
            .map(i64::to_string)
            .collect();
        let failed: Vec<String> = applied
            .iter()
            .filter(|(_, (success, _))| !success)
            .map(|(v, _)| v.to_string())
            .collect();
        let changed: Vec<String> = applied
            .iter()
            .filter(|(v, (_, checksum))| known.get(v).is_some_and(|k| *k != checksum.as_slice()))
            .map(|(v, _)| v.to_string())
            .collect();
        let mut problems = Vec::new();
        if !missing.is_empty() {
            problems.push(format!("not applied: {}", missing.join(", ")));
        }
        if !failed.is_empty() {
            problems.push(format!("failed midway: {}", failed.join(", ")));
        }
        if !unknown.is_empty() {
            problems.push(format!(
                "applied but unknown to this version (a newer library migrated it): {}",
                unknown.join(", ")
            ));
        }
        if !changed.is_empty() {
            problems.push(format!(
                "applied from different SQL than this version ships: {}",
                changed.join(", ")
            ));
        }
        let latest = known.keys().last().copied().unwrap_or_default();
        if problems.is_empty() {
            return Ok(Check::pass(
                ids::MIGRATIONS,
                Area::Schema,
                format!("all {} migrations applied (latest {latest})", known.len()),
            ));
        }
        let hint = if unknown.is_empty() {
            self.migrate_hint()
        } else {
            "run the library version that migrated the schema (or a newer one)".to_owned()
        };
        Ok(Check::new(
            ids::MIGRATIONS,
            Area::Schema,
            Severity::Fail,
            format!("migrations are not current: {}", problems.join("; ")),
        )
        .hint(hint))
    }

    /// The primary key columns of `table`, in key order; `None`: no primary key.
    pub(super) async fn primary_key(&self, table: &str) -> Result<Option<Vec<String>>, OpsError> {
        let columns: Option<Vec<String>> = sqlx::query_scalar(
            "SELECT array_agg(a.attname::text ORDER BY k.ord) \
             FROM pg_constraint c \
             JOIN pg_class t ON t.oid = c.conrelid \
             JOIN pg_namespace n ON n.oid = t.relnamespace \
             CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, ord) \
             JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = k.attnum \
             WHERE n.nspname = $1 AND t.relname = $2 AND c.contype = 'p' \
             GROUP BY c.oid",
        )
        .bind(self.schema.as_str())
        .bind(table)
        .fetch_optional(&self.pool)
        .await?
        .flatten();
        Ok(columns)
    }

    pub(super) async fn check_primary_keys(&self) -> Result<Check, OpsError> {
        let expected = BTreeSet::from(["consumer_name", "message_id"]);
        let mut problems = Vec::new();
        for table in ["message_inbox", "inbox_tombstone"] {
            match self.primary_key(table).await? {
                None => problems.push(format!("{table} has no primary key")),
                Some(cols) => {
                    let have: BTreeSet<&str> = cols.iter().map(String::as_str).collect();
                    if have != expected {
                        problems.push(format!(
                            "{table} is keyed by ({}), expected (message_id, consumer_name)",
                            cols.join(", ")
                        ));
                    }
                }
            }
        }
        if problems.is_empty() {
            return Ok(Check::pass(
                ids::PRIMARY_KEY,
                Area::Schema,
                "message_inbox and inbox_tombstone are keyed by (message_id, consumer_name)",
            ));
        }
        Ok(Check::new(
            ids::PRIMARY_KEY,
            Area::Schema,
            Severity::Fail,
            problems.join("; "),
        )
        .detail(
            "the key is what deduplicates: without consumer_name, consumers of one message \
             share one row (the second consumer's effect is skipped); without any key, \
             duplicates are not recognised",
        )
        .hint(format!(
            "restore the key: ALTER TABLE {s}.message_inbox DROP CONSTRAINT <wrong key>, ADD \
             PRIMARY KEY (message_id, consumer_name) (after removing rows the wrong key let in)",
            s = self.schema
        )))
    }

    pub(super) async fn check_indexes(&self) -> Result<Check, OpsError> {
        let rows = sqlx::query(
            "SELECT c.relname::text AS name, i.indisvalid AS valid \
             FROM pg_index i \
             JOIN pg_class c ON c.oid = i.indexrelid \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1",
        )
        .bind(self.schema.as_str())
        .fetch_all(&self.pool)
        .await?;
        let mut present = BTreeMap::new();
        for r in &rows {
            present.insert(
                r.try_get::<String, _>("name")?,
                r.try_get::<bool, _>("valid")?,
            );
        }
        let expected = migration_indexes();
        let missing: Vec<&str> = expected
            .iter()
            .filter(|i| !present.contains_key(*i))
            .map(String::as_str)
            .collect();
        let invalid: Vec<&str> = expected
            .iter()
            .filter(|i| present.get(*i) == Some(&false))
            .map(String::as_str)
            .collect();
        if missing.is_empty() && invalid.is_empty() {
            return Ok(Check::pass(
                ids::INDEXES,
                Area::Schema,
                format!("all {} indexes of the migrations present", expected.len()),
            ));
        }
        let mut summary = Vec::new();
        if !missing.is_empty() {
            summary.push(format!("missing: {}", missing.join(", ")));
        }
        if !invalid.is_empty() {
            summary.push(format!(
                "invalid (an interrupted concurrent build): {}",
                invalid.join(", ")
            ));
        }
        Ok(Check::new(
            ids::INDEXES,
            Area::Schema,
            Severity::Fail,
            format!("indexes: {}", summary.join("; ")),
        )
        .detail("without them the open-row lookups (recovery, status) and retention scan the table")
        .hint(
            "recreate them as the migrations define them (CREATE INDEX CONCURRENTLY ...; an \
             invalid one: DROP INDEX CONCURRENTLY first)",
        ))
    }

    pub(super) async fn check_status_constraint(&self) -> Result<Check, OpsError> {
        let row = sqlx::query(
            "SELECT c.convalidated AS validated, pg_get_constraintdef(c.oid) AS definition \
             FROM pg_constraint c \
             JOIN pg_class t ON t.oid = c.conrelid \
             JOIN pg_namespace n ON n.oid = t.relnamespace \
             WHERE n.nspname = $1 AND t.relname = 'message_inbox' AND c.contype = 'c' \
               AND c.conname = 'message_inbox_status_check'",
        )
        .bind(self.schema.as_str())
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(Check::new(
                ids::STATUS_CHECK,
                Area::Schema,
                Severity::Fail,
                "message_inbox has no status check constraint (message_inbox_status_check)",
            )
            .hint(self.migrate_hint()));
        };
        let validated: bool = row.try_get("validated")?;
        let definition: String = row.try_get("definition")?;
        let absent: Vec<&str> = rabbit_inbox::status::InboxStatus::ALL
            .iter()
            .map(|s| s.as_str())
            .filter(|s| !definition.contains(&format!("'{s}'")))
            .collect();
        if !absent.is_empty() {
            return Ok(Check::new(
                ids::STATUS_CHECK,
                Area::Schema,
                Severity::Fail,
                format!(
                    "the status check does not allow {}: rows in that status cannot be written",
                    absent.join(", ")
                ),
            )
            .detail(definition)
            .hint(self.migrate_hint()));
        }
        if !validated {
            return Ok(Check::new(
                ids::STATUS_CHECK,
                Area::Schema,
                Severity::Fail,
                "the status check is NOT VALID: rows written before it was added are unchecked",
            )
            .hint(format!(
                "ALTER TABLE {}.message_inbox VALIDATE CONSTRAINT message_inbox_status_check \
                 (does not block writes)",
                self.schema
            )));
        }
        Ok(Check::pass(
            ids::STATUS_CHECK,
            Area::Schema,
            "status check present and validated",
        ))
    }
}
