//! `inboxctl redrive`: move parked messages back to the work queue after a fix (or, with
//! `--discard`, remove the copies of parked rows), each one classified against its inbox row
//! first.

use std::process::ExitCode;

use clap::Args;
use inbox_ops::redrive::{ParkedAction, RedriveReport, RedriveRequest};

use crate::{
    Servers,
    actor::ActorArgs,
    connect,
    report::{InboxArgs, table},
    when,
};

#[derive(Args)]
pub(crate) struct RedriveArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    /// The consumer's work queue; the parking lot is `<queue>.parking-lot` unless given.
    #[arg(long)]
    queue: String,
    /// The parking-lot queue, when not `<queue>.parking-lot`.
    #[arg(long)]
    parking_queue: Option<String>,
    /// Report what the run would do (would_move, would_remove, would_discard), changing
    /// nothing.
    #[arg(long)]
    dry_run: bool,
    /// Only this message type.
    #[arg(long = "type")]
    message_type: Option<String>,
    /// Only this error code.
    #[arg(long)]
    error_code: Option<String>,
    /// Only copies parked at or after (RFC 3339, or a duration ago: 2h).
    #[arg(long, value_parser = when::instant)]
    since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only copies parked before (RFC 3339, or a duration ago).
    #[arg(long, value_parser = when::instant)]
    until: Option<chrono::DateTime<chrono::Utc>>,
    /// Only the copies of this inbox key; repeat for several (all keys when omitted).
    #[arg(long = "message-id", value_name = "ID")]
    message_ids: Vec<String>,
    /// At most this many moves (or discards) per second.
    #[arg(long)]
    rate: Option<f64>,
    /// At most this many messages moved (or discarded).
    #[arg(long)]
    limit: Option<u64>,
    /// Also replay messages whose inbox row retention removed (their effect applies again)
    /// and messages the inbox does not know; audited as forced_replay.
    #[arg(long)]
    force: bool,
    /// Remove copies whose row is PROCESSED (effect already applied) instead of leaving them
    /// in the parking lot; audited. (A copy left by a killed redrive is removed without it.)
    #[arg(long)]
    drop_processed: bool,
    /// Remove the selected copies whose row is parked (PERMANENT_FAILED, POISONED,
    /// MANUAL_REVIEW) instead of moving them: each removal is audited (discard) before its copy
    /// is acked, and the row keeps its status and data, noting when its copy was discarded.
    /// Copies of other rows are left where they are. Not with --force or --drop-processed.
    #[arg(long, conflicts_with_all = ["force", "drop_processed"])]
    discard: bool,
    #[command(flatten)]
    actor: ActorArgs,
}

pub(crate) async fn run(servers: &Servers, args: RedriveArgs) -> anyhow::Result<ExitCode> {
    let actor = if args.dry_run {
        None
    } else {
        Some(args.actor.required()?)
    };
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let parking = args
        .parking_queue
        .clone()
        .unwrap_or_else(|| rabbit_inbox::Topology::new(args.queue.clone()).parking_queue);
    let lot = connect::parking_lot(&servers.amqp_url, &args.queue, &parking).await?;
    let request = RedriveRequest {
        dry_run: args.dry_run,
        consumer: args.inbox.consumer.clone(),
        message_type: args.message_type.clone(),
        error_code: args.error_code.clone(),
        since: args.since,
        until: args.until,
        rate_per_sec: args.rate,
        limit: args.limit,
        force: args.force,
        drop_processed: args.drop_processed,
        discard: args.discard,
        message_ids: args.message_ids.clone(),
        job: None,
    };
    let result = {
        let bar = args
            .inbox
            .progress(if args.discard { "discard" } else { "redrive" });
        ops.redrive(&lot, &request, actor.as_ref(), &bar).await
    };
    lot.close().await;
    let report = result?;
    args.inbox.print(&report, render)?;
    // Refused copies need an operator's decision: not a clean run.
    if report.action(ParkedAction::Refused) > 0 {
        eprintln!(
            "{} parked message(s) refused; see the findings (--force replays them)",
            report.action(ParkedAction::Refused)
        );
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn render(r: &RedriveReport) -> comfy_table::Table {
    let mut t = table(["", "count"]);
    t.add_row(vec![
        if r.dry_run {
            "parked (dry run)".to_owned()
        } else {
            "parked".to_owned()
        },
        r.parked_at_start.to_string(),
    ]);
    t.add_row(vec!["examined".to_owned(), r.examined.to_string()]);
    for (class, n) in &r.classes {
        t.add_row(vec![format!("class {class}"), n.to_string()]);
    }
    for (action, n) in &r.actions {
        t.add_row(vec![format!("action {action}"), n.to_string()]);
    }
    if r.user_id_not_restored > 0 {
        t.add_row(vec![
            "user-id kept in header".to_owned(),
            r.user_id_not_restored.to_string(),
        ]);
    }
    for f in &r.findings {
        t.add_row(vec![
            format!(
                "{} {}",
                f.message_id.as_deref().unwrap_or("(no key)"),
                serde_json::to_value(f.action)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default()
            ),
            f.detail.clone(),
        ]);
    }
    t
}
