//! `inboxctl recover`: glue over `Operations::recover`.

use std::{process::ExitCode, time::Duration};

use anyhow::Context;
use clap::{Args, ValueEnum};
use inbox_ops::recover::{RecoverRequest, RecoveryPolicy, RecoveryReport};
use rabbit_inbox::RetryPolicy;

use crate::{
    Servers,
    actor::ActorArgs,
    connect,
    report::{InboxArgs, table},
};

/// What to do with the rows found.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum Policy {
    /// Republish the stored payload to the work queue (rows without a payload, or with their
    /// attempts spent, go to manual review).
    Retry,
    /// Move the rows to MANUAL_REVIEW.
    ManualReview,
}

#[derive(Args)]
pub(crate) struct RecoverArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    /// The consumer's work queue, where republished copies go.
    #[arg(long, env = "INBOX_QUEUE")]
    queue: String,
    /// Who runs the recovery and why (audited; not needed for --dry-run).
    #[command(flatten)]
    actor: ActorArgs,
    /// Republish, or set aside for manual review.
    #[arg(long, value_enum, default_value = "retry")]
    policy: Policy,
    /// Find and classify only; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// The consumer's retry tier delays, comma-separated: a RETRYABLE_FAILED row counts as
    /// lost once its tier's delay plus --grace has passed since it failed [default: the
    /// library's tiers]
    #[arg(long, env = "INBOX_RETRY_DELAYS", value_delimiter = ',', value_parser = humantime::parse_duration)]
    retry_delays: Vec<Duration>,
    /// Added to a tier's delay before a retry counts as lost.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    grace: Duration,
    /// The consumer's attempt budget: a stale PROCESSING row that has spent it goes to manual
    /// review instead of being republished.
    #[arg(long, env = "INBOX_MAX_ATTEMPTS", default_value_t = 5)]
    max_attempts: i32,
    /// A PROCESSING row without a lease (not from leased mode) counts as stale after this.
    #[arg(long, env = "INBOX_STALE_AFTER", default_value = "5m", value_parser = humantime::parse_duration)]
    stale_after: Duration,
    /// Most rows per run.
    #[arg(long, default_value_t = 1000)]
    limit: usize,
}

pub(crate) async fn run(servers: &Servers, args: RecoverArgs) -> anyhow::Result<ExitCode> {
    let Some(consumer) = args.inbox.consumer.clone() else {
        anyhow::bail!("--consumer is required: recovery acts on one consumer's rows");
    };
    // A dry run changes nothing, so it needs no one to answer for it.
    let actor = if args.dry_run {
        None
    } else {
        Some(args.actor.required()?)
    };
    let mut retry = if args.retry_delays.is_empty() {
        RetryPolicy::default()
    } else {
        RetryPolicy::tiered(args.retry_delays.clone())
    };
    retry.max_attempts = args.max_attempts;
    retry.stale_processing_after = args.stale_after;
    let request = RecoverRequest {
        consumer,
        work_queue: args.queue.clone(),
        policy: match args.policy {
            Policy::Retry => RecoveryPolicy::Retry,
            Policy::ManualReview => RecoveryPolicy::ManualReview,
        },
        retry,
        grace: args.grace,
        limit: args.limit,
        dry_run: args.dry_run,
    };
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let report = match &actor {
        None => ops
            .recover_preview(&request)
            .await
            .context("recovery dry run failed")?,
        Some(actor) => {
            let broker = connect::rabbitmq(&servers.amqp_url).await?;
            let report = {
                let bar = args.inbox.progress("recovering");
                ops.recover(&broker, actor, &request, &bar).await
            };
            broker.close().await;
            report.context("recovery failed")?
        }
    };
    args.inbox.print(&report, render)?;
    Ok(if report.failed > 0 {
        eprintln!(
            "{} row(s) could not be recovered and were left as they were; run again",
            report.failed
        );
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn render(report: &RecoveryReport) -> comfy_table::Table {
    let mut t = table([
        "message id",
        "type",
        "status",
        "cause",
        "attempt",
        "stuck since",
        if report.dry_run { "would" } else { "action" },
        "detail",
    ]);
    for m in &report.messages {
        t.add_row([
            m.message_id.clone(),
            m.message_type.clone(),
            m.status.clone(),
            serde_plain(&m.cause),
            m.attempt.to_string(),
            m.stuck_since.map(|s| s.to_rfc3339()).unwrap_or_default(),
            serde_plain(&m.action),
            m.detail.clone().unwrap_or_default(),
        ]);
    }
    t.add_row([
        format!(
            "{} found: {} republished, {} to manual review, {} skipped, {} failed{}",
            report.found,
            report.republished,
            report.manual_review,
            report.skipped,
            report.failed,
            if report.dry_run { " (dry run)" } else { "" }
        ),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
    ]);
    t
}

/// A unit enum variant as its serialized name.
fn serde_plain<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}
