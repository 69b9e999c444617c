//! Off the happy path, the ledger says what happened: the first delivery of a key owns its row
//! (valid or not), a failing message has one copy in the broker however its duplicates arrive,
//! every delivery is counted on its row, and a deployment fault parks nothing. Against the real
//! PostgreSQL and RabbitMQ.

use std::time::Duration;

use crate::capture::{Counters, capture_logs};
use inbox_testkit::env::{Rule, TestEnv, lane_of, message, thing, wait_for};
use rabbit_inbox::{
    Handler, HandlerError, InboxMessage, InboxStatus, broker::OutgoingMessage,
    status::PAYLOAD_CONFLICT,
};
use serde_json::{Map, json};
use sqlx::{AssertSqlSafe, PgConnection};

/// A copy of `id` whose body is not JSON, with the given type and headers.
fn not_json(id: Option<&str>, body: &str) -> OutgoingMessage {
    OutgoingMessage {
        message_id: id.map(str::to_owned),
        kind: Some("Thing".into()),
        correlation_id: None,
        headers: Map::new(),
        body: body.as_bytes().to_vec(),
    }
}

/// Events of `kind` in a row's history, and the deliveries they account for.
async fn history(env: &TestEnv, id: &str, kind: &str) -> i64 {
    env.scalar(&format!(
        "SELECT coalesce(sum(deliveries), 0)::int8 FROM \"{}\".inbox_event \
         WHERE message_id = '{id}' AND kind = '{kind}'",
        env.schema
    ))
    .await
}

/// A valid message and, right behind it, a copy of its id that is not JSON: the valid one is
/// processed, the invalid copy is a payload conflict of its row. Both land in one batch (queued
/// before the consumer starts, one lane) and, in a second pair, in two batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_message_keeps_its_row_when_an_invalid_copy_follows() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("valid-first"));
    config.lanes = 1;
    let topology = config.topology.clone();
    env.declare(&config).await;

    // One batch: both are in the queue when the consumer starts.
    env.publish(&topology, &thing("x", 1)).await;
    env.publish(&topology, &not_json(Some("x"), "{not json"))
        .await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);
    let row = env
        .wait_for_record("svc", "x", "processed, the conflict counted", |r| {
            r.status == InboxStatus::Processed && r.payload_conflicts == 1
        })
        .await;
    assert_eq!(row.delivery_count, 2, "both deliveries counted");
    assert_eq!(
        env.effects("x").await,
        1,
        "the valid message's effect applied"
    );

    // Two batches: the invalid copy arrives after the valid one committed.
    env.publish(&topology, &thing("y", 1)).await;
    env.wait_for_record("svc", "y", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    env.publish(&topology, &not_json(Some("y"), "{not json"))
        .await;
    env.wait_for_record("svc", "y", "conflict counted", |r| r.payload_conflicts == 1)
        .await;
    assert_eq!(env.effects("y").await, 1);

    let parked = env.take_parked(&topology, 2).await;
    assert_eq!(parked.len(), 2, "the two invalid copies, nothing else");
    for copy in &parked {
        assert_eq!(
            inbox_testkit::env::header(copy, "x-inbox-error-code"),
            Some(PAYLOAD_CONFLICT)
        );
        assert_eq!(copy.body, b"{not json");
    }
    consumer.stop().await;
}

/// The other order: an invalid copy delivered first owns the row (PERMANENT_FAILED
/// invalid_json, parked), and the valid body that follows under its id is a payload conflict,
/// not processed: delivery order decides, in one batch and across batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_message_delivered_first_owns_its_row() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("invalid-first"));
    config.lanes = 1;
    let topology = config.topology.clone();
    env.declare(&config).await;

    env.publish(&topology, &not_json(Some("x"), "{not json"))
        .await;
    env.publish(&topology, &thing("x", 1)).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);
    let row = env
        .wait_for_record("svc", "x", "parked, the conflict counted", |r| {
            r.payload_conflicts == 1
        })
        .await;
    assert_eq!(row.status, InboxStatus::PermanentFailed);
    assert_eq!(row.last_error_code.as_deref(), Some("invalid_json"));
    assert_eq!(
        env.effects("x").await,
        0,
        "the later valid copy is not applied"
    );

    env.publish(&topology, &not_json(Some("y"), "{not json"))
        .await;
    env.wait_for_record("svc", "y", "parked", |r| {
        r.status == InboxStatus::PermanentFailed && r.parked_copy_at.is_some()
    })
    .await;
    env.publish(&topology, &thing("y", 1)).await;
    env.wait_for_record("svc", "y", "conflict counted", |r| r.payload_conflicts == 1)
        .await;
    assert_eq!(env.effects("y").await, 0);
    // Each key: the invalid message's own copy and the conflicting valid copy.
    let parked = env.take_parked(&topology, 4).await;
    assert_eq!(parked.len(), 4);
    consumer.stop().await;
}

/// With several lanes, an invalid copy (no aggregate id: its lane comes from its key) follows
/// the valid message to the valid message's lane (chosen by aggregate id) while the valid one
/// is unsettled, so delivery order still decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_copy_on_another_lane_waits_for_the_valid_message() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("lanes"));
    config.lanes = 4;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let id = "x";
    let aggregate = (0..100)
        .map(|n| format!("agg-{n}"))
        .find(|a| lane_of(a, 4) != lane_of(id, 4))
        .expect("an aggregate on another lane");
    // The valid message waits in its handler until the invalid copy has surely arrived.
    let latch = std::sync::Arc::new(inbox_testkit::env::Latch::default());
    let (handler, plan) = env.handler();
    plan.for_id(id, Rule::Hold(latch.clone()));
    let mut valid = thing(id, 1);
    valid
        .headers
        .insert("x-aggregate-id".into(), json!(aggregate));
    env.publish(&topology, &valid).await;
    env.publish(&topology, &not_json(Some(id), "{not json"))
        .await;
    let consumer = env.start(config, handler);
    wait_for("the valid message in its handler", async || {
        latch.arrivals() >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    latch.open();
    let row = env
        .wait_for_record("svc", id, "processed, the conflict counted", |r| {
            r.payload_conflicts == 1
        })
        .await;
    assert_eq!(row.status, InboxStatus::Processed);
    assert_eq!(env.effects(id).await, 1);
    consumer.stop().await;
}

/// Across instances: the invalid copy's failure record waits for the valid message's
/// uncommitted row (another instance is in its handler) and then finds it PROCESSED with
/// another body: a payload conflict, parked, not a duplicate acked away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_copy_waiting_on_another_instances_claim_is_a_conflict() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("instances-conflict"));
    config.prefetch = 1;
    config.lanes = 1;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let latch = std::sync::Arc::new(inbox_testkit::env::Latch::default());
    let (handler, plan) = env.handler();
    plan.for_id("x", Rule::Hold(latch.clone()));
    let a = env.start(config.clone(), handler.clone());
    env.publish(&topology, &thing("x", 1)).await;
    wait_for("the valid message in its handler", async || {
        latch.arrivals() >= 1
    })
    .await;
    // The first instance's one prefetch slot is taken: the copy goes to the second.
    let b = env.start(config, handler);
    env.publish(&topology, &not_json(Some("x"), "{not json"))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    latch.open();
    let row = env
        .wait_for_record("svc", "x", "processed, the conflict counted", |r| {
            r.status == InboxStatus::Processed && r.payload_conflicts == 1
        })
        .await;
    assert_eq!(row.delivery_count, 2);
    assert_eq!(env.effects("x").await, 1);
    let parked = env.take_parked(&topology, 1).await;
    assert_eq!(
        inbox_testkit::env::header(&parked[0], "x-inbox-error-code"),
        Some(PAYLOAD_CONFLICT)
    );
    a.stop().await;
    b.stop().await;
}

/// Twenty failing messages, each published twice back to back: one parked copy per row, the
/// second delivery counted as its duplicate. Queued before the consumer starts (pairs in one
/// batch) and again while it runs (pairs in one batch or across batches).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_to_back_duplicates_of_a_failing_message_leave_one_parked_copy() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("pairs"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_type("Poison", Rule::Permanent);
    let poison = |id: &str| message(Some(id), "Poison", &json!({ "id": id }));
    for n in 0..20 {
        let m = poison(&format!("before-{n}"));
        env.publish(&topology, &m).await;
        env.publish(&topology, &m).await;
    }
    let consumer = env.start(config, handler);
    for n in 0..20 {
        let m = poison(&format!("running-{n}"));
        env.publish(&topology, &m).await;
        env.publish(&topology, &m).await;
    }
    let ids: Vec<String> = (0..20)
        .flat_map(|n| [format!("before-{n}"), format!("running-{n}")])
        .collect();
    for id in &ids {
        let row = env
            .wait_for_record("svc", id, "parked, the second copy counted", |r| {
                r.status == InboxStatus::PermanentFailed && r.parked_duplicates == 1
            })
            .await;
        assert_eq!(row.processing_attempt, 1, "{id}: the handler ran once");
        assert!(row.delivery_count >= 2, "{id}: both deliveries counted");
    }
    // Nothing more is on its way: the parking lot holds exactly one copy per row.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.retry), (0, 0));
    assert_eq!(depths.parking, 40, "one parked copy per row");
    consumer.stop().await;
}

/// The same pairs split across two consumer instances of one consumer name: the row lock and
/// the copy in flight decide, and the parking lot still holds one copy per row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_across_instances_leave_one_parked_copy() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("instances"));
    config.prefetch = 1;
    config.lanes = 1;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_type("Poison", Rule::Permanent);
    let a = env.start(config.clone(), handler.clone());
    let b = env.start(config, handler);
    let poison = |id: &str| message(Some(id), "Poison", &json!({ "id": id }));
    for n in 0..30 {
        let m = poison(&format!("p-{n}"));
        env.publish(&topology, &m).await;
        env.publish(&topology, &m).await;
    }
    for n in 0..30 {
        env.wait_for_record(
            "svc",
            &format!("p-{n}"),
            "parked, its duplicate counted",
            |r| r.status == InboxStatus::PermanentFailed && r.parked_duplicates == 1,
        )
        .await;
    }
    wait_for("the retry tiers empty", async || {
        let d = env.depths(&topology).await;
        d.work == 0 && d.retry == 0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        env.depths(&topology).await.parking,
        30,
        "one parked copy per row"
    );
    a.stop().await;
    b.stop().await;
}

/// Repeats of an invalid message are deliveries of its row: counted (delivery count, history,
/// parked duplicates), with one parked copy. Twenty identical id-less messages share one
/// synthetic key; an invalid-JSON message with an id is sent five times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeats_of_an_invalid_message_are_counted_on_its_row() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("invalid-repeats"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config, handler);
    for _ in 0..5 {
        env.publish(&topology, &not_json(Some("bad"), "{not json"))
            .await;
    }
    let no_id = message(None, "Thing", &json!({ "n": 1 }));
    for _ in 0..20 {
        env.publish(&topology, &no_id).await;
    }
    let row = env
        .wait_for_record("svc", "bad", "five deliveries counted", |r| {
            r.delivery_count == 5
        })
        .await;
    assert_eq!(row.status, InboxStatus::PermanentFailed);
    assert_eq!(row.parked_duplicates, 4);
    assert_eq!(history(&env, "bad", "duplicate").await, 4);

    let synthetic: String = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT message_id FROM \"{}\".message_inbox WHERE message_id <> 'bad'",
        env.schema
    )))
    .fetch_one(&env.pool)
    .await
    .expect("one row for the id-less messages");
    let row = env
        .wait_for_record("svc", &synthetic, "twenty deliveries counted", |r| {
            r.delivery_count == 20
        })
        .await;
    assert_eq!(row.last_error_code.as_deref(), Some("missing_message_id"));
    assert_eq!(row.parked_duplicates, 19);
    assert_eq!(history(&env, &synthetic, "duplicate").await, 19);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        env.depths(&topology).await.parking,
        2,
        "one parked copy per row"
    );
    consumer.stop().await;
}

/// Writes each message to `ledger_entries`, a table a test creates late (a missing migration).
#[derive(Clone)]
struct Ledger(String);

impl Handler for Ledger {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".ledger_entries (message_id) VALUES ($1)",
            self.0
        )))
        .bind(msg.message_id())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

async fn create_ledger_entries(env: &TestEnv) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{}\".ledger_entries (message_id TEXT PRIMARY KEY)",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("the migration runs");
}

/// A valid message whose delivery goes back to the queue unrecorded (here: a deployment
/// fault) keeps its place ahead of the invalid copy delivered behind it: the copy goes back
/// too, instead of being recorded first and taking the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_copy_does_not_overtake_a_requeued_valid_message() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("requeued-first"));
    config.lanes = 1;
    let topology = config.topology.clone();
    env.declare(&config).await;
    env.publish(&topology, &thing("x", 1)).await;
    env.publish(&topology, &not_json(Some("x"), "{not json"))
        .await;
    let consumer = env.start(config, Ledger(env.schema.as_str().to_owned()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rows = env
        .scalar(&format!(
            "SELECT count(*) FROM \"{}\".message_inbox",
            env.schema
        ))
        .await;
    assert_eq!(
        rows, 0,
        "the invalid copy waits behind the requeued valid message"
    );
    create_ledger_entries(&env).await;
    let row = env
        .wait_for_record("svc", "x", "processed, the copy a conflict", |r| {
            r.status == InboxStatus::Processed && r.payload_conflicts == 1
        })
        .await;
    assert_eq!(row.processing_attempt, 1);
    consumer.stop().await;
}

/// A handler whose SQL names a table that does not exist (a missing migration): nothing is
/// parked or charged, the deliveries go back to the queue, and once the table exists every
/// message is processed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_parks_nothing_and_the_stream_resumes_once_it_exists() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("deployment"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let consumer = env.start(config, Ledger(env.schema.as_str().to_owned()));
    for n in 0..10 {
        env.publish(&topology, &thing(&format!("m-{n}"), n)).await;
    }
    // Long enough for several requeues with back-off.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rows = env
        .scalar(&format!(
            "SELECT count(*) FROM \"{}\".message_inbox",
            env.schema
        ))
        .await;
    assert_eq!(rows, 0, "nothing recorded against the messages");
    let depths = env.depths(&topology).await;
    assert_eq!(depths.parking, 0, "nothing parked");
    assert_eq!(depths.retry, 0, "nothing sent to a retry tier");

    create_ledger_entries(&env).await;
    for n in 0..10 {
        let row = env
            .wait_for_record("svc", &format!("m-{n}"), "processed", |r| {
                r.status == InboxStatus::Processed
            })
            .await;
        assert_eq!(row.processing_attempt, 1, "no attempt charged to the fault");
    }
    let entries = env
        .scalar(&format!(
            "SELECT count(*) FROM \"{}\".ledger_entries",
            env.schema
        ))
        .await;
    assert_eq!(entries, 10);
    assert_eq!(env.depths(&topology).await.parking, 0);
    consumer.stop().await;
}

// One thread: the log subscriber is this thread's, and so the consumer's.
#[tokio::test]
async fn failed_messages_are_logged_without_their_bodies_within_the_budget() {
    let (captured, _logs) = capture_logs("rabbit_inbox=info");
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("failure-log"));
    config.telemetry.failure_log_per_minute = 5;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_type("Poison", Rule::Permanent);
    plan.for_id("retry-me", Rule::FailAttempts(1));
    let consumer = env.start(config, handler);
    let marked =
        |id: &str, kind: &str| message(Some(id), kind, &json!({ "id": id, "card": "BODY-MARKER" }));
    env.publish(&topology, &marked("retry-me", "Thing")).await;
    env.wait_for_record("svc", "retry-me", "retried and processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    for n in 0..12 {
        env.publish(&topology, &marked(&format!("poison-{n}"), "Poison"))
            .await;
    }
    env.take_parked(&topology, 12).await;
    consumer.stop().await;
    let text = captured.text();
    let retry_lines = text.matches("retried after its tier's delay").count();
    let parked_lines = text.matches("message parked;").count();
    assert_eq!(retry_lines, 1, "the retry is logged at INFO:\n{text}");
    assert!(
        text.contains("message_id=\"retry-me\"") || text.contains("message_id=retry-me"),
        "{text}"
    );
    assert!(text.contains("retry_queue="), "{text}");
    assert_eq!(
        retry_lines + parked_lines,
        5,
        "five failed-message lines a minute, however many fail:\n{text}"
    );
    assert!(text.contains("parked_in="), "{text}");
    assert!(text.contains("test_permanent"), "{text}");
    assert!(
        !text.contains("BODY-MARKER"),
        "a body reached the log:\n{text}"
    );
}

// One thread: the log subscriber and the recorder are this thread's, and so the consumer's.
#[tokio::test]
async fn a_deployment_fault_is_an_error_line_and_a_counted_metric() {
    let (captured, _logs) = capture_logs("rabbit_inbox=info");
    let counters = Counters(metrics_util::registry::Registry::atomic());
    let _metrics = metrics::set_default_local_recorder(&counters);
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("deployment-log"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let consumer = env.start(config, Ledger(env.schema.as_str().to_owned()));
    env.publish(&topology, &thing("m", 1)).await;
    let faults = || {
        counters.get(
            rabbit_inbox::telemetry::metrics::DEPLOYMENT_FAULTS,
            &[("consumer", "svc"), ("sqlstate", "42P01")],
        )
    };
    wait_for("the fault counted", async || faults() >= 1).await;
    let text = captured.text();
    let line = text
        .lines()
        .find(|l| l.contains("ERROR") && l.contains("deployment fault"))
        .unwrap_or_else(|| panic!("no deployment fault line:\n{text}"));
    assert!(line.contains("ERROR"), "{line}");
    assert!(line.contains("42P01") && line.contains("svc"), "{line}");
    assert!(
        line.contains("ledger_entries"),
        "the line names the table: {line}"
    );
    create_ledger_entries(&env).await;
    env.wait_for_record("svc", "m", "processed once the table exists", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    assert_eq!(env.depths(&topology).await.parking, 0);
    consumer.stop().await;
}

/// A missing privilege (SQLSTATE 42501) is a deployment fault too: the handler's role may not
/// write its table, nothing is parked, and the grant lets the stream through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_grant_parks_nothing_and_the_stream_resumes_once_granted() {
    #[derive(Clone)]
    struct AsRole {
        schema: String,
        role: String,
    }
    impl Handler for AsRole {
        async fn handle(
            &self,
            msg: &InboxMessage<'_>,
            tx: &mut PgConnection,
        ) -> Result<(), HandlerError> {
            // The business write under a role of its own, as a service whose grants are
            // per table would run it.
            sqlx::raw_sql(AssertSqlSafe(format!("SET LOCAL ROLE \"{}\"", self.role)))
                .execute(&mut *tx)
                .await?;
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO \"{}\".ledger_entries (message_id) VALUES ($1)",
                self.schema
            )))
            .bind(msg.message_id())
            .execute(&mut *tx)
            .await?;
            // The inbox's own statements run as the service's role again (a rollback undoes
            // SET LOCAL by itself).
            sqlx::raw_sql("RESET ROLE").execute(&mut *tx).await?;
            Ok(())
        }
    }
    let env = TestEnv::new().await;
    create_ledger_entries(&env).await;
    let role = format!("t_writer_{}", env.id);
    let schema = env.schema.as_str().to_owned();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE ROLE \"{role}\" NOLOGIN; GRANT USAGE ON SCHEMA \"{schema}\" TO \"{role}\""
    )))
    .execute(&env.pool)
    .await
    .expect("a role without the table's grant");
    let config = env.config("svc", env.topology("grant"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let consumer = env.start(
        config,
        AsRole {
            schema: schema.clone(),
            role: role.clone(),
        },
    );
    for n in 0..3 {
        env.publish(&topology, &thing(&format!("g-{n}"), n)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rows = env
        .scalar(&format!("SELECT count(*) FROM \"{schema}\".message_inbox"))
        .await;
    assert_eq!(rows, 0, "nothing recorded against the messages");
    assert_eq!(env.depths(&topology).await.parking, 0, "nothing parked");

    sqlx::raw_sql(AssertSqlSafe(format!(
        "GRANT INSERT ON \"{schema}\".ledger_entries TO \"{role}\""
    )))
    .execute(&env.pool)
    .await
    .expect("the grant");
    for n in 0..3 {
        env.wait_for_record("svc", &format!("g-{n}"), "processed once granted", |r| {
            r.status == InboxStatus::Processed && r.processing_attempt == 1
        })
        .await;
    }
    consumer.stop().await;
    // Roles belong to the cluster, not the test's schema.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "REVOKE ALL ON ALL TABLES IN SCHEMA \"{schema}\" FROM \"{role}\"; \
         REVOKE USAGE ON SCHEMA \"{schema}\" FROM \"{role}\"; DROP ROLE \"{role}\""
    )))
    .execute(&env.pool)
    .await
    .expect("the role is dropped");
}
