//! `inbox-lab consume --metrics-addr` serves the metrics catalog in the Prometheus text format:
//! scraped while it consumes the example stream, the counters, histograms and sampled gauges
//! are there and move.

use std::{
    hash::{BuildHasher, RandomState},
    process::Stdio,
    time::{Duration, SystemTime},
};

use rabbit_inbox::{SchemaName, broker::Broker};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    process::Command,
};

use inbox_testkit::{amqp_url, database_url};

/// Removes the schema and the queues when dropped, also when the test panics.
struct Cleanup {
    config: rabbit_inbox::ConsumerConfig,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let config = self.config.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cleanup runtime");
            runtime.block_on(async {
                if let Ok(pool) = sqlx::PgPool::connect(&database_url()).await {
                    let _ = rabbit_inbox::schema::drop_schema(&pool, &config.schema).await;
                    pool.close().await;
                }
                if let Ok(broker) = Broker::connect(&amqp_url(), "inboxctl test cleanup").await {
                    let _ = broker.delete(&config.topology, &config.retry).await;
                    broker.close().await;
                }
            });
        })
        .join();
    }
}

/// One scrape of `/metrics` (HTTP/1.0, so the server closes after the body).
async fn scrape(addr: &str) -> Option<String> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
}

/// The value of the first sample whose line starts with `series`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_serves_the_catalog_to_prometheus() {
    let h = RandomState::new().hash_one((SystemTime::now(), std::process::id()));
    let schema = format!("t_metrics_{h:016x}");
    let queue = format!("t-{h:016x}-metrics");
    let exchange = format!("t-{h:016x}-metrics-x");
    let config = order_service::config(
        SchemaName::new(&schema).expect("schema name"),
        &queue,
        &exchange,
    );
    let _cleanup = Cleanup {
        config: config.clone(),
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let service = [
        "--schema",
        &schema,
        "--queue",
        &queue,
        "--exchange",
        &exchange,
    ];

    let mut consumer = Command::new(crate::bins::inbox_lab())
        .arg("consume")
        .args(service)
        .args(["--metrics-addr", &addr, "--sample-interval-secs", "1"])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("inbox-lab consume starts");

    // Publishing declares the exchange; the consumer has bound its queue once it serves.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while scrape(&addr).await.is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "metrics endpoint never came up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let published = Command::new(crate::bins::inbox_lab())
        .arg("publish")
        .args(service)
        .args(["--orders", "20", "--seed", "7"])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .env_remove("RUST_LOG")
        .output()
        .await
        .expect("inbox-lab publish runs");
    assert!(
        published.status.success(),
        "{}",
        String::from_utf8_lossy(&published.stderr)
    );

    // "published N messages (U unique) ...": the N - U exact duplicates are counted only once
    // their copy's batch has settled, which can be after the last order is processed.
    let summary = String::from_utf8_lossy(&published.stdout);
    let counts: Vec<u64> = summary
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .take(2)
        .collect();
    let [total, unique] = counts[..] else {
        panic!("no message counts in the publish summary: {summary}");
    };
    assert!(
        total > unique,
        "seed 7 publishes exact duplicates: {summary}"
    );
    let processed = "rabbit_inbox_outcomes_total{consumer=\"order-service\",message_type=\"OrderPlaced\",outcome=\"processed\"}";
    let duplicates = "rabbit_inbox_duplicates_total{consumer=\"order-service\"";
    let text = loop {
        let text = scrape(&addr).await.unwrap_or_default();
        if sample(&text, processed).is_some_and(|n| n >= 20.0)
            && sample(&text, duplicates).is_some_and(|n| n >= 1.0)
            && text.contains("rabbit_inbox_open_rows{")
        {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "20 processed OrderPlaced, a counted duplicate and the sampled gauges never showed:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };

    for expected in [
        "# TYPE rabbit_inbox_handler_duration_seconds histogram",
        "# TYPE rabbit_inbox_transaction_duration_seconds histogram",
        "# TYPE rabbit_inbox_commit_to_ack_seconds histogram",
        "# TYPE rabbit_inbox_attempts histogram",
        "rabbit_inbox_received_total{consumer=\"order-service\"}",
        "rabbit_inbox_duplicates_total{consumer=\"order-service\"",
        "rabbit_inbox_oldest_unprocessed_age_seconds{consumer=\"order-service\"}",
        "rabbit_inbox_parked_rows{consumer=\"order-service\"}",
        "le=\"0.005\"",
    ] {
        assert!(text.contains(expected), "{expected} missing from:\n{text}");
    }
    let received = sample(
        &text,
        "rabbit_inbox_received_total{consumer=\"order-service\"}",
    )
    .expect("received");
    assert!(received >= 60.0, "20 orders and their payments: {received}");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(consumer.id().expect("pid") as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let status = tokio::time::timeout(Duration::from_secs(30), consumer.wait())
        .await
        .expect("consumer stops after SIGTERM")
        .expect("exit status");
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_samples_the_inbox_gauges_of_the_consumers_it_is_told() {
    let h = RandomState::new().hash_one((SystemTime::now(), std::process::id(), "serve"));
    let schema = format!("t_serve_metrics_{h:016x}");
    let queue = format!("t-{h:016x}-serve-metrics");
    let config = order_service::config(
        SchemaName::new(&schema).expect("schema name"),
        &queue,
        &format!("{queue}-x"),
    );
    let _cleanup = Cleanup {
        config: config.clone(),
    };
    let migrated = Command::new(crate::bins::inboxctl())
        .args(["migrate", "--schema", &schema])
        .env("DATABASE_URL", database_url())
        .output()
        .await
        .expect("inboxctl migrate runs");
    assert!(migrated.status.success(), "{migrated:?}");
    // Another service's inbox, seen only through the database: a claim stuck for an hour and
    // two parked rows.
    let pool = sqlx::PgPool::connect(&database_url()).await.expect("pool");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, processing_started_at, last_failed_at, \
           first_received_at, payload_sha256) \
         SELECT id, 'billing', 'InvoiceIssued', 1, st, 1, now() - interval '1 hour', \
           CASE WHEN st <> 'PROCESSING' THEN now() END, now() - interval '1 hour', '\\x00' \
         FROM (VALUES ('stuck', 'PROCESSING'), ('bad-1', 'POISONED'), \
           ('bad-2', 'PERMANENT_FAILED')) AS v(id, st)"
    )))
    .execute(&pool)
    .await
    .expect("rows inserted");
    pool.close().await;

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut server = Command::new(crate::bins::inboxctl())
        .args(["serve", "--listen", &addr, "--schema", &schema])
        .args([
            "--sample-consumer",
            "billing",
            "--sample-interval-secs",
            "1",
        ])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .env_remove("INBOX_ADMIN_READ_TOKENS")
        .env_remove("INBOX_ADMIN_ADMIN_TOKENS")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("inboxctl serve starts");

    let stale = "rabbit_inbox_stale_processing_rows{consumer=\"billing\"}";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let text = loop {
        let text = scrape(&addr).await.unwrap_or_default();
        if sample(&text, stale).is_some() {
            break text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the sampled gauges never showed:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(sample(&text, stale), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, "rabbit_inbox_parked_rows{consumer=\"billing\"}"),
        Some(2.0),
        "{text}"
    );
    let oldest = sample(
        &text,
        "rabbit_inbox_oldest_unprocessed_age_seconds{consumer=\"billing\"}",
    )
    .expect("oldest unprocessed age");
    assert!((3500.0..3700.0).contains(&oldest), "{text}");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.id().expect("pid") as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let status = tokio::time::timeout(Duration::from_secs(30), server.wait())
        .await
        .expect("server stops after SIGTERM")
        .expect("exit status");
    assert!(status.success(), "{status}");
}
