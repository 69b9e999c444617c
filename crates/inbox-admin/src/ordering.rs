//! The endpoints of ordered processing: a consumer's blocked keys (read scope) and skipping
//! what one of them waits for (admin scope, audited under the token's name). Glue over
//! [`Operations::blocked_keys`](inbox_ops::Operations::blocked_keys) and
//! [`Operations::skip_head`](inbox_ops::Operations::skip_head).

use std::sync::Arc;

use axum::{Extension, Json, extract::State};
use inbox_ops::ordering::{BlockedKey, SkippedHead};
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};

use crate::{
    auth::Caller,
    error::{ApiError, Body, Params, Segments, storable},
    request::{actor, given, sees_payloads},
    server::Server,
};

/// Keys listed when the request names no limit.
const DEFAULT_LIMIT: i64 = 100;

/// Query of `GET /api/v1/consumers/{consumer}/blocked-keys`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct BlockedParams {
    /// Most keys, 1 to 1000 (default 100).
    limit: Option<i64>,
}

/// The consumer's keys whose held messages wait, oldest first: keys blocked behind a head (a
/// message of the key that failed and is retrying or parked) and keys waiting for a missing
/// sequence number. The head's error text is returned to `read:payload` and admin tokens
/// only.
#[utoipa::path(get, path = "/api/v1/consumers/{consumer}/blocked-keys", tag = "inspection",
    params(("consumer" = String, Path, description = "Consumer name"), BlockedParams),
    security(("bearer" = [])),
    responses((status = 200, description = "the blocked keys, oldest first", body = Vec<BlockedKey>),
        (status = 400, description = "bad limit"),
        (status = 401, description = "no or unknown token")))]
pub(crate) async fn blocked_keys(
    State(state): State<Arc<Server>>,
    caller: Option<Extension<Caller>>,
    Segments((consumer,)): Segments<(String,)>,
    Params(p): Params<BlockedParams>,
) -> Result<Json<Vec<BlockedKey>>, ApiError> {
    let limit = p.limit.unwrap_or(DEFAULT_LIMIT);
    let mut keys = state.ops.blocked_keys(&consumer, limit).await?;
    if !sees_payloads(caller.as_ref().map(|Extension(c)| c)) {
        for key in &mut keys {
            key.head_error = None;
        }
    }
    Ok(Json(keys))
}

/// Body of `POST /api/v1/consumers/{consumer}/blocked-keys/skip`.
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct SkipBody {
    /// The ordering key, as listed.
    order_key: String,
    /// The head the operator saw: refused if the key's head is another one by now. Absent:
    /// skip whatever the key waits for (a sequence gap has no head).
    expected_head: Option<String>,
    /// Why (written to the audit trail).
    reason: String,
    /// Ticket to cite beside the reason.
    ticket: Option<String>,
}

/// Skips what a key waits for, so that its held messages are released in order: a blocked
/// key loses its head (the head's row stays as it is, parked or retrying), and with sequence
/// numbers waits for the number after the head's; a key waiting on a sequence gap goes on from
/// its first held number. Audited (`skip_head`) with the token's name and the reason.
#[utoipa::path(post, path = "/api/v1/consumers/{consumer}/blocked-keys/skip", tag = "actions",
    params(("consumer" = String, Path, description = "Consumer name")),
    request_body = SkipBody, security(("bearer" = [])),
    responses((status = 200, description = "what was skipped, and how many messages go on", body = SkippedHead),
        (status = 400, description = "refused: the key waits for nothing, or its head is not expected_head; or no reason"),
        (status = 403, description = "not an admin token")))]
pub(crate) async fn skip_head(
    State(state): State<Arc<Server>>,
    Extension(caller): Extension<Caller>,
    Segments((consumer,)): Segments<(String,)>,
    Body(body): Body<SkipBody>,
) -> Result<Json<SkippedHead>, ApiError> {
    let actor = actor(&caller, &body.reason, body.ticket.as_deref())?;
    storable("order_key", &body.order_key)?;
    if body.order_key.trim().is_empty() {
        return Err(ApiError::bad_request("order_key is required"));
    }
    let expected = given(&body.expected_head);
    if let Some(head) = expected {
        storable("expected_head", head)?;
    }
    Ok(Json(
        state
            .ops
            .skip_head(&actor, &consumer, &body.order_key, expected)
            .await?,
    ))
}
