//! `inboxctl status`: counts and ages per consumer and status, stale PROCESSING rows, the last
//! hour's failures and duplicate deliveries, and the broker's queue depths.

use std::process::ExitCode;

use clap::Args;
use inbox_ops::inspect::{StatusQuery, StatusReport};

use crate::{
    Servers, connect,
    report::{InboxArgs, QueueArgs, table},
    when,
};

#[derive(Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    #[command(flatten)]
    queues: QueueArgs,
    /// A PROCESSING row whose attempt started longer ago than this is stale (a leased one:
    /// once its lease expired). The "overdue" column leaves out rows waiting for their retry
    /// (--retry-delays) and leases still heartbeating.
    #[arg(long, env = "INBOX_STALE_AFTER", value_parser = when::duration, default_value = "5m")]
    stale_after: std::time::Duration,
    /// Also count every PROCESSED row (scans the table; by default only the last hour's are
    /// counted, through the processed_at index).
    #[arg(long)]
    count_processed: bool,
}

pub(crate) async fn run(servers: &Servers, args: StatusArgs) -> anyhow::Result<ExitCode> {
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let lot = args.queues.parking_lot(&servers.amqp_url).await?;
    let report = ops
        .status(
            &StatusQuery {
                consumer: args.inbox.consumer.clone(),
                stale_after: args.stale_after,
                retry_delays: args.queues.retry_delays.0.clone(),
                count_processed: args.count_processed,
            },
            lot.as_ref(),
        )
        .await?;
    if let Some(lot) = lot {
        lot.close().await;
    }
    args.inbox.print(&report, render)?;
    Ok(ExitCode::SUCCESS)
}

fn render(r: &StatusReport) -> comfy_table::Table {
    let mut t = table([
        "consumer",
        "status",
        "rows",
        "oldest age",
        "overdue",
        "stale",
        "failed 1h",
        "duplicates 1h",
        "conflicts 1h",
        "processed 1h",
    ]);
    let n = |v: Option<i64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    for l in &r.lines {
        t.add_row(vec![
            l.consumer.clone(),
            l.status.to_string(),
            n(l.rows),
            when::age(l.oldest_age_secs),
            when::age(l.overdue_age_secs),
            l.stale.to_string(),
            l.failed_last_hour.to_string(),
            l.duplicates_last_hour.to_string(),
            l.conflicts_last_hour.to_string(),
            n(l.processed_last_hour),
        ]);
    }
    if let Some(b) = &r.broker {
        for q in [&b.work, &b.parking] {
            let depth = q
                .messages
                .map_or_else(|| "missing".to_owned(), |m| m.to_string());
            t.add_row(vec![format!("queue {}", q.queue), "ready".into(), depth]);
        }
    }
    t
}
