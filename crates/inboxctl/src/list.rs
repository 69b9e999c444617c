//! `inboxctl list`: inbox rows by filter, oldest first, a page at a time.

use std::process::ExitCode;

use clap::Args;
use inbox_ops::inspect::{ListFilter, ListPage};
use rabbit_inbox::InboxStatus;

use crate::{
    Servers, connect,
    report::{InboxArgs, table},
    when,
};

#[derive(Args)]
pub(crate) struct ListArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    /// Status to list (repeat for several) [default: every status but PROCESSED]
    #[arg(long, value_parser = parse_status)]
    status: Vec<InboxStatus>,
    /// Message type.
    #[arg(long = "type")]
    message_type: Option<String>,
    /// Last error code.
    #[arg(long)]
    error_code: Option<String>,
    /// Aggregate type.
    #[arg(long)]
    aggregate_type: Option<String>,
    /// Aggregate id.
    #[arg(long)]
    aggregate_id: Option<String>,
    /// Tenant.
    #[arg(long)]
    tenant: Option<String>,
    /// Exact message id (the inbox key).
    #[arg(long)]
    message_id: Option<String>,
    /// Correlation id.
    #[arg(long)]
    correlation_id: Option<String>,
    /// First received at or after (RFC 3339, or a duration ago: 2h).
    #[arg(long, value_parser = when::instant)]
    since: Option<chrono::DateTime<chrono::Utc>>,
    /// First received before (RFC 3339, or a duration ago).
    #[arg(long, value_parser = when::instant)]
    until: Option<chrono::DateTime<chrono::Utc>>,
    /// Where the previous page ended (its next_cursor).
    #[arg(long)]
    cursor: Option<String>,
    /// Rows per page (1 to 1000).
    #[arg(long, default_value_t = 50)]
    limit: u32,
}

pub(crate) fn parse_status(text: &str) -> Result<InboxStatus, String> {
    text.to_ascii_uppercase().parse().map_err(|_| {
        format!("unknown status {text:?}: one of PROCESSING, PROCESSED, RETRYABLE_FAILED, PERMANENT_FAILED, POISONED, MANUAL_REVIEW")
    })
}

pub(crate) async fn run(servers: &Servers, args: ListArgs) -> anyhow::Result<ExitCode> {
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let page = ops
        .list(&ListFilter {
            consumer: args.inbox.consumer.clone(),
            statuses: args.status,
            message_type: args.message_type,
            error_code: args.error_code,
            aggregate_type: args.aggregate_type,
            aggregate_id: args.aggregate_id,
            tenant: args.tenant,
            message_id: args.message_id,
            correlation_id: args.correlation_id,
            since: args.since,
            until: args.until,
            cursor: args.cursor,
            limit: args.limit,
        })
        .await?;
    args.inbox.print(&page, render)?;
    if !args.inbox.json
        && let Some(next) = &page.next_cursor
    {
        eprintln!("more rows: --cursor {next}");
    }
    Ok(ExitCode::SUCCESS)
}

fn render(page: &ListPage) -> comfy_table::Table {
    let mut t = table([
        "message id",
        "consumer",
        "type",
        "status",
        "attempts",
        "deliveries",
        "first received",
        "last failed",
        "error code",
        "aggregate",
        "tenant",
    ]);
    for r in &page.rows {
        let aggregate = match (&r.aggregate_type, &r.aggregate_id) {
            (Some(t), Some(id)) => format!("{t}/{id}"),
            (None, Some(id)) => id.clone(),
            _ => String::new(),
        };
        t.add_row(vec![
            r.message_id.clone(),
            r.consumer_name.clone(),
            r.message_type.clone(),
            r.status.to_string(),
            r.processing_attempt.to_string(),
            r.delivery_count.to_string(),
            when::cell(Some(r.first_received_at)),
            when::cell(r.last_failed_at),
            r.last_error_code.clone().unwrap_or_default(),
            aggregate,
            r.tenant_id.clone().unwrap_or_default(),
        ]);
    }
    t
}
