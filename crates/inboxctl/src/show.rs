//! `inboxctl show <message-id>`: one message's rows (every consumer), payload, tombstones,
//! audit trail and where it is on the broker.

use std::process::ExitCode;

use clap::Args;
use inbox_ops::{
    audit::AuditEntry,
    inspect::{Payload, RowDetail, ShowQuery, ShowReport},
};
use rabbit_inbox::InboxStatus;

use crate::{
    Servers, connect,
    report::{InboxArgs, QueueArgs, table},
    when,
};

#[derive(Args)]
pub(crate) struct ShowArgs {
    /// The message's inbox key (its message id, or an `invalid:` key).
    message_id: String,
    #[command(flatten)]
    inbox: InboxArgs,
    #[command(flatten)]
    queues: QueueArgs,
}

pub(crate) async fn run(servers: &Servers, args: ShowArgs) -> anyhow::Result<ExitCode> {
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let report = ops
        .show(&ShowQuery {
            message_id: args.message_id.clone(),
            consumer: args.inbox.consumer.clone(),
            topology: args.queues.topology(),
        })
        .await?;
    let unknown = report.rows.is_empty() && report.tombstones.is_empty();
    if !unknown || args.inbox.json {
        args.inbox.print(&report, render)?;
    }
    if unknown {
        eprintln!("no inbox row or tombstone for {:?}", args.message_id);
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

/// A row's attempts as recorded: a reopen (by hand or by a redrive) resets them to 0, keeping
/// the earlier count in its audit record, so after one the row's count is the attempts since,
/// and the ones before are told beside it.
fn attempts(row: &RowDetail, audit: &[AuditEntry]) -> String {
    let reopens: Vec<&AuditEntry> = audit
        .iter()
        .filter(|a| {
            a.consumer_name.as_deref() == Some(row.consumer_name.as_str())
                && matches!(a.action.as_str(), "reopen" | "forced_replay")
        })
        .collect();
    let Some(last) = reopens.last() else {
        return row.processing_attempt.to_string();
    };
    let before: i64 = reopens
        .iter()
        .filter_map(|a| a.details["previous_attempts"].as_i64())
        .sum();
    let by = if last.details["via"] == "redrive" {
        "a redrive"
    } else {
        "an operator"
    };
    format!(
        "{} since {by} reopened it {} ({before} before)",
        row.processing_attempt,
        when::cell(Some(last.occurred_at)),
    )
}

/// The row's last error: shown as current while the row is failing, and as the past failure
/// it is once the row is PROCESSED.
fn error_rows(row: &RowDetail) -> Vec<(&'static str, String)> {
    let opt = |v: &Option<String>| v.clone().unwrap_or_default();
    let message = match &row.last_error_sealed {
        // The message is sealed and this run could not open it.
        Some(why) => format!(
            "{} (sealed message not shown: {why})",
            opt(&row.last_error_message)
        ),
        None => opt(&row.last_error_message),
    };
    if row.status != InboxStatus::Processed {
        return vec![
            ("error code", opt(&row.last_error_code)),
            ("error", message),
        ];
    }
    if row.last_error_code.is_none() && row.last_error_message.is_none() {
        return Vec::new();
    }
    let code = opt(&row.last_error_code);
    vec![(
        "last failure before it was processed",
        match (code.is_empty(), message.is_empty()) {
            (false, false) => format!("{code}: {message}"),
            (true, _) => message,
            (false, true) => code,
        },
    )]
}

fn render(r: &ShowReport) -> comfy_table::Table {
    let mut t = table(["field", "value"]);
    for row in &r.rows {
        let location = match &row.location.queue {
            Some(q) => format!("{} ({q})", row.location.place),
            None => row.location.place.to_owned(),
        };
        let payload = match &row.payload {
            None => "(not kept)".to_owned(),
            Some(Payload::Utf8(text)) => text.clone(),
            Some(Payload::Base64(b)) => format!("base64:{b}"),
            Some(Payload::Sealed { key_id, reason }) => {
                format!("(encrypted with key {key_id}, not shown: {reason})")
            }
            Some(_) => "(kept in a form this tool cannot show)".to_owned(),
        };
        let opt = |v: &Option<String>| v.clone().unwrap_or_default();
        for (k, v) in [
            ("consumer", row.consumer_name.clone()),
            ("message id", row.message_id.clone()),
            (
                "type",
                format!("{} v{}", row.message_type, row.message_version),
            ),
            ("status", row.status.to_string()),
            ("broker", location),
            ("attempts", attempts(row, &r.audit)),
            ("deliveries", row.delivery_count.to_string()),
            ("first received", when::cell(Some(row.first_received_at))),
            ("last received", when::cell(Some(row.last_received_at))),
            ("attempt started", when::cell(row.processing_started_at)),
            (
                "lease",
                match (&row.lease_owner, row.fencing_token) {
                    (Some(owner), Some(token)) => format!(
                        "{owner}, token {token}, expires {}",
                        when::cell(row.lease_expires_at)
                    ),
                    _ => String::new(),
                },
            ),
            ("processed", when::cell(row.processed_at)),
            ("first failed", when::cell(row.first_failed_at)),
            ("last failed", when::cell(row.last_failed_at)),
        ] {
            t.add_row(vec![k.to_owned(), v]);
        }
        for (k, v) in error_rows(row) {
            t.add_row(vec![k.to_owned(), v]);
        }
        for (k, v) in [
            ("payload sha256", row.payload_sha256.clone()),
            ("payload conflicts", row.payload_conflicts.to_string()),
            (
                "parked copy",
                match row.parked_copy_at {
                    Some(at) => format!(
                        "confirmed {}, {} duplicate(s) acked",
                        when::cell(Some(at)),
                        row.parked_duplicates
                    ),
                    None if row.parked_duplicates > 0 => {
                        format!("{} duplicate(s) acked", row.parked_duplicates)
                    }
                    None => String::new(),
                },
            ),
            (
                "pending retry",
                match row.retry_due_at {
                    Some(at) => format!(
                        "due {}, {} duplicate(s) acked",
                        when::cell(Some(at)),
                        row.retry_duplicates
                    ),
                    None if row.retry_duplicates > 0 => {
                        format!("{} duplicate(s) acked", row.retry_duplicates)
                    }
                    None => String::new(),
                },
            ),
            (
                "aggregate",
                format!("{} {}", opt(&row.aggregate_type), opt(&row.aggregate_id)),
            ),
            ("tenant", opt(&row.tenant_id)),
            ("correlation id", opt(&row.correlation_id)),
            ("trace id", opt(&row.trace_id)),
            ("headers", row.headers.to_string()),
            ("payload", payload),
        ] {
            t.add_row(vec![k.to_owned(), v]);
        }
    }
    for ts in &r.tombstones {
        t.add_row(vec![
            "tombstone".to_owned(),
            format!(
                "{} {} ({}), removed {}, sha256 {}",
                ts.consumer_name,
                ts.final_status,
                ts.message_type,
                when::cell(Some(ts.removed_at)),
                ts.payload_sha256
            ),
        ]);
    }
    for a in &r.audit {
        t.add_row(vec![
            format!("audit #{}", a.audit_id),
            format!(
                "{} {} by {} [db role {}] ({}{}): {} {}",
                when::cell(Some(a.occurred_at)),
                a.action,
                a.actor,
                a.db_role.as_deref().unwrap_or("-"),
                a.reason,
                a.ticket
                    .as_deref()
                    .map(|t| format!(", {t}"))
                    .unwrap_or_default(),
                a.consumer_name.as_deref().unwrap_or(""),
                a.details
            ),
        ]);
    }
    t
}
