//! Ordered consumers through the consumer's processing path (the test kit, real PostgreSQL):
//! a key's later messages are held behind a failed or parked head and run in order once it
//! is resolved; sequence numbers hold a gap; other keys never wait. A delivery of a held
//! row stands for the copy the release task publishes.

use std::time::Duration;

use rabbit_inbox::{
    ConsumerConfig, Handler, HandlerError, InboxMessage, InboxStatus, Outcome, PerMessage,
    Topology,
    ordering::{OrderingPolicy, SequencePolicy},
    status::SEQUENCE_PASSED,
    testing::{BrokerAction, ScratchSchema, TestConsumer, TestMessage},
};
use serde_json::json;
use sqlx::PgConnection;

use crate::testing_kit::Scratch;

/// Appends `{"step": n}` to `applied` in the order effects commit; fails as `"fail"` says:
/// `"first_attempt"` on attempt 1 only, `"permanent"` always.
struct Journal;

impl Handler for Journal {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        #[derive(serde::Deserialize)]
        struct Step {
            step: i64,
            #[serde(default)]
            fail: Option<String>,
        }
        let step: Step = msg.decode()?;
        match step.fail.as_deref() {
            Some("first_attempt") if msg.attempt() == 1 => {
                return Err(HandlerError::retryable("busy", "first attempt fails"));
            }
            Some("permanent") => return Err(HandlerError::permanent("refused", "never")),
            _ => {}
        }
        sqlx::query("INSERT INTO applied (aggregate, step) VALUES ($1, $2)")
            .bind(msg.envelope().aggregate_id.as_deref())
            .bind(step.step)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

async fn scratch() -> Scratch {
    let scratch = ScratchSchema::create(&inbox_testkit::database_url())
        .await
        .expect("the scratch schema is created and migrated");
    let scratch = Scratch::new(scratch);
    scratch
        .execute("CREATE TABLE applied (n BIGSERIAL PRIMARY KEY, aggregate TEXT, step BIGINT)")
        .await
        .expect("the journal is created");
    scratch
}

fn kit(scratch: &ScratchSchema, policy: OrderingPolicy) -> TestConsumer<PerMessage<Journal>> {
    let mut config = ConsumerConfig::new("orders", Topology::new("orders"));
    config.schema = scratch.name().clone();
    config.ordering = Some(policy);
    TestConsumer::new(scratch.pool().clone(), config, Journal).expect("valid config")
}

fn step(aggregate: &str, n: i64) -> TestMessage {
    TestMessage::json("Step", json!({"step": n})).aggregate("Order", aggregate)
}

async fn applied(scratch: &ScratchSchema, aggregate: &str) -> Vec<i64> {
    sqlx::query_scalar("SELECT step FROM applied WHERE aggregate = $1 ORDER BY n")
        .bind(aggregate)
        .fetch_all(scratch.pool())
        .await
        .expect("journal readable")
}

async fn head(scratch: &ScratchSchema, key: &str) -> Option<String> {
    sqlx::query_scalar("SELECT head_message_id FROM inbox_order_key WHERE order_key = $1")
        .bind(key)
        .fetch_optional(scratch.pool())
        .await
        .expect("key rows readable")
        .flatten()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retrying_head_holds_its_key_and_the_held_run_in_order_after_it() {
    let scratch = scratch().await;
    let kit = kit(&scratch, OrderingPolicy::by_aggregate());
    let first = TestMessage::json("Step", json!({"step": 1, "fail": "first_attempt"}))
        .aggregate("Order", "k");
    let (second, third, other) = (step("k", 2), step("k", 3), step("other", 1));

    let failed = kit.deliver(first.clone()).await.expect("delivered");
    assert!(
        matches!(failed.outcome, Outcome::RetryScheduled { .. }),
        "{failed:?}"
    );
    assert_eq!(
        head(&scratch, "k").await.as_deref(),
        failed.record.as_ref().map(|r| r.message_id.as_str())
    );

    let later = kit
        .deliver_batch([second.clone(), other.clone(), third.clone()])
        .await
        .expect("delivered");
    assert_eq!(later[0].outcome, Outcome::Held);
    assert_eq!(later[0].broker_action, BrokerAction::Ack);
    assert_eq!(later[0].status(), Some(InboxStatus::Held));
    assert_eq!(
        later[1].outcome,
        Outcome::Processed,
        "another key never waits"
    );
    assert_eq!(later[2].status(), Some(InboxStatus::Held));
    assert_eq!(applied(&scratch, "k").await, Vec::<i64>::new());

    // A duplicate of a held message is a duplicate: acked, the row stays HELD, nothing runs.
    let copy = kit.deliver(third.clone()).await.expect("delivered");
    assert_eq!(copy.outcome, Outcome::Held);
    assert_eq!(copy.status(), Some(InboxStatus::Held));

    // The head's retry runs and unblocks the key.
    let retried = kit
        .deliver(failed.retry_copy().expect("a retry copy"))
        .await
        .expect("delivered");
    assert_eq!(retried.outcome, Outcome::Processed);
    assert_eq!(head(&scratch, "k").await, None);

    // Released out of order: only the first held one runs; the third waits its turn.
    let early = kit.deliver(third.clone()).await.expect("delivered");
    assert_eq!(early.outcome, Outcome::Held);
    let turn = kit.deliver(second.clone()).await.expect("delivered");
    assert_eq!(turn.outcome, Outcome::Processed);
    let last = kit.deliver(third.clone()).await.expect("delivered");
    assert_eq!(last.outcome, Outcome::Processed);
    assert_eq!(applied(&scratch, "k").await, vec![1, 2, 3]);
    let again = kit.deliver(second).await.expect("delivered");
    assert_eq!(again.outcome, Outcome::Duplicate);
    assert_eq!(applied(&scratch, "k").await, vec![1, 2, 3]);

    // A head whose row is PROCESSED (another instance applied a copy of it while this one
    // recorded the copy's failure) blocks nothing.
    sqlx::query("UPDATE inbox_order_key SET head_message_id = $1 WHERE order_key = 'k'")
        .bind(&again.inbox_key)
        .execute(scratch.pool())
        .await
        .expect("head set");
    let fourth = kit.deliver(step("k", 4)).await.expect("delivered");
    assert_eq!(fourth.outcome, Outcome::Processed);
    assert_eq!(applied(&scratch, "k").await, vec![1, 2, 3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_in_a_batch_holds_the_rest_of_its_key_in_the_same_batch() {
    let scratch = scratch().await;
    let kit = kit(&scratch, OrderingPolicy::by_aggregate());
    let before = step("k", 1);
    let failing =
        TestMessage::json("Step", json!({"step": 2, "fail": "permanent"})).aggregate("Order", "k");
    let after = step("k", 3);
    let done = kit
        .deliver_batch([before, failing, after, step("j", 1)])
        .await
        .expect("delivered");
    assert_eq!(
        done[0].outcome,
        Outcome::Processed,
        "before the failure: runs"
    );
    assert!(
        matches!(done[1].outcome, Outcome::Parked { .. }),
        "{:?}",
        done[1]
    );
    assert_eq!(done[2].outcome, Outcome::Held, "after the failure: held");
    assert_eq!(done[3].outcome, Outcome::Processed);
    assert_eq!(applied(&scratch, "k").await, vec![1]);
    assert_eq!(
        head(&scratch, "k").await.as_deref(),
        Some(done[1].inbox_key.as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequence_numbers_hold_a_gap_until_the_missing_number_arrives() {
    let scratch = scratch().await;
    let kit = kit(
        &scratch,
        OrderingPolicy::by_aggregate().with_sequence(SequencePolicy::header("x-sequence").on_gap(
            Duration::from_secs(60),
            rabbit_inbox::ordering::GapPolicy::KeepHolding,
        )),
    );
    let n = |n: i64| step("k", n).header("x-sequence", n);
    let first = kit
        .deliver_batch([n(1), n(3), n(4)])
        .await
        .expect("delivered");
    assert_eq!(first[0].outcome, Outcome::Processed);
    assert_eq!(first[1].outcome, Outcome::Held);
    assert_eq!(first[2].outcome, Outcome::Held);
    let gap: Option<bool> = sqlx::query_scalar(
        "SELECT gap_since IS NOT NULL FROM inbox_order_key WHERE order_key = 'k'",
    )
    .fetch_optional(scratch.pool())
    .await
    .expect("key row");
    assert_eq!(gap, Some(true), "the gap's clock runs");

    let filled = kit.deliver(n(2)).await.expect("delivered");
    assert_eq!(filled.outcome, Outcome::Processed);
    assert_eq!(
        kit.deliver(n(3)).await.expect("delivered").outcome,
        Outcome::Processed
    );
    assert_eq!(
        kit.deliver(n(4)).await.expect("delivered").outcome,
        Outcome::Processed
    );
    assert_eq!(applied(&scratch, "k").await, vec![1, 2, 3, 4]);

    // A number the key has passed (sent again under a new id) is parked, not applied.
    let passed = kit.deliver(n(2)).await.expect("delivered");
    match &passed.outcome {
        Outcome::Parked { code, .. } => assert_eq!(code, SEQUENCE_PASSED),
        other => panic!("parked expected, got {other:?}"),
    }
    assert_eq!(
        head(&scratch, "k").await,
        None,
        "a passed number blocks nothing"
    );
    assert_eq!(applied(&scratch, "k").await, vec![1, 2, 3, 4]);

    // A failing head records its key and number, so an operator sees where it stands.
    let failing = TestMessage::json("Step", json!({"step": 5, "fail": "permanent"}))
        .aggregate("Order", "k")
        .header("x-sequence", 5);
    let parked = kit.deliver(failing).await.expect("delivered");
    let row = parked.record.as_ref().expect("a row");
    assert_eq!(row.order_key.as_deref(), Some("k"));
    assert_eq!(row.order_position, Some(5));
    assert_eq!(
        head(&scratch, "k").await.as_deref(),
        Some(row.message_id.as_str())
    );
    let behind = kit.deliver(n(6)).await.expect("delivered");
    assert_eq!(behind.outcome, Outcome::Held);
}
