//! Turns a batch of parsed deliveries into durable outcomes (database only; no broker here).
//!
//! One transaction per batch: claim all keys with one multi-row insert, run the handler for the
//! new ones, mark them PROCESSED, commit once. A handler failure rolls the batch back; the batch
//! is re-run without the failing message (optimistic group commit: cheap when failures are rare),
//! and the failure is recorded afterwards in its own short transaction.

use std::{collections::HashMap, sync::Arc};

use sha2::{Digest, Sha256};
use sqlx::{Connection, PgConnection, PgPool, Postgres, pool::PoolConnection};

use crate::{
    config::{ConsumerConfig, PayloadStorage, RetryPolicy},
    envelope::{Envelope, InvalidMessage},
    error::StoreError,
    handler::{BatchError, BatchHandler, ErrorKind, HandlerError, InboxMessage},
    store::{Claim, Failure, InboxStatus, InboxStore, Redelivery},
};

/// A delivery after parsing: an envelope, or the reason it cannot be processed.
pub(crate) type Parsed = Result<Envelope, Box<InvalidMessage>>;

/// The durable result of one delivery, produced only after the state it describes is committed
/// (or when none could be written). Each maps to one broker action (see ARCHITECTURE.md).
#[derive(Clone, Debug, PartialEq)]
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
    },
    /// Another consumer holds a fresh PROCESSING row for this key. Broker: delayed retry.
    InFlightElsewhere,
    /// Nothing durable could be written (database unreachable, commit outcome unknown).
    /// Broker: requeued after a back-off, so the message comes back.
    Unrecorded {
        /// Why.
        error: String,
    },
}

/// Error code of a body that differs from the one first recorded under the same key.
pub const PAYLOAD_CONFLICT: &str = "payload_conflict";

/// A lane's database connection, kept across batches: taking one from the pool costs a ping
/// round trip each time. Discarded after a database error, so a broken one is not reused.
pub(crate) struct LaneConnection {
    pool: PgPool,
    conn: Option<PoolConnection<Postgres>>,
}

impl LaneConnection {
    pub(crate) fn new(pool: PgPool) -> Self {
        Self { pool, conn: None }
    }

    async fn get(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        if self.conn.is_none() {
            self.conn = Some(self.pool.acquire().await?);
        }
        match self.conn.as_mut() {
            Some(conn) => Ok(&mut **conn),
            None => Err(sqlx::Error::PoolClosed),
        }
    }

    fn discard(&mut self) {
        self.conn = None;
    }
}

pub(crate) struct Processor<H> {
    pool: PgPool,
    store: InboxStore,
    handler: Arc<H>,
    consumer: String,
    retry: RetryPolicy,
    lock_aggregates: bool,
    payload_storage: PayloadStorage,
    body_must_match: bool,
}

/// Why a batch transaction did not commit.
enum TxError {
    /// The handler failed for the message at this index: re-run without it.
    Handler(usize, HandlerError),
    /// A batch handler failed without saying for which message: isolate them.
    Unattributed(HandlerError),
    /// Deadlock, serialization failure or a row that vanished mid-claim: run again.
    Transient(StoreError),
    /// The database failed; nothing was committed (or the commit outcome is unknown).
    Database(StoreError),
}

impl From<StoreError> for TxError {
    fn from(e: StoreError) -> Self {
        let transient = match &e {
            StoreError::Corrupt(_) => true,
            StoreError::Database(sqlx::Error::Database(db)) => {
                matches!(db.code().as_deref(), Some("40001" | "40P01"))
            }
            _ => false,
        };
        if transient {
            TxError::Transient(e)
        } else {
            TxError::Database(e)
        }
    }
}

impl From<sqlx::Error> for TxError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::from(e).into()
    }
}

/// Transaction attempts for deadlocks and the like before giving up on a batch.
const MAX_TRANSIENT_RETRIES: u32 = 3;

impl<H: BatchHandler> Processor<H> {
    pub(crate) fn new(pool: PgPool, handler: Arc<H>, config: &ConsumerConfig) -> Self {
        Self {
            pool,
            store: InboxStore::new(config.schema.clone()),
            handler,
            consumer: config.consumer_name.clone(),
            retry: config.retry.clone(),
            lock_aggregates: config.lock_aggregates,
            payload_storage: config.payload_storage,
            body_must_match: config.envelope.dedup.body_must_match(),
        }
    }

    /// A connection slot for one lane.
    pub(crate) fn lane_connection(&self) -> LaneConnection {
        LaneConnection::new(self.pool.clone())
    }

    /// Processes a batch; returns one outcome per item, in order.
    pub(crate) async fn process(&self, items: &[Parsed], db: &mut LaneConnection) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; items.len()];

        // Bad input: recorded and parked, never processed.
        for (i, item) in items.iter().enumerate() {
            if let Err(invalid) = item {
                let store_payload = self.payload_storage != PayloadStorage::Never
                    && invalid.reason != crate::InvalidReason::PayloadTooLarge;
                outcomes[i] = Some(
                    self.record_failure(
                        &invalid.envelope,
                        InboxStatus::PermanentFailed,
                        invalid.reason.code(),
                        &invalid.detail,
                        store_payload,
                    )
                    .await,
                );
            }
        }

        // The same key twice in one batch: later copies wait for a later round, where they meet
        // the first copy's committed outcome like any redelivery.
        let mut pending: Vec<usize> = (0..items.len()).filter(|&i| items[i].is_ok()).collect();
        while !pending.is_empty() {
            let mut seen = HashMap::new();
            let (round, later): (Vec<usize>, Vec<usize>) = pending.into_iter().partition(|&i| {
                let key = envelope_of(items, i).message_id.as_str();
                seen.insert(key, ()).is_none()
            });
            self.run_round(items, round, &mut outcomes, db).await;
            pending = later;
        }

        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| Outcome::Unrecorded {
                    error: "internal: no outcome".into(),
                })
            })
            .collect()
    }

    async fn run_round(
        &self,
        items: &[Parsed],
        round: Vec<usize>,
        outcomes: &mut [Option<Outcome>],
        db: &mut LaneConnection,
    ) {
        let mut active = round;
        let mut failed: Vec<(usize, HandlerError)> = Vec::new();
        let mut transient_retries = 0;
        while !active.is_empty() {
            let attempt = self.transaction(items, &active, db).await;
            if matches!(attempt, Err(TxError::Database(_))) {
                db.discard();
            }
            match attempt {
                Ok(decided) => {
                    for (i, outcome) in decided {
                        outcomes[i] = Some(outcome);
                    }
                    break;
                }
                Err(TxError::Handler(i, e)) => {
                    active.retain(|&a| a != i);
                    failed.push((i, e));
                }
                Err(TxError::Unattributed(e)) if active.len() > 1 => {
                    tracing::debug!(error = %e, "batch failed without a culprit; isolating its messages");
                    for i in std::mem::take(&mut active) {
                        Box::pin(self.run_round(items, vec![i], outcomes, db)).await;
                    }
                }
                Err(TxError::Unattributed(e)) => {
                    failed.extend(active.drain(..).map(|i| (i, e.clone())));
                }
                Err(TxError::Transient(e)) if transient_retries < MAX_TRANSIENT_RETRIES => {
                    transient_retries += 1;
                    tracing::debug!(error = %e, "batch transaction conflict, running it again");
                }
                Err(TxError::Transient(e) | TxError::Database(e)) if active.len() > 1 => {
                    // A handler may have swallowed an SQL error and left the transaction
                    // aborted: isolate the messages so only the culprit is blamed.
                    tracing::warn!(error = %e, batch = active.len(), "batch failed; retrying one message per transaction");
                    for i in std::mem::take(&mut active) {
                        Box::pin(self.run_round(items, vec![i], outcomes, db)).await;
                    }
                }
                Err(TxError::Transient(e) | TxError::Database(e)) => {
                    let error = e.to_string();
                    for &i in &active {
                        outcomes[i] = Some(match &e {
                            StoreError::Database(sqlx::Error::Database(db))
                                if db.code().as_deref() == Some("25P02") =>
                            {
                                // The transaction was aborted by a statement the handler ran
                                // and ignored.
                                failed.push((
                                    i,
                                    HandlerError::retryable(
                                        "transaction_aborted",
                                        db.message().to_owned(),
                                    ),
                                ));
                                continue;
                            }
                            _ => Outcome::Unrecorded {
                                error: error.clone(),
                            },
                        });
                    }
                    break;
                }
            }
        }
        for (i, e) in failed {
            let status = match e.kind() {
                ErrorKind::Retryable => InboxStatus::RetryableFailed,
                ErrorKind::Permanent => InboxStatus::PermanentFailed,
            };
            let store_payload = self.payload_storage != PayloadStorage::Never;
            outcomes[i] = Some(
                self.record_failure(
                    envelope_of(items, i),
                    status,
                    e.code(),
                    e.message(),
                    store_payload,
                )
                .await,
            );
        }
    }

    /// One attempt at the batch transaction. Returns the outcomes of all `active` items.
    async fn transaction(
        &self,
        items: &[Parsed],
        active: &[usize],
        db: &mut LaneConnection,
    ) -> Result<Vec<(usize, Outcome)>, TxError> {
        let mut tx = db.get().await?.begin().await?;
        match self.apply(items, active, &mut tx).await {
            Ok(decided) => {
                // A failed commit leaves the outcome unknown: report Unrecorded, the message
                // comes back, and the inbox tells on redelivery whether it committed.
                tx.commit()
                    .await
                    .map_err(|e| TxError::Database(StoreError::from(e)))?;
                Ok(decided)
            }
            Err(e) => {
                // Roll back now, not lazily on the connection's next use: the failure is
                // recorded next on another connection and would wait for this claim's locks.
                tx.rollback()
                    .await
                    .map_err(|e| TxError::Database(StoreError::from(e)))?;
                Err(e)
            }
        }
    }

    /// The batch transaction's work: claims, decisions, handlers, marks. Returns the outcomes
    /// it will have once committed.
    async fn apply(
        &self,
        items: &[Parsed],
        active: &[usize],
        tx: &mut PgConnection,
    ) -> Result<Vec<(usize, Outcome)>, TxError> {
        let envelopes: Vec<&Envelope> = active.iter().map(|&i| envelope_of(items, i)).collect();
        let claims = self
            .store
            .try_claim_many_committing(
                &mut *tx,
                &self.consumer,
                &envelopes,
                self.payload_storage == PayloadStorage::Always,
            )
            .await?;

        let mut decided = Vec::with_capacity(active.len());
        let mut run: Vec<(usize, i32)> = Vec::new();
        let mut reclaim: Vec<usize> = Vec::new();
        let mut redeliveries = Vec::new();
        for ((&i, envelope), claim) in active.iter().zip(&envelopes).zip(claims) {
            let record = match claim {
                Claim::Claimed => {
                    run.push((i, 1));
                    continue;
                }
                Claim::Existing(record) => record,
            };
            let conflict =
                self.body_must_match && record.payload_sha256[..] != envelope.payload_sha256[..];
            redeliveries.push(Redelivery {
                message_id: &envelope.message_id,
                conflicting_sha256: conflict.then_some(&envelope.payload_sha256[..]),
            });
            if conflict {
                decided.push((
                    i,
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
                    },
                ));
                continue;
            }
            let outcome = match record.status {
                InboxStatus::Processed => Outcome::Duplicate,
                InboxStatus::RetryableFailed => {
                    reclaim.push(i);
                    continue;
                }
                InboxStatus::Processing => {
                    let stale_after = chrono::Duration::from_std(self.retry.stale_processing_after)
                        .unwrap_or(chrono::Duration::MAX);
                    let started = record
                        .processing_started_at
                        .unwrap_or(record.last_received_at);
                    if chrono::Utc::now() - started > stale_after {
                        reclaim.push(i);
                        continue;
                    }
                    Outcome::InFlightElsewhere
                }
                // Already parked once; this copy is a redelivery (e.g. a crash between the
                // parking publish and the ack). Park it again rather than risk losing it.
                InboxStatus::PermanentFailed | InboxStatus::Poisoned => Outcome::Parked {
                    status: record.status,
                    code: record.last_error_code.clone().unwrap_or_default(),
                    message: record.last_error_message.clone().unwrap_or_default(),
                },
            };
            decided.push((i, outcome));
        }
        if !reclaim.is_empty() {
            let ids: Vec<&str> = reclaim
                .iter()
                .map(|&i| envelope_of(items, i).message_id.as_str())
                .collect();
            let attempts = self
                .store
                .mark_processing(&mut *tx, &self.consumer, &ids)
                .await?;
            for &i in &reclaim {
                let id = &envelope_of(items, i).message_id;
                let attempt = attempts
                    .iter()
                    .find(|(a, _)| a == id)
                    .map(|(_, n)| *n)
                    .ok_or_else(|| {
                        StoreError::Corrupt(format!("row {id} could not be reclaimed"))
                    })?;
                run.push((i, attempt));
            }
        }
        self.store
            .note_redeliveries(&mut *tx, &self.consumer, &redeliveries)
            .await?;

        if self.lock_aggregates {
            lock_aggregates(
                &mut *tx,
                &self.consumer,
                run.iter().map(|&(i, _)| envelope_of(items, i)),
            )
            .await?;
        }
        if !run.is_empty() {
            // Delivery order, whatever order the claims came back in.
            run.sort_unstable_by_key(|&(i, _)| i);
            let msgs: Vec<InboxMessage<'_>> = run
                .iter()
                .map(|&(i, attempt)| InboxMessage {
                    envelope: envelope_of(items, i),
                    consumer_name: &self.consumer,
                    attempt,
                })
                .collect();
            match self.handler.handle_batch(&msgs, &mut *tx).await {
                Ok(()) => {}
                Err(BatchError::Message { index, error }) => {
                    let i = run.get(index).map(|&(i, _)| i).ok_or_else(|| {
                        TxError::Unattributed(HandlerError::retryable(
                            "bad_batch_index",
                            format!("batch handler blamed message {index} of {}", run.len()),
                        ))
                    })?;
                    return Err(TxError::Handler(i, error));
                }
                Err(BatchError::Batch(error)) => return Err(TxError::Unattributed(error)),
            }
        }
        // New rows were inserted PROCESSED already; reclaimed ones still need the update.
        if !reclaim.is_empty() {
            let ids: Vec<&str> = reclaim
                .iter()
                .map(|&i| envelope_of(items, i).message_id.as_str())
                .collect();
            self.store
                .mark_processed(
                    &mut *tx,
                    &self.consumer,
                    &ids,
                    self.payload_storage == PayloadStorage::Always,
                )
                .await?;
        }
        decided.extend(run.into_iter().map(|(i, _)| (i, Outcome::Processed)));
        Ok(decided)
    }

    /// Records a failure in its own short transaction and says where the message goes.
    async fn record_failure(
        &self,
        envelope: &Envelope,
        status: InboxStatus,
        code: &str,
        message: &str,
        store_payload: bool,
    ) -> Outcome {
        let failure = Failure {
            status,
            code,
            message,
            max_attempts: self.retry.max_attempts,
            store_payload,
        };
        let recorded = async {
            let mut conn = self.pool.acquire().await?;
            self.store
                .record_failure(&mut conn, &self.consumer, envelope, failure)
                .await
        }
        .await;
        match recorded {
            Ok(Some((InboxStatus::RetryableFailed, attempt))) => Outcome::RetryScheduled {
                attempt,
                code: code.to_owned(),
            },
            Ok(Some((status, _))) => Outcome::Parked {
                status,
                code: code.to_owned(),
                message: message.to_owned(),
            },
            Ok(None) => Outcome::Duplicate,
            Err(e) => Outcome::Unrecorded {
                error: format!("could not record failure {code}: {e}"),
            },
        }
    }
}

fn envelope_of(items: &[Parsed], i: usize) -> &Envelope {
    match &items[i] {
        Ok(envelope) => envelope,
        Err(invalid) => &invalid.envelope,
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
