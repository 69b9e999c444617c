//! `GET /api/v1/depths`, the console's depth chart: the queues' depths over the last day from
//! the server's [`DepthHistory`](crate::depth_history::DepthHistory), which its sampler fills
//! every [`SAMPLE_INTERVAL`] while the server runs.

use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use axum::{Json, extract::State};
use chrono::Utc;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::{
    depth_history::{DepthSample, FRESH, KEEP, SAMPLE_INTERVAL},
    error::{ApiError, Params},
    request::{duration, given},
    server::Server,
};

/// Samples the depths every [`SAMPLE_INTERVAL`] until the server is gone (or at once returns
/// when it has no queues to sample).
pub(crate) async fn sampler(server: Weak<Server>) {
    loop {
        {
            let Some(server) = server.upgrade() else {
                return;
            };
            let Some((topology, retry)) = &server.queues else {
                return;
            };
            // Less than an interval: a sample a page asked for a moment ago is not repeated.
            server
                .depths
                .sample_unless_fresh(
                    &server.amqp_url,
                    server.management_url.as_deref(),
                    topology,
                    retry,
                    FRESH,
                )
                .await;
        }
        tokio::time::sleep(SAMPLE_INTERVAL).await;
    }
}

/// Query of `GET /api/v1/depths`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct DepthParams {
    /// How far back (default `1h`, at most `24h`).
    window: Option<String>,
}

/// What `GET /api/v1/depths` returns.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct DepthsResponse {
    /// The queues sampled; `null` when the server was not given the consumer's queues.
    queues: Option<SampledQueues>,
    /// Seconds between the server's own samples.
    interval_secs: u64,
    /// Oldest first; a sample without figures is one the broker did not answer.
    samples: Vec<DepthSample>,
}

/// The queues whose depths are sampled.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct SampledQueues {
    /// The work queue.
    work: String,
    /// The retry tiers, whose depths are summed.
    retry: Vec<String>,
    /// The parking lot.
    parking: String,
}

/// The work queue's ready and unacked messages and consumers, the retry tiers' messages
/// (summed) and the parking lot's over time: through the management API (else ready counts
/// through AMQP), sampled by the server every 15 s (and when read, if the newest sample is
/// older than a few seconds) and kept for a day.
#[utoipa::path(get, path = "/api/v1/depths", tag = "inspection", params(DepthParams),
    security(("bearer" = [])),
    responses((status = 200, description = "the queues and their samples", body = DepthsResponse),
        (status = 400, description = "bad window")))]
pub(crate) async fn depths(
    State(state): State<Arc<Server>>,
    Params(p): Params<DepthParams>,
) -> Result<Json<DepthsResponse>, ApiError> {
    let window = match given(&p.window) {
        Some(w) => duration("window", w)?,
        None => Duration::from_secs(3600),
    };
    if window > KEEP || window.is_zero() {
        return Err(ApiError::bad_request(
            "window: between 1s and 24h (the server keeps a day of samples)",
        ));
    }
    let Some((topology, retry)) = &state.queues else {
        return Ok(Json(DepthsResponse {
            queues: None,
            interval_secs: SAMPLE_INTERVAL.as_secs(),
            samples: Vec::new(),
        }));
    };
    state
        .depths
        .sample_unless_fresh(
            &state.amqp_url,
            state.management_url.as_deref(),
            topology,
            retry,
            FRESH,
        )
        .await;
    Ok(Json(DepthsResponse {
        queues: Some(SampledQueues {
            work: topology.queue.clone(),
            retry: topology.retry_tier_queues(retry),
            parking: topology.parking_queue.clone(),
        }),
        interval_secs: SAMPLE_INTERVAL.as_secs(),
        samples: state.depths.recent(Utc::now(), window),
    }))
}
