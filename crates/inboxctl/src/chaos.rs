//! `inboxctl chaos`: several consumer processes on one queue while consumers are SIGKILLed and
//! restarted, broker connections are force-closed and PostgreSQL is restarted; then
//! exactly-once and "nothing lost" are checked from the database and the broker.

use std::{
    collections::HashSet,
    path::PathBuf,
    process::{ExitCode, Stdio},
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use nix::{sys::signal::Signal, unistd::Pid};
use rabbit_inbox::{InboxStatus, InboxStore, SchemaName, parking_headers};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use tokio::process::{Child, Command};

use crate::{
    Servers, clean_slate, connect, publish_all,
    scenario::{EXPIRATION_MS, Hostile, Scenario},
};

/// Messages per order in the generated stream, about (placed, two payments, some duplicates).
const MESSAGES_PER_ORDER: f64 = 3.3;

#[derive(Args)]
pub(crate) struct ChaosArgs {
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
    #[arg(
        long,
        default_value = "rabbitmqctl -q close_all_connections --vhost '{vhost}' 'inboxctl chaos'"
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
        ]
    )]
    hostile: Vec<Hostile>,
}

/// A fault, scheduled at a share of the run's progress.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    KillConsumer,
    DropConnections,
    RestartPostgres,
}

/// Faults spread over 5%..90% of the progress, each at a random point of its own slot, so they
/// hit the run everywhere but never all at once.
fn schedule(kills: usize, drops: usize, restarts: usize, rng: &mut StdRng) -> Vec<(f64, Fault)> {
    let mut plan = Vec::new();
    for (n, fault) in [
        (kills, Fault::KillConsumer),
        (drops, Fault::DropConnections),
        (restarts, Fault::RestartPostgres),
    ] {
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
        self.kills + self.connection_drops + self.postgres_restarts
    }
}

/// One consumer process and where its log goes.
struct Instance {
    child: Child,
    log: PathBuf,
}

struct Fleet<'a> {
    servers: &'a Servers,
    args: &'a ChaosArgs,
    exchange: String,
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
        let exe = std::env::current_exe().context("locating the inboxctl binary")?;
        let mut cmd = Command::new(exe);
        cmd.arg("consume")
            .args(["--schema", &self.args.schema])
            .args(["--queue", &self.args.queue])
            .args(["--exchange", &self.exchange])
            .env("DATABASE_URL", &self.servers.database_url)
            .env("AMQP_URL", &self.servers.amqp_url)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        if let Some(b) = self.args.batch_size {
            cmd.args(["--batch-size", &b.to_string()]);
        }
        let child = cmd
            .kill_on_drop(true)
            .spawn()
            .context("starting a consumer")?;
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
                // A consumer that cannot reach a server at start-up exits with 2 (the CLI's
                // error exit); before any fault, with both servers up, no start may fail;
                // anything else is a crash.
                if early && figures.faults_run() == 0 {
                    figures
                        .launch_failures
                        .push(format!("{status} (log {log})"));
                } else if status.code() == Some(2) && early {
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
) -> Option<(order_service::Verification, rabbit_inbox::QueueDepths)> {
    let v = order_service::verify(pool, schema).await.ok()?;
    // A short-lived connection: the fault schedule closes every connection of the run, and a
    // held one would be closed (and logged by lapin as an error) at every drop.
    let broker = rabbit_inbox::Broker::connect(&servers.amqp_url, "inboxctl chaos")
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

/// Creates the run's virtual host (an existing one is fine) and lets `user` use it.
async fn prepare_vhost(vhost: &str, user: &str) -> anyhow::Result<()> {
    let exists = Command::new("rabbitmqctl")
        .args(["-q", "list_vhosts", "name"])
        .output()
        .await
        .context("running rabbitmqctl (needed to isolate the run in its own vhost)")?;
    let listed = String::from_utf8_lossy(&exists.stdout);
    if !listed.lines().any(|l| l.trim() == vhost) {
        rabbitmqctl(&["-q", "add_vhost", vhost]).await?;
    }
    rabbitmqctl(&["-q", "set_permissions", "-p", vhost, user, ".*", ".*", ".*"]).await
}

/// Runs `rabbitmqctl` with `args` (no shell, so names need no quoting).
async fn rabbitmqctl(args: &[&str]) -> anyhow::Result<()> {
    let shown = format!("rabbitmqctl {}", args.join(" "));
    checked(Command::new("rabbitmqctl").args(args), &shown).await
}

pub(crate) async fn run(servers: &Servers, args: ChaosArgs) -> anyhow::Result<ExitCode> {
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
    let (amqp_url, user) = on_vhost(&servers.amqp_url, &args.vhost)?;
    prepare_vhost(&args.vhost, &user).await?;
    let servers = &Servers {
        database_url: servers.database_url.clone(),
        amqp_url,
    };
    let drop_connections = args
        .drop_connections_command
        .replace("{vhost}", &args.vhost);
    let schema = SchemaName::new(&args.schema)?;
    let exchange = format!("{}.orders", args.queue);
    let config = order_service::config(schema.clone(), &args.queue, &exchange);
    let topology = config.topology.clone();
    let seed = args.seed.unwrap_or_else(rand::random);
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc4a0_5eed);

    let (pool, broker) = clean_slate(servers, &config).await?;

    // At least the asked-for count: the number of messages per order varies with the seed.
    let mut orders = ((args.messages as f64 / MESSAGES_PER_ORDER).ceil() as usize).max(1);
    let mut scenario = Scenario::generate_with(orders, seed, &args.hostile);
    while scenario.messages.len() < args.messages {
        orders += (args.messages - scenario.messages.len()).div_ceil(3);
        scenario = Scenario::generate_with(orders, seed, &args.hostile);
    }
    let hostile = |kind: Hostile| args.hostile.contains(&kind);
    let plan = schedule(
        args.kills,
        args.connection_drops,
        args.postgres_restarts,
        &mut rng,
    );
    println!(
        "rabbit-inbox chaos: seed {seed}, {} consumers, {} kills, {} connection drops, {} PostgreSQL restarts",
        args.consumers, args.kills, args.connection_drops, args.postgres_restarts
    );
    let kinds: Vec<String> = args
        .hostile
        .iter()
        .filter_map(|h| clap::ValueEnum::to_possible_value(h).map(|v| v.get_name().to_owned()))
        .collect();
    println!(
        "replay with: inboxctl chaos --messages {} --seed {seed} --hostile '{}'",
        args.messages,
        kinds.join(",")
    );
    publish_all(&broker, &exchange, &scenario.messages).await?;
    broker.close().await;
    let published = scenario.messages.len();
    println!(
        "published {published} messages ({} unique, {} exact duplicates, {} payments before their order)",
        scenario.unique_keys, scenario.duplicates, scenario.out_of_order
    );

    let log_dir = std::env::temp_dir().join(format!("inbox-chaos-{seed:016x}"));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    println!("consumer logs in {}", log_dir.display());
    let mut fleet = Fleet {
        servers,
        args: &args,
        exchange,
        log_dir,
        instances: Vec::new(),
        started: 0,
    };
    if hostile(Hostile::SimultaneousStart) {
        // A fresh schema: every consumer creates it and runs all migrations as it starts,
        // at the same moment, as a rolling deploy does.
        rabbit_inbox::drop_schema(&pool, &schema)
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
        let Some((v, depths)) = progress(servers, &pool, &schema, &config).await else {
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
            let outcome = match fault {
                Fault::KillConsumer => {
                    let i = rng.random_range(0..fleet.instances.len());
                    let r = fleet.kill(i).await;
                    started_at[i] = Instant::now();
                    figures.kills += 1;
                    figures.restarts += 1;
                    r
                }
                Fault::DropConnections => {
                    figures.connection_drops += 1;
                    shell(&drop_connections).await
                }
                Fault::RestartPostgres => {
                    figures.postgres_restarts += 1;
                    shell(&args.restart_postgres_command).await
                }
            };
            if let Err(e) = outcome {
                faults_failed.push(format!("{fault:?}: {e:#}"));
            }
        }
        if last_line.elapsed() >= Duration::from_secs(2) {
            eprintln!(
                "  {:>5.1} s: {:>6} processed, {:>4} parked, {:>4} waiting to retry, queue {:>6}, \
                 {} kills, {} drops, {} pg restarts",
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
        let all_final = v.processed + v.parked == unique && v.retryable == 0 && v.processing == 0;
        if !acted && next == plan.len() && all_final && depths.work == 0 && depths.retry == 0 {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
    };
    let elapsed = began.elapsed();
    if settled && hostile(Hostile::Expiration) {
        // Past the TTL of the expiring messages' parked copies, so a copy that kept it has
        // expired out of the parking lot before the lot is read.
        let past_ttl = consumers_started + Duration::from_millis(EXPIRATION_MS * 3 / 2);
        tokio::time::sleep_until(past_ttl.into()).await;
    }
    let stop_problems = fleet.stop().await;

    // The verdict, from the database and the broker, after every consumer has stopped.
    let v = order_service::verify(&pool, &schema).await?;
    let broker = connect::rabbitmq(&servers.amqp_url).await?;
    let depths = broker.queue_depths(&topology, &config.retry).await?;
    let parking = ParkingLot::read(&broker, &topology.parking_queue).await?;
    broker.close().await;
    let parking_check = parking.check(&pool, &schema, &scenario).await?;

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
            v.parked == scenario.expected.parked_rows,
        ),
        (
            "payload conflicts parked as expected, without a row",
            parking_check.conflict_keys == scenario.expected.conflicts,
        ),
        (
            "every hostile input parked (with a row, or as a conflict)",
            parking_check.hostile_missing.is_empty(),
        ),
    ];
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
    line("hostile inputs", kinds.join(","));
    for (kind, codes) in &parking_check.hostile_codes {
        line(&format!("  {kind} parked as"), codes.clone());
    }
    line("PROCESSED", v.processed.to_string());
    line("parked (PERMANENT_FAILED / POISONED)", v.parked.to_string());
    line(
        "messages in the parking lot",
        parking.copies.len().to_string(),
    );
    line("lost", lost.to_string());
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
    {
        println!("  - {problem}");
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
    /// Drains the parking lot (the run's queues are recreated by the next run).
    async fn read(broker: &rabbit_inbox::Broker, queue: &str) -> anyhow::Result<Self> {
        let mut copies = Vec::new();
        while let Some(m) = broker.take_one(queue).await? {
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
        }
        Ok(Self { copies })
    }

    async fn check(
        &self,
        pool: &sqlx::PgPool,
        schema: &SchemaName,
        scenario: &Scenario,
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
            if code == rabbit_inbox::PAYLOAD_CONFLICT && conflicts.insert(key.clone()) {
                check.conflict_keys += 1;
            }
            let record = store
                .find(&mut conn, order_service::CONSUMER_NAME, key)
                .await?;
            let status = record.map(|r| r.status);
            if let Some(id) = copy.message_id.as_deref() {
                codes_by_id.insert(id, code);
                if code == rabbit_inbox::PAYLOAD_CONFLICT {
                    as_conflict.insert(id);
                } else if matches!(
                    status,
                    Some(InboxStatus::PermanentFailed | InboxStatus::Poisoned)
                ) {
                    with_row.insert(id);
                }
            }
            match status {
                Some(InboxStatus::Processed) if code != rabbit_inbox::PAYLOAD_CONFLICT => {
                    check.processed_copies += 1;
                    check
                        .problems
                        .push(format!("PROCESSED message {key} parked with {code}"));
                }
                Some(InboxStatus::PermanentFailed | InboxStatus::Poisoned) => {
                    if seen.insert(key.clone()) {
                        check.parked_rows_with_copy += 1;
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
        for h in &scenario.hostile {
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
                rabbit_inbox::PAYLOAD_CONFLICT
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
        let plan = schedule(20, 5, 1, &mut rng);
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
    fn schedule_is_replayable_from_the_seed() {
        let a = schedule(3, 2, 1, &mut StdRng::seed_from_u64(42));
        let b = schedule(3, 2, 1, &mut StdRng::seed_from_u64(42));
        assert_eq!(a, b);
    }
}
