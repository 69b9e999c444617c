//! The JSON endpoints under `/api/v1`: inspection (read scope) and operator actions (admin
//! scope). Each handler parses its request, calls [`Operations`](inbox_ops::Operations)
//! and returns the operation's report as JSON; no operation is implemented here.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    Extension, Json,
    extract::{ConnectInfo, State},
};
use inbox_ops::{
    Actor, NoProgress,
    doctor::{DoctorReport, DoctorRequest},
    inspect::{
        FailureGroup, ListFilter, ListPage, ShowQuery, ShowReport, StatusQuery, StatusReport,
    },
    recover::{RecoverRequest, RecoveryPolicy, RecoveryReport},
    redrive::RedriveReport,
    reopen::Reopened,
    retention::{CleanupReport, CleanupRequest},
};
use rabbit_inbox::{InboxStatus, PayloadStorage, broker::Broker, retention::RetentionPolicy};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::{
    auth::Caller,
    error::{ApiError, Body, Params, Segments, storable},
    redrive_body::RedriveBody,
    request::{actor, duration, given, instant, parking_lot, required_parking_lot, sees_payloads},
    server::Server,
    state::{AdminState, BROKER_TIMEOUT},
};

/// Most rows one recovery request may take.
const MAX_RECOVER_LIMIT: usize = 10_000;

/// Query of `GET /api/v1/status`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct StatusParams {
    /// One consumer, or all.
    consumer: Option<String>,
    /// A PROCESSING row whose attempt started longer ago than this is stale (default 5m).
    stale_after: Option<String>,
    /// Count every PROCESSED row (a scan of the table).
    #[serde(default)]
    count_processed: bool,
}

/// Counts and ages per consumer and status, stale PROCESSING rows, the last hour's failures
/// and duplicates, and (when the server knows the consumer's queue) the broker's depths.
#[utoipa::path(get, path = "/api/v1/status", tag = "inspection", params(StatusParams),
    security(("bearer" = [])),
    responses((status = 200, description = "counts and ages per consumer and status", body = StatusReport),
        (status = 401, description = "no or unknown token")))]
pub(crate) async fn status(
    State(state): State<Arc<Server>>,
    Params(p): Params<StatusParams>,
) -> Result<Json<StatusReport>, ApiError> {
    let mut query = StatusQuery {
        consumer: given(&p.consumer).map(str::to_owned),
        count_processed: p.count_processed,
        ..StatusQuery::default()
    };
    // Rows waiting for their retry are overdue only after the consumer's own delays.
    if let Some((_, retry)) = &state.queues {
        query.retry_delays = retry.delays.clone();
        query.stale_after = retry.stale_processing_after;
    }
    if let Some(s) = given(&p.stale_after) {
        query.stale_after = duration("stale_after", s)?;
    }
    let lot = parking_lot(&state).await?;
    let report = state.ops.status(&query, lot.as_ref()).await;
    if let Some(lot) = lot {
        lot.close().await;
    }
    Ok(Json(report?))
}

/// Query of `GET /api/v1/messages`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListParams {
    /// One message id (exact).
    message_id: Option<String>,
    /// Correlation id (exact).
    correlation_id: Option<String>,
    /// Consumer.
    consumer: Option<String>,
    /// Statuses, comma-separated (default: every status but PROCESSED).
    status: Option<String>,
    /// Message type.
    #[serde(rename = "type")]
    #[param(rename = "type")]
    message_type: Option<String>,
    /// Last error code.
    error_code: Option<String>,
    /// Aggregate type.
    aggregate_type: Option<String>,
    /// Aggregate id.
    aggregate_id: Option<String>,
    /// Tenant.
    tenant: Option<String>,
    /// First received at or after (RFC 3339, or a duration ago such as `2h`).
    since: Option<String>,
    /// First received before (RFC 3339, or a duration ago).
    until: Option<String>,
    /// `next_cursor` of the previous page.
    cursor: Option<String>,
    /// Rows per page, 1 to 1000 (default 50).
    limit: Option<u32>,
}

/// Inbox rows by filter, oldest first, a page at a time (keyset cursor).
#[utoipa::path(get, path = "/api/v1/messages", tag = "inspection", params(ListParams),
    security(("bearer" = [])),
    responses((status = 200, description = "a page of rows", body = ListPage),
        (status = 400, description = "bad filter or cursor")))]
pub(crate) async fn list(
    State(state): State<Arc<Server>>,
    Params(p): Params<ListParams>,
) -> Result<Json<ListPage>, ApiError> {
    let statuses = given(&p.status)
        .map(|s| {
            s.split(',')
                .map(|one| {
                    one.trim()
                        .to_ascii_uppercase()
                        .parse::<InboxStatus>()
                        .map_err(|_| ApiError::bad_request(format!("unknown status {one:?}")))
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?
        .unwrap_or_default();
    let owned = |v: &Option<String>| given(v).map(str::to_owned);
    let filter = ListFilter {
        message_id: owned(&p.message_id),
        correlation_id: owned(&p.correlation_id),
        consumer: owned(&p.consumer),
        statuses,
        message_type: owned(&p.message_type),
        error_code: owned(&p.error_code),
        aggregate_type: owned(&p.aggregate_type),
        aggregate_id: owned(&p.aggregate_id),
        tenant: owned(&p.tenant),
        since: given(&p.since).map(|s| instant("since", s)).transpose()?,
        until: given(&p.until).map(|s| instant("until", s)).transpose()?,
        cursor: owned(&p.cursor),
        limit: p.limit.unwrap_or(ListFilter::default().limit),
    };
    Ok(Json(state.ops.list(&filter).await?))
}

/// `GET /api/v1/messages/{consumer}/{message_id}`: the report, and whether its contents were
/// withheld for want of the `read:payload` scope.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct ShowResponse {
    #[serde(flatten)]
    report: ShowReport,
    /// Payloads, headers and error texts were left out: the token lacks `read:payload`.
    payload_hidden: bool,
}

/// One message of one consumer: its row, payload (if kept), tombstones, audit trail and where
/// it is on the broker. 404 when the inbox has no trace of it. The payload, headers and error
/// text are returned to `read:payload` and admin tokens only, and each such read is audited
/// (`payload_read`, the token's name as actor) before it is answered; other tokens get
/// `payload_hidden: true` and those fields empty.
#[utoipa::path(get, path = "/api/v1/messages/{consumer}/{message_id}", tag = "inspection",
    params(("consumer" = String, Path, description = "Consumer name"),
        ("message_id" = String, Path, description = "The inbox key (percent-encoded)")),
    security(("bearer" = [])),
    responses((status = 200, description = "the message everywhere it is known", body = ShowResponse),
        (status = 404, description = "no row or tombstone")))]
pub(crate) async fn show(
    State(state): State<Arc<Server>>,
    caller: Option<Extension<Caller>>,
    peer: Option<Extension<ConnectInfo<SocketAddr>>>,
    Segments((consumer, message_id)): Segments<(String, String)>,
) -> Result<Json<ShowResponse>, ApiError> {
    let mut report = state
        .ops
        .show(&ShowQuery {
            message_id: message_id.clone(),
            consumer: Some(consumer.clone()),
            topology: state.queues.clone(),
        })
        .await?;
    if report.rows.is_empty() && report.tombstones.is_empty() {
        return Err(ApiError::not_found(format!(
            "no inbox row or tombstone for {message_id:?} of consumer {consumer:?}"
        )));
    }
    let caller = caller.map(|Extension(c)| c);
    let payload_hidden = !sees_payloads(caller.as_ref());
    match &caller {
        Some(caller) if !payload_hidden && !report.rows.is_empty() => {
            let actor = Actor::new(&caller.name, "message contents read through the admin API")?;
            let row = &report.rows[0];
            let details = serde_json::json!({
                "scope": caller.scope.to_string(),
                "payload_kept": row.payload.is_some(),
                "status": row.status,
                "peer": peer.map(|Extension(ConnectInfo(p))| p.ip().to_string()),
            });
            // Written before the contents leave: no audit row, no contents.
            state
                .ops
                .audit_payload_read(&actor, &consumer, &message_id, details)
                .await?;
        }
        _ => {}
    }
    if payload_hidden {
        for row in &mut report.rows {
            row.payload = None;
            row.headers = serde_json::Value::Null;
            row.last_error_message = None;
        }
    }
    Ok(Json(ShowResponse {
        report,
        payload_hidden,
    }))
}

/// Query of `GET /api/v1/failures`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct FailureParams {
    /// One consumer, or all.
    consumer: Option<String>,
}

/// Failed rows (retrying, parked, poisoned, in manual review) grouped by consumer, status,
/// message type and error code, largest group first, with a sample of each. The sample's error
/// text is returned to `read:payload` and admin tokens only.
#[utoipa::path(get, path = "/api/v1/failures", tag = "inspection", params(FailureParams),
    security(("bearer" = [])),
    responses((status = 200, description = "the failure groups, largest first", body = Vec<FailureGroup>)))]
pub(crate) async fn failures(
    State(state): State<Arc<Server>>,
    caller: Option<Extension<Caller>>,
    Params(p): Params<FailureParams>,
) -> Result<Json<Vec<FailureGroup>>, ApiError> {
    let mut groups = state.ops.failure_groups(given(&p.consumer)).await?;
    if !sees_payloads(caller.as_ref().map(|Extension(c)| c)) {
        for group in &mut groups {
            group.sample_error = None;
        }
    }
    Ok(Json(groups))
}

/// Body of `POST /api/v1/recover`.
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct RecoverBody {
    /// Consumer whose rows to recover.
    consumer: String,
    /// Why (written to the audit trail).
    reason: String,
    /// Ticket to cite beside the reason.
    ticket: Option<String>,
    /// Find and classify only; change nothing.
    #[serde(default)]
    dry_run: bool,
    /// `retry` (republish; default) or `manual-review`.
    policy: Option<String>,
    /// Most rows per run, 1 to 10000 (default 1000).
    limit: Option<usize>,
    /// Added to a retry tier's delay before a retry counts as lost (default 1m).
    grace: Option<String>,
}

/// Recovers messages whose path was lost (expired leases, retries that never came back):
/// republished from the stored payload or moved to MANUAL_REVIEW, each audited with the
/// token's name and the reason.
#[utoipa::path(post, path = "/api/v1/recover", tag = "actions", request_body = RecoverBody,
    security(("bearer" = [])),
    responses((status = 200, description = "what recovery found and did", body = RecoveryReport),
        (status = 403, description = "not an admin token"),
        (status = 409, description = "the server was started without --queue")))]
pub(crate) async fn recover(
    State(state): State<Arc<Server>>,
    Extension(caller): Extension<Caller>,
    Body(body): Body<RecoverBody>,
) -> Result<Json<RecoveryReport>, ApiError> {
    let actor = actor(&caller, &body.reason, body.ticket.as_deref())?;
    storable("consumer", &body.consumer)?;
    let Some((topology, retry)) = &state.queues else {
        return Err(ApiError::new(
            axum::http::StatusCode::CONFLICT,
            "recovery republishes to the work queue: start the server with --queue",
        ));
    };
    let limit = body.limit.unwrap_or(1000);
    if !(1..=MAX_RECOVER_LIMIT).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit must be 1 to {MAX_RECOVER_LIMIT}"
        )));
    }
    let policy = match body.policy.as_deref() {
        None | Some("retry") => RecoveryPolicy::Retry,
        Some("manual-review") => RecoveryPolicy::ManualReview,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "unknown policy {other:?} (retry or manual-review)"
            )));
        }
    };
    let request = RecoverRequest {
        consumer: body.consumer.clone(),
        work_queue: topology.queue.clone(),
        policy,
        retry: retry.clone(),
        grace: body
            .grace
            .as_deref()
            .map(|g| duration("grace", g))
            .transpose()?
            .unwrap_or(Duration::from_secs(60)),
        limit,
        dry_run: body.dry_run,
    };
    let broker = tokio::time::timeout(
        BROKER_TIMEOUT,
        Broker::connect(&state.amqp_url, "inbox-admin recover"),
    )
    .await
    .map_err(|_| ApiError::broker(&"no answer within the timeout"))?
    .map_err(|e| ApiError::broker(&e))?;
    let report = state
        .ops
        .recover(&broker, &actor, &request, &NoProgress)
        .await;
    broker.close().await;
    Ok(Json(report?))
}

/// Body of `POST /api/v1/cleanup/dry-run`.
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct CleanupBody {
    /// Consumer whose rows retention would clean.
    consumer: String,
    /// Why the preview is asked for.
    reason: String,
    /// PROCESSED rows are removed this long after processing (default 30days).
    processed_retention: Option<String>,
    /// Parked rows are removed this long after their last failure (default: kept).
    parked_retention: Option<String>,
}

/// What retention would scrub, remove and expire for one consumer; changes nothing. (Cleanup
/// itself runs on the consumer's timer or with `inboxctl cleanup`.)
#[utoipa::path(post, path = "/api/v1/cleanup/dry-run", tag = "actions",
    request_body = CleanupBody, security(("bearer" = [])),
    responses((status = 200, description = "what retention would do", body = CleanupReport),
        (status = 409, description = "the dedup window is shorter than the redelivery horizon")))]
pub(crate) async fn cleanup_dry_run(
    State(state): State<Arc<Server>>,
    Extension(caller): Extension<Caller>,
    Body(body): Body<CleanupBody>,
) -> Result<Json<CleanupReport>, ApiError> {
    actor(&caller, &body.reason, None)?;
    storable("consumer", &body.consumer)?;
    let mut retention = RetentionPolicy::default();
    if let Some(p) = body.processed_retention.as_deref() {
        retention.processed = duration("processed_retention", p)?;
    }
    retention.parked = body
        .parked_retention
        .as_deref()
        .map(|p| duration("parked_retention", p))
        .transpose()?;
    let retry = state
        .queues
        .as_ref()
        .map(|(_, r)| r.clone())
        .unwrap_or_default();
    let mut request = CleanupRequest::new(body.consumer, retention, retry);
    request.dry_run = true;
    Ok(Json(state.ops.cleanup(&request, &NoProgress).await?))
}

/// Moves parked messages back to the work queue after a fix, each classified against its
/// inbox row first; with `dry_run` only counts what would happen. Every move is audited with
/// the token's name and the reason.
#[utoipa::path(post, path = "/api/v1/redrive", tag = "actions", request_body = RedriveBody,
    security(("bearer" = [])),
    responses((status = 200, description = "what the pass found and did", body = RedriveReport),
        (status = 403, description = "not an admin token"),
        (status = 409, description = "the server was started without --queue")))]
pub(crate) async fn redrive(
    State(state): State<Arc<Server>>,
    Extension(caller): Extension<Caller>,
    Body(body): Body<RedriveBody>,
) -> Result<Json<RedriveReport>, ApiError> {
    let actor = actor(&caller, &body.reason, body.ticket.as_deref())?;
    let request = body.request(false)?;
    let lot = required_parking_lot(&state).await?;
    let report = state
        .ops
        .redrive(&lot, &request, Some(&actor), &NoProgress)
        .await;
    lot.close().await;
    Ok(Json(report?))
}

/// Removes parked copies whose rows are parked (PERMANENT_FAILED, POISONED, MANUAL_REVIEW):
/// messages an operator decided are not to be processed. The rows stay parked, as evidence,
/// and note when their copy was discarded; each removal is audited (`discard`) before its copy is acked. With `dry_run`
/// only counts what would be removed.
#[utoipa::path(post, path = "/api/v1/discard", tag = "actions", request_body = RedriveBody,
    security(("bearer" = [])),
    responses((status = 200, description = "what the pass found and did", body = RedriveReport),
        (status = 400, description = "force or drop_processed given"),
        (status = 403, description = "not an admin token"),
        (status = 409, description = "the server was started without --queue")))]
pub(crate) async fn discard(
    State(state): State<Arc<Server>>,
    Extension(caller): Extension<Caller>,
    Body(body): Body<RedriveBody>,
) -> Result<Json<RedriveReport>, ApiError> {
    let actor = actor(&caller, &body.reason, body.ticket.as_deref())?;
    let request = body.request(true)?;
    let lot = required_parking_lot(&state).await?;
    let report = state
        .ops
        .redrive(&lot, &request, Some(&actor), &NoProgress)
        .await;
    lot.close().await;
    Ok(Json(report?))
}

/// Body of `POST /api/v1/messages/{consumer}/{message_id}/reopen`.
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct ReopenBody {
    /// Why (written to the audit trail).
    reason: String,
    /// Ticket to cite beside the reason.
    ticket: Option<String>,
    /// Reopen a PROCESSED row too, so the next delivery applies the effect again (audited as
    /// `forced_replay`).
    #[serde(default)]
    force_replay: bool,
}

/// Reopens one failed row (attempts reset) so its next delivery runs the handler again;
/// `force_replay` also reopens a PROCESSED one. Audited with the token's name and reason.
#[utoipa::path(post, path = "/api/v1/messages/{consumer}/{message_id}/reopen", tag = "actions",
    params(("consumer" = String, Path, description = "Consumer name"),
        ("message_id" = String, Path, description = "The inbox key (percent-encoded)")),
    request_body = ReopenBody, security(("bearer" = [])),
    responses((status = 200, description = "the row reopened", body = Reopened),
        (status = 404, description = "no inbox row for the message"),
        (status = 409, description = "refused (PROCESSED without force_replay, PROCESSING)")))]
pub(crate) async fn reopen(
    State(state): State<Arc<Server>>,
    Extension(caller): Extension<Caller>,
    Segments((consumer, message_id)): Segments<(String, String)>,
    Body(body): Body<ReopenBody>,
) -> Result<Json<Reopened>, ApiError> {
    let actor = actor(&caller, &body.reason, body.ticket.as_deref())?;
    Ok(Json(
        state
            .ops
            .reopen(&message_id, &consumer, &actor, body.force_replay)
            .await?,
    ))
}

/// Query of `GET /api/v1/doctor`, and body of `POST /api/v1/doctor`.
#[derive(Debug, Default, Deserialize, IntoParams, ToSchema)]
#[into_params(parameter_in = Query)]
#[serde(default)]
pub(crate) struct DoctorParams {
    /// Check this consumer's rows; every consumer's when absent.
    consumer: Option<String>,
    /// The consumer's dedup window: PROCESSED rows are removed this long after processing
    /// (default 30days).
    processed_retention: Option<String>,
    /// How long after parking a message may still be replayed (default 14days).
    replay_window: Option<String>,
    /// Which bodies the consumer keeps: `failed-only` (default), `always` or `never`.
    payload_storage: Option<String>,
    /// The consumer encrypts stored payloads.
    encrypted: bool,
}

/// The doctor's request for `p`; with `broker`, the broker and parking-lot checks too.
fn doctor_request(
    state: &AdminState,
    p: &DoctorParams,
    broker: bool,
) -> Result<DoctorRequest, ApiError> {
    let mut retention = RetentionPolicy::default();
    if let Some(d) = given(&p.processed_retention) {
        retention.processed = duration("processed_retention", d)?;
    }
    if let Some(d) = given(&p.replay_window) {
        retention.parking_replay_window = duration("replay_window", d)?;
    }
    let payload_storage = match given(&p.payload_storage) {
        None | Some("failed-only") => PayloadStorage::FailedOnly,
        Some("always") => PayloadStorage::Always,
        Some("never") => PayloadStorage::Never,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "unknown payload_storage {other:?} (failed-only, always or never)"
            )));
        }
    };
    if let Some(consumer) = &p.consumer {
        storable("consumer", consumer)?;
    }
    let (topology, retry) = match &state.queues {
        Some((t, r)) => (Some(t.clone()), r.clone()),
        None => (None, rabbit_inbox::RetryPolicy::default()),
    };
    Ok(DoctorRequest {
        consumer: given(&p.consumer).map(str::to_owned),
        amqp_url: broker.then(|| state.amqp_url.clone()),
        management_url: state.management_url.clone(),
        topology: if broker { topology } else { None },
        retry,
        retention: Some(retention),
        payload_storage,
        payload_encrypted: p.encrypted,
        ..DoctorRequest::default()
    })
}

/// What a GET without a token says of the checks it left out, and how to run them.
fn ledger_only(mut report: DoctorReport) -> DoctorReport {
    const HINT: &str = "POST /api/v1/doctor (a JSON body, such as {}) runs the broker and \
                        parking-lot checks too, or GET it with a token: a page of another site \
                        can make a browser send a plain GET, and that never starts broker work";
    for check in &mut report.checks {
        let what = match check.id {
            inbox_ops::doctor::check_ids::TOPOLOGY => "broker topology",
            inbox_ops::doctor::check_ids::PARKING_LOT_READ => "parking lot",
            _ => continue,
        };
        check.summary = format!("{what} not checked: a GET without a token checks the ledger only");
        check.hint = Some(HINT.into());
    }
    report
}

/// The installation checked against the inbox review checklist: schema, the broker topology
/// (through the management API; the server's `--queue`), retention, recovery, parking-lot
/// reconciliation and payload privacy. One row per check with `pass`, `warn` or `fail`;
/// changes nothing. A GET without a token (a server without tokens) runs the ledger's checks
/// only, never the broker's: a page of another site can make a browser send a plain GET.
/// `POST /api/v1/doctor` (or a GET with a token) runs them all.
#[utoipa::path(get, path = "/api/v1/doctor", tag = "inspection", params(DoctorParams),
    security(("bearer" = [])),
    responses((status = 200, description = "one row per check", body = DoctorReport),
        (status = 400, description = "bad parameter"),
        (status = 401, description = "no or unknown token")))]
pub(crate) async fn doctor(
    State(state): State<Arc<Server>>,
    caller: Option<Extension<Caller>>,
    Params(p): Params<DoctorParams>,
) -> Result<Json<DoctorReport>, ApiError> {
    let broker = caller.is_some();
    let request = doctor_request(&state, &p, broker)?;
    let report = state.ops.doctor(&request).await;
    Ok(Json(if broker { report } else { ledger_only(report) }))
}

/// Every check of the doctor, the broker's and the parking lot's included (the parking lot is
/// read and put back, nothing consumed): the same report as `GET /api/v1/doctor` with a token.
/// The body has the GET's parameters, each optional (`{}`); being JSON, a page of another site
/// cannot make a browser send it without the browser asking the server first.
#[utoipa::path(post, path = "/api/v1/doctor", tag = "inspection", request_body = DoctorParams,
    security(("bearer" = [])),
    responses((status = 200, description = "one row per check", body = DoctorReport),
        (status = 400, description = "bad parameter"),
        (status = 401, description = "no or unknown token")))]
pub(crate) async fn doctor_pass(
    State(state): State<Arc<Server>>,
    Body(p): Body<DoctorParams>,
) -> Result<Json<DoctorReport>, ApiError> {
    let request = doctor_request(&state, &p, true)?;
    Ok(Json(state.ops.doctor(&request).await))
}
