//! `inbox-lab bench-retention`: glue over `inbox_bench::retention`.

use std::{process::ExitCode, time::Duration};

use clap::Args;
use inbox_bench::retention::{RetentionBenchOptions, run};
use rabbit_inbox::SchemaName;

use crate::{Servers, connect};

#[derive(Args)]
pub(crate) struct BenchRetentionArgs {
    /// Rows in the inbox before cleanup.
    #[arg(long, default_value_t = 10_000_000)]
    rows: u64,
    /// Share of the rows past the 30-day window.
    #[arg(long, default_value_t = 0.3)]
    expired_share: f64,
    /// Rows per cleanup statement.
    #[arg(long, default_value_t = 5000)]
    batch: u32,
    /// Claims per load transaction (a tenth duplicates of rows inside the window).
    #[arg(long, default_value_t = 100)]
    load_batch: usize,
    /// Concurrent load transactions.
    #[arg(long, default_value_t = 2)]
    load_workers: usize,
    /// Seconds of load alone, the baseline.
    #[arg(long, default_value_t = 20)]
    baseline_secs: u64,
    /// Batches of the plain LIMIT delete loop to time first (0 skips it).
    #[arg(long, default_value_t = 40)]
    naive_batches: u32,
    /// Scratch schema (recreated, dropped at the end).
    #[arg(long, default_value = "inbox_bench_retention")]
    schema: String,
    /// Print the figures as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run_bench(
    servers: &Servers,
    args: BenchRetentionArgs,
) -> anyhow::Result<ExitCode> {
    let pool =
        connect::postgres(&servers.database_url, connect::pool_size(args.load_workers)).await?;
    let options = RetentionBenchOptions {
        rows: args.rows,
        expired_share: args.expired_share,
        batch: args.batch,
        load_batch: args.load_batch,
        load_workers: args.load_workers,
        baseline: Duration::from_secs(args.baseline_secs),
        naive_batches: args.naive_batches,
        schema: SchemaName::new(&args.schema)?,
    };
    let result = run(&pool, &options, |step| eprintln!("{step} ...")).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        print!("{}", result.render());
    }
    Ok(ExitCode::SUCCESS)
}
