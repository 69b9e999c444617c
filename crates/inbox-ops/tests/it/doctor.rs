//! The doctor against real servers: a correct installation has no failing check, and each
//! deliberately broken one (a primary key without consumer_name, a work queue without its
//! dead-letter route, retention shorter than the replay window, an orphaned parked message, a
//! PROCESSED message in the parking lot, a parked row whose copy is gone, lost retries,
//! payloads the policy does not allow, a quorum work queue with at-most-once dead-lettering and
//! a delivery limit inside the retry budget) fails, or warns, on exactly the check that covers
//! it.
//! The broker topology is read through the management API (port 15672).

// Shared with the other integration tests; not every helper is used here.

use std::time::Duration;

use inbox_ops::{
    Operations,
    doctor::{DoctorReport, DoctorRequest, Severity, check_ids as ids},
};
use inbox_testkit::env::{Rule, TestEnv, amqp_url, message, wait_for};
use rabbit_inbox::{
    ConsumerConfig, InboxStatus, PayloadStorage, Topology, broker::OutgoingMessage,
    retention::RetentionPolicy, status::parking_headers,
};
use serde_json::json;

const CONSUMER: &str = "invoicer";
const MANAGEMENT: &str = "http://127.0.0.1:15672";

fn invoice(id: &str) -> OutgoingMessage {
    message(
        Some(id),
        "InvoiceIssued",
        &json!({ "invoice": id, "amount": 42 }),
    )
}

/// The request that describes `config` as it is deployed, retention included.
fn request(config: &ConsumerConfig) -> DoctorRequest {
    let mut request = DoctorRequest::for_consumer(config, amqp_url());
    request.retention = Some(RetentionPolicy::default());
    request
}

async fn doctor(env: &TestEnv, request: &DoctorRequest) -> DoctorReport {
    Operations::new(env.pool.clone(), env.schema.clone())
        .doctor(request)
        .await
}

fn severity(report: &DoctorReport, id: &str) -> Severity {
    report
        .severity(id)
        .unwrap_or_else(|| panic!("check {id} did not run: {report:#?}"))
}

fn failing(report: &DoctorReport) -> Vec<&str> {
    report
        .checks
        .iter()
        .filter(|c| c.severity == Severity::Fail)
        .map(|c| c.id)
        .collect()
}

/// A copy in the parking lot as the consumer would have parked it, whatever the inbox holds.
async fn park_by_hand(env: &TestEnv, topology: &Topology, id: &str) {
    let mut m = invoice(id);
    for (k, v) in [
        (parking_headers::INBOX_KEY, json!(id)),
        (parking_headers::CONSUMER, json!(CONSUMER)),
        (parking_headers::STATUS, json!("PERMANENT_FAILED")),
        (parking_headers::ERROR_CODE, json!("test_permanent")),
    ] {
        m.headers.insert(k.into(), v);
    }
    env.broker
        .publish("", &topology.parking_queue, &m)
        .await
        .expect("parked by hand");
}

/// A request to the management API as guest; panics unless it succeeds.
async fn management(method: reqwest::Method, path: &str, body: Option<serde_json::Value>) {
    let mut request = reqwest::Client::new()
        .request(method.clone(), format!("{MANAGEMENT}{path}"))
        .basic_auth("guest", Some("guest"));
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect(
        "RabbitMQ's management API answers on port 15672 (rabbitmq-plugins enable rabbitmq_management)",
    );
    assert!(
        response.status().is_success(),
        "{method} {path}: {}",
        response.status()
    );
}

/// Deletes a broker policy when dropped, also when the test panics.
struct PolicyGuard(String);

impl Drop for PolicyGuard {
    fn drop(&mut self) {
        let path = format!("/api/policies/%2F/{}", self.0);
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(async {
                    let _ = reqwest::Client::new()
                        .delete(format!("{MANAGEMENT}{path}"))
                        .basic_auth("guest", Some("guest"))
                        .send()
                        .await;
                });
            }
        })
        .join();
    }
}

/// A consumer that processes `done`, parks `broken` (permanent failure) and stops.
async fn run_consumer(env: &TestEnv, config: &ConsumerConfig, done: &[&str], broken: &[&str]) {
    env.declare(config).await;
    let (handler, plan) = env.handler();
    for id in broken {
        plan.for_id(id, Rule::Permanent);
    }
    let running = env.start(config.clone(), handler);
    for id in done.iter().chain(broken) {
        env.publish(&config.topology, &invoice(id)).await;
    }
    for id in done {
        env.wait_for_record(CONSUMER, id, "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    }
    for id in broken {
        env.wait_for_record(CONSUMER, id, "parked", |r| {
            r.status == InboxStatus::PermanentFailed
        })
        .await;
    }
    let parked = u32::try_from(broken.len()).expect("few");
    wait_for("parked copies", async || {
        env.depths(&config.topology).await.parking == parked
    })
    .await;
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correct_installation_has_no_failing_check() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    run_consumer(&env, &config, &["inv-1", "inv-2"], &["inv-bad"]).await;

    let report = doctor(&env, &request(&config)).await;
    assert!(failing(&report).is_empty(), "{report:#?}");
    assert_ne!(report.worst, Severity::Fail);
    for id in [
        ids::MIGRATIONS,
        ids::PRIMARY_KEY,
        ids::INDEXES,
        ids::STATUS_CHECK,
        ids::WORK_QUEUE,
        ids::RETRY_TIERS,
        ids::PARKING_LOT,
        ids::RETENTION_WINDOW,
        ids::STALE_PROCESSING,
        ids::LOST_RETRIES,
        ids::PARKED_WITHOUT_ROW,
        ids::ROW_WITHOUT_COPY,
        ids::PROCESSED_IN_PARKING_LOT,
        ids::PAYLOAD_CONFLICTS,
        ids::PARKED_COPIES,
        ids::PAYLOAD_STORAGE,
        ids::PAYLOAD_ENCRYPTION,
    ] {
        assert_eq!(severity(&report, id), Severity::Pass, "{id}: {report:#?}");
    }
    assert!(
        report.check(ids::TOPOLOGY).is_none(),
        "the topology was read"
    );
    let reconciled = report.check(ids::ROW_WITHOUT_COPY).expect("ran");
    assert!(
        reconciled.summary.contains("1 parked row"),
        "{reconciled:?}"
    );
    // Read, not consumed: the parked copy is still there.
    assert_eq!(env.depths(&config.topology).await.parking, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_key_without_consumer_name_fails() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    env.declare(&config).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE \"{}\".message_inbox DROP CONSTRAINT message_inbox_pkey CASCADE, \
           ADD PRIMARY KEY (message_id)",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("key changed");

    let report = doctor(&env, &request(&config)).await;
    assert_eq!(failing(&report), [ids::PRIMARY_KEY], "{report:#?}");
    let check = report.check(ids::PRIMARY_KEY).expect("ran");
    assert!(check.summary.contains("(message_id)"), "{check:?}");
    assert_eq!(report.worst, Severity::Fail);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_queue_without_dead_lettering_fails_unless_a_policy_sets_it() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    env.declare(&config).await;
    let queue = config.topology.queue.clone();
    management(
        reqwest::Method::DELETE,
        &format!("/api/queues/%2F/{queue}"),
        None,
    )
    .await;
    management(
        reqwest::Method::PUT,
        &format!("/api/queues/%2F/{queue}"),
        Some(json!({ "durable": true, "arguments": {} })),
    )
    .await;

    let report = doctor(&env, &request(&config)).await;
    assert_eq!(failing(&report), [ids::WORK_QUEUE], "{report:#?}");
    let check = report.check(ids::WORK_QUEUE).expect("ran");
    assert!(
        check.summary.contains("no dead-letter exchange"),
        "{check:?}"
    );

    // The same route set by a policy instead of queue arguments is as good.
    let first_tier = config.topology.retry_tier_queues(&config.retry)[0].clone();
    let policy = PolicyGuard(format!("{queue}-dlx"));
    management(
        reqwest::Method::PUT,
        &format!("/api/policies/%2F/{}", policy.0),
        Some(json!({
            "pattern": format!("^{}$", queue.replace('.', "\\.")),
            "apply-to": "queues",
            "definition": {
                "dead-letter-exchange": "",
                "dead-letter-routing-key": first_tier,
            },
        })),
    )
    .await;
    let mut report = doctor(&env, &request(&config)).await;
    let start = tokio::time::Instant::now();
    while report.severity(ids::WORK_QUEUE) != Some(Severity::Pass)
        && start.elapsed() < inbox_testkit::env::DEADLINE
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
        report = doctor(&env, &request(&config)).await;
    }
    assert_eq!(
        severity(&report, ids::WORK_QUEUE),
        Severity::Pass,
        "{report:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_queues_pass_and_fail_on_at_most_once_dead_lettering_or_a_low_delivery_limit() {
    let env = TestEnv::new().await;
    let mut config = env.config(CONSUMER, env.topology("quorum-invoices"));
    config.use_quorum_queues(None);
    run_consumer(&env, &config, &["inv-q1"], &["inv-q-bad"]).await;

    let report = doctor(&env, &request(&config)).await;
    assert!(failing(&report).is_empty(), "{report:#?}");
    for id in [ids::WORK_QUEUE, ids::RETRY_TIERS, ids::PARKING_LOT] {
        assert_eq!(severity(&report, id), Severity::Pass, "{id}: {report:#?}");
    }

    // The work queue declared again by hand as a quorum queue with the default (at-most-once)
    // dead-letter strategy and a delivery limit the retry budget plus the prefetch reaches.
    let queue = config.topology.queue.clone();
    let first_tier = config.topology.retry_tier_queues(&config.retry)[0].clone();
    management(
        reqwest::Method::DELETE,
        &format!("/api/queues/%2F/{queue}"),
        None,
    )
    .await;
    management(
        reqwest::Method::PUT,
        &format!("/api/queues/%2F/{queue}"),
        Some(json!({ "durable": true, "arguments": {
            "x-queue-type": "quorum",
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": first_tier,
            "x-delivery-limit": 10,
        } })),
    )
    .await;

    let report = doctor(&env, &request(&config)).await;
    assert_eq!(failing(&report), [ids::WORK_QUEUE], "{report:#?}");
    let check = report.check(ids::WORK_QUEUE).expect("ran");
    let found = format!(
        "{} {}",
        check.summary,
        check.detail.as_deref().unwrap_or("")
    );
    assert!(found.contains("at-least-once"), "{check:?}");
    assert!(found.contains("delivery limit 10"), "{check:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_shorter_than_the_replay_window_fails() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    let mut request = request(&config);
    request.topology = None;
    request.retention = Some(RetentionPolicy {
        processed: Duration::from_secs(86_400),
        ..RetentionPolicy::default()
    });

    let report = doctor(&env, &request).await;
    assert_eq!(failing(&report), [ids::RETENTION_WINDOW], "{report:#?}");
    let check = report.check(ids::RETENTION_WINDOW).expect("ran");
    assert!(
        check
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("shorter")),
        "{check:?}"
    );
    // Without a queue the broker is not looked at, and says so.
    assert_eq!(severity(&report, ids::TOPOLOGY), Severity::Warn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orphaned_parked_message_fails_and_stays_in_the_parking_lot() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    run_consumer(&env, &config, &["inv-1"], &["inv-bad"]).await;
    park_by_hand(&env, &config.topology, "inv-stranger").await;
    wait_for("two parked copies", async || {
        env.depths(&config.topology).await.parking == 2
    })
    .await;

    let report = doctor(&env, &request(&config)).await;
    assert_eq!(failing(&report), [ids::PARKED_WITHOUT_ROW], "{report:#?}");
    let check = report.check(ids::PARKED_WITHOUT_ROW).expect("ran");
    assert!(check.summary.starts_with("1 parked message"), "{check:?}");
    assert!(
        check
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("inv-stranger")),
        "{check:?}"
    );
    assert_eq!(
        env.depths(&config.topology).await.parking,
        2,
        "nothing consumed"
    );
    // Read again, the same findings: the copies went back in place.
    let again = doctor(&env, &request(&config)).await;
    assert_eq!(failing(&again), [ids::PARKED_WITHOUT_ROW]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processed_message_in_the_parking_lot_fails() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    run_consumer(&env, &config, &["inv-done"], &[]).await;
    park_by_hand(&env, &config.topology, "inv-done").await;
    wait_for("a parked copy", async || {
        env.depths(&config.topology).await.parking == 1
    })
    .await;

    let report = doctor(&env, &request(&config)).await;
    assert_eq!(
        failing(&report),
        [ids::PROCESSED_IN_PARKING_LOT],
        "{report:#?}"
    );
    let check = report.check(ids::PROCESSED_IN_PARKING_LOT).expect("ran");
    assert_eq!(check.detail.as_deref(), Some("inv-done"));
    assert_eq!(env.depths(&config.topology).await.parking, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_payload_conflict_is_a_warning_not_a_lost_state() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    env.declare(&config).await;
    let (handler, _) = env.handler();
    let running = env.start(config.clone(), handler);
    env.publish(&config.topology, &invoice("inv-1")).await;
    env.wait_for_record(CONSUMER, "inv-1", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    // The same id with another body: parked by design, the row stays PROCESSED.
    let conflict = message(
        Some("inv-1"),
        "InvoiceIssued",
        &json!({ "invoice": "inv-1", "amount": 43 }),
    );
    env.publish(&config.topology, &conflict).await;
    wait_for("the conflict parked", async || {
        env.depths(&config.topology).await.parking == 1
    })
    .await;
    running.stop().await;

    let report = doctor(&env, &request(&config)).await;
    assert!(failing(&report).is_empty(), "{report:#?}");
    assert_eq!(severity(&report, ids::PAYLOAD_CONFLICTS), Severity::Warn);
    assert_eq!(
        report
            .check(ids::PAYLOAD_CONFLICTS)
            .and_then(|c| c.detail.as_deref()),
        Some("inv-1")
    );
    assert_eq!(
        severity(&report, ids::PROCESSED_IN_PARKING_LOT),
        Severity::Pass
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_row_without_its_copy_fails() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    run_consumer(&env, &config, &[], &["inv-bad"]).await;
    // The copy is lost (taken off the queue), the row stays parked.
    assert_eq!(env.take_parked(&config.topology, 1).await.len(), 1);

    let report = doctor(&env, &request(&config)).await;
    assert_eq!(failing(&report), [ids::ROW_WITHOUT_COPY], "{report:#?}");
    let check = report.check(ids::ROW_WITHOUT_COPY).expect("ran");
    assert_eq!(check.detail.as_deref(), Some("inv-bad"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_management_api_is_a_warning_not_an_error() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    env.declare(&config).await;
    let mut request = request(&config);
    request.management_url = Some("http://127.0.0.1:1".into());

    let report = doctor(&env, &request).await;
    assert_eq!(
        severity(&report, ids::TOPOLOGY),
        Severity::Warn,
        "{report:#?}"
    );
    let check = report.check(ids::TOPOLOGY).expect("ran");
    assert!(
        check
            .hint
            .as_deref()
            .is_some_and(|h| h.contains("rabbitmq_management")),
        "{check:?}"
    );
    assert!(report.check(ids::WORK_QUEUE).is_none());
    assert!(failing(&report).is_empty(), "{report:#?}");
    assert_eq!(report.worst, Severity::Warn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_address_list_is_checked_through_the_first_node_that_answers() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    run_consumer(&env, &config, &["inv-1"], &[]).await;
    let real = amqp_url();
    assert!(real.contains("127.0.0.1"), "{real}");
    // A node that is down (its name does not even resolve), then the one that runs: as
    // `AMQP_URL=amqp://a,amqp://b` gives them.
    let down = real.replace("127.0.0.1", "node-down.invalid");
    let mut request = DoctorRequest::for_consumer(&config, format!("{down},{real}"));
    request.retention = Some(RetentionPolicy::default());
    let report = doctor(&env, &request).await;
    assert!(failing(&report).is_empty(), "{report:#?}");
    for id in [ids::TOPOLOGY, ids::WORK_QUEUE, ids::PARKING_LOT] {
        if let Some(check) = report.check(id) {
            assert_ne!(check.severity, Severity::Warn, "{check:?}");
        }
    }
    assert_eq!(severity(&report, ids::WORK_QUEUE), Severity::Pass);

    // The same with the management API's addresses given as a list.
    let mut request = request.clone();
    request.amqp_url = Some(real);
    request.management_url = Some(format!("http://127.0.0.1:1,{MANAGEMENT}"));
    let report = doctor(&env, &request).await;
    assert_eq!(severity(&report, ids::WORK_QUEUE), Severity::Pass);
    assert!(failing(&report).is_empty(), "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_retries_fail_and_stale_processing_warns_with_the_command_that_fixes_them() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    run_consumer(&env, &config, &["inv-lost", "inv-stuck"], &[]).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{s}\".message_inbox SET status = 'RETRYABLE_FAILED', processing_attempt = 1, \
           last_failed_at = now() - interval '1 hour' WHERE message_id = 'inv-lost'; \
         UPDATE \"{s}\".message_inbox SET status = 'PROCESSING', \
           processing_started_at = now() - interval '1 hour' WHERE message_id = 'inv-stuck'",
        s = env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("rows changed");

    let report = doctor(&env, &request(&config)).await;
    assert_eq!(failing(&report), [ids::LOST_RETRIES], "{report:#?}");
    let lost = report.check(ids::LOST_RETRIES).expect("ran");
    assert!(lost.summary.starts_with("1 "), "{lost:?}");
    assert!(
        lost.detail
            .as_deref()
            .is_some_and(|d| d.contains("inv-lost"))
    );
    assert!(
        lost.hint
            .as_deref()
            .is_some_and(|h| h.contains("inboxctl recover")),
        "{lost:?}"
    );
    assert_eq!(severity(&report, ids::STALE_PROCESSING), Severity::Warn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_the_policy_does_not_allow_are_warnings() {
    let env = TestEnv::new().await;
    let mut config = env.config(CONSUMER, env.topology("invoices"));
    config.payload_storage = PayloadStorage::Always;
    run_consumer(&env, &config, &["inv-1", "inv-2"], &[]).await;

    assert_eq!(
        severity(&doctor(&env, &request(&config)).await, ids::PAYLOAD_STORAGE),
        Severity::Pass
    );
    // Deployed since as metadata-only and encrypted: the rows written before do not fit.
    let mut request = request(&config);
    request
        .payload_storage_by_type
        .insert("InvoiceIssued".into(), PayloadStorage::Never);
    request.payload_encrypted = true;
    let report = doctor(&env, &request).await;
    let storage = report.check(ids::PAYLOAD_STORAGE).expect("ran");
    assert_eq!(storage.severity, Severity::Warn, "{report:#?}");
    assert_eq!(storage.detail.as_deref(), Some("InvoiceIssued: 2"));
    assert_eq!(severity(&report, ids::PAYLOAD_ENCRYPTION), Severity::Warn);
    assert!(failing(&report).is_empty(), "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_parked_copies_than_parked_rows_is_a_warning_naming_both_figures() {
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    run_consumer(&env, &config, &["inv-1"], &["inv-bad-1", "inv-bad-2"]).await;
    // A second copy of a parked message (a copy parked again, or redelivered by the broker).
    park_by_hand(&env, &config.topology, "inv-bad-1").await;
    wait_for("three parked copies", async || {
        env.depths(&config.topology).await.parking == 3
    })
    .await;

    let report = doctor(&env, &request(&config)).await;
    assert!(failing(&report).is_empty(), "{report:#?}");
    let check = report
        .check("reconciliation.parked_copies")
        .unwrap_or_else(|| panic!("the copies are counted: {report:#?}"));
    assert_eq!(check.severity, Severity::Warn, "{check:?}");
    assert!(
        check.summary.contains("3 copies") && check.summary.contains("account for 2"),
        "both figures named: {check:?}"
    );
    assert!(
        check
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("inv-bad-1") && !d.contains("inv-bad-2")),
        "{check:?}"
    );
    assert!(
        check.hint.as_deref().is_some_and(|h| h.contains("redrive")),
        "{check:?}"
    );
    // The other direction and the other checks are as before.
    assert_eq!(severity(&report, ids::ROW_WITHOUT_COPY), Severity::Pass);
    assert_eq!(severity(&report, ids::PARKED_WITHOUT_ROW), Severity::Pass);
    assert_eq!(
        env.depths(&config.topology).await.parking,
        3,
        "nothing consumed"
    );

    // One copy per parked row: the count passes.
    assert_eq!(env.take_parked(&config.topology, 3).await.len(), 3);
    for id in ["inv-bad-1", "inv-bad-2"] {
        park_by_hand(&env, &config.topology, id).await;
    }
    wait_for("two parked copies", async || {
        env.depths(&config.topology).await.parking == 2
    })
    .await;
    let report = doctor(&env, &request(&config)).await;
    assert_eq!(
        report.severity("reconciliation.parked_copies"),
        Some(Severity::Pass),
        "{report:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_beside_a_doctor_pass_moves_every_parked_copy() {
    const N: u32 = 300;
    let env = TestEnv::new().await;
    let config = env.config(CONSUMER, env.topology("invoices"));
    env.declare(&config).await;
    // N parked rows, each with its copy in the parking lot.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, first_received_at, first_failed_at, \
           last_failed_at, parked_copy_at, last_error_code, payload_sha256) \
         SELECT 'inv-' || i, $1, 'InvoiceIssued', 1, 'PERMANENT_FAILED', 1, \
           now() - interval '1 minute', now() - interval '1 minute', now() - interval '1 minute', \
           now() - interval '1 minute', 'test_permanent', '\\x00' \
         FROM generate_series(1, $2) AS i",
        env.schema
    )))
    .bind(CONSUMER)
    .bind(i32::try_from(N).expect("small"))
    .execute(&env.pool)
    .await
    .expect("parked rows");
    for i in 1..=N {
        park_by_hand(&env, &config.topology, &format!("inv-{i}")).await;
    }
    wait_for("every copy parked", async || {
        env.depths(&config.topology).await.parking == N
    })
    .await;

    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let doctor_pass = {
        let ops = ops.clone();
        let request = request(&config);
        tokio::spawn(async move { ops.doctor(&request).await })
    };
    // The doctor's pass holds copies while it reads them.
    let mut overlapped = false;
    for _ in 0..4000 {
        if env.depths(&config.topology).await.parking < N {
            overlapped = true;
            break;
        }
        if doctor_pass.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(
        overlapped,
        "the redrive starts while the doctor reads the parking lot"
    );
    let lot = rabbit_inbox::broker::ParkingLot::connect(
        &amqp_url(),
        &config.topology.queue,
        &config.topology.parking_queue,
    )
    .await
    .expect("parking lot");
    let actor = inbox_ops::Actor::new("alice", "fix deployed").expect("actor");
    let redrive = ops
        .redrive(
            &lot,
            &inbox_ops::redrive::RedriveRequest::default(),
            Some(&actor),
            &inbox_ops::NoProgress,
        )
        .await
        .expect("redrive");
    lot.close().await;
    let report = doctor_pass.await.expect("the doctor's pass");

    assert_eq!(
        redrive.action(inbox_ops::redrive::ParkedAction::Moved),
        u64::from(N),
        "every parked copy redriven: {redrive:#?}"
    );
    let depths = env.depths(&config.topology).await;
    assert_eq!((depths.parking, depths.work), (0, N));
    // The doctor saw the parking lot whole, before or after the redrive, never half of it.
    assert!(
        failing(&report).is_empty(),
        "{:#?}",
        report
            .checks
            .iter()
            .filter(|c| c.severity == Severity::Fail)
            .collect::<Vec<_>>()
    );
}
