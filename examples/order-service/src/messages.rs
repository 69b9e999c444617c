//! Builders for the service's messages, as a producer would publish them.

use rabbit_inbox::{
    broker::OutgoingMessage, envelope::AGGREGATE_ID_HEADER, envelope::AGGREGATE_TYPE_HEADER,
    envelope::VERSION_HEADER,
};
use serde_json::{Map, Value, json};

use crate::SEQUENCE_HEADER;

/// Routing key of each message type on the `orders` exchange.
pub fn routing_key(message_type: &str) -> &'static str {
    match message_type {
        "OrderPlaced" => "order.placed",
        "PaymentReceived" => "order.payment-received",
        "OrderCancelled" => "order.cancelled",
        "OrderStep" => "order.step",
        _ => "order.other",
    }
}

fn message(message_id: &str, message_type: &str, order_id: &str, body: Value) -> OutgoingMessage {
    let mut headers = Map::new();
    headers.insert(AGGREGATE_TYPE_HEADER.into(), "Order".into());
    headers.insert(AGGREGATE_ID_HEADER.into(), order_id.into());
    headers.insert(VERSION_HEADER.into(), 1.into());
    OutgoingMessage {
        message_id: Some(message_id.to_owned()),
        kind: Some(message_type.to_owned()),
        correlation_id: Some(order_id.to_owned()),
        headers,
        body: body.to_string().into_bytes(),
    }
}

/// `OrderPlaced{order_id, customer_id, total}`; `total` in cents.
pub fn order_placed(
    message_id: &str,
    order_id: &str,
    customer_id: &str,
    total: i64,
) -> OutgoingMessage {
    message(
        message_id,
        "OrderPlaced",
        order_id,
        json!({"order_id": order_id, "customer_id": customer_id, "total": total}),
    )
}

/// `PaymentReceived{order_id, amount}`; `amount` in cents.
pub fn payment_received(message_id: &str, order_id: &str, amount: i64) -> OutgoingMessage {
    message(
        message_id,
        "PaymentReceived",
        order_id,
        json!({"order_id": order_id, "amount": amount}),
    )
}

/// `OrderCancelled{order_id}`.
pub fn order_cancelled(message_id: &str, order_id: &str) -> OutgoingMessage {
    message(
        message_id,
        "OrderCancelled",
        order_id,
        json!({"order_id": order_id}),
    )
}

/// `OrderStep{order_id, step}`: step `step` of an order's fulfilment, with `step` also in the
/// [`SEQUENCE_HEADER`] header, so an ordered consumer runs an order's steps in their order.
pub fn order_step(message_id: &str, order_id: &str, step: i64) -> OutgoingMessage {
    let mut m = message(
        message_id,
        "OrderStep",
        order_id,
        json!({"order_id": order_id, "step": step}),
    );
    m.headers.insert(SEQUENCE_HEADER.into(), step.into());
    m
}
