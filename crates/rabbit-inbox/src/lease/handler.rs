//! What application code implements in leased mode.

use std::{future::Future, marker::PhantomData};

use sqlx::PgConnection;

use super::fencing::Lease;
use crate::handler::{HandlerError, InboxMessage};

/// The type parameter of a [`crate::Consumer`] in leased mode.
#[derive(Debug)]
pub struct Leased<L>(PhantomData<L>);

/// Application logic in leased mode: long work outside any transaction, then the effect in a
/// short transaction that commits only while the lease is still this worker's.
///
/// The work may run again (after a crash, or when a paused worker's lease was taken over), so
/// external calls in it must be idempotent: use [`InboxMessage::idempotency_key`], and pass
/// [`Lease::token`] to systems that can refuse stale writers. The effect belongs in
/// [`LeasedHandler::commit`]: it commits together with PROCESSED, once.
///
/// ```no_run
/// use rabbit_inbox::{HandlerError, InboxMessage, Lease, LeasedHandler};
/// use sqlx::PgConnection;
///
/// struct Render;
///
/// impl LeasedHandler for Render {
///     type Output = String;
///
///     async fn work(&self, msg: &InboxMessage<'_>, lease: &Lease) -> Result<String, HandlerError> {
///         // A slow external call, keyed by msg.idempotency_key(), fenced by lease.token().
///         Ok(format!("document {} (token {})", msg.message_id(), lease.token()))
///     }
///
///     async fn commit(
///         &self,
///         msg: &InboxMessage<'_>,
///         doc: String,
///         tx: &mut PgConnection,
///     ) -> Result<(), HandlerError> {
///         sqlx::query("INSERT INTO documents (id, body) VALUES ($1, $2)")
///             .bind(msg.message_id())
///             .bind(doc)
///             .execute(&mut *tx)
///             .await?;
///         Ok(())
///     }
/// }
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let config = rabbit_inbox::ConsumerConfig::new("renderer", rabbit_inbox::Topology::new("renders"));
/// let lease = rabbit_inbox::LeaseConfig::new(std::time::Duration::from_secs(60));
/// let consumer = rabbit_inbox::Consumer::leased("amqp://127.0.0.1", pool, config, lease, Render)?;
/// consumer.run(rabbit_inbox::shutdown_signal()).await?;
/// # Ok(()) }
/// ```
pub trait LeasedHandler: Send + Sync + 'static {
    /// What the work hands to the commit.
    type Output: Send;

    /// The long part, outside any transaction, while the consumer heartbeats the lease.
    /// Intermediate database writes go through [`Lease::fenced`]; return `Err` to record a
    /// failure (retryable ones go through the retry tiers as in the transactional mode).
    fn work(
        &self,
        msg: &InboxMessage<'_>,
        lease: &Lease,
    ) -> impl Future<Output = Result<Self::Output, HandlerError>> + Send;

    /// The effect, in the completion transaction: the row is locked and the lease checked
    /// before this runs, and PROCESSED is written after it in the same transaction.
    fn commit(
        &self,
        msg: &InboxMessage<'_>,
        output: Self::Output,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}
