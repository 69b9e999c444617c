//! The connection flags of every command: where PostgreSQL and RabbitMQ are, and the TLS files
//! of the broker connections.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

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
    /// `certfile` and `keyfile` query parameters, see [`rabbit_inbox::broker::AmqpTls`]), so that every
    /// connection made from the URL, in this process or a child given it, uses them.
    pub fn with_amqp_tls(mut self) -> anyhow::Result<Self> {
        let tls = rabbit_inbox::broker::AmqpTls {
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
