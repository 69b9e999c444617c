//! Probes and metrics: `/healthz` (the process answers), `/readyz` (PostgreSQL and RabbitMQ
//! answer within a short timeout) and `/metrics` (the Prometheus exporter's text).

use std::sync::Arc;

use axum::{
    Json,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
};
use rabbit_inbox::Broker;
use serde::Serialize;

use crate::{AdminState, BROKER_TIMEOUT, error::ApiError};

/// The process is up. Needs no token.
#[utoipa::path(get, path = "/healthz", tag = "health",
    responses((status = 200, description = "the process answers")))]
pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

/// One dependency's check.
#[derive(Debug, Serialize)]
struct Check {
    ok: bool,
    error: Option<String>,
}

impl Check {
    fn of<E: std::fmt::Display>(
        result: Result<Result<(), E>, tokio::time::error::Elapsed>,
    ) -> Self {
        let error = match result {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {BROKER_TIMEOUT:?}")),
        };
        Self {
            ok: error.is_none(),
            error,
        }
    }
}

#[derive(Debug, Serialize)]
struct Readiness {
    database: Check,
    broker: Check,
}

/// PostgreSQL answers a trivial query and RabbitMQ accepts a connection, each within a short
/// timeout; 503 with the failing check otherwise. Needs no token.
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses((status = 200, description = "both reachable"),
        (status = 503, description = "a dependency is unreachable")))]
pub(crate) async fn readyz(State(state): State<Arc<AdminState>>) -> Response {
    let database = tokio::time::timeout(BROKER_TIMEOUT, async {
        sqlx::query("SELECT 1")
            .execute(state.ops.pool())
            .await
            .map(drop)
    });
    let broker = tokio::time::timeout(BROKER_TIMEOUT, async {
        let broker = Broker::connect(&state.amqp_url, "inbox-admin readiness").await?;
        broker.close().await;
        Ok::<(), rabbit_inbox::BrokerError>(())
    });
    let (database, broker) = tokio::join!(database, broker);
    let readiness = Readiness {
        database: Check::of(database),
        broker: Check::of(broker),
    };
    let code = if readiness.database.ok && readiness.broker.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(readiness)).into_response()
}

/// The Prometheus exposition of this process's metrics.
#[utoipa::path(get, path = "/metrics", tag = "health", security(("bearer" = [])),
    responses((status = 200, description = "Prometheus text format"),
        (status = 503, description = "no metrics recorder in this process")))]
pub(crate) async fn metrics(State(state): State<Arc<AdminState>>) -> Result<Response, ApiError> {
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
