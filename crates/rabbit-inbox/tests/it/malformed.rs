//! Malformed deliveries, end to end and at the parser. Each one is published for real, must end
//! recorded in the inbox as PERMANENT_FAILED with a stable code and parked with the same code,
//! and must not stop the consumer: a valid message sent afterwards is still processed. Inputs
//! the inbox accepts although they look odd (a body that is JSON but not an object, a type
//! header that is not text, very many headers) are processed normally.

// Shared with the other integration tests; not every helper is used here.

use std::collections::HashMap;

use inbox_testkit::env::{TestEnv, header, thing};
#[cfg(feature = "fuzzing")]
use rabbit_inbox::broker::convert_encoded_headers;
use rabbit_inbox::{
    EnvelopeRules, InboxStatus, broker::OutgoingMessage, dedup::DedupStrategy, dedup::MAX_KEY_LEN,
    envelope::AmqpMessage, envelope::TYPE_HEADER, envelope::VERSION_HEADER, envelope::parse,
    status::parking_headers,
};
use serde_json::{Map, Value, json};

/// Body limit of the consumers here, small so an oversized body stays cheap to publish.
const MAX_PAYLOAD: usize = 4096;
/// The header the header strategy reads its key from.
const EVENT_ID: &str = "x-event-id";

/// What a case must become.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// Recorded PERMANENT_FAILED with this code, and parked.
    Parked(&'static str),
    /// Accepted and processed, with this message type.
    Processed(&'static str),
}

struct Case {
    name: &'static str,
    message: OutgoingMessage,
    expect: Expect,
}

/// A `Thing` with id `id`, `headers` and `body`.
fn msg(id: Option<&str>, headers: Value, body: impl Into<Vec<u8>>) -> OutgoingMessage {
    OutgoingMessage {
        message_id: id.map(str::to_owned),
        kind: Some("Thing".into()),
        correlation_id: None,
        headers: headers.as_object().cloned().unwrap_or_default(),
        body: body.into(),
    }
}

/// A body unique to a case, so synthetic keys (hash of id and body) never collide.
fn body(name: &str) -> Vec<u8> {
    json!({ "case": name }).to_string().into_bytes()
}

fn case(name: &'static str, message: OutgoingMessage, expect: Expect) -> Case {
    Case {
        name,
        message,
        expect,
    }
}

/// `depth` tables nested in one another, innermost `{"leaf": true}`.
fn nested(depth: usize) -> Value {
    (0..depth).fold(json!({"leaf": true}), |inner, _| json!({ "t": inner }))
}

/// `n` distinct headers.
fn many_headers(n: usize) -> Map<String, Value> {
    (0..n).map(|i| (format!("x-h-{i:05}"), json!(i))).collect()
}

/// Cases for a consumer keyed by the AMQP `message-id` property (the default strategy).
fn message_id_cases() -> Vec<Case> {
    use Expect::{Parked, Processed};
    let with_version = |name: &'static str, v: Value, code| {
        case(
            name,
            msg(Some(name), json!({ VERSION_HEADER: v }), body(name)),
            Parked(code),
        )
    };
    let mut many = msg(Some("many-headers"), json!({}), body("many-headers"));
    many.headers = many_headers(2000);
    let mut many_v9 = msg(Some("many-headers-v9"), json!({}), body("many-headers-v9"));
    many_v9.headers = many_headers(2000);
    many_v9.headers.insert(VERSION_HEADER.into(), json!(9));
    let mut typed_by_table = msg(
        Some("type-header-table"),
        json!({ TYPE_HEADER: {"name": "Thing"} }),
        body("type-header-table"),
    );
    typed_by_table.kind = None;
    let mut typed_by_number = msg(
        Some("type-header-number"),
        json!({ TYPE_HEADER: 7 }),
        body("type-header-number"),
    );
    typed_by_number.kind = None;
    vec![
        case(
            "missing message id",
            msg(None, json!({}), body("missing message id")),
            Parked("missing_message_id"),
        ),
        case(
            "empty message id",
            msg(Some(""), json!({}), body("empty message id")),
            Parked("malformed_message_id"),
        ),
        case(
            "blank message id",
            msg(Some("   "), json!({}), body("blank message id")),
            Parked("malformed_message_id"),
        ),
        case(
            "message id with a control character",
            msg(Some("id\u{1}x"), json!({}), body("control")),
            Parked("malformed_message_id"),
        ),
        case(
            "invalid UTF-8 body",
            msg(Some("utf8"), json!({}), vec![b'{', 0xff, 0xfe, b'}']),
            Parked("invalid_json"),
        ),
        case(
            "non-JSON body",
            msg(Some("not-json"), json!({}), b"{not json".to_vec()),
            Parked("invalid_json"),
        ),
        case(
            "empty body",
            msg(Some("empty-body"), json!({}), Vec::new()),
            Parked("invalid_json"),
        ),
        case(
            "truncated JSON",
            msg(Some("truncated"), json!({}), br#"{"a": [1, 2"#.to_vec()),
            Parked("invalid_json"),
        ),
        case(
            "body above max_payload_bytes",
            msg(
                Some("too-big"),
                json!({}),
                json!({ "blob": "x".repeat(2 * MAX_PAYLOAD) }).to_string(),
            ),
            Parked("payload_too_large"),
        ),
        case(
            "body above max_payload_bytes without an id",
            msg(None, json!({}), vec![b'x'; MAX_PAYLOAD + 1]),
            Parked("payload_too_large"),
        ),
        with_version("unknown version", json!(9), "unsupported_version"),
        with_version("version zero", json!(0), "unsupported_version"),
        with_version("version text", json!("abc"), "malformed_version"),
        with_version("version float", json!(1.5), "malformed_version"),
        with_version("version table", json!({"v": 1}), "malformed_version"),
        with_version("version array", json!([1]), "malformed_version"),
        with_version("version bool", json!(true), "malformed_version"),
        with_version(
            "version above 32 bits",
            json!(1_i64 << 40),
            "malformed_version",
        ),
        case(
            "many headers, unknown version",
            many_v9,
            Parked("unsupported_version"),
        ),
        case(
            "deeply nested headers, unknown version",
            msg(
                Some("nested-v9"),
                json!({ "x-deep": nested(62), VERSION_HEADER: 9 }),
                body("nested-v9"),
            ),
            Parked("unsupported_version"),
        ),
        // Accepted: the inbox does not look inside the payload or limit the headers, but for
        // their nesting depth.
        case(
            "JSON array body",
            msg(Some("array-body"), json!({}), b"[1, 2, 3]".to_vec()),
            Processed("Thing"),
        ),
        case(
            "JSON string body",
            msg(Some("string-body"), json!({}), br#""text""#.to_vec()),
            Processed("Thing"),
        ),
        case(
            "version as text",
            msg(
                Some("version-as-text"),
                json!({ VERSION_HEADER: " 1 " }),
                body("version-as-text"),
            ),
            Processed("Thing"),
        ),
        case(
            "type header of a wrong type",
            typed_by_table,
            Processed("unknown"),
        ),
        case("type header of a number", typed_by_number, Processed("7")),
        case("many headers", many, Processed("Thing")),
        // 64 levels with the headers table: the most the conversion follows (deeper ones are
        // in deep_headers.rs).
        case(
            "deeply nested headers",
            msg(
                Some("nested"),
                json!({ "x-deep": nested(62) }),
                body("nested"),
            ),
            Processed("Thing"),
        ),
        case(
            "x-death counts beyond 64 bits in total",
            msg(
                Some("death-overflow"),
                json!({ "x-death": [{"count": i64::MAX}, {"count": i64::MAX}, {"count": i64::MAX}] }),
                body("death-overflow"),
            ),
            Processed("Thing"),
        ),
    ]
}

/// Cases for a consumer keyed by the `x-event-id` header.
fn header_cases() -> Vec<Case> {
    use Expect::{Parked, Processed};
    let with_key = |name: &'static str, v: Value, expect| {
        // The AMQP message id is set but is not the key here.
        case(
            name,
            msg(Some("amqp-id"), json!({ EVENT_ID: v }), body(name)),
            expect,
        )
    };
    vec![
        case(
            "key header missing",
            msg(Some("amqp-id"), json!({}), body("key header missing")),
            Parked("missing_message_id"),
        ),
        with_key("key header null", Value::Null, Parked("missing_message_id")),
        with_key(
            "key header table",
            json!({"id": "e-1"}),
            Parked("malformed_message_id"),
        ),
        with_key(
            "key header array",
            json!(["e-1"]),
            Parked("malformed_message_id"),
        ),
        with_key(
            "key header float",
            json!(1.5),
            Parked("malformed_message_id"),
        ),
        with_key(
            "key header bool",
            json!(true),
            Parked("malformed_message_id"),
        ),
        with_key(
            "key header empty",
            json!(""),
            Parked("malformed_message_id"),
        ),
        with_key(
            "key header of 256 bytes",
            json!("k".repeat(MAX_KEY_LEN + 1)),
            Parked("message_id_too_long"),
        ),
        with_key(
            "key header of 255 bytes",
            json!("k".repeat(MAX_KEY_LEN)),
            Processed("Thing"),
        ),
        with_key("key header integer", json!(42), Processed("Thing")),
    ]
}

fn rules(dedup: DedupStrategy) -> EnvelopeRules {
    EnvelopeRules {
        dedup,
        max_payload_bytes: MAX_PAYLOAD,
        supported_versions: 1..=1,
        ..EnvelopeRules::default()
    }
}

/// `m` as the consumer receives it.
fn delivered(m: &OutgoingMessage) -> AmqpMessage {
    AmqpMessage {
        message_id: m.message_id.clone(),
        kind: m.kind.clone(),
        content_type: Some("application/json".into()),
        correlation_id: m.correlation_id.clone(),
        headers: m.headers.clone(),
        headers_truncated: None,
        body: m.body.clone(),
        redelivered: false,
    }
}

/// The inbox key of `m` under `rules` and what parsing made of it, checking the invariants
/// every result keeps: deterministic, bounded key, a reason code for each refusal.
fn classify(m: &AmqpMessage, rules: &EnvelopeRules) -> (String, Expect) {
    let first = parse(m.clone(), rules);
    assert_eq!(first, parse(m.clone(), rules), "parsing is deterministic");
    let (key, got) = match first {
        Ok(e) => {
            let ty: &'static str = match e.message_type.as_str() {
                "Thing" => "Thing",
                "unknown" => "unknown",
                "7" => "7",
                other => panic!("unexpected message type {other:?}"),
            };
            (e.message_id, Expect::Processed(ty))
        }
        Err(invalid) => {
            assert!(!invalid.detail.is_empty());
            (
                invalid.envelope.message_id,
                Expect::Parked(invalid.reason.code()),
            )
        }
    };
    assert!((1..=MAX_KEY_LEN).contains(&key.len()), "key {key:?}");
    (key, got)
}

#[test]
fn parse_classifies_every_malformed_case() {
    for (cases, rules) in [
        (message_id_cases(), rules(DedupStrategy::MessageId)),
        (
            header_cases(),
            rules(DedupStrategy::Header(EVENT_ID.into())),
        ),
    ] {
        for c in &cases {
            let (key, got) = classify(&delivered(&c.message), &rules);
            assert_eq!(got, c.expect, "{}", c.name);
            // The synthetic key only for a message without a usable id; any other refusal
            // (an oversized body included) is recorded under the message's own id.
            let synthetic = matches!(
                c.expect,
                Expect::Parked(
                    "missing_message_id" | "malformed_message_id" | "message_id_too_long"
                )
            ) || c.name.ends_with("without an id");
            assert_eq!(key.starts_with("invalid:"), synthetic, "{}: {key}", c.name);
        }
    }
}

#[test]
fn synthetic_keys_separate_bodies_and_ids() {
    let rules = rules(DedupStrategy::MessageId);
    let key = |id: Option<&str>, body: &[u8]| {
        let m = delivered(&msg(id, json!({}), body.to_vec()));
        parse(m, &rules)
            .expect_err("no usable id")
            .envelope
            .message_id
    };
    // One bad message, one row however often it comes; different ones, different rows.
    assert_eq!(key(None, b"{}"), key(None, b"{}"));
    assert_ne!(key(None, b"{}"), key(None, b"[]"));
    assert_ne!(key(Some(" "), b"{}"), key(Some("  "), b"{}"));
}

#[test]
fn death_counts_saturate_instead_of_overflowing() {
    let m = delivered(&msg(
        Some("m"),
        json!({ "x-death": [{"count": u64::MAX}, {"count": u64::MAX}, {"count": 1}] }),
        b"{}".to_vec(),
    ));
    let e = parse(m, &rules(DedupStrategy::MessageId)).expect("valid");
    assert_eq!(e.death_count, u64::MAX);
}

/// AMQP values JSON cannot hold as such (byte arrays, decimals, timestamps, text that is not
/// UTF-8) reach the parser converted, and are classified like their JSON forms.
// The conversion is reached through the `fuzzing` hooks (`--all-features`, as the tests run).
#[cfg(feature = "fuzzing")]
#[test]
fn amqp_header_values_are_classified_after_conversion() {
    use lapin::types::{AMQPValue, DecimalValue, FieldTable, LongString};

    let cases: [(&str, AMQPValue, Expect); 8] = [
        (
            "version not UTF-8",
            AMQPValue::LongString(LongString::from(vec![0xff, b'1'])),
            Expect::Parked("malformed_version"),
        ),
        (
            "version decimal",
            AMQPValue::DecimalValue(DecimalValue {
                scale: 1,
                value: 10,
            }),
            Expect::Parked("malformed_version"),
        ),
        (
            "version byte array",
            AMQPValue::ByteArray(vec![1].into()),
            // Hex text "01", which reads as 1.
            Expect::Processed("Thing"),
        ),
        (
            "version timestamp",
            AMQPValue::Timestamp(2),
            Expect::Parked("unsupported_version"),
        ),
        (
            "version unsigned byte",
            AMQPValue::ShortShortUInt(1),
            Expect::Processed("Thing"),
        ),
        (
            "version NaN",
            AMQPValue::Double(f64::NAN),
            // JSON has no NaN: it becomes null, which means "absent".
            Expect::Processed("Thing"),
        ),
        ("version void", AMQPValue::Void, Expect::Processed("Thing")),
        (
            "version table",
            AMQPValue::FieldTable(FieldTable::default()),
            Expect::Parked("malformed_version"),
        ),
    ];
    let rules = rules(DedupStrategy::MessageId);
    for (name, value, expect) in cases {
        let mut table = FieldTable::default();
        table.insert(VERSION_HEADER.into(), value);
        let m = AmqpMessage {
            message_id: Some("m".into()),
            kind: Some("Thing".into()),
            headers: headers_json(&table),
            body: b"{}".to_vec(),
            ..AmqpMessage::default()
        };
        assert_eq!(classify(&m, &rules).1, expect, "{name}");
    }
}

/// Two key headers that differ only in bytes that are not UTF-8 are two messages. Both arrive
/// with U+FFFD in place of those bytes, so neither may be accepted as a key (the second one's
/// effect would be skipped as a duplicate): both are refused and parked.
#[cfg(feature = "fuzzing")]
#[test]
fn key_headers_that_are_not_utf8_are_refused_not_collided() {
    use lapin::types::{AMQPValue, FieldTable, LongString};

    let rules = rules(DedupStrategy::Header(EVENT_ID.into()));
    let key = |raw: &[u8]| {
        let mut table = FieldTable::default();
        table.insert(
            EVENT_ID.into(),
            AMQPValue::LongString(LongString::from(raw.to_vec())),
        );
        let m = AmqpMessage {
            headers: headers_json(&table),
            body: b"{}".to_vec(),
            ..AmqpMessage::default()
        };
        classify(&m, &rules).1
    };
    assert_eq!(key(&[b'e', 0xff]), Expect::Parked("malformed_message_id"));
    assert_eq!(key(&[b'e', 0xfe]), Expect::Parked("malformed_message_id"));
    // Valid UTF-8 in the same header is a key.
    assert_eq!(key("e-\u{e9}".as_bytes()), Expect::Processed("unknown"));
}

/// `table` as the library converts a delivery's headers: encoded as on the wire, then
/// parsed and converted.
#[cfg(feature = "fuzzing")]
fn headers_json(table: &lapin::types::FieldTable) -> Map<String, Value> {
    let encoded = lapin::types::generation::gen_field_table(table)(Vec::new().into())
        .expect("encodes")
        .write;
    convert_encoded_headers(&encoded).expect("one table").0
}

/// Starts a consumer with `dedup`, publishes `cases` and then one valid message, and checks
/// from the database and the broker that every case ended as expected and nothing was lost.
async fn run_cases(tag: &str, dedup: DedupStrategy, cases: Vec<Case>, last: OutgoingMessage) {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology(tag));
    config.envelope = rules(dedup);
    let rules = config.envelope.clone();
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);

    let mut expected: HashMap<String, (&str, Expect, &OutgoingMessage)> = HashMap::new();
    for c in &cases {
        let (key, got) = classify(&delivered(&c.message), &rules);
        assert_eq!(got, c.expect, "{}", c.name);
        let clash = expected.insert(key.clone(), (c.name, c.expect, &c.message));
        assert!(clash.is_none(), "{}: key {key} used twice", c.name);
    }
    for c in &cases {
        env.publish(&topology, &c.message).await;
    }
    // Published after every malformed one: processed only if the consumer kept going.
    let (last_key, _) = classify(&delivered(&last), &rules);
    env.publish(&topology, &last).await;
    let published = cases.len() + 1;

    let parked_count = cases
        .iter()
        .filter(|c| matches!(c.expect, Expect::Parked(_)))
        .count();
    let processed_count = published - parked_count;
    env.wait_for_record("svc", &last_key, "PROCESSED", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    let parked = env
        .take_parked(&topology, u32::try_from(parked_count).expect("small"))
        .await;
    inbox_testkit::env::wait_for("every processed message", async || {
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE status = 'PROCESSED'")
            .await
            >= i64::try_from(processed_count).expect("small")
    })
    .await;
    let stats = consumer.stop().await;

    for (key, (name, expect, original)) in &expected {
        let row = env
            .record("svc", key)
            .await
            .unwrap_or_else(|| panic!("{name}: row {key} recorded"));
        match expect {
            Expect::Parked(code) => {
                assert_eq!(row.status, InboxStatus::PermanentFailed, "{name}");
                assert_eq!(row.last_error_code.as_deref(), Some(*code), "{name}");
                assert_eq!(row.processing_attempt, 1, "{name}");
                let copies: Vec<_> = parked
                    .iter()
                    .filter(|p| header(p, parking_headers::INBOX_KEY) == Some(key.as_str()))
                    .collect();
                assert_eq!(copies.len(), 1, "{name}: parked once");
                let copy = copies[0];
                assert_eq!(
                    header(copy, parking_headers::ERROR_CODE),
                    Some(*code),
                    "{name}"
                );
                assert_eq!(
                    header(copy, parking_headers::STATUS),
                    Some("PERMANENT_FAILED"),
                    "{name}"
                );
                assert_eq!(
                    copy.body, original.body,
                    "{name}: the original body is parked"
                );
                assert_eq!(env.effects(key).await, 0, "{name}: no effect");
            }
            Expect::Processed(ty) => {
                assert_eq!(row.status, InboxStatus::Processed, "{name}");
                assert_eq!(row.message_type, *ty, "{name}");
                assert_eq!(row.last_error_code, None, "{name}");
                assert_eq!(env.effects(key).await, 1, "{name}: applied once");
            }
        }
    }

    // Nothing lost, nothing doubled: every publish is parked or processed, exactly once.
    assert_eq!(parked.len(), parked_count, "parked copies");
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE status = 'PROCESSED'")
            .await,
        i64::try_from(processed_count).expect("small")
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox").await,
        i64::try_from(published).expect("small"),
        "one row per published message"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.handler_calls").await,
        i64::try_from(processed_count).expect("small"),
        "no handler saw a refused message"
    );
    assert_eq!(stats.received, published as u64);
    assert_eq!(stats.parked, parked_count as u64);
    assert_eq!(stats.processed, processed_count as u64);
    assert_eq!(stats.unrecorded + stats.retried, 0);
    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.retry, depths.parking), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_recorded_and_parked_by_message_id() {
    run_cases(
        "malformed-id",
        DedupStrategy::MessageId,
        message_id_cases(),
        thing("after", 1),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_recorded_and_parked_by_header() {
    let mut last = thing("after", 1);
    last.headers.insert(EVENT_ID.into(), json!("e-after"));
    run_cases(
        "malformed-header",
        DedupStrategy::Header(EVENT_ID.into()),
        header_cases(),
        last,
    )
    .await;
}

/// The inbox key must be refused (control character) and the message parked; the original id
/// travels in the recorded headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_id_with_a_nul_is_parked() {
    run_cases(
        "nul-id",
        DedupStrategy::MessageId,
        vec![case(
            "message id with a NUL",
            msg(Some("a\u{0}b"), json!({}), body("nul id")),
            Expect::Parked("malformed_message_id"),
        )],
        thing("after", 1),
    )
    .await;
}

/// A NUL in an ordinary header does not make a message malformed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_with_a_nul_is_processed() {
    run_cases(
        "nul-header",
        DedupStrategy::MessageId,
        vec![case(
            "header with a NUL",
            msg(
                Some("nul-header"),
                json!({"x-note": "a\u{0}b"}),
                body("nul header"),
            ),
            Expect::Processed("Thing"),
        )],
        thing("after", 1),
    )
    .await;
}
