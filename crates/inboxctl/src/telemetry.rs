//! `consume`'s observability: the Prometheus exporter over the library's metrics catalog and,
//! when an OTLP endpoint is given, the export of the delivery spans.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Context;
use clap::Args;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::SdkTracerProvider;
use rabbit_inbox::{ConsumerConfig, InboxSampler, telemetry::metrics as m};

/// Metrics and trace export of a consumer process (`inbox-lab consume`).
#[derive(Args, Clone, Debug, Default)]
pub struct ObserveArgs {
    /// Serve the metrics catalog in the Prometheus text format at http://ADDR/metrics
    /// (e.g. 127.0.0.1:9464). Also samples the inbox gauges every --sample-interval-secs.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Seconds between samples of the inbox gauges (oldest unprocessed age, open and parked
    /// rows, dedup-window headroom); one query over the index of open rows per sample.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(1..))]
    pub sample_interval_secs: u64,
    /// The longest time after which a message may be delivered again (DLQ replays, outbox
    /// republishes), in seconds; the dedup-window headroom gauge is measured against it.
    #[arg(long, value_name = "SECS")]
    pub replay_window_secs: Option<u64>,
    /// Message types with their own `message_type` label (comma-separated); other types are
    /// labelled by name up to the library's limit, then `other`.
    #[arg(long, value_delimiter = ',')]
    pub known_message_types: Vec<String>,
    /// Export a span per delivery, child of the producer's `traceparent`, over OTLP/HTTP
    /// (protobuf) to this collector URL (e.g. http://127.0.0.1:4318/v1/traces).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// TLS of the export to an `https://` collector.
    #[command(flatten)]
    pub otlp_tls: OtlpTls,
}

/// TLS of the OTLP export to an `https://` collector (the OpenTelemetry SDK's variables).
#[derive(Args, Clone, Debug, Default)]
pub struct OtlpTls {
    /// CA certificate file (PEM) trusted for an https:// collector beside the system roots.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
        value_name = "PEM"
    )]
    pub otlp_ca_file: Option<PathBuf>,
    /// Client certificate file (PEM) for a collector that requires one; needs
    /// --otlp-client-key.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        value_name = "PEM",
        requires = "otlp_client_key"
    )]
    pub otlp_client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM, unencrypted).
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY",
        value_name = "PEM",
        requires = "otlp_client_cert"
    )]
    pub otlp_client_key: Option<PathBuf>,
}

/// How long one export request may take (the OTLP default).
const OTLP_TIMEOUT: Duration = Duration::from_secs(10);

impl OtlpTls {
    /// The exporter's HTTP client: the system roots and the CA file, the client certificate.
    fn http_client(&self) -> anyhow::Result<reqwest::blocking::Client> {
        let read = |path: &PathBuf, what: &str| {
            std::fs::read(path).with_context(|| format!("OTLP {what} {}", path.display()))
        };
        let mut builder = reqwest::blocking::Client::builder().timeout(OTLP_TIMEOUT);
        if let Some(path) = &self.otlp_ca_file {
            let certs = reqwest::Certificate::from_pem_bundle(&read(path, "CA file")?)
                .with_context(|| {
                    format!("OTLP CA file {}: not PEM certificates", path.display())
                })?;
            anyhow::ensure!(
                !certs.is_empty(),
                "OTLP CA file {}: holds no PEM certificate",
                path.display()
            );
            builder = builder.tls_certs_merge(certs);
        }
        if let (Some(cert), Some(key)) = (&self.otlp_client_cert, &self.otlp_client_key) {
            let pem = [read(cert, "client certificate")?, read(key, "client key")?].join(&b'\n');
            let identity = reqwest::Identity::from_pem(&pem).with_context(|| {
                format!(
                    "OTLP client certificate {} with key {}",
                    cert.display(),
                    key.display()
                )
            })?;
            builder = builder.identity(identity);
        }
        // The blocking client runs a runtime of its own, which must not be built (or dropped)
        // on one of the async runtime's threads.
        std::thread::spawn(move || builder.build())
            .join()
            .map_err(|_| anyhow::anyhow!("building the OTLP HTTP client panicked"))?
            .context("building the OTLP HTTP client")
    }
}

impl ObserveArgs {
    /// Applies the labels to the consumer's configuration.
    pub fn configure(&self, config: &mut ConsumerConfig) {
        config
            .telemetry
            .known_message_types
            .extend(self.known_message_types.iter().cloned());
    }

    /// The sampler of the inbox gauges to run beside the consumer, when metrics are served.
    pub fn sampler(
        &self,
        pool: &sqlx::PgPool,
        config: &ConsumerConfig,
    ) -> anyhow::Result<Option<InboxSampler>> {
        if self.metrics_addr.is_none() {
            return Ok(None);
        }
        let mut sampler = InboxSampler::for_consumer(
            pool.clone(),
            config,
            Duration::from_secs(self.sample_interval_secs),
        )?;
        if let Some(secs) = self.replay_window_secs {
            sampler = sampler.with_replay_window(Duration::from_secs(secs));
        }
        Ok(Some(sampler))
    }

    /// Installs the Prometheus exporter, if asked for. Call inside the runtime.
    pub fn install_metrics(&self) -> anyhow::Result<()> {
        match self.metrics_addr {
            Some(addr) => serve_metrics(addr),
            None => Ok(()),
        }
    }
}

/// Installs the Prometheus exporter serving the catalog at http://ADDR/metrics. Call inside
/// the runtime.
pub fn serve_metrics(addr: SocketAddr) -> anyhow::Result<()> {
    prometheus()?
        .with_http_listener(addr)
        .install()
        .with_context(|| format!("serving metrics at {addr}"))?;
    m::describe();
    Ok(())
}

/// Installs the Prometheus recorder without a listener of its own, for a server that renders
/// it (`inboxctl serve` at `/metrics`).
pub fn metrics_recorder() -> anyhow::Result<metrics_exporter_prometheus::PrometheusHandle> {
    let handle = prometheus()?
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    m::describe();
    Ok(handle)
}

/// The exporter with histogram buckets fitting the catalog: latencies from a millisecond to
/// minutes, attempts as small integers.
fn prometheus() -> anyhow::Result<PrometheusBuilder> {
    const SECONDS: [f64; 14] = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 120.0, 600.0,
    ];
    const ATTEMPTS: [f64; 8] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0];
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS)?
        .set_buckets_for_metric(Matcher::Full(m::ATTEMPTS.into()), &ATTEMPTS)?)
}

/// Exports spans over OTLP until dropped (then flushes).
#[derive(Debug)]
pub struct SpanExport {
    provider: SdkTracerProvider,
}

impl SpanExport {
    /// The layer that sends the library's delivery spans to `endpoint`, and its guard.
    pub fn start<S>(
        endpoint: &str,
        tls: &OtlpTls,
    ) -> anyhow::Result<(impl tracing_subscriber::Layer<S> + use<S>, SpanExport)>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        use opentelemetry_otlp::WithHttpConfig as _;
        use tracing_subscriber::Layer as _;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(tls.http_client()?)
            .with_endpoint(endpoint)
            .build()
            .with_context(|| format!("OTLP exporter for {endpoint}"))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name("inboxctl")
                    .build(),
            )
            .build();
        let layer = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("rabbit-inbox"))
            // The delivery spans whatever RUST_LOG says for the terminal.
            .with_filter(
                tracing_subscriber::filter::Targets::new()
                    .with_target("rabbit_inbox::delivery", tracing::Level::INFO),
            );
        Ok((layer, SpanExport { provider }))
    }
}

impl Drop for SpanExport {
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("flushing spans: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{path::Path, sync::Arc};

    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        sync::mpsc,
    };
    use tracing_subscriber::layer::SubscriberExt as _;

    use super::*;

    /// The certificates of `scripts/tls-endpoints.sh start`, or `None` after saying so.
    fn certificates() -> Option<PathBuf> {
        let dir = std::env::var("RABBIT_INBOX_TLS_DIR")
            .map_or_else(|_| PathBuf::from("/tmp/rabbit-inbox-tls"), PathBuf::from)
            .join("certs");
        if dir.join("server.pem").exists() {
            Some(dir)
        } else {
            inbox_testkit::missing(
                "the TLS test certificates",
                "run scripts/tls-endpoints.sh start",
            );
            None
        }
    }

    /// An HTTPS collector on 127.0.0.1 with the script's server certificate (for localhost):
    /// reports each request line, or the failed handshake, and answers 200.
    async fn collector(certs: &Path) -> (u16, mpsc::UnboundedReceiver<String>) {
        let chain = CertificateDer::pem_file_iter(certs.join("server.pem"))
            .expect("server.pem")
            .collect::<Result<Vec<_>, _>>()
            .expect("certificates");
        let key = PrivateKeyDer::from_pem_file(certs.join("server.key")).expect("server.key");
        let config = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("address").port();
        let (report, requests) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (acceptor, report) = (acceptor.clone(), report.clone());
                tokio::spawn(async move {
                    let mut tls = match acceptor.accept(stream).await {
                        Ok(tls) => tls,
                        Err(e) => {
                            let _ = report.send(format!("handshake failed: {e}"));
                            return;
                        }
                    };
                    // The request head; the body is not needed.
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let line = String::from_utf8_lossy(&head)
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .to_owned();
                    let _ = report.send(line);
                    let _ = tls
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                        )
                        .await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        (port, requests)
    }

    /// Exports one delivery span to `endpoint` and flushes.
    async fn export_one_span(endpoint: String, tls: OtlpTls) {
        tokio::task::spawn_blocking(move || {
            let (layer, export) =
                SpanExport::start::<tracing_subscriber::Registry>(&endpoint, &tls)
                    .expect("exporter");
            let subscriber = tracing_subscriber::registry().with(layer);
            tracing::subscriber::with_default(subscriber, || {
                tracing::info_span!(target: "rabbit_inbox::delivery", "inbox.delivery")
                    .in_scope(|| {});
            });
            drop(export);
        })
        .await
        .expect("export thread");
    }

    #[tokio::test]
    async fn spans_go_to_an_https_collector_verified_against_the_ca_file() {
        let Some(certs) = certificates() else { return };
        let (port, mut requests) = collector(&certs).await;
        let endpoint = format!("https://localhost:{port}/v1/traces");

        let trusted = OtlpTls {
            otlp_ca_file: Some(certs.join("ca.pem")),
            ..OtlpTls::default()
        };
        export_one_span(endpoint.clone(), trusted).await;
        let request = tokio::time::timeout(Duration::from_secs(10), requests.recv())
            .await
            .expect("the collector was reached")
            .expect("a request");
        assert_eq!(request, "POST /v1/traces HTTP/1.1");

        // A CA that did not sign the collector's certificate: the client ends the handshake.
        let untrusted = OtlpTls {
            otlp_ca_file: Some(certs.join("other-ca.pem")),
            ..OtlpTls::default()
        };
        export_one_span(endpoint, untrusted).await;
        let refused = tokio::time::timeout(Duration::from_secs(10), requests.recv())
            .await
            .expect("the collector saw the attempt")
            .expect("a report");
        assert!(refused.starts_with("handshake failed"), "{refused}");
    }

    #[test]
    fn a_bad_ca_file_is_named() {
        let tls = OtlpTls {
            otlp_ca_file: Some("/nonexistent/collector-ca.pem".into()),
            ..OtlpTls::default()
        };
        let e = tls.http_client().expect_err("missing file");
        assert!(
            format!("{e:#}").contains("OTLP CA file /nonexistent/collector-ca.pem"),
            "{e:#}"
        );
    }
}
