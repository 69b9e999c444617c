//! Fault injection for tests and demos (feature `fault-injection`): drop the broker connection
//! after a batch commits and before it is acked, the crash window the inbox exists for.

use std::{collections::HashSet, sync::Mutex};

use crate::processor::{Outcome, Parsed};

/// Faults a [`crate::Consumer`] injects.
#[derive(Debug, Default)]
pub struct FaultPlan {
    drop_after_commit: Mutex<HashSet<String>>,
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
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
