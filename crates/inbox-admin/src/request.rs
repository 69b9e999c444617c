//! What the handlers read from a request, shared by the API's endpoints and the console's:
//! durations and instants in their text forms, blank parameters, the actor of an action, what
//! the caller may see, and the consumer's parking lot.

use std::time::Duration;

use chrono::{DateTime, Utc};
use inbox_ops::Actor;
use rabbit_inbox::broker::ParkingLot;

use crate::{
    auth::{Caller, Scope},
    error::ApiError,
    state::{AdminState, BROKER_TIMEOUT},
};

/// Longest duration accepted in a request: a century. Longer ones overflow date arithmetic,
/// and no retention or grace period is meant to be that long.
const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A duration in humantime form (`90s`, `5m`, `2h`, `30days`), at most a century.
pub(crate) fn duration(name: &str, text: &str) -> Result<Duration, ApiError> {
    let d = humantime::parse_duration(text)
        .map_err(|e| ApiError::bad_request(format!("invalid {name} {text:?}: {e}")))?;
    if d > MAX_DURATION {
        return Err(ApiError::bad_request(format!(
            "{name} {text:?} is longer than a century"
        )));
    }
    Ok(d)
}

/// A point in time: RFC 3339, or a duration meaning that long ago (`2h`).
pub(crate) fn instant(name: &str, text: &str) -> Result<DateTime<Utc>, ApiError> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = humantime::parse_duration(text).map_err(|_| {
        ApiError::bad_request(format!(
            "invalid {name} {text:?}: expected RFC 3339 or a duration ago such as 2h"
        ))
    })?;
    if ago > MAX_DURATION {
        return Err(ApiError::bad_request(format!(
            "{name} {text:?} is too far back"
        )));
    }
    chrono::Duration::from_std(ago)
        .ok()
        .and_then(|ago| Utc::now().checked_sub_signed(ago))
        .ok_or_else(|| ApiError::bad_request(format!("{name} {text:?} is too far back")))
}

/// Blank query parameters count as absent (a form's empty field).
pub(crate) fn given(value: &Option<String>) -> Option<&str> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// The consumer's parking lot, if the server knows its queues.
pub(crate) async fn parking_lot(state: &AdminState) -> Result<Option<ParkingLot>, ApiError> {
    let Some((topology, _)) = &state.queues else {
        return Ok(None);
    };
    let connect = ParkingLot::connect(&state.amqp_url, &topology.queue, &topology.parking_queue);
    match tokio::time::timeout(BROKER_TIMEOUT, connect).await {
        Ok(Ok(lot)) => Ok(Some(lot)),
        Ok(Err(e)) => Err(ApiError::broker(&e)),
        Err(_) => Err(ApiError::broker(&"no answer within the timeout")),
    }
}

/// The actor of an admin action: the token's name, with the request's reason and ticket.
pub(crate) fn actor(
    caller: &Caller,
    reason: &str,
    ticket: Option<&str>,
) -> Result<Actor, ApiError> {
    if reason.trim().is_empty() {
        return Err(ApiError::bad_request(
            "a reason is required: it is written to the audit trail",
        ));
    }
    Ok(Actor::new(&caller.name, reason)?.with_ticket(ticket.unwrap_or_default())?)
}

/// The caller may see payloads, headers and error texts.
pub(crate) fn sees_payloads(caller: Option<&Caller>) -> bool {
    caller.is_some_and(|c| c.scope >= Scope::ReadPayload)
}

/// The parking lot an action walks, or 409 when the server does not know the consumer's
/// queues.
pub(crate) async fn required_parking_lot(state: &AdminState) -> Result<ParkingLot, ApiError> {
    parking_lot(state).await?.ok_or_else(|| {
        ApiError::new(
            axum::http::StatusCode::CONFLICT,
            "this action reads the parking lot: start the server with --queue",
        )
    })
}
