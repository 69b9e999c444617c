//! How failures become HTTP responses: a status code and `{"error": "...", "request_id": "..."}`.
//!
//! Every request gets an id (the `X-Request-Id` response header). A failure of the database or
//! the broker is logged with that id and answered with a generic message carrying it: their
//! error texts (table names, hosts, SQL) are for the operator's log, not for the caller.
//! Malformed bodies, queries and paths are 400s with the same JSON shape as every other error,
//! and so is text PostgreSQL cannot store (a NUL character) in a query parameter or a path
//! segment, named in the answer. A database failure because the server's schema holds no inbox
//! is answered as such ([`no_inbox`]), naming the schema and how to create the inbox.

use axum::{
    Json,
    extract::{
        FromRequest, FromRequestParts, Query, RawPathParams, Request, rejection::JsonRejection,
    },
    http::{HeaderName, HeaderValue, StatusCode, header, request::Parts},
    middleware::Next,
    response::{IntoResponse, Response},
};
use inbox_ops::OpsError;
use rabbit_inbox::error::StoreError;
use serde::de::DeserializeOwned;

/// The response header carrying the request's id.
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

tokio::task_local! {
    /// The id of the request this task serves (set by [`request_id`]).
    static REQUEST_ID: String;
}

/// The id of the request being served, if any.
pub(crate) fn current_request_id() -> Option<String> {
    REQUEST_ID.try_with(Clone::clone).ok()
}

/// Runs `task` (work a request started that outlives it) under the request's id, so its
/// failures are logged under the id the caller was given.
pub(crate) fn spawn_for_request<F>(task: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let id = current_request_id().unwrap_or_else(|| "-".into());
    tokio::spawn(REQUEST_ID.scope(id, task))
}

/// Middleware: gives the request an id, visible to everything that runs for it (the handler
/// runs in the same task) and returned in `X-Request-Id`.
pub(crate) async fn request_id(request: Request, next: Next) -> Response {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let mut response = REQUEST_ID.scope(id.clone(), next.run(request)).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    retry_after_secs: Option<u64>,
    /// PostgreSQL refused a statement: [`no_inbox`](crate::missing_inbox::no_inbox) looks whether the schema is there.
    database: bool,
}

/// Marks a response to a request that PostgreSQL refused a statement of.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DatabaseRefused;

impl ApiError {
    /// A response with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after_secs: None,
            database: false,
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

    /// 429 with `Retry-After`.
    pub fn too_many(message: impl Into<String>, retry_after_secs: u64) -> Self {
        Self {
            retry_after_secs: Some(retry_after_secs),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, message)
        }
    }

    /// A failure of `what` (the database, RabbitMQ): `error` is logged under the request's id,
    /// and the caller gets a generic message citing that id.
    pub fn internal(status: StatusCode, what: &str, error: &dyn std::fmt::Display) -> Self {
        let id = current_request_id().unwrap_or_else(|| "-".into());
        tracing::error!(request_id = %id, error = %error, "admin API: {what} failed");
        Self::new(
            status,
            format!("{what} failed; the server's log has the details under request id {id}"),
        )
    }

    /// 503: the server's schema holds no inbox.
    pub fn no_inbox(schema: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "no inbox in schema {schema} (run `inboxctl migrate --schema {schema}`, or check \
                 the server's --schema / INBOX_SCHEMA)"
            ),
        )
    }

    /// 502: the broker could not be reached; `error` goes to the log only.
    pub fn broker(error: &dyn std::fmt::Display) -> Self {
        Self::internal(StatusCode::BAD_GATEWAY, "reaching RabbitMQ", error)
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// What the caller is told.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl From<OpsError> for ApiError {
    fn from(e: OpsError) -> Self {
        match &e {
            OpsError::Invalid(_) => Self::bad_request(e.to_string()),
            OpsError::NotFound(_) => Self::not_found(e.to_string()),
            OpsError::Refused(_) => Self::new(StatusCode::CONFLICT, e.to_string()),
            OpsError::Store(store) => Self {
                database: matches!(store, StoreError::Database(sqlx::Error::Database(_))),
                ..Self::internal(StatusCode::SERVICE_UNAVAILABLE, "the inbox database", &e)
            },
            OpsError::NoInbox { schema } => Self::no_inbox(schema),
            OpsError::Broker(_) => Self::broker(&e),
            // A kind this server does not know yet: logged under the request id, not shown.
            _ => Self::internal(StatusCode::INTERNAL_SERVER_ERROR, "an operation", &e),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = match current_request_id() {
            Some(id) => serde_json::json!({ "error": self.message, "request_id": id }),
            None => serde_json::json!({ "error": self.message }),
        };
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.database {
            response.extensions_mut().insert(DatabaseRefused);
        }
        response
    }
}

/// 400 if `value` of the parameter `name` holds a NUL character, which PostgreSQL's text
/// cannot store.
pub(crate) fn storable(name: &str, value: &str) -> Result<(), ApiError> {
    if value.contains('\0') {
        return Err(ApiError::bad_request(format!(
            "{name} contains a NUL character, which the inbox cannot store"
        )));
    }
    Ok(())
}

/// A JSON request body; a malformed one is a 400 (413 when too large) in the API's error shape.
pub(crate) struct Body<T>(pub(crate) T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(rejected(rejection.status(), &rejection.body_text(), || {
                matches!(rejection, JsonRejection::MissingJsonContentType(_))
            })),
        }
    }
}

/// Query parameters; malformed ones are a 400 in the API's error shape.
pub(crate) struct Params<T>(pub(crate) T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        // Every parameter by its name first: a value PostgreSQL cannot store is named.
        if let Ok(Query(pairs)) = Query::<Vec<(String, String)>>::try_from_uri(&parts.uri) {
            for (name, value) in &pairs {
                storable(name, value)?;
            }
        }
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Self(q.0))
            .map_err(|r| rejected(r.status(), &r.body_text(), || false))
    }
}

/// Path segments; malformed ones are a 400 in the API's error shape.
pub(crate) struct Segments<T>(pub(crate) T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Segments<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        if let Ok(params) = RawPathParams::from_request_parts(parts, state).await {
            for (name, value) in &params {
                storable(name, value)?;
            }
        }
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Self(p.0))
            .map_err(|r| rejected(r.status(), &r.body_text(), || false))
    }
}

fn rejected(status: StatusCode, text: &str, wrong_type: impl FnOnce() -> bool) -> ApiError {
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::new(status, "the request body is too large");
    }
    if wrong_type() {
        return ApiError::bad_request("the body must be JSON (Content-Type: application/json)");
    }
    if status.is_server_error() {
        return ApiError::internal(status, "reading the request", &text);
    }
    ApiError::bad_request(text)
}
