//! A doubling delay after consecutive failures, reset after a success: what the runtime waits
//! before reconnecting, before requeueing what the database could not record, and before
//! requeueing copies the broker refused, and before noting confirmed copies again, so that
//! no failure becomes a hot loop.

use std::{
    sync::{Mutex, PoisonError},
    time::Duration,
};

/// Doubles from `initial` up to `max` on each failure; back to `initial` on success. Shared by
/// reference (lanes settle through one settler), hence the lock.
#[derive(Debug)]
pub(crate) struct Backoff {
    initial: Duration,
    max: Duration,
    next: Mutex<Duration>,
}

impl Backoff {
    pub(crate) fn new(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            next: Mutex::new(initial),
        }
    }

    /// The delay to wait now; the next one doubles.
    pub(crate) fn failed(&self) -> Duration {
        let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        let now = *next;
        *next = (now * 2).min(self.max);
        now
    }

    /// Back to the initial delay.
    pub(crate) fn succeeded(&self) {
        *self.next.lock().unwrap_or_else(PoisonError::into_inner) = self.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_max_and_resets() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        assert_eq!(b.failed(), Duration::from_millis(100));
        assert_eq!(b.failed(), Duration::from_millis(200));
        assert_eq!(b.failed(), Duration::from_millis(350));
        assert_eq!(b.failed(), Duration::from_millis(350));
        b.succeeded();
        assert_eq!(b.failed(), Duration::from_millis(100));
    }
}
