//! Integration tests of the inbox against a real PostgreSQL and a real RabbitMQ: claims and
//! effects commit together, deliveries are settled only after the outcome is durable, and
//! duplicates of every origin (redelivery, republish, replay, a second consumer) are acked
//! without applying the effect again.

use std::time::Duration;

use inbox_testkit::env::{
    BatchRule, Gate, Latch, OpenOnDrop, Rule, TestEnv, expected_idempotency_key, header, message,
    sha256, thing, wait_for,
};
use rabbit_inbox::{
    EnvelopeRules, ErrorKind, InboxStatus, broker::OutgoingMessage, broker::QueueDepths,
    envelope::AmqpMessage, envelope::VERSION_HEADER, status::PAYLOAD_CONFLICT,
    status::parking_headers, store::Claim,
};
use serde_json::json;
use sqlx::AssertSqlSafe;

const EMPTY: QueueDepths = QueueDepths {
    work: 0,
    retry: 0,
    parking: 0,
};

fn is(status: InboxStatus) -> impl Fn(&rabbit_inbox::store::InboxRecord) -> bool {
    move |r| r.status == status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_delivery_inserts_inbox_row_and_applies_effect() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("first"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);

    let msg = thing("m1", 1);
    env.publish(&topology, &msg).await;
    let row = env
        .wait_for_record("svc", "m1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;

    assert_eq!(row.consumer_name, "svc");
    assert_eq!(row.message_type, "Thing");
    assert_eq!(row.message_version, 1);
    assert_eq!(row.processing_attempt, 1);
    assert_eq!(row.delivery_count, 1);
    assert_eq!(row.payload_sha256, sha256(&msg.body));
    assert_eq!(row.payload_conflicts, 0);
    assert!(row.processed_at.is_some());
    assert_eq!(row.last_error_code, None);
    assert_eq!(env.effects("m1").await, 1);
    let body: String = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT body FROM \"{}\".effects WHERE message_id = 'm1'",
        env.schema
    )))
    .fetch_one(&env.pool)
    .await
    .expect("effect row");
    assert_eq!(body.as_bytes(), &msg.body[..]);
    // The default payload storage keeps no body for processed messages.
    let mut conn = env.pool.acquire().await.expect("connection");
    let kept = env
        .store
        .find_payload(&mut conn, "svc", "m1")
        .await
        .expect("read payload")
        .expect("row exists");
    assert_eq!(kept.stored, None);
    assert_eq!(stats.received, 1);
    assert_eq!(stats.processed, 1);
    assert_eq!(stats.duplicates, 0);
    assert_eq!(env.depths(&topology).await, EMPTY, "the delivery was acked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_delivery_after_processed_does_not_reapply_effect() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("dup"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);

    env.publish(&topology, &thing("m1", 1)).await;
    env.wait_for_record("svc", "m1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    // The producer publishes the same message again (e.g. its outbox retried).
    env.publish(&topology, &thing("m1", 1)).await;
    let row = env
        .wait_for_record("svc", "m1", "second delivery noted", |r| {
            r.delivery_count == 2
        })
        .await;
    wait_for("the duplicate to be settled", async || {
        consumer.snapshot().duplicates == 1
    })
    .await;
    let stats = consumer.stop().await;

    assert_eq!(env.effects("m1").await, 1, "the effect was applied once");
    assert_eq!(row.status, InboxStatus::Processed);
    assert_eq!(row.processing_attempt, 1);
    assert_eq!(env.calls("svc", "m1").await.len(), 1, "handler ran once");
    assert_eq!(stats.processed, 1);
    assert_eq!(stats.duplicates, 1);
    assert_eq!(stats.retried + stats.parked + stats.unrecorded, 0);
    assert_eq!(
        env.depths(&topology).await,
        EMPTY,
        "both deliveries acked; nothing retried or parked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_delivery_is_acked() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("dup-ack"));
    // Let both copies land in one batch: the processor must still settle both.
    config.lanes = 1;
    config.max_batch_delay = Duration::from_millis(200);
    let topology = config.topology.clone();
    env.declare(&config).await;
    env.publish(&topology, &thing("m1", 1)).await;
    env.publish(&topology, &thing("m1", 1)).await;
    env.publish(&topology, &thing("m2", 2)).await;

    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);
    wait_for("3 deliveries settled", async || {
        let s = consumer.snapshot();
        s.processed + s.duplicates == 3
    })
    .await;
    let stats = consumer.stop().await;

    assert_eq!(stats.received, 3);
    assert_eq!(stats.processed, 2);
    assert_eq!(stats.duplicates, 1);
    assert_eq!(stats.settle_failures, 0, "the broker took every ack");
    // The consumer's connection is closed: an unacked delivery would be ready again now.
    assert_eq!(
        env.depths(&topology).await,
        EMPTY,
        "no delivery left unacked"
    );
    assert_eq!(env.effects("m1").await, 1);
    assert_eq!(env.effects("m2").await, 1);
    let row = env.record("svc", "m1").await.expect("row");
    assert_eq!(row.delivery_count, 2);
    assert_eq!(row.status, InboxStatus::Processed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_failure_does_not_mark_processed() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("retry"));
    config.retry.max_attempts = 1000;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("m1", Rule::Retryable);
    let consumer = env.start(config, handler);

    env.publish(&topology, &thing("m1", 1)).await;
    // Failed, went to the retry queue, came back and failed again.
    let failed = env
        .wait_for_record("svc", "m1", "RETRYABLE_FAILED twice", |r| {
            r.status == InboxStatus::RetryableFailed && r.processing_attempt >= 2
        })
        .await;
    assert_eq!(failed.last_error_code.as_deref(), Some("test_retryable"));
    assert!(
        failed
            .last_error_message
            .as_deref()
            .is_some_and(|m| m.contains("planned retryable failure of m1")),
        "{:?}",
        failed.last_error_message
    );
    assert!(failed.first_failed_at.is_some() && failed.last_failed_at.is_some());
    assert_eq!(
        failed.delivery_count, failed.processing_attempt,
        "each failed attempt was one delivery, counted once"
    );
    assert_eq!(failed.processed_at, None);
    assert_eq!(
        env.effects("m1").await,
        0,
        "a failed attempt leaves no effect"
    );
    // The failed row keeps the body for operators.
    let mut conn = env.pool.acquire().await.expect("connection");
    let kept = env
        .store
        .find_payload(&mut conn, "svc", "m1")
        .await
        .expect("read")
        .expect("row");
    let payload = kept.stored.map(|p| p.bytes);
    assert_eq!(payload.as_deref(), Some(&thing("m1", 1).body[..]));
    drop(conn);

    // The dependency recovers: the next retry succeeds.
    plan.clear_id("m1");
    let done = env
        .wait_for_record("svc", "m1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;

    assert_eq!(env.effects("m1").await, 1, "applied exactly once");
    assert!(done.processing_attempt >= 3, "{done:?}");
    assert_eq!(
        done.delivery_count, done.processing_attempt,
        "each attempt was one delivery, counted once"
    );
    let calls = env.calls("svc", "m1").await;
    assert_eq!(calls.len(), done.processing_attempt as usize);
    let attempts: Vec<i32> = calls.iter().map(|c| c.0).collect();
    assert_eq!(
        attempts,
        (1..=done.processing_attempt).collect::<Vec<_>>(),
        "one handler call per attempt"
    );
    let (last_attempt, _, deaths) = calls.last().cloned().expect("a call");
    assert!(
        deaths >= 1,
        "the successful attempt came back through the retry queue (x-death)"
    );
    let effect_attempt = env
        .scalar("SELECT max(attempt)::int8 FROM {s}.effects WHERE message_id = 'm1'")
        .await;
    assert_eq!(effect_attempt, i64::from(last_attempt));
    assert!(stats.retried >= 2);
    assert_eq!(stats.processed, 1);
    assert_eq!(stats.parked, 0);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn db_rollback_removes_inbox_row_and_effect_together() {
    let env = TestEnv::new().await;
    let store = &env.store;
    let envelope = rabbit_inbox::envelope::parse(
        AmqpMessage {
            message_id: Some("m1".into()),
            kind: Some("Thing".into()),
            body: br#"{"n":1}"#.to_vec(),
            ..AmqpMessage::default()
        },
        &EnvelopeRules::default(),
    )
    .expect("valid message");
    let insert_effect = format!(
        "INSERT INTO \"{}\".effects (message_id, consumer_name, message_type, attempt, body) \
         VALUES ('m1', 'svc', 'Thing', 1, '{{}}')",
        env.schema
    );

    // Rolled back: neither the claim nor the effect survives.
    let mut tx = env.pool.begin().await.expect("begin");
    let claim = store
        .try_claim(&mut tx, "svc", &envelope, false)
        .await
        .expect("claim");
    assert_eq!(claim, Claim::Claimed);
    sqlx::query(AssertSqlSafe(insert_effect.clone()))
        .execute(&mut *tx)
        .await
        .expect("effect");
    let marked = store
        .mark_processed(&mut tx, "svc", &["m1"], false)
        .await
        .expect("mark processed");
    assert_eq!(marked, 1);
    tx.rollback().await.expect("rollback");
    assert_eq!(env.record("svc", "m1").await, None, "inbox row rolled back");
    assert_eq!(env.effects("m1").await, 0, "effect rolled back");

    // Committed: both exist, and a later claim sees the processed row.
    let mut tx = env.pool.begin().await.expect("begin");
    let claim = store
        .try_claim(&mut tx, "svc", &envelope, false)
        .await
        .expect("claim");
    assert_eq!(claim, Claim::Claimed, "the rolled-back claim left nothing");
    sqlx::query(AssertSqlSafe(insert_effect))
        .execute(&mut *tx)
        .await
        .expect("effect");
    store
        .mark_processed(&mut tx, "svc", &["m1"], false)
        .await
        .expect("mark processed");
    tx.commit().await.expect("commit");
    let row = env.record("svc", "m1").await.expect("row committed");
    assert_eq!(row.status, InboxStatus::Processed);
    assert_eq!(env.effects("m1").await, 1);

    let mut tx = env.pool.begin().await.expect("begin");
    match store
        .try_claim(&mut tx, "svc", &envelope, false)
        .await
        .expect("claim")
    {
        Claim::Existing(record) => assert_eq!(record.status, InboxStatus::Processed),
        Claim::Claimed => panic!("a committed row must not be claimed again"),
        other => panic!("unexpected claim {other:?}"),
    }
    tx.rollback().await.expect("rollback");
}

/// While one transaction holds an uncommitted claim, a second claimer of the same key waits
/// on it (observed in `pg_stat_activity`, not by timing) and then sees its outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claim_waits_for_the_first_transaction() {
    let env = TestEnv::new().await;
    let envelope = rabbit_inbox::envelope::parse(
        AmqpMessage {
            message_id: Some("m1".into()),
            body: br#"{"n":1}"#.to_vec(),
            ..AmqpMessage::default()
        },
        &EnvelopeRules::default(),
    )
    .expect("valid message");

    let mut first = env.pool.begin().await.expect("begin");
    let claim = env
        .store
        .try_claim(&mut first, "svc", &envelope, false)
        .await
        .expect("claim");
    assert_eq!(claim, Claim::Claimed);

    let mut second = env.pool.begin().await.expect("begin");
    let second_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *second)
        .await
        .expect("pid");
    let store = env.store.clone();
    let env_ref = envelope.clone();
    let waiter = tokio::spawn(async move {
        let claim = store.try_claim(&mut second, "svc", &env_ref, false).await;
        let _ = second.rollback().await;
        claim
    });
    wait_for("the second claim to wait on a lock", async || {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(second_pid)
                .fetch_optional(&env.pool)
                .await
                .expect("pg_stat_activity")
                .flatten();
        waiting.as_deref() == Some("Lock")
    })
    .await;
    assert!(!waiter.is_finished(), "the second claim must wait");

    env.store
        .mark_processed(&mut first, "svc", &["m1"], false)
        .await
        .expect("mark");
    first.commit().await.expect("commit");
    let claim = waiter.await.expect("join").expect("second claim");
    match claim {
        Claim::Existing(record) => assert_eq!(record.status, InboxStatus::Processed),
        Claim::Claimed => panic!("two transactions claimed the same key"),
        other => panic!("unexpected claim {other:?}"),
    }
}

#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_commit_before_ack_leads_to_redelivery_and_dedup() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("crash"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);
    consumer.faults.drop_connection_after_commit_of("m1");

    env.publish(&topology, &thing("m1", 1)).await;
    // Committed, then the connection died before the ack: the broker redelivers, and the
    // redelivery finds the committed row.
    let row = env
        .wait_for_record("svc", "m1", "redelivered after the crash", |r| {
            r.status == InboxStatus::Processed && r.delivery_count >= 2
        })
        .await;
    wait_for("the redelivery to be acked as a duplicate", async || {
        consumer.snapshot().duplicates >= 1
    })
    .await;
    // The consumer keeps working on the new connection.
    env.publish(&topology, &thing("m2", 2)).await;
    env.wait_for_record("svc", "m2", "PROCESSED", is(InboxStatus::Processed))
        .await;
    assert_eq!(consumer.faults.pending(), 0, "the fault fired");
    let stats = consumer.stop().await;

    assert!(stats.sessions >= 2, "the consumer reconnected: {stats:?}");
    assert!(stats.settle_failures >= 1, "m1 was committed but not acked");
    assert_eq!(stats.processed, 2);
    assert_eq!(stats.duplicates, 1);
    assert_eq!(
        env.effects("m1").await,
        1,
        "the effect was not applied again"
    );
    assert_eq!(env.calls("svc", "m1").await.len(), 1, "handler ran once");
    assert_eq!(row.processing_attempt, 1);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_side_effect_uses_idempotency_key() {
    let env = TestEnv::new().await;
    let config = env.config("c1", env.topology("idem-1"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    // The first attempt calls the external system, then fails; the retry calls it again.
    plan.for_id("m1", Rule::FailAttempts(1));
    let consumer = env.start(config, handler);

    // Published twice: a duplicate redelivery on top of the retry.
    env.publish(&topology, &thing("m1", 1)).await;
    env.publish(&topology, &thing("m1", 1)).await;
    env.wait_for_record("c1", "m1", "three deliveries, processed", |r| {
        r.status == InboxStatus::Processed && r.delivery_count == 3
    })
    .await;
    let stats = consumer.stop().await;

    let calls = env.calls("c1", "m1").await;
    assert_eq!(
        calls.iter().map(|c| c.0).collect::<Vec<_>>(),
        vec![1, 2],
        "attempt 1 failed, attempt 2 succeeded, the third copy was a duplicate"
    );
    let key = expected_idempotency_key("c1", "m1");
    assert!(
        calls.iter().all(|(_, k, _)| *k == key),
        "every attempt used the same key: {calls:?}"
    );
    assert_eq!(stats.duplicates, 1, "{stats:?}");
    assert_eq!(env.effects("m1").await, 1);
    // The external system deduplicated by the key: one entry, called twice.
    let ledger: Vec<(String, i32)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT idempotency_key, calls FROM \"{}\".external_ledger",
        env.schema
    )))
    .fetch_all(&env.pool)
    .await
    .expect("ledger");
    assert_eq!(ledger, vec![(key.clone(), 2)]);

    // Another consumer of the same message has its own key.
    let config = env.config("c2", env.topology("idem-2"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);
    env.publish(&topology, &thing("m1", 1)).await;
    env.wait_for_record("c2", "m1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    consumer.stop().await;
    let calls = env.calls("c2", "m1").await;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].1, expected_idempotency_key("c2", "m1"));
    assert_ne!(calls[0].1, key, "keys differ across consumers");
    assert_eq!(env.effects("m1").await, 2, "one effect per consumer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_message_is_marked_and_dead_lettered() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("poison"));
    config.retry.max_attempts = 3;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    // Every `Rejected` message breaks a business rule; `forever` hits an outage that lasts.
    plan.for_type("Rejected", Rule::Permanent);
    plan.for_id("forever", Rule::Retryable);
    let consumer = env.start(config, handler);

    let rejected = message(Some("perm"), "Rejected", &json!({"id": "perm"}));
    env.publish(&topology, &rejected).await;
    env.publish(&topology, &thing("forever", 2)).await;
    env.publish(&topology, &thing("fine", 3)).await;
    let perm = env
        .wait_for_record(
            "svc",
            "perm",
            "PERMANENT_FAILED",
            is(InboxStatus::PermanentFailed),
        )
        .await;
    let poisoned = env
        .wait_for_record("svc", "forever", "POISONED", is(InboxStatus::Poisoned))
        .await;
    let parked = env.take_parked(&topology, 2).await;
    let stats = consumer.stop().await;

    assert_eq!(
        perm.processing_attempt, 1,
        "a permanent failure is not retried"
    );
    assert_eq!(perm.last_error_code.as_deref(), Some("test_permanent"));
    assert_eq!(
        poisoned.processing_attempt, 3,
        "the attempt budget was spent"
    );
    assert_eq!(poisoned.last_error_code.as_deref(), Some("test_retryable"));
    assert_eq!(env.calls("svc", "forever").await.len(), 3);
    assert_eq!(env.effects("perm").await, 0);
    assert_eq!(env.effects("forever").await, 0);
    assert_eq!(env.effects("fine").await, 1);

    assert_eq!(parked.len(), 2, "exactly the two failures are parked");
    for (id, status, code, original) in [
        ("perm", "PERMANENT_FAILED", "test_permanent", &rejected),
        (
            "forever",
            "POISONED",
            "test_retryable",
            &thing("forever", 2),
        ),
    ] {
        let m = parked
            .iter()
            .find(|m| m.message_id.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("{id} is parked"));
        assert_eq!(header(m, parking_headers::STATUS), Some(status));
        assert_eq!(header(m, parking_headers::ERROR_CODE), Some(code));
        assert_eq!(header(m, parking_headers::INBOX_KEY), Some(id));
        assert_eq!(header(m, parking_headers::CONSUMER), Some("svc"));
        assert_eq!(m.body, original.body, "the original body is parked");
        assert_eq!(m.kind, original.kind);
    }
    assert_eq!(stats.parked, 2);
    assert_eq!(
        stats.retried, 2,
        "forever was retried twice before it was poisoned"
    );
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_of_processed_message_is_ignored() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("replay"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);

    let original = thing("m1", 1);
    env.publish(&topology, &original).await;
    env.wait_for_record("svc", "m1", "PROCESSED", is(InboxStatus::Processed))
        .await;

    // A copy of the processed message sits in a dead-letter queue (here: the parking lot),
    // and an operator replays it to the work queue as it is, with its extra headers.
    let mut dead = original.clone();
    dead.headers
        .insert("x-first-death-reason".into(), json!("rejected"));
    env.broker
        .publish("", &topology.parking_queue, &dead)
        .await
        .expect("publish to the dead-letter queue");
    let taken = env
        .take_one(&topology.parking_queue)
        .await
        .expect("the dead-lettered copy");
    let mut replay = OutgoingMessage {
        message_id: taken.message_id.clone(),
        kind: taken.kind.clone(),
        correlation_id: taken.correlation_id.clone(),
        headers: taken.headers.clone(),
        body: taken.body.clone(),
    };
    replay.headers.insert("x-replayed-by".into(), json!("test"));
    env.publish(&topology, &replay).await;

    wait_for("the replay to be acked as a duplicate", async || {
        consumer.snapshot().duplicates == 1
    })
    .await;
    let stats = consumer.stop().await;

    assert_eq!(env.effects("m1").await, 1, "the replay applied nothing");
    assert_eq!(env.calls("svc", "m1").await.len(), 1);
    let row = env.record("svc", "m1").await.expect("row");
    assert_eq!(row.status, InboxStatus::Processed);
    assert_eq!(row.delivery_count, 2);
    assert_eq!(row.payload_conflicts, 0, "extra headers are not a conflict");
    assert_eq!(stats.processed, 1);
    assert_eq!(stats.parked, 0);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_hash_conflict_is_reported() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("conflict"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);

    let first = thing("m1", 1);
    let reused = thing("m1", 999);
    env.publish(&topology, &first).await;
    env.wait_for_record("svc", "m1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    env.publish(&topology, &reused).await;
    let parked = env.take_parked(&topology, 1).await;
    let stats = consumer.stop().await;

    assert_eq!(parked.len(), 1);
    let m = &parked[0];
    assert_eq!(
        header(m, parking_headers::ERROR_CODE),
        Some(PAYLOAD_CONFLICT)
    );
    assert_eq!(header(m, parking_headers::STATUS), Some("PROCESSED"));
    assert_eq!(
        m.body, reused.body,
        "the conflicting copy is the one parked"
    );

    let row = env.record("svc", "m1").await.expect("row");
    assert_eq!(
        row.status,
        InboxStatus::Processed,
        "the row keeps its status"
    );
    assert_eq!(row.payload_conflicts, 1);
    assert_eq!(row.payload_sha256, sha256(&first.body));
    let conflict_sha: Option<Vec<u8>> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT last_conflict_sha256 FROM \"{}\".message_inbox WHERE message_id = 'm1'",
        env.schema
    )))
    .fetch_one(&env.pool)
    .await
    .expect("conflict hash");
    assert_eq!(conflict_sha, Some(sha256(&reused.body)));
    assert_eq!(
        env.effects("m1").await,
        1,
        "effect applied once, from the first body"
    );
    let n = env
        .scalar("SELECT count(*) FROM {s}.effects WHERE body LIKE '%\"n\":1}'")
        .await;
    assert_eq!(n, 1);
    assert_eq!(stats.processed, 1);
    assert_eq!(stats.parked, 1);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicate_delivery_to_two_consumers_applies_effect_once() {
    let env = TestEnv::new().await;
    // Two queues bound to one exchange, consumed under one consumer name: each consumer gets
    // every message, so every message is claimed concurrently twice.
    let exchange = env.exchange_name("fanout");
    let configs: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|q| {
            let topology = env.register(
                rabbit_inbox::Topology::new(format!("t-{}-{q}", env.id))
                    .with_exchange(exchange.clone(), &["#"]),
            );
            let mut config = env.config("shared", topology);
            config.lanes = 3;
            config.batch_size = 8;
            config.prefetch = 16;
            config
        })
        .collect();
    for config in &configs {
        env.declare(config).await;
    }
    let (handler, _plan) = env.handler();
    let consumers: Vec<_> = configs
        .iter()
        .map(|c| env.start(c.clone(), handler.clone()))
        .collect();

    let unique: i64 = 60;
    let mut published = 0u64;
    for i in 0..unique {
        let id = format!("m{i:03}");
        env.broker
            .publish(&exchange, "thing", &thing(&id, i))
            .await
            .expect("publish");
        published += 1;
        // Every third message is published again right away, and every fifth an extra time
        // later, so copies race each other across and within consumers.
        if i % 3 == 0 {
            env.broker
                .publish(&exchange, "thing", &thing(&id, i))
                .await
                .expect("publish");
            published += 1;
        }
    }
    for i in (0..unique).step_by(5) {
        let id = format!("m{i:03}");
        env.broker
            .publish(&exchange, "thing", &thing(&id, i))
            .await
            .expect("publish");
        published += 1;
    }
    let deliveries = 2 * published;
    wait_for("every delivery settled", async || {
        let settled: u64 = consumers
            .iter()
            .map(|c| {
                let s = c.snapshot();
                s.processed + s.duplicates
            })
            .sum();
        settled == deliveries
    })
    .await;
    let mut processed = 0;
    let mut duplicates = 0;
    let mut parked = 0;
    for c in consumers {
        let s = c.stop().await;
        processed += s.processed;
        duplicates += s.duplicates;
        parked += s.parked;
    }

    assert_eq!(processed, unique as u64, "one commit per message");
    assert_eq!(duplicates, deliveries - unique as u64);
    assert_eq!(parked, 0);
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.effects").await,
        unique,
        "one effect per message"
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM (SELECT message_id FROM {s}.effects \
             GROUP BY message_id HAVING count(*) <> 1) x"
        )
        .await,
        0,
        "no message applied twice"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE status = 'PROCESSED'")
            .await,
        unique
    );
    assert_eq!(
        env.scalar("SELECT sum(delivery_count)::int8 FROM {s}.message_inbox")
            .await,
        i64::try_from(deliveries).expect("small"),
        "every delivery was seen by the inbox"
    );
    for config in &configs {
        assert_eq!(env.depths(&config.topology).await, EMPTY);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_messages_are_recorded_and_parked() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("invalid"));
    config.envelope.max_payload_bytes = 1024;
    let rules = config.envelope.clone();
    let topology = config.topology.clone();
    env.declare(&config).await;

    let no_id = message(None, "Thing", &json!({"n": 1}));
    let mut not_json = thing("bad-json", 2);
    not_json.body = b"{not json".to_vec();
    let mut v9 = thing("v9", 3);
    v9.headers.insert(VERSION_HEADER.into(), json!(9));
    let big = message(Some("big"), "Thing", &json!({"blob": "x".repeat(2000)}));
    // The inbox key each one must be recorded under: invalid messages without a usable id
    // get a synthetic key derived from the id and body.
    let key_of = |m: &OutgoingMessage| {
        let invalid = rabbit_inbox::envelope::parse(
            AmqpMessage {
                message_id: m.message_id.clone(),
                kind: m.kind.clone(),
                content_type: Some("application/json".into()),
                headers: m.headers.clone(),
                body: m.body.clone(),
                ..AmqpMessage::default()
            },
            &rules,
        )
        .expect_err("invalid");
        invalid.envelope.message_id
    };
    let cases = [
        (&no_id, "missing_message_id", 1),
        (&not_json, "invalid_json", 1),
        (&v9, "unsupported_version", 9),
        (&big, "payload_too_large", 1),
    ];
    for (m, _, _) in &cases {
        env.publish(&topology, m).await;
    }
    env.publish(&topology, &thing("ok", 5)).await;

    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);
    let parked = env.take_parked(&topology, 4).await;
    env.wait_for_record("svc", "ok", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;

    assert_eq!(
        parked.len(),
        cases.len(),
        "nothing lost: every invalid message is parked"
    );
    assert_eq!(key_of(&not_json), "bad-json", "a usable id is kept");
    assert_eq!(key_of(&v9), "v9");
    assert!(key_of(&no_id).starts_with("invalid:"));
    assert_eq!(
        key_of(&big),
        "big",
        "an oversized body with a usable id is recorded under that id"
    );
    let mut conn = env.pool.acquire().await.expect("connection");
    for (m, code, version) in &cases {
        let key = key_of(m);
        let row = env
            .record("svc", &key)
            .await
            .unwrap_or_else(|| panic!("{code}: row {key} recorded"));
        assert_eq!(row.status, InboxStatus::PermanentFailed, "{code}");
        assert_eq!(row.last_error_code.as_deref(), Some(*code));
        assert_eq!(row.processing_attempt, 1, "{code}");
        assert_eq!(row.message_version, *version, "{code}");
        assert_eq!(row.payload_sha256, sha256(&m.body), "{code}");
        let payload = env
            .store
            .find_payload(&mut conn, "svc", &key)
            .await
            .expect("read")
            .expect("row")
            .stored
            .map(|p| p.bytes);
        if *code == "payload_too_large" {
            assert_eq!(payload, None, "an oversized body is not stored");
        } else {
            assert_eq!(payload.as_deref(), Some(&m.body[..]), "{code}: body kept");
        }
        let copy = parked
            .iter()
            .find(|p| header(p, parking_headers::INBOX_KEY) == Some(key.as_str()))
            .unwrap_or_else(|| panic!("{code}: parked copy"));
        assert_eq!(header(copy, parking_headers::ERROR_CODE), Some(*code));
        assert_eq!(
            header(copy, parking_headers::STATUS),
            Some("PERMANENT_FAILED")
        );
        assert_eq!(copy.body, m.body, "{code}: original body parked");
    }
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox").await,
        5,
        "four invalid rows and one processed"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.effects").await, 1);
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.handler_calls").await,
        1,
        "no handler saw an invalid message"
    );
    assert_eq!(stats.parked, 4);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

/// The database refuses the write that records a handler failure (a `lock_timeout` while the
/// test holds an exclusive lock on the inbox table, queued before the failure is recorded).
/// Nothing durable says what happened, so the delivery must not be acked, retried through the
/// retry queue or parked: it is requeued, and processed once the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_unreachable_when_recording_failure_requeues() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("db-down"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let options = inbox_testkit::env::database_url()
        .parse::<sqlx::postgres::PgConnectOptions>()
        .expect("url")
        .options([("lock_timeout", "300ms")]);
    let consumer_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(6)
        .connect_with(options)
        .await
        .expect("consumer pool");
    let (handler, plan) = env.handler();
    let gate = std::sync::Arc::new(Gate::default());
    plan.for_id("m1", Rule::Gate(gate.clone()));
    let consumer = env.start_with_pool(consumer_pool.clone(), config, handler);

    env.publish(&topology, &thing("m1", 1)).await;
    // The handler runs inside the claim's transaction and waits at the gate.
    tokio::time::timeout(inbox_testkit::env::DEADLINE, gate.entered.notified())
        .await
        .expect("the handler was called");

    // Queue an exclusive lock on the inbox table behind the claim's transaction.
    let mut locker = env.pool.begin().await.expect("begin");
    let locker_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *locker)
        .await
        .expect("pid");
    let lock_sql = format!(
        "LOCK TABLE \"{}\".message_inbox IN ACCESS EXCLUSIVE MODE",
        env.schema
    );
    let locking = tokio::spawn(async move {
        sqlx::query(AssertSqlSafe(lock_sql))
            .execute(&mut *locker)
            .await
            .expect("lock granted");
        locker
    });
    wait_for("the lock request to queue", async || {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(locker_pid)
                .fetch_optional(&env.pool)
                .await
                .expect("pg_stat_activity")
                .flatten();
        waiting.as_deref() == Some("Lock")
    })
    .await;

    // The handler fails; its transaction rolls back, the lock is granted, and recording the
    // failure times out.
    gate.release.notify_one();
    let locker = tokio::time::timeout(inbox_testkit::env::DEADLINE, locking)
        .await
        .expect("lock granted in time")
        .expect("join");
    wait_for("the delivery to be requeued unrecorded", async || {
        consumer.snapshot().unrecorded >= 1
    })
    .await;
    let during = consumer.snapshot();
    assert_eq!(during.retried, 0, "not sent to the retry queue");
    assert_eq!(during.parked, 0, "not parked");
    assert_eq!(during.processed + during.duplicates, 0, "not acked");
    locker.rollback().await.expect("release the lock");

    // The database is back: the requeued message is processed once.
    let row = env
        .wait_for_record("svc", "m1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;
    consumer_pool.close().await;

    assert_eq!(
        row.processing_attempt, 1,
        "the failure was never recorded, so the next attempt is the first on record"
    );
    assert_eq!(
        row.delivery_count, 1,
        "deliveries that could not be recorded left no trace in the inbox"
    );
    assert_eq!(env.effects("m1").await, 1);
    assert!(
        env.calls("svc", "m1").await.len() >= 2,
        "the message came back after the unrecorded failure"
    );
    assert!(stats.unrecorded >= 1);
    assert_eq!(stats.retried, 0);
    assert_eq!(stats.parked, 0);
    assert_eq!(stats.processed, 1);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_with_one_failing_message_commits_the_others() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("batch"));
    config.batch_size = 50;
    config.lanes = 1;
    // All 20 are in the queue before the consumer starts; the generous batch delay lets them
    // all into the first batch (checked below through the handler's call log).
    config.max_batch_delay = Duration::from_secs(2);
    let topology = config.topology.clone();
    env.declare(&config).await;
    let ids: Vec<String> = (0..20).map(|i| format!("m{i:02}")).collect();
    for (n, id) in (0..).zip(&ids) {
        env.publish(&topology, &thing(id, n)).await;
    }
    let (handler, plan) = env.handler();
    plan.for_id("m07", Rule::Permanent);
    let consumer = env.start(config, handler);

    let parked = env.take_parked(&topology, 1).await;
    wait_for("19 processed", async || consumer.snapshot().processed == 19).await;
    let stats = consumer.stop().await;

    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].message_id.as_deref(), Some("m07"));
    assert_eq!(
        header(&parked[0], parking_headers::ERROR_CODE),
        Some("test_permanent")
    );
    for id in &ids {
        let row = env.record("svc", id).await.expect("row");
        if id == "m07" {
            assert_eq!(row.status, InboxStatus::PermanentFailed);
            assert_eq!(
                env.effects(id).await,
                0,
                "the failed message's effect rolled back"
            );
        } else {
            assert_eq!(row.status, InboxStatus::Processed, "{id}");
            assert_eq!(row.processing_attempt, 1, "{id}");
            assert_eq!(env.effects(id).await, 1, "{id} applied exactly once");
        }
    }
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.effects").await, 19);
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.handler_calls WHERE message_id = 'm07'")
            .await,
        1,
        "a permanent failure is not retried"
    );
    // m07 shared a transaction with the messages before it: its failure rolled their work
    // back and they ran again without it. Their effect rows above prove the re-run did not
    // double them.
    assert!(
        env.scalar("SELECT count(*) FROM {s}.handler_calls WHERE message_id < 'm07'")
            .await
            >= 14,
        "m00..m06 ran in m07's batch and again after the rollback"
    );
    assert_eq!(stats.processed, 19);
    assert_eq!(stats.parked, 1);
    assert_eq!(stats.retried, 0);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

/// Publishes a message of type `kind` on aggregate `aggregate` (`x-aggregate-id`) per id.
async fn publish_on_aggregate(
    env: &TestEnv,
    topology: &rabbit_inbox::Topology,
    ids: &[String],
    kind: &str,
    aggregate: &str,
) {
    for (n, id) in (0..).zip(ids) {
        let mut m = message(Some(id), kind, &json!({ "id": id, "n": n }));
        m.headers.insert(
            rabbit_inbox::envelope::AGGREGATE_ID_HEADER.into(),
            json!(aggregate),
        );
        env.publish(topology, &m).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_handler_applies_a_batch_with_one_set_based_statement() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("batch-set"));
    config.batch_size = 50;
    // Everything is in the queue before the consumer starts; let the batches fill.
    config.max_batch_delay = Duration::from_secs(1);
    let topology = config.topology.clone();
    env.declare(&config).await;
    // 80 messages and 20 duplicates: 10 copies right behind their original (same batch, so a
    // later round of it) and 10 more at the end (a later batch, or a later round of the same).
    let ids: Vec<String> = (0..80).map(|i| format!("m{i:02}")).collect();
    let mut published = Vec::new();
    for (n, id) in (0..).zip(&ids) {
        published.push(thing(id, n));
        if n % 8 == 0 {
            published.push(thing(id, n));
        }
    }
    for (n, id) in (0..).zip(&ids).filter(|(n, _)| n % 8 == 4) {
        published.push(thing(id, n));
    }
    assert_eq!(published.len(), 100);
    for m in &published {
        env.publish(&topology, m).await;
    }
    let (handler, plan) = env.batch_handler();
    let consumer = env.start_batch(config, handler);

    wait_for("100 deliveries settled", async || {
        let s = consumer.snapshot();
        s.processed + s.duplicates == 100
    })
    .await;
    let stats = consumer.stop().await;

    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.effects").await,
        80,
        "one effect per unique message, none for the duplicates"
    );
    assert_eq!(
        env.scalar("SELECT count(DISTINCT message_id) FROM {s}.effects")
            .await,
        80
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE status = 'PROCESSED' \
             AND processing_attempt = 1"
        )
        .await,
        80
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE delivery_count = 2")
            .await,
        20,
        "each duplicate was seen by the inbox"
    );
    let calls = plan.calls();
    let mut handled: Vec<&String> = calls.iter().flatten().collect();
    assert_eq!(handled.len(), 80, "duplicates never reach the handler");
    handled.sort();
    handled.dedup();
    assert_eq!(
        handled.len(),
        80,
        "no message was handed to the handler twice"
    );
    assert!(
        calls.len() <= 10,
        "{} handle_batch calls for 100 messages; batch sizes {:?}",
        calls.len(),
        calls.iter().map(Vec::len).collect::<Vec<_>>()
    );
    assert_eq!(stats.received, 100);
    assert_eq!(stats.processed, 80);
    assert_eq!(stats.duplicates, 20);
    assert_eq!(stats.retried + stats.parked + stats.unrecorded, 0);
    assert_eq!(stats.settle_failures, 0);
    assert_eq!(
        stats.latency_samples, 100,
        "every delivery's receipt-to-ack latency was measured once"
    );
    assert!(stats.latency_p99 > Duration::ZERO);
    assert!(stats.latency_p50 <= stats.latency_p99);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_handler_blaming_one_message_commits_the_rest() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("batch-blame"));
    config.batch_size = 50;
    config.lanes = 1;
    config.max_batch_delay = Duration::from_secs(2);
    let topology = config.topology.clone();
    env.declare(&config).await;
    let ids: Vec<String> = (0..20).map(|i| format!("m{i:02}")).collect();
    for (n, id) in (0..).zip(&ids) {
        env.publish(&topology, &thing(id, n)).await;
    }
    let (handler, plan) = env.batch_handler();
    plan.for_id("m07", BatchRule::Blame(ErrorKind::Permanent));
    let consumer = env.start_batch(config, handler);

    let parked = env.take_parked(&topology, 1).await;
    wait_for("19 processed", async || consumer.snapshot().processed == 19).await;
    let stats = consumer.stop().await;

    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].message_id.as_deref(), Some("m07"));
    assert_eq!(
        header(&parked[0], parking_headers::ERROR_CODE),
        Some("test_blamed")
    );
    assert_eq!(
        header(&parked[0], parking_headers::STATUS),
        Some("PERMANENT_FAILED")
    );
    assert_eq!(parked[0].body, thing("m07", 7).body);
    for id in &ids {
        let row = env.record("svc", id).await.expect("row");
        assert_eq!(row.processing_attempt, 1, "{id}");
        if id == "m07" {
            assert_eq!(row.status, InboxStatus::PermanentFailed);
            assert_eq!(row.last_error_code.as_deref(), Some("test_blamed"));
            assert_eq!(env.effects(id).await, 0, "the blamed effect rolled back");
        } else {
            assert_eq!(row.status, InboxStatus::Processed, "{id}");
            assert_eq!(env.effects(id).await, 1, "{id} applied exactly once");
        }
    }
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.effects").await, 19);

    // The blamed batch ran again at once without m07 (one lane: calls are sequential), in
    // groups under savepoints, and m07 was never handed over again.
    let calls = plan.calls();
    let blamed: Vec<usize> = (0..calls.len())
        .filter(|&k| calls[k].iter().any(|id| id == "m07"))
        .collect();
    assert_eq!(
        blamed.len(),
        1,
        "a permanent failure is not retried: {calls:?}"
    );
    let k = blamed[0];
    assert!(
        calls[k].len() > 1,
        "m07 was blamed inside a real batch: {calls:?}"
    );
    let without: Vec<String> = calls[k].iter().filter(|id| *id != "m07").cloned().collect();
    let mut rerun: Vec<String> = Vec::new();
    for call in &calls[k + 1..] {
        if rerun.len() >= without.len() {
            break;
        }
        rerun.extend(call.iter().cloned());
    }
    assert_eq!(
        rerun, without,
        "the batch was re-run without the blamed message"
    );
    assert_eq!(stats.processed, 19);
    assert_eq!(stats.parked, 1);
    assert_eq!(stats.retried, 0);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_handler_unattributed_failure_isolates_the_culprit() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("batch-isolate"));
    config.batch_size = 50;
    config.lanes = 1;
    config.max_batch_delay = Duration::from_secs(2);
    config.retry.max_attempts = 3;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let ids: Vec<String> = (0..20).map(|i| format!("m{i:02}")).collect();
    for (n, id) in (0..).zip(&ids) {
        env.publish(&topology, &thing(id, n)).await;
    }
    // Whenever a batch holds m05 or m13, the handler fails the whole batch without saying why:
    // permanently for m05, retryably for m13.
    let (handler, plan) = env.batch_handler();
    plan.for_id("m05", BatchRule::Unattributed(ErrorKind::Permanent));
    plan.for_id("m13", BatchRule::Unattributed(ErrorKind::Retryable));
    let consumer = env.start_batch(config, handler);

    let parked = env.take_parked(&topology, 2).await;
    wait_for("18 processed", async || consumer.snapshot().processed == 18).await;
    let stats = consumer.stop().await;

    let mut parked_ids: Vec<_> = parked.iter().filter_map(|m| m.message_id.clone()).collect();
    parked_ids.sort();
    assert_eq!(parked_ids, ["m05", "m13"], "only the culprits are parked");
    for m in &parked {
        assert_eq!(
            header(m, parking_headers::ERROR_CODE),
            Some("test_unattributed")
        );
    }
    let perm = env.record("svc", "m05").await.expect("row");
    assert_eq!(perm.status, InboxStatus::PermanentFailed);
    assert_eq!(
        perm.processing_attempt, 1,
        "a permanent failure is not retried"
    );
    let poisoned = env.record("svc", "m13").await.expect("row");
    assert_eq!(poisoned.status, InboxStatus::Poisoned);
    assert_eq!(
        poisoned.processing_attempt, 3,
        "the attempt budget was spent"
    );
    for id in &ids {
        if id == "m05" || id == "m13" {
            assert_eq!(env.effects(id).await, 0, "{id}'s effect rolled back");
            continue;
        }
        let row = env.record("svc", id).await.expect("row");
        assert_eq!(row.status, InboxStatus::Processed, "{id}");
        assert_eq!(row.processing_attempt, 1, "{id}: it was never blamed");
        assert_eq!(env.effects(id).await, 1, "{id} applied exactly once");
    }
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.effects").await, 18);

    // The failed batch was split into one call per message, so every message it held (the
    // innocent ones too) ran alone once; m13 then came back alone for attempts 2 and 3.
    let calls = plan.calls();
    let first = calls
        .iter()
        .position(|c| c.iter().any(|id| id == "m05"))
        .expect("m05 was handled");
    assert!(
        calls[first].len() > 1,
        "the culprit hid in a batch: {calls:?}"
    );
    for id in &calls[first] {
        let alone = calls[first + 1..]
            .iter()
            .filter(|c| c.len() == 1 && &c[0] == id)
            .count();
        let expected = if id == "m13" { 3 } else { 1 };
        assert_eq!(
            alone, expected,
            "{id} ran alone after the failed batch: {calls:?}"
        );
    }
    let count = |id: &str| calls.iter().filter(|c| c.iter().any(|x| x == id)).count();
    assert_eq!(count("m05"), 2, "in the batch, then alone: {calls:?}");
    assert_eq!(stats.processed, 18);
    assert_eq!(stats.parked, 2);
    assert_eq!(
        stats.retried, 2,
        "m13 failed retryably twice before it was poisoned"
    );
    assert_eq!(env.depths(&topology).await, EMPTY);
}

/// Two aggregates on different lanes of one consumer (2 lanes): `(slow, fast)`.
fn aggregates_on_two_lanes() -> (&'static str, String) {
    let slow = "slow";
    let fast = (0..)
        .map(|n| format!("fast-{n}"))
        .find(|a| inbox_testkit::env::lane_of(a, 2) != inbox_testkit::env::lane_of(slow, 2))
        .expect("an aggregate on the other lane");
    (slow, fast)
}

/// Lanes finish out of order: the lane holding the earlier deliveries is slow. The fast lane's
/// multiple-ack must not cover them. The consumer's connection drops right after the fast
/// lane's last commit, while the slow batch still runs: every delivery that was not acked
/// returns to the queue, and that must include the slow lane's.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multiple_ack_waits_for_a_slow_earlier_batch() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("slow-lane"));
    config.lanes = 2;
    config.batch_size = 2;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (slow_aggregate, fast_aggregate) = aggregates_on_two_lanes();
    let (handler, plan) = env.handler();
    let latch = std::sync::Arc::new(Latch::default());
    let _open = OpenOnDrop(latch.clone());
    plan.for_type("Slow", Rule::Hold(latch.clone()));
    let consumer = env.start(config, handler);
    consumer.faults.drop_connection_after_commit_of("f7");

    // Delivery tags follow publication order: f0-f3 are 1-4, s0-s2 5-7, f4-f7 8-11.
    let early: Vec<String> = (0..4).map(|i| format!("f{i}")).collect();
    let slow: Vec<String> = (0..3).map(|i| format!("s{i}")).collect();
    let late: Vec<String> = (4..8).map(|i| format!("f{i}")).collect();
    publish_on_aggregate(&env, &topology, &early, "Thing", &fast_aggregate).await;
    publish_on_aggregate(&env, &topology, &slow, "Slow", slow_aggregate).await;
    wait_for("the slow batch to start", async || latch.arrivals() >= 1).await;
    publish_on_aggregate(&env, &topology, &late, "Thing", &fast_aggregate).await;

    // The fast lane commits f4-f7 (in at least two batches of two, so at least one of them
    // was settled before the drop) while s0 holds its lane.
    for id in early.iter().chain(&late) {
        env.wait_for_record("svc", id, "PROCESSED", is(InboxStatus::Processed))
            .await;
    }
    wait_for("the connection drop after f7's commit", async || {
        consumer.faults.pending() == 0
    })
    .await;
    for id in &slow {
        assert_eq!(
            env.record("svc", id).await,
            None,
            "{id}'s transaction has not committed"
        );
    }
    assert_eq!(latch.arrivals(), 1, "s0 holds the slow lane");
    // The closed connection returned what was not acked.
    wait_for("unacked deliveries to return", async || {
        env.depths(&topology).await.work > 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        env.depths(&topology).await,
        QueueDepths {
            work: 7,
            retry: 0,
            parking: 0
        },
        "s0-s2 were not acked (nor f4-f7, which wait behind them); f0-f3 were"
    );

    // The slow batch finishes on the dead channel; the consumer reconnects and finds all
    // seven redeliveries committed.
    latch.open();
    for id in &slow {
        env.wait_for_record("svc", id, "PROCESSED", is(InboxStatus::Processed))
            .await;
    }
    wait_for("7 redeliveries acked as duplicates", async || {
        consumer.snapshot().duplicates == 7
    })
    .await;
    let stats = consumer.stop().await;

    for id in early.iter().chain(&slow).chain(&late) {
        let row = env.record("svc", id).await.expect("row");
        assert_eq!(row.status, InboxStatus::Processed, "{id}");
        assert_eq!(row.processing_attempt, 1, "{id}");
        let expected = if early.contains(id) { 1 } else { 2 };
        assert_eq!(row.delivery_count, expected, "{id}: deliveries");
        assert_eq!(env.effects(id).await, 1, "{id} applied exactly once");
    }
    assert_eq!(stats.processed, 11);
    assert_eq!(stats.duplicates, 7);
    assert_eq!(stats.sessions, 2, "{stats:?}");
    assert!(
        stats.settle_failures >= 3,
        "the slow batch could not be acked on the dropped connection: {stats:?}"
    );
    assert_eq!(env.depths(&topology).await, EMPTY);
}

/// The same out-of-order completion without a crash: the fast lane's acks wait behind the
/// slow lane's earlier deliveries and go out with the slow lane's multiple-ack when it
/// finishes, in the same session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_acks_go_out_when_the_slow_earlier_batch_finishes() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("slow-lane-ok"));
    config.lanes = 2;
    config.batch_size = 2;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (slow_aggregate, fast_aggregate) = aggregates_on_two_lanes();
    let (handler, plan) = env.handler();
    let latch = std::sync::Arc::new(Latch::default());
    let _open = OpenOnDrop(latch.clone());
    plan.for_type("Slow", Rule::Hold(latch.clone()));
    let consumer = env.start(config, handler);

    let early: Vec<String> = (0..4).map(|i| format!("f{i}")).collect();
    let slow: Vec<String> = (0..3).map(|i| format!("s{i}")).collect();
    let late: Vec<String> = (4..8).map(|i| format!("f{i}")).collect();
    publish_on_aggregate(&env, &topology, &early, "Thing", &fast_aggregate).await;
    publish_on_aggregate(&env, &topology, &slow, "Slow", slow_aggregate).await;
    wait_for("the slow batch to start", async || latch.arrivals() >= 1).await;
    let held_since = tokio::time::Instant::now();
    publish_on_aggregate(&env, &topology, &late, "Thing", &fast_aggregate).await;
    wait_for("the fast lane to commit all 8", async || {
        consumer.snapshot().processed == 8
    })
    .await;

    // The broker's view, where rabbitmqctl can see this broker: s0-s2 and f4-f7 unacked.
    if let Some((ready, _)) = inbox_testkit::env::rabbitmqctl_counts(&topology.queue).await {
        assert_eq!(ready, 0);
        wait_for(
            "s0-s2 and f4-f7 to be the only unacked deliveries",
            async || inbox_testkit::env::rabbitmqctl_counts(&topology.queue).await == Some((0, 7)),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            inbox_testkit::env::rabbitmqctl_counts(&topology.queue).await,
            Some((0, 7)),
            "the fast lane's later acks stay behind the slow lane's deliveries"
        );
    } else {
        inbox_testkit::missing(
            "rabbitmqctl access to the test broker (for the unacked count)",
            "run the tests on the broker's machine, as root or the rabbitmq user",
        );
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let held_for = held_since.elapsed();
    latch.open();
    wait_for("all 11 processed", async || {
        consumer.snapshot().processed == 11
    })
    .await;
    if inbox_testkit::env::rabbitmqctl_counts(&topology.queue)
        .await
        .is_some()
    {
        wait_for("every delivery acked", async || {
            inbox_testkit::env::rabbitmqctl_counts(&topology.queue).await == Some((0, 0))
        })
        .await;
    }
    let stats = consumer.stop().await;

    for id in early.iter().chain(&slow).chain(&late) {
        let row = env.record("svc", id).await.expect("row");
        assert_eq!(row.status, InboxStatus::Processed, "{id}");
        assert_eq!(row.delivery_count, 1, "{id} was never redelivered");
        assert_eq!(env.effects(id).await, 1, "{id} applied exactly once");
    }
    assert_eq!(stats.sessions, 1);
    assert_eq!(stats.duplicates, 0);
    assert_eq!(stats.settle_failures, 0);
    // The consumer closed its connection: anything left unacked would be ready again.
    assert_eq!(
        env.depths(&topology).await,
        EMPTY,
        "every delivery was acked"
    );
    assert_eq!(stats.latency_samples, 11, "one latency per acked delivery");
    assert!(
        stats.latency_p99 >= held_for,
        "the held deliveries' latency includes the wait: p99 {:?}, held {held_for:?}",
        stats.latency_p99
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_only_old_processed_rows_and_stale_lookup_finds_stuck_claims() {
    let env = TestEnv::new().await;
    let s = env.schema.as_str();
    // (key, consumer, status, age of processed_at / processing_started_at)
    let rows = [
        ("old-1", "svc", "PROCESSED", "2 days"),
        ("old-2", "svc", "PROCESSED", "3 days"),
        ("old-3", "svc", "PROCESSED", "30 days"),
        ("new-1", "svc", "PROCESSED", "1 minute"),
        ("failed-old", "svc", "PERMANENT_FAILED", "30 days"),
        ("other-old", "other", "PROCESSED", "30 days"),
        ("stuck", "svc", "PROCESSING", "1 hour"),
        ("fresh", "svc", "PROCESSING", "1 second"),
    ];
    for (key, consumer, status, age) in rows {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{s}\".message_inbox (message_id, consumer_name, message_type, \
               message_version, status, processing_attempt, payload_sha256, processed_at, \
               processing_started_at) \
             VALUES ($1, $2, 'Thing', 1, $3, 1, '\\x00', \
               CASE WHEN $3 = 'PROCESSED' THEN now() - $4::interval END, \
               now() - $4::interval)"
        )))
        .bind(key)
        .bind(consumer)
        .bind(status)
        .bind(age)
        .execute(&env.pool)
        .await
        .expect("insert row");
    }
    let mut conn = env.pool.acquire().await.expect("connection");
    let day = Duration::from_secs(24 * 3600);

    // Bounded batches: the caller loops until nothing is left.
    let mut deleted = Vec::new();
    loop {
        let n = env
            .store
            .cleanup_processed_older_than(&mut conn, "svc", day, 2)
            .await
            .expect("cleanup");
        assert!(n <= 2, "a batch deletes at most its limit, deleted {n}");
        if n == 0 {
            break;
        }
        deleted.push(n);
    }
    assert_eq!(deleted.iter().sum::<u64>(), 3, "batches {deleted:?}");
    let mut left: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT message_id FROM \"{s}\".message_inbox ORDER BY message_id"
    )))
    .fetch_all(&env.pool)
    .await
    .expect("rows left");
    left.sort();
    assert_eq!(
        left,
        ["failed-old", "fresh", "new-1", "other-old", "stuck"],
        "only old PROCESSED rows of the consumer are deleted"
    );

    let stale = env
        .store
        .find_stale_processing(&mut conn, "svc", Duration::from_secs(600), 10)
        .await
        .expect("stale lookup");
    let stale: Vec<&str> = stale.iter().map(|r| r.message_id.as_str()).collect();
    assert_eq!(stale, ["stuck"]);
}

/// Several instances on one queue keep one aggregate's order only with a single active
/// consumer: the broker delivers to one instance, and to the next when it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_active_consumer_keeps_order_across_instances_and_fails_over() {
    let env = TestEnv::new().await;
    let topology = env.register(
        rabbit_inbox::Topology::new(format!("t-{}-sac", env.id)).with_single_active_consumer(),
    );
    let config = env.config("svc", topology.clone());
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let mut instances = vec![
        env.start(config.clone(), handler.clone()),
        env.start(config.clone(), handler.clone()),
    ];

    let ids: Vec<String> = (0..80).map(|i| format!("m{i:03}")).collect();
    publish_on_aggregate(&env, &topology, &ids[..40], "Thing", "order-1").await;
    wait_for("the first half settled", async || {
        instances
            .iter()
            .map(|c| c.snapshot().processed)
            .sum::<u64>()
            == 40
    })
    .await;
    let received: Vec<u64> = instances.iter().map(|c| c.snapshot().received).collect();
    assert!(
        received.contains(&0) && received.contains(&40),
        "one instance gets every delivery: {received:?}"
    );
    let active = received
        .iter()
        .position(|&r| r == 40)
        .expect("an active one");
    let first = instances.remove(active).stop().await;
    assert_eq!(first.processed, 40);

    publish_on_aggregate(&env, &topology, &ids[40..], "Thing", "order-1").await;
    wait_for("the standby took over", async || {
        instances[0].snapshot().processed == 40
    })
    .await;

    let applied: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT message_id FROM \"{}\".effects ORDER BY seq",
        env.schema
    )))
    .fetch_all(&env.pool)
    .await
    .expect("effects");
    assert_eq!(applied, ids, "each effect once, in publish order");
    let second = instances.remove(0).stop().await;
    assert_eq!(second.received, 40);
    assert_eq!(env.depths(&topology).await, EMPTY);
}
