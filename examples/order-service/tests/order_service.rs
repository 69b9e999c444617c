//! The order service's business rules under real RabbitMQ delivery: logical duplicates,
//! out-of-order messages, refused transitions and duplicate payments. Talks to the real
//! servers (`DATABASE_URL`, `AMQP_URL`, defaulting to the local ones); every test owns a
//! schema `t_<random hex>` and queues `t-<random hex>...`, removed afterwards even on panic.

use std::{
    hash::{BuildHasher, RandomState},
    sync::Arc,
    time::{Duration, SystemTime},
};

use order_service::messages::{
    order_cancelled, order_placed, order_step, payment_received, routing_key,
};
use rabbit_inbox::{
    Consumer, ConsumerConfig, InboxStatus, SchemaName, broker::Broker, broker::OutgoingMessage,
    broker::ParkingLot, broker::QueueDepths, stats::ConsumerStats, stats::StatsSnapshot,
    status::parking_headers, store::InboxRecord, store::InboxStore,
};
use sqlx::{AssertSqlSafe, PgPool, postgres::PgPoolOptions};
use tokio::time::Instant;

const DEADLINE: Duration = Duration::from_secs(30);
const EMPTY: QueueDepths = QueueDepths {
    work: 0,
    retry: 0,
    parking: 0,
};

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

async fn wait_for(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if check().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {DEADLINE:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Drops the schema and deletes the queues and exchange, from its own thread and runtime.
struct Cleanup {
    schema: SchemaName,
    config: ConsumerConfig,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let schema = self.schema.clone();
        let topology = self.config.topology.clone();
        let retry = self.config.retry.clone();
        let thread = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                eprintln!("cleanup: cannot build a runtime");
                return;
            };
            runtime.block_on(async {
                match Broker::connect(&amqp_url(), "order-service test cleanup").await {
                    Ok(broker) => {
                        if let Err(e) = broker.delete(&topology, &retry).await {
                            eprintln!("cleanup: deleting {}: {e}", topology.queue);
                        }
                        broker.close().await;
                    }
                    Err(e) => eprintln!("cleanup: cannot reach RabbitMQ: {e}"),
                }
                let Ok(options) = database_url().parse::<sqlx::postgres::PgConnectOptions>() else {
                    eprintln!("cleanup: bad DATABASE_URL");
                    return;
                };
                match PgPoolOptions::new()
                    .max_connections(1)
                    .connect_with(options.options([("lock_timeout", "20s")]))
                    .await
                {
                    Ok(pool) => {
                        if let Err(e) = rabbit_inbox::schema::drop_schema(&pool, &schema).await {
                            eprintln!("cleanup: dropping schema {schema}: {e}");
                        }
                        pool.close().await;
                    }
                    Err(e) => eprintln!("cleanup: cannot reach PostgreSQL: {e}"),
                }
            });
        });
        let _ = thread.join();
    }
}

/// One test's service: schema with inbox and business tables, its queue and exchange.
struct Service {
    pool: PgPool,
    schema: SchemaName,
    store: InboxStore,
    broker: Broker,
    config: ConsumerConfig,
    _cleanup: Cleanup,
}

struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), rabbit_inbox::ConsumerError>>,
    stats: Arc<ConsumerStats>,
}

impl Running {
    async fn stop(self) -> StatsSnapshot {
        let _ = self.stop.send(());
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("consumer stops in time")
            .expect("consumer task did not panic")
            .expect("consumer ran without a fatal error");
        self.stats.snapshot()
    }
}

impl Service {
    async fn new() -> Self {
        let id = format!(
            "{:016x}",
            RandomState::new().hash_one((SystemTime::now(), std::process::id()))
        );
        let schema = SchemaName::new(format!("t_{id}")).expect("valid schema name");
        let mut config = order_service::config(
            schema.clone(),
            &format!("t-{id}-orders"),
            &format!("t-{id}-orders-exchange"),
        );
        // Fast retries, and a budget that outlasts any wait in these tests.
        config.retry.delays = vec![Duration::from_millis(200)];
        config.retry.max_attempts = 50;
        config.max_batch_delay = Duration::from_millis(10);
        config.reconnect_initial_delay = Duration::from_millis(100);
        config.reconnect_max_delay = Duration::from_secs(1);
        let cleanup = Cleanup {
            schema: schema.clone(),
            config: config.clone(),
        };
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(DEADLINE)
            .connect(&database_url())
            .await
            .expect("PostgreSQL is reachable");
        rabbit_inbox::migrate(&pool, &schema)
            .await
            .expect("inbox migrations");
        order_service::migrate(&pool, &schema)
            .await
            .expect("business tables");
        let broker = Broker::connect(&amqp_url(), &format!("order-service test {id}"))
            .await
            .expect("RabbitMQ is reachable");
        broker
            .declare(&config.topology, &config.retry)
            .await
            .expect("declare");
        Self {
            store: InboxStore::new(schema.clone()),
            pool,
            schema,
            broker,
            config,
            _cleanup: cleanup,
        }
    }

    fn start(&self) -> Running {
        let consumer = Consumer::new(
            amqp_url(),
            self.pool.clone(),
            self.config.clone(),
            order_service::OrderHandler::new(self.schema.clone()),
        )
        .expect("valid config");
        let stats = consumer.stats();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run(async move {
            let _ = stopped.await;
        }));
        Running { stop, task, stats }
    }

    /// Publishes to the service's exchange as a producer would.
    async fn publish(&self, message: &OutgoingMessage) {
        let exchange = self.config.topology.exchange.as_deref().expect("exchange");
        let kind = message.kind.as_deref().expect("type");
        self.broker
            .publish(exchange, routing_key(kind), message)
            .await
            .expect("publish is confirmed");
    }

    async fn record(&self, message_id: &str) -> Option<InboxRecord> {
        let mut conn = self.pool.acquire().await.expect("connection");
        self.store
            .find(&mut conn, order_service::CONSUMER_NAME, message_id)
            .await
            .expect("inbox row")
    }

    async fn wait_for_record(
        &self,
        message_id: &str,
        what: &str,
        check: impl Fn(&InboxRecord) -> bool,
    ) -> InboxRecord {
        let mut found = None;
        wait_for(&format!("inbox row {message_id}: {what}"), async || {
            found = self.record(message_id).await.filter(|r| check(r));
            found.is_some()
        })
        .await;
        found.expect("found")
    }

    /// (status, total_cents, paid_cents, placed_by_message) of an order.
    async fn order(&self, order_id: &str) -> Option<(String, i64, i64, String)> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, total_cents, paid_cents, placed_by_message FROM \"{}\".orders \
             WHERE order_id = $1",
            self.schema
        )))
        .bind(order_id)
        .fetch_optional(&self.pool)
        .await
        .expect("read order")
    }

    async fn count(&self, table: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{}\".{table}",
            self.schema
        )))
        .fetch_one(&self.pool)
        .await
        .expect("count")
    }

    /// The sequence numbers journaled for `aggregate_id`, in the order they were applied.
    async fn journal(&self, aggregate_id: &str) -> Vec<i64> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT sequence_number FROM \"{}\".order_journal WHERE aggregate_id = $1 \
             ORDER BY serial",
            self.schema
        )))
        .bind(aggregate_id)
        .fetch_all(&self.pool)
        .await
        .expect("read journal")
    }

    /// The error codes of a message's recorded failures, oldest first.
    async fn failures(&self, message_id: &str) -> Vec<String> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT error_code FROM \"{}\".inbox_event WHERE message_id = $1 AND kind = 'failed' \
             ORDER BY event_id",
            self.schema
        )))
        .bind(message_id)
        .fetch_all(&self.pool)
        .await
        .expect("read history")
    }

    async fn verify(&self) -> order_service::Verification {
        order_service::verify(&self.pool, &self.schema)
            .await
            .expect("verification query")
    }

    async fn depths(&self) -> QueueDepths {
        self.broker
            .queue_depths(&self.config.topology, &self.config.retry)
            .await
            .expect("queue depths")
    }
}

fn is(status: InboxStatus) -> impl Fn(&InboxRecord) -> bool {
    move |r| r.status == status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logical_duplicate_order_placed_is_a_no_op() {
    let svc = Service::new().await;
    let consumer = svc.start();
    svc.publish(&order_placed("m1", "o1", "alice", 1000)).await;
    // The producer emits the same business event again under a new message id.
    svc.publish(&order_placed("m2", "o1", "alice", 1000)).await;
    svc.wait_for_record("m1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    svc.wait_for_record("m2", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;

    assert_eq!(svc.count("orders").await, 1, "one order, not two");
    let (status, total, paid, placed_by) = svc.order("o1").await.expect("order");
    assert_eq!(
        (status.as_str(), total, paid, placed_by.as_str()),
        ("PLACED", 1000, 0, "m1"),
        "the second OrderPlaced changed nothing"
    );
    assert_eq!(
        stats.processed, 2,
        "both messages are processed (the second as a no-op)"
    );
    assert_eq!(stats.parked + stats.retried, 0);
    let v = svc.verify().await;
    assert!(v.exactly_once(), "{v:?}");
    assert_eq!((v.processed, v.orders), (2, 1));
    assert_eq!(svc.depths().await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payment_before_order_is_retried_then_applied_once() {
    let svc = Service::new().await;
    let consumer = svc.start();
    svc.publish(&payment_received("p1", "o1", 1000)).await;
    let early = svc
        .wait_for_record("p1", "RETRYABLE_FAILED", is(InboxStatus::RetryableFailed))
        .await;
    assert_eq!(early.last_error_code.as_deref(), Some("order_not_found"));
    assert_eq!(svc.count("payment_history").await, 0, "nothing applied yet");
    assert_eq!(svc.count("orders").await, 0);

    svc.publish(&order_placed("m1", "o1", "alice", 1000)).await;
    let paid = svc
        .wait_for_record("p1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let stats = consumer.stop().await;

    assert!(paid.processing_attempt >= 2, "{paid:?}");
    let (status, total, paid_cents, _) = svc.order("o1").await.expect("order");
    assert_eq!((status.as_str(), total, paid_cents), ("PAID", 1000, 1000));
    assert_eq!(svc.count("payment_history").await, 1, "applied once");
    assert!(stats.retried >= 1);
    assert_eq!(stats.parked, 0);
    let v = svc.verify().await;
    assert!(v.exactly_once(), "{v:?}");
    assert_eq!((v.processed, v.retryable, v.parked), (2, 0, 0));
    assert_eq!(svc.depths().await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_paid_order_is_a_permanent_failure_and_parked() {
    let svc = Service::new().await;
    let consumer = svc.start();
    svc.publish(&order_placed("m1", "o1", "alice", 1000)).await;
    svc.publish(&payment_received("p1", "o1", 1000)).await;
    svc.publish(&order_placed("m2", "o2", "bob", 500)).await;
    svc.wait_for_record("p1", "PROCESSED", is(InboxStatus::Processed))
        .await;
    svc.wait_for_record("m2", "PROCESSED", is(InboxStatus::Processed))
        .await;

    svc.publish(&order_cancelled("x1", "o1")).await;
    // Control: a PLACED order can be cancelled.
    svc.publish(&order_cancelled("x2", "o2")).await;
    let refused = svc
        .wait_for_record("x1", "PERMANENT_FAILED", is(InboxStatus::PermanentFailed))
        .await;
    svc.wait_for_record("x2", "PROCESSED", is(InboxStatus::Processed))
        .await;
    wait_for("the refused cancellation in the parking lot", async || {
        svc.depths().await.parking == 1
    })
    .await;
    let lot = ParkingLot::connect(
        &amqp_url(),
        &svc.config.topology.queue,
        &svc.config.topology.parking_queue,
    )
    .await
    .expect("RabbitMQ is reachable");
    let copy = lot
        .next()
        .await
        .expect("basic.get")
        .expect("parked message");
    let parked = copy.message().clone();
    lot.remove(copy).await.expect("basic.ack");
    lot.close().await;
    let stats = consumer.stop().await;

    assert_eq!(
        refused.last_error_code.as_deref(),
        Some("invalid_transition")
    );
    assert_eq!(refused.processing_attempt, 1, "not retried");
    assert_eq!(parked.message_id.as_deref(), Some("x1"));
    let header = |name: &str| parked.headers.get(name).and_then(|v| v.as_str());
    assert_eq!(
        header(parking_headers::ERROR_CODE),
        Some("invalid_transition")
    );
    assert_eq!(header(parking_headers::STATUS), Some("PERMANENT_FAILED"));
    assert_eq!(parked.body, order_cancelled("x1", "o1").body);

    let (status, _, paid, _) = svc.order("o1").await.expect("order");
    assert_eq!(
        (status.as_str(), paid),
        ("PAID", 1000),
        "the paid order is untouched"
    );
    let (status, _, _, _) = svc.order("o2").await.expect("order");
    assert_eq!(status, "CANCELLED");
    assert_eq!(stats.parked, 1);
    let v = svc.verify().await;
    assert!(v.exactly_once(), "{v:?}");
    assert_eq!((v.processed, v.parked), (4, 1));
    assert_eq!(svc.depths().await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_payment_delivery_never_double_pays() {
    let svc = Service::new().await;
    // Two instances of the service compete on the queue, so copies of one payment can be
    // processed at the same time by different instances.
    let consumers = [svc.start(), svc.start()];
    let orders = 10;
    for i in 0..orders {
        svc.publish(&order_placed(
            &format!("m{i}"),
            &format!("o{i}"),
            "alice",
            1000,
        ))
        .await;
    }
    let copies = 3;
    for _ in 0..copies {
        for i in 0..orders {
            svc.publish(&payment_received(&format!("p{i}"), &format!("o{i}"), 1000))
                .await;
        }
    }
    let deliveries = orders * (1 + copies);
    wait_for("every delivery settled", async || {
        let settled: u64 = consumers
            .iter()
            .map(|c| {
                let s = c.stats.snapshot();
                s.processed + s.duplicates
            })
            .sum();
        settled == deliveries
    })
    .await;
    let mut processed = 0;
    let mut parked = 0;
    for c in consumers {
        let s = c.stop().await;
        processed += s.processed;
        parked += s.parked;
    }

    assert_eq!(
        processed,
        2 * orders,
        "each order and each payment committed once"
    );
    assert_eq!(parked, 0);
    let v = svc.verify().await;
    assert!(v.exactly_once(), "{v:?}");
    assert_eq!(v.double_applied, 0);
    assert_eq!(v.payment_rows, 10);
    assert_eq!(
        (v.processed, v.orders, v.retryable, v.parked),
        (20, 10, 0, 0)
    );
    for i in 0..orders {
        let (status, _, paid, _) = svc.order(&format!("o{i}")).await.expect("order");
        assert_eq!((status.as_str(), paid), ("PAID", 1000), "o{i} paid once");
    }
    assert_eq!(svc.depths().await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_replay_of_a_payment_the_rules_refuse_ends_permanent_failed_and_parked() {
    let svc = Service::new().await;
    let consumer = svc.start();
    svc.publish(&order_placed("m1", "o1", "alice", 1000)).await;
    svc.publish(&payment_received("p1", "o1", 1000)).await;
    svc.wait_for_record("p1", "PROCESSED", is(InboxStatus::Processed))
        .await;

    // An operator forces a replay of the payment; its next delivery runs the handler again,
    // and the order, now PAID, refuses a second payment.
    let ops = inbox_ops::Operations::new(svc.pool.clone(), svc.schema.clone());
    let actor =
        inbox_ops::Actor::new("alice", "customer disputed the payment").expect("valid actor");
    let replay = ops
        .reopen("p1", &svc.config.consumer_name, &actor, true)
        .await
        .expect("forced replay");
    assert_eq!(replay.action, inbox_ops::reopen::FORCED_REPLAY);
    svc.publish(&payment_received("p1", "o1", 1000)).await;
    let refused = svc
        .wait_for_record("p1", "PERMANENT_FAILED", is(InboxStatus::PermanentFailed))
        .await;
    wait_for("the refused replay in the parking lot", async || {
        svc.depths().await.parking == 1
    })
    .await;
    consumer.stop().await;

    assert_eq!(
        refused.last_error_code.as_deref(),
        Some("invalid_transition")
    );
    let (status, _, paid, _) = svc.order("o1").await.expect("order");
    assert_eq!((status.as_str(), paid), ("PAID", 1000), "paid once");
    assert_eq!(svc.count("payment_history").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_steps_apply_once_each_in_order_through_a_retry_and_a_redrive() {
    let mut svc = Service::new().await;
    let mut ordering = order_service::ordering();
    ordering.release_interval = Duration::from_millis(50);
    svc.config.ordering = Some(ordering);
    let fault =
        |step, fault| order_service::set_step_fault(&svc.pool, &svc.schema, "o1", step, fault);
    fault(2, order_service::StepFault::RetryOnce)
        .await
        .expect("fault set");
    fault(4, order_service::StepFault::Refuse)
        .await
        .expect("fault set");
    // Held before it runs: its first run is a released copy.
    fault(5, order_service::StepFault::RetryOnce)
        .await
        .expect("fault set");
    let consumer = svc.start();
    let release = inbox_ops::ReleaseTask::for_consumer(svc.pool.clone(), amqp_url(), &svc.config)
        .expect("an ordered consumer has a release task");
    let (stop_release, release_stopped) = tokio::sync::oneshot::channel::<()>();
    let release = tokio::spawn(release.run(async move {
        let _ = release_stopped.await;
    }));
    for step in 1..=6 {
        svc.publish(&order_step(&format!("o1-{step}"), "o1", step))
            .await;
    }
    for step in 1..=3 {
        svc.publish(&order_step(&format!("o2-{step}"), "o2", step))
            .await;
    }

    // Step 4 is parked; 5 and 6 wait behind it, while the other order goes on.
    let refused = svc
        .wait_for_record("o1-4", "PERMANENT_FAILED", is(InboxStatus::PermanentFailed))
        .await;
    assert_eq!(refused.last_error_code.as_deref(), Some("step_refused"));
    for id in ["o1-5", "o1-6"] {
        svc.wait_for_record(id, "HELD", is(InboxStatus::Held)).await;
    }
    svc.wait_for_record("o2-3", "PROCESSED", is(InboxStatus::Processed))
        .await;
    assert_eq!(svc.journal("o1").await, [1, 2, 3]);
    assert_eq!(svc.journal("o2").await, [1, 2, 3]);
    assert_eq!(
        svc.failures("o1-2").await,
        ["step_not_ready"],
        "step 2 failed once, then applied on its retry"
    );

    // The fix, then the redrive: step 4 applies, and the held steps after it, in order.
    assert!(
        order_service::clear_step_fault(&svc.pool, &svc.schema, "o1", 4)
            .await
            .expect("fault cleared")
    );
    wait_for("the refused step in the parking lot", async || {
        svc.depths().await.parking == 1
    })
    .await;
    let lot = ParkingLot::connect(
        &amqp_url(),
        &svc.config.topology.queue,
        &svc.config.topology.parking_queue,
    )
    .await
    .expect("parking lot");
    let ops = inbox_ops::Operations::new(svc.pool.clone(), svc.schema.clone());
    let actor = inbox_ops::Actor::new("alice", "step 4 fixed").expect("valid actor");
    let request = inbox_ops::redrive::RedriveRequest {
        message_ids: vec!["o1-4".into()],
        ..Default::default()
    };
    ops.redrive(&lot, &request, Some(&actor), &inbox_ops::NoProgress)
        .await
        .expect("redrive");
    lot.close().await;
    svc.wait_for_record("o1-6", "PROCESSED", is(InboxStatus::Processed))
        .await;
    let _ = stop_release.send(());
    release.await.expect("release task did not panic");
    consumer.stop().await;

    assert_eq!(svc.journal("o1").await, [1, 2, 3, 4, 5, 6]);
    assert_eq!(svc.failures("o1-4").await, ["step_refused"]);
    assert_eq!(svc.failures("o1-5").await, ["step_not_ready"]);
    assert_eq!(svc.journal("o2").await, [1, 2, 3]);
    let v = svc.verify().await;
    assert_eq!((v.processed, v.parked, v.retryable), (9, 0, 0), "{v:?}");
    assert_eq!(svc.depths().await, EMPTY);
}
