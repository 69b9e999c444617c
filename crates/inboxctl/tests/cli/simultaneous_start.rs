//! `inboxctl migrate` started by several processes at the same instant on a fresh schema (a
//! rolling deploy starts instances exactly like this): every process exits 0 and the schema
//! holds the inbox tables once, and nothing else: exactly what the library's own migration
//! creates. Without `--schema` (or `INBOX_SCHEMA`) it refuses to guess.

use std::{
    hash::{BuildHasher, RandomState},
    process::Stdio,
    time::{Duration, SystemTime},
};

use sqlx::PgPool;
use tokio::process::Command;

/// Processes started together.
const PROCESSES: usize = 6;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// Drops the schema when dropped, also when the test panics.
struct DropSchema(String);

impl Drop for DropSchema {
    fn drop(&mut self) {
        let schema = self.0.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cleanup runtime");
            runtime.block_on(async {
                if let Ok(pool) = PgPool::connect(&database_url()).await {
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
                    )))
                    .execute(&pool)
                    .await;
                    pool.close().await;
                }
            });
        })
        .join();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simultaneous_migrate_processes_all_exit_zero() {
    let h = RandomState::new().hash_one((SystemTime::now(), std::process::id()));
    let schema = format!("t_start_{h:016x}");
    let _cleanup = DropSchema(schema.clone());

    // Spawned back to back; each then connects and migrates at about the same moment.
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_inboxctl"))
                .args(["migrate", "--schema", &schema])
                .env("DATABASE_URL", database_url())
                .env_remove("RUST_LOG")
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
    let _reference_cleanup = DropSchema(reference.clone());
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
    let out = Command::new(env!("CARGO_BIN_EXE_inboxctl"))
        .arg("migrate")
        .env("DATABASE_URL", database_url())
        .env_remove("INBOX_SCHEMA")
        .output()
        .await
        .expect("inboxctl runs");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--schema"), "{stderr}");
}
