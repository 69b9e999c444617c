//! `inbox-chaos`: the reliability runs of the example service against real servers, with their
//! verdicts: deterministic message streams ([`scenario`]), the chaos run ([`chaos`]: consumer
//! processes killed and restarted, broker connections dropped, PostgreSQL restarted) and the
//! soak run ([`soak`]); [`cluster`] adds node failures on a local RabbitMQ cluster to the
//! chaos run. `inboxctl chaos` and `inboxctl soak` are their command lines; the
//! argument structs are clap `Args` so the CLI flattens them as they are.
//!
//! The runs report to the operator, who reads the whole error chain, hence `anyhow`.

pub mod chaos;
pub mod cluster;
pub mod connect;
pub mod scenario;
pub mod soak;

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use rabbit_inbox::{Broker, ConsumerConfig, SchemaName};

/// Where PostgreSQL and RabbitMQ are.
#[derive(Args, Clone, Debug)]
pub struct Servers {
    /// PostgreSQL connection URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    /// RabbitMQ connection URL; for a cluster, every node's URL separated by commas (each
    /// connection takes the first that accepts, and fails over to the others).
    #[arg(
        long,
        env = "AMQP_URL",
        global = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// CA certificate file (PEM) trusted for `amqps://` brokers beside the system roots; also
    /// for the management API over HTTPS.
    #[arg(long, env = "AMQP_CA_FILE", global = true, value_name = "PEM")]
    pub amqp_ca_file: Option<PathBuf>,
    /// Client certificate file (PEM) for brokers that require one (mutual TLS); needs
    /// --amqp-client-key.
    #[arg(long, env = "AMQP_CLIENT_CERT", global = true, value_name = "PEM")]
    pub amqp_client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM, unencrypted).
    #[arg(long, env = "AMQP_CLIENT_KEY", global = true, value_name = "PEM")]
    pub amqp_client_key: Option<PathBuf>,
}

impl Servers {
    /// The servers with the TLS files of `--amqp-ca-file`, `--amqp-client-cert` and
    /// `--amqp-client-key` written into every entry of the AMQP URL list (as its `cacertfile`,
    /// `certfile` and `keyfile` query parameters, see [`rabbit_inbox::AmqpTls`]), so that every
    /// connection made from the URL, in this process or a child given it, uses them.
    pub fn with_amqp_tls(mut self) -> anyhow::Result<Self> {
        let tls = rabbit_inbox::AmqpTls {
            ca_file: self.amqp_ca_file.take(),
            client_cert: self.amqp_client_cert.take(),
            client_key: self.amqp_client_key.take(),
        };
        self.amqp_url = tls
            .apply_to(&self.amqp_url)
            .context("applying the AMQP TLS files to AMQP_URL")?;
        Ok(self)
    }
}

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
    rabbit_inbox::drop_schema(&pool, &config.schema).await?;
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
    let batch: Vec<(&str, &rabbit_inbox::OutgoingMessage, Option<&str>)> = messages
        .iter()
        .map(|m| (m.routing_key.as_str(), &m.message, m.expiration.as_deref()))
        .collect();
    broker
        .publish_batch_expiring(exchange, &batch)
        .await
        .with_context(|| format!("publishing to exchange {exchange}"))
}
