//! `inboxctl serve`: the admin HTTP API and console (crate `inbox-admin`) over one inbox.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Context;
use clap::Args;
use inbox_admin::{AdminState, Scope, ServeOptions, TlsFiles, Tokens};
use inbox_ops::Operations;
use rabbit_inbox::{InboxSampler, SchemaName};

use crate::{Servers, connect, report::QueueArgs};

/// Variable holding the read tokens, `name=token` pairs separated by commas.
const READ_TOKENS: &str = "INBOX_ADMIN_READ_TOKENS";
/// Variable holding the read:payload tokens, `name=token` pairs separated by commas.
const PAYLOAD_TOKENS: &str = "INBOX_ADMIN_PAYLOAD_TOKENS";
/// Variable holding the admin tokens, `name=token` pairs separated by commas.
const ADMIN_TOKENS: &str = "INBOX_ADMIN_ADMIN_TOKENS";

/// How to run the admin server safely.
pub(crate) const SERVE_HELP: &str = "\
Running it safely:
  - Listen on loopback (the default) unless other machines must reach it. A non-loopback
    address needs tokens and TLS (--tls-cert/--tls-key), or --insecure-http, which serves
    clear text: tokens and message contents cross the network readable by anyone on the
    path. It is logged as a warning at start and reported on /readyz as insecure_http.
  - Tokens (INBOX_ADMIN_READ_TOKENS, INBOX_ADMIN_PAYLOAD_TOKENS, INBOX_ADMIN_ADMIN_TOKENS,
    or --tokens-file with lines `SCOPE NAME=TOKEN`) carry at least 128 bits: generate each
    with `openssl rand -hex 32`. Scopes: `read` sees metadata (statuses, counts, ids, error
    codes); `read:payload` also payloads, headers and error texts, each read audited as
    payload_read under the token's name; `admin` also runs audited actions, and implies
    read:payload. Without any token only loopback is served, metadata only, no actions.
    Keep the tokens file readable by its owner only (a warning says otherwise). Repeated
    failed authentications from one address are logged and answered 429 for a minute.
  - Only requests addressed to the bind address (on loopback also localhost) or to an
    --allowed-host are answered (421 otherwise): this defeats DNS rebinding. Behind a proxy
    or on 0.0.0.0, list the names clients use.
  - A client must send its request head within --header-read-timeout-secs; at most
    --max-connections are served at once.

Example:
  INBOX_ADMIN_READ_TOKENS=grafana=$(openssl rand -hex 32) \\
  INBOX_ADMIN_ADMIN_TOKENS=alice=$(openssl rand -hex 32) \\
    inboxctl serve --listen 0.0.0.0:9480 --tls-cert admin.pem --tls-key admin-key.pem \\
    --allowed-host admin.example.com --schema billing --queue billing.commands";

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on. Without any token only a loopback address is accepted; any
    /// other address needs TLS or --insecure-http.
    #[arg(long, env = "INBOX_ADMIN_LISTEN", default_value = "127.0.0.1:9480")]
    listen: SocketAddr,
    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(
        long,
        env = "INBOX_ADMIN_TLS_CERT",
        value_name = "PEM",
        requires = "tls_key"
    )]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(
        long,
        env = "INBOX_ADMIN_TLS_KEY",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    tls_key: Option<PathBuf>,
    /// Serve clear-text HTTP on a non-loopback address anyway: tokens and messages cross the
    /// network unencrypted. For a trusted network only; logged and reported on /readyz.
    #[arg(long, conflicts_with = "tls_cert")]
    insecure_http: bool,
    /// A host name (or host:port) requests may be addressed to besides the bind address (and
    /// localhost on loopback); repeatable. Requests for any other Host get 421.
    #[arg(long = "allowed-host", value_name = "HOST")]
    allowed_hosts: Vec<String>,
    /// Seconds a client has to send a request's head (and finish the TLS handshake), and
    /// then its body.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=300))]
    header_read_timeout_secs: u64,
    /// Connections served at once; more are closed at accept.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    max_connections: u64,
    /// PostgreSQL schema of the inbox.
    #[arg(long, env = "INBOX_SCHEMA")]
    schema: String,
    #[command(flatten)]
    queues: QueueArgs,
    /// The RabbitMQ management API, `http://user:password@host:15672` (a cluster's: several,
    /// comma-separated; the first that answers is read), for the queues' ready and unacked
    /// counts and consumers on the console and for the doctor [default: port 15672 of each
    /// AMQP URL's host, with the first URL's credentials]
    #[arg(long, env = "INBOX_MANAGEMENT_URL")]
    management_url: Option<String>,
    /// File of tokens, one `SCOPE NAME=TOKEN` a line (scope `read`, `read:payload` or
    /// `admin`), added to those in INBOX_ADMIN_READ_TOKENS, INBOX_ADMIN_PAYLOAD_TOKENS and
    /// INBOX_ADMIN_ADMIN_TOKENS (`name=token,name=token`). Should be readable by its owner
    /// only.
    #[arg(long, env = "INBOX_ADMIN_TOKENS_FILE")]
    tokens_file: Option<PathBuf>,
    /// Sample this consumer's inbox gauges (open, stale and parked rows, oldest unprocessed
    /// age, dedup-window headroom) into /metrics, judged by --retry-delays; repeatable. The
    /// consumers' own counters and histograms are on their --metrics-addr.
    #[arg(
        long = "sample-consumer",
        env = "INBOX_SAMPLE_CONSUMERS",
        value_delimiter = ',',
        value_name = "NAME"
    )]
    sample_consumers: Vec<String>,
    /// Seconds between samples: one query over the index of open rows per consumer.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    sample_interval_secs: u64,
    /// The longest time after which a message may be delivered again, in seconds; the
    /// dedup-window headroom gauge and the console's headroom alert are measured against it.
    #[arg(long, value_name = "SECS")]
    replay_window_secs: Option<u64>,
    /// A Prometheus server that evaluates the shipped alert rules
    /// (deploy/prometheus/rabbit-inbox-rules.yml) and scrapes the consumers, e.g.
    /// http://prometheus:9090: the console shows the rules' state and the consumers' p50/p99
    /// receipt-to-settlement latency. Without it the console evaluates the same conditions,
    /// and a latency from first receipt to processed, from the inbox tables.
    #[arg(long, value_name = "URL", env = "INBOX_PROMETHEUS_URL")]
    prometheus_url: Option<String>,
    /// The header ordered consumers read sequence numbers from (their SequencePolicy
    /// header): skipping a blocked key's head reads the head's number from it, so that the
    /// key waits for the next number.
    #[arg(long, env = "INBOX_SEQUENCE_HEADER", value_name = "HEADER")]
    sequence_header: Option<String>,
}

/// An `http://` or `https://` URL with a host.
fn http_url(text: &str) -> Result<String, String> {
    let url = reqwest::Url::parse(text).map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err("an http:// or https:// URL with a host is expected".into());
    }
    Ok(text.to_owned())
}

fn tokens(args: &ServeArgs) -> anyhow::Result<Tokens> {
    let mut tokens = Tokens::none();
    for (scope, var) in [
        (Scope::Read, READ_TOKENS),
        (Scope::ReadPayload, PAYLOAD_TOKENS),
        (Scope::Admin, ADMIN_TOKENS),
    ] {
        if let Ok(pairs) = std::env::var(var) {
            tokens.add_pairs(scope, &pairs).with_context(|| var)?;
        }
    }
    if let Some(path) = &args.tokens_file {
        warn_if_shared(path);
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        tokens
            .add_file(&text)
            .with_context(|| path.display().to_string())?;
    }
    Ok(tokens)
}

/// Warns when other users may read the tokens file.
fn warn_if_shared(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt as _;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(
            path = %path.display(),
            mode = format!("{:o}", meta.permissions().mode() & 0o777),
            "the tokens file is readable or writable by other users: chmod 600 it"
        );
        eprintln!(
            "warning: {} is accessible to other users (mode {:o}); chmod 600 it",
            path.display(),
            meta.permissions().mode() & 0o777
        );
    }
}

fn options(args: &ServeArgs) -> ServeOptions {
    ServeOptions {
        tls: match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        },
        insecure_http: args.insecure_http,
        allowed_hosts: args.allowed_hosts.clone(),
        header_read_timeout: Duration::from_secs(args.header_read_timeout_secs),
        max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        ..ServeOptions::default()
    }
}

pub(crate) async fn run(servers: &Servers, args: ServeArgs) -> anyhow::Result<ExitCode> {
    // Clap checks this for flags and variables, not for values from a settings file.
    if args.tls_cert.is_some() != args.tls_key.is_some() {
        anyhow::bail!(
            "--tls-cert and --tls-key go together (INBOX_ADMIN_TLS_CERT and \
             INBOX_ADMIN_TLS_KEY, or admin_tls_cert and admin_tls_key in the settings file): \
             give both, or neither for plain HTTP"
        );
    }
    let tokens = tokens(&args)?;
    let options = options(&args);
    // Refused before anything is connected: the error is about the command line.
    options.validate(args.listen, &tokens)?;
    // Checked here rather than by clap, whose error would repeat the URL and its password.
    if let Some(url) = &args.prometheus_url {
        http_url(url).map_err(|e| anyhow::anyhow!("--prometheus-url: {e}"))?;
    }
    if let Some(url) = &args.management_url {
        inbox_ops::management::ManagementClient::new(&servers.amqp_url, Some(url))
            .context("--management-url")?;
    }
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
        )?;
        if let Some(secs) = args.replay_window_secs {
            sampler = sampler.with_replay_window(Duration::from_secs(secs));
        }
        // Aborted with the set when the server stops.
        samplers.spawn(sampler.run(std::future::pending()));
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    eprintln!(
        "admin API and console on {}://{} ({} read, {} read:payload, {} admin token(s)); \
         Ctrl-C or SIGTERM to stop",
        if options.tls.is_some() {
            "https"
        } else {
            "http"
        },
        listener.local_addr()?,
        tokens.count(Scope::Read),
        tokens.count(Scope::ReadPayload),
        tokens.count(Scope::Admin),
    );
    let state = AdminState {
        ops: match &args.sequence_header {
            Some(header) => Operations::new(pool, schema).with_sequence_header(header),
            None => Operations::new(pool, schema),
        },
        amqp_url: servers.amqp_url.clone(),
        management_url: args.management_url.clone(),
        queues: args.queues.topology(),
        tokens,
        metrics: Some(metrics),
        prometheus_url: args.prometheus_url.clone(),
        replay_window: args.replay_window_secs.map(Duration::from_secs),
    };
    inbox_admin::serve(listener, state, options, rabbit_inbox::shutdown_signal()).await?;
    samplers.abort_all();
    Ok(ExitCode::SUCCESS)
}
