//! Ordered processing: per-key order through retries, parking and sequence gaps (opt-in per
//! consumer, [`OrderingPolicy`]).
//!
//! - `policy`: what a consumer orders by (pure).
//! - `gate`: the decision per batch: run, hold, still held, or refuse (pure).
//! - `ledger`: the per-key rows the decision reads and writes, under the keys' locks.
//!
//! The batch transaction locks the batch's ordered keys before its claim, reads their state,
//! lets `gate` decide, records HELD rows (with their bodies) and runs the rest; a failure
//! blocks its key behind it. Held rows are released by the operator crate's release task,
//! which publishes them again, one at a time and in order, once their key is free: a released
//! copy is an ordinary delivery, so its claim, transaction, retry and parking are the same.

mod gate;
mod ledger;
mod policy;

pub(crate) use gate::{Arrival, Candidate, Decision, decide};
pub use ledger::key_lock;
pub(crate) use ledger::{KeyAdvance, KeyNote, OrderLedger};
pub use policy::{GapPolicy, MAX_ORDER_KEY_BYTES, OrderKey, OrderingPolicy, SequencePolicy};
