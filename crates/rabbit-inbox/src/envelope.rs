//! The typed envelope a handler sees, parsed from a broker-neutral [`AmqpMessage`].
//!
//! Parsing never fails silently: a delivery without a usable key, with a body that is not JSON,
//! too large, or of an unsupported version becomes an [`InvalidMessage`] that the consumer
//! records and parks. It is never processed without dedup and never dropped.

use std::ops::RangeInclusive;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::dedup::{DedupStrategy, KeyError};

/// Header carrying the message version (integer, or a string holding one). Absent means 1.
pub const VERSION_HEADER: &str = "x-message-version";
/// Header carrying the message type when the AMQP `type` property is not set.
pub const TYPE_HEADER: &str = "x-message-type";
/// Header naming the aggregate type (e.g. `Order`).
pub const AGGREGATE_TYPE_HEADER: &str = "x-aggregate-type";
/// Header naming the aggregate id; also the lane key that keeps one aggregate in order.
pub const AGGREGATE_ID_HEADER: &str = "x-aggregate-id";
/// Header carrying the id of the message that caused this one.
pub const CAUSATION_HEADER: &str = "x-causation-id";
/// Header carrying the tenant.
pub const TENANT_HEADER: &str = "x-tenant-id";
/// W3C trace context header.
pub const TRACEPARENT_HEADER: &str = "traceparent";

/// A delivery as the broker handed it over, without broker handles. The consumer builds it from
/// the AMQP delivery; tests and fuzzers can build it directly.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AmqpMessage {
    /// The AMQP `message-id` property.
    pub message_id: Option<String>,
    /// The AMQP `type` property.
    pub kind: Option<String>,
    /// The AMQP `content-type` property.
    pub content_type: Option<String>,
    /// The AMQP `correlation-id` property.
    pub correlation_id: Option<String>,
    /// Application headers, converted to JSON.
    pub headers: Map<String, Value>,
    /// Why `headers` are incomplete: a value nested deeper than [`crate::MAX_HEADER_DEPTH`]
    /// was replaced by [`crate::HEADER_TOO_DEEP`]. Such a message is invalid.
    pub headers_truncated: Option<String>,
    /// The raw body.
    pub body: Vec<u8>,
    /// The broker's redelivered flag.
    pub redelivered: bool,
}

/// What a consumer accepts; part of [`crate::ConsumerConfig`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvelopeRules {
    /// Where the dedup key comes from.
    pub dedup: DedupStrategy,
    /// Largest accepted body, in bytes.
    pub max_payload_bytes: usize,
    /// Message versions this consumer understands.
    pub supported_versions: RangeInclusive<i32>,
}

impl Default for EnvelopeRules {
    fn default() -> Self {
        Self {
            dedup: DedupStrategy::MessageId,
            max_payload_bytes: 1024 * 1024,
            supported_versions: 1..=1,
        }
    }
}

/// A parsed message. Immutable for handlers.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    /// The dedup key (stored as `message_id` in the inbox).
    pub message_id: String,
    /// Message type: the AMQP `type` property, else `x-message-type`, Spring's `__TypeId__`,
    /// or the CloudEvents type; `unknown` when none is set.
    pub message_type: String,
    /// Message version from `x-message-version`, 1 when absent.
    pub message_version: i32,
    /// Aggregate type from `x-aggregate-type`.
    pub aggregate_type: Option<String>,
    /// Aggregate id from `x-aggregate-id`.
    pub aggregate_id: Option<String>,
    /// The AMQP `correlation-id` property.
    pub correlation_id: Option<String>,
    /// `x-causation-id`.
    pub causation_id: Option<String>,
    /// W3C `traceparent`.
    pub traceparent: Option<String>,
    /// `x-tenant-id`.
    pub tenant_id: Option<String>,
    /// All application headers as JSON.
    pub headers: Map<String, Value>,
    /// The body parsed as JSON (`Null` for an invalid message).
    pub payload: Value,
    /// The raw body.
    pub body: Vec<u8>,
    /// SHA-256 of the raw body.
    pub payload_sha256: [u8; 32],
    /// The broker's redelivered flag. Not an error: redelivery is normal.
    pub redelivered: bool,
    /// How many times the broker dead-lettered this message (sum of `x-death` counts).
    pub death_count: u64,
}

impl Envelope {
    /// Key used to keep one aggregate's messages in order: the aggregate id, else the dedup key.
    pub fn lane_key(&self) -> &str {
        self.aggregate_id.as_deref().unwrap_or(&self.message_id)
    }
}

/// Why a delivery was refused before any handler saw it. All are permanent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InvalidReason {
    /// No dedup key could be found.
    MissingMessageId,
    /// The dedup key is longer than [`crate::dedup::MAX_KEY_LEN`].
    MessageIdTooLong,
    /// The dedup key is empty, has control characters or the wrong type.
    MalformedMessageId,
    /// The body exceeds `max_payload_bytes`.
    PayloadTooLarge,
    /// The body is not valid JSON (or not UTF-8).
    InvalidJson,
    /// The version header is not an integer.
    MalformedVersion,
    /// The version is outside the supported range.
    UnsupportedVersion,
    /// A header nests field tables or arrays deeper than [`crate::MAX_HEADER_DEPTH`].
    HeadersTooDeep,
}

impl InvalidReason {
    /// Stable code stored in `last_error_code` and in the parking-lot headers.
    pub fn code(self) -> &'static str {
        match self {
            InvalidReason::MissingMessageId => "missing_message_id",
            InvalidReason::MessageIdTooLong => "message_id_too_long",
            InvalidReason::MalformedMessageId => "malformed_message_id",
            InvalidReason::PayloadTooLarge => "payload_too_large",
            InvalidReason::InvalidJson => "invalid_json",
            InvalidReason::MalformedVersion => "malformed_version",
            InvalidReason::UnsupportedVersion => "unsupported_version",
            InvalidReason::HeadersTooDeep => "headers_too_deep",
        }
    }
}

/// A delivery that cannot be processed. `envelope` holds what could be read, under a synthetic
/// key (`invalid:<sha256>`) when the message had no usable one, so that it can be recorded.
#[derive(Clone, Debug, PartialEq)]
pub struct InvalidMessage {
    /// The reason, as a stable code.
    pub reason: InvalidReason,
    /// A human-readable explanation.
    pub detail: String,
    /// Best-effort envelope used to record the failure.
    pub envelope: Envelope,
}

/// Parses `msg` under `rules`.
pub fn parse(msg: AmqpMessage, rules: &EnvelopeRules) -> Result<Envelope, Box<InvalidMessage>> {
    let payload_sha256: [u8; 32] = Sha256::digest(&msg.body).into();
    let mut envelope = Envelope {
        message_id: String::new(),
        message_type: message_type(&msg),
        message_version: 1,
        aggregate_type: header_text(&msg.headers, AGGREGATE_TYPE_HEADER),
        aggregate_id: header_text(&msg.headers, AGGREGATE_ID_HEADER),
        correlation_id: msg.correlation_id.clone(),
        causation_id: header_text(&msg.headers, CAUSATION_HEADER),
        traceparent: header_text(&msg.headers, TRACEPARENT_HEADER),
        tenant_id: header_text(&msg.headers, TENANT_HEADER),
        death_count: death_count(&msg.headers),
        headers: msg.headers,
        payload: Value::Null,
        body: msg.body,
        payload_sha256,
        redelivered: msg.redelivered,
    };

    let invalid = |mut envelope: Envelope, reason: InvalidReason, detail: String| {
        // Identity for recording: hash of the original id (if any) and the body, so one bad
        // message maps to one inbox row however often it is redelivered.
        let mut hasher = Sha256::new();
        if let Some(id) = &msg.message_id {
            hasher.update(id.as_bytes());
            let shown: String = id.chars().take(512).collect();
            envelope
                .headers
                .insert("x-inbox-original-message-id".into(), Value::String(shown));
        }
        hasher.update([0u8]);
        hasher.update(&envelope.body);
        envelope.message_id = format!("invalid:{}", hex::encode(hasher.finalize()));
        Box::new(InvalidMessage {
            reason,
            detail,
            envelope,
        })
    };

    if envelope.body.len() > rules.max_payload_bytes {
        let detail = format!(
            "body is {} bytes, the limit is {}",
            envelope.body.len(),
            rules.max_payload_bytes
        );
        return Err(invalid(envelope, InvalidReason::PayloadTooLarge, detail));
    }

    // Incomplete headers: nothing read from them (key, version, aggregate) can be trusted.
    if let Some(detail) = &msg.headers_truncated {
        return Err(invalid(
            envelope,
            InvalidReason::HeadersTooDeep,
            detail.clone(),
        ));
    }

    let payload: Option<Value> = serde_json::from_slice(&envelope.body).ok();
    let key = rules.dedup.extract(
        msg.message_id.as_deref(),
        &envelope.headers,
        msg.content_type.as_deref(),
        payload.as_ref(),
    );
    match key {
        Ok(key) => envelope.message_id = key,
        Err(KeyError::Missing(d)) => {
            return Err(invalid(envelope, InvalidReason::MissingMessageId, d));
        }
        Err(KeyError::TooLong(len)) => {
            let detail = format!(
                "the id is {len} bytes, the limit is {}",
                crate::dedup::MAX_KEY_LEN
            );
            return Err(invalid(envelope, InvalidReason::MessageIdTooLong, detail));
        }
        Err(KeyError::Malformed(d)) => {
            return Err(invalid(envelope, InvalidReason::MalformedMessageId, d));
        }
    }

    match version(&envelope.headers) {
        Ok(v) if rules.supported_versions.contains(&v) => envelope.message_version = v,
        Ok(v) => {
            envelope.message_version = v;
            let detail = format!(
                "version {v} is not supported (supported: {}..={})",
                rules.supported_versions.start(),
                rules.supported_versions.end()
            );
            return Err(keep_key(
                envelope,
                InvalidReason::UnsupportedVersion,
                detail,
            ));
        }
        Err(detail) => {
            return Err(keep_key(envelope, InvalidReason::MalformedVersion, detail));
        }
    }

    match payload {
        Some(payload) => {
            envelope.payload = payload;
            Ok(envelope)
        }
        None => {
            let detail = match serde_json::from_slice::<Value>(&envelope.body) {
                Err(e) => format!("body is not valid JSON: {e}"),
                Ok(_) => "body is not valid JSON".into(),
            };
            Err(keep_key(envelope, InvalidReason::InvalidJson, detail))
        }
    }
}

/// An invalid message whose key is usable keeps it, so a redelivery maps to the same row.
fn keep_key(envelope: Envelope, reason: InvalidReason, detail: String) -> Box<InvalidMessage> {
    Box::new(InvalidMessage {
        reason,
        detail,
        envelope,
    })
}

fn message_type(msg: &AmqpMessage) -> String {
    msg.kind
        .clone()
        .filter(|k| !k.is_empty())
        .or_else(|| header_text(&msg.headers, TYPE_HEADER))
        .or_else(|| header_text(&msg.headers, "__TypeId__"))
        .or_else(|| header_text(&msg.headers, "cloudEvents:type"))
        .or_else(|| header_text(&msg.headers, "cloudEvents_type"))
        .unwrap_or_else(|| "unknown".to_owned())
}

fn header_text(headers: &Map<String, Value>, name: &str) -> Option<String> {
    match headers.get(name)? {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn version(headers: &Map<String, Value>) -> Result<i32, String> {
    match headers.get(VERSION_HEADER) {
        None | Some(Value::Null) => Ok(1),
        Some(Value::Number(n)) => n
            .as_i64()
            .and_then(|v| i32::try_from(v).ok())
            .ok_or_else(|| format!("{VERSION_HEADER} {n} is not a 32-bit integer")),
        Some(Value::String(s)) => s
            .trim()
            .parse()
            .map_err(|_| format!("{VERSION_HEADER} {s:?} is not an integer")),
        Some(other) => Err(format!("{VERSION_HEADER} must be an integer, got {other}")),
    }
}

/// Sum of the `count` fields of the broker's `x-death` entries. Saturating: the header can be
/// set by any producer, and an overflow must not panic the consumer.
fn death_count(headers: &Map<String, Value>) -> u64 {
    headers
        .get("x-death")
        .and_then(Value::as_array)
        .map(|entries| {
            entries
                .iter()
                .filter_map(|e| e.get("count").and_then(Value::as_u64))
                .fold(0, u64::saturating_add)
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msg(id: Option<&str>, headers: Value, body: &[u8]) -> AmqpMessage {
        AmqpMessage {
            message_id: id.map(str::to_owned),
            kind: Some("OrderPlaced".into()),
            headers: headers.as_object().cloned().unwrap_or_default(),
            body: body.to_vec(),
            ..AmqpMessage::default()
        }
    }

    #[test]
    fn parses_metadata_and_payload() {
        let m = msg(
            Some("m-1"),
            json!({
                "x-message-version": "1", "x-aggregate-type": "Order", "x-aggregate-id": "o-1",
                "traceparent": "00-abc-def-01", "x-tenant-id": "t1",
                "x-death": [{"count": 2}, {"count": 1}]
            }),
            br#"{"order_id":"o-1"}"#,
        );
        let e = parse(m, &EnvelopeRules::default()).expect("valid");
        assert_eq!(e.message_id, "m-1");
        assert_eq!(e.message_type, "OrderPlaced");
        assert_eq!(e.aggregate_id.as_deref(), Some("o-1"));
        assert_eq!(e.lane_key(), "o-1");
        assert_eq!(e.tenant_id.as_deref(), Some("t1"));
        assert_eq!(e.death_count, 3);
        assert_eq!(e.payload["order_id"], "o-1");
    }

    #[test]
    fn bad_input_is_classified_and_keyed_stably() {
        let rules = EnvelopeRules::default();
        let cases = [
            (msg(None, json!({}), b"{}"), InvalidReason::MissingMessageId),
            (
                msg(Some(&"x".repeat(300)), json!({}), b"{}"),
                InvalidReason::MessageIdTooLong,
            ),
            (
                msg(Some("m"), json!({}), b"{not json"),
                InvalidReason::InvalidJson,
            ),
            (
                msg(Some("m"), json!({}), &[0xff, 0xfe]),
                InvalidReason::InvalidJson,
            ),
            (
                msg(Some("m"), json!({"x-message-version": 7}), b"{}"),
                InvalidReason::UnsupportedVersion,
            ),
            (
                msg(Some("m"), json!({"x-message-version": "v2"}), b"{}"),
                InvalidReason::MalformedVersion,
            ),
            (
                msg(Some("m"), json!({}), &vec![b' '; 2 * 1024 * 1024]),
                InvalidReason::PayloadTooLarge,
            ),
        ];
        for (m, reason) in cases {
            let again = parse(m.clone(), &rules).expect_err("invalid");
            let first = parse(m, &rules).expect_err("invalid");
            assert_eq!(first.reason, reason, "{}", first.detail);
            assert_eq!(first.envelope.message_id, again.envelope.message_id);
            assert!(first.envelope.message_id.len() <= crate::dedup::MAX_KEY_LEN);
        }
    }

    #[test]
    fn spring_type_header_is_a_fallback() {
        let mut m = msg(
            Some("m"),
            json!({"__TypeId__": "com.acme.OrderPlaced"}),
            b"{}",
        );
        m.kind = None;
        let e = parse(m, &EnvelopeRules::default()).expect("valid");
        assert_eq!(e.message_type, "com.acme.OrderPlaced");
    }
}
