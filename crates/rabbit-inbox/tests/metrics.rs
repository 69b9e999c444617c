//! The metrics catalog moves under real runs: counters, histograms and sampled gauges, read
//! from a recorder installed once for this test binary (each test filters by its own
//! consumer name).

#[allow(dead_code)]
mod util;

use std::{sync::OnceLock, time::Duration};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{AtomicStorage, Registry};
use rabbit_inbox::{InboxStatus, RetryPolicy, canonical_json, telemetry::metrics as m};
use serde_json::json;
use sqlx::AssertSqlSafe;
use util::{Rule, TestEnv, message, sha256, thing, wait_for};

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
    config.telemetry.sample_interval = Some(Duration::from_millis(100));
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
    let running = env.start(config, handler);
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
}

#[test]
fn the_catalog_names_every_metric_once() {
    let names = [
        m::RECEIVED,
        m::OUTCOMES,
        m::DUPLICATES,
        m::SETTLE_FAILURES,
        m::REPEATED_REQUEUES,
        m::STALE_LEASE_RECOVERIES,
        m::RETENTION_DELETED,
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
        m::SAMPLER_ERRORS,
        m::OUTBOX_BACKLOG,
        m::OUTBOX_OLDEST_AGE,
    ];
    let unique: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len());
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
