//! A delivery as the broker hands it over: the handle the settler acks it by, and the
//! broker-neutral message the consumer parses.

use std::time::Instant;

use lapin::message::Delivery;

use super::{frames, headers::table_to_json};
use crate::envelope::AmqpMessage;

/// A delivery waiting for its outcome. Holds the acker; only the settler uses it.
pub(crate) struct PendingDelivery {
    pub(super) delivery: Delivery,
    pub(super) received_at: Instant,
    /// Bytes of its content header frame's payload (properties and headers).
    header_len: usize,
    /// The same, without the headers dead-lettering added: what the producer sent.
    producer_header_len: usize,
    /// The connection's `frame_max`.
    frame_max: u32,
}

impl PendingDelivery {
    /// Splits a lapin delivery, received on a connection with `frame_max`, into its broker
    /// handle and a broker-neutral message.
    pub(crate) fn new(mut delivery: Delivery, frame_max: u32) -> (Self, AmqpMessage) {
        // Move the body out first, so it is not copied.
        let body = std::mem::take(&mut delivery.data);
        let mut message = amqp_message(&delivery);
        message.body = body;
        let received_at = Instant::now();
        let header_len = frames::content_header_len(&delivery.properties);
        let producer_header_len = frames::producer_header_len(&delivery.properties);
        (
            Self {
                delivery,
                received_at,
                header_len,
                producer_header_len,
                frame_max,
            },
            message,
        )
    }

    pub(crate) fn tag(&self) -> u64 {
        self.delivery.delivery_tag
    }

    /// The broker's redelivered flag.
    pub(crate) fn redelivered(&self) -> bool {
        self.delivery.redelivered
    }

    /// Bytes of the content header frame's payload (properties and headers) it came with.
    pub(crate) fn header_len(&self) -> usize {
        self.header_len
    }

    /// Why a retry or parking copy of this delivery could not carry all of its headers within
    /// the broker's `frame_max`; `None` when it can.
    pub(crate) fn too_large_to_copy(&self) -> Option<String> {
        frames::too_large_to_copy(self.producer_header_len, self.frame_max)
    }
}

pub(super) fn amqp_message(delivery: &Delivery) -> AmqpMessage {
    let p = &delivery.properties;
    let (headers, headers_truncated) = p.headers().as_ref().map(table_to_json).unwrap_or_default();
    AmqpMessage {
        message_id: p.message_id().as_ref().map(|s| s.as_str().to_owned()),
        kind: p.kind().as_ref().map(|s| s.as_str().to_owned()),
        content_type: p.content_type().as_ref().map(|s| s.as_str().to_owned()),
        correlation_id: p.correlation_id().as_ref().map(|s| s.as_str().to_owned()),
        headers,
        headers_truncated,
        body: delivery.data.clone(),
        redelivered: delivery.redelivered,
    }
}
