//! What a consumer is told about its telemetry.

/// Telemetry settings of a consumer; part of [`crate::ConsumerConfig`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// Message types that get their own `message_type` label. Set it for labels that are the
    /// same on every instance and after restarts.
    pub known_message_types: Vec<String>,
    /// Other message types labelled by name, first seen first; later ones are labelled
    /// `other`. Bounds the label's cardinality whatever producers send. 0: only known types.
    pub max_message_types: usize,
    /// The level of the line logged for each scheduled retry (message id, type, code, safe
    /// detail, attempt, retry queue). Parked and poisoned messages are always logged at WARN.
    pub retry_log_level: tracing::Level,
    /// Failed-message lines (parked and retries together) logged per consumer per minute; past
    /// it, one summary line a minute gives the counts. 0: summaries only.
    pub failure_log_per_minute: u32,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            known_message_types: Vec::new(),
            max_message_types: 20,
            retry_log_level: tracing::Level::INFO,
            failure_log_per_minute: 30,
        }
    }
}
