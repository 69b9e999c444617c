//! The ledger's tables as SQL sees them, shared by the library's statements and the operator
//! crate's: the table names, the status values and sets spliced into statements (rendered from
//! [`InboxStatus`], so no statement spells a status by hand), and the conditions several
//! statements must agree on (what a stale claim is, by how much an open row is overdue).
//!
//! Below the ledger ([`crate::store`]) and everything else that writes SQL; above [`status`],
//! whose words it renders. Values are always bound; only these fragments and a validated
//! [`crate::SchemaName`] are spliced.
//!
//! [`status`]: crate::status

use std::fmt;

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use crate::status::InboxStatus;

/// The tables the migrations create, unqualified (see [`crate::SchemaName::qualify`]).
pub mod tables {
    /// One row per `(message_id, consumer_name)`: the inbox ledger.
    pub const MESSAGE_INBOX: &str = "message_inbox";
    /// Append-only record of operator actions (replay, reopen, purge): who, when, what, why.
    pub const INBOX_AUDIT: &str = "inbox_audit";
    /// What happened to a row that the row keeps only the latest of (failed attempts,
    /// duplicates dropped, conflicting bodies); written by triggers.
    pub const INBOX_EVENT: &str = "inbox_event";
    /// What is left of a row retention removed: enough to recognize the message when it comes
    /// back.
    pub const INBOX_TOMBSTONE: &str = "inbox_tombstone";
    /// Rows retention moved out instead of deleting them (retention mode "archive").
    pub const INBOX_ARCHIVE: &str = "inbox_archive";
    /// How far each retention pass has got.
    pub const INBOX_RETENTION_MARK: &str = "inbox_retention_mark";
    /// Messages written in business transactions, waiting for the relay.
    pub const OUTBOX: &str = "outbox";
    /// Per ordering key of an ordered consumer: its blocking head, held messages, next
    /// sequence number.
    pub const INBOX_ORDER_KEY: &str = "inbox_order_key";
    /// The last position taken per ordering key of the outbox.
    pub const OUTBOX_STREAM: &str = "outbox_stream";
}

/// Statuses as SQL text: rendered as their quoted values separated by `, `, so one status
/// is a literal (`status = {PROCESSED}` gives `status = 'PROCESSED'`) and several are the list
/// of an `IN` (`status IN ({PARKED})`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Statuses(pub &'static [InboxStatus]);

impl Statuses {
    /// The stored values, for binding as an array (`status = ANY($1)`).
    pub fn names(self) -> Vec<&'static str> {
        self.0.iter().map(|s| s.as_str()).collect()
    }

    /// Whether `status` is one of them.
    pub fn contains(self, status: InboxStatus) -> bool {
        self.0.contains(&status)
    }
}

impl fmt::Display for Statuses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, status) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "'{}'", status.as_str())?;
        }
        Ok(())
    }
}

/// [`InboxStatus::Processing`] as an SQL literal.
pub const PROCESSING: Statuses = Statuses(&[InboxStatus::Processing]);
/// [`InboxStatus::Processed`] as an SQL literal.
pub const PROCESSED: Statuses = Statuses(&[InboxStatus::Processed]);
/// [`InboxStatus::RetryableFailed`] as an SQL literal.
pub const RETRYABLE_FAILED: Statuses = Statuses(&[InboxStatus::RetryableFailed]);
/// [`InboxStatus::PermanentFailed`] as an SQL literal.
pub const PERMANENT_FAILED: Statuses = Statuses(&[InboxStatus::PermanentFailed]);
/// [`InboxStatus::Poisoned`] as an SQL literal.
pub const POISONED: Statuses = Statuses(&[InboxStatus::Poisoned]);
/// [`InboxStatus::ManualReview`] as an SQL literal.
pub const MANUAL_REVIEW: Statuses = Statuses(&[InboxStatus::ManualReview]);

/// The parked statuses ([`InboxStatus::is_parked`]): only an explicit, audited reopen changes
/// such a row, and copies of its message belong in the parking lot.
pub const PARKED: Statuses = Statuses(&[
    InboxStatus::PermanentFailed,
    InboxStatus::Poisoned,
    InboxStatus::ManualReview,
]);

/// The statuses a failure never changes: PROCESSED (another copy committed the effect, the
/// failure is moot) and the [`PARKED`] ones.
pub const CLOSED_TO_FAILURES: Statuses = Statuses(&[
    InboxStatus::Processed,
    InboxStatus::PermanentFailed,
    InboxStatus::Poisoned,
    InboxStatus::ManualReview,
]);

/// The SQL condition of a stale PROCESSING row, with the stale threshold (seconds) in
/// placeholder `secs`: a leased row whose lease expired, or an unleased row whose claim is
/// older than the threshold. A leased row whose worker still heartbeats is never stale, however
/// long it runs. The lease takeover, `status` and the sampler use it; recovery's causes
/// (`lease_expired`, `stale_processing`) split the same condition in two.
pub fn stale_processing(secs: &str) -> String {
    format!(
        "(status = {PROCESSING} AND (lease_expires_at < now() OR (lease_expires_at IS NULL \
           AND coalesce(processing_started_at, last_received_at) < now() - make_interval(secs => {secs}))))"
    )
}

/// The SQL interval by which an open row is overdue, with each attempt's retry delay
/// (seconds, the last for later attempts) in placeholder `delays`: a committed PROCESSING row
/// since its claim (unless its lease is alive), a RETRYABLE_FAILED row since its retry delay
/// passed; NULL for the rest (parked rows, live leases). Negative while a retry still waits.
/// The sampler's "oldest unprocessed" gauge and `status` share it, so a backlog signal never
/// fires on rows that are only waiting for their retry.
pub fn overdue_by(delays: &str) -> String {
    format!(
        "CASE \
           WHEN status = {PROCESSING} AND lease_expires_at > now() THEN NULL \
           WHEN status = {PROCESSING} THEN now() - coalesce(processing_started_at, last_received_at) \
           WHEN status = {RETRYABLE_FAILED} THEN now() - last_failed_at - make_interval(secs => \
             ({delays}::float8[])[least(greatest(processing_attempt, 1), cardinality({delays}::float8[]))]) \
         END"
    )
}

/// Shared (cheaply cloned) SQL text built from a validated schema name and the fragments of
/// this module.
pub fn audited(sql: String) -> SqlStr {
    AssertSqlSafe(std::sync::Arc::<str>::from(sql)).into_sql_str()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_literals_and_lists() {
        assert_eq!(PROCESSED.to_string(), "'PROCESSED'");
        assert_eq!(
            PARKED.to_string(),
            "'PERMANENT_FAILED', 'POISONED', 'MANUAL_REVIEW'"
        );
        assert_eq!(
            Statuses(&[InboxStatus::RetryableFailed, InboxStatus::Processing]).names(),
            ["RETRYABLE_FAILED", "PROCESSING"]
        );
    }

    #[test]
    fn sets_follow_the_state_machine() {
        for &status in InboxStatus::ALL {
            assert_eq!(PARKED.contains(status), status.is_parked(), "{status}");
            assert_eq!(
                CLOSED_TO_FAILURES.contains(status),
                status.is_parked() || status == InboxStatus::Processed,
                "{status}"
            );
        }
    }
}
