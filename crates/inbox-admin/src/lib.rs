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

// Bottom first: the error shape and the tokens, what the server serves and keeps, the
// helpers the handlers share, then the handlers and the routes over them.
mod api;
mod auth;
mod console;
mod dashboard;
mod depth_history;
mod depths;
mod error;
mod guard;
mod health;
mod host;
mod jobs;
mod listen;
mod missing_inbox;
mod ordering;
mod prometheus;
mod readiness;
mod redrive_body;
mod request;
mod routes;
mod server;
mod state;
mod throttle;

use std::{future::Future, net::SocketAddr, sync::Arc};

use axum::Router;
pub use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

pub use auth::{Caller, MIN_SECRET_BITS, MIN_SECRET_LEN, Scope, TokenError, Tokens, secret_bits};
pub use error::{ApiError, REQUEST_ID_HEADER};
pub use listen::{
    DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_READINESS_INTERVAL, ServeError,
    ServeOptions, TlsFiles,
};
pub use state::{AdminState, BROKER_TIMEOUT};
pub use throttle::{FAILURE_WINDOW, MAX_FAILURES, MAX_TRACKED_ADDRESSES};

use crate::{
    depth_history::DepthHistory, jobs::Jobs, readiness::Readiness, server::Server,
    throttle::FailureThrottle,
};

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
        throttle: FailureThrottle::default(),
        readiness: Readiness::default(),
        insecure_http: options.serves_insecure_http(addr),
        jobs: Jobs::default(),
        depths: DepthHistory::default(),
    });
    let app = routes::router(&server, hosts, options);
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
