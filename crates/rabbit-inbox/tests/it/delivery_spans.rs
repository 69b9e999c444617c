//! The delivery span continues the producer's trace (W3C `traceparent`), carries the message's
//! identifiers and its outcome, and is exported through OpenTelemetry (an in-memory exporter
//! here); the library's logs never print a body, whatever happens to the message.

use inbox_testkit::env::{TestEnv, thing};
use rabbit_inbox::{BatchError, BatchHandler, Handler, HandlerError, InboxMessage};
use serde_json::json;
use sqlx::PgConnection;

use crate::capture::capture_logs;

/// Spans exported to memory, for this test's thread (its runtime is single-threaded, so every
/// task of the test sees the subscriber) until the guard drops.
#[cfg(feature = "otel")]
fn spans_in_memory() -> (
    opentelemetry_sdk::trace::InMemorySpanExporter,
    tracing::subscriber::DefaultGuard,
) {
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing_subscriber::layer::SubscriberExt as _;

    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    (exporter, inbox_testkit::set_scoped_subscriber(subscriber))
}

#[cfg(feature = "otel")]
#[tokio::test]
async fn a_delivery_span_is_a_child_of_the_producers_trace() {
    use inbox_testkit::env::{Rule, wait_for};
    use opentelemetry::{
        Value,
        trace::{SpanId, SpanKind, TraceId},
    };
    use opentelemetry_sdk::trace::SpanData;
    use rabbit_inbox::envelope::TRACEPARENT_HEADER;

    let (exporter, _guard) = spans_in_memory();

    let env = TestEnv::new().await;
    let config = env.config("traced", env.topology("traced"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("refused", Rule::Permanent);
    let running = env.start(config, handler);

    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    let mut traced = thing("traced", 1);
    traced.correlation_id = Some("order-42".into());
    traced.headers.insert(
        TRACEPARENT_HEADER.into(),
        json!(format!("00-{trace}-{parent}-01")),
    );
    env.publish(&topology, &traced).await;
    let mut refused = thing("refused", 2);
    refused.headers.insert(
        TRACEPARENT_HEADER.into(),
        json!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
    );
    env.publish(&topology, &refused).await;
    env.publish(&topology, &thing("untraced", 3)).await;

    let delivery = |id: &str| -> Option<SpanData> {
        exporter
            .get_finished_spans()
            .expect("spans")
            .into_iter()
            .find(|s| {
                s.name == "inbox.delivery"
                    && s.attributes
                        .iter()
                        .any(|kv| kv.key.as_str() == "message_id" && kv.value.as_str() == id)
            })
    };
    wait_for("three delivery spans", async || {
        ["traced", "refused", "untraced"]
            .iter()
            .all(|id| delivery(id).is_some())
    })
    .await;
    running.stop().await;

    let attribute = |span: &SpanData, key: &str| -> Option<Value> {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.clone())
    };
    let span = delivery("traced").expect("span");
    assert_eq!(
        span.span_context.trace_id(),
        TraceId::from_hex(trace).expect("hex"),
        "same trace as the producer"
    );
    assert_eq!(span.parent_span_id, SpanId::from_hex(parent).expect("hex"));
    assert!(span.parent_span_is_remote);
    assert_eq!(span.span_kind, SpanKind::Consumer);
    assert_eq!(attribute(&span, "consumer"), Some("traced".into()));
    assert_eq!(attribute(&span, "message_type"), Some("Thing".into()));
    assert_eq!(attribute(&span, "correlation_id"), Some("order-42".into()));
    assert_eq!(attribute(&span, "outcome"), Some("processed".into()));
    assert_eq!(
        attribute(&span, "messaging.system"),
        Some("rabbitmq".into())
    );

    let span = delivery("refused").expect("span");
    assert_eq!(
        span.span_context.trace_id(),
        TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").expect("hex")
    );
    assert_eq!(attribute(&span, "outcome"), Some("permanent_failed".into()));

    let span = delivery("untraced").expect("span");
    assert_eq!(
        span.parent_span_id,
        SpanId::INVALID,
        "a root span of its own"
    );
    assert_ne!(
        span.span_context.trace_id(),
        TraceId::from_hex(trace).expect("hex")
    );
}

/// Decodes the card number as a number: a string there makes serde's error quote it.
struct Cards;

impl Handler for Cards {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        _: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct Card {
            number: u64,
        }
        let _: Card = msg.decode()?;
        Ok(())
    }
}

/// The same as a batch handler that does not say which message failed.
struct CardBatches;

impl BatchHandler for CardBatches {
    async fn handle_batch(
        &self,
        msgs: &[InboxMessage<'_>],
        tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        for msg in msgs {
            Cards.handle(msg, tx).await.map_err(BatchError::Batch)?;
        }
        Ok(())
    }
}

const SECRET: &str = "4111-SECRET-1111";

#[tokio::test]
async fn the_librarys_logs_never_print_a_body() {
    let (captured, _guard) = capture_logs("rabbit_inbox=trace");

    let env = TestEnv::new().await;
    let config = env.config("cards", env.topology("cards"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let running = env.start(config, Cards);
    let card = |id: &str, body: Vec<u8>| {
        let mut m = thing(id, 0);
        m.body = body;
        m
    };
    // Decoding fails on the secret, quoted by serde: permanent, parked.
    env.publish(
        &topology,
        &card(
            "typed",
            json!({ "number": SECRET }).to_string().into_bytes(),
        ),
    )
    .await;
    // Not JSON: parked as invalid.
    env.publish(
        &topology,
        &card("garbled", format!("{{number: {SECRET}").into_bytes()),
    )
    .await;
    // Same id, another body: a payload conflict.
    env.publish(
        &topology,
        &card(
            "typed",
            json!({ "number": SECRET, "x": 1 }).to_string().into_bytes(),
        ),
    )
    .await;
    // No id at all.
    let mut anonymous = card("x", json!({ "number": SECRET }).to_string().into_bytes());
    anonymous.message_id = None;
    env.publish(&topology, &anonymous).await;
    env.take_parked(&topology, 4).await;
    running.stop().await;

    let mut config = env.config("card-batches", env.topology("card-batches"));
    config.lanes = 1;
    let batches = config.topology.clone();
    env.declare(&config).await;
    // Published first, so that they arrive in one batch.
    for id in ["batch-1", "batch-2"] {
        env.publish(
            &batches,
            &card(id, json!({ "number": SECRET }).to_string().into_bytes()),
        )
        .await;
    }
    let running = env.start_batch(config, CardBatches);
    env.take_parked(&batches, 2).await;
    running.stop().await;

    let logs = captured.text();
    assert!(
        logs.contains("invalid message"),
        "the capture works: the invalid messages were logged:\n{logs}"
    );
    assert!(
        !logs.contains("SECRET"),
        "a body reached the log:\n{}",
        logs.lines()
            .filter(|l| l.contains("SECRET"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The record keeps the error for operators.
    let row = env.record("cards", "typed").await.expect("row");
    assert!(
        row.last_error_message
            .is_some_and(|m| m.contains("invalid type"))
    );
}

#[cfg(feature = "otel")]
#[tokio::test]
async fn an_enqueue_outside_a_handler_carries_the_current_spans_trace() {
    use opentelemetry::trace::TraceContextExt as _;
    use rabbit_inbox::{Outbox, OutboxMessage};
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let (_exporter, _guard) = spans_in_memory();

    let env = TestEnv::new().await;
    let outbox = Outbox::new(env.schema.clone());
    let mut conn = env.pool.acquire().await.expect("connection");
    // A web request's span, as an HTTP framework's tracing layer would open it.
    let request = tracing::info_span!("POST /orders");
    let (trace_id, span_id) = {
        let context = request.context();
        let span = context.span();
        let sc = span.span_context();
        (sc.trace_id().to_string(), sc.span_id().to_string())
    };
    {
        let _entered = request.enter();
        let m = OutboxMessage::json("OrderPlaced", "", "orders", &json!({}))
            .expect("json")
            .with_id("from-a-request");
        outbox.enqueue(&mut conn, &m).await.expect("enqueue");
    }
    // Outside any span, and with a context of its own, nothing is taken.
    let m = OutboxMessage::json("OrderPlaced", "", "orders", &json!({}))
        .expect("json")
        .with_id("untraced");
    outbox.enqueue(&mut conn, &m).await.expect("enqueue");
    let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    {
        let _entered = request.enter();
        let m = OutboxMessage::json("OrderPlaced", "", "orders", &json!({}))
            .expect("json")
            .with_id("own-context")
            .with_trace_context(own, None);
        outbox.enqueue(&mut conn, &m).await.expect("enqueue");
    }
    let stored = |id: &'static str| {
        let env = &env;
        async move {
            sqlx::query_scalar::<_, Option<String>>(sqlx::AssertSqlSafe(format!(
                "SELECT traceparent FROM \"{}\".outbox WHERE message_id = $1",
                env.schema
            )))
            .bind(id)
            .fetch_one(&env.pool)
            .await
            .expect("row")
        }
    };
    assert_eq!(
        stored("from-a-request").await,
        Some(format!("00-{trace_id}-{span_id}-01"))
    );
    assert_eq!(stored("untraced").await, None);
    assert_eq!(stored("own-context").await.as_deref(), Some(own));
}
