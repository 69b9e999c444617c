//! A minimal service built on rabbit-inbox: it consumes `DepositMade` messages and records each
//! deposit in its `deposits` table exactly once, however often RabbitMQ delivers it.
//!
//! One run checks that end to end. It creates its own schema and queues (named after the
//! process id), publishes a few deposits, two of them twice under the same message id, consumes
//! until every delivery is settled, then verifies from the database that each deposit was
//! recorded once. It removes its schema and queues on every path and exits non-zero on any
//! violation.
//!
//! Like a service, it also serves a health endpoint (axum) and records the library's metrics
//! (Prometheus); the run checks that both answer.
//!
//! `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`), `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`); `RUST_LOG=info` shows the library's logs.

use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use rabbit_inbox::broker::{Broker, OutgoingMessage};
use rabbit_inbox::stats::StatsSnapshot;
use rabbit_inbox::{
    Consumer, ConsumerConfig, ConsumerError, Handler, HandlerError, InboxMessage, RetryPolicy,
    SchemaName, Topology,
};
use serde::{Deserialize, Serialize};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

/// The consumer name: the second half of each inbox key `(message_id, consumer_name)`.
const CONSUMER_NAME: &str = "standalone";
/// How long the consumer may take to settle every delivery.
const DEADLINE: Duration = Duration::from_secs(30);
/// The deposits: `(message id, account, amount in cents)`.
const DEPOSITS: [(&str, &str, i64); 5] = [
    ("d-1", "alice", 1_000),
    ("d-2", "bob", 250),
    ("d-3", "alice", 75),
    ("d-4", "carol", 4_200),
    ("d-5", "bob", 30),
];
/// What the producer publishes, as indexes into [`DEPOSITS`]: `d-1` again right behind itself
/// (likely in the same batch), `d-3` again at the end (after its effect committed).
const DELIVERIES: [usize; 7] = [0, 0, 1, 2, 3, 4, 2];

/// The message body; its AMQP `type` is `DepositMade`.
#[derive(Serialize, Deserialize)]
struct DepositMade {
    account: String,
    amount: i64,
}

/// The business logic: one `deposits` row per deposit, in the service's schema.
struct Deposits {
    schema: SchemaName,
}

impl Handler for Deposits {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        if msg.message_type() != "DepositMade" {
            return Err(HandlerError::permanent(
                "unknown_message_type",
                format!("{CONSUMER_NAME} does not handle {:?}", msg.message_type()),
            ));
        }
        // A body that does not match is a permanent error: recorded and parked, never retried.
        let deposit: DepositMade = msg.decode()?;
        // Through `tx`, the transaction that claimed the message's inbox row: the deposit
        // commits together with that row or not at all, and a duplicate never gets here.
        let schema = &self.schema;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{schema}\".deposits (message_id, account, amount_cents) \
             VALUES ($1, $2, $3)"
        )))
        .bind(msg.message_id())
        .bind(&deposit.account)
        .bind(deposit.amount)
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    // The library's counters and histograms; a service would also serve them
    // (`PrometheusBuilder::with_http_listener`), this run only reads them back.
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    let health = serve_health().await?;
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());

    // Names of this run only, so concurrent runs (and other services) are left alone.
    let id = std::process::id();
    let mut config = ConsumerConfig::new(CONSUMER_NAME, Topology::new(format!("standalone-{id}")));
    config.schema = SchemaName::new(format!("standalone_{id}"))?;
    // One retry tier, so this run declares (and deletes) only the work queue,
    // `<queue>.retry.1s` and `<queue>.parking-lot`.
    config.retry = RetryPolicy::fixed(Duration::from_secs(1));
    println!("schema {}, queue {}", config.schema, config.topology.queue);

    // Nothing exists yet, so a failure here leaves nothing behind.
    let pool = PgPool::connect(&database_url)
        .await
        .with_context(|| format!("cannot reach PostgreSQL at {database_url}"))?;
    let outcome = run(&pool, &amqp_url, &config).await;
    let cleaned = cleanup(&pool, &amqp_url, &config).await;
    pool.close().await;
    if let (Err(_), Err(c)) = (&outcome, &cleaned) {
        // The run's error is the one returned; this one must not go unreported.
        eprintln!("cleanup failed as well: {c:#}");
    }
    outcome.and(cleaned)?;

    let rendered = metrics.render();
    if !rendered.contains("rabbit_inbox_duplicates_total") {
        bail!("the library recorded no rabbit_inbox_duplicates_total counter:\n{rendered}");
    }
    let answer = get_health(health).await?;
    if !answer.starts_with("HTTP/1.1 200") {
        bail!("the health endpoint answered {answer:?}");
    }
    tracing::info!(%health, "metrics recorded and health endpoint answering");
    println!("ok: metrics recorded, health endpoint at {health} answers 200");
    Ok(())
}

/// Serves `GET /health` on a free local port, in the background, and returns its address.
async fn serve_health() -> anyhow::Result<std::net::SocketAddr> {
    let app = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the health endpoint")?;
    let address = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the health endpoint stopped");
        }
    });
    Ok(address)
}

/// The status line of `GET /health`, over a plain socket (no HTTP client needed).
async fn get_health(address: std::net::SocketAddr) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
        let mut stream = std::net::TcpStream::connect(address)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer)?;
        Ok(answer.lines().next().unwrap_or_default().to_owned())
    })
    .await?
    .with_context(|| format!("asking the health endpoint at {address}"))
}

/// Sets up, publishes, consumes and verifies; the caller cleans up whatever happens here.
async fn run(pool: &PgPool, amqp_url: &str, config: &ConsumerConfig) -> anyhow::Result<()> {
    let schema = &config.schema;
    rabbit_inbox::migrate(pool, schema)
        .await
        .context("migrating the inbox")?;
    // No unique constraint on message_id: the inbox is what prevents a second row, and a
    // deposit recorded twice must show up in the check below rather than fail on insert. A
    // violated CHECK fails the handler's statement, which the consumer parks as permanent.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".deposits (
             deposit_id   BIGSERIAL PRIMARY KEY,
             message_id   TEXT NOT NULL,
             account      TEXT NOT NULL,
             amount_cents BIGINT NOT NULL CHECK (amount_cents > 0)
         )"
    )))
    .execute(pool)
    .await
    .context("creating the deposits table")?;

    // The consumer declares the same topology when it connects; declaring it first lets the
    // messages wait in the queue until it does.
    let broker = Broker::connect(amqp_url, "standalone producer").await?;
    let published = publish(&broker, config).await;
    broker.close().await;
    published?;
    println!(
        "published {} deliveries of {} deposits",
        DELIVERIES.len(),
        DEPOSITS.len()
    );

    let stats = consume(pool, amqp_url, config).await?;
    println!(
        "consumer: {} processed, {} duplicates acked, {} retried, {} parked",
        stats.processed, stats.duplicates, stats.retried, stats.parked
    );
    verify(pool, schema).await
}

async fn publish(broker: &Broker, config: &ConsumerConfig) -> anyhow::Result<()> {
    broker.declare(&config.topology, &config.retry).await?;
    for (id, account, amount) in DELIVERIES.map(|i| DEPOSITS[i]) {
        let deposit = DepositMade {
            account: account.into(),
            amount,
        };
        let message = OutgoingMessage {
            message_id: Some(id.into()),
            kind: Some("DepositMade".into()),
            body: serde_json::to_vec(&deposit)?,
            ..OutgoingMessage::default()
        };
        // Straight to the work queue through the default exchange; waits for the confirm.
        broker.publish("", &config.topology.queue, &message).await?;
    }
    Ok(())
}

/// Runs the consumer until every delivery is settled, and stops it on every path: left
/// running, it would declare its queues again after the cleanup deleted them.
async fn consume(
    pool: &PgPool,
    amqp_url: &str,
    config: &ConsumerConfig,
) -> anyhow::Result<StatsSnapshot> {
    let handler = Deposits {
        schema: config.schema.clone(),
    };
    let consumer = Consumer::new(amqp_url, pool.clone(), config.clone(), handler)?;
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut task = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    // Each delivery ends as a committed effect or as a duplicate acked without running it.
    let settled = async {
        let expected = DELIVERIES.len() as u64;
        loop {
            let s = stats.snapshot();
            if s.processed + s.duplicates >= expected {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let waited = tokio::select! {
        () = settled => Ok(()),
        () = tokio::time::sleep(DEADLINE) => Err(anyhow!("deliveries not settled within {DEADLINE:?}")),
        () = rabbit_inbox::shutdown_signal() => Err(anyhow!("interrupted")),
        // Only a fatal error (such as a topology the broker refuses) ends it unasked.
        ended = &mut task => {
            joined(ended)?;
            bail!("the consumer stopped by itself");
        }
    };
    // The consumer finishes and settles the deliveries in hand before `run` returns.
    let _ = stop.send(());
    joined(task.await)?;
    waited?;
    Ok(stats.snapshot())
}

fn joined(ended: Result<Result<(), ConsumerError>, tokio::task::JoinError>) -> anyhow::Result<()> {
    ended
        .context("the consumer task panicked")?
        .context("the consumer failed")
}

/// Counted from the database, not from the consumer's counters: per deposit, its rows in
/// `deposits` and its inbox row.
async fn verify(pool: &PgPool, schema: &SchemaName) -> anyhow::Result<()> {
    let ids = DEPOSITS.map(|d| d.0);
    let rows: Vec<(String, i64, Option<String>, Option<i32>)> =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT m.id,
                    (SELECT count(*) FROM \"{schema}\".deposits d WHERE d.message_id = m.id),
                    i.status, i.delivery_count
             FROM unnest($1::text[]) WITH ORDINALITY AS m(id, n)
             LEFT JOIN \"{schema}\".message_inbox i
               ON i.consumer_name = $2 AND i.message_id = m.id
             ORDER BY m.n"
        )))
        .bind(&ids[..])
        .bind(CONSUMER_NAME)
        .fetch_all(pool)
        .await?;
    // Also catches a row under an id that was never published.
    let total: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{schema}\".deposits"
    )))
    .fetch_one(pool)
    .await?;

    let mut violations = Vec::new();
    for (n, (id, effects, status, deliveries)) in rows.iter().enumerate() {
        let status = status.as_deref().unwrap_or("no inbox row");
        let deliveries = deliveries.unwrap_or(0);
        let published = DELIVERIES.iter().filter(|&&i| i == n).count();
        println!(
            "  {id}: {effects} row(s), inbox {status}, {deliveries} of {published} deliveries seen"
        );
        if *effects != 1 || status != "PROCESSED" {
            violations.push(format!("{id}: {effects} row(s), inbox {status}"));
        }
        // Each copy reached the inbox (so the duplicates were suppressed, not lost on the way).
        if usize::try_from(deliveries).unwrap_or(0) < published {
            violations.push(format!("{id}: {deliveries} of {published} deliveries seen"));
        }
    }
    if total != rows.len() as i64 {
        violations.push(format!("{total} deposit rows for {} deposits", rows.len()));
    }
    if !violations.is_empty() {
        bail!("exactly-once violated: {}", violations.join("; "));
    }
    println!("ok: each of {total} deposits recorded exactly once; duplicates suppressed");
    Ok(())
}

/// Deletes the queues (from a fresh connection: a failed operation may have closed the
/// previous channel), then drops the schema. Both are attempted; deleting what does not exist
/// is no error, so this is safe after a failure at any step.
async fn cleanup(pool: &PgPool, amqp_url: &str, config: &ConsumerConfig) -> anyhow::Result<()> {
    let queues = async {
        let broker = Broker::connect(amqp_url, "standalone cleanup").await?;
        let deleted = broker.delete(&config.topology, &config.retry).await;
        broker.close().await;
        deleted
    }
    .await
    .with_context(|| format!("deleting queues {}*", config.topology.queue));
    let schema = rabbit_inbox::schema::drop_schema(pool, &config.schema)
        .await
        .with_context(|| format!("dropping schema {}", config.schema));
    if let (Err(q), Err(_)) = (&queues, &schema) {
        eprintln!("{q:#}"); // the schema's error is the one returned
    }
    queues.and(schema)?;
    println!(
        "removed schema {} and queues {}*",
        config.schema, config.topology.queue
    );
    Ok(())
}
