//! The delivery state machine's vocabulary: what a row's status is, what a delivery's durable
//! outcome is, and the error codes the library itself records. Everything else builds on these
//! words; this module imports nothing of the crate but the error type its parser returns.
//!
//! Each [`InboxStatus`] and each [`Outcome`] maps to exactly one broker action (see
//! ARCHITECTURE.md), so the ledger and the broker cannot disagree.

use std::{fmt, str::FromStr, time::Duration};

use crate::error::StoreError;

/// Status of an inbox row. Each one maps to exactly one broker action, so the ledger and the
/// broker cannot disagree (see ARCHITECTURE.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
#[non_exhaustive]
pub enum InboxStatus {
    /// Being worked on. The transactional mode never commits it (its claim commits PROCESSED
    /// with the effect); leased mode commits it with a lease while the work runs outside any
    /// transaction. Broker: the delivery is unacked. Any other committed PROCESSING row comes
    /// from a custom loop or a crash mid-way there.
    Processing,
    /// The business effect committed. Broker: ack.
    Processed,
    /// Failed, will be retried. Broker: dead-lettered to the delayed retry queue.
    RetryableFailed,
    /// Invalid message or business rule violated. Broker: parked.
    PermanentFailed,
    /// Retries exhausted. Broker: parked.
    Poisoned,
    /// Recovery found the row stale or its retry lost and set it aside for an operator
    /// (the manual-review recovery policy of the operator crate, or no payload kept to
    /// republish).
    /// Broker: a copy that still turns up is parked.
    ManualReview,
    /// Ordered consumers only: the message waits behind an earlier message of its ordering
    /// key that failed, is parked, or (with sequence numbers) has not arrived. Its body is in
    /// the row. Broker: ack; the release task publishes it again when its turn comes.
    Held,
}

impl InboxStatus {
    /// Every status, in the order above (the values the `status` column's check allows). A
    /// slice, so a new status does not change its type.
    pub const ALL: &'static [InboxStatus] = &[
        InboxStatus::Processing,
        InboxStatus::Processed,
        InboxStatus::RetryableFailed,
        InboxStatus::PermanentFailed,
        InboxStatus::Poisoned,
        InboxStatus::ManualReview,
        InboxStatus::Held,
    ];

    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            InboxStatus::Processing => "PROCESSING",
            InboxStatus::Processed => "PROCESSED",
            InboxStatus::RetryableFailed => "RETRYABLE_FAILED",
            InboxStatus::PermanentFailed => "PERMANENT_FAILED",
            InboxStatus::Poisoned => "POISONED",
            InboxStatus::ManualReview => "MANUAL_REVIEW",
            InboxStatus::Held => "HELD",
        }
    }

    /// Whether copies of the message belong in the parking lot when its row has this status
    /// (only an explicit, audited reopen changes such a row).
    pub fn is_parked(self) -> bool {
        matches!(
            self,
            InboxStatus::PermanentFailed | InboxStatus::Poisoned | InboxStatus::ManualReview
        )
    }
}

// A status added to the enum stops this compiling: add it to `InboxStatus::ALL` too.
const _: () = {
    let mut i = 0;
    while i < InboxStatus::ALL.len() {
        match InboxStatus::ALL[i] {
            InboxStatus::Processing
            | InboxStatus::Processed
            | InboxStatus::RetryableFailed
            | InboxStatus::PermanentFailed
            | InboxStatus::Poisoned
            | InboxStatus::ManualReview
            | InboxStatus::Held => {}
        }
        i += 1;
    }
};

impl fmt::Display for InboxStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for InboxStatus {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, StoreError> {
        Ok(match s {
            "PROCESSING" => InboxStatus::Processing,
            "PROCESSED" => InboxStatus::Processed,
            "RETRYABLE_FAILED" => InboxStatus::RetryableFailed,
            "PERMANENT_FAILED" => InboxStatus::PermanentFailed,
            "POISONED" => InboxStatus::Poisoned,
            "MANUAL_REVIEW" => InboxStatus::ManualReview,
            "HELD" => InboxStatus::Held,
            other => return Err(StoreError::Corrupt(format!("unknown status {other:?}"))),
        })
    }
}

/// The durable result of one delivery, produced only after the state it describes is committed
/// (or when none could be written). Each maps to one broker action (see ARCHITECTURE.md).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// This delivery's effect committed now. Broker: ack.
    Processed,
    /// The effect had already committed. Broker: ack.
    Duplicate,
    /// RETRYABLE_FAILED recorded. Broker: to the delayed retry queue.
    RetryScheduled {
        /// Attempts made so far.
        attempt: i32,
        /// Error code.
        code: String,
    },
    /// PERMANENT_FAILED or POISONED recorded (or a body conflict counted). Broker: parked with
    /// the reason in headers.
    Parked {
        /// Recorded status of the row.
        status: InboxStatus,
        /// Error code.
        code: String,
        /// Error message.
        message: String,
        /// The row's attempt count when this copy is the row's own (noted on the row once
        /// the parking lot confirms it); `None` for a copy that is not the row's (a payload
        /// conflict), which is parked every time.
        attempt: Option<i32>,
    },
    /// A confirmed copy of the message already waits in the broker for its row: the parked
    /// copy of a parked row, or the retry copy of a RETRYABLE_FAILED row that is not due yet.
    /// This delivery is a duplicate of it, counted on the row, and runs nothing and charges
    /// no attempt. Broker: ack.
    CopyPending {
        /// Which copy.
        copy: PendingCopy,
    },
    /// Another consumer holds a fresh PROCESSING row for this key. Broker: delayed retry.
    InFlightElsewhere,
    /// Ordered consumers: HELD recorded, with the body, behind an earlier message of its
    /// ordering key; or a copy of a held message whose turn has not come (counted on the
    /// row). Broker: ack.
    Held,
    /// Nothing durable could be written (database unreachable, commit outcome unknown).
    /// Broker: requeued after a back-off, so the message comes back.
    Unrecorded {
        /// Why.
        error: String,
    },
}

/// Error code of a body that differs from the one first recorded under the same key.
pub const PAYLOAD_CONFLICT: &str = "payload_conflict";

/// Error code of a message whose handler left the transaction unusable: it ignored a failed
/// statement (the transaction is aborted) or ended the transaction itself.
pub const TRANSACTION_ABORTED: &str = "transaction_aborted";

/// Error code recorded when a handler panics. The message is parked with the panic's text: a
/// panic in a handler is a bug the message exposed, and retrying runs into it again.
pub const HANDLER_PANICKED: &str = "handler_panicked";

/// Error code of a database error that says the deployment is wrong, not the message (an
/// undefined table, column, function, type or schema; a missing privilege). Never recorded on
/// a row: the deliveries are requeued with back-off until the deployment is fixed.
pub const DEPLOYMENT_FAULT: &str = "db_deployment_fault";

/// Error code of a message whose type (or version of it) no handler takes: refused at parse
/// time under [`crate::envelope::EnvelopeRules::accepted_types`], or by a
/// [`crate::router::Router`] without a route for it. Permanent.
pub const UNKNOWN_MESSAGE_TYPE: &str = "unknown_message_type";

/// Error code of a message whose business sequence number the key has already passed (a
/// sequence gap released by policy, or a number sent twice). Parked; it does not block the key.
pub const SEQUENCE_PASSED: &str = "sequence_passed";

/// Error code of an ordered message whose ordering header cannot be used: a sequence number
/// that is missing or not an integer, or a key header longer than 255 bytes. Parked; it does
/// not block the key.
pub const ORDER_HEADER_INVALID: &str = "order_header_invalid";

/// Error code recorded on the held messages of a key whose sequence gap outlived its timeout
/// (released past the gap, or parked, as the policy says).
pub const SEQUENCE_GAP: &str = "sequence_gap";

/// Error code of a handler's failure caused by a lost lease (see [`crate::LeaseError::Lost`]).
pub const LEASE_LOST: &str = "lease_lost";

/// A confirmed copy the broker holds for a row; another delivery of the message is acked as
/// its duplicate (and counted on the row) instead of being copied or run again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PendingCopy {
    /// The row is parked and its copy is in the parking lot.
    Parked,
    /// The row waits for a retry whose copy is in a retry tier and not yet due.
    Retry,
}

/// A copy whose publish the broker confirmed, to be noted on its row (see
/// [`crate::store::InboxStore::note_confirmed_copies`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ConfirmedCopy {
    /// Dedup key of the row.
    pub message_id: String,
    /// The row's attempt count the copy was made for.
    pub attempt: i32,
    /// Where it went.
    pub kind: ConfirmedCopyKind,
}

/// Where a confirmed copy went.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum ConfirmedCopyKind {
    /// The parking lot.
    Parked,
    /// A retry tier, due back after this delay.
    Retry(Duration),
}

/// Headers the consumer adds to a parked message. Replay tools read them.
pub mod parking_headers {
    /// Inbox status of the row (`PERMANENT_FAILED`, `POISONED`, ...).
    pub const STATUS: &str = "x-inbox-status";
    /// Stable error code.
    pub const ERROR_CODE: &str = "x-inbox-error-code";
    /// Error message (truncated).
    pub const ERROR: &str = "x-inbox-error";
    /// Consumer that parked it.
    pub const CONSUMER: &str = "x-inbox-consumer";
    /// Inbox key of the row (a synthetic `invalid:` key for messages without a usable id).
    pub const INBOX_KEY: &str = "x-inbox-message-id";
    /// Unix milliseconds when it was parked.
    pub const PARKED_AT: &str = "x-inbox-parked-at";
    /// Exchange and routing key it first arrived with, for replay. Kept from the first
    /// delivery through the retry tiers.
    pub const ORIGINAL_EXCHANGE: &str = "x-inbox-original-exchange";
    /// See [`ORIGINAL_EXCHANGE`].
    pub const ORIGINAL_ROUTING_KEY: &str = "x-inbox-original-routing-key";
    /// The producer's `expiration` property. Copies to the retry tiers and the parking lot do
    /// not carry it (a parked copy would expire out of the parking lot); a redrive restores it.
    pub const ORIGINAL_EXPIRATION: &str = "x-inbox-original-expiration";
    /// The producer's `user-id` property. Copies do not carry it: the broker refuses a
    /// publish whose `user-id` is not the publishing connection's user.
    pub const ORIGINAL_USER_ID: &str = "x-inbox-original-user-id";
    /// On a copy that could not carry all of the producer's headers within the broker's
    /// `frame_max`: how many of them were dropped (the largest first) and their encoded size,
    /// as a table `{count, bytes}`. The inbox row's error says so too.
    pub const HEADERS_DROPPED: &str = "x-inbox-headers-dropped";
    /// On a copy sent to a retry tier: the attempt whose failure scheduled it. The copy that
    /// comes back with the row's current attempt is the scheduled retry and runs; other
    /// copies of the message that arrive before it is due are acked as duplicates.
    pub const RETRY_ATTEMPT: &str = "x-inbox-retry-attempt";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_round_trips_through_its_stored_value() {
        for &s in InboxStatus::ALL {
            assert_eq!(s.as_str().parse::<InboxStatus>().ok(), Some(s));
        }
        assert!("DONE".parse::<InboxStatus>().is_err());
    }
}
