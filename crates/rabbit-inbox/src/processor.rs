//! Turns a batch of parsed deliveries into durable outcomes (database only; no broker here).
//!
//! One transaction per batch: claim all keys with one multi-row insert (new rows go in
//! PROCESSED, invisible until the commit that carries the effect), run the handler for the new
//! ones, check the transaction is still the one that claimed, commit once. When the handler
//! fails for one message the batch rolls back and runs again without it, in groups under
//! savepoints, so that a further failure undoes its own group only. Each handler runs at most
//! about twice per message, however many messages fail. The failures of a round are recorded
//! together in one short transaction afterwards.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    panic::AssertUnwindSafe,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
};

use futures::FutureExt;
use sha2::{Digest, Sha256};
use sqlx::{Connection, PgConnection, PgPool, Postgres, pool::PoolConnection};

use crate::{
    config::ConsumerConfig,
    db_error::{DbErrorClass, deterministic_code, sqlstate},
    envelope::{Envelope, InvalidMessage, InvalidReason},
    error::StoreError,
    handler::{BatchError, BatchHandler, ErrorKind, HandlerError, InboxMessage},
    ordering::{
        Arrival, Candidate, Decision, KeyAdvance, KeyNote, OrderLedger, OrderingPolicy, decide,
    },
    outbox::Outbox,
    retry::RetryPolicy,
    stats::ConsumerStats,
    status::{
        ConfirmedCopy, HANDLER_PANICKED, InboxStatus, ORDER_HEADER_INVALID, Outcome,
        PAYLOAD_CONFLICT, SEQUENCE_PASSED, TRANSACTION_ABORTED,
    },
    store::{Claim, Failure, HeldRow, InboxRecord, InboxStore, Redelivery},
    telemetry::{
        failure_log::{FailureLine, FailureLog},
        metrics as m,
    },
};

/// A delivery after parsing: its envelope, valid or not (an invalid one's under the key it is
/// recorded by), and why it cannot be processed when it cannot.
#[derive(Clone, Debug)]
pub(crate) struct Parsed {
    pub(crate) envelope: Envelope,
    /// `None` for a delivery to process.
    pub(crate) refusal: Option<Refusal>,
}

/// Why a delivery is refused before any handler sees it: an [`InvalidMessage`] without its
/// envelope.
#[derive(Clone, Debug)]
pub(crate) struct Refusal {
    pub(crate) reason: InvalidReason,
    pub(crate) detail: String,
}

impl Parsed {
    /// The envelope of a delivery to process; `None` for a refused one.
    pub(crate) fn valid(&self) -> Option<&Envelope> {
        self.refusal.is_none().then_some(&self.envelope)
    }

    /// The inbox key the delivery is recorded under.
    pub(crate) fn key(&self) -> &str {
        &self.envelope.message_id
    }
}

impl From<Result<Envelope, Box<InvalidMessage>>> for Parsed {
    fn from(parsed: Result<Envelope, Box<InvalidMessage>>) -> Self {
        match parsed {
            Ok(envelope) => Parsed {
                envelope,
                refusal: None,
            },
            Err(invalid) => {
                let InvalidMessage {
                    reason,
                    detail,
                    envelope,
                } = *invalid;
                Parsed {
                    envelope,
                    refusal: Some(Refusal { reason, detail }),
                }
            }
        }
    }
}

/// Requeues "database unavailable" after which a message is logged by its key: one or two are
/// an outage being ridden out, more point at the message.
const REQUEUE_WARN_AFTER: u32 = 3;

/// A lane's database connection, kept across batches: taking one from the pool costs a ping
/// round trip each time. Discarded after a database error, so a broken one is not reused.
///
/// Its session default is `default_transaction_read_only = on` and every transaction of the
/// runtime begins `READ WRITE`: a handler that ends the transaction itself (`ROLLBACK`,
/// `COMMIT`) cannot go on writing in autocommit mode, outside any inbox row. The connection is
/// therefore never handed back to the pool: it is closed when the lane lets it go.
pub(crate) struct LaneConnection {
    pool: PgPool,
    conn: Option<PoolConnection<Postgres>>,
    /// Set when this session took a copy lock ([`InboxStore::try_copy_locks`]); the lane
    /// releases them once the batch's copies are noted.
    copy_locks: Arc<AtomicBool>,
}

impl LaneConnection {
    pub(crate) fn new(pool: PgPool) -> Self {
        Self {
            pool,
            conn: None,
            copy_locks: Arc::default(),
        }
    }

    /// The flag a statement sets when it takes copy locks on this connection.
    pub(crate) fn copy_lock_flag(&self) -> Arc<AtomicBool> {
        self.copy_locks.clone()
    }

    /// Releases the copy locks this session holds: the batch's copies are settled (confirmed
    /// and noted, or requeued), so later deliveries of those keys read the row. On an error
    /// the connection goes, and the session's locks with it.
    pub(crate) async fn release_copy_locks(&mut self) {
        if !self.copy_locks.swap(false, Ordering::Relaxed) {
            return;
        }
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        if let Err(error) = sqlx::raw_sql("SELECT pg_advisory_unlock_all()")
            .execute(&mut **conn)
            .await
        {
            tracing::debug!(%error, "copy locks could not be released; closing the connection");
            self.discard();
        }
    }

    async fn get(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        if self.conn.is_none() {
            let mut conn = self.pool.acquire().await?;
            sqlx::raw_sql("SET default_transaction_read_only = on")
                .execute(&mut *conn)
                .await?;
            self.conn = Some(conn);
        }
        match self.conn.as_mut() {
            Some(conn) => Ok(&mut **conn),
            None => Err(sqlx::Error::PoolClosed),
        }
    }

    /// The lane's connection outside any transaction, for reads between batches (its
    /// transactions default to read-only).
    #[cfg(feature = "testing")]
    pub(crate) async fn connection(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        self.get().await
    }

    /// Begins a read-write transaction on the lane's connection.
    pub(crate) async fn begin(&mut self) -> Result<sqlx::Transaction<'_, Postgres>, sqlx::Error> {
        self.get().await?.begin_with("BEGIN READ WRITE").await
    }

    pub(crate) fn discard(&mut self) {
        // The session's copy locks end with it.
        self.copy_locks.store(false, Ordering::Relaxed);
        if let Some(conn) = self.conn.take() {
            // Closed, not returned: its session settings are the lane's, not the pool's.
            drop(conn.detach());
        }
    }
}

impl Drop for LaneConnection {
    fn drop(&mut self) {
        self.discard();
    }
}

/// What a lane runs a batch through: the transactional [`Processor`] (the default) or the
/// leased one (`crate::lease`). Boxed futures: one allocation per batch, nothing per message.
pub(crate) trait Process: Send + Sync + 'static {
    /// A connection slot for one lane.
    fn lane_connection(&self) -> LaneConnection;

    /// Processes a batch; returns one outcome per item, in order.
    fn process_batch<'a>(
        &'a self,
        items: &'a [Parsed],
        db: &'a mut LaneConnection,
    ) -> futures::future::BoxFuture<'a, Vec<Outcome>>;

    /// The ledger the lane notes its confirmed copies in.
    fn store(&self) -> (&InboxStore, &str);

    /// Called after each batch: writes the failure log's summary of a window that is over.
    fn flush_failure_log(&self);
}

/// How long a lane keeps trying to note confirmed copies on their rows (the database
/// restarting, say) before it settles their deliveries without the note.
const NOTE_RETRY_BUDGET: std::time::Duration = std::time::Duration::from_secs(20);
/// The first wait between two tries at noting; it doubles up to [`NOTE_RETRY_MAX_DELAY`].
const NOTE_RETRY_DELAY: std::time::Duration = std::time::Duration::from_millis(100);
const NOTE_RETRY_MAX_DELAY: std::time::Duration = std::time::Duration::from_secs(2);

impl LaneConnection {
    /// Notes the copies the broker confirmed on their rows (see
    /// [`InboxStore::note_confirmed_copies`]), in a short transaction of its own, before their
    /// deliveries are acked. A failure (the session or the database went away) is retried on a
    /// fresh session for up to [`NOTE_RETRY_BUDGET`], the copy locks taken again first: acked
    /// unnoted, a parked copy would make the next copy of its message a second parked copy,
    /// and an unnoted retry copy would let the next copy run before it is due. After the
    /// budget the failure is logged and the deliveries are acked anyway: their copies are in
    /// the broker, so nothing is lost, only that dedup.
    pub(crate) async fn note_confirmed_copies(
        &mut self,
        store: &InboxStore,
        consumer: &str,
        copies: &[ConfirmedCopy],
    ) {
        let began = std::time::Instant::now();
        let backoff = crate::backoff::Backoff::new(NOTE_RETRY_DELAY, NOTE_RETRY_MAX_DELAY);
        let mut tries = 0u32;
        loop {
            tries += 1;
            // The first try runs on the session that holds the copy locks; a later one on a
            // new session, which must hold them again while it notes.
            let error = match self.try_note(store, consumer, copies, tries > 1).await {
                Ok(()) => {
                    if tries > 1 {
                        tracing::info!(
                            copies = copies.len(),
                            tries,
                            "confirmed copies noted on their rows after the database came back"
                        );
                    }
                    return;
                }
                Err(error) => error,
            };
            self.discard();
            let delay = backoff.failed();
            if began.elapsed() + delay > NOTE_RETRY_BUDGET {
                tracing::warn!(%error, copies = copies.len(), tries, "confirmed copies could not be noted on their rows; their deliveries are acked, and a later copy of those messages will be parked or retried a second time (check the database)");
                return;
            }
            tracing::debug!(%error, retry_in = ?delay, "noting confirmed copies failed; retrying on a new session");
            tokio::time::sleep(delay).await;
        }
    }

    /// One try at noting `copies`; `relock` takes their copy locks first (a new session).
    async fn try_note(
        &mut self,
        store: &InboxStore,
        consumer: &str,
        copies: &[ConfirmedCopy],
        relock: bool,
    ) -> Result<(), StoreError> {
        let copy_locks = self.copy_lock_flag();
        let mut tx = self.begin().await?;
        if relock {
            let ids: Vec<&str> = copies.iter().map(|c| c.message_id.as_str()).collect();
            if store
                .try_copy_locks(&mut tx, consumer, &ids)
                .await?
                .contains(&true)
            {
                copy_locks.store(true, Ordering::Relaxed);
            }
        }
        store
            .note_confirmed_copies(&mut tx, consumer, copies)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Fault injection: ends this lane's database session as a database restart would.
    #[cfg(feature = "fault-injection")]
    pub(crate) async fn end_session(&mut self) {
        if let Ok(conn) = self.get().await {
            let _ = sqlx::raw_sql("SELECT pg_terminate_backend(pg_backend_pid())")
                .execute(conn)
                .await;
        }
    }
}

impl<H: BatchHandler> Process for Processor<H> {
    fn lane_connection(&self) -> LaneConnection {
        LaneConnection::new(self.pool.clone())
    }

    fn process_batch<'a>(
        &'a self,
        items: &'a [Parsed],
        db: &'a mut LaneConnection,
    ) -> futures::future::BoxFuture<'a, Vec<Outcome>> {
        Box::pin(self.process(items, db))
    }

    fn store(&self) -> (&InboxStore, &str) {
        (&self.store, &self.consumer)
    }

    fn flush_failure_log(&self) {
        Processor::flush_failure_log(self);
    }
}

pub(crate) struct Processor<H> {
    pool: PgPool,
    store: InboxStore,
    /// Handlers' outbox, in the inbox's schema.
    outbox: Outbox,
    handler: Arc<H>,
    consumer: String,
    retry: RetryPolicy,
    lock_aggregates: bool,
    body_must_match: bool,
    /// Keys requeued as "unavailable" in a row, to name the ones that keep coming back.
    requeues: Mutex<HashMap<String, u32>>,
    /// Metric labels of this consumer.
    stats: Arc<ConsumerStats>,
    /// The lines of failed messages, rate-limited per consumer.
    failure_log: FailureLog,
    /// Where parked copies go, for the log.
    parking_queue: String,
    /// Retry tier queues by tier, for the log.
    retry_tiers: Vec<String>,
    /// Per-key order, when the consumer keeps it.
    ordering: Option<KeyOrder>,
}

/// An ordered consumer's policy and the statements of its per-key rows.
struct KeyOrder {
    policy: OrderingPolicy,
    ledger: OrderLedger,
}

/// Why a batch transaction did not commit.
enum TxError {
    /// The handler failed for the message at this index.
    Handler(usize, HandlerError),
    /// The handler failed for the messages at these indexes (a set-based handler).
    Handlers(Vec<(usize, HandlerError)>),
    /// The transaction failed and which message caused it is unknown: run each message on its
    /// own to find out. A message that fails alone is charged with this error.
    Isolate(HandlerError),
    /// Deadlock, serialization failure or a row that vanished mid-claim: run again.
    Transient(String),
    /// The database cannot serve (or the commit outcome is unknown): nothing is charged, the
    /// messages are requeued.
    Outage(String),
    /// The database says the deployment is wrong, not the message (see
    /// [`DbErrorClass::Deployment`]): the message at `index` (every message of the
    /// transaction when unknown) is requeued with nothing recorded, and the fault reported.
    Deployment {
        index: Option<usize>,
        sqlstate: String,
        error: String,
    },
}

impl TxError {
    /// A failure of the library's own statements inside the batch transaction.
    fn from_store(e: StoreError) -> Self {
        match &e {
            // A row vanished between insert and select (retention ran): run again.
            StoreError::Corrupt(_) => TxError::Transient(e.to_string()),
            StoreError::Database(db) => Self::from_db(db, &e.to_string()),
            StoreError::Migrate(_) => TxError::Outage(e.to_string()),
        }
    }

    fn from_db(e: &sqlx::Error, text: &str) -> Self {
        match DbErrorClass::of(e) {
            DbErrorClass::Transient => TxError::Transient(text.to_owned()),
            DbErrorClass::Aborted => TxError::Isolate(aborted()),
            DbErrorClass::Deterministic => {
                let code = match e {
                    sqlx::Error::Database(db) => db.code().map(|c| deterministic_code(&c)),
                    _ => None,
                };
                TxError::Isolate(HandlerError::permanent(
                    code.unwrap_or("db_error"),
                    text.to_owned(),
                ))
            }
            DbErrorClass::Deployment => TxError::Deployment {
                index: None,
                sqlstate: sqlstate(e).unwrap_or_default(),
                error: text.to_owned(),
            },
            DbErrorClass::Outage | DbErrorClass::Other => TxError::Outage(text.to_owned()),
        }
    }

    /// A handler's failure, for the message at `index` when the handler said which one.
    fn from_handler(index: Option<usize>, e: HandlerError) -> Self {
        match e.db_class() {
            Some(DbErrorClass::Transient) => TxError::Transient(e.to_string()),
            Some(DbErrorClass::Outage) => TxError::Outage(e.to_string()),
            Some(DbErrorClass::Deployment) => TxError::Deployment {
                index,
                sqlstate: e.deployment_sqlstate().unwrap_or_default().to_owned(),
                error: e.message().to_owned(),
            },
            // The statement failed because an earlier one did, maybe another message's.
            Some(DbErrorClass::Aborted) => TxError::Isolate(aborted()),
            _ => match index {
                Some(i) => TxError::Handler(i, e),
                None => TxError::Isolate(e),
            },
        }
    }

    /// A failed handler call over `run`: the messages it blamed, by their batch positions, or
    /// the whole transaction's problem.
    fn from_batch(run: &[(usize, i32)], error: BatchError) -> Self {
        let bad_index = |index: usize| {
            TxError::Isolate(HandlerError::retryable(
                "bad_batch_index",
                format!("batch handler blamed message {index} of {}", run.len()),
            ))
        };
        match error {
            BatchError::Message { index, error } => match run.get(index) {
                Some(&(i, _)) => TxError::from_handler(Some(i), error),
                None => bad_index(index),
            },
            BatchError::Messages(errors) => {
                let mut blamed = Vec::with_capacity(errors.len());
                for (index, error) in errors {
                    let Some(&(i, _)) = run.get(index) else {
                        return bad_index(index);
                    };
                    match TxError::from_handler(Some(i), error) {
                        TxError::Handler(i, e) => blamed.push((i, e)),
                        // Not about the message: the whole transaction's problem.
                        other => return other,
                    }
                }
                if blamed.is_empty() {
                    return TxError::Isolate(HandlerError::retryable(
                        "batch_failed",
                        "batch handler reported failed messages without naming one",
                    ));
                }
                blamed.sort_by_key(|(i, _)| *i);
                blamed.dedup_by_key(|(i, _)| *i);
                TxError::Handlers(blamed)
            }
            BatchError::Batch(error) => TxError::from_handler(None, error),
        }
    }
}

fn aborted() -> HandlerError {
    HandlerError::retryable(
        TRANSACTION_ABORTED,
        "a statement failed inside the transaction and the handler carried on (or it ended \
         the transaction itself); nothing of it was committed",
    )
}

/// A failure to record once the round's transactions are done.
struct PendingFailure {
    index: usize,
    status: InboxStatus,
    code: String,
    message: String,
    /// Stored as it is whatever the privacy policy (see `Failure::safe_detail`).
    safe_detail: Option<String>,
    store_payload: bool,
    /// An invalid delivery: it must never change the row of a valid copy of its key.
    invalid: bool,
    /// Record without the producer's optional fields (after they could not be stored).
    minimal: bool,
}

/// How a batch transaction runs its messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// All at once; a failure rolls everything back. Cheapest when nothing fails.
    Optimistic,
    /// In groups under savepoints, after a failure: a further failure undoes its group only.
    Savepoints,
}

/// Messages per savepoint after a failure: small enough that a failing group wastes little,
/// large enough that the savepoints cost little.
const GROUP: usize = 8;

/// Savepoints per transaction. Each one that writes is a subtransaction; past 64 in one
/// transaction PostgreSQL's snapshots overflow to disk lookups for every session.
const MAX_SAVEPOINTS: usize = 48;

/// What a committed batch transaction decided.
struct Committed {
    /// Outcomes of the messages it committed (or found settled).
    decided: Vec<(usize, Outcome)>,
    /// Messages whose group was rolled back to its savepoint without them: to record.
    failed: Vec<(usize, HandlerError)>,
    /// Messages it did not get to (savepoint budget): to run next.
    rest: Vec<usize>,
}

/// What the claims of a batch transaction found, message by message (batch positions).
struct Triage<'a> {
    /// Outcomes decided without running the handler.
    decided: Vec<(usize, Outcome)>,
    /// Messages to run, with their attempt.
    run: Vec<(usize, i32)>,
    /// Existing rows to take back into PROCESSING and run.
    reclaim: Vec<usize>,
    /// First receipt of each reclaimed key.
    first_received: Vec<(usize, chrono::DateTime<chrono::Utc>)>,
    /// How many reclaimed rows were stale PROCESSING rows.
    stale_taken_over: u64,
    /// Deliveries of existing rows, counted on them.
    redeliveries: Vec<Redelivery<'a>>,
    /// Rows whose copy may be in flight elsewhere: parked or retryable, no copy noted.
    contested: Vec<(usize, Box<InboxRecord>)>,
    /// Copies of HELD rows: position in their key's order, first receipt.
    held: Vec<(usize, i64, chrono::DateTime<chrono::Utc>)>,
    /// Ordered messages that run: the key's head or not, for the key's row after the run.
    ordered_runs: Vec<(usize, bool)>,
}

impl Triage<'_> {
    fn with_capacity(n: usize) -> Self {
        Self {
            decided: Vec::with_capacity(n),
            run: Vec::new(),
            reclaim: Vec::new(),
            first_received: Vec::new(),
            stale_taken_over: 0,
            redeliveries: Vec::new(),
            contested: Vec::new(),
            held: Vec::new(),
            ordered_runs: Vec::new(),
        }
    }
}

/// Transaction attempts for deadlocks and the like before giving up on a batch.
const MAX_TRANSIENT_RETRIES: u32 = 3;

/// A round's work in progress: the transactions still to run, and what to record or report
/// once they are done.
struct RoundPlan {
    /// Messages to run together, and how; the front runs next.
    queue: VecDeque<(Vec<usize>, Mode)>,
    /// Failures to record after the round's transactions.
    failed: Vec<PendingFailure>,
    /// (SQLSTATE, error) of each delivery requeued for a deployment fault.
    deployment_faults: Vec<(String, String)>,
    /// Conflicts run again in a row.
    transient_retries: u32,
}

impl RoundPlan {
    fn new(round: Vec<usize>) -> Self {
        Self {
            queue: VecDeque::from([(round, Mode::Optimistic)]),
            failed: Vec::new(),
            deployment_faults: Vec::new(),
            transient_retries: 0,
        }
    }
}

impl<H: BatchHandler> Processor<H> {
    pub(crate) fn new(
        pool: PgPool,
        handler: Arc<H>,
        config: &ConsumerConfig,
        stats: Arc<ConsumerStats>,
    ) -> Self {
        Self {
            pool,
            // The store applies the payload policy per message type: the processor offers
            // every body and the rules keep, redact or seal it.
            store: InboxStore::new(config.schema.clone())
                .with_privacy(config.payload_storage, config.privacy.clone()),
            outbox: Outbox::new(config.schema.clone()).with_notify(config.outbox_notify),
            handler,
            consumer: config.consumer_name.clone(),
            retry: config.retry.clone(),
            lock_aggregates: config.lock_aggregates,
            body_must_match: config.envelope.dedup.body_must_match(),
            requeues: Mutex::default(),
            stats,
            failure_log: FailureLog::new(&config.consumer_name, &config.telemetry),
            parking_queue: config.topology.parking_queue.clone(),
            retry_tiers: config.topology.retry_tier_queues(&config.retry),
            ordering: config.ordering.clone().map(|policy| KeyOrder {
                policy,
                ledger: OrderLedger::new(&config.schema),
            }),
        }
    }

    /// Logs a failed message's outcome (parked at WARN, a retry at the configured level),
    /// with the safe detail only: a message text may quote the body.
    pub(crate) fn log_failure(
        &self,
        envelope: &Envelope,
        outcome: &Outcome,
        safe_detail: Option<&str>,
    ) {
        let line = |code, attempt, queue| FailureLine {
            message_id: &envelope.message_id,
            message_type: &envelope.message_type,
            code,
            safe_detail,
            attempt,
            queue,
        };
        match outcome {
            Outcome::Parked {
                status,
                code,
                attempt,
                ..
            } => self
                .failure_log
                .parked(*status, &line(code, *attempt, &self.parking_queue)),
            Outcome::RetryScheduled { attempt, code } => {
                let tier = self.retry.tier_of_attempt(*attempt);
                let queue = self
                    .retry_tiers
                    .get(tier)
                    .or(self.retry_tiers.last())
                    .map_or("", String::as_str);
                let delay = self.retry.delays.get(tier).copied().unwrap_or_default();
                self.failure_log
                    .retry_scheduled(delay, &line(code, Some(*attempt), queue));
            }
            _ => {}
        }
    }

    /// Writes the summary of a window whose lines were cut short, once it is over.
    pub(crate) fn flush_failure_log(&self) {
        self.failure_log.flush();
    }

    /// Processes a batch; returns one outcome per item, in order.
    pub(crate) async fn process(&self, items: &[Parsed], db: &mut LaneConnection) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; items.len()];
        // The same key twice in one batch: later copies wait for a later round, where they meet
        // the first copy's committed outcome like any redelivery. Valid or not, the first
        // delivery of a key owns its row: an invalid copy never records before a valid one
        // delivered ahead of it. (The lane gives each batch distinct keys and holds later
        // copies back until the batch's copies are confirmed and noted; rounds keep other
        // callers right.)
        let mut pending: Vec<usize> = (0..items.len()).collect();
        while !pending.is_empty() {
            let mut seen = HashSet::new();
            let (round, later): (Vec<usize>, Vec<usize>) = pending
                .into_iter()
                .partition(|&i| seen.insert(items[i].key()));
            let (valid, invalid): (Vec<usize>, Vec<usize>) =
                round.into_iter().partition(|&i| items[i].refusal.is_none());
            self.record_invalid_of(items, &invalid, &mut outcomes, db)
                .await;
            self.run_round(items, valid, &mut outcomes, db).await;
            pending = later;
        }
        self.finish(items, outcomes)
    }

    /// Outcomes in order (a gap is a bug, reported as unrecorded so the message comes back),
    /// with the keys requeued again and again named.
    pub(crate) fn finish(&self, items: &[Parsed], outcomes: Vec<Option<Outcome>>) -> Vec<Outcome> {
        let outcomes: Vec<Outcome> = outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| Outcome::Unrecorded {
                    error: "internal: no outcome".into(),
                })
            })
            .collect();
        self.track_requeues(items, &outcomes);
        outcomes
    }

    /// Bad input: recorded and parked, never processed.
    pub(crate) async fn record_invalid(
        &self,
        items: &[Parsed],
        outcomes: &mut [Option<Outcome>],
        db: &mut LaneConnection,
    ) {
        let all: Vec<usize> = (0..items.len()).collect();
        self.record_invalid_of(items, &all, outcomes, db).await;
    }

    /// [`Processor::record_invalid`] for the invalid items among `indexes`.
    async fn record_invalid_of(
        &self,
        items: &[Parsed],
        indexes: &[usize],
        outcomes: &mut [Option<Outcome>],
        db: &mut LaneConnection,
    ) {
        let invalid: Vec<PendingFailure> = indexes
            .iter()
            .filter_map(|&index| {
                let refusal = items[index].refusal.as_ref()?;
                Some(PendingFailure {
                    index,
                    status: InboxStatus::PermanentFailed,
                    code: refusal.reason.code().to_owned(),
                    message: refusal.detail.clone(),
                    // The library's own words: sizes, positions, kinds, never the values.
                    safe_detail: Some(refusal.detail.clone()),
                    store_payload: refusal.reason != InvalidReason::PayloadTooLarge,
                    invalid: true,
                    minimal: false,
                })
            })
            .collect();
        if !invalid.is_empty() {
            self.record_failures(items, invalid, outcomes, db).await;
        }
    }

    /// Records a permanent failure of the valid message at `index` that could not be claimed
    /// (a value the database refuses): its minimal row if need be, and parked, so it neither
    /// loops nor is lost.
    pub(crate) async fn record_unclaimable(
        &self,
        items: &[Parsed],
        index: usize,
        code: &str,
        message: String,
        outcomes: &mut [Option<Outcome>],
        db: &mut LaneConnection,
    ) {
        let failure = PendingFailure {
            index,
            status: InboxStatus::PermanentFailed,
            code: code.to_owned(),
            message,
            safe_detail: None,
            store_payload: true, // the store applies the privacy policy
            invalid: false,
            minimal: false,
        };
        self.record_failures(items, vec![failure], outcomes, db)
            .await;
    }

    /// Names the messages that keep being requeued as "unavailable": after an outage they go
    /// through; one that does not is likely the cause, and an operator needs its key.
    fn track_requeues(&self, items: &[Parsed], outcomes: &[Outcome]) {
        let mut requeues = self.requeues.lock().unwrap_or_else(PoisonError::into_inner);
        for (i, outcome) in outcomes.iter().enumerate() {
            let key = items[i].key();
            match outcome {
                Outcome::Unrecorded { error } => {
                    if requeues.len() >= 100_000 && !requeues.contains_key(key) {
                        // Bounded: a long outage must not grow memory without limit.
                        requeues.clear();
                    }
                    let n = requeues.entry(key.to_owned()).or_default();
                    *n += 1;
                    if *n > REQUEUE_WARN_AFTER {
                        metrics::counter!(m::REPEATED_REQUEUES, "consumer" => self.stats.consumer_label().clone())
                            .increment(1);
                        tracing::warn!(
                            message_id = key,
                            requeues = *n,
                            %error,
                            "message requeued again because its outcome could not be recorded"
                        );
                    }
                }
                _ if !requeues.is_empty() => {
                    requeues.remove(key);
                }
                _ => {}
            }
        }
    }

    /// Runs a round's valid messages (distinct keys) through batch transactions until each
    /// has an outcome, then records the round's failures together.
    async fn run_round(
        &self,
        items: &[Parsed],
        round: Vec<usize>,
        outcomes: &mut [Option<Outcome>],
        db: &mut LaneConnection,
    ) {
        let mut plan = RoundPlan::new(round);
        while let Some((active, mode)) = plan.queue.pop_front() {
            if active.is_empty() {
                continue;
            }
            // What failed earlier in the round: an ordered key holds what follows it.
            let failed: Vec<usize> = plan
                .failed
                .iter()
                .filter(|f| !f.invalid && blocks_its_key(&f.code))
                .map(|f| f.index)
                .collect();
            match self.transaction(items, &active, mode, &failed, db).await {
                Ok(done) => self.take_committed(items, done, &mut plan, outcomes),
                Err(e) => self.replan(e, active, mode, &mut plan, outcomes, db),
            }
        }
        if !plan.deployment_faults.is_empty() {
            self.report_deployment_faults(&plan.deployment_faults);
        }
        if !plan.failed.is_empty() {
            self.record_failures(items, plan.failed, outcomes, db).await;
        }
    }

    /// Takes in what a committed transaction decided: outcomes, failures to record, and the
    /// messages it did not get to.
    fn take_committed(
        &self,
        items: &[Parsed],
        done: Committed,
        plan: &mut RoundPlan,
        outcomes: &mut [Option<Outcome>],
    ) {
        plan.transient_retries = 0;
        for (i, outcome) in done.decided {
            if let Outcome::Parked { code, message, .. } = &outcome
                && code == PAYLOAD_CONFLICT
            {
                // The library's words (ids and hashes): safe to log.
                self.log_failure(&items[i].envelope, &outcome, Some(message));
            }
            outcomes[i] = Some(outcome);
        }
        plan.failed
            .extend(done.failed.iter().map(|(i, e)| self.handler_failure(*i, e)));
        // Past the savepoint budget: optimistic again, failures are rare.
        plan.queue.push_front((done.rest, Mode::Optimistic));
    }

    /// Plans what runs next after a transaction over `active` failed: without the culprits,
    /// one message at a time, the same again, or not at all (requeued).
    fn replan(
        &self,
        error: TxError,
        active: Vec<usize>,
        mode: Mode,
        plan: &mut RoundPlan,
        outcomes: &mut [Option<Outcome>],
        db: &mut LaneConnection,
    ) {
        let without = |failed: &[usize]| -> Vec<usize> {
            active
                .iter()
                .copied()
                .filter(|a| !failed.contains(a))
                .collect()
        };
        match error {
            // Linear in failures: the rest runs again at once, in groups under savepoints,
            // so a later failure undoes its group only, not everything before it.
            TxError::Handler(i, e) => {
                plan.queue.push_front((without(&[i]), Mode::Savepoints));
                plan.failed.push(self.handler_failure(i, &e));
            }
            TxError::Handlers(errors) => {
                let blamed: Vec<usize> = errors.iter().map(|(i, _)| *i).collect();
                plan.queue.push_front((without(&blamed), mode));
                plan.failed
                    .extend(errors.iter().map(|(i, e)| self.handler_failure(*i, e)));
            }
            TxError::Isolate(e) if active.len() > 1 => {
                // The code only: a handler's message may quote the body (a decode error does).
                tracing::debug!(
                    code = e.code(),
                    batch = active.len(),
                    "batch failed without a culprit; one message per transaction"
                );
                for &i in active.iter().rev() {
                    plan.queue.push_front((vec![i], Mode::Optimistic));
                }
            }
            TxError::Isolate(e) => plan.failed.push(self.handler_failure(active[0], &e)),
            TxError::Transient(e) if plan.transient_retries < MAX_TRANSIENT_RETRIES => {
                plan.transient_retries += 1;
                tracing::debug!(error = %e, "batch transaction conflict, running it again");
                plan.queue.push_front((active, mode));
            }
            TxError::Transient(error) | TxError::Outage(error) => {
                db.discard();
                for &i in &active {
                    outcomes[i] = Some(Outcome::Unrecorded {
                        error: error.clone(),
                    });
                }
            }
            // Not the message's fault: requeued with nothing recorded. A culprit named by
            // the handler goes alone and the rest runs again (other message types may be
            // fine); otherwise the whole transaction's messages go back.
            TxError::Deployment {
                index,
                sqlstate,
                error,
            } => {
                let requeued = match index {
                    Some(i) => {
                        plan.queue.push_front((without(&[i]), Mode::Savepoints));
                        vec![i]
                    }
                    None => active,
                };
                for &i in &requeued {
                    outcomes[i] = Some(Outcome::Unrecorded {
                        error: format!("deployment fault (SQLSTATE {sqlstate}): {error}"),
                    });
                    plan.deployment_faults
                        .push((sqlstate.clone(), error.clone()));
                }
            }
        }
    }

    /// Logs and counts deliveries requeued for a deployment fault: the service cannot run
    /// until it is fixed, and an operator must hear of it (nothing is parked to show it). One
    /// line per round; the lane's back-off bounds how often.
    pub(crate) fn report_deployment_faults(&self, faults: &[(String, String)]) {
        let consumer = self.stats.consumer_label();
        let mut by_state: Vec<(&str, u64)> = Vec::new();
        for (state, _) in faults {
            match by_state.iter_mut().find(|(s, _)| s == state) {
                Some((_, n)) => *n += 1,
                None => by_state.push((state, 1)),
            }
        }
        for (state, n) in by_state {
            metrics::counter!(m::DEPLOYMENT_FAULTS, "consumer" => consumer.clone(), "sqlstate" => state.to_owned())
                .increment(n);
        }
        let (sqlstate, error) = &faults[0];
        tracing::error!(
            consumer = %self.consumer,
            sqlstate = %sqlstate,
            %error,
            requeued = faults.len(),
            "the database refuses the consumer's statements (undefined table, column, function, \
             type or schema, or a missing privilege): a deployment fault, not the messages'. \
             Nothing is parked or charged; the deliveries are requeued and retried with back-off. \
             Run the missing migration, fix the search_path or grant the privilege"
        );
    }

    fn handler_failure(&self, index: usize, e: &HandlerError) -> PendingFailure {
        PendingFailure {
            index,
            status: match e.kind() {
                ErrorKind::Retryable => InboxStatus::RetryableFailed,
                ErrorKind::Permanent => InboxStatus::PermanentFailed,
            },
            code: e.code().to_owned(),
            message: e.message().to_owned(),
            safe_detail: e.safe_detail().map(str::to_owned),
            store_payload: true,
            invalid: false,
            minimal: false,
        }
    }

    /// One attempt at the batch transaction. Returns the outcomes of all `active` items.
    async fn transaction(
        &self,
        items: &[Parsed],
        active: &[usize],
        mode: Mode,
        failed: &[usize],
        db: &mut LaneConnection,
    ) -> Result<Committed, TxError> {
        let began = std::time::Instant::now();
        let copy_locks = db.copy_lock_flag();
        let mut tx = db
            .begin()
            .await
            .map_err(|e| TxError::Outage(e.to_string()))?;
        let mut result = match mode {
            Mode::Optimistic => self
                .apply(items, active, failed, &mut tx, &copy_locks)
                .await
                .map(|(decided, txid)| {
                    (
                        Committed {
                            decided,
                            failed: Vec::new(),
                            rest: Vec::new(),
                        },
                        txid,
                    )
                }),
            Mode::Savepoints => {
                self.apply_in_groups(items, active, failed, &mut tx, &copy_locks)
                    .await
            }
        };
        if let Ok((_, Some(txid))) = &result {
            // One check per batch, only when a handler ran: the transaction must still be the
            // one that claimed. PostgreSQL answers COMMIT on an aborted transaction with a
            // ROLLBACK tag and no error, and after a handler's own ROLLBACK there is nothing to
            // commit; either way reporting an outcome would lose the messages.
            match self.store.current_txid(&mut tx).await {
                Ok(Some(now)) if now == *txid => {}
                Ok(_) => result = Err(TxError::Isolate(aborted())),
                Err(e) => result = Err(TxError::from_db(&e, &e.to_string())),
            }
        }
        match result {
            Ok((committed, _)) => {
                // A failed commit leaves the outcome unknown: report Unrecorded, the message
                // comes back, and the inbox tells on redelivery whether it committed. Only a
                // deferred constraint is known to have failed for the data's sake.
                tx.commit().await.map_err(|e| match DbErrorClass::of(&e) {
                    DbErrorClass::Deterministic
                    | DbErrorClass::Transient
                    | DbErrorClass::Deployment => TxError::from_db(&e, &e.to_string()),
                    _ => TxError::Outage(e.to_string()),
                })?;
                self.record_transaction(began, "committed");
                Ok(committed)
            }
            Err(e) => {
                // Roll back now, not lazily on the connection's next use: the failures are
                // recorded next and would wait for this claim's locks.
                let rolled_back = tx.rollback().await;
                self.record_transaction(began, "rolled_back");
                let panicked = matches!(&e, TxError::Handler(_, h) | TxError::Isolate(h) if h.code() == HANDLER_PANICKED);
                if rolled_back.is_err() || panicked || matches!(e, TxError::Outage(_)) {
                    // A panic may have left a statement half-read on the connection.
                    db.discard();
                }
                Err(e)
            }
        }
    }

    /// The batch transaction's work after a failure: the messages in groups of [`GROUP`], each
    /// under a savepoint. A group whose handler blames a message is rolled back to its
    /// savepoint (claims, reclaims and effects alike) and runs again without it; the others
    /// are untouched. Stops after [`MAX_SAVEPOINTS`] (each is a subtransaction, and PostgreSQL
    /// tracks only 64 per transaction cheaply) and hands the rest back.
    async fn apply_in_groups(
        &self,
        items: &[Parsed],
        active: &[usize],
        failed: &[usize],
        tx: &mut PgConnection,
        copy_locks: &AtomicBool,
    ) -> Result<(Committed, Option<i64>), TxError> {
        let mut done = Committed {
            decided: Vec::with_capacity(active.len()),
            failed: Vec::new(),
            rest: Vec::new(),
        };
        let mut txid = None;
        let mut savepoints = 0;
        let mut groups: VecDeque<Vec<usize>> =
            active.chunks(GROUP).map(<[usize]>::to_vec).collect();
        while let Some(group) = groups.pop_front() {
            if group.is_empty() {
                continue;
            }
            if savepoints == MAX_SAVEPOINTS {
                done.rest = group
                    .into_iter()
                    .chain(groups.into_iter().flatten())
                    .collect();
                break;
            }
            savepoint(tx, "SAVEPOINT inbox_group").await?;
            savepoints += 1;
            let failed: Vec<usize> = failed
                .iter()
                .copied()
                .chain(
                    done.failed
                        .iter()
                        .filter(|(_, e)| blocks_its_key(e.code()))
                        .map(|(i, _)| *i),
                )
                .collect();
            let blamed = match self.apply(items, &group, &failed, tx, copy_locks).await {
                Ok((decided, t)) => {
                    done.decided.extend(decided);
                    txid = t.or(txid);
                    continue;
                }
                // A panic may have left the connection mid-statement: the whole transaction
                // goes (and the connection with it), and the rest runs again without it.
                Err(TxError::Handler(i, e)) if e.code() == HANDLER_PANICKED => {
                    return Err(TxError::Handler(i, e));
                }
                Err(TxError::Handler(i, e)) => vec![(i, e)],
                Err(TxError::Handlers(errors)) => errors,
                Err(other) => return Err(other),
            };
            savepoint(tx, "ROLLBACK TO SAVEPOINT inbox_group").await?;
            let rest: Vec<usize> = group
                .into_iter()
                .filter(|g| !blamed.iter().any(|(i, _)| i == g))
                .collect();
            groups.push_front(rest);
            done.failed.extend(blamed);
        }
        Ok((done, txid))
    }

    /// The batch transaction's work: claims, decisions, handlers, marks. Returns the outcomes
    /// it will have once committed, and the claiming transaction's id when a handler ran.
    async fn apply(
        &self,
        items: &[Parsed],
        active: &[usize],
        failed: &[usize],
        tx: &mut PgConnection,
        copy_locks: &AtomicBool,
    ) -> Result<(Vec<(usize, Outcome)>, Option<i64>), TxError> {
        let envelopes: Vec<&Envelope> = active.iter().map(|&i| &items[i].envelope).collect();
        self.lock_order_keys(&envelopes, tx).await?;
        let batch = self
            .store
            .claim_committing(&mut *tx, &self.consumer, &envelopes, true)
            .await
            .map_err(TxError::from_store)?;
        let mut triage = self.triage(active, &envelopes, batch.claims, batch.db_now);
        self.settle_contested(items, &mut triage, tx, copy_locks)
            .await?;
        self.gate_order(items, &mut triage, failed, tx).await?;
        self.reclaim(items, &mut triage, tx).await?;
        self.store
            .note_redeliveries(&mut *tx, &self.consumer, &triage.redeliveries)
            .await
            .map_err(TxError::from_store)?;

        if self.lock_aggregates {
            lock_aggregates(
                &mut *tx,
                &self.consumer,
                triage.run.iter().map(|&(i, _)| &items[i].envelope),
            )
            .await
            .map_err(TxError::from_store)?;
        }
        if triage.run.is_empty() {
            return Ok((triage.decided, None));
        }
        // Delivery order, whatever order the claims came back in.
        triage.run.sort_unstable_by_key(|&(i, _)| i);
        self.run_handler(items, &triage, batch.db_now, tx).await?;
        self.mark_reclaimed_processed(items, &triage.reclaim, tx)
            .await?;
        self.advance_order(items, &triage.ordered_runs, tx).await?;
        let Triage {
            mut decided, run, ..
        } = triage;
        decided.extend(run.into_iter().map(|(i, _)| (i, Outcome::Processed)));
        Ok((decided, Some(batch.txid)))
    }

    /// Sorts the claims of `active` by what their rows say: to run, decided without running,
    /// to reclaim, or contested (a copy may be in flight elsewhere).
    fn triage<'a>(
        &self,
        active: &[usize],
        envelopes: &[&'a Envelope],
        claims: Vec<Claim>,
        db_now: chrono::DateTime<chrono::Utc>,
    ) -> Triage<'a> {
        let stale_after = chrono::Duration::from_std(self.retry.stale_processing_after)
            .unwrap_or(chrono::Duration::MAX);
        let mut triage = Triage::with_capacity(active.len());
        for ((&i, &envelope), claim) in active.iter().zip(envelopes).zip(claims) {
            let record = match claim {
                Claim::Claimed => {
                    triage.run.push((i, 1));
                    continue;
                }
                Claim::Existing(record) => record,
            };
            let conflict = self.body_must_match && !same_body(&record.payload_sha256, envelope);
            let pending = (!conflict)
                .then(|| record.pending_copy(scheduled_attempt(envelope), db_now))
                .flatten();
            triage.redeliveries.push(Redelivery {
                message_id: &envelope.message_id,
                conflicting_sha256: conflict.then_some(&envelope.payload_sha256[..]),
                duplicate_of: pending,
            });
            if conflict {
                triage
                    .decided
                    .push((i, payload_conflict(&record, envelope)));
                continue;
            }
            if let Some(copy) = pending {
                triage.decided.push((i, Outcome::CopyPending { copy }));
                continue;
            }
            let outcome = match record.status {
                InboxStatus::Processed => Outcome::Duplicate,
                InboxStatus::Held if self.ordering.is_some() => {
                    let position = record.order_position.unwrap_or_default();
                    triage.held.push((i, position, record.first_received_at));
                    continue;
                }
                // Held by an ordered consumer that no longer orders: its turn is now.
                InboxStatus::Held => {
                    triage.reclaim.push(i);
                    triage.first_received.push((i, record.first_received_at));
                    continue;
                }
                InboxStatus::RetryableFailed
                | InboxStatus::PermanentFailed
                | InboxStatus::Poisoned
                | InboxStatus::ManualReview => {
                    triage.contested.push((i, record));
                    continue;
                }
                InboxStatus::Processing => {
                    let started = record
                        .processing_started_at
                        .unwrap_or(record.last_received_at);
                    // The database's clock on both sides: hosts' clocks drift.
                    if db_now - started > stale_after {
                        triage.reclaim.push(i);
                        triage.first_received.push((i, record.first_received_at));
                        triage.stale_taken_over += 1;
                        continue;
                    }
                    Outcome::InFlightElsewhere
                }
            };
            triage.decided.push((i, outcome));
        }
        triage
    }

    /// Decides the contested rows by their copy locks: a row whose lock another session holds
    /// has its copy on the way; otherwise a retryable row is reclaimed and a parked one
    /// parks this copy.
    async fn settle_contested(
        &self,
        items: &[Parsed],
        triage: &mut Triage<'_>,
        tx: &mut PgConnection,
        copy_locks: &AtomicBool,
    ) -> Result<(), TxError> {
        if triage.contested.is_empty() {
            return Ok(());
        }
        let contested = std::mem::take(&mut triage.contested);
        let ids: Vec<&str> = contested.iter().map(|(i, _)| items[*i].key()).collect();
        let mine = self
            .store
            .try_copy_locks(&mut *tx, &self.consumer, &ids)
            .await
            .map_err(TxError::from_store)?;
        if mine.contains(&true) {
            copy_locks.store(true, Ordering::Relaxed);
        }
        for ((i, record), mine) in contested.into_iter().zip(mine) {
            if !mine {
                // Another session decided on this row's copy and has not noted it yet: a
                // second copy would be a second parked (or retry) copy. This one goes
                // round a retry tier and then finds the copy noted.
                triage.decided.push((i, Outcome::InFlightElsewhere));
            } else if record.status == InboxStatus::RetryableFailed {
                triage.reclaim.push(i);
                triage.first_received.push((i, record.first_received_at));
            } else {
                // Parked, but no confirmed parking copy is noted and none is on its way
                // (the confirm never came, or the process died before noting it): park
                // this copy rather than risk losing it.
                triage.decided.push((i, parked_again(&record)));
            }
        }
        Ok(())
    }

    /// Takes the rows to reclaim back into PROCESSING; they run with their next attempt.
    async fn reclaim(
        &self,
        items: &[Parsed],
        triage: &mut Triage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), TxError> {
        if triage.reclaim.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = triage.reclaim.iter().map(|&i| items[i].key()).collect();
        let attempts = self
            .store
            .mark_processing(&mut *tx, &self.consumer, &ids)
            .await
            .map_err(TxError::from_store)?;
        for &i in &triage.reclaim {
            let id = &items[i].envelope.message_id;
            let attempt = attempts
                .iter()
                .find(|(a, _)| a == id)
                .map(|(_, n)| *n)
                .ok_or_else(|| TxError::Transient(format!("row {id} could not be reclaimed")))?;
            triage.run.push((i, attempt));
        }
        Ok(())
    }

    /// Runs the handler over the messages to run, in delivery order, and records its metrics
    /// when it succeeds. A panic counts as the batch's failure.
    async fn run_handler(
        &self,
        items: &[Parsed],
        triage: &Triage<'_>,
        db_now: chrono::DateTime<chrono::Utc>,
        tx: &mut PgConnection,
    ) -> Result<(), TxError> {
        let run = &triage.run;
        // Fresh per run: a rolled-back run's emitted messages are gone, and the next run
        // derives the same ids again from position 0.
        let emitted: Vec<AtomicU32> = run.iter().map(|_| AtomicU32::new(0)).collect();
        let msgs: Vec<InboxMessage<'_>> = run
            .iter()
            .zip(&emitted)
            .map(|(&(i, attempt), emitted)| InboxMessage {
                envelope: &items[i].envelope,
                consumer_name: &self.consumer,
                attempt,
                outbox: &self.outbox,
                emitted,
            })
            .collect();
        // A panic in a handler is bad input the runtime must survive, not a reason to lose the
        // lane and every delivery it holds.
        let handler_began = std::time::Instant::now();
        let handled = AssertUnwindSafe(self.handler.handle_batch(&msgs, &mut *tx))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| Err(BatchError::Batch(HandlerError::panicked(&*panic))));
        match handled {
            Ok(()) => {
                self.record_handled(
                    &msgs,
                    run,
                    &triage.first_received,
                    db_now,
                    handler_began,
                    triage.stale_taken_over,
                );
                Ok(())
            }
            Err(error) => Err(TxError::from_batch(run, error)),
        }
    }

    /// Marks the reclaimed rows PROCESSED (new rows were inserted PROCESSED already). Whether
    /// a body kept from the failure stays depends on the message type's policy.
    async fn mark_reclaimed_processed(
        &self,
        items: &[Parsed],
        reclaim: &[usize],
        tx: &mut PgConnection,
    ) -> Result<(), TxError> {
        let (keep, drop): (Vec<&Envelope>, Vec<&Envelope>) = reclaim
            .iter()
            .map(|&i| &items[i].envelope)
            .partition(|e| self.store.keeps_processed_payload(&e.message_type));
        for (envelopes, keep_payload) in [(keep, true), (drop, false)] {
            if envelopes.is_empty() {
                continue;
            }
            let ids: Vec<&str> = envelopes.iter().map(|e| e.message_id.as_str()).collect();
            let marked = self
                .store
                .mark_processed(&mut *tx, &self.consumer, &ids, keep_payload)
                .await
                .map_err(TxError::from_store)?;
            if marked != ids.len() as u64 {
                return Err(TxError::Transient(format!(
                    "{} of {} reclaimed rows changed state meanwhile",
                    ids.len() as u64 - marked,
                    ids.len()
                )));
            }
        }
        Ok(())
    }

    /// Metrics of a batch transaction: from BEGIN to its COMMIT or ROLLBACK.
    fn record_transaction(&self, began: std::time::Instant, result: &'static str) {
        metrics::histogram!(m::TRANSACTION_DURATION, "consumer" => self.stats.consumer_label().clone(), "result" => result)
            .record(began.elapsed().as_secs_f64());
    }

    /// Metrics of a handler call that succeeded: its duration, and the attempt and processing
    /// age of each message. Recorded before COMMIT: a commit that fails afterwards (an
    /// outage) leaves them counted, rare enough not to skew the distributions.
    fn record_handled(
        &self,
        msgs: &[InboxMessage<'_>],
        run: &[(usize, i32)],
        first_received: &[(usize, chrono::DateTime<chrono::Utc>)],
        db_now: chrono::DateTime<chrono::Utc>,
        handler_began: std::time::Instant,
        stale_taken_over: u64,
    ) {
        let consumer = self.stats.consumer_label();
        let handler_time = handler_began.elapsed().as_secs_f64();
        metrics::histogram!(m::HANDLER_DURATION, "consumer" => consumer.clone())
            .record(handler_time);
        if stale_taken_over > 0 {
            metrics::counter!(m::STALE_LEASE_RECOVERIES, "consumer" => consumer.clone())
                .increment(stale_taken_over);
        }
        // (type label, attempts, processing ages): one pair of histogram handles per type.
        let types = self.stats.type_labels(msgs.iter().map(|msg| msg.envelope));
        let mut by_type: Vec<(&metrics::SharedString, Vec<f64>, Vec<f64>)> = Vec::new();
        for (&(i, attempt), ty) in run.iter().zip(&types) {
            let waited = first_received
                .iter()
                .find(|(r, _)| *r == i)
                .map_or(0.0, |(_, first)| {
                    (db_now - *first).as_seconds_f64().max(0.0)
                });
            let group = match by_type.iter().position(|(t, ..)| *t == ty) {
                Some(g) => g,
                None => {
                    by_type.push((ty, Vec::new(), Vec::new()));
                    by_type.len() - 1
                }
            };
            by_type[group].1.push(f64::from(attempt));
            by_type[group].2.push(waited + handler_time);
        }
        for (ty, attempts, ages) in by_type {
            let attempt_histogram = metrics::histogram!(m::ATTEMPTS, "consumer" => consumer.clone(), "message_type" => ty.clone());
            attempts
                .into_iter()
                .for_each(|a| attempt_histogram.record(a));
            let age_histogram = metrics::histogram!(m::PROCESSING_AGE, "consumer" => consumer.clone(), "message_type" => ty.clone());
            ages.into_iter().for_each(|a| age_histogram.record(a));
        }
    }

    /// Records failures in one short transaction on the lane's connection (the batch
    /// transactions are over, so it holds no locks and needs no second connection) and says
    /// where each message goes.
    async fn record_failures(
        &self,
        items: &[Parsed],
        mut failures: Vec<PendingFailure>,
        outcomes: &mut [Option<Outcome>],
        db: &mut LaneConnection,
    ) {
        let mut transient_retries = 0;
        // All failures in one statement first; one statement each once a statement has been
        // refused, to find which failure cannot be stored.
        let mut one_by_one = false;
        loop {
            match self
                .failure_transaction(items, &failures, one_by_one, db)
                .await
            {
                Ok(decided) => {
                    for (i, outcome) in decided {
                        let safe_detail = failures
                            .iter()
                            .find(|f| f.index == i)
                            .and_then(|f| f.safe_detail.as_deref());
                        self.log_failure(&items[i].envelope, &outcome, safe_detail);
                        outcomes[i] = Some(outcome);
                    }
                    return;
                }
                Err(FailureTxError::Unstorable(None, _)) => one_by_one = true,
                // A failure that cannot be stored as it is (a value over an index limit): store
                // the minimal row, so that nothing is parked without one and nothing loops.
                Err(FailureTxError::Unstorable(Some(k), error)) => {
                    if failures[k].minimal {
                        let f = failures.remove(k);
                        outcomes[f.index] = Some(Outcome::Unrecorded {
                            error: format!("could not record failure {}: {error}", f.code),
                        });
                        if failures.is_empty() {
                            return;
                        }
                    } else {
                        tracing::warn!(%error, message_id = %items[failures[k].index].key(), "failure record refused; recording a minimal row");
                        failures[k].minimal = true;
                    }
                }
                Err(FailureTxError::Transient(_)) if transient_retries < MAX_TRANSIENT_RETRIES => {
                    transient_retries += 1;
                }
                Err(FailureTxError::Transient(error) | FailureTxError::Outage(error)) => {
                    db.discard();
                    for f in failures {
                        outcomes[f.index] = Some(Outcome::Unrecorded {
                            error: format!("could not record failure {}: {error}", f.code),
                        });
                    }
                    return;
                }
            }
        }
    }

    async fn failure_transaction(
        &self,
        items: &[Parsed],
        failures: &[PendingFailure],
        one_by_one: bool,
        db: &mut LaneConnection,
    ) -> Result<Vec<(usize, Outcome)>, FailureTxError> {
        let copy_locks = db.copy_lock_flag();
        let mut tx = db.begin().await.map_err(FailureTxError::outage)?;
        let result = self
            .write_failures(items, failures, one_by_one, &mut tx, &copy_locks)
            .await;
        match result {
            Ok(decided) => {
                tx.commit().await.map_err(FailureTxError::outage)?;
                Ok(decided)
            }
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    /// The failure transaction's work: conflicting copies sorted out against the locked rows,
    /// the rest recorded in waves of distinct keys, the deliveries counted on their rows, and
    /// the copy locks of the copies decided on taken.
    async fn write_failures(
        &self,
        items: &[Parsed],
        failures: &[PendingFailure],
        one_by_one: bool,
        tx: &mut PgConnection,
        copy_locks: &AtomicBool,
    ) -> Result<Vec<(usize, Outcome)>, FailureTxError> {
        let ids: Vec<&str> = failures.iter().map(|f| items[f.index].key()).collect();
        let existing = self
            .store
            .lock_rows(&mut *tx, &self.consumer, &ids)
            .await
            .map_err(FailureTxError::store)?;
        let row_of = |id: &str| existing.iter().find(|r| r.message_id == id);
        let mut decided = Vec::with_capacity(failures.len());
        // Deliveries noted on rows the failure statement left alone: conflicting invalid
        // copies, and copies of rows already PROCESSED or parked. Every delivery is counted.
        let mut notes = Vec::new();
        let mut to_record = Vec::with_capacity(failures.len());
        for (k, f) in failures.iter().enumerate() {
            let envelope = &items[f.index].envelope;
            if let Some(conflict) =
                row_of(&envelope.message_id).and_then(|row| self.failure_conflict(row, envelope, f))
            {
                notes.push(conflict.0);
                decided.push((f.index, conflict.1));
                continue;
            }
            to_record.push(k);
        }

        let minimal: HashMap<usize, Envelope> = to_record
            .iter()
            .filter(|&&k| failures[k].minimal)
            .map(|&k| (k, minimal(&items[failures[k].index].envelope)))
            .collect();
        // Waves of distinct keys: one upsert cannot touch a row twice.
        while !to_record.is_empty() {
            let mut seen = HashSet::new();
            let (wave, later): (Vec<usize>, Vec<usize>) = to_record.iter().partition(|&&k| {
                (!one_by_one || seen.is_empty()) && seen.insert(items[failures[k].index].key())
            });
            to_record = later;
            let recorded = self
                .record_wave(items, failures, &wave, &minimal, tx)
                .await?;
            for (&k, recorded) in wave.iter().zip(recorded) {
                let f = &failures[k];
                let outcome = match recorded {
                    Some((InboxStatus::RetryableFailed, attempt)) => Outcome::RetryScheduled {
                        attempt,
                        code: f.code.clone(),
                    },
                    Some((status, attempt)) => Outcome::Parked {
                        status,
                        code: f.code.clone(),
                        message: f.message.clone(),
                        attempt: Some(attempt),
                    },
                    None => {
                        self.failure_left_alone(&items[f.index].envelope, f, &mut notes, tx)
                            .await?
                    }
                };
                decided.push((f.index, outcome));
            }
        }
        self.store
            .note_redeliveries(&mut *tx, &self.consumer, &notes)
            .await
            .map_err(FailureTxError::store)?;
        self.block_order_keys(items, failures, &decided, tx).await?;
        self.hold_copy_locks(&mut decided, items, tx, copy_locks)
            .await?;
        Ok(decided)
    }

    /// Records one wave of failures (distinct keys) in one statement; for each, the status and
    /// attempt its row now has, or `None` where the row was left alone. A statement the
    /// database refuses as such names its failure when the wave has one.
    async fn record_wave(
        &self,
        items: &[Parsed],
        failures: &[PendingFailure],
        wave: &[usize],
        minimal: &HashMap<usize, Envelope>,
        tx: &mut PgConnection,
    ) -> Result<Vec<Option<(InboxStatus, i32)>>, FailureTxError> {
        let rows: Vec<(&Envelope, Failure<'_>)> = wave
            .iter()
            .map(|&k| {
                let f = &failures[k];
                let stored = minimal.get(&k).unwrap_or_else(|| &items[f.index].envelope);
                let failure = Failure {
                    status: f.status,
                    code: &f.code,
                    message: &f.message,
                    safe_detail: f.safe_detail.as_deref(),
                    max_attempts: self.retry.max_attempts,
                    store_payload: f.store_payload && !f.minimal,
                };
                (stored, failure)
            })
            .collect();
        self.store
            .record_failures(&mut *tx, &self.consumer, self.retry.max_attempts, &rows)
            .await
            .map_err(|e| match &e {
                StoreError::Database(db) if DbErrorClass::of(db) == DbErrorClass::Deterministic => {
                    let k = (wave.len() == 1).then(|| wave[0]);
                    FailureTxError::Unstorable(k, e.to_string())
                }
                _ => FailureTxError::store(e),
            })
    }

    /// The outcome of a failure whose row the statement left alone, PROCESSED or parked: this
    /// delivery is counted on it (`notes`) as a repeat of its effect or of its parked copy, or
    /// as a conflict when the row holds another body.
    async fn failure_left_alone<'e>(
        &self,
        envelope: &'e Envelope,
        f: &PendingFailure,
        notes: &mut Vec<Redelivery<'e>>,
        tx: &mut PgConnection,
    ) -> Result<Outcome, FailureTxError> {
        let row = self
            .store
            .find(&mut *tx, &self.consumer, &envelope.message_id)
            .await
            .map_err(FailureTxError::store)?;
        // Another body's row, committed while this statement waited for its insert (another
        // consumer's copy): a conflict, as before the statement.
        let conflict = row
            .as_ref()
            .and_then(|row| self.failure_conflict(row, envelope, f));
        Ok(match (row, conflict) {
            (_, Some((note, outcome))) => {
                notes.push(note);
                outcome
            }
            (Some(row), None) if row.status == InboxStatus::Processed => {
                notes.push(Redelivery {
                    message_id: &envelope.message_id,
                    conflicting_sha256: None,
                    duplicate_of: None,
                });
                Outcome::Duplicate
            }
            (Some(row), None) if row.status.is_parked() => {
                let copy = row.pending_copy(None, chrono::Utc::now());
                notes.push(Redelivery {
                    message_id: &envelope.message_id,
                    conflicting_sha256: None,
                    duplicate_of: copy,
                });
                match copy {
                    Some(copy) => Outcome::CopyPending { copy },
                    None => parked_again(&row),
                }
            }
            _ => {
                return Err(FailureTxError::Transient(format!(
                    "row {} changed while its failure was recorded",
                    envelope.message_id
                )));
            }
        })
    }

    /// The payload conflict of a failure whose row holds another body: an invalid copy under
    /// the key of another message (a valid one, or another invalid body), or, when bodies must
    /// match, another body under a valid message's key. Counted on the row, which stays the
    /// first body's; the copy is parked with both reasons. `None`: the same body.
    fn failure_conflict<'e>(
        &self,
        row: &InboxRecord,
        envelope: &'e Envelope,
        f: &PendingFailure,
    ) -> Option<(Redelivery<'e>, Outcome)> {
        if !(f.invalid || self.body_must_match) || same_body(&row.payload_sha256, envelope) {
            return None;
        }
        let note = Redelivery {
            message_id: &envelope.message_id,
            conflicting_sha256: Some(&envelope.payload_sha256[..]),
            duplicate_of: None,
        };
        let outcome = if f.invalid {
            Outcome::Parked {
                status: row.status,
                code: PAYLOAD_CONFLICT.into(),
                message: format!(
                    "message id {} is recorded ({}) with another body (sha256 {}); this copy \
                     (sha256 {}) is invalid and was not processed ({}: {})",
                    envelope.message_id,
                    row.status,
                    hex::encode(&row.payload_sha256),
                    hex::encode(envelope.payload_sha256),
                    f.code,
                    f.message
                ),
                attempt: None,
            }
        } else {
            payload_conflict(row, envelope)
        };
        Some((note, outcome))
    }

    /// Takes the copy lock of every row whose copy this transaction decided on (a retry copy,
    /// the row's parked copy). Where another session holds it, that session's copy of the row
    /// is on its way: this delivery goes round a retry tier instead of becoming a second copy.
    async fn hold_copy_locks(
        &self,
        decided: &mut [(usize, Outcome)],
        items: &[Parsed],
        tx: &mut PgConnection,
        copy_locks: &AtomicBool,
    ) -> Result<(), FailureTxError> {
        let copying: Vec<usize> = (0..decided.len())
            .filter(|&k| {
                matches!(
                    decided[k].1,
                    Outcome::RetryScheduled { .. }
                        | Outcome::Parked {
                            attempt: Some(_),
                            ..
                        }
                )
            })
            .collect();
        let ids: Vec<&str> = copying.iter().map(|&k| items[decided[k].0].key()).collect();
        let mine = self
            .store
            .try_copy_locks(tx, &self.consumer, &ids)
            .await
            .map_err(FailureTxError::store)?;
        if mine.contains(&true) {
            copy_locks.store(true, Ordering::Relaxed);
        }
        for (k, mine) in copying.into_iter().zip(mine) {
            if !mine {
                decided[k].1 = Outcome::InFlightElsewhere;
            }
        }
        Ok(())
    }
}

/// Whether a failure with `code` makes its message its ordering key's head: not a refusal of
/// its ordering header or of a sequence number the key has passed (those are parked aside).
fn blocks_its_key(code: &str) -> bool {
    code != SEQUENCE_PASSED && code != ORDER_HEADER_INVALID
}

/// Ordered consumers: the keys' locks, the ordering decision, the keys' rows after a run or a
/// failure (see [`crate::ordering`]).
impl<H: BatchHandler> Processor<H> {
    /// The ordering key of `envelope` and its sequence number (`Ok(None)`: not ordered).
    fn order_of<'e>(
        order: &KeyOrder,
        envelope: &'e Envelope,
    ) -> Result<Option<(&'e str, Option<i64>)>, String> {
        let Some(key) = order.policy.key_of(envelope)? else {
            return Ok(None);
        };
        Ok(Some((key, order.policy.sequence_of(envelope)?)))
    }

    /// Locks the ordered keys of the batch before its claim, so that deciding on a key and
    /// writing its rows is one step for every consumer instance.
    async fn lock_order_keys(
        &self,
        envelopes: &[&Envelope],
        tx: &mut PgConnection,
    ) -> Result<(), TxError> {
        let Some(order) = &self.ordering else {
            return Ok(());
        };
        let keys: Vec<&str> = envelopes
            .iter()
            .filter_map(|e| order.policy.key_of(e).ok().flatten())
            .collect();
        order
            .ledger
            .lock_keys(tx, &self.consumer, &keys)
            .await
            .map_err(TxError::from_store)
    }

    /// The ordering decision over the messages about to run and the copies of held rows:
    /// holds what must wait (recorded HELD, acked), lets a held copy whose turn has come run,
    /// refuses an unusable ordering header or a passed sequence number (parked, not blocking).
    async fn gate_order(
        &self,
        items: &[Parsed],
        triage: &mut Triage<'_>,
        failed: &[usize],
        tx: &mut PgConnection,
    ) -> Result<(), TxError> {
        let Some(order) = &self.ordering else {
            return Ok(());
        };
        let held = std::mem::take(&mut triage.held);
        let fresh = triage
            .run
            .iter()
            .map(|&(i, _)| i)
            .chain(triage.reclaim.iter().copied());
        let arrivals = fresh
            .map(|i| (i, Arrival::Fresh))
            .chain(held.iter().map(|&(i, at, _)| (i, Arrival::HeldCopy(at))));
        let mut candidates = Vec::new();
        let mut refused = Vec::new();
        let mut unordered = Vec::new();
        for (i, arrival) in arrivals {
            let envelope = &items[i].envelope;
            match Self::order_of(order, envelope) {
                Ok(Some((key, sequence))) => candidates.push(Candidate {
                    index: i,
                    message_id: &envelope.message_id,
                    key,
                    sequence,
                    arrival,
                }),
                // No key: not ordered. A held copy without one (the policy changed since it
                // was held) runs unordered.
                Ok(None) => {
                    if let Some(&(_, _, first)) = held.iter().find(|h| h.0 == i) {
                        unordered.push((i, first));
                    }
                }
                Err(why) => refused.push((i, HandlerError::permanent(ORDER_HEADER_INVALID, why))),
            }
        }
        if !refused.is_empty() {
            return Err(TxError::Handlers(refused));
        }
        for (i, first) in unordered {
            triage.reclaim.push(i);
            triage.first_received.push((i, first));
        }
        candidates.sort_unstable_by_key(|c| c.index);
        let mut keys: Vec<&str> = candidates.iter().map(|c| c.key).collect();
        keys.sort_unstable();
        keys.dedup();
        let states = order
            .ledger
            .load(tx, &self.consumer, &keys)
            .await
            .map_err(TxError::from_store)?;
        let round_heads = self.round_heads(order, items, failed);
        let first = order.policy.sequence.as_ref().map_or(1, |s| s.first);
        let decisions = decide(&candidates, &states, &round_heads, first);
        self.take_decisions(items, triage, &held, &candidates, decisions, tx)
            .await
    }

    /// Per ordered key, the first message of it that failed earlier in this round.
    fn round_heads<'a>(
        &self,
        order: &KeyOrder,
        items: &'a [Parsed],
        failed: &[usize],
    ) -> HashMap<&'a str, (usize, &'a str)> {
        let mut heads: HashMap<&str, (usize, &str)> = HashMap::new();
        for &f in failed {
            let envelope = &items[f].envelope;
            if let Ok(Some((key, _))) = Self::order_of(order, envelope) {
                let head = heads.entry(key).or_insert((f, &envelope.message_id));
                if f < head.0 {
                    *head = (f, &envelope.message_id);
                }
            }
        }
        heads
    }

    /// Carries out the ordering decisions: held and still-held messages decided, held copies
    /// whose turn came reclaimed, the HELD rows and the keys' rows written.
    async fn take_decisions(
        &self,
        items: &[Parsed],
        triage: &mut Triage<'_>,
        held: &[(usize, i64, chrono::DateTime<chrono::Utc>)],
        candidates: &[Candidate<'_>],
        decisions: Vec<(usize, Decision)>,
        tx: &mut PgConnection,
    ) -> Result<(), TxError> {
        let Some(order) = &self.ordering else {
            return Ok(());
        };
        let mut holds = Vec::new();
        let mut notes: Vec<(&str, Option<String>, bool)> = Vec::new();
        let mut refused = Vec::new();
        let mut off = HashSet::new();
        let mut cleared: Vec<KeyAdvance<'_>> = Vec::new();
        for (c, (i, decision)) in candidates.iter().zip(decisions) {
            match decision {
                Decision::Run { head } => {
                    if let Some(&(_, _, first)) = held.iter().find(|h| h.0 == i) {
                        triage.reclaim.push(i);
                        triage.first_received.push((i, first));
                    }
                    triage.ordered_runs.push((i, head));
                }
                Decision::Hold {
                    position,
                    behind,
                    gap,
                    was_head,
                } => {
                    if was_head {
                        cleared.push(KeyAdvance {
                            key: c.key,
                            head_ran: Some(c.message_id),
                            next_sequence: None,
                        });
                    }
                    let fresh = triage.run.iter().any(|&(r, _)| r == i);
                    holds.push((i, c.key, position, fresh));
                    // One note per key: one upsert cannot change a row twice.
                    match notes.iter_mut().find(|(k, _, _)| *k == c.key) {
                        Some((_, b, g)) => {
                            *b = b.take().or(behind);
                            *g |= gap;
                        }
                        None if behind.is_some() || gap => notes.push((c.key, behind, gap)),
                        None => {}
                    }
                    off.insert(i);
                    triage.decided.push((i, Outcome::Held));
                }
                Decision::StillHeld => triage.decided.push((i, Outcome::Held)),
                Decision::Refuse { code, message } => {
                    refused.push((i, HandlerError::permanent(code, message)));
                }
            }
        }
        if !refused.is_empty() {
            return Err(TxError::Handlers(refused));
        }
        triage.run.retain(|(i, _)| !off.contains(i));
        triage.reclaim.retain(|i| !off.contains(i));
        triage.first_received.retain(|(i, _)| !off.contains(i));
        order
            .ledger
            .advance(tx, &self.consumer, &cleared)
            .await
            .map_err(TxError::from_store)?;
        self.write_holds(order, items, &holds, &notes, tx).await
    }

    /// Records the held rows (positions given in arrival order where no sequence number
    /// gives one) and the keys' notes (a head found failing in this round, a gap).
    async fn write_holds(
        &self,
        order: &KeyOrder,
        items: &[Parsed],
        holds: &[(usize, &str, Option<i64>, bool)],
        notes: &[(&str, Option<String>, bool)],
        tx: &mut PgConnection,
    ) -> Result<(), TxError> {
        let unnumbered = holds.iter().filter(|h| h.2.is_none()).count();
        let mut positions = order
            .ledger
            .positions(tx, unnumbered)
            .await
            .map_err(TxError::from_store)?
            .into_iter();
        let rows: Vec<HeldRow<'_>> = holds
            .iter()
            .map(|&(i, key, position, fresh)| HeldRow {
                envelope: &items[i].envelope,
                key,
                position: position.or_else(|| positions.next()).unwrap_or_default(),
                fresh,
            })
            .collect();
        self.store
            .hold(tx, &self.consumer, &rows)
            .await
            .map_err(TxError::from_store)?;
        let first_sequence = order.policy.sequence.as_ref().map(|s| s.first);
        let notes: Vec<KeyNote<'_>> = notes
            .iter()
            .map(|(key, behind, gap)| KeyNote {
                key,
                head: behind.as_deref(),
                first_sequence,
                gap: *gap,
            })
            .collect();
        order
            .ledger
            .note(tx, &self.consumer, &notes)
            .await
            .map_err(TxError::from_store)
    }

    /// After the handler ran: the keys whose head ran are unblocked, sequence numbers move on.
    async fn advance_order(
        &self,
        items: &[Parsed],
        runs: &[(usize, bool)],
        tx: &mut PgConnection,
    ) -> Result<(), TxError> {
        let Some(order) = &self.ordering else {
            return Ok(());
        };
        let mut advances: Vec<KeyAdvance<'_>> = Vec::new();
        for &(i, head) in runs {
            let envelope = &items[i].envelope;
            let Ok(Some((key, sequence))) = Self::order_of(order, envelope) else {
                continue;
            };
            if !head && sequence.is_none() {
                continue;
            }
            let next = sequence.map(|s| s + 1);
            match advances.iter_mut().find(|a| a.key == key) {
                Some(a) => {
                    a.next_sequence = a.next_sequence.max(next);
                    if head {
                        a.head_ran = Some(&envelope.message_id);
                    }
                }
                None => advances.push(KeyAdvance {
                    key,
                    head_ran: head.then_some(envelope.message_id.as_str()),
                    next_sequence: next,
                }),
            }
        }
        order
            .ledger
            .advance(tx, &self.consumer, &advances)
            .await
            .map_err(TxError::from_store)
    }

    /// In the failure transaction: each ordered message whose own row now records its failure
    /// (a retry scheduled, or parked) blocks its key, unless the key is blocked already. An
    /// unusable ordering header or a passed sequence number blocks nothing.
    async fn block_order_keys(
        &self,
        items: &[Parsed],
        failures: &[PendingFailure],
        decided: &[(usize, Outcome)],
        tx: &mut PgConnection,
    ) -> Result<(), FailureTxError> {
        let Some(order) = &self.ordering else {
            return Ok(());
        };
        let sequenced = order.policy.sequence.as_ref().map(|s| s.first);
        let mut notes: Vec<KeyNote<'_>> = Vec::new();
        let mut failed_rows = Vec::new();
        for f in failures {
            if f.invalid || !blocks_its_key(&f.code) {
                continue;
            }
            let own_row = decided.iter().any(|(i, o)| {
                *i == f.index
                    && matches!(
                        o,
                        Outcome::RetryScheduled { .. }
                            | Outcome::Parked {
                                attempt: Some(_),
                                ..
                            }
                    )
            });
            let envelope = &items[f.index].envelope;
            let Ok(Some((key, sequence))) = Self::order_of(order, envelope) else {
                continue;
            };
            if own_row {
                failed_rows.push((envelope.message_id.as_str(), key, sequence));
            }
            if own_row && !notes.iter().any(|n| n.key == key) {
                notes.push(KeyNote {
                    key,
                    head: Some(&envelope.message_id),
                    first_sequence: sequenced,
                    gap: false,
                });
            }
        }
        let mut keys: Vec<&str> = notes.iter().map(|n| n.key).collect();
        keys.sort_unstable();
        order
            .ledger
            .lock_keys(tx, &self.consumer, &keys)
            .await
            .and(Ok(()))
            .map_err(FailureTxError::store)?;
        order
            .ledger
            .mark_failed(tx, &self.consumer, &failed_rows)
            .await
            .map_err(FailureTxError::store)?;
        order
            .ledger
            .note(tx, &self.consumer, &notes)
            .await
            .map_err(FailureTxError::store)
    }
}

/// Why recording failures did not commit.
enum FailureTxError {
    /// The failure at this position (unknown when several were written in one statement)
    /// cannot be stored as it is.
    Unstorable(Option<usize>, String),
    Transient(String),
    Outage(String),
}

impl FailureTxError {
    fn outage(e: sqlx::Error) -> Self {
        FailureTxError::Outage(e.to_string())
    }

    fn store(e: StoreError) -> Self {
        match &e {
            StoreError::Database(db) if DbErrorClass::of(db) == DbErrorClass::Transient => {
                FailureTxError::Transient(e.to_string())
            }
            _ => FailureTxError::Outage(e.to_string()),
        }
    }
}

/// Runs a savepoint statement of the runtime's own.
async fn savepoint(tx: &mut PgConnection, statement: &'static str) -> Result<(), TxError> {
    sqlx::raw_sql(statement)
        .execute(tx)
        .await
        .map(|_| ())
        .map_err(|e| TxError::from_db(&e, &e.to_string()))
}

/// The outcome of a copy whose body differs from the one first recorded under its key: parked,
/// the row untouched but for the conflict count.
pub(crate) fn payload_conflict(record: &InboxRecord, envelope: &Envelope) -> Outcome {
    Outcome::Parked {
        status: record.status,
        code: PAYLOAD_CONFLICT.into(),
        message: format!(
            "message id {} was first received with another body (sha256 {}); \
             this copy (sha256 {}) was not processed: the producer reuses ids",
            envelope.message_id,
            hex::encode(&record.payload_sha256),
            hex::encode(envelope.payload_sha256)
        ),
        attempt: None,
    }
}

/// The outcome of a copy of a parked row: parked again with the row's reason.
pub(crate) fn parked_again(record: &InboxRecord) -> Outcome {
    Outcome::Parked {
        status: record.status,
        code: record.last_error_code.clone().unwrap_or_default(),
        message: record.last_error_message.clone().unwrap_or_default(),
        attempt: Some(record.processing_attempt),
    }
}

/// The attempt a retry-tier copy was scheduled for (the consumer's own header on the copies
/// it sends to a tier); `None` on any other copy.
pub(crate) fn scheduled_attempt(envelope: &Envelope) -> Option<i32> {
    envelope
        .headers
        .get(crate::status::parking_headers::RETRY_ATTEMPT)
        .and_then(serde_json::Value::as_i64)
        .and_then(|n| i32::try_from(n).ok())
}

/// Whether a recorded body hash is this envelope's body. Rows may hold the hash of the raw
/// bytes (recorded before bodies were hashed in canonical form, or by a consumer configured
/// so), so both count.
pub(crate) fn same_body(recorded: &[u8], envelope: &Envelope) -> bool {
    recorded == envelope.payload_sha256 || recorded == envelope.raw_body_sha256()
}

/// The envelope as a minimal ledger row: key, type (bounded), version and body hash; none of
/// the producer's optional fields or headers, no body.
fn minimal(envelope: &Envelope) -> Envelope {
    Envelope {
        message_id: envelope.message_id.clone(),
        message_type: envelope.message_type.chars().take(255).collect(),
        message_version: envelope.message_version,
        aggregate_type: None,
        aggregate_id: None,
        correlation_id: None,
        causation_id: None,
        traceparent: None,
        tenant_id: None,
        headers: serde_json::Map::new(),
        payload: serde_json::Value::Null,
        body: Vec::new(),
        payload_sha256: envelope.payload_sha256,
        redelivered: envelope.redelivered,
        death_count: envelope.death_count,
    }
}

/// Transaction-scoped advisory locks on the aggregates of `envelopes`, taken in key order so
/// that two transactions locking overlapping sets cannot deadlock.
async fn lock_aggregates<'a>(
    conn: &mut PgConnection,
    consumer: &str,
    envelopes: impl Iterator<Item = &'a Envelope>,
) -> Result<(), StoreError> {
    let mut keys: Vec<i64> = envelopes
        .filter_map(|e| {
            let id = e.aggregate_id.as_deref()?;
            let mut h = Sha256::new();
            for part in [consumer, e.aggregate_type.as_deref().unwrap_or(""), id] {
                h.update(part.as_bytes());
                h.update([0u8]);
            }
            let digest = h.finalize();
            let mut first = [0u8; 8];
            first.copy_from_slice(&digest[..8]);
            Some(i64::from_be_bytes(first))
        })
        .collect();
    keys.sort_unstable();
    keys.dedup();
    if !keys.is_empty() {
        sqlx::query("SELECT count(pg_advisory_xact_lock(k)) FROM unnest($1::int8[]) AS k")
            .bind(&keys)
            .execute(conn)
            .await?;
    }
    Ok(())
}
