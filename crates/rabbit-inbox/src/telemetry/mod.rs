//! What a running consumer tells the outside: metrics (the catalog in [`metrics`]; the gauges
//! that need the database come from [`crate::InboxSampler`]) and a tracing span per delivery
//! (`trace`).

pub mod metrics;
pub(crate) mod trace;

/// Telemetry settings of a consumer; part of [`crate::ConsumerConfig`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// Message types that get their own `message_type` label. Set it for labels that are the
    /// same on every instance and after restarts.
    pub known_message_types: Vec<String>,
    /// Other message types labelled by name, first seen first; later ones are labelled
    /// `other`. Bounds the label's cardinality whatever producers send. 0: only known types.
    pub max_message_types: usize,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            known_message_types: Vec::new(),
            max_message_types: 20,
        }
    }
}
