//! The outbox against the real servers: enqueue through the handler's transaction with
//! deterministic ids, the relay's confirms and returns, fencing between relays, order per key,
//! the wake-up after commit, a republish deduped by the downstream inbox, and the relay's
//! destination exchanges (declared, required, missing at run time).

// Shared with the other integration tests; not every helper is used here.

use std::{collections::HashMap, sync::Arc, time::Duration};

use inbox_testkit::env::{DEADLINE, TestEnv, amqp_url, header, wait_for};
use rabbit_inbox::{
    Consumer, Handler, HandlerError, InboxMessage, Outbox, OutboxError, OutboxMessage, Relay,
    RelayConfig, Runner, Topology,
    broker::{Exchange, ExchangeKind},
    envelope::AmqpMessage,
    outbox::{OutboxStatus, OutboxStore, RelayError, RelayStats, emitted_message_id},
};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, Connection, PgConnection};
use tokio::{task::JoinHandle, time::Instant};

/// A relay running in a task.
struct RunningRelay {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), rabbit_inbox::outbox::RelayError>>>,
    stats: Arc<RelayStats>,
    #[cfg(feature = "fault-injection")]
    faults: Arc<rabbit_inbox::outbox::RelayFaults>,
}

impl RunningRelay {
    fn start(env: &TestEnv, config: RelayConfig) -> Self {
        Self::start_at(env, amqp_url(), config)
    }

    /// A relay publishing to the broker at `amqp_url`.
    fn start_at(env: &TestEnv, amqp_url: String, config: RelayConfig) -> Self {
        let relay = Relay::new(amqp_url, env.pool.clone(), config).expect("valid relay config");
        let stats = relay.stats();
        #[cfg(feature = "fault-injection")]
        let faults = relay.faults();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(relay.run(async move {
            let _ = stopped.await;
        }));
        Self {
            stop: Some(stop),
            task: Some(task),
            stats,
            #[cfg(feature = "fault-injection")]
            faults,
        }
    }

    async fn stop(mut self) -> rabbit_inbox::outbox::RelayStatsSnapshot {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(DEADLINE, task)
                .await
                .expect("relay stops in time")
                .expect("relay task did not panic")
                .expect("relay ran without a fatal error");
        }
        self.stats.snapshot()
    }
}

/// Test relay settings: fast retries, short polls.
fn relay_config(env: &TestEnv) -> RelayConfig {
    let mut c = RelayConfig::new(env.schema.clone());
    c.poll_interval = Duration::from_millis(200);
    c.retry_initial_delay = Duration::from_millis(100);
    c.retry_max_delay = Duration::from_millis(400);
    c.reconnect_initial_delay = Duration::from_millis(100);
    c.reconnect_max_delay = Duration::from_secs(1);
    c.maintenance_interval = Duration::from_millis(300);
    c
}

/// A plain queue to receive emitted messages on (through the default exchange).
async fn target(env: &TestEnv, name: &str) -> Topology {
    let topology = env.topology(name);
    env.broker
        .declare(&topology, &inbox_testkit::env::test_retry())
        .await
        .expect("target queues declared");
    topology
}

/// Takes messages from `queue` until `n` arrived (fails after the deadline).
async fn take(env: &TestEnv, queue: &str, n: usize) -> Vec<AmqpMessage> {
    let mut got = Vec::new();
    let deadline = Instant::now() + DEADLINE;
    while got.len() < n {
        match env.take_one(queue).await {
            Some(m) => got.push(m),
            None => {
                assert!(
                    Instant::now() < deadline,
                    "only {} of {n} messages arrived on {queue}",
                    got.len()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    got
}

/// Nothing more arrives on `queue` within `quiet`.
async fn assert_quiet(env: &TestEnv, queue: &str, quiet: Duration) {
    tokio::time::sleep(quiet).await;
    let extra = env.take_one(queue).await;
    assert!(
        extra.is_none(),
        "unexpected message on {queue}: {:?}",
        extra.map(|m| m.message_id)
    );
}

async fn status_counts(env: &TestEnv) -> HashMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(AssertSqlSafe(format!(
        "SELECT status, count(*) FROM \"{}\".outbox GROUP BY status",
        env.schema
    )))
    .fetch_all(&env.pool)
    .await
    .expect("outbox counts")
    .into_iter()
    .collect()
}

/// One aggregate over the outbox table, e.g. `count(*) FILTER (WHERE ...)`.
async fn outbox_figure(env: &TestEnv, aggregate: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT ({aggregate})::bigint FROM \"{}\".outbox",
        env.schema
    )))
    .fetch_one(&env.pool)
    .await
    .unwrap_or_else(|e| panic!("{aggregate}: {e}"))
}

/// Emits `emit` messages per incoming message (`{"emit": n, "fail_first": bool}`) to
/// `routing_key` on the default exchange, after writing an effect row; fails the first attempt
/// after emitting when asked, so the emitted rows roll back with it.
struct Emitter {
    routing_key: String,
    schema: rabbit_inbox::SchemaName,
}

impl Handler for Emitter {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        #[derive(serde::Deserialize)]
        struct Order {
            emit: u32,
            #[serde(default)]
            fail_first: bool,
        }
        let order: Order = msg.decode()?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".effects (message_id, consumer_name, message_type, attempt, body) \
             VALUES ($1, $2, $3, $4, '')",
            self.schema
        )))
        .bind(msg.message_id())
        .bind(msg.consumer_name())
        .bind(msg.message_type())
        .bind(msg.attempt())
        .execute(&mut *tx)
        .await?;
        for n in 0..order.emit {
            let out = OutboxMessage::json(
                "Emitted",
                "",
                &self.routing_key,
                &json!({"from": msg.message_id(), "n": n}),
            )?;
            msg.outbox(&mut *tx).enqueue(out).await?;
        }
        if order.fail_first && msg.attempt() == 1 {
            return Err(HandlerError::retryable("test_fail_first", "planned"));
        }
        Ok(())
    }
}

#[tokio::test]
async fn handler_emits_through_its_transaction_with_deterministic_ids_and_context() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "downstream").await;
    let config = env.config("emitter", env.topology("upstream"));
    env.declare(&config).await;
    let consumer = Consumer::new(
        amqp_url(),
        env.pool.clone(),
        config.clone(),
        Emitter {
            routing_key: downstream.queue.clone(),
            schema: env.schema.clone(),
        },
    )
    .expect("valid config");
    let relay =
        Relay::new(amqp_url(), env.pool.clone(), relay_config(&env)).expect("valid relay config");
    let relay_stats = relay.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(
        Runner::new()
            .task("consumer", |s| consumer.run(s))
            .task("relay", |s| relay.run(s))
            .run(async move {
                let _ = stopped.await;
            }),
    );

    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut first = inbox_testkit::env::message(
        Some("in-1"),
        "Order",
        &json!({"emit": 2, "fail_first": true}),
    );
    first.correlation_id = Some("corr-1".into());
    first
        .headers
        .insert("traceparent".into(), traceparent.into());
    env.publish(&config.topology, &first).await;
    env.publish(
        &config.topology,
        &inbox_testkit::env::message(Some("in-2"), "Order", &json!({"emit": 1})),
    )
    .await;
    // A duplicate of in-2: its handler does not run again, nothing more is emitted.
    env.publish(
        &config.topology,
        &inbox_testkit::env::message(Some("in-2"), "Order", &json!({"emit": 1})),
    )
    .await;

    let got = take(&env, &downstream.queue, 3).await;
    assert_quiet(&env, &downstream.queue, Duration::from_millis(800)).await;
    let by_id: HashMap<String, &AmqpMessage> = got
        .iter()
        .map(|m| (m.message_id.clone().expect("message id"), m))
        .collect();
    let expected = [
        emitted_message_id("emitter", "in-1", 0),
        emitted_message_id("emitter", "in-1", 1),
        emitted_message_id("emitter", "in-2", 0),
    ];
    for id in &expected {
        assert!(by_id.contains_key(id), "missing emitted message {id}");
    }
    let m = by_id[&expected[0]];
    assert_eq!(header(m, "x-causation-id"), Some("in-1"));
    assert_eq!(m.correlation_id.as_deref(), Some("corr-1"));
    assert_eq!(m.kind.as_deref(), Some("Emitted"));
    let child = header(m, "traceparent").expect("trace context carried on");
    assert!(
        child.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
        "{child}"
    );
    assert_ne!(
        child, traceparent,
        "the emitting operation is the new parent"
    );
    let body: Value = serde_json::from_slice(&m.body).expect("JSON body");
    assert_eq!(body, json!({"from": "in-1", "n": 0}));
    // Without a correlation id of its own, the incoming id correlates.
    assert_eq!(by_id[&expected[2]].correlation_id.as_deref(), Some("in-2"));

    // The failed first attempt's rows rolled back with it: three rows, all sent.
    wait_for("rows marked SENT", async || {
        status_counts(&env).await.get("SENT") == Some(&3)
    })
    .await;
    assert_eq!(status_counts(&env).await.len(), 1);
    let _ = stop.send(());
    tokio::time::timeout(DEADLINE, running)
        .await
        .expect("stops in time")
        .expect("no panic")
        .expect("no fatal error");
    let s = relay_stats.snapshot();
    assert_eq!(s.published, 3);
    assert_eq!(s.fenced, 0);
}

#[tokio::test]
async fn plain_enqueue_commits_and_rolls_back_with_its_transaction() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "plain").await;
    let outbox = Outbox::new(env.schema.clone());
    let msg = |id: &str| {
        OutboxMessage::json("Plain", "", &downstream.queue, &json!({"id": id}))
            .expect("serializable")
            .with_id(id)
    };
    let mut conn = env.pool.acquire().await.expect("connection");
    let mut tx = conn.begin().await.expect("begin");
    outbox
        .enqueue(&mut tx, &msg("rolled-back"))
        .await
        .expect("enqueue");
    tx.rollback().await.expect("rollback");
    let mut tx = conn.begin().await.expect("begin");
    let kept = outbox
        .enqueue(&mut tx, &msg("kept"))
        .await
        .expect("enqueue");
    assert!(kept.inserted);
    // The same id again is a replay: nothing new is written.
    let again = outbox
        .enqueue(&mut tx, &msg("kept"))
        .await
        .expect("enqueue");
    assert!(!again.inserted);
    let random = outbox
        .enqueue(
            &mut tx,
            &OutboxMessage::json("Plain", "", &downstream.queue, &json!({})).expect("json"),
        )
        .await
        .expect("enqueue");
    assert_eq!(random.message_id.len(), 36, "a UUID: {}", random.message_id);
    tx.commit().await.expect("commit");

    // What could never be published is refused at enqueue, not discovered by the relay.
    let too_long = OutboxMessage::json("Plain", "", "k".repeat(256), &json!({})).expect("json");
    assert!(matches!(
        outbox.enqueue(&mut conn, &too_long).await,
        Err(OutboxError::Invalid(_))
    ));
    let bad_header = OutboxMessage::json("Plain", "", "k", &json!({}))
        .expect("json")
        .with_header("h".repeat(300), 1);
    assert!(matches!(
        outbox.enqueue(&mut conn, &bad_header).await,
        Err(OutboxError::Invalid(_))
    ));

    let relay = RunningRelay::start(&env, relay_config(&env));
    let got = take(&env, &downstream.queue, 2).await;
    assert_quiet(&env, &downstream.queue, Duration::from_millis(600)).await;
    let mut ids: Vec<String> = got.into_iter().filter_map(|m| m.message_id).collect();
    ids.sort();
    let mut expected = vec!["kept".to_owned(), random.message_id];
    expected.sort();
    assert_eq!(ids, expected);
    relay.stop().await;
}

#[tokio::test]
async fn a_returned_message_is_a_failure_and_is_published_once_routable() {
    let env = TestEnv::new().await;
    let outbox = Outbox::new(env.schema.clone());
    let store = OutboxStore::new(env.schema.clone());
    // Routed through the default exchange to a queue that does not exist yet: returned.
    let later = env.register(Topology::new(format!("t-{}-later", env.id)));
    // And to an exchange that does not exist at all.
    let exchange = env.exchange_name("missing");
    let mut conn = env.pool.acquire().await.expect("connection");
    outbox
        .enqueue(
            &mut conn,
            &OutboxMessage::json("Late", "", &later.queue, &json!({}))
                .expect("json")
                .with_id("unroutable"),
        )
        .await
        .expect("enqueue");
    outbox
        .enqueue(
            &mut conn,
            &OutboxMessage::json("Lost", &exchange, "any", &json!({}))
                .expect("json")
                .with_id("no-exchange"),
        )
        .await
        .expect("enqueue");
    let mut config = relay_config(&env);
    config.max_attempts = 3;
    let relay = RunningRelay::start(&env, config);

    // The relay counts the return before it records it on the row: wait for the row.
    let all_statuses = [
        OutboxStatus::Pending,
        OutboxStatus::Failed,
        OutboxStatus::Sent,
    ];
    wait_for("the unroutable message's return on its row", async || {
        let all = store
            .list(&mut conn, &all_statuses, 10)
            .await
            .expect("list");
        all.iter()
            .any(|r| r.message_id == "unroutable" && r.last_error_code.is_some())
    })
    .await;
    assert!(relay.stats.snapshot().returned >= 1);
    let all = store
        .list(&mut conn, &all_statuses, 10)
        .await
        .expect("list");
    let row = all
        .iter()
        .find(|r| r.message_id == "unroutable")
        .expect("row");
    assert_ne!(row.status, OutboxStatus::Sent, "a return is no success");
    assert_eq!(row.last_error_code.as_deref(), Some("returned"));
    // Once the queue exists the message goes out.
    env.broker
        .declare(&later, &inbox_testkit::env::test_retry())
        .await
        .expect("declare");
    let got = take(&env, &later.queue, 1).await;
    assert_eq!(got[0].message_id.as_deref(), Some("unroutable"));

    // The missing exchange is charged like a return, and given up after max_attempts.
    wait_for("the missing exchange's row to be FAILED", async || {
        let failed = store
            .list(&mut conn, &[OutboxStatus::Failed], 10)
            .await
            .expect("list");
        failed.iter().any(|r| r.message_id == "no-exchange")
    })
    .await;
    let failed = store
        .list(&mut conn, &[OutboxStatus::Failed], 10)
        .await
        .expect("list");
    let row = failed
        .iter()
        .find(|r| r.message_id == "no-exchange")
        .expect("failed row");
    assert_eq!(row.attempts, 3);
    assert_eq!(row.last_error_code.as_deref(), Some("exchange_missing"));
    let requeued = store
        .requeue_failed(&mut conn, Some(&["no-exchange".to_owned()]))
        .await
        .expect("requeue");
    assert_eq!(requeued, 1);
    let summary = store.summary(&mut conn).await.expect("summary");
    assert_eq!(summary.failed, 0);
    assert!(summary.pending >= 1);
    let s = relay.stop().await;
    assert!(s.exchange_missing >= 3);
    assert_eq!(s.published, 1);
    assert_eq!(s.fenced, 0);
}

#[tokio::test]
async fn two_relays_never_publish_the_same_row_twice() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "pair").await;
    let outbox = Outbox::new(env.schema.clone());
    const ROWS: usize = 3000;
    let mut config = relay_config(&env);
    config.batch_size = 40;
    let mut a = config.clone();
    a.name = "relay-a".into();
    let mut b = config;
    b.name = "relay-b".into();
    let relay_a = RunningRelay::start(&env, a);
    let relay_b = RunningRelay::start(&env, b);
    // Written while both relays run, in transactions of 50, from two writers at once.
    let mut writers = Vec::new();
    for w in 0..2 {
        let pool = env.pool.clone();
        let outbox = outbox.clone();
        let queue = downstream.queue.clone();
        writers.push(tokio::spawn(async move {
            for chunk in 0..ROWS / 100 {
                let mut tx = pool.begin().await.expect("begin");
                for i in 0..50 {
                    let id = format!("m-{w}-{chunk}-{i}");
                    let m = OutboxMessage::json("Pair", "", &queue, &json!({}))
                        .expect("json")
                        .with_id(id);
                    outbox.enqueue(&mut tx, &m).await.expect("enqueue");
                }
                tx.commit().await.expect("commit");
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
    let got = take(&env, &downstream.queue, ROWS).await;
    assert_quiet(&env, &downstream.queue, Duration::from_secs(1)).await;
    let mut seen: HashMap<String, u32> = HashMap::new();
    for m in got {
        *seen.entry(m.message_id.expect("id")).or_default() += 1;
    }
    assert_eq!(seen.len(), ROWS);
    assert!(seen.values().all(|&n| n == 1), "a row was published twice");
    let (sa, sb) = (relay_a.stop().await, relay_b.stop().await);
    assert_eq!(sa.published + sb.published, ROWS as u64);
    assert_eq!(sa.fenced + sb.fenced, 0);
    assert!(
        sa.published > 0 && sb.published > 0,
        "both relays took part: {} / {}",
        sa.published,
        sb.published
    );
    assert_eq!(status_counts(&env).await.get("SENT"), Some(&(ROWS as i64)));
}

#[tokio::test]
async fn a_relay_stopped_with_batches_in_flight_settles_every_batch_it_published() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "inflight").await;
    let outbox = Outbox::new(env.schema.clone());
    const ROWS: usize = 4000;
    let mut tx = env.pool.begin().await.expect("begin");
    for i in 0..ROWS {
        let m = OutboxMessage::json("Backlog", "", &downstream.queue, &json!({"n": i}))
            .expect("json")
            .with_id(format!("b-{i}"));
        outbox.enqueue(&mut tx, &m).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
    let mut config = relay_config(&env);
    config.batch_size = 50;
    config.window = 8;
    let relay = RunningRelay::start(&env, config);
    // Stopped while the backlog is still draining, so batches are claimed, published and not
    // yet settled when the stop comes.
    wait_for("the first batches settled", async || {
        relay.stats.snapshot().published >= 200
    })
    .await;
    let stats = relay.stop().await;
    assert!(
        (stats.published as usize) < ROWS,
        "the relay was stopped mid-backlog: {stats:?}"
    );
    // Every batch handed over was settled before the connection closed: no row is left
    // leased, and each claimed row is either SENT or released.
    let leased = outbox_figure(&env, "count(*) FILTER (WHERE lease_owner IS NOT NULL)").await;
    assert_eq!(leased, 0, "rows left under the stopped relay's lease");
    assert_eq!(stats.published + stats.released, stats.claimed, "{stats:?}");
    let sent = status_counts(&env).await.get("SENT").copied().unwrap_or(0);
    assert_eq!(sent as u64, stats.published);
    // SENT means confirmed: exactly those rows are on the queue, each once.
    let got = take(&env, &downstream.queue, sent as usize).await;
    assert_quiet(&env, &downstream.queue, Duration::from_millis(500)).await;
    let ids: std::collections::HashSet<String> =
        got.into_iter().filter_map(|m| m.message_id).collect();
    assert_eq!(ids.len(), sent as usize, "a row was published twice");
    // A fresh relay publishes the rest, none of them again.
    let rest = RunningRelay::start(&env, relay_config(&env));
    let got = take(&env, &downstream.queue, ROWS - sent as usize).await;
    assert_quiet(&env, &downstream.queue, Duration::from_millis(500)).await;
    for m in got {
        let id = m.message_id.expect("id");
        assert!(!ids.contains(&id), "{id} published by both relays");
    }
    assert_eq!(rest.stop().await.fenced, 0);
    assert_eq!(status_counts(&env).await.get("SENT"), Some(&(ROWS as i64)));
}

#[cfg(feature = "fault-injection")]
#[tokio::test]
async fn a_republish_after_an_unconfirmed_publish_is_deduped_downstream() {
    let env = TestEnv::new().await;
    let config = env.config("downstream", env.topology("dedup"));
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let consumer = env.start(config.clone(), handler);
    let outbox = Outbox::new(env.schema.clone());
    const ROWS: usize = 40;
    let mut tx = env.pool.begin().await.expect("begin");
    for i in 0..ROWS {
        let m = OutboxMessage::json("Thing", "", &config.topology.queue, &json!({"n": i}))
            .expect("json")
            .with_id(format!("r-{i}"));
        outbox.enqueue(&mut tx, &m).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");

    // The relay publishes, the broker confirms, and the relay "dies" before marking: the lease
    // runs out and the rows go out again under the same ids.
    let mut rc = relay_config(&env);
    rc.lease = Duration::from_secs(2);
    rc.confirm_timeout = Duration::from_secs(1);
    let relay = RunningRelay::start(&env, rc);
    relay.faults.skip_marks(1);
    wait_for("every row SENT", async || {
        status_counts(&env).await.get("SENT") == Some(&(ROWS as i64))
    })
    .await;
    wait_for("duplicates seen downstream", async || {
        consumer.snapshot().duplicates >= ROWS as u64
    })
    .await;
    let s = relay.stop().await;
    assert!(s.claimed >= 2 * ROWS as u64, "published twice: {s:?}");
    let stats = consumer.stop().await;
    assert_eq!(stats.processed, ROWS as u64);
    for i in 0..ROWS {
        assert_eq!(
            env.effects(&format!("r-{i}")).await,
            1,
            "r-{i} applied once"
        );
    }
}

#[tokio::test]
async fn rows_of_one_key_are_published_in_commit_order() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "ordered").await;
    let outbox = Outbox::new(env.schema.clone());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{}\".counters (k TEXT PRIMARY KEY, n BIGINT NOT NULL)",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("counters");
    const KEYS: usize = 6;
    const PER_WRITER: usize = 15;
    let mut rc = relay_config(&env);
    rc.batch_size = 16;
    let relays: Vec<RunningRelay> = (0..2)
        .map(|i| {
            let mut c = rc.clone();
            c.name = format!("ordered-{i}");
            RunningRelay::start(&env, c)
        })
        .collect();
    // Four writers interleave on every key. Each transaction bumps the key's counter (a row
    // lock, so the counter follows commit order) and emits it, sometimes after a pause that
    // lets a later transaction of another key commit first.
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let pool = env.pool.clone();
        let outbox = outbox.clone();
        let queue = downstream.queue.clone();
        let schema = env.schema.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..PER_WRITER * KEYS {
                let key = format!("k{}", (i + w as usize) % KEYS);
                let mut tx = pool.begin().await.expect("begin");
                let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                    "INSERT INTO \"{schema}\".counters VALUES ($1, 1) ON CONFLICT (k) \
                     DO UPDATE SET n = counters.n + 1 RETURNING n"
                )))
                .bind(&key)
                .fetch_one(&mut *tx)
                .await
                .expect("counter");
                let m = OutboxMessage::json("Step", "", &queue, &json!({"key": key, "n": n}))
                    .expect("json")
                    .with_ordering_key(key.clone())
                    .with_id(format!("{key}-{n}"));
                outbox.enqueue(&mut tx, &m).await.expect("enqueue");
                if (i as u64 + w).is_multiple_of(5) {
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
                tx.commit().await.expect("commit");
            }
        }));
    }
    for w in writers {
        w.await.expect("writer");
    }
    let total = 4 * PER_WRITER * KEYS;
    let got = take(&env, &downstream.queue, total).await;
    let mut last: HashMap<String, i64> = HashMap::new();
    for m in &got {
        let body: Value = serde_json::from_slice(&m.body).expect("json");
        let key = body["key"].as_str().expect("key").to_owned();
        let n = body["n"].as_i64().expect("n");
        let prev = last.insert(key.clone(), n).unwrap_or(0);
        assert_eq!(n, prev + 1, "key {key}: {n} published after {prev}");
    }
    assert_eq!(last.len(), KEYS);
    assert_quiet(&env, &downstream.queue, Duration::from_millis(500)).await;
    let mut sent = 0;
    for r in relays {
        let stats = r.stop().await;
        assert_eq!(stats.fenced, 0);
        sent += stats.published;
    }
    assert_eq!(sent, total as u64, "each row settled once");
    let rows = status_counts(&env).await;
    assert_eq!(rows.get("SENT"), Some(&(total as i64)), "{rows:?}");
}

#[tokio::test]
async fn what_the_broker_could_never_take_is_refused_at_enqueue_or_given_up() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "refused").await;
    let mut conn = env.pool.acquire().await.expect("connection");
    let outbox = Outbox::new(env.schema.clone()).with_max_payload_bytes(64);
    let big = OutboxMessage::json(
        "Big",
        "",
        &downstream.queue,
        &json!({ "x": "y".repeat(100) }),
    )
    .expect("json");
    let err = outbox.enqueue(&mut conn, &big).await.expect_err("too big");
    assert!(err.to_string().contains("at most 64"), "{err}");
    let mut typed = OutboxMessage::json("Typed", "", &downstream.queue, &json!({})).expect("json");
    typed.content_type = "x".repeat(300);
    let err = outbox
        .enqueue(&mut conn, &typed)
        .await
        .expect_err("long type");
    assert!(err.to_string().contains("content type"), "{err}");

    // A row written around the API (an older version, a hand-made SQL insert) with such a
    // content type: the relay gives it up as unpublishable and goes on with the next row.
    let ok = OutboxMessage::json("Fine", "", &downstream.queue, &json!({}))
        .expect("json")
        .with_id("fine");
    outbox.enqueue(&mut conn, &ok).await.expect("enqueue");
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}\".outbox SET content_type = repeat('x', 300), message_id = 'bad' \
         WHERE message_id = 'fine'",
        env.schema
    )))
    .execute(&mut *conn)
    .await
    .expect("row changed");
    outbox.enqueue(&mut conn, &ok).await.expect("enqueue");
    let relay = RunningRelay::start(&env, relay_config(&env));
    let got = take(&env, &downstream.queue, 1).await;
    assert_eq!(got[0].message_id.as_deref(), Some("fine"));
    let store = OutboxStore::new(env.schema.clone());
    wait_for("the bad row FAILED", async || {
        store
            .list(&mut conn, &[OutboxStatus::Failed], 10)
            .await
            .expect("list")
            .iter()
            .any(|r| r.message_id == "bad" && r.last_error_code.as_deref() == Some("unpublishable"))
    })
    .await;
    relay.stop().await;
}

#[tokio::test]
async fn a_relay_without_a_broker_claims_nothing_and_publishes_once_it_is_back() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "outage").await;
    let outbox = Outbox::new(env.schema.clone());
    let mut conn = env.pool.acquire().await.expect("connection");
    for i in 0..3 {
        let m = OutboxMessage::json("Step", "", &downstream.queue, &json!({ "i": i }))
            .expect("json")
            .with_id(format!("o-{i}"));
        outbox.enqueue(&mut conn, &m).await.expect("enqueue");
    }
    // Nothing listens on port 1: an outage from the start.
    let relay = RunningRelay::start_at(
        &env,
        "amqp://guest:guest@127.0.0.1:1/%2f".to_owned(),
        relay_config(&env),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stats = relay.stop().await;
    // It backed off instead of claiming and releasing the rows in a loop.
    assert_eq!(stats.claimed, 0, "{stats:?}");
    assert_eq!(status_counts(&env).await.get("PENDING"), Some(&3));
    let attempts = outbox_figure(&env, "coalesce(sum(attempts), 0)").await;
    assert_eq!(attempts, 0, "an outage is not the messages' fault");

    let relay = RunningRelay::start(&env, relay_config(&env));
    take(&env, &downstream.queue, 3).await;
    relay.stop().await;
}

#[tokio::test]
async fn a_gap_in_a_keys_positions_does_not_let_a_later_row_overtake() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "gap").await;
    // The first row goes to a queue that does not exist yet: returned, it stays PENDING.
    let later = env.register(Topology::new(format!("t-{}-gap-later", env.id)));
    let outbox = Outbox::new(env.schema.clone());
    let first = OutboxMessage::json("Step", "", &later.queue, &json!({ "n": 1 }))
        .expect("json")
        .with_ordering_key("k")
        .with_id("dup");
    // Two transactions enqueue the same id for one key at once (a retried web request, a
    // takeover of a stale claim): the second waits for the key's lock, finds the id taken
    // and writes no row, but its position is gone: a gap.
    let mut tx1 = env.pool.begin().await.expect("begin");
    outbox.enqueue(&mut tx1, &first).await.expect("enqueue");
    let racing = {
        let pool = env.pool.clone();
        let outbox = outbox.clone();
        let first = first.clone();
        tokio::spawn(async move {
            let mut tx2 = pool.begin().await.expect("begin");
            outbox.enqueue(&mut tx2, &first).await.expect("enqueue");
            tx2.commit().await.expect("commit");
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    tx1.commit().await.expect("commit");
    racing.await.expect("second writer");
    let mut conn = env.pool.acquire().await.expect("connection");
    let next = OutboxMessage::json("Step", "", &downstream.queue, &json!({ "n": 2 }))
        .expect("json")
        .with_ordering_key("k")
        .with_id("next");
    outbox.enqueue(&mut conn, &next).await.expect("enqueue");
    let positions: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, stream_position FROM \"{}\".outbox ORDER BY seq",
        env.schema
    )))
    .fetch_all(&env.pool)
    .await
    .expect("positions");
    assert_eq!(
        positions,
        [("dup".to_owned(), 1), ("next".to_owned(), 3)],
        "the race left a gap"
    );

    let relay = RunningRelay::start(&env, relay_config(&env));
    wait_for("a return of the first row", async || {
        relay.stats.snapshot().returned >= 2
    })
    .await;
    // Past the gap, the second row still waits for the first.
    assert_quiet(&env, &downstream.queue, Duration::from_millis(800)).await;
    env.broker
        .declare(&later, &inbox_testkit::env::test_retry())
        .await
        .expect("declare");
    assert_eq!(
        take(&env, &later.queue, 1).await[0].message_id.as_deref(),
        Some("dup")
    );
    assert_eq!(
        take(&env, &downstream.queue, 1).await[0]
            .message_id
            .as_deref(),
        Some("next")
    );
    relay.stop().await;
}

#[tokio::test]
async fn an_idle_relay_wakes_on_commit_and_after_losing_its_listener() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "wake").await;
    let outbox = Outbox::new(env.schema.clone());
    let store = OutboxStore::new(env.schema.clone());
    // Polling alone would take up to 30 s: a message within a few seconds came by NOTIFY.
    let mut rc = relay_config(&env);
    rc.poll_interval = Duration::from_secs(30);
    let relay = RunningRelay::start(&env, rc);
    let listening = async || -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN \"' || $1 || '\"%'",
        )
        .bind(store.wakeup_channel())
        .fetch_one(&env.pool)
        .await
        .expect("pg_stat_activity")
    };
    wait_for("the relay to LISTEN", async || listening().await == 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // the relay is idle now
    let send = async |id: &str| {
        let m = OutboxMessage::json("Wake", "", &downstream.queue, &json!({}))
            .expect("json")
            .with_id(id);
        let mut tx = env.pool.begin().await.expect("begin");
        outbox.enqueue(&mut tx, &m).await.expect("enqueue");
        tx.commit().await.expect("commit");
        Instant::now()
    };
    let committed = send("first").await;
    let got = take(&env, &downstream.queue, 1).await;
    let latency = committed.elapsed();
    assert_eq!(got[0].message_id.as_deref(), Some("first"));
    assert!(latency < Duration::from_secs(5), "woken after {latency:?}");

    // The listener's connection is killed: it reconnects and LISTENs again.
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE query LIKE 'LISTEN \"' || $1 || '\"%') t",
    )
    .bind(store.wakeup_channel())
    .fetch_one(&env.pool)
    .await
    .expect("terminate");
    assert_eq!(killed, 1);
    wait_for("the relay to LISTEN again", async || listening().await == 1).await;
    let committed = send("second").await;
    let got = take(&env, &downstream.queue, 1).await;
    assert_eq!(got[0].message_id.as_deref(), Some("second"));
    assert!(committed.elapsed() < Duration::from_secs(5));
    relay.stop().await;
}

/// Statistics of an outbox vacuumed while empty say it has no rows. A burst written after
/// must still be claimed through the pending rows' index and updated by key, not by a plan made
/// for an empty table that reads all of it for every claim: the rows the relay's statements
/// read (sequential scans and primary-key lookups) tell the two apart, about one or two per
/// row against one per row per claim.
#[tokio::test]
async fn a_burst_into_an_outbox_vacuumed_empty_is_claimed_by_key() {
    const ROWS: i64 = 1_000;
    let env = TestEnv::new().await;
    let downstream = target(&env, "vacuumed").await;
    let outbox = Outbox::new(env.schema.clone());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "VACUUM ANALYZE \"{}\".outbox",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("vacuum");
    // Updates (each row claimed, then settled) and the rows read by sequential scans and
    // through the primary key.
    let figures = async || -> (i64, i64) {
        sqlx::query_as(
            "SELECT t.n_tup_upd, t.seq_tup_read + i.idx_tup_read FROM pg_stat_user_tables t \
             JOIN pg_stat_user_indexes i ON i.relid = t.relid \
             WHERE t.schemaname = $1 AND t.relname = 'outbox' AND i.indexrelname = 'outbox_pkey'",
        )
        .bind(env.schema.as_str())
        .fetch_one(&env.pool)
        .await
        .expect("statistics")
    };
    let mut rc = relay_config(&env);
    rc.batch_size = 16;
    // Its gauges count the table with scans of their own: once, at the start.
    rc.maintenance_interval = Duration::from_secs(3600);
    let relay = RunningRelay::start(&env, rc);
    // Idle, it polls the empty table: its sessions cache the claim's plan as they go, the
    // plan a burst then meets.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (updated_before, read_before) = figures().await;
    let mut tx = env.pool.begin().await.expect("begin");
    for i in 0..ROWS {
        let m = OutboxMessage::json("Burst", "", &downstream.queue, &json!({"n": i}))
            .expect("json")
            .with_id(format!("burst-{i}"));
        outbox.enqueue(&mut tx, &m).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
    wait_for("every row published", async || {
        i64::from(env.depths(&downstream).await.work) >= ROWS
    })
    .await;
    let stats = relay.stop().await;
    assert_eq!(stats.published, ROWS as u64);
    // The relay's backends report their counts when idle, within seconds.
    wait_for("the relay's updates counted", async || {
        figures().await.0 - updated_before >= 2 * ROWS
    })
    .await;
    let read = figures().await.1 - read_before;
    assert!(
        read < 20 * ROWS,
        "{read} rows read to publish {ROWS} in batches of 16: a claim or a settle read the \
         table instead of its rows"
    );
}

#[tokio::test]
async fn sent_rows_are_removed_after_the_retention() {
    let env = TestEnv::new().await;
    let downstream = target(&env, "retention").await;
    let outbox = Outbox::new(env.schema.clone());
    let mut conn = env.pool.acquire().await.expect("connection");
    for i in 0..5 {
        let m = OutboxMessage::json("Old", "", &downstream.queue, &json!({}))
            .expect("json")
            .with_id(format!("old-{i}"));
        outbox.enqueue(&mut conn, &m).await.expect("enqueue");
    }
    let mut rc = relay_config(&env);
    rc.retention = Some(Duration::from_millis(500));
    let relay = RunningRelay::start(&env, rc);
    take(&env, &downstream.queue, 5).await;
    wait_for("sent rows deleted", async || {
        status_counts(&env).await.is_empty()
    })
    .await;
    relay.stop().await;
}

/// `exchange`, which the test creates (or its relay does), deleted with the test's
/// topologies: a registration whose queues never exist.
fn delete_at_end(env: &TestEnv, exchange: &str) {
    env.register(
        Topology::new(format!("{exchange}-unused")).with_exchange(exchange.to_owned(), &[]),
    );
}

/// Binds `queue` to `exchange` with `key`; false while the exchange does not exist.
async fn bind(exchange: &str, queue: &str, key: &str) -> bool {
    let connection =
        lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
            .await
            .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    let bound = channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            lapin::options::QueueBindOptions::default(),
            lapin::types::FieldTable::default(),
        )
        .await
        .is_ok();
    let _ = connection.close(200, "done".into()).await;
    bound
}

#[tokio::test]
async fn a_declared_exchange_is_created_at_start_with_its_type_and_routes_the_outbox() {
    let env = TestEnv::new().await;
    let exchange = env.exchange_name("declared");
    delete_at_end(&env, &exchange);
    let queue = target(&env, "declared-target").await.queue;
    assert!(
        !bind(&exchange, &queue, "").await,
        "the exchange does not exist before the relay starts"
    );
    let config = relay_config(&env)
        .with_declared_exchange(Exchange::new(exchange.clone(), ExchangeKind::Fanout));
    let relay = RunningRelay::start(&env, config);
    wait_for("the relay to declare the exchange", async || {
        bind(&exchange, &queue, "").await
    })
    .await;

    // A fanout exchange routes whatever the routing key; a topic or direct one would return
    // this message (bound with "" only), and the row would not be SENT.
    let mut conn = env.pool.acquire().await.expect("connection");
    Outbox::new(env.schema.clone())
        .enqueue(
            &mut conn,
            &OutboxMessage::json("Fanned", &exchange, "any.key", &json!({"n": 1}))
                .expect("json")
                .with_id("fanned"),
        )
        .await
        .expect("enqueue");
    let got = take(&env, &queue, 1).await;
    assert_eq!(got[0].message_id.as_deref(), Some("fanned"));
    let s = relay.stop().await;
    assert_eq!((s.published, s.returned, s.exchange_missing), (1, 0, 0));
}

#[tokio::test]
async fn a_required_exchange_that_is_missing_fails_the_start_naming_it() {
    let env = TestEnv::new().await;
    let present = env.exchange_name("present");
    let absent = env.exchange_name("absent");
    delete_at_end(&env, &present);
    env.broker
        .declare_exchange(&present)
        .await
        .expect("declare the present exchange");
    let mut conn = env.pool.acquire().await.expect("connection");
    Outbox::new(env.schema.clone())
        .enqueue(
            &mut conn,
            &OutboxMessage::json("Waits", &absent, "k", &json!({}))
                .expect("json")
                .with_id("waits"),
        )
        .await
        .expect("enqueue");

    let config = relay_config(&env)
        .with_required_exchange(present.clone())
        .with_required_exchange(absent.clone());
    let relay = Relay::new(amqp_url(), env.pool.clone(), config).expect("valid config");
    let error = tokio::time::timeout(DEADLINE, relay.run(std::future::pending()))
        .await
        .expect("the relay ends at start")
        .expect_err("a required exchange is missing");
    match &error {
        RelayError::ExchangesMissing { exchanges } => {
            assert_eq!(exchanges, std::slice::from_ref(&absent))
        }
        other => panic!("unexpected error: {other}"),
    }
    let text = error.to_string();
    assert!(
        text.contains(&format!("{absent:?}")) && !text.contains(&present),
        "{text}"
    );
    assert!(
        text.contains("declare them") && text.contains("declared_exchanges"),
        "{text}"
    );
    // Nothing was claimed or charged.
    let store = OutboxStore::new(env.schema.clone());
    let rows = store
        .list(&mut conn, &[OutboxStatus::Pending], 10)
        .await
        .expect("list");
    assert_eq!(rows.len(), 1);
    assert_eq!(
        (rows[0].attempts, rows[0].lease_owner.as_deref()),
        (0, None)
    );

    // An exchange declared with another type than the one it has is refused, and named.
    let config = relay_config(&env)
        .with_declared_exchange(Exchange::new(present.clone(), ExchangeKind::Direct));
    let relay = Relay::new(amqp_url(), env.pool.clone(), config).expect("valid config");
    let error = tokio::time::timeout(DEADLINE, relay.run(std::future::pending()))
        .await
        .expect("the relay ends at start")
        .expect_err("the declaration is refused");
    assert!(
        matches!(&error, RelayError::ExchangeRefused { exchange, .. } if exchange == &present),
        "{error}"
    );
    assert!(error.to_string().contains("PRECONDITION_FAILED"), "{error}");
}

#[tokio::test]
async fn a_missing_exchange_at_run_time_is_warned_about_once_per_back_off_period() {
    let (logs, _guard) = crate::capture::capture_logs("rabbit_inbox=warn");
    let env = TestEnv::new().await;
    let exchange = env.exchange_name("nowhere");
    let outbox = Outbox::new(env.schema.clone());
    let mut conn = env.pool.acquire().await.expect("connection");
    const ROWS: u64 = 10;
    for i in 0..ROWS {
        outbox
            .enqueue(
                &mut conn,
                &OutboxMessage::json("Lost", &exchange, "k", &json!({ "i": i }))
                    .expect("json")
                    .with_id(format!("lost-{i}")),
            )
            .await
            .expect("enqueue");
    }
    // One row per batch, each retried every second: without the limit, every batch (ten a
    // round) would warn.
    let period = Duration::from_secs(1);
    let mut config = relay_config(&env);
    config.batch_size = 1;
    config.retry_initial_delay = period;
    config.retry_max_delay = period;
    config.max_attempts = 1_000;
    let started = Instant::now();
    let relay = RunningRelay::start(&env, config);
    wait_for(
        "three rounds of publishes to the missing exchange",
        async || relay.stats.snapshot().exchange_missing >= 3 * ROWS,
    )
    .await;
    let s = relay.stop().await;
    let elapsed = started.elapsed();

    let text = logs.text();
    let warnings: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("WARN") && l.contains(&format!("exchange {exchange:?}")))
        .collect();
    let most = elapsed.as_secs_f64() / period.as_secs_f64() + 1.0;
    assert!(
        !warnings.is_empty() && warnings.len() as f64 <= most,
        "{} warnings in {elapsed:?} for {} failed publishes:\n{text}",
        warnings.len(),
        s.exchange_missing
    );
    let first = warnings[0];
    assert!(
        first.contains(&format!("rows_waiting={ROWS}"))
            && first.contains("does not exist")
            && first.contains("declared_exchanges"),
        "{first}"
    );
}
