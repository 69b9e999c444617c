//! Admin HTTP API and operator console for rabbit-inbox.
//!
//! Probes (`/healthz`, `/readyz`), `/metrics`, JSON inspection endpoints and audited operator
//! actions under `/api/v1`, its OpenAPI description at `/api/v1/openapi.json`, and the
//! operator console at `/` (overview with live charts and alerts, message search and timeline,
//! bulk actions with preview and progress, edit-and-replay). Every endpoint is glue over
//! [`inbox_ops::Operations`]: the operations are written once, in the library, and the CLI and
//! this server only front them.
//!
//! **Access:** read endpoints need a token of any scope (`read`, `read:payload`, `admin`);
//! messages' payloads, headers and error texts need `read:payload` (or `admin`), and each such
//! read is audited under the token's name; operator actions need an admin token and a
//! `reason`, and the token's *name* is the audit trail's actor. Without any token the server
//! serves metadata reads only and refuses to listen on a non-loopback address
//! ([`Tokens::check_bind`]). Probes, the OpenAPI document and the page's static assets need no
//! token.
//!
//! **Exposure:** a request is answered only when its `Host` is the bind address or an allowed
//! host (DNS rebinding), a non-loopback address needs TLS or an explicit `insecure_http`, and
//! the listener bounds connections and how long a client may take to send a request
//! ([`ServeOptions`]). Responses carry `X-Content-Type-Options: nosniff`, API responses
//! `Cache-Control: no-store`, the dashboard a Content-Security-Policy without inline script.
//! A database or broker failure is logged under the request's id (`X-Request-Id`) and answered
//! with a generic message citing it.

mod api;
mod auth;
mod console;
mod dashboard;
mod depths;
mod error;
mod guard;
mod health;
mod host;
mod listen;
mod prometheus;

use std::{future::Future, net::SocketAddr, ops::Deref, sync::Arc, time::Duration};

use axum::{
    Json, Router,
    http::{HeaderValue, header},
    middleware,
    routing::get,
};
use inbox_ops::Operations;
pub use metrics_exporter_prometheus::PrometheusHandle;
use rabbit_inbox::{RetryPolicy, Topology};
use tokio::net::TcpListener;
use utoipa::{
    Modify, OpenApi,
    openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme},
};
use utoipa_axum::{router::OpenApiRouter, routes};

pub use auth::{Caller, MIN_SECRET_BITS, MIN_SECRET_LEN, Scope, TokenError, Tokens, secret_bits};
pub use error::{ApiError, REQUEST_ID_HEADER};
pub use guard::{FAILURE_WINDOW, MAX_FAILURES, MAX_TRACKED_ADDRESSES};
pub use listen::{
    DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_READINESS_INTERVAL, ServeOptions,
    TlsFiles,
};

/// How long a probe or a request waits for RabbitMQ (and `/readyz` for PostgreSQL).
pub const BROKER_TIMEOUT: Duration = Duration::from_secs(3);

/// What the server serves.
pub struct AdminState {
    /// The inbox's operations.
    pub ops: Operations,
    /// The broker, for `/readyz`, queue depths and actions that move messages.
    pub amqp_url: String,
    /// The broker's management API (`http://user:password@host:15672`; a cluster's: several,
    /// comma-separated), read for the queues' counts and by the doctor. `None`: port 15672 of
    /// the AMQP URL's host, with its credentials.
    pub management_url: Option<String>,
    /// The consumer's queues and retry tiers: broker depths in the status, where a message is
    /// on the broker, and where recovery republishes. Without them those parts are left out
    /// and recovery is refused.
    pub queues: Option<(Topology, RetryPolicy)>,
    /// The bearer tokens.
    pub tokens: Tokens,
    /// This process's Prometheus recorder, rendered at `/metrics`.
    pub metrics: Option<PrometheusHandle>,
    /// A Prometheus server evaluating the shipped alert rules and scraping the consumers: the
    /// console shows the rules' state and the consumers' latency quantiles. Without it the
    /// console evaluates the same conditions, and a latency, from the ledger.
    pub prometheus_url: Option<String>,
    /// The longest time after which a message may be delivered again: without Prometheus, the
    /// console's dedup-window headroom alert is evaluated against it.
    pub replay_window: Option<Duration>,
}

impl std::fmt::Debug for AdminState {
    /// Neither the tokens nor the broker URL (it may hold a password).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminState")
            .field("ops", &self.ops)
            .field("queues", &self.queues)
            // Whether set only: the URL may hold credentials.
            .field("management_url", &self.management_url.is_some())
            // Whether set only: the URL may hold credentials.
            .field("prometheus_url", &self.prometheus_url.is_some())
            .field("replay_window", &self.replay_window)
            .finish_non_exhaustive()
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "rabbit-inbox admin API",
        description = "Inspection and audited operator actions on a rabbit-inbox inbox. Read \
            endpoints need a bearer token of any scope (read, read:payload, admin); payloads, \
            headers and error texts are returned to read:payload and admin tokens only, each \
            read audited; actions need an admin token and a reason. The token's name is \
            recorded as the actor. Errors are JSON: {\"error\": ..., \"request_id\": ...}."
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

/// What the handlers share: the operator's [`AdminState`] and what the server keeps.
pub(crate) struct Server {
    admin: AdminState,
    throttle: guard::FailureThrottle,
    readiness: health::Readiness,
    insecure_http: bool,
    jobs: console::Jobs,
    /// A client of `admin.prometheus_url`.
    prometheus: Option<prometheus::Prometheus>,
    /// The queues' depths over the last day.
    depths: depths::DepthHistory,
}

impl Deref for Server {
    type Target = AdminState;

    fn deref(&self) -> &AdminState {
        &self.admin
    }
}

/// The documented routes, each group behind its guard.
fn api_routes(state: &Arc<Server>) -> OpenApiRouter<Arc<Server>> {
    let open = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz));
    let read = OpenApiRouter::new()
        .routes(routes!(health::metrics))
        .routes(routes!(api::status))
        .routes(routes!(api::list))
        .routes(routes!(api::show))
        .routes(routes!(api::failures))
        .routes(routes!(api::doctor, api::doctor_pass))
        .routes(routes!(console::activity))
        .routes(routes!(depths::depths))
        .routes(routes!(console::alerts))
        .routes(routes!(console::timeline))
        .routes(routes!(console::audit))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::read));
    let admin = OpenApiRouter::new()
        .routes(routes!(api::recover))
        .routes(routes!(api::redrive))
        .routes(routes!(api::reopen))
        .routes(routes!(api::cleanup_dry_run))
        .routes(routes!(api::discard))
        .routes(routes!(console::start_job))
        .routes(routes!(console::job))
        .routes(routes!(console::replay_edited))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::admin));
    open.merge(read).merge(admin)
}

/// Headers every response gets unless it sets its own: no sniffing, no caching, no framing,
/// and nothing a browser may load or run from an API response.
fn security_headers(app: Router, tls: bool) -> Router {
    use tower_http::set_header::SetResponseHeaderLayer as Set;
    let app = app
        .layer(Set::overriding(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ))
        .layer(Set::if_not_present(
            header::CACHE_CONTROL,
            HeaderValue::from_static("no-store"),
        ))
        .layer(Set::if_not_present(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"),
        ))
        .layer(Set::if_not_present(
            header::X_FRAME_OPTIONS,
            HeaderValue::from_static("DENY"),
        ));
    if tls {
        app.layer(Set::if_not_present(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static("max-age=31536000"),
        ))
    } else {
        app
    }
}

/// The whole application: API, OpenAPI document and dashboard, behind the Host check.
fn router(server: &Arc<Server>, hosts: host::AllowedHosts, options: &ServeOptions) -> Router {
    let (api, openapi) = api_routes(server).split_for_parts();
    let openapi = Arc::new(openapi);
    let app = api
        .route(
            "/api/v1/openapi.json",
            get(move || {
                let openapi = openapi.clone();
                async move { Json(openapi.as_ref().clone()) }
            }),
        )
        .route("/", get(dashboard::index))
        .route("/assets/js/{module}", get(dashboard::module))
        .route("/assets/app.css", get(dashboard::style))
        .route("/assets/uplot.js", get(dashboard::chart_script))
        .route("/assets/uplot.css", get(dashboard::chart_style))
        .fallback(|| async { ApiError::not_found("no such page or endpoint") })
        .layer(middleware::from_fn_with_state(
            server.clone(),
            error::no_inbox,
        ))
        .with_state(server.clone())
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            options.header_read_timeout,
        ))
        .layer(middleware::from_fn_with_state(Arc::new(hosts), host::check));
    security_headers(app, options.tls.is_some()).layer(middleware::from_fn(error::request_id))
}

/// Why the server stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address may not be bound without tokens.
    #[error(transparent)]
    Tokens(#[from] TokenError),
    /// The listening options are refused (TLS, allowed hosts, limits).
    #[error("{0}")]
    Config(String),
    /// Listening or serving failed.
    #[error("admin server: {0}")]
    Io(#[from] std::io::Error),
}

/// Aborts a background task when the server stops.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The server's shared state and its application, for a listener on `addr`.
fn build(
    state: AdminState,
    addr: SocketAddr,
    options: &ServeOptions,
) -> Result<(Arc<Server>, Router), ServeError> {
    let hosts = options.check(addr, &state.tokens)?;
    let server = Arc::new(Server {
        prometheus: state
            .prometheus_url
            .as_deref()
            .map(prometheus::Prometheus::new),
        admin: state,
        throttle: guard::FailureThrottle::default(),
        readiness: health::Readiness::default(),
        insecure_http: options.serves_insecure_http(addr),
        jobs: console::Jobs::default(),
        depths: depths::DepthHistory::default(),
    });
    let app = router(&server, hosts, options);
    Ok((server, app))
}

/// The application [`serve`] answers each request with, to drive without a listener (for
/// example with `tower::ServiceExt::oneshot`): the routes, tokens, `Host` check and headers
/// of a server on `addr` with `options`, refused where [`serve`] refuses them. What the
/// listener adds is left out: TLS itself, the connection limit and timeouts, the background
/// readiness check (`/readyz` stays unchecked) and queue-depth sampler (`/api/v1/depths`
/// samples only when read), and each request's peer address, which the
/// failed-authentication throttle and the payload audit read from a
/// `ConnectInfo<SocketAddr>` extension when the request carries one.
pub fn app(
    state: AdminState,
    addr: SocketAddr,
    options: &ServeOptions,
) -> Result<Router, ServeError> {
    build(state, addr, options).map(|(_, app)| app)
}

/// Serves `state` on `listener` as `options` say until `shutdown` completes. Refuses what
/// [`ServeOptions::validate`] refuses.
pub async fn serve(
    listener: TcpListener,
    state: AdminState,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let addr = listener.local_addr()?;
    let (server, app) = build(state, addr, &options)?;
    let tls = options
        .tls
        .as_ref()
        .map(listen::tls_config)
        .transpose()?
        .map(tokio_rustls::TlsAcceptor::from);
    if server.insecure_http {
        tracing::warn!(
            %addr,
            "admin server: serving clear-text HTTP on an address other machines can reach \
             (--insecure-http): tokens and messages cross the network unencrypted"
        );
    }
    let _monitor = AbortOnDrop(tokio::spawn(health::monitor(
        server.clone(),
        options.readiness_interval,
    )));
    let _depths = AbortOnDrop(tokio::spawn(depths::sampler(Arc::downgrade(&server))));
    listen::run(listener, app, &options, tls, shutdown).await
}
