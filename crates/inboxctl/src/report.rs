//! What every operations command shares: which inbox it acts on, and how it prints results
//! (a table for people, JSON with `--json` for scripts) and progress (a bar on stderr).

use std::{io::IsTerminal, time::Duration};

use clap::Args;
use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use inbox_ops::{Operations, Progress};
use rabbit_inbox::SchemaName;
use serde::Serialize;

/// The inbox an operations command acts on, and its output format.
#[derive(Args, Clone, Debug)]
pub(crate) struct InboxArgs {
    /// PostgreSQL schema of the inbox.
    #[arg(long, env = "INBOX_SCHEMA")]
    pub(crate) schema: String,
    /// Consumer name (the inbox key's second half); all consumers when omitted.
    #[arg(long, env = "INBOX_CONSUMER")]
    pub(crate) consumer: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

impl InboxArgs {
    pub(crate) fn schema(&self) -> anyhow::Result<SchemaName> {
        Ok(SchemaName::new(&self.schema)?)
    }

    /// The operations on the inbox in `--schema`, over `pool`; [`inbox_ops::OpsError::NoInbox`]
    /// (exit code [`crate::EXIT_NO_INBOX`]) when the schema holds none, rather than the
    /// database's error about a missing relation at the first read.
    pub(crate) async fn operations(&self, pool: sqlx::PgPool) -> anyhow::Result<Operations> {
        let ops = Operations::new(pool, self.schema()?);
        ops.require_inbox().await?;
        Ok(ops)
    }

    /// Prints `value` as JSON with `--json`, otherwise as the table `to_table` builds.
    pub(crate) fn print<T: Serialize>(
        &self,
        value: &T,
        to_table: impl FnOnce(&T) -> Table,
    ) -> anyhow::Result<()> {
        if self.json {
            println!("{}", serde_json::to_string_pretty(value)?);
        } else {
            println!("{}", to_table(value));
        }
        Ok(())
    }

    /// A progress bar on stderr, hidden with `--json` or when stderr is not a terminal.
    pub(crate) fn progress(&self, what: &str) -> Bar {
        let bar = if self.json || !std::io::stderr().is_terminal() {
            indicatif::ProgressBar::hidden()
        } else {
            indicatif::ProgressBar::no_length()
        };
        // A count until the operation knows its total (cleanup never does: counting first
        // would be a scan of what it deletes).
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {msg} {pos} ({per_sec})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        bar.set_message(what.to_owned());
        bar.enable_steady_tick(Duration::from_millis(250));
        Bar(bar)
    }
}

/// A table with the given header, in the style every command uses.
pub(crate) fn table<I, S>(header: I) -> Table
where
    I: IntoIterator<Item = S>,
    S: Into<comfy_table::Cell>,
{
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(header);
    t
}

/// The CLI's [`Progress`]: an indicatif bar, cleared when dropped.
pub(crate) struct Bar(indicatif::ProgressBar);

impl Progress for Bar {
    fn set_total(&self, total: u64) {
        self.0.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {pos}/{len} ({per_sec}, eta {eta})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        self.0.set_length(total);
    }

    fn advance(&self, n: u64) {
        self.0.inc(n);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

/// The consumer's queues, for commands that look at (or move messages on) the broker. Named as
/// the library's `Topology::new(queue)` names them unless given.
#[derive(Args, Clone, Debug)]
pub(crate) struct QueueArgs {
    /// The consumer's work queue; its parking lot is `<queue>.parking-lot` and its retry
    /// tiers `<queue>.retry.<delay>` unless given below.
    #[arg(long, env = "INBOX_QUEUE")]
    pub(crate) queue: Option<String>,
    /// The parking-lot queue, when not `<queue>.parking-lot`.
    #[arg(long, env = "INBOX_PARKING_QUEUE", requires = "queue")]
    pub(crate) parking_queue: Option<String>,
    /// The consumer's retry delays, comma-separated (they name the retry tiers).
    #[arg(
        long,
        env = "INBOX_RETRY_DELAYS",
        value_parser = crate::when::delays,
        default_value = "1s,5s,30s,2m,10m"
    )]
    pub(crate) retry_delays: crate::when::Delays,
}

impl QueueArgs {
    /// The topology and retry tiers, if `--queue` was given.
    pub(crate) fn topology(&self) -> Option<(rabbit_inbox::Topology, rabbit_inbox::RetryPolicy)> {
        let queue = self.queue.as_ref()?;
        let mut topology = rabbit_inbox::Topology::new(queue.clone());
        if let Some(p) = &self.parking_queue {
            topology.parking_queue = p.clone();
        }
        Some((
            topology,
            rabbit_inbox::RetryPolicy::tiered(self.retry_delays.0.clone()),
        ))
    }

    /// A connection to the parking lot, if `--queue` was given.
    pub(crate) async fn parking_lot(
        &self,
        amqp_url: &str,
    ) -> anyhow::Result<Option<rabbit_inbox::broker::ParkingLot>> {
        match self.topology() {
            None => Ok(None),
            Some((t, _)) => Ok(Some(
                crate::connect::parking_lot(amqp_url, &t.queue, &t.parking_queue).await?,
            )),
        }
    }
}
