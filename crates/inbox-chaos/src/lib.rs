//! `inbox-chaos`: the reliability runs of the example service against real servers, with their
//! verdicts: deterministic message streams ([`scenario`]), the chaos run ([`chaos`]: consumer
//! processes killed and restarted, broker connections dropped, PostgreSQL restarted) and the
//! soak run ([`soak`]); [`cluster`] adds node failures on a local RabbitMQ cluster to the
//! chaos run. `inbox-lab chaos` and `inbox-lab soak` are their command lines; the
//! argument structs are clap `Args` so the CLI flattens them as they are.
//!
//! The runs report to the operator, who reads the whole error chain, hence `anyhow`.

pub mod chaos;
pub mod cluster;
pub mod scenario;
pub mod soak;

use anyhow::Context;
use inboxctl::{Servers, connect};
use rabbit_inbox::{ConsumerConfig, SchemaName, broker::Broker};

/// The inbox and the example's tables in `schema`. Each takes the schema's lock, so any number
/// of instances may start at once.
pub async fn migrate_service(pool: &sqlx::PgPool, schema: &SchemaName) -> anyhow::Result<()> {
    rabbit_inbox::migrate(pool, schema)
        .await
        .with_context(|| format!("migrating the inbox in schema {schema}"))?;
    order_service::migrate(pool, schema)
        .await
        .with_context(|| format!("creating the example's tables in schema {schema}"))?;
    Ok(())
}

/// Connects to both servers and gives a run of the example service a clean slate: its schema
/// (inbox and example tables) and its queues are recreated, so the figures describe this run
/// only.
pub async fn clean_slate(
    servers: &Servers,
    config: &ConsumerConfig,
) -> anyhow::Result<(sqlx::PgPool, Broker)> {
    let pool = connect::postgres(&servers.database_url, connect::pool_size(config.lanes)).await?;
    rabbit_inbox::schema::drop_schema(&pool, &config.schema).await?;
    migrate_service(&pool, &config.schema).await?;
    // A connection of its own for the deletes: the declarations below must not depend on how
    // the broker took the deletion of queues an earlier run may not have left.
    let deleting = connect::rabbitmq(&servers.amqp_url).await?;
    deleting
        .delete(&config.topology, &config.retry)
        .await
        .context("deleting the previous run's queues")?;
    deleting.close().await;
    let broker = connect::rabbitmq(&servers.amqp_url).await?;
    broker
        .declare(&config.topology, &config.retry)
        .await
        .context("declaring the topology")?;
    Ok((pool, broker))
}

/// Publishes a generated stream in order, with broker confirms.
pub async fn publish_all(
    broker: &Broker,
    exchange: &str,
    messages: &[scenario::Published],
) -> anyhow::Result<()> {
    let batch: Vec<(&str, &rabbit_inbox::broker::OutgoingMessage, Option<&str>)> = messages
        .iter()
        .map(|m| (m.routing_key.as_str(), &m.message, m.expiration.as_deref()))
        .collect();
    broker
        .publish_batch_expiring(exchange, &batch)
        .await
        .with_context(|| format!("publishing to exchange {exchange}"))
}
