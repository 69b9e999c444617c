//! # inbox-ops
//!
//! The operator API of rabbit-inbox: what an operator (through `inboxctl` or the admin HTTP
//! API) does when something goes wrong, on a live inbox. Each operation is written once, here;
//! front ends only parse arguments and render results. Also the operations that run on a timer
//! beside a consumer ([`RetentionTask`], [`RecoveryTask`]) under a [`rabbit_inbox::Runner`],
//! and [`Service`], which builds a consumer with all of its background work in one place.
//!
//! Feature `management` (off by default) adds the broker's management HTTP API
//! (`ManagementClient`) and the doctor's topology checks that read it; without it the crate
//! needs no HTTP client.
//!
//! This crate sits above the consumer runtime, which knows nothing of it.
//!
//! **Invariant:** an operation that changes a row or moves a message takes an [`Actor`] and
//! writes `inbox_audit` in the same transaction as the change; no operation deletes inbox
//! evidence except retention, which leaves a tombstone.

mod activity;
mod alerts;
mod audit;
mod doctor;
#[cfg(feature = "fault-injection")]
mod fault;
mod history;
mod inspect;
#[cfg(feature = "management")]
mod management;
mod recover;
mod redrive;
mod reopen;
mod replay;
mod retention;
mod service;

pub use activity::{ActivityBucket, ActivityQuery, ActivityReport, ConsumerActivity};
pub use alerts::{
    ALERT_DEDUP_WINDOW_HEADROOM, ALERT_DUPLICATE_SPIKE, ALERT_OLDEST_UNPROCESSED_AGE,
    ALERT_PARKING_LOT_GROWING, ALERT_STALE_PROCESSING, AlertQuery, LedgerAlert,
};
pub use audit::{AuditFilter, PAYLOAD_READ, audit};
pub use doctor::{Area, Check, DoctorReport, DoctorRequest, Severity, check_ids};
#[cfg(feature = "fault-injection")]
pub use fault::{RedriveFaults, RedriveStep};
pub use history::{TIMELINE_LIMIT, Timeline, TimelineEntry, TimelineKind};
pub use inspect::{
    AuditEntry, BrokerDepths, BrokerLocation, FailureGroup, ListFilter, ListPage, OPEN_STATUSES,
    Payload, RowDetail, RowSummary, ShowQuery, ShowReport, StatusLine, StatusQuery, StatusReport,
    Tombstone,
};
#[cfg(feature = "management")]
pub use management::{
    DEFAULT_MANAGEMENT_PORT, DEFAULT_MANAGEMENT_TLS_PORT, ManagementClient, ManagementError,
    QueueCounts, QueueInfo, QueueSetting,
};
pub use recover::RecoveryTask;
pub use recover::{
    RECOVERY_HEADER, RecoverRequest, RecoveredMessage, RecoveryAction, RecoveryCause,
    RecoveryConfig, RecoveryPolicy, RecoveryReport,
};
pub use redrive::{
    DISCARD, DROP_PROCESSED, DROP_REDRIVEN, Finding, MAX_REDRIVE_RATE, MIN_REDRIVE_RATE,
    ParkedAction, ParkedClass, REDRIVE, RedriveReport, RedriveRequest, planned_action,
};
pub use reopen::{FORCED_REPLAY, REOPEN, Reopened};
pub use replay::{
    DiffLine, DiffOp, REPLACEMENT_NAMESPACE, REPLACES_HEADER, REPLAY_EDITED, ReplayEditedReport,
    ReplayEditedRequest, WorkQueue, replacement_id,
};
pub use retention::{CleanupReport, CleanupRequest, RetentionTask};
pub use service::{
    DEFAULT_RETENTION_INTERVAL, DEFAULT_SAMPLER_INTERVAL, DEFAULT_SHUTDOWN_TIMEOUT, PoolShares,
    Service, ServiceBuilder,
};

use std::sync::Arc;

use sqlx::PgPool;

use rabbit_inbox::{BrokerError, error::StoreError, privacy::Keyring, schema::SchemaName};

/// Longest actor name accepted, in characters.
pub const MAX_ACTOR_CHARS: usize = 200;
/// Longest reason accepted, in characters: the audit trail is append-only, so what is written
/// there stays; a reason is a sentence or two, not a document.
pub const MAX_REASON_CHARS: usize = 1000;
/// Longest ticket reference accepted, in characters.
pub const MAX_TICKET_CHARS: usize = 200;

fn bounded(what: &str, text: &str, max: usize) -> Result<(), OpsError> {
    no_nul(what, text)?;
    let n = text.chars().count();
    if n > max {
        return Err(OpsError::Invalid(format!(
            "the {what} is {n} characters long; at most {max} are accepted"
        )));
    }
    Ok(())
}

/// Refuses `text` if it holds a NUL character: PostgreSQL's text cannot store one, so it is
/// a wrong request (naming `what`), not a database failure.
pub fn no_nul(what: &str, text: &str) -> Result<(), OpsError> {
    if text.contains('\0') {
        return Err(OpsError::Invalid(format!(
            "the {what} contains a NUL character, which the inbox cannot store"
        )));
    }
    Ok(())
}

/// Who asks for a change, and why. Required by every operation that changes a row or moves a
/// message, and written to `inbox_audit`. Its name, reason and ticket are bounded
/// ([`MAX_ACTOR_CHARS`], [`MAX_REASON_CHARS`], [`MAX_TICKET_CHARS`]) whatever the front end.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Actor {
    name: String,
    reason: String,
    ticket: Option<String>,
}

impl Actor {
    /// An operator (or a token's name) with the reason for the action. Both must be non-blank
    /// and within their bounds.
    pub fn new(name: impl Into<String>, reason: impl Into<String>) -> Result<Self, OpsError> {
        let (name, reason) = (name.into(), reason.into());
        if name.trim().is_empty() {
            return Err(OpsError::Invalid("an actor name is required".into()));
        }
        if reason.trim().is_empty() {
            return Err(OpsError::Invalid("a reason is required".into()));
        }
        bounded("actor name", &name, MAX_ACTOR_CHARS)?;
        bounded("reason", &reason, MAX_REASON_CHARS)?;
        Ok(Self {
            name,
            reason,
            ticket: None,
        })
    }

    /// Cites a ticket (incident, change request) beside the reason; a blank one cites none.
    pub fn with_ticket(mut self, ticket: impl Into<String>) -> Result<Self, OpsError> {
        let ticket = ticket.into();
        bounded("ticket", &ticket, MAX_TICKET_CHARS)?;
        self.ticket = (!ticket.trim().is_empty()).then_some(ticket);
        Ok(self)
    }

    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Why the action is taken.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The cited ticket, if any.
    pub fn ticket(&self) -> Option<&str> {
        self.ticket.as_deref()
    }
}

/// Progress of a long operation, reported as it goes (a progress bar in the CLI, nothing in
/// the HTTP API).
pub trait Progress: Send + Sync {
    /// The total is known (or has changed).
    fn set_total(&self, _total: u64) {}
    /// `n` more items are done.
    fn advance(&self, _n: u64) {}
}

/// Reports nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoProgress;

impl Progress for NoProgress {}

/// Why an operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// The request itself is wrong (missing actor or reason, bad filter).
    #[error("{0}")]
    Invalid(String),
    /// The message it names has no row, tombstone or audit entry for that consumer.
    #[error("{0}")]
    NotFound(String),
    /// The operation would be unsafe and was refused; the message says what would force it.
    #[error("refused: {0}")]
    Refused(String),
    /// The inbox could not be read or written.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The broker could not be reached or refused an action.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The schema holds no inbox (its tables were never migrated there, or the schema is
    /// another one): see [`Operations::require_inbox`].
    #[error("no inbox in schema {schema} (run `inboxctl migrate --schema {schema}`)")]
    NoInbox {
        /// The schema asked for.
        schema: String,
    },
}

impl From<sqlx::Error> for OpsError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(StoreError::Database(e))
    }
}

/// The operations on one inbox schema. Cheap to clone; holds a pool, not a connection.
#[derive(Clone, Debug)]
pub struct Operations {
    pool: PgPool,
    schema: SchemaName,
    keyring: Option<Arc<Keyring>>,
    #[cfg(feature = "fault-injection")]
    redrive_faults: Arc<crate::fault::RedriveFaults>,
}

impl Operations {
    /// Operations on the inbox in `schema`.
    pub fn new(pool: PgPool, schema: SchemaName) -> Self {
        Self {
            pool,
            schema,
            keyring: None,
            #[cfg(feature = "fault-injection")]
            redrive_faults: Arc::default(),
        }
    }

    /// Opens encrypted payloads with `keyring` (the consumer's, see
    /// [`rabbit_inbox::privacy::PayloadPrivacy::encrypt_with`]): `show` returns them decrypted and
    /// `recover` can republish them. Without it they stay sealed: `show` says which key sealed
    /// them and `recover` leaves their rows unchanged.
    pub fn with_keyring(mut self, keyring: Arc<Keyring>) -> Self {
        self.keyring = Some(keyring);
        self
    }

    /// The pool the operations run on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The inbox's schema.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// Whether the schema holds an inbox (its `message_inbox` table exists).
    pub async fn inbox_exists(&self) -> Result<bool, OpsError> {
        Ok(sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(self.schema.qualify("message_inbox"))
            .fetch_one(&self.pool)
            .await?)
    }

    /// [`OpsError::NoInbox`] unless the schema holds an inbox: what a front end checks before
    /// reading, so that a wrong or unmigrated schema is named as such, not reported as the
    /// database's error about a missing relation.
    pub async fn require_inbox(&self) -> Result<(), OpsError> {
        if self.inbox_exists().await? {
            Ok(())
        } else {
            Err(OpsError::NoInbox {
                schema: self.schema.as_str().to_owned(),
            })
        }
    }

    /// `error`, or [`OpsError::NoInbox`] when it is a database error and the schema holds no
    /// inbox: how a failure of an operation is told once it happened (no extra statement on
    /// the way to a success).
    pub async fn explain(&self, error: OpsError) -> OpsError {
        match &error {
            OpsError::Store(StoreError::Database(sqlx::Error::Database(_))) => {
                match self.inbox_exists().await {
                    Ok(false) => OpsError::NoInbox {
                        schema: self.schema.as_str().to_owned(),
                    },
                    _ => error,
                }
            }
            _ => error,
        }
    }

    /// Kills to inject into `redrive` (tests); shared by this value's clones.
    #[cfg(feature = "fault-injection")]
    pub fn redrive_faults(&self) -> Arc<crate::fault::RedriveFaults> {
        self.redrive_faults.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actor_needs_a_name_and_a_reason() {
        assert!(Actor::new("", "fix deployed").is_err());
        assert!(Actor::new("alice", "  ").is_err());
        let a = Actor::new("alice", "fix deployed")
            .expect("valid")
            .with_ticket("")
            .expect("no ticket");
        assert_eq!(a.ticket(), None);
        assert_eq!(
            a.with_ticket("INC-42").expect("valid ticket").ticket(),
            Some("INC-42")
        );
    }

    #[test]
    fn actor_reason_and_ticket_are_bounded() {
        let longest = "r".repeat(MAX_REASON_CHARS);
        let actor = Actor::new("alice", &longest).expect("the longest reason");
        assert!(Actor::new("alice", format!("{longest}r")).is_err());
        assert!(Actor::new("a".repeat(MAX_ACTOR_CHARS + 1), "why").is_err());
        assert!(
            actor
                .clone()
                .with_ticket("t".repeat(MAX_TICKET_CHARS))
                .is_ok()
        );
        let e = actor
            .with_ticket("t".repeat(MAX_TICKET_CHARS + 1))
            .expect_err("too long");
        assert!(e.to_string().contains("ticket"), "{e}");
    }

    /// The admin HTTP API runs operations on a multi-threaded runtime: their futures must be
    /// `Send` (this compiles only if they are).
    #[allow(dead_code)]
    fn operations_are_send(
        ops: &Operations,
        lot: &rabbit_inbox::broker::ParkingLot,
        actor: &Actor,
        broker: &rabbit_inbox::broker::Broker,
    ) {
        fn send<T: Send>(_: &T) {}
        send(&ops.status(&StatusQuery::default(), Some(lot)));
        send(&ops.list(&ListFilter::default()));
        send(&ops.failure_groups(None));
        send(&ops.reopen("m", "c", actor, false));
        send(&ops.redrive(lot, &RedriveRequest::default(), Some(actor), &NoProgress));
        send(&ops.replay_edited(
            &WorkQueue::new(broker, "q"),
            Some(lot),
            &ReplayEditedRequest::default(),
            actor,
        ));
        send(&ops.doctor(&DoctorRequest::default()));
        send(&ops.show(&ShowQuery {
            message_id: "m".into(),
            consumer: None,
            topology: None,
        }));
    }
}
