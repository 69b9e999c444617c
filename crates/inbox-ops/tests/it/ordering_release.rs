//! Ordered processing end to end against the real servers: a consumer ordering by aggregate
//! runs beside its release task. A key's messages behind a failed head are held and run in
//! their order once the head succeeds, other keys never wait; sequence numbers hold a gap
//! until the missing number arrives; a gap past its timeout is released past (a late number
//! is then parked) or parks the followers, whose copies a redrive moves back in order. A
//! service of an ordered consumer runs the release task itself; a held message whose body was
//! not kept goes to manual review and its key waits for it.

use std::time::Duration;

use inbox_ops::{
    Actor, NoProgress, Operations, ReleaseTask, Service,
    redrive::{ParkedClass, RedriveRequest},
    release::{HELD_PAYLOAD_LOST, RELEASE_ACTOR},
};
use inbox_testkit::env::{
    DEADLINE, Rule, Running, TestEnv, TestHandler, amqp_url, thing, wait_for,
};
use rabbit_inbox::{
    ConsumerConfig, InboxStatus, PayloadStorage, Topology,
    broker::{OutgoingMessage, ParkingLot},
    ordering::{GapPolicy, OrderingPolicy, SequencePolicy},
    status::{SEQUENCE_GAP, SEQUENCE_PASSED},
};
use serde_json::json;
use sqlx::AssertSqlSafe;

const CONSUMER: &str = "ordered-svc";

/// Message `id` of aggregate `key`, with sequence number `seq` in `x-sequence` if given.
fn ordered(id: &str, key: &str, seq: Option<i64>) -> OutgoingMessage {
    let mut message = thing(id, seq.unwrap_or_default());
    message.headers.insert("x-aggregate-id".into(), json!(key));
    if let Some(seq) = seq {
        message.headers.insert("x-sequence".into(), json!(seq));
    }
    message
}

/// A consumer config ordering by aggregate under `policy`, its queues declared, a fast release
/// task.
async fn ordered_config(
    env: &TestEnv,
    name: &str,
    mut policy: OrderingPolicy,
) -> (ConsumerConfig, Topology) {
    let topology = env.topology(name);
    let mut config = env.config(CONSUMER, topology.clone());
    // Room for a head that keeps failing while the test looks at what it holds.
    config.retry.max_attempts = 1000;
    policy.release_interval = Duration::from_millis(100);
    config.ordering = Some(policy);
    env.declare(&config).await;
    (config, topology)
}

/// The consumer with its release task beside it.
fn start(env: &TestEnv, config: &ConsumerConfig, handler: TestHandler) -> Running {
    let release = ReleaseTask::for_consumer(env.pool.clone(), amqp_url(), config)
        .expect("an ordered consumer has a release task");
    env.start_beside(config.clone(), handler, |runner| {
        runner.task("release", |stop| release.run(stop))
    })
}

/// The message ids of the effects applied, in the order they committed.
async fn applied(env: &TestEnv) -> Vec<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT message_id FROM \"{}\".effects ORDER BY seq",
        env.schema
    )))
    .fetch_all(&env.pool)
    .await
    .expect("effects")
}

/// Publishes message `{prefix}{n}` of key K with sequence number `n` for each `(n, status)`,
/// each once the one before it reached its status: one message per batch, so that what the
/// test sees is the release task's doing, not the order within a batch.
async fn publish_in_turn(
    env: &TestEnv,
    topology: &Topology,
    prefix: &str,
    messages: &[(i64, InboxStatus)],
) {
    for &(n, status) in messages {
        let id = format!("{prefix}{n}");
        env.publish(topology, &ordered(&id, "K", Some(n))).await;
        wait_status(env, &id, status).await;
    }
}

async fn wait_status(env: &TestEnv, id: &str, status: InboxStatus) {
    env.wait_for_record(CONSUMER, id, status.as_str(), |r| r.status == status)
        .await;
}

async fn status_of(env: &TestEnv, id: &str) -> InboxStatus {
    env.record(CONSUMER, id).await.expect("row").status
}

/// The head of `key`'s row in `inbox_order_key` (`None` also without a row).
async fn head_of(env: &TestEnv, key: &str) -> Option<String> {
    sqlx::query_scalar::<_, Option<String>>(AssertSqlSafe(format!(
        "SELECT head_message_id FROM \"{}\".inbox_order_key \
         WHERE consumer_name = $1 AND order_key = $2",
        env.schema
    )))
    .bind(CONSUMER)
    .bind(key)
    .fetch_optional(&env.pool)
    .await
    .expect("key row")
    .flatten()
}

async fn audited(env: &TestEnv, action: &str, id: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{}\".inbox_audit \
         WHERE action = $1 AND message_id = $2 AND actor = $3 AND consumer_name = $4",
        env.schema
    )))
    .bind(action)
    .bind(id)
    .bind(RELEASE_ACTOR)
    .bind(CONSUMER)
    .fetch_one(&env.pool)
    .await
    .expect("audit count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_keys_messages_behind_a_failed_head_run_in_order_once_it_succeeds() {
    let env = TestEnv::new().await;
    let (config, topology) = ordered_config(&env, "ord-head", OrderingPolicy::by_aggregate()).await;
    let (handler, plan) = env.handler();
    plan.for_id("a1", Rule::Retryable);
    let running = start(&env, &config, handler);

    env.publish(&topology, &ordered("a1", "K", None)).await;
    wait_status(&env, "a1", InboxStatus::RetryableFailed).await;
    for (id, key) in [("a2", "K"), ("a3", "K"), ("b1", "L")] {
        env.publish(&topology, &ordered(id, key, None)).await;
    }
    wait_status(&env, "b1", InboxStatus::Processed).await;
    wait_status(&env, "a2", InboxStatus::Held).await;
    wait_status(&env, "a3", InboxStatus::Held).await;
    assert_eq!(head_of(&env, "K").await.as_deref(), Some("a1"));
    // Several retries and release passes later, nothing of K has run.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        applied(&env).await,
        ["b1"],
        "only the other key's message ran"
    );
    assert_eq!(status_of(&env, "a2").await, InboxStatus::Held);
    assert_eq!(status_of(&env, "a3").await, InboxStatus::Held);

    // The head's next retry succeeds; then the held ones are released, one at a time.
    plan.clear_id("a1");
    wait_status(&env, "a3", InboxStatus::Processed).await;
    running.stop().await;
    assert_eq!(applied(&env).await, ["b1", "a1", "a2", "a3"]);
    for id in ["a1", "a2", "a3", "b1"] {
        assert_eq!(status_of(&env, id).await, InboxStatus::Processed, "{id}");
        assert_eq!(env.effects(id).await, 1, "{id} applied once");
    }
    assert_eq!(head_of(&env, "K").await, None, "K is unblocked");
    assert_eq!(
        env.calls(CONSUMER, "a2").await.len(),
        1,
        "a held message runs once, when released"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sequence_gap_holds_the_later_numbers_until_the_missing_one_arrives() {
    let env = TestEnv::new().await;
    let policy = OrderingPolicy::by_aggregate().with_sequence(SequencePolicy::header("x-sequence"));
    let (config, topology) = ordered_config(&env, "ord-seq", policy).await;
    let (handler, _plan) = env.handler();
    let running = start(&env, &config, handler);

    publish_in_turn(
        &env,
        &topology,
        "s",
        &[
            (1, InboxStatus::Processed),
            (3, InboxStatus::Held),
            (4, InboxStatus::Held),
        ],
    )
    .await;
    let gap_started = env
        .scalar(
            "SELECT count(*) FROM {s}.inbox_order_key WHERE order_key = 'K' \
             AND next_sequence = 2 AND gap_since IS NOT NULL",
        )
        .await;
    assert_eq!(gap_started, 1, "K waits for 2, its gap's clock running");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(applied(&env).await, ["s1"]);

    env.publish(&topology, &ordered("s2", "K", Some(2))).await;
    wait_status(&env, "s4", InboxStatus::Processed).await;
    running.stop().await;
    assert_eq!(applied(&env).await, ["s1", "s2", "s3", "s4"]);
    let moved_on = env
        .scalar(
            "SELECT count(*) FROM {s}.inbox_order_key WHERE order_key = 'K' \
             AND next_sequence = 5 AND gap_since IS NULL AND head_message_id IS NULL",
        )
        .await;
    assert_eq!(moved_on, 1, "K waits for 5, no gap");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gap_past_its_timeout_is_released_past_and_a_late_number_is_parked() {
    let env = TestEnv::new().await;
    let policy = OrderingPolicy::by_aggregate().with_sequence(
        SequencePolicy::header("x-sequence").on_gap(Duration::from_secs(1), GapPolicy::Release),
    );
    let (config, topology) = ordered_config(&env, "ord-release", policy).await;
    let (handler, _plan) = env.handler();
    let running = start(&env, &config, handler);

    env.publish(&topology, &ordered("r1", "K", Some(1))).await;
    env.publish(&topology, &ordered("r3", "K", Some(3))).await;
    wait_status(&env, "r1", InboxStatus::Processed).await;
    wait_status(&env, "r3", InboxStatus::Held).await;
    // After the gap's timeout the key goes on past 2.
    wait_status(&env, "r3", InboxStatus::Processed).await;
    assert_eq!(audited(&env, "sequence_gap_released", "r3").await, 1);
    let reported = env
        .scalar(
            "SELECT count(*) FROM {s}.inbox_order_key WHERE order_key = 'K' \
             AND next_sequence = 4 AND gap_since IS NULL",
        )
        .await;
    assert_eq!(reported, 1, "K went on to 4");

    // 2 arrives late: parked, not applied out of order.
    env.publish(&topology, &ordered("r2", "K", Some(2))).await;
    let late = env
        .wait_for_record(CONSUMER, "r2", "parked", |r| {
            r.status == InboxStatus::PermanentFailed
        })
        .await;
    assert_eq!(late.last_error_code.as_deref(), Some(SEQUENCE_PASSED));
    let parked = env.take_parked(&topology, 1).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].message_id.as_deref(), Some("r2"));
    running.stop().await;
    assert_eq!(applied(&env).await, ["r1", "r3"]);
    assert_eq!(
        head_of(&env, "K").await,
        None,
        "a passed number blocks nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gap_past_its_timeout_parks_the_followers_and_a_redrive_runs_them_in_order() {
    let env = TestEnv::new().await;
    let policy = OrderingPolicy::by_aggregate().with_sequence(
        SequencePolicy::header("x-sequence")
            .on_gap(Duration::from_secs(1), GapPolicy::ParkFollowers),
    );
    let (config, topology) = ordered_config(&env, "ord-park", policy).await;
    let (handler, _plan) = env.handler();
    let running = start(&env, &config, handler);

    publish_in_turn(
        &env,
        &topology,
        "p",
        &[(1, InboxStatus::Processed), (3, InboxStatus::Held)],
    )
    .await;
    env.publish(&topology, &ordered("p4", "K", Some(4))).await;
    for id in ["p3", "p4"] {
        let row = env
            .wait_for_record(CONSUMER, id, "parked for the gap", |r| {
                r.status == InboxStatus::PermanentFailed
            })
            .await;
        assert_eq!(row.last_error_code.as_deref(), Some(SEQUENCE_GAP), "{id}");
        assert!(row.parked_copy_at.is_some(), "{id}: its copy is marked");
        assert_eq!(audited(&env, "sequence_gap_parked", id).await, 1, "{id}");
    }
    wait_for("two copies in the parking lot", async || {
        env.depths(&topology).await.parking == 2
    })
    .await;
    let waiting = env
        .scalar(
            "SELECT count(*) FROM {s}.inbox_order_key WHERE order_key = 'K' \
             AND next_sequence = 2 AND gap_since IS NULL AND gap_reported_at IS NOT NULL",
        )
        .await;
    assert_eq!(waiting, 1, "K still waits for 2");

    // The parked copies are what a redrive expects: each selected by its consumer, code and
    // inbox key, and found with a parked row to reopen.
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let request = RedriveRequest {
        consumer: Some(CONSUMER.into()),
        error_code: Some(SEQUENCE_GAP.into()),
        message_ids: vec!["p3".into(), "p4".into()],
        ..RedriveRequest::default()
    };
    let dry = ops
        .redrive(
            &lot,
            &RedriveRequest {
                dry_run: true,
                ..request.clone()
            },
            None,
            &NoProgress,
        )
        .await
        .expect("dry run");
    assert_eq!(dry.class(ParkedClass::Reopen), 2, "{dry:#?}");

    // The missing number arrives, then the parked ones go back in their order.
    env.publish(&topology, &ordered("p2", "K", Some(2))).await;
    wait_status(&env, "p2", InboxStatus::Processed).await;
    let actor = Actor::new("alice", "the missing number arrived").expect("actor");
    ops.redrive(&lot, &request, Some(&actor), &NoProgress)
        .await
        .expect("redrive");
    lot.close().await;
    wait_status(&env, "p4", InboxStatus::Processed).await;
    running.stop().await;
    assert_eq!(applied(&env).await, ["p1", "p2", "p3", "p4"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_service_of_an_ordered_consumer_runs_its_release_task() {
    let env = TestEnv::new().await;
    let (config, topology) = ordered_config(&env, "ord-svc", OrderingPolicy::by_aggregate()).await;
    let (handler, plan) = env.handler();
    plan.for_id("v1", Rule::Retryable);
    let service = Service::builder(amqp_url(), env.pool.clone(), config)
        .handler(handler)
        .without_sampler()
        .build()
        .expect("the test pool fits");
    assert_eq!(
        service.pool_shares().release,
        1,
        "a pass holds one connection"
    );
    let health = service.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(service.run(async move {
        let _ = stopped.await;
    }));
    let ready = tokio::time::timeout(DEADLINE, health.wait_for(|s| s.ready))
        .await
        .expect("ready once it consumes");
    assert!(
        ready.tasks.iter().any(|t| t.name == "release" && t.running),
        "{:?}",
        ready.tasks
    );

    env.publish(&topology, &ordered("v1", "K", None)).await;
    wait_status(&env, "v1", InboxStatus::RetryableFailed).await;
    env.publish(&topology, &ordered("v2", "K", None)).await;
    wait_status(&env, "v2", InboxStatus::Held).await;
    plan.clear_id("v1");
    wait_status(&env, "v2", InboxStatus::Processed).await;
    let _ = stop.send(());
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("stops in time")
        .expect("no panic")
        .expect("a clean stop");
    assert_eq!(applied(&env).await, ["v1", "v2"]);

    // Without ordering there is no release task.
    let (handler, _plan) = env.handler();
    let plain = Service::builder(
        amqp_url(),
        env.pool.clone(),
        env.config("plain", env.topology("ord-plain")),
    )
    .handler(handler)
    .build()
    .expect("the test pool fits");
    assert_eq!(plain.pool_shares().release, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_message_without_a_kept_body_goes_to_manual_review_and_blocks_its_key() {
    let env = TestEnv::new().await;
    let (config, topology) =
        ordered_config(&env, "ord-nobody", OrderingPolicy::by_aggregate()).await;
    // A policy of `Never` is refused for an ordered consumer; a body can still be lost
    // (scrubbed by hand, say): the release task must not skip its message.
    let mut never = config.clone();
    never.payload_storage = PayloadStorage::Never;
    assert!(never.validate().is_err(), "held bodies must be kept");
    let (handler, plan) = env.handler();
    plan.for_id("n1", Rule::Retryable);
    let running = start(&env, &config, handler);

    env.publish(&topology, &ordered("n1", "K", None)).await;
    wait_status(&env, "n1", InboxStatus::RetryableFailed).await;
    env.publish(&topology, &ordered("n2", "K", None)).await;
    wait_status(&env, "n2", InboxStatus::Held).await;
    env.publish(&topology, &ordered("n3", "K", None)).await;
    wait_status(&env, "n3", InboxStatus::Held).await;
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}\".message_inbox SET payload = NULL \
         WHERE consumer_name = $1 AND message_id = 'n2'",
        env.schema
    )))
    .bind(CONSUMER)
    .execute(&env.pool)
    .await
    .expect("the body is lost");
    plan.clear_id("n1");
    let row = env
        .wait_for_record(CONSUMER, "n2", "in manual review", |r| {
            r.status == InboxStatus::ManualReview
        })
        .await;
    assert_eq!(row.last_error_code.as_deref(), Some(HELD_PAYLOAD_LOST));
    assert_eq!(
        head_of(&env, "K").await.as_deref(),
        Some("n2"),
        "K waits for n2"
    );
    assert_eq!(audited(&env, "recover_manual_review", "n2").await, 1);
    // Passes later, what follows it is still held, not run out of order.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(status_of(&env, "n3").await, InboxStatus::Held);
    running.stop().await;
    assert_eq!(applied(&env).await, ["n1"]);
}
