//! Fault injection for tests and demos (feature `fault-injection`): drop the broker connection
//! after a batch commits and before it is acked, the crash window the inbox exists for; or when
//! a given message is received, as a delivery that breaks every session it reaches would.

use std::{
    collections::{HashMap, HashSet},
    sync::{Mutex, PoisonError},
};

use crate::processor::{Outcome, Parsed};

/// Faults a [`crate::Consumer`] injects.
#[derive(Debug, Default)]
pub struct FaultPlan {
    drop_after_commit: Mutex<HashSet<String>>,
    drop_on_receipt: Mutex<HashMap<String, u32>>,
}

impl FaultPlan {
    /// After the transaction that processes `message_id` commits, close the connection before
    /// acking (once).
    pub fn drop_connection_after_commit_of(&self, message_id: impl Into<String>) {
        self.lock().insert(message_id.into());
    }

    /// Whether a planned drop is still pending.
    pub fn pending(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.drop_after_commit
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Close the connection as soon as a delivery with inbox key `message_id` is received, the
    /// next `times` times it is (the delivery is then processed on a closed connection, and
    /// comes back).
    pub fn drop_connection_on_receipt_of(&self, message_id: impl Into<String>, times: u32) {
        self.drop_on_receipt
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(message_id.into(), times);
    }

    pub(crate) fn should_drop_on_receipt(&self, message_id: &str) -> bool {
        let mut planned = self
            .drop_on_receipt
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match planned.get_mut(message_id) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }

    pub(crate) fn should_drop_after_commit(&self, parsed: &[Parsed], outcomes: &[Outcome]) -> bool {
        let mut planned = self.lock();
        let mut fire = false;
        for (item, outcome) in parsed.iter().zip(outcomes) {
            if let (Ok(e), Outcome::Processed) = (item, outcome) {
                fire |= planned.remove(&e.message_id);
            }
        }
        fire
    }
}

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

/// Kills [`crate::ops::Operations::redrive`] at a [`RedriveStep`]: the pass stops there for
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
