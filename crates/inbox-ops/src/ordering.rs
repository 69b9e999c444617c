//! Ordered processing, the operator's side: the keys whose held messages wait (behind a
//! failed or parked head, or for a missing sequence number), and skipping what they wait for.
//!
//! Skipping a head unblocks its key without touching the head's row: it stays parked (or
//! retrying) as evidence and can still be redriven or replayed; the key's held messages are
//! released after it. Skipping a sequence gap moves the key's next number to its first held
//! one. Both are audited as [`SKIP_HEAD`].

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sqlx::{PgConnection, Row, postgres::PgRow};

use crate::{
    actor::Actor, audit::audit, error::OpsError, operations::Operations, sql::sql, text::no_nul,
};
use rabbit_inbox::{
    SchemaName,
    ledger_sql::{Statuses, tables},
    ordering::key_lock,
    privacy::open_headers,
    status::InboxStatus,
};

/// Audit action of a skipped head or sequence gap.
pub const SKIP_HEAD: &str = "skip_head";

/// [`InboxStatus::Held`] as an SQL literal.
const HELD: Statuses = Statuses(&[InboxStatus::Held]);

/// What a key's held messages wait for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum BlockReason {
    /// A failed or parked message of the key (its head) has not been processed.
    Head,
    /// With sequence numbers: a later number is held for a missing one.
    SequenceGap,
}

impl BlockReason {
    /// `head` or `sequence_gap`, as serialized.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockReason::Head => "head",
            BlockReason::SequenceGap => "sequence_gap",
        }
    }
}

/// One key whose held messages wait (see [`Operations::blocked_keys`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BlockedKey {
    /// The ordering key.
    pub order_key: String,
    /// What the key waits for.
    pub reason: BlockReason,
    /// The head: the failed or parked message the key waits for (`head` only).
    pub head_message_id: Option<String>,
    /// The head's status (RETRYABLE_FAILED, PERMANENT_FAILED, POISONED, MANUAL_REVIEW);
    /// `None` when its row is gone.
    pub head_status: Option<String>,
    /// The head's last error code.
    pub head_error_code: Option<String>,
    /// The head's last error message as the inbox shows it (its safe detail or a marker when
    /// the privacy policy keeps the handler's message out).
    pub head_error: Option<String>,
    /// Since when the key is blocked (for a gap: since when it waits for the missing number,
    /// else since its first held message arrived).
    pub blocked_since: Option<DateTime<Utc>>,
    /// Seconds since `blocked_since`, by the database's clock.
    pub age_seconds: f64,
    /// The key's HELD messages.
    pub held: i64,
    /// With sequence numbers: the number the key waits for.
    pub next_sequence: Option<i64>,
    /// The first held message's position (with sequence numbers: its number).
    pub first_held_position: Option<i64>,
}

/// What [`Operations::skip_head`] did.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SkippedHead {
    /// Consumer.
    pub consumer: String,
    /// The ordering key.
    pub order_key: String,
    /// What was skipped: the key's head, or its sequence gap.
    pub skipped: BlockReason,
    /// The head skipped (its row unchanged); `None` for a gap.
    pub head_message_id: Option<String>,
    /// The head's status, which it keeps.
    pub head_status: Option<String>,
    /// The key's HELD messages.
    pub held: i64,
    /// The number the key waited for (with sequence numbers).
    pub next_sequence_before: Option<i64>,
    /// The number it waits for now: past the head's, or the first held one for a gap;
    /// unchanged when the head's number is unknown (see
    /// [`Operations::with_sequence_header`]).
    pub next_sequence_after: Option<i64>,
    /// The first held message's position.
    pub first_held_position: Option<i64>,
    /// Held messages the release task now publishes, one at a time and in order (without
    /// sequence numbers all of them; with, the consecutive numbers from the next one). A
    /// released message that fails blocks the key again.
    pub to_release: i64,
    /// The audit row written.
    pub audit_id: i64,
}

impl Operations {
    /// The keys of `consumer` whose held messages wait, oldest first, at most `limit` (1 to
    /// 1000): keys blocked behind a head, and (with sequence numbers) keys that are not
    /// blocked but whose first held number is above the one they wait for.
    pub async fn blocked_keys(
        &self,
        consumer: &str,
        limit: i64,
    ) -> Result<Vec<BlockedKey>, OpsError> {
        if !(1..=1000).contains(&limit) {
            return Err(OpsError::Invalid("limit must be 1 to 1000".into()));
        }
        no_nul("consumer", consumer)?;
        let t = self.schema.qualify(tables::MESSAGE_INBOX);
        let k = self.schema.qualify(tables::INBOX_ORDER_KEY);
        // The held rows are few and indexed (idx_message_inbox_held); the keys table may hold
        // every key ever seen, so gaps are found from the held rows, not from the keys.
        sqlx::query(sql(format!(
            "WITH held AS ( \
               SELECT order_key, count(*) AS n, min(order_position) AS first_position, \
                 min(first_received_at) AS first_held_at \
               FROM {t} WHERE consumer_name = $1 AND status = {HELD} GROUP BY order_key), \
             waiting AS ( \
               SELECT k.order_key, 'head' AS reason, k.head_message_id, k.blocked_since, \
                 k.next_sequence \
               FROM {k} k WHERE k.consumer_name = $1 AND k.head_message_id IS NOT NULL \
               UNION ALL \
               SELECT k.order_key, 'sequence_gap', NULL, \
                 coalesce(k.gap_since, h.first_held_at), k.next_sequence \
               FROM held h JOIN {k} k ON k.consumer_name = $1 AND k.order_key = h.order_key \
               WHERE k.head_message_id IS NULL AND h.first_position > k.next_sequence) \
             SELECT w.order_key, w.reason, w.head_message_id, w.blocked_since, \
               w.next_sequence, coalesce(h.n, 0) AS held, h.first_position, \
               m.status AS head_status, m.last_error_code, m.last_error_message, \
               coalesce(extract(epoch FROM now() - w.blocked_since)::float8, 0) AS age \
             FROM waiting w \
             LEFT JOIN held h ON h.order_key = w.order_key \
             LEFT JOIN {t} m ON m.consumer_name = $1 AND m.message_id = w.head_message_id \
             ORDER BY w.blocked_since NULLS LAST, w.order_key LIMIT $2"
        )))
        .persistent(false)
        .bind(consumer)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(blocked_key_of)
        .collect()
    }

    /// The header the ordered consumers of this inbox carry their business sequence numbers
    /// in (their `SequencePolicy::header`): [`skip_head`](Self::skip_head) reads a head's
    /// number from its stored headers when its row holds no position (a message that failed
    /// on its first delivery), to move the key past it. Without it such a head's number is
    /// unknown and the key keeps waiting for it, as a sequence gap to skip in turn.
    pub fn with_sequence_header(mut self, header: impl Into<String>) -> Self {
        self.sequence_header = Some(header.into());
        self
    }

    /// Skips what `consumer`'s key `order_key` waits for, audited ([`SKIP_HEAD`]). A blocked
    /// key is unblocked: its head's row stays as it is (parked or retrying), and with
    /// sequence numbers the key's next number moves past the head's when the head holds it.
    /// A key that is not blocked but waits for a missing sequence number goes on from its
    /// first held number instead. `expected_head` (what the operator saw) must name the
    /// current head; a key that waits for nothing, or whose head is another, is refused
    /// ([`OpsError::Invalid`]).
    ///
    /// Runs under the key's lock, the one the consumer decides under, so no delivery of the
    /// key interleaves with it. The held messages are then released by the release task, in
    /// order. A retry copy of a skipped head that still comes back waits behind them (without
    /// sequence numbers) or is parked as passed (with).
    pub async fn skip_head(
        &self,
        actor: &Actor,
        consumer: &str,
        order_key: &str,
        expected_head: Option<&str>,
    ) -> Result<SkippedHead, OpsError> {
        no_nul("consumer", consumer)?;
        no_nul("ordering key", order_key)?;
        if let Some(head) = expected_head {
            no_nul("expected head", head)?;
        }
        let mut tx = self.pool.begin().await?;
        lock_key(&mut tx, &self.schema, consumer, order_key).await?;
        let key = self.key_state(&mut tx, consumer, order_key).await?;
        let head = match &key.head {
            Some(id) => Some(self.head_row(&mut tx, consumer, id).await?),
            None => None,
        };
        let plan = plan_skip(consumer, order_key, &key, head.as_ref(), expected_head)?;
        self.apply_skip(&mut tx, consumer, order_key, &key, &plan)
            .await?;
        let to_release = self
            .releasable(&mut tx, consumer, order_key, &key, plan.next_after)
            .await?;
        let mut skipped = SkippedHead {
            consumer: consumer.to_owned(),
            order_key: order_key.to_owned(),
            skipped: plan.skipped,
            head_message_id: key.head.clone(),
            head_status: head.and_then(|h| h.status),
            held: key.held,
            next_sequence_before: key.next_sequence,
            next_sequence_after: plan.next_after,
            first_held_position: key.first_held,
            to_release,
            audit_id: 0,
        };
        skipped.audit_id = audit(
            &mut tx,
            &self.schema,
            actor,
            SKIP_HEAD,
            Some(consumer),
            skipped.head_message_id.as_deref(),
            audit_details(&skipped),
        )
        .await?;
        tx.commit().await?;
        Ok(skipped)
    }

    /// The key's row, locked, with its held messages' count and first position; refused when
    /// the key has no row (it never blocked nor waited).
    async fn key_state(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        order_key: &str,
    ) -> Result<KeyState, OpsError> {
        let row = sqlx::query(sql(format!(
            "SELECT k.head_message_id, k.next_sequence, \
               (SELECT count(*) FROM {t} m WHERE m.consumer_name = $1 AND m.order_key = $2 \
                  AND m.status = {HELD}) AS held, \
               (SELECT min(order_position) FROM {t} m WHERE m.consumer_name = $1 \
                  AND m.order_key = $2 AND m.status = {HELD}) AS first_held \
             FROM {k} k WHERE k.consumer_name = $1 AND k.order_key = $2 FOR UPDATE OF k",
            t = self.schema.qualify(tables::MESSAGE_INBOX),
            k = self.schema.qualify(tables::INBOX_ORDER_KEY),
        )))
        .persistent(false)
        .bind(consumer)
        .bind(order_key)
        .fetch_optional(&mut *conn)
        .await?
        .ok_or_else(|| {
            OpsError::Invalid(format!(
                "key {order_key:?} of consumer {consumer} has no ordering state: it is neither \
                 blocked nor waiting on a sequence gap (list the blocked keys with `inboxctl \
                 ordering blocked --consumer {consumer}`)"
            ))
        })?;
        Ok(KeyState {
            head: row.try_get("head_message_id")?,
            next_sequence: row.try_get("next_sequence")?,
            held: row.try_get("held")?,
            first_held: row.try_get("first_held")?,
        })
    }

    /// The head's row: its status, and its sequence number where it can be known (its
    /// position, else the sequence header of its stored headers). A missing row (retention
    /// removed it) has neither.
    async fn head_row(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<HeadRow, OpsError> {
        let row = sqlx::query(sql(format!(
            "SELECT status, order_position, headers FROM {} \
             WHERE consumer_name = $1 AND message_id = $2",
            self.schema.qualify(tables::MESSAGE_INBOX)
        )))
        .persistent(false)
        .bind(consumer)
        .bind(message_id)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(row) = row else {
            return Ok(HeadRow::default());
        };
        let position: Option<i64> = row.try_get("order_position")?;
        let sequence = match (position, &self.sequence_header) {
            (Some(position), _) => Some(position),
            (None, Some(header)) => {
                let stored: Value = row.try_get("headers")?;
                open_headers(self.keyring.as_deref(), &stored, consumer, message_id)
                    .ok()
                    .and_then(|headers| sequence_in(&headers, header))
            }
            (None, None) => None,
        };
        Ok(HeadRow {
            status: row.try_get("status")?,
            sequence,
        })
    }

    /// Unblocks the key and moves its next number as planned. When the next number moves,
    /// the gap clock restarts: it runs from now if a later number is still held.
    async fn apply_skip(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        order_key: &str,
        key: &KeyState,
        plan: &SkipPlan,
    ) -> Result<(), OpsError> {
        let gap_after = matches!((plan.next_after, key.first_held), (Some(n), Some(f)) if f > n);
        sqlx::query(sql(format!(
            "UPDATE {} SET head_message_id = NULL, blocked_since = NULL, next_sequence = $3, \
               gap_since = CASE WHEN $4 THEN coalesce( \
                 CASE WHEN next_sequence IS NOT DISTINCT FROM $3 THEN gap_since END, now()) END, \
               gap_reported_at = CASE WHEN $4 AND next_sequence IS NOT DISTINCT FROM $3 \
                 THEN gap_reported_at END, \
               updated_at = now() \
             WHERE consumer_name = $1 AND order_key = $2",
            self.schema.qualify(tables::INBOX_ORDER_KEY)
        )))
        .persistent(false)
        .bind(consumer)
        .bind(order_key)
        .bind(plan.next_after)
        .bind(gap_after)
        .execute(conn)
        .await?;
        Ok(())
    }

    /// How many held messages go on now that the key waits for `next`: all of them without
    /// sequence numbers, else the consecutive numbers from `next`.
    async fn releasable(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        order_key: &str,
        key: &KeyState,
        next: Option<i64>,
    ) -> Result<i64, OpsError> {
        let Some(next) = next else {
            return Ok(key.held);
        };
        Ok(sqlx::query_scalar(sql(format!(
            "SELECT count(*) FROM ( \
               SELECT p, row_number() OVER (ORDER BY p) AS rn FROM ( \
                 SELECT DISTINCT order_position AS p FROM {} \
                 WHERE consumer_name = $1 AND order_key = $2 AND status = {HELD} \
                   AND order_position >= $3) d) s \
             WHERE p = $3 + rn - 1",
            self.schema.qualify(tables::MESSAGE_INBOX)
        )))
        .persistent(false)
        .bind(consumer)
        .bind(order_key)
        .bind(next)
        .fetch_one(conn)
        .await?)
    }
}

/// Takes the key's transaction-scoped lock, the one the consumer's batch transaction takes
/// before deciding on the key's messages ([`key_lock`]).
async fn lock_key(
    conn: &mut PgConnection,
    schema: &SchemaName,
    consumer: &str,
    order_key: &str,
) -> Result<(), OpsError> {
    let lock = key_lock(schema, consumer, order_key);
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(lock)
        .execute(conn)
        .await?;
    Ok(())
}

/// A key's row and held messages, as read under its lock.
#[derive(Clone, Debug, Default, PartialEq)]
struct KeyState {
    head: Option<String>,
    next_sequence: Option<i64>,
    held: i64,
    first_held: Option<i64>,
}

/// The head's row, as far as a skip needs it.
#[derive(Clone, Debug, Default, PartialEq)]
struct HeadRow {
    status: Option<String>,
    /// Its sequence number, when known.
    sequence: Option<i64>,
}

/// What a skip changes.
#[derive(Clone, Copy, Debug, PartialEq)]
struct SkipPlan {
    skipped: BlockReason,
    next_after: Option<i64>,
}

/// Decides the skip, or refuses it: a blocked key loses its head (the one expected, if
/// given), and its next number moves past the head's when they are the same; a key that is
/// not blocked skips its gap, if it has one.
fn plan_skip(
    consumer: &str,
    order_key: &str,
    key: &KeyState,
    head: Option<&HeadRow>,
    expected_head: Option<&str>,
) -> Result<SkipPlan, OpsError> {
    match (&key.head, expected_head) {
        (Some(current), Some(expected)) if current != expected => Err(OpsError::Invalid(format!(
            "key {order_key:?} of consumer {consumer} is blocked by {current}, not by \
             {expected}: the head changed since it was listed; list the blocked keys again \
             and skip the head shown"
        ))),
        (Some(_), _) => {
            let head_sequence = head.and_then(|h| h.sequence);
            let next_after = match key.next_sequence {
                Some(next) if head_sequence == Some(next) => Some(next.saturating_add(1)),
                other => other,
            };
            Ok(SkipPlan {
                skipped: BlockReason::Head,
                next_after,
            })
        }
        (None, Some(expected)) => Err(OpsError::Invalid(format!(
            "key {order_key:?} of consumer {consumer} is not blocked (by {expected} or any \
             other head: it was processed or skipped already); there is no head to skip"
        ))),
        (None, None) => match (key.next_sequence, key.first_held) {
            (Some(next), Some(first)) if first > next => Ok(SkipPlan {
                skipped: BlockReason::SequenceGap,
                next_after: Some(first),
            }),
            _ => Err(OpsError::Invalid(format!(
                "key {order_key:?} of consumer {consumer} is not blocked and waits on no \
                 sequence gap: there is nothing to skip"
            ))),
        },
    }
}

/// The number in `header` of `headers`: an integer, or its decimal text (as the consumer
/// reads it).
fn sequence_in(headers: &Value, header: &str) -> Option<i64> {
    match headers.get(header)? {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// The audit details of a skip.
fn audit_details(skipped: &SkippedHead) -> Value {
    json!({
        "order_key": skipped.order_key,
        "skipped": skipped.skipped.as_str(),
        "head_message_id": skipped.head_message_id,
        "head_status": skipped.head_status,
        "held": skipped.held,
        "next_sequence_before": skipped.next_sequence_before,
        "next_sequence_after": skipped.next_sequence_after,
        "first_held_position": skipped.first_held_position,
        "to_release": skipped.to_release,
    })
}

fn blocked_key_of(row: &PgRow) -> Result<BlockedKey, OpsError> {
    let reason = match row.try_get::<&str, _>("reason")? {
        "head" => BlockReason::Head,
        _ => BlockReason::SequenceGap,
    };
    Ok(BlockedKey {
        order_key: row.try_get("order_key")?,
        reason,
        head_message_id: row.try_get("head_message_id")?,
        head_status: row.try_get("head_status")?,
        head_error_code: row.try_get("last_error_code")?,
        head_error: row.try_get("last_error_message")?,
        blocked_since: row.try_get("blocked_since")?,
        age_seconds: row.try_get("age")?,
        held: row.try_get("held")?,
        next_sequence: row.try_get("next_sequence")?,
        first_held_position: row.try_get("first_position")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(head: Option<&str>, next: Option<i64>, first_held: Option<i64>) -> KeyState {
        KeyState {
            head: head.map(str::to_owned),
            next_sequence: next,
            held: 2,
            first_held,
        }
    }

    fn head(sequence: Option<i64>) -> HeadRow {
        HeadRow {
            status: Some("PERMANENT_FAILED".into()),
            sequence,
        }
    }

    #[test]
    fn a_head_is_skipped_and_the_next_number_moves_past_its_own() {
        let plan = |k: &KeyState, h: Option<i64>| plan_skip("c", "k", k, Some(&head(h)), None);
        let blocked = key(Some("m-3"), Some(3), Some(4));
        assert_eq!(plan(&blocked, Some(3)).expect("skips").next_after, Some(4));
        // Another number, or an unknown one, leaves the next number where it is.
        assert_eq!(plan(&blocked, Some(7)).expect("skips").next_after, Some(3));
        assert_eq!(plan(&blocked, None).expect("skips").next_after, Some(3));
        let unsequenced = key(Some("m-3"), None, Some(10));
        let p = plan(&unsequenced, Some(9)).expect("skips");
        assert_eq!((p.skipped, p.next_after), (BlockReason::Head, None));
    }

    #[test]
    fn a_skip_names_the_head_it_expects() {
        let blocked = key(Some("m-3"), None, Some(1));
        let h = head(None);
        assert!(plan_skip("c", "k", &blocked, Some(&h), Some("m-3")).is_ok());
        let e = plan_skip("c", "k", &blocked, Some(&h), Some("m-2")).expect_err("other head");
        assert!(e.to_string().contains("blocked by m-3, not by m-2"), "{e}");
        let free = key(None, None, Some(1));
        let e = plan_skip("c", "k", &free, None, Some("m-3")).expect_err("not blocked");
        assert!(e.to_string().contains("not blocked"), "{e}");
    }

    #[test]
    fn a_gap_is_skipped_to_the_first_held_number() {
        let gap = key(None, Some(2), Some(5));
        let p = plan_skip("c", "k", &gap, None, None).expect("skips the gap");
        assert_eq!(
            (p.skipped, p.next_after),
            (BlockReason::SequenceGap, Some(5))
        );
        for nothing in [key(None, Some(5), Some(5)), key(None, None, Some(1))] {
            let e = plan_skip("c", "k", &nothing, None, None).expect_err("nothing to skip");
            assert!(e.to_string().contains("nothing to skip"), "{e}");
        }
    }

    #[test]
    fn a_sequence_is_read_as_the_consumer_reads_it() {
        let headers = json!({ "x-seq": 7, "x-text": " 8 ", "x-bad": "eight" });
        assert_eq!(sequence_in(&headers, "x-seq"), Some(7));
        assert_eq!(sequence_in(&headers, "x-text"), Some(8));
        assert_eq!(sequence_in(&headers, "x-bad"), None);
        assert_eq!(sequence_in(&headers, "x-none"), None);
    }

    #[test]
    fn reasons_serialize_in_snake_case() {
        for reason in [BlockReason::Head, BlockReason::SequenceGap] {
            assert_eq!(
                serde_json::to_value(reason).expect("serializes"),
                json!(reason.as_str())
            );
        }
    }
}
