//! `inboxctl cleanup` and `inboxctl grants` as an operator runs them, on an inbox of a small
//! service of its own (not the example): a dry run changes nothing and says what would go, an
//! unsafe window exits non-zero and says what to set, a forced run is audited, `grants` prints
//! SQL that PostgreSQL accepts; the exit codes the README gives for `cleanup` and `reopen`.

use std::process::Output;

use inbox_testkit::{database_url, unique_suffix};
use sqlx::{AssertSqlSafe, PgPool};

use crate::common::{Cleanup, inboxctl};

async fn count(pool: &PgPool, sql: String) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test]
async fn cleanup_and_grants_from_the_command_line() {
    let schema = format!("t_cli_{}", unique_suffix());
    let _cleanup = Cleanup::schema(&schema).role(format!("{schema}_ro"));
    let pool = PgPool::connect(&database_url()).await.expect("PostgreSQL");
    let name = rabbit_inbox::SchemaName::new(&schema).expect("valid");
    rabbit_inbox::migrate(&pool, &name).await.expect("migrated");
    // A small "billing" service's ledger: 40 rows past 30 days, 10 of today.
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, first_received_at, processed_at, \
           payload_sha256) \
         SELECT 'inv-' || g, 'billing', 'InvoiceIssued', 1, 'PROCESSED', 1, \
           now() - make_interval(days => CASE WHEN g <= 40 THEN 45 ELSE 0 END), \
           now() - make_interval(days => CASE WHEN g <= 40 THEN 45 ELSE 0 END), \
           sha256(g::text::bytea) FROM generate_series(1, 50) AS g"
    )))
    .execute(&pool)
    .await
    .expect("seeded");
    let rows = || {
        count(
            &pool,
            format!("SELECT count(*) FROM \"{schema}\".message_inbox"),
        )
    };

    let dry = inboxctl(&[
        "cleanup",
        "--schema",
        &schema,
        "--consumer",
        "billing",
        "--dry-run",
        "--json",
    ])
    .await;
    assert!(
        dry.status.success(),
        "{}",
        String::from_utf8_lossy(&dry.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&dry.stdout).expect("JSON");
    assert_eq!(report["removed_processed"], 40);
    assert_eq!(report["dry_run"], true);
    assert_eq!(rows().await, 50, "a dry run changes nothing");

    let refused = inboxctl(&[
        "cleanup",
        "--schema",
        &schema,
        "--consumer",
        "billing",
        "--processed-retention",
        "1day",
        "--tombstone-retention",
        "2days",
        "--no-scrub",
    ])
    .await;
    assert_eq!(refused.status.code(), Some(1), "a refusal exits 1");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("unsafe retention window") && stderr.contains("at least 14days"),
        "{stderr}"
    );
    assert_eq!(rows().await, 50);

    let forced = inboxctl(&[
        "cleanup",
        "--schema",
        &schema,
        "--consumer",
        "billing",
        "--processed-retention",
        "1day",
        "--tombstone-retention",
        "2days",
        "--no-scrub",
        "--force",
        "--actor",
        "bob",
        "--reason",
        "replays of billing are disabled",
    ])
    .await;
    assert!(
        forced.status.success(),
        "{}",
        String::from_utf8_lossy(&forced.stderr)
    );
    let table = String::from_utf8_lossy(&forced.stdout);
    assert!(
        table.contains("PROCESSED rows deleted") && table.contains("FORCED"),
        "{table}"
    );
    assert_eq!(rows().await, 10, "the recent rows are younger than 1 day");
    assert_eq!(
        count(
            &pool,
            format!(
                "SELECT count(*) FROM \"{schema}\".inbox_audit WHERE action = 'cleanup_forced' \
                 AND actor = 'bob'"
            )
        )
        .await,
        1
    );

    // The printed grants are valid SQL for an existing role.
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE ROLE \"{schema}_ro\"")))
        .execute(&pool)
        .await
        .expect("role");
    let grants = inboxctl(&[
        "grants",
        "--schema",
        &schema,
        "--role",
        "operator",
        "--grantee",
        &format!("{schema}_ro"),
    ])
    .await;
    assert!(grants.status.success());
    let sql = String::from_utf8(grants.stdout).expect("text");
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&pool)
        .await
        .expect("grants apply");
    assert_eq!(
        count(
            &pool,
            format!(
                "SELECT count(*) FROM information_schema.role_table_grants \
                 WHERE grantee = '{schema}_ro' AND privilege_type = 'SELECT'"
            )
        )
        .await,
        count(
            &pool,
            format!(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = '{schema}' \
                 AND table_name <> '_rabbit_inbox_migrations'"
            )
        )
        .await,
        "SELECT on every inbox table of the schema (the migrations ledger only through the \
         columns the doctor reads)"
    );
    let bad = inboxctl(&[
        "grants",
        "--schema",
        &schema,
        "--role",
        "root",
        "--grantee",
        "x",
    ])
    .await;
    assert!(!bad.status.success());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP OWNED BY \"{schema}_ro\"; DROP ROLE \"{schema}_ro\""
    )))
    .execute(&pool)
    .await
    .expect("role dropped");
}

fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn cleanup_and_reopen_exit_as_documented() {
    let schema = format!("t_cli_exit_{}", unique_suffix());
    let _cleanup = Cleanup::schema(&schema);
    let pool = PgPool::connect(&database_url()).await.expect("PostgreSQL");
    let name = rabbit_inbox::SchemaName::new(&schema).expect("valid");
    rabbit_inbox::migrate(&pool, &name).await.expect("migrated");
    let cleanup = |extra: &[&str]| {
        let mut args = vec!["cleanup", "--schema", &schema, "--consumer", "svc"];
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = async |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        inboxctl(&args).await
    };

    // The README's refused window, with its flags: exit 1, and the message names the flags to
    // change.
    let refused = run(cleanup(&[
        "--processed-retention",
        "1day",
        "--scrub-after",
        "12h",
    ]))
    .await;
    let stderr = stderr_of(&refused);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--processed-retention = 1day is shorter than")
            && stderr.contains("set --processed-retention to at least 14days 2m 36s")
            && stderr.contains("or shorten --replay-window"),
        "{stderr}"
    );
    assert!(!stderr.contains("retention."), "setting names: {stderr}");
    // Without --scrub-after, the default (3 days) outlives 1-day rows: a bad setting, exit 2.
    let scrub = run(cleanup(&["--processed-retention", "1day"])).await;
    assert_eq!(scrub.status.code(), Some(2), "{}", stderr_of(&scrub));
    assert!(stderr_of(&scrub).contains("scrub_payload_after"));
    // --force needs --actor and --reason: a bad argument, exit 2 (nothing runs).
    let unnamed = run(cleanup(&[
        "--processed-retention",
        "1day",
        "--scrub-after",
        "12h",
        "--force",
    ]))
    .await;
    assert_eq!(unnamed.status.code(), Some(2), "{}", stderr_of(&unnamed));
    assert!(stderr_of(&unnamed).contains("--actor"));
    // Retention runs per consumer: --consumer is required, and --help says so.
    let everyone = inboxctl(&["cleanup", "--schema", &schema, "--dry-run"]).await;
    assert_eq!(everyone.status.code(), Some(2));
    assert!(stderr_of(&everyone).contains("--consumer"));

    // reopen acts on one row: --consumer is required (exit 2), and the help says so.
    let help = inboxctl(&["reopen", "--help"]).await;
    let help = String::from_utf8_lossy(&help.stdout);
    let consumer_help = help
        .lines()
        .find(|l| l.trim_start().starts_with("--consumer"))
        .unwrap_or_default();
    assert!(
        consumer_help.contains("required") && !consumer_help.contains("all consumers"),
        "{consumer_help}"
    );
    let actor = ["--actor", "alice", "--reason", "fix deployed"];
    let mut no_consumer = vec!["reopen", "inv-1", "--schema", &schema];
    no_consumer.extend_from_slice(&actor);
    let out = inboxctl(&no_consumer).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    // An id the inbox has no row for: nothing to reopen, exit 1.
    let mut unknown = vec!["reopen", "inv-1", "--schema", &schema, "--consumer", "svc"];
    unknown.extend_from_slice(&actor);
    let out = inboxctl(&unknown).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("no inbox row for inv-1"));
    assert_eq!(
        count(
            &pool,
            format!("SELECT count(*) FROM \"{schema}\".inbox_audit")
        )
        .await,
        0,
        "nothing ran"
    );
    pool.close().await;
}
