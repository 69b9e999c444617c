//! Recovery of lost retries against the real servers: a retry copy lost with its deleted tier
//! queue is found and republished (effect once), a late copy meeting the republished one
//! applies the effect once, the manual-review policy sets rows aside (a late copy is parked),
//! a row without a stored payload goes to manual review, the consumer's own timer recovers on
//! its own, and an encrypted payload is republished only when opened and a redacted one never.

use std::{sync::Arc, time::Duration};

use inbox_ops::{
    Actor, NoProgress, Operations, RecoveryConfig, RecoveryTask,
    inspect::{Payload, ShowQuery},
    recover::{RecoverRequest, RecoveryAction, RecoveryCause, RecoveryPolicy, RecoveryReport},
};
use inbox_testkit::env::{Rule, TestEnv, amqp_url, header, message, thing, wait_for};
use rabbit_inbox::{
    ConsumerConfig, InboxStatus, PayloadStorage, RetryPolicy, Topology,
    privacy::{Keyring, PayloadPrivacy},
};
use serde_json::json;

/// One retry tier of 3 s: long enough to delete it while a copy waits in it.
fn slow_retry() -> RetryPolicy {
    RetryPolicy::fixed(Duration::from_secs(3))
}

/// A consumer config with the slow tier; its queues are deleted at the end by [`Tiers`].
fn config(env: &TestEnv, name: &str) -> (ConsumerConfig, Topology, Tiers) {
    let topology = env.topology(name);
    let mut config = env.config("recover-svc", topology.clone());
    config.retry = slow_retry();
    let tiers = Tiers(topology.clone());
    (config, topology, tiers)
}

/// Deletes the slow tier queue at the end (the shared cleanup knows only the test tiers).
struct Tiers(Topology);

impl Drop for Tiers {
    fn drop(&mut self) {
        let topology = self.0.clone();
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(broker) = rabbit_inbox::broker::Broker::connect(
                    &inbox_testkit::env::amqp_url(),
                    "test cleanup",
                )
                .await
                {
                    let _ = broker.delete(&topology, &slow_retry()).await;
                    broker.close().await;
                }
            });
        })
        .join();
    }
}

/// Deletes a queue (a retry tier an operator removed by mistake), with its messages.
async fn delete_queue(name: &str) {
    let conn = lapin::Connection::connect(&inbox_testkit::env::amqp_url(), Default::default())
        .await
        .expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    channel
        .queue_delete(name.into(), Default::default())
        .await
        .expect("queue deleted");
    let _ = conn.close(200, "bye".into()).await;
}

fn actor() -> Actor {
    Actor::new("alice", "retry tier deleted by mistake")
        .expect("actor")
        .with_ticket("INC-7")
        .expect("ticket")
}

async fn recover(env: &TestEnv, request: &RecoverRequest) -> RecoveryReport {
    Operations::new(env.pool.clone(), env.schema.clone())
        .recover(&env.broker, &actor(), request, &NoProgress)
        .await
        .expect("recovery runs")
}

fn request(config: &ConsumerConfig, policy: RecoveryPolicy, grace: Duration) -> RecoverRequest {
    RecoverRequest {
        policy,
        grace,
        ..RecoverRequest::for_consumer(config, &RecoveryConfig::default())
    }
}

/// Fails `id` once and waits until its retry copy sits in the tier; then deletes the tier.
async fn lose_the_retry(env: &TestEnv, config: &ConsumerConfig, topology: &Topology, id: &str) {
    env.wait_for_record("recover-svc", id, "failed once", |r| {
        r.status == InboxStatus::RetryableFailed
    })
    .await;
    let tier = topology.retry_tier_queues(&config.retry).remove(0);
    wait_for("the retry copy in its tier", async || {
        env.broker
            .queue_depths(topology, &config.retry)
            .await
            .is_ok_and(|d| d.retry == 1)
    })
    .await;
    delete_queue(&tier).await;
}

async fn audit_count(env: &TestEnv, action: &str, id: &str) -> i64 {
    env.scalar(&format!(
        "SELECT count(*) FROM {{s}}.inbox_audit WHERE action = '{action}' AND message_id = '{id}' \
         AND actor = 'alice' AND ticket = 'INC-7' AND reason = 'retry tier deleted by mistake'"
    ))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_lost_with_its_tier_queue_is_found_and_republished() {
    let env = TestEnv::new().await;
    let (config, topology, _tiers) = config(&env, "lost");
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("m1", Rule::FailAttempts(1));
    let running = env.start(config.clone(), handler);
    env.publish(&topology, &thing("m1", 1)).await;
    lose_the_retry(&env, &config, &topology, "m1").await;

    // Within the tier's delay plus grace the row is not lost yet.
    let early = recover(
        &env,
        &request(&config, RecoveryPolicy::Retry, Duration::from_secs(60)),
    )
    .await;
    assert_eq!(early.found, 0, "{early:?}");
    // A dry run past the window finds it and changes nothing.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let mut dry = request(&config, RecoveryPolicy::Retry, Duration::from_millis(100));
    dry.dry_run = true;
    let planned = recover(&env, &dry).await;
    assert_eq!((planned.found, planned.republished), (1, 1), "{planned:?}");
    assert_eq!(planned.messages[0].cause, RecoveryCause::RetryLost);
    assert_eq!(audit_count(&env, "recover_republish", "m1").await, 0);
    assert_eq!(env.effects("m1").await, 0, "nothing ran in the dry run");

    let done = recover(
        &env,
        &request(&config, RecoveryPolicy::Retry, Duration::from_millis(100)),
    )
    .await;
    assert_eq!(
        (done.found, done.republished, done.failed),
        (1, 1, 0),
        "{done:?}"
    );
    assert_eq!(done.messages[0].action, RecoveryAction::Republished);
    assert_eq!(audit_count(&env, "recover_republish", "m1").await, 1);

    let row = env
        .wait_for_record("recover-svc", "m1", "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    assert_eq!(
        row.processing_attempt, 2,
        "the republished copy is attempt 2"
    );
    assert_eq!(env.effects("m1").await, 1);
    // Right after, the republished row is not lost again.
    let again = recover(
        &env,
        &request(&config, RecoveryPolicy::Retry, Duration::ZERO),
    )
    .await;
    assert_eq!(again.found, 0, "{again:?}");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_retry_copy_and_the_republished_one_apply_the_effect_once() {
    let env = TestEnv::new().await;
    let (config, topology, _tiers) = config(&env, "late");
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("m2", Rule::FailAttempts(1));
    // Two instances, so the copies may meet the row at the same moment.
    let a = env.start(config.clone(), handler.clone());
    let b = env.start(config.clone(), handler);
    env.publish(&topology, &thing("m2", 1)).await;
    env.wait_for_record("recover-svc", "m2", "failed once", |r| {
        r.status == InboxStatus::RetryableFailed
    })
    .await;

    // Recovery misjudges the tier (100 ms instead of 3 s): the copy in the tier is merely late.
    // It republishes, and a producer's duplicate follows at once: three copies of a
    // RETRYABLE_FAILED row, two of them meeting it at about the same moment.
    let mut hasty = request(&config, RecoveryPolicy::Retry, Duration::ZERO);
    hasty.retry.delays = vec![Duration::from_millis(100)];
    tokio::time::sleep(Duration::from_millis(200)).await;
    let report = recover(&env, &hasty).await;
    env.publish(&topology, &thing("m2", 1)).await;
    assert_eq!(report.republished, 1, "{report:?}");

    env.wait_for_record("recover-svc", "m2", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    // The late copy comes out of its tier and meets the processed row.
    wait_for("all three copies settled", async || {
        let (sa, sb) = (a.snapshot(), b.snapshot());
        sa.processed + sb.processed + sa.duplicates + sb.duplicates >= 3
    })
    .await;
    let (sa, sb) = (a.stop().await, b.stop().await);
    assert_eq!(sa.processed + sb.processed, 1, "{sa:?} {sb:?}");
    assert_eq!(sa.duplicates + sb.duplicates, 2, "{sa:?} {sb:?}");
    assert_eq!(env.effects("m2").await, 1, "the effect is applied once");
    let depths = env
        .broker
        .queue_depths(&topology, &config.retry)
        .await
        .expect("depths");
    assert_eq!((depths.work, depths.retry, depths.parking), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn manual_review_sets_lost_rows_aside_and_parks_their_late_copies() {
    let env = TestEnv::new().await;
    let (mut config, topology, _tiers) = config(&env, "review");
    // Bodies never kept: even the retry policy cannot republish m4.
    config.payload_storage = PayloadStorage::Never;
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("m3", Rule::FailAttempts(1));
    plan.for_id("m4", Rule::FailAttempts(1));
    let running = env.start(config.clone(), handler);
    env.publish(&topology, &thing("m3", 1)).await;
    env.wait_for_record("recover-svc", "m3", "failed once", |r| {
        r.status == InboxStatus::RetryableFailed
    })
    .await;
    env.publish(&topology, &thing("m4", 1)).await;
    env.wait_for_record("recover-svc", "m4", "failed once", |r| {
        r.status == InboxStatus::RetryableFailed
    })
    .await;
    wait_for("both retry copies in the tier", async || {
        env.broker
            .queue_depths(&topology, &config.retry)
            .await
            .is_ok_and(|d| d.retry == 2)
    })
    .await;
    delete_queue(&topology.retry_tier_queues(&config.retry)[0]).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;

    // m3 by policy, m4 by the retry policy for lack of a payload.
    let mut only_m3 = request(
        &config,
        RecoveryPolicy::ManualReview,
        Duration::from_millis(100),
    );
    only_m3.limit = 1;
    let reviewed = recover(&env, &only_m3).await;
    assert_eq!(reviewed.messages.len(), 1, "{reviewed:?}");
    assert_eq!(reviewed.messages[0].message_id, "m3");
    assert_eq!(reviewed.manual_review, 1);
    let fallback = recover(
        &env,
        &request(&config, RecoveryPolicy::Retry, Duration::from_millis(100)),
    )
    .await;
    assert_eq!(
        (fallback.found, fallback.manual_review, fallback.republished),
        (1, 1, 0),
        "{fallback:?}"
    );
    assert_eq!(fallback.messages[0].message_id, "m4");
    assert_eq!(
        fallback.messages[0].detail.as_deref(),
        Some("no payload kept to republish")
    );
    for id in ["m3", "m4"] {
        let row = env.record("recover-svc", id).await.expect("row");
        assert_eq!(row.status, InboxStatus::ManualReview, "{id}");
        assert_eq!(
            row.last_error_code.as_deref(),
            Some("test_retryable"),
            "the failure stays visible"
        );
        assert_eq!(
            audit_count(&env, "recover_manual_review", id).await,
            1,
            "{id}"
        );
    }
    // Nothing was republished: no further handler run.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for id in ["m3", "m4"] {
        assert_eq!(env.calls("recover-svc", id).await.len(), 1, "{id}");
    }

    // A copy that still turns up is parked with the row's status, and nothing runs.
    env.publish(&topology, &thing("m3", 1)).await;
    let mut parked = None;
    wait_for("the late copy parked", async || {
        parked = env.take_one(&topology.parking_queue).await;
        parked.is_some()
    })
    .await;
    let parked = parked.expect("parked");
    assert_eq!(header(&parked, "x-inbox-status"), Some("MANUAL_REVIEW"));
    assert_eq!(header(&parked, "x-inbox-message-id"), Some("m3"));
    running.stop().await;
    assert_eq!(
        env.calls("recover-svc", "m3").await.len(),
        1,
        "the parked copy did not run"
    );
    assert_eq!(env.effects("m3").await + env.effects("m4").await, 0);
    let status_ok = env
        .scalar(
            "SELECT count(*) FROM pg_constraint WHERE conname = 'message_inbox_status_check' \
             AND convalidated AND connamespace = '{s}'::regnamespace",
        )
        .await;
    assert_eq!(status_ok, 1, "the widened status check is validated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_recovery_task_beside_the_consumer_recovers_lost_retries_on_its_timer() {
    let env = TestEnv::new().await;
    let (config, topology, _tiers) = config(&env, "timer");
    let recovery = RecoveryTask::new(
        env.pool.clone(),
        amqp_url(),
        &config,
        RecoveryConfig {
            interval: Duration::from_millis(500),
            policy: RecoveryPolicy::Retry,
            grace: Duration::from_millis(500),
            limit: 100,
        },
    )
    .expect("valid recovery settings");
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("m5", Rule::FailAttempts(1));
    let running = env.start_beside(config.clone(), handler, |runner| {
        runner.task("recovery", |stop| recovery.run(stop))
    });
    env.publish(&topology, &thing("m5", 1)).await;
    lose_the_retry(&env, &config, &topology, "m5").await;
    let row = env
        .wait_for_record("recover-svc", "m5", "recovered and processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    assert_eq!(row.processing_attempt, 2);
    running.stop().await;
    assert_eq!(env.effects("m5").await, 1);
    let audited = env
        .scalar(
            "SELECT count(*) FROM {s}.inbox_audit WHERE action = 'recover_republish' \
             AND message_id = 'm5' AND actor = 'consumer recover-svc'",
        )
        .await;
    assert_eq!(audited, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_processing_row_left_by_a_crashed_custom_loop_is_recovered() {
    let env = TestEnv::new().await;
    let (config, _topology, _tiers) = config(&env, "stale");
    env.declare(&config).await;
    // A custom loop claimed the message, committed PROCESSING and died: no lease, no copy.
    // m7 had spent its attempts already.
    let mut conn = env.pool.acquire().await.expect("connection");
    for id in ["m6", "m7"] {
        let envelope = rabbit_inbox::envelope::parse(
            rabbit_inbox::envelope::AmqpMessage {
                message_id: Some(id.into()),
                kind: Some("Thing".into()),
                body: format!(r#"{{"id":"{id}","n":1}}"#).into_bytes(),
                ..Default::default()
            },
            &config.envelope,
        )
        .expect("valid");
        env.store
            .try_claim(&mut conn, "recover-svc", &envelope, true)
            .await
            .expect("claimed");
    }
    drop(conn);
    let stale = request(&config, RecoveryPolicy::Retry, Duration::ZERO);
    assert_eq!(
        recover(&env, &stale).await.found,
        0,
        "fresh PROCESSING is not stale"
    );
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{}\".message_inbox SET processing_started_at = now() - interval '1 hour', \
           processing_attempt = CASE WHEN message_id = 'm7' THEN 5 ELSE 1 END",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("age the row");

    let (handler, _plan) = env.handler();
    let running = env.start(config.clone(), handler);
    let report = recover(&env, &stale).await;
    assert_eq!(
        (report.republished, report.manual_review),
        (1, 1),
        "{report:?}"
    );
    assert!(
        report
            .messages
            .iter()
            .all(|m| m.cause == RecoveryCause::StaleProcessing)
    );
    let spent = report
        .messages
        .iter()
        .find(|m| m.message_id == "m7")
        .expect("m7");
    assert_eq!(spent.action, RecoveryAction::ManualReview);
    assert_eq!(spent.detail.as_deref(), Some("attempts spent (5 of 5)"));
    let row = env
        .wait_for_record("recover-svc", "m6", "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    assert_eq!(row.processing_attempt, 2);
    assert_eq!(row.last_error_code.as_deref(), Some("stale_processing"));
    running.stop().await;
    assert_eq!(env.effects("m6").await, 1);
    assert_eq!(env.effects("m7").await, 0);
    assert_eq!(
        env.record("recover-svc", "m7").await.map(|r| r.status),
        Some(InboxStatus::ManualReview)
    );
    let token = env
        .scalar("SELECT coalesce(fencing_token, 0) FROM {s}.message_inbox WHERE message_id = 'm6'")
        .await;
    assert_eq!(token, 1, "recovery fenced off the dead owner");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sealed_and_redacted_payloads_are_republished_only_as_the_original_message() {
    let env = TestEnv::new().await;
    let (mut config, topology, _tiers) = config(&env, "sealed");
    let keyring = Arc::new(Keyring::new());
    keyring.add("main-1", [7; 32]).expect("key");
    config.privacy = PayloadPrivacy::default()
        .redact("Card", &["/card"])
        .redact_headers(&["x-user-email"])
        .encrypt_with(keyring.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("s1", Rule::FailAttempts(1));
    plan.for_id("r1", Rule::FailAttempts(1));
    plan.for_id("h1", Rule::FailAttempts(1));
    let running = env.start(config.clone(), handler);
    let card = message(Some("r1"), "Card", &json!({ "card": "4111-1111", "n": 1 }));
    env.publish(&topology, &thing("s1", 1)).await;
    env.publish(&topology, &card).await;
    let mut personal = thing("h1", 3);
    personal
        .headers
        .insert("x-user-email".into(), json!("d@example.com"));
    env.publish(&topology, &personal).await;
    for id in ["s1", "r1", "h1"] {
        env.wait_for_record("recover-svc", id, "failed once", |r| {
            r.status == InboxStatus::RetryableFailed
        })
        .await;
    }
    wait_for("the three retry copies in their tier", async || {
        env.broker
            .queue_depths(&topology, &config.retry)
            .await
            .is_ok_and(|d| d.retry == 3)
    })
    .await;
    delete_queue(&topology.retry_tier_queues(&config.retry)[0]).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let lost = request(&config, RecoveryPolicy::Retry, Duration::from_millis(100));
    let show = async |ops: &Operations, id: &str| {
        ops.show(&ShowQuery {
            message_id: id.into(),
            consumer: None,
            topology: None,
        })
        .await
        .expect("show")
        .rows
        .remove(0)
        .payload
        .expect("payload kept")
    };

    // Without the keyring the sealed payloads stay sealed: not republished (the ciphertext is
    // not the message), rows unchanged for a recovery that holds the key.
    let keyless = Operations::new(env.pool.clone(), env.schema.clone());
    let report = keyless
        .recover(&env.broker, &actor(), &lost, &NoProgress)
        .await
        .expect("recovery runs");
    assert_eq!((report.found, report.failed), (3, 3), "{report:?}");
    for m in &report.messages {
        assert_eq!(m.action, RecoveryAction::Failed, "{m:?}");
        let detail = m.detail.as_deref().unwrap_or_default();
        assert!(detail.contains("keyring"), "{detail}");
        let row = env.record("recover-svc", &m.message_id).await.expect("row");
        assert_eq!(row.status, InboxStatus::RetryableFailed);
    }
    match show(&keyless, "s1").await {
        Payload::Sealed { key_id, .. } => assert_eq!(key_id, "main-1"),
        other => panic!("shown without its key: {other:?}"),
    }
    assert_eq!(audit_count(&env, "recover_republish", "s1").await, 0);

    // With it: the intact one is republished and processed once; the redacted one is not the
    // message any more, so it goes to manual review instead of applying other data.
    let keyed = Operations::new(env.pool.clone(), env.schema.clone()).with_keyring(keyring);
    match show(&keyed, "s1").await {
        Payload::Utf8(text) => assert!(text.contains("\"s1\""), "{text}"),
        other => panic!("not opened: {other:?}"),
    }
    match show(&keyed, "r1").await {
        Payload::Utf8(text) => assert!(!text.contains("4111"), "{text}"),
        other => panic!("not opened: {other:?}"),
    }
    let report = keyed
        .recover(&env.broker, &actor(), &lost, &NoProgress)
        .await
        .expect("recovery runs");
    assert_eq!(
        (report.found, report.republished, report.manual_review),
        (3, 1, 2),
        "{report:?}"
    );
    let redacted = report
        .messages
        .iter()
        .find(|m| m.message_id == "r1")
        .expect("r1 found");
    assert_eq!(redacted.action, RecoveryAction::ManualReview);
    assert!(
        redacted
            .detail
            .as_deref()
            .unwrap_or_default()
            .contains("redacted"),
        "{redacted:?}"
    );
    env.wait_for_record("recover-svc", "s1", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    assert_eq!(env.effects("s1").await, 1);
    let row = env.record("recover-svc", "r1").await.expect("row");
    assert_eq!(row.status, InboxStatus::ManualReview);
    assert_eq!(env.effects("r1").await, 0, "a redacted copy never ran");
    // Nor one whose stored headers were redacted: the handler would read "[redacted]".
    let header = report
        .messages
        .iter()
        .find(|m| m.message_id == "h1")
        .expect("h1 found");
    assert_eq!(header.action, RecoveryAction::ManualReview);
    assert!(
        header
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("x-user-email")),
        "{header:?}"
    );
    assert_eq!(env.effects("h1").await, 0);
    running.stop().await;
}
