//! Fault injection for tests (feature `fault-injection`): kill a redrive at a chosen step, as
//! a killed process would stop it.

use std::sync::Mutex;

/// A point inside one move of `redrive` where a planned kill stops it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RedriveStep {
    /// The row's reopen and audit record are written, not committed.
    BeforeCommit,
    /// The reopen is committed; the copy is not yet published to the work queue.
    AfterCommit,
    /// The broker confirmed the copy in the work queue; the parked copy is not yet acked.
    AfterConfirm,
}

/// Kills [`crate::Operations::redrive`] at a [`RedriveStep`]: the pass stops there for
/// good, as a killed process would (drop its future and close its parking-lot connection: the
/// transaction rolls back, held copies return to the parking lot).
#[derive(Debug, Default)]
pub struct RedriveFaults {
    planned: Mutex<Option<RedriveStep>>,
    /// The inbox key of the message the pass stopped at.
    killed: Mutex<Option<String>>,
    reached: tokio::sync::Notify,
}

impl RedriveFaults {
    /// The next move stops dead at `step` (once).
    pub fn kill_at(&self, step: RedriveStep) {
        *lock(&self.planned) = Some(step);
    }

    /// Waits until a planned kill stopped a pass; returns the inbox key of the message being
    /// moved then.
    pub async fn killed(&self) -> Option<String> {
        self.reached.notified().await;
        lock(&self.killed).take()
    }

    /// Stops here forever if a kill is planned at `step`.
    pub(crate) async fn at(&self, step: RedriveStep, message_id: Option<&str>) {
        {
            let mut planned = lock(&self.planned);
            if *planned != Some(step) {
                return;
            }
            *planned = None;
        }
        *lock(&self.killed) = message_id.map(str::to_owned);
        self.reached.notify_one();
        std::future::pending::<()>().await;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
