//! `inbox-lab bench --sustained` end to end on a small scale: the ceiling's and the mode's
//! drain runs, a probe, the hold, the exactly-once check of every message the stream
//! published, and the report. What rate this machine sustains is not asserted (that is the
//! benchmark's to measure, not a test's); that the run checks and reports is.

use std::{
    hash::{BuildHasher, RandomState},
    time::SystemTime,
};

use rabbit_inbox::{ConsumerConfig, SchemaName, Topology, broker::Broker};
use tokio::process::Command;

use inbox_testkit::{amqp_url, database_url};

/// Drops the schema and the run's queues when dropped, also when the test panics.
struct Cleanup {
    schema: String,
    prefix: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (schema, prefix) = (self.schema.clone(), self.prefix.clone());
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cleanup runtime");
            runtime.block_on(async {
                if let Ok(pool) = sqlx::PgPool::connect(&database_url()).await {
                    let schema = SchemaName::new(&schema).expect("schema name");
                    let _ = rabbit_inbox::schema::drop_schema(&pool, &schema).await;
                    pool.close().await;
                }
                if let Ok(broker) = Broker::connect(&amqp_url(), "bench test cleanup").await {
                    for slug in ["ceiling", "batch", "batch-sustained"] {
                        let topology = Topology::new(format!("{prefix}-{slug}"));
                        let retry = ConsumerConfig::new("bench", topology.clone()).retry;
                        let _ = broker.delete(&topology, &retry).await;
                    }
                    broker.close().await;
                }
            });
        })
        .join();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sustained_bench_holds_a_rate_and_checks_every_message() {
    let h = RandomState::new().hash_one((SystemTime::now(), std::process::id()));
    let cleanup = Cleanup {
        schema: format!("t_sustained_{h:016x}"),
        prefix: format!("t-{h:016x}-sustained"),
    };
    let out = Command::new(crate::bins::inbox_lab())
        .args(["bench", "--sustained", "--modes", "batch", "--runs", "1"])
        .args(["--messages", "2000", "--probes", "2", "--probe-secs", "2"])
        .args(["--hold-secs", "5", "--keys", "0"])
        .args([
            "--schema",
            &cleanup.schema,
            "--queue-prefix",
            &cleanup.prefix,
        ])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .env_remove("RUST_LOG")
        .output()
        .await
        .expect("inbox-lab runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    // Exit code 0 only when every message the stream published was applied exactly once.
    assert!(out.status.success(), "bench failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("broker ceiling (consume + multiple-ack, no db), drain:"),
        "{stdout}"
    );
    let row = stdout
        .lines()
        .find(|l| l.starts_with("| rabbit-inbox, batch handler"))
        .unwrap_or_else(|| panic!("no batch row in\n{stdout}"));
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    let drain: f64 = cells[2].parse().expect("drain rate");
    assert!(drain > 0.0, "{row}");
    assert_eq!(cells.last().copied(), Some(""), "{row}");
    assert_eq!(cells[cells.len() - 2], "yes", "exactly-once column: {row}");
    // Two probes and at least one hold, each reported.
    assert_eq!(stderr.matches("    probe ").count(), 2, "{stderr}");
    assert!(stderr.contains("    hold "), "{stderr}");
    // The run leaves no schema behind.
    let pool = sqlx::PgPool::connect(&database_url()).await.expect("pool");
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.schemata WHERE schema_name = $1",
    )
    .bind(&cleanup.schema)
    .fetch_one(&pool)
    .await
    .expect("schemata");
    assert_eq!(left, 0, "the bench drops its schema");
}
