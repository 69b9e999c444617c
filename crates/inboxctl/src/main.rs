//! `inboxctl`: the operator's tool for rabbit-inbox. Thin glue over the library; each
//! subcommand lives in its own module.

mod actor;
mod cleanup;
mod doctor;
mod failures;
mod grants;
mod list;
mod ordering;
mod outbox;
mod recover;
mod redrive;
mod reopen;
mod replay;
mod report;
mod serve;
mod show;
mod status;

use std::{ffi::OsString, path::PathBuf, process::ExitCode};

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use inbox_ops::OpsError;
use inboxctl::{Servers, connect, error_chain, settings::SettingsFile, telemetry, when};

/// Exit code of a command run on a schema that holds no inbox.
const EXIT_NO_INBOX: u8 = 4;
use rabbit_inbox::SchemaName;

/// The operator's tool for rabbit-inbox (exactly-once RabbitMQ consumers on a PostgreSQL
/// inbox): migrate, inspect, redrive, reopen, recover, clean up, unblock ordered keys, check,
/// relay and serve.
#[derive(Parser)]
#[command(
    version,
    about,
    long_about = None,
    after_help = "Exit codes: 0 done, 1 what the command reports as refused or missing (see its \
        help), 2 the command could not run (a server unreachable, a bad argument), 4 no inbox \
        in the --schema given (run `inboxctl migrate --schema <schema>`, or check --schema / \
        INBOX_SCHEMA). The doctor adds 3: warnings only.\n\n\
        Settings: a flag with an environment variable ([env: ...]) can also be set in a TOML \
        settings file (--config, else INBOXCTL_CONFIG, else ./inboxctl.toml if present), under \
        the variable's name without INBOX_ in lower case: schema = \"billing\", \
        retry_delays = \"1s,5s,30s\", database_url = \"postgres://...\". A flag beats its \
        variable, the variable beats the file, the file beats the built-in default (a \
        [default: ...] shown here includes the file's values). An unknown key is an error."
)]
struct Cli {
    /// TOML settings file of the installation (see below) [default: ./inboxctl.toml if present]
    #[arg(long, env = "INBOXCTL_CONFIG", global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    servers: Servers,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create or update the inbox tables in a schema (the schema too if missing). Takes the
    /// schema's lock, so any number of instances may run it at once. Creates nothing else:
    /// a service migrates its own tables.
    #[command(after_help = "Example:\n  inboxctl migrate --schema billing")]
    Migrate {
        /// PostgreSQL schema of the inbox.
        #[arg(long, env = "INBOX_SCHEMA")]
        schema: String,
    },
    /// Run an outbox relay until SIGINT/SIGTERM: publish committed outbox rows with publisher
    /// confirms (returned = failed), under a lease, so any number of relays can run at once.
    Relay(outbox::RelayArgs),
    /// Show an outbox: pending and failed counts, the oldest pending row's age, and the pending
    /// and failed rows (a table, or --json); --requeue-failed puts FAILED rows back.
    Outbox(outbox::OutboxArgs),
    /// Inbox status per consumer and status: row counts, age of the oldest unfinished row,
    /// stale PROCESSING rows, the last hour's failures, duplicate deliveries (copies delivered
    /// again and acked without running the handler; retries are attempts, not duplicates) and
    /// payload conflicts, and (with --queue) the work queue's and parking lot's depths.
    #[command(
        after_help = "Example:\n  inboxctl status --schema billing --consumer invoicer --queue invoices"
    )]
    Status(status::StatusArgs),
    /// List inbox rows by consumer, status, type, error code, aggregate, tenant, message id,
    /// correlation id and time, oldest first, a page at a time (pass the printed cursor for the
    /// next page). Without --status, every status but PROCESSED.
    #[command(
        after_help = "Examples:\n  inboxctl list --schema billing --status POISONED --type InvoiceIssued --since 2h\n  inboxctl list --schema billing --json --limit 100 --cursor <next_cursor>"
    )]
    List(list::ListArgs),
    /// Show one message: its inbox row for every consumer (or --consumer), its payload if
    /// kept, tombstones, the audit trail, and where it is on the broker. A PROCESSED row's
    /// error is shown as its last failure before it was processed, and its attempts as those
    /// since the last reopen (a redrive reopens a row with its attempts reset) with the ones
    /// before. Exit code 1 if the inbox has no trace of it.
    #[command(
        after_help = "Example:\n  inboxctl show 7f3c2a9e-invoice-42 --schema billing --queue invoices"
    )]
    Show(show::ShowArgs),
    /// Failed rows (retrying, permanently failed, poisoned) grouped by consumer, status,
    /// message type and error code, largest group first, with a sample of each.
    #[command(after_help = "Example:\n  inboxctl failures --schema billing --consumer invoicer")]
    Failures(failures::FailuresArgs),
    /// Move parked messages back to the work queue after a fix. Each parked copy is classified
    /// against its inbox row: parked row -> reopened (audited) and moved; row already open ->
    /// moved; PROCESSED after a redrive moved it -> removed (audited: left by a killed
    /// redrive); other PROCESSED -> left in place (a finding; --drop-processed removes it);
    /// row removed by retention or unknown -> refused unless --force. Each row's reopen
    /// commits before its copy is published with a confirm, and the parked copy is acked
    /// last, so a redrive killed midway loses nothing and running it again finishes the job.
    /// --discard removes the copies of parked rows instead of moving them (each audited before
    /// its ack; the rows stay parked, as evidence). --message-id (repeatable) acts on listed messages
    /// only. --dry-run reports what the run would do. Any change needs --actor and --reason;
    /// exit code 1 if any message was refused.
    #[command(
        after_help = "Examples:\n  inboxctl redrive --schema billing --queue invoices --dry-run\n  inboxctl redrive --schema billing --queue invoices --error-code tax_lookup_failed --rate 50 \\\n      --actor alice --reason 'tax service fixed' --ticket INC-7\n  inboxctl redrive --schema billing --queue invoices --discard --message-id inv-7 --message-id inv-9 \\\n      --actor alice --reason 'test orders, never to be applied'"
    )]
    Redrive(redrive::RedriveArgs),
    /// Reopen one inbox row so that the next delivery of its message runs the handler again
    /// (attempts reset), audited with --actor and --reason. A PROCESSED row needs
    /// --force-replay (its next delivery runs the handler again: the effect applies again
    /// unless the handler's rules refuse it, which parks the message); the row is never
    /// deleted. Exit code 1 if refused or if the inbox has no such row.
    #[command(
        after_help = "Example:\n  inboxctl reopen invoice-42 --schema billing --consumer invoicer --actor alice --reason 'customer disputed, re-run'",
        mut_arg("consumer", |a| a.required(true).help(
            "Consumer name (the inbox key's second half); required: a reopen acts on one row"
        ))
    )]
    Reopen(reopen::ReopenArgs),
    /// Replace a parked message (PERMANENT_FAILED, POISONED, MANUAL_REVIEW) by an edited copy:
    /// the body in --body-file is published to the work queue with the original's headers and
    /// properties under a new id (a UUID v5 of the original id and the edited body, so the same
    /// edit gets the same id and is applied once) and the header x-inbox-replaces; then the
    /// original row becomes PROCESSED naming its replacement (audited with both bodies' hashes
    /// and the changed JSON paths, no body values) and its parked copy is removed. Prints the
    /// diff and the new id. --dry-run only shows them. Exit code 1 if refused (the row is not
    /// parked or already replaced, its stored body cannot be read, the edit is not JSON where
    /// the original was, or edits nothing) or if the parked copy is left to remove.
    #[command(
        after_help = "Examples:\n  inboxctl replay-edited --schema billing --consumer invoicer --message-id inv-42 \\\n      --body-file inv-42.json --dry-run\n  inboxctl replay-edited --schema billing --consumer invoicer --message-id inv-42 \\\n      --body-file inv-42.json --queue invoices --actor alice --reason 'amount corrected' --ticket INC-7",
        mut_arg("consumer", |a| a.required(true).help(
            "Consumer name (the inbox key's second half); required: a replay acts on one row"
        ))
    )]
    ReplayEdited(replay::ReplayEditedArgs),
    /// Recover messages whose path was lost: PROCESSING rows whose lease expired (a worker
    /// died or paused past its lease) and RETRYABLE_FAILED rows whose retry copy never came
    /// back (a deleted retry tier, a dropped dead-letter). Each is republished from its stored
    /// payload to the work queue (--policy retry) or moved to MANUAL_REVIEW
    /// (--policy manual-review), and audited. Exit code 1 if a row could not be recovered.
    #[command(
        after_help = "Example:\n  inboxctl recover --schema billing --consumer billing-svc \\\n    \
        --queue billing.commands --retry-delays 1s,5s,30s,2m,10m --actor alice \\\n    \
        --reason \"retry tier deleted by mistake\" --ticket INC-42 --dry-run"
    )]
    Recover(recover::RecoverArgs),
    /// Retention for one consumer: scrub payloads, remove expired rows (tombstones kept;
    /// archived with --archive), expire tombstones. Bounded batches, safe beside running
    /// consumers, one cleaner at a time. Refused (exit 1) when the dedup window is shorter
    /// than the redelivery horizon, unless forced with an actor and a reason (audited).
    #[command(after_help = "Examples:\n  \
        inboxctl cleanup --schema billing --consumer invoicer --dry-run\n  \
        inboxctl cleanup --schema billing --consumer invoicer \\\n    \
        --processed-retention 30days --scrub-after 3days --type-retention ledger.entry=90days --archive",
        mut_arg("consumer", |a| a.required(true).help(
            "Consumer name (the inbox key's second half); required: retention runs per consumer"
        )))]
    Cleanup(cleanup::CleanupArgs),
    /// Print the least-privilege grants of a role kind (consumer, retention, operator,
    /// admin) on an inbox schema, as SQL for psql.
    #[command(after_help = "Example:\n  \
        inboxctl grants --schema billing --role consumer --grantee billing_app | psql")]
    Grants(grants::GrantsArgs),
    /// Ordered consumers: list the keys whose held messages wait (behind a failed or parked
    /// head, or for a missing sequence number), and skip what a key waits for (audited).
    #[command(after_help = "Examples:\n  \
        inboxctl ordering blocked --schema billing --consumer invoicer\n  \
        inboxctl ordering skip --schema billing --consumer invoicer --key order-42 --head inv-7 \\\n    \
        --actor alice --reason 'invoice voided by finance' --ticket INC-7")]
    Ordering(ordering::OrderingArgs),
    /// The admin HTTP API and operator console: /healthz, /readyz, /metrics, JSON inspection,
    /// history and operator actions under /api/v1 (OpenAPI at /api/v1/openapi.json), the
    /// console at / (charts, alerts, message search and timelines, bulk actions, edit and
    /// replay).
    /// Reads need a bearer token (payloads the read:payload or admin scope, audited), actions an
    /// admin token and a reason (audited under the token's name). Without tokens only a
    /// loopback address may be bound, payloads are hidden and actions refused. A non-loopback
    /// address needs TLS (--tls-cert, --tls-key) or --insecure-http.
    #[command(after_help = serve::SERVE_HELP)]
    Serve(serve::ServeArgs),
    /// Check a live installation against the inbox review checklist: schema (migrations
    /// current, primary key with consumer_name, indexes, validated status check), the broker
    /// topology as the broker has it (read through the management API, port 15672: dead-letter
    /// routes, retry tier TTLs, parking lot, queue types, quorum delivery limit), retention
    /// against the redelivery horizon, rows recovery would pick up, the parking lot against
    /// the parked rows both ways (read and put back, nothing consumed), and stored payloads
    /// against the payload policy. Changes nothing. Prints pass/warn/fail per check (or
    /// --json). Exit code 0 all pass, 1 any fail, 3 warnings only, 2 could not run.
    #[command(after_help = "Example:\n  \
        inboxctl doctor --schema billing --consumer invoicer --queue invoices \\\n    \
        --retry-delays 1s,5s,30s,2m,10m --processed-retention 30days --replay-window 14days\n\n\
        Exit codes: 0 every check passed, 1 at least one failed, 3 warnings only, 2 the \
        command could not run (e.g. PostgreSQL unreachable).")]
    Doctor(doctor::DoctorArgs),
}

/// The command line, with the settings file's values as defaults; exits on `--help`, a bad
/// flag (as clap does), or an unreadable or wrong settings file.
fn parse_command_line() -> Cli {
    let args: Vec<OsString> = std::env::args_os().collect();
    let command = match SettingsFile::find(&args).and_then(|file| match file {
        Some(file) => file.apply(Cli::command()),
        None => Ok(Cli::command()),
    }) {
        Ok(command) => command,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            std::process::exit(2);
        }
    };
    let matches = command.get_matches_from(args);
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = parse_command_line();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => match e.downcast_ref::<OpsError>() {
            Some(OpsError::NoInbox { schema }) => {
                eprintln!(
                    "error: no inbox in schema {schema} (run `inboxctl migrate --schema \
                     {schema}`, or check --schema / INBOX_SCHEMA)"
                );
                ExitCode::from(EXIT_NO_INBOX)
            }
            _ => {
                eprintln!("error: {}", error_chain(&e));
                ExitCode::from(2)
            }
        },
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let servers = cli.servers.with_amqp_tls()?;
    match cli.command {
        Command::Migrate { schema } => {
            let schema = SchemaName::new(schema)?;
            let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
            rabbit_inbox::migrate(&pool, &schema).await?;
            println!("schema {schema} is up to date");
            Ok(ExitCode::SUCCESS)
        }
        Command::Relay(args) => outbox::relay(&servers, args).await,
        Command::Outbox(args) => outbox::inspect(&servers, args).await,
        Command::Status(args) => status::run(&servers, args).await,
        Command::List(args) => list::run(&servers, args).await,
        Command::Show(args) => show::run(&servers, args).await,
        Command::Failures(args) => failures::run(&servers, args).await,
        Command::Redrive(args) => redrive::run(&servers, args).await,
        Command::Reopen(args) => reopen::run(&servers, args).await,
        Command::ReplayEdited(args) => replay::run(&servers, args).await,
        Command::Recover(args) => recover::run(&servers, args).await,
        Command::Serve(args) => serve::run(&servers, args).await,
        Command::Doctor(args) => doctor::run(&servers, args).await,
        Command::Cleanup(args) => cleanup::run(&servers, args).await,
        Command::Grants(args) => grants::run(args),
        Command::Ordering(args) => ordering::run(&servers, args).await,
    }
}
