//! A message's history: what happened to one consumer's row from its first receipt to now,
//! oldest first. Merged from the row's own timestamps, the `inbox_event` rows the ledger's
//! triggers write (each failed attempt, each batch of duplicate deliveries, each conflicting
//! body), the operator actions in `inbox_audit`, and the tombstone retention left.
//!
//! Every read is by key: the row through its primary key, its events through
//! `idx_inbox_event_message`, its audit entries through `idx_inbox_audit_message`, the row it
//! replaces through the partial index on `replaced_by`.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{Row, postgres::PgRow};

use crate::{error::OpsError, operations::Operations, sql::sql};
use rabbit_inbox::status::InboxStatus;

/// One message's story for one consumer ([`Operations::timeline`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Timeline {
    /// Consumer.
    pub consumer: String,
    /// Dedup key.
    pub message_id: String,
    /// The row's current status; `None` when there is no row (retention removed it, or the
    /// message was never received).
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub status: Option<InboxStatus>,
    /// The id of the corrected copy an operator published in this message's place (edit and
    /// replay); the row is then PROCESSED.
    pub replaced_by: Option<String>,
    /// The id of the message this one replaces (the row of the same consumer whose
    /// `replaced_by` names this one).
    pub replaces: Option<String>,
    /// What happened, oldest first.
    pub entries: Vec<TimelineEntry>,
    /// Older history was left out: only the newest [`TIMELINE_LIMIT`] history entries and the
    /// newest [`TIMELINE_LIMIT`] audit entries are returned (the row's own entries always are).
    pub truncated: bool,
}

/// At most this many history entries (runs of duplicates counting as one) and as many audit
/// entries in a [`Timeline`]: a message caught in a redelivery loop, or read a thousand times,
/// still has a page that loads.
pub const TIMELINE_LIMIT: i64 = 1000;

/// What a [`TimelineEntry`] records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TimelineKind {
    /// The first copy was received.
    Received,
    /// The latest attempt started (earlier attempts' starts are not kept; their failures are).
    AttemptStarted,
    /// An attempt failed and the message went to a retry tier (or, rarely, the row stayed
    /// in another open status): [`TimelineEntry::attempt`], `status`, `error_code`,
    /// `error_message`, and for a retry the tier it waits in.
    Failed,
    /// An attempt failed and the message was parked (PERMANENT_FAILED, POISONED,
    /// MANUAL_REVIEW), with the same details as [`TimelineKind::Failed`].
    Parked,
    /// The pending retry copy is due back from its tier (may lie in the future).
    RetryDue,
    /// The parking lot confirmed the parked copy; later copies are acked as its duplicates.
    ParkedCopyConfirmed,
    /// Copies of the message were delivered again and dropped as duplicates
    /// ([`TimelineEntry::deliveries`] of them).
    Duplicate,
    /// Copies with the same id and another body arrived ([`TimelineEntry::deliveries`] of
    /// them).
    Conflict,
    /// Recovery last republished the row's message or set it aside for review.
    Recovered,
    /// The effect committed (or, for a replaced row, the replacement resolved it).
    Processed,
    /// An operator action recorded in the audit trail (redrive, reopen, recovery, edit and
    /// replay, discard, payload read, cleanup, ...): [`TimelineEntry::action`], `actor`,
    /// `reason`, `ticket`.
    Audit,
    /// Retention scrubbed the processed row: its body, headers and error text are gone (the
    /// failed attempts' error texts too), its key, metadata and hash stay.
    Scrubbed,
    /// Retention removed the row; [`TimelineEntry::status`] is its final status.
    Removed,
}

impl TimelineKind {
    /// Order among entries with the same instant (one transaction writes several): the
    /// order in which they happen.
    fn rank(self) -> u8 {
        match self {
            TimelineKind::Received => 0,
            TimelineKind::AttemptStarted => 1,
            TimelineKind::Duplicate => 2,
            TimelineKind::Conflict => 3,
            TimelineKind::Failed => 4,
            TimelineKind::Parked => 5,
            TimelineKind::RetryDue => 6,
            TimelineKind::ParkedCopyConfirmed => 7,
            TimelineKind::Recovered => 8,
            TimelineKind::Audit => 9,
            TimelineKind::Processed => 10,
            TimelineKind::Scrubbed => 11,
            TimelineKind::Removed => 12,
        }
    }
}

/// One step of a [`Timeline`]. Fields that do not apply to its kind are `None`.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TimelineEntry {
    /// When (the database's clock).
    pub at: DateTime<Utc>,
    /// What.
    pub kind: TimelineKind,
    /// Failed, parked, attempt started: the attempt number.
    pub attempt: Option<i32>,
    /// Failed, parked: the row's status after the failure; duplicate, conflict: the row's
    /// status when the copies came; removed: the final status.
    pub status: Option<String>,
    /// Failed, parked: the error code.
    pub error_code: Option<String>,
    /// Failed, parked: the error text as the consumer's privacy policy lets anyone with read
    /// access see it (in clear, its safe detail, or a redaction marker; never the sealed text).
    ///
    /// **Sensitive:** even so it may quote the message's contents. Show it only to callers
    /// allowed to read payloads (the admin API drops it for tokens without the payload scope).
    pub error_message: Option<String>,
    /// Failed with RETRYABLE_FAILED, retry due: the retry tier queue the message waits in,
    /// when the caller named the tiers.
    pub retry_tier: Option<String>,
    /// Duplicate, conflict: how many copies.
    pub deliveries: Option<i32>,
    /// Duplicate, conflict: when the last copy of a run came. Consecutive notes of the same
    /// kind (nothing else happening between them) are one entry from `at` to `until`; `None`
    /// for a single note.
    pub until: Option<DateTime<Utc>>,
    /// Audit: the action (`redrive`, `reopen`, `replay_edited`, `payload_read`, ...).
    pub action: Option<String>,
    /// Audit: who.
    pub actor: Option<String>,
    /// Audit: why.
    pub reason: Option<String>,
    /// Audit: the ticket cited.
    pub ticket: Option<String>,
}

impl TimelineEntry {
    fn new(at: DateTime<Utc>, kind: TimelineKind) -> Self {
        Self {
            at,
            kind,
            attempt: None,
            status: None,
            error_code: None,
            error_message: None,
            retry_tier: None,
            deliveries: None,
            until: None,
            action: None,
            actor: None,
            reason: None,
            ticket: None,
        }
    }
}

/// The tier a message waits in after failed attempt `attempt`: `tiers[min(attempt, len) - 1]`
/// (the last tier for every attempt past the list), as the consumer routes it.
fn tier_of(tiers: &[String], attempt: i32) -> Option<String> {
    let n = usize::try_from(attempt.max(1)).unwrap_or(1);
    tiers.get(n.min(tiers.len()).checked_sub(1)?).cloned()
}

/// Statuses after which a failed attempt's message is parked.
fn parked(status: Option<&str>) -> bool {
    status
        .and_then(|s| s.parse::<InboxStatus>().ok())
        .is_some_and(InboxStatus::is_parked)
}

fn row_entries(
    row: &PgRow,
    tiers: &[String],
    has_conflict_events: bool,
) -> Result<Vec<TimelineEntry>, OpsError> {
    let mut entries = Vec::new();
    let status: String = row.try_get("status")?;
    let attempt: i32 = row.try_get("processing_attempt")?;
    let at = |column: &str| row.try_get::<Option<DateTime<Utc>>, _>(column);
    if let Some(t) = at("first_received_at")? {
        entries.push(TimelineEntry::new(t, TimelineKind::Received));
    }
    if let Some(t) = at("processing_started_at")? {
        entries.push(TimelineEntry {
            attempt: Some(attempt),
            ..TimelineEntry::new(t, TimelineKind::AttemptStarted)
        });
    }
    if let Some(t) = at("processed_at")? {
        entries.push(TimelineEntry::new(t, TimelineKind::Processed));
    }
    if let Some(t) = at("parked_copy_at")? {
        entries.push(TimelineEntry {
            attempt: Some(attempt),
            status: Some(status.clone()),
            ..TimelineEntry::new(t, TimelineKind::ParkedCopyConfirmed)
        });
    }
    if let Some(t) = at("retry_due_at")? {
        entries.push(TimelineEntry {
            attempt: Some(attempt),
            retry_tier: tier_of(tiers, attempt),
            ..TimelineEntry::new(t, TimelineKind::RetryDue)
        });
    }
    if let Some(t) = at("last_recovered_at")? {
        entries.push(TimelineEntry::new(t, TimelineKind::Recovered));
    }
    // Rows older than the event history know only their last conflict: all of them, there.
    if !has_conflict_events && let Some(t) = at("last_conflict_at")? {
        entries.push(TimelineEntry {
            deliveries: Some(row.try_get("payload_conflicts")?),
            ..TimelineEntry::new(t, TimelineKind::Conflict)
        });
    }
    Ok(entries)
}

fn event_entry(row: &PgRow, tiers: &[String]) -> Result<TimelineEntry, OpsError> {
    let at: DateTime<Utc> = row.try_get("occurred_at")?;
    let kind: String = row.try_get("kind")?;
    let status: Option<String> = row.try_get("status")?;
    let deliveries: i32 = row.try_get("deliveries")?;
    Ok(match kind.as_str() {
        "failed" => {
            let attempt: Option<i32> = row.try_get("attempt")?;
            let retrying = status.as_deref() == Some(InboxStatus::RetryableFailed.as_str());
            let kind = if parked(status.as_deref()) {
                TimelineKind::Parked
            } else {
                TimelineKind::Failed
            };
            TimelineEntry {
                attempt,
                retry_tier: attempt.filter(|_| retrying).and_then(|a| tier_of(tiers, a)),
                status,
                error_code: row.try_get("error_code")?,
                error_message: row.try_get("error_message")?,
                ..TimelineEntry::new(at, kind)
            }
        }
        "duplicate" => TimelineEntry {
            deliveries: Some(deliveries),
            status,
            until: row.try_get("until")?,
            ..TimelineEntry::new(at, TimelineKind::Duplicate)
        },
        "conflict" => TimelineEntry {
            deliveries: Some(deliveries),
            status,
            until: row.try_get("until")?,
            ..TimelineEntry::new(at, TimelineKind::Conflict)
        },
        "scrubbed" => TimelineEntry {
            status,
            ..TimelineEntry::new(at, TimelineKind::Scrubbed)
        },
        other => {
            return Err(OpsError::Store(rabbit_inbox::error::StoreError::Corrupt(
                format!("unknown inbox event kind {other:?}"),
            )));
        }
    })
}

impl Operations {
    /// The story of `message_id` for `consumer`, oldest first: its receipt, its latest
    /// attempt, each failed attempt (retried, with the tier it waits in, or parked), duplicate
    /// and conflicting deliveries, confirmed copies, recovery, every operator action on it,
    /// its processing, and its removal by retention. `retry_tiers` are the consumer's retry
    /// tier queues in order ([`rabbit_inbox::Topology::retry_tier_queues`]), to say which tier a
    /// retried message waits in; empty names none.
    ///
    /// Entries with the same instant come in the order they happen (receipt, attempt,
    /// failure, ..., processing). A message unknown to the consumer (no row, no tombstone, no
    /// audit entry, and not named as another row's replacement) is [`OpsError::NotFound`].
    pub async fn timeline(
        &self,
        consumer: &str,
        message_id: &str,
        retry_tiers: &[String],
    ) -> Result<Timeline, OpsError> {
        let t = self.schema.qualify("message_inbox");
        // The row (if any) and the row it replaces, in one statement.
        let head = sqlx::query(sql(format!(
            "SELECT m.status, m.processing_attempt, m.first_received_at, \
               m.processing_started_at, m.processed_at, m.parked_copy_at, m.retry_due_at, \
               m.last_recovered_at, m.last_conflict_at, m.payload_conflicts, m.replaced_by, \
               (SELECT p.message_id FROM {t} p \
                 WHERE p.consumer_name = $1 AND p.replaced_by = $2 \
                 ORDER BY p.message_id LIMIT 1) AS replaces \
             FROM (VALUES (1)) AS one (x) \
             LEFT JOIN {t} m ON m.consumer_name = $1 AND m.message_id = $2"
        )))
        .persistent(false)
        .bind(consumer)
        .bind(message_id)
        .fetch_one(&self.pool)
        .await?;
        // Runs of duplicate (or conflict) notes with the same status and nothing between them
        // are one entry (gaps and islands: within a run, the event's position among all and
        // among its kind grow together). The newest TIMELINE_LIMIT entries, and one more to
        // know whether any were left out.
        let mut events = sqlx::query(sql(format!(
            "SELECT min(occurred_at) AS occurred_at, \
               CASE WHEN count(*) > 1 THEN max(occurred_at) END AS until, kind, \
               min(attempt) AS attempt, sum(deliveries)::int4 AS deliveries, status, \
               min(error_code) AS error_code, min(error_message) AS error_message, \
               min(event_id) AS first_event \
             FROM (SELECT e.*, \
                 CASE WHEN kind IN ('duplicate', 'conflict') \
                   THEN row_number() OVER (ORDER BY occurred_at, event_id) \
                     - row_number() OVER (PARTITION BY kind, status \
                                          ORDER BY occurred_at, event_id) \
                   ELSE -event_id END AS run \
               FROM {} e WHERE consumer_name = $1 AND message_id = $2) runs \
             GROUP BY kind, status, run \
             ORDER BY min(occurred_at) DESC, min(event_id) DESC LIMIT $3 + 1",
            self.schema.qualify("inbox_event")
        )))
        .persistent(false)
        .bind(consumer)
        .bind(message_id)
        .bind(TIMELINE_LIMIT)
        .fetch_all(&self.pool)
        .await?;
        let mut audit = sqlx::query(sql(format!(
            "SELECT occurred_at, action, actor, reason, ticket FROM {} \
             WHERE consumer_name = $1 AND message_id = $2 ORDER BY audit_id DESC LIMIT $3 + 1",
            self.schema.qualify("inbox_audit")
        )))
        .persistent(false)
        .bind(consumer)
        .bind(message_id)
        .bind(TIMELINE_LIMIT)
        .fetch_all(&self.pool)
        .await?;
        let limit = usize::try_from(TIMELINE_LIMIT).unwrap_or(usize::MAX);
        let truncated = events.len() > limit || audit.len() > limit;
        events.truncate(limit);
        audit.truncate(limit);
        events.reverse();
        audit.reverse();
        let tombstone = sqlx::query(sql(format!(
            "SELECT final_status, removed_at FROM {} \
             WHERE consumer_name = $1 AND message_id = $2",
            self.schema.qualify("inbox_tombstone")
        )))
        .persistent(false)
        .bind(consumer)
        .bind(message_id)
        .fetch_optional(&self.pool)
        .await?;

        let status = head
            .try_get::<Option<String>, _>("status")?
            .map(|s| s.parse::<InboxStatus>())
            .transpose()?;
        let replaced_by: Option<String> = head.try_get("replaced_by")?;
        let replaces: Option<String> = head.try_get("replaces")?;
        if status.is_none() && tombstone.is_none() && audit.is_empty() && replaces.is_none() {
            return Err(OpsError::NotFound(format!(
                "no message {message_id} for consumer {consumer}: no row, tombstone or audit \
                 entry"
            )));
        }

        let mut entries = Vec::with_capacity(events.len() + audit.len() + 8);
        if status.is_some() {
            let has_conflict_events = events.iter().any(|e| {
                e.try_get::<String, _>("kind")
                    .is_ok_and(|k| k == "conflict")
            });
            entries.extend(row_entries(&head, retry_tiers, has_conflict_events)?);
        }
        for event in &events {
            entries.push(event_entry(event, retry_tiers)?);
        }
        for row in &audit {
            entries.push(TimelineEntry {
                action: Some(row.try_get("action")?),
                actor: Some(row.try_get("actor")?),
                reason: Some(row.try_get("reason")?),
                ticket: row.try_get("ticket")?,
                ..TimelineEntry::new(row.try_get("occurred_at")?, TimelineKind::Audit)
            });
        }
        if let Some(row) = &tombstone {
            entries.push(TimelineEntry {
                status: Some(row.try_get("final_status")?),
                ..TimelineEntry::new(row.try_get("removed_at")?, TimelineKind::Removed)
            });
        }
        // Stable: events and audit entries keep their own order within an instant.
        entries.sort_by_key(|e| (e.at, e.kind.rank()));
        Ok(Timeline {
            consumer: consumer.to_owned(),
            message_id: message_id.to_owned(),
            status,
            replaced_by,
            replaces,
            entries,
            truncated,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_tiers_follow_the_attempt_clamped_at_the_last() {
        let tiers: Vec<String> = ["q.retry.1s", "q.retry.5s"].map(String::from).into();
        assert_eq!(tier_of(&tiers, 1).as_deref(), Some("q.retry.1s"));
        assert_eq!(tier_of(&tiers, 2).as_deref(), Some("q.retry.5s"));
        assert_eq!(tier_of(&tiers, 7).as_deref(), Some("q.retry.5s"));
        assert_eq!(tier_of(&tiers, 0).as_deref(), Some("q.retry.1s"));
        assert_eq!(tier_of(&[], 1), None);
    }

    #[test]
    fn kinds_serialize_in_snake_case() {
        let json = serde_json::to_value([
            TimelineKind::AttemptStarted,
            TimelineKind::ParkedCopyConfirmed,
            TimelineKind::RetryDue,
        ])
        .expect("serializes");
        assert_eq!(
            json,
            serde_json::json!(["attempt_started", "parked_copy_confirmed", "retry_due"])
        );
    }

    #[test]
    fn only_parked_statuses_park() {
        assert!(parked(Some("POISONED")));
        assert!(parked(Some("MANUAL_REVIEW")));
        assert!(!parked(Some("RETRYABLE_FAILED")));
        assert!(!parked(None));
    }
}
