//! The endpoints behind the console's views: per-minute activity for the charts, alerts, a
//! message's timeline, the audit trail, bulk actions run in the background with progress, and
//! edit-and-replay. Like the API's own endpoints, each handler parses its request and calls
//! [`Operations`](inbox_ops::Operations); the rules live in the operations.

use std::{collections::BTreeMap, sync::Arc};

use axum::{
    Extension, Json,
    extract::State,
    http::StatusCode,
    response::{IntoResponse, Response},
};
use inbox_ops::{
    activity::{ActivityQuery, ActivityReport},
    alerts::{AlertQuery, LedgerAlert},
    audit::{AuditEntry, AuditFilter},
    history::Timeline,
    replay::{ReplayEditedReport, ReplayEditedRequest, WorkQueue},
};
use rabbit_inbox::broker::Broker;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::{
    auth::Caller,
    error::{ApiError, Body, Params, Segments, spawn_for_request},
    jobs::{Job, JobAction, JobView},
    prometheus::RuleAlert,
    redrive_body::RedriveBody,
    request::{actor, duration, given, instant, parking_lot, required_parking_lot, sees_payloads},
    server::Server,
    state::BROKER_TIMEOUT,
};

/// Query of `GET /api/v1/activity`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ActivityParams {
    /// One consumer, or all.
    consumer: Option<String>,
    /// How far back (default `1h`, at most `7d`).
    window: Option<String>,
    /// Bucket width (default `1m`; at most 1500 buckets per window).
    bucket: Option<String>,
}

/// What `GET /api/v1/activity` returns: the ledger's report, its latency replaced by the
/// consumers' own metrics where Prometheus has them.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ActivityResponse {
    #[serde(flatten)]
    report: ActivityReport,
    /// Per consumer of the report, what its `latency_p50_ms`/`latency_p99_ms` measure:
    /// `metrics` (receipt to settlement of each delivery, from the consumer's
    /// `rabbit_inbox_delivery_to_settle_seconds` histogram in the configured Prometheus) or
    /// `ledger` (first receipt to processed, retry waits included, from the inbox rows).
    latency_sources: BTreeMap<String, &'static str>,
    /// Why the configured Prometheus could not be read; the ledger's latency is shown then.
    latency_error: Option<String>,
}

/// Per consumer and time bucket: messages processed, duplicate deliveries dropped, attempts
/// that failed and wait for a retry, messages parked, conflicting bodies, and p50/p99
/// latency. The counts come from the ledger (the processed rows' BRIN index and the history
/// table's recent entries, not a scan of the inbox); the latency from the consumer's metrics
/// when a Prometheus is configured and scrapes them, else from the ledger (first receipt to
/// processed).
#[utoipa::path(get, path = "/api/v1/activity", tag = "inspection", params(ActivityParams),
    security(("bearer" = [])),
    responses((status = 200, description = "per consumer and bucket, and where the latency comes from", body = ActivityResponse),
        (status = 400, description = "bad window or bucket")))]
pub(crate) async fn activity(
    State(state): State<Arc<Server>>,
    Params(p): Params<ActivityParams>,
) -> Result<Json<ActivityResponse>, ApiError> {
    let mut query = ActivityQuery {
        consumer: given(&p.consumer).map(str::to_owned),
        ..ActivityQuery::default()
    };
    if let Some(window) = given(&p.window) {
        query.window = duration("window", window)?;
    }
    if let Some(bucket) = given(&p.bucket) {
        query.bucket = duration("bucket", bucket)?;
    }
    let mut report = state.ops.activity(&query).await?;
    let mut latency_sources: BTreeMap<String, &'static str> = report
        .consumers
        .iter()
        .map(|c| (c.consumer.clone(), "ledger"))
        .collect();
    let mut latency_error = None;
    if let (Some(prometheus), Some(first)) = (&state.prometheus, report.consumers.first()) {
        let count = first.buckets.len();
        let width = std::time::Duration::from_secs(report.bucket_secs);
        match prometheus
            .latency(query.consumer.as_deref(), report.from, width, count)
            .await
        {
            Ok(mut measured) => {
                for c in &mut report.consumers {
                    let Some(points) = measured.remove(&c.consumer) else {
                        continue;
                    };
                    for (bucket, (p50, p99)) in c.buckets.iter_mut().zip(points) {
                        bucket.latency_p50_ms = p50;
                        bucket.latency_p99_ms = p99;
                    }
                    latency_sources.insert(c.consumer.clone(), "metrics");
                }
            }
            Err(why) => {
                tracing::warn!(error = %why, "admin API: reading latency from Prometheus failed");
                latency_error = Some(PROMETHEUS_DOWN.into());
            }
        }
    }
    Ok(Json(ActivityResponse {
        report,
        latency_sources,
        latency_error,
    }))
}

/// What the browser is told when Prometheus fails: its address and the client's error text
/// stay in the server's log.
const PROMETHEUS_DOWN: &str = "Prometheus did not answer; the server's log has why";

/// What `GET /api/v1/alerts` returns.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct AlertsResponse {
    /// `prometheus` (the shipped rules' state, from the configured Prometheus) or `ledger`
    /// (the same conditions evaluated from the inbox tables).
    source: &'static str,
    /// Firing (and, from Prometheus, pending) alerts.
    alerts: Vec<ShownAlert>,
    /// Why the source could not be read, when it could not; `alerts` is then empty.
    error: Option<String>,
}

/// One alert as the console shows it.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ShownAlert {
    /// The rule's name.
    name: String,
    /// `critical`, `warning` or `info`.
    severity: String,
    /// The consumer it is about, when it names one.
    consumer: Option<String>,
    /// One sentence with the figure.
    summary: String,
    /// `firing` or `pending`.
    state: String,
}

impl From<RuleAlert> for ShownAlert {
    fn from(a: RuleAlert) -> Self {
        Self {
            name: a.name,
            severity: a.severity,
            consumer: a.consumer,
            summary: a.summary,
            state: a.state,
        }
    }
}

impl From<LedgerAlert> for ShownAlert {
    fn from(a: LedgerAlert) -> Self {
        Self {
            name: a.name,
            severity: a.severity,
            consumer: Some(a.consumer),
            summary: a.summary,
            state: "firing".into(),
        }
    }
}

/// The shipped alert rules' state: from Prometheus when the server was given its URL (alerts
/// whose names start with `Inbox`), otherwise the same conditions evaluated from the ledger.
#[utoipa::path(get, path = "/api/v1/alerts", tag = "inspection",
    security(("bearer" = [])),
    responses((status = 200, description = "AlertsResponse", body = AlertsResponse)))]
pub(crate) async fn alerts(
    State(state): State<Arc<Server>>,
) -> Result<Json<AlertsResponse>, ApiError> {
    if let Some(prometheus) = &state.prometheus {
        return Ok(Json(match prometheus.alerts().await {
            Ok(alerts) => AlertsResponse {
                source: "prometheus",
                alerts: alerts.into_iter().map(ShownAlert::from).collect(),
                error: None,
            },
            Err(why) => {
                tracing::warn!(error = %why, "admin API: reading Prometheus's alerts failed");
                AlertsResponse {
                    source: "prometheus",
                    alerts: Vec::new(),
                    error: Some(PROMETHEUS_DOWN.into()),
                }
            }
        }));
    }
    let mut query = AlertQuery {
        replay_window: state.replay_window,
        ..AlertQuery::default()
    };
    if let Some((_, retry)) = &state.queues {
        query.retry_delays = retry.delays.clone();
        query.stale_after = retry.stale_processing_after;
    }
    let alerts = state.ops.alerts(&query).await?;
    Ok(Json(AlertsResponse {
        source: "ledger",
        alerts: alerts.into_iter().map(ShownAlert::from).collect(),
        error: None,
    }))
}

/// `GET /api/v1/messages/{consumer}/{message_id}/timeline`.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct TimelineResponse {
    #[serde(flatten)]
    timeline: Timeline,
    /// Error texts were left out: the token lacks `read:payload`.
    payload_hidden: bool,
}

/// What happened to one message, oldest first: receipt, each attempt with its error and the
/// retry tier it waited in, parking, duplicates and conflicting bodies, processing, and each
/// audited operator action (redrive, reopen, recovery, replay, discard, reads). Error texts
/// go to `read:payload` and admin tokens only, and such a read is audited.
#[utoipa::path(get, path = "/api/v1/messages/{consumer}/{message_id}/timeline",
    tag = "inspection",
    params(("consumer" = String, Path, description = "Consumer name"),
        ("message_id" = String, Path, description = "The inbox key (percent-encoded)")),
    security(("bearer" = [])),
    responses((status = 200, description = "the message's timeline", body = TimelineResponse),
        (status = 404, description = "no trace of the message")))]
pub(crate) async fn timeline(
    State(state): State<Arc<Server>>,
    caller: Option<Extension<Caller>>,
    Segments((consumer, message_id)): Segments<(String, String)>,
) -> Result<Json<TimelineResponse>, ApiError> {
    let tiers = state
        .queues
        .as_ref()
        .map(|(topology, retry)| topology.retry_tier_queues(retry))
        .unwrap_or_default();
    let mut timeline = state.ops.timeline(&consumer, &message_id, &tiers).await?;
    let caller = caller.map(|Extension(c)| c);
    let payload_hidden = !sees_payloads(caller.as_ref());
    let has_texts = timeline.entries.iter().any(|e| e.error_message.is_some());
    match &caller {
        Some(caller) if !payload_hidden && has_texts => {
            let actor = inbox_ops::Actor::new(
                &caller.name,
                "message error texts read through the admin API",
            )?;
            let details = serde_json::json!({
                "scope": caller.scope.to_string(),
                "read": "timeline error texts",
            });
            // Written before the texts leave: no audit row, no texts.
            state
                .ops
                .audit_payload_read(&actor, &consumer, &message_id, details)
                .await?;
        }
        _ => {}
    }
    if payload_hidden {
        for entry in &mut timeline.entries {
            entry.error_message = None;
        }
    }
    Ok(Json(TimelineResponse {
        timeline,
        payload_hidden,
    }))
}

/// Query of `GET /api/v1/audit`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct AuditParams {
    /// Only entries of this actor (a token's name).
    actor: Option<String>,
    /// Only this action (`redrive`, `discard`, `replay_edited`, ...).
    action: Option<String>,
    /// Only this consumer.
    consumer: Option<String>,
    /// Only entries at or after (RFC 3339, or a duration ago such as `2h`).
    since: Option<String>,
    /// Only the entries a bulk job wrote (its id, `POST /api/v1/jobs`): each carries it as
    /// `job` in its details.
    job: Option<String>,
    /// Most entries, newest first, 1 to 1000 (default 200).
    limit: Option<u32>,
}

/// The audit trail, newest first: who did what to which message, why, under which ticket.
#[utoipa::path(get, path = "/api/v1/audit", tag = "inspection", params(AuditParams),
    security(("bearer" = [])),
    responses((status = 200, description = "audit entries, newest first", body = Vec<AuditEntry>),
        (status = 400, description = "bad filter")))]
pub(crate) async fn audit(
    State(state): State<Arc<Server>>,
    Params(p): Params<AuditParams>,
) -> Result<Json<Vec<AuditEntry>>, ApiError> {
    let filter = AuditFilter {
        actor: given(&p.actor).map(str::to_owned),
        action: given(&p.action).map(str::to_owned),
        consumer: given(&p.consumer).map(str::to_owned),
        since: given(&p.since).map(|s| instant("since", s)).transpose()?,
        job: given(&p.job).map(str::to_owned),
        limit: p.limit.unwrap_or(200),
    };
    Ok(Json(state.ops.audit_trail(&filter).await?))
}

/// Body of `POST /api/v1/jobs`: the action and the same fields as `POST /api/v1/redrive`
/// (`dry_run` must be false: a preview is answered at once by the action's own endpoint).
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct JobBody {
    action: JobAction,
    #[serde(flatten)]
    body: RedriveBody,
}

/// Starts a redrive or discard in the background and answers at once (202) with the job to
/// poll; each copy it moves or removes is audited as the action's own endpoint does, each
/// audit row carrying the job's id as `job` in its details (`GET /api/v1/audit?job=<id>`
/// lists exactly them).
#[utoipa::path(post, path = "/api/v1/jobs", tag = "actions", request_body = JobBody,
    security(("bearer" = [])),
    responses((status = 202, description = "the job, running", body = JobView),
        (status = 400, description = "bad request (a dry run belongs to the action's endpoint)"),
        (status = 403, description = "not an admin token"),
        (status = 409, description = "the server was started without --queue")))]
pub(crate) async fn start_job(
    State(state): State<Arc<Server>>,
    Extension(caller): Extension<Caller>,
    Body(job): Body<JobBody>,
) -> Result<Response, ApiError> {
    if job.body.dry_run {
        return Err(ApiError::bad_request(
            "a dry run is answered at once: POST it to /api/v1/redrive or /api/v1/discard",
        ));
    }
    let actor = actor(&caller, &job.body.reason, job.body.ticket.as_deref())?;
    let mut request = job.body.request(job.action == JobAction::Discard)?;
    let id = uuid::Uuid::new_v4().simple().to_string();
    request.job = Some(id.clone());
    let lot = required_parking_lot(&state).await?;
    let running = Arc::new(Job::start(id, job.action, caller.name.clone()));
    state.jobs.add(running.clone())?;
    let view = running.view();
    let server = state.clone();
    let progress = running.clone();
    // The run in a task of its own, awaited by the one that records its outcome: a run that
    // panics is reported failed instead of showing as running for ever.
    let run = spawn_for_request(async move {
        let report = server
            .ops
            .redrive(&lot, &request, Some(&actor), progress.as_ref())
            .await;
        lot.close().await;
        match report {
            Ok(report) => Ok(report),
            Err(e) => Err(server.ops.explain(e).await),
        }
    });
    spawn_for_request(async move {
        let outcome = match run.await {
            Ok(report) => report.map_err(|e| ApiError::from(e).message().to_owned()),
            Err(e) => {
                tracing::error!(error = %e, "admin API: a bulk job stopped unexpectedly");
                Err("the job stopped unexpectedly; the server's log has why".to_owned())
            }
        };
        running.finish(outcome);
    });
    Ok((StatusCode::ACCEPTED, Json(view)).into_response())
}

/// A job's progress, and its report once done.
#[utoipa::path(get, path = "/api/v1/jobs/{id}", tag = "actions",
    params(("id" = String, Path, description = "The job's id")),
    security(("bearer" = [])),
    responses((status = 200, description = "the job", body = JobView),
        (status = 404, description = "no such job (or forgotten: the server keeps the last 100)")))]
pub(crate) async fn job(
    State(state): State<Arc<Server>>,
    Segments((id,)): Segments<(String,)>,
) -> Result<Json<JobView>, ApiError> {
    state
        .jobs
        .get(&id)
        .map(|j| Json(j.view()))
        .ok_or_else(|| ApiError::not_found(format!("no job {id:?}")))
}

/// Body of `POST /api/v1/messages/{consumer}/{message_id}/replay-edited`.
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct ReplayEditedBody {
    /// The edited body (JSON when the original was JSON).
    body: String,
    /// Show the diff and the new id only; nothing is published or changed.
    #[serde(default)]
    dry_run: bool,
    /// Why (written to the audit trail).
    reason: String,
    /// Ticket to cite beside the reason.
    ticket: Option<String>,
}

/// Most bytes an edited body may have.
const MAX_EDITED_BODY: usize = 1 << 20;

/// Replays a parked message with an edited body as a new message: its id derives from the
/// original's and the edit (the same edit twice gives the same id, which the inbox
/// deduplicates); the original row becomes PROCESSED with `replaced_by`, its parked copy is
/// removed, and the audit trail keeps both bodies' hashes and the changed paths. With
/// `dry_run`, only the diff and the new id. The body follows the consumer's privacy policy as
/// any delivery does.
#[utoipa::path(post, path = "/api/v1/messages/{consumer}/{message_id}/replay-edited",
    tag = "actions",
    params(("consumer" = String, Path, description = "Consumer name"),
        ("message_id" = String, Path, description = "The inbox key (percent-encoded)")),
    request_body = ReplayEditedBody, security(("bearer" = [])),
    responses((status = 200, description = "the diff, the new id and what was done", body = ReplayEditedReport),
        (status = 400, description = "nothing edited, invalid JSON"),
        (status = 404, description = "no inbox row for the message"),
        (status = 403, description = "not an admin token"),
        (status = 409, description = "refused: the row is not parked, already replaced, or its body is not readable")))]
pub(crate) async fn replay_edited(
    State(state): State<Arc<Server>>,
    Extension(caller): Extension<Caller>,
    Segments((consumer, message_id)): Segments<(String, String)>,
    Body(body): Body<ReplayEditedBody>,
) -> Result<Json<ReplayEditedReport>, ApiError> {
    let actor = actor(&caller, &body.reason, body.ticket.as_deref())?;
    if body.body.len() > MAX_EDITED_BODY {
        return Err(ApiError::bad_request(format!(
            "the edited body is {} bytes; at most {MAX_EDITED_BODY} are accepted",
            body.body.len()
        )));
    }
    let request = ReplayEditedRequest {
        consumer,
        message_id,
        body: body.body.into_bytes(),
        dry_run: body.dry_run,
    };
    if request.dry_run {
        let preview = state.ops.replay_edited_preview(&request).await?;
        // The diff shows the original body: a read of it, audited before it leaves.
        let details = serde_json::json!({
            "scope": caller.scope.to_string(),
            "read": "replay-edited preview (diff against the original body)",
        });
        state
            .ops
            .audit_payload_read(&actor, &request.consumer, &request.message_id, details)
            .await?;
        return Ok(Json(preview));
    }
    let Some((topology, _)) = &state.queues else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "a replay publishes to the consumer's work queue: start the server with --queue",
        ));
    };
    let broker = tokio::time::timeout(
        BROKER_TIMEOUT,
        Broker::connect(&state.amqp_url, "inbox-admin replay-edited"),
    )
    .await
    .map_err(|_| ApiError::broker(&"no answer within the timeout"))?
    .map_err(|e| ApiError::broker(&e))?;
    let lot = match parking_lot(&state).await {
        Ok(lot) => lot,
        Err(e) => {
            broker.close().await;
            return Err(e);
        }
    };
    let work = WorkQueue::new(&broker, &topology.queue);
    let report = state
        .ops
        .replay_edited(&work, lot.as_ref(), &request, &actor)
        .await;
    if let Some(lot) = lot {
        lot.close().await;
    }
    broker.close().await;
    Ok(Json(report?))
}
