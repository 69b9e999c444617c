//! `inboxctl replay-edited --dry-run` on a parked row: the diff, the changed paths and the
//! deterministic new id are printed, and nothing changes; an edit that edits nothing is
//! refused.

use inbox_testkit::{database_url, env::sha256, unique_suffix};
use rabbit_inbox::SchemaName;
use sqlx::{AssertSqlSafe, PgPool};

use crate::common::{Cleanup, inboxctl};

/// Removes a file when dropped.
struct TempFile(std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_edited_dry_run_prints_the_diff_and_the_new_id_and_changes_nothing() {
    let id = unique_suffix();
    let schema = SchemaName::new(format!("t_rpcli_{id}")).expect("schema");
    let _cleanup = Cleanup::schema(schema.as_str());
    let pool = PgPool::connect(&database_url()).await.expect("PostgreSQL");
    rabbit_inbox::migrate(&pool, &schema)
        .await
        .expect("migrate");
    // A poisoned row as the consumer leaves it, its body kept.
    let original = br#"{"invoice":"inv-42","amount":42,"currency":"EUR"}"#;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, payload_sha256, payload, headers, \
           last_error_code, last_failed_at) \
         VALUES ('inv-42', 'invoicer', 'InvoiceIssued', 1, 'POISONED', 1, $1, $2, \
           '{{\"x-tenant-id\": \"t-7\"}}', 'bad_amount', now())"
    )))
    .bind(sha256(original))
    .bind(original.as_slice())
    .execute(&pool)
    .await
    .expect("a parked row");
    let body_file = TempFile(std::env::temp_dir().join(format!("inboxctl-replay-{id}.json")));
    std::fs::write(
        &body_file.0,
        "{\n  \"invoice\": \"inv-42\",\n  \"amount\": 40,\n  \"currency\": \"EUR\"\n}\n",
    )
    .expect("edited body written");
    let schema_arg = schema.to_string();
    let path = body_file.0.to_string_lossy().into_owned();
    let args = [
        "replay-edited",
        "--schema",
        &schema_arg,
        "--consumer",
        "invoicer",
        "--message-id",
        "inv-42",
        "--body-file",
        &path,
        "--dry-run",
    ];

    let out = inboxctl(&[args.as_slice(), &["--json"]].concat()).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(report["dry_run"], true);
    assert_eq!(report["published"], false);
    assert_eq!(report["original_id"], "inv-42");
    assert_eq!(report["changed_paths"], serde_json::json!(["/amount"]));
    let new_id = report["replacement_id"]
        .as_str()
        .expect("the new id")
        .to_owned();
    assert_eq!(
        (new_id.len(), &new_id[14..15]),
        (36, "5"),
        "a UUID v5: {new_id}"
    );
    let diff = report["diff"].as_array().expect("the diff");
    assert!(diff.contains(&serde_json::json!({"op": "remove", "text": "  \"amount\": 42,"})));
    assert!(diff.contains(&serde_json::json!({"op": "add", "text": "  \"amount\": 40,"})));

    // For people: the diff and the same id again.
    let out = inboxctl(&args).await;
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&new_id), "{text}");
    assert!(text.contains("-   \"amount\": 42,") && text.contains("+   \"amount\": 40,"));

    // A dry run changes nothing and writes no audit row.
    let (status, replaced_by, audited): (String, Option<String>, i64) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, replaced_by, (SELECT count(*) FROM \"{schema}\".inbox_audit) \
             FROM \"{schema}\".message_inbox WHERE message_id = 'inv-42'"
        )))
        .fetch_one(&pool)
        .await
        .expect("the row");
    assert_eq!(
        (status.as_str(), replaced_by, audited),
        ("POISONED", None, 0)
    );

    // The original itself, however written, edits nothing: refused, exit code 1.
    std::fs::write(
        &body_file.0,
        br#"{ "currency": "EUR", "amount": 42, "invoice": "inv-42" }"#,
    )
    .expect("body written");
    let out = inboxctl(&args).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing edited"));
    // A real run needs the work queue.
    let out = inboxctl(&args[..args.len() - 1]).await;
    assert_eq!(out.status.code(), Some(2), "--queue is required");
    pool.close().await;
}
