//! `inbox-lab chaos`: several consumer processes on one queue while consumers are SIGKILLed and
//! restarted, broker connections are force-closed and PostgreSQL is restarted; then
//! exactly-once and "nothing lost" are checked from the database and the broker.

use std::{
    collections::{HashMap, HashSet},
    ffi::OsString,
    path::PathBuf,
    process::{ExitCode, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use nix::{sys::signal::Signal, unistd::Pid};
use rabbit_inbox::{InboxStatus, SchemaName, status::parking_headers, store::InboxStore};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use sqlx::{AssertSqlSafe, Row};
use tokio::process::{Child, Command};

use crate::{
    Servers, clean_slate,
    cluster::{Cluster, ClusterArgs, NodeFault, spawn_publisher},
    connect, publish_all,
    scenario::{EXPIRATION_MS, Hostile, HostileMessage, Scenario},
};

mod ordered;

/// How the consumer's log (its stderr) begins the line that says it has started up.
const STARTED_UP: &str = "consuming ";

/// The consumer process the run starts, kills and restarts: `program` with `args`, to which
/// the run appends `--schema`, `--queue`, `--exchange` and `--events-exchange` (and
/// `--batch-size` when given, `--quorum` on a cluster, `--ordered` in the ordered run), with
/// `DATABASE_URL` and `AMQP_URL` (on a cluster, every node's URL, comma-separated) in its
/// environment. It must consume until SIGTERM, then drain and exit 0, exit with 2 when a
/// server is unreachable at start-up, and write a line beginning with `consuming ` to stderr
/// once it has started up. It emits `OrderPaid` to the events exchange through its outbox and
/// relays the outbox itself (`inbox-lab consume --relay`), so a kill also kills a relay
/// mid-flight.
#[derive(Clone, Debug)]
pub struct ConsumerCommand {
    /// The executable.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
}

/// Messages per order in the generated stream, about (placed, two payments, some duplicates).
const MESSAGES_PER_ORDER: f64 = 3.3;

/// The chaos run's settings.
#[derive(Args, Debug)]
pub struct ChaosArgs {
    /// Messages to publish, at least (the stream is made of orders with payments, duplicates,
    /// out-of-order payments and poison messages).
    #[arg(long, default_value_t = 100_000)]
    messages: usize,
    /// Consumer processes on the queue.
    #[arg(long, default_value_t = 4)]
    consumers: usize,
    /// Consumers to SIGKILL (and restart) during the run, spread over its progress.
    #[arg(long, default_value_t = 20)]
    kills: usize,
    /// Times every broker connection is force-closed during the run.
    #[arg(long, default_value_t = 5)]
    connection_drops: usize,
    /// Times PostgreSQL is restarted during the run.
    #[arg(long, default_value_t = 1)]
    postgres_restarts: usize,
    /// RabbitMQ virtual host of the run, created if missing (with permissions for the URL's
    /// user), so that force-closing connections hits this run only.
    #[arg(long, default_value = "inbox-chaos")]
    vhost: String,
    /// Shell command that force-closes the run's broker connections; `{vhost}` is replaced.
    /// With `--cluster`, a `rabbitmqctl` command is sent to a node that is up (`-n`).
    #[arg(
        long,
        default_value = "rabbitmqctl -q close_all_connections --vhost '{vhost}' 'inbox-lab chaos'"
    )]
    drop_connections_command: String,
    /// Shell command that restarts PostgreSQL.
    #[arg(
        long,
        default_value = "pg_ctlcluster --skip-systemctl-redirect \"$(ls /etc/postgresql | head -n 1)\" main restart"
    )]
    restart_postgres_command: String,
    /// Seed of the stream and of the fault schedule; printed, so a run can be replayed.
    #[arg(long)]
    seed: Option<u64>,
    /// PostgreSQL schema of the run (dropped and recreated at the start, kept afterwards).
    #[arg(long, default_value = "inbox_chaos")]
    schema: String,
    /// Work queue of the run (recreated at the start, with `.retry` and `.parking-lot`).
    #[arg(long, default_value = "inbox-chaos")]
    queue: String,
    /// Deliveries per transaction in each consumer [default: the library's]
    #[arg(long)]
    batch_size: Option<usize>,
    /// Give up waiting for the stream to settle after this many seconds.
    #[arg(long, default_value_t = 900)]
    timeout_secs: u64,
    /// Hostile inputs to add, comma-separated; `--hostile` without a value adds none.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        num_args = 0..,
        default_values = [
            "deep-headers",
            "oversized-fields",
            "expiration",
            "invalid-copies",
            "simultaneous-start",
            "duplicate-bursts",
            "repeated-invalid",
            "valid-then-invalid",
        ]
    )]
    hostile: Vec<Hostile>,
    /// The ordered run instead: the consumers order each order's messages by `x-sequence`
    /// (`consume --ordered`), the stream is each order's `OrderStep`s 1..n (`--hostile` does
    /// not apply), some fail until retried, some are refused, then redriven or skipped during
    /// the run, and the order service's journal must show every step applied once, in order
    /// (a skipped one never).
    #[arg(long, conflicts_with = "cluster")]
    ordered: bool,
    /// Steps per order of the ordered run.
    #[arg(
        long,
        default_value_t = 10,
        requires = "ordered",
        value_parser = clap::value_parser!(i64).range(1..=1000)
    )]
    steps: i64,
    #[command(flatten)]
    cluster: ClusterArgs,
}

/// A fault, scheduled at a share of the run's progress.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    KillConsumer,
    DropConnections,
    RestartPostgres,
    /// SIGKILL a broker node's process (cluster runs).
    KillNode,
    /// `rabbitmqctl stop_app` on a broker node (cluster runs).
    StopNode,
}

/// Faults spread over 5%..90% of the progress, each at a random point of its own slot, so they
/// hit the run everywhere but never all at once.
fn schedule(counts: &[(usize, Fault)], rng: &mut StdRng) -> Vec<(f64, Fault)> {
    let mut plan = Vec::new();
    for &(n, fault) in counts {
        for i in 0..n {
            let at = 0.05 + 0.85 * (i as f64 + rng.random::<f64>()) / n as f64;
            plan.push((at, fault));
        }
    }
    plan.sort_by(|a, b| a.0.total_cmp(&b.0));
    plan
}

/// What happened during the run.
#[derive(Default)]
struct Figures {
    kills: usize,
    connection_drops: usize,
    postgres_restarts: usize,
    node_kills: usize,
    node_stops: usize,
    restarts: usize,
    /// Consumer exits nobody asked for, with their status (a panic exits with 101).
    crashes: Vec<String>,
    /// Consumer exits at start-up while a server was down (restarted).
    startup_failures: usize,
    /// Consumers of the first, simultaneous start that exited before any fault.
    launch_failures: Vec<String>,
}

impl Figures {
    fn faults_run(&self) -> usize {
        self.kills
            + self.connection_drops
            + self.postgres_restarts
            + self.node_kills
            + self.node_stops
    }
}

/// What a fault changes beside the fleet: its count, the cluster's nodes, the schedule's
/// random choices (in a fixed order, so a seed replays the run), the consumers' start times.
struct Shaken<'a> {
    figures: &'a mut Figures,
    cluster: Option<&'a mut Cluster>,
    rng: &'a mut StdRng,
    started_at: &'a mut [Instant],
}

/// One consumer process and where its log goes.
struct Instance {
    child: Child,
    log: PathBuf,
}

struct Fleet<'a> {
    servers: &'a Servers,
    quorum: bool,
    args: &'a ChaosArgs,
    consumer: &'a ConsumerCommand,
    exchange: String,
    events_exchange: String,
    log_dir: PathBuf,
    instances: Vec<Instance>,
    started: usize,
}

impl Fleet<'_> {
    fn spawn(&mut self) -> anyhow::Result<Instance> {
        self.started += 1;
        let log = self.log_dir.join(format!("consumer-{}.log", self.started));
        let file =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = Command::new(&self.consumer.program);
        cmd.args(&self.consumer.args)
            .args(["--schema", &self.args.schema])
            .args(["--queue", &self.args.queue])
            .args(["--exchange", &self.exchange])
            .args(["--events-exchange", &self.events_exchange])
            .env("DATABASE_URL", &self.servers.database_url)
            .env("AMQP_URL", &self.servers.amqp_url)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        if let Some(b) = self.args.batch_size {
            cmd.args(["--batch-size", &b.to_string()]);
        }
        if self.quorum {
            cmd.arg("--quorum");
        }
        if self.args.ordered {
            cmd.arg("--ordered");
        }
        let child = cmd.kill_on_drop(true).spawn().with_context(|| {
            format!("starting the consumer {}", self.consumer.program.display())
        })?;
        Ok(Instance { child, log })
    }

    /// Restarts every consumer that has exited and records why it did.
    fn reap(&mut self, figures: &mut Figures, started_at: &mut [Instant]) -> anyhow::Result<()> {
        for i in 0..self.instances.len() {
            if let Some(status) = self.instances[i].child.try_wait()? {
                let early = started_at
                    .get(i)
                    .is_some_and(|t| t.elapsed() < Duration::from_secs(10));
                let log = self.instances[i].log.display().to_string();
                // Told by its log, not only by the time: the run may notice the exit long
                // after it happened (a fault's command holds the run up).
                let started_up = std::fs::read_to_string(&self.instances[i].log)
                    .is_ok_and(|text| text.lines().any(|l| l.starts_with(STARTED_UP)));
                // A consumer that cannot reach a server at start-up exits with 2 (the CLI's
                // error exit); before any fault, with both servers up, no start may fail;
                // anything else is a crash.
                if early && figures.faults_run() == 0 {
                    figures
                        .launch_failures
                        .push(format!("{status} (log {log})"));
                } else if status.code() == Some(2) && (early || !started_up) {
                    figures.startup_failures += 1;
                } else {
                    figures.crashes.push(format!("{status} (log {log})"));
                }
                self.instances[i] = self.spawn()?;
                started_at[i] = Instant::now();
                figures.restarts += 1;
            }
        }
        Ok(())
    }

    async fn kill(&mut self, index: usize) -> anyhow::Result<()> {
        let instance = &mut self.instances[index];
        instance.child.start_kill()?;
        instance.child.wait().await?;
        self.instances[index] = self.spawn()?;
        Ok(())
    }

    /// Runs one fault of the schedule, counted in `w.figures`.
    async fn inflict(
        &mut self,
        fault: Fault,
        w: &mut Shaken<'_>,
        drop_connections: &str,
    ) -> anyhow::Result<()> {
        match fault {
            Fault::KillConsumer => {
                let i = w.rng.random_range(0..self.instances.len());
                let r = self.kill(i).await;
                w.started_at[i] = Instant::now();
                w.figures.kills += 1;
                w.figures.restarts += 1;
                r
            }
            Fault::DropConnections => {
                w.figures.connection_drops += 1;
                match w.cluster.as_deref() {
                    // On a cluster, asked of a node that is up (the vhost's connections
                    // are tracked cluster-wide).
                    Some(c) => match c.running_node().await {
                        Ok(node) => shell(&on_node(drop_connections, &node)).await,
                        Err(e) => Err(e),
                    },
                    None => shell(drop_connections).await,
                }
            }
            Fault::RestartPostgres => {
                w.figures.postgres_restarts += 1;
                shell(&self.args.restart_postgres_command).await
            }
            Fault::KillNode | Fault::StopNode => {
                let (how, count) = match fault {
                    Fault::KillNode => (NodeFault::Kill, &mut w.figures.node_kills),
                    _ => (NodeFault::Stop, &mut w.figures.node_stops),
                };
                *count += 1;
                match w.cluster.as_deref_mut() {
                    Some(c) => {
                        let node = w.rng.random_range(1..=c.nodes());
                        c.take_down(node, how).await
                    }
                    None => Ok(()),
                }
            }
        }
    }

    /// SIGTERM: each consumer drains, settles what it holds and exits.
    async fn stop(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        for instance in &self.instances {
            if let Some(pid) = instance.child.id() {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
            }
        }
        for instance in &mut self.instances {
            match tokio::time::timeout(Duration::from_secs(30), instance.child.wait()).await {
                Ok(Ok(status)) if status.success() => {}
                Ok(Ok(status)) => problems.push(format!(
                    "consumer exited with {status} on SIGTERM (log {})",
                    instance.log.display()
                )),
                Ok(Err(e)) => problems.push(format!("waiting for a consumer: {e}")),
                Err(_) => {
                    let _ = instance.child.start_kill();
                    problems.push(format!(
                        "consumer did not stop within 30 s of SIGTERM (log {})",
                        instance.log.display()
                    ));
                }
            }
        }
        problems
    }
}

/// Runs a shell command of the fault schedule.
async fn shell(command: &str) -> anyhow::Result<()> {
    checked(Command::new("sh").args(["-c", command]), command).await
}

/// Runs `cmd` to completion; a failure carries its stderr. `shown` names it in errors.
async fn checked(cmd: &mut Command, shown: &str) -> anyhow::Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {shown}"))?;
    if !out.status.success() {
        anyhow::bail!(
            "{shown} failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Settled state as counted from the database; `None` while a server is unreachable.
async fn progress(
    servers: &Servers,
    pool: &sqlx::PgPool,
    schema: &SchemaName,
    config: &rabbit_inbox::ConsumerConfig,
) -> Option<(
    order_service::Verification,
    rabbit_inbox::broker::QueueDepths,
)> {
    let v = order_service::verify(pool, schema).await.ok()?;
    // A short-lived connection: the fault schedule closes every connection of the run, and a
    // held one would be closed (and logged by lapin as an error) at every drop.
    let broker = rabbit_inbox::broker::Broker::connect(&servers.amqp_url, "inbox-lab chaos")
        .await
        .ok()?;
    let depths = broker
        .queue_depths(&config.topology, &config.retry)
        .await
        .ok();
    broker.close().await;
    Some((v, depths?))
}

/// `url` with its virtual host replaced, and the user it names.
fn on_vhost(url: &str, vhost: &str) -> anyhow::Result<(String, String)> {
    let scheme_end = url
        .find("://")
        .map(|i| i + 3)
        .with_context(|| format!("AMQP URL without a scheme: {url}"))?;
    let rest = &url[scheme_end..];
    let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
    let user = match authority.rfind('@') {
        Some(at) => authority[..at].split(':').next().unwrap_or("guest"),
        None => "guest",
    };
    Ok((
        format!("{}{authority}/{vhost}", &url[..scheme_end]),
        user.to_owned(),
    ))
}

/// Creates the run's virtual host (an existing one is fine) and lets `user` use it; on the
/// broker node `node` (`rabbitmqctl -n`), or the default one.
async fn prepare_vhost(vhost: &str, user: &str, node: Option<&str>) -> anyhow::Result<()> {
    let on_node: Vec<&str> = node.map(|n| vec!["-n", n]).unwrap_or_default();
    let exists = Command::new("rabbitmqctl")
        .args(&on_node)
        .args(["-q", "list_vhosts", "name"])
        .output()
        .await
        .context("running rabbitmqctl (needed to isolate the run in its own vhost)")?;
    let listed = String::from_utf8_lossy(&exists.stdout);
    if !listed.lines().any(|l| l.trim() == vhost) {
        rabbitmqctl(&[&on_node[..], &["-q", "add_vhost", vhost]].concat()).await?;
    }
    rabbitmqctl(
        &[
            &on_node[..],
            &["-q", "set_permissions", "-p", vhost, user, ".*", ".*", ".*"],
        ]
        .concat(),
    )
    .await
}

/// Runs `rabbitmqctl` with `args` (no shell, so names need no quoting).
async fn rabbitmqctl(args: &[&str]) -> anyhow::Result<()> {
    let shown = format!("rabbitmqctl {}", args.join(" "));
    checked(Command::new("rabbitmqctl").args(args), &shown).await
}

/// `command` addressed to broker node `node` when it is a `rabbitmqctl` command.
fn on_node(command: &str, node: &str) -> String {
    match command.strip_prefix("rabbitmqctl ") {
        Some(rest) => format!("rabbitmqctl -n '{node}' {rest}"),
        None => command.to_owned(),
    }
}

/// Every address of `urls` (comma-separated) moved to `vhost`, and the first one's user.
fn all_on_vhost(urls: &str, vhost: &str) -> anyhow::Result<(String, String)> {
    let mut moved = Vec::new();
    let mut user = None;
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let (u, who) = on_vhost(url, vhost)?;
        moved.push(u);
        user.get_or_insert(who);
    }
    let user = user.context("no AMQP URL given")?;
    Ok((moved.join(","), user))
}

/// Checks the arguments every run shares, creates the run's vhost and moves the servers'
/// broker URL (on a cluster, every node's) to it; gives the servers and the command that
/// drops the run's connections.
async fn isolate(
    servers: &Servers,
    args: &ChaosArgs,
    cluster: Option<&Cluster>,
) -> anyhow::Result<(Servers, String)> {
    if args.consumers == 0 {
        anyhow::bail!("--consumers must be at least 1");
    }
    if !args
        .vhost
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        anyhow::bail!("--vhost takes letters, digits, '-' and '_' only");
    }
    let (broker_urls, node) = match cluster {
        Some(c) => (c.urls().await?, Some(c.running_node().await?)),
        None => (servers.amqp_url.clone(), None),
    };
    let (amqp_url, user) = all_on_vhost(&broker_urls, &args.vhost)?;
    prepare_vhost(&args.vhost, &user, node.as_deref()).await?;
    let servers = Servers {
        amqp_url,
        ..servers.clone()
    };
    let drop_connections = args
        .drop_connections_command
        .replace("{vhost}", &args.vhost);
    Ok((servers, drop_connections))
}

/// The chaos run; exit code 1 on a violation of the verdict.
pub async fn run(
    servers: &Servers,
    args: ChaosArgs,
    consumer: &ConsumerCommand,
) -> anyhow::Result<ExitCode> {
    if args.ordered {
        return ordered::run(servers, args, consumer).await;
    }
    let mut cluster = args.cluster.cluster.then(|| Cluster::new(&args.cluster));
    let (servers, drop_connections) = &isolate(servers, &args, cluster.as_ref()).await?;
    let schema = SchemaName::new(&args.schema)?;
    let exchange = format!("{}.orders", args.queue);
    let mut config = order_service::config(schema.clone(), &args.queue, &exchange);
    if cluster.is_some() {
        // Replicated on every node, so the queues outlive any one node; the delivery limit
        // leaves room for the retry budget and every prefetched redelivery after kills.
        config.use_quorum_queues(None);
    }
    let topology = config.topology.clone();
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc4a0_5eed);

    let (pool, broker) = clean_slate(servers, &config).await?;
    // Downstream of the consumers' outbox: shipping-service, in this process, with its own
    // inbox; it rides out the faults like any consumer.
    let events_exchange = format!("{}.events", args.queue);
    let shipping_schema = SchemaName::new(format!("{}_shipping", args.schema))?;
    let mut shipping_config = shipping_service::config(
        shipping_schema.clone(),
        &format!("{}.shipping", args.queue),
        &events_exchange,
    );
    if cluster.is_some() {
        shipping_config.use_quorum_queues(None);
    }
    rabbit_inbox::schema::drop_schema(&pool, &shipping_schema).await?;
    rabbit_inbox::migrate(&pool, &shipping_schema).await?;
    shipping_service::migrate(&pool, &shipping_schema).await?;
    broker
        .delete(&shipping_config.topology, &shipping_config.retry)
        .await
        .context("deleting the previous run's shipping queues")?;
    let broker = {
        // The deletes above may have closed the channel; declare on a fresh connection.
        broker.close().await;
        let b = connect::rabbitmq(&servers.amqp_url).await?;
        b.declare(&shipping_config.topology, &shipping_config.retry)
            .await
            .context("declaring the shipping topology")?;
        b.declare(&config.topology, &config.retry)
            .await
            .context("declaring the topology")?;
        b
    };
    let shipper = rabbit_inbox::Consumer::new(
        servers.amqp_url.clone(),
        pool.clone(),
        shipping_config.clone(),
        shipping_service::ShippingHandler::new(shipping_schema.clone()),
    )?;
    let (stop_shipper, shipper_stopped) = tokio::sync::oneshot::channel::<()>();
    let shipper = tokio::spawn(shipper.run(async move {
        let _ = shipper_stopped.await;
    }));

    // At least the asked-for count: the number of messages per order varies with the seed.
    let mut orders = ((args.messages as f64 / MESSAGES_PER_ORDER).ceil() as usize).max(1);
    let mut scenario = Scenario::generate_with(orders, seed, &args.hostile);
    while scenario.messages.len() < args.messages {
        orders += (args.messages - scenario.messages.len()).div_ceil(3);
        scenario = Scenario::generate_with(orders, seed, &args.hostile);
    }
    let hostile = |kind: Hostile| args.hostile.contains(&kind);
    // Copies per inbox key, for the verdict: on a cluster the publisher takes the messages.
    let published_copies = scenario.published_copies(&config.envelope);
    let (node_kills, node_stops) = match cluster {
        Some(_) => (args.cluster.node_kills, args.cluster.node_stops),
        None => (0, 0),
    };
    let plan = schedule(
        &[
            (args.kills, Fault::KillConsumer),
            (args.connection_drops, Fault::DropConnections),
            (args.postgres_restarts, Fault::RestartPostgres),
            (node_kills, Fault::KillNode),
            (node_stops, Fault::StopNode),
        ],
        &mut rng,
    );
    println!(
        "rabbit-inbox chaos: seed {seed}, {} consumers, {} kills, {} connection drops, {} PostgreSQL restarts",
        args.consumers, args.kills, args.connection_drops, args.postgres_restarts
    );
    if cluster.is_some() {
        println!(
            "on the cluster at {}: quorum queues, {node_kills} node kills, {node_stops} node stops \
             ({} s down each), publishing at {} msgs/s while consuming",
            rabbit_inbox::broker::AmqpAddresses::parse(&servers.amqp_url)?,
            args.cluster.node_down_secs,
            args.cluster.publish_rate
        );
    }
    let kinds: Vec<String> = args
        .hostile
        .iter()
        .filter_map(|h| clap::ValueEnum::to_possible_value(h).map(|v| v.get_name().to_owned()))
        .collect();
    println!(
        "replay with: inbox-lab chaos --messages {} --seed {seed} --hostile '{}'",
        args.messages,
        kinds.join(",")
    );
    // On a cluster the stream is published while the consumers run, through the node
    // failures; otherwise all of it before they start.
    if cluster.is_none() {
        publish_all(&broker, &exchange, &scenario.messages).await?;
    }
    broker.close().await;
    let published = scenario.messages.len();
    println!(
        "{} {published} messages ({} unique, {} exact duplicates, {} payments before their order)",
        if cluster.is_some() {
            "publishing"
        } else {
            "published"
        },
        scenario.unique_keys,
        scenario.duplicates,
        scenario.out_of_order
    );

    let log_dir = std::env::temp_dir().join(format!("inbox-chaos-{seed:016x}"));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    println!("consumer logs in {}", log_dir.display());
    let mut fleet = Fleet {
        servers,
        quorum: cluster.is_some(),
        args: &args,
        consumer,
        exchange,
        events_exchange,
        log_dir,
        instances: Vec::new(),
        started: 0,
    };
    if hostile(Hostile::SimultaneousStart) {
        // A fresh schema: every consumer creates it and runs all migrations as it starts,
        // at the same moment, as a rolling deploy does.
        rabbit_inbox::schema::drop_schema(&pool, &schema)
            .await
            .context("dropping the schema for the simultaneous start")?;
    }
    // All consumers at once, one spawn right after the other.
    let mut started_at = Vec::new();
    for _ in 0..args.consumers {
        let instance = fleet.spawn()?;
        fleet.instances.push(instance);
        started_at.push(Instant::now());
    }
    let consumers_started = Instant::now();
    let publisher = cluster.is_some().then(|| {
        spawn_publisher(
            servers.amqp_url.clone(),
            fleet.exchange.clone(),
            std::mem::take(&mut scenario.messages),
            args.cluster.publish_rate,
        )
    });
    let publishing = || {
        publisher
            .as_ref()
            .is_some_and(|p| !p.done.load(std::sync::atomic::Ordering::SeqCst))
    };

    let mut figures = Figures::default();
    let mut faults_failed = Vec::new();
    let mut next = 0;
    let began = Instant::now();
    let deadline = began + Duration::from_secs(args.timeout_secs);
    let mut last_line = Instant::now();
    let unique = scenario.unique_keys as i64;
    let settled = loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        fleet.reap(&mut figures, &mut started_at)?;
        if let Some(c) = cluster.as_mut()
            && let Err(e) = c.bring_back_when_due().await
        {
            faults_failed.push(format!("bringing a node back: {e:#}"));
        }
        let Some((v, depths)) = progress(servers, &pool, &schema, &config).await else {
            if Instant::now() > deadline {
                break false;
            }
            continue;
        };
        let Ok(chain) = shipping_service::verify_chain(&pool, &schema, &shipping_schema).await
        else {
            if Instant::now() > deadline {
                break false;
            }
            continue;
        };
        let done = (v.processed + v.parked) as f64 / unique as f64;
        let mut acted = false;
        while next < plan.len() && plan[next].0 <= done {
            let fault = plan[next].1;
            next += 1;
            acted = true;
            let outcome = fleet
                .inflict(
                    fault,
                    &mut Shaken {
                        figures: &mut figures,
                        cluster: cluster.as_mut(),
                        rng: &mut rng,
                        started_at: &mut started_at,
                    },
                    drop_connections,
                )
                .await;
            if let Err(e) = outcome {
                faults_failed.push(format!("{fault:?}: {e:#}"));
            }
        }
        if last_line.elapsed() >= Duration::from_secs(2) {
            let nodes = match &cluster {
                Some(c) => format!(
                    ", {} node kills, {} node stops{}",
                    figures.node_kills,
                    figures.node_stops,
                    c.down()
                        .map(|(n, f)| format!(" (node {n} down: {f:?})"))
                        .unwrap_or_default()
                ),
                None => String::new(),
            };
            eprintln!(
                "  {:>5.1} s: {:>6} processed, {:>4} parked, {:>4} waiting to retry, queue {:>6}, \
                 {} kills, {} drops, {} pg restarts{nodes}",
                began.elapsed().as_secs_f64(),
                v.processed,
                v.parked,
                v.retryable,
                depths.work,
                figures.kills,
                figures.connection_drops,
                figures.postgres_restarts
            );
            last_line = Instant::now();
        }
        let all_final = v.processed + v.parked == unique
            && v.retryable == 0
            && v.processing == 0
            && chain.emitted == v.paid_orders
            && chain.unsent == 0
            && chain.shipments >= chain.emitted;
        let nodes_up = cluster.as_ref().is_none_or(|c| c.down().is_none());
        if !acted
            && next == plan.len()
            && all_final
            && !publishing()
            && nodes_up
            && depths.work == 0
            && depths.retry == 0
        {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
    };
    let elapsed = began.elapsed();
    if let Some(c) = cluster.as_mut()
        && let Err(e) = c.bring_back().await
    {
        faults_failed.push(format!("bringing a node back: {e:#}"));
    }
    let published_at = Instant::now();
    let publisher = match publisher {
        Some(p) => {
            if !p.done.load(std::sync::atomic::Ordering::SeqCst) {
                p.task.abort();
            }
            Some(match p.task.await {
                Ok(Ok(f)) => f,
                Ok(Err(e)) => {
                    faults_failed.push(format!("publisher: {e:#}"));
                    Default::default()
                }
                Err(_) => Default::default(),
            })
        }
        None => None,
    };
    if settled && hostile(Hostile::Expiration) {
        // Past the TTL of the expiring messages' parked copies, so a copy that kept it has
        // expired out of the parking lot before the lot is read.
        let since = if publisher.is_some() {
            published_at
        } else {
            consumers_started
        };
        let past_ttl = since + Duration::from_millis(EXPIRATION_MS * 3 / 2);
        tokio::time::sleep_until(past_ttl.into()).await;
    }
    let stop_problems = fleet.stop().await;
    let _ = stop_shipper.send(());
    let shipper_stopped = matches!(
        tokio::time::timeout(Duration::from_secs(30), shipper).await,
        Ok(Ok(Ok(())))
    );

    // The verdict, from the database and the broker, after every consumer has stopped.
    let v = order_service::verify(&pool, &schema).await?;
    let broker = connect::rabbitmq(&servers.amqp_url).await?;
    let depths = broker.queue_depths(&topology, &config.retry).await?;
    broker.close().await;
    let parking = ParkingLot::read(&servers.amqp_url, &topology).await?;
    let parking_check = parking.check(&pool, &schema, &scenario.hostile).await?;
    let ledger = read_ledger(&pool, &schema).await?;
    let deliveries = Deliveries::count(&published_copies, &ledger, &parking.copies_by_key());
    let pairs = applied_once(&pool, &schema, &ledger, scenario.valid_before_invalid()).await?;
    let chain = shipping_service::verify_chain(&pool, &schema, &shipping_schema).await?;
    let broker = connect::rabbitmq(&servers.amqp_url).await?;
    let shipping_depths = broker
        .queue_depths(&shipping_config.topology, &shipping_config.retry)
        .await?;
    broker.close().await;

    let lost = unique - (v.processed + v.parked);
    let checks = [
        ("settled before the deadline", settled),
        (
            "every fault of the schedule ran",
            faults_failed.is_empty() && next == plan.len(),
        ),
        (
            "every consumer of the simultaneous start started",
            figures.launch_failures.is_empty(),
        ),
        ("no consumer crashed", figures.crashes.is_empty()),
        (
            "every consumer stopped cleanly on SIGTERM",
            stop_problems.is_empty(),
        ),
        (
            "zero lost: every unique message PROCESSED or parked",
            lost == 0 && v.retryable == 0 && v.processing == 0,
        ),
        ("zero double-applied payments", v.double_applied == 0),
        (
            "every PROCESSED payment applied, none without a ledger entry",
            v.ledger_without_effect == 0 && v.effects_without_ledger == 0,
        ),
        (
            "paid totals equal the sum of payment rows",
            v.paid_mismatches == 0,
        ),
        (
            "work and retry queues empty",
            depths.work == 0 && depths.retry == 0,
        ),
        (
            "no PROCESSED message in the parking lot",
            parking_check.processed_copies == 0,
        ),
        (
            "every message in the parking lot recorded in the inbox",
            parking_check.unrecorded == 0,
        ),
        (
            "every parked row has its message in the parking lot, with a reason",
            parking_check.parked_rows_with_copy == v.parked && parking_check.without_reason == 0,
        ),
        (
            "parked rows as expected",
            // On a cluster the stream is published while nodes fail: an `OrderPlaced` held up
            // past the retry budget of the payments before it poisons them, with their parked
            // copy; they are counted apart, and every other parked row must be expected.
            // An overtaken pair (see `Pairs::overtaken`) adds the invalid copy's parked row.
            if cluster.is_some() {
                v.parked - v.poisoned_before_their_order - pairs.overtaken as i64
                    == scenario.expected.parked_rows
            } else {
                v.parked - pairs.overtaken as i64 == scenario.expected.parked_rows
            },
        ),
        (
            "one parking-lot copy per parked row (another only after a redelivery)",
            deliveries.extra_copies.is_empty(),
        ),
        (
            "every published copy counted on its row (delivery_count)",
            deliveries.short.is_empty(),
        ),
        (
            "each valid payment followed by an invalid copy applied once (or parked as the conflict of a copy recorded first)",
            pairs.problems.is_empty(),
        ),
        (
            "payload conflicts parked as expected, without a row",
            parking_check.conflict_keys == scenario.expected.conflicts,
        ),
        (
            "every hostile input parked (with a row, or as a conflict)",
            parking_check.hostile_missing.is_empty(),
        ),
        (
            "one OrderPaid in the outbox per paid order, none for others",
            v.paid_without_event == 0
                && v.wrong_events == 0
                && v.order_paid_events == v.paid_orders,
        ),
        (
            "every emitted OrderPaid confirmed by the broker",
            chain.unsent == 0 && chain.sent == chain.emitted,
        ),
        (
            "every OrderPaid shipped exactly once downstream",
            chain.exactly_once() && chain.shipments == chain.emitted,
        ),
        (
            "shipping queues empty, shipping consumer stopped cleanly",
            shipping_depths.work == 0
                && shipping_depths.retry == 0
                && shipping_depths.parking == 0
                && shipper_stopped,
        ),
    ];
    let mut checks = checks.to_vec();
    if let Some(p) = &publisher {
        checks.push((
            "every published message confirmed by the cluster",
            p.confirmed == published as u64,
        ));
    }
    let ok = checks.iter().all(|(_, pass)| *pass);

    println!();
    let line = |name: &str, value: String| println!("  {name:<46} {value:>10}");
    line("messages published", published.to_string());
    line("unique messages", scenario.unique_keys.to_string());
    line("exact duplicates injected", scenario.duplicates.to_string());
    line(
        "payments published before their order",
        scenario.out_of_order.to_string(),
    );
    line("consumer processes", args.consumers.to_string());
    line("consumers SIGKILLed", figures.kills.to_string());
    line("consumer restarts", figures.restarts.to_string());
    line(
        "start-ups refused while a server was down",
        figures.startup_failures.to_string(),
    );
    line(
        "broker connection drops (every run connection)",
        figures.connection_drops.to_string(),
    );
    line("PostgreSQL restarts", figures.postgres_restarts.to_string());
    if let Some(p) = &publisher {
        line("broker nodes SIGKILLed", figures.node_kills.to_string());
        line(
            "broker nodes stopped (stop_app)",
            figures.node_stops.to_string(),
        );
        line(
            "publishes not confirmed, republished",
            p.republished.to_string(),
        );
        line("publisher reconnects", p.reconnects.to_string());
    }
    line("hostile inputs", kinds.join(","));
    for (kind, codes) in &parking_check.hostile_codes {
        line(&format!("  {kind} parked as"), codes.clone());
    }
    line("PROCESSED", v.processed.to_string());
    if cluster.is_some() {
        line(
            "poisoned waiting for a held-up order",
            v.poisoned_before_their_order.to_string(),
        );
    }
    line("parked (PERMANENT_FAILED / POISONED)", v.parked.to_string());
    line(
        "messages in the parking lot",
        parking.copies.len().to_string(),
    );
    line(
        "parking-lot copies per parked row",
        if parking_check.parked_rows_with_copy == 0 {
            "- (nothing parked)".to_owned()
        } else {
            format!(
                "{:.2} ({} copies of {} rows; payload conflicts apart)",
                parking_check.parked_row_copies as f64 / parking_check.parked_rows_with_copy as f64,
                parking_check.parked_row_copies,
                parking_check.parked_rows_with_copy
            )
        },
    );
    line(
        "parked rows with copies beyond their redeliveries",
        deliveries.extra_copies.len().to_string(),
    );
    line(
        "deliveries counted on the rows",
        format!(
            "{} of {} published copies ({} of {} keys short)",
            deliveries.counted,
            deliveries.published,
            deliveries.short.len(),
            deliveries.keys
        ),
    );
    line(
        "valid payments before an invalid copy, applied once",
        format!(
            "{} of {} ({} overtaken by the copy, parked as its conflict)",
            pairs.applied_once, pairs.pairs, pairs.overtaken
        ),
    );
    line("lost", lost.to_string());
    line(
        "OrderPaid emitted / confirmed / shipped",
        format!("{} / {} / {}", chain.emitted, chain.sent, chain.shipments),
    );
    line("double-applied", v.double_applied.to_string());
    line(
        "payments applied (expected without faults)",
        format!("{} ({})", v.payment_rows, scenario.expected.payments),
    );
    line(
        "throughput until settled (msgs/s)",
        format!("{:.0}", published as f64 / elapsed.as_secs_f64().max(1e-9)),
    );
    line(
        "time until settled (s)",
        format!("{:.1}", elapsed.as_secs_f64()),
    );
    println!();
    for (name, pass) in &checks {
        println!("  [{}] {name}", if *pass { " ok " } else { "FAIL" });
    }
    for problem in faults_failed
        .iter()
        .chain(&figures.launch_failures)
        .chain(&figures.crashes)
        .chain(&stop_problems)
        .chain(&parking_check.problems)
        .chain(&parking_check.hostile_missing)
        .chain(&pairs.problems)
    {
        println!("  - {problem}");
    }
    // The first few rows of each kind, with what the ledger and the parking lot show.
    for (what, rows) in [
        (
            "parked with copies beyond its redeliveries",
            &deliveries.extra_copies,
        ),
        ("short of its published copies", &deliveries.short),
    ] {
        for row in rows.iter().take(SHOWN_ROWS) {
            println!("  - {what}: {row}");
        }
        if rows.len() > SHOWN_ROWS {
            println!("  - ... and {} more {what}", rows.len() - SHOWN_ROWS);
        }
    }
    println!();
    if ok {
        // Logs are kept only when there is something to look into.
        let _ = std::fs::remove_dir_all(&fleet.log_dir);
        println!("chaos: OK (seed {seed})");
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "chaos: FAILED; replay with --seed {seed}; inspect schema {schema}, consumer logs in {}",
            fleet.log_dir.display()
        );
        Ok(ExitCode::FAILURE)
    }
}

/// Rows named per failed check of the deliveries.
const SHOWN_ROWS: usize = 5;

/// What the ledger holds for one key.
#[derive(Clone, Debug, Default)]
struct LedgerRow {
    status: String,
    delivery_count: i32,
    processing_attempt: i32,
    parked_duplicates: i32,
    payload_conflicts: i32,
}

/// The order service's inbox rows, by key.
async fn read_ledger(
    pool: &sqlx::PgPool,
    schema: &SchemaName,
) -> anyhow::Result<HashMap<String, LedgerRow>> {
    let sql = format!(
        "SELECT message_id, status, delivery_count, processing_attempt, parked_duplicates, \
           payload_conflicts FROM {} WHERE consumer_name = $1",
        schema.qualify("message_inbox")
    );
    let rows = sqlx::query(AssertSqlSafe(sql))
        .bind(order_service::CONSUMER_NAME)
        .fetch_all(pool)
        .await
        .context("reading the inbox")?;
    rows.into_iter()
        .map(|r| {
            Ok((
                r.try_get("message_id")?,
                LedgerRow {
                    status: r.try_get("status")?,
                    delivery_count: r.try_get("delivery_count")?,
                    processing_attempt: r.try_get("processing_attempt")?,
                    parked_duplicates: r.try_get("parked_duplicates")?,
                    payload_conflicts: r.try_get("payload_conflicts")?,
                },
            ))
        })
        .collect()
}

/// Every published copy against the ledger's count of deliveries, and the parking lot's copies
/// against the deliveries that explain them.
#[derive(Debug, Default)]
struct Deliveries {
    /// Keys published.
    keys: usize,
    /// Copies published.
    published: usize,
    /// Published copies counted on their rows (a row's count above its key's copies, from
    /// redeliveries, makes up for no other key).
    counted: usize,
    /// Keys whose row counts fewer deliveries than copies were published, or has no row.
    short: Vec<String>,
    /// Parked rows with more parking-lot copies than the deliveries beyond the published
    /// copies and the retries explain.
    extra_copies: Vec<String>,
}

impl Deliveries {
    /// `published`: copies per key; `ledger`: the rows by key; `lot`: parking-lot copies per
    /// key, payload conflicts apart.
    ///
    /// Every delivery of a key is counted on its row (`delivery_count`: the first, duplicates,
    /// retries and conflicting copies alike), so faults can only add to the published copies.
    /// A parked row has one copy in the parking lot; a second is made only for a delivery
    /// that finds no copy noted on the row (the consumer died, or the database went away,
    /// between the copy's confirm and its note), and such a delivery is one more than the
    /// published copies and the retry tiers' returns (`processing_attempt - 1`).
    fn count(
        published: &HashMap<String, usize>,
        ledger: &HashMap<String, LedgerRow>,
        lot: &HashMap<String, usize>,
    ) -> Self {
        let mut d = Deliveries {
            keys: published.len(),
            published: published.values().sum(),
            ..Default::default()
        };
        let mut keys: Vec<(&String, &usize)> = published.iter().collect();
        keys.sort();
        let shown = |key: &str, copies: usize, row: &LedgerRow| {
            format!(
                "{key}: {copies} published, status {}, delivery_count {}, processing_attempt {}, \
                 parked_duplicates {}, payload_conflicts {}, {} in the parking lot",
                row.status,
                row.delivery_count,
                row.processing_attempt,
                row.parked_duplicates,
                row.payload_conflicts,
                lot.get(key).copied().unwrap_or(0)
            )
        };
        for (key, &copies) in keys {
            let Some(row) = ledger.get(key) else {
                d.short.push(format!("{key}: {copies} published, no row"));
                continue;
            };
            let counted = usize::try_from(row.delivery_count).unwrap_or(0);
            d.counted += counted.min(copies);
            if counted < copies {
                d.short.push(shown(key, copies, row));
            }
            let parked = matches!(
                row.status.as_str(),
                "PERMANENT_FAILED" | "POISONED" | "MANUAL_REVIEW"
            );
            let in_lot = lot.get(key.as_str()).copied().unwrap_or(0);
            let redelivered = i64::from(row.delivery_count)
                - copies as i64
                - i64::from(row.processing_attempt - 1).max(0);
            if parked && in_lot as i64 > 1 + redelivered.max(0) {
                d.extra_copies.push(shown(key, copies, row));
            }
        }
        d
    }
}

/// The valid payments of the stream followed at once by an invalid copy under their id.
#[derive(Debug, Default)]
struct Pairs {
    pairs: usize,
    applied_once: usize,
    /// Pairs whose invalid copy was recorded first: the valid payment's delivery was lost
    /// with its consumer, its channel or its node, or ran on another consumer that committed
    /// later, and came back behind the copy. Its row is the invalid copy's (parked) and the
    /// payment is parked as a payload conflict of it, never applied: allowed, and counted.
    overtaken: usize,
    problems: Vec<String>,
}

/// Each of `ids` applied once (one payment row) and PROCESSED: the invalid copy after it took
/// neither its row nor its effect. Across consumers the first commit under the row lock
/// decides, so a pair may also end overtaken (see [`Pairs::overtaken`]), never lost or applied
/// twice.
async fn applied_once(
    pool: &sqlx::PgPool,
    schema: &SchemaName,
    ledger: &HashMap<String, LedgerRow>,
    ids: impl Iterator<Item = &str>,
) -> anyhow::Result<Pairs> {
    let sql = format!(
        "SELECT count(*) FROM {} WHERE message_id = $1",
        schema.qualify("payment_history")
    );
    let mut pairs = Pairs::default();
    for id in ids {
        pairs.pairs += 1;
        let applied: i64 = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
            .bind(id)
            .fetch_one(pool)
            .await
            .context("counting payment rows")?;
        let row = ledger.get(id);
        let status = row.map_or("no row", |r| r.status.as_str());
        if applied == 1 && status == "PROCESSED" {
            pairs.applied_once += 1;
        } else if applied == 0
            && status == "PERMANENT_FAILED"
            && row.is_some_and(|r| r.payload_conflicts >= 1)
        {
            pairs.overtaken += 1;
        } else {
            pairs.problems.push(format!(
                "payment {id} followed by an invalid copy: applied {applied} times, inbox status {status}"
            ));
        }
    }
    Ok(pairs)
}

/// One message of the parking lot.
struct ParkedCopy {
    /// The inbox key it was parked under.
    key: Option<String>,
    /// The recorded reason.
    code: Option<String>,
    /// Its AMQP message id (the producer's).
    message_id: Option<String>,
}

/// The parking lot's messages.
struct ParkingLot {
    copies: Vec<ParkedCopy>,
}

#[derive(Default)]
struct ParkingCheck {
    /// Copies whose inbox row is PROCESSED (a same-key copy with another body excepted: the
    /// row counts that conflict and its copy is parked by design).
    processed_copies: i64,
    /// Parked rows (PERMANENT_FAILED / POISONED) with at least one copy in the parking lot.
    parked_rows_with_copy: i64,
    /// Copies of parked rows (payload conflicts, parked apart by design, not counted): one
    /// per row when parking is idempotent. More only where a consumer died between the
    /// parking lot's confirm and noting it on the row.
    parked_row_copies: i64,
    /// Copies without an inbox key or an error code.
    without_reason: i64,
    /// Copies whose key has no inbox row, or one that is neither parked nor PROCESSED.
    unrecorded: i64,
    /// Distinct keys with a copy parked as a payload conflict.
    conflict_keys: i64,
    /// Hostile messages without the parked copy they must have.
    hostile_missing: Vec<String>,
    /// Error codes of the hostile messages' parked copies, by kind.
    hostile_codes: Vec<(String, String)>,
    problems: Vec<String>,
}

impl ParkingLot {
    /// Copies per inbox key, payload conflicts apart (parked every time, by design).
    fn copies_by_key(&self) -> HashMap<String, usize> {
        let mut copies = HashMap::new();
        for copy in &self.copies {
            if let (Some(key), Some(code)) = (&copy.key, &copy.code)
                && code != rabbit_inbox::status::PAYLOAD_CONFLICT
            {
                *copies.entry(key.clone()).or_insert(0) += 1;
            }
        }
        copies
    }

    /// Drains the parking lot (the run's queues are recreated by the next run).
    async fn read(amqp_url: &str, topology: &rabbit_inbox::Topology) -> anyhow::Result<Self> {
        let lot = rabbit_inbox::broker::ParkingLot::connect(
            amqp_url,
            &topology.queue,
            &topology.parking_queue,
        )
        .await?;
        let mut copies = Vec::new();
        while let Some(parked) = lot.next().await? {
            let m = parked.message();
            let text = |name: &str| {
                m.headers
                    .get(name)
                    .and_then(|v| v.as_str())
                    .map(str::to_owned)
            };
            copies.push(ParkedCopy {
                key: text(parking_headers::INBOX_KEY),
                code: text(parking_headers::ERROR_CODE),
                message_id: m.message_id.clone(),
            });
            lot.remove(parked).await?;
        }
        lot.close().await;
        Ok(Self { copies })
    }

    /// The copies against their inbox rows; `hostile`: the hostile messages of the stream,
    /// each of which must have its copy.
    async fn check(
        &self,
        pool: &sqlx::PgPool,
        schema: &SchemaName,
        hostile: &[HostileMessage],
    ) -> anyhow::Result<ParkingCheck> {
        let store = InboxStore::new(schema.clone());
        let mut conn = pool.acquire().await?;
        let mut check = ParkingCheck::default();
        let mut seen = HashSet::new();
        let mut conflicts = HashSet::new();
        // Message ids whose copy is parked with a row, and those parked as a conflict.
        let mut with_row = HashSet::new();
        let mut as_conflict = HashSet::new();
        let mut codes_by_id: std::collections::HashMap<&str, &str> = Default::default();
        for copy in &self.copies {
            let (Some(key), Some(code)) = (&copy.key, &copy.code) else {
                check.without_reason += 1;
                continue;
            };
            if code == rabbit_inbox::status::PAYLOAD_CONFLICT && conflicts.insert(key.clone()) {
                check.conflict_keys += 1;
            }
            let record = store
                .find(&mut conn, order_service::CONSUMER_NAME, key)
                .await?;
            let status = record.map(|r| r.status);
            if let Some(id) = copy.message_id.as_deref() {
                codes_by_id.insert(id, code);
                if code == rabbit_inbox::status::PAYLOAD_CONFLICT {
                    as_conflict.insert(id);
                } else if matches!(
                    status,
                    Some(InboxStatus::PermanentFailed | InboxStatus::Poisoned)
                ) {
                    with_row.insert(id);
                }
            }
            match status {
                Some(InboxStatus::Processed) if code != rabbit_inbox::status::PAYLOAD_CONFLICT => {
                    check.processed_copies += 1;
                    check
                        .problems
                        .push(format!("PROCESSED message {key} parked with {code}"));
                }
                Some(InboxStatus::PermanentFailed | InboxStatus::Poisoned) => {
                    if seen.insert(key.clone()) {
                        check.parked_rows_with_copy += 1;
                    }
                    if code != rabbit_inbox::status::PAYLOAD_CONFLICT {
                        check.parked_row_copies += 1;
                    }
                }
                Some(InboxStatus::Processed) => {}
                other => {
                    check.unrecorded += 1;
                    check.problems.push(format!(
                        "parked message {key} ({code}) has inbox status {other:?}"
                    ));
                }
            }
        }
        let mut codes: Vec<(String, std::collections::BTreeSet<&str>)> = Vec::new();
        for h in hostile {
            let id = h.message_id.as_str();
            let (parked, wanted) = if h.conflict {
                (as_conflict.contains(id), "its payload-conflict copy")
            } else {
                (with_row.contains(id), "its copy with a parked row")
            };
            if !parked {
                check.hostile_missing.push(format!(
                    "{:?} input {id}: {wanted} missing from the parking lot",
                    h.kind
                ));
            }
            let kind = format!("{:?}", h.kind);
            let code = if h.conflict {
                rabbit_inbox::status::PAYLOAD_CONFLICT
            } else {
                codes_by_id.get(id).copied().unwrap_or("missing")
            };
            match codes.iter_mut().find(|(k, _)| *k == kind) {
                Some((_, set)) => {
                    set.insert(code);
                }
                None => codes.push((kind, [code].into())),
            }
        }
        check.hostile_codes = codes
            .into_iter()
            .map(|(kind, set)| (kind, set.into_iter().collect::<Vec<_>>().join(",")))
            .collect();
        Ok(check)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_spreads_every_fault_over_the_run() {
        let mut rng = StdRng::seed_from_u64(7);
        let plan = schedule(
            &[
                (20, Fault::KillConsumer),
                (5, Fault::DropConnections),
                (1, Fault::RestartPostgres),
            ],
            &mut rng,
        );
        assert_eq!(plan.len(), 26);
        let count = |f: Fault| plan.iter().filter(|(_, g)| *g == f).count();
        assert_eq!(count(Fault::KillConsumer), 20);
        assert_eq!(count(Fault::DropConnections), 5);
        assert_eq!(count(Fault::RestartPostgres), 1);
        assert!(
            plan.windows(2).all(|w| w[0].0 <= w[1].0),
            "sorted by progress"
        );
        assert!(plan.iter().all(|(at, _)| (0.05..0.9).contains(at)));
        // Kills land in distinct slots of the run, not bunched at one point.
        let kills: Vec<f64> = plan
            .iter()
            .filter(|(_, f)| *f == Fault::KillConsumer)
            .map(|(at, _)| *at)
            .collect();
        for (i, at) in kills.iter().enumerate() {
            let slot = 0.05 + 0.85 * i as f64 / 20.0;
            assert!((slot..slot + 0.85 / 20.0).contains(at), "kill {i} at {at}");
        }
    }

    #[test]
    fn vhost_replaces_the_path_and_keeps_the_credentials() {
        let (url, user) = on_vhost("amqp://bob:secret@10.0.0.1:5672/%2f", "chaos").expect("url");
        assert_eq!(url, "amqp://bob:secret@10.0.0.1:5672/chaos");
        assert_eq!(user, "bob");
        let (url, user) = on_vhost("amqp://localhost", "x").expect("url");
        assert_eq!(url, "amqp://localhost/x");
        assert_eq!(user, "guest");
        assert!(on_vhost("localhost:5672", "x").is_err());
    }

    #[test]
    fn every_address_of_a_cluster_moves_to_the_vhost() {
        let (urls, user) = all_on_vhost(
            "amqp://guest:guest@127.0.0.1:5681/%2f,amqp://guest:guest@127.0.0.1:5682/%2f",
            "chaos",
        )
        .expect("urls");
        assert_eq!(
            urls,
            "amqp://guest:guest@127.0.0.1:5681/chaos,amqp://guest:guest@127.0.0.1:5682/chaos"
        );
        assert_eq!(user, "guest");
    }

    fn row(status: &str, delivery_count: i32, processing_attempt: i32) -> LedgerRow {
        LedgerRow {
            status: status.into(),
            delivery_count,
            processing_attempt,
            ..Default::default()
        }
    }

    fn counted(
        published: &[(&str, usize)],
        ledger: &[(&str, LedgerRow)],
        lot: &[(&str, usize)],
    ) -> Deliveries {
        let owned = |v: &[(&str, usize)]| v.iter().map(|(k, n)| (k.to_string(), *n)).collect();
        let ledger = ledger
            .iter()
            .map(|(k, r)| (k.to_string(), r.clone()))
            .collect();
        Deliveries::count(&owned(published), &ledger, &owned(lot))
    }

    #[test]
    fn every_published_copy_must_be_counted_on_its_row() {
        let d = counted(
            &[("a", 3), ("b", 2), ("c", 1), ("gone", 1)],
            &[
                // Two kills' redeliveries on top: they make up for no other key.
                ("a", row("PROCESSED", 5, 1)),
                ("b", row("PERMANENT_FAILED", 1, 1)),
                ("c", row("PROCESSED", 1, 1)),
            ],
            &[("b", 1)],
        );
        assert_eq!((d.keys, d.published, d.counted), (4, 7, 5));
        assert_eq!(d.short.len(), 2);
        assert!(d.short[0].starts_with("b: 2 published, status PERMANENT_FAILED"));
        assert!(d.short[0].ends_with("1 in the parking lot"));
        assert_eq!(d.short[1], "gone: 1 published, no row");
        assert!(d.extra_copies.is_empty());
    }

    #[test]
    fn a_second_parked_copy_needs_a_redelivery() {
        let d = counted(
            &[("burst", 2), ("killed", 1), ("poison", 1), ("retried", 1)],
            &[
                // Both copies of a burst parked: nothing explains the second.
                ("burst", row("PERMANENT_FAILED", 2, 1)),
                // Redelivered after its first copy's confirm, before the note.
                ("killed", row("PERMANENT_FAILED", 2, 1)),
                // Four returns from the retry tiers, then poisoned: one copy.
                ("poison", row("POISONED", 5, 5)),
                ("retried", row("POISONED", 5, 5)),
            ],
            &[("burst", 2), ("killed", 2), ("poison", 1), ("retried", 2)],
        );
        assert!(d.short.is_empty());
        let named: Vec<&str> = d
            .extra_copies
            .iter()
            .map(|r| r.split(':').next().unwrap_or(""))
            .collect();
        assert_eq!(named, ["burst", "retried"]);
    }

    #[test]
    fn schedule_is_replayable_from_the_seed() {
        let counts = [
            (3, Fault::KillConsumer),
            (2, Fault::KillNode),
            (1, Fault::StopNode),
        ];
        let a = schedule(&counts, &mut StdRng::seed_from_u64(42));
        let b = schedule(&counts, &mut StdRng::seed_from_u64(42));
        assert_eq!(a, b);
    }
}
