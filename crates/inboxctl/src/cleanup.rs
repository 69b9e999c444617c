//! `inboxctl cleanup`: retention for one consumer, glue over `Operations::cleanup`.

use std::{process::ExitCode, time::Duration};

use anyhow::{Context, bail};
use clap::Args;
use inbox_ops::{
    Actor, OpsError,
    retention::{CleanupReport, CleanupRequest},
};
use rabbit_inbox::{
    RetryPolicy, retention::RetentionMode, retention::RetentionPolicy, retention::TypeRetention,
};

use crate::{
    Servers, connect,
    report::{InboxArgs, table},
};

#[derive(Args)]
pub(crate) struct CleanupArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    /// Count what would be scrubbed, removed and expired; change nothing.
    #[arg(long)]
    dry_run: bool,
    /// Rows per statement (each batch is its own short transaction).
    #[arg(long, default_value_t = 5000)]
    batch: u32,
    /// PROCESSED rows are removed this long after processing (the dedup window).
    #[arg(long, env = "INBOX_PROCESSED_RETENTION", value_parser = humantime::parse_duration, default_value = "30days")]
    processed_retention: Duration,
    /// Per message type, TYPE=DURATION (repeatable), e.g. `--type-retention ledger.entry=90days`.
    #[arg(long, env = "INBOX_TYPE_RETENTION", value_delimiter = ',', value_parser = type_retention)]
    type_retention: Vec<(String, Duration)>,
    /// Parked rows (PERMANENT_FAILED, POISONED) are removed this long after their last failure
    /// [default: kept].
    #[arg(long, env = "INBOX_PARKED_RETENTION", value_parser = humantime::parse_duration)]
    parked_retention: Option<Duration>,
    /// Payloads and headers of PROCESSED rows are removed this long after processing.
    #[arg(long, env = "INBOX_SCRUB_AFTER", value_parser = humantime::parse_duration, default_value = "3days")]
    scrub_after: Duration,
    /// Do not scrub payloads (they go with their rows); overrides --scrub-after.
    #[arg(long)]
    no_scrub: bool,
    /// Tombstones of removed rows are kept this long.
    #[arg(long, env = "INBOX_TOMBSTONE_RETENTION", value_parser = humantime::parse_duration, default_value = "180days")]
    tombstone_retention: Duration,
    /// How long after parking a message may still be replayed from the parking lot (the
    /// consumer's `retention.parking_replay_window`).
    #[arg(long, env = "INBOX_REPLAY_WINDOW", value_parser = humantime::parse_duration, default_value = "14days")]
    replay_window: Duration,
    /// The consumer's retry tiers, for the window check [default: the library's].
    #[arg(long, env = "INBOX_RETRY_DELAYS", value_delimiter = ',', value_parser = humantime::parse_duration)]
    retry_delays: Vec<Duration>,
    /// The consumer's attempt budget, for the window check [default: the library's].
    #[arg(long, env = "INBOX_MAX_ATTEMPTS")]
    max_attempts: Option<i32>,
    /// Move expired rows to inbox_archive instead of deleting them.
    #[arg(long)]
    archive: bool,
    /// Run although the dedup window is shorter than the redelivery horizon (audited; needs
    /// --actor and --reason).
    #[arg(long, requires_all = ["actor", "reason"])]
    force: bool,
    /// Who forces the run.
    #[arg(long)]
    actor: Option<String>,
    /// Why.
    #[arg(long)]
    reason: Option<String>,
    /// Ticket to cite beside the reason.
    #[arg(long)]
    ticket: Option<String>,
}

fn type_retention(s: &str) -> Result<(String, Duration), String> {
    let (ty, d) = s
        .split_once('=')
        .ok_or_else(|| format!("expected TYPE=DURATION, got {s:?}"))?;
    let d = humantime::parse_duration(d).map_err(|e| e.to_string())?;
    Ok((ty.to_owned(), d))
}

impl CleanupArgs {
    fn request(&self) -> anyhow::Result<CleanupRequest> {
        let Some(consumer) = self.inbox.consumer.clone() else {
            bail!("cleanup needs --consumer (retention runs per consumer)");
        };
        let scrub = (!self.no_scrub).then_some(self.scrub_after);
        let retention = RetentionPolicy {
            processed: self.processed_retention,
            parked: self.parked_retention,
            scrub_payload_after: scrub,
            per_type: self
                .type_retention
                .iter()
                .map(|(ty, d)| {
                    let t = TypeRetention {
                        processed: *d,
                        scrub_payload_after: None,
                    };
                    (ty.clone(), t)
                })
                .collect(),
            tombstones: self.tombstone_retention,
            parking_replay_window: self.replay_window,
            mode: if self.archive {
                RetentionMode::Archive
            } else {
                RetentionMode::Delete
            },
            batch_size: self.batch,
            interval: None,
        };
        let mut retry = if self.retry_delays.is_empty() {
            RetryPolicy::default()
        } else {
            RetryPolicy::tiered(self.retry_delays.clone())
        };
        if let Some(n) = self.max_attempts {
            retry.max_attempts = n;
        }
        let mut request = CleanupRequest::new(consumer, retention, retry);
        request.dry_run = self.dry_run;
        if self.force {
            let actor = Actor::new(
                self.actor.clone().unwrap_or_default(),
                self.reason.clone().unwrap_or_default(),
            )?;
            request.force = Some(actor.with_ticket(self.ticket.clone().unwrap_or_default())?);
        }
        Ok(request)
    }
}

pub(crate) async fn run(servers: &Servers, args: CleanupArgs) -> anyhow::Result<ExitCode> {
    let request = args.request()?;
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let bar = args
        .inbox
        .progress(if args.dry_run { "counting" } else { "cleaning" });
    let report = match ops.cleanup(&request, &bar).await {
        Ok(report) => report,
        // Refused (an unsafe window, another cleaner at work): exit 1, like every refusal.
        Err(OpsError::Refused(why)) => {
            drop(bar);
            eprintln!(
                "cleanup of {}: refused: {}",
                request.consumer,
                in_flag_names(&why)
            );
            return Ok(ExitCode::FAILURE);
        }
        Err(e) => return Err(e).with_context(|| format!("cleanup of {}", request.consumer)),
    };
    drop(bar);
    args.inbox.print(&report, render)?;
    Ok(ExitCode::SUCCESS)
}

/// A refusal names the library's settings (`retention.processed`, ...); on the command line
/// they are this command's flags.
fn in_flag_names(message: &str) -> String {
    [
        ("retention.parking_replay_window", "--replay-window"),
        ("retention.processed", "--processed-retention"),
        ("retention.parked", "--parked-retention"),
        // `retention.per_type["ledger.entry"].processed` -> `--type-retention "ledger.entry"`
        ("retention.per_type[", "--type-retention "),
        ("].processed", ""),
    ]
    .into_iter()
    .fold(message.to_owned(), |m, (setting, flag)| {
        m.replace(setting, flag)
    })
}

fn render(r: &CleanupReport) -> comfy_table::Table {
    let verb = if r.dry_run { "would be " } else { "" };
    let removed = match r.mode {
        RetentionMode::Delete => "deleted",
        RetentionMode::Archive => "archived",
        _ => "removed",
    };
    let mut t = table(["consumer", "what", "rows"]);
    for (what, n) in [
        (format!("payloads {verb}scrubbed"), r.scrubbed),
        (
            format!("PROCESSED rows {verb}{removed}"),
            r.removed_processed,
        ),
        (format!("parked rows {verb}{removed}"), r.removed_parked),
        (format!("tombstones {verb}expired"), r.tombstones_expired),
    ] {
        t.add_row([r.consumer.clone(), what, n.to_string()]);
    }
    let note = format!(
        "{} statements in {} ms; redelivery horizon {}{}",
        r.batches,
        r.elapsed_ms,
        humantime::format_duration(Duration::from_secs(r.horizon_secs)),
        if r.forced {
            "; FORCED past an unsafe window (audited)"
        } else {
            ""
        }
    );
    t.add_row([String::new(), note, String::new()]);
    t
}
