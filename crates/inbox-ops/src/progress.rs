//! How a long operation reports its progress as it goes.

/// Progress of a long operation, reported as it goes (a progress bar in the CLI, nothing in
/// the HTTP API).
pub trait Progress: Send + Sync {
    /// The total is known (or has changed).
    fn set_total(&self, _total: u64) {}
    /// `n` more items are done.
    fn advance(&self, _n: u64) {}
}

/// Reports nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoProgress;

impl Progress for NoProgress {}
