//! One copy per message in the broker: a parked message has one copy in the parking lot however
//! often it is delivered again, and duplicates of a message waiting for its retry neither run
//! before the retry is due nor spend the retry budget. Against the real PostgreSQL and RabbitMQ.

use std::time::Duration;

use inbox_testkit::env::{Rule, TestEnv, message, thing, wait_for};
use rabbit_inbox::{InboxStatus, RetryPolicy, status::PAYLOAD_CONFLICT};
use serde_json::json;

fn is(status: InboxStatus) -> impl Fn(&rabbit_inbox::store::InboxRecord) -> bool {
    move |r| r.status == status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_message_has_one_copy_in_the_parking_lot() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("park-once"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("p", Rule::Permanent);
    let consumer = env.start(config, handler);

    env.publish(&topology, &thing("p", 1)).await;
    env.wait_for_record("svc", "p", "parked, its copy noted", |r| {
        r.status == InboxStatus::PermanentFailed && r.parked_copy_at.is_some()
    })
    .await;

    // Exact duplicates from the producer (and, the same path, redeliveries after a lost ack):
    // acked and counted on the row, not copied again.
    for _ in 0..3 {
        env.publish(&topology, &thing("p", 1)).await;
    }
    env.publish(&topology, &thing("after", 1)).await;
    env.wait_for_record("svc", "after", "processed", is(InboxStatus::Processed))
        .await;
    let row = env
        .wait_for_record("svc", "p", "three duplicates counted", |r| {
            r.parked_duplicates == 3
        })
        .await;
    assert_eq!(row.status, InboxStatus::PermanentFailed);
    assert_eq!(row.delivery_count, 4);
    assert_eq!(row.processing_attempt, 1, "the handler ran once");
    assert_eq!(env.calls("svc", "p").await.len(), 1);
    assert_eq!(env.depths(&topology).await.parking, 1, "one parked copy");

    // A copy whose confirm was never noted (the process died between the parking lot's confirm
    // and the note) is parked again rather than risk losing it.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{}\".message_inbox SET parked_copy_at = NULL WHERE message_id = 'p'",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("forget the note");
    env.publish(&topology, &thing("p", 1)).await;
    wait_for("an unnoted copy parked again", async || {
        env.depths(&topology).await.parking == 2
    })
    .await;
    let row = env
        .wait_for_record("svc", "p", "noted again", |r| r.parked_copy_at.is_some())
        .await;
    assert_eq!(row.parked_duplicates, 3);

    // Another body under the same id stays a payload conflict, parked every time.
    env.publish(
        &topology,
        &message(Some("p"), "Thing", &json!({"id": "p", "n": 2})),
    )
    .await;
    wait_for("the conflicting copy parked", async || {
        env.depths(&topology).await.parking == 3
    })
    .await;
    let row = env
        .wait_for_record("svc", "p", "conflict counted", |r| r.payload_conflicts == 1)
        .await;
    assert_eq!(row.parked_duplicates, 3, "a conflict is no duplicate");
    assert_eq!(row.last_error_code.as_deref(), Some("test_permanent"));
    let stats = consumer.stop().await;
    assert_eq!(
        stats.parked, 3,
        "the first copy, the unnoted one, the conflict"
    );
    assert_eq!(stats.duplicates, 3);
    assert_ne!(PAYLOAD_CONFLICT, "test_permanent");
}

/// The database session ends between the parking lot's confirm and the note on the row (a
/// database restart, a killed backend): the note is made again on a new session before the
/// delivery is acked, so a later copy of the message is a duplicate of the parked copy, not a
/// second parked copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_confirmed_while_the_database_session_ends_is_still_noted() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("park-note-retry"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("p", Rule::Permanent);
    let consumer = env.start(config, handler);
    consumer.faults.end_db_session_before_noting_copy_of("p");

    env.publish(&topology, &thing("p", 1)).await;
    let row = env
        .wait_for_record("svc", "p", "parked, its copy noted", |r| {
            r.status == InboxStatus::PermanentFailed && r.parked_copy_at.is_some()
        })
        .await;
    assert_eq!(row.delivery_count, 1, "acked once noted, not redelivered");

    env.publish(&topology, &thing("p", 1)).await;
    let row = env
        .wait_for_record("svc", "p", "the copy counted as a duplicate", |r| {
            r.delivery_count == 2
        })
        .await;
    assert_eq!(row.parked_duplicates, 1, "{row:?}");
    assert_eq!(env.depths(&topology).await.parking, 1, "one parked copy");
    assert_eq!(env.calls("svc", "p").await.len(), 1, "the handler ran once");
    let stats = consumer.stop().await;
    assert_eq!(stats.parked, 1);
    assert_eq!(stats.duplicates, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_of_a_retrying_message_do_not_spend_its_retries() {
    const TIER: Duration = Duration::from_secs(2);
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("retry-dups"));
    config.retry = RetryPolicy {
        max_attempts: 3,
        ..RetryPolicy::fixed(TIER)
    };
    let topology = config.topology.clone();
    let retry = config.retry.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("r", Rule::Retryable);
    let consumer = env.start(config, handler);

    env.publish(&topology, &thing("r", 1)).await;
    let first = env
        .wait_for_record("svc", "r", "its retry copy noted", |r| {
            r.status == InboxStatus::RetryableFailed && r.retry_copy_attempt == Some(1)
        })
        .await;
    // The producer resends it four times, 100 ms apart: each copy is acked as a duplicate of
    // the pending retry, runs nothing and charges nothing.
    for _ in 0..4 {
        env.publish(&topology, &thing("r", 1)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let row = env
        .wait_for_record("svc", "r", "four duplicates counted", |r| {
            r.retry_duplicates == 4
        })
        .await;
    assert_eq!(row.processing_attempt, 1, "no attempt charged: {row:?}");
    assert_eq!(row.status, InboxStatus::RetryableFailed);
    assert_eq!(env.calls("svc", "r").await.len(), 1, "the handler ran once");

    // The retries still come on schedule, one tier delay apart, and poison the row after
    // max_attempts runs of the handler.
    let poisoned = env
        .wait_for_record("svc", "r", "poisoned", is(InboxStatus::Poisoned))
        .await;
    assert_eq!(poisoned.processing_attempt, 3);
    assert_eq!(env.calls("svc", "r").await.len(), 3, "three runs, no more");
    let first_failed = first.first_failed_at.expect("failed");
    let last_failed = poisoned.last_failed_at.expect("failed");
    assert!(
        last_failed - first_failed >= chrono::Duration::from_std(TIER * 2).expect("small"),
        "poisoned {} after the first failure, before two tier delays of {TIER:?}",
        last_failed - first_failed
    );
    consumer.stop().await;
    // The 2 s tier is not the test default's; remove it here.
    env.broker.delete(&topology, &retry).await.expect("delete");
}
