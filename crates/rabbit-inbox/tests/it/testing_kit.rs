//! The handler test kit (`rabbit_inbox::testing`, feature `testing`) against the real
//! PostgreSQL and no broker: each outcome (processed, duplicate, retry, poisoned, permanent,
//! invalid) and the row it leaves, and the same rows as a real consumer leaves for the same
//! handler and messages.

use std::time::Duration;

use inbox_testkit::env::{BatchRule, Rule, TestEnv, message, thing};
use rabbit_inbox::{
    ConsumerConfig, ErrorKind, Handler, HandlerError, InboxMessage, InboxStatus, Outcome, Topology,
    broker::OutgoingMessage,
    status::{ConfirmedCopyKind, PendingCopy},
    store::InboxRecord,
    testing::{BrokerAction, ScratchSchema, TestConsumer, TestMessage},
};
use serde_json::json;
use sqlx::PgConnection;

/// Books `{"amount": n}` into `entries` (a table of the scratch schema, named without a
/// schema), then fails as the body's `"fail"` says: `"retryable"` every time,
/// `"first_attempt"` on attempt 1 only, `"permanent"`.
struct Bookkeeper;

impl Handler for Bookkeeper {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        #[derive(serde::Deserialize)]
        struct Entry {
            amount: i64,
            #[serde(default)]
            fail: Option<String>,
        }
        let entry: Entry = msg.decode()?;
        sqlx::query("INSERT INTO entries (message_id, amount, attempt) VALUES ($1, $2, $3)")
            .bind(msg.message_id())
            .bind(entry.amount)
            .bind(msg.attempt())
            .execute(&mut *tx)
            .await?;
        match entry.fail.as_deref() {
            Some("retryable") => Err(HandlerError::retryable("ledger_busy", "try again")),
            Some("first_attempt") if msg.attempt() == 1 => Err(HandlerError::retryable(
                "ledger_busy",
                "first attempt fails",
            )),
            Some("permanent") => Err(HandlerError::permanent(
                "unknown_account",
                "no such account",
            )),
            _ => Ok(()),
        }
    }
}

/// A test's [`ScratchSchema`], removed by [`Scratch::remove`] at its end, or on drop when the
/// test panics before (from a thread with a runtime and a connection of its own, since the
/// test's runtime is unwinding).
pub(crate) struct Scratch(Option<ScratchSchema>);

impl std::ops::Deref for Scratch {
    type Target = ScratchSchema;
    fn deref(&self) -> &ScratchSchema {
        self.0.as_ref().expect("not removed yet")
    }
}

impl Scratch {
    /// Arms the guard over a created schema: dropped with the schema on a panic.
    pub(crate) fn new(scratch: ScratchSchema) -> Self {
        Self(Some(scratch))
    }

    async fn remove(mut self) {
        if let Some(scratch) = self.0.take() {
            scratch.remove().await.expect("scratch schema dropped");
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(scratch) = self.0.take() {
            drop(inbox_testkit::DropSchemaOnDrop(scratch.name().clone()));
        }
    }
}

async fn scratch() -> Scratch {
    let scratch = ScratchSchema::create(&inbox_testkit::database_url())
        .await
        .expect("the scratch schema is created and migrated");
    // Armed before anything else can fail.
    let scratch = Scratch(Some(scratch));
    scratch
        .execute(
            "CREATE TABLE entries (message_id TEXT NOT NULL, amount BIGINT NOT NULL, \
             attempt INT NOT NULL)",
        )
        .await
        .expect("the test table is created");
    scratch
}

fn config(scratch: &ScratchSchema) -> ConsumerConfig {
    let mut config = ConsumerConfig::new("billing", Topology::new("payments"));
    config.schema = scratch.name().clone();
    config
}

async fn entries(scratch: &ScratchSchema, message_id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM entries WHERE message_id = $1")
        .bind(message_id)
        .fetch_one(scratch.pool())
        .await
        .expect("entries readable")
}

fn row(delivered: &rabbit_inbox::testing::Delivered) -> &InboxRecord {
    delivered.record.as_ref().expect("the delivery has a row")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processed_then_duplicate() {
    let scratch = scratch().await;
    let kit = TestConsumer::new(scratch.pool().clone(), config(&scratch), Bookkeeper)
        .expect("valid config");
    let msg =
        TestMessage::json("PaymentReceived", json!({"amount": 40})).aggregate("Account", "a1");
    let id = msg.message_id().expect("a fresh id").to_owned();

    let first = kit.deliver(msg.clone()).await.expect("delivered");
    assert_eq!(first.outcome, Outcome::Processed);
    assert_eq!(first.broker_action, BrokerAction::Ack);
    assert_eq!(first.inbox_key, id);
    assert_eq!(first.noted_copy, None);
    let record = row(&first);
    assert_eq!(record.status, InboxStatus::Processed);
    assert_eq!(record.consumer_name, "billing");
    assert_eq!(record.message_type, "PaymentReceived");
    assert_eq!(record.aggregate_id.as_deref(), Some("a1"));
    assert_eq!(record.processing_attempt, 1);
    assert_eq!(record.delivery_count, 1);
    assert!(record.processed_at.is_some());

    let again = kit.deliver(msg.redelivered(true)).await.expect("delivered");
    assert_eq!(again.outcome, Outcome::Duplicate);
    assert_eq!(again.broker_action, BrokerAction::Ack);
    assert_eq!(row(&again).delivery_count, 2);
    assert_eq!(row(&again).processing_attempt, 1);
    assert_eq!(entries(&scratch, &id).await, 1, "the effect committed once");
    let stats = kit.stats();
    assert_eq!(
        (stats.received, stats.processed, stats.duplicates),
        (2, 1, 1)
    );
    assert_eq!(
        kit.record(&id).await.expect("readable").as_ref(),
        again.record.as_ref()
    );
    drop(kit);
    scratch.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retryable_failure_schedules_a_retry_whose_copy_runs_the_next_attempt() {
    let scratch = scratch().await;
    let kit = TestConsumer::new(scratch.pool().clone(), config(&scratch), Bookkeeper)
        .expect("valid config");
    let msg = TestMessage::json(
        "PaymentReceived",
        json!({"amount": 5, "fail": "first_attempt"}),
    );
    let id = msg.message_id().expect("id").to_owned();

    let failed = kit.deliver(msg.clone()).await.expect("delivered");
    assert_eq!(
        failed.outcome,
        Outcome::RetryScheduled {
            attempt: 1,
            code: "ledger_busy".into()
        }
    );
    assert_eq!(
        failed.broker_action,
        BrokerAction::Retry {
            queue: "payments.retry.1s".into(),
            delay: Duration::from_secs(1),
            attempt: 1
        },
        "{}",
        failed.broker_action
    );
    assert_eq!(
        failed.noted_copy.as_ref().map(|c| c.kind),
        Some(ConfirmedCopyKind::Retry(Duration::from_secs(1)))
    );
    let record = row(&failed);
    assert_eq!(record.status, InboxStatus::RetryableFailed);
    assert_eq!(record.processing_attempt, 1);
    assert_eq!(record.last_error_code.as_deref(), Some("ledger_busy"));
    assert_eq!(
        record.retry_copy_attempt,
        Some(1),
        "the retry copy is noted"
    );
    assert!(record.retry_due_at.is_some());
    assert_eq!(
        entries(&scratch, &id).await,
        0,
        "the failed attempt rolled back"
    );

    // Another copy before the retry is due: a duplicate of the copy in the tier.
    let early = kit.deliver(msg.clone()).await.expect("delivered");
    assert_eq!(
        early.outcome,
        Outcome::CopyPending {
            copy: PendingCopy::Retry
        }
    );
    assert_eq!(early.broker_action, BrokerAction::Ack);
    assert_eq!(row(&early).retry_duplicates, 1);

    // The copy back from the tier runs attempt 2.
    let copy = failed.retry_copy().expect("a retry was scheduled");
    assert_eq!(
        copy.as_amqp().headers.get("x-inbox-retry-attempt"),
        Some(&json!(1))
    );
    let retried = kit.deliver(copy).await.expect("delivered");
    assert_eq!(retried.outcome, Outcome::Processed);
    assert_eq!(row(&retried).processing_attempt, 2);
    assert_eq!(row(&retried).status, InboxStatus::Processed);
    assert_eq!(row(&retried).retry_copy_attempt, None);
    let attempts: Vec<i32> =
        sqlx::query_scalar("SELECT attempt FROM entries WHERE message_id = $1")
            .bind(&id)
            .fetch_all(scratch.pool())
            .await
            .expect("entries");
    assert_eq!(attempts, [2]);
    drop(kit);
    scratch.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spent_retries_poison_and_park_the_message() {
    let scratch = scratch().await;
    let mut config = config(&scratch);
    config.retry.max_attempts = 2;
    let kit = TestConsumer::new(scratch.pool().clone(), config, Bookkeeper).expect("valid");
    let msg = TestMessage::json("PaymentReceived", json!({"amount": 1, "fail": "retryable"}));

    let first = kit.deliver(msg).await.expect("delivered");
    let copy = first.retry_copy().expect("retry scheduled");
    let last = kit.deliver(copy).await.expect("delivered");
    assert!(
        matches!(
            &last.outcome,
            Outcome::Parked { status: InboxStatus::Poisoned, code, attempt: Some(2), .. }
                if code == "ledger_busy"
        ),
        "{:?}",
        last.outcome
    );
    assert_eq!(
        last.broker_action,
        BrokerAction::Park {
            queue: "payments.parking-lot".into(),
            status: InboxStatus::Poisoned,
            code: "ledger_busy".into()
        }
    );
    assert_eq!(last.retry_copy(), None);
    let record = row(&last);
    assert_eq!(record.status, InboxStatus::Poisoned);
    assert_eq!(record.processing_attempt, 2);
    assert!(record.parked_copy_at.is_some(), "the parked copy is noted");
    drop(kit);
    scratch.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failure_is_parked_once_and_later_copies_are_its_duplicates() {
    let scratch = scratch().await;
    let kit = TestConsumer::new(scratch.pool().clone(), config(&scratch), Bookkeeper)
        .expect("valid config");
    let msg = TestMessage::json("PaymentReceived", json!({"amount": 9, "fail": "permanent"}));
    let id = msg.message_id().expect("id").to_owned();

    let parked = kit.deliver(msg.clone()).await.expect("delivered");
    assert_eq!(
        parked.outcome,
        Outcome::Parked {
            status: InboxStatus::PermanentFailed,
            code: "unknown_account".into(),
            message: "no such account".into(),
            attempt: Some(1)
        }
    );
    assert_eq!(
        parked.broker_action.to_string(),
        "would park in payments.parking-lot (PERMANENT_FAILED, unknown_account), then ack"
    );
    let record = row(&parked);
    assert_eq!(record.status, InboxStatus::PermanentFailed);
    assert_eq!(record.last_error_code.as_deref(), Some("unknown_account"));
    assert_eq!(record.processing_attempt, 1);
    assert!(record.parked_copy_at.is_some());
    assert_eq!(entries(&scratch, &id).await, 0, "the effect rolled back");

    let again = kit.deliver(msg).await.expect("delivered");
    assert_eq!(
        again.outcome,
        Outcome::CopyPending {
            copy: PendingCopy::Parked
        }
    );
    assert_eq!(again.broker_action, BrokerAction::Ack);
    assert_eq!(row(&again).parked_duplicates, 1);
    assert_eq!(row(&again).delivery_count, 2);
    assert_eq!(row(&again).processing_attempt, 1, "the handler did not run");
    drop(kit);
    scratch.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_messages_are_recorded_and_parked_without_the_handler() {
    let scratch = scratch().await;
    let kit = TestConsumer::new(scratch.pool().clone(), config(&scratch), Bookkeeper)
        .expect("valid config");

    let no_id = kit
        .deliver(TestMessage::json("PaymentReceived", json!({"amount": 1})).without_id())
        .await
        .expect("delivered");
    assert!(
        no_id.inbox_key.starts_with("invalid:"),
        "{}",
        no_id.inbox_key
    );
    assert!(matches!(
        &no_id.broker_action,
        BrokerAction::Park { status: InboxStatus::PermanentFailed, code, .. } if code == "missing_message_id"
    ));
    assert_eq!(
        row(&no_id).last_error_code.as_deref(),
        Some("missing_message_id")
    );

    let bad_json = kit
        .deliver(TestMessage::bytes("PaymentReceived", &b"{\"amount\": "[..]).id("p-bad"))
        .await
        .expect("delivered");
    assert_eq!(bad_json.inbox_key, "p-bad", "a usable id keeps its key");
    assert_eq!(bad_json.status(), Some(InboxStatus::PermanentFailed));
    assert_eq!(
        row(&bad_json).last_error_code.as_deref(),
        Some("invalid_json")
    );
    assert!(row(&bad_json).parked_copy_at.is_some());

    let too_new = kit
        .deliver(
            TestMessage::json("PaymentReceived", json!({"amount": 1}))
                .id("p-v2")
                .version(2),
        )
        .await
        .expect("delivered");
    assert_eq!(
        row(&too_new).last_error_code.as_deref(),
        Some("unsupported_version")
    );
    assert_eq!(row(&too_new).message_version, 2);

    let handled: i64 = sqlx::query_scalar("SELECT count(*) FROM entries")
        .fetch_one(scratch.pool())
        .await
        .expect("entries");
    assert_eq!(handled, 0, "no invalid message reached the handler");
    assert_eq!(kit.stats().parked, 3);
    drop(kit);
    scratch.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_reports_each_message_and_holds_a_second_copy_for_the_next_batch() {
    let scratch = scratch().await;
    let kit = TestConsumer::new(scratch.pool().clone(), config(&scratch), Bookkeeper)
        .expect("valid config");
    let ok = TestMessage::json("PaymentReceived", json!({"amount": 1}));
    let failing = TestMessage::json("PaymentReceived", json!({"amount": 2, "fail": "permanent"}));
    let delivered = kit
        .deliver_batch([ok.clone(), failing, ok.clone()])
        .await
        .expect("delivered");
    let outcomes: Vec<&Outcome> = delivered.iter().map(|d| &d.outcome).collect();
    assert_eq!(outcomes[0], &Outcome::Processed);
    assert!(matches!(outcomes[1], Outcome::Parked { .. }));
    // The second copy of `ok` went in the next batch, after the first one committed.
    assert_eq!(outcomes[2], &Outcome::Duplicate);
    assert_eq!(row(&delivered[2]).delivery_count, 2);
    let id = ok.message_id().expect("id");
    assert_eq!(entries(&scratch, id).await, 1);
    drop(kit);
    scratch.remove().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handler_gets_the_batch_at_once_and_a_blamed_message_fails_alone() {
    let env = TestEnv::new().await;
    let mut config = env.config("batch", env.topology("kit-batch"));
    config.batch_size = 3;
    let (handler, plan) = env.batch_handler();
    plan.for_id("b2", BatchRule::Blame(ErrorKind::Permanent));
    let kit = TestConsumer::with_batch_handler(env.pool.clone(), config, handler).expect("valid");
    let messages = ["b1", "b2", "b3", "b4"].map(|id| as_test_message(&thing(id, 1)));
    let delivered = kit.deliver_batch(messages).await.expect("delivered");
    let statuses: Vec<Option<InboxStatus>> = delivered.iter().map(|d| d.status()).collect();
    assert_eq!(
        statuses,
        [
            Some(InboxStatus::Processed),
            Some(InboxStatus::PermanentFailed),
            Some(InboxStatus::Processed),
            Some(InboxStatus::Processed)
        ]
    );
    assert!(matches!(
        &delivered[1].broker_action,
        BrokerAction::Park { code, .. } if code == "test_blamed"
    ));
    // One call per batch of `batch_size`, then the failed batch again without the blamed one.
    assert_eq!(
        plan.calls(),
        [vec!["b1", "b2", "b3"], vec!["b1", "b3"], vec!["b4"]]
    );
    for (id, effects) in [("b1", 1), ("b2", 0), ("b3", 1), ("b4", 1)] {
        assert_eq!(env.effects(id).await, effects, "effects of {id}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_without_the_inbox_is_requeued_as_a_deployment_fault() {
    let scratch = scratch().await;
    let mut config = config(&scratch);
    config.schema =
        rabbit_inbox::SchemaName::new(format!("{}_missing", scratch.name())).expect("valid name");
    let kit = TestConsumer::new(scratch.pool().clone(), config, Bookkeeper).expect("valid");
    let delivered = kit
        .deliver(TestMessage::json("PaymentReceived", json!({"amount": 1})))
        .await
        .expect("an unrecorded delivery still reports");
    assert!(
        matches!(&delivered.outcome, Outcome::Unrecorded { error } if error.contains("deployment fault")),
        "{:?}",
        delivered.outcome
    );
    assert_eq!(delivered.broker_action, BrokerAction::Requeue);
    assert!(delivered.record.is_none());
    drop(kit);
    scratch.remove().await;
}

/// What the two paths must agree on; timestamps differ by when each ran.
fn ledger_state(r: &InboxRecord) -> impl PartialEq + std::fmt::Debug {
    (
        (
            r.message_type.clone(),
            r.message_version,
            r.status,
            r.processing_attempt,
            r.delivery_count,
            r.payload_sha256.clone(),
            r.payload_conflicts,
        ),
        (
            r.last_error_code.clone(),
            r.last_error_message.clone(),
            r.processed_at.is_some(),
            r.parked_copy_at.is_some(),
            r.parked_duplicates,
            r.retry_copy_attempt,
            r.retry_duplicates,
        ),
    )
}

fn as_test_message(m: &OutgoingMessage) -> TestMessage {
    let mut msg = TestMessage::bytes(m.kind.clone().unwrap_or_default(), m.body.clone());
    msg = match &m.message_id {
        Some(id) => msg.id(id.clone()),
        None => msg.without_id(),
    };
    msg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kit_leaves_the_rows_a_real_consumer_leaves() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("kit-parity"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("k-perm", Rule::Permanent);
    plan.for_id("k-retry", Rule::FailAttempts(1));
    let processed = thing("k-ok", 1);
    let permanent = thing("k-perm", 2);
    let retried = thing("k-retry", 3);
    let not_json = OutgoingMessage {
        body: b"{not json".to_vec(),
        ..thing("k-bad", 4)
    };
    let no_id = message(None, "Thing", &json!({"n": 5}));

    // The real consumer, through RabbitMQ.
    let consumer = env.start(config.clone(), handler.clone());
    for m in [&processed, &permanent, &retried, &not_json, &no_id] {
        env.publish(&topology, m).await;
    }
    let parked = |r: &InboxRecord| r.status.is_parked() && r.parked_copy_at.is_some();
    env.wait_for_record("svc", "k-ok", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    env.wait_for_record("svc", "k-perm", "parked, copy noted", parked)
        .await;
    env.wait_for_record("svc", "k-bad", "parked, copy noted", parked)
        .await;
    env.wait_for_record("svc", "k-retry", "processed on attempt 2", |r| {
        r.status == InboxStatus::Processed && r.processing_attempt == 2
    })
    .await;
    // A second copy of the parked message: a duplicate of its parked copy.
    env.publish(&topology, &permanent).await;
    env.wait_for_record("svc", "k-perm", "one parked duplicate", |r| {
        r.parked_duplicates == 1
    })
    .await;

    // The kit, with the same handler and messages, under another consumer name.
    let mut kit_config = config.clone();
    kit_config.consumer_name = "kit".into();
    let kit = TestConsumer::new(env.pool.clone(), kit_config, handler).expect("valid config");
    for m in [&processed, &permanent, &not_json] {
        kit.deliver(as_test_message(m)).await.expect("delivered");
    }
    let failed = kit
        .deliver(as_test_message(&retried))
        .await
        .expect("delivered");
    kit.deliver(failed.retry_copy().expect("retry scheduled"))
        .await
        .expect("delivered");
    let invalid = kit
        .deliver(as_test_message(&no_id))
        .await
        .expect("delivered");
    kit.deliver(as_test_message(&permanent))
        .await
        .expect("delivered");

    // The no-id message is keyed by its body, whichever consumer saw it.
    env.wait_for_record("svc", &invalid.inbox_key, "parked, copy noted", parked)
        .await;
    for key in [
        "k-ok",
        "k-perm",
        "k-retry",
        "k-bad",
        invalid.inbox_key.as_str(),
    ] {
        let real = env.record("svc", key).await.expect("the consumer's row");
        let kit_row = kit
            .record(key)
            .await
            .expect("readable")
            .expect("the kit's row");
        assert_eq!(
            ledger_state(&kit_row),
            ledger_state(&real),
            "row {key}: the kit's ledger differs from the consumer's"
        );
    }
    assert_eq!(env.effects("k-ok").await, 2, "one effect per consumer");
    assert_eq!(env.effects("k-perm").await, 0);
    consumer.stop().await;
    env.take_parked(&topology, 3).await;
}
