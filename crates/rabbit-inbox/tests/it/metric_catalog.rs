//! The metrics catalog moves under real runs: counters, histograms and sampled gauges, read
//! from a recorder installed once for this test binary (each test filters by its own
//! consumer name).

use std::{sync::OnceLock, time::Duration};

use inbox_ops::{NoProgress, Operations, retention::CleanupRequest};
use inbox_testkit::env::{Rule, TestEnv, message, sha256, thing, wait_for};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{AtomicStorage, Registry};
use rabbit_inbox::{
    InboxSampler, InboxStatus, Outbox, OutboxMessage, Relay, RelayConfig, RetryPolicy, Topology,
    canonical_json::canonical_json, ordering::OrderingPolicy, retention::RetentionPolicy,
    telemetry::metrics as m,
};
use serde_json::json;
use sqlx::AssertSqlSafe;

/// Keeps every metric's current value: counters add up, gauges hold their last value,
/// histograms keep all samples.
struct TestRecorder {
    registry: Registry<Key, AtomicStorage>,
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.registry
            .get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        self.registry
            .get_or_create_gauge(key, |g| Gauge::from_arc(g.clone()))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        self.registry
            .get_or_create_histogram(key, |h| Histogram::from_arc(h.clone()))
    }
}

fn recorder() -> &'static Registry<Key, AtomicStorage> {
    static RECORDER: OnceLock<&'static TestRecorder> = OnceLock::new();
    &RECORDER
        .get_or_init(|| {
            let recorder: &'static TestRecorder = Box::leak(Box::new(TestRecorder {
                registry: Registry::atomic(),
            }));
            metrics::set_global_recorder(recorder).expect("the only recorder of this binary");
            recorder
        })
        .registry
}

fn key(name: &str, pairs: &[(&str, &str)]) -> Key {
    let labels: Vec<metrics::Label> = pairs
        .iter()
        .map(|(k, v)| metrics::Label::new((*k).to_owned(), (*v).to_owned()))
        .collect();
    Key::from_parts(name.to_owned(), labels)
}

/// Labels must be given in the order the library records them.
fn counter(name: &str, pairs: &[(&str, &str)]) -> u64 {
    recorder()
        .get_counter_handles()
        .get(&key(name, pairs))
        .map_or(0, |c| c.load(std::sync::atomic::Ordering::Relaxed))
}

fn histogram(name: &str, pairs: &[(&str, &str)]) -> Vec<f64> {
    recorder()
        .get_histogram_handles()
        .get(&key(name, pairs))
        .map(|h| h.data())
        .unwrap_or_default()
}

fn gauge(name: &str, pairs: &[(&str, &str)]) -> Option<f64> {
    recorder()
        .get_gauge_handles()
        .get(&key(name, pairs))
        .map(|g| f64::from_bits(g.load(std::sync::atomic::Ordering::Relaxed)))
}

async fn wait_counter(name: &str, pairs: &[(&str, &str)], at_least: u64) {
    wait_for(&format!("{name}{pairs:?} >= {at_least}"), async || {
        counter(name, pairs) >= at_least
    })
    .await;
}

async fn wait_gauge(name: &str, pairs: &[(&str, &str)], what: &str, ok: impl Fn(f64) -> bool) {
    wait_for(&format!("{name}{pairs:?} {what}"), async || {
        gauge(name, pairs).is_some_and(&ok)
    })
    .await;
}

#[tokio::test]
async fn outcomes_duplicates_latencies_and_attempts_move_under_a_run() {
    recorder();
    let env = TestEnv::new().await;
    let consumer = format!("metrics-{}", env.id);
    let c = consumer.as_str();
    let mut config = env.config(&consumer, env.topology("metrics"));
    config.retry.max_attempts = 2;
    config.telemetry.known_message_types = vec!["Thing".into()];
    config.telemetry.max_message_types = 1;
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("retried", Rule::FailAttempts(1));
    plan.for_id("permanent", Rule::Permanent);
    plan.for_id("poisoned", Rule::Retryable);
    let running = env.start(config, handler);

    env.publish(&topology, &thing("ok", 1)).await;
    // A type beyond the known one and the one first-seen slot folds into `other`.
    env.publish(&topology, &message(Some("first-seen"), "Seen", &json!({})))
        .await;
    wait_counter(
        m::OUTCOMES,
        &[
            ("consumer", c),
            ("message_type", "Seen"),
            ("outcome", "processed"),
        ],
        1,
    )
    .await;
    env.publish(&topology, &message(Some("folded"), "Unheard", &json!({})))
        .await;
    env.publish(&topology, &thing("retried", 2)).await;
    env.publish(&topology, &thing("permanent", 3)).await;
    env.publish(&topology, &thing("poisoned", 4)).await;
    let mut not_json = thing("not-json", 5);
    not_json.body = b"{not json".to_vec();
    env.publish(&topology, &not_json).await;

    let thing_outcome = |outcome| {
        [
            ("consumer", c),
            ("message_type", "Thing"),
            ("outcome", outcome),
        ]
    };
    wait_counter(m::OUTCOMES, &thing_outcome("processed"), 2).await;
    wait_counter(m::OUTCOMES, &thing_outcome("retry_scheduled"), 2).await;
    wait_counter(m::OUTCOMES, &thing_outcome("permanent_failed"), 2).await;
    wait_counter(m::OUTCOMES, &thing_outcome("poisoned"), 1).await;
    wait_counter(
        m::OUTCOMES,
        &[
            ("consumer", c),
            ("message_type", "Seen"),
            ("outcome", "processed"),
        ],
        1,
    )
    .await;
    wait_counter(
        m::OUTCOMES,
        &[
            ("consumer", c),
            ("message_type", "other"),
            ("outcome", "processed"),
        ],
        1,
    )
    .await;

    // A republish of a processed message, and a copy of it with another body.
    env.publish(&topology, &thing("ok", 1)).await;
    env.publish(&topology, &thing("ok", 99)).await;
    wait_counter(
        m::DUPLICATES,
        &[
            ("consumer", c),
            ("message_type", "Thing"),
            ("reason", "republished"),
        ],
        1,
    )
    .await;
    wait_counter(m::OUTCOMES, &thing_outcome("duplicate"), 1).await;
    wait_counter(m::OUTCOMES, &thing_outcome("payload_conflict"), 1).await;

    let stats = running.stop().await;
    assert_eq!(
        counter(m::RECEIVED, &[("consumer", c)]),
        stats.received,
        "received counter and stats agree"
    );
    // 9 published, and the second attempts of "retried" and "poisoned".
    assert_eq!(stats.received, 11, "{stats:?}");

    let attempts = histogram(m::ATTEMPTS, &[("consumer", c), ("message_type", "Thing")]);
    let mut sorted = attempts.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(sorted, [1.0, 2.0], "ok on attempt 1, retried on attempt 2");
    let ages = histogram(
        m::PROCESSING_AGE,
        &[("consumer", c), ("message_type", "Thing")],
    );
    assert_eq!(ages.len(), 2);
    assert!(
        ages.iter().any(|&a| a >= 0.2),
        "the retried message waited at least its 200 ms retry delay: {ages:?}"
    );
    assert!(!histogram(m::HANDLER_DURATION, &[("consumer", c)]).is_empty());
    assert!(
        !histogram(
            m::TRANSACTION_DURATION,
            &[("consumer", c), ("result", "committed")]
        )
        .is_empty()
    );
    assert!(
        !histogram(
            m::TRANSACTION_DURATION,
            &[("consumer", c), ("result", "rolled_back")]
        )
        .is_empty(),
        "failing handlers roll their transaction back"
    );
    let settled = histogram(m::DELIVERY_TO_SETTLE, &[("consumer", c)]);
    assert_eq!(
        settled.len() as u64,
        stats.received,
        "one latency per delivery"
    );
    assert!(!histogram(m::COMMIT_TO_ACK, &[("consumer", c)]).is_empty());
}

#[cfg(feature = "fault-injection")]
#[tokio::test]
async fn a_redelivery_after_a_lost_ack_counts_as_a_redelivered_duplicate() {
    recorder();
    let env = TestEnv::new().await;
    let consumer = format!("metrics-{}", env.id);
    let c = consumer.as_str();
    let config = env.config(&consumer, env.topology("redelivered"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, _) = env.handler();
    let running = env.start(config, handler);
    running.faults.drop_connection_after_commit_of("crash");
    env.publish(&topology, &thing("crash", 1)).await;
    wait_counter(
        m::DUPLICATES,
        &[
            ("consumer", c),
            ("message_type", "Thing"),
            ("reason", "redelivered"),
        ],
        1,
    )
    .await;
    wait_counter(m::SETTLE_FAILURES, &[("consumer", c)], 1).await;
    running.stop().await;
    assert_eq!(env.effects("crash").await, 1);
}

#[tokio::test]
async fn sampled_gauges_follow_stale_rows_and_their_recovery() {
    recorder();
    let env = TestEnv::new().await;
    let consumer = format!("metrics-{}", env.id);
    let c = consumer.as_str();
    let mut config = env.config(&consumer, env.topology("sampled"));
    config.retry.stale_processing_after = Duration::from_secs(60);
    let sampler = InboxSampler::for_consumer(env.pool.clone(), &config, Duration::from_millis(100))
        .expect("valid interval");
    let topology = config.topology.clone();
    env.declare(&config).await;

    // A PROCESSING row left an hour ago by an instance that died with its claim committed.
    let body = json!({ "id": "stale", "n": 1 });
    let s = &env.schema;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, processing_started_at, payload_sha256) \
         VALUES ('stale', $1, 'Thing', 1, 'PROCESSING', 1, now() - interval '1 hour', $2)"
    )))
    .bind(c)
    .bind(sha256(canonical_json(&body).as_bytes()))
    .execute(&env.pool)
    .await
    .expect("stale row");

    let (handler, plan) = env.handler();
    plan.for_id("parked", Rule::Permanent);
    let running = env.start_beside(config, handler, |runner| {
        runner.task("sampler", |stop| sampler.run(stop))
    });
    wait_gauge(m::STALE_PROCESSING_ROWS, &[("consumer", c)], "= 1", |v| {
        v == 1.0
    })
    .await;
    wait_gauge(
        m::OLDEST_UNPROCESSED_AGE,
        &[("consumer", c)],
        ">= 3500 s",
        |v| v >= 3500.0,
    )
    .await;
    wait_gauge(
        m::OPEN_ROWS,
        &[("consumer", c), ("status", "PROCESSING")],
        "= 1",
        |v| v == 1.0,
    )
    .await;

    // Its message comes back: the consumer takes the stale row over.
    env.publish(&topology, &message(Some("stale"), "Thing", &body))
        .await;
    wait_counter(m::STALE_LEASE_RECOVERIES, &[("consumer", c)], 1).await;
    env.publish(&topology, &thing("parked", 2)).await;
    wait_gauge(m::PARKED_ROWS, &[("consumer", c)], "= 1", |v| v == 1.0).await;
    // The stale row is no longer open.
    wait_gauge(m::STALE_PROCESSING_ROWS, &[("consumer", c)], "= 0", |v| {
        v == 0.0
    })
    .await;
    wait_gauge(
        m::OLDEST_UNPROCESSED_AGE,
        &[("consumer", c)],
        "< 60 s",
        |v| v < 60.0,
    )
    .await;
    wait_gauge(m::PARKED_OLDEST_AGE, &[("consumer", c)], "> 0", |v| v > 0.0).await;
    running.stop().await;
    assert_eq!(env.effects("stale").await, 1);
}

/// Inserts a row of `consumer` directly, to give the sampler's queries known ages.
async fn insert_row(env: &TestEnv, consumer: &str, id: &str, status: InboxStatus, sql: &str) {
    let s = &env.schema;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, payload_sha256, \
           last_failed_at, processing_started_at, processed_at) \
         SELECT $1, $2, 'Thing', 1, $3, attempt, '\\x00', failed, started, processed \
         FROM (SELECT {sql}) AS v(attempt, failed, started, processed)"
    )))
    .bind(id)
    .bind(consumer)
    .bind(status.as_str())
    .execute(&env.pool)
    .await
    .expect("row inserted");
}

#[tokio::test]
async fn oldest_unprocessed_age_leaves_out_rows_waiting_for_their_retry() {
    let env = TestEnv::new().await;
    let consumer = "sampled";
    let retry = RetryPolicy::tiered(vec![Duration::from_secs(30), Duration::from_secs(600)]);
    // Failed 20 s ago on attempt 1: waits 30 s, not stuck.
    insert_row(
        &env,
        consumer,
        "waiting",
        InboxStatus::RetryableFailed,
        "1, now() - interval '20 seconds', NULL::timestamptz, NULL::timestamptz",
    )
    .await;
    // Failed 500 s ago on attempt 2: waits 600 s, not stuck.
    insert_row(
        &env,
        consumer,
        "waiting-longer",
        InboxStatus::RetryableFailed,
        "2, now() - interval '500 seconds', NULL::timestamptz, NULL::timestamptz",
    )
    .await;
    // Failed 100 s ago on attempt 1: its 30 s delay ended 70 s ago, a lost retry.
    insert_row(
        &env,
        consumer,
        "overdue",
        InboxStatus::RetryableFailed,
        "1, now() - interval '100 seconds', NULL::timestamptz, NULL::timestamptz",
    )
    .await;
    insert_row(
        &env,
        consumer,
        "in-progress",
        InboxStatus::Processing,
        "1, NULL::timestamptz, now() - interval '10 seconds', NULL::timestamptz",
    )
    .await;
    insert_row(
        &env,
        consumer,
        "parked",
        InboxStatus::Poisoned,
        "5, now() - interval '1 hour', NULL::timestamptz, NULL::timestamptz",
    )
    .await;
    insert_row(
        &env,
        consumer,
        "done",
        InboxStatus::Processed,
        "1, NULL::timestamptz, NULL::timestamptz, now() - interval '10 days'",
    )
    .await;
    insert_row(
        &env,
        "other-consumer",
        "overdue-elsewhere",
        InboxStatus::RetryableFailed,
        "1, now() - interval '1 day', NULL::timestamptz, NULL::timestamptz",
    )
    .await;

    let mut conn = env.pool.acquire().await.expect("connection");
    let sample = env
        .store
        .sample_open_rows(&mut conn, consumer, Duration::from_secs(5), &retry)
        .await
        .expect("sample");
    assert_eq!(sample.processing, 1);
    assert_eq!(sample.retryable_failed, 3);
    assert_eq!(sample.permanent_failed, 0);
    assert_eq!(sample.poisoned, 1);
    assert_eq!(
        sample.stale_processing, 1,
        "started 10 s ago, stale after 5 s"
    );
    let age = sample.oldest_unprocessed_age;
    assert!(
        (69.0..80.0).contains(&age),
        "overdue by about 70 s, got {age}"
    );
    let parked = sample.parked_oldest_age.expect("a parked row");
    assert!((3590.0..3700.0).contains(&parked), "{parked}");

    let week = Duration::from_secs(7 * 86_400);
    let headroom = env
        .store
        .dedup_window_headroom(&mut conn, consumer, week)
        .await
        .expect("headroom")
        .expect("processed rows");
    assert!(
        (3.0 * 86_400.0 - 60.0..3.0 * 86_400.0 + 60.0).contains(&headroom),
        "10 days kept, 7 needed: about 3 days of headroom, got {headroom}"
    );
    let month = Duration::from_secs(30 * 86_400);
    let short = env
        .store
        .dedup_window_headroom(&mut conn, consumer, month)
        .await
        .expect("headroom")
        .expect("processed rows");
    assert!(
        (-20.0 * 86_400.0 - 60.0..-20.0 * 86_400.0 + 60.0).contains(&short),
        "10 days kept, 30 needed: 20 days short, got {short}"
    );
    assert_eq!(
        env.store
            .dedup_window_headroom(&mut conn, "no-such-consumer", week)
            .await
            .expect("headroom"),
        None
    );
}

/// Inserts an ordering key row of `consumer`; `sql` gives (head_message_id, blocked_since,
/// next_sequence, gap_since).
async fn insert_order_key(env: &TestEnv, consumer: &str, key: &str, sql: &str) {
    let s = &env.schema;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".inbox_order_key (consumer_name, order_key, head_message_id, \
           blocked_since, next_sequence, gap_since) \
         SELECT $1, $2, head, blocked, next, gap \
         FROM (SELECT {sql}) AS v(head, blocked, next, gap)"
    )))
    .bind(consumer)
    .bind(key)
    .execute(&env.pool)
    .await
    .expect("order key inserted");
}

/// Inserts a HELD row of `consumer` at `position` in `key`'s order.
async fn insert_held(env: &TestEnv, consumer: &str, key: &str, position: i64) {
    let s = &env.schema;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, payload_sha256, order_key, \
           order_position) \
         VALUES ($1, $2, 'Thing', 1, 'HELD', 0, '\\x00', $3, $4)"
    )))
    .bind(format!("{key}-{position}"))
    .bind(consumer)
    .bind(key)
    .bind(position)
    .execute(&env.pool)
    .await
    .expect("HELD row inserted");
}

/// Runs `sampler` until `ready` holds, then stops it.
async fn sample_until(sampler: InboxSampler, what: &str, ready: impl Fn() -> bool) {
    let task = tokio::spawn(sampler.run(std::future::pending()));
    wait_for(what, async || ready()).await;
    task.abort();
}

#[tokio::test]
async fn ordered_consumers_sample_blocked_keys_gaps_and_held_messages() {
    recorder();
    let env = TestEnv::new().await;
    let consumer = format!("ordered-{}", env.id);
    let c = consumer.as_str();
    let by_consumer = [("consumer", c)];
    let none = "NULL::text, NULL::timestamptz";
    // Blocked behind its head for 20 minutes, two messages held behind it.
    insert_order_key(
        &env,
        c,
        "a",
        "'a-1', now() - interval '20 minutes', NULL::int8, NULL::timestamptz",
    )
    .await;
    insert_held(&env, c, "a", 2).await;
    insert_held(&env, c, "a", 3).await;
    // Blocked for 5 minutes, nothing held yet.
    insert_order_key(
        &env,
        c,
        "b",
        "'b-1', now() - interval '5 minutes', NULL::int8, NULL::timestamptz",
    )
    .await;
    // Waits for number 4 while 6 and 7 are held: a gap for 45 minutes, the oldest wait.
    insert_order_key(
        &env,
        c,
        "g",
        &format!("{none}, 4, now() - interval '45 minutes'"),
    )
    .await;
    insert_held(&env, c, "g", 6).await;
    insert_held(&env, c, "g", 7).await;
    // Its first held number is the one it waits for: released, not blocked (the stale
    // gap_since does not count).
    insert_order_key(
        &env,
        c,
        "turn",
        &format!("{none}, 3, now() - interval '3 hours'"),
    )
    .await;
    insert_held(&env, c, "turn", 3).await;
    // Held in arrival order behind nothing: waiting for the release task, not blocked.
    insert_held(&env, c, "arrival", 100).await;
    // A key seen before, nothing held.
    insert_order_key(&env, c, "idle", &format!("{none}, 10, NULL::timestamptz")).await;
    // Another consumer's blocked key and held message.
    let other = format!("other-{}", env.id);
    insert_order_key(
        &env,
        &other,
        "a",
        "'x', now() - interval '2 days', NULL::int8, NULL::timestamptz",
    )
    .await;
    insert_held(&env, &other, "a", 1).await;

    // Built from a config without an ordering policy, the sampler leaves the ordering
    // gauges alone.
    let interval = Duration::from_millis(100);
    let mut config = env.config(c, Topology::new("unused"));
    let unordered =
        InboxSampler::for_consumer(env.pool.clone(), &config, interval).expect("sampler");
    sample_until(unordered, "open rows sampled", || {
        gauge(m::PARKED_ROWS, &by_consumer).is_some()
    })
    .await;
    for name in [m::BLOCKED_KEYS, m::BLOCKED_OLDEST_AGE, m::HELD_MESSAGES] {
        assert_eq!(
            gauge(name, &by_consumer),
            None,
            "{name} sampled without a policy"
        );
    }

    config.ordering = Some(OrderingPolicy::by_aggregate());
    let ordered =
        || InboxSampler::for_consumer(env.pool.clone(), &config, interval).expect("sampler");
    sample_until(ordered(), "ordering gauges sampled", || {
        gauge(m::HELD_MESSAGES, &by_consumer).is_some()
    })
    .await;
    assert_eq!(
        gauge(m::BLOCKED_KEYS, &by_consumer),
        Some(3.0),
        "a, b and the gap of g"
    );
    assert_eq!(gauge(m::HELD_MESSAGES, &by_consumer), Some(6.0));
    let age = gauge(m::BLOCKED_OLDEST_AGE, &by_consumer).expect("age sampled");
    assert!(
        (2690.0..2800.0).contains(&age),
        "the gap of g, 45 minutes: {age}"
    );

    // The heads are resolved and the gap filled: nothing waits, the age drops to 0.
    let s = &env.schema;
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{s}\".inbox_order_key SET head_message_id = NULL, blocked_since = NULL, \
           next_sequence = CASE WHEN order_key = 'g' THEN 6 END \
         WHERE consumer_name = $1"
    )))
    .bind(c)
    .execute(&env.pool)
    .await
    .expect("keys unblocked");
    // A sampler that does not know the config samples the ordering gauges too.
    let unknown = InboxSampler::new(
        env.pool.clone(),
        env.schema.clone(),
        c,
        RetryPolicy::default(),
        interval,
    )
    .expect("sampler");
    sample_until(unknown, "no key waits", || {
        gauge(m::BLOCKED_KEYS, &by_consumer) == Some(0.0)
    })
    .await;
    assert_eq!(gauge(m::BLOCKED_OLDEST_AGE, &by_consumer), Some(0.0));
    assert_eq!(
        gauge(m::HELD_MESSAGES, &by_consumer),
        Some(6.0),
        "held until released"
    );
}

#[tokio::test]
async fn retention_counts_the_rows_it_deletes() {
    recorder();
    let env = TestEnv::new().await;
    let consumer = format!("retention-{}", env.id);
    for id in ["old-1", "old-2"] {
        insert_row(
            &env,
            &consumer,
            id,
            InboxStatus::Processed,
            "1, NULL::timestamptz, NULL::timestamptz, now() - interval '10 days'",
        )
        .await;
    }
    insert_row(
        &env,
        &consumer,
        "new",
        InboxStatus::Processed,
        "1, NULL::timestamptz, NULL::timestamptz, now()",
    )
    .await;
    let mut conn = env.pool.acquire().await.expect("connection");
    let deleted = env
        .store
        .cleanup_processed_older_than(&mut conn, &consumer, Duration::from_secs(86_400), 100)
        .await
        .expect("cleanup");
    assert_eq!(deleted, 2);
    assert_eq!(counter(m::RETENTION_DELETED, &[("consumer", &consumer)]), 2);

    // The operations' cleanup (the consumer's timer, `inboxctl cleanup`) counts the same way.
    for id in ["old-3", "old-4", "old-5"] {
        insert_row(
            &env,
            &consumer,
            id,
            InboxStatus::Processed,
            "1, NULL::timestamptz, NULL::timestamptz, now() - interval '10 days'",
        )
        .await;
    }
    let retention = RetentionPolicy {
        processed: Duration::from_secs(86_400),
        scrub_payload_after: None,
        parking_replay_window: Duration::from_secs(3_600),
        ..RetentionPolicy::default()
    };
    let retry = env.config(&consumer, Topology::new("unused")).retry;
    let report = Operations::new(env.pool.clone(), env.schema.clone())
        .cleanup(
            &CleanupRequest::new(&consumer, retention, retry),
            &NoProgress,
        )
        .await
        .expect("cleanup");
    assert_eq!(report.removed_processed, 3);
    assert_eq!(counter(m::RETENTION_DELETED, &[("consumer", &consumer)]), 5);
}

#[tokio::test]
async fn the_headroom_gauge_follows_the_history_and_a_failing_sampler_is_counted() {
    recorder();
    let env = TestEnv::new().await;
    let consumer = format!("headroom-{}", env.id);
    let c = consumer.as_str();
    insert_row(
        &env,
        c,
        "ten-days-old",
        InboxStatus::Processed,
        "1, NULL::timestamptz, NULL::timestamptz, now() - interval '10 days'",
    )
    .await;
    let day = 86_400.0;
    let retry = RetryPolicy::default();
    let sample = |window_days: u64| {
        InboxSampler::new(
            env.pool.clone(),
            env.schema.clone(),
            c,
            retry.clone(),
            Duration::from_millis(100),
        )
        .expect("valid interval")
        .with_replay_window(Duration::from_secs(window_days * 86_400))
        .run(std::future::pending())
    };
    // Ten days kept against a week of replays: three days to spare.
    let sampler = tokio::spawn(sample(7));
    wait_gauge(
        m::DEDUP_WINDOW_HEADROOM,
        &[("consumer", c)],
        "about +3 days",
        |v| (v - 3.0 * day).abs() < 3600.0,
    )
    .await;
    sampler.abort();
    // Against a month of replays the history is twenty days short.
    let sampler = tokio::spawn(sample(30));
    wait_gauge(
        m::DEDUP_WINDOW_HEADROOM,
        &[("consumer", c)],
        "about -20 days",
        |v| (v + 20.0 * day).abs() < 3600.0,
    )
    .await;
    sampler.abort();

    // A sampler whose queries fail (here: its schema does not exist) counts every failure and
    // keeps running.
    let lost = format!("lost-{}", env.id);
    let missing = rabbit_inbox::SchemaName::new(format!("t_missing_{}", env.id)).expect("name");
    let sampler = tokio::spawn(
        InboxSampler::new(
            env.pool.clone(),
            missing,
            lost.as_str(),
            retry.clone(),
            Duration::from_millis(100),
        )
        .expect("valid interval")
        .run(std::future::pending()),
    );
    wait_counter(m::SAMPLER_ERRORS, &[("consumer", lost.as_str())], 3).await;
    sampler.abort();
}

#[tokio::test]
async fn the_relay_samples_its_backlog_and_counts_publishes_and_returns() {
    recorder();
    let env = TestEnv::new().await;
    let schema = env.schema.as_str().to_owned();
    let by_schema = [("schema", schema.as_str())];
    let downstream = env.topology("relay-metrics");
    env.broker
        .declare(&downstream, &inbox_testkit::env::test_retry())
        .await
        .expect("queues declared");
    let outbox = Outbox::new(env.schema.clone());
    let mut conn = env.pool.acquire().await.expect("connection");
    for i in 0..3 {
        let m = OutboxMessage::json("Routed", "", &downstream.queue, &json!({ "i": i }))
            .expect("json")
            .with_id(format!("routed-{i}"));
        outbox.enqueue(&mut conn, &m).await.expect("enqueue");
    }
    // No queue is bound to this routing key: returned, retried once, then given up.
    let nowhere = format!("t-{}-nowhere", env.id);
    let m = OutboxMessage::json("Unroutable", "", &nowhere, &json!({}))
        .expect("json")
        .with_id("unroutable");
    outbox.enqueue(&mut conn, &m).await.expect("enqueue");

    let mut config = RelayConfig::new(env.schema.clone());
    config.poll_interval = Duration::from_millis(200);
    config.maintenance_interval = Duration::from_millis(200);
    config.max_attempts = 2;
    config.retry_initial_delay = Duration::from_secs(3);
    config.retry_max_delay = Duration::from_secs(3);
    let relay =
        Relay::new(inbox_testkit::env::amqp_url(), env.pool.clone(), config).expect("relay config");
    let stats = relay.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(relay.run(async move {
        let _ = stopped.await;
    }));

    wait_counter(m::OUTBOX_PUBLISHED, &by_schema, 3).await;
    wait_counter(m::OUTBOX_RETURNS, &by_schema, 1).await;
    assert_eq!(histogram(m::OUTBOX_DELAY, &by_schema).len(), 3);
    assert!(!histogram(m::OUTBOX_PUBLISH_DURATION, &by_schema).is_empty());
    // Between its two attempts the unroutable row is the whole backlog, and it ages.
    wait_gauge(m::OUTBOX_PENDING, &by_schema, "== 1", |v| v == 1.0).await;
    wait_gauge(m::OUTBOX_OLDEST_PENDING_AGE, &by_schema, "> 0", |v| v > 0.0).await;
    // After its second return it is FAILED, and nothing is pending.
    let deadline = tokio::time::Instant::now() + inbox_testkit::env::DEADLINE;
    loop {
        let row: (String, i32, Option<String>) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, attempts, last_error_code FROM \"{schema}\".outbox \
             WHERE message_id = 'unroutable'"
        )))
        .fetch_one(&env.pool)
        .await
        .expect("row");
        if row.0 == "FAILED" {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline && !task.is_finished(),
            "the unroutable row is not FAILED: {row:?}, relay {:?}, task finished: {}",
            stats.snapshot(),
            task.is_finished()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_gauge(m::OUTBOX_FAILED, &by_schema, "== 1", |v| v == 1.0).await;
    wait_gauge(m::OUTBOX_PENDING, &by_schema, "== 0", |v| v == 0.0).await;
    wait_gauge(m::OUTBOX_OLDEST_PENDING_AGE, &by_schema, "== 0", |v| {
        v == 0.0
    })
    .await;
    assert_eq!(counter(m::OUTBOX_RETURNS, &by_schema), 2);
    assert_eq!(counter(m::OUTBOX_PUBLISHED, &by_schema), 3);
    assert_eq!(counter(m::OUTBOX_CONFIRM_FAILURES, &by_schema), 0);
    assert_eq!(counter(m::OUTBOX_FENCED, &by_schema), 0);

    let _ = stop.send(());
    tokio::time::timeout(inbox_testkit::env::DEADLINE, task)
        .await
        .expect("relay stops in time")
        .expect("relay task did not panic")
        .expect("relay ran without a fatal error");
}

#[test]
fn the_catalog_names_every_metric_once() {
    let names = [
        m::RECEIVED,
        m::OUTCOMES,
        m::DUPLICATES,
        m::SETTLE_FAILURES,
        m::REPEATED_REQUEUES,
        m::DEPLOYMENT_FAULTS,
        m::STALE_LEASE_RECOVERIES,
        m::RETENTION_DELETED,
        m::SEQUENCE_GAPS,
        m::REPEATED_SESSION_LOSSES,
        m::DELIVERY_TO_SETTLE,
        m::PROCESSING_AGE,
        m::ATTEMPTS,
        m::HANDLER_DURATION,
        m::TRANSACTION_DURATION,
        m::COMMIT_TO_ACK,
        m::OLDEST_UNPROCESSED_AGE,
        m::OPEN_ROWS,
        m::STALE_PROCESSING_ROWS,
        m::PARKED_ROWS,
        m::PARKED_OLDEST_AGE,
        m::DEDUP_WINDOW_HEADROOM,
        m::BLOCKED_KEYS,
        m::BLOCKED_OLDEST_AGE,
        m::HELD_MESSAGES,
        m::SAMPLER_ERRORS,
        m::LEASES_LOST,
        m::OUTBOX_PENDING,
        m::OUTBOX_FAILED,
        m::OUTBOX_OLDEST_PENDING_AGE,
        m::OUTBOX_PUBLISHED,
        m::OUTBOX_PUBLISH_DURATION,
        m::OUTBOX_DELAY,
        m::OUTBOX_RETURNS,
        m::OUTBOX_CONFIRM_FAILURES,
        m::OUTBOX_FENCED,
    ];
    let unique: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len());
    // The library records metrics only through the catalog's names, so no metric escapes it.
    fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("source dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    sources(
        std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/src")),
        &mut files,
    );
    for file in files {
        if file.ends_with("telemetry/metrics.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&file).expect("source");
        assert!(
            !text.contains("\"rabbit_inbox_"),
            "{} names a metric outside the catalog",
            file.display()
        );
    }
    // The shipped alert rules and dashboard refer only to catalog metrics.
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy");
    for file in [
        "prometheus/rabbit-inbox-rules.yml",
        "grafana/rabbit-inbox-dashboard.json",
    ] {
        let text = std::fs::read_to_string(format!("{root}/{file}")).expect("deploy file");
        for word in text.split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')) {
            if let Some(base) = word.strip_prefix("rabbit_inbox_") {
                let base = base
                    .strip_suffix("_bucket")
                    .or_else(|| base.strip_suffix("_count"))
                    .or_else(|| base.strip_suffix("_sum"))
                    .unwrap_or(base);
                let name = format!("rabbit_inbox_{base}");
                assert!(
                    names.contains(&name.as_str()),
                    "{file} refers to {word}, which is not in the catalog"
                );
            }
        }
    }
}
