//! `inboxctl serve`: the admin HTTP API and dashboard (crate `inbox-admin`) over one inbox.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context;
use clap::Args;
use inbox_admin::{AdminState, Scope, Tokens};
use rabbit_inbox::{SchemaName, ops::Operations, telemetry::InboxSampler};

use crate::{Servers, connect, report::QueueArgs};

/// Variable holding the read tokens, `name=token` pairs separated by commas.
const READ_TOKENS: &str = "INBOX_ADMIN_READ_TOKENS";
/// Variable holding the admin tokens, `name=token` pairs separated by commas.
const ADMIN_TOKENS: &str = "INBOX_ADMIN_ADMIN_TOKENS";

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on. Without any token only a loopback address is accepted.
    #[arg(long, default_value = "127.0.0.1:9480")]
    listen: SocketAddr,
    /// PostgreSQL schema of the inbox.
    #[arg(long, env = "INBOX_SCHEMA", default_value = "order_service")]
    schema: String,
    #[command(flatten)]
    queues: QueueArgs,
    /// File of tokens, one `SCOPE NAME=TOKEN` a line (scope `read` or `admin`), added to those
    /// in INBOX_ADMIN_READ_TOKENS and INBOX_ADMIN_ADMIN_TOKENS (`name=token,name=token`).
    #[arg(long)]
    tokens_file: Option<PathBuf>,
    /// Sample this consumer's inbox gauges (open, stale and parked rows, oldest unprocessed
    /// age, dedup-window headroom) into /metrics, judged by --retry-delays; repeatable. The
    /// consumers' own counters and histograms are on their --metrics-addr.
    #[arg(long = "sample-consumer", value_name = "NAME")]
    sample_consumers: Vec<String>,
    /// Seconds between samples: one query over the index of open rows per consumer.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    sample_interval_secs: u64,
    /// The longest time after which a message may be delivered again, in seconds; the
    /// dedup-window headroom gauge is measured against it.
    #[arg(long, value_name = "SECS")]
    replay_window_secs: Option<u64>,
}

fn tokens(args: &ServeArgs) -> anyhow::Result<Tokens> {
    let mut tokens = Tokens::none();
    for (scope, var) in [(Scope::Read, READ_TOKENS), (Scope::Admin, ADMIN_TOKENS)] {
        if let Ok(pairs) = std::env::var(var) {
            tokens.add_pairs(scope, &pairs).with_context(|| var)?;
        }
    }
    if let Some(path) = &args.tokens_file {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        tokens
            .add_file(&text)
            .with_context(|| path.display().to_string())?;
    }
    Ok(tokens)
}

pub(crate) async fn run(servers: &Servers, args: ServeArgs) -> anyhow::Result<ExitCode> {
    let tokens = tokens(&args)?;
    // Refused before anything is connected: the error is about the command line.
    tokens.check_bind(args.listen)?;
    let metrics = crate::telemetry::metrics_recorder()?;
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
    let schema = SchemaName::new(&args.schema)?;
    let retry = rabbit_inbox::RetryPolicy::tiered(args.queues.retry_delays.0.clone());
    let mut samplers = tokio::task::JoinSet::new();
    for consumer in &args.sample_consumers {
        let mut sampler = InboxSampler::new(
            pool.clone(),
            schema.clone(),
            consumer.clone(),
            retry.clone(),
            Duration::from_secs(args.sample_interval_secs),
        );
        if let Some(secs) = args.replay_window_secs {
            sampler = sampler.with_replay_window(Duration::from_secs(secs));
        }
        samplers.spawn(sampler.run());
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    eprintln!(
        "admin API and dashboard on http://{} ({} read, {} admin token(s)); Ctrl-C or SIGTERM \
         to stop",
        listener.local_addr()?,
        tokens.count(Scope::Read),
        tokens.count(Scope::Admin),
    );
    let state = AdminState {
        ops: Operations::new(pool, schema),
        amqp_url: servers.amqp_url.clone(),
        queues: args.queues.topology(),
        tokens,
        metrics: Some(metrics),
    };
    inbox_admin::serve(listener, state, rabbit_inbox::shutdown_signal()).await?;
    samplers.abort_all();
    Ok(ExitCode::SUCCESS)
}
