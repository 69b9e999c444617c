//! Leased processing, for handlers whose work cannot live inside one database transaction
//! (long work, calls to external systems).
//!
//! ```text
//! claim tx:  row -> PROCESSING, lease_owner = me, lease_expires_at = now() + ttl,
//!            fencing_token + 1 (1 for a new row); commit. The delivery stays unacked.
//! work:      LeasedHandler::work, outside any transaction; a heartbeat extends the lease
//!            every `heartbeat` while it runs. Checkpoints go through Lease::fenced.
//! commit tx: lock the row, check token and owner are still mine, LeasedHandler::commit
//!            (the effect), mark PROCESSED; commit. Then ack.
//! ```
//!
//! A worker that stopped heartbeating (paused, partitioned) for longer than the TTL may be
//! taken over: a redelivery, or recovery's republished copy, claims the row again with a
//! higher token. From then on everything the old worker tries (a heartbeat, a fenced write,
//! its completion, its failure record) is refused with [`LeaseError::Lost`], and its delivery
//! is settled by the row as it then is: acked as a duplicate once the successor has processed
//! it, parked if the row is parked, otherwise sent to the first retry tier like any copy of a
//! message in flight elsewhere, to meet the successor's outcome later. It is never acked as
//! processed on its own say-so.
//!
//! **Invariant:** a PROCESSED row and the effect written in its completion transaction commit
//! together and only under the row's current fencing token; a lease that has not expired is
//! never taken over.

mod config;
mod fencing;
mod handler;
mod processor;
mod sql;

pub use config::LeaseConfig;
pub use fencing::{Lease, LeaseError};
pub use handler::{Leased, LeasedHandler};
pub(crate) use processor::LeasedProcessor;
