//! Everything that speaks AMQP; the only module that imports lapin.
//!
//! - `addresses`: [`AmqpAddresses`], the nodes of a cluster, tried in order on every
//!   (re)connect.
//! - `tls`: [`AmqpTls`], the CA file and client certificate of `amqps://` connections (and of
//!   the management API over HTTPS, which the operator crate reads), carried in the AMQP URL's
//!   query.
//! - `topology`: [`Topology`], the queues a consumer uses, and declaring them; [`Exchange`],
//!   an exchange to declare (the outbox relay's destinations).
//! - `publish`: confirmed publishing: the consumer runtime's own publishing connection,
//!   [`Broker`] (the tool-side connection).
//! - `session`: the consumer runtime's connections, its deliveries.
//! - `settle`: `Settler`, the one place that acks or nacks.
//! - `headers`: AMQP header tables to and from JSON.
//! - `frames`: the size of a content header frame: whether a delivery can be copied whole,
//!   and copies cut to fit in `frame_max`.
//! - `parking`: [`ParkingLot`], reading a parking lot one copy at a time and moving parked
//!   copies back to the work queue: the AMQP half of the operator crate's redrive.
//! - `confirmed`: the outbox relay's link: mandatory publishes, a confirm or a return per
//!   message.
//!
//! Architecture invariants: `Settler::settle_batch` is the one function that acks or nacks
//! a delivery, and it takes [`crate::Outcome`]s, which only the processor produces after the
//! outcome is durable. Lapin's `Acker` never leaves this module. The broker knows no
//! [`crate::ConsumerConfig`]: a session gets the few settings it needs.

mod addresses;
mod confirmed;
mod frames;
mod headers;
mod parking;
mod publish;
mod session;
mod settle;
mod tls;
mod topology;

pub use addresses::AmqpAddresses;
pub(crate) use addresses::check_addresses;
pub(crate) use confirmed::{ConfirmedLink, ConnectFailed, Outstanding, Publication, PublishResult};
pub use headers::convert_encoded_headers;
pub use parking::{ParkedMessage, ParkingLot, QueueDepth, Republished};
pub(crate) use publish::check_publishable;
pub use publish::{Broker, OutgoingMessage, QueueDepths};
#[cfg(feature = "fault-injection")]
pub(crate) use session::{ConnectionHandle, drop_connection};
pub(crate) use session::{PendingDelivery, Session, SessionSettings, is_fatal};
pub(crate) use settle::Settler;
pub use tls::{AmqpTls, TlsFiles};
pub use topology::{Exchange, ExchangeKind, QueueType, Topology};

use lapin::Connection;

use crate::error::BrokerError;

/// Opens a connection named `name` to the first reachable of `amqp_url`'s addresses (one URL
/// or several, comma-separated; see [`AmqpAddresses`]).
async fn connect(amqp_url: &str, name: &str) -> Result<Connection, BrokerError> {
    AmqpAddresses::parse(amqp_url)?.connect(name).await
}
