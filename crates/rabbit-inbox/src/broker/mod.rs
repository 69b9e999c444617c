//! Everything that speaks AMQP; the only module that imports lapin.
//!
//! Its files, bottom to top (each imports only those before it; this facade re-exports):
//!
//! - `tls`: [`AmqpTls`], the CA file and client certificate of `amqps://` connections (and of
//!   the management API over HTTPS, which the operator crate reads), carried in the AMQP URL's
//!   query; URLs with their password hidden, for error messages.
//! - `addresses`: [`AmqpAddresses`], the nodes of a cluster, tried in order on every
//!   (re)connect; `connect`, which every connection of this module opens through.
//! - `headers`: AMQP header tables to and from JSON.
//! - `frames`: the size of a content header frame: whether a delivery can be copied whole,
//!   and copies cut to fit in `frame_max`.
//! - `topology`: [`Topology`], the queues a consumer uses, and declaring them; [`Exchange`],
//!   an exchange to declare (the outbox relay's destinations).
//! - `delivery`: a delivery as received: the handle the settler acks it by, and the
//!   broker-neutral [`crate::envelope::AmqpMessage`].
//! - `settings`: what a consumer's session is told of the consumer.
//! - `publish`: confirmed publishing: the consumer runtime's own publishing connection,
//!   [`Broker`] (the tool-side connection).
//! - `confirmed`: the outbox relay's link: mandatory publishes, a confirm or a return per
//!   message.
//! - `parking`: [`ParkingLot`], reading a parking lot one copy at a time and moving parked
//!   copies back to the work queue: the AMQP half of the operator crate's redrive.
//! - `settle`: `Settler`, the one place that acks or nacks.
//! - `session`: the consumer runtime's connections, its deliveries.
//!
//! Architecture invariants: `Settler::settle_batch` is the one function that acks or nacks
//! a delivery, and it takes [`crate::Outcome`]s, which only the processor produces after the
//! outcome is durable. Lapin's `Acker` never leaves this module. The broker knows no
//! [`crate::ConsumerConfig`]: a session gets the few settings it needs.

mod addresses;
mod confirmed;
mod delivery;
mod frames;
mod headers;
mod parking;
mod publish;
mod session;
mod settings;
mod settle;
mod tls;
mod topology;

pub use addresses::AmqpAddresses;
pub(crate) use addresses::check_addresses;
pub(crate) use confirmed::{ConfirmedLink, ConnectFailed, Outstanding, Publication, PublishResult};
pub(crate) use delivery::PendingDelivery;
#[cfg(feature = "fuzzing")]
pub use headers::convert_encoded_headers;
pub use parking::{ParkedMessage, ParkingLot, QueueDepth, Republished};
pub(crate) use publish::check_publishable;
pub use publish::{Broker, OutgoingMessage, QueueDepths};
#[cfg(feature = "fault-injection")]
pub(crate) use session::{ConnectionHandle, drop_connection};
pub(crate) use session::{Session, is_fatal};
pub(crate) use settings::SessionSettings;
pub(crate) use settle::Settler;
pub use tls::{AmqpTls, TlsFiles};
pub use topology::{Exchange, ExchangeKind, QueueType, Topology};
