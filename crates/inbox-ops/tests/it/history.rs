//! A message's history, the console's activity series and the ledger's alerts: a timeline told
//! from what a real consumer recorded (retries, parking, duplicates, conflicts, audit) and from
//! retention's tombstone; `list` by message id and correlation id; per-minute counts in known
//! minutes and zeros elsewhere; the activity statements reading only the recent part of a large
//! ledger; and the alerting rules evaluated from the ledger.

use std::time::Duration;

use chrono::{DateTime, Utc};
use inbox_ops::{
    Actor, Operations, OpsError,
    activity::{ActivityBucket, ActivityQuery},
    alerts::{
        ALERT_DEDUP_WINDOW_HEADROOM, ALERT_DUPLICATE_SPIKE, ALERT_OLDEST_UNPROCESSED_AGE,
        ALERT_PARKING_LOT_GROWING, ALERT_STALE_PROCESSING, AlertQuery,
    },
    history::TimelineKind,
    inspect::ListFilter,
};
use inbox_testkit::env::{Rule, TestEnv, message};
use rabbit_inbox::{InboxStatus, broker::OutgoingMessage};
use serde_json::{Value, json};
use sqlx::AssertSqlSafe;

const CONSUMER: &str = "invoicer";

fn ops(env: &TestEnv) -> Operations {
    Operations::new(env.pool.clone(), env.schema.clone())
}

fn invoice(id: &str, amount: i64) -> OutgoingMessage {
    let mut m = message(
        Some(id),
        "InvoiceIssued",
        &json!({ "invoice": id, "amount": amount }),
    );
    m.correlation_id = Some(format!("corr-{id}"));
    m
}

/// Runs `sql` with `{s}` standing for the quoted schema.
async fn exec(env: &TestEnv, sql: &str) {
    let sql = sql.replace("{s}", &format!("\"{}\"", env.schema));
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&env.pool)
        .await
        .expect("statement runs");
}

/// A row's columns for a direct insert: key, consumer, status, then the rest as given.
fn row_sql(id: &str, consumer: &str, status: &str, columns: &str, values: &str) -> String {
    format!(
        "INSERT INTO {{s}}.message_inbox (message_id, consumer_name, message_type, \
           message_version, status, payload_sha256{columns}) \
         VALUES ('{id}', '{consumer}', 'Thing', 1, '{status}', sha256('{id}'::bytea){values});"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeline_tells_what_happened_to_a_message() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("inv-flaky", Rule::FailAttempts(2));
    plan.for_id("inv-bad", Rule::Permanent);
    let running = env.start(config.clone(), handler);
    for id in ["inv-flaky", "inv-bad", "inv-ok"] {
        env.publish(&topology, &invoice(id, 42)).await;
    }
    env.wait_for_record(CONSUMER, "inv-flaky", "processed on the third try", |r| {
        r.status == InboxStatus::Processed && r.processing_attempt == 3
    })
    .await;
    env.wait_for_record(CONSUMER, "inv-ok", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    env.wait_for_record(CONSUMER, "inv-bad", "parked, its copy confirmed", |r| {
        r.status == InboxStatus::PermanentFailed && r.parked_copy_at.is_some()
    })
    .await;
    // A copy of each, one at a time: the same body for both, then another body for inv-ok.
    env.publish(&topology, &invoice("inv-bad", 42)).await;
    env.wait_for_record(CONSUMER, "inv-bad", "its copy noted", |r| {
        r.delivery_count == 2
    })
    .await;
    env.publish(&topology, &invoice("inv-ok", 42)).await;
    env.wait_for_record(CONSUMER, "inv-ok", "its copy noted", |r| {
        r.delivery_count == 2
    })
    .await;
    env.publish(&topology, &invoice("inv-ok", 43)).await;
    env.wait_for_record(CONSUMER, "inv-ok", "its conflicting copy noted", |r| {
        r.payload_conflicts == 1
    })
    .await;
    running.stop().await;

    let ops = ops(&env);
    let actor = Actor::new("alice", "why was it refused?").expect("actor");
    ops.audit_payload_read(&actor, CONSUMER, "inv-bad", json!({ "shown": ["payload"] }))
        .await
        .expect("payload read audited");
    let tiers = topology.retry_tier_queues(&config.retry);

    // Retried twice, processed on the third attempt.
    let flaky = ops
        .timeline(CONSUMER, "inv-flaky", &tiers)
        .await
        .expect("timeline");
    // A retry copy's delivery is counted on the row but is an attempt, not a duplicate.
    let kinds: Vec<TimelineKind> = flaky.entries.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            TimelineKind::Received,
            TimelineKind::Failed,
            TimelineKind::Failed,
            TimelineKind::AttemptStarted,
            TimelineKind::Processed
        ],
        "{flaky:#?}"
    );
    assert_eq!(flaky.status, Some(InboxStatus::Processed));
    for (entry, attempt) in flaky.entries[1..3].iter().zip([1, 2]) {
        assert_eq!(entry.attempt, Some(attempt));
        assert_eq!(entry.status.as_deref(), Some("RETRYABLE_FAILED"));
        assert_eq!(entry.error_code.as_deref(), Some("test_retryable"));
        assert!(entry.error_message.is_some(), "{entry:?}");
        assert_eq!(entry.retry_tier.as_ref(), tiers.first());
    }
    assert_eq!(flaky.entries[3].attempt, Some(3));
    assert!(
        flaky.entries.windows(2).all(|w| w[0].at <= w[1].at),
        "oldest first"
    );

    // Parked, its copy confirmed, a duplicate dropped against it, its payload read.
    let bad = ops
        .timeline(CONSUMER, "inv-bad", &tiers)
        .await
        .expect("timeline");
    let kinds: Vec<TimelineKind> = bad.entries.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            TimelineKind::Received,
            TimelineKind::Parked,
            TimelineKind::ParkedCopyConfirmed,
            TimelineKind::Duplicate,
            TimelineKind::Audit
        ],
        "{bad:#?}"
    );
    let parked = &bad.entries[1];
    assert_eq!(parked.status.as_deref(), Some("PERMANENT_FAILED"));
    assert_eq!(parked.error_code.as_deref(), Some("test_permanent"));
    assert_eq!(parked.retry_tier, None, "a parked message waits in no tier");
    assert_eq!(bad.entries[3].deliveries, Some(1));
    let audit = &bad.entries[4];
    assert_eq!(audit.action.as_deref(), Some("payload_read"));
    assert_eq!(audit.actor.as_deref(), Some("alice"));
    assert_eq!(audit.reason.as_deref(), Some("why was it refused?"));

    // Processed, then a duplicate and a conflicting copy (which is also a redelivery).
    let ok = ops
        .timeline(CONSUMER, "inv-ok", &[])
        .await
        .expect("timeline");
    let count = |kind| ok.entries.iter().filter(|e| e.kind == kind).count();
    assert_eq!(count(TimelineKind::Processed), 1, "{ok:#?}");
    assert_eq!(count(TimelineKind::Conflict), 1, "{ok:#?}");
    let redeliveries: i32 = ok
        .entries
        .iter()
        .filter(|e| e.kind == TimelineKind::Duplicate)
        .filter_map(|e| e.deliveries)
        .sum();
    assert_eq!(redeliveries, 2, "{ok:#?}");

    // The same message through the list's new filters, whatever its status.
    let by = |message_id: Option<&str>, correlation_id: Option<&str>| ListFilter {
        message_id: message_id.map(str::to_owned),
        correlation_id: correlation_id.map(str::to_owned),
        statuses: vec![InboxStatus::Processed, InboxStatus::PermanentFailed],
        ..ListFilter::default()
    };
    let ids = |page: inbox_ops::inspect::ListPage| -> Vec<String> {
        page.rows.into_iter().map(|r| r.message_id).collect()
    };
    assert_eq!(
        ids(ops
            .list(&by(None, Some("corr-inv-flaky")))
            .await
            .expect("list")),
        ["inv-flaky"]
    );
    assert_eq!(
        ids(ops.list(&by(Some("inv-bad"), None)).await.expect("list")),
        ["inv-bad"]
    );
    assert!(
        ops.list(&by(Some("inv-bad"), Some("corr-inv-ok")))
            .await
            .expect("list")
            .rows
            .is_empty(),
        "both filters apply"
    );

    // A removed row: its tombstone, nothing else.
    exec(
        &env,
        &format!(
            "INSERT INTO {{s}}.inbox_tombstone (message_id, consumer_name, payload_sha256, \
               final_status, message_type, first_received_at, processed_at, removed_at) \
             VALUES ('inv-old', '{CONSUMER}', '\\xabcd', 'PROCESSED', 'InvoiceIssued', \
               now() - interval '40 days', now() - interval '40 days', now() - interval '1 day')"
        ),
    )
    .await;
    let old = ops
        .timeline(CONSUMER, "inv-old", &[])
        .await
        .expect("timeline");
    assert_eq!(old.status, None);
    assert_eq!(old.entries.len(), 1);
    assert_eq!(old.entries[0].kind, TimelineKind::Removed);
    assert_eq!(old.entries[0].status.as_deref(), Some("PROCESSED"));

    // A row replaced by an edited copy names it, and the copy names the row it replaces.
    exec(
        &env,
        &[
            row_sql(
                "inv-edit",
                CONSUMER,
                "PROCESSED",
                ", processed_at, replaced_by",
                ", now(), 'inv-edit-2'",
            ),
            row_sql(
                "inv-edit-2",
                CONSUMER,
                "PROCESSED",
                ", processed_at",
                ", now()",
            ),
        ]
        .concat(),
    )
    .await;
    let original = ops
        .timeline(CONSUMER, "inv-edit", &[])
        .await
        .expect("timeline");
    assert_eq!(original.replaced_by.as_deref(), Some("inv-edit-2"));
    assert_eq!(original.replaces, None);
    let copy = ops
        .timeline(CONSUMER, "inv-edit-2", &[])
        .await
        .expect("timeline");
    assert_eq!(copy.replaces.as_deref(), Some("inv-edit"));
    assert_eq!(copy.replaced_by, None);

    // Unknown to this consumer (and the key of another consumer's message).
    for (consumer, id) in [(CONSUMER, "inv-never"), ("someone-else", "inv-ok")] {
        match ops.timeline(consumer, id, &[]).await {
            Err(OpsError::NotFound(e)) => assert!(e.contains(id), "{e}"),
            other => panic!("expected NotFound, got {other:?}"),
        }
    }

    // The error text is in the JSON (the admin API decides who sees it).
    let json = serde_json::to_value(&bad).expect("serializes");
    assert_eq!(json["entries"][1]["kind"], "parked");
    assert!(json["entries"][1]["error_message"].is_string(), "{json}");
}

#[tokio::test]
async fn a_redelivery_storm_is_one_entry_and_a_long_history_is_cut_to_the_newest() {
    let env = TestEnv::new().await;
    let ops = ops(&env);
    exec(
        &env,
        &row_sql(
            "inv-storm",
            CONSUMER,
            "PROCESSED",
            ", processed_at",
            ", now() - interval '1 day'",
        ),
    )
    .await;
    // 5,000 duplicate notes in a row, a conflicting body, three more notes; one by one, as a
    // producer stuck in a retry loop would leave them.
    let event = |kind: &str, n: &str, at: &str| {
        format!(
            "INSERT INTO {{s}}.inbox_event (message_id, consumer_name, occurred_at, kind, \
               deliveries, status) \
             SELECT 'inv-storm', '{CONSUMER}', {at}, '{kind}', 1, 'PROCESSED' \
             FROM generate_series(1, {n}) AS g;"
        )
    };
    exec(
        &env,
        &[
            event(
                "duplicate",
                "5000",
                "now() - interval '1 hour' + g * interval '1 ms'",
            ),
            event("conflict", "1", "now() - interval '30 minutes'"),
            event(
                "duplicate",
                "3",
                "now() - interval '10 minutes' + g * interval '1 s'",
            ),
        ]
        .concat(),
    )
    .await;
    let storm = ops
        .timeline(CONSUMER, "inv-storm", &[])
        .await
        .expect("timeline");
    let runs: Vec<(TimelineKind, Option<i32>, bool)> = storm
        .entries
        .iter()
        .filter(|e| matches!(e.kind, TimelineKind::Duplicate | TimelineKind::Conflict))
        .map(|e| (e.kind, e.deliveries, e.until.is_some()))
        .collect();
    assert_eq!(
        runs,
        [
            (TimelineKind::Duplicate, Some(5000), true),
            (TimelineKind::Conflict, Some(1), false),
            (TimelineKind::Duplicate, Some(3), true),
        ],
        "{storm:#?}"
    );
    assert!(!storm.truncated);
    let first = &storm.entries[storm
        .entries
        .iter()
        .position(|e| e.kind == TimelineKind::Duplicate)
        .expect("a run")];
    assert!(first.until.expect("a run's end") > first.at);

    // Failures alternating with duplicates (a message redriven again and again): more entries
    // than a page holds. The newest are kept, oldest first, and the cut is said.
    let limit = usize::try_from(inbox_ops::history::TIMELINE_LIMIT).expect("a size");
    exec(
        &env,
        &format!(
            "INSERT INTO {{s}}.inbox_event (message_id, consumer_name, occurred_at, kind, \
               attempt, deliveries, status, error_code) \
             SELECT 'inv-storm', '{CONSUMER}', now() - interval '5 minutes' + g * interval '1 ms', \
               CASE WHEN g % 2 = 0 THEN 'failed' ELSE 'duplicate' END, g, 1, \
               'RETRYABLE_FAILED', 'again' \
             FROM generate_series(1, {n}) AS g;",
            n = limit + 200
        ),
    )
    .await;
    let long = ops
        .timeline(CONSUMER, "inv-storm", &[])
        .await
        .expect("timeline");
    assert!(long.truncated, "the cut is said");
    let history = long
        .entries
        .iter()
        .filter(|e| {
            matches!(
                e.kind,
                TimelineKind::Duplicate | TimelineKind::Conflict | TimelineKind::Failed
            )
        })
        .count();
    assert_eq!(history, limit, "{} entries", long.entries.len());
    let last_failure = long
        .entries
        .iter()
        .rev()
        .find(|e| e.kind == TimelineKind::Failed)
        .expect("failures");
    assert_eq!(
        last_failure.attempt,
        i32::try_from(limit + 200).ok(),
        "the newest kept"
    );
    assert!(
        long.entries.windows(2).all(|w| w[0].at <= w[1].at),
        "oldest first"
    );
    // The row's own entries are kept whatever the history's length.
    for kind in [TimelineKind::Received, TimelineKind::Processed] {
        assert!(long.entries.iter().any(|e| e.kind == kind), "{kind:?}");
    }
}

/// Sums one field over a consumer's buckets.
fn total(buckets: &[ActivityBucket], field: impl Fn(&ActivityBucket) -> i64) -> i64 {
    buckets.iter().map(field).sum()
}

#[tokio::test]
async fn activity_counts_known_minutes_and_zeros_elsewhere() {
    let env = TestEnv::new().await;
    // Instants `m` minutes and `s` seconds after the start of the current minute (m <= 0),
    // fixed now: the report may come in the next minute.
    let base: DateTime<Utc> = sqlx::query_scalar("SELECT date_trunc('minute', now())")
        .fetch_one(&env.pool)
        .await
        .expect("clock");
    let instant =
        |m: i64, s: i64| base + chrono::Duration::minutes(m) + chrono::Duration::seconds(s);
    let at = |m: i64, s: i64| format!("'{}'::timestamptz", instant(m, s).to_rfc3339());
    let processed = |id: &str, consumer: &str, m: i64, latency_ms: i32| {
        row_sql(
            id,
            consumer,
            "PROCESSED",
            ", processed_at, first_received_at",
            &format!(
                ", {t}, {t} - make_interval(secs => {latency_ms} / 1000.0)",
                t = at(m, 10)
            ),
        )
    };
    let event = |id: &str, consumer: &str, when: String, kind: &str, status: &str, n: i32| {
        format!(
            "INSERT INTO {{s}}.inbox_event (message_id, consumer_name, occurred_at, kind, \
               attempt, deliveries, status) \
             VALUES ('{id}', '{consumer}', {when}, '{kind}', 1, {n}, '{status}');"
        )
    };
    exec(
        &env,
        &[
            // orders: three rows processed 3 minutes ago (100, 200, 300 ms), one 5 minutes ago
            // (1 s), one two hours ago (outside the window).
            processed("o-1", "orders", -3, 100),
            processed("o-2", "orders", -3, 200),
            processed("o-3", "orders", -3, 300),
            processed("o-4", "orders", -5, 1000),
            processed("o-old", "orders", -120, 50),
            // Its events: duplicates 3 minutes ago (2 + 1 copies), failures 4 minutes ago (two
            // retried, two parked), a conflict; one failure two hours ago.
            event("o-1", "orders", at(-3, 20), "duplicate", "PROCESSED", 2),
            event("o-2", "orders", at(-3, 30), "duplicate", "PROCESSED", 1),
            event("o-3", "orders", at(-4, 5), "failed", "RETRYABLE_FAILED", 1),
            event("o-3", "orders", at(-4, 15), "failed", "RETRYABLE_FAILED", 1),
            event("o-4", "orders", at(-4, 25), "failed", "POISONED", 1),
            event("o-4", "orders", at(-4, 35), "failed", "MANUAL_REVIEW", 1),
            event("o-1", "orders", at(-4, 45), "conflict", "PROCESSED", 1),
            event(
                "o-old",
                "orders",
                at(-120, 0),
                "failed",
                "RETRYABLE_FAILED",
                1,
            ),
            // billing: nothing in the window but an open row.
            row_sql(
                "b-1",
                "billing",
                "PROCESSING",
                ", processing_started_at",
                ", now()",
            ),
            // quiet: only old rows.
            processed("q-1", "quiet", -300, 10),
        ]
        .concat(),
    )
    .await;

    let ops = ops(&env);
    let report = ops
        .activity(&ActivityQuery::default())
        .await
        .expect("activity");
    assert_eq!(report.bucket_secs, 60);
    let names: Vec<&str> = report
        .consumers
        .iter()
        .map(|c| c.consumer.as_str())
        .collect();
    assert_eq!(
        names,
        ["billing", "orders"],
        "quiet has nothing in the window"
    );
    let minute = |m: i64| instant(m, 0);
    let current = {
        let now = report.to.timestamp();
        DateTime::from_timestamp(now - now.rem_euclid(60), 0).expect("instant")
    };
    for series in &report.consumers {
        let buckets = &series.buckets;
        assert_eq!(buckets.first().map(|b| b.at), Some(report.from));
        assert!(
            buckets
                .windows(2)
                .all(|w| (w[1].at - w[0].at).num_seconds() == 60)
        );
        assert_eq!(buckets.last().map(|b| b.at), Some(current));
        assert!((61..=62).contains(&buckets.len()), "{}", buckets.len());
    }
    let billing = &report.consumers[0].buckets;
    assert!(
        billing.iter().all(|b| *b
            == ActivityBucket {
                at: b.at,
                processed: 0,
                duplicates: 0,
                retried: 0,
                parked: 0,
                conflicts: 0,
                latency_p50_ms: None,
                latency_p99_ms: None,
            }),
        "zeros only"
    );

    let orders = &report.consumers[1].buckets;
    let bucket = |m: i64| {
        orders
            .iter()
            .find(|b| b.at == minute(m))
            .unwrap_or_else(|| panic!("a bucket {m} minutes back"))
    };
    let three = bucket(-3);
    assert_eq!((three.processed, three.duplicates), (3, 3));
    let p50 = three.latency_p50_ms.expect("p50");
    let p99 = three.latency_p99_ms.expect("p99");
    assert!((p50 - 200.0).abs() < 0.01, "{p50}");
    assert!((p99 - 298.0).abs() < 0.01, "{p99}");
    let four = bucket(-4);
    assert_eq!(
        (four.processed, four.retried, four.parked, four.conflicts),
        (0, 2, 2, 1)
    );
    assert_eq!(four.latency_p50_ms, None);
    let five = bucket(-5);
    assert_eq!(five.processed, 1);
    assert!((five.latency_p99_ms.expect("p99") - 1000.0).abs() < 0.01);
    // Nothing anywhere else.
    assert_eq!(total(orders, |b| b.processed), 4);
    assert_eq!(total(orders, |b| b.duplicates), 3);
    assert_eq!(total(orders, |b| b.retried), 2);
    assert_eq!(total(orders, |b| b.parked), 2);
    assert_eq!(total(orders, |b| b.conflicts), 1);

    // One consumer, wider buckets: the same totals in fewer buckets.
    let report = ops
        .activity(&ActivityQuery {
            consumer: Some("orders".into()),
            window: Duration::from_secs(3 * 3600),
            bucket: Duration::from_secs(600),
        })
        .await
        .expect("activity");
    assert_eq!(report.consumers.len(), 1);
    let orders = &report.consumers[0].buckets;
    assert!((19..=20).contains(&orders.len()), "{}", orders.len());
    assert!(orders.iter().all(|b| b.at.timestamp() % 600 == 0));
    assert_eq!(
        total(orders, |b| b.processed),
        5,
        "the old row is in the window"
    );
    assert_eq!(total(orders, |b| b.retried), 3);

    match ops
        .activity(&ActivityQuery {
            bucket: Duration::from_secs(1),
            ..ActivityQuery::default()
        })
        .await
    {
        Err(OpsError::Invalid(e)) => assert!(e.contains("at least 10"), "{e}"),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

/// Shared buffers (hit and read) the statement's execution touched, its execution time in
/// milliseconds and the plan, from `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`.
async fn explain(
    env: &TestEnv,
    sql: &str,
    from: DateTime<Utc>,
    consumer: Option<&str>,
) -> (i64, f64, Value) {
    let plan: Value = sqlx::query_scalar(AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"
    )))
    .persistent(false)
    .bind(from)
    .bind(60_i64)
    .bind(consumer)
    .fetch_one(&env.pool)
    .await
    .expect("explained");
    let top = &plan[0];
    // The top node's counts include every node below it, subplans and CTEs included.
    let node = &top["Plan"];
    let buffers = node["Shared Hit Blocks"].as_i64().expect("hit blocks")
        + node["Shared Read Blocks"].as_i64().expect("read blocks");
    let ms = top["Execution Time"].as_f64().expect("execution time");
    (buffers, ms, plan)
}

#[tokio::test]
async fn the_activity_queries_read_only_the_recent_part_of_a_large_ledger() {
    let env = TestEnv::new().await;
    // 300,000 rows of two consumers processed 40 to 10 days ago, in time order (physically
    // first), each with an old event (a failure, or a duplicate); then 400 rows processed in the last 40
    // minutes with 300 recent events, and 50 parked rows.
    exec(
        &env,
        "INSERT INTO {s}.message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, first_received_at, processed_at, \
           payload_sha256) \
         SELECT 'old-' || g, CASE WHEN g % 2 = 0 THEN 'orders' ELSE 'billing' END, 'Thing', 1, \
           'PROCESSED', 1, t - interval '50 ms', t, sha256(('old-' || g)::bytea) \
         FROM generate_series(1, 300000) AS g, \
           LATERAL (SELECT now() - interval '40 days' + g * interval '8640 ms') AS x (t); \
         INSERT INTO {s}.inbox_event (message_id, consumer_name, occurred_at, kind, attempt, \
           status, error_code) \
         SELECT message_id, consumer_name, processed_at - interval '1 s', \
           CASE WHEN substr(message_id, 5)::int % 3 = 0 THEN 'failed' ELSE 'duplicate' END, \
           1, 'RETRYABLE_FAILED', 'boom' \
         FROM {s}.message_inbox WHERE message_id LIKE 'old-%' ORDER BY processed_at; \
         INSERT INTO {s}.message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, first_received_at, processed_at, \
           payload_sha256) \
         SELECT 'new-' || g, CASE WHEN g % 2 = 0 THEN 'orders' ELSE 'billing' END, 'Thing', 1, \
           'PROCESSED', 1, t - interval '20 ms', t, sha256(('new-' || g)::bytea) \
         FROM generate_series(1, 400) AS g, \
           LATERAL (SELECT now() - interval '40 minutes' + g * interval '6 s') AS x (t); \
         INSERT INTO {s}.inbox_event (message_id, consumer_name, occurred_at, kind, \
           deliveries, status) \
         SELECT message_id, consumer_name, processed_at + interval '1 s', 'duplicate', 1, \
           'PROCESSED' \
         FROM {s}.message_inbox WHERE message_id LIKE 'new-%' \
           AND substr(message_id, 5)::int <= 300; \
         INSERT INTO {s}.message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, first_received_at, payload_sha256) \
         SELECT 'parked-' || g, 'orders', 'Thing', 1, 'PERMANENT_FAILED', 1, now(), \
           sha256(('parked-' || g)::bytea) \
         FROM generate_series(1, 50) AS g;",
    )
    .await;
    // As autovacuum does on a live table: statistics, and the BRIN summaries of the filled
    // block ranges (a range never summarized matches every query).
    exec(&env, "VACUUM (ANALYZE) {s}.message_inbox").await;
    exec(&env, "VACUUM (ANALYZE) {s}.inbox_event").await;
    let pages = async |table: &str| {
        env.scalar(&format!("SELECT pg_relation_size('{{s}}.{table}') / 8192"))
            .await
    };
    let ops = ops(&env);
    let [processed_sql, events_sql] = ops.activity_statements();
    let from = {
        let start = (Utc::now() - chrono::Duration::hours(1)).timestamp();
        DateTime::from_timestamp(start - start.rem_euclid(60), 0).expect("instant")
    };
    // Buffers each statement reads, per consumer filter, printed with the table's size.
    let measure = async || {
        let (inbox_pages, event_pages) = (pages("message_inbox").await, pages("inbox_event").await);
        let rows = env.scalar("SELECT count(*) FROM {s}.message_inbox").await;
        let events = env.scalar("SELECT count(*) FROM {s}.inbox_event").await;
        let mut read = Vec::new();
        for consumer in [None, Some("orders")] {
            let (buffers, ms, plan) = explain(&env, &processed_sql, from, consumer).await;
            println!(
                "activity, processed rows ({consumer:?}): {rows} rows in {inbox_pages} pages; \
                 {buffers} buffers ({:.2}% of the pages), {ms:.1} ms",
                100.0 * buffers as f64 / inbox_pages as f64
            );
            assert!(
                buffers * 20 < inbox_pages,
                "{buffers} buffers of {inbox_pages} pages: {plan:#}"
            );
            read.push(buffers);
            let (buffers, ms, plan) = explain(&env, &events_sql, from, consumer).await;
            println!(
                "activity, events ({consumer:?}): {events} events in {event_pages} pages \
                 ({inbox_pages} inbox pages); {buffers} buffers ({:.2}% of the event pages), \
                 {ms:.1} ms",
                100.0 * buffers as f64 / event_pages as f64
            );
            assert!(
                buffers * 20 < event_pages,
                "{buffers} buffers of {event_pages} pages: {plan:#}"
            );
            read.push(buffers);
        }
        read
    };
    let before = measure().await;

    // Twice the old history, older still, appended as a backfill would be: what the
    // statements read must not follow the table's size, which is what makes them as cheap at
    // 10 million rows as here. A backfill written after the recent rows can share their last
    // BRIN block range (128 pages), and the first old range after them, so those may now be
    // read whole: a bound of two ranges, whatever the number of rows.
    exec(
        &env,
        "INSERT INTO {s}.message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, first_received_at, processed_at, \
           payload_sha256) \
         SELECT 'older-' || g, CASE WHEN g % 2 = 0 THEN 'orders' ELSE 'billing' END, 'Thing', \
           1, 'PROCESSED', 1, t - interval '50 ms', t, sha256(('older-' || g)::bytea) \
         FROM generate_series(1, 300000) AS g, \
           LATERAL (SELECT now() - interval '80 days' + g * interval '8640 ms') AS x (t); \
         INSERT INTO {s}.inbox_event (message_id, consumer_name, occurred_at, kind, \
           deliveries, status) \
         SELECT message_id, consumer_name, processed_at + interval '1 s', 'duplicate', 1, \
           'PROCESSED' \
         FROM {s}.message_inbox WHERE message_id LIKE 'older-%' ORDER BY processed_at;",
    )
    .await;
    exec(&env, "VACUUM (ANALYZE) {s}.message_inbox").await;
    exec(&env, "VACUUM (ANALYZE) {s}.inbox_event").await;
    let after = measure().await;
    for (b, a) in before.iter().zip(&after) {
        println!("buffers with 300,000 old rows: {b}; with 600,000: {a}");
        assert!(
            *a <= b + b / 2 + 2 * 128 + 16,
            "reads grew with the table: {before:?} -> {after:?}"
        );
    }

    // And what they count.
    let report = ops
        .activity(&ActivityQuery::default())
        .await
        .expect("activity");
    let processed: i64 = report
        .consumers
        .iter()
        .map(|c| total(&c.buckets, |b| b.processed))
        .sum();
    let duplicates: i64 = report
        .consumers
        .iter()
        .map(|c| total(&c.buckets, |b| b.duplicates))
        .sum();
    assert_eq!((processed, duplicates), (400, 300));
    assert!(
        report
            .consumers
            .iter()
            .all(|c| total(&c.buckets, |b| b.retried) == 0),
        "old failures are outside the window"
    );
}

#[tokio::test]
async fn alerts_name_a_stale_claim_and_a_growing_parking_lot_and_spare_a_quiet_consumer() {
    let env = TestEnv::new().await;
    let parked_rows = |consumer: &str, n: i32| {
        // Each insert with a failure writes its 'failed' event (the ledger's trigger).
        format!(
            "INSERT INTO {{s}}.message_inbox (message_id, consumer_name, message_type, \
               message_version, status, processing_attempt, first_failed_at, last_failed_at, \
               last_error_code, payload_sha256) \
             SELECT '{consumer}-' || g, '{consumer}', 'Thing', 1, 'POISONED', 5, \
               now() - interval '10 minutes', now() - interval '10 minutes', 'boom', \
               sha256(g::text::bytea) \
             FROM generate_series(1, {n}) AS g;"
        )
    };
    exec(
        &env,
        &[
            // stuck: a claim whose attempt began 10 minutes ago (stale after 5, not yet
            // overdue by 15), and 101 messages parked in the last hour.
            row_sql(
                "s-claim",
                "stuck",
                "PROCESSING",
                ", processing_attempt, processing_started_at",
                ", 1, now() - interval '10 minutes'",
            ),
            parked_rows("stuck", 101),
            // hundred: exactly the rule's threshold, which does not fire.
            parked_rows("hundred", 100),
            // late: a retry whose 1 s delay passed 20 minutes ago.
            row_sql(
                "l-retry",
                "late",
                "RETRYABLE_FAILED",
                ", processing_attempt, first_failed_at, last_failed_at",
                ", 1, now() - interval '20 minutes', now() - interval '20 minutes'",
            ),
            // quiet: processed rows, a retry waiting for its 10 minute delay, a fresh claim
            // and a few duplicates.
            row_sql(
                "q-done",
                "quiet",
                "PROCESSED",
                ", processed_at, delivery_count",
                ", now(), 1",
            ),
            row_sql(
                "q-retry",
                "quiet",
                "RETRYABLE_FAILED",
                ", processing_attempt, first_failed_at, last_failed_at",
                ", 5, now() - interval '1 minute', now() - interval '1 minute'",
            ),
            row_sql(
                "q-claim",
                "quiet",
                "PROCESSING",
                ", processing_attempt, processing_started_at",
                ", 1, now()",
            ),
            "UPDATE {s}.message_inbox SET delivery_count = delivery_count + 3 \
             WHERE message_id = 'q-done';"
                .into(),
            // noisy: 700 duplicates in the last 10 minutes (> 1 per second), none before.
            row_sql("n-done", "noisy", "PROCESSED", ", processed_at", ", now()"),
            "INSERT INTO {s}.inbox_event (message_id, consumer_name, occurred_at, kind, \
               deliveries, status) \
             VALUES ('n-done', 'noisy', now() - interval '2 minutes', 'duplicate', 700, \
               'PROCESSED');"
                .into(),
            // steady: as many, but the hour before the last had 6000 (more than a third of
            // the rate now).
            row_sql(
                "st-done",
                "steady",
                "PROCESSED",
                ", processed_at",
                ", now()",
            ),
            "INSERT INTO {s}.inbox_event (message_id, consumer_name, occurred_at, kind, \
               deliveries, status) \
             VALUES ('st-done', 'steady', now() - interval '2 minutes', 'duplicate', 700, \
               'PROCESSED'), \
               ('st-done', 'steady', now() - interval '90 minutes', 'duplicate', 6000, \
               'PROCESSED');"
                .into(),
        ]
        .concat(),
    )
    .await;

    let ops = ops(&env);
    let alerts = ops.alerts(&AlertQuery::default()).await.expect("alerts");
    let fired: Vec<(&str, &str, &str, f64)> = alerts
        .iter()
        .map(|a| {
            (
                a.consumer.as_str(),
                a.name.as_str(),
                a.severity.as_str(),
                a.value,
            )
        })
        .collect();
    assert_eq!(fired.len(), 4, "{alerts:#?}");
    assert_eq!(
        (fired[0].0, fired[0].1, fired[0].2),
        ("late", ALERT_OLDEST_UNPROCESSED_AGE, "critical")
    );
    assert!((1190.0..1300.0).contains(&fired[0].3), "{alerts:#?}");
    assert_eq!(
        (fired[1].0, fired[1].1, fired[1].2),
        ("noisy", ALERT_DUPLICATE_SPIKE, "info")
    );
    assert!((fired[1].3 - 700.0 / 600.0).abs() < 1e-9);
    assert_eq!(
        fired[2..],
        [
            ("stuck", ALERT_PARKING_LOT_GROWING, "warning", 101.0),
            ("stuck", ALERT_STALE_PROCESSING, "warning", 1.0),
        ]
    );
    assert_eq!(
        alerts[2].summary,
        "stuck: 101 more parked messages in the last hour"
    );
    assert_eq!(alerts[3].summary, "stuck: 1 stale PROCESSING rows");
    assert!(
        alerts[0]
            .summary
            .starts_with("late: a message has been stuck for 19m")
    );

    // One consumer at a time; a quiet one has none.
    let only = |consumer: &str| AlertQuery {
        consumer: Some(consumer.into()),
        ..AlertQuery::default()
    };
    let stuck = ops.alerts(&only("stuck")).await.expect("alerts");
    assert_eq!(stuck, alerts[2..]);
    for consumer in ["quiet", "hundred", "steady"] {
        let none = ops.alerts(&only(consumer)).await.expect("alerts");
        assert!(none.is_empty(), "{consumer}: {none:#?}");
    }
    // The thresholds are the caller's: a longer stale threshold spares the claim.
    let patient = AlertQuery {
        stale_after: Duration::from_secs(3600),
        ..only("stuck")
    };
    let names: Vec<String> = ops
        .alerts(&patient)
        .await
        .expect("alerts")
        .into_iter()
        .map(|a| a.name)
        .collect();
    assert_eq!(names, [ALERT_PARKING_LOT_GROWING]);
}

#[tokio::test]
async fn the_headroom_alert_needs_a_replay_window_and_recent_retention() {
    let env = TestEnv::new().await;
    // Processed history reaching 2 hours back; retention removed an older row an hour ago.
    exec(
        &env,
        "INSERT INTO {s}.message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, first_received_at, processed_at, \
           payload_sha256) \
         SELECT 'h-' || g, 'ledger', 'Thing', 1, 'PROCESSED', 1, now() - g * interval '1 hour', \
           now() - g * interval '1 hour', sha256(('h-' || g)::bytea) \
         FROM generate_series(1, 2) AS g; \
         INSERT INTO {s}.inbox_tombstone (message_id, consumer_name, payload_sha256, \
           final_status, message_type, first_received_at, processed_at, removed_at) \
         VALUES ('h-9', 'ledger', sha256('h-9'::bytea), 'PROCESSED', 'Thing', \
           now() - interval '9 hours', now() - interval '9 hours', now() - interval '1 hour');",
    )
    .await;
    let ops = ops(&env);
    let names = async |window: Option<Duration>| -> Vec<String> {
        ops.alerts(&AlertQuery {
            replay_window: window,
            ..AlertQuery::default()
        })
        .await
        .expect("alerts")
        .into_iter()
        .map(|a| a.name)
        .collect()
    };
    assert!(names(None).await.is_empty(), "no window, no verdict");
    // Two hours of history against a one-hour window: headroom.
    assert!(names(Some(Duration::from_secs(3600))).await.is_empty());
    // Against a day: retention deletes inside the window.
    let alerts = ops
        .alerts(&AlertQuery {
            replay_window: Some(Duration::from_secs(86_400)),
            ..AlertQuery::default()
        })
        .await
        .expect("alerts");
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!(alerts[0].name, ALERT_DEDUP_WINDOW_HEADROOM);
    assert_eq!(alerts[0].consumer, "ledger");
    assert_eq!(alerts[0].severity, "critical");
    assert!(alerts[0].value < -20.0 * 3600.0, "{alerts:?}");
    // Without retention's deletions in the last day the short history is young, not lost.
    exec(&env, "DELETE FROM {s}.inbox_tombstone").await;
    assert!(names(Some(Duration::from_secs(86_400))).await.is_empty());
}
