//! Admin HTTP API and dashboard for rabbit-inbox.
//!
//! Probes (`/healthz`, `/readyz`), `/metrics`, JSON inspection endpoints and audited operator
//! actions under `/api/v1`, its OpenAPI description at `/api/v1/openapi.json`, and a dashboard
//! page at `/`. Every endpoint is glue over [`rabbit_inbox::ops::Operations`]: the operations
//! are written once, in the library, and the CLI and this server only front them.
//!
//! **Access:** read endpoints need a read or admin token, operator actions an admin token and a
//! `reason`; the token's *name* is the audit trail's actor. Without any token the server serves
//! reads only and refuses to listen on a non-loopback address ([`Tokens::check_bind`]).
//! Probes, the OpenAPI document and the page's static assets need no token.

mod api;
mod auth;
mod dashboard;
mod error;
mod guard;
mod health;

use std::{future::Future, sync::Arc, time::Duration};

use axum::{Json, Router, middleware, routing::get};
pub use metrics_exporter_prometheus::PrometheusHandle;
use rabbit_inbox::{RetryPolicy, Topology, ops::Operations};
use tokio::net::TcpListener;
use utoipa::{
    Modify, OpenApi,
    openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme},
};
use utoipa_axum::{router::OpenApiRouter, routes};

pub use auth::{Caller, MIN_SECRET_LEN, Scope, TokenError, Tokens};
pub use error::ApiError;

/// How long a probe or a request waits for RabbitMQ (and `/readyz` for PostgreSQL).
pub const BROKER_TIMEOUT: Duration = Duration::from_secs(3);

/// What the server serves.
pub struct AdminState {
    /// The inbox's operations.
    pub ops: Operations,
    /// The broker, for `/readyz`, queue depths and actions that move messages.
    pub amqp_url: String,
    /// The consumer's queues and retry tiers: broker depths in the status, where a message is
    /// on the broker, and where recovery republishes. Without them those parts are left out
    /// and recovery is refused.
    pub queues: Option<(Topology, RetryPolicy)>,
    /// The bearer tokens.
    pub tokens: Tokens,
    /// This process's Prometheus recorder, rendered at `/metrics`.
    pub metrics: Option<PrometheusHandle>,
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "rabbit-inbox admin API",
        description = "Inspection and audited operator actions on a rabbit-inbox inbox. Read \
            endpoints need a read or admin bearer token, actions an admin token and a reason; \
            the token's name is recorded as the actor."
    ),
    modifiers(&BearerAuth),
    tags((name = "health"), (name = "inspection"), (name = "actions"))
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The documented routes, each group behind its guard.
fn api_routes(state: &Arc<AdminState>) -> OpenApiRouter<Arc<AdminState>> {
    let open = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz));
    let read = OpenApiRouter::new()
        .routes(routes!(health::metrics))
        .routes(routes!(api::status))
        .routes(routes!(api::list))
        .routes(routes!(api::show))
        .routes(routes!(api::failures))
        .routes(routes!(api::doctor))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::read));
    let admin = OpenApiRouter::new()
        .routes(routes!(api::recover))
        .routes(routes!(api::redrive))
        .routes(routes!(api::reopen))
        .routes(routes!(api::cleanup_dry_run))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::admin));
    open.merge(read).merge(admin)
}

/// The whole application: API, OpenAPI document and dashboard.
pub fn router(state: AdminState) -> Router {
    let state = Arc::new(state);
    let (api, openapi) = api_routes(&state).split_for_parts();
    let openapi = Arc::new(openapi);
    api.route(
        "/api/v1/openapi.json",
        get(move || {
            let openapi = openapi.clone();
            async move { Json(openapi.as_ref().clone()) }
        }),
    )
    .route("/", get(dashboard::index))
    .route("/assets/app.js", get(dashboard::script))
    .route("/assets/app.css", get(dashboard::style))
    .with_state(state)
}

/// Why the server stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address may not be bound without tokens.
    #[error(transparent)]
    Tokens(#[from] TokenError),
    /// Listening or serving failed.
    #[error("admin server: {0}")]
    Io(#[from] std::io::Error),
}

/// Serves `state` on `listener` until `shutdown` completes. Refuses a non-loopback listener
/// when no token is configured.
pub async fn serve(
    listener: TcpListener,
    state: AdminState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    state.tokens.check_bind(listener.local_addr()?)?;
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}
