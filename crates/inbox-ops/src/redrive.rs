//! Redrive: moving parked messages back to their work queue after a fix, each one classified
//! against its inbox row first.
//!
//! | parked copy's row              | class          | redrive does                             |
//! |--------------------------------|----------------|------------------------------------------|
//! | PERMANENT_FAILED / POISONED /  | `reopen`       | reopen the row (audited), move the copy  |
//! | MANUAL_REVIEW                  |                |                                          |
//! | RETRYABLE_FAILED / PROCESSING  | `resume`       | move the copy (row already open: an      |
//! |                                |                | earlier redrive stopped midway)          |
//! | PROCESSED, after a redrive     | `redriven`     | remove it, audited (left over by a       |
//! | moved the same message         |                | redrive killed before its ack)           |
//! | PROCESSED                      | `processed`    | leave it (a finding); `drop_processed`   |
//! |                                |                | removes it, audited                      |
//! | none, tombstone kept           | `would_reapply`| refuse; `force` replays it, audited      |
//! | none, no tombstone (or no key) | `unknown`      | refuse; `force` moves it, audited        |
//!
//! With `discard` the walker removes instead of moving: a copy whose row is parked is acked
//! away (audited `discard`, one audit row per copy, committed before the ack) and its row
//! keeps its status and data as evidence; copies of other classes are left where they are
//! (but for `redriven` leftovers, which every pass removes). `force` and `drop_processed` are
//! redrive options, refused with `discard`.
//! `message_ids` narrows either kind of run to the copies of the listed inbox keys: how an
//! operator acts on a search result.
//!
//! What happens to a copy is decided once ([`planned_action`]), for the dry run and the real
//! run alike, so a preview shows what the run will do.
//!
//! A move is: reopen the row and write the audit record in one transaction and commit it,
//! publish the restored original to the work queue through the default exchange and wait for
//! the confirm, and only then ack the parked copy. The row is open before any copy of it can
//! reach the consumer, so the moved copy never meets a parked row. Whatever the step a redrive
//! is killed at, the message exists at least once and its effect applies once, and a rerun
//! finishes the job:
//! - before the commit: nothing changed; the parked copy (never acked) returns to the parking
//!   lot and the rerun reopens and moves it;
//! - after the commit, before the publish: the row is open and its only copy is the parked
//!   one, back in the parking lot: the rerun resumes it (and without a rerun, recovery
//!   republishes a RETRYABLE_FAILED row whose retry never came back);
//! - after the confirm, before the ack: the parked copy comes back as well; the rerun resumes
//!   it while its row is still open (the inbox drops the second copy as a duplicate), or,
//!   once the moved copy was processed, classes it `redriven` and removes it.
//!
//! Copies left alone stay unacked until the pass ends, so one pass reads each copy once; they
//! then go back to the parking lot in their places. A pass reads at most as many copies as the
//! parking lot held when it started: messages parked meanwhile wait for the next pass.
//!
//! Copies a pass holds are invisible to any other reader of the queue, so two passes over one
//! parking lot at once would each see a part of it: a redrive would leave behind what the
//! other held. Every pass (a redrive, its dry run, a discard, the doctor's reconciliation)
//! therefore holds a `LotLock`, a PostgreSQL session advisory lock per schema and parking
//! lot: a redrive waits for the pass before it to end; the doctor waits a while, then reports
//! the parking lot not reconciled rather than wait behind a long redrive.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::Duration,
};

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Row};
use tokio::time::Interval;

use crate::{
    actor::Actor,
    audit::audit,
    error::OpsError,
    operations::Operations,
    progress::Progress,
    reopen::{FORCED_REPLAY, reopen_row},
    sql::OPEN,
};
use rabbit_inbox::{
    advisory_lock::{self, SessionLock},
    broker::ParkedMessage,
    broker::ParkingLot,
    broker::Republished,
    envelope::EnvelopeRules,
    envelope::parse,
    ledger_sql::PARKED,
    schema::SchemaName,
    status::InboxStatus,
};

/// Audit action of a parked copy moved back for an open row, or without an inbox row.
pub const REDRIVE: &str = "redrive";
/// Slowest redrive pace accepted: one move every 1,000 seconds.
pub const MIN_REDRIVE_RATE: f64 = 0.001;
/// Fastest redrive pace accepted, moves per second.
pub const MAX_REDRIVE_RATE: f64 = 100_000.0;
/// Audit action of a parked copy of a PROCESSED row removed from the parking lot.
pub const DROP_PROCESSED: &str = "redrive_drop_processed";
/// Audit action of a parked copy removed because a redrive already moved its message (the
/// redrive was killed before it acked the copy) and the moved copy was processed.
pub const DROP_REDRIVEN: &str = "redrive_drop_redriven";
/// Audit action of a parked copy removed by a discard, its parked row kept as evidence.
pub const DISCARD: &str = "discard";

/// What a pass read in the parking lot, for reconciliation.
#[derive(Debug, Default)]
pub(crate) struct ParkedKeys {
    /// Inbox keys (consumer, message id) of every copy read.
    pub(crate) keys: HashSet<(String, String)>,
    /// Message ids of the copies of PROCESSED rows that were parked as payload conflicts (a
    /// producer reused the id with another body): parked by design, not a lost state.
    pub(crate) processed_conflicts: Vec<String>,
    /// Per inbox key whose row is parked (PERMANENT_FAILED, POISONED, MANUAL_REVIEW), its
    /// copies read, payload conflicts aside: more than one is a duplicate parked.
    pub(crate) parked_copies: HashMap<(String, String), u64>,
    /// Copies read that were parked as payload conflicts, whatever their row's status.
    pub(crate) conflict_copies: u64,
}

impl ParkedKeys {
    /// Notes one copy read, of the row `c` found for it (a copy without an inbox key is not
    /// noted).
    fn note(&mut self, parked: &ParkedMessage, c: &Classified) {
        let (Some(consumer), Some(key)) = (&c.consumer, &c.key) else {
            return;
        };
        self.keys.insert((consumer.clone(), key.clone()));
        let conflict = parked.error_code() == Some(rabbit_inbox::status::PAYLOAD_CONFLICT);
        if conflict {
            self.conflict_copies += 1;
        }
        if c.class == ParkedClass::Processed && conflict {
            self.processed_conflicts.push(key.clone());
        }
        if c.class == ParkedClass::Reopen && !conflict {
            *self
                .parked_copies
                .entry((consumer.clone(), key.clone()))
                .or_default() += 1;
        }
    }
}

/// The right to walk one parking lot of one schema: a session advisory lock keyed by both
/// names, held on a connection of its own for the whole pass. Dropped without
/// [`LotLock::release`] (an error, a killed pass), the connection closes and the server
/// releases the lock with the session.
pub(crate) struct LotLock(SessionLock);

impl LotLock {
    /// The lock of `parking_queue` in `schema`, once no other pass holds it; with `patience`,
    /// `None` if it is still held after that long.
    pub(crate) async fn acquire(
        pool: &sqlx::PgPool,
        schema: &SchemaName,
        parking_queue: &str,
        patience: Option<Duration>,
    ) -> Result<Option<Self>, OpsError> {
        let key = advisory_lock::key(&["rabbit-inbox parking lot", schema.as_str(), parking_queue]);
        let notice = || {
            tracing::warn!(
                schema = %schema,
                parking_queue,
                "waiting for another redrive or doctor pass over this parking lot to end"
            );
        };
        Ok(SessionLock::acquire(pool, key, patience, notice)
            .await?
            .map(Self))
    }

    /// Unlocks and closes the connection.
    pub(crate) async fn release(self) {
        let _ = self.0.release().await;
    }
}

/// How long the doctor waits for a redrive's pass over the parking lot before it reports the
/// parking lot not reconciled.
pub(crate) const DOCTOR_LOT_PATIENCE: Duration = Duration::from_secs(30);

/// Most entries in [`RedriveReport::findings`].
const MAX_FINDINGS: usize = 1000;

/// One walk over the parking lot: what it was asked, the copies it leaves (put back in their
/// places when it ends) and what it found.
struct Pass<'a> {
    lot: &'a ParkingLot,
    request: &'a RedriveRequest,
    actor: Option<&'a Actor>,
    progress: &'a dyn Progress,
    /// Copies in the parking lot when the walk began: it reads no more than these.
    depth: u32,
    held: &'a mut Vec<ParkedMessage>,
    report: &'a mut RedriveReport,
    /// Where the inbox keys of the copies read go, for reconciliation.
    seen: Option<&'a mut ParkedKeys>,
}

impl Pass<'_> {
    /// Counts `action` on a copy of `c`'s class, and lists it among the findings unless it
    /// moved (or would), at most [`MAX_FINDINGS`] of them.
    fn record(&mut self, c: &Classified, action: ParkedAction) {
        self.report.note(c.class, action);
        if action != ParkedAction::Moved
            && action != ParkedAction::WouldMove
            && self.report.findings.len() < MAX_FINDINGS
        {
            self.report.findings.push(Finding {
                message_id: c.key.clone(),
                consumer: c.consumer.clone(),
                class: c.class,
                action,
                detail: c.detail.clone(),
            });
        }
    }
}

/// What a redrive does, and to which parked copies. Empty filters match everything.
#[derive(Clone, Debug, Default)]
pub struct RedriveRequest {
    /// Classify and count only; nothing moves (copies are read and put back).
    pub dry_run: bool,
    /// Only copies parked by this consumer.
    pub consumer: Option<String>,
    /// Only this message type (the row's, else the tombstone's, else the copy's).
    pub message_type: Option<String>,
    /// Only this error code (the row's last, else the one the copy was parked with).
    pub error_code: Option<String>,
    /// Only copies parked at or after.
    pub since: Option<DateTime<Utc>>,
    /// Only copies parked before.
    pub until: Option<DateTime<Utc>>,
    /// At most this many moves (or discards) per second, from [`MIN_REDRIVE_RATE`] to
    /// [`MAX_REDRIVE_RATE`].
    pub rate_per_sec: Option<f64>,
    /// At most this many copies moved or discarded (or, in a dry run, that would be).
    pub limit: Option<u64>,
    /// Also replay copies whose row retention removed, and copies the inbox does not know.
    /// Not with `discard`.
    pub force: bool,
    /// Remove copies whose row is PROCESSED instead of leaving them. Not with `discard`.
    pub drop_processed: bool,
    /// Remove the selected copies whose row is parked (PERMANENT_FAILED, POISONED,
    /// MANUAL_REVIEW) instead of moving them: each removal is audited as [`DISCARD`], the row
    /// keeps its status and data. Copies of open or unknown rows are left where they are.
    pub discard: bool,
    /// Only the copies of these inbox keys (`x-inbox-message-id`); empty: every key.
    pub message_ids: Vec<String>,
    /// The id of the job this run is (a console's background job): written as `job` into the
    /// details of every audit row the run writes, so that exactly its rows can be found
    /// ([`crate::audit::AuditFilter::job`]) however many runs one actor has going.
    pub job: Option<String>,
}

/// `details` with the run's job id, if it has one.
fn stamped(mut details: Value, job: Option<&str>) -> Value {
    if let (Some(job), Some(d)) = (job, details.as_object_mut()) {
        d.insert("job".into(), Value::from(job));
    }
    details
}

/// How a parked copy relates to the inbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ParkedClass {
    /// Row parked: reopen and move.
    Reopen,
    /// Row already open (RETRYABLE_FAILED, PROCESSING): move.
    Resume,
    /// Row PROCESSED after a redrive moved this message (the audit trail says so) and the copy
    /// has the row's body: the redrive was killed before it acked this copy. Removed.
    Redriven,
    /// Row PROCESSED: the effect is applied; the copy should not be in the parking lot.
    Processed,
    /// No row, but a tombstone: moving it would apply the effect again.
    WouldReapply,
    /// No row, no tombstone, or no inbox key at all.
    Unknown,
    /// Not selected by the request's filters.
    Filtered,
}

impl ParkedClass {
    /// Its name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ParkedClass::Reopen => "reopen",
            ParkedClass::Resume => "resume",
            ParkedClass::Redriven => "redriven",
            ParkedClass::Processed => "processed",
            ParkedClass::WouldReapply => "would_reapply",
            ParkedClass::Unknown => "unknown",
            ParkedClass::Filtered => "filtered",
        }
    }
}

/// What happened to one parked copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ParkedAction {
    /// Published to the work queue and removed from the parking lot.
    Moved,
    /// Dry run: would be moved.
    WouldMove,
    /// Removed from the parking lot (a `redriven` copy, or a PROCESSED row's copy with
    /// `drop_processed`).
    Removed,
    /// Dry run: would be removed.
    WouldRemove,
    /// Put back: needs `force` (or `drop_processed`).
    Refused,
    /// Put back: not selected, or a PROCESSED row's copy without `drop_processed`, or (with
    /// `discard`) a copy whose row is not parked.
    Left,
    /// Removed from the parking lot by a discard; its parked row kept as it was.
    Discarded,
    /// Dry run: would be discarded.
    WouldDiscard,
}

impl ParkedAction {
    /// Its name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ParkedAction::Moved => "moved",
            ParkedAction::WouldMove => "would_move",
            ParkedAction::Removed => "removed",
            ParkedAction::WouldRemove => "would_remove",
            ParkedAction::Refused => "refused",
            ParkedAction::Left => "left",
            ParkedAction::Discarded => "discarded",
            ParkedAction::WouldDiscard => "would_discard",
        }
    }

    /// What a dry run reports for this action of a real run.
    pub fn previewed(self) -> Self {
        match self {
            ParkedAction::Moved => ParkedAction::WouldMove,
            ParkedAction::Removed => ParkedAction::WouldRemove,
            ParkedAction::Discarded => ParkedAction::WouldDiscard,
            other => other,
        }
    }
}

/// What a redrive does with a selected copy of `class` under `request` (a real run's action;
/// a dry run reports [`ParkedAction::previewed`]). The one decision both share.
pub fn planned_action(class: ParkedClass, request: &RedriveRequest) -> ParkedAction {
    if request.discard {
        return match class {
            ParkedClass::Reopen => ParkedAction::Discarded,
            ParkedClass::Redriven => ParkedAction::Removed,
            _ => ParkedAction::Left,
        };
    }
    match class {
        ParkedClass::Reopen | ParkedClass::Resume => ParkedAction::Moved,
        ParkedClass::Redriven => ParkedAction::Removed,
        ParkedClass::Processed if request.drop_processed => ParkedAction::Removed,
        ParkedClass::Processed | ParkedClass::Filtered => ParkedAction::Left,
        ParkedClass::WouldReapply | ParkedClass::Unknown if request.force => ParkedAction::Moved,
        ParkedClass::WouldReapply | ParkedClass::Unknown => ParkedAction::Refused,
    }
}

/// A parked copy an operator should look at (refused, removed, discarded, or PROCESSED).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Finding {
    /// Inbox key, if the copy has one.
    pub message_id: Option<String>,
    /// Consumer that parked it.
    pub consumer: Option<String>,
    /// Class.
    pub class: ParkedClass,
    /// Action.
    pub action: ParkedAction,
    /// Why.
    pub detail: String,
}

/// What [`Operations::redrive`] did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RedriveReport {
    /// Nothing was changed.
    pub dry_run: bool,
    /// Copies in the parking lot when the pass started.
    pub parked_at_start: u32,
    /// Copies read.
    pub examined: u64,
    /// Copies per class (`reopen`, `resume`, `processed`, ...).
    pub classes: BTreeMap<&'static str, u64>,
    /// Copies per action (`moved`, `removed`, `discarded`, `refused`, `left`; a dry run's
    /// `would_move`, `would_remove`, `would_discard`).
    pub actions: BTreeMap<&'static str, u64>,
    /// Moved copies whose producer `user-id` could not be restored (see [`Republished`]).
    pub user_id_not_restored: u64,
    /// Copies not moved (refused, removed, discarded, PROCESSED), at most 1000.
    pub findings: Vec<Finding>,
}

impl RedriveReport {
    /// Copies of `class`.
    pub fn class(&self, class: ParkedClass) -> u64 {
        self.classes.get(class.as_str()).copied().unwrap_or(0)
    }

    /// Copies that got `action`.
    pub fn action(&self, action: ParkedAction) -> u64 {
        self.actions.get(action.as_str()).copied().unwrap_or(0)
    }

    fn note(&mut self, class: ParkedClass, action: ParkedAction) {
        *self.classes.entry(class.as_str()).or_default() += 1;
        *self.actions.entry(action.as_str()).or_default() += 1;
    }
}

/// The inbox's view of a parked copy.
struct Classified {
    class: ParkedClass,
    key: Option<String>,
    consumer: Option<String>,
    message_type: Option<String>,
    error_code: Option<String>,
    detail: String,
    /// For `would_reapply`: whether the copy's body hashes as the removed row's did.
    tombstone_hash_matches: Option<bool>,
}

/// Both hashes the inbox may have recorded for a body: canonical JSON (the default) and raw.
fn body_hashes(parked: &ParkedMessage) -> [Vec<u8>; 2] {
    let canonical = match parse(parked.message().clone(), &EnvelopeRules::default()) {
        Ok(e) => e.payload_sha256.to_vec(),
        Err(invalid) => invalid.envelope.payload_sha256.to_vec(),
    };
    [canonical, Sha256::digest(&parked.message().body).to_vec()]
}

impl Operations {
    async fn classify(&self, parked: &ParkedMessage) -> Result<Classified, OpsError> {
        let key = parked.inbox_key().map(str::to_owned);
        let consumer = parked.consumer().map(str::to_owned);
        let mut c = Classified {
            class: ParkedClass::Unknown,
            key: key.clone(),
            consumer: consumer.clone(),
            message_type: parked.message().kind.clone(),
            error_code: parked.error_code().map(str::to_owned),
            detail: String::new(),
            tombstone_hash_matches: None,
        };
        let (Some(key), Some(consumer)) = (key, consumer) else {
            c.detail = "the copy has no x-inbox-message-id / x-inbox-consumer headers: the \
                        inbox cannot tell whether it was processed"
                .into();
            return Ok(c);
        };
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT status, message_type, last_error_code, payload_sha256 FROM {} \
             WHERE consumer_name = $1 AND message_id = $2",
            self.schema.qualify("message_inbox")
        )))
        .persistent(false)
        .bind(&consumer)
        .bind(&key)
        .fetch_optional(&self.pool)
        .await?;
        if let Some(row) = row {
            let status: InboxStatus = row.try_get::<String, _>("status")?.parse()?;
            c.message_type = Some(row.try_get("message_type")?);
            if let Some(code) = row.try_get::<Option<String>, _>("last_error_code")? {
                c.error_code = Some(code);
            }
            (c.class, c.detail) = match status {
                InboxStatus::PermanentFailed
                | InboxStatus::Poisoned
                | InboxStatus::ManualReview => (ParkedClass::Reopen, format!("row {status}")),
                InboxStatus::RetryableFailed | InboxStatus::Processing => (
                    ParkedClass::Resume,
                    format!("row already reopened ({status})"),
                ),
                InboxStatus::Processed => {
                    let hash: Vec<u8> = row.try_get("payload_sha256")?;
                    if self
                        .left_over_by_redrive(parked, &hash, &consumer, &key)
                        .await?
                    {
                        (
                            ParkedClass::Redriven,
                            "row PROCESSED after a redrive moved this message: this copy is \
                             left over from a redrive stopped before its ack; removed"
                                .into(),
                        )
                    } else {
                        (
                            ParkedClass::Processed,
                            "row PROCESSED: the effect is applied; this copy is left in the \
                             parking lot for reconciliation (drop_processed removes it)"
                                .into(),
                        )
                    }
                }
                // A status this version does not know: left where it is for an operator.
                _ => (ParkedClass::Unknown, format!("row {status}, left alone")),
            };
            return Ok(c);
        }
        let tombstone = sqlx::query(AssertSqlSafe(format!(
            "SELECT payload_sha256, message_type, final_status, removed_at FROM {} \
             WHERE consumer_name = $1 AND message_id = $2",
            self.schema.qualify("inbox_tombstone")
        )))
        .persistent(false)
        .bind(&consumer)
        .bind(&key)
        .fetch_optional(&self.pool)
        .await?;
        match tombstone {
            Some(t) => {
                let hash: Vec<u8> = t.try_get("payload_sha256")?;
                let matches = body_hashes(parked).contains(&hash);
                let removed: DateTime<Utc> = t.try_get("removed_at")?;
                let status: String = t.try_get("final_status")?;
                c.class = ParkedClass::WouldReapply;
                c.message_type = Some(t.try_get("message_type")?);
                c.tombstone_hash_matches = Some(matches);
                let body = if matches {
                    "identical"
                } else {
                    "differs from the removed row's"
                };
                c.detail = if status == InboxStatus::Processed.as_str() {
                    format!(
                        "retention removed its PROCESSED row on {removed} (body {body}): its \
                         effect ran, and moving it would apply it again; needs force"
                    )
                } else {
                    format!(
                        "retention removed its {status} row on {removed} (body {body}): its \
                         effect never ran, but its row and attempts are gone, so moving it runs \
                         it as a new message; needs force"
                    )
                };
            }
            None => {
                c.detail =
                    "no inbox row and no tombstone: unknown to the inbox; needs force".into();
            }
        }
        Ok(c)
    }

    /// Whether a parked copy of a PROCESSED row is one a redrive already moved: the row's
    /// audit trail has a move by a redrive (`via: redrive`: a reopen, a resume or a forced
    /// replay), and the copy is the message that was moved (the row's body, not a payload
    /// conflict parked beside it).
    async fn left_over_by_redrive(
        &self,
        parked: &ParkedMessage,
        row_hash: &[u8],
        consumer: &str,
        key: &str,
    ) -> Result<bool, OpsError> {
        if parked.error_code() == Some(rabbit_inbox::status::PAYLOAD_CONFLICT)
            || !body_hashes(parked).iter().any(|h| h.as_slice() == row_hash)
        {
            return Ok(false);
        }
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE consumer_name = $1 AND message_id = $2 \
               AND details ->> 'via' = $3)",
            self.schema.qualify("inbox_audit")
        )))
        .persistent(false)
        .bind(consumer)
        .bind(key)
        .bind(REDRIVE)
        .fetch_one(&self.pool)
        .await?)
    }

    fn selected(&self, request: &RedriveRequest, parked: &ParkedMessage, c: &Classified) -> bool {
        let matches = |want: &Option<String>, have: &Option<String>| {
            want.as_ref().is_none_or(|w| have.as_ref() == Some(w))
        };
        let parked_at = parked.parked_at();
        let listed = request.message_ids.is_empty()
            || c.key
                .as_ref()
                .is_some_and(|k| request.message_ids.contains(k));
        listed
            && matches(&request.consumer, &c.consumer)
            && matches(&request.message_type, &c.message_type)
            && matches(&request.error_code, &c.error_code)
            && request
                .since
                .is_none_or(|s| parked_at.is_some_and(|p| p >= s))
            && request
                .until
                .is_none_or(|u| parked_at.is_some_and(|p| p < u))
    }

    /// Moves parked messages back to the work queue after a fix (or, with `discard`, removes
    /// the copies of parked rows), classifying each against its inbox row (see the module
    /// docs); counts per class and action at the end. Anything but a dry run needs an `actor`:
    /// every change is audited. Fails on a broker or database error, after putting back what
    /// it held.
    pub async fn redrive(
        &self,
        lot: &ParkingLot,
        request: &RedriveRequest,
        actor: Option<&Actor>,
        progress: &dyn Progress,
    ) -> Result<RedriveReport, OpsError> {
        self.redrive_seeing(lot, request, actor, progress, None, None)
            .await
    }

    /// [`Operations::redrive`], also collecting the inbox key (consumer, message id) of every
    /// copy read into `seen`, whatever its class: the other direction of reconciliation
    /// (parked rows without a copy) needs the keys, not only the counts. With `patience`, the
    /// pass waits at most that long for another pass over the parking lot to end (refused
    /// after it); without, as long as it takes.
    pub(crate) async fn redrive_seeing(
        &self,
        lot: &ParkingLot,
        request: &RedriveRequest,
        actor: Option<&Actor>,
        progress: &dyn Progress,
        seen: Option<&mut ParkedKeys>,
        patience: Option<Duration>,
    ) -> Result<RedriveReport, OpsError> {
        if !request.dry_run && actor.is_none() {
            return Err(OpsError::Invalid(
                "a redrive that moves messages needs an actor and a reason (or a dry run)".into(),
            ));
        }
        if request.discard && (request.force || request.drop_processed) {
            return Err(OpsError::Invalid(
                "force and drop_processed are redrive options; a discard removes only the \
                 copies of parked rows"
                    .into(),
            ));
        }
        // The pace is an interval of 1/rate: a tiny rate would overflow it.
        if request
            .rate_per_sec
            .is_some_and(|r| !(MIN_REDRIVE_RATE..=MAX_REDRIVE_RATE).contains(&r))
        {
            return Err(OpsError::Invalid(format!(
                "rate must be a number from {MIN_REDRIVE_RATE} to {MAX_REDRIVE_RATE} per second"
            )));
        }
        // One pass over a parking lot at a time: copies another pass holds are invisible to
        // this one, which would count and walk only the rest.
        let Some(walking) =
            LotLock::acquire(&self.pool, &self.schema, lot.parking_queue(), patience).await?
        else {
            return Err(OpsError::Refused(format!(
                "another redrive or doctor pass is walking the parking lot {} of schema {}; \
                 try again once it has ended",
                lot.parking_queue(),
                self.schema
            )));
        };
        let result = self
            .redrive_locked(lot, request, actor, progress, seen)
            .await;
        walking.release().await;
        result
    }

    /// [`Operations::redrive_seeing`] under the parking lot's [`LotLock`].
    async fn redrive_locked(
        &self,
        lot: &ParkingLot,
        request: &RedriveRequest,
        actor: Option<&Actor>,
        progress: &dyn Progress,
        seen: Option<&mut ParkedKeys>,
    ) -> Result<RedriveReport, OpsError> {
        let (_, parking) = lot.depths().await?;
        let Some(depth) = parking.messages else {
            return Err(OpsError::Invalid(format!(
                "parking lot {} does not exist",
                lot.parking_queue()
            )));
        };
        progress.set_total(u64::from(depth));
        let mut report = RedriveReport {
            dry_run: request.dry_run,
            parked_at_start: depth,
            ..RedriveReport::default()
        };
        let mut held = Vec::new();
        let result = self
            .redrive_pass(Pass {
                lot,
                request,
                actor,
                progress,
                depth,
                held: &mut held,
                report: &mut report,
                seen,
            })
            .await;
        // Back in their places, whatever happened; a copy not put back (broken channel) comes
        // back when the connection closes.
        for parked in held {
            if let Err(e) = lot.put_back(parked).await {
                tracing::warn!(error = %e, "could not put a parked copy back; it returns when the connection closes");
            }
        }
        result.map(|()| report)
    }

    /// Walks the parking lot once: each copy read is classified, noted for reconciliation
    /// and, when the request selects it, acted on as planned (or previewed in a dry run).
    async fn redrive_pass(&self, mut pass: Pass<'_>) -> Result<(), OpsError> {
        let mut pace = pass.request.rate_per_sec.map(|r| {
            let mut i = tokio::time::interval(Duration::from_secs_f64(1.0 / r));
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        let mut moving = 0u64;
        for _ in 0..pass.depth {
            if pass.request.limit.is_some_and(|l| moving >= l) {
                break;
            }
            let Some(parked) = pass.lot.next().await? else {
                break;
            };
            pass.report.examined += 1;
            pass.progress.advance(1);
            let c = match self.classify(&parked).await {
                Ok(c) => c,
                Err(e) => {
                    pass.held.push(parked);
                    return Err(e);
                }
            };
            if let Some(seen) = pass.seen.as_mut() {
                seen.note(&parked, &c);
            }
            if !self.selected(pass.request, &parked, &c) {
                pass.report.note(ParkedClass::Filtered, ParkedAction::Left);
                pass.held.push(parked);
                continue;
            }
            let planned = planned_action(c.class, pass.request);
            let (true, Some(actor)) = (!pass.request.dry_run, pass.actor) else {
                // Dry run: what the real run would do, nothing done.
                if matches!(planned, ParkedAction::Moved | ParkedAction::Discarded) {
                    moving += 1;
                }
                pass.record(&c, planned.previewed());
                pass.held.push(parked);
                continue;
            };
            if self
                .act(&mut pass, &mut pace, parked, &c, planned, actor)
                .await?
            {
                moving += 1;
            }
        }
        Ok(())
    }

    /// Does what was planned for one selected copy in a real run. `true`: the copy counts
    /// against the request's limit (moved or discarded).
    async fn act(
        &self,
        pass: &mut Pass<'_>,
        pace: &mut Option<Interval>,
        parked: ParkedMessage,
        c: &Classified,
        planned: ParkedAction,
        actor: &Actor,
    ) -> Result<bool, OpsError> {
        match planned {
            ParkedAction::Removed => {
                self.remove_copy(pass, parked, c, actor).await?;
                Ok(false)
            }
            ParkedAction::Moved => {
                if let Some(pace) = pace.as_mut() {
                    pace.tick().await;
                }
                self.move_parked(pass, parked, c, actor).await
            }
            ParkedAction::Discarded => {
                if let Some(pace) = pace.as_mut() {
                    pace.tick().await;
                }
                self.discard_parked(pass, parked, c, actor).await
            }
            ParkedAction::Left
            | ParkedAction::Refused
            | ParkedAction::WouldMove
            | ParkedAction::WouldRemove
            | ParkedAction::WouldDiscard => {
                pass.record(c, planned);
                pass.held.push(parked);
                Ok(false)
            }
        }
    }

    /// Removes a copy whose message is already processed (or was redriven and processed),
    /// audited first.
    async fn remove_copy(
        &self,
        pass: &mut Pass<'_>,
        parked: ParkedMessage,
        c: &Classified,
        actor: &Actor,
    ) -> Result<(), OpsError> {
        let action = if c.class == ParkedClass::Redriven {
            DROP_REDRIVEN
        } else {
            DROP_PROCESSED
        };
        let mut tx = self.pool.begin().await?;
        audit(
            &mut tx,
            &self.schema,
            actor,
            action,
            c.consumer.as_deref(),
            c.key.as_deref(),
            stamped(
                json!({ "parking_queue": pass.lot.parking_queue() }),
                pass.request.job.as_deref(),
            ),
        )
        .await?;
        tx.commit().await?;
        pass.lot.remove(parked).await?;
        pass.record(c, ParkedAction::Removed);
        Ok(())
    }

    /// Moves a copy back to the work queue, its row reopened. `true`: moved.
    async fn move_parked(
        &self,
        pass: &mut Pass<'_>,
        parked: ParkedMessage,
        c: &Classified,
        actor: &Actor,
    ) -> Result<bool, OpsError> {
        match self
            .move_copy(pass.lot, &parked, c, actor, pass.request.job.as_deref())
            .await
        {
            Ok(Some(republished)) => {
                #[cfg(feature = "fault-injection")]
                self.redrive_faults
                    .at(crate::fault::RedriveStep::AfterConfirm, c.key.as_deref())
                    .await;
                pass.lot.remove(parked).await?;
                if republished.user_id_kept_in_header {
                    pass.report.user_id_not_restored += 1;
                }
                pass.record(c, ParkedAction::Moved);
                Ok(true)
            }
            // The row changed between classification and its lock (a consumer or another
            // operator got there first): leave the copy for the next pass.
            Ok(None) => {
                pass.record(c, ParkedAction::Left);
                pass.held.push(parked);
                Ok(false)
            }
            // Before the commit nothing changed; after it the row is open and the copy goes
            // back to the parking lot, for the next pass to resume.
            Err(e) => {
                pass.held.push(parked);
                Err(e)
            }
        }
    }

    /// Discards a copy of a parked row, audited and committed first. `true`: discarded.
    async fn discard_parked(
        &self,
        pass: &mut Pass<'_>,
        parked: ParkedMessage,
        c: &Classified,
        actor: &Actor,
    ) -> Result<bool, OpsError> {
        match self
            .audit_discard(pass.lot, &parked, c, actor, pass.request.job.as_deref())
            .await
        {
            // Audited and committed: only now is the copy acked away. Killed in between, the
            // copy comes back and a rerun discards it again.
            Ok(true) => {
                pass.lot.remove(parked).await?;
                pass.record(c, ParkedAction::Discarded);
                Ok(true)
            }
            // The row left its parked state since it was classified: leave it.
            Ok(false) => {
                pass.record(c, ParkedAction::Left);
                pass.held.push(parked);
                Ok(false)
            }
            Err(e) => {
                pass.held.push(parked);
                Err(e)
            }
        }
    }

    /// Writes the `discard` audit row of one parked copy and the row's `discarded_at`, and
    /// commits, with the row locked and checked still parked (its status is kept). `false`: the
    /// row is no longer parked (nothing written).
    async fn audit_discard(
        &self,
        lot: &ParkingLot,
        parked: &ParkedMessage,
        c: &Classified,
        actor: &Actor,
        job: Option<&str>,
    ) -> Result<bool, OpsError> {
        let (Some(key), Some(consumer)) = (c.key.as_deref(), c.consumer.as_deref()) else {
            return Ok(false);
        };
        let mut tx = self.pool.begin().await?;
        let status: Option<String> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT status FROM {} WHERE consumer_name = $1 AND message_id = $2 \
               AND status IN ({PARKED}) FOR UPDATE",
            self.schema.qualify("message_inbox")
        )))
        .persistent(false)
        .bind(consumer)
        .bind(key)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(status) = status else {
            return Ok(false);
        };
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET discarded_at = now() WHERE consumer_name = $1 AND message_id = $2",
            self.schema.qualify("message_inbox")
        )))
        .persistent(false)
        .bind(consumer)
        .bind(key)
        .execute(&mut *tx)
        .await?;
        audit(
            &mut tx,
            &self.schema,
            actor,
            DISCARD,
            Some(consumer),
            Some(key),
            stamped(
                json!({
                    "parking_queue": lot.parking_queue(),
                    "status": status,
                    "error_code": c.error_code,
                    "message_type": c.message_type,
                    "parked_at": parked.parked_at(),
                }),
                job,
            ),
        )
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Reopens (or audits) the row of one copy and commits, then republishes the copy and waits
    /// for the broker's confirm: the row is open before its copy can reach the consumer. `None`:
    /// the row no longer fits the class (nothing changed).
    async fn move_copy(
        &self,
        lot: &ParkingLot,
        parked: &ParkedMessage,
        c: &Classified,
        actor: &Actor,
        job: Option<&str>,
    ) -> Result<Option<Republished>, OpsError> {
        let mut tx = self.pool.begin().await?;
        let details = stamped(
            json!({
                "via": REDRIVE,
                "parking_queue": lot.parking_queue(),
                "work_queue": lot.work_queue(),
            }),
            job,
        );
        match (c.class, c.key.as_deref(), c.consumer.as_deref()) {
            (ParkedClass::Reopen, Some(key), Some(consumer)) => {
                match reopen_row(&mut tx, &self.schema, key, consumer, actor, false, details).await
                {
                    Ok(_) => {}
                    Err(OpsError::Refused(_) | OpsError::Invalid(_)) => return Ok(None),
                    Err(e) => return Err(e),
                }
            }
            (ParkedClass::Resume, Some(key), Some(consumer)) => {
                let still_open: Option<String> = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT status FROM {} WHERE consumer_name = $1 AND message_id = $2 \
                       AND status IN ({OPEN}) FOR UPDATE",
                    self.schema.qualify("message_inbox")
                )))
                .bind(consumer)
                .bind(key)
                .fetch_optional(&mut *tx)
                .await?;
                if still_open.is_none() {
                    return Ok(None);
                }
                audit(
                    &mut tx,
                    &self.schema,
                    actor,
                    REDRIVE,
                    Some(consumer),
                    Some(key),
                    details,
                )
                .await?;
            }
            (ParkedClass::WouldReapply | ParkedClass::Unknown, key, consumer) => {
                let mut details = details;
                if let Some(d) = details.as_object_mut() {
                    d.insert("class".into(), Value::from(c.class.as_str()));
                    d.insert(
                        "tombstone_hash_matches".into(),
                        c.tombstone_hash_matches.map_or(Value::Null, Value::from),
                    );
                    d.insert(
                        "amqp_message_id".into(),
                        parked
                            .message()
                            .message_id
                            .clone()
                            .map_or(Value::Null, Value::from),
                    );
                }
                audit(
                    &mut tx,
                    &self.schema,
                    actor,
                    FORCED_REPLAY,
                    consumer,
                    key,
                    details,
                )
                .await?;
            }
            _ => return Ok(None),
        }
        #[cfg(feature = "fault-injection")]
        self.redrive_faults
            .at(crate::fault::RedriveStep::BeforeCommit, c.key.as_deref())
            .await;
        tx.commit().await?;
        #[cfg(feature = "fault-injection")]
        self.redrive_faults
            .at(crate::fault::RedriveStep::AfterCommit, c.key.as_deref())
            .await;
        // A failed publish leaves the row open and the parked copy (unacked) goes back: the
        // next pass resumes it.
        let republished = lot.republish(parked).await?;
        Ok(Some(republished))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLASSES: [ParkedClass; 7] = [
        ParkedClass::Reopen,
        ParkedClass::Resume,
        ParkedClass::Redriven,
        ParkedClass::Processed,
        ParkedClass::WouldReapply,
        ParkedClass::Unknown,
        ParkedClass::Filtered,
    ];

    fn plan(request: &RedriveRequest) -> Vec<ParkedAction> {
        CLASSES
            .iter()
            .map(|&c| planned_action(c, request))
            .collect()
    }

    #[test]
    fn a_redrive_moves_open_and_parked_rows_and_refuses_the_unknown() {
        use ParkedAction::*;
        assert_eq!(
            plan(&RedriveRequest::default()),
            [Moved, Moved, Removed, Left, Refused, Refused, Left]
        );
        let forced = RedriveRequest {
            force: true,
            drop_processed: true,
            ..RedriveRequest::default()
        };
        assert_eq!(
            plan(&forced),
            [Moved, Moved, Removed, Removed, Moved, Moved, Left]
        );
    }

    #[test]
    fn a_discard_removes_only_the_copies_of_parked_rows() {
        use ParkedAction::*;
        let discard = RedriveRequest {
            discard: true,
            ..RedriveRequest::default()
        };
        assert_eq!(
            plan(&discard),
            [Discarded, Left, Removed, Left, Left, Left, Left]
        );
    }

    #[test]
    fn a_preview_names_what_the_run_would_do() {
        assert_eq!(
            ParkedAction::Discarded.previewed(),
            ParkedAction::WouldDiscard
        );
        assert_eq!(ParkedAction::Moved.previewed(), ParkedAction::WouldMove);
        assert_eq!(ParkedAction::Removed.previewed(), ParkedAction::WouldRemove);
        assert_eq!(ParkedAction::Left.previewed(), ParkedAction::Left);
        assert_eq!(ParkedAction::WouldDiscard.as_str(), "would_discard");
        assert_eq!(ParkedAction::Discarded.as_str(), "discarded");
        assert_eq!(
            serde_json::to_value(ParkedAction::WouldDiscard).ok(),
            Some(serde_json::json!("would_discard"))
        );
    }
}
