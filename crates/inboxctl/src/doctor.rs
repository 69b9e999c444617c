//! `inboxctl doctor`: glue over `Operations::doctor`, the installation checked against the
//! inbox review checklist.

use std::{process::ExitCode, time::Duration};

use clap::{Args, ValueEnum};
use inbox_ops::doctor::{DoctorReport, DoctorRequest, Severity};
use rabbit_inbox::{
    PayloadStorage, QueueType, retention::RetentionPolicy, retention::TypeRetention,
};

use crate::{
    Servers, connect,
    report::{InboxArgs, QueueArgs, table},
    when,
};

/// Exit code when the worst finding is a warning (no failure).
pub(crate) const EXIT_WARNINGS: u8 = 3;

/// Which bodies the consumer keeps.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum Storage {
    /// Bodies of failed and parked messages only.
    FailedOnly,
    /// Every body.
    Always,
    /// No body (hash and metadata only).
    Never,
}

impl From<Storage> for PayloadStorage {
    fn from(s: Storage) -> Self {
        match s {
            Storage::FailedOnly => PayloadStorage::FailedOnly,
            Storage::Always => PayloadStorage::Always,
            Storage::Never => PayloadStorage::Never,
        }
    }
}

#[derive(Args)]
pub(crate) struct DoctorArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    #[command(flatten)]
    queues: QueueArgs,
    /// The consumer's queues are quorum queues.
    #[arg(long, env = "INBOX_QUORUM")]
    quorum: bool,
    /// The consumer's attempt budget.
    #[arg(long, env = "INBOX_MAX_ATTEMPTS", default_value_t = 5)]
    max_attempts: i32,
    /// The consumer's prefetch (a quorum delivery limit must exceed attempts + prefetch).
    #[arg(long, env = "INBOX_PREFETCH", default_value_t = 1000)]
    prefetch: u16,
    /// The RabbitMQ management API, `http://user:password@host:15672` (a cluster's: several,
    /// comma-separated; the first that answers is read) [default: port 15672 of each AMQP
    /// URL's host, with the first URL's credentials]
    #[arg(long, env = "INBOX_MANAGEMENT_URL")]
    management_url: Option<String>,
    /// PROCESSED rows are removed this long after processing (the dedup window).
    #[arg(long, env = "INBOX_PROCESSED_RETENTION", value_parser = when::duration, default_value = "30days")]
    processed_retention: Duration,
    /// Per message type, TYPE=DURATION (repeatable).
    #[arg(long, env = "INBOX_TYPE_RETENTION", value_delimiter = ',', value_parser = type_value::<Duration>)]
    type_retention: Vec<(String, Duration)>,
    /// How long after parking a message may still be replayed from the parking lot.
    #[arg(long, env = "INBOX_REPLAY_WINDOW", value_parser = when::duration, default_value = "14days")]
    replay_window: Duration,
    /// The consumer runs no retention (rows are kept until removed by hand); overrides
    /// --processed-retention and --type-retention.
    #[arg(long)]
    no_retention: bool,
    /// Which bodies the consumer keeps, for types without their own --type-storage.
    #[arg(
        long,
        env = "INBOX_PAYLOAD_STORAGE",
        value_enum,
        default_value = "failed-only"
    )]
    payload_storage: Storage,
    /// Per message type, TYPE=failed-only|always|never (repeatable).
    #[arg(long, env = "INBOX_TYPE_STORAGE", value_delimiter = ',', value_parser = type_value::<Storage>)]
    type_storage: Vec<(String, Storage)>,
    /// The consumer encrypts stored payloads (a keyring is configured).
    #[arg(long, env = "INBOX_ENCRYPTED")]
    encrypted: bool,
    /// A PROCESSING row without a lease counts as stale after this.
    #[arg(long, env = "INBOX_STALE_AFTER", value_parser = when::duration, default_value = "5m")]
    stale_after: Duration,
    /// Added to a retry tier's delay before a retry counts as lost.
    #[arg(long, value_parser = when::duration, default_value = "1m")]
    grace: Duration,
}

/// A value parsed from text: a duration or a storage policy.
trait FromArg: Sized {
    fn from_arg(text: &str) -> Result<Self, String>;
}

impl FromArg for Duration {
    fn from_arg(text: &str) -> Result<Self, String> {
        when::duration(text)
    }
}

impl FromArg for Storage {
    fn from_arg(text: &str) -> Result<Self, String> {
        Storage::from_str(text, true)
    }
}

/// `TYPE=VALUE`.
fn type_value<T: FromArg>(text: &str) -> Result<(String, T), String> {
    let (ty, value) = text
        .split_once('=')
        .ok_or_else(|| format!("expected TYPE=VALUE, got {text:?}"))?;
    Ok((ty.to_owned(), T::from_arg(value)?))
}

impl DoctorArgs {
    fn request(&self, servers: &Servers) -> DoctorRequest {
        let topology = self.queues.topology();
        let mut retry = rabbit_inbox::RetryPolicy::tiered(self.queues.retry_delays.0.clone());
        retry.max_attempts = self.max_attempts;
        retry.stale_processing_after = self.stale_after;
        let retention = (!self.no_retention).then(|| RetentionPolicy {
            processed: self.processed_retention,
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
            parking_replay_window: self.replay_window,
            ..RetentionPolicy::default()
        });
        DoctorRequest {
            consumer: self.inbox.consumer.clone(),
            amqp_url: Some(servers.amqp_url.clone()),
            management_url: self.management_url.clone(),
            topology: topology.map(|(mut t, _)| {
                if self.quorum {
                    t.queue_type = QueueType::Quorum;
                }
                t
            }),
            retry,
            prefetch: self.prefetch,
            retention,
            payload_storage: self.payload_storage.into(),
            payload_storage_by_type: self
                .type_storage
                .iter()
                .map(|(ty, s)| (ty.clone(), (*s).into()))
                .collect(),
            payload_encrypted: self.encrypted,
            recovery_grace: self.grace,
        }
    }
}

pub(crate) async fn run(servers: &Servers, args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let request = args.request(servers);
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let ops = args.inbox.operations(pool).await?;
    let report = ops.doctor(&request).await;
    args.inbox.print(&report, render)?;
    Ok(exit_code(report.worst))
}

/// 0 all pass, 1 any fail, 3 warnings only (2 stays the CLI's "could not run").
fn exit_code(worst: Severity) -> ExitCode {
    match worst {
        Severity::Pass => ExitCode::SUCCESS,
        Severity::Warn => ExitCode::from(EXIT_WARNINGS),
        // A severity this tool does not know is not taken for a pass.
        _ => ExitCode::FAILURE,
    }
}

fn render(r: &DoctorReport) -> comfy_table::Table {
    let mut t = table(["check", "result", "summary", "detail / what to do"]);
    for c in &r.checks {
        let mut notes = Vec::new();
        if let Some(d) = &c.detail {
            notes.push(d.clone());
        }
        if let Some(h) = &c.hint {
            notes.push(format!("-> {h}"));
        }
        t.add_row(vec![
            c.id.to_owned(),
            c.severity.as_str().to_uppercase(),
            c.summary.clone(),
            notes.join("\n"),
        ]);
    }
    let count = |s: &str| r.counts.get(s).copied().unwrap_or(0);
    t.add_row(vec![
        format!("schema {}", r.schema),
        r.worst.as_str().to_uppercase(),
        format!(
            "{} pass, {} warn, {} fail",
            count("pass"),
            count("warn"),
            count("fail")
        ),
        String::new(),
    ]);
    t
}
