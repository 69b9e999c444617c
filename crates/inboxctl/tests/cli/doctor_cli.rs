//! `inboxctl doctor` against real servers: its exit code says the worst finding (0 all pass,
//! 3 warnings only, 1 a failure) and `--json` names the failing check.

use std::{process::Output, time::Duration};

use inbox_testkit::{amqp_url, database_url, unique_suffix};
use rabbit_inbox::{RetryPolicy, SchemaName, Topology, broker::Broker};
use serde_json::Value;
use sqlx::{AssertSqlSafe, PgPool};

use crate::common::{Cleanup, command};

const CONSUMER: &str = "doctor-svc";

fn retry() -> RetryPolicy {
    RetryPolicy::fixed(Duration::from_secs(2))
}

async fn doctor(schema: &SchemaName, topology: &Topology, extra: &[&str]) -> (Output, Value) {
    let output = command()
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
    let id = unique_suffix();
    let schema = SchemaName::new(format!("t_dcli_{id}")).expect("schema");
    let topology = Topology::new(format!("t-dcli-{id}"));
    let _cleanup = Cleanup::schema(schema.as_str()).queues(&topology, retry());
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
        "ALTER TABLE \"{schema}\".message_inbox DROP CONSTRAINT message_inbox_pkey CASCADE, \
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
