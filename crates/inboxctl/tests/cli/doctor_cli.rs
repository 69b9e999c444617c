//! `inboxctl doctor` against real servers: its exit code says the worst finding (0 all pass,
//! 3 warnings only, 1 a failure) and `--json` names the failing check.

use std::{
    hash::{BuildHasher, RandomState},
    process::Output,
    time::{Duration, SystemTime},
};

use rabbit_inbox::{RetryPolicy, SchemaName, Topology, broker::Broker};
use serde_json::Value;
use sqlx::{AssertSqlSafe, PgPool};
use tokio::process::Command;

const CONSUMER: &str = "doctor-svc";

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn retry() -> RetryPolicy {
    RetryPolicy::fixed(Duration::from_secs(2))
}

/// Drops the schema and deletes the queues when dropped, also when the test panics.
struct Cleanup(SchemaName, Topology);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (schema, topology) = (self.0.clone(), self.1.clone());
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(broker) = Broker::connect(&amqp_url(), "test cleanup").await {
                    let _ = broker.delete(&topology, &retry()).await;
                    broker.close().await;
                }
                if let Ok(pool) = PgPool::connect(&database_url()).await {
                    let _ = rabbit_inbox::schema::drop_schema(&pool, &schema).await;
                    pool.close().await;
                }
            });
        })
        .join();
    }
}

async fn doctor(schema: &SchemaName, topology: &Topology, extra: &[&str]) -> (Output, Value) {
    let output = Command::new(env!("CARGO_BIN_EXE_inboxctl"))
        .args([
            "doctor",
            "--schema",
            schema.as_str(),
            "--consumer",
            CONSUMER,
            "--queue",
            &topology.queue,
            "--retry-delays",
            "2s",
            "--json",
        ])
        .args(extra)
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .env_remove("RUST_LOG")
        .env_remove("INBOX_SCHEMA")
        .env_remove("INBOX_CONSUMER")
        .env_remove("INBOX_MANAGEMENT_URL")
        .output()
        .await
        .expect("inboxctl runs");
    let json = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON on stdout ({e}): {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output, json)
}

fn severity_of<'a>(report: &'a Value, id: &str) -> &'a str {
    report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["id"] == id))
        .and_then(|c| c["severity"].as_str())
        .unwrap_or_else(|| panic!("no check {id}: {report:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_exit_code_and_json_say_the_worst_finding() {
    let h = RandomState::new().hash_one((SystemTime::now(), std::process::id()));
    let schema = SchemaName::new(format!("t_dcli_{h:016x}")).expect("schema");
    let topology = Topology::new(format!("t-dcli-{h:016x}"));
    let _cleanup = Cleanup(schema.clone(), topology.clone());
    let pool = PgPool::connect(&database_url()).await.expect("PostgreSQL");
    rabbit_inbox::migrate(&pool, &schema)
        .await
        .expect("migrate");
    let broker = Broker::connect(&amqp_url(), "doctor cli test")
        .await
        .expect("RabbitMQ");
    broker.declare(&topology, &retry()).await.expect("declare");
    broker.close().await;

    // As deployed: every check passes.
    let (output, report) = doctor(&schema, &topology, &[]).await;
    assert_eq!(output.status.code(), Some(0), "{report:#}");
    assert_eq!(report["worst"], "pass");
    assert_eq!(severity_of(&report, "broker.retry_tiers"), "pass");

    // The management API out of reach: the topology is not checked, a warning.
    let (output, report) = doctor(
        &schema,
        &topology,
        &["--management-url", "http://127.0.0.1:1"],
    )
    .await;
    assert_eq!(output.status.code(), Some(3), "{report:#}");
    assert_eq!(severity_of(&report, "broker.topology"), "warn");

    // Keyed by message id alone: deduplication across consumers is broken.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "ALTER TABLE \"{schema}\".message_inbox DROP CONSTRAINT message_inbox_pkey, \
           ADD PRIMARY KEY (message_id)"
    )))
    .execute(&pool)
    .await
    .expect("key changed");
    let (output, report) = doctor(&schema, &topology, &[]).await;
    assert_eq!(output.status.code(), Some(1), "{report:#}");
    assert_eq!(report["worst"], "fail");
    assert_eq!(severity_of(&report, "schema.primary_key"), "fail");
    assert_eq!(severity_of(&report, "schema.migrations"), "pass");
    pool.close().await;
}
