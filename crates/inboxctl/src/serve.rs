//! `inboxctl serve`: the admin HTTP API and dashboard (crate `inbox-admin`) over one inbox.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

use anyhow::Context;
use clap::Args;
use inbox_admin::{AdminState, Scope, Tokens};
use rabbit_inbox::{SchemaName, ops::Operations};

use crate::{Servers, connect, report::QueueArgs};

/// Variable holding the read tokens, `name=token` pairs separated by commas.
const READ_TOKENS: &str = "INBOX_ADMIN_READ_TOKENS";
/// Variable holding the admin tokens, `name=token` pairs separated by commas.
const ADMIN_TOKENS: &str = "INBOX_ADMIN_ADMIN_TOKENS";

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on. Without any token only a loopback address is accepted.
    #[arg(long, default_value = "127.0.0.1:9464")]
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
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    let pool = connect::postgres(&servers.database_url, connect::pool_size(0)).await?;
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
        ops: Operations::new(pool, SchemaName::new(&args.schema)?),
        amqp_url: servers.amqp_url.clone(),
        queues: args.queues.topology(),
        tokens,
        metrics: Some(metrics),
    };
    inbox_admin::serve(listener, state, rabbit_inbox::shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}
