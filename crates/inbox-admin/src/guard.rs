//! The HTTP side of the tokens: middleware that admits a request to a read or an admin route,
//! and hands the handler the [`Caller`] it authenticated as.

use std::sync::Arc;

use axum::{
    extract::{Request, State},
    http::header,
    middleware::Next,
    response::Response,
};

use crate::{
    AdminState,
    auth::{Caller, Scope},
    error::ApiError,
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

fn admit(state: &AdminState, request: &Request, needed: Scope) -> Result<Option<Caller>, ApiError> {
    if state.tokens.is_empty() {
        // Bound to loopback only (checked at start); reads are open, but a change needs a
        // token's name for the audit trail.
        return match needed {
            Scope::Read => Ok(None),
            Scope::Admin => Err(ApiError::forbidden(
                "no admin token is configured: operator actions need one (its name is the \
                 audit trail's actor)",
            )),
        };
    }
    let presented = bearer(request).ok_or_else(|| {
        ApiError::unauthorized("an Authorization: Bearer <token> header is required")
    })?;
    let caller = state
        .tokens
        .authenticate(presented)
        .ok_or_else(|| ApiError::unauthorized("the token matches no configured token"))?;
    if caller.scope < needed {
        return Err(ApiError::forbidden(format!(
            "the token {:?} has the {} scope; this call needs {needed}",
            caller.name, caller.scope
        )));
    }
    Ok(Some(caller))
}

async fn guard(
    state: Arc<AdminState>,
    needed: Scope,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(caller) = admit(&state, &request, needed)? {
        request.extensions_mut().insert(caller);
    }
    Ok(next.run(request).await)
}

/// Admits requests with a read or admin token (any request when no token is configured).
pub(crate) async fn read(
    State(state): State<Arc<AdminState>>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    guard(state, Scope::Read, request, next).await
}

/// Admits requests with an admin token.
pub(crate) async fn admin(
    State(state): State<Arc<AdminState>>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    guard(state, Scope::Admin, request, next).await
}
