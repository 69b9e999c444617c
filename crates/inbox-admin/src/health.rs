//! Probes and metrics: `/healthz` (the process answers), `/readyz` (PostgreSQL and RabbitMQ
//! answered the last check) and `/metrics` (the Prometheus exporter's text).
//!
//! `/readyz` answers from the latest result of a background check that runs every
//! `readiness_interval` (one query and one short broker connection per check), never from a
//! check of its own: however often it is called, and unauthenticated, it opens no connection.

use std::{sync::Arc, time::Duration};

use axum::{
    Json,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
};
use chrono::Utc;
use rabbit_inbox::broker::Broker;
use serde::Serialize;
use utoipa::ToSchema;

use crate::{
    error::ApiError,
    readiness::{Check, Snapshot},
    server::Server,
    state::BROKER_TIMEOUT,
};

/// The process is up. Needs no token.
#[utoipa::path(get, path = "/healthz", tag = "health",
    responses((status = 200, description = "the process answers", body = String,
        content_type = "text/plain")))]
pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

/// Checks PostgreSQL and RabbitMQ every `interval`, forever (the server aborts it).
pub(crate) async fn monitor(server: Arc<Server>, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let database = tokio::time::timeout(BROKER_TIMEOUT, async {
            sqlx::query("SELECT 1")
                .execute(server.ops.pool())
                .await
                .map(drop)
        });
        let broker = tokio::time::timeout(BROKER_TIMEOUT, async {
            let broker = Broker::connect(&server.amqp_url, "inbox-admin readiness").await?;
            broker.close().await;
            Ok::<(), rabbit_inbox::BrokerError>(())
        });
        let (database, broker) = tokio::join!(database, broker);
        server.readiness.set(Snapshot {
            database: Check::of("PostgreSQL", database),
            broker: Check::of("RabbitMQ", broker),
            checked_at: Some(Utc::now()),
        });
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Readyz {
    #[serde(flatten)]
    snapshot: Snapshot,
    /// The server was started with `--insecure-http` on an address other machines can reach:
    /// tokens and data cross the network in clear text.
    insecure_http: bool,
}

/// PostgreSQL answered a trivial query and RabbitMQ accepted a connection at the last
/// background check (every few seconds); 503 with the failing check otherwise. Also says
/// whether the server runs with `--insecure-http`. Needs no token.
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses((status = 200, description = "both reachable", body = Readyz),
        (status = 503, description = "a dependency is unreachable, or not checked yet",
            body = Readyz)))]
pub(crate) async fn readyz(State(server): State<Arc<Server>>) -> Response {
    let snapshot = server.readiness.latest();
    let code = if snapshot.database.ok && snapshot.broker.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = Readyz {
        snapshot,
        insecure_http: server.insecure_http,
    };
    (code, Json(body)).into_response()
}

/// The Prometheus exposition of this process's metrics.
#[utoipa::path(get, path = "/metrics", tag = "health", security(("bearer" = [])),
    responses((status = 200, description = "Prometheus text format", body = String,
            content_type = "text/plain; version=0.0.4"),
        (status = 503, description = "no metrics recorder in this process")))]
pub(crate) async fn metrics(State(state): State<Arc<Server>>) -> Result<Response, ApiError> {
    let handle = state.metrics.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no Prometheus recorder is installed in this process",
        )
    })?;
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response())
}
