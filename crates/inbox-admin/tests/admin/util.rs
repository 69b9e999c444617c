//! A real inbox for the admin server to serve: an isolated schema and queues, filled by a real
//! consumer that processes `OrderPlaced` and permanently refuses `RefundRequested` (parked),
//! and the admin server on a free loopback port.

use std::{
    collections::hash_map::RandomState,
    hash::BuildHasher,
    net::SocketAddr,
    time::{Duration, SystemTime},
};

use inbox_admin::{AdminState, PrometheusHandle, Scope, ServeOptions, Tokens};
use inbox_ops::Operations;
use rabbit_inbox::{
    Consumer, ConsumerConfig, Handler, HandlerError, InboxMessage, RetryPolicy, SchemaName,
    Topology, broker::Broker, broker::OutgoingMessage, broker::QueueDepths,
};
use sqlx::{PgConnection, PgPool, postgres::PgPoolOptions};

pub(crate) const CONSUMER: &str = "orders";
pub(crate) const READ_TOKEN: &str = "9b1f3c7e5a2d4f6081c3e5a7b9d1f3e5";
pub(crate) const PAYLOAD_TOKEN: &str = "4c8e2a6f0b3d5e7a9c1e3f5b7d9a2c4e";
pub(crate) const ADMIN_TOKEN: &str = "e7d5c3b1a9f8e6d4c2b0a8f6e4d2c0b9";
pub(crate) const REFUSED_TYPE: &str = "RefundRequested";
pub(crate) const REFUSED_CODE: &str = "refund_unsupported";
pub(crate) const DEADLINE: Duration = Duration::from_secs(30);

pub(crate) fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

pub(crate) fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn retry() -> RetryPolicy {
    RetryPolicy::fixed(Duration::from_millis(200))
}

/// Processes everything but refunds, which it refuses permanently.
#[derive(Clone)]
struct OrderHandler;

impl Handler for OrderHandler {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        _tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        if msg.message_type() == REFUSED_TYPE {
            return Err(HandlerError::permanent(
                REFUSED_CODE,
                "refunds are not supported yet",
            ));
        }
        Ok(())
    }
}

pub(crate) fn message(id: &str, kind: &str) -> OutgoingMessage {
    OutgoingMessage {
        message_id: Some(id.to_owned()),
        kind: Some(kind.to_owned()),
        correlation_id: None,
        headers: serde_json::Map::new(),
        body: serde_json::json!({ "order": id }).to_string().into_bytes(),
    }
}

/// The fixture's tokens: `grafana` (read), `support` (read:payload), `alice` (admin).
pub(crate) fn tokens() -> Tokens {
    let mut tokens = Tokens::none();
    tokens
        .add(Scope::Read, "grafana", READ_TOKEN)
        .expect("read token");
    tokens
        .add(Scope::ReadPayload, "support", PAYLOAD_TOKEN)
        .expect("read:payload token");
    tokens
        .add(Scope::Admin, "alice", ADMIN_TOKEN)
        .expect("admin token");
    tokens
}

/// Polls `check` until it holds, failing the test after [`DEADLINE`].
pub(crate) async fn wait_for(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let start = tokio::time::Instant::now();
    while !check().await {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The inbox, its queues and the admin server. Drops the schema and queues when dropped.
pub(crate) struct Fixture {
    pub(crate) schema: SchemaName,
    pub(crate) topology: Topology,
    pub(crate) pool: PgPool,
    pub(crate) broker: Broker,
    /// `http://127.0.0.1:<port>`.
    pub(crate) base: String,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl Fixture {
    /// Three processed orders and two parked refunds (`refund-1`, `refund-2`), served with a
    /// read token `grafana`, a read:payload token `support` and an admin token `alice`, and
    /// `metrics` at `/metrics`.
    pub(crate) async fn new(metrics: Option<PrometheusHandle>) -> Self {
        let id = format!(
            "{:016x}",
            RandomState::new().hash_one((SystemTime::now(), std::process::id()))
        );
        let schema = SchemaName::new(format!("t_admin_{id}")).expect("schema name");
        let topology = Topology::new(format!("t-admin-{id}-orders"));
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(DEADLINE)
            .connect(&database_url())
            .await
            .expect("PostgreSQL is reachable");
        rabbit_inbox::migrate(&pool, &schema)
            .await
            .expect("migrations apply");
        let broker = Broker::connect(&amqp_url(), "inbox-admin test")
            .await
            .expect("RabbitMQ is reachable");
        let mut config = ConsumerConfig::new(CONSUMER, topology.clone());
        config.schema = schema.clone();
        config.retry = retry();
        config.max_batch_delay = Duration::from_millis(10);
        broker
            .declare(&topology, &config.retry)
            .await
            .expect("queues are declared");
        let mut fixture = Self {
            schema,
            topology,
            pool,
            broker,
            base: String::new(),
            server: None,
        };
        for (id, kind) in [
            ("order-1", "OrderPlaced"),
            ("order-2", "OrderPlaced"),
            ("refund-1", REFUSED_TYPE),
            ("order-3", "OrderPlaced"),
            ("refund-2", REFUSED_TYPE),
        ] {
            fixture
                .broker
                .publish("", &fixture.topology.queue, &message(id, kind))
                .await
                .expect("publish is confirmed");
        }
        let consumer = Consumer::new(amqp_url(), fixture.pool.clone(), config, OrderHandler)
            .expect("valid consumer");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(consumer.run(async move {
            let _ = stopped.await;
        }));
        wait_for("two parked refunds", async || {
            let d = fixture.depths().await;
            d.parking == 2 && d.work == 0
        })
        .await;
        let _ = stop.send(());
        tokio::time::timeout(DEADLINE, running)
            .await
            .expect("consumer stops")
            .expect("consumer task")
            .expect("consumer ran");

        let (base, server) = fixture.serve(tokens(), metrics, "127.0.0.1:0").await;
        fixture.base = base;
        fixture.server = Some(server);
        fixture
    }

    /// Starts another admin server over this inbox.
    pub(crate) async fn serve(
        &self,
        tokens: Tokens,
        metrics: Option<PrometheusHandle>,
        addr: &str,
    ) -> (String, tokio::task::JoinHandle<()>) {
        let (local, server) = self
            .serve_with(tokens, metrics, addr, ServeOptions::default())
            .await;
        (format!("http://{local}"), server)
    }

    /// The state of an admin server over this inbox.
    pub(crate) fn state(&self, tokens: Tokens, metrics: Option<PrometheusHandle>) -> AdminState {
        AdminState {
            ops: Operations::new(self.pool.clone(), self.schema.clone()),
            amqp_url: amqp_url(),
            queues: Some((self.topology.clone(), retry())),
            tokens,
            metrics,
        }
    }

    /// Starts another admin server over this inbox with `options`; returns its address.
    pub(crate) async fn serve_with(
        &self,
        tokens: Tokens,
        metrics: Option<PrometheusHandle>,
        addr: &str,
        options: ServeOptions,
    ) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("a free port");
        let local: SocketAddr = listener.local_addr().expect("address");
        let state = self.state(tokens, metrics);
        let server = tokio::spawn(async move {
            inbox_admin::serve(listener, state, options, std::future::pending())
                .await
                .expect("admin server runs");
        });
        (local, server)
    }

    pub(crate) async fn depths(&self) -> QueueDepths {
        self.broker
            .queue_depths(&self.topology, &retry())
            .await
            .expect("queue depths")
    }

    /// `(actor, action, message_id, reason)` of every audit row, oldest first.
    pub(crate) async fn audit(&self) -> Vec<(String, String, Option<String>, String)> {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT actor, action, message_id, reason FROM \"{}\".inbox_audit ORDER BY audit_id",
            self.schema.as_str()
        )))
        .fetch_all(&self.pool)
        .await
        .expect("audit rows")
    }

    /// Stops the server and removes the schema and queues.
    pub(crate) async fn cleanup(mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
        }
        if let Err(e) = self.broker.delete(&self.topology, &retry()).await {
            eprintln!("cleanup: deleting queues: {e}");
        }
        if let Err(e) = rabbit_inbox::schema::drop_schema(&self.pool, &self.schema).await {
            eprintln!("cleanup: dropping schema: {e}");
        }
    }
}
