//! The HTTP side of the tokens: middleware that admits a request to a read or an admin route,
//! and hands the handler the [`Caller`] it authenticated as. A failed authentication (a token
//! that matches none) is logged with the caller's address, never with the secret presented,
//! and counted by the [`FailureThrottle`](crate::throttle::FailureThrottle).

use std::{net::SocketAddr, sync::Arc};

use axum::{
    extract::{ConnectInfo, Request, State},
    http::header,
    middleware::Next,
    response::Response,
};

use crate::{
    auth::{Caller, Scope},
    error::ApiError,
    server::Server,
};

fn bearer(request: &Request) -> Option<&str> {
    let value = request
        .headers()
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (kind, token) = value.split_once(' ')?;
    kind.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

fn admit(state: &Server, request: &Request, needed: Scope) -> Result<Option<Caller>, ApiError> {
    if state.tokens.is_empty() {
        // Bound to loopback only (checked at start); metadata reads are open, but payloads
        // and changes need a token's name for the audit trail.
        return match needed {
            Scope::Read => Ok(None),
            Scope::ReadPayload | Scope::Admin => Err(ApiError::forbidden(
                "no token is configured: this call needs one (its name is the audit trail's \
                 actor)",
            )),
        };
    }
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    // A valid token passes whatever others at its address did; only the attempts that fail
    // are throttled.
    let presented = bearer(request);
    let caller = presented.and_then(|p| state.tokens.authenticate(p));
    if caller.is_none()
        && let Some(ip) = peer
        && let Some(left) = state.throttle.refused_for(ip)
    {
        return Err(ApiError::too_many(
            "too many failed authentications from this address; try again later",
            left.as_secs().max(1),
        ));
    }
    if presented.is_none() {
        return Err(ApiError::unauthorized(
            "an Authorization: Bearer <token> header is required",
        ));
    }
    let Some(caller) = caller else {
        // The address and the path only: the presented secret may be a real one mistyped.
        tracing::warn!(
            peer = %peer.map_or_else(|| "-".to_owned(), |ip| ip.to_string()),
            path = %request.uri().path(),
            "admin API: authentication failed (the token matches no configured token)"
        );
        if let Some(ip) = peer {
            state.throttle.failed(ip);
        }
        return Err(ApiError::unauthorized(
            "the token matches no configured token",
        ));
    };
    if caller.scope < needed {
        return Err(ApiError::forbidden(format!(
            "the token {:?} has the {} scope; this call needs {needed}",
            caller.name, caller.scope
        )));
    }
    Ok(Some(caller))
}

async fn guard(
    state: Arc<Server>,
    needed: Scope,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(caller) = admit(&state, &request, needed)? {
        request.extensions_mut().insert(caller);
    }
    Ok(next.run(request).await)
}

/// Admits requests with any token (any request when no token is configured).
pub(crate) async fn read(
    State(state): State<Arc<Server>>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    guard(state, Scope::Read, request, next).await
}

/// Admits requests with an admin token.
pub(crate) async fn admin(
    State(state): State<Arc<Server>>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    guard(state, Scope::Admin, request, next).await
}
