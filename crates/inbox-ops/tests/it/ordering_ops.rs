//! The operator's side of ordered processing on a ledger written as an ordered consumer
//! leaves it: keys blocked behind a parked head with held messages after it, a key waiting on
//! a sequence gap, and skipping each (refused when the head is another one or nothing waits).

use inbox_ops::{
    Actor, Operations, OpsError,
    audit::AuditFilter,
    ordering::{BlockReason, SKIP_HEAD},
};
use inbox_testkit::env::TestEnv;
use sqlx::AssertSqlSafe;

const CONSUMER: &str = "shipper";

/// Runs `sql` with `{s}` standing for the quoted schema.
async fn exec(env: &TestEnv, sql: &str) {
    let sql = sql.replace("{s}", &format!("\"{}\"", env.schema));
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&env.pool)
        .await
        .expect("statement runs");
}

/// A row of `key` in `status`, at `position` (if any), received `minutes` ago; its headers
/// carry `sequence` (else its position) as `x-sequence`.
fn row(id: &str, status: &str, key: &str, position: Option<i64>, minutes: i64) -> String {
    let sequence = position.map_or("NULL".to_owned(), |p| p.to_string());
    head_row(id, status, key, position, &sequence, minutes)
}

fn head_row(
    id: &str,
    status: &str,
    key: &str,
    position: Option<i64>,
    sequence: &str,
    minutes: i64,
) -> String {
    let position = position.map_or("NULL".to_owned(), |p| p.to_string());
    format!(
        "INSERT INTO {{s}}.message_inbox (message_id, consumer_name, message_type, \
           message_version, status, payload_sha256, order_key, order_position, \
           first_received_at, headers, last_error_code, last_error_message) \
         VALUES ('{id}', '{CONSUMER}', 'Shipment', 1, '{status}', sha256('{id}'::bytea), \
           '{key}', {position}, now() - interval '{minutes} minutes', \
           jsonb_build_object('x-sequence', {sequence}), \
           CASE WHEN '{status}' = 'HELD' THEN NULL ELSE 'carrier_refused' END, \
           CASE WHEN '{status}' = 'HELD' THEN NULL ELSE 'carrier said no' END);"
    )
}

/// A key's row: blocked by `head` since `minutes` ago, or (without a head) waiting on a gap
/// since then.
fn key_row(key: &str, head: Option<&str>, next: Option<i64>, minutes: i64) -> String {
    let next = next.map_or("NULL".to_owned(), |n| n.to_string());
    let since = format!("now() - interval '{minutes} minutes'");
    let (head, blocked, gap) = match head {
        Some(h) => (format!("'{h}'"), since, "NULL".to_owned()),
        None => ("NULL".to_owned(), "NULL".to_owned(), since),
    };
    format!(
        "INSERT INTO {{s}}.inbox_order_key (consumer_name, order_key, head_message_id, \
           blocked_since, next_sequence, gap_since) \
         VALUES ('{CONSUMER}', '{key}', {head}, {blocked}, {next}, {gap});"
    )
}

/// The ledger: `seq-1` (sequence numbers) blocked by its parked head, number 3 (a first
/// delivery that failed: no position stored), with 4 and 5 held; `seq-2` waiting for 2 and 3
/// with 4 and 5 held; `arrival-1` (no sequence numbers) blocked by a retrying head with two
/// held; `seq-3` blocked like `seq-1`; `seq-free` waiting for nothing.
async fn ledger(env: &TestEnv) {
    let statements = [
        head_row("s1-3", "PERMANENT_FAILED", "seq-1", None, "3", 10),
        row("s1-4", "HELD", "seq-1", Some(4), 9),
        row("s1-5", "HELD", "seq-1", Some(5), 8),
        key_row("seq-1", Some("s1-3"), Some(3), 10),
        row("s2-4", "HELD", "seq-2", Some(4), 5),
        row("s2-5", "HELD", "seq-2", Some(5), 4),
        key_row("seq-2", None, Some(2), 5),
        row("a1-1", "RETRYABLE_FAILED", "arrival-1", None, 20),
        row("a1-2", "HELD", "arrival-1", Some(101), 19),
        row("a1-3", "HELD", "arrival-1", Some(102), 18),
        key_row("arrival-1", Some("a1-1"), None, 20),
        head_row("s3-1", "POISONED", "seq-3", None, "'1'", 1),
        row("s3-2", "HELD", "seq-3", Some(2), 1),
        key_row("seq-3", Some("s3-1"), Some(1), 1),
        key_row("seq-free", None, Some(7), 30),
    ];
    exec(env, &statements.concat()).await;
}

fn actor() -> Actor {
    Actor::new("alice", "carrier will never accept it")
        .expect("actor")
        .with_ticket("INC-9")
        .expect("ticket")
}

async fn status_of(env: &TestEnv, id: &str) -> String {
    env.record(CONSUMER, id)
        .await
        .expect("the row is kept")
        .status
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_keys_lists_heads_and_gaps_oldest_first() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let ops = Operations::new(env.pool.clone(), env.schema.clone());

    let keys = ops.blocked_keys(CONSUMER, 100).await.expect("blocked keys");
    let names: Vec<&str> = keys.iter().map(|k| k.order_key.as_str()).collect();
    assert_eq!(names, ["arrival-1", "seq-1", "seq-2", "seq-3"], "{keys:#?}");
    let seq1 = &keys[1];
    assert_eq!(seq1.reason, BlockReason::Head);
    assert_eq!(seq1.head_message_id.as_deref(), Some("s1-3"));
    assert_eq!(seq1.head_status.as_deref(), Some("PERMANENT_FAILED"));
    assert_eq!(seq1.head_error_code.as_deref(), Some("carrier_refused"));
    assert_eq!(seq1.head_error.as_deref(), Some("carrier said no"));
    assert_eq!((seq1.held, seq1.next_sequence), (2, Some(3)));
    assert_eq!(seq1.first_held_position, Some(4));
    assert!(
        (590.0..700.0).contains(&seq1.age_seconds),
        "blocked 10 minutes ago: {}",
        seq1.age_seconds
    );
    let seq2 = &keys[2];
    assert_eq!(seq2.reason, BlockReason::SequenceGap);
    assert_eq!(
        (seq2.head_message_id.as_deref(), seq2.head_status.as_deref()),
        (None, None)
    );
    assert_eq!(
        (seq2.held, seq2.next_sequence, seq2.first_held_position),
        (2, Some(2), Some(4))
    );
    assert!(
        seq2.blocked_since.is_some() && seq2.age_seconds >= 290.0,
        "{seq2:?}"
    );
    assert_eq!(keys[0].head_status.as_deref(), Some("RETRYABLE_FAILED"));
    assert_eq!((keys[0].held, keys[0].next_sequence), (2, None));

    let json = serde_json::to_value(seq2).expect("serializes");
    assert_eq!(json["reason"], "sequence_gap");
    let first = ops.blocked_keys(CONSUMER, 1).await.expect("one key");
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].order_key, "arrival-1");
    assert!(
        ops.blocked_keys("nobody", 10)
            .await
            .expect("none")
            .is_empty()
    );
    assert!(matches!(
        ops.blocked_keys(CONSUMER, 0).await,
        Err(OpsError::Invalid(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skip_head_unblocks_a_key_and_leaves_its_head_parked() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    let ops =
        Operations::new(env.pool.clone(), env.schema.clone()).with_sequence_header("x-sequence");

    let refused = |r: Result<_, OpsError>, says: &str| match r {
        Err(OpsError::Invalid(m)) => assert!(m.contains(says), "{m}"),
        other => panic!("expected a refusal saying {says:?}, got {other:?}"),
    };
    refused(
        ops.skip_head(&actor(), CONSUMER, "seq-1", Some("s1-4"))
            .await,
        "blocked by s1-3, not by s1-4",
    );
    refused(
        ops.skip_head(&actor(), CONSUMER, "seq-free", None).await,
        "nothing to skip",
    );
    refused(
        ops.skip_head(&actor(), CONSUMER, "seq-free", Some("s1-3"))
            .await,
        "not blocked",
    );
    refused(
        ops.skip_head(&actor(), CONSUMER, "never-seen", None).await,
        "no ordering state",
    );
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.inbox_audit").await, 0);

    let skipped = ops
        .skip_head(&actor(), CONSUMER, "seq-1", Some("s1-3"))
        .await
        .expect("skips the head");
    assert_eq!(skipped.skipped, BlockReason::Head);
    assert_eq!(skipped.head_message_id.as_deref(), Some("s1-3"));
    assert_eq!(skipped.head_status.as_deref(), Some("PERMANENT_FAILED"));
    assert_eq!(
        (skipped.next_sequence_before, skipped.next_sequence_after),
        (Some(3), Some(4))
    );
    assert_eq!((skipped.held, skipped.to_release), (2, 2));
    assert_eq!(status_of(&env, "s1-3").await, "PERMANENT_FAILED");
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_order_key WHERE order_key = 'seq-1' \
             AND head_message_id IS NULL AND blocked_since IS NULL AND next_sequence = 4 \
             AND gap_since IS NULL"
        )
        .await,
        1
    );

    let trail = ops
        .audit_trail(&AuditFilter {
            action: Some(SKIP_HEAD.into()),
            ..AuditFilter::default()
        })
        .await
        .expect("audit trail");
    assert_eq!(trail.len(), 1, "{trail:#?}");
    let entry = &trail[0];
    assert_eq!(entry.audit_id, skipped.audit_id);
    assert_eq!(
        (entry.actor.as_str(), entry.ticket.as_deref()),
        ("alice", Some("INC-9"))
    );
    assert_eq!(entry.reason, "carrier will never accept it");
    assert_eq!(entry.consumer_name.as_deref(), Some(CONSUMER));
    assert_eq!(entry.message_id.as_deref(), Some("s1-3"));
    let d = &entry.details;
    assert_eq!(
        (d["order_key"].as_str(), d["skipped"].as_str()),
        (Some("seq-1"), Some("head"))
    );
    assert_eq!(d["head_status"], "PERMANENT_FAILED");
    assert_eq!(
        (d["held"].as_i64(), d["to_release"].as_i64()),
        (Some(2), Some(2))
    );
    assert_eq!(
        (
            d["next_sequence_before"].as_i64(),
            d["next_sequence_after"].as_i64()
        ),
        (Some(3), Some(4))
    );

    // Skipped once, the key waits for nothing: a second skip is refused.
    refused(
        ops.skip_head(&actor(), CONSUMER, "seq-1", Some("s1-3"))
            .await,
        "not blocked",
    );
    let left: Vec<String> = ops
        .blocked_keys(CONSUMER, 100)
        .await
        .expect("blocked keys")
        .into_iter()
        .map(|k| k.order_key)
        .collect();
    assert_eq!(left, ["arrival-1", "seq-2", "seq-3"]);

    // Without sequence numbers every held message goes on.
    let arrival = ops
        .skip_head(&actor(), CONSUMER, "arrival-1", None)
        .await
        .expect("skips the retrying head");
    assert_eq!((arrival.to_release, arrival.next_sequence_after), (2, None));
    assert_eq!(status_of(&env, "a1-1").await, "RETRYABLE_FAILED");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_skipped_and_an_unknown_head_number_leaves_one() {
    let env = TestEnv::new().await;
    ledger(&env).await;
    // No sequence header known: the heads' numbers cannot be read.
    let ops = Operations::new(env.pool.clone(), env.schema.clone());

    let gap = ops
        .skip_head(&actor(), CONSUMER, "seq-2", None)
        .await
        .expect("skips the gap");
    assert_eq!(gap.skipped, BlockReason::SequenceGap);
    assert_eq!(gap.head_message_id, None);
    assert_eq!(
        (gap.next_sequence_before, gap.next_sequence_after),
        (Some(2), Some(4))
    );
    assert_eq!(gap.to_release, 2);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_audit WHERE action = 'skip_head' \
             AND message_id IS NULL AND details ->> 'skipped' = 'sequence_gap' \
             AND (details ->> 'next_sequence_after')::int = 4"
        )
        .await,
        1
    );

    // seq-3's head (number 1, unreadable here) is skipped; the key still waits for 1, so its
    // held number 2 now waits on a gap, which the listing shows and a second skip passes.
    let head = ops
        .skip_head(&actor(), CONSUMER, "seq-3", Some("s3-1"))
        .await
        .expect("skips the head");
    assert_eq!((head.next_sequence_after, head.to_release), (Some(1), 0));
    assert_eq!(status_of(&env, "s3-1").await, "POISONED");
    let keys = ops.blocked_keys(CONSUMER, 100).await.expect("blocked keys");
    let seq3 = keys
        .iter()
        .find(|k| k.order_key == "seq-3")
        .expect("seq-3 waits on a gap");
    assert_eq!(seq3.reason, BlockReason::SequenceGap);
    assert!(
        seq3.blocked_since.is_some(),
        "the gap's clock runs: {seq3:?}"
    );
    let second = ops
        .skip_head(&actor(), CONSUMER, "seq-3", None)
        .await
        .expect("skips the gap");
    assert_eq!(
        (second.next_sequence_after, second.to_release),
        (Some(2), 1)
    );
}
