//! `inboxctl relay` (the outbox relay as a process of its own) and `inboxctl outbox` (what is
//! pending or failed in an outbox).

use std::{process::ExitCode, time::Duration};

use crate::{Servers, connect};
use anyhow::Context;
use clap::Args;
use rabbit_inbox::{
    Relay, RelayConfig, outbox::OutboxRecord, outbox::OutboxStatus, outbox::OutboxStore,
    outbox::OutboxSummary,
};
use serde::Serialize;

use crate::report;

/// `inboxctl relay`.
#[derive(Args, Clone, Debug)]
pub(crate) struct RelayArgs {
    /// PostgreSQL schema of the outbox.
    #[arg(long, env = "INBOX_SCHEMA")]
    schema: String,
    /// Lease owner and connection name [default: relay-<pid>-<random>]
    #[arg(long)]
    name: Option<String>,
    /// Rows claimed and published per batch.
    #[arg(long, default_value_t = 256)]
    batch_size: usize,
    /// Batches published and not yet settled, at most: how far claiming runs ahead of the
    /// confirms (1: claim, publish, await, mark, one batch at a time).
    #[arg(long, default_value_t = 4)]
    window: usize,
    /// Lease per claim, seconds: other relays keep off the claimed rows this long.
    #[arg(long, default_value_t = 30)]
    lease_secs: u64,
    /// Longest wait for a batch's confirms from its claim, seconds (at most half the lease).
    #[arg(long, default_value_t = 10)]
    confirm_timeout_secs: u64,
    /// Longest sleep between claims without a NOTIFY, milliseconds.
    #[arg(long, default_value_t = 1000)]
    poll_interval_ms: u64,
    /// Do not LISTEN: poll only.
    #[arg(long)]
    no_listen: bool,
    /// Failed publishes (returned, nacked, exchange missing) before a row is FAILED.
    #[arg(long, default_value_t = 20)]
    max_attempts: i32,
    /// Delete SENT rows older than this many hours; 0 keeps them.
    #[arg(long, default_value_t = 168)]
    retention_hours: u64,
    /// Serve the relay's metrics (rabbit_inbox_outbox_*: pending, failed, oldest pending age,
    /// publish latency, returns, confirm failures) in the Prometheus text format at
    /// http://ADDR/metrics (e.g. 127.0.0.1:9465).
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
}

impl RelayArgs {
    fn config(&self) -> anyhow::Result<RelayConfig> {
        let mut c = RelayConfig::new(rabbit_inbox::SchemaName::new(&self.schema)?);
        if let Some(name) = &self.name {
            c.name = name.clone();
        }
        c.batch_size = self.batch_size;
        c.window = self.window;
        c.lease = Duration::from_secs(self.lease_secs);
        c.confirm_timeout = Duration::from_secs(self.confirm_timeout_secs);
        c.poll_interval = Duration::from_millis(self.poll_interval_ms);
        c.listen = !self.no_listen;
        c.max_attempts = self.max_attempts;
        c.retention = match self.retention_hours {
            0 => None,
            hours => Some(Duration::from_secs(hours.checked_mul(3600).ok_or_else(
                || anyhow::anyhow!("--retention-hours {hours} is too large"),
            )?)),
        };
        c.validate()?;
        Ok(c)
    }
}

/// Runs a relay until SIGINT/SIGTERM.
pub(crate) async fn relay(servers: &Servers, args: RelayArgs) -> anyhow::Result<ExitCode> {
    let config = args.config()?;
    if let Some(addr) = args.metrics_addr {
        crate::telemetry::serve_metrics(addr)?;
    }
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    connect::rabbitmq(&servers.amqp_url).await?.close().await;
    rabbit_inbox::migrate(&pool, &config.schema)
        .await
        .with_context(|| format!("migrating schema {}", config.schema))?;
    let name = config.name.clone();
    let relay = Relay::new(servers.amqp_url.clone(), pool, config)?;
    let stats = relay.stats();
    eprintln!(
        "relay {name} publishing the outbox of {}; Ctrl-C or SIGTERM to stop",
        args.schema
    );
    relay.run(rabbit_inbox::shutdown_signal()).await?;
    let s = stats.snapshot();
    eprintln!(
        "stopped: published {}, returned {}, confirm failures {}, missing exchange {}, failed {}, fenced {}",
        s.published, s.returned, s.confirm_failures, s.exchange_missing, s.failed, s.fenced
    );
    Ok(ExitCode::SUCCESS)
}

/// `inboxctl outbox`.
#[derive(Args, Clone, Debug)]
pub(crate) struct OutboxArgs {
    /// PostgreSQL schema of the outbox.
    #[arg(long, env = "INBOX_SCHEMA")]
    schema: String,
    /// Rows listed, oldest first.
    #[arg(long, default_value_t = 50)]
    limit: i64,
    /// List only FAILED rows.
    #[arg(long)]
    failed: bool,
    /// Put FAILED rows back to PENDING (all, or those given with --message-id) and wake the
    /// relays.
    #[arg(long)]
    requeue_failed: bool,
    /// With --requeue-failed: only these message ids (repeatable).
    #[arg(long = "message-id")]
    message_ids: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Inspection {
    schema: String,
    summary: OutboxSummary,
    requeued: Option<u64>,
    rows: Vec<OutboxRecord>,
}

/// Prints the outbox's summary and its pending and failed rows.
pub(crate) async fn inspect(servers: &Servers, args: OutboxArgs) -> anyhow::Result<ExitCode> {
    let schema = rabbit_inbox::SchemaName::new(&args.schema)?;
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let store = OutboxStore::new(schema.clone());
    let mut conn = pool.acquire().await?;
    let requeued = if args.requeue_failed {
        let ids = (!args.message_ids.is_empty()).then_some(args.message_ids.as_slice());
        Some(store.requeue_failed(&mut conn, ids).await?)
    } else {
        None
    };
    let summary = store.summary(&mut conn).await.with_context(|| {
        format!("reading the outbox of schema {schema} (run `inboxctl migrate`?)")
    })?;
    let statuses: &[OutboxStatus] = if args.failed {
        &[OutboxStatus::Failed]
    } else {
        &[OutboxStatus::Pending, OutboxStatus::Failed]
    };
    let rows = store.list(&mut conn, statuses, args.limit).await?;
    let inspection = Inspection {
        schema: schema.to_string(),
        summary,
        requeued,
        rows,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&inspection)?);
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(n) = requeued {
        println!("requeued {n} failed row(s)");
    }
    let s = &inspection.summary;
    println!(
        "outbox {}: {} pending ({} leased by a relay now), {} failed, oldest pending {}",
        inspection.schema,
        s.pending,
        s.leased,
        s.failed,
        s.oldest_pending_secs
            .map_or("-".to_owned(), |a| format!("{a:.1} s ago"))
    );
    if inspection.rows.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = report::table([
        "seq",
        "message id",
        "status",
        "type",
        "exchange / routing key",
        "order",
        "attempts",
        "next attempt",
        "lease",
        "last error",
    ]);
    for r in &inspection.rows {
        t.add_row(vec![
            r.seq.to_string(),
            r.message_id.clone(),
            r.status.to_string(),
            r.message_type.clone(),
            format!("{:?} / {}", r.exchange, r.routing_key),
            match (&r.ordering_key, r.stream_position) {
                (Some(k), Some(p)) => format!("{k} #{p}"),
                _ => "-".into(),
            },
            r.attempts.to_string(),
            r.next_attempt_at.format("%H:%M:%S").to_string(),
            r.lease_owner.clone().unwrap_or_else(|| "-".into()),
            match (&r.last_error_code, &r.last_error) {
                (Some(code), Some(text)) => format!("{code}: {text}"),
                (Some(code), None) => code.clone(),
                _ => "-".into(),
            },
        ]);
    }
    println!("{t}");
    Ok(ExitCode::SUCCESS)
}
