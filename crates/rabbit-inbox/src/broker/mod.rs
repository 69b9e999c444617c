//! Everything that speaks AMQP. The only module that imports lapin.
//!
//! - [`topology`]: declaring the work queue, the retry tiers and the parking queue.
//! - [`publish`]: confirmed publishing: the consumer runtime's own publishing connection,
//!   [`Broker`] (the tool-side connection).
//! - [`session`]: the consumer runtime's connections, its deliveries.
//! - [`settle`]: [`Settler`], the one place that acks or nacks.
//! - [`headers`]: AMQP header tables to and from JSON.
//!
//! Architecture invariant: [`Settler::settle_batch`] is the one function that acks or
//! nacks a delivery, and it takes [`crate::Outcome`]s, which only the processor produces after
//! the outcome is durable. Lapin's `Acker` never leaves this module.

mod headers;
mod publish;
mod session;
mod settle;
mod topology;

pub use headers::{HEADER_TOO_DEEP, MAX_HEADER_DEPTH, convert_headers, headers_to_json};
pub use publish::{Broker, OutgoingMessage, QueueDepths};
#[cfg(feature = "fault-injection")]
pub(crate) use session::{ConnectionHandle, drop_connection};
pub(crate) use session::{PendingDelivery, Session, is_fatal};
pub(crate) use settle::Settler;
pub use settle::parking_headers;

use lapin::{Connection, ConnectionProperties};

use crate::error::BrokerError;

async fn connect(amqp_url: &str, name: &str) -> Result<Connection, BrokerError> {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    Ok(Connection::connect(amqp_url, props).await?)
}
