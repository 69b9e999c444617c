//! Run with: `cargo run -p shipping-service`
//!
//! Consumes the `shipping-service` queue (bound to exchange `order-events` with `order.paid`)
//! until SIGINT or SIGTERM, with retention, recovery and the gauges' sampler beside it. `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`), `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`), `INBOX_SCHEMA` (default `shipping_service`).

use anyhow::Context;
use rabbit_inbox::SchemaName;

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
    let schema = SchemaName::new(
        std::env::var("INBOX_SCHEMA").unwrap_or_else(|_| "shipping_service".into()),
    )?;
    let pool = sqlx::PgPool::connect(&database_url)
        .await
        .with_context(|| format!("cannot reach PostgreSQL at {database_url}"))?;
    shipping_service::migrate(&pool, &schema).await?;
    let config = shipping_service::config(
        schema.clone(),
        shipping_service::QUEUE,
        shipping_service::EVENTS_EXCHANGE,
    );
    // Its handler writes no outbox rows: no relay. The inbox's migrations run at start.
    inbox_ops::Service::builder(amqp_url, pool, config)
        .handler(shipping_service::ShippingHandler::new(schema))
        .without_relay()
        .build()?
        .run(rabbit_inbox::shutdown_signal())
        .await?;
    Ok(())
}
