//! `inbox-lab bench-ledger`: glue over `inbox_bench::ledger_layout`.

use std::{process::ExitCode, time::Duration};

use clap::Args;
use inbox_bench::ledger_layout::{LedgerBenchOptions, LedgerLayout, run};
use rabbit_inbox::SchemaName;

use crate::{Servers, connect};

#[derive(Args)]
pub(crate) struct BenchLedgerArgs {
    /// Rows in the ledger before the run (generated, oldest first).
    #[arg(long, default_value_t = 100_000_000)]
    rows: u64,
    /// Share of the rows past the 30-day window.
    #[arg(long, default_value_t = 0.3)]
    expired_share: f64,
    /// Layouts to measure, one after the other: `table` (today's ledger, retention deletes
    /// rows) and `generations` (partitioned by generation, retention drops a partition).
    #[arg(long, value_delimiter = ',', default_value = "table,generations")]
    layouts: Vec<LedgerLayout>,
    /// Generations per 30-day window in the partitioned layout.
    #[arg(long, default_value_t = 3)]
    generations_per_window: u32,
    /// Rows per cleanup statement (table layout).
    #[arg(long, default_value_t = 5000)]
    cleanup_batch: u32,
    /// Claims per load transaction (a tenth duplicates of rows inside the window).
    #[arg(long, default_value_t = 100)]
    load_batch: usize,
    /// Concurrent load transactions.
    #[arg(long, default_value_t = 2)]
    load_workers: usize,
    /// Seconds of the phases before and after the pin.
    #[arg(long, default_value_t = 120)]
    phase_secs: u64,
    /// Seconds a REPEATABLE READ transaction holds its snapshot (and so the xmin horizon).
    #[arg(long, default_value_t = 600)]
    pin_secs: u64,
    /// Scratch schema (recreated, dropped at the end).
    #[arg(long, default_value = "inbox_bench_ledger")]
    schema: String,
    /// Print the figures as JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run_bench(
    servers: &Servers,
    args: BenchLedgerArgs,
) -> anyhow::Result<ExitCode> {
    let pool =
        connect::postgres(&servers.database_url, connect::pool_size(args.load_workers)).await?;
    let options = LedgerBenchOptions {
        rows: args.rows,
        expired_share: args.expired_share,
        generations_per_window: args.generations_per_window,
        cleanup_batch: args.cleanup_batch,
        load_batch: args.load_batch,
        load_workers: args.load_workers,
        phase: Duration::from_secs(args.phase_secs),
        pin: Duration::from_secs(args.pin_secs),
        layouts: args.layouts,
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
