//! `inboxctl replay-edited`: replace a parked message by an edited copy under a new id; audited.

use std::{io::Read, path::PathBuf, process::ExitCode};

use anyhow::Context;
use clap::Args;
use inbox_ops::{
    OpsError,
    replay::{DiffOp, ReplayEditedReport, ReplayEditedRequest, WorkQueue},
};

use crate::{
    Servers,
    actor::ActorArgs,
    connect,
    report::{InboxArgs, table},
};

#[derive(Args)]
pub(crate) struct ReplayEditedArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    /// The parked message's inbox key.
    #[arg(long, value_name = "ID")]
    message_id: String,
    /// File holding the edited body, published as it is (`-`: standard input). JSON when the
    /// original is JSON.
    #[arg(long, value_name = "FILE")]
    body_file: PathBuf,
    /// The consumer's work queue, where the replacement goes; the original's parked copy is
    /// removed from `<queue>.parking-lot` unless --parking-queue names another. Required
    /// unless --dry-run.
    #[arg(long, env = "INBOX_QUEUE", required_unless_present = "dry_run")]
    queue: Option<String>,
    /// The parking-lot queue, when not `<queue>.parking-lot`.
    #[arg(long, env = "INBOX_PARKING_QUEUE", requires = "queue")]
    parking_queue: Option<String>,
    /// Show the diff, the changed paths and the new id only; publish and change nothing (needs
    /// no broker, and no --actor or --reason).
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    actor: ActorArgs,
}

pub(crate) async fn run(servers: &Servers, args: ReplayEditedArgs) -> anyhow::Result<ExitCode> {
    let Some(consumer) = args.inbox.consumer.clone() else {
        anyhow::bail!("replay-edited acts on one row: pass --consumer");
    };
    // A dry run changes nothing, so it needs no one to answer for it.
    let actor = if args.dry_run {
        None
    } else {
        Some(args.actor.required()?)
    };
    let body = if args.body_file.as_os_str() == "-" {
        let mut body = Vec::new();
        std::io::stdin()
            .read_to_end(&mut body)
            .context("reading the edited body from standard input")?;
        body
    } else {
        std::fs::read(&args.body_file)
            .with_context(|| format!("reading the edited body {}", args.body_file.display()))?
    };
    let request = ReplayEditedRequest {
        consumer,
        message_id: args.message_id.clone(),
        body,
        dry_run: args.dry_run,
    };
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let result = match (&actor, args.queue.as_deref()) {
        (Some(actor), Some(queue)) => {
            let parking = args
                .parking_queue
                .clone()
                .unwrap_or_else(|| rabbit_inbox::Topology::new(queue).parking_queue);
            let broker = connect::rabbitmq(&servers.amqp_url).await?;
            let lot = match connect::parking_lot(&servers.amqp_url, queue, &parking).await {
                Ok(lot) => lot,
                Err(e) => {
                    broker.close().await;
                    return Err(e);
                }
            };
            let result = ops
                .replay_edited(&WorkQueue::new(&broker, queue), Some(&lot), &request, actor)
                .await;
            lot.close().await;
            broker.close().await;
            result
        }
        (Some(_), None) => anyhow::bail!("--queue is required: the replacement is published there"),
        (None, _) => ops.replay_edited_preview(&request).await,
    };
    let report = match result {
        Ok(report) => report,
        // Refused, or a request that cannot be (no such row, nothing edited, not JSON).
        Err(e @ (OpsError::Refused(_) | OpsError::Invalid(_) | OpsError::NotFound(_))) => {
            eprintln!("{e}");
            return Ok(ExitCode::FAILURE);
        }
        Err(e) => return Err(e.into()),
    };
    if !args.inbox.json {
        for line in &report.diff {
            let mark = match line.op {
                DiffOp::Keep => ' ',
                DiffOp::Remove => '-',
                DiffOp::Add => '+',
            };
            println!("{mark} {}", line.text);
        }
    }
    args.inbox.print(&report, render)?;
    if let Some(follow_up) = &report.follow_up {
        eprintln!("{follow_up}");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn render(r: &ReplayEditedReport) -> comfy_table::Table {
    let mut t = table(["", ""]);
    let yes_no = |b: bool| if b { "yes" } else { "no" }.to_owned();
    t.add_row(vec!["message id".to_owned(), r.original_id.clone()]);
    t.add_row(vec!["consumer".to_owned(), r.consumer.clone()]);
    t.add_row(vec![
        if r.dry_run {
            "replacement id (dry run)".to_owned()
        } else {
            "replacement id".to_owned()
        },
        r.replacement_id.clone(),
    ]);
    t.add_row(vec![
        "original sha256".to_owned(),
        r.original_sha256.clone(),
    ]);
    t.add_row(vec!["edited sha256".to_owned(), r.edited_sha256.clone()]);
    t.add_row(vec![
        "changed paths".to_owned(),
        r.changed_paths
            .iter()
            .map(|p| if p.is_empty() { "(whole body)" } else { p })
            .collect::<Vec<_>>()
            .join("\n"),
    ]);
    if !r.dry_run {
        t.add_row(vec!["published".to_owned(), yes_no(r.published)]);
        t.add_row(vec![
            "parked copy removed".to_owned(),
            yes_no(r.parked_copy_removed),
        ]);
        if let Some(id) = r.audit_id {
            t.add_row(vec!["audit".to_owned(), format!("#{id} replay_edited")]);
        }
    }
    t
}
