//! `inboxctl reopen <message-id>`: reopen a failed row (or, forced, a processed one) so the
//! next delivery runs the handler again; audited.

use std::process::ExitCode;

use clap::Args;
use inbox_ops::{OpsError, reopen::Reopened};

use crate::{
    Servers,
    actor::ActorArgs,
    connect,
    report::{InboxArgs, table},
};

#[derive(Args)]
pub(crate) struct ReopenArgs {
    /// The row's inbox key.
    message_id: String,
    #[command(flatten)]
    inbox: InboxArgs,
    #[command(flatten)]
    actor: ActorArgs,
    /// Also reopen a PROCESSED row: its next delivery applies the effect a second time
    /// (audited as forced_replay).
    #[arg(long)]
    force_replay: bool,
}

pub(crate) async fn run(servers: &Servers, args: ReopenArgs) -> anyhow::Result<ExitCode> {
    let Some(consumer) = args.inbox.consumer.clone() else {
        anyhow::bail!("reopen acts on one row: pass --consumer");
    };
    let actor = args.actor.required()?;
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    match ops
        .reopen(&args.message_id, &consumer, &actor, args.force_replay)
        .await
    {
        Ok(reopened) => {
            args.inbox.print(&reopened, render)?;
            Ok(ExitCode::SUCCESS)
        }
        // Refused, or no such row (a mistyped id, another consumer's, a row retention
        // removed without a tombstone): nothing to reopen, like a refusal.
        Err(e @ (OpsError::Refused(_) | OpsError::Invalid(_) | OpsError::NotFound(_))) => {
            eprintln!("{e}");
            Ok(ExitCode::FAILURE)
        }
        Err(e) => Err(e.into()),
    }
}

fn render(r: &Reopened) -> comfy_table::Table {
    let mut t = table(["message id", "consumer", "was", "attempts", "now", "audit"]);
    t.add_row(vec![
        r.message_id.clone(),
        r.consumer.clone(),
        r.previous_status.to_string(),
        r.previous_attempts.to_string(),
        "RETRYABLE_FAILED".to_owned(),
        format!("#{} {}", r.audit_id, r.action),
    ]);
    t
}
