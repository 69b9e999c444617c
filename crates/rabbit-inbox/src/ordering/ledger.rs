//! The ordering state in the ledger: the per-key rows of `inbox_order_key` (head, next
//! sequence number, gap), read and written inside the batch and failure transactions. The
//! held messages themselves are rows of the inbox (see [`crate::store::InboxStore::hold`]).

use std::collections::HashMap;

use sqlx::{PgConnection, Row, SqlStr};

use super::gate::KeyState;
use crate::{
    advisory_lock,
    error::StoreError,
    ledger_sql::{audited, tables},
    schema::SchemaName,
    status::InboxStatus,
};

/// The transaction-scoped advisory lock under which a consumer decides on ordering key `key`:
/// whoever changes a key's ordering state (the release task, an operator's skip) takes it too.
/// Advisory locks are per database, so the key names the schema as well as the consumer.
pub fn key_lock(schema: &SchemaName, consumer: &str, key: &str) -> i64 {
    advisory_lock::key(&["rabbit-inbox order", schema.as_str(), consumer, key])
}

/// The ordering statements of one schema.
#[derive(Debug)]
pub(crate) struct OrderLedger {
    schema: SchemaName,
    load: SqlStr,
    note: SqlStr,
    advance: SqlStr,
    positions: SqlStr,
    mark_failed: SqlStr,
}

/// A change to a key's row on holding or failing (see [`OrderLedger::note`]).
pub(crate) struct KeyNote<'a> {
    pub(crate) key: &'a str,
    /// Block the key behind this message, unless it is blocked already.
    pub(crate) head: Option<&'a str>,
    /// With sequence numbers: the number a new row starts at.
    pub(crate) first_sequence: Option<i64>,
    /// A later number is held for a missing one: start the gap's clock.
    pub(crate) gap: bool,
}

/// A change to a key's row after its messages ran (see [`OrderLedger::advance`]).
pub(crate) struct KeyAdvance<'a> {
    pub(crate) key: &'a str,
    /// The head that ran: the key is unblocked.
    pub(crate) head_ran: Option<&'a str>,
    /// With sequence numbers: the number the key waits for now.
    pub(crate) next_sequence: Option<i64>,
}

// A key's first held row is read as `ORDER BY order_position LIMIT 1`, never `min(..)`: with
// stale statistics the planner takes `min` through another index and reads every HELD row of
// the consumer per key; the ordered form always walks the held rows' index.
impl OrderLedger {
    pub(crate) fn new(schema: &SchemaName) -> Self {
        let t = schema.qualify(tables::MESSAGE_INBOX);
        let k = schema.qualify(tables::INBOX_ORDER_KEY);
        let held = InboxStatus::Held.as_str();
        // A head whose row is PROCESSED blocks nothing: another copy of it committed (on
        // another instance, while this one recorded the copy's failure as the key's head).
        let processed = InboxStatus::Processed.as_str();
        Self {
            schema: schema.clone(),
            load: audited(format!(
                "SELECT u.key, CASE WHEN h.status = '{processed}' THEN NULL \
                   ELSE k.head_message_id END AS head_message_id, \
                   h.order_position AS head_position, k.next_sequence, \
                   (SELECT m.order_position FROM {t} m WHERE m.consumer_name = $1 \
                      AND m.order_key = u.key AND m.status = '{held}' \
                      ORDER BY m.order_position LIMIT 1) AS first_held \
                 FROM unnest($2::text[]) AS u(key) \
                 LEFT JOIN {k} k ON k.consumer_name = $1 AND k.order_key = u.key \
                 LEFT JOIN {t} h ON h.consumer_name = $1 AND h.message_id = k.head_message_id"
            )),
            note: audited(format!(
                "INSERT INTO {k} AS k (consumer_name, order_key, head_message_id, blocked_since, \
                   next_sequence, gap_since) \
                 SELECT $1, u.key, u.head, CASE WHEN u.head IS NULL THEN NULL ELSE now() END, \
                   u.first, CASE WHEN u.gap THEN now() END \
                 FROM unnest($2::text[], $3::text[], $4::int8[], $5::bool[]) \
                   AS u(key, head, first, gap) \
                 ON CONFLICT (consumer_name, order_key) DO UPDATE SET \
                   head_message_id = coalesce(k.head_message_id, EXCLUDED.head_message_id), \
                   blocked_since = CASE WHEN k.head_message_id IS NULL \
                                   THEN EXCLUDED.blocked_since ELSE k.blocked_since END, \
                   next_sequence = coalesce(k.next_sequence, EXCLUDED.next_sequence), \
                   gap_since = CASE WHEN EXCLUDED.gap_since IS NULL THEN k.gap_since \
                               ELSE coalesce(k.gap_since, EXCLUDED.gap_since) END, \
                   updated_at = now()"
            )),
            // Under the keys' locks: the update and the insert of new keys cannot race.
            advance: audited(format!(
                "WITH u AS (SELECT * FROM unnest($2::text[], $3::text[], $4::int8[]) \
                   AS u(key, head, next)), \
                 upd AS (UPDATE {k} AS k SET \
                   head_message_id = CASE WHEN k.head_message_id = u.head THEN NULL \
                                     ELSE k.head_message_id END, \
                   blocked_since = CASE WHEN k.head_message_id = u.head THEN NULL \
                                   ELSE k.blocked_since END, \
                   next_sequence = CASE WHEN u.next IS NULL THEN k.next_sequence \
                                   ELSE greatest(k.next_sequence, u.next) END, \
                   gap_since = CASE WHEN u.next IS NULL \
                                    OR u.next <= coalesce(k.next_sequence, u.next - 1) \
                               THEN k.gap_since \
                               WHEN (SELECT m.order_position FROM {t} m \
                                     WHERE m.consumer_name = $1 AND m.order_key = u.key \
                                       AND m.status = '{held}' \
                                     ORDER BY m.order_position LIMIT 1) > u.next \
                               THEN now() END, \
                   gap_reported_at = CASE WHEN u.next > coalesce(k.next_sequence, u.next - 1) \
                                     THEN NULL ELSE k.gap_reported_at END, \
                   updated_at = now() \
                   FROM u WHERE k.consumer_name = $1 AND k.order_key = u.key \
                   RETURNING k.order_key) \
                 INSERT INTO {k} (consumer_name, order_key, next_sequence) \
                 SELECT $1, u.key, u.next FROM u \
                 WHERE u.next IS NOT NULL AND u.key NOT IN (SELECT order_key FROM upd)"
            )),
            // Only a row that failed under the key: one already HELD keeps its place.
            mark_failed: audited(format!(
                "UPDATE {t} AS i SET order_key = u.key, \
                   order_position = coalesce(u.pos, i.order_position) \
                 FROM unnest($2::text[], $3::text[], $4::int8[]) AS u(id, key, pos) \
                 WHERE i.consumer_name = $1 AND i.message_id = u.id AND i.status <> '{held}'"
            )),
            positions: audited(format!(
                "SELECT nextval('{}') FROM generate_series(1, $1)",
                schema
                    .qualify("inbox_order_position_seq")
                    .replace('\'', "''")
            )),
        }
    }

    /// Takes the transaction-scoped lock of each key (in one order, so that two transactions
    /// cannot deadlock): while a transaction decides on a key, no other one does.
    pub(crate) async fn lock_keys(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        keys: &[&str],
    ) -> Result<(), StoreError> {
        let mut locks: Vec<i64> = keys
            .iter()
            .map(|key| key_lock(&self.schema, consumer, key))
            .collect();
        locks.sort_unstable();
        locks.dedup();
        if !locks.is_empty() {
            sqlx::query("SELECT count(pg_advisory_xact_lock(k)) FROM unnest($1::int8[]) AS k")
                .bind(&locks)
                .execute(conn)
                .await?;
        }
        Ok(())
    }

    /// The state of each key (absent keys have the default state).
    pub(crate) async fn load<'k>(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        keys: &[&'k str],
    ) -> Result<HashMap<&'k str, KeyState>, StoreError> {
        let rows = sqlx::query(self.load.clone())
            .persistent(false)
            .bind(consumer)
            .bind(keys)
            .fetch_all(conn)
            .await?;
        let mut states = HashMap::with_capacity(rows.len());
        for row in rows {
            let key: String = row.try_get("key")?;
            let Some(&k) = keys.iter().find(|k| **k == key) else {
                continue;
            };
            states.insert(
                k,
                KeyState {
                    head: row.try_get("head_message_id")?,
                    head_position: row.try_get("head_position")?,
                    next_sequence: row.try_get("next_sequence")?,
                    first_held: row.try_get("first_held")?,
                },
            );
        }
        Ok(states)
    }

    /// `n` new positions in arrival order, increasing.
    pub(crate) async fn positions(
        &self,
        conn: &mut PgConnection,
        n: usize,
    ) -> Result<Vec<i64>, StoreError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        Ok(sqlx::query_scalar(self.positions.clone())
            .bind(i32::try_from(n).unwrap_or(i32::MAX))
            .fetch_all(conn)
            .await?)
    }

    /// Blocks keys behind a head (unless blocked already) and starts gaps' clocks; creates the
    /// rows of keys seen for the first time.
    pub(crate) async fn note(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        notes: &[KeyNote<'_>],
    ) -> Result<(), StoreError> {
        if notes.is_empty() {
            return Ok(());
        }
        sqlx::query(self.note.clone())
            .persistent(false)
            .bind(consumer)
            .bind(notes.iter().map(|n| n.key).collect::<Vec<_>>())
            .bind(notes.iter().map(|n| n.head).collect::<Vec<_>>())
            .bind(notes.iter().map(|n| n.first_sequence).collect::<Vec<_>>())
            .bind(notes.iter().map(|n| n.gap).collect::<Vec<_>>())
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Writes the ordering key and sequence number on rows that failed under a key (its head,
    /// or a message behind it), so that an operator's view and skip know the head's place.
    pub(crate) async fn mark_failed(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        rows: &[(&str, &str, Option<i64>)],
    ) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        sqlx::query(self.mark_failed.clone())
            .persistent(false)
            .bind(consumer)
            .bind(rows.iter().map(|r| r.0).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.1).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.2).collect::<Vec<_>>())
            .execute(conn)
            .await?;
        Ok(())
    }

    /// Unblocks the keys whose head ran and moves sequence numbers on. A gap's clock restarts
    /// when the number moves on and later ones still wait (another number is missing now).
    pub(crate) async fn advance(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        advances: &[KeyAdvance<'_>],
    ) -> Result<(), StoreError> {
        if advances.is_empty() {
            return Ok(());
        }
        sqlx::query(self.advance.clone())
            .persistent(false)
            .bind(consumer)
            .bind(advances.iter().map(|a| a.key).collect::<Vec<_>>())
            .bind(advances.iter().map(|a| a.head_ran).collect::<Vec<_>>())
            .bind(advances.iter().map(|a| a.next_sequence).collect::<Vec<_>>())
            .execute(conn)
            .await?;
        Ok(())
    }
}
