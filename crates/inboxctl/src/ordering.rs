//! `inboxctl ordering`: the keys of an ordered consumer whose held messages wait (`blocked`),
//! and skipping what one of them waits for (`skip`), audited.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use inbox_ops::{
    OpsError,
    ordering::{BlockReason, BlockedKey, SkippedHead},
};

use crate::{
    Servers,
    actor::ActorArgs,
    connect,
    report::{InboxArgs, table},
    when,
};

/// Longest error text shown in a table cell (the full text is in `--json` and `show`).
const ERROR_CELL_CHARS: usize = 120;

#[derive(Args)]
pub(crate) struct OrderingArgs {
    #[command(subcommand)]
    command: OrderingCommand,
}

#[derive(Subcommand)]
enum OrderingCommand {
    /// List the consumer's keys whose held messages wait, oldest first: keys blocked behind a
    /// head (a message of the key that failed and is retrying or parked), with the head, its
    /// status and error, and keys that wait for a missing sequence number (sequence gap).
    /// Each shows since when it waits and how many messages it holds.
    #[command(
        after_help = "Example:\n  inboxctl ordering blocked --schema billing --consumer invoicer",
        mut_arg("consumer", |a| a.required(true).help(
            "Consumer name; required: ordering is per consumer"
        ))
    )]
    Blocked(BlockedArgs),
    /// Skip what a key waits for, so that its held messages go on (released in order by the
    /// consumer's release task). A blocked key is unblocked without touching its head: the
    /// head's row stays parked or retrying (redrive or replay it later if it should still
    /// apply). With sequence numbers the key then waits for the number after the head's. A
    /// key that is not blocked but waits on a sequence gap goes on from its first held
    /// number instead: the missing messages are given up (one that arrives later is parked
    /// as passed). Audited (skip_head) with --actor and --reason. Exit code 1 if refused:
    /// the key waits for nothing, or its head is not --head.
    #[command(
        after_help = "Examples:\n  inboxctl ordering skip --schema billing --consumer invoicer --key order-42 \\\n      --head inv-7 --actor alice --reason 'invoice voided by finance' --ticket INC-7\n  inboxctl ordering skip --schema billing --consumer invoicer --key order-43 \\\n      --sequence-header x-sequence --actor alice --reason 'sequence 5 was never sent'",
        mut_arg("consumer", |a| a.required(true).help(
            "Consumer name; required: a skip acts on one consumer's key"
        ))
    )]
    Skip(SkipArgs),
}

#[derive(Args)]
struct BlockedArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    /// Most keys to list (1 to 1000).
    #[arg(long, default_value_t = 100)]
    limit: i64,
}

#[derive(Args)]
struct SkipArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    /// The ordering key (as `ordering blocked` lists it).
    #[arg(long)]
    key: String,
    /// The head you expect to skip (as `ordering blocked` lists it): refused if the key's
    /// head is another one by now. Leave it out to skip whatever the key waits for (a
    /// sequence gap has no head).
    #[arg(long, value_name = "MESSAGE_ID")]
    head: Option<String>,
    /// The header the consumer reads sequence numbers from (its SequencePolicy header): the
    /// key then waits for the number after the head's. Without it, a head that failed on its
    /// first delivery has no known number and the key keeps waiting for it, as a gap to skip
    /// in turn.
    #[arg(long, env = "INBOX_SEQUENCE_HEADER", value_name = "HEADER")]
    sequence_header: Option<String>,
    #[command(flatten)]
    actor: ActorArgs,
}

pub(crate) async fn run(servers: &Servers, args: OrderingArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        OrderingCommand::Blocked(args) => blocked(servers, args).await,
        OrderingCommand::Skip(args) => skip(servers, args).await,
    }
}

async fn blocked(servers: &Servers, args: BlockedArgs) -> anyhow::Result<ExitCode> {
    let Some(consumer) = args.inbox.consumer.clone() else {
        anyhow::bail!("blocked keys are per consumer: pass --consumer");
    };
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let keys = ops.blocked_keys(&consumer, args.limit).await?;
    args.inbox.print(&keys, render_blocked)?;
    if !args.inbox.json && keys.is_empty() {
        eprintln!("no key of {consumer} is blocked or waits on a sequence gap");
    }
    Ok(ExitCode::SUCCESS)
}

async fn skip(servers: &Servers, args: SkipArgs) -> anyhow::Result<ExitCode> {
    let Some(consumer) = args.inbox.consumer.clone() else {
        anyhow::bail!("a skip acts on one consumer's key: pass --consumer");
    };
    let actor = args.actor.required()?;
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let mut ops = args.inbox.operations(pool).await?;
    if let Some(header) = &args.sequence_header {
        ops = ops.with_sequence_header(header);
    }
    match ops
        .skip_head(&actor, &consumer, &args.key, args.head.as_deref())
        .await
    {
        Ok(skipped) => {
            args.inbox.print(&skipped, render_skipped)?;
            if !args.inbox.json {
                eprintln!("{}", what_now(&skipped));
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e @ (OpsError::Invalid(_) | OpsError::Refused(_))) => {
            eprintln!("{e}");
            Ok(ExitCode::FAILURE)
        }
        Err(e) => Err(e.into()),
    }
}

/// What happens next, for the operator reading the table.
fn what_now(s: &SkippedHead) -> String {
    let waits_on_gap = matches!(
        (s.next_sequence_after, s.first_held_position),
        (Some(next), Some(first)) if first > next
    );
    // A head skipped with its number unread: the key still waits for that number.
    let number_unknown = s.skipped == BlockReason::Head
        && s.next_sequence_before.is_some()
        && s.next_sequence_before == s.next_sequence_after;
    let why = if number_unknown {
        " (the head's number was not known: pass --sequence-header to read it from its headers)"
    } else {
        ""
    };
    if waits_on_gap {
        format!(
            "{} held message(s) go on now; the key still waits for sequence number {}{why} \
             before its first held one ({}): send it, or skip the gap with `inboxctl ordering \
             skip` without --head",
            s.to_release,
            s.next_sequence_after.unwrap_or_default(),
            s.first_held_position.unwrap_or_default()
        )
    } else {
        format!(
            "{} of {} held message(s) go on now, released in order by the consumer's release \
             task",
            s.to_release, s.held
        )
    }
}

fn render_blocked(keys: &Vec<BlockedKey>) -> comfy_table::Table {
    let mut t = table([
        "key",
        "reason",
        "head",
        "head status",
        "error code",
        "error",
        "blocked since",
        "age",
        "held",
        "next seq",
        "first held",
    ]);
    for k in keys {
        t.add_row(vec![
            k.order_key.clone(),
            reason(k.reason).to_owned(),
            k.head_message_id.clone().unwrap_or_default(),
            k.head_status.clone().unwrap_or_default(),
            k.head_error_code.clone().unwrap_or_default(),
            k.head_error
                .as_deref()
                .map(|e| e.chars().take(ERROR_CELL_CHARS).collect())
                .unwrap_or_default(),
            when::cell(k.blocked_since),
            when::age(Some(k.age_seconds)),
            k.held.to_string(),
            number(k.next_sequence),
            number(k.first_held_position),
        ]);
    }
    t
}

fn render_skipped(s: &SkippedHead) -> comfy_table::Table {
    let mut t = table([
        "key",
        "skipped",
        "head",
        "head status (kept)",
        "held",
        "next seq",
        "to release",
        "audit",
    ]);
    let next = match (s.next_sequence_before, s.next_sequence_after) {
        (Some(before), Some(after)) if before != after => format!("{before} -> {after}"),
        (_, after) => number(after),
    };
    t.add_row(vec![
        s.order_key.clone(),
        reason(s.skipped).to_owned(),
        s.head_message_id.clone().unwrap_or_default(),
        s.head_status.clone().unwrap_or_default(),
        s.held.to_string(),
        next,
        s.to_release.to_string(),
        format!("#{} skip_head", s.audit_id),
    ]);
    t
}

fn reason(reason: BlockReason) -> &'static str {
    match reason {
        BlockReason::Head => "head",
        BlockReason::SequenceGap => "sequence gap",
        _ => reason.as_str(),
    }
}

fn number(n: Option<i64>) -> String {
    n.map(|n| n.to_string()).unwrap_or_default()
}
