//! `inboxctl migrate` started by several processes at the same instant on a fresh schema (a
//! rolling deploy starts instances exactly like this): every process exits 0 and the schema
//! holds the inbox tables once, and nothing else: exactly what the library's own migration
//! creates. Without `--schema` (or `INBOX_SCHEMA`) it refuses to guess.

use std::{process::Stdio, time::Duration};

use inbox_testkit::{database_url, unique_suffix};
use sqlx::PgPool;

use crate::common::{Cleanup, command};

/// Processes started together.
const PROCESSES: usize = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simultaneous_migrate_processes_all_exit_zero() {
    let schema = format!("t_start_{}", unique_suffix());
    let _cleanup = Cleanup::schema(&schema);

    // Spawned back to back; each then connects and migrates at about the same moment.
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            command()
                .args(["migrate", "--schema", &schema])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .expect("inboxctl starts")
        })
        .collect();
    let mut failures = Vec::new();
    for child in children {
        let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
            .await
            .expect("inboxctl migrate finishes within a minute")
            .expect("inboxctl output");
        if !out.status.success() {
            failures.push(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {PROCESSES} simultaneous `inboxctl migrate` failed: {failures:#?}",
        failures.len()
    );

    // The library's own migration in a second scratch schema is the reference.
    let pool = PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL is reachable");
    let reference = format!("{schema}_ref");
    let _reference_cleanup = Cleanup::schema(&reference);
    rabbit_inbox::migrate(
        &pool,
        &rabbit_inbox::SchemaName::new(&reference).expect("schema name"),
    )
    .await
    .expect("reference migration");
    let tables = async |schema: &str| -> Vec<String> {
        sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') ORDER BY 1",
        )
        .bind(schema)
        .fetch_all(&pool)
        .await
        .expect("catalog query")
    };
    let created = tables(&schema).await;
    assert!(created.iter().any(|t| t == "message_inbox"), "{created:?}");
    assert_eq!(created, tables(&reference).await, "only the inbox's tables");
    pool.close().await;
}

#[tokio::test]
async fn migrate_needs_a_schema() {
    // `command` leaves `INBOX_SCHEMA` out of the environment.
    let out = command()
        .arg("migrate")
        .output()
        .await
        .expect("inboxctl runs");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--schema"), "{stderr}");
}
