//! Producer-controlled fields the inbox stores, end to end: values too long to store or index
//! are refused and parked under their own key, never requeued forever; and a republish that
//! writes the same JSON differently is a duplicate, not a payload conflict.

// Shared with the other integration tests; not every helper is used here.

use inbox_testkit::env::{TestEnv, header, sha256, thing};
use rabbit_inbox::{
    EnvelopeRules, InboxStatus, broker::OutgoingMessage, canonical_json::canonical_json,
    envelope::AGGREGATE_ID_HEADER, envelope::AGGREGATE_TYPE_HEADER, envelope::AmqpMessage,
    envelope::CAUSATION_HEADER, envelope::TENANT_HEADER, envelope::TRACEPARENT_HEADER,
    envelope::TYPE_HEADER, envelope::parse, status::PAYLOAD_CONFLICT, status::parking_headers,
};
use serde_json::{Value, json};

/// A `Thing` with id `id` (if any) and `headers`, its body naming the case.
fn msg(id: Option<&str>, headers: Value, case: &str) -> OutgoingMessage {
    OutgoingMessage {
        message_id: id.map(str::to_owned),
        kind: Some("Thing".into()),
        correlation_id: None,
        headers: headers.as_object().cloned().unwrap_or_default(),
        body: json!({ "case": case }).to_string().into_bytes(),
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
        body: m.body.clone(),
        redelivered: false,
        headers_truncated: None,
    }
}

/// `len` bytes of `c`.
fn long(c: char, len: usize) -> String {
    c.to_string().repeat(len)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_producer_fields_are_parked_not_requeued_forever() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("oversized"));
    // The AMQP correlation-id is a short string (at most 255 bytes): a lower limit lets one be
    // too long. Small header limit: the publish stays far below any frame size.
    config.envelope.field_limits.correlation_id = 64;
    config.envelope.field_limits.headers = 16 * 1024;
    let rules = config.envelope.clone();
    let topology = config.topology.clone();
    env.declare(&config).await;

    let mut typed = msg(
        Some("type"),
        json!({ TYPE_HEADER: long('t', 4096) }),
        "type",
    );
    typed.kind = None;
    let mut correlated = msg(Some("correlation"), json!({}), "correlation");
    correlated.correlation_id = Some(long('c', 200));
    let mut big_headers = msg(Some("headers"), json!({}), "headers");
    big_headers.headers = (0..10)
        .map(|i| (format!("x-big-{i}"), json!(long('h', 2000))))
        .collect();
    // (message, code, what the failure message names)
    let cases: Vec<(OutgoingMessage, &str, &str)> = vec![
        (
            msg(
                Some("aggregate-id"),
                json!({ AGGREGATE_TYPE_HEADER: "Order", AGGREGATE_ID_HEADER: long('a', 4096) }),
                "aggregate-id",
            ),
            "field_too_long",
            AGGREGATE_ID_HEADER,
        ),
        (
            msg(
                Some("aggregate-type"),
                json!({ AGGREGATE_TYPE_HEADER: long('y', 4096), AGGREGATE_ID_HEADER: "o-1" }),
                "aggregate-type",
            ),
            "field_too_long",
            AGGREGATE_TYPE_HEADER,
        ),
        (
            msg(
                Some("causation"),
                json!({ CAUSATION_HEADER: long('k', 4096) }),
                "causation",
            ),
            "field_too_long",
            CAUSATION_HEADER,
        ),
        (
            msg(
                Some("tenant"),
                json!({ TENANT_HEADER: long('n', 4096) }),
                "tenant",
            ),
            "field_too_long",
            TENANT_HEADER,
        ),
        (
            msg(
                Some("traceparent"),
                json!({ TRACEPARENT_HEADER: format!("00-{}-01", long('f', 4096)) }),
                "traceparent",
            ),
            "field_too_long",
            TRACEPARENT_HEADER,
        ),
        (typed, "field_too_long", "message type"),
        (correlated, "field_too_long", "correlation-id"),
        (big_headers, "headers_too_large", "headers"),
        // Refused for its missing id; its oversized aggregate id must not stop the record.
        (
            msg(
                None,
                json!({ AGGREGATE_ID_HEADER: long('z', 4096) }),
                "no id, long aggregate id",
            ),
            "missing_message_id",
            "message-id",
        ),
    ];
    let keys: Vec<String> = cases
        .iter()
        .map(|(m, code, _)| {
            let invalid = parse(delivered(m), &rules).expect_err("refused");
            assert_eq!(invalid.reason.code(), *code, "{}", invalid.detail);
            invalid.envelope.message_id
        })
        .collect();

    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);
    for (m, _, _) in &cases {
        env.publish(&topology, m).await;
    }
    // Processed only if the consumer got past every refused message.
    env.publish(&topology, &thing("after", 1)).await;
    env.wait_for_record("svc", "after", "PROCESSED", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    let parked = env
        .take_parked(&topology, u32::try_from(cases.len()).expect("small"))
        .await;
    let stats = consumer.stop().await;

    for ((m, code, field), key) in cases.iter().zip(&keys) {
        if m.message_id.is_some() {
            assert_eq!(m.message_id.as_ref(), Some(key), "a usable id is kept");
        } else {
            assert!(key.starts_with("invalid:"), "{key}");
        }
        let row = env
            .record("svc", key)
            .await
            .unwrap_or_else(|| panic!("{key}: row recorded"));
        assert_eq!(row.status, InboxStatus::PermanentFailed, "{key}");
        assert_eq!(row.last_error_code.as_deref(), Some(*code), "{key}");
        assert_eq!(row.processing_attempt, 1, "{key}: recorded once");
        let error = row.last_error_message.unwrap_or_default();
        assert!(error.contains(field), "{key}: {error}");
        let copies: Vec<&AmqpMessage> = parked
            .iter()
            .filter(|p| header(p, parking_headers::INBOX_KEY) == Some(key.as_str()))
            .collect();
        assert_eq!(copies.len(), 1, "{key}: parked once");
        assert_eq!(header(copies[0], parking_headers::ERROR_CODE), Some(*code));
        assert_eq!(copies[0].body, m.body, "{key}: the original body is parked");
        // The parked copy keeps the original headers, for a redrive after a fix.
        for (name, value) in &m.headers {
            assert_eq!(copies[0].headers.get(name), Some(value), "{key}: {name}");
        }
    }
    // What the rows hold is cut to the limits.
    let id_row = env.record("svc", "aggregate-id").await.expect("row");
    assert_eq!(id_row.aggregate_id, Some(long('a', 255)));
    assert_eq!(id_row.aggregate_type.as_deref(), Some("Order"));
    let no_id_row = env.record("svc", &keys[8]).await.expect("row");
    assert_eq!(no_id_row.aggregate_id, Some(long('z', 255)));
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE greatest(octet_length(message_type), \
               octet_length(aggregate_type), octet_length(aggregate_id), \
               octet_length(correlation_id), octet_length(causation_id), \
               octet_length(tenant_id), octet_length(trace_id)) > 255"
        )
        .await,
        0
    );
    assert!(
        env.scalar(
            "SELECT max(octet_length(headers::text))::int8 FROM {s}.message_inbox \
             WHERE message_id = 'headers'"
        )
        .await
            < 1024,
        "oversized headers are not stored"
    );

    // No loop: every message was received once and settled for good.
    let published = cases.len() as u64 + 1;
    assert_eq!(stats.received, published, "each delivery seen once");
    assert_eq!(stats.parked, cases.len() as u64);
    assert_eq!(stats.processed, 1);
    assert_eq!(stats.unrecorded + stats.retried, 0);
    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.retry, depths.parking), (0, 0, 0));
    assert_eq!(env.effects("after").await, 1);
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.handler_calls").await,
        1,
        "no handler saw a refused message"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserialized_equal_json_is_a_duplicate_and_a_changed_body_a_conflict() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("canonical"));
    assert_eq!(config.envelope, EnvelopeRules::default());
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);

    let copy = |body: &str| OutgoingMessage {
        message_id: Some("order-1".into()),
        kind: Some("Thing".into()),
        correlation_id: None,
        headers: Default::default(),
        body: body.as_bytes().to_vec(),
    };
    let first = copy(
        r#"{"order_id":"o-1","amount":12.50,"items":[{"sku":"x","qty":1}],"note":"caf\u00e9"}"#,
    );
    // The same value: other key order, whitespace, number forms and escapes.
    let rewritten = copy(
        "{\n  \"note\": \"café\",\n  \"items\": [ { \"qty\": 1.0, \"sku\": \"x\" } ],\n  \
         \"amount\": 1.25e1,\n  \"order_id\": \"o\\u002d1\"\n}",
    );
    let changed =
        copy(r#"{"order_id":"o-1","amount":13,"items":[{"sku":"x","qty":1}],"note":"café"}"#);
    assert_ne!(first.body, rewritten.body);

    env.publish(&topology, &first).await;
    env.wait_for_record("svc", "order-1", "PROCESSED", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    env.publish(&topology, &rewritten).await;
    let row = env
        .wait_for_record("svc", "order-1", "second delivery noted", |r| {
            r.delivery_count == 2
        })
        .await;
    assert_eq!(row.payload_conflicts, 0, "an equal body is no conflict");
    assert_eq!(row.status, InboxStatus::Processed);
    let value: Value = serde_json::from_slice(&first.body).expect("JSON");
    assert_eq!(
        row.payload_sha256,
        sha256(canonical_json(&value).as_bytes()),
        "the row holds the canonical hash"
    );
    assert_eq!(env.depths(&topology).await.parking, 0);

    env.publish(&topology, &changed).await;
    let parked = env.take_parked(&topology, 1).await;
    let stats = consumer.stop().await;

    assert_eq!(parked.len(), 1);
    assert_eq!(
        header(&parked[0], parking_headers::ERROR_CODE),
        Some(PAYLOAD_CONFLICT)
    );
    assert_eq!(parked[0].body, changed.body, "the changed copy is parked");
    let row = env.record("svc", "order-1").await.expect("row");
    assert_eq!(
        row.payload_conflicts, 1,
        "a changed body still is a conflict"
    );
    assert_eq!(row.status, InboxStatus::Processed);
    assert_eq!(env.effects("order-1").await, 1, "applied once");
    assert_eq!(stats.duplicates, 1);
    assert_eq!(stats.parked, 1);
    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.retry, depths.parking), (0, 0, 0));
}
