//! The leased counterpart of [`crate::processor::Processor`]: a short claim transaction per
//! message, the handler's work outside any transaction under a heartbeated lease, a fenced
//! completion (or failure) transaction. Invalid deliveries are recorded exactly as the
//! transactional mode records them.

use std::{panic::AssertUnwindSafe, sync::Arc};

use futures::{FutureExt, future::BoxFuture};
use sqlx::{Connection, PgConnection, PgPool};

use super::{
    config::LeaseConfig,
    fencing::{Lease, LeaseError, owner_name},
    handler::LeasedHandler,
    sql::LeaseSql,
};
use crate::{
    config::ConsumerConfig,
    db_error::{DbErrorClass, deterministic_code},
    envelope::Envelope,
    error::StoreError,
    handler::{BatchError, BatchHandler, ErrorKind, HandlerError, InboxMessage},
    privacy::PayloadStorage,
    processor::{
        LaneConnection, Parsed, Process, Processor, parked_again, payload_conflict, same_body,
        scheduled_attempt,
    },
    retry::RetryPolicy,
    status::{InboxStatus, LEASE_LOST, Outcome},
    store::{Claim, InboxRecord, InboxStore, Redelivery},
};

/// What a claim transaction decided for one message.
enum Claimed {
    /// This worker holds the lease: run attempt `attempt` under `token`.
    Run { attempt: i32, token: i64 },
    /// Settled without running (duplicate, parked, in flight elsewhere).
    Decided(Outcome),
}

/// Never runs: the recorder below is only given invalid deliveries and unclaimable ones.
struct NoHandler;

impl BatchHandler for NoHandler {
    async fn handle_batch(
        &self,
        _msgs: &[InboxMessage<'_>],
        _tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        Err(BatchError::Batch(HandlerError::retryable(
            "internal",
            "the leased consumer's failure recorder ran a handler",
        )))
    }
}

pub(crate) struct LeasedProcessor<L> {
    pool: PgPool,
    store: InboxStore,
    sql: Arc<LeaseSql>,
    handler: L,
    consumer: String,
    owner: Arc<str>,
    lease: LeaseConfig,
    retry: RetryPolicy,
    payload_storage: PayloadStorage,
    body_must_match: bool,
    /// Records invalid and unclaimable deliveries the way the transactional mode does.
    recorder: Processor<NoHandler>,
    /// What `commit` enqueues through, in the completion transaction.
    outbox: crate::outbox::Outbox,
}

impl<L: LeasedHandler> LeasedProcessor<L> {
    pub(crate) fn new(
        pool: PgPool,
        handler: L,
        config: &ConsumerConfig,
        lease: LeaseConfig,
        stats: Arc<crate::stats::ConsumerStats>,
    ) -> Self {
        Self {
            // The privacy rules apply to what the claim stores, as in the transactional mode.
            store: InboxStore::new(config.schema.clone())
                .with_privacy(config.payload_storage, config.privacy.clone()),
            sql: Arc::new(LeaseSql::new(&config.schema)),
            handler,
            consumer: config.consumer_name.clone(),
            owner: owner_name(&config.consumer_name).into(),
            lease,
            retry: config.retry.clone(),
            payload_storage: config.payload_storage,
            body_must_match: config.envelope.dedup.body_must_match(),
            recorder: Processor::new(pool.clone(), Arc::new(NoHandler), config, stats),
            outbox: crate::outbox::Outbox::new(config.schema.clone())
                .with_notify(config.outbox_notify),
            pool,
        }
    }

    async fn process(&self, items: &[Parsed], db: &mut LaneConnection) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; items.len()];
        self.recorder.record_invalid(items, &mut outcomes, db).await;

        // Claims one by one, in delivery order: a second copy of a key in the batch meets the
        // first one's lease like any copy in flight elsewhere.
        let mut runs = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let Some(envelope) = item.valid() else {
                continue;
            };
            match self.claim(envelope, db).await {
                Ok(Claimed::Run { attempt, token }) => runs.push((i, envelope, attempt, token)),
                Ok(Claimed::Decided(outcome)) => outcomes[i] = Some(outcome),
                Err(e) => {
                    db.discard();
                    match &e {
                        StoreError::Database(db_error)
                            if DbErrorClass::of(db_error) == DbErrorClass::Deterministic =>
                        {
                            let code = match db_error {
                                sqlx::Error::Database(d) => {
                                    d.code().map(|c| deterministic_code(&c))
                                }
                                _ => None,
                            };
                            self.recorder
                                .record_unclaimable(
                                    items,
                                    i,
                                    code.unwrap_or("db_error"),
                                    e.to_string(),
                                    &mut outcomes,
                                    db,
                                )
                                .await;
                        }
                        _ => {
                            outcomes[i] = Some(Outcome::Unrecorded {
                                error: e.to_string(),
                            })
                        }
                    }
                }
            }
        }

        // The handlers of a batch work at once, each under its own lease.
        let done = futures::future::join_all(
            runs.into_iter()
                .map(|(i, envelope, attempt, token)| async move {
                    (i, self.run(envelope, attempt, token).await)
                }),
        )
        .await;
        for (i, outcome) in done {
            outcomes[i] = Some(outcome);
        }
        self.recorder.finish(items, outcomes)
    }

    /// One short transaction: claim the key, take the lease if the row may be taken.
    async fn claim(
        &self,
        envelope: &Envelope,
        db: &mut LaneConnection,
    ) -> Result<Claimed, StoreError> {
        let copy_locks = db.copy_lock_flag();
        let mut tx = db.begin().await?;
        let claimed = self.claim_in(&mut tx, envelope, &copy_locks).await;
        match claimed {
            Ok(claimed) => {
                tx.commit().await?;
                Ok(claimed)
            }
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    /// The claim transaction's work: the row inserted and leased, or the existing row decided
    /// on.
    async fn claim_in(
        &self,
        tx: &mut PgConnection,
        envelope: &Envelope,
        copy_locks: &std::sync::atomic::AtomicBool,
    ) -> Result<Claimed, StoreError> {
        // The body is kept from the claim on (unless never kept): a lease that expires leaves
        // a PROCESSING row recovery may have to republish.
        let store_payload = self.payload_storage != PayloadStorage::Never;
        match self
            .store
            .try_claim(&mut *tx, &self.consumer, envelope, store_payload)
            .await?
        {
            Claim::Claimed => self.take(tx, envelope, true).await?.ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "row {} was inserted but could not be leased",
                    envelope.message_id
                ))
            }),
            Claim::Existing(record) => self.claim_existing(tx, envelope, &record, copy_locks).await,
        }
    }

    /// Takes the lease on the row of `envelope` (a `fresh` one just inserted, else one whose
    /// lease expired or that is due for a retry): `None` when the row may not be taken.
    async fn take(
        &self,
        tx: &mut PgConnection,
        envelope: &Envelope,
        fresh: bool,
    ) -> Result<Option<Claimed>, StoreError> {
        Ok(self
            .sql
            .take(
                tx,
                &self.consumer,
                &envelope.message_id,
                &self.owner,
                self.lease.ttl,
                fresh,
                self.retry.stale_processing_after,
            )
            .await?
            .map(|(attempt, token)| Claimed::Run { attempt, token }))
    }

    /// Decides a delivery of an existing row: counted on it, then a conflict, a copy already
    /// on its way, a duplicate, parked again, or the row's lease taken.
    async fn claim_existing(
        &self,
        tx: &mut PgConnection,
        envelope: &Envelope,
        record: &InboxRecord,
        copy_locks: &std::sync::atomic::AtomicBool,
    ) -> Result<Claimed, StoreError> {
        let conflict = self.body_must_match && !same_body(&record.payload_sha256, envelope);
        let db_now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut *tx)
            .await?;
        let pending = (!conflict)
            .then(|| record.pending_copy(scheduled_attempt(envelope), db_now))
            .flatten();
        self.store
            .note_redeliveries(
                &mut *tx,
                &self.consumer,
                &[Redelivery {
                    message_id: &envelope.message_id,
                    conflicting_sha256: conflict.then_some(&envelope.payload_sha256[..]),
                    duplicate_of: pending,
                }],
            )
            .await?;
        if conflict {
            return Ok(Claimed::Decided(payload_conflict(record, envelope)));
        }
        if let Some(copy) = pending {
            return Ok(Claimed::Decided(Outcome::CopyPending { copy }));
        }
        Ok(match record.status {
            InboxStatus::Processed => Claimed::Decided(Outcome::Duplicate),
            // Parked, no copy noted: park this copy, unless another session's copy of the row
            // is on its way (its copy lock held), as in the transactional processor.
            status if status.is_parked() => {
                let mine = self
                    .store
                    .try_copy_locks(&mut *tx, &self.consumer, &[&envelope.message_id])
                    .await?;
                if mine.first() == Some(&true) {
                    copy_locks.store(true, std::sync::atomic::Ordering::Relaxed);
                    Claimed::Decided(parked_again(record))
                } else {
                    Claimed::Decided(Outcome::InFlightElsewhere)
                }
            }
            // RETRYABLE_FAILED, or PROCESSING: taken only if its lease expired.
            _ => self
                .take(tx, envelope, false)
                .await?
                .unwrap_or(Claimed::Decided(Outcome::InFlightElsewhere)),
        })
    }

    /// The work under a heartbeated lease, then the fenced completion or failure.
    async fn run(&self, envelope: &Envelope, attempt: i32, token: i64) -> Outcome {
        let lease = Lease {
            pool: self.pool.clone(),
            sql: self.sql.clone(),
            consumer: self.consumer.clone(),
            message_id: envelope.message_id.clone(),
            owner: self.owner.clone(),
            token,
            lost: Default::default(),
        };
        let emitted = std::sync::atomic::AtomicU32::new(0);
        let msg = InboxMessage {
            envelope,
            consumer_name: &self.consumer,
            attempt,
            outbox: &self.outbox,
            emitted: &emitted,
        };
        // The heartbeat runs in the handler's own task: a worker whose task stops (a blocked
        // thread, a paused process) stops renewing too, as it should.
        let worked = {
            let mut work =
                std::pin::pin!(AssertUnwindSafe(self.handler.work(&msg, &lease)).catch_unwind());
            tokio::select! {
                worked = &mut work => worked,
                () = lease.keep_alive(self.lease) => work.await,
            }
        };
        let result = match worked {
            Ok(Ok(output)) => self.complete(&msg, &lease, output).await,
            Ok(Err(e)) => Err(LeaseError::Handler(e)),
            Err(panic) => Err(LeaseError::Handler(HandlerError::panicked(&*panic))),
        };
        match result {
            Ok(()) => Outcome::Processed,
            Err(LeaseError::Lost { .. }) => self.lost(&lease).await,
            Err(LeaseError::Handler(e)) if e.code() == LEASE_LOST => self.lost(&lease).await,
            Err(LeaseError::Handler(e)) => match e.db_class() {
                // Nothing durable about this attempt is known: back to the queue. Its lease
                // runs out and the copy (or recovery) takes the row over.
                Some(DbErrorClass::Outage) => Outcome::Unrecorded {
                    error: e.to_string(),
                },
                // Not the message's fault: requeued, never recorded (see `DbErrorClass`).
                Some(DbErrorClass::Deployment) => {
                    let sqlstate = e.deployment_sqlstate().unwrap_or_default().to_owned();
                    self.recorder
                        .report_deployment_faults(&[(sqlstate, e.message().to_owned())]);
                    Outcome::Unrecorded {
                        error: e.to_string(),
                    }
                }
                _ => self.fail(&lease, msg.envelope, e).await,
            },
            Err(LeaseError::Database(e)) => match DbErrorClass::of(&e) {
                DbErrorClass::Deterministic => {
                    self.fail(&lease, msg.envelope, HandlerError::from(e)).await
                }
                _ => Outcome::Unrecorded {
                    error: e.to_string(),
                },
            },
        }
    }

    /// The completion transaction: lock and check the lease, the handler's effect, PROCESSED.
    async fn complete(
        &self,
        msg: &InboxMessage<'_>,
        lease: &Lease,
        output: L::Output,
    ) -> Result<(), LeaseError> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        match self.complete_in(&mut tx, msg, lease, output).await {
            Ok(()) => Ok(tx.commit().await?),
            Err(e) => {
                // Now, not lazily: a failure is recorded next and would wait for this lock.
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    async fn complete_in(
        &self,
        tx: &mut PgConnection,
        msg: &InboxMessage<'_>,
        lease: &Lease,
        output: L::Output,
    ) -> Result<(), LeaseError> {
        let txid = lease.check(&mut *tx).await?;
        AssertUnwindSafe(self.handler.commit(msg, output, &mut *tx))
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| Err(HandlerError::panicked(&*panic)))
            .map_err(LeaseError::Handler)?;
        // The handler must have left the transaction as it found it: open, not aborted.
        let same: Option<i64> = sqlx::query_scalar("SELECT txid_current_if_assigned()")
            .fetch_one(&mut *tx)
            .await
            .map_err(|e| LeaseError::Handler(HandlerError::from(e)))?;
        if same != Some(txid) {
            return Err(LeaseError::Handler(HandlerError::retryable(
                crate::status::TRANSACTION_ABORTED,
                "the commit handler ended the completion transaction itself",
            )));
        }
        let keep_payload = self.payload_storage == PayloadStorage::Always;
        if !self
            .sql
            .complete(
                &mut *tx,
                &self.consumer,
                &lease.message_id,
                lease.token,
                &lease.owner,
                keep_payload,
            )
            .await?
        {
            return Err(lease.lost_error(None));
        }
        Ok(())
    }

    /// Records the handler's failure while the lease is still held; a lost lease otherwise.
    async fn fail(&self, lease: &Lease, envelope: &Envelope, e: HandlerError) -> Outcome {
        let status = match e.kind() {
            ErrorKind::Retryable => InboxStatus::RetryableFailed,
            ErrorKind::Permanent => InboxStatus::PermanentFailed,
        };
        let error = self
            .store
            .stored_error(&self.consumer, envelope, e.message(), e.safe_detail());
        let recorded = self
            .sql
            .fail(
                &self.pool,
                &self.consumer,
                &lease.message_id,
                lease.token,
                &lease.owner,
                status,
                e.code(),
                &error,
                self.retry.max_attempts,
                self.payload_storage != PayloadStorage::Never,
            )
            .await;
        let outcome = match recorded {
            Ok(Some((InboxStatus::RetryableFailed, attempt))) => Outcome::RetryScheduled {
                attempt,
                code: e.code().to_owned(),
            },
            Ok(Some((status, attempt))) => Outcome::Parked {
                status,
                code: e.code().to_owned(),
                message: e.message().to_owned(),
                attempt: Some(attempt),
            },
            Ok(None) => self.lost(lease).await,
            Err(error) => Outcome::Unrecorded {
                error: format!("could not record failure {}: {error}", e.code()),
            },
        };
        self.recorder
            .log_failure(envelope, &outcome, e.safe_detail());
        outcome
    }

    /// This worker's lease was taken over: the delivery is settled by the row as it is now,
    /// never acked as processed on this worker's say-so.
    async fn lost(&self, lease: &Lease) -> Outcome {
        metrics::counter!(crate::telemetry::metrics::LEASES_LOST, "consumer" => self.consumer.clone())
            .increment(1);
        tracing::warn!(
            message_id = %lease.message_id,
            token = lease.token,
            "lease lost: another worker or recovery took the message over; this worker's completion was refused"
        );
        let row = async {
            let mut conn = self.pool.acquire().await?;
            self.store
                .find(&mut conn, &self.consumer, &lease.message_id)
                .await
        }
        .await;
        match row {
            Ok(Some(row)) if row.status == InboxStatus::Processed => Outcome::Duplicate,
            Ok(Some(row)) if row.status.is_parked() => parked_again(&row),
            // Someone else's run, or a retry on its way: this copy waits in the first tier
            // and then meets that outcome.
            Ok(_) => Outcome::InFlightElsewhere,
            Err(e) => Outcome::Unrecorded {
                error: e.to_string(),
            },
        }
    }
}

impl<L: LeasedHandler> Process for LeasedProcessor<L> {
    fn lane_connection(&self) -> LaneConnection {
        LaneConnection::new(self.pool.clone())
    }

    fn process_batch<'a>(
        &'a self,
        items: &'a [Parsed],
        db: &'a mut LaneConnection,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(self.process(items, db))
    }

    fn store(&self) -> (&InboxStore, &str) {
        (&self.store, &self.consumer)
    }

    fn flush_failure_log(&self) {
        self.recorder.flush_failure_log();
    }
}
