//! Recovery of messages whose path through the broker was lost: PROCESSING rows whose lease
//! expired (the worker died or was paused past its TTL, or a custom loop committed a PROCESSING
//! row and crashed), and RETRYABLE_FAILED rows whose retry copy never came back (a deleted
//! retry tier, a dropped dead-letter). Runs by hand (`inboxctl recover`) and on a timer in the
//! consumer ([`RecoveryConfig`]).
//!
//! Each row found is, by policy, republished to the work queue from its stored payload and
//! headers (the row becomes RETRYABLE_FAILED, so the copy reclaims it with one more attempt),
//! or moved to MANUAL_REVIEW. Never dropped: a row that cannot be republished (no payload
//! kept, attempts spent) goes to manual review, a publish the broker does not confirm leaves
//! the row as it was. Each recovery is audited in the transaction that changes the row, and
//! the row stays locked from the check to the commit, with the publish confirmed in between:
//! a crash after the publish leaves at worst a second copy, which the inbox deduplicates.
//!
//! **Invariant:** a live lease is never taken over; a retry copy that is merely late is
//! harmless (its copy and the republished one meet the same row, and the effect commits once).

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::json;
use sqlx::{Connection, PgConnection, Row};

use crate::{
    actor::Actor,
    audit::audit,
    error::OpsError,
    operations::Operations,
    progress::{NoProgress, Progress},
    sql::OPEN,
};
use rabbit_inbox::{
    broker::Broker,
    broker::OutgoingMessage,
    config::ConsumerConfig,
    error::ConfigError,
    ledger_sql::{PROCESSING, RETRYABLE_FAILED, audited},
    privacy::{PrivacyError, is_original_body, open_headers, open_payload},
    retry::RetryPolicy,
    status::InboxStatus,
    store::InboxStore,
};

/// Longest wait for the broker to confirm a republished copy.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(15);

/// Header a republished copy carries: why it was republished.
pub const RECOVERY_HEADER: &str = "x-inbox-recovered";

/// What recovery does with a row it finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum RecoveryPolicy {
    /// Republish the stored payload to the work queue; the copy reclaims the row with one more
    /// attempt. A row without a stored payload, or with its attempts spent, goes to manual
    /// review instead.
    Retry,
    /// Move the row to MANUAL_REVIEW for an operator.
    ManualReview,
}

/// Why a row was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RecoveryCause {
    /// PROCESSING under a lease that expired.
    LeaseExpired,
    /// PROCESSING without a lease for longer than the stale threshold.
    StaleProcessing,
    /// RETRYABLE_FAILED for longer than its retry tier's delay plus the grace.
    RetryLost,
}

impl RecoveryCause {
    fn from_sql(cause: &str) -> Result<Self, OpsError> {
        match cause {
            "lease_expired" => Ok(Self::LeaseExpired),
            "stale_processing" => Ok(Self::StaleProcessing),
            "retry_lost" => Ok(Self::RetryLost),
            other => Err(OpsError::Store(rabbit_inbox::error::StoreError::Corrupt(
                format!("unknown recovery cause {other:?}"),
            ))),
        }
    }

    /// The code recorded on a PROCESSING row that recovery takes over.
    pub fn code(self) -> &'static str {
        match self {
            Self::LeaseExpired => "lease_expired",
            Self::StaleProcessing => "stale_processing",
            Self::RetryLost => "retry_lost",
        }
    }
}

/// What was (or, in a dry run, would be) done with a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RecoveryAction {
    /// Republished to the work queue; the row is RETRYABLE_FAILED.
    Republished,
    /// Moved to MANUAL_REVIEW.
    ManualReview,
    /// The row changed or was busy when its turn came (a late copy is being processed): left
    /// alone.
    Skipped,
    /// The publish or the update failed; the row is as it was and the next run finds it again.
    Failed,
}

/// A recovery run.
#[derive(Clone, Debug)]
pub struct RecoverRequest {
    /// Consumer whose rows to recover.
    pub consumer: String,
    /// The consumer's work queue, where republished copies go (through the default exchange).
    pub work_queue: String,
    /// Republish or manual review.
    pub policy: RecoveryPolicy,
    /// The consumer's retry tiers (how long a retry may take), attempt budget and stale
    /// threshold for PROCESSING rows without a lease.
    pub retry: RetryPolicy,
    /// Added to a tier's delay before a RETRYABLE_FAILED row counts as lost.
    pub grace: Duration,
    /// Most rows per run.
    pub limit: usize,
    /// Find and classify only; change nothing.
    pub dry_run: bool,
}

impl RecoverRequest {
    /// The request a consumer with `config` makes on its timer.
    pub fn for_consumer(config: &ConsumerConfig, recovery: &RecoveryConfig) -> Self {
        Self {
            consumer: config.consumer_name.clone(),
            work_queue: config.topology.queue.clone(),
            policy: recovery.policy,
            retry: config.retry.clone(),
            grace: recovery.grace,
            limit: recovery.limit,
            dry_run: false,
        }
    }
}

/// One row recovery found.
#[derive(Clone, Debug, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RecoveredMessage {
    /// Dedup key.
    pub message_id: String,
    /// Message type.
    pub message_type: String,
    /// Status when found.
    pub status: String,
    /// Why it was found.
    pub cause: RecoveryCause,
    /// Attempts made.
    pub attempt: i32,
    /// The expired lease's owner, if any.
    pub lease_owner: Option<String>,
    /// Since when the row has been stuck (lease expiry, start of processing, last failure or
    /// recovery).
    pub stuck_since: Option<DateTime<Utc>>,
    /// Done (or, in a dry run, to be done).
    pub action: RecoveryAction,
    /// Why this action (e.g. "no payload kept"), or what failed.
    pub detail: Option<String>,
}

/// The result of a run.
#[derive(Clone, Debug, Default, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RecoveryReport {
    /// Whether nothing was changed.
    pub dry_run: bool,
    /// Rows found.
    pub found: usize,
    /// Republished.
    pub republished: usize,
    /// Moved to manual review.
    pub manual_review: usize,
    /// Left alone (busy or changed).
    pub skipped: usize,
    /// Failed (left as they were).
    pub failed: usize,
    /// Every row found, oldest first.
    pub messages: Vec<RecoveredMessage>,
}

/// Recovery on a timer inside the consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecoveryConfig {
    /// Time between runs.
    pub interval: Duration,
    /// What to do with the rows found.
    pub policy: RecoveryPolicy,
    /// Added to a retry tier's delay before a RETRYABLE_FAILED row counts as lost: room for a
    /// busy broker. Too short only costs a duplicate copy, which the inbox suppresses.
    pub grace: Duration,
    /// Most rows per run.
    pub limit: usize,
}

impl Default for RecoveryConfig {
    /// Every minute, republish, one minute of grace, up to 500 rows.
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            policy: RecoveryPolicy::Retry,
            grace: Duration::from_secs(60),
            limit: 500,
        }
    }
}

impl RecoveryConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.interval < Duration::from_millis(100) {
            return Err(ConfigError::InvalidSetting {
                name: "recovery.interval",
                reason: "must be at least 100 ms".into(),
            });
        }
        if self.limit == 0 || self.limit > 10_000 {
            return Err(ConfigError::InvalidSetting {
                name: "recovery.limit",
                reason: "must be 1 to 10000".into(),
            });
        }
        Ok(())
    }
}

/// Which rows count as lost, and why. `$2` stale threshold (s), `$3` tier delays (s), `$4`
/// grace (s). Matches rows through the partial index on open rows.
fn cause() -> String {
    format!(
        "CASE \
           WHEN status = {PROCESSING} AND lease_expires_at < now() THEN 'lease_expired' \
           WHEN status = {PROCESSING} AND lease_expires_at IS NULL \
                AND processing_started_at < now() - make_interval(secs => $2) \
                THEN 'stale_processing' \
           WHEN status = {RETRYABLE_FAILED} \
                AND greatest(last_failed_at, last_recovered_at) < now() - make_interval(secs => \
                    ($3::float8[])[least(greatest(processing_attempt, 1), cardinality($3::float8[]))] + $4) \
                THEN 'retry_lost' \
         END"
    )
}

/// The finder: every lost row (`$6` null), or one (`$6`), `$5` at most. `{lock}` is empty for
/// the listing and `FOR UPDATE SKIP LOCKED` for the re-check of one row before it is changed.
fn find_sql(t: &str, lock: &str) -> String {
    let cause = cause();
    format!(
        "SELECT message_id, message_type, status, processing_attempt, lease_owner, \
           correlation_id, payload IS NOT NULL AS has_payload, {cause} AS cause, \
           CASE WHEN status = {RETRYABLE_FAILED} THEN greatest(last_failed_at, last_recovered_at) \
                ELSE coalesce(lease_expires_at, processing_started_at) END AS stuck_since \
         FROM {t} \
         WHERE consumer_name = $1 AND status IN ({OPEN}) \
           AND ($6::text IS NULL OR message_id = $6) AND ({cause}) IS NOT NULL \
         ORDER BY first_received_at, message_id LIMIT $5 {lock}"
    )
}

/// A row as the finder returns it.
struct Found {
    message: RecoveredMessage,
    correlation_id: Option<String>,
    has_payload: bool,
}

impl Operations {
    /// Finds PROCESSING rows whose lease expired and RETRYABLE_FAILED rows whose retry never
    /// came back, and republishes each (through `broker`, confirmed) or moves it to manual
    /// review, as `request.policy` says. See the module documentation.
    pub async fn recover(
        &self,
        broker: &Broker,
        actor: &Actor,
        request: &RecoverRequest,
        progress: &dyn Progress,
    ) -> Result<RecoveryReport, OpsError> {
        self.recover_with(Some((broker, actor)), request, progress)
            .await
    }

    /// What [`Operations::recover`] would do, as a dry run: needs neither a broker nor an
    /// actor, whatever `request.dry_run` says.
    pub async fn recover_preview(
        &self,
        request: &RecoverRequest,
    ) -> Result<RecoveryReport, OpsError> {
        self.recover_with(None, request, &NoProgress).await
    }

    /// `live`: the broker and actor of a run that changes rows; `None` forces a dry run.
    async fn recover_with(
        &self,
        live: Option<(&Broker, &Actor)>,
        request: &RecoverRequest,
        progress: &dyn Progress,
    ) -> Result<RecoveryReport, OpsError> {
        let live = live.filter(|_| !request.dry_run);
        if request.work_queue.is_empty() {
            return Err(OpsError::Invalid("a work queue is required".into()));
        }
        if request.limit == 0 {
            return Err(OpsError::Invalid("the limit must be at least 1".into()));
        }
        let t = self.schema.qualify("message_inbox");
        let mut conn = self.pool.acquire().await?;
        let found = self.find_lost(&mut conn, &t, request, None, "").await?;
        progress.set_total(found.len() as u64);
        let mut report = RecoveryReport {
            dry_run: live.is_none(),
            found: found.len(),
            ..RecoveryReport::default()
        };
        for candidate in found {
            let message = match live {
                None => {
                    let (action, detail) = planned_action(request, &candidate);
                    RecoveredMessage {
                        action,
                        detail,
                        ..candidate.message
                    }
                }
                Some((broker, actor)) => {
                    self.recover_one(&mut conn, &t, broker, actor, request, candidate)
                        .await?
                }
            };
            match message.action {
                RecoveryAction::Republished => report.republished += 1,
                RecoveryAction::ManualReview => report.manual_review += 1,
                RecoveryAction::Skipped => report.skipped += 1,
                RecoveryAction::Failed => report.failed += 1,
            }
            report.messages.push(message);
            progress.advance(1);
        }
        Ok(report)
    }

    /// [`Operations::recover`] without progress reports.
    pub async fn recover_quietly(
        &self,
        broker: &Broker,
        actor: &Actor,
        request: &RecoverRequest,
    ) -> Result<RecoveryReport, OpsError> {
        self.recover(broker, actor, request, &NoProgress).await
    }

    async fn find_lost(
        &self,
        conn: &mut PgConnection,
        t: &str,
        request: &RecoverRequest,
        message_id: Option<&str>,
        lock: &str,
    ) -> Result<Vec<Found>, OpsError> {
        let delays: Vec<f64> = request
            .retry
            .delays
            .iter()
            .map(Duration::as_secs_f64)
            .collect();
        let rows = sqlx::query(audited(find_sql(t, lock)))
            .persistent(false)
            .bind(&request.consumer)
            .bind(request.retry.stale_processing_after.as_secs_f64())
            .bind(&delays)
            .bind(request.grace.as_secs_f64())
            .bind(i64::try_from(request.limit).unwrap_or(i64::MAX))
            .bind(message_id)
            .fetch_all(conn)
            .await?;
        rows.iter()
            .map(|r| {
                let cause: String = r.try_get("cause")?;
                Ok(Found {
                    message: RecoveredMessage {
                        message_id: r.try_get("message_id")?,
                        message_type: r.try_get("message_type")?,
                        status: r.try_get("status")?,
                        cause: RecoveryCause::from_sql(&cause)?,
                        attempt: r.try_get("processing_attempt")?,
                        lease_owner: r.try_get("lease_owner")?,
                        stuck_since: r.try_get("stuck_since")?,
                        action: RecoveryAction::Skipped,
                        detail: None,
                    },
                    correlation_id: r.try_get("correlation_id")?,
                    has_payload: r.try_get("has_payload")?,
                })
            })
            .collect()
    }

    /// One row in one transaction: re-check under a lock, publish (confirmed) if republishing,
    /// update the row, audit, commit.
    async fn recover_one(
        &self,
        conn: &mut PgConnection,
        t: &str,
        broker: &Broker,
        actor: &Actor,
        request: &RecoverRequest,
        candidate: Found,
    ) -> Result<RecoveredMessage, OpsError> {
        let id = candidate.message.message_id.clone();
        let mut tx = conn.begin().await?;
        let locked = self
            .find_lost(&mut tx, t, request, Some(&id), "FOR UPDATE SKIP LOCKED")
            .await?
            .pop();
        let Some(current) = locked else {
            return Ok(RecoveredMessage {
                action: RecoveryAction::Skipped,
                detail: Some("busy or no longer lost when its turn came".into()),
                ..candidate.message
            });
        };
        let (mut action, mut detail) = planned_action(request, &current);
        if action == RecoveryAction::Republished {
            let failed = |why: String| RecoveredMessage {
                action: RecoveryAction::Failed,
                detail: Some(format!("not republished, row unchanged: {why}")),
                ..current.message.clone()
            };
            match self.copy_to_republish(&mut tx, request, &current).await? {
                Ok(copy) => {
                    if let Err(e) = publish(broker, &request.work_queue, &copy).await {
                        return Ok(failed(e.to_string()));
                    }
                }
                Err(Unrepublishable::Sealed(why)) => return Ok(failed(why)),
                Err(Unrepublishable::Lost(why)) => {
                    action = RecoveryAction::ManualReview;
                    detail = Some(why);
                }
            }
        }
        let target = match action {
            RecoveryAction::Republished => InboxStatus::RetryableFailed,
            _ => InboxStatus::ManualReview,
        };
        let m = &current.message;
        let error_message = format!(
            "{} (attempt {}, status {}); recovery {}",
            match m.cause {
                RecoveryCause::LeaseExpired => "the lease expired without completion",
                RecoveryCause::StaleProcessing => "processing never completed",
                RecoveryCause::RetryLost => "the retry copy never came back",
            },
            m.attempt,
            m.status,
            match target {
                InboxStatus::RetryableFailed => "republished it",
                _ => "moved it to manual review",
            }
        );
        sqlx::query(audited(format!(
            "UPDATE {t} SET status = $3, last_recovered_at = now(), \
               first_failed_at = CASE WHEN status = {PROCESSING} \
                                 THEN coalesce(first_failed_at, now()) ELSE first_failed_at END, \
               last_failed_at = CASE WHEN status = {PROCESSING} THEN now() ELSE last_failed_at END, \
               last_error_code = CASE WHEN status = {PROCESSING} THEN $4 ELSE last_error_code END, \
               last_error_message = CASE WHEN status = {PROCESSING} THEN $5 \
                                    ELSE last_error_message END, \
               fencing_token = CASE WHEN status = {PROCESSING} \
                               THEN coalesce(fencing_token, 0) + 1 ELSE fencing_token END, \
               lease_owner = NULL, lease_expires_at = NULL \
             WHERE consumer_name = $1 AND message_id = $2"
        )))
        .persistent(false)
        .bind(&request.consumer)
        .bind(&id)
        .bind(target.as_str())
        .bind(m.cause.code())
        .bind(&error_message)
        .execute(&mut *tx)
        .await?;
        let details = json!({
            "cause": m.cause,
            "previous_status": m.status,
            "status": target.as_str(),
            "attempt": m.attempt,
            "lease_owner": m.lease_owner,
            "stuck_since": m.stuck_since,
            "policy": request.policy,
            "work_queue": request.work_queue,
            "why": detail,
        });
        self.audit_recovery(&mut tx, actor, target, &request.consumer, &id, details)
            .await?;
        tx.commit().await?;
        Ok(RecoveredMessage {
            action,
            detail,
            ..current.message
        })
    }

    /// The copy that republishes a row: its original body (opened when sealed) and headers.
    async fn copy_to_republish(
        &self,
        tx: &mut PgConnection,
        request: &RecoverRequest,
        found: &Found,
    ) -> Result<Result<OutgoingMessage, Unrepublishable>, OpsError> {
        let m = &found.message;
        let kept = match self
            .kept_message(tx, &request.consumer, &m.message_id)
            .await?
        {
            Ok(kept) => kept,
            Err(why) => return Ok(Err(why)),
        };
        let mut headers = kept.headers;
        headers.insert(RECOVERY_HEADER.into(), json!(m.cause.code()));
        Ok(Ok(OutgoingMessage {
            message_id: Some(m.message_id.clone()),
            kind: Some(m.message_type.clone()),
            correlation_id: found.correlation_id.clone(),
            headers,
            body: kept.body,
        }))
    }

    /// A row's message as the producer sent it, from what the row kept: its body (opened when
    /// sealed) and headers, refused when either is gone or redacted (republished, a redacted
    /// copy would apply other data). Shared by recovery and the replay of an edited body.
    pub(crate) async fn kept_message(
        &self,
        conn: &mut PgConnection,
        consumer: &str,
        message_id: &str,
    ) -> Result<Result<KeptMessage, Unrepublishable>, OpsError> {
        let kept = InboxStore::new(self.schema.clone())
            .find_payload(conn, consumer, message_id)
            .await?
            .ok_or_else(|| OpsError::Invalid(format!("row {message_id} is gone")))?;
        let Some(stored) = &kept.stored else {
            return Ok(Err(Unrepublishable::Lost(
                "no payload kept to republish".into(),
            )));
        };
        let body = match open_payload(self.keyring.as_deref(), stored, consumer, message_id) {
            Ok(body) => body,
            // Another holder of the key (the consumer's own recovery) can still republish it.
            Err(e @ (PrivacyError::NoKeyring { .. } | PrivacyError::UnknownKey { .. })) => {
                return Ok(Err(Unrepublishable::Sealed(e.to_string())));
            }
            Err(e) => return Ok(Err(Unrepublishable::Lost(e.to_string()))),
        };
        // A redacted payload is not the message: republished, it would apply other data.
        if !is_original_body(&body, &kept.payload_sha256) {
            return Ok(Err(Unrepublishable::Lost(
                "the stored payload is redacted, not the message: the producer must send it \
                 again"
                    .into(),
            )));
        }
        // Headers are sealed with the body when encryption is on.
        let headers =
            match open_headers(self.keyring.as_deref(), &kept.headers, consumer, message_id) {
                Ok(headers) => headers,
                Err(e @ (PrivacyError::NoKeyring { .. } | PrivacyError::UnknownKey { .. })) => {
                    return Ok(Err(Unrepublishable::Sealed(e.to_string())));
                }
                Err(e) => return Ok(Err(Unrepublishable::Lost(e.to_string()))),
            };
        let headers = match headers {
            serde_json::Value::Object(map) => map,
            _ => serde_json::Map::new(),
        };
        // Nor are redacted headers: the handler would read "[redacted]" where a value was.
        if let Some(name) = headers
            .iter()
            .find(|(_, v)| v.as_str() == Some(rabbit_inbox::privacy::REDACTED))
            .map(|(k, _)| k.clone())
        {
            return Ok(Err(Unrepublishable::Lost(format!(
                "header {name:?} is stored redacted, not as the message had it: the producer \
                 must send it again"
            ))));
        }
        Ok(Ok(KeptMessage { body, headers }))
    }

    async fn audit_recovery(
        &self,
        tx: &mut PgConnection,
        actor: &Actor,
        target: InboxStatus,
        consumer: &str,
        message_id: &str,
        details: serde_json::Value,
    ) -> Result<(), OpsError> {
        let action = match target {
            InboxStatus::RetryableFailed => "recover_republish",
            _ => "recover_manual_review",
        };
        audit(
            tx,
            &self.schema,
            actor,
            action,
            Some(consumer),
            Some(message_id),
            details,
        )
        .await?;
        Ok(())
    }
}

/// A row's message as the producer sent it (see [`Operations::kept_message`]).
pub(crate) struct KeptMessage {
    /// The original body.
    pub(crate) body: Vec<u8>,
    /// The original application headers.
    pub(crate) headers: serde_json::Map<String, serde_json::Value>,
}

/// Why a row's kept payload cannot be republished.
pub(crate) enum Unrepublishable {
    /// Sealed with a key this recovery does not hold: left unchanged for one that does.
    Sealed(String),
    /// Nothing can republish it (no payload, redacted, key destroyed): manual review.
    Lost(String),
}

/// Publishes `copy` to `work_queue` through the default exchange and waits for the broker's
/// confirm, bounded.
pub(crate) async fn publish(
    broker: &Broker,
    work_queue: &str,
    copy: &OutgoingMessage,
) -> Result<(), OpsError> {
    tokio::time::timeout(PUBLISH_TIMEOUT, broker.publish("", work_queue, copy))
        .await
        .map_err(|_| {
            OpsError::Broker(rabbit_inbox::BrokerError::NotConfirmed(format!(
                "queue {work_queue:?} (no confirm within {PUBLISH_TIMEOUT:?})"
            )))
        })??;
    Ok(())
}

/// What the policy does with a row, and why when it is not the policy's first choice.
fn planned_action(request: &RecoverRequest, found: &Found) -> (RecoveryAction, Option<String>) {
    match request.policy {
        RecoveryPolicy::ManualReview => (RecoveryAction::ManualReview, None),
        RecoveryPolicy::Retry if !found.has_payload => (
            RecoveryAction::ManualReview,
            Some("no payload kept to republish".into()),
        ),
        RecoveryPolicy::Retry
            if found.message.status == InboxStatus::Processing.as_str()
                && found.message.attempt >= request.retry.max_attempts =>
        {
            (
                RecoveryAction::ManualReview,
                Some(format!(
                    "attempts spent ({} of {})",
                    found.message.attempt, request.retry.max_attempts
                )),
            )
        }
        RecoveryPolicy::Retry => (RecoveryAction::Republished, None),
    }
}

/// Recovery of stale leases and lost retries on a timer, beside a consumer (run it under a
/// [`rabbit_inbox::Runner`]); `inboxctl recover` runs the same operation by hand. Every run
/// that finds something is audited under the actor `consumer <name>`.
#[derive(Debug)]
pub struct RecoveryTask {
    ops: Operations,
    amqp_url: String,
    request: RecoverRequest,
    connection_name: String,
    actor: Actor,
    interval: Duration,
}

impl RecoveryTask {
    /// Recovery for the consumer `config` describes, republishing through the broker at
    /// `amqp_url`. Checks `recovery`.
    pub fn new(
        pool: sqlx::PgPool,
        amqp_url: impl Into<String>,
        config: &ConsumerConfig,
        recovery: RecoveryConfig,
    ) -> Result<Self, ConfigError> {
        recovery.validate()?;
        let mut ops = Operations::new(pool, config.schema.clone());
        if let Some(keyring) = &config.privacy.encryption {
            ops = ops.with_keyring(keyring.clone());
        }
        let actor = Actor::new(
            format!("consumer {}", config.consumer_name),
            "automatic recovery of expired leases and lost retries",
        )
        .map_err(|e| ConfigError::InvalidSetting {
            name: "consumer_name",
            reason: e.to_string(),
        })?;
        Ok(Self {
            ops,
            amqp_url: amqp_url.into(),
            request: RecoverRequest::for_consumer(config, &recovery),
            connection_name: format!("rabbit-inbox {} recovery", config.consumer_name),
            actor,
            interval: recovery.interval,
        })
    }

    /// Recovers every interval until `shutdown` completes. A failed run is logged and tried
    /// again at the next tick; nothing ends the task but `shutdown`.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()> + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut broker: Option<Broker> = None;
        let mut tick = tokio::time::interval(self.interval);
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
                    .inspect_err(|e| tracing::warn!(error = %e, "recovery cannot reach the broker"))
                    .ok();
            }
            let Some(connected) = &broker else { continue };
            let run = self
                .ops
                .recover_quietly(connected, &self.actor, &self.request);
            let report = tokio::select! {
                biased;
                () = &mut shutdown => return,
                report = run => report,
            };
            match report {
                Ok(report) if report.found > 0 => {
                    tracing::warn!(
                        found = report.found,
                        republished = report.republished,
                        manual_review = report.manual_review,
                        failed = report.failed,
                        "recovered stale or lost messages"
                    );
                    if report.failed > 0 {
                        // A refused publish may have closed the channel: reconnect.
                        broker = None;
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "recovery run failed"),
            }
        }
    }
}
