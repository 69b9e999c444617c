//! What a running consumer tells the outside: metrics (the catalog in [`metrics`]; the gauges
//! that need the database come from [`crate::InboxSampler`]) and a tracing span per delivery
//! (`trace`).

mod config;
pub(crate) mod failure_log;
pub mod metrics;
pub(crate) mod trace;

pub use config::TelemetryConfig;
