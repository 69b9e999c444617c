//! `inbox-lab bench`: glue over `inbox-bench`.

use std::{process::ExitCode, time::Duration};

use clap::Args;
use rabbit_inbox::SchemaName;

use crate::{Servers, connect};

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Deliveries per run.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Body size in bytes.
    #[arg(long, default_value_t = 320)]
    payload_size: usize,
    /// Share of deliveries that repeat an earlier message (same id and body), 0 to 0.9.
    #[arg(long, default_value_t = 0.0)]
    duplicates: f64,
    /// Share of unique messages the handlers refuse permanently (they are parked), 0 to 0.5;
    /// shows what failing messages cost (the batch handler names them all at once).
    #[arg(long, default_value_t = 0.0)]
    failures: f64,
    /// Aggregates the messages are spread over: message n carries `x-aggregate-id` n modulo
    /// this, the key of the ordered modes. A prime, so that evenly spread failing messages
    /// (every 10th at 0.1) hit every key; 0 sends no aggregate id (no ordered modes then).
    #[arg(long, default_value_t = 997)]
    keys: usize,
    /// rabbit-inbox batch size (default: the library's).
    #[arg(long)]
    batch_size: Option<usize>,
    /// rabbit-inbox lanes (default: the library's).
    #[arg(long)]
    lanes: Option<usize>,
    /// rabbit-inbox prefetch (default: the library's).
    #[arg(long)]
    prefetch: Option<u16>,
    /// Prefetch of the broker-ceiling consumer.
    #[arg(long, default_value_t = 1000)]
    ceiling_prefetch: u16,
    /// Multiple-ack interval of the broker-ceiling consumer.
    #[arg(long, default_value_t = 250)]
    ceiling_ack_every: usize,
    /// Repetitions; the table shows medians.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Rate of the low-load latency run in messages per second (0 skips it).
    #[arg(long, default_value_t = 100)]
    low_load_rate: u32,
    /// Duration of the low-load run in seconds.
    #[arg(long, default_value_t = 5)]
    low_load_secs: u64,
    /// Also measure the batch handler with the inbox already holding this many rows
    /// (repeatable, e.g. --prefill 1000000 --prefill 10000000).
    #[arg(long)]
    prefill: Vec<u64>,
    /// Modes to run, comma-separated: ceiling, textbook, per-message, batch (default: these
    /// four); per-message-late: the per-message handler refusing failing messages in `handle`
    /// instead of `check` (with --failures, what a refusal after effects costs);
    /// per-message-ordered and batch-ordered: the same consumers ordered by aggregate
    /// (a failed message holds the rest of its key; the report gives their cost as ratios to
    /// the unordered twins run in the same rounds); and outbox: a plain confirmed publisher
    /// against the outbox relay (NOTIFY, and polling), plus the commit rate of outbox
    /// transactions with and without NOTIFY.
    #[arg(long, value_delimiter = ',')]
    modes: Vec<String>,
    /// Outbox mode: concurrent writer transactions.
    #[arg(long, default_value_t = 4)]
    writers: usize,
    /// Outbox mode: messages enqueued per transaction.
    #[arg(long, default_value_t = 10)]
    per_transaction: usize,
    /// PostgreSQL schema of the benchmark (recreated for every run).
    #[arg(long, default_value = "inbox_bench")]
    schema: String,
    /// Prefix of the benchmark's queue names, so runs side by side on one broker do not meet.
    #[arg(long, default_value = "inbox-bench")]
    queue_prefix: String,
    /// Quorum queues (work, retry tiers, parking lot) for every mode, as on a cluster; with
    /// every node's URL in --amqp-url the run measures the cluster.
    #[arg(long)]
    quorum: bool,
    /// Print one JSON object as the last line.
    #[arg(long)]
    json: bool,
    /// Instead of draining a full queue, find the highest publish rate each library mode
    /// (per-message and batch, or those --modes names) keeps up with: probes of --probe-secs,
    /// then a hold of --hold-secs at the rate found. A rate holds when the publisher keeps up,
    /// the backlog stays under 2 s of publishing after the first tenth of the window, and ends
    /// under 1 s. Each run starts with a drain run of --messages, for the ratio.
    #[arg(long)]
    sustained: bool,
    /// Sustained: how long the rate found must hold.
    #[arg(long, default_value_t = 600)]
    hold_secs: u64,
    /// Sustained: length of each probe of the search.
    #[arg(long, default_value_t = 30)]
    probe_secs: u64,
    /// Sustained: most probes per search (up 15% while they hold, down 15% while they do not,
    /// then one bisection).
    #[arg(long, default_value_t = 6)]
    probes: usize,
}

pub(crate) async fn run(servers: &Servers, args: BenchArgs) -> anyhow::Result<ExitCode> {
    if !(0.0..=0.9).contains(&args.duplicates) {
        anyhow::bail!("--duplicates must be between 0 and 0.9");
    }
    if !(0.0..=0.5).contains(&args.failures) {
        anyhow::bail!("--failures must be between 0 and 0.5");
    }
    let outbox = args.modes.iter().any(|m| m == "outbox");
    let modes: Vec<String> = args
        .modes
        .iter()
        .filter(|m| *m != "outbox")
        .cloned()
        .collect();
    let pool = connect::postgres(
        &servers.database_url,
        connect::pool_size(args.lanes.unwrap_or(0).max(args.writers)),
    )
    .await?;
    connect::rabbitmq(&servers.amqp_url).await?.close().await;
    let mut exactly_once = true;
    if outbox {
        let options = inbox_bench::outbox::OutboxOptions {
            messages: args.messages,
            payload_size: args.payload_size,
            writers: args.writers,
            per_transaction: args.per_transaction,
            runs: args.runs,
            schema: SchemaName::new(format!("{}_outbox", args.schema))?,
            queue: "inbox-bench-outbox".into(),
        };
        let report = inbox_bench::outbox::run(&servers.amqp_url, &pool, &options, |line| {
            eprintln!("{line}")
        })
        .await?;
        println!("{report}");
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        }
        exactly_once &= report.exactly_once();
        if modes.is_empty() {
            return Ok(verdict(exactly_once));
        }
    }
    let options = inbox_bench::BenchOptions {
        messages: args.messages,
        payload_size: args.payload_size,
        duplicate_share: args.duplicates,
        failure_share: args.failures,
        keys: args.keys,
        batch_size: args.batch_size,
        lanes: args.lanes,
        prefetch: args.prefetch,
        ceiling_prefetch: args.ceiling_prefetch,
        ceiling_ack_every: args.ceiling_ack_every,
        runs: args.runs,
        low_load_rate: args.low_load_rate,
        low_load_duration: Duration::from_secs(args.low_load_secs),
        prefill: args.prefill,
        modes,
        schema: SchemaName::new(args.schema)?,
        queue_prefix: args.queue_prefix,
        quorum: args.quorum,
    };
    if args.sustained {
        let options = inbox_bench::sustained::SustainedOptions {
            bench: options,
            hold: Duration::from_secs(args.hold_secs),
            probe: Duration::from_secs(args.probe_secs),
            probes: args.probes,
        };
        let report = inbox_bench::sustained::run(&servers.amqp_url, &pool, &options, |line| {
            eprintln!("{line}")
        })
        .await?;
        println!("{report}");
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        }
        return Ok(verdict(exactly_once && report.exactly_once()));
    }
    let report = inbox_bench::run(&servers.amqp_url, &pool, &options, |line| {
        eprintln!("{line}")
    })
    .await?;
    println!("{report}");
    exactly_once &= report.exactly_once();
    if args.json {
        println!("{}", report.json());
    }
    Ok(verdict(exactly_once))
}

fn verdict(exactly_once: bool) -> ExitCode {
    if exactly_once {
        ExitCode::SUCCESS
    } else {
        eprintln!("exactly-once check FAILED");
        ExitCode::FAILURE
    }
}
