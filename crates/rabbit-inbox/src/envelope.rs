//! The typed envelope a handler sees, parsed from a broker-neutral [`AmqpMessage`].
//!
//! Parsing never fails silently: a delivery without a usable key, with a body that is not JSON,
//! too large, or of an unsupported version becomes an [`InvalidMessage`] that the consumer
//! records and parks. It is never processed without dedup and never dropped. Every field a
//! producer controls that the inbox stores is bounded ([`FieldLimits`]), and an invalid
//! message's envelope is cut down to those bounds, so that its failure can always be recorded.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    ops::RangeInclusive,
};

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::{
    canonical_json::canonical_sha256,
    dedup::{DedupStrategy, KeyError},
    status::UNKNOWN_MESSAGE_TYPE,
};

/// Most levels of field tables and arrays a header value may nest, the headers table itself
/// included. The patched frame parser (`forks/amq-protocol-types`) keeps the same bound and
/// replaces anything deeper with a marker before the client hands the delivery over.
pub const MAX_HEADER_DEPTH: usize = 64;

/// What a header value nested deeper than [`MAX_HEADER_DEPTH`] becomes: in the JSON headers of
/// the envelope and the inbox row, and as a long string in the parked copy.
pub const HEADER_TOO_DEEP: &str = "[omitted: nested deeper than 64 levels]";

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
    /// Why `headers` are incomplete: a value nested deeper than [`MAX_HEADER_DEPTH`]
    /// was replaced by [`HEADER_TOO_DEEP`]. Such a message is invalid.
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
    /// Longest accepted value of each stored field a producer controls.
    pub field_limits: FieldLimits,
    /// How the body hash that detects payload conflicts is computed.
    pub body_hash: BodyHash,
    /// The message types (and versions) this consumer accepts; any other is invalid
    /// ([`InvalidReason::UnknownMessageType`]) and parked before a handler sees it. `None`
    /// accepts every type and leaves the decision to the handler. A consumer whose handler is
    /// a closed [`crate::router::Router`] sets it from the router's routes.
    pub accepted_types: Option<MessageTypes>,
}

impl Default for EnvelopeRules {
    fn default() -> Self {
        Self {
            dedup: DedupStrategy::MessageId,
            max_payload_bytes: 1024 * 1024,
            supported_versions: 1..=1,
            field_limits: FieldLimits::default(),
            body_hash: BodyHash::default(),
            accepted_types: None,
        }
    }
}

/// A set of message types, each with the versions it covers: some listed versions, or every
/// version ([`EnvelopeRules::supported_versions`] still bounds them).
#[derive(Clone, Debug, Default)]
pub struct MessageTypes {
    types: BTreeMap<String, Versions>,
}

/// The versions of one type in a [`MessageTypes`]. Listed versions are kept beside `every`:
/// a version with a handler of its own must still be one the consumer supports.
#[derive(Clone, Debug, Default)]
struct Versions {
    every: bool,
    listed: BTreeSet<i32>,
}

impl MessageTypes {
    /// Most types, and versions of one type, that [`MessageTypes`]'s `Display` lists: it ends
    /// up in stored error details, which must stay short.
    const LISTED: usize = 16;

    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds every version of `message_type`.
    #[must_use]
    pub fn with_type(mut self, message_type: impl Into<String>) -> Self {
        self.insert(message_type.into(), None);
        self
    }

    /// Adds `version` of `message_type`.
    #[must_use]
    pub fn with_version(mut self, message_type: impl Into<String>, version: i32) -> Self {
        self.insert(message_type.into(), Some(version));
        self
    }

    /// Adds `version` of `message_type`, or every version for `None`.
    pub fn insert(&mut self, message_type: String, version: Option<i32>) {
        let versions = self.types.entry(message_type).or_default();
        match version {
            None => versions.every = true,
            Some(v) => {
                versions.listed.insert(v);
            }
        }
    }

    /// Whether `version` of `message_type` is in the set.
    pub fn contains(&self, message_type: &str, version: i32) -> bool {
        self.types
            .get(message_type)
            .is_some_and(|v| v.every || v.listed.contains(&version))
    }

    /// Whether the set holds no type.
    pub fn is_empty(&self) -> bool {
        self.types.is_empty()
    }

    /// Each type with its versions (`None`: every version), by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Option<&BTreeSet<i32>>)> {
        self.types
            .iter()
            .map(|(t, v)| (t.as_str(), (!v.every).then_some(&v.listed)))
    }

    /// Every version added by itself, also of a type that has every version.
    pub fn listed_versions(&self) -> impl Iterator<Item = (&str, i32)> {
        self.types
            .iter()
            .flat_map(|(t, v)| v.listed.iter().map(move |&v| (t.as_str(), v)))
    }
}

/// Equal when they hold the same versions of the same types.
impl PartialEq for MessageTypes {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for MessageTypes {}

/// `A, B v1/v2`: the first 16 types, then how many more.
impl fmt::Display for MessageTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.types.is_empty() {
            return f.write_str("none");
        }
        for (i, (name, versions)) in self.iter().take(Self::LISTED).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(name)?;
            if let Some(versions) = versions {
                for (j, v) in versions.iter().take(Self::LISTED).enumerate() {
                    write!(f, "{}v{v}", if j == 0 { " " } else { "/" })?;
                }
                if versions.len() > Self::LISTED {
                    write!(f, "/..")?;
                }
            }
        }
        if self.types.len() > Self::LISTED {
            write!(f, " and {} more", self.types.len() - Self::LISTED)?;
        }
        Ok(())
    }
}

/// Longest accepted value, in bytes, of each producer-controlled field the inbox stores or
/// indexes. A message over a limit is invalid ([`InvalidReason::FieldTooLong`],
/// [`InvalidReason::HeadersTooLarge`]). Lengths count UTF-8 bytes as stored: a U+0000, which
/// PostgreSQL text cannot hold, is stored as U+FFFD and counts its 3 bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldLimits {
    /// [`Envelope::message_type`].
    pub message_type: usize,
    /// `x-aggregate-type`. Indexed together with the aggregate id, see
    /// [`FieldLimits::MAX_AGGREGATE_BYTES`].
    pub aggregate_type: usize,
    /// `x-aggregate-id`.
    pub aggregate_id: usize,
    /// The AMQP `correlation-id` property.
    pub correlation_id: usize,
    /// `x-causation-id`.
    pub causation_id: usize,
    /// `x-tenant-id`.
    pub tenant_id: usize,
    /// W3C `traceparent`: 55 characters in version 00 of the format.
    pub traceparent: usize,
    /// All application headers, serialized as compact JSON.
    pub headers: usize,
}

impl FieldLimits {
    /// Most bytes the aggregate type and id may take together: they share one B-tree index
    /// entry, which PostgreSQL caps at about 2,700 bytes (SQLSTATE 54000 beyond).
    pub const MAX_AGGREGATE_BYTES: usize = 2400;
    /// The length of a W3C `traceparent` of version 00, the least `traceparent` limit.
    pub const TRACEPARENT_V00_LEN: usize = 55;
}

impl Default for FieldLimits {
    fn default() -> Self {
        Self {
            message_type: 255,
            aggregate_type: 255,
            aggregate_id: 255,
            correlation_id: 255,
            causation_id: 255,
            tenant_id: 255,
            traceparent: Self::TRACEPARENT_V00_LEN,
            headers: 64 * 1024,
        }
    }
}

/// How [`Envelope::payload_sha256`] is computed. A redelivered key whose body hashes
/// differently is a payload conflict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BodyHash {
    /// A JSON body hashes in canonical form ([`crate::canonical_json::canonical_json()`]): a republish that
    /// writes the same JSON with other key order, whitespace, escapes or number forms is the
    /// same body. A body that is not JSON, or too large to be parsed, hashes its raw bytes.
    #[default]
    CanonicalJson,
    /// Always the raw bytes: any byte of difference is a conflict.
    RawBytes,
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
    /// SHA-256 of the body as [`EnvelopeRules::body_hash`] says: by default of the canonical
    /// JSON of the payload, of the raw bytes for a body that is not JSON.
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

    /// SHA-256 of the raw body bytes, computed on each call. Rows recorded with
    /// [`BodyHash::RawBytes`] (or before canonical hashing) hold this hash: a body matching
    /// either hash is the same body.
    pub fn raw_body_sha256(&self) -> [u8; 32] {
        Sha256::digest(&self.body).into()
    }
}

/// Why a delivery was refused before any handler saw it. All are permanent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
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
    /// A stored field (aggregate type or id, correlation, causation or tenant id,
    /// traceparent, message type) is longer than its [`FieldLimits`] entry.
    FieldTooLong,
    /// The headers as JSON are larger than [`FieldLimits::headers`].
    HeadersTooLarge,
    /// A header nests field tables or arrays deeper than [`MAX_HEADER_DEPTH`].
    HeadersTooDeep,
    /// The message type (or this version of it) is not in [`EnvelopeRules::accepted_types`].
    UnknownMessageType,
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
            InvalidReason::FieldTooLong => "field_too_long",
            InvalidReason::HeadersTooLarge => "headers_too_large",
            InvalidReason::HeadersTooDeep => "headers_too_deep",
            InvalidReason::UnknownMessageType => UNKNOWN_MESSAGE_TYPE,
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
    classify(msg, rules).map_err(|mut invalid| {
        make_storable(&mut invalid, &rules.field_limits);
        invalid
    })
}

/// [`parse`], before an invalid message's envelope is cut down to the limits.
fn classify(msg: AmqpMessage, rules: &EnvelopeRules) -> Result<Envelope, Box<InvalidMessage>> {
    let Read {
        mut envelope,
        payload,
        key,
        original_id,
        headers_truncated,
    } = read(msg, rules);
    // Refused before anything else is read, but recorded under the message's own key when it
    // has a usable one (so `show <id>` finds it and a redelivery maps to the same row); the
    // synthetic key only when it has none. A body over the limit is not parsed, so a key
    // taken from the body is missing here. Headers cut at the depth bound keep their upper
    // levels intact (a key header is a top-level string), but a key that is the cut marker
    // itself is no key.
    if let Some((reason, detail)) = unreadable(&envelope, rules, headers_truncated) {
        return Err(match key {
            Ok(key) if !key.contains(HEADER_TOO_DEEP) => {
                envelope.message_id = key;
                keep_key(envelope, reason, detail)
            }
            _ => synthetic_key(envelope, original_id.as_deref(), reason, detail),
        });
    }
    match key {
        Ok(key) => envelope.message_id = key,
        Err(e) => {
            let (reason, detail) = key_refusal(e);
            return Err(synthetic_key(
                envelope,
                original_id.as_deref(),
                reason,
                detail,
            ));
        }
    }
    // The key is usable: the refusal keeps it, so redeliveries map to one row.
    if let Err((reason, detail)) = check_keyed(&mut envelope, rules) {
        return Err(keep_key(envelope, reason, detail));
    }
    match payload {
        Some(payload) => {
            envelope.payload = payload;
            Ok(envelope)
        }
        None => {
            let detail = match serde_json::from_slice::<Value>(&envelope.body) {
                // Never the body's text: a syntax error's position only.
                Err(e) => format!(
                    "body is not valid JSON: {}",
                    crate::json_error::describe(&e)
                ),
                Ok(_) => "body is not valid JSON".into(),
            };
            Err(keep_key(envelope, InvalidReason::InvalidJson, detail))
        }
    }
}

/// A delivery as [`read`] takes it apart, before any check.
struct Read {
    /// Every field read, without key or payload, version 1.
    envelope: Envelope,
    /// The body as JSON; `None` when it is not JSON or over the size limit.
    payload: Option<Value>,
    /// The dedup key as the rules derive it.
    key: Result<String, KeyError>,
    /// The AMQP `message-id` property.
    original_id: Option<String>,
    /// Why the headers are incomplete.
    headers_truncated: Option<String>,
}

/// Reads what the envelope holds from `msg`: fields, headers, body and its hash, and the key.
fn read(msg: AmqpMessage, rules: &EnvelopeRules) -> Read {
    // A body over the limit is not even parsed.
    let payload: Option<Value> = (msg.body.len() <= rules.max_payload_bytes)
        .then(|| serde_json::from_slice(&msg.body).ok())
        .flatten();
    let payload_sha256 = match (&payload, rules.body_hash) {
        (Some(payload), BodyHash::CanonicalJson) => canonical_sha256(payload),
        _ => Sha256::digest(&msg.body).into(),
    };
    let key = rules.dedup.extract(
        msg.message_id.as_deref(),
        &msg.headers,
        msg.content_type.as_deref(),
        payload.as_ref(),
    );
    let envelope = Envelope {
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
    Read {
        envelope,
        payload,
        key,
        original_id: msg.message_id,
        headers_truncated: msg.headers_truncated,
    }
}

/// Why a delivery is refused before its key is read: a body over the size limit, or headers
/// cut at the depth bound (nothing else read from them, version or aggregate, can be
/// trusted).
fn unreadable(
    envelope: &Envelope,
    rules: &EnvelopeRules,
    headers_truncated: Option<String>,
) -> Option<(InvalidReason, String)> {
    if envelope.body.len() > rules.max_payload_bytes {
        let detail = format!(
            "body is {} bytes, the limit is {}",
            envelope.body.len(),
            rules.max_payload_bytes
        );
        return Some((InvalidReason::PayloadTooLarge, detail));
    }
    headers_truncated.map(|detail| (InvalidReason::HeadersTooDeep, detail))
}

/// The refusal of a delivery without a usable key.
fn key_refusal(error: KeyError) -> (InvalidReason, String) {
    match error {
        KeyError::Missing(d) => (InvalidReason::MissingMessageId, d),
        KeyError::TooLong(len) => {
            let detail = format!(
                "the id is {len} bytes, the limit is {}",
                crate::dedup::MAX_KEY_LEN
            );
            (InvalidReason::MessageIdTooLong, detail)
        }
        KeyError::Malformed(d) => (InvalidReason::MalformedMessageId, d),
    }
}

/// The checks of a keyed delivery, in order: stored fields and headers within their limits,
/// a supported version (set on the envelope, even when refused), an accepted type.
fn check_keyed(
    envelope: &mut Envelope,
    rules: &EnvelopeRules,
) -> Result<(), (InvalidReason, String)> {
    if let Some((field, len, limit)) = oversized_field(envelope, &rules.field_limits) {
        let detail = format!("{field} is {len} bytes, the limit is {limit}");
        return Err((InvalidReason::FieldTooLong, detail));
    }
    let headers_len = json_len(&envelope.headers);
    if headers_len > rules.field_limits.headers {
        let detail = format!(
            "the headers are {headers_len} bytes as JSON, the limit is {}",
            rules.field_limits.headers
        );
        return Err((InvalidReason::HeadersTooLarge, detail));
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
            return Err((InvalidReason::UnsupportedVersion, detail));
        }
        Err(detail) => return Err((InvalidReason::MalformedVersion, detail)),
    }
    if let Some(accepted) = &rules.accepted_types
        && !accepted.contains(&envelope.message_type, envelope.message_version)
    {
        // The type is within its field limit (checked above) and stored in its own column
        // anyway, so the detail may name it.
        let detail = format!(
            "message type {:?} version {} is not one this consumer accepts (accepted: {accepted})",
            envelope.message_type, envelope.message_version
        );
        return Err((InvalidReason::UnknownMessageType, detail));
    }
    Ok(())
}

/// A delivery without a usable key, recorded under a synthetic one: the hash of its original
/// id (if any, kept in a header) and its body, so one bad message maps to one inbox row
/// however often it is redelivered.
fn synthetic_key(
    mut envelope: Envelope,
    original_id: Option<&str>,
    reason: InvalidReason,
    detail: String,
) -> Box<InvalidMessage> {
    let mut hasher = Sha256::new();
    if let Some(id) = original_id {
        hasher.update(id.as_bytes());
        let shown: String = id.chars().take(512).collect();
        envelope
            .headers
            .insert(ORIGINAL_MESSAGE_ID.into(), Value::String(shown));
    }
    hasher.update([0u8]);
    hasher.update(&envelope.body);
    envelope.message_id = format!("invalid:{}", hex::encode(hasher.finalize()));
    Box::new(InvalidMessage {
        reason,
        detail,
        envelope,
    })
}

/// An invalid message whose key is usable keeps it, so a redelivery maps to the same row.
fn keep_key(envelope: Envelope, reason: InvalidReason, detail: String) -> Box<InvalidMessage> {
    Box::new(InvalidMessage {
        reason,
        detail,
        envelope,
    })
}

/// Name of the message-type field in details.
const MESSAGE_TYPE_FIELD: &str = "the message type";
/// Name of the correlation id in details.
const CORRELATION_FIELD: &str = "correlation-id";
/// Header an invalid message's stored headers are replaced by when they are over the limit;
/// holds their size. The parked copy keeps the originals.
const HEADERS_OMITTED: &str = "x-inbox-headers-omitted";
/// Header that [`synthetic_key`] adds to keep a refused id; kept when the headers are omitted.
const ORIGINAL_MESSAGE_ID: &str = "x-inbox-original-message-id";

/// The first stored field over its limit: its name, stored length and limit.
fn oversized_field(
    envelope: &Envelope,
    limits: &FieldLimits,
) -> Option<(&'static str, usize, usize)> {
    [
        (
            MESSAGE_TYPE_FIELD,
            Some(envelope.message_type.as_str()),
            limits.message_type,
        ),
        (
            AGGREGATE_TYPE_HEADER,
            envelope.aggregate_type.as_deref(),
            limits.aggregate_type,
        ),
        (
            AGGREGATE_ID_HEADER,
            envelope.aggregate_id.as_deref(),
            limits.aggregate_id,
        ),
        (
            CORRELATION_FIELD,
            envelope.correlation_id.as_deref(),
            limits.correlation_id,
        ),
        (
            CAUSATION_HEADER,
            envelope.causation_id.as_deref(),
            limits.causation_id,
        ),
        (
            TENANT_HEADER,
            envelope.tenant_id.as_deref(),
            limits.tenant_id,
        ),
        (
            TRACEPARENT_HEADER,
            envelope.traceparent.as_deref(),
            limits.traceparent,
        ),
    ]
    .into_iter()
    .find_map(|(name, value, limit)| {
        let len = stored_len(value?);
        (len > limit).then_some((name, len, limit))
    })
}

/// Cuts an invalid message's envelope down to `limits`, so that its failure record can be
/// written whatever the producer sent: a field over its limit keeps its first bytes (a
/// traceparent is dropped: a cut one means nothing), headers over theirs are replaced by a note
/// of their size. The detail names what was cut and its original length; the parked copy
/// carries the original properties and headers.
fn make_storable(invalid: &mut InvalidMessage, limits: &FieldLimits) {
    let e = &mut invalid.envelope;
    let mut cut = Vec::new();
    let len = stored_len(&e.message_type);
    if len > limits.message_type {
        truncate_stored(&mut e.message_type, limits.message_type);
        cut.push(format!("{MESSAGE_TYPE_FIELD} ({len} bytes)"));
    }
    for (name, field, limit) in [
        (
            AGGREGATE_TYPE_HEADER,
            &mut e.aggregate_type,
            limits.aggregate_type,
        ),
        (
            AGGREGATE_ID_HEADER,
            &mut e.aggregate_id,
            limits.aggregate_id,
        ),
        (
            CORRELATION_FIELD,
            &mut e.correlation_id,
            limits.correlation_id,
        ),
        (CAUSATION_HEADER, &mut e.causation_id, limits.causation_id),
        (TENANT_HEADER, &mut e.tenant_id, limits.tenant_id),
    ] {
        if let Some(value) = field {
            let len = stored_len(value);
            if len > limit {
                truncate_stored(value, limit);
                cut.push(format!("{name} ({len} bytes)"));
            }
        }
    }
    if let Some(len) = e.traceparent.as_deref().map(stored_len)
        && len > limits.traceparent
    {
        e.traceparent = None;
        cut.push(format!("{TRACEPARENT_HEADER} ({len} bytes, dropped)"));
    }
    let headers_len = json_len(&e.headers);
    if headers_len > limits.headers {
        let original_id = e.headers.remove(ORIGINAL_MESSAGE_ID);
        e.headers = Map::new();
        e.headers.insert(
            HEADERS_OMITTED.into(),
            serde_json::json!({ "bytes": headers_len }),
        );
        if let Some(id) = original_id {
            e.headers.insert(ORIGINAL_MESSAGE_ID.into(), id);
        }
        cut.push(format!("the headers ({headers_len} bytes, omitted)"));
    }
    if !cut.is_empty() {
        invalid.detail = format!(
            "{}; over the limit, so shortened in the inbox row: {}",
            invalid.detail,
            cut.join(", ")
        );
    }
}

/// Bytes `text` takes once stored: U+0000 becomes the 3 bytes of U+FFFD.
fn stored_len(text: &str) -> usize {
    text.len() + 2 * text.bytes().filter(|&b| b == 0).count()
}

/// Cuts `text` at a char boundary to at most `limit` stored bytes.
fn truncate_stored(text: &mut String, limit: usize) {
    let mut used = 0;
    let mut end = 0;
    for (i, c) in text.char_indices() {
        used += if c == '\0' { 3 } else { c.len_utf8() };
        if used > limit {
            break;
        }
        end = i + c.len_utf8();
    }
    text.truncate(end);
}

/// Length of `headers` written as compact JSON (as `serde_json` writes it), counted without
/// recursion: a producer nests header tables as deep as the frame size allows.
fn json_len(headers: &Map<String, Value>) -> usize {
    let mut len = object_len(headers);
    let mut pending: Vec<&Value> = headers.values().collect();
    while let Some(value) = pending.pop() {
        len += match value {
            Value::Null | Value::Bool(true) => 4,
            Value::Bool(false) => 5,
            Value::Number(n) => {
                let mut counter = ByteCounter(0);
                let _ = std::fmt::Write::write_fmt(&mut counter, format_args!("{n}"));
                counter.0
            }
            Value::String(s) => string_len(s),
            Value::Array(items) => {
                pending.extend(items);
                2 + items.len().saturating_sub(1)
            }
            Value::Object(map) => {
                pending.extend(map.values());
                object_len(map)
            }
        };
    }
    len
}

/// Braces, commas, names and colons of an object, without its values.
fn object_len(map: &Map<String, Value>) -> usize {
    2 + map.len().saturating_sub(1) + map.keys().map(|k| string_len(k) + 1).sum::<usize>()
}

/// A JSON string's length with quotes and escapes.
fn string_len(s: &str) -> usize {
    2 + s
        .chars()
        .map(|c| match c {
            '"' | '\\' | '\u{8}' | '\u{c}' | '\n' | '\r' | '\t' => 2,
            c if c < ' ' => 6,
            c => c.len_utf8(),
        })
        .sum::<usize>()
}

/// Counts formatted bytes without keeping them.
struct ByteCounter(usize);

impl std::fmt::Write for ByteCounter {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0 += s.len();
        Ok(())
    }
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
        Some(Value::String(s)) => s.trim().parse().map_err(|_| {
            format!(
                "{VERSION_HEADER} is not an integer (a string of {} characters)",
                s.chars().count()
            )
        }),
        Some(other) => Err(format!(
            "{VERSION_HEADER} must be an integer, got {}",
            crate::json_error::kind_of(other)
        )),
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
    fn refusal_details_do_not_quote_producer_data() {
        let secret = "4111111111111111";
        let cases = [
            (
                msg(
                    Some("m-1"),
                    json!({}),
                    format!("{{\"card\": \"{secret}").as_bytes(),
                ),
                InvalidReason::InvalidJson,
            ),
            (
                msg(
                    Some("m-1"),
                    json!({}),
                    format!("{{\"card\": {secret}x}}").as_bytes(),
                ),
                InvalidReason::InvalidJson,
            ),
            (
                msg(
                    Some("m-1"),
                    json!({ VERSION_HEADER: secret.to_owned() + "x" }),
                    b"{}",
                ),
                InvalidReason::MalformedVersion,
            ),
            (
                msg(
                    Some("m-1"),
                    json!({ VERSION_HEADER: { "card": secret } }),
                    b"{}",
                ),
                InvalidReason::MalformedVersion,
            ),
        ];
        for (m, reason) in cases {
            let invalid = parse(m, &EnvelopeRules::default()).expect_err("invalid");
            assert_eq!(invalid.reason, reason, "{}", invalid.detail);
            assert!(!invalid.detail.contains("4111"), "{}", invalid.detail);
        }
        let rules = EnvelopeRules {
            dedup: DedupStrategy::Header("x-key".into()),
            ..EnvelopeRules::default()
        };
        let m = msg(None, json!({ "x-key": { "card": secret } }), b"{}");
        let invalid = parse(m, &rules).expect_err("invalid");
        assert_eq!(invalid.reason, InvalidReason::MalformedMessageId);
        assert!(!invalid.detail.contains("4111"), "{}", invalid.detail);
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

    /// `m` with one more header.
    fn with_header(mut m: AmqpMessage, name: &str, value: Value) -> AmqpMessage {
        m.headers.insert(name.into(), value);
        m
    }

    #[test]
    fn oversized_fields_are_refused_under_their_own_key() {
        let rules = EnvelopeRules::default();
        let long = "x".repeat(4096);
        let base = msg(Some("m-1"), json!({}), b"{}");
        let mut typed = with_header(base.clone(), TYPE_HEADER, json!(long));
        typed.kind = None;
        let mut correlated = base.clone();
        correlated.correlation_id = Some(long.clone());
        let cases = [
            (
                with_header(base.clone(), AGGREGATE_ID_HEADER, json!(long)),
                AGGREGATE_ID_HEADER,
            ),
            (
                with_header(base.clone(), AGGREGATE_TYPE_HEADER, json!(long)),
                AGGREGATE_TYPE_HEADER,
            ),
            (
                with_header(base.clone(), CAUSATION_HEADER, json!(long)),
                CAUSATION_HEADER,
            ),
            (
                with_header(base.clone(), TENANT_HEADER, json!(long)),
                TENANT_HEADER,
            ),
            (
                with_header(base.clone(), TRACEPARENT_HEADER, json!(long)),
                TRACEPARENT_HEADER,
            ),
            (typed, MESSAGE_TYPE_FIELD),
            (correlated, CORRELATION_FIELD),
        ];
        for (m, field) in cases {
            let invalid = parse(m, &rules).expect_err(field);
            assert_eq!(invalid.reason, InvalidReason::FieldTooLong, "{field}");
            assert_eq!(invalid.reason.code(), "field_too_long");
            assert_eq!(
                invalid.envelope.message_id, "m-1",
                "{field}: the key is kept"
            );
            assert!(
                invalid
                    .detail
                    .starts_with(&format!("{field} is 4096 bytes, the limit is ")),
                "{}",
                invalid.detail
            );
            let e = &invalid.envelope;
            assert!(e.message_type.len() <= 255);
            for stored in [&e.aggregate_type, &e.aggregate_id, &e.correlation_id]
                .into_iter()
                .chain([&e.causation_id, &e.tenant_id])
            {
                assert!(stored.as_ref().is_none_or(|v| v.len() <= 255), "{field}");
            }
            assert_eq!(
                e.traceparent, None,
                "{field}: a long traceparent is dropped"
            );
        }
        // Within the limits.
        let m = with_header(base.clone(), AGGREGATE_ID_HEADER, json!("x".repeat(255)));
        assert!(parse(m, &rules).is_ok());
        let trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let m = with_header(base, TRACEPARENT_HEADER, json!(trace));
        assert_eq!(
            parse(m, &rules).expect("valid").traceparent.as_deref(),
            Some(trace)
        );
    }

    #[test]
    fn oversized_fields_are_cut_at_char_boundaries_and_nul_counts_as_stored() {
        let rules = EnvelopeRules::default();
        let base = msg(Some("m-1"), json!({}), b"{}");
        let m = with_header(
            base.clone(),
            AGGREGATE_ID_HEADER,
            json!("\u{e9}".repeat(200)),
        );
        let invalid = parse(m, &rules).expect_err("400 bytes");
        let cut = invalid.envelope.aggregate_id.expect("kept, shortened");
        assert_eq!(cut, "\u{e9}".repeat(127));
        assert!(
            invalid.detail.contains("x-aggregate-id (400 bytes)"),
            "{}",
            invalid.detail
        );

        // 100 NULs are stored as 300 bytes of U+FFFD.
        let m = with_header(base.clone(), TENANT_HEADER, json!("\0".repeat(100)));
        let invalid = parse(m, &rules).expect_err("300 bytes as stored");
        assert_eq!(invalid.reason, InvalidReason::FieldTooLong);
        assert_eq!(
            invalid.envelope.tenant_id.as_deref(),
            Some(&"\0".repeat(85)[..])
        );
        let m = with_header(base, TENANT_HEADER, json!("\0".repeat(85)));
        assert!(parse(m, &rules).is_ok());
    }

    #[test]
    fn limits_are_configurable() {
        let mut rules = EnvelopeRules::default();
        rules.field_limits.aggregate_id = 8;
        let m = msg(Some("m"), json!({AGGREGATE_ID_HEADER: "order-123"}), b"{}");
        let invalid = parse(m.clone(), &rules).expect_err("9 bytes");
        assert_eq!(invalid.envelope.aggregate_id.as_deref(), Some("order-12"));
        rules.field_limits.aggregate_id = 9;
        assert!(parse(m, &rules).is_ok());
    }

    #[test]
    fn oversized_headers_are_refused_and_not_stored() {
        let rules = EnvelopeRules::default();
        let headers: Map<String, Value> = (0..40)
            .map(|i| (format!("x-big-{i}"), json!("y".repeat(2000))))
            .collect();
        let mut m = msg(Some("m-1"), json!({}), b"{}");
        m.headers = headers;
        let invalid = parse(m.clone(), &rules).expect_err("80 KB of headers");
        assert_eq!(invalid.reason, InvalidReason::HeadersTooLarge);
        assert_eq!(invalid.reason.code(), "headers_too_large");
        assert_eq!(invalid.envelope.message_id, "m-1");
        let size = serde_json::to_vec(&m.headers).expect("serializable").len();
        assert!(
            invalid.detail.contains(&format!("{size} bytes")),
            "{}",
            invalid.detail
        );
        assert_eq!(
            Value::Object(invalid.envelope.headers),
            json!({ HEADERS_OMITTED: { "bytes": size } })
        );
        // An invalid message of any reason is cut down too; a refused id is kept.
        m.message_id = Some(" ".into());
        let invalid = parse(m, &rules).expect_err("blank id");
        assert_eq!(invalid.reason, InvalidReason::MalformedMessageId);
        assert!(invalid.envelope.headers.contains_key(HEADERS_OMITTED));
        assert_eq!(invalid.envelope.headers[ORIGINAL_MESSAGE_ID], " ");
    }

    #[test]
    fn invalid_messages_of_other_reasons_are_made_storable() {
        let rules = EnvelopeRules::default();
        let m = msg(None, json!({AGGREGATE_ID_HEADER: "a".repeat(4096)}), b"{}");
        let invalid = parse(m, &rules).expect_err("no id");
        assert_eq!(invalid.reason, InvalidReason::MissingMessageId);
        assert!(invalid.envelope.message_id.starts_with("invalid:"));
        assert_eq!(
            invalid.envelope.aggregate_id.as_deref().map(str::len),
            Some(255)
        );
        assert!(
            invalid.detail.contains("x-aggregate-id (4096 bytes)"),
            "{}",
            invalid.detail
        );
    }

    #[test]
    fn header_length_is_the_compact_json_length() {
        let headers = json!({
            "a": null, "b": true, "c": false, "d": 12, "e": -3.5, "f": 1e300,
            "g": "quote\" back\\ nl\n tab\t ctl\u{1} \u{e9}\u{1F600}",
            "h": [], "i": {}, "j": [1, [2, {"k": "v"}]], "\u{7f}name\"": "x"
        });
        let map = headers.as_object().expect("object");
        let want = serde_json::to_vec(map).expect("serializable").len();
        assert_eq!(json_len(map), want);
        assert_eq!(json_len(&Map::new()), 2);
    }

    #[test]
    fn json_bodies_hash_canonically_by_default() {
        let rules = EnvelopeRules::default();
        let hash = |body: &[u8]| parse(msg(Some("m"), json!({}), body), &rules).expect("valid");
        let a = hash(br#"{"a":1,"b":[1.0,"\u00e9"]}"#);
        let b = hash(b"{ \"b\" : [ 1 , \"\xc3\xa9\" ] ,\n \"a\" : 1e0 }");
        assert_eq!(a.payload_sha256, b.payload_sha256);
        assert_ne!(a.raw_body_sha256(), b.raw_body_sha256());
        let canonical: [u8; 32] = Sha256::digest(b"{\"a\":1,\"b\":[1,\"\xc3\xa9\"]}").into();
        assert_eq!(a.payload_sha256, canonical);
        assert_ne!(
            a.payload_sha256,
            hash(br#"{"a":2,"b":[1,"\u00e9"]}"#).payload_sha256
        );

        // Raw bytes on request, and for bodies that are not JSON or too large to parse.
        let raw_rules = EnvelopeRules {
            body_hash: BodyHash::RawBytes,
            ..EnvelopeRules::default()
        };
        let raw =
            parse(msg(Some("m"), json!({}), br#"{"b":1, "a":1}"#), &raw_rules).expect("valid");
        assert_eq!(raw.payload_sha256, raw.raw_body_sha256());
        let not_json = parse(msg(Some("m"), json!({}), b"{nope"), &rules).expect_err("invalid");
        assert_eq!(
            not_json.envelope.payload_sha256,
            not_json.envelope.raw_body_sha256()
        );
        let small = EnvelopeRules {
            max_payload_bytes: 4,
            ..EnvelopeRules::default()
        };
        let big = parse(msg(Some("m"), json!({}), br#"{"a": 1}"#), &small).expect_err("large");
        assert_eq!(big.reason, InvalidReason::PayloadTooLarge);
        assert_eq!(big.envelope.payload_sha256, big.envelope.raw_body_sha256());
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

    #[test]
    fn a_type_outside_the_accepted_ones_is_refused_under_its_key() {
        let rules = EnvelopeRules {
            supported_versions: 1..=3,
            accepted_types: Some(
                MessageTypes::new()
                    .with_type("OrderPlaced")
                    .with_version("OrderShipped", 2),
            ),
            ..EnvelopeRules::default()
        };
        let typed = |kind: &str, version: i32| AmqpMessage {
            kind: Some(kind.into()),
            ..msg(Some("m1"), json!({"x-message-version": version}), b"{}")
        };
        assert!(parse(typed("OrderPlaced", 3), &rules).is_ok());
        assert!(parse(typed("OrderShipped", 2), &rules).is_ok());
        for (kind, version) in [("OrderShipped", 1), ("InvoiceSent", 1)] {
            let invalid = parse(typed(kind, version), &rules).expect_err("not accepted");
            assert_eq!(invalid.reason, InvalidReason::UnknownMessageType);
            assert_eq!(invalid.reason.code(), "unknown_message_type");
            assert_eq!(
                invalid.envelope.message_id, "m1",
                "recorded under its own key"
            );
            assert_eq!(
                invalid.detail,
                format!(
                    "message type {kind:?} version {version} is not one this consumer accepts \
                     (accepted: OrderPlaced, OrderShipped v2)"
                )
            );
        }
        // An unsupported version is refused as such first.
        let invalid = parse(typed("OrderPlaced", 4), &rules).expect_err("unsupported");
        assert_eq!(invalid.reason, InvalidReason::UnsupportedVersion);
    }

    #[test]
    fn message_types_merge_versions_and_list_briefly() {
        let mut types = MessageTypes::new()
            .with_version("A", 2)
            .with_version("A", 1);
        assert_eq!(types.to_string(), "A v1/v2");
        types.insert("A".into(), None);
        assert!(types.contains("A", 99), "every version now");
        types.insert("A".into(), Some(3));
        assert_eq!(types.to_string(), "A");
        assert_eq!(
            types,
            MessageTypes::new().with_type("A"),
            "the same versions"
        );
        assert_eq!(
            types.listed_versions().collect::<Vec<_>>(),
            [("A", 1), ("A", 2), ("A", 3)],
            "kept for the check of supported versions"
        );
        let many = (0..20).fold(MessageTypes::new(), |t, i| t.with_type(format!("T{i:02}")));
        assert!(many.to_string().ends_with("T15 and 4 more"), "{many}");
        assert_eq!(MessageTypes::new().to_string(), "none");
    }
}
