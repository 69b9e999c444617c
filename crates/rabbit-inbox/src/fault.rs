//! Fault injection for tests and demos (feature `fault-injection`): drop the broker connection
//! after a batch commits and before it is acked, the crash window the inbox exists for; or when
//! a given message is received, as a delivery that breaks every session it reaches would; or
//! end the database session between a copy's confirm and its note on the row.

use std::{
    collections::{HashMap, HashSet},
    sync::{Mutex, PoisonError},
};

use crate::{
    processor::Parsed,
    status::{ConfirmedCopy, Outcome},
};

/// Faults a [`crate::Consumer`] injects.
#[derive(Debug, Default)]
pub struct FaultPlan {
    drop_after_commit: Mutex<HashSet<String>>,
    drop_on_receipt: Mutex<HashMap<String, u32>>,
    end_session_before_note: Mutex<HashSet<String>>,
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

    /// End the lane's database session (as a database restart would) after the broker
    /// confirmed the retry or parking copy of `message_id` and before the copy is noted on its
    /// row (once).
    pub fn end_db_session_before_noting_copy_of(&self, message_id: impl Into<String>) {
        self.end_session_before_note
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(message_id.into());
    }

    pub(crate) fn should_end_session_before_note(&self, copies: &[ConfirmedCopy]) -> bool {
        let mut planned = self
            .end_session_before_note
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut fire = false;
        for copy in copies {
            fire |= planned.remove(&copy.message_id);
        }
        fire
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
            if let (Some(e), Outcome::Processed) = (item.valid(), outcome) {
                fire |= planned.remove(&e.message_id);
            }
        }
        fire
    }
}
