//! An outbox row as the AMQP message the relay publishes.

use serde_json::{Map, Value};

use crate::broker::OutgoingMessage;

/// The headers the relay sets from an outbox row's columns.
pub(crate) struct Headers<'a> {
    pub(crate) aggregate_type: Option<&'a str>,
    pub(crate) aggregate_id: Option<&'a str>,
    pub(crate) causation_id: Option<&'a str>,
    pub(crate) traceparent: Option<&'a str>,
    pub(crate) tracestate: Option<&'a str>,
    pub(crate) headers: &'a Map<String, Value>,
}

/// One mapping from outbox columns to AMQP, used when enqueuing (to refuse what could never
/// be published) and when publishing.
pub(crate) fn outgoing(
    message_id: &str,
    message_type: &str,
    message_version: i32,
    h: Headers<'_>,
    correlation_id: Option<&str>,
    payload: &[u8],
) -> OutgoingMessage {
    let mut headers = h.headers.clone();
    headers.insert(
        crate::envelope::VERSION_HEADER.into(),
        message_version.into(),
    );
    let named = [
        (crate::envelope::AGGREGATE_TYPE_HEADER, h.aggregate_type),
        (crate::envelope::AGGREGATE_ID_HEADER, h.aggregate_id),
        (crate::envelope::CAUSATION_HEADER, h.causation_id),
        (crate::envelope::TRACEPARENT_HEADER, h.traceparent),
        ("tracestate", h.tracestate),
    ];
    for (name, value) in named {
        if let Some(v) = value {
            headers.insert(name.into(), v.into());
        }
    }
    OutgoingMessage {
        message_id: Some(message_id.to_owned()),
        kind: Some(message_type.to_owned()),
        correlation_id: correlation_id.map(str::to_owned),
        headers,
        body: payload.to_vec(),
    }
}
