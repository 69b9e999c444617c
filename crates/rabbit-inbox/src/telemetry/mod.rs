//! What a running consumer tells the outside: metrics (the catalog in [`metrics`], gauges from
//! the database by [`InboxSampler`] and the consumer's own sampler) and a tracing span per delivery ([`trace`]).

pub mod metrics;
pub(crate) mod sampler;
pub(crate) mod trace;

pub use sampler::InboxSampler;

use std::time::Duration;

/// Telemetry settings of a consumer; part of [`crate::ConsumerConfig`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TelemetryConfig {
    /// Message types that get their own `message_type` label. Set it for labels that are the
    /// same on every instance and after restarts.
    pub known_message_types: Vec<String>,
    /// Other message types labelled by name, first seen first; later ones are labelled
    /// `other`. Bounds the label's cardinality whatever producers send. 0: only known types.
    pub max_message_types: usize,
    /// How often the consumer samples the inbox for the gauges (oldest unprocessed age, open
    /// and parked rows, dedup-window headroom): one query per tick over the index of open
    /// rows. `None` (the default): no sampling.
    pub sample_interval: Option<Duration>,
    /// The longest time after which a message may be delivered again (DLQ replays, outbox
    /// republishes, backfills). With it, the sampler reports how far the retained PROCESSED
    /// history reaches beyond it (`rabbit_inbox_dedup_window_headroom_seconds`).
    pub replay_window: Option<Duration>,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            known_message_types: Vec::new(),
            max_message_types: 20,
            sample_interval: None,
            replay_window: None,
        }
    }
}
