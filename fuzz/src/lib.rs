//! Invariants of envelope parsing, checked by every fuzz target against every dedup strategy
//! and both a small and the default set of envelope rules.

use arbitrary::{Arbitrary, Unstructured};
use rabbit_inbox::{
    AGGREGATE_ID_HEADER, AGGREGATE_TYPE_HEADER, AmqpMessage, BodyHash, CAUSATION_HEADER,
    DedupStrategy, Envelope, EnvelopeRules, FieldLimits, InvalidReason, MAX_KEY_LEN, TENANT_HEADER,
    TRACEPARENT_HEADER, TYPE_HEADER, VERSION_HEADER, canonical_json, parse,
};
use serde_json::{Map, Number, Value};
use sha2::{Digest, Sha256};

/// The header the header strategy reads.
pub const EVENT_ID_HEADER: &str = "x-event-id";

/// Header names the parser gives meaning to, so that generated maps hit them often.
pub const KNOWN_HEADERS: &[&str] = &[
    VERSION_HEADER,
    TYPE_HEADER,
    AGGREGATE_ID_HEADER,
    AGGREGATE_TYPE_HEADER,
    CAUSATION_HEADER,
    TENANT_HEADER,
    TRACEPARENT_HEADER,
    EVENT_ID_HEADER,
    "x-death",
    "count",
    "cloudEvents:id",
    "cloudEvents_id",
    "__TypeId__",
    "id",
];

/// A header or field name: usually one the parser knows, sometimes anything.
#[derive(Debug)]
pub struct Name(pub String);

impl<'a> Arbitrary<'a> for Name {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(Name(if u.ratio(3, 4)? {
            (*u.choose(KNOWN_HEADERS)?).to_owned()
        } else {
            String::arbitrary(u)?
        }))
    }
}

/// Any JSON value, nested.
#[derive(Debug, Arbitrary)]
pub enum Json {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(Name, Json)>),
}

impl Json {
    pub fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Int(n) => Value::from(*n),
            Json::UInt(n) => Value::from(*n),
            Json::Float(f) => Number::from_f64(*f).map_or(Value::Null, Value::Number),
            Json::Str(s) => Value::String(s.clone()),
            Json::Array(a) => Value::Array(a.iter().map(Json::to_value).collect()),
            Json::Object(o) => Value::Object(to_map(o)),
        }
    }
}

pub fn to_map(entries: &[(Name, Json)]) -> Map<String, Value> {
    entries
        .iter()
        .map(|(k, v)| (k.0.clone(), v.to_value()))
        .collect()
}

/// A body: raw bytes, or JSON so that the payload strategies see real fields.
#[derive(Debug, Arbitrary)]
pub enum Body {
    Raw(Vec<u8>),
    Json(Json),
}

impl Body {
    pub fn to_bytes(&self) -> Vec<u8> {
        match self {
            Body::Raw(b) => b.clone(),
            Body::Json(j) => j.to_value().to_string().into_bytes(),
        }
    }
}

/// A content type: the ones the parser distinguishes, or anything.
#[derive(Debug)]
pub struct ContentType(pub String);

impl<'a> Arbitrary<'a> for ContentType {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        Ok(ContentType(if u.ratio(3, 4)? {
            (*u.choose(&[
                "application/json",
                "application/cloudevents+json",
                "application/cloudevents",
                "",
            ])?)
            .to_owned()
        } else {
            String::arbitrary(u)?
        }))
    }
}

/// Every dedup strategy, with fixed and with caller-chosen names.
pub fn strategies(header: &str, pointers: &[String]) -> Vec<DedupStrategy> {
    vec![
        DedupStrategy::MessageId,
        DedupStrategy::Header(EVENT_ID_HEADER.to_owned()),
        DedupStrategy::Header(header.to_owned()),
        DedupStrategy::CloudEventsId,
        DedupStrategy::PayloadFields(vec!["/id".to_owned()]),
        DedupStrategy::PayloadFields(vec!["/id".to_owned(), "/count".to_owned()]),
        DedupStrategy::PayloadFields(vec![String::new()]),
        DedupStrategy::PayloadFields(pointers.to_vec()),
    ]
}

/// Field limits small enough for generated values to cross them.
pub fn small_limits() -> FieldLimits {
    FieldLimits {
        message_type: 8,
        aggregate_type: 8,
        aggregate_id: 8,
        correlation_id: 8,
        causation_id: 8,
        tenant_id: 8,
        traceparent: FieldLimits::TRACEPARENT_V00_LEN,
        headers: 256,
    }
}

/// A small rule set (tiny body and field limits, versions 1..=3, raw body hash) and the
/// default one, per strategy.
pub fn rule_sets(header: &str, pointers: &[String]) -> Vec<EnvelopeRules> {
    strategies(header, pointers)
        .into_iter()
        .flat_map(|dedup| {
            [
                EnvelopeRules {
                    dedup: dedup.clone(),
                    max_payload_bytes: 64,
                    supported_versions: 1..=3,
                    field_limits: small_limits(),
                    body_hash: BodyHash::RawBytes,
                    accepted_types: None,
                },
                EnvelopeRules {
                    dedup,
                    ..EnvelopeRules::default()
                },
            ]
        })
        .collect()
}

/// Every stored field of `e` is within `limits` (a byte length below the stored length).
fn assert_within_limits(e: &Envelope, limits: &FieldLimits) {
    let fields = [
        ("type", Some(&e.message_type), limits.message_type),
        (
            "aggregate type",
            e.aggregate_type.as_ref(),
            limits.aggregate_type,
        ),
        ("aggregate id", e.aggregate_id.as_ref(), limits.aggregate_id),
        (
            "correlation",
            e.correlation_id.as_ref(),
            limits.correlation_id,
        ),
        ("causation", e.causation_id.as_ref(), limits.causation_id),
        ("tenant", e.tenant_id.as_ref(), limits.tenant_id),
        ("traceparent", e.traceparent.as_ref(), limits.traceparent),
    ];
    for (name, value, limit) in fields {
        let len = value.map_or(0, String::len);
        assert!(len <= limit, "{name} of {len} bytes over {limit}");
    }
}

/// SHA-256 of `body` as the rules hash it.
fn body_sha256(body: &[u8], rules: &EnvelopeRules) -> [u8; 32] {
    let payload = (body.len() <= rules.max_payload_bytes)
        .then(|| serde_json::from_slice::<Value>(body).ok())
        .flatten();
    match (payload, rules.body_hash) {
        (Some(payload), BodyHash::CanonicalJson) => {
            Sha256::digest(canonical_json(&payload).as_bytes()).into()
        }
        _ => Sha256::digest(body).into(),
    }
}

/// Parses `msg` under `rules` twice and checks what any result must satisfy.
pub fn check(msg: &AmqpMessage, rules: &EnvelopeRules) {
    let first = parse(msg.clone(), rules);
    let again = parse(msg.clone(), rules);
    assert_eq!(first, again, "parsing is deterministic");
    let sha: [u8; 32] = Sha256::digest(&msg.body).into();
    let hashed = body_sha256(&msg.body, rules);
    match first {
        Ok(e) => {
            assert!(
                (1..=MAX_KEY_LEN).contains(&e.message_id.len()),
                "key length {}",
                e.message_id.len()
            );
            assert!(!e.message_id.trim().is_empty(), "blank key");
            assert!(!e.message_id.chars().any(char::is_control), "control char");
            assert!(msg.body.len() <= rules.max_payload_bytes);
            assert!(rules.supported_versions.contains(&e.message_version));
            let payload: Value = serde_json::from_slice(&msg.body).expect("a valid body is JSON");
            assert_eq!(e.payload, payload);
            assert_eq!(e.payload_sha256, hashed);
            assert_eq!(e.raw_body_sha256(), sha);
            assert_within_limits(&e, &rules.field_limits);
            let headers_len = serde_json::to_vec(&e.headers).map_or(0, |h| h.len());
            assert!(headers_len <= rules.field_limits.headers);
            assert_eq!(e.body, msg.body);
            assert_eq!(e.headers, msg.headers, "headers are passed through");
            assert!(!e.message_type.is_empty());
            if let DedupStrategy::PayloadFields(_) = &rules.dedup {
                // The key depends on field values, not on how the body is written.
                let written = serde_json::to_vec(&payload).expect("serializable");
                if written.len() <= rules.max_payload_bytes
                    && serde_json::from_slice::<Value>(&written).ok() == Some(payload)
                {
                    let rewritten = AmqpMessage {
                        body: written,
                        ..msg.clone()
                    };
                    let key = parse(rewritten, rules).map(|e| e.message_id);
                    assert_eq!(key.ok(), Some(e.message_id), "key of the rewritten body");
                }
            }
            if rules.body_hash == BodyHash::CanonicalJson {
                // The same JSON, written another way, is the same body.
                let mut written = serde_json::to_vec_pretty(&e.payload).expect("serializable");
                written.insert(0, b' ');
                if written.len() <= rules.max_payload_bytes
                    && serde_json::from_slice::<Value>(&written).ok().as_ref() == Some(&e.payload)
                {
                    let rewritten = AmqpMessage {
                        body: written,
                        ..msg.clone()
                    };
                    if let Ok(again) = parse(rewritten, rules) {
                        assert_eq!(again.payload_sha256, e.payload_sha256, "rewritten body");
                    }
                }
            }
        }
        Err(invalid) => {
            let key = &invalid.envelope.message_id;
            assert!(
                (1..=MAX_KEY_LEN).contains(&key.len()),
                "invalid key length {}",
                key.len()
            );
            assert!(!key.trim().is_empty());
            assert!(!invalid.reason.code().is_empty());
            assert!(
                !invalid.detail.is_empty(),
                "{:?} has no detail",
                invalid.reason
            );
            assert_eq!(invalid.envelope.payload_sha256, hashed);
            assert_eq!(invalid.envelope.raw_body_sha256(), sha);
            // Storable whatever the reason.
            assert_within_limits(&invalid.envelope, &rules.field_limits);
            let headers_len = serde_json::to_vec(&invalid.envelope.headers).map_or(0, |h| h.len());
            assert!(
                headers_len <= rules.field_limits.headers
                    || invalid
                        .envelope
                        .headers
                        .contains_key("x-inbox-headers-omitted"),
                "stored headers of {headers_len} bytes"
            );
            assert_eq!(
                invalid.envelope.body, msg.body,
                "the body is kept to park it"
            );
            let synthetic = matches!(
                invalid.reason,
                InvalidReason::MissingMessageId
                    | InvalidReason::MessageIdTooLong
                    | InvalidReason::MalformedMessageId
                    | InvalidReason::PayloadTooLarge
                    | InvalidReason::HeadersTooDeep
            );
            if synthetic {
                assert!(
                    key.starts_with("invalid:"),
                    "{:?}: key {key}",
                    invalid.reason
                );
                assert_eq!(key.len(), "invalid:".len() + 64);
            } else {
                // Bad version or body: the message's own key is usable and kept.
                assert!(!key.chars().any(char::is_control));
            }
            assert_eq!(
                invalid.reason == InvalidReason::PayloadTooLarge,
                msg.body.len() > rules.max_payload_bytes,
                "the size check comes first"
            );
        }
    }
}
