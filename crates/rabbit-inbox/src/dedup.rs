//! Dedup key strategies: where a message's identity comes from.
//!
//! The delivery tag is never an identity: it names one delivery on one channel and changes on
//! every redelivery.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// Longest accepted dedup key, in bytes. Longer ids are bad input, not truncated: two distinct
/// ids must never collapse into one key.
pub const MAX_KEY_LEN: usize = 255;

/// How a consumer derives the dedup key of a message. Chosen per consumer.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DedupStrategy {
    /// The AMQP `message-id` property, set by the producer or its outbox (the default).
    #[default]
    MessageId,
    /// A named application header, e.g. `x-event-id`. String or integer values.
    Header(String),
    /// The CloudEvents `id` attribute in the AMQP binding: the `cloudEvents:id` (or
    /// `cloudEvents_id`) header in binary mode, the body's `id` in structured mode.
    CloudEventsId,
    /// SHA-256 over named stable payload fields (JSON pointers such as `/order_id`), for
    /// producers that send no usable id. List only fields that are equal on every copy. Each
    /// value is hashed in canonical JSON ([`crate::canonical_json::canonical_json()`]), so key order and
    /// number forms inside it do not matter.
    PayloadFields(Vec<String>),
}

/// Why no key could be derived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyError {
    Missing(String),
    TooLong(usize),
    Malformed(String),
}

impl DedupStrategy {
    /// Whether a redelivery with the same key must also carry the same body. Not so for
    /// [`DedupStrategy::PayloadFields`], whose point is to ignore the other fields.
    pub(crate) fn body_must_match(&self) -> bool {
        !matches!(self, DedupStrategy::PayloadFields(_))
    }

    pub(crate) fn extract(
        &self,
        message_id: Option<&str>,
        headers: &Map<String, Value>,
        content_type: Option<&str>,
        payload: Option<&Value>,
    ) -> Result<String, KeyError> {
        let key = match self {
            DedupStrategy::MessageId => message_id.map(str::to_owned).ok_or_else(|| {
                KeyError::Missing("the AMQP message-id property is not set".into())
            })?,
            DedupStrategy::Header(name) => header_key(headers, name)?
                .ok_or_else(|| KeyError::Missing(format!("header {name:?} is not set")))?,
            DedupStrategy::CloudEventsId => {
                let structured =
                    content_type.is_some_and(|ct| ct.starts_with("application/cloudevents"));
                let binary = match header_key(headers, "cloudEvents:id")? {
                    Some(id) => Some(id),
                    None => header_key(headers, "cloudEvents_id")?,
                };
                match (binary, structured) {
                    (Some(id), _) => id,
                    (None, true) => match payload.and_then(|p| p.get("id")) {
                        Some(Value::String(id)) => id.clone(),
                        Some(other) => {
                            return Err(KeyError::Malformed(format!(
                                "CloudEvents id must be a string, got {}",
                                crate::json_error::kind_of(other)
                            )));
                        }
                        None => {
                            return Err(KeyError::Missing(
                                "structured CloudEvent has no \"id\"".into(),
                            ));
                        }
                    },
                    (None, false) => {
                        return Err(KeyError::Missing(
                            "no cloudEvents:id header and the body is not a structured CloudEvent"
                                .into(),
                        ));
                    }
                }
            }
            DedupStrategy::PayloadFields(pointers) => {
                let payload = payload.ok_or_else(|| {
                    KeyError::Missing("the body is not JSON, so it has no fields to hash".into())
                })?;
                let mut hasher = Sha256::new();
                for pointer in pointers {
                    let value = payload.pointer(pointer).ok_or_else(|| {
                        KeyError::Missing(format!("payload field {pointer:?} is absent"))
                    })?;
                    // Canonical JSON: equal values hash equally however the body wrote them
                    // and whatever serde_json features the build enables (`preserve_order`
                    // keeps a Map in insertion order). The separator, which JSON text never
                    // contains, keeps ["ab","c"] apart from ["a","bc"].
                    crate::canonical_json::hash_into(value, &mut hasher);
                    hasher.update([0u8]);
                }
                format!("sha256:{}", hex::encode(hasher.finalize()))
            }
        };
        validate_key(key)
    }
}

fn header_key(headers: &Map<String, Value>, name: &str) -> Result<Option<String>, KeyError> {
    match headers.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(Some(n.to_string())),
        Some(other) => Err(KeyError::Malformed(format!(
            "header {name:?} must be a string or an integer, got {}",
            crate::json_error::kind_of(other)
        ))),
    }
}

fn validate_key(key: String) -> Result<String, KeyError> {
    if key.trim().is_empty() {
        return Err(KeyError::Malformed("the id is empty".into()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong(key.len()));
    }
    if key.chars().any(char::is_control) {
        return Err(KeyError::Malformed(
            "the id contains control characters".into(),
        ));
    }
    // Header bytes that are not UTF-8 reach us replaced by U+FFFD: two distinct ids could
    // then share one key and the second message would be skipped as a duplicate.
    if key.contains(char::REPLACEMENT_CHARACTER) {
        return Err(KeyError::Malformed(
            "the id contains U+FFFD (bytes that are not UTF-8?)".into(),
        ));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn headers(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn message_id_is_the_default_and_is_required() {
        let s = DedupStrategy::default();
        let h = Map::new();
        assert_eq!(s.extract(Some("abc"), &h, None, None), Ok("abc".into()));
        assert!(matches!(
            s.extract(None, &h, None, None),
            Err(KeyError::Missing(_))
        ));
    }

    #[test]
    fn header_accepts_strings_and_integers_only() {
        let s = DedupStrategy::Header("x-event-id".into());
        let ok = headers(json!({"x-event-id": 42}));
        assert_eq!(s.extract(None, &ok, None, None), Ok("42".into()));
        let bad = headers(json!({"x-event-id": [1]}));
        assert!(matches!(
            s.extract(None, &bad, None, None),
            Err(KeyError::Malformed(_))
        ));
    }

    #[test]
    fn cloudevents_binary_and_structured() {
        let s = DedupStrategy::CloudEventsId;
        let bin = headers(json!({"cloudEvents:id": "ce-1"}));
        assert_eq!(s.extract(None, &bin, None, None), Ok("ce-1".into()));
        let body = json!({"id": "ce-2", "specversion": "1.0"});
        let got = s.extract(
            None,
            &Map::new(),
            Some("application/cloudevents+json"),
            Some(&body),
        );
        assert_eq!(got, Ok("ce-2".into()));
        assert!(
            s.extract(None, &Map::new(), Some("application/json"), Some(&body))
                .is_err()
        );
    }

    #[test]
    fn payload_fields_ignore_other_fields_and_separate_values() {
        let s = DedupStrategy::PayloadFields(vec!["/a".into(), "/b".into()]);
        let h = Map::new();
        let one = s.extract(None, &h, None, Some(&json!({"a": "x", "b": 1, "ts": 1})));
        let two = s.extract(None, &h, None, Some(&json!({"b": 1, "a": "x", "ts": 2})));
        assert_eq!(one, two);
        let split1 = s.extract(None, &h, None, Some(&json!({"a": "ab", "b": "c"})));
        let split2 = s.extract(None, &h, None, Some(&json!({"a": "a", "b": "bc"})));
        assert_ne!(split1, split2);
        assert!(s.extract(None, &h, None, Some(&json!({"a": 1}))).is_err());
    }

    #[test]
    fn payload_field_keys_do_not_depend_on_how_the_body_is_written() {
        let s = DedupStrategy::PayloadFields(vec!["/order".into(), "/n".into()]);
        let h = Map::new();
        let key = |body: &str| {
            let payload: Value = serde_json::from_str(body).expect("valid");
            s.extract(None, &h, None, Some(&payload))
        };
        let one = key(r#"{"order":{"id":"o-1","lines":[1,2]},"n":2.0}"#);
        let two = key("{ \"n\": 2, \"order\": { \"lines\": [1, 2], \"id\": \"o-\\u0031\" } }");
        assert_eq!(one, two);
        assert_ne!(one, key(r#"{"order":{"id":"o-1","lines":[2,1]},"n":2}"#));
        assert_ne!(one, key(r#"{"order":{"id":"o-1","lines":[1,2]},"n":3}"#));
    }

    #[test]
    fn payload_field_keys_of_strings_and_integers_are_unchanged() {
        // Keys recorded by earlier versions (compact serde_json text of each value) still
        // match: for strings and integers the canonical form is the same text.
        let s = DedupStrategy::PayloadFields(vec!["/id".into(), "/seq".into()]);
        let got = s.extract(
            None,
            &Map::new(),
            None,
            Some(&json!({"id": "o-\u{e9}\n", "seq": 7})),
        );
        let mut hasher = Sha256::new();
        hasher.update(json!("o-\u{e9}\n").to_string().as_bytes());
        hasher.update([0u8]);
        hasher.update(b"7");
        hasher.update([0u8]);
        assert_eq!(
            got,
            Ok(format!("sha256:{}", hex::encode(hasher.finalize())))
        );
    }

    #[test]
    fn keys_are_bounded_and_printable() {
        let s = DedupStrategy::MessageId;
        let h = Map::new();
        let long = "x".repeat(MAX_KEY_LEN + 1);
        assert_eq!(
            s.extract(Some(&long), &h, None, None),
            Err(KeyError::TooLong(MAX_KEY_LEN + 1))
        );
        assert!(s.extract(Some("  "), &h, None, None).is_err());
        assert!(s.extract(Some("a\nb"), &h, None, None).is_err());
        assert!(
            s.extract(Some(&"x".repeat(MAX_KEY_LEN)), &h, None, None)
                .is_ok()
        );
    }
}
