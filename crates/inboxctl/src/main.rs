//! `inboxctl`: operator CLI for rabbit-inbox. Thin glue over the library and the example
//! service; each subcommand lives in its own module.

mod bench;
mod chaos;
mod connect;
mod demo;
mod log_capture;
mod scenario;
mod soak;

use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use rabbit_inbox::{Broker, Consumer, SchemaName};

/// Operator CLI for rabbit-inbox: exactly-once RabbitMQ consumers on a PostgreSQL inbox.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    servers: Servers,
    #[command(subcommand)]
    command: Command,
}

/// Where PostgreSQL and RabbitMQ are.
#[derive(Args, Clone)]
pub(crate) struct Servers {
    /// PostgreSQL connection URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        global = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub(crate) database_url: String,
    /// RabbitMQ connection URL.
    #[arg(
        long,
        env = "AMQP_URL",
        global = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub(crate) amqp_url: String,
}

#[derive(Subcommand)]
enum Command {
    /// Create the inbox schema and tables (and the example service's tables).
    Migrate {
        /// PostgreSQL schema for the inbox and the example's tables.
        #[arg(long, env = "INBOX_SCHEMA", default_value = "order_service")]
        schema: String,
    },
    /// Run the example order-service consumer until SIGINT/SIGTERM, then drain and exit.
    Consume(ServiceArgs),
    /// Publish a stream of example messages (with duplicates, out-of-order payments and
    /// poison messages) to the example service's exchange.
    Publish {
        #[command(flatten)]
        service: ServiceArgs,
        /// Orders to generate (each with an OrderPlaced and two payments).
        #[arg(long, default_value_t = 10)]
        orders: usize,
        /// Seed for the stream (same seed, same messages and ids).
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Check the example service's effects against its inbox: no payment applied twice, none
    /// without a PROCESSED inbox row, paid totals consistent. Exit code 1 on a violation.
    Verify {
        /// PostgreSQL schema for the inbox and the example's tables.
        #[arg(long, env = "INBOX_SCHEMA", default_value = "order_service")]
        schema: String,
    },
    /// The main job: declare an isolated topology, publish a realistic stream, consume it with
    /// the example service (including a crash between commit and ack), and check from the
    /// database that every unique message's effect was applied exactly once.
    Demo(demo::DemoArgs),
    /// Measure throughput side by side: the broker ceiling, the textbook inbox recipe, and
    /// rabbit-inbox with a per-message and a batch handler, each checked for exactly-once.
    Bench(bench::BenchArgs),
    /// The reliability run: several consumer processes on one queue while consumers are
    /// SIGKILLed and restarted, broker connections are force-closed and PostgreSQL restarts;
    /// then zero lost and zero double-applied are checked from the database and the broker.
    /// Exit code 1 on a violation.
    Chaos(chaos::ChaosArgs),
    /// The example service at a steady rate for a set time: resident memory and latency
    /// percentiles per interval; exit code 1 if memory keeps growing or effects are not
    /// exactly-once.
    Soak(soak::SoakArgs),
}

/// Where the example service lives.
#[derive(Args, Clone)]
pub(crate) struct ServiceArgs {
    /// PostgreSQL schema for the inbox and the example's tables.
    #[arg(long, env = "INBOX_SCHEMA", default_value = "order_service")]
    pub(crate) schema: String,
    /// Work queue.
    #[arg(long, default_value = order_service::QUEUE)]
    pub(crate) queue: String,
    /// Exchange producers publish to.
    #[arg(long, default_value = order_service::EXCHANGE)]
    pub(crate) exchange: String,
    /// Deliveries per transaction, 1 = one transaction per message [default: the library's]
    #[arg(long)]
    pub(crate) batch_size: Option<usize>,
    /// Transactions in flight [default: the library's]
    #[arg(long)]
    pub(crate) lanes: Option<usize>,
    /// Unacked deliveries the broker may push [default: the library's]
    #[arg(long)]
    pub(crate) prefetch: Option<u16>,
}

impl ServiceArgs {
    pub(crate) fn config(&self) -> anyhow::Result<rabbit_inbox::ConsumerConfig> {
        let mut config =
            order_service::config(SchemaName::new(&self.schema)?, &self.queue, &self.exchange);
        config.batch_size = self.batch_size.unwrap_or(config.batch_size);
        config.lanes = self.lanes.unwrap_or(config.lanes);
        config.prefetch = self.prefetch.unwrap_or(config.prefetch);
        config.validate()?;
        Ok(config)
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let capture = init_logging(&cli.command);
    match run(cli, capture.as_ref()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            if let Some(capture) = &capture {
                eprintln!("log: {}", capture.path().display());
            }
            ExitCode::from(2)
        }
    }
}

/// Log output goes to stderr at `RUST_LOG` (default `warn`). The demo's terminal belongs to its
/// progress line and table: unless `RUST_LOG` is set, its log goes to a file and the warnings
/// are summarized at the end.
fn init_logging(command: &Command) -> Option<log_capture::LogCapture> {
    let filter =
        || tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    if matches!(command, Command::Demo(_)) && std::env::var_os("RUST_LOG").is_none() {
        let path = std::env::temp_dir().join("inboxctl-demo.log");
        match log_capture::LogCapture::install(&path, filter()) {
            Ok(capture) => return Some(capture),
            Err(e) => eprintln!("logging to stderr: {}", error_chain(&e)),
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter())
        .with_writer(std::io::stderr)
        .init();
    None
}

/// The error and its causes, skipping causes whose text the previous message already holds.
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

async fn run(cli: Cli, capture: Option<&log_capture::LogCapture>) -> anyhow::Result<ExitCode> {
    let servers = cli.servers;
    match cli.command {
        Command::Migrate { schema } => {
            let schema = SchemaName::new(schema)?;
            let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
            migrate_service(&pool, &schema).await?;
            println!("schema {schema} is up to date");
            Ok(ExitCode::SUCCESS)
        }
        Command::Consume(args) => {
            let config = args.config()?;
            let pool =
                connect::postgres(&servers.database_url, connect::pool_size(config.lanes)).await?;
            connect::rabbitmq(&servers.amqp_url).await?.close().await;
            migrate_service(&pool, &config.schema).await?;
            let handler = order_service::OrderHandler::new(config.schema.clone());
            let consumer = Consumer::new(servers.amqp_url.clone(), pool, config, handler)?;
            let stats = consumer.stats();
            eprintln!("consuming {}; Ctrl-C or SIGTERM to stop", args.queue);
            consumer.run(rabbit_inbox::shutdown_signal()).await?;
            let s = stats.snapshot();
            eprintln!(
                "stopped: received {}, processed {}, duplicates {}, retried {}, parked {}",
                s.received, s.processed, s.duplicates, s.retried, s.parked
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Publish {
            service,
            orders,
            seed,
        } => {
            let config = service.config()?;
            let broker = connect::rabbitmq(&servers.amqp_url).await?;
            broker
                .declare(&config.topology, &config.retry)
                .await
                .context("declaring the topology")?;
            let seed = seed.unwrap_or_else(rand::random);
            let stream = scenario::Scenario::generate(orders, seed);
            publish_all(&broker, &service.exchange, &stream.messages).await?;
            println!(
                "published {} messages ({} unique) for {} orders to exchange {} (seed {seed})",
                stream.messages.len(),
                stream.unique_keys,
                orders,
                service.exchange
            );
            broker.close().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify { schema } => {
            let schema = SchemaName::new(schema)?;
            let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
            let v = order_service::verify(&pool, &schema).await?;
            println!("{v:#?}");
            if v.exactly_once() {
                println!("exactly-once: OK");
                Ok(ExitCode::SUCCESS)
            } else {
                println!("exactly-once: VIOLATED");
                Ok(ExitCode::FAILURE)
            }
        }
        Command::Demo(args) => demo::run(&servers, args, capture).await,
        Command::Bench(args) => bench::run(&servers, args).await,
        Command::Chaos(args) => chaos::run(&servers, args).await,
        Command::Soak(args) => soak::run(&servers, args).await,
    }
}

/// The inbox and the example's tables in `schema`. Each takes the schema's lock, so any number
/// of instances may start at once.
async fn migrate_service(pool: &sqlx::PgPool, schema: &SchemaName) -> anyhow::Result<()> {
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
pub(crate) async fn clean_slate(
    servers: &Servers,
    config: &rabbit_inbox::ConsumerConfig,
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
pub(crate) async fn publish_all(
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
