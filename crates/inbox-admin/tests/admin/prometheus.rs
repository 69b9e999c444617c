//! The console over a real Prometheus (Debian's `prometheus` package): it scrapes a consumer's
//! metrics and evaluates the shipped alert rules (`deploy/prometheus/rabbit-inbox-rules.yml`),
//! and the console shows their alerts and the consumer's latency quantiles from it.
//!
//! The scraped endpoint serves a histogram whose shape is known, so the quantiles the console
//! shows can be checked against what `histogram_quantile` must make of it.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{Router, http::StatusCode, routing::get};
use serde_json::Value;

use crate::{
    browser::on_path,
    util::{
        CONSUMER, Fixture, InProcess, LocalProcess, READ_TOKEN, TempDir, activity_buckets, tokens,
    },
};

/// A Prometheus server on a free port with its own configuration and storage, killed when
/// dropped (the process first, then its directory).
struct PrometheusServer {
    process: LocalProcess,
    _dir: TempDir,
}

impl PrometheusServer {
    /// Scrapes `target` every second and evaluates `rules` every second; `None` (after saying
    /// so, which fails the run under `RABBIT_INBOX_REQUIRE_ALL`) without the binary.
    async fn start(target: &str, rules: &Path) -> Option<Self> {
        let Some(program) = on_path("prometheus") else {
            inbox_testkit::missing("prometheus", "apt-get install -y prometheus");
            return None;
        };
        let dir = TempDir::new("inbox-admin-prometheus");
        let config = dir.0.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {rules}\n\
                 scrape_configs:\n  - job_name: consumer\n    static_configs:\n      \
                 - targets: ['{target}']\n",
                rules = rules.display()
            ),
        )
        .expect("config written");
        let process = LocalProcess::spawn(&program, |port| {
            vec![
                format!("--config.file={}", config.display()),
                format!("--storage.tsdb.path={}", dir.0.join("data").display()),
                format!("--web.listen-address=127.0.0.1:{port}"),
                "--log.level=warn".into(),
            ]
        });
        let ready = format!("{}/-/ready", process.url);
        inbox_testkit::wait_for(
            "prometheus to be ready",
            Duration::from_secs(60),
            async || {
                reqwest::get(&ready)
                    .await
                    .is_ok_and(|r| r.status().is_success())
            },
        )
        .await;
        Some(Self { process, _dir: dir })
    }
}

/// What the scraped consumer reports: per scrape, 100 more deliveries settled, none in 4 ms,
/// 60 within 8 ms, all within 200 ms; and two stale PROCESSING rows.
fn exposition(consumer: &str, scrapes: u64) -> String {
    let name = "rabbit_inbox_delivery_to_settle_seconds";
    let (fast, all) = (60 * scrapes, 100 * scrapes);
    format!(
        "# TYPE {name} histogram\n\
         {name}_bucket{{consumer=\"{consumer}\",le=\"0.004\"}} 0\n\
         {name}_bucket{{consumer=\"{consumer}\",le=\"0.008\"}} {fast}\n\
         {name}_bucket{{consumer=\"{consumer}\",le=\"0.2\"}} {all}\n\
         {name}_bucket{{consumer=\"{consumer}\",le=\"+Inf\"}} {all}\n\
         {name}_sum{{consumer=\"{consumer}\"}} {sum}\n\
         {name}_count{{consumer=\"{consumer}\"}} {all}\n\
         # TYPE rabbit_inbox_stale_processing_rows gauge\n\
         rabbit_inbox_stale_processing_rows{{consumer=\"{consumer}\"}} 2\n",
        sum = 5 * scrapes,
    )
}

/// The latency figures of `consumer` in an activity answer: (p50, p99) of each bucket that has
/// them.
fn latencies(answer: &Value, consumer: &str) -> Vec<(f64, f64)> {
    activity_buckets(answer, consumer)
        .filter_map(|b| Some((b["latency_p50_ms"].as_f64()?, b["latency_p99_ms"].as_f64()?)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_reads_the_shipped_rules_alerts_and_the_consumers_latency_from_prometheus() {
    let fx = Fixture::inbox().await;

    // The consumer's metrics endpoint.
    let scrapes = Arc::new(AtomicU64::new(0));
    let counted = scrapes.clone();
    let exporter = Router::new().route(
        "/metrics",
        get(move || {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            async move { exposition(CONSUMER, n) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let target = listener.local_addr().expect("address").to_string();
    let exporter = tokio::spawn(async move {
        axum::serve(listener, exporter).await.expect("serves");
    });

    let rules: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "../../deploy/prometheus/rabbit-inbox-rules.yml",
    ]
    .iter()
    .collect();
    let Some(prometheus) = PrometheusServer::start(&target, &rules).await else {
        exporter.abort();
        return;
    };
    let mut state = fx.state(tokens(), None);
    state.prometheus_url = Some(prometheus.process.url.clone());
    let app = InProcess::new(state, crate::util::LOCAL, &Default::default());

    // The shipped rule for stale rows holds for ten minutes before it fires: pending now.
    let mut alerts = Value::Null;
    inbox_testkit::wait_for(
        "InboxStaleProcessing pending in Prometheus",
        Duration::from_secs(60),
        async || {
            let (code, answer) = app.get("/api/v1/alerts", Some(READ_TOKEN)).await;
            assert_eq!(code, StatusCode::OK, "{answer}");
            alerts = answer;
            alerts["alerts"]
                .as_array()
                .is_some_and(|a| a.iter().any(|a| a["name"] == "InboxStaleProcessing"))
        },
    )
    .await;
    assert_eq!(alerts["source"], "prometheus", "{alerts:#}");
    let stale = alerts["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .find(|a| a["name"] == "InboxStaleProcessing")
        .expect("the stale alert");
    assert_eq!(stale["state"], "pending", "{alerts:#}");
    assert_eq!(stale["consumer"], CONSUMER, "{alerts:#}");
    assert_eq!(stale["severity"], "warning", "{alerts:#}");

    // Latency: the consumer's histogram replaces the ledger's figures once two scrapes are in.
    let url = format!("/api/v1/activity?consumer={CONSUMER}&window=1h&bucket=1m");
    let mut activity = Value::Null;
    inbox_testkit::wait_for(
        "latency from the consumer's metrics",
        Duration::from_secs(60),
        async || {
            let (code, answer) = app.get(&url, Some(READ_TOKEN)).await;
            assert_eq!(code, StatusCode::OK, "{answer}");
            activity = answer;
            activity["latency_sources"][CONSUMER] == "metrics"
                && !latencies(&activity, CONSUMER).is_empty()
        },
    )
    .await;
    assert_eq!(activity["latency_error"], Value::Null, "{activity:#}");
    // 60 of every 100 within (4 ms, 8 ms], the rest within (8 ms, 200 ms], whatever the rate;
    // histogram_quantile interpolates inside a bucket: the 50th of 60 in the first is
    // 4 + 4 * 50/60 ms, the 39th of 40 in the second 8 + 192 * 39/40 ms.
    for (p50, p99) in latencies(&activity, CONSUMER) {
        assert!(
            (p50 - (4.0 + 4.0 * 50.0 / 60.0)).abs() < 0.01,
            "p50 {p50} ms: {activity:#}"
        );
        assert!(
            (p99 - (8.0 + 192.0 * 39.0 / 40.0)).abs() < 0.01,
            "p99 {p99} ms: {activity:#}"
        );
    }
    // The counts are still the ledger's.
    let processed: u64 = activity_buckets(&activity, CONSUMER)
        .map(|b| b["processed"].as_u64().expect("a count"))
        .sum();
    assert_eq!(processed, 3, "{activity:#}");

    // A consumer Prometheus has no series of keeps the ledger's latency, said so.
    let (_, all) = app.get("/api/v1/activity", Some(READ_TOKEN)).await;
    for (consumer, source) in all["latency_sources"].as_object().expect("sources") {
        let want = if consumer == CONSUMER {
            "metrics"
        } else {
            "ledger"
        };
        assert_eq!(source, want, "{consumer}: {all:#}");
    }

    // Prometheus gone: the ledger's latency, and a reason without its address.
    drop(prometheus);
    let (code, answer) = app.get(&url, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    assert_eq!(answer["latency_sources"][CONSUMER], "ledger", "{answer:#}");
    let error = answer["latency_error"].as_str().expect("a reason");
    assert!(!error.contains("127.0.0.1"), "{error}");
    let (_, alerts) = app.get("/api/v1/alerts", Some(READ_TOKEN)).await;
    assert_eq!(alerts["alerts"], serde_json::json!([]), "{alerts:#}");
    assert!(alerts["error"].is_string(), "{alerts:#}");
    exporter.abort();
}
