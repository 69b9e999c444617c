//! The release of held messages of an ordered consumer (see
//! [`rabbit_inbox::ordering::OrderingPolicy`]), on a timer beside the consumer: [`ReleaseTask`].
//!
//! The consumer records a message HELD (with its body) while its ordering key is blocked by a
//! failed or parked head, or waits for a missing sequence number; nobody else publishes it
//! again. Each pass of the task finds the keys that are not blocked and have HELD rows, and
//! for each takes its first HELD row (by position):
//!
//! - its turn has come (without sequence numbers always; with them when its number is the
//!   one the key waits for): a copy of the stored message (body opened when sealed, headers)
//!   is published to the work queue, confirmed, and the row's `released_at` set, in the
//!   transaction that locks the row. The consumer runs the copy like any delivery, marks the
//!   row PROCESSED, and the next pass releases the key's next row. A copy that does not come
//!   back within the policy's `release_timeout` is published again (a duplicate at worst);
//! - its number is above the one the key waits for: a gap, whose clock starts now if the
//!   consumer did not start it. A gap that outlives the policy's `gap_timeout` is logged,
//!   counted ([`rabbit_inbox::telemetry::metrics::SEQUENCE_GAPS`]) and handled by the policy's
//!   [`GapPolicy`]: keep holding, release past the gap, or park the held followers.
//!
//! A held row whose message cannot be published again (no payload kept, redacted) goes to
//! MANUAL_REVIEW and becomes its key's head, so the key's order is never silently broken.
//!
//! **Invariant:** every change to a key's held rows is made under the key's transaction-scoped
//! advisory lock, the one the consumer's batch transaction takes, so the task and the consumer
//! never decide on one key at once; a busy key is left for the next pass.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::json;
use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};

use crate::{
    actor::Actor,
    audit::audit,
    error::OpsError,
    operations::Operations,
    recover::{Unrepublishable, publish},
};
use rabbit_inbox::{
    broker::{Broker, OutgoingMessage},
    config::ConsumerConfig,
    ledger_sql::{PROCESSED, Statuses, tables},
    ordering::{GapPolicy, OrderingPolicy, SequencePolicy, key_lock},
    status::{InboxStatus, SEQUENCE_GAP, parking_headers},
    telemetry::metrics as m,
};

/// The actor the task's audit rows name.
pub const RELEASE_ACTOR: &str = "release-task";

/// Error code of a held row moved to manual review because its message cannot be published
/// again (no payload kept, or only a redacted one).
pub const HELD_PAYLOAD_LOST: &str = "held_payload_lost";

/// Most keys one pass looks at.
const KEYS_PER_PASS: i64 = 200;

/// Most held rows of one key parked per transaction when a gap's policy parks them.
const PARKED_PER_TRANSACTION: i64 = 200;

/// The HELD status as an SQL literal.
const HELD: Statuses = Statuses(&[InboxStatus::Held]);

/// What one pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ReleaseReport {
    /// Held rows whose copy was published to the work queue.
    pub released: usize,
    /// Gaps whose clock this pass started.
    pub gaps_started: usize,
    /// Gaps that outlived their timeout and were acted on.
    pub gaps_timed_out: usize,
    /// Held rows parked by a gap's policy.
    pub parked: usize,
    /// Held rows moved to manual review (their message cannot be published again).
    pub manual_review: usize,
    /// Keys left for the next pass: busy (the consumer was deciding on them) or changed.
    pub skipped: usize,
    /// Publishes the broker did not confirm (the rows stay as they were).
    pub failed: usize,
    /// Held rows sealed with a key this task does not hold: tried again after the policy's
    /// `release_timeout`.
    pub sealed: usize,
}

impl ReleaseReport {
    /// Whether the pass changed or published anything.
    pub fn acted(&self) -> bool {
        self.released
            + self.gaps_timed_out
            + self.parked
            + self.manual_review
            + self.failed
            + self.sealed
            > 0
    }
}

/// A key's first held row, as a pass finds it.
#[derive(Clone, Debug)]
struct Candidate {
    key: String,
    message_id: String,
    position: i64,
    /// The number the key waits for (with sequence numbers).
    next: i64,
    /// Never published, or published longer than `release_timeout` ago.
    due: bool,
    gap_started: bool,
    /// The gap outlived its timeout and was not acted on since it began.
    gap_expired: bool,
}

/// What a pass does with a key's first held row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Release,
    StartGap,
    GapTimedOut,
    Wait,
}

/// The step for `c`; `sequenced`: the policy orders by sequence numbers.
fn step(c: &Candidate, sequenced: bool) -> Step {
    if !sequenced || c.position <= c.next {
        if c.due { Step::Release } else { Step::Wait }
    } else if !c.gap_started {
        Step::StartGap
    } else if c.gap_expired {
        Step::GapTimedOut
    } else {
        Step::Wait
    }
}

/// What a gap's policy does, as this task applies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GapAction {
    Keep,
    Release,
    Park,
}

impl GapAction {
    fn of(policy: GapPolicy) -> Self {
        match policy {
            GapPolicy::Release => Self::Release,
            GapPolicy::ParkFollowers => Self::Park,
            // KeepHolding, and any later policy this task does not know: only alert.
            _ => Self::Keep,
        }
    }

    /// The `policy` label of the gap counter.
    fn label(self) -> &'static str {
        match self {
            Self::Keep => "keep_holding",
            Self::Release => "release",
            Self::Park => "park_followers",
        }
    }
}

/// A gap that outlived its timeout, read under its key's lock.
struct Gap {
    key: String,
    /// The first missing number.
    next: i64,
    first_held: i64,
    first_held_id: String,
    held: i64,
}

impl Gap {
    fn missing(&self) -> String {
        format!("{}..{}", self.next, self.first_held - 1)
    }
}

/// The statements of one consumer's release passes.
#[derive(Debug)]
struct Statements {
    clear_processed_heads: String,
    candidates: String,
    lock_first: String,
    gap: String,
}

impl Statements {
    fn new(t: &str, k: &str) -> Self {
        Self {
            clear_processed_heads: format!(
                "UPDATE {k} AS ok SET head_message_id = NULL, blocked_since = NULL, \
                   updated_at = now() \
                 WHERE ok.consumer_name = $1 AND ok.head_message_id IS NOT NULL \
                   AND EXISTS (SELECT 1 FROM {t} m WHERE m.consumer_name = $1 \
                     AND m.message_id = ok.head_message_id AND m.status = {PROCESSED})"
            ),
            candidates: candidates_sql(t, k),
            lock_first: lock_first_sql(t, k),
            gap: gap_sql(t, k),
        }
    }
}

/// The keys of consumer `$1` not blocked that have HELD rows, from the key after `$2` (NULL:
/// the first), `$3` at most, each with its first HELD row and what the pass may do with it.
/// `$4`: sequence numbers on; `$5`: the policy's first number; `$6` release timeout (s);
/// `$7` gap timeout (s). Walks the distinct keys through the partial index on HELD rows (one
/// probe per key) and skips the keys with nothing to do now, so that they do not use up the
/// pass's bound.
fn candidates_sql(t: &str, k: &str) -> String {
    format!(
        "WITH RECURSIVE keys (order_key) AS ( \
           (SELECT order_key FROM {t} WHERE consumer_name = $1 AND status = {HELD} \
              AND ($2::text IS NULL OR order_key > $2) ORDER BY order_key LIMIT 1) \
           UNION ALL \
           SELECT (SELECT m.order_key FROM {t} m WHERE m.consumer_name = $1 \
                     AND m.status = {HELD} AND m.order_key > c.order_key \
                   ORDER BY m.order_key LIMIT 1) \
           FROM keys c WHERE c.order_key IS NOT NULL) \
         SELECT c.order_key, f.message_id, f.order_position, \
           coalesce(ok.next_sequence, $5) AS next_sequence, \
           (f.released_at IS NULL OR f.released_at < now() - make_interval(secs => $6)) AS due, \
           ok.gap_since IS NOT NULL AS gap_started, \
           coalesce(ok.gap_since < now() - make_interval(secs => $7) \
             AND (ok.gap_reported_at IS NULL OR ok.gap_reported_at < ok.gap_since), false) \
             AS gap_expired \
         FROM keys c \
         LEFT JOIN {k} ok ON ok.consumer_name = $1 AND ok.order_key = c.order_key \
         CROSS JOIN LATERAL (SELECT m.message_id, m.order_position, m.released_at FROM {t} m \
             WHERE m.consumer_name = $1 AND m.status = {HELD} AND m.order_key = c.order_key \
             ORDER BY m.order_position LIMIT 1) f \
         WHERE c.order_key IS NOT NULL AND ok.head_message_id IS NULL AND ( \
           ((NOT $4 OR f.order_position <= coalesce(ok.next_sequence, $5)) \
             AND (f.released_at IS NULL OR f.released_at < now() - make_interval(secs => $6))) \
           OR ($4 AND f.order_position > coalesce(ok.next_sequence, $5) \
             AND (ok.gap_since IS NULL OR (ok.gap_since < now() - make_interval(secs => $7) \
               AND (ok.gap_reported_at IS NULL OR ok.gap_reported_at < ok.gap_since))))) \
         ORDER BY c.order_key LIMIT $3"
    )
}

/// Row `$2` of consumer `$1`, locked, if it is still due for release: HELD, its copy never
/// published or not back within `$3` seconds, its key not blocked, first among the key's HELD
/// rows, and (`$4` sequence numbers on, `$5` first number) its turn.
fn lock_first_sql(t: &str, k: &str) -> String {
    format!(
        "SELECT m.message_type, m.correlation_id FROM {t} m \
         LEFT JOIN {k} ok ON ok.consumer_name = m.consumer_name AND ok.order_key = m.order_key \
         WHERE m.consumer_name = $1 AND m.message_id = $2 AND m.status = {HELD} \
           AND (m.released_at IS NULL OR m.released_at < now() - make_interval(secs => $3)) \
           AND ok.head_message_id IS NULL \
           AND m.order_position = (SELECT min(h.order_position) FROM {t} h \
                                   WHERE h.consumer_name = $1 AND h.order_key = m.order_key \
                                     AND h.status = {HELD}) \
           AND (NOT $4 OR m.order_position <= coalesce(ok.next_sequence, $5)) \
         FOR UPDATE OF m SKIP LOCKED"
    )
}

/// Key `$2` of consumer `$1`, locked, if its gap outlived `$4` seconds and was not acted on
/// since it began; `$3` the policy's first number. With its first HELD row and their count.
fn gap_sql(t: &str, k: &str) -> String {
    format!(
        "SELECT coalesce(ok.next_sequence, $3) AS next_sequence, f.message_id, \
           f.order_position, \
           (SELECT count(*) FROM {t} h WHERE h.consumer_name = $1 AND h.order_key = $2 \
              AND h.status = {HELD}) AS held \
         FROM {k} ok \
         CROSS JOIN LATERAL (SELECT m.message_id, m.order_position FROM {t} m \
             WHERE m.consumer_name = $1 AND m.status = {HELD} AND m.order_key = $2 \
             ORDER BY m.order_position LIMIT 1) f \
         WHERE ok.consumer_name = $1 AND ok.order_key = $2 AND ok.head_message_id IS NULL \
           AND ok.gap_since < now() - make_interval(secs => $4) \
           AND (ok.gap_reported_at IS NULL OR ok.gap_reported_at < ok.gap_since) \
           AND f.order_position > coalesce(ok.next_sequence, $3) \
         FOR UPDATE OF ok"
    )
}

/// Publishes the held messages of an ordered consumer again when their key's turn comes, and
/// acts on sequence gaps that outlive their timeout, every `release_interval` of the
/// consumer's [`OrderingPolicy`] (run it under a [`rabbit_inbox::Runner`] beside the consumer;
/// [`crate::Service`] does). See the module documentation.
#[derive(Debug)]
pub struct ReleaseTask {
    ops: Operations,
    amqp_url: String,
    consumer: String,
    work_queue: String,
    parking_queue: String,
    policy: OrderingPolicy,
    actor: Actor,
    connection_name: String,
    statements: Statements,
    /// Where the next pass starts when the last one stopped at its bound.
    cursor: Option<String>,
}

impl ReleaseTask {
    /// The release task of the consumer `config` describes, publishing through the broker at
    /// `amqp_url`; `None` when the consumer does not order its messages (`config.ordering`).
    pub fn for_consumer(
        pool: sqlx::PgPool,
        amqp_url: impl Into<String>,
        config: &ConsumerConfig,
    ) -> Option<Self> {
        let policy = config.ordering.clone()?;
        let mut ops = Operations::new(pool, config.schema.clone());
        if let Some(keyring) = &config.privacy.encryption {
            ops = ops.with_keyring(keyring.clone());
        }
        let statements = Statements::new(
            &config.schema.qualify(tables::MESSAGE_INBOX),
            &config.schema.qualify(tables::INBOX_ORDER_KEY),
        );
        Some(Self {
            ops,
            amqp_url: amqp_url.into(),
            consumer: config.consumer_name.clone(),
            work_queue: config.topology.queue.clone(),
            parking_queue: config.topology.parking_queue.clone(),
            policy,
            actor: release_actor(),
            connection_name: format!("rabbit-inbox {} release", config.consumer_name),
            statements,
            cursor: None,
        })
    }

    /// Releases every `release_interval` until `shutdown` completes. A failed pass is logged
    /// and tried again at the next tick; nothing ends the task but `shutdown`.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut broker: Option<Broker> = None;
        let mut tick = tokio::time::interval(self.policy.release_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => return,
                _ = tick.tick() => {}
            }
            if broker.is_none() {
                broker = Broker::connect(&self.amqp_url, &self.connection_name)
                    .await
                    .inspect_err(|e| {
                        tracing::warn!(
                            consumer = %self.consumer,
                            error = %e,
                            "the release task cannot reach the broker: held messages wait until \
                             it can; check the broker and the consumer's AMQP URL"
                        );
                    })
                    .ok();
            }
            let Some(connected) = &broker else { continue };
            let report = tokio::select! {
                biased;
                () = &mut shutdown => return,
                report = self.pass(connected) => report,
            };
            match report {
                Ok(report) => {
                    if report.acted() {
                        tracing::debug!(consumer = %self.consumer, ?report, "release pass");
                    }
                    if report.failed > 0 {
                        // A refused publish may have closed the channel: reconnect.
                        broker = None;
                    }
                }
                Err(e) => tracing::warn!(
                    consumer = %self.consumer,
                    error = %e,
                    "a release pass failed; the next one tries again (check the database)"
                ),
            }
        }
    }

    /// One pass: finds the keys whose first held row may go on and releases it, starts the
    /// clocks of gaps, and acts on gaps that outlived their timeout, through `broker`.
    pub async fn pass(&mut self, broker: &Broker) -> Result<ReleaseReport, OpsError> {
        let mut conn = self.ops.pool.acquire().await?;
        self.clear_processed_heads(&mut conn).await?;
        let candidates = self.candidates(&mut conn).await?;
        self.cursor = (candidates.len() as i64 >= KEYS_PER_PASS)
            .then(|| candidates.last().map(|c| c.key.clone()))
            .flatten();
        let sequence = self.policy.sequence.clone();
        let mut report = ReleaseReport::default();
        for candidate in &candidates {
            match (step(candidate, sequence.is_some()), &sequence) {
                (Step::Release, _) => {
                    self.release(&mut conn, broker, candidate, &mut report)
                        .await?;
                }
                (Step::StartGap, _) => {
                    self.start_gap(&mut conn, &candidate.key).await?;
                    report.gaps_started += 1;
                }
                (Step::GapTimedOut, Some(sequence)) => {
                    self.act_on_gap(&mut conn, broker, &candidate.key, sequence, &mut report)
                        .await?;
                }
                (Step::GapTimedOut | Step::Wait, _) => {}
            }
        }
        Ok(report)
    }

    /// Unblocks the keys whose head is PROCESSED: another copy of the head committed (two
    /// instances took copies of it at once, and one recorded its failure as the key's head
    /// after the other had applied it). Nothing waits for an applied message.
    async fn clear_processed_heads(&self, conn: &mut PgConnection) -> Result<(), OpsError> {
        sqlx::query(AssertSqlSafe(self.statements.clear_processed_heads.clone()))
            .persistent(false)
            .bind(&self.consumer)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn candidates(&self, conn: &mut PgConnection) -> Result<Vec<Candidate>, OpsError> {
        let sequence = self.policy.sequence.as_ref();
        let rows = sqlx::query(AssertSqlSafe(self.statements.candidates.clone()))
            .persistent(false)
            .bind(&self.consumer)
            .bind(self.cursor.as_deref())
            .bind(KEYS_PER_PASS)
            .bind(sequence.is_some())
            .bind(sequence.map_or(1, |s| s.first))
            .bind(self.policy.release_timeout.as_secs_f64())
            .bind(sequence.map_or(0.0, |s| s.gap_timeout.as_secs_f64()))
            .fetch_all(conn)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(Candidate {
                    key: r.try_get("order_key")?,
                    message_id: r.try_get("message_id")?,
                    position: r.try_get("order_position")?,
                    next: r.try_get("next_sequence")?,
                    due: r.try_get("due")?,
                    gap_started: r.try_get("gap_started")?,
                    gap_expired: r.try_get("gap_expired")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// Takes the transaction-scoped lock the consumer's batch takes on `key`, if free.
    async fn try_lock_key(&self, tx: &mut PgConnection, key: &str) -> Result<bool, OpsError> {
        let lock = key_lock(&self.ops.schema, &self.consumer, key);
        Ok(sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
            .bind(lock)
            .fetch_one(tx)
            .await?)
    }

    /// Releases a key's first held row in one transaction: lock the key and the row, re-check
    /// that its turn has come, publish its copy (confirmed), mark it released, commit.
    async fn release(
        &self,
        conn: &mut PgConnection,
        broker: &Broker,
        c: &Candidate,
        report: &mut ReleaseReport,
    ) -> Result<(), OpsError> {
        let mut tx = conn.begin().await?;
        if !self.try_lock_key(&mut tx, &c.key).await? {
            report.skipped += 1;
            return Ok(());
        }
        let sequence = self.policy.sequence.as_ref();
        let locked = sqlx::query(AssertSqlSafe(self.statements.lock_first.clone()))
            .persistent(false)
            .bind(&self.consumer)
            .bind(&c.message_id)
            .bind(self.policy.release_timeout.as_secs_f64())
            .bind(sequence.is_some())
            .bind(sequence.map_or(1, |s| s.first))
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = locked else {
            report.skipped += 1;
            return Ok(());
        };
        let kept = match self
            .ops
            .kept_message(&mut tx, &self.consumer, &c.message_id)
            .await?
        {
            Ok(kept) => kept,
            Err(Unrepublishable::Lost(why)) => {
                self.to_manual_review(&mut tx, c, &why, true).await?;
                tx.commit().await?;
                report.manual_review += 1;
                return Ok(());
            }
            Err(Unrepublishable::Sealed(why)) => {
                self.sealed(&mut tx, c, &why).await?;
                tx.commit().await?;
                report.sealed += 1;
                return Ok(());
            }
        };
        let copy = OutgoingMessage {
            message_id: Some(c.message_id.clone()),
            kind: Some(row.try_get("message_type")?),
            correlation_id: row.try_get("correlation_id")?,
            headers: kept.headers,
            body: kept.body,
        };
        if let Err(e) = publish(broker, &self.work_queue, &copy).await {
            tracing::warn!(
                consumer = %self.consumer,
                order_key = %c.key,
                message_id = %c.message_id,
                error = %e,
                "a held message could not be released to the work queue; the next pass tries \
                 again (check the broker)"
            );
            report.failed += 1;
            return Ok(());
        }
        self.mark_released(&mut tx, &c.message_id).await?;
        tx.commit().await?;
        report.released += 1;
        Ok(())
    }

    async fn mark_released(&self, tx: &mut PgConnection, message_id: &str) -> Result<(), OpsError> {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET released_at = now() WHERE consumer_name = $1 AND message_id = $2",
            self.ops.schema.qualify(tables::MESSAGE_INBOX)
        )))
        .persistent(false)
        .bind(&self.consumer)
        .bind(message_id)
        .execute(tx)
        .await?;
        Ok(())
    }

    /// A held row sealed with a key this task does not hold: left HELD, marked as released so
    /// that it is tried again only after `release_timeout`, not on every pass.
    async fn sealed(
        &self,
        tx: &mut PgConnection,
        c: &Candidate,
        why: &str,
    ) -> Result<(), OpsError> {
        tracing::warn!(
            consumer = %self.consumer,
            order_key = %c.key,
            message_id = %c.message_id,
            error = %why,
            retry_after = ?self.policy.release_timeout,
            "a held message is sealed with a key the release task does not hold, so its key \
             cannot go on; give the consumer's keyring the key that sealed it"
        );
        self.mark_released(tx, &c.message_id).await
    }

    /// A held row whose message cannot be published again: MANUAL_REVIEW, audited, and, when
    /// it was to run next (`block`), the head of its key (unless the key has one), so that
    /// nothing behind it runs out of order. A follower parked for a gap blocks nothing: the
    /// key waits for the missing number anyway.
    async fn to_manual_review(
        &self,
        tx: &mut PgConnection,
        c: &Candidate,
        why: &str,
        block: bool,
    ) -> Result<(), OpsError> {
        let message = if block {
            format!(
                "held behind an earlier message of key {:?}, but its message cannot be \
                 published again to run in its turn: {why}; the key is blocked behind it",
                c.key
            )
        } else {
            format!(
                "held behind a sequence gap of key {:?} that outlived its timeout, but its \
                 message cannot be parked with a copy: {why}",
                c.key
            )
        };
        let t = self.ops.schema.qualify(tables::MESSAGE_INBOX);
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {t} SET status = '{}', last_error_code = $3, last_error_message = $4, \
               first_failed_at = coalesce(first_failed_at, now()), last_failed_at = now(), \
               last_recovered_at = now(), released_at = NULL \
             WHERE consumer_name = $1 AND message_id = $2",
            InboxStatus::ManualReview.as_str()
        )))
        .persistent(false)
        .bind(&self.consumer)
        .bind(&c.message_id)
        .bind(HELD_PAYLOAD_LOST)
        .bind(&message)
        .execute(&mut *tx)
        .await?;
        if block {
            self.block_key(tx, &c.key, &c.message_id).await?;
        }
        let details = json!({
            "cause": HELD_PAYLOAD_LOST,
            "previous_status": InboxStatus::Held.as_str(),
            "status": InboxStatus::ManualReview.as_str(),
            "order_key": c.key,
            "order_position": c.position,
            "blocks_key": block,
            "why": why,
        });
        self.audit(tx, "recover_manual_review", &c.message_id, details)
            .await?;
        tracing::warn!(
            consumer = %self.consumer,
            order_key = %c.key,
            message_id = %c.message_id,
            error = %why,
            blocks_key = block,
            "a held message cannot be published again: it is in manual review{}; have the \
             producer send it again, or skip it with `inboxctl ordering skip` to let the key's \
             later messages go on",
            if block { " and its key is blocked behind it" } else { "" }
        );
        Ok(())
    }

    /// Makes `message_id` the head of `key` unless the key has one.
    async fn block_key(
        &self,
        tx: &mut PgConnection,
        key: &str,
        message_id: &str,
    ) -> Result<(), OpsError> {
        let k = self.ops.schema.qualify(tables::INBOX_ORDER_KEY);
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {k} AS k (consumer_name, order_key, head_message_id, blocked_since) \
             VALUES ($1, $2, $3, now()) \
             ON CONFLICT (consumer_name, order_key) DO UPDATE SET \
               head_message_id = coalesce(k.head_message_id, EXCLUDED.head_message_id), \
               blocked_since = CASE WHEN k.head_message_id IS NULL THEN now() \
                               ELSE k.blocked_since END, \
               updated_at = now()"
        )))
        .persistent(false)
        .bind(&self.consumer)
        .bind(key)
        .bind(message_id)
        .execute(tx)
        .await?;
        Ok(())
    }

    /// Starts the clock of a gap the consumer did not start (a key row it never wrote).
    async fn start_gap(&self, conn: &mut PgConnection, key: &str) -> Result<(), OpsError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} AS k (consumer_name, order_key, gap_since) VALUES ($1, $2, now()) \
             ON CONFLICT (consumer_name, order_key) DO UPDATE SET \
               gap_since = coalesce(k.gap_since, now()), updated_at = now()",
            self.ops.schema.qualify(tables::INBOX_ORDER_KEY)
        )))
        .persistent(false)
        .bind(&self.consumer)
        .bind(key)
        .execute(conn)
        .await?;
        Ok(())
    }

    /// Acts on a gap that outlived its timeout: alert, count, and apply the policy, in one
    /// transaction under the key's lock (several for a long run of followers to park).
    async fn act_on_gap(
        &self,
        conn: &mut PgConnection,
        broker: &Broker,
        key: &str,
        sequence: &SequencePolicy,
        report: &mut ReleaseReport,
    ) -> Result<(), OpsError> {
        let action = GapAction::of(sequence.on_gap);
        loop {
            let mut tx = conn.begin().await?;
            let gap = match self.locked_gap(&mut tx, key, sequence).await? {
                Some(gap) => gap,
                None => {
                    report.skipped += 1;
                    return Ok(());
                }
            };
            let done = match action {
                GapAction::Keep => true,
                GapAction::Release => {
                    self.release_past(&mut tx, &gap, sequence).await?;
                    true
                }
                GapAction::Park => {
                    match self
                        .park_followers(&mut tx, broker, &gap, sequence, report)
                        .await?
                    {
                        Some(all) => all,
                        // Not confirmed: nothing of this transaction is kept.
                        None => return Ok(()),
                    }
                }
            };
            if done {
                self.gap_reported(&mut tx, &gap, action).await?;
                tx.commit().await?;
                self.alert(&gap, sequence, action);
                report.gaps_timed_out += 1;
                return Ok(());
            }
            tx.commit().await?;
        }
    }

    /// The gap of `key`, under the key's lock, if it still outlived its timeout unreported.
    async fn locked_gap(
        &self,
        tx: &mut PgConnection,
        key: &str,
        sequence: &SequencePolicy,
    ) -> Result<Option<Gap>, OpsError> {
        if !self.try_lock_key(tx, key).await? {
            return Ok(None);
        }
        let row = sqlx::query(AssertSqlSafe(self.statements.gap.clone()))
            .persistent(false)
            .bind(&self.consumer)
            .bind(key)
            .bind(sequence.first)
            .bind(sequence.gap_timeout.as_secs_f64())
            .fetch_optional(tx)
            .await?;
        row.map(|r| {
            Ok(Gap {
                key: key.to_owned(),
                next: r.try_get("next_sequence")?,
                first_held: r.try_get("order_position")?,
                first_held_id: r.try_get("message_id")?,
                held: r.try_get("held")?,
            })
        })
        .transpose()
        .map_err(|e: sqlx::Error| e.into())
    }

    /// The key's row once its gap was acted on. Parking clears the gap's clock (the key waits
    /// on for the missing number; later followers start a new one), releasing past it moves
    /// the key on to its first held number.
    async fn gap_reported(
        &self,
        tx: &mut PgConnection,
        gap: &Gap,
        action: GapAction,
    ) -> Result<(), OpsError> {
        let set = match action {
            GapAction::Keep => "",
            GapAction::Park => ", gap_since = NULL",
            GapAction::Release => ", gap_since = NULL, next_sequence = $3",
        };
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET gap_reported_at = now(), updated_at = now(){set} \
             WHERE consumer_name = $1 AND order_key = $2",
            self.ops.schema.qualify(tables::INBOX_ORDER_KEY)
        )))
        .persistent(false)
        .bind(&self.consumer)
        .bind(&gap.key)
        .bind(gap.first_held)
        .execute(tx)
        .await?;
        Ok(())
    }

    /// Records on the first held row that the key goes on past the gap, audited.
    async fn release_past(
        &self,
        tx: &mut PgConnection,
        gap: &Gap,
        sequence: &SequencePolicy,
    ) -> Result<(), OpsError> {
        let message = format!(
            "sequence numbers {} never arrived within {:?}; released past the gap by policy",
            gap.missing(),
            sequence.gap_timeout
        );
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET last_error_code = $3, last_error_message = $4 \
             WHERE consumer_name = $1 AND message_id = $2",
            self.ops.schema.qualify(tables::MESSAGE_INBOX)
        )))
        .persistent(false)
        .bind(&self.consumer)
        .bind(&gap.first_held_id)
        .bind(SEQUENCE_GAP)
        .bind(&message)
        .execute(&mut *tx)
        .await?;
        let details = json!({
            "order_key": gap.key,
            "missing_from": gap.next,
            "missing_to": gap.first_held - 1,
            "next_sequence": gap.first_held,
            "held": gap.held,
            "gap_timeout_secs": sequence.gap_timeout.as_secs_f64(),
        });
        self.audit(tx, "sequence_gap_released", &gap.first_held_id, details)
            .await
    }

    /// Parks up to [`PARKED_PER_TRANSACTION`] held rows of the gap's key, in order: a copy of
    /// each in the parking lot (confirmed), then the row PERMANENT_FAILED with code
    /// `sequence_gap`, audited. `Some(true)`: none is left HELD; `None`: a copy was not
    /// confirmed, and the caller drops the transaction (the next pass tries again).
    async fn park_followers(
        &self,
        tx: &mut PgConnection,
        broker: &Broker,
        gap: &Gap,
        sequence: &SequencePolicy,
        report: &mut ReleaseReport,
    ) -> Result<Option<bool>, OpsError> {
        let t = self.ops.schema.qualify(tables::MESSAGE_INBOX);
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT message_id, message_type, correlation_id, order_position FROM {t} \
             WHERE consumer_name = $1 AND order_key = $2 AND status = {HELD} \
             ORDER BY order_position LIMIT $3 FOR UPDATE"
        )))
        .persistent(false)
        .bind(&self.consumer)
        .bind(&gap.key)
        .bind(PARKED_PER_TRANSACTION)
        .fetch_all(&mut *tx)
        .await?;
        let error = format!(
            "sequence numbers {} never arrived within {:?}; parked by policy, the key waits for \
             {}: redrive in order once it arrived, or skip the gap with `inboxctl ordering skip`",
            gap.missing(),
            sequence.gap_timeout,
            gap.next
        );
        for row in &rows {
            let follower = Follower {
                message_id: row.try_get("message_id")?,
                message_type: row.try_get("message_type")?,
                correlation_id: row.try_get("correlation_id")?,
                position: row.try_get("order_position")?,
            };
            if !self
                .park_one(tx, broker, gap, &follower, &error, report)
                .await?
            {
                return Ok(None);
            }
        }
        Ok(Some(rows.len() < PARKED_PER_TRANSACTION as usize))
    }

    /// Parks one follower; false when its copy was not confirmed.
    async fn park_one(
        &self,
        tx: &mut PgConnection,
        broker: &Broker,
        gap: &Gap,
        follower: &Follower,
        error: &str,
        report: &mut ReleaseReport,
    ) -> Result<bool, OpsError> {
        let id = &follower.message_id;
        let kept = match self.ops.kept_message(tx, &self.consumer, id).await? {
            Ok(kept) => kept,
            Err(Unrepublishable::Lost(why) | Unrepublishable::Sealed(why)) => {
                let c = Candidate {
                    key: gap.key.clone(),
                    message_id: id.clone(),
                    position: follower.position,
                    next: gap.next,
                    due: false,
                    gap_started: true,
                    gap_expired: true,
                };
                self.to_manual_review(tx, &c, &why, false).await?;
                report.manual_review += 1;
                return Ok(true);
            }
        };
        let mut headers = kept.headers;
        let status = InboxStatus::PermanentFailed.as_str();
        for (name, value) in [
            (parking_headers::STATUS, json!(status)),
            (parking_headers::ERROR_CODE, json!(SEQUENCE_GAP)),
            (parking_headers::ERROR, json!(error)),
            (parking_headers::CONSUMER, json!(self.consumer)),
            (parking_headers::INBOX_KEY, json!(id)),
            (parking_headers::PARKED_AT, json!(unix_millis())),
        ] {
            headers.insert(name.into(), value);
        }
        let copy = OutgoingMessage {
            message_id: Some(id.clone()),
            kind: Some(follower.message_type.clone()),
            correlation_id: follower.correlation_id.clone(),
            headers,
            body: kept.body,
        };
        if let Err(e) = publish(broker, &self.parking_queue, &copy).await {
            tracing::warn!(
                consumer = %self.consumer,
                order_key = %gap.key,
                message_id = %id,
                error = %e,
                "a held message behind a sequence gap could not be parked; the next pass tries \
                 again (check the broker)"
            );
            report.failed += 1;
            return Ok(false);
        }
        self.mark_parked(tx, id, error).await?;
        let details = json!({
            "order_key": gap.key,
            "order_position": follower.position,
            "missing_from": gap.next,
            "missing_to": gap.first_held - 1,
            "parking_queue": self.parking_queue,
            "status": status,
        });
        self.audit(tx, "sequence_gap_parked", id, details).await?;
        report.parked += 1;
        Ok(true)
    }

    /// PERMANENT_FAILED with code `sequence_gap`, then the mark of its confirmed parking-lot
    /// copy (a second statement: a status change voids the copy marks).
    async fn mark_parked(
        &self,
        tx: &mut PgConnection,
        message_id: &str,
        error: &str,
    ) -> Result<(), OpsError> {
        let t = self.ops.schema.qualify(tables::MESSAGE_INBOX);
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {t} SET status = '{}', last_error_code = $3, last_error_message = $4, \
               first_failed_at = coalesce(first_failed_at, now()), last_failed_at = now(), \
               released_at = NULL \
             WHERE consumer_name = $1 AND message_id = $2",
            InboxStatus::PermanentFailed.as_str()
        )))
        .persistent(false)
        .bind(&self.consumer)
        .bind(message_id)
        .bind(SEQUENCE_GAP)
        .bind(error)
        .execute(&mut *tx)
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {t} SET parked_copy_at = now() WHERE consumer_name = $1 AND message_id = $2"
        )))
        .persistent(false)
        .bind(&self.consumer)
        .bind(message_id)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    /// The gap's alert: a warning that says what is missing, what the policy did and what an
    /// operator can do, and the gap counter.
    fn alert(&self, gap: &Gap, sequence: &SequencePolicy, action: GapAction) {
        metrics::counter!(
            m::SEQUENCE_GAPS,
            "consumer" => self.consumer.clone(),
            "policy" => action.label()
        )
        .increment(1);
        let done = match action {
            GapAction::Keep => {
                "the key keeps holding them: send the missing messages, or skip the gap with \
                 `inboxctl ordering skip` to let the held ones go on"
            }
            GapAction::Release => {
                "the policy releases the held ones past the gap; a missing message that \
                 arrives later is parked (sequence_passed) and must be redriven by hand if \
                 it still applies"
            }
            GapAction::Park => {
                "the policy parked the held ones (code sequence_gap) and the key waits on for \
                 the missing number: send it, then redrive the parked ones in order"
            }
        };
        tracing::warn!(
            consumer = %self.consumer,
            order_key = %gap.key,
            missing = %gap.missing(),
            held = gap.held,
            gap_timeout = ?sequence.gap_timeout,
            policy = action.label(),
            "sequence numbers {} of key {:?} never arrived within {:?}, {} message(s) wait \
             behind them; {done}",
            gap.missing(),
            gap.key,
            sequence.gap_timeout,
            gap.held
        );
    }

    async fn audit(
        &self,
        tx: &mut PgConnection,
        action: &str,
        message_id: &str,
        details: serde_json::Value,
    ) -> Result<(), OpsError> {
        audit(
            tx,
            &self.ops.schema,
            &self.actor,
            action,
            Some(&self.consumer),
            Some(message_id),
            details,
        )
        .await?;
        Ok(())
    }
}

/// A held row a gap's policy parks.
struct Follower {
    message_id: String,
    message_type: String,
    correlation_id: Option<String>,
    position: i64,
}

/// The task's actor: one name for every consumer (the audit rows name the consumer).
fn release_actor() -> Actor {
    Actor::new(
        RELEASE_ACTOR,
        "automatic release of held messages of ordered keys, and of sequence gaps past their \
         timeout",
    )
    .expect("a fixed, non-blank actor name and reason within their bounds")
}

/// Now in Unix milliseconds, as the consumer stamps a parked copy.
fn unix_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(position: i64, next: i64) -> Candidate {
        Candidate {
            key: "k".into(),
            message_id: "m".into(),
            position,
            next,
            due: true,
            gap_started: false,
            gap_expired: false,
        }
    }

    #[test]
    fn without_sequence_numbers_a_due_first_row_is_released() {
        assert_eq!(step(&candidate(40, 1), false), Step::Release);
        let waiting = Candidate {
            due: false,
            ..candidate(40, 1)
        };
        assert_eq!(step(&waiting, false), Step::Wait);
    }

    #[test]
    fn with_sequence_numbers_a_row_above_the_next_number_is_a_gap() {
        assert_eq!(step(&candidate(3, 3), true), Step::Release);
        assert_eq!(step(&candidate(5, 3), true), Step::StartGap);
        let started = Candidate {
            gap_started: true,
            ..candidate(5, 3)
        };
        assert_eq!(step(&started, true), Step::Wait);
        let expired = Candidate {
            gap_expired: true,
            ..started
        };
        assert_eq!(step(&expired, true), Step::GapTimedOut);
    }

    #[test]
    fn the_actor_is_valid() {
        assert_eq!(release_actor().name(), RELEASE_ACTOR);
    }

    #[test]
    fn gap_policies_have_their_labels() {
        assert_eq!(
            GapAction::of(GapPolicy::KeepHolding).label(),
            "keep_holding"
        );
        assert_eq!(GapAction::of(GapPolicy::Release).label(), "release");
        assert_eq!(
            GapAction::of(GapPolicy::ParkFollowers).label(),
            "park_followers"
        );
    }
}
