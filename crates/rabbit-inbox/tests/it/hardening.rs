//! Regression tests for what ordinary handler bugs and racing copies must not do to the
//! ledger: a handler that ignores a failed statement, ends the transaction itself, panics or
//! raises database errors; invalid copies of an existing key; failures racing a parked row;
//! a pool too small for the lanes; failures in bulk.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use inbox_testkit::env::{TestEnv, amqp_url, header, message, thing, wait_for};
use rabbit_inbox::{
    BatchError, BatchHandler, ConfigError, Consumer, EnvelopeRules, Handler, HandlerError,
    InboxMessage, InboxStatus, SchemaName, broker::OutgoingMessage, broker::QueueDepths,
    envelope::VERSION_HEADER, status::HANDLER_PANICKED, status::PAYLOAD_CONFLICT,
    status::TRANSACTION_ABORTED, status::parking_headers, store::Failure,
};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgConnection, postgres::PgPoolOptions};

const EMPTY: QueueDepths = QueueDepths {
    work: 0,
    retry: 0,
    parking: 0,
};

fn is(status: InboxStatus) -> impl Fn(&rabbit_inbox::store::InboxRecord) -> bool {
    move |r| r.status == status
}

/// What a [`Hostile`] handler does for a message, after writing its effect row.
#[derive(Clone, Copy, Debug)]
enum Act {
    /// Runs a statement that fails, ignores the error and reports success.
    IgnoreFailedStatement,
    /// Runs `ROLLBACK` itself and reports success.
    RollbackItself,
    /// Panics.
    Panic,
    /// Raises a real PostgreSQL error with this SQLSTATE on its first call, then succeeds.
    RaiseOnce(&'static str),
    /// Raises a real PostgreSQL error with this SQLSTATE every time.
    Raise(&'static str),
    /// Inserts a row that breaks a deferred unique constraint: COMMIT fails.
    BreakDeferredConstraint,
}

/// A per-message handler with ordinary bugs, by message id. Writes one `effects` row per
/// message in the transaction and counts its calls.
#[derive(Clone)]
struct Hostile {
    schema: SchemaName,
    acts: Arc<Mutex<HashMap<String, Act>>>,
    calls: Arc<Mutex<HashMap<String, u32>>>,
}

impl Hostile {
    fn new(env: &TestEnv) -> Self {
        Self {
            schema: env.schema.clone(),
            acts: Arc::default(),
            calls: Arc::default(),
        }
    }

    fn act(&self, id: &str, act: Act) {
        self.acts.lock().expect("lock").insert(id.to_owned(), act);
    }

    fn calls(&self, id: &str) -> u32 {
        self.calls
            .lock()
            .expect("lock")
            .get(id)
            .copied()
            .unwrap_or(0)
    }

    fn total_calls(&self) -> u32 {
        self.calls.lock().expect("lock").values().sum()
    }
}

async fn raise(tx: &mut PgConnection, sqlstate: &str) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DO $$ BEGIN RAISE EXCEPTION 'raised by the test handler' USING ERRCODE = '{sqlstate}'; END $$"
    )))
    .execute(tx)
    .await
    .map(|_| ())
}

impl Handler for Hostile {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let id = msg.message_id().to_owned();
        let call = {
            let mut calls = self.calls.lock().expect("lock");
            let n = calls.entry(id.clone()).or_default();
            *n += 1;
            *n
        };
        let s = &self.schema;
        insert_effect(tx, s, msg).await?;
        let act = self.acts.lock().expect("lock").get(&id).copied();
        match act {
            None => {}
            Some(Act::IgnoreFailedStatement) => {
                let _ = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
            }
            Some(Act::RollbackItself) => {
                sqlx::raw_sql("ROLLBACK").execute(&mut *tx).await?;
            }
            Some(Act::Panic) => panic!("the handler cannot cope with {id}"),
            Some(Act::RaiseOnce(code)) if call == 1 => raise(tx, code).await?,
            Some(Act::RaiseOnce(_)) => {}
            Some(Act::Raise(code)) => raise(tx, code).await?,
            Some(Act::BreakDeferredConstraint) => {
                for _ in 0..2 {
                    sqlx::query(AssertSqlSafe(format!(
                        "INSERT INTO \"{s}\".deferred_unique (k) VALUES ($1)"
                    )))
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?;
                }
            }
        }
        Ok(())
    }
}

/// One `effects` row for `msg`, in the transaction.
async fn insert_effect(
    tx: &mut PgConnection,
    schema: &SchemaName,
    msg: &InboxMessage<'_>,
) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".effects (message_id, consumer_name, message_type, attempt, body) \
         VALUES ($1, $2, $3, $4, '')"
    )))
    .bind(msg.message_id())
    .bind(msg.consumer_name())
    .bind(msg.message_type())
    .bind(msg.attempt())
    .execute(tx)
    .await
    .map(|_| ())
}

/// Publishes `ids` as `Thing` messages.
async fn publish_all(env: &TestEnv, topology: &rabbit_inbox::Topology, ids: &[&str]) {
    for (n, id) in (0..).zip(ids) {
        env.publish(topology, &thing(id, n)).await;
    }
}

/// The culprit of an aborted transaction is charged and never acked as processed; the
/// messages that shared its batch are processed once and never charged.
async fn culprit_is_blamed(act: Act, tag: &str) {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology(tag));
    config.lanes = 1;
    config.retry.max_attempts = 2;
    config.max_batch_delay = Duration::from_millis(300);
    let topology = config.topology.clone();
    env.declare(&config).await;
    let handler = Hostile::new(&env);
    handler.act("bad", act);
    let ids = ["a", "b", "bad", "c", "d"];
    publish_all(&env, &topology, &ids).await;
    let consumer = env.start(config, handler.clone());

    let bad = env
        .wait_for_record("svc", "bad", "POISONED", is(InboxStatus::Poisoned))
        .await;
    for id in ["a", "b", "c", "d"] {
        env.wait_for_record("svc", id, "PROCESSED", is(InboxStatus::Processed))
            .await;
    }
    let parked = env.take_parked(&topology, 1).await;
    let stats = consumer.stop().await;

    assert_eq!(bad.last_error_code.as_deref(), Some(TRANSACTION_ABORTED));
    assert_eq!(
        bad.processing_attempt, 2,
        "the culprit is charged per attempt"
    );
    assert_eq!(
        env.effects("bad").await,
        0,
        "nothing of the culprit committed"
    );
    for id in ["a", "b", "c", "d"] {
        let row = env.record("svc", id).await.expect("row");
        assert_eq!(row.processing_attempt, 1, "{id} is not charged");
        assert_eq!(row.last_error_code, None, "{id} is not blamed");
        assert_eq!(env.effects(id).await, 1, "{id} applied exactly once");
    }
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].message_id.as_deref(), Some("bad"));
    assert_eq!(
        header(&parked[0], parking_headers::ERROR_CODE),
        Some(TRANSACTION_ABORTED)
    );
    assert_eq!(stats.sessions, 1);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_transaction_is_not_acked_as_processed_and_the_culprit_is_blamed() {
    culprit_is_blamed(Act::IgnoreFailedStatement, "aborted").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_rollback_is_not_acked_as_processed_and_cannot_write_outside_the_inbox() {
    culprit_is_blamed(Act::RollbackItself, "rollback").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panic_is_parked_and_the_lane_keeps_running() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("panic"));
    config.lanes = 1;
    config.max_batch_delay = Duration::from_millis(300);
    let topology = config.topology.clone();
    env.declare(&config).await;
    let handler = Hostile::new(&env);
    handler.act("boom", Act::Panic);
    publish_all(&env, &topology, &["a", "boom", "b"]).await;
    let consumer = env.start(config, handler.clone());

    let row = env
        .wait_for_record(
            "svc",
            "boom",
            "PERMANENT_FAILED",
            is(InboxStatus::PermanentFailed),
        )
        .await;
    let parked = env.take_parked(&topology, 1).await;
    // The lane still runs: a message published after the panic is processed.
    env.publish(&topology, &thing("after", 9)).await;
    env.wait_for_record("svc", "after", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;

    assert_eq!(row.last_error_code.as_deref(), Some(HANDLER_PANICKED));
    let text = row.last_error_message.unwrap_or_default();
    assert!(text.contains("cannot cope with boom"), "{text}");
    assert_eq!(
        handler.calls("boom"),
        1,
        "a panic is permanent: not retried"
    );
    assert_eq!(env.effects("boom").await, 0);
    for id in ["a", "b", "after"] {
        assert_eq!(env.effects(id).await, 1, "{id}");
    }
    assert_eq!(parked.len(), 1);
    assert_eq!(
        header(&parked[0], parking_headers::ERROR_CODE),
        Some(HANDLER_PANICKED)
    );
    assert_eq!(stats.sessions, 1, "no reconnect: the lane survived");
    assert_eq!(env.depths(&topology).await, EMPTY);
}

/// A batch handler that panics whenever its batch holds `boom`.
#[derive(Clone)]
struct PanickingBatch(SchemaName);

impl BatchHandler for PanickingBatch {
    async fn handle_batch(
        &self,
        msgs: &[InboxMessage<'_>],
        tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        for m in msgs {
            if m.message_id() == "boom" {
                panic!("batch with boom");
            }
            insert_effect(tx, &self.0, m)
                .await
                .map_err(|e| BatchError::Batch(e.into()))?;
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_handler_panic_is_isolated_to_its_message() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("batch-panic"));
    config.lanes = 1;
    config.max_batch_delay = Duration::from_millis(300);
    let topology = config.topology.clone();
    env.declare(&config).await;
    publish_all(&env, &topology, &["a", "boom", "b", "c"]).await;
    let consumer = env.start_batch(config, PanickingBatch(env.schema.clone()));

    let row = env
        .wait_for_record(
            "svc",
            "boom",
            "PERMANENT_FAILED",
            is(InboxStatus::PermanentFailed),
        )
        .await;
    for id in ["a", "b", "c"] {
        env.wait_for_record("svc", id, "PROCESSED", is(InboxStatus::Processed))
            .await;
        assert_eq!(env.effects(id).await, 1, "{id}");
    }
    env.take_parked(&topology, 1).await;
    let stats = consumer.stop().await;
    assert_eq!(row.last_error_code.as_deref(), Some(HANDLER_PANICKED));
    assert_eq!(stats.sessions, 1);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deterministic_database_errors_are_parked_not_requeued() {
    let env = TestEnv::new().await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{}\".deferred_unique (k TEXT, \
           CONSTRAINT deferred_unique_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("table");
    let mut config = env.config("svc", env.topology("deterministic"));
    config.lanes = 1;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let handler = Hostile::new(&env);
    // Raised by the handler (data exception, program limit) and at COMMIT (deferred
    // constraint): all permanent, whatever the handler's own classification would say.
    handler.act("data", Act::Raise("22023"));
    handler.act("limit", Act::Raise("54000"));
    handler.act("deferred", Act::BreakDeferredConstraint);
    // An 8 KB aggregate id that does not compress is too large for the aggregate index (54000
    // in the library's own claim statement): recorded and parked, never requeued forever.
    let mut huge = thing("huge", 4);
    let incompressible: String = (0..512).map(|_| inbox_testkit::env::random_hex()).collect();
    huge.headers.insert(
        rabbit_inbox::envelope::AGGREGATE_ID_HEADER.into(),
        json!(incompressible),
    );
    publish_all(&env, &topology, &["data", "limit", "deferred", "fine"]).await;
    env.publish(&topology, &huge).await;
    let consumer = env.start(config, handler.clone());

    let parked = env.take_parked(&topology, 4).await;
    env.wait_for_record("svc", "fine", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;

    for (id, codes) in [
        ("data", &["db_invalid_data"][..]),
        ("limit", &["db_limit_exceeded"]),
        ("deferred", &["db_constraint"]),
        ("huge", &["db_limit_exceeded", "field_too_long"]),
    ] {
        let row = env
            .record("svc", id)
            .await
            .expect("row of a parked message");
        assert_eq!(row.status, InboxStatus::PermanentFailed, "{id}");
        let code = row.last_error_code.unwrap_or_default();
        assert!(codes.contains(&code.as_str()), "{id}: {code}");
        assert!(
            parked.iter().any(|m| m.message_id.as_deref() == Some(id)),
            "{id} is parked"
        );
        assert_eq!(env.effects(id).await, 0, "{id}");
    }
    assert_eq!(
        handler.calls("data"),
        1,
        "a permanent failure is not retried"
    );
    assert_eq!(stats.unrecorded, 0, "nothing was requeued as unavailable");
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_deadlock_is_run_again_without_charging_an_attempt() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("deadlock"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let handler = Hostile::new(&env);
    handler.act("dl", Act::RaiseOnce("40P01"));
    handler.act("ser", Act::RaiseOnce("40001"));
    publish_all(&env, &topology, &["dl", "ser"]).await;
    let consumer = env.start(config, handler.clone());
    for id in ["dl", "ser"] {
        let row = env
            .wait_for_record("svc", id, "PROCESSED", is(InboxStatus::Processed))
            .await;
        assert_eq!(row.processing_attempt, 1, "{id}: no attempt charged");
        assert_eq!(env.effects(id).await, 1, "{id}");
        assert_eq!(handler.calls(id), 2, "{id} ran again in a new transaction");
    }
    let stats = consumer.stop().await;
    assert_eq!(stats.retried, 0, "not sent through the retry queue");
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_copy_of_a_processed_id_is_a_conflict_not_a_duplicate() {
    let env = TestEnv::new().await;
    let rules = EnvelopeRules {
        supported_versions: 1..=2,
        ..EnvelopeRules::default()
    };
    let mut config = env.config("svc", env.topology("invalid-processed"));
    config.envelope = rules;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let handler = Hostile::new(&env);
    env.publish(&topology, &thing("m1", 1)).await;
    let consumer = env.start(config, handler.clone());
    env.wait_for_record("svc", "m1", "PROCESSED", is(InboxStatus::Processed))
        .await;

    let mut not_json = thing("m1", 1);
    not_json.body = b"{not json".to_vec();
    let mut future_version = thing("m1", 1);
    future_version
        .headers
        .insert(VERSION_HEADER.into(), json!(7));
    future_version.body = br#"{"id":"m1","n":2}"#.to_vec();
    env.publish(&topology, &not_json).await;
    env.publish(&topology, &future_version).await;
    let parked = env.take_parked(&topology, 2).await;
    let stats = consumer.stop().await;

    let row = env.record("svc", "m1").await.expect("row");
    assert_eq!(row.status, InboxStatus::Processed, "the valid copy's row");
    assert_eq!(row.payload_conflicts, 2, "both copies counted as conflicts");
    assert_eq!(row.last_error_code, None);
    assert_eq!(env.effects("m1").await, 1);
    assert_eq!(parked.len(), 2);
    for m in &parked {
        assert_eq!(
            header(m, parking_headers::ERROR_CODE),
            Some(PAYLOAD_CONFLICT)
        );
    }
    assert_eq!(stats.duplicates, 0, "no invalid copy acked as a duplicate");
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_copy_of_a_retrying_id_does_not_change_its_row() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("invalid-retrying"));
    config.retry.delays = vec![Duration::from_millis(1500)];
    let retry = config.retry.clone();
    let topology = config.topology.clone();
    env.declare(&config).await;
    let handler = Hostile::new(&env);
    handler.act("m1", Act::RaiseOnce("55P03"));
    env.publish(&topology, &thing("m1", 1)).await;
    let consumer = env.start(config, handler.clone());
    let failed = env
        .wait_for_record(
            "svc",
            "m1",
            "RETRYABLE_FAILED",
            is(InboxStatus::RetryableFailed),
        )
        .await;

    // While the valid copy waits in the retry queue, an invalid one arrives under its id.
    let mut not_json = thing("m1", 1);
    not_json.body = b"\xff\xfe not json".to_vec();
    env.publish(&topology, &not_json).await;
    // Its retry tier is its own, not the test default's: count the queues by its policy.
    let mut parked = Vec::new();
    wait_for("the invalid copy parked", async || {
        if let Some(m) = env.take_one(&topology.parking_queue).await {
            parked.push(m);
        }
        !parked.is_empty()
    })
    .await;
    let during = env.record("svc", "m1").await.expect("row");
    assert_eq!(during.status, InboxStatus::RetryableFailed, "row unchanged");
    assert_eq!(during.payload_sha256, failed.payload_sha256);
    assert_eq!(during.processing_attempt, failed.processing_attempt);

    // The valid copy comes back and is processed, not parked as invalid.
    let done = env
        .wait_for_record("svc", "m1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;
    assert_eq!(done.payload_conflicts, 1);
    assert_eq!(env.effects("m1").await, 1);
    assert_eq!(parked.len(), 1);
    assert_eq!(
        header(&parked[0], parking_headers::ERROR_CODE),
        Some(PAYLOAD_CONFLICT)
    );
    assert_eq!(parked[0].body, not_json.body);
    assert_eq!(stats.parked, 1);
    let depths = env
        .broker
        .queue_depths(&topology, &retry)
        .await
        .expect("depths");
    assert_eq!(depths, EMPTY);
    // The cleanup knows the default tier only: remove this one here.
    env.broker
        .delete(&topology, &retry)
        .await
        .expect("queues deleted");
}

fn envelope(id: &str) -> rabbit_inbox::Envelope {
    rabbit_inbox::envelope::parse(
        rabbit_inbox::envelope::AmqpMessage {
            message_id: Some(id.into()),
            body: b"{\"n\":1}".to_vec(),
            ..Default::default()
        },
        &EnvelopeRules::default(),
    )
    .expect("valid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_failure_does_not_revive_a_parked_row() {
    let env = TestEnv::new().await;
    let mut conn = env.pool.acquire().await.expect("connection");
    let failure = |status, code| Failure {
        status,
        code,
        message: "m",
        safe_detail: None,
        max_attempts: 5,
        store_payload: false,
    };
    for parked in [InboxStatus::PermanentFailed, InboxStatus::Poisoned] {
        let e = envelope(&format!("m-{parked}"));
        let first = env
            .store
            .record_failure(&mut conn, "svc", &e, failure(parked, "first"))
            .await
            .expect("recorded");
        assert_eq!(first.map(|(s, _)| s), Some(parked));
        // A copy that raced the first one fails retryably afterwards.
        let racing = env
            .store
            .record_failure(
                &mut conn,
                "svc",
                &e,
                failure(InboxStatus::RetryableFailed, "racing"),
            )
            .await
            .expect("statement runs");
        assert_eq!(racing, None, "the parked row is left alone");
        let row = env.record("svc", &e.message_id).await.expect("row");
        assert_eq!(row.status, parked);
        assert_eq!(row.last_error_code.as_deref(), Some("first"));
        // Nor can a success mark it processed.
        let marked = env
            .store
            .mark_processed(&mut conn, "svc", &[e.message_id.as_str()], false)
            .await
            .expect("statement runs");
        assert_eq!(marked, 0, "mark_processed leaves a parked row alone");
        assert_eq!(
            env.record("svc", &e.message_id).await.map(|r| r.status),
            Some(parked)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_without_a_spare_connection_is_rejected() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("pool"));
    config.lanes = 3;
    let small = PgPoolOptions::new()
        .max_connections(3)
        .connect_lazy(&inbox_testkit::env::database_url())
        .expect("lazy pool");
    match Consumer::new(amqp_url(), small, config.clone(), Hostile::new(&env)) {
        Err(ConfigError::InvalidSetting { name, reason }) => {
            assert_eq!(name, "pool");
            assert!(reason.contains("lanes + 1"), "{reason}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a pool of 3 for 3 lanes must be refused"),
    }
    // One spare connection is enough for failures to be recorded and parked.
    let enough = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&inbox_testkit::env::database_url())
        .await
        .expect("pool");
    let topology = config.topology.clone();
    env.declare(&config).await;
    let handler = Hostile::new(&env);
    handler.act("data", Act::Raise("22023"));
    handler.act("retry", Act::RaiseOnce("55P03"));
    publish_all(&env, &topology, &["data", "retry", "ok"]).await;
    let consumer = env.start_with_pool(enough, config, handler);
    env.take_parked(&topology, 1).await;
    env.wait_for_record("svc", "retry", "PROCESSED", is(InboxStatus::Processed))
        .await;
    env.wait_for_record("svc", "ok", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;
    assert_eq!(stats.unrecorded, 0, "no failure record timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_cost_linear_handler_runs() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("linear"));
    config.lanes = 1;
    config.batch_size = 100;
    config.prefetch = 200;
    config.max_batch_delay = Duration::from_secs(1);
    let topology = config.topology.clone();
    env.declare(&config).await;
    let handler = Hostile::new(&env);
    let ids: Vec<String> = (0..200).map(|i| format!("m{i:03}")).collect();
    // Every fifth message fails permanently: 20% of each batch.
    for id in ids.iter().step_by(5) {
        handler.act(id, Act::Raise("22023"));
    }
    let messages: Vec<OutgoingMessage> = (0..).zip(&ids).map(|(n, id)| thing(id, n)).collect();
    let pairs: Vec<(&str, &OutgoingMessage)> = messages
        .iter()
        .map(|m| (topology.queue.as_str(), m))
        .collect();
    env.broker
        .publish_batch("", &pairs)
        .await
        .expect("published");
    let consumer = env.start(config, handler.clone());
    wait_for("every message settled", async || {
        let s = consumer.snapshot();
        s.processed + s.parked >= 200
    })
    .await;
    let stats = consumer.stop().await;

    assert_eq!(stats.processed, 160);
    assert_eq!(stats.parked, 40);
    let runs = handler.total_calls();
    assert!(
        runs <= 2 * 200,
        "{runs} handler runs for 200 messages: at most two per message on average"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.effects").await,
        160,
        "each good message applied once"
    );
    env.take_parked(&topology, 40).await;
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_message_without_json_is_parked_with_its_row() {
    // An invalid delivery keyed by its own id, never seen before: recorded and parked.
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("invalid-new"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let mut bad = message(Some("nj"), "Thing", &json!({}));
    bad.body = b"nope".to_vec();
    env.publish(&topology, &bad).await;
    let consumer = env.start(config, Hostile::new(&env));
    let parked = env.take_parked(&topology, 1).await;
    consumer.stop().await;
    let row = env.record("svc", "nj").await.expect("row");
    assert_eq!(row.status, InboxStatus::PermanentFailed);
    assert_eq!(row.last_error_code.as_deref(), Some("invalid_json"));
    assert_eq!(
        header(&parked[0], parking_headers::ERROR_CODE),
        Some("invalid_json")
    );
}

/// A set-based batch handler that refuses every message whose id starts with `bad`, all at
/// once, before writing anything; logs the ids of each call.
#[derive(Clone)]
struct Validating {
    schema: SchemaName,
    calls: Arc<Mutex<Vec<Vec<String>>>>,
}

impl BatchHandler for Validating {
    async fn handle_batch(
        &self,
        msgs: &[InboxMessage<'_>],
        tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        self.calls
            .lock()
            .expect("lock")
            .push(msgs.iter().map(|m| m.message_id().to_owned()).collect());
        let refused: Vec<(usize, HandlerError)> = msgs
            .iter()
            .enumerate()
            .filter(|(_, m)| m.message_id().starts_with("bad"))
            .map(|(i, m)| {
                (
                    i,
                    HandlerError::permanent("refused", format!("{} is refused", m.message_id())),
                )
            })
            .collect();
        if !refused.is_empty() {
            return Err(BatchError::Messages(refused));
        }
        let ids: Vec<&str> = msgs.iter().map(|m| m.message_id()).collect();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".effects (message_id, consumer_name, message_type, attempt, body) \
             SELECT id, 'svc', 'Thing', 1, '' FROM UNNEST($1::text[]) AS id",
            self.schema
        )))
        .bind(&ids)
        .execute(&mut *tx)
        .await
        .map_err(|e| BatchError::Batch(e.into()))?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_handler_refusing_several_messages_reruns_the_batch_once() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("several"));
    config.lanes = 1;
    config.batch_size = 50;
    config.max_batch_delay = Duration::from_secs(1);
    let topology = config.topology.clone();
    env.declare(&config).await;
    let ids: Vec<String> = (0..30)
        .map(|i| {
            if i % 4 == 1 {
                format!("bad{i:02}")
            } else {
                format!("ok{i:02}")
            }
        })
        .collect();
    let messages: Vec<OutgoingMessage> = (0..).zip(&ids).map(|(n, id)| thing(id, n)).collect();
    let pairs: Vec<(&str, &OutgoingMessage)> = messages
        .iter()
        .map(|m| (topology.queue.as_str(), m))
        .collect();
    env.broker
        .publish_batch("", &pairs)
        .await
        .expect("published");
    let handler = Validating {
        schema: env.schema.clone(),
        calls: Arc::default(),
    };
    let consumer = env.start_batch(config, handler.clone());
    let bad = ids.iter().filter(|id| id.starts_with("bad")).count();
    let parked = env.take_parked(&topology, bad as u32).await;
    wait_for("the rest processed", async || {
        consumer.snapshot().processed as usize == ids.len() - bad
    })
    .await;
    consumer.stop().await;

    assert_eq!(parked.len(), bad);
    let calls = handler.calls.lock().expect("lock").clone();
    let handed: usize = calls.iter().map(Vec::len).sum();
    assert!(
        handed <= 2 * ids.len(),
        "every message handed over at most twice: {calls:?}"
    );
    for id in &ids {
        let expected = i64::from(!id.starts_with("bad"));
        assert_eq!(env.effects(id).await, expected, "{id}");
    }
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_after_an_earlier_failure_is_parked_and_the_rest_processed() {
    // The first failure sends the rest of the batch through groups under savepoints; a panic
    // there must still be charged to its own message only.
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("panic-later"));
    config.lanes = 1;
    config.max_batch_delay = Duration::from_millis(500);
    let topology = config.topology.clone();
    env.declare(&config).await;
    let handler = Hostile::new(&env);
    handler.act("m01", Act::Raise("22023"));
    handler.act("m13", Act::Panic);
    handler.act("m17", Act::Raise("23505"));
    let ids: Vec<String> = (0..24).map(|i| format!("m{i:02}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    publish_all(&env, &topology, &refs).await;
    let consumer = env.start(config, handler.clone());
    let parked = env.take_parked(&topology, 3).await;
    wait_for("the rest processed", async || {
        consumer.snapshot().processed == 21
    })
    .await;
    let stats = consumer.stop().await;

    for (id, code) in [
        ("m01", "db_invalid_data"),
        ("m13", HANDLER_PANICKED),
        ("m17", "db_constraint"),
    ] {
        let row = env.record("svc", id).await.expect("row");
        assert_eq!(row.status, InboxStatus::PermanentFailed, "{id}");
        assert_eq!(row.last_error_code.as_deref(), Some(code), "{id}");
        assert_eq!(env.effects(id).await, 0, "{id}");
    }
    for id in &ids {
        if !["m01", "m13", "m17"].contains(&id.as_str()) {
            assert_eq!(env.effects(id).await, 1, "{id} applied exactly once");
        }
    }
    assert_eq!(parked.len(), 3);
    assert!(
        handler.total_calls() <= 2 * 24,
        "{} runs",
        handler.total_calls()
    );
    assert_eq!(stats.sessions, 1);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

/// A per-message handler that refuses in `check`: `bad*` permanently, `late*` as retryable on
/// its first attempt, `boom` by panicking; counts the calls of `handle` per message id.
#[derive(Clone)]
struct Checked {
    schema: SchemaName,
    handled: Arc<Mutex<HashMap<String, usize>>>,
}

impl Handler for Checked {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        *self
            .handled
            .lock()
            .expect("lock")
            .entry(msg.message_id().to_owned())
            .or_default() += 1;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".effects (message_id, consumer_name, message_type, attempt, body) \
             VALUES ($1, 'svc', 'Thing', $2, '')",
            self.schema
        )))
        .bind(msg.message_id())
        .bind(msg.attempt())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }

    fn check(&self, msg: &InboxMessage<'_>) -> Result<(), HandlerError> {
        let id = msg.message_id();
        if id == "boom" {
            panic!("check cannot cope with boom");
        }
        if id.starts_with("bad") {
            return Err(HandlerError::permanent(
                "refused",
                format!("{id} is refused"),
            ));
        }
        if id.starts_with("late") && msg.attempt() < 2 {
            return Err(HandlerError::retryable(
                "not_yet",
                format!("{id} comes back"),
            ));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_in_check_cost_no_message_a_second_run() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("checked"));
    config.lanes = 1;
    config.batch_size = 50;
    config.max_batch_delay = Duration::from_secs(1);
    config.retry.delays = vec![Duration::from_millis(200)];
    let topology = config.topology.clone();
    env.declare(&config).await;
    let ids: Vec<String> = (0..40)
        .map(|i| match i {
            7 => "boom".to_owned(),
            i if i % 5 == 1 => format!("bad{i:02}"),
            i if i % 9 == 4 => format!("late{i:02}"),
            i => format!("ok{i:02}"),
        })
        .collect();
    let messages: Vec<OutgoingMessage> = (0..).zip(&ids).map(|(n, id)| thing(id, n)).collect();
    let pairs: Vec<(&str, &OutgoingMessage)> = messages
        .iter()
        .map(|m| (topology.queue.as_str(), m))
        .collect();
    env.broker
        .publish_batch("", &pairs)
        .await
        .expect("published");
    let handler = Checked {
        schema: env.schema.clone(),
        handled: Arc::default(),
    };
    let consumer = env.start(config, handler.clone());
    let refused = ids
        .iter()
        .filter(|id| id.starts_with("bad") || *id == "boom")
        .count();
    let parked = env.take_parked(&topology, refused as u32).await;
    wait_for(
        "the rest processed, the late ones on their retry",
        async || consumer.snapshot().processed as usize == ids.len() - refused,
    )
    .await;
    consumer.stop().await;

    assert_eq!(parked.len(), refused);
    let handled = handler.handled.lock().expect("lock").clone();
    for id in &ids {
        let row = env.record("svc", id).await.expect("row");
        if id.starts_with("bad") || id == "boom" {
            // Refused before any effect: handle never ran for it, nothing to undo.
            assert_eq!(row.status, InboxStatus::PermanentFailed, "{id}");
            let code = if id == "boom" {
                HANDLER_PANICKED
            } else {
                "refused"
            };
            assert_eq!(row.last_error_code.as_deref(), Some(code), "{id}");
            assert_eq!(env.effects(id).await, 0, "{id}");
            assert_eq!(handled.get(id), None, "{id}");
        } else {
            // The refusals were known before any handler ran: no accepted message's work
            // was rolled back and run again.
            assert_eq!(row.status, InboxStatus::Processed, "{id}");
            assert_eq!(env.effects(id).await, 1, "{id}");
            assert_eq!(handled.get(id), Some(&1), "{id}: {handled:?}");
            let attempt = if id.starts_with("late") { 2 } else { 1 };
            assert_eq!(row.processing_attempt, attempt, "{id}");
        }
    }
    assert_eq!(env.depths(&topology).await, EMPTY);
}
