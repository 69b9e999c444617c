//! What the server serves: the operator's [`AdminState`] (the inbox's operations, the broker,
//! the tokens), and how long the server waits for the broker.

use std::time::Duration;

use inbox_ops::Operations;
use metrics_exporter_prometheus::PrometheusHandle;
use rabbit_inbox::{RetryPolicy, Topology};

use crate::auth::Tokens;

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
