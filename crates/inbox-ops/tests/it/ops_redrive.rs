//! Redrive from the parking lot and audited reopen / forced replay, against a small invoicing
//! service: parked messages are moved back and actually processed once the handler is fixed,
//! processed ones are skipped, retention-removed and unknown ones are refused without force, an
//! interrupted redrive is completed by the next run without loss or double effects, and every
//! change leaves an append-only audit row.

// Shared with the other integration tests; not every helper is used here.

use inbox_ops::{
    Actor, NoProgress, Operations, OpsError,
    redrive::{DROP_PROCESSED, DROP_REDRIVEN, ParkedAction, ParkedClass, REDRIVE, RedriveRequest},
    reopen::{FORCED_REPLAY, REOPEN},
};
use inbox_testkit::env::{Rule, TestEnv, amqp_url, message, wait_for};
use rabbit_inbox::{
    InboxStatus, Topology, broker::OutgoingMessage, broker::ParkingLot, status::parking_headers,
};
use serde_json::json;

const CONSUMER: &str = "invoicer";

fn invoice(id: &str) -> OutgoingMessage {
    message(
        Some(id),
        "InvoiceIssued",
        &json!({ "invoice": id, "amount": 42 }),
    )
}

/// A copy in the parking lot as the consumer would have parked it, for a key whose row is
/// not what parked it (a reconciliation finding, a retention-removed row, a foreign copy).
async fn park_by_hand(env: &TestEnv, topology: &Topology, id: &str) {
    park_copy(env, topology, id, invoice(id), "test_permanent").await;
}

/// `message` in the parking lot under the inbox key `id`, parked with `error_code`.
async fn park_copy(
    env: &TestEnv,
    topology: &Topology,
    id: &str,
    mut m: OutgoingMessage,
    error_code: &str,
) {
    for (k, v) in [
        (parking_headers::INBOX_KEY, json!(id)),
        (parking_headers::CONSUMER, json!(CONSUMER)),
        (parking_headers::STATUS, json!("PERMANENT_FAILED")),
        (parking_headers::ERROR_CODE, json!(error_code)),
        (parking_headers::PARKED_AT, json!(1_700_000_000_000i64)),
    ] {
        m.headers.insert(k.into(), v);
    }
    env.broker
        .publish("", &topology.parking_queue, &m)
        .await
        .expect("parked by hand");
}

async fn audit_actions(env: &TestEnv, id: &str) -> Vec<String> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT action FROM \"{}\".inbox_audit WHERE message_id = $1 ORDER BY audit_id",
        env.schema
    )))
    .bind(id)
    .fetch_all(&env.pool)
    .await
    .expect("audit rows")
}

fn operator() -> Actor {
    Actor::new("alice", "fix for invoice rounding deployed")
        .expect("valid actor")
        .with_ticket("INC-7")
        .expect("ticket")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redrive_moves_parked_messages_back_and_they_are_processed() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    let broken = ["inv-1", "inv-2", "inv-3"];
    for id in broken {
        plan.for_id(id, Rule::Permanent);
    }
    let running = env.start(config.clone(), handler);
    for id in broken.iter().chain(&["inv-done"]) {
        env.publish(&topology, &invoice(id)).await;
    }
    env.wait_for_record(CONSUMER, "inv-done", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    // A PROCESSED message's copy in the parking lot, one whose row retention removed (its
    // tombstone kept), and one the inbox never saw.
    park_by_hand(&env, &topology, "inv-done").await;
    park_by_hand(&env, &topology, "inv-removed").await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".inbox_tombstone (message_id, consumer_name, payload_sha256, \
           final_status, message_type, first_received_at, processed_at) \
         VALUES ('inv-removed', $1, '\\x00', 'PROCESSED', 'InvoiceIssued', now() - interval '40 days', \
           now() - interval '40 days')",
        env.schema
    )))
    .bind(CONSUMER)
    .execute(&env.pool)
    .await
    .expect("tombstone");
    park_by_hand(&env, &topology, "inv-stranger").await;
    wait_for("six parked copies", async || {
        env.depths(&topology).await.parking == 6
    })
    .await;

    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");

    // Dry run: every copy classified, nothing moved or audited.
    let dry = ops
        .redrive(
            &lot,
            &RedriveRequest {
                dry_run: true,
                ..RedriveRequest::default()
            },
            None,
            &NoProgress,
        )
        .await
        .expect("dry run");
    assert_eq!((dry.parked_at_start, dry.examined), (6, 6));
    assert_eq!(dry.class(ParkedClass::Reopen), 3);
    assert_eq!(dry.class(ParkedClass::Processed), 1);
    assert_eq!(dry.class(ParkedClass::WouldReapply), 1);
    assert_eq!(dry.class(ParkedClass::Unknown), 1);
    assert_eq!(dry.action(ParkedAction::WouldMove), 3);
    assert_eq!(dry.action(ParkedAction::Refused), 2);
    assert_eq!(
        env.depths(&topology).await.parking,
        6,
        "a dry run moves nothing"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.inbox_audit").await, 0);
    // A filter selects, the rest is left where it is.
    let one = ops
        .redrive(
            &lot,
            &RedriveRequest {
                dry_run: true,
                consumer: Some(CONSUMER.into()),
                error_code: Some("test_permanent".into()),
                limit: Some(2),
                ..RedriveRequest::default()
            },
            None,
            &NoProgress,
        )
        .await
        .expect("dry run");
    assert_eq!(one.action(ParkedAction::WouldMove), 2, "limited to 2");
    // Moving needs an actor.
    assert!(matches!(
        ops.redrive(&lot, &RedriveRequest::default(), None, &NoProgress)
            .await,
        Err(OpsError::Invalid(_))
    ));

    // The fix is deployed; redrive.
    for id in broken {
        plan.clear_id(id);
    }
    let actor = operator();
    let done = ops
        .redrive(
            &lot,
            &RedriveRequest {
                rate_per_sec: Some(50.0),
                ..RedriveRequest::default()
            },
            Some(&actor),
            &NoProgress,
        )
        .await
        .expect("redrive");
    assert_eq!(done.action(ParkedAction::Moved), 3, "{done:#?}");
    assert_eq!(done.action(ParkedAction::Refused), 2);
    assert_eq!(
        done.action(ParkedAction::Left),
        1,
        "the PROCESSED copy stays"
    );
    assert!(
        done.findings
            .iter()
            .any(|f| f.class == ParkedClass::WouldReapply
                && f.message_id.as_deref() == Some("inv-removed"))
    );
    for id in broken {
        // Not merely moved: processed, once, by the consumer that was running all along.
        env.wait_for_record(CONSUMER, id, "processed after redrive", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
        assert_eq!(env.effects(id).await, 1, "{id} applied once");
        assert_eq!(audit_actions(&env, id).await, [REOPEN]);
    }
    assert_eq!(env.effects("inv-removed").await, 0, "refused without force");
    assert_eq!(env.effects("inv-done").await, 1);
    assert_eq!(env.depths(&topology).await.parking, 3);
    let reason: (String, String, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT actor, reason, ticket FROM \"{}\".inbox_audit WHERE message_id = 'inv-1'",
        env.schema
    )))
    .fetch_one(&env.pool)
    .await
    .expect("audit row");
    assert_eq!(
        reason,
        (
            "alice".into(),
            "fix for invoice rounding deployed".into(),
            Some("INC-7".into())
        )
    );

    // Forced: the retention-removed one and the unknown one are replayed, audited.
    let forced = ops
        .redrive(
            &lot,
            &RedriveRequest {
                force: true,
                ..RedriveRequest::default()
            },
            Some(&actor),
            &NoProgress,
        )
        .await
        .expect("forced redrive");
    assert_eq!(forced.action(ParkedAction::Moved), 2);
    assert_eq!(forced.action(ParkedAction::Left), 1);
    for id in ["inv-removed", "inv-stranger"] {
        env.wait_for_record(CONSUMER, id, "processed after forced redrive", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
        assert_eq!(env.effects(id).await, 1);
        assert_eq!(audit_actions(&env, id).await, [FORCED_REPLAY]);
    }
    // The PROCESSED copy goes only when asked, audited; its effect is not applied again.
    let dropped = ops
        .redrive(
            &lot,
            &RedriveRequest {
                drop_processed: true,
                ..RedriveRequest::default()
            },
            Some(&actor),
            &NoProgress,
        )
        .await
        .expect("drop processed");
    assert_eq!(dropped.action(ParkedAction::Removed), 1);
    assert_eq!(env.depths(&topology).await.parking, 0);
    assert_eq!(audit_actions(&env, "inv-done").await, [DROP_PROCESSED]);
    assert_eq!(env.effects("inv-done").await, 1);
    running.stop().await;
    lot.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_redrive_is_completed_by_the_next_run_without_loss_or_double_effects() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    let ids: Vec<String> = (0..6).map(|i| format!("inv-{i}")).collect();
    for id in &ids {
        plan.for_id(id, Rule::Permanent);
    }
    let running = env.start(config.clone(), handler.clone());
    for id in &ids {
        env.publish(&topology, &invoice(id)).await;
    }
    wait_for("six parked", async || {
        env.depths(&topology).await.parking == 6
    })
    .await;
    running.stop().await;
    for id in &ids {
        plan.clear_id(id);
    }
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let actor = operator();

    // A redrive that died after committing the reopen and publishing, before the ack: the
    // parked copy returns when its connection goes.
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let first = lot.next().await.expect("get").expect("a parked copy");
    let first_id = first.inbox_key().expect("inbox key").to_owned();
    ops.reopen(&first_id, CONSUMER, &actor, false)
        .await
        .expect("reopen");
    lot.republish(&first).await.expect("republished");
    // One that died after publishing, before its transaction committed: row still parked.
    let second = lot.next().await.expect("get").expect("a parked copy");
    let second_id = second.inbox_key().expect("inbox key").to_owned();
    lot.republish(&second).await.expect("republished");
    drop((first, second));
    lot.close().await; // killed: nothing acked
    wait_for("both copies back in the parking lot", async || {
        let d = env.depths(&topology).await;
        d.parking == 6 && d.work == 2
    })
    .await;

    // The next run finishes the job.
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let report = ops
        .redrive(&lot, &RedriveRequest::default(), Some(&actor), &NoProgress)
        .await
        .expect("redrive");
    assert_eq!(report.class(ParkedClass::Resume), 1, "{report:#?}");
    assert_eq!(report.class(ParkedClass::Reopen), 5);
    assert_eq!(report.action(ParkedAction::Moved), 6);
    assert_eq!(env.depths(&topology).await.parking, 0);
    lot.close().await;

    let running = env.start(config.clone(), handler);
    for id in &ids {
        env.wait_for_record(CONSUMER, id, "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    }
    wait_for("work queue drained", async || {
        let d = env.depths(&topology).await;
        d.work == 0 && d.retry == 0
    })
    .await;
    let stats = running.stop().await;
    for id in &ids {
        assert_eq!(env.effects(id).await, 1, "{id} applied exactly once");
    }
    assert_eq!(
        stats.duplicates, 2,
        "the two extra copies were dropped as duplicates"
    );
    let d = env.depths(&topology).await;
    assert_eq!(
        (d.work, d.retry, d.parking),
        (0, 0, 0),
        "nothing left anywhere"
    );
    assert_eq!(audit_actions(&env, &first_id).await, [REOPEN, REDRIVE]);
    assert_eq!(audit_actions(&env, &second_id).await, [REOPEN]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopen_and_forced_replay_are_audited_and_refused_without_force() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("inv-poison", Rule::Retryable);
    let running = env.start(config.clone(), handler);
    env.publish(&topology, &invoice("inv-paid")).await;
    env.publish(&topology, &invoice("inv-poison")).await;
    env.wait_for_record(CONSUMER, "inv-poison", "poisoned", |r| {
        r.status == InboxStatus::Poisoned
    })
    .await;
    env.wait_for_record(CONSUMER, "inv-paid", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let actor = operator();

    // PROCESSED: refused unless forced.
    assert!(matches!(
        ops.reopen("inv-paid", CONSUMER, &actor, false).await,
        Err(OpsError::Refused(_))
    ));
    assert!(audit_actions(&env, "inv-paid").await.is_empty());
    let replay = ops
        .reopen("inv-paid", CONSUMER, &actor, true)
        .await
        .expect("forced replay");
    assert_eq!(replay.action, FORCED_REPLAY);
    assert_eq!(replay.previous_status, InboxStatus::Processed);
    let row = env.record(CONSUMER, "inv-paid").await.expect("row kept");
    assert_eq!(
        (row.status, row.processing_attempt),
        (InboxStatus::RetryableFailed, 0)
    );
    // The next delivery applies the effect again: that is what was forced.
    env.publish(&topology, &invoice("inv-paid")).await;
    wait_for("replayed effect", async || {
        env.effects("inv-paid").await == 2
    })
    .await;

    // A poisoned row: reopened with a fresh budget, processed on its next delivery.
    plan.clear_id("inv-poison");
    let reopened = ops
        .reopen("inv-poison", CONSUMER, &actor, false)
        .await
        .expect("reopen");
    assert_eq!(
        (
            reopened.action,
            reopened.previous_status,
            reopened.previous_attempts
        ),
        (REOPEN, InboxStatus::Poisoned, 5)
    );
    env.publish(&topology, &invoice("inv-poison")).await;
    env.wait_for_record(CONSUMER, "inv-poison", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    assert_eq!(env.effects("inv-poison").await, 1);
    running.stop().await;

    // Removed by retention: refused, and the tombstone is named.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".inbox_tombstone (message_id, consumer_name, payload_sha256, \
           final_status, message_type, first_received_at) \
         VALUES ('inv-gone', $1, '\\x00', 'PROCESSED', 'InvoiceIssued', now())",
        env.schema
    )))
    .bind(CONSUMER)
    .execute(&env.pool)
    .await
    .expect("tombstone");
    match ops.reopen("inv-gone", CONSUMER, &actor, true).await {
        Err(OpsError::Refused(why)) => assert!(why.contains("retention"), "{why}"),
        other => panic!("refused: {other:?}"),
    }
    assert!(matches!(
        ops.reopen("inv-never", CONSUMER, &actor, false).await,
        Err(OpsError::NotFound(_))
    ));
    // A row recovery set aside for review is reopened like a parked one.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, payload_sha256) \
         VALUES ('inv-review', $1, 'InvoiceIssued', 1, 'MANUAL_REVIEW', 3, '\\x00')",
        env.schema
    )))
    .bind(CONSUMER)
    .execute(&env.pool)
    .await
    .expect("row in review");
    let reviewed = ops
        .reopen("inv-review", CONSUMER, &actor, false)
        .await
        .expect("reopen after review");
    assert_eq!(
        (reviewed.action, reviewed.previous_status),
        (REOPEN, InboxStatus::ManualReview)
    );

    // The audit trail names everything and cannot be rewritten.
    assert_eq!(audit_actions(&env, "inv-paid").await, [FORCED_REPLAY]);
    assert_eq!(audit_actions(&env, "inv-poison").await, [REOPEN]);
    let shown = ops
        .show(&inbox_ops::inspect::ShowQuery {
            message_id: "inv-poison".into(),
            consumer: None,
            topology: None,
        })
        .await
        .expect("show");
    assert_eq!(shown.audit.len(), 1);
    assert_eq!(shown.audit[0].details["previous_status"], "POISONED");
    assert_eq!(shown.audit[0].ticket.as_deref(), Some("INC-7"));
    // Stamped by the database: the session's role, whatever the writer says.
    let session: String = sqlx::query_scalar("SELECT session_user::text")
        .fetch_one(&env.pool)
        .await
        .expect("session user");
    assert_eq!(shown.audit[0].db_role.as_deref(), Some(session.as_str()));
    let s = env.schema.as_str();
    for tamper in [
        format!("UPDATE \"{s}\".inbox_audit SET reason = 'nothing happened'"),
        format!("DELETE FROM \"{s}\".inbox_audit"),
        format!("TRUNCATE \"{s}\".inbox_audit"),
    ] {
        let err = sqlx::query(sqlx::AssertSqlSafe(tamper.clone()))
            .execute(&env.pool)
            .await
            .expect_err("audit rows are append-only");
        assert!(err.to_string().contains("append-only"), "{tamper}: {err}");
    }
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.inbox_audit").await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redriven_copy_is_the_producers_message_without_reason_headers() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("inv-ttl", Rule::Permanent);
    let running = env.start(config.clone(), handler);
    let mut m = invoice("inv-ttl");
    m.headers.insert("x-tenant-id".into(), json!("acme"));
    env.broker
        .publish_batch_expiring("", &[(&topology.queue, &m, Some("600000"))])
        .await
        .expect("published with a TTL");
    wait_for("parked", async || env.depths(&topology).await.parking == 1).await;
    running.stop().await;

    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let report = ops
        .redrive(
            &lot,
            &RedriveRequest::default(),
            Some(&operator()),
            &NoProgress,
        )
        .await
        .expect("redrive");
    assert_eq!(report.action(ParkedAction::Moved), 1);
    lot.close().await;
    let moved = env
        .take_one(&topology.queue)
        .await
        .expect("the message is in the work queue");
    assert_eq!(moved.body, m.body);
    assert_eq!(moved.message_id.as_deref(), Some("inv-ttl"));
    assert_eq!(
        inbox_testkit::env::header(&moved, "x-tenant-id"),
        Some("acme")
    );
    for gone in [
        parking_headers::STATUS,
        parking_headers::ERROR_CODE,
        parking_headers::ERROR,
        parking_headers::CONSUMER,
        parking_headers::INBOX_KEY,
        parking_headers::PARKED_AT,
        // Back in the `expiration` property.
        parking_headers::ORIGINAL_EXPIRATION,
    ] {
        assert!(
            !moved.headers.contains_key(gone),
            "{gone} in {:?}",
            moved.headers
        );
    }
    assert_eq!(
        inbox_testkit::env::header(&moved, parking_headers::ORIGINAL_ROUTING_KEY),
        Some(topology.queue.as_str()),
        "where it first arrived is kept"
    );
    assert_eq!(env.depths(&topology).await.parking, 0);
}

/// The audit record a redrive writes when it moves a copy of `id` (a reopen `via: redrive`):
/// with a PROCESSED row and the copy still parked, the state a redrive killed after the confirm
/// and before the ack leaves once the moved copy is processed.
async fn audit_redrive_reopen(env: &TestEnv, id: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".inbox_audit (actor, action, consumer_name, message_id, reason, details) \
         VALUES ('alice', $1, $2, $3, 'fix deployed', $4)",
        env.schema
    )))
    .bind(REOPEN)
    .bind(CONSUMER)
    .bind(id)
    .bind(json!({ "previous_status": "POISONED", "via": REDRIVE }))
    .execute(&env.pool)
    .await
    .expect("audit row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_left_over_by_a_killed_redrive_is_removed_by_the_next_run() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let running = env.start(config.clone(), handler);
    for id in ["inv-redriven", "inv-done"] {
        env.publish(&topology, &invoice(id)).await;
        env.wait_for_record(CONSUMER, id, "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    }
    running.stop().await;
    // inv-redriven: moved by a redrive that was killed before acking its parked copy; the
    // moved copy was processed. Beside it, a payload conflict of the same key (another body).
    audit_redrive_reopen(&env, "inv-redriven").await;
    park_by_hand(&env, &topology, "inv-redriven").await;
    let mut other_body = invoice("inv-redriven");
    other_body.body =
        serde_json::to_vec(&json!({ "invoice": "inv-redriven", "amount": 43 })).expect("json");
    park_copy(
        &env,
        &topology,
        "inv-redriven",
        other_body,
        rabbit_inbox::status::PAYLOAD_CONFLICT,
    )
    .await;
    // inv-done: PROCESSED, its copy parked, no redrive in its history: a finding, left.
    park_by_hand(&env, &topology, "inv-done").await;
    wait_for("three parked copies", async || {
        env.depths(&topology).await.parking == 3
    })
    .await;

    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let rerun = ops
        .redrive(
            &lot,
            &RedriveRequest::default(),
            Some(&operator()),
            &NoProgress,
        )
        .await
        .expect("redrive");
    lot.close().await;
    assert_eq!(rerun.classes.get("redriven"), Some(&1), "{rerun:#?}");
    assert_eq!(rerun.class(ParkedClass::Processed), 2, "{rerun:#?}");
    assert_eq!(rerun.action(ParkedAction::Removed), 1, "{rerun:#?}");
    assert_eq!(rerun.action(ParkedAction::Left), 2, "{rerun:#?}");
    assert_eq!(rerun.action(ParkedAction::Moved), 0, "{rerun:#?}");
    assert_eq!(env.depths(&topology).await.parking, 2);
    assert_eq!(
        audit_actions(&env, "inv-redriven").await,
        [REOPEN, DROP_REDRIVEN]
    );
    assert!(audit_actions(&env, "inv-done").await.is_empty());
    let left = env.take_parked(&topology, 2).await;
    let mut left: Vec<_> = left
        .iter()
        .map(|m| {
            (
                inbox_testkit::env::header(m, parking_headers::INBOX_KEY).map(str::to_owned),
                inbox_testkit::env::header(m, parking_headers::ERROR_CODE).map(str::to_owned),
            )
        })
        .collect();
    left.sort();
    assert_eq!(
        left,
        [
            (Some("inv-done".into()), Some("test_permanent".into())),
            (
                Some("inv-redriven".into()),
                Some(rabbit_inbox::status::PAYLOAD_CONFLICT.into())
            ),
        ],
        "the finding and the payload conflict stay"
    );
    for id in ["inv-redriven", "inv-done"] {
        assert_eq!(env.effects(id).await, 1, "{id} applied once");
    }
}

/// Counts by name.
type Counts = Vec<(String, u64)>;

/// A report's counts per class and per action, a dry run's `would_` actions named as the real
/// run's.
fn as_run(report: &inbox_ops::redrive::RedriveReport) -> (Counts, Counts) {
    let classes = report
        .classes
        .iter()
        .map(|(k, v)| ((*k).to_owned(), *v))
        .collect();
    let mut actions: Vec<(String, u64)> = report
        .actions
        .iter()
        .map(|(k, v)| {
            let k = match *k {
                "would_move" => "moved",
                "would_remove" => "removed",
                k => k,
            };
            (k.to_owned(), *v)
        })
        .collect();
    actions.sort();
    (classes, actions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_reports_what_the_run_then_does_with_and_without_drop_processed() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    for id in ["inv-1", "inv-2"] {
        plan.for_id(id, Rule::Permanent);
    }
    let running = env.start(config.clone(), handler);
    for id in ["inv-1", "inv-2", "inv-done", "inv-redriven"] {
        env.publish(&topology, &invoice(id)).await;
    }
    for id in ["inv-done", "inv-redriven"] {
        env.wait_for_record(CONSUMER, id, "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    }
    wait_for("two parked", async || {
        env.depths(&topology).await.parking == 2
    })
    .await;
    running.stop().await;
    park_by_hand(&env, &topology, "inv-done").await;
    audit_redrive_reopen(&env, "inv-redriven").await;
    park_by_hand(&env, &topology, "inv-redriven").await;
    park_by_hand(&env, &topology, "inv-stranger").await;
    wait_for("five parked", async || {
        env.depths(&topology).await.parking == 5
    })
    .await;

    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let actor = operator();
    let mut runs = Vec::new();
    for drop_processed in [false, true] {
        let request = RedriveRequest {
            drop_processed,
            ..RedriveRequest::default()
        };
        let preview = ops
            .redrive(
                &lot,
                &RedriveRequest {
                    dry_run: true,
                    ..request.clone()
                },
                None,
                &NoProgress,
            )
            .await
            .expect("dry run");
        let run = ops
            .redrive(&lot, &request, Some(&actor), &NoProgress)
            .await
            .expect("redrive");
        assert_eq!(
            as_run(&preview),
            as_run(&run),
            "drop_processed {drop_processed}: the preview {preview:#?} against the run {run:#?}"
        );
        runs.push(run);
    }
    lot.close().await;
    // Without --drop-processed: two moved, the leftover removed, the PROCESSED finding left,
    // the stranger refused; then the finding is removed as asked.
    let counts = |r: &inbox_ops::redrive::RedriveReport| {
        [
            ParkedAction::Moved,
            ParkedAction::Removed,
            ParkedAction::Left,
            ParkedAction::Refused,
        ]
        .map(|a| r.action(a))
    };
    assert_eq!(counts(&runs[0]), [2, 1, 1, 1], "{:#?}", runs[0]);
    assert_eq!(counts(&runs[1]), [0, 1, 0, 1], "{:#?}", runs[1]);
    assert_eq!(audit_actions(&env, "inv-done").await, [DROP_PROCESSED]);
    assert_eq!(env.depths(&topology).await.parking, 1, "the stranger stays");
}

/// Kills a redrive at `step` of its first move and closes its connection, as a killed process
/// would leave things; returns the key of the message it was moving.
#[cfg(feature = "fault-injection")]
async fn kill_redrive_at(
    ops: &Operations,
    topology: &Topology,
    step: inbox_ops::fault::RedriveStep,
) -> String {
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let faults = ops.redrive_faults();
    faults.kill_at(step);
    let (actor, request) = (operator(), RedriveRequest::default());
    let killed = tokio::select! {
        done = ops.redrive(&lot, &request, Some(&actor), &NoProgress) => {
            panic!("the redrive was not killed at {step:?}: {done:?}")
        }
        killed = faults.killed() => killed.expect("the key of the message being moved"),
    };
    lot.close().await;
    killed
}

#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_killed_at_each_step_loses_nothing_and_its_rerun_finishes_the_job() {
    use inbox_ops::fault::RedriveStep;

    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("inv-1", Rule::Permanent);
    let running = env.start(config.clone(), handler.clone());
    env.publish(&topology, &invoice("inv-1")).await;
    wait_for("parked", async || env.depths(&topology).await.parking == 1).await;
    running.stop().await;
    plan.clear_id("inv-1");
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let state = async || {
        let row = env.record(CONSUMER, "inv-1").await.expect("row");
        let d = env.depths(&topology).await;
        (row.status, d.work, audit_actions(&env, "inv-1").await)
    };
    let parked_again = async || {
        wait_for("the parked copy back in the parking lot", async || {
            env.depths(&topology).await.parking == 1
        })
        .await;
    };

    // Killed before the commit: nothing changed.
    let killed = kill_redrive_at(&ops, &topology, RedriveStep::BeforeCommit).await;
    assert_eq!(killed, "inv-1");
    parked_again().await;
    assert_eq!(
        state().await,
        (InboxStatus::PermanentFailed, 0, Vec::<String>::new())
    );
    // Killed after the commit, before the publish: the row is open and its only copy is the
    // parked one, back in the parking lot.
    kill_redrive_at(&ops, &topology, RedriveStep::AfterCommit).await;
    parked_again().await;
    assert_eq!(
        state().await,
        (InboxStatus::RetryableFailed, 0, vec![REOPEN.to_owned()])
    );
    // Killed after the confirm, before the ack (the rerun resumes the open row): the copy in
    // the work queue already finds its row open; the parked copy comes back too.
    kill_redrive_at(&ops, &topology, RedriveStep::AfterConfirm).await;
    parked_again().await;
    assert_eq!(
        state().await,
        (
            InboxStatus::RetryableFailed,
            1,
            vec![REOPEN.to_owned(), REDRIVE.to_owned()]
        )
    );

    // The consumer processes the moved copy; the rerun removes the parked one, audited.
    let running = env.start(config.clone(), handler);
    env.wait_for_record(CONSUMER, "inv-1", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let rerun = ops
        .redrive(
            &lot,
            &RedriveRequest::default(),
            Some(&operator()),
            &NoProgress,
        )
        .await
        .expect("rerun");
    lot.close().await;
    assert_eq!(rerun.class(ParkedClass::Redriven), 1, "{rerun:#?}");
    assert_eq!(rerun.action(ParkedAction::Removed), 1, "{rerun:#?}");
    let stats = running.stop().await;
    let d = env.depths(&topology).await;
    assert_eq!(
        (d.work, d.retry, d.parking),
        (0, 0, 0),
        "nothing left anywhere"
    );
    assert_eq!(env.effects("inv-1").await, 1, "applied exactly once");
    assert_eq!(stats.parked, 0, "the moved copy never met a parked row");
    assert_eq!(
        audit_actions(&env, "inv-1").await,
        [REOPEN, REDRIVE, DROP_REDRIVEN]
    );
}
