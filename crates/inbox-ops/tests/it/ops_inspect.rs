//! Inspection (`status`, `list`, `show`, failure groups) on an inbox populated by a real
//! consumer of a small invoicing service: processed, duplicated, permanently failed, poisoned
//! and invalid messages, plus a stuck PROCESSING row and a tombstone of a removed row.

// Shared with the other integration tests; not every helper is used here.

use inbox_ops::{
    Operations,
    inspect::{ListFilter, Payload, ShowQuery, StatusQuery},
};
use inbox_testkit::env::{Rule, TestEnv, amqp_url, message, wait_for};
use rabbit_inbox::{
    InboxStatus, broker::OutgoingMessage, broker::ParkingLot, envelope::AGGREGATE_ID_HEADER,
    envelope::AGGREGATE_TYPE_HEADER, envelope::TENANT_HEADER,
};
use serde_json::json;

const CONSUMER: &str = "invoicer";

fn invoice(id: &str, customer: &str, tenant: &str) -> OutgoingMessage {
    let mut m = message(
        Some(id),
        "InvoiceIssued",
        &json!({ "invoice": id, "customer": customer }),
    );
    m.headers
        .insert(AGGREGATE_TYPE_HEADER.into(), json!("customer"));
    m.headers
        .insert(AGGREGATE_ID_HEADER.into(), json!(customer));
    m.headers.insert(TENANT_HEADER.into(), json!(tenant));
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspection_reports_a_populated_inbox() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("inv-bad-1", Rule::Permanent);
    plan.for_id("inv-bad-2", Rule::Permanent);
    plan.for_id("inv-flaky", Rule::Retryable);

    for i in 0..5 {
        env.publish(&topology, &invoice(&format!("inv-ok-{i}"), "c-1", "acme"))
            .await;
    }
    env.publish(&topology, &invoice("inv-ok-0", "c-1", "acme"))
        .await; // duplicate
    env.publish(&topology, &invoice("inv-bad-1", "c-2", "acme"))
        .await;
    env.publish(&topology, &invoice("inv-bad-2", "c-2", "globex"))
        .await;
    env.publish(&topology, &invoice("inv-flaky", "c-3", "acme"))
        .await;
    let mut not_json = invoice("inv-garbled", "c-4", "acme");
    not_json.body = b"\xff not json".to_vec();
    env.publish(&topology, &not_json).await;

    let running = env.start(config.clone(), handler);
    wait_for("four parked messages", async || {
        env.depths(&topology).await.parking == 4
    })
    .await;
    env.wait_for_record(CONSUMER, "inv-ok-0", "duplicate counted", |r| {
        r.delivery_count == 2
    })
    .await;
    running.stop().await;

    // A row a crashed custom loop left in PROCESSING an hour ago, and a tombstone.
    let s = env.schema.as_str();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, processing_started_at, \
           first_received_at, payload_sha256) \
         VALUES ('inv-stuck', $1, 'InvoiceIssued', 1, 'PROCESSING', 1, now() - interval '1 hour', \
           now() - interval '1 hour', '\\x00')"
    )))
    .bind(CONSUMER)
    .execute(&env.pool)
    .await
    .expect("stuck row");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{s}\".inbox_tombstone (message_id, consumer_name, payload_sha256, \
           final_status, message_type, first_received_at, processed_at) \
         VALUES ('inv-old', $1, '\\xabcd', 'PROCESSED', 'InvoiceIssued', now() - interval '40 days', \
           now() - interval '40 days')"
    )))
    .bind(CONSUMER)
    .execute(&env.pool)
    .await
    .expect("tombstone");

    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");

    // status
    let report = ops
        .status(
            &StatusQuery {
                consumer: Some(CONSUMER.into()),
                stale_after: std::time::Duration::from_secs(300),
                retry_delays: config.retry.delays.clone(),
                count_processed: true,
            },
            Some(&lot),
        )
        .await
        .expect("status");
    let line = |status| {
        report
            .lines
            .iter()
            .find(|l| l.status == status)
            .unwrap_or_else(|| panic!("a {status} line in {:#?}", report.lines))
    };
    let processed = line(InboxStatus::Processed);
    assert_eq!(processed.rows, Some(5));
    assert_eq!(processed.processed_last_hour, Some(5));
    assert_eq!(processed.duplicates_last_hour, 1, "inv-ok-0 came twice");
    let permanent = line(InboxStatus::PermanentFailed);
    assert_eq!(permanent.rows, Some(3), "two refused, one not JSON");
    assert_eq!(permanent.failed_last_hour, 3);
    // Parked moments ago, by this test.
    assert!(
        permanent
            .oldest_age_secs
            .is_some_and(|a| (0.0..600.0).contains(&a)),
        "{permanent:?}"
    );
    let poisoned = line(InboxStatus::Poisoned);
    assert_eq!(poisoned.rows, Some(1));
    let stuck = line(InboxStatus::Processing);
    assert_eq!((stuck.rows, stuck.stale), (Some(1), 1));
    assert!(stuck.oldest_age_secs.is_some_and(|a| a >= 3500.0));
    let broker = report.broker.as_ref().expect("broker depths");
    assert_eq!(broker.parking.messages, Some(4));
    assert_eq!(broker.work.messages, Some(0));
    // Without counting, PROCESSED rows are only the last hour's.
    let cheap = ops
        .status(&StatusQuery::default(), None)
        .await
        .expect("status");
    let processed = cheap
        .lines
        .iter()
        .find(|l| l.status == InboxStatus::Processed)
        .expect("processed line");
    assert_eq!(
        (processed.rows, processed.processed_last_hour),
        (None, Some(5))
    );
    assert!(cheap.broker.is_none());

    // list: open rows by default, paged through the cursor without gaps or repeats.
    let mut seen = Vec::new();
    let mut filter = ListFilter {
        consumer: Some(CONSUMER.into()),
        limit: 2,
        ..ListFilter::default()
    };
    loop {
        let page = ops.list(&filter).await.expect("list");
        assert!(page.rows.len() <= 2);
        seen.extend(page.rows.iter().map(|r| r.message_id.clone()));
        match page.next_cursor {
            Some(c) => filter.cursor = Some(c),
            None => break,
        }
    }
    let mut expected = vec![
        "inv-bad-1".to_owned(),
        "inv-bad-2".into(),
        "inv-flaky".into(),
        "inv-stuck".into(),
        "inv-garbled".into(),
    ];
    expected.sort();
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "every open row once");
    assert_eq!(seen[0], "inv-stuck", "oldest first");

    let ids = async |f: ListFilter| -> Vec<String> {
        let mut ids: Vec<String> = ops
            .list(&f)
            .await
            .expect("list")
            .rows
            .into_iter()
            .map(|r| r.message_id)
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(
        ids(ListFilter {
            error_code: Some("test_permanent".into()),
            ..ListFilter::default()
        })
        .await,
        ["inv-bad-1", "inv-bad-2"]
    );
    assert_eq!(
        ids(ListFilter {
            tenant: Some("globex".into()),
            ..ListFilter::default()
        })
        .await,
        ["inv-bad-2"]
    );
    assert_eq!(
        ids(ListFilter {
            aggregate_type: Some("customer".into()),
            aggregate_id: Some("c-3".into()),
            ..ListFilter::default()
        })
        .await,
        ["inv-flaky"]
    );
    assert_eq!(
        ids(ListFilter {
            statuses: vec![InboxStatus::Processed],
            aggregate_id: Some("c-1".into()),
            since: Some(chrono::Utc::now() - chrono::Duration::minutes(10)),
            ..ListFilter::default()
        })
        .await
        .len(),
        5
    );
    assert!(
        ids(ListFilter {
            until: Some(chrono::Utc::now() - chrono::Duration::minutes(10)),
            ..ListFilter::default()
        })
        .await
            == ["inv-stuck"]
    );
    assert!(
        ops.list(&ListFilter {
            cursor: Some("garbage".into()),
            ..ListFilter::default()
        })
        .await
        .is_err()
    );

    // show
    let topo = Some((topology.clone(), config.retry.clone()));
    let shown = ops
        .show(&ShowQuery {
            message_id: "inv-bad-1".into(),
            consumer: None,
            topology: topo.clone(),
        })
        .await
        .expect("show");
    assert_eq!(shown.rows.len(), 1);
    let row = &shown.rows[0];
    assert_eq!(row.status, InboxStatus::PermanentFailed);
    assert_eq!(row.location.place, "parking_lot");
    assert_eq!(
        row.location.queue.as_deref(),
        Some(topology.parking_queue.as_str())
    );
    assert_eq!(row.tenant_id.as_deref(), Some("acme"));
    match &row.payload {
        Some(Payload::Utf8(text)) => assert!(text.contains("inv-bad-1"), "{text}"),
        other => panic!("the failed message's body is kept: {other:?}"),
    }
    let ok = ops
        .show(&ShowQuery {
            message_id: "inv-ok-1".into(),
            consumer: Some(CONSUMER.into()),
            topology: topo.clone(),
        })
        .await
        .expect("show");
    assert_eq!(ok.rows[0].location.place, "acked");
    assert_eq!(
        ok.rows[0].payload, None,
        "processed bodies are not kept by default"
    );
    let garbled_row = ops
        .show(&ShowQuery {
            message_id: "inv-garbled".into(),
            consumer: None,
            topology: None,
        })
        .await
        .expect("show");
    assert!(
        matches!(&garbled_row.rows[0].payload, Some(Payload::Base64(_))),
        "a body that is not UTF-8 is shown as base64"
    );
    let old = ops
        .show(&ShowQuery {
            message_id: "inv-old".into(),
            consumer: None,
            topology: None,
        })
        .await
        .expect("show");
    assert!(old.rows.is_empty());
    assert_eq!(old.tombstones.len(), 1);
    assert_eq!(old.tombstones[0].payload_sha256, "abcd");

    // failure groups
    let groups = ops.failure_groups(Some(CONSUMER)).await.expect("groups");
    let refused = groups
        .iter()
        .find(|g| g.error_code.as_deref() == Some("test_permanent"))
        .expect("group of refused invoices");
    assert_eq!(
        (refused.rows, refused.status),
        (2, InboxStatus::PermanentFailed)
    );
    assert_eq!(refused.message_type, "InvoiceIssued");
    assert!(refused.sample_message_id.starts_with("inv-bad-"));
    assert_eq!(groups[0].rows, 2, "largest group first");
    let flaky = groups
        .iter()
        .find(|g| g.status == InboxStatus::Poisoned)
        .expect("poisoned group");
    assert_eq!(flaky.error_code.as_deref(), Some("test_retryable"));
    assert_eq!(groups.iter().map(|g| g.rows).sum::<i64>(), 4);
    lot.close().await;
}

#[tokio::test]
async fn stale_and_overdue_follow_leases_and_retry_delays() {
    let env = TestEnv::new().await;
    let s = env.schema.as_str();
    // (id, status, started/failed this long ago, lease expiring in this long)
    let rows: [(&str, &str, &str, Option<&str>); 5] = [
        // A crashed custom loop's claim, unleased: stale and overdue for an hour.
        ("stuck", "PROCESSING", "1 hour", None),
        // Long leased work whose worker still heartbeats: neither stale nor overdue.
        ("heartbeating", "PROCESSING", "2 hours", Some("1 hour")),
        // A lease that expired a minute after a recent claim: stale at once.
        ("lease-lost", "PROCESSING", "2 minutes", Some("-1 minute")),
        // A retry still inside its delay (1 hour below): not overdue.
        ("waiting", "RETRYABLE_FAILED", "10 minutes", None),
        // A retry whose delay passed 30 minutes ago: its copy never came back.
        ("overdue", "RETRYABLE_FAILED", "90 minutes", None),
    ];
    for (id, status, ago, lease) in rows {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO \"{s}\".message_inbox (message_id, consumer_name, message_type, \
               message_version, status, processing_attempt, processing_started_at, \
               last_failed_at, lease_owner, lease_expires_at, fencing_token, \
               first_received_at, payload_sha256) \
             VALUES ($1, $2, 'InvoiceIssued', 1, $3, 1, now() - $4::interval, \
               CASE WHEN $3 = 'RETRYABLE_FAILED' THEN now() - $4::interval END, \
               CASE WHEN $5::interval IS NOT NULL THEN 'worker-1' END, now() + $5::interval, \
               CASE WHEN $5::interval IS NOT NULL THEN 1 END, \
               now() - $4::interval, '\\x00')"
        )))
        .bind(id)
        .bind(CONSUMER)
        .bind(status)
        .bind(ago)
        .bind(lease)
        .execute(&env.pool)
        .await
        .expect("row inserted");
    }
    let hour = std::time::Duration::from_secs(3600);
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let shown = ops
        .show(&ShowQuery {
            message_id: "heartbeating".into(),
            consumer: None,
            topology: None,
        })
        .await
        .expect("show");
    let row = &shown.rows[0];
    assert_eq!(
        (row.lease_owner.as_deref(), row.fencing_token),
        (Some("worker-1"), Some(1))
    );
    assert!(row.lease_expires_at.is_some_and(|t| t > chrono::Utc::now()));
    let report = ops
        .status(
            &StatusQuery {
                consumer: Some(CONSUMER.into()),
                stale_after: std::time::Duration::from_secs(300),
                retry_delays: vec![hour],
                count_processed: false,
            },
            None,
        )
        .await
        .expect("status");
    let line = |status| {
        report
            .lines
            .iter()
            .find(|l| l.status == status)
            .unwrap_or_else(|| panic!("a {status} line in {:#?}", report.lines))
    };
    let processing = line(InboxStatus::Processing);
    assert_eq!(
        (processing.rows, processing.stale),
        (Some(3), 2),
        "{processing:?}"
    );
    assert!(
        processing
            .overdue_age_secs
            .is_some_and(|a| (3500.0..3700.0).contains(&a)),
        "the unleased claim of an hour ago, not the heartbeating one of two: {processing:?}"
    );
    let retrying = line(InboxStatus::RetryableFailed);
    assert_eq!((retrying.rows, retrying.stale), (Some(2), 0));
    assert!(
        retrying
            .overdue_age_secs
            .is_some_and(|a| (1700.0..1900.0).contains(&a)),
        "90 minutes since the failure, less the hour's delay: {retrying:?}"
    );

    // The sampler's gauges mean the same.
    let mut conn = env.pool.acquire().await.expect("connection");
    let sample = env
        .store
        .sample_open_rows(
            &mut conn,
            CONSUMER,
            std::time::Duration::from_secs(300),
            &rabbit_inbox::RetryPolicy::tiered(vec![hour]),
        )
        .await
        .expect("sample");
    assert_eq!(sample.stale_processing, 2, "{sample:?}");
    assert!(
        (3500.0..3700.0).contains(&sample.oldest_unprocessed_age),
        "{sample:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_duplicate_deliveries_not_retries() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    // Retried once, then processed: two deliveries, two attempts, no duplicate.
    plan.for_id("inv-retried", Rule::FailAttempts(1));
    // Retried until poisoned: every delivery an attempt.
    plan.for_id("inv-poisoned", Rule::Retryable);
    let running = env.start(config.clone(), handler);
    for id in ["inv-retried", "inv-poisoned", "inv-twice"] {
        env.publish(&topology, &invoice(id, "c-1", "acme")).await;
    }
    env.wait_for_record(CONSUMER, "inv-twice", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    // The same message again: a duplicate delivery.
    env.publish(&topology, &invoice("inv-twice", "c-1", "acme"))
        .await;
    env.wait_for_record(CONSUMER, "inv-twice", "duplicate noted", |r| {
        r.delivery_count == 2
    })
    .await;
    env.wait_for_record(CONSUMER, "inv-retried", "processed on its retry", |r| {
        r.status == InboxStatus::Processed && r.delivery_count == 2
    })
    .await;
    env.wait_for_record(CONSUMER, "inv-poisoned", "poisoned", |r| {
        r.status == InboxStatus::Poisoned
    })
    .await;
    running.stop().await;

    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let report = ops
        .status(
            &StatusQuery {
                consumer: Some(CONSUMER.into()),
                retry_delays: config.retry.delays.clone(),
                ..StatusQuery::default()
            },
            None,
        )
        .await
        .expect("status");
    let line = |status| {
        report
            .lines
            .iter()
            .find(|l| l.status == status)
            .unwrap_or_else(|| panic!("a {status} line in {:#?}", report.lines))
    };
    assert_eq!(
        line(InboxStatus::Processed).duplicates_last_hour,
        1,
        "inv-twice came twice; inv-retried's second delivery was its retry: {:#?}",
        report.lines
    );
    assert_eq!(
        line(InboxStatus::Poisoned).duplicates_last_hour,
        0,
        "each delivery of inv-poisoned was an attempt"
    );
}
