//! Everything that speaks to the broker: AMQP (the only module that imports lapin) and the
//! management HTTP API.
//!
//! - [`addresses`]: [`AmqpAddresses`], the nodes of a cluster, tried in order on every
//!   (re)connect.
//! - [`tls`]: [`AmqpTls`], the CA file and client certificate of `amqps://` connections and of
//!   the management API over HTTPS, carried in the AMQP URL's query.
//! - [`topology`]: declaring the work queue, the retry tiers and the parking queue.
//! - [`publish`]: confirmed publishing: the consumer runtime's own publishing connection,
//!   [`Broker`] (the tool-side connection).
//! - [`session`]: the consumer runtime's connections, its deliveries.
//! - [`settle`]: [`Settler`], the one place that acks or nacks.
//! - [`headers`]: AMQP header tables to and from JSON.
//! - [`frames`]: the size of a content header frame: whether a delivery can be copied whole,
//!   and copies cut to fit in `frame_max`.
//! - [`parking`]: [`ParkingLot`], reading a parking lot and moving parked copies back to the
//!   work queue (redrive).
//! - [`confirmed`]: the outbox relay's link: mandatory publishes, a confirm or a return per
//!   message.
//! - [`management`]: [`ManagementClient`], reading how the broker has a queue declared
//!   (arguments, effective policy) through the management HTTP API; HTTP, not AMQP.
//!
//! Architecture invariant: [`Settler::settle_batch`] is the one function that acks or
//! nacks a delivery, and it takes [`crate::Outcome`]s, which only the processor produces after
//! the outcome is durable. Lapin's `Acker` never leaves this module.

mod addresses;
mod confirmed;
mod frames;
mod headers;
mod management;
mod parking;
mod publish;
mod session;
mod settle;
mod tls;
mod topology;

pub use addresses::AmqpAddresses;
pub(crate) use confirmed::{ConfirmedLink, Publication, PublishResult};
pub use headers::{HEADER_TOO_DEEP, MAX_HEADER_DEPTH, convert_headers, headers_to_json};
pub use management::{
    DEFAULT_MANAGEMENT_PORT, DEFAULT_MANAGEMENT_TLS_PORT, ManagementClient, ManagementError,
    QueueInfo, QueueSetting,
};
pub use parking::{ParkedMessage, ParkingLot, QueueDepth, Republished};
pub(crate) use publish::check_publishable;
pub use publish::{Broker, OutgoingMessage, QueueDepths};
#[cfg(feature = "fault-injection")]
pub(crate) use session::{ConnectionHandle, drop_connection};
pub(crate) use session::{PendingDelivery, Session, is_fatal};
pub(crate) use settle::Settler;
pub use settle::parking_headers;
pub use tls::AmqpTls;

use lapin::Connection;

use crate::error::BrokerError;

/// Opens a connection named `name` to the first reachable of `amqp_url`'s addresses (one URL
/// or several, comma-separated; see [`AmqpAddresses`]).
async fn connect(amqp_url: &str, name: &str) -> Result<Connection, BrokerError> {
    AmqpAddresses::parse(amqp_url)?.connect(name).await
}
