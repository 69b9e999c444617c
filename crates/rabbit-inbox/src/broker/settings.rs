//! What the broker side of a consumer is told of the consumer.

use super::topology::Topology;
use crate::retry::RetryPolicy;

/// What a consumer's session needs to know of the consumer: its name (in connection names and
/// parking headers), its queues, its retry tiers, its prefetch and its publish back-off.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SessionSettings<'a> {
    pub(crate) consumer_name: &'a str,
    pub(crate) topology: &'a Topology,
    pub(crate) retry: &'a RetryPolicy,
    pub(crate) prefetch: u16,
    pub(crate) reconnect_initial_delay: std::time::Duration,
    pub(crate) reconnect_max_delay: std::time::Duration,
}
