//! Retention against the real servers: cleanup beside running consumers keeps every duplicate
//! inside the window suppressed, leaves tombstones, scrubs payloads first, archives on request,
//! refuses an unsafe window (unless forced, audited), and runs one cleaner at a time.

use std::time::Duration;

use inbox_ops::{
    Actor, NoProgress, Operations, OpsError, RetentionTask, history::TimelineKind,
    retention::CleanupRequest,
};
use inbox_testkit::env::{TestEnv, thing, wait_for};
use rabbit_inbox::{
    ConfigError, InboxStatus, PayloadStorage, Topology, retention::RetentionMode,
    retention::RetentionPolicy, retention::TypeRetention,
};
use sqlx::AssertSqlSafe;

const DAY: Duration = Duration::from_secs(86_400);

/// A policy whose window fits the test retry schedule: rows 30 days, payloads 3 days.
fn policy(batch_size: u32) -> RetentionPolicy {
    RetentionPolicy {
        batch_size,
        ..RetentionPolicy::default()
    }
}

/// Inserts `n` PROCESSED rows `prefix1..prefixn` of `consumer`, processed `days` ago, with a
/// payload and headers.
async fn seed(env: &TestEnv, consumer: &str, prefix: &str, n: i64, days: i64) {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, first_received_at, processed_at, \
           payload_sha256, payload, headers) \
         SELECT $1 || g, $2, 'Thing', 1, 'PROCESSED', 1, \
           now() - make_interval(days => $4::int), now() - make_interval(days => $4::int), \
           sha256(($1 || g)::bytea), convert_to('{{}}', 'UTF8'), '{{\"h\": 1}}'::jsonb \
         FROM generate_series(1, $3) AS g",
        env.schema
    )))
    .bind(prefix)
    .bind(consumer)
    .bind(n)
    .bind(i32::try_from(days).expect("days"))
    .execute(&env.pool)
    .await
    .expect("rows seeded");
}

/// Moves the processing time of `consumer`'s rows whose id starts with `prefix` `days` back.
async fn age(env: &TestEnv, consumer: &str, prefix: &str, days: i32) {
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}\".message_inbox SET processed_at = processed_at - make_interval(days => $3), \
           first_received_at = first_received_at - make_interval(days => $3) \
         WHERE consumer_name = $1 AND message_id LIKE $2 || '%'",
        env.schema
    )))
    .bind(consumer)
    .bind(prefix)
    .bind(days)
    .execute(&env.pool)
    .await
    .expect("rows aged");
}

fn ops(env: &TestEnv) -> Operations {
    Operations::new(env.pool.clone(), env.schema.clone())
}

fn request(env: &TestEnv, consumer: &str, retention: RetentionPolicy) -> CleanupRequest {
    CleanupRequest::new(
        consumer,
        retention,
        env.config(consumer, Topology::new("unused")).retry,
    )
}

#[tokio::test]
async fn cleanup_beside_consumers_keeps_duplicates_within_the_window_suppressed() {
    let env = TestEnv::new().await;
    let topology = env.topology("orders");
    let mut config = env.config("svc", topology.clone());
    config.payload_storage = PayloadStorage::Always;
    env.declare(&config).await;
    let (handler, _) = env.handler();
    let first = env.start(config.clone(), handler.clone());
    let second = env.start(config.clone(), handler.clone());

    // Old rows (past the window), rows whose payload is past its 3 days, fresh rows.
    for i in 0..60 {
        env.publish(&topology, &thing(&format!("old-{i}"), i)).await;
        env.publish(&topology, &thing(&format!("mid-{i}"), i)).await;
        env.publish(&topology, &thing(&format!("new-{i}"), i)).await;
    }
    wait_for("180 processed", async || {
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE status = 'PROCESSED'")
            .await
            == 180
    })
    .await;
    age(&env, "svc", "old-", 40).await;
    age(&env, "svc", "mid-", 5).await;

    // Cleanup in batches of 7 while both consumers take new messages and duplicates of the
    // rows inside the window.
    let ops = ops(&env);
    let req = request(&env, "svc", policy(7));
    let cleanup = tokio::spawn({
        let ops = ops.clone();
        let req = req.clone();
        async move { ops.cleanup(&req, &NoProgress).await }
    });
    for i in 0..60 {
        env.publish(&topology, &thing(&format!("mid-{i}"), i)).await;
        env.publish(&topology, &thing(&format!("new-{i}"), i)).await;
        env.publish(&topology, &thing(&format!("later-{i}"), i))
            .await;
    }
    let report = cleanup.await.expect("joined").expect("cleanup ran");
    assert!(report.batches > 10, "bounded batches: {report:?}");
    // Rows a consumer held locked (a duplicate being noted) were skipped, not waited for;
    // the next run gets them, and then nothing is left.
    let again = ops.cleanup(&req, &NoProgress).await.expect("cleanup ran");
    assert_eq!(report.removed_processed + again.removed_processed, 60);
    // Payloads go first: the old rows' too, before the rows themselves.
    assert_eq!(
        report.scrubbed + again.scrubbed,
        120,
        "{report:?} {again:?}"
    );
    let last = ops.cleanup(&req, &NoProgress).await.expect("cleanup ran");
    assert_eq!((last.removed_processed, last.scrubbed), (0, 0), "{last:?}");
    for i in 0..60 {
        env.publish(&topology, &thing(&format!("mid-{i}"), i)).await;
        env.publish(&topology, &thing(&format!("new-{i}"), i)).await;
    }
    wait_for("every copy settled", async || {
        let s = (first.snapshot(), second.snapshot());
        s.0.received + s.1.received == 180 + 180 + 120
    })
    .await;
    let (a, b) = (first.stop().await, second.stop().await);
    assert_eq!(a.duplicates + b.duplicates, 240, "{a:?} {b:?}");
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.effects").await,
        240,
        "one effect per message: old, mid, new and later"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.effects GROUP BY message_id ORDER BY 1 DESC LIMIT 1")
            .await,
        1
    );

    // Removed rows left tombstones with their hash; scrubbed rows kept key and hash only.
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_tombstone t WHERE message_id LIKE 'old-%' \
             AND final_status = 'PROCESSED' AND length(payload_sha256) = 32"
        )
        .await,
        60
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE message_id LIKE 'old-%'")
            .await,
        0
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE message_id LIKE 'mid-%' \
             AND payload IS NULL AND headers = '{}'::jsonb AND length(payload_sha256) = 32"
        )
        .await,
        60
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE message_id LIKE 'new-%' \
             AND payload IS NOT NULL"
        )
        .await,
        60,
        "payloads inside their window are kept"
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_audit WHERE action = 'cleanup' AND actor = 'retention' \
             AND (details->>'removed_processed')::int = 60"
        )
        .await,
        1
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_event WHERE kind = 'scrubbed' \
             AND message_id LIKE 'mid-%'"
        )
        .await,
        60,
        "each scrub is in the message's history, once"
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_event WHERE kind = 'scrubbed' \
             AND message_id NOT LIKE 'mid-%'"
        )
        .await,
        0,
        "processing, duplicates of processed rows and kept payloads are no scrub"
    );
}

#[tokio::test]
async fn a_scrub_reaches_the_history_and_is_on_the_timeline() {
    let env = TestEnv::new().await;
    // A message that failed twice with texts quoting its body, then was processed (its body
    // kept, as under `Always`) ten days ago; and one processed yesterday.
    let failing = "UPDATE {s}.message_inbox SET status = 'RETRYABLE_FAILED', \
         processing_attempt = processing_attempt + 1, last_failed_at = clock_timestamp(), \
         last_error_code = 'card_declined', last_error_message = 'card 4111 refused' \
         WHERE message_id = 'pay-1'";
    for statement in [
        "INSERT INTO {s}.message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, payload_sha256, payload, headers) \
         VALUES ('pay-1', 'svc', 'Payment', 1, 'PROCESSING', 0, sha256('pay-1'::bytea), \
           convert_to('{\"card\": \"4111\"}', 'UTF8'), '{\"h\": 1}'::jsonb)",
        failing,
        failing,
        "UPDATE {s}.message_inbox SET status = 'PROCESSED', processing_attempt = 3, \
           processed_at = now() - interval '10 days', \
           first_received_at = now() - interval '10 days' WHERE message_id = 'pay-1'",
    ] {
        sqlx::raw_sql(AssertSqlSafe(
            statement.replace("{s}", &format!("\"{}\"", env.schema)),
        ))
        .execute(&env.pool)
        .await
        .expect("statement runs");
    }
    seed(&env, "svc", "fresh-", 1, 1).await;
    let history = "SELECT count(*) FROM {s}.inbox_event WHERE message_id = 'pay-1' \
         AND kind = 'failed' AND error_message = 'card 4111 refused'";
    assert_eq!(env.scalar(history).await, 2, "both failures in the history");

    let ops = ops(&env);
    let report = ops
        .cleanup(&request(&env, "svc", policy(100)), &NoProgress)
        .await
        .expect("cleanup ran");
    assert_eq!(report.scrubbed, 1, "{report:?}");
    assert_eq!(env.scalar(history).await, 0, "no failure text is left");
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_event WHERE message_id = 'pay-1' \
             AND kind = 'failed' AND error_message = '[redacted]' \
             AND error_code = 'card_declined'"
        )
        .await,
        2,
        "the failures stay in the history, their codes with them"
    );
    let timeline = ops.timeline("svc", "pay-1", &[]).await.expect("timeline");
    let kinds: Vec<TimelineKind> = timeline.entries.iter().map(|e| e.kind).collect();
    assert_eq!(kinds.last(), Some(&TimelineKind::Scrubbed), "{timeline:#?}");
    assert!(kinds.contains(&TimelineKind::Processed), "{timeline:#?}");
    let fresh = ops.timeline("svc", "fresh-1", &[]).await.expect("timeline");
    assert!(
        fresh
            .entries
            .iter()
            .all(|e| e.kind != TimelineKind::Scrubbed),
        "inside its window: {fresh:#?}"
    );

    // A second run finds nothing more to scrub, and writes nothing more.
    let again = ops
        .cleanup(&request(&env, "svc", policy(100)), &NoProgress)
        .await
        .expect("cleanup ran");
    assert_eq!(again.scrubbed, 0, "{again:?}");
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.inbox_event WHERE kind = 'scrubbed'")
            .await,
        1
    );
}

#[tokio::test]
async fn an_unsafe_window_is_refused_by_the_timer_and_by_cleanup_unless_forced() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("orders"));
    let unsafe_policy = RetentionPolicy {
        processed: DAY,
        tombstones: 2 * DAY,
        scrub_payload_after: None,
        ..policy(100)
    };
    let err = RetentionTask::new(
        env.pool.clone(),
        &config,
        RetentionPolicy {
            interval: Some(Duration::from_secs(60)),
            ..unsafe_policy.clone()
        },
        None,
    )
    .expect_err("refused");
    let text = err.to_string();
    assert!(
        matches!(err, ConfigError::UnsafeRetentionWindow(_)),
        "{text}"
    );
    assert!(
        text.contains("retention.processed = 1day") && text.contains("parking-lot replay window"),
        "{text}"
    );

    seed(&env, "svc", "m-", 30, 2).await;
    let ops = ops(&env);
    let mut req = request(&env, "svc", unsafe_policy.clone());
    match ops.cleanup(&req, &NoProgress).await {
        Err(OpsError::Refused(why)) => {
            assert!(why.contains("set retention.processed to at least"), "{why}");
            assert!(why.contains("force"), "{why}");
        }
        other => panic!("not refused: {other:?}"),
    }
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox").await,
        30,
        "nothing removed"
    );

    req.force = Some(
        Actor::new("alice", "disk full, replays disabled")
            .expect("actor")
            .with_ticket("INC-7")
            .expect("ticket"),
    );
    let report = ops.cleanup(&req, &NoProgress).await.expect("forced");
    assert!(report.forced);
    assert_eq!(report.removed_processed, 30);
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_audit WHERE action = 'cleanup_forced' \
             AND actor = 'alice' AND ticket = 'INC-7' AND details->>'window' LIKE '%horizon%'"
        )
        .await,
        1
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_audit WHERE action = 'cleanup' AND actor = 'alice'"
        )
        .await,
        1
    );

    // The consumer starts with the same window once someone accepted it, and its timer's
    // cleanups are audited under that actor.
    let topology = env.topology("forced");
    let config = env.config("forced-svc", topology.clone());
    let timer = RetentionTask::new(
        env.pool.clone(),
        &config,
        RetentionPolicy {
            interval: Some(Duration::from_millis(200)),
            ..unsafe_policy
        },
        Some(Actor::new("bob", "replays disabled for this consumer").expect("actor")),
    )
    .expect("accepted by bob");
    env.declare(&config).await;
    seed(&env, "forced-svc", "later-", 10, 2).await;
    let (handler, _) = env.handler();
    let running = env.start_beside(config, handler, |runner| {
        runner.task("retention", |stop| timer.run(stop))
    });
    wait_for("the forced timer's cleanup", async || {
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE message_id LIKE 'later-%'")
            .await
            == 0
    })
    .await;
    running.stop().await;
    assert!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_audit WHERE action = 'cleanup_forced' AND actor = 'bob'"
        )
        .await
            >= 1
    );
}

#[tokio::test]
async fn two_cleaners_at_once_remove_each_row_once() {
    let env = TestEnv::new().await;
    seed(&env, "svc", "a-", 20_000, 45).await;
    seed(&env, "svc", "b-", 500, 1).await;
    let ops = ops(&env);
    let req = request(&env, "svc", policy(500));
    let (one, two) = tokio::join!(
        ops.cleanup(&req, &NoProgress),
        ops.cleanup(&req, &NoProgress)
    );
    let mut removed = 0;
    let mut refused = 0;
    for result in [one, two] {
        match result {
            Ok(r) => removed += r.removed_processed,
            Err(OpsError::Refused(why)) => {
                assert!(why.contains("another cleanup"), "{why}");
                refused += 1;
            }
            Err(e) => panic!("cleanup failed: {e}"),
        }
    }
    assert_eq!(removed, 20_000);
    assert_eq!(refused, 1, "the second cleaner found the lock taken");
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.inbox_tombstone").await,
        20_000
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox").await,
        500
    );
    // The lock was released: a run afterwards goes ahead (and has nothing to remove).
    let after = ops
        .cleanup(&req, &NoProgress)
        .await
        .expect("lock free again");
    assert_eq!(after.removed_processed, 0);
}

#[tokio::test]
async fn parked_rows_per_type_retention_archive_and_tombstone_expiry() {
    let env = TestEnv::new().await;
    seed(&env, "svc", "p-", 10, 40).await;
    seed(&env, "svc", "keep-", 10, 40).await;
    seed(&env, "other", "p-", 10, 40).await;
    let s = &env.schema;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "UPDATE \"{s}\".message_inbox SET message_type = 'Ledger' WHERE message_id LIKE 'keep-%';
         UPDATE \"{s}\".message_inbox SET status = 'POISONED', processed_at = NULL, \
           last_failed_at = first_received_at WHERE message_id IN ('p-1', 'p-2');
         UPDATE \"{s}\".message_inbox SET status = 'RETRYABLE_FAILED', processed_at = NULL \
           WHERE message_id = 'p-3';
         INSERT INTO \"{s}\".inbox_tombstone (message_id, consumer_name, payload_sha256, \
           final_status, message_type, first_received_at, removed_at) \
         SELECT 'gone-' || g, 'svc', '\\x00', 'PROCESSED', 'Thing', now() - interval '300 days', \
           now() - interval '200 days' FROM generate_series(1, 5) AS g;"
    )))
    .execute(&env.pool)
    .await
    .expect("rows shaped");

    let mut retention = policy(3);
    retention.mode = RetentionMode::Archive;
    retention.parked = Some(30 * DAY);
    retention.per_type.insert(
        "Ledger".into(),
        TypeRetention {
            processed: 60 * DAY,
            scrub_payload_after: None,
        },
    );
    let ops = ops(&env);
    let mut req = request(&env, "svc", retention);
    req.dry_run = true;
    let dry = ops.cleanup(&req, &NoProgress).await.expect("dry run");
    assert_eq!(
        (
            dry.removed_processed,
            dry.removed_parked,
            dry.tombstones_expired
        ),
        (7, 2, 5),
        "{dry:?}"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox").await,
        30
    );

    req.dry_run = false;
    let report = ops.cleanup(&req, &NoProgress).await.expect("cleanup");
    assert_eq!(
        (
            report.removed_processed,
            report.removed_parked,
            report.tombstones_expired
        ),
        (7, 2, 5),
        "{report:?}"
    );
    // The retryable row has a retry path and stays; the Ledger type has its own 60 days; the
    // other consumer is not touched.
    let left = env
        .scalar("SELECT count(*) FROM {s}.message_inbox WHERE consumer_name = 'svc'")
        .await;
    assert_eq!(left, 11);
    assert!(env.record("svc", "p-3").await.is_some());
    assert_eq!(
        env.record("svc", "keep-1").await.map(|r| r.status),
        Some(InboxStatus::Processed)
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE consumer_name = 'other'")
            .await,
        10
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_archive WHERE row_data->>'message_id' = message_id \
             AND row_data ? 'payload'"
        )
        .await,
        9
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.inbox_tombstone WHERE final_status = 'POISONED' \
             AND message_id IN ('p-1', 'p-2')"
        )
        .await,
        2
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.inbox_tombstone WHERE message_id LIKE 'gone-%'")
            .await,
        0,
        "expired tombstones are gone"
    );
}

#[tokio::test]
async fn a_retention_task_beside_the_consumer_cleans_up_on_its_timer() {
    let env = TestEnv::new().await;
    let topology = env.topology("timer");
    let config = env.config("svc", topology.clone());
    let mut retention = policy(50);
    retention.interval = Some(Duration::from_millis(200));
    let timer = RetentionTask::new(env.pool.clone(), &config, retention, None).expect("safe");
    env.declare(&config).await;
    seed(&env, "svc", "old-", 300, 40).await;
    let (handler, _) = env.handler();
    let running = env.start_beside(config, handler, |runner| {
        runner.task("retention", |stop| timer.run(stop))
    });
    env.publish(&topology, &thing("fresh", 1)).await;
    wait_for("old rows removed by the consumer's timer", async || {
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE message_id LIKE 'old-%'")
            .await
            == 0
    })
    .await;
    // The timer and the deliveries are independent: under load the old rows can be gone
    // before the fresh message is through.
    wait_for("the fresh message processed", async || {
        env.effects("fresh").await == 1
    })
    .await;
    running.stop().await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.inbox_tombstone").await,
        300
    );
    assert_eq!(env.effects("fresh").await, 1);
}
