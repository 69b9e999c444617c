//! `inbox-lab`: the example services and the runs that prove rabbit-inbox against the local
//! servers (demo, benchmarks, chaos, soak). Not published, and the only binary built with the
//! `fault-injection` feature (the demo drops a broker connection between commit and ack).
//! Operators use `inboxctl`; this shares its connection flags.

mod bench;
mod bench_ledger;
mod bench_retention;
mod demo;
mod log_capture;

use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use inbox_chaos::{chaos, migrate_service, scenario, soak};
use inboxctl::{Servers, connect, error_chain, telemetry, when};
use rabbit_inbox::{Consumer, Relay, RelayConfig, Runner, SchemaName};

/// The rabbit-inbox lab: the example services, the demo, benchmarks and reliability runs
/// against the local PostgreSQL and RabbitMQ.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    servers: Servers,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the inbox and the example service's tables in a schema.
    Migrate {
        /// PostgreSQL schema for the inbox and the example's tables.
        #[arg(long, env = "INBOX_SCHEMA", default_value = "order_service")]
        schema: String,
    },
    /// Run the example order-service consumer until SIGINT/SIGTERM, then drain and exit. It
    /// emits `OrderPaid` through its outbox; `--relay` also publishes the outbox in this process.
    /// Optionally serves Prometheus metrics and exports delivery spans over OTLP.
    Consume(ConsumeArgs),
    /// Run the example shipping-service consumer (downstream of order-service's `OrderPaid`
    /// events, with its own inbox) until SIGINT/SIGTERM.
    ConsumeShipping(ShippingArgs),
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
    /// rabbit-inbox with a per-message and a batch handler, each checked for exactly-once;
    /// `--sustained`: the highest publish rate each handler keeps up with for a set time.
    Bench(bench::BenchArgs),
    /// The reliability run: several consumer processes on one queue while consumers are
    /// SIGKILLed and restarted, broker connections are force-closed and PostgreSQL restarts;
    /// then zero lost and zero double-applied are checked from the database and the broker.
    /// `--ordered`: the consumers keep each order's messages in sequence, and the run checks
    /// that every order's steps applied once each, in order. Exit code 1 on a violation.
    Chaos(chaos::ChaosArgs),
    /// The example service at a steady rate for a set time: resident memory and latency
    /// percentiles per interval; exit code 1 if memory keeps growing or effects are not
    /// exactly-once.
    Soak(soak::SoakArgs),
    /// Measure retention at scale: fill an inbox in a scratch schema (10 million rows by
    /// default), run a consumer-like claim load alone, then beside `cleanup`; print the delete
    /// rate, the load's latency and throughput during cleanup against the load alone, and the
    /// plain LIMIT delete loop's per-batch cost for comparison.
    #[command(after_help = "Example:\n  inbox-lab bench-retention --rows 10000000 --batch 5000")]
    BenchRetention(bench_retention::BenchRetentionArgs),
    /// Measure retention at 100 million rows while a transaction pins the xmin horizon: today's
    /// ledger (retention deletes rows) against one partitioned by generation (retention drops
    /// a partition), each under the same claim load; rate, p99, rows removed, dead tuples and
    /// size before, during and after a snapshot held for ten minutes.
    #[command(after_help = "Example:\n  inbox-lab bench-ledger --rows 100000000 --pin-secs 600")]
    BenchLedger(bench_ledger::BenchLedgerArgs),
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
    /// Retry tier delays, comma-separated [default: the example's 1s,2s,5s,10s]; five attempts
    /// in all, the last tier repeating. Every instance and tool on the queue must agree.
    #[arg(long, value_parser = when::delays)]
    pub(crate) retry_delays: Option<when::Delays>,
    #[command(flatten)]
    pub(crate) queue_type: QueueTypeArgs,
}

/// Classic or quorum queues, for `consume` and `consume-shipping`.
#[derive(Args, Clone)]
pub(crate) struct QueueTypeArgs {
    /// Declare quorum queues (replicated across the nodes of a cluster) instead of classic
    /// ones. Every instance and tool on the queue must agree.
    #[arg(long)]
    pub(crate) quorum: bool,
    /// `x-delivery-limit` of the quorum work queue; must exceed the retry budget plus the
    /// prefetch [default with --quorum: max attempts + prefetch + 100]
    #[arg(long, requires = "quorum")]
    pub(crate) delivery_limit: Option<u32>,
}

impl QueueTypeArgs {
    fn apply(&self, config: &mut rabbit_inbox::ConsumerConfig) {
        if self.quorum {
            config.use_quorum_queues(self.delivery_limit);
        }
    }
}

/// `inbox-lab consume`.
#[derive(Args, Clone)]
pub(crate) struct ConsumeArgs {
    #[command(flatten)]
    service: ServiceArgs,
    /// Exchange the service emits its events to through its outbox (declared at start).
    #[arg(long, default_value = order_service::EVENTS_EXCHANGE)]
    events_exchange: String,
    /// Also run the outbox relay in this process.
    #[arg(long)]
    relay: bool,
    /// Process each order's messages in their `x-sequence` order (`order_service::ordering`),
    /// and run the release task that publishes held messages again in their turn. Every
    /// instance on the queue must agree.
    #[arg(long)]
    ordered: bool,
    #[command(flatten)]
    observe: telemetry::ObserveArgs,
}

/// `inbox-lab consume-shipping`.
#[derive(Args, Clone)]
pub(crate) struct ShippingArgs {
    /// PostgreSQL schema for the shipping inbox and its table.
    #[arg(long, default_value = "shipping_service")]
    schema: String,
    /// Work queue.
    #[arg(long, default_value = shipping_service::QUEUE)]
    queue: String,
    /// Exchange order-service emits to.
    #[arg(long, default_value = shipping_service::EVENTS_EXCHANGE)]
    exchange: String,
    #[command(flatten)]
    queue_type: QueueTypeArgs,
}

impl ServiceArgs {
    pub(crate) fn config(&self) -> anyhow::Result<rabbit_inbox::ConsumerConfig> {
        let mut config =
            order_service::config(SchemaName::new(&self.schema)?, &self.queue, &self.exchange);
        config.batch_size = self.batch_size.unwrap_or(config.batch_size);
        config.lanes = self.lanes.unwrap_or(config.lanes);
        config.prefetch = self.prefetch.unwrap_or(config.prefetch);
        if let Some(delays) = &self.retry_delays {
            config.retry.delays = delays.0.clone();
        }
        self.queue_type.apply(&mut config);
        config.validate()?;
        Ok(config)
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let (capture, spans) = match init_logging(&cli.command) {
        Ok(logging) => logging,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            return ExitCode::from(2);
        }
    };
    let code = match run(cli, capture.as_ref()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            if let Some(capture) = &capture {
                eprintln!("log: {}", capture.path().display());
            }
            ExitCode::from(2)
        }
    };
    // Flushes the spans still buffered.
    drop(spans);
    code
}

/// Log output goes to stderr at `RUST_LOG` (default `warn`). The demo's terminal belongs to its
/// progress line and table: unless `RUST_LOG` is set, its log goes to a file and the warnings
/// are summarized at the end. `consume --otlp-endpoint` adds the span export.
fn init_logging(
    command: &Command,
) -> anyhow::Result<(
    Option<log_capture::LogCapture>,
    Option<telemetry::SpanExport>,
)> {
    use tracing_subscriber::{Layer as _, layer::SubscriberExt as _, util::SubscriberInitExt as _};
    let filter =
        || tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    if matches!(command, Command::Demo(_)) && std::env::var_os("RUST_LOG").is_none() {
        let path = std::env::temp_dir().join("inbox-lab-demo.log");
        match log_capture::LogCapture::install(&path, filter()) {
            Ok(capture) => return Ok((Some(capture), None)),
            Err(e) => eprintln!("logging to stderr: {}", error_chain(&e)),
        }
    }
    let terminal = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter());
    let endpoint = match command {
        Command::Consume(args) => args
            .observe
            .otlp_endpoint
            .as_deref()
            .map(|e| (e, &args.observe.otlp_tls)),
        _ => None,
    };
    let (spans, export) = match endpoint {
        Some((endpoint, tls)) => {
            let (layer, export) = telemetry::SpanExport::start(endpoint, tls)?;
            (Some(layer), Some(export))
        }
        None => (None, None),
    };
    tracing_subscriber::registry()
        .with(terminal)
        .with(spans)
        .init();
    Ok((None, export))
}

async fn run(cli: Cli, capture: Option<&log_capture::LogCapture>) -> anyhow::Result<ExitCode> {
    let servers = cli.servers.with_amqp_tls()?;
    match cli.command {
        Command::Migrate { schema } => {
            let schema = SchemaName::new(schema)?;
            let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
            migrate_service(&pool, &schema).await?;
            println!("schema {schema} is up to date");
            Ok(ExitCode::SUCCESS)
        }
        Command::Consume(args) => consume(&servers, args).await,
        Command::ConsumeShipping(args) => {
            let schema = SchemaName::new(&args.schema)?;
            let mut config = shipping_service::config(schema.clone(), &args.queue, &args.exchange);
            args.queue_type.apply(&mut config);
            config.validate()?;
            let pool =
                connect::postgres(&servers.database_url, connect::pool_size(config.lanes)).await?;
            connect::rabbitmq(&servers.amqp_url).await?.close().await;
            rabbit_inbox::migrate(&pool, &schema).await?;
            shipping_service::migrate(&pool, &schema).await?;
            let handler = shipping_service::ShippingHandler::new(schema);
            let consumer = Consumer::new(servers.amqp_url.clone(), pool, config, handler)?;
            let stats = consumer.stats();
            eprintln!("consuming {}; Ctrl-C or SIGTERM to stop", args.queue);
            consumer.run(rabbit_inbox::shutdown_signal()).await?;
            let s = stats.snapshot();
            eprintln!(
                "stopped: received {}, processed {}, duplicates {}, parked {}",
                s.received, s.processed, s.duplicates, s.parked
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
            inbox_chaos::publish_all(&broker, &service.exchange, &stream.messages).await?;
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
        Command::Chaos(args) => {
            // The consumers the run kills are this binary's `consume`.
            let consumer = chaos::ConsumerCommand {
                program: std::env::current_exe().context("locating the inbox-lab binary")?,
                args: vec!["consume".into(), "--relay".into()],
            };
            chaos::run(&servers, args, &consumer).await
        }
        Command::Soak(args) => soak::run(&servers, args).await,
        Command::BenchRetention(args) => bench_retention::run_bench(&servers, args).await,
        Command::BenchLedger(args) => bench_ledger::run_bench(&servers, args).await,
    }
}

/// `inbox-lab consume`: the example consumer with recovery (and, ordered, the release task)
/// beside it, until SIGINT/SIGTERM.
async fn consume(servers: &Servers, args: ConsumeArgs) -> anyhow::Result<ExitCode> {
    let mut config = args.service.config()?;
    if args.ordered {
        config.ordering = Some(order_service::ordering());
    }
    args.observe.configure(&mut config);
    config.validate()?;
    args.observe.install_metrics()?;
    let pool = connect::postgres(&servers.database_url, connect::pool_size(config.lanes)).await?;
    let broker = connect::rabbitmq(&servers.amqp_url).await?;
    broker
        .declare_exchange(&args.events_exchange)
        .await
        .with_context(|| format!("declaring exchange {}", args.events_exchange))?;
    broker.close().await;
    migrate_service(&pool, &config.schema).await?;
    let handler = order_service::OrderHandler::new(config.schema.clone())
        .with_events_exchange(&args.events_exchange);
    let sampler = args.observe.sampler(&pool, &config)?;
    // What a service runs beside its consumer: a retry copy the broker lost (a node
    // failure can strand a quorum tier's expired messages) is republished.
    let recovery = inbox_ops::RecoveryTask::new(
        pool.clone(),
        servers.amqp_url.clone(),
        &config,
        inbox_ops::RecoveryConfig::default(),
    )?;
    // An ordered consumer's held messages run only once this task publishes them.
    let release =
        inbox_ops::ReleaseTask::for_consumer(pool.clone(), servers.amqp_url.clone(), &config);
    let schema = config.schema.clone();
    let consumer = Consumer::new(servers.amqp_url.clone(), pool.clone(), config, handler)?;
    let stats = consumer.stats();
    let mut service = Runner::new()
        .task("consumer", |stop| consumer.run(stop))
        .task("recovery", |stop| recovery.run(stop));
    if let Some(release) = release {
        service = service.task("release", |stop| release.run(stop));
    }
    if args.relay {
        let relay = Relay::new(servers.amqp_url.clone(), pool, RelayConfig::new(schema))?;
        service = service.task("outbox relay", |stop| relay.run(stop));
    }
    if let Some(sampler) = sampler {
        service = service.task("sampler", |stop| sampler.run(stop));
    }
    eprintln!(
        "consuming {}{}; Ctrl-C or SIGTERM to stop",
        args.service.queue,
        if args.ordered {
            " in each order's sequence"
        } else {
            ""
        }
    );
    service.run(rabbit_inbox::shutdown_signal()).await?;
    let s = stats.snapshot();
    eprintln!(
        "stopped: received {}, processed {}, duplicates {}, retried {}, parked {}",
        s.received, s.processed, s.duplicates, s.retried, s.parked
    );
    Ok(ExitCode::SUCCESS)
}
