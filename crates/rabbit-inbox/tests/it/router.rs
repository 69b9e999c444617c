//! A consumer of three message types through a `Router`, against the real servers: each
//! message reaches its typed handler once, duplicates are suppressed, an unknown type and a
//! payload that does not match its type are parked with their codes, a retryable failure is
//! retried, and the batch form commits the valid messages of a mixed batch.

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use inbox_testkit::{
    amqp_url,
    env::{TestEnv, header, message, wait_for},
};
use rabbit_inbox::{
    BatchError, Consumer, HandlerError, InboxMessage, InboxStatus, Router, SchemaName,
    TypedBatchHandler, TypedHandler, TypedMessage, broker::OutgoingMessage, broker::QueueDepths,
    envelope::VERSION_HEADER, status::parking_headers,
};
use serde::Deserialize;
use serde_json::json;
use sqlx::{AssertSqlSafe, PgConnection};

const EMPTY: QueueDepths = QueueDepths {
    work: 0,
    retry: 0,
    parking: 0,
};

#[derive(Deserialize)]
struct OrderPlaced {
    order_id: String,
}

#[derive(Deserialize)]
struct OrderCancelled {
    order_id: String,
}

#[derive(Deserialize)]
struct PaymentCaptured {
    order_id: String,
    /// The payment gateway is down on the first attempt.
    #[serde(default)]
    gateway_down_once: bool,
}

/// The service's handlers: each writes one effect row (no unique constraint, so a double
/// application shows) naming the route that ran. The batch route logs its calls.
#[derive(Clone)]
struct Orders {
    schema: SchemaName,
    batches: Arc<Mutex<Vec<Vec<String>>>>,
}

impl Orders {
    fn new(env: &TestEnv) -> Self {
        Self {
            schema: env.schema.clone(),
            batches: Arc::default(),
        }
    }

    fn batches(&self) -> Vec<Vec<String>> {
        self.batches
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    async fn effect(
        &self,
        route: &str,
        order_id: &str,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".effects (message_id, consumer_name, message_type, attempt, body) \
             VALUES ($1, $2, $3, $4, $5)",
            self.schema
        )))
        .bind(msg.message_id())
        .bind(msg.consumer_name())
        .bind(route)
        .bind(msg.attempt())
        .bind(order_id)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

impl TypedHandler<OrderPlaced> for Orders {
    async fn handle(
        &self,
        order: OrderPlaced,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        self.effect("placed", &order.order_id, msg, tx).await
    }
}

impl TypedHandler<OrderCancelled> for Orders {
    async fn handle(
        &self,
        order: OrderCancelled,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        self.effect("cancelled", &order.order_id, msg, tx).await
    }
}

impl TypedHandler<PaymentCaptured> for Orders {
    async fn handle(
        &self,
        payment: PaymentCaptured,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        if payment.gateway_down_once && msg.attempt() == 1 {
            return Err(HandlerError::retryable(
                "gateway_down",
                "the payment gateway did not answer",
            ));
        }
        self.effect("captured", &payment.order_id, msg, tx).await
    }
}

/// Set-based: one statement for the route's messages of a batch.
impl TypedBatchHandler<OrderPlaced> for Orders {
    async fn handle_batch(
        &self,
        msgs: Vec<TypedMessage<'_, OrderPlaced>>,
        tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        let ids: Vec<String> = msgs.iter().map(|m| m.msg.message_id().to_owned()).collect();
        self.batches
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(ids.clone());
        let orders: Vec<String> = msgs.into_iter().map(|m| m.payload.order_id).collect();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".effects (message_id, consumer_name, message_type, attempt, body) \
             SELECT id, 'svc', 'placed-batch', 1, o FROM UNNEST($1::text[], $2::text[]) AS u(id, o)",
            self.schema
        )))
        .bind(&ids)
        .bind(&orders)
        .execute(&mut *tx)
        .await
        .map_err(|e| BatchError::Batch(e.into()))?;
        Ok(())
    }
}

fn placed(id: &str) -> OutgoingMessage {
    message(
        Some(id),
        "OrderPlaced",
        &json!({ "order_id": format!("o-{id}") }),
    )
}

fn cancelled(id: &str) -> OutgoingMessage {
    message(
        Some(id),
        "OrderCancelled",
        &json!({ "order_id": format!("o-{id}") }),
    )
}

fn captured(id: &str, gateway_down_once: bool) -> OutgoingMessage {
    message(
        Some(id),
        "PaymentCaptured",
        &json!({ "order_id": format!("o-{id}"), "gateway_down_once": gateway_down_once }),
    )
}

/// The route that applied `message_id`'s effect, once each.
async fn applied(env: &TestEnv, message_id: &str) -> Vec<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT message_type FROM \"{}\".effects WHERE message_id = $1 ORDER BY seq",
        env.schema
    )))
    .bind(message_id)
    .fetch_all(&env.pool)
    .await
    .expect("effects")
}

/// Asserts that `id` was parked with `code`, PERMANENT_FAILED, its effect never applied.
async fn assert_parked(
    env: &TestEnv,
    parked: &[rabbit_inbox::envelope::AmqpMessage],
    id: &str,
    code: &str,
) {
    let copy = parked
        .iter()
        .find(|m| m.message_id.as_deref() == Some(id))
        .unwrap_or_else(|| panic!("{id} parked"));
    assert_eq!(
        header(copy, parking_headers::ERROR_CODE),
        Some(code),
        "{id}"
    );
    let row = env.record("svc", id).await.expect("row");
    assert_eq!(row.status, InboxStatus::PermanentFailed, "{id}");
    assert_eq!(row.last_error_code.as_deref(), Some(code), "{id}");
    assert_eq!(
        row.processing_attempt, 1,
        "{id}: a permanent failure is not retried"
    );
    assert!(applied(env, id).await.is_empty(), "{id}: no effect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_type_reaches_its_handler_once_and_the_rest_is_parked_or_retried() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("router"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let orders = Orders::new(&env);
    let router = Router::builder()
        .route::<OrderPlaced, _>("OrderPlaced", orders.clone())
        .route::<OrderCancelled, _>("OrderCancelled", orders.clone())
        .route::<PaymentCaptured, _>("PaymentCaptured", orders.clone())
        .build()
        .expect("router");
    let consumer = env.start(config, router);

    env.publish(&topology, &placed("p1")).await;
    env.publish(&topology, &cancelled("c1")).await;
    env.publish(&topology, &captured("pay1", true)).await;
    env.publish(&topology, &message(Some("u1"), "InvoiceSent", &json!({})))
        .await;
    // An OrderPlaced whose order id is a number.
    env.publish(
        &topology,
        &message(Some("bad1"), "OrderPlaced", &json!({ "order_id": 17 })),
    )
    .await;
    for id in ["p1", "c1", "pay1"] {
        env.wait_for_record("svc", id, "PROCESSED", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    }
    // The producer publishes p1 again.
    env.publish(&topology, &placed("p1")).await;
    wait_for("the duplicate settled", async || {
        consumer.snapshot().duplicates == 1
    })
    .await;
    let parked = env.take_parked(&topology, 2).await;
    let stats = consumer.stop().await;

    assert_eq!(
        applied(&env, "p1").await,
        ["placed"],
        "once, despite the duplicate"
    );
    assert_eq!(applied(&env, "c1").await, ["cancelled"]);
    assert_eq!(applied(&env, "pay1").await, ["captured"]);
    let pay1 = env.record("svc", "pay1").await.expect("row");
    assert_eq!(pay1.processing_attempt, 2, "retried once through the tier");
    assert_eq!(parked.len(), 2);
    assert_parked(&env, &parked, "u1", "unknown_message_type").await;
    assert_parked(&env, &parked, "bad1", "payload_mismatch").await;
    let unknown = env.record("svc", "u1").await.expect("row");
    let text = unknown.last_error_message.unwrap_or_default();
    assert!(
        text.contains("\"InvoiceSent\"")
            && text.contains("OrderCancelled, OrderPlaced, PaymentCaptured"),
        "names the type and the routed ones: {text}"
    );
    let mismatch = env.record("svc", "bad1").await.expect("row");
    let text = mismatch.last_error_message.unwrap_or_default();
    assert!(text.contains("order_id"), "names the field: {text}");
    assert_eq!(stats.processed, 3);
    assert_eq!(stats.duplicates, 1);
    assert_eq!(stats.retried, 1);
    assert_eq!(stats.parked, 2);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_batch_commits_its_valid_messages_and_runs_routes_in_delivery_order() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("router-batch"));
    config.lanes = 1;
    config.batch_size = 50;
    // All are queued before the consumer starts; the delay lets them into one batch.
    config.max_batch_delay = Duration::from_secs(2);
    let topology = config.topology.clone();
    env.declare(&config).await;
    for m in [
        placed("p1"),
        placed("p2"),
        cancelled("c1"),
        message(Some("u1"), "InvoiceSent", &json!({})),
        message(Some("bad1"), "OrderPlaced", &json!({ "order_id": 17 })),
        placed("p3"),
        captured("pay1", false),
    ] {
        env.publish(&topology, &m).await;
    }
    let orders = Orders::new(&env);
    let router = Router::builder()
        .route_batch::<OrderPlaced, _>("OrderPlaced", orders.clone())
        .route::<OrderCancelled, _>("OrderCancelled", orders.clone())
        .route::<PaymentCaptured, _>("PaymentCaptured", orders.clone())
        .build()
        .expect("router");
    let consumer = env.start_batch(config, router);
    let parked = env.take_parked(&topology, 2).await;
    wait_for("5 processed", async || consumer.snapshot().processed == 5).await;
    let stats = consumer.stop().await;

    for id in ["p1", "p2", "p3"] {
        assert_eq!(applied(&env, id).await, ["placed-batch"], "{id}");
    }
    assert_eq!(applied(&env, "c1").await, ["cancelled"]);
    assert_eq!(applied(&env, "pay1").await, ["captured"]);
    assert_parked(&env, &parked, "u1", "unknown_message_type").await;
    assert_parked(&env, &parked, "bad1", "payload_mismatch").await;
    // The unknown type and the mismatch were found before any handler ran; the batch then
    // ran once without them, each run of OrderPlaced in one call, in delivery order (c1
    // between p2 and p3 splits them).
    assert_eq!(
        orders.batches(),
        [
            vec!["p1".to_owned(), "p2".to_owned()],
            vec!["p3".to_owned()]
        ]
    );
    assert_eq!(stats.processed, 5);
    assert_eq!(stats.parked, 2);
    assert_eq!(stats.retried, 0);
    assert_eq!(env.depths(&topology).await, EMPTY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_router_has_unknown_types_refused_at_parse_time() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("router-closed"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let orders = Orders::new(&env);
    let closed = || {
        Router::builder()
            .route::<OrderPlaced, _>("OrderPlaced", orders.clone())
            .route::<OrderCancelled, _>(("OrderCancelled", 2), orders.clone())
            .closed()
            .build()
            .expect("router")
    };
    // Version 2 is not supported by the consumer: that route could never run.
    let refused = Consumer::new(amqp_url(), env.pool.clone(), config.clone(), closed())
        .expect_err("an unreachable route");
    assert!(
        refused.to_string().contains("envelope.supported_versions"),
        "{refused}"
    );
    config.envelope.supported_versions = 1..=2;
    let consumer = env.start(config, closed());

    env.publish(&topology, &placed("p1")).await;
    env.publish(&topology, &message(Some("u1"), "InvoiceSent", &json!({})))
        .await;
    // A routed type in a version without a route.
    let mut c1 = cancelled("c1");
    c1.headers.insert(VERSION_HEADER.into(), json!(1));
    env.publish(&topology, &c1).await;
    let mut c2 = cancelled("c2");
    c2.headers.insert(VERSION_HEADER.into(), json!(2));
    env.publish(&topology, &c2).await;
    let parked = env.take_parked(&topology, 2).await;
    wait_for("2 processed", async || consumer.snapshot().processed == 2).await;
    let stats = consumer.stop().await;

    assert_eq!(applied(&env, "p1").await, ["placed"]);
    assert_eq!(applied(&env, "c2").await, ["cancelled"]);
    assert_parked(&env, &parked, "u1", "unknown_message_type").await;
    assert_parked(&env, &parked, "c1", "unknown_message_type").await;
    // Refused by the envelope rules, not by the router: the invalid message's detail.
    let c1 = env.record("svc", "c1").await.expect("row");
    let text = c1.last_error_message.unwrap_or_default();
    assert!(
        text.contains("\"OrderCancelled\" version 1 is not one this consumer accepts"),
        "{text}"
    );
    assert_eq!(stats.processed, 2);
    assert_eq!(stats.parked, 2);
    assert_eq!(env.depths(&topology).await, EMPTY);
}
