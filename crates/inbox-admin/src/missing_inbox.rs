//! A database refusal explained: when the server's schema holds no inbox, a request whose
//! statement PostgreSQL refused is answered "no inbox in schema ..." rather than as a generic
//! database failure.

use std::sync::Arc;

use axum::{
    extract::{Request, State},
    middleware::Next,
    response::{IntoResponse, Response},
};

use crate::{
    error::{ApiError, DatabaseRefused},
    server::Server,
};

/// Middleware: a request PostgreSQL refused a statement of is answered "no inbox in schema
/// ..." when the server's schema holds no inbox (checked only then: the answers that succeed
/// cost nothing more), instead of the generic database failure.
pub(crate) async fn no_inbox(
    State(server): State<Arc<Server>>,
    request: Request,
    next: Next,
) -> Response {
    let response = next.run(request).await;
    if response.extensions().get::<DatabaseRefused>().is_none() {
        return response;
    }
    match server.ops.inbox_exists().await {
        Ok(false) => ApiError::no_inbox(server.ops.schema().as_str()).into_response(),
        _ => response,
    }
}
