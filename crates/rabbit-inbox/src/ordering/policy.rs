//! What an ordered consumer orders by: the key of a message, its optional business sequence
//! number, and what happens when a number does not arrive. Pure; read from the envelope.

use std::time::Duration;

use serde_json::Value;

use crate::envelope::Envelope;

/// Longest ordering key, in bytes: it is stored and indexed beside the inbox key.
pub const MAX_ORDER_KEY_BYTES: usize = 255;

/// Per-key order through retries and parking, for one consumer (opt-in, see
/// [`crate::ConsumerConfig::ordering`]).
///
/// When a message of a key fails retryably or is parked, the key's later messages are held:
/// recorded HELD in the ledger with their bodies and acked. When the head is resolved
/// (processed after its retry, redriven and processed, or skipped by an operator), the release
/// task (`inbox_ops::ReleaseTask`, started by `inbox_ops::Service`) publishes them again one by
/// one, in their order, and each runs through the same claim and transaction as any delivery.
/// Other keys never wait. Messages without a key are not ordered.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct OrderingPolicy {
    /// Where a message's ordering key comes from.
    pub key: OrderKey,
    /// Business sequence numbers, when the producer sends them.
    pub sequence: Option<SequencePolicy>,
    /// How often the release task looks for keys whose held messages may go on.
    pub release_interval: Duration,
    /// How long a released copy may take to come back before the release task publishes
    /// another (the first could have been lost with a queue; a second copy is a duplicate).
    pub release_timeout: Duration,
}

impl OrderingPolicy {
    /// Orders each aggregate's messages, by the `x-aggregate-id` header.
    pub fn by_aggregate() -> Self {
        Self::by(OrderKey::AggregateId)
    }

    /// Orders by the value of header `name` (a string or an integer).
    pub fn by_header(name: impl Into<String>) -> Self {
        Self::by(OrderKey::Header(name.into()))
    }

    fn by(key: OrderKey) -> Self {
        Self {
            key,
            sequence: None,
            release_interval: Duration::from_millis(250),
            release_timeout: Duration::from_secs(30),
        }
    }

    /// Orders each key's messages by their business sequence numbers (see
    /// [`SequencePolicy`]) instead of their arrival.
    #[must_use]
    pub fn with_sequence(mut self, sequence: SequencePolicy) -> Self {
        self.sequence = Some(sequence);
        self
    }

    /// The ordering key of `envelope`: `None` for a message without one (not ordered),
    /// `Err` for a key header too long to store.
    pub fn key_of<'e>(&self, envelope: &'e Envelope) -> Result<Option<&'e str>, String> {
        let key = match &self.key {
            OrderKey::AggregateId => envelope.aggregate_id.as_deref(),
            OrderKey::Header(name) => match envelope.headers.get(name) {
                Some(Value::String(s)) if !s.is_empty() => Some(s.as_str()),
                Some(Value::Number(_)) => {
                    return Err(format!(
                        "ordering header {name} is a number; send it as a string"
                    ));
                }
                _ => None,
            },
        };
        match key {
            Some(k) if k.len() > MAX_ORDER_KEY_BYTES => Err(format!(
                "ordering key of {} bytes, longer than {MAX_ORDER_KEY_BYTES}",
                k.len()
            )),
            other => Ok(other),
        }
    }

    /// The business sequence number of `envelope` when the policy orders by them: `Ok(None)`
    /// without sequence numbers, `Err` when the header is missing or not an integer.
    pub fn sequence_of(&self, envelope: &Envelope) -> Result<Option<i64>, String> {
        let Some(sequence) = &self.sequence else {
            return Ok(None);
        };
        let name = &sequence.header;
        match envelope.headers.get(name) {
            Some(Value::Number(n)) => n
                .as_i64()
                .map(Some)
                .ok_or_else(|| format!("sequence header {name} {n} is not a 64-bit integer")),
            Some(Value::String(s)) => s
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| format!("sequence header {name} is not an integer")),
            None | Some(Value::Null) => Err(format!(
                "sequence header {name} is missing: an ordered consumer with sequence numbers \
                 needs one on every message that has an ordering key"
            )),
            Some(_) => Err(format!("sequence header {name} is not an integer")),
        }
    }
}

/// Where a message's ordering key comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OrderKey {
    /// The `x-aggregate-id` header (the same key the lanes use).
    AggregateId,
    /// A header of the producer's choosing (a string value).
    Header(String),
}

/// Business sequence numbers: each key's messages carry consecutive integers in a header, and
/// a message runs only after the one before it in that sequence. A gap (a later number
/// arrives first) holds the later messages until the missing one arrives or `gap_timeout`
/// passes; then the release task alerts and applies `on_gap`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SequencePolicy {
    /// The header carrying the number (an integer, or its decimal text).
    pub header: String,
    /// The number each key starts at: a key's first message must carry it.
    pub first: i64,
    /// How long later numbers wait for a missing one before `on_gap` applies.
    pub gap_timeout: Duration,
    /// What happens to the messages behind a gap that outlived its timeout.
    pub on_gap: GapPolicy,
}

impl SequencePolicy {
    /// Numbers in header `header`, starting at 1 per key; a gap waits 10 minutes, then keeps
    /// holding (alerting).
    pub fn header(header: impl Into<String>) -> Self {
        Self {
            header: header.into(),
            first: 1,
            gap_timeout: Duration::from_secs(600),
            on_gap: GapPolicy::KeepHolding,
        }
    }

    /// Each key's first number.
    #[must_use]
    pub fn starting_at(mut self, first: i64) -> Self {
        self.first = first;
        self
    }

    /// How long a gap may last before `policy` applies.
    #[must_use]
    pub fn on_gap(mut self, timeout: Duration, policy: GapPolicy) -> Self {
        self.gap_timeout = timeout;
        self.on_gap = policy;
        self
    }
}

/// What happens to the held messages behind a sequence gap that outlived its timeout. Each is
/// recorded on the rows (code `sequence_gap`) and audited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GapPolicy {
    /// Keep holding them: the alert is the only action; an operator decides (skip the gap
    /// with `inboxctl ordering skip`, or send the missing message).
    KeepHolding,
    /// Park them (PERMANENT_FAILED, code `sequence_gap`), each with its parking-lot copy; the
    /// key waits on for the missing number.
    ParkFollowers,
    /// Go on past the gap: the key's next number becomes the first held one. A missing message
    /// that arrives later is parked (`sequence_passed`).
    Release,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(headers: serde_json::Value) -> Envelope {
        let Value::Object(mut headers) = headers else {
            panic!("headers are an object");
        };
        headers.insert("x-aggregate-id".into(), "order-1".into());
        crate::envelope::parse(
            crate::envelope::AmqpMessage {
                message_id: Some("m-1".into()),
                kind: Some("Placed".into()),
                headers,
                body: b"{}".to_vec(),
                ..crate::envelope::AmqpMessage::default()
            },
            &crate::envelope::EnvelopeRules::default(),
        )
        .expect("valid")
    }

    #[test]
    fn keys_come_from_the_aggregate_or_a_header() {
        let e = envelope(serde_json::json!({"x-tenant-key": "t-9", "x-n": 5}));
        assert_eq!(
            OrderingPolicy::by_aggregate().key_of(&e),
            Ok(Some("order-1"))
        );
        let by_header = OrderingPolicy::by_header("x-tenant-key");
        assert_eq!(by_header.key_of(&e), Ok(Some("t-9")));
        assert_eq!(OrderingPolicy::by_header("x-absent").key_of(&e), Ok(None));
        assert!(OrderingPolicy::by_header("x-n").key_of(&e).is_err());
        let mut long = e.clone();
        long.aggregate_id = Some("k".repeat(MAX_ORDER_KEY_BYTES + 1));
        assert!(OrderingPolicy::by_aggregate().key_of(&long).is_err());
    }

    #[test]
    fn sequence_numbers_are_integers_or_their_text() {
        let policy = OrderingPolicy::by_aggregate().with_sequence(SequencePolicy::header("x-seq"));
        let seq =
            |v: serde_json::Value| policy.sequence_of(&envelope(serde_json::json!({"x-seq": v})));
        assert_eq!(seq(serde_json::json!(7)), Ok(Some(7)));
        assert_eq!(seq(serde_json::json!(" 8 ")), Ok(Some(8)));
        assert!(seq(serde_json::json!("eight")).is_err());
        assert!(seq(serde_json::json!(1.5)).is_err());
        assert!(
            policy
                .sequence_of(&envelope(serde_json::json!({})))
                .is_err()
        );
        assert_eq!(
            OrderingPolicy::by_aggregate().sequence_of(&envelope(serde_json::json!({}))),
            Ok(None)
        );
    }
}
