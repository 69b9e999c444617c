//! How failures become HTTP responses: a status code and `{"error": "..."}`.

use axum::{
    Json,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use rabbit_inbox::ops::OpsError;

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    /// A response with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// 400: the request is wrong.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 401: no token, or one that matches none.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }

    /// 403: a valid token without the scope the call needs.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, message)
    }

    /// 404.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// 502: the broker could not be reached.
    pub fn broker(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, message)
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl From<OpsError> for ApiError {
    fn from(e: OpsError) -> Self {
        let status = match &e {
            OpsError::Invalid(_) => StatusCode::BAD_REQUEST,
            OpsError::Refused(_) => StatusCode::CONFLICT,
            OpsError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
            OpsError::Broker(_) => StatusCode::BAD_GATEWAY,
        };
        if status.is_server_error() {
            tracing::warn!(error = %e, "admin API operation failed");
        }
        Self::new(status, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(serde_json::json!({ "error": self.message })),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
