//! `inboxctl ordering`: the blocked keys of an ordered consumer, as a table and as JSON, and
//! skipping a key's head (refused for another head, audited when done) and a sequence gap.

use std::process::Output;

use inbox_testkit::env::TestEnv;
use serde_json::Value;
use sqlx::AssertSqlSafe;

use crate::common::inboxctl;

const CONSUMER: &str = "dispatcher";

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "JSON output ({e}): {}\nstderr: {}",
            text(&out.stdout),
            text(&out.stderr)
        )
    })
}

/// `order-1` (sequence numbers in `x-seq`) blocked by its parked head, number 1, with 2 and 3
/// held; `order-2` waiting for 1 with 3 held (a gap).
async fn ledger(env: &TestEnv) {
    let row = |id: &str, status: &str, key: &str, position: &str, minutes: u32| {
        format!(
            "INSERT INTO {{s}}.message_inbox (message_id, consumer_name, message_type, \
               message_version, status, payload_sha256, order_key, order_position, \
               first_received_at, headers, last_error_code, last_error_message) \
             VALUES ('{id}', '{CONSUMER}', 'Dispatch', 1, '{status}', sha256('{id}'::bytea), \
               '{key}', {position}, now() - interval '{minutes} minutes', \
               jsonb_build_object('x-seq', {seq}), {code}, {message});",
            seq = if position == "NULL" { "1" } else { position },
            code = if status == "HELD" {
                "NULL"
            } else {
                "'address_unknown'"
            },
            message = if status == "HELD" {
                "NULL"
            } else {
                "'no such street'"
            },
        )
    };
    let sql = [
        row("d-1", "PERMANENT_FAILED", "order-1", "NULL", 30),
        row("d-2", "HELD", "order-1", "2", 29),
        row("d-3", "HELD", "order-1", "3", 28),
        format!(
            "INSERT INTO {{s}}.inbox_order_key (consumer_name, order_key, head_message_id, \
               blocked_since, next_sequence) \
             VALUES ('{CONSUMER}', 'order-1', 'd-1', now() - interval '30 minutes', 1);"
        ),
        row("e-3", "HELD", "order-2", "3", 10),
        format!(
            "INSERT INTO {{s}}.inbox_order_key (consumer_name, order_key, next_sequence, \
               gap_since) VALUES ('{CONSUMER}', 'order-2', 1, now() - interval '10 minutes');"
        ),
    ]
    .concat()
    .replace("{s}", &format!("\"{}\"", env.schema));
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&env.pool)
        .await
        .expect("ledger rows");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_blocked_and_skip() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let schema = env.schema.as_str().to_owned();
    let base = ["--schema", schema.as_str(), "--consumer", CONSUMER];
    let run = async |extra: &[&str]| {
        let args: Vec<&str> = ["ordering"]
            .iter()
            .chain(&extra[..1])
            .chain(&base)
            .chain(&extra[1..])
            .copied()
            .collect();
        inboxctl(&args).await
    };

    let out = run(&["blocked", "--json"]).await;
    assert!(out.status.success(), "{out:?}");
    let keys = json_of(&out);
    let keys = keys.as_array().expect("an array of keys");
    assert_eq!(keys.len(), 2, "{keys:#?}");
    assert_eq!(keys[0]["order_key"], "order-1");
    assert_eq!(keys[0]["reason"], "head");
    assert_eq!(keys[0]["head_message_id"], "d-1");
    assert_eq!(keys[0]["head_status"], "PERMANENT_FAILED");
    assert_eq!(keys[0]["head_error_code"], "address_unknown");
    assert_eq!(keys[0]["held"], 2);
    assert_eq!(keys[1]["order_key"], "order-2");
    assert_eq!(keys[1]["reason"], "sequence_gap");
    assert_eq!(
        (
            keys[1]["next_sequence"].as_i64(),
            keys[1]["first_held_position"].as_i64()
        ),
        (Some(1), Some(3))
    );

    let out = run(&["blocked"]).await;
    assert!(out.status.success(), "{out:?}");
    let table = text(&out.stdout);
    let line = |key: &str| {
        table
            .lines()
            .find(|l| l.contains(key))
            .unwrap_or_else(|| panic!("a line of {key} in\n{table}"))
            .to_owned()
    };
    assert!(line("order-1").contains("PERMANENT_FAILED"), "{table}");
    assert!(line("order-1").contains("30m"), "its age: {table}");
    assert!(line("order-2").contains("sequence gap"), "{table}");

    // Refused: not audited without an actor; another head than the key's.
    let out = run(&["skip", "--key", "order-1", "--head", "d-1"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(text(&out.stderr).contains("--actor"), "{out:?}");
    let actor = ["--actor", "alice", "--reason", "address will never exist"];
    let out = run(&[&["skip", "--key", "order-1", "--head", "d-2"], &actor[..]].concat()).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        text(&out.stderr).contains("blocked by d-1, not by d-2"),
        "{out:?}"
    );

    let skip = [
        &[
            "skip",
            "--key",
            "order-1",
            "--head",
            "d-1",
            "--sequence-header",
            "x-seq",
        ],
        &actor[..],
        &["--ticket", "INC-12", "--json"],
    ]
    .concat();
    let out = run(&skip).await;
    assert!(out.status.success(), "{out:?}");
    let skipped = json_of(&out);
    assert_eq!(skipped["skipped"], "head");
    assert_eq!(skipped["head_status"], "PERMANENT_FAILED");
    assert_eq!(
        (
            skipped["next_sequence_before"].as_i64(),
            skipped["next_sequence_after"].as_i64()
        ),
        (Some(1), Some(2))
    );
    assert_eq!(skipped["to_release"], 2);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_audit WHERE action = 'skip_head' \
             AND actor = 'alice' AND ticket = 'INC-12' AND message_id = 'd-1' \
             AND reason = 'address will never exist' AND details ->> 'order_key' = 'order-1'"
        )
        .await,
        1
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE message_id = 'd-1' \
             AND status = 'PERMANENT_FAILED'"
        )
        .await,
        1,
        "the head stays parked"
    );

    // The gap: skipped without --head, told in a table.
    let out = run(&[&["skip", "--key", "order-2"], &actor[..]].concat()).await;
    assert!(out.status.success(), "{out:?}");
    assert!(text(&out.stdout).contains("1 -> 3"), "{out:?}");
    assert!(
        text(&out.stderr).contains("1 of 1 held message(s) go on now"),
        "{out:?}"
    );
    let out = run(&["blocked", "--json"]).await;
    assert_eq!(json_of(&out), serde_json::json!([]));
}
