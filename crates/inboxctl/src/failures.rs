//! `inboxctl failures`: failed rows grouped by consumer, status, message type and error code.

use std::process::ExitCode;

use clap::Args;
use inbox_ops::inspect::FailureGroup;

use crate::{
    Servers, connect,
    report::{InboxArgs, table},
    when,
};

#[derive(Args)]
pub(crate) struct FailuresArgs {
    #[command(flatten)]
    inbox: InboxArgs,
}

pub(crate) async fn run(servers: &Servers, args: FailuresArgs) -> anyhow::Result<ExitCode> {
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let groups = ops.failure_groups(args.inbox.consumer.as_deref()).await?;
    args.inbox.print(&groups, render)?;
    Ok(ExitCode::SUCCESS)
}

fn render(groups: &Vec<FailureGroup>) -> comfy_table::Table {
    let mut t = table([
        "consumer",
        "status",
        "type",
        "error code",
        "rows",
        "first failed",
        "last failed",
        "sample",
        "sample error",
    ]);
    for g in groups {
        t.add_row(vec![
            g.consumer.clone(),
            g.status.to_string(),
            g.message_type.clone(),
            g.error_code.clone().unwrap_or_default(),
            g.rows.to_string(),
            when::cell(g.first_failed_at),
            when::cell(g.last_failed_at),
            g.sample_message_id.clone(),
            g.sample_error
                .as_deref()
                .map(|e| e.chars().take(120).collect())
                .unwrap_or_default(),
        ]);
    }
    t
}
