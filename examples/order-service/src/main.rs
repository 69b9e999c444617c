//! Run with: `cargo run -p order-service`
//!
//! Consumes the `order-service` queue until SIGINT or SIGTERM, and relays its outbox
//! (`OrderPaid` events to exchange `order-events`) in the same process unless
//! `OUTBOX_RELAY=off`; retention, recovery and the gauges' sampler run beside it. `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`),
//! `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), `INBOX_SCHEMA` (default
//! `order_service`).

use anyhow::Context;
use rabbit_inbox::{SchemaName, broker::Broker};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let schema =
        SchemaName::new(std::env::var("INBOX_SCHEMA").unwrap_or_else(|_| "order_service".into()))?;
    let pool = sqlx::PgPool::connect(&database_url)
        .await
        .with_context(|| format!("cannot reach PostgreSQL at {database_url}"))?;
    order_service::migrate(&pool, &schema).await?;
    let config = order_service::config(
        schema.clone(),
        order_service::QUEUE,
        order_service::EXCHANGE,
    );
    let broker = Broker::connect(&amqp_url, "order-service setup").await?;
    broker
        .declare_exchange(order_service::EVENTS_EXCHANGE)
        .await?;
    broker.close().await;
    // The inbox's migrations run when the service starts.
    let mut service = inbox_ops::Service::builder(amqp_url, pool, config)
        .handler(order_service::OrderHandler::new(schema));
    if std::env::var("OUTBOX_RELAY").as_deref() == Ok("off") {
        service = service.without_relay();
    }
    service
        .build()?
        .run(rabbit_inbox::shutdown_signal())
        .await?;
    Ok(())
}
