//! Edit and replay of a parked message, and the discard of parked copies, against messages a
//! consumer really parked: the replacement gets a deterministic id, reaches the work queue
//! once with the edited body and the original's headers, the original row becomes PROCESSED
//! naming it and loses its parked copy, and the audit trail keeps hashes and paths, never body
//! values; a discard removes exactly the listed copies and keeps their rows as they were.

use inbox_ops::{
    Actor, NoProgress, Operations, OpsError,
    redrive::{DISCARD, DROP_PROCESSED, ParkedAction, RedriveRequest},
    replay::{DiffOp, REPLACES_HEADER, REPLAY_EDITED, ReplayEditedRequest, WorkQueue},
};
use inbox_testkit::env::{Rule, TestEnv, amqp_url, header, message, wait_for};
use rabbit_inbox::{
    ConsumerConfig, InboxStatus, broker::OutgoingMessage, broker::ParkingLot,
    status::parking_headers,
};
use serde_json::{Value, json};
use sqlx::AssertSqlSafe;

const CONSUMER: &str = "invoicer";

fn invoice(id: &str) -> OutgoingMessage {
    let mut m = message(
        Some(id),
        "InvoiceIssued",
        &json!({ "invoice": id, "amount": 42, "currency": "EUR" }),
    );
    m.correlation_id = Some(format!("corr-{id}"));
    m.headers.insert("x-tenant-id".into(), json!("t-7"));
    m
}

fn operator() -> Actor {
    Actor::new("alice", "invoice amounts corrected by finance")
        .expect("valid actor")
        .with_ticket("INC-9")
        .expect("ticket")
}

/// A consumer that parks `broken` and processes `fine`, run until all are settled and
/// stopped: the parking lot then holds one copy per broken message. Returns its config.
async fn parked_inbox(env: &TestEnv, broken: &[&str], fine: &[&str]) -> ConsumerConfig {
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    for id in broken {
        plan.for_id(id, Rule::Permanent);
    }
    let running = env.start(config.clone(), handler);
    for id in broken.iter().chain(fine) {
        env.publish(&topology, &invoice(id)).await;
    }
    for id in fine {
        env.wait_for_record(CONSUMER, id, "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    }
    let parked = u32::try_from(broken.len()).expect("a few");
    wait_for("the broken messages parked", async || {
        env.depths(&topology).await.parking == parked
    })
    .await;
    running.stop().await;
    config
}

/// Every column of the row, to tell that nothing changed.
async fn row_json(env: &TestEnv, id: &str) -> Value {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT to_jsonb(m) FROM \"{}\".message_inbox m \
         WHERE consumer_name = $1 AND message_id = $2",
        env.schema
    )))
    .bind(CONSUMER)
    .bind(id)
    .fetch_one(&env.pool)
    .await
    .expect("row")
}

/// `(action, details)` of every audit row of `id`, oldest first.
async fn audit_rows(env: &TestEnv, id: &str) -> Vec<(String, Value)> {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT action, details FROM \"{}\".inbox_audit WHERE message_id = $1 ORDER BY audit_id",
        env.schema
    )))
    .bind(id)
    .fetch_all(&env.pool)
    .await
    .expect("audit rows")
}

fn edit(id: &str, dry_run: bool, body: &[u8]) -> ReplayEditedRequest {
    ReplayEditedRequest {
        consumer: CONSUMER.into(),
        message_id: id.into(),
        body: body.to_vec(),
        dry_run,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_parked_message_is_replayed_once_under_a_deterministic_id() {
    let env = TestEnv::new().await;
    let config = parked_inbox(&env, &["inv-1", "inv-2"], &[]).await;
    let topology = config.topology.clone();
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let edited = serde_json::to_vec_pretty(&json!({
        "invoice": "inv-1", "amount": 40, "currency": "EUR", "note": "credited-by-finance"
    }))
    .expect("JSON");

    // The preview: the diff, the paths, the id; the same edit written otherwise, the same id.
    let preview = ops
        .replay_edited_preview(&edit("inv-1", true, &edited))
        .await
        .expect("preview");
    assert!(preview.dry_run && !preview.published && !preview.parked_copy_removed);
    assert_eq!(preview.changed_paths, ["/amount", "/note"]);
    assert!(
        preview
            .diff
            .iter()
            .any(|l| l.op == DiffOp::Remove && l.text.contains("42"))
    );
    assert!(
        preview
            .diff
            .iter()
            .any(|l| l.op == DiffOp::Add && l.text.contains("40"))
    );
    assert!(preview.diff.iter().any(|l| l.op == DiffOp::Keep));
    let compact =
        br#"{"note":"credited-by-finance","currency":"EUR","amount":40.0,"invoice":"inv-1"}"#;
    let again = ops
        .replay_edited_preview(&edit("inv-1", true, compact))
        .await
        .expect("preview");
    assert_eq!(again.replacement_id, preview.replacement_id);
    assert_eq!(again.edited_sha256, preview.edited_sha256);
    assert_ne!(preview.original_sha256, preview.edited_sha256);
    uuid_v5(&preview.replacement_id);
    let before = row_json(&env, "inv-1").await;
    // A dry run through the full operation touches nothing either.
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let work = WorkQueue::new(&env.broker, &topology.queue);
    let dry = ops
        .replay_edited(
            &work,
            Some(&lot),
            &edit("inv-1", true, &edited),
            &operator(),
        )
        .await
        .expect("dry run");
    assert_eq!(dry, preview);
    assert_eq!(
        row_json(&env, "inv-1").await,
        before,
        "a dry run changes nothing"
    );
    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.parking), (0, 2));
    assert!(audit_rows(&env, "inv-1").await.is_empty());

    // The real run.
    let done = ops
        .replay_edited(
            &work,
            Some(&lot),
            &edit("inv-1", false, &edited),
            &operator(),
        )
        .await
        .expect("replayed");
    assert_eq!(done.replacement_id, preview.replacement_id);
    assert!(
        !done.dry_run && done.published && done.parked_copy_removed,
        "{done:#?}"
    );
    assert!(done.audit_id.is_some());
    assert_eq!(done.follow_up, None);

    // Exactly one message in the work queue: the edit, under the new id, naming the original,
    // with the original's headers and properties.
    wait_for("the replacement in the work queue", async || {
        env.depths(&topology).await.work == 1
    })
    .await;
    let sent = env
        .take_one(&topology.queue)
        .await
        .expect("the replacement");
    assert_eq!(
        sent.message_id.as_deref(),
        Some(done.replacement_id.as_str())
    );
    assert_eq!(sent.body, edited);
    assert_eq!(header(&sent, REPLACES_HEADER), Some("inv-1"));
    assert_eq!(header(&sent, "x-tenant-id"), Some("t-7"));
    assert_eq!(sent.kind.as_deref(), Some("InvoiceIssued"));
    assert_eq!(sent.correlation_id.as_deref(), Some("corr-inv-1"));
    assert!(
        env.take_one(&topology.queue).await.is_none(),
        "one message only"
    );

    // The original row: PROCESSED, naming its replacement, its evidence kept.
    let row = env.record(CONSUMER, "inv-1").await.expect("row kept");
    assert_eq!(row.status, InboxStatus::Processed);
    let after = row_json(&env, "inv-1").await;
    assert_eq!(after["replaced_by"], json!(done.replacement_id));
    assert!(after["processed_at"].is_string());
    for kept in [
        "payload",
        "payload_sha256",
        "first_received_at",
        "last_error_code",
    ] {
        assert_eq!(after[kept], before[kept], "{kept} kept");
    }
    // Its parked copy is gone; the other one stays.
    assert_eq!(env.depths(&topology).await.parking, 1);
    let left = env.take_parked(&topology, 1).await;
    assert_eq!(header(&left[0], parking_headers::INBOX_KEY), Some("inv-2"));

    // One replay_edited audit row with both hashes and the paths, no body value; then the
    // removal of the parked copy.
    let audit = audit_rows(&env, "inv-1").await;
    let actions: Vec<&str> = audit.iter().map(|(a, _)| a.as_str()).collect();
    assert_eq!(actions, [REPLAY_EDITED, DROP_PROCESSED]);
    let details = &audit[0].1;
    assert_eq!(details["replacement_id"], json!(done.replacement_id));
    assert_eq!(details["original_sha256"], json!(done.original_sha256));
    assert_eq!(details["edited_sha256"], json!(done.edited_sha256));
    assert_eq!(details["changed_paths"], json!(["/amount", "/note"]));
    let text = details.to_string();
    assert!(
        !text.contains("credited-by-finance") && !text.contains("EUR"),
        "{text}"
    );

    // The same edit again: refused, the row is already replaced; nothing more is published.
    let twice = ops
        .replay_edited(
            &work,
            Some(&lot),
            &edit("inv-1", false, &edited),
            &operator(),
        )
        .await;
    assert!(
        matches!(&twice, Err(OpsError::Refused(m)) if m.contains(&done.replacement_id)),
        "{twice:?}"
    );
    assert_eq!(env.depths(&topology).await.work, 0);
    assert_eq!(audit_rows(&env, "inv-1").await.len(), 2);
    lot.close().await;

    // The replacement, published twice (a replay killed before its commit, then run again):
    // the consumer applies the edit once, under the new id; the original's effect never ran.
    let replacement = OutgoingMessage {
        message_id: sent.message_id.clone(),
        kind: sent.kind.clone(),
        correlation_id: sent.correlation_id.clone(),
        headers: sent.headers.clone(),
        body: sent.body.clone(),
    };
    env.publish(&topology, &replacement).await;
    env.publish(&topology, &replacement).await;
    let (handler, _) = env.handler();
    let running = env.start(config, handler);
    env.wait_for_record(CONSUMER, &done.replacement_id, "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    wait_for("both copies settled", async || {
        env.depths(&topology).await.work == 0
    })
    .await;
    running.stop().await;
    assert_eq!(env.effects(&done.replacement_id).await, 1, "applied once");
    assert_eq!(env.effects("inv-1").await, 0);
    let body: String = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT body FROM \"{}\".effects WHERE message_id = $1",
        env.schema
    )))
    .bind(&done.replacement_id)
    .fetch_one(&env.pool)
    .await
    .expect("the effect");
    assert_eq!(body.as_bytes(), edited.as_slice());
}

fn uuid_v5(id: &str) {
    let parts: Vec<&str> = id.split('-').collect();
    assert_eq!(
        parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
        [8, 4, 4, 4, 12],
        "{id}"
    );
    assert!(parts[2].starts_with('5'), "version 5: {id}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_refused_unless_a_parked_row_is_really_edited() {
    let env = TestEnv::new().await;
    let topology = parked_inbox(&env, &["inv-1"], &["inv-done"]).await.topology;
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let work = WorkQueue::new(&env.broker, &topology.queue);
    let actor = operator();
    let edited = br#"{"invoice":"inv-done","amount":1,"currency":"EUR"}"#;
    // (message, edited body, refused (else invalid), what the error says)
    let cases: [(&str, &[u8], bool, &str); 4] = [
        // Processed: nothing to replace.
        ("inv-done", edited, true, "is PROCESSED"),
        // The original as JSON, however written: nothing edited.
        (
            "inv-1",
            b"{ \"currency\": \"EUR\",\n  \"amount\": 42.0, \"invoice\": \"inv-1\" }",
            false,
            "nothing edited",
        ),
        ("inv-1", b"{\"amount\": 40,", false, "not valid JSON"),
        ("inv-nope", edited, false, "no inbox row"),
    ];
    for (id, body, refused, says) in cases {
        for dry_run in [true, false] {
            let result = ops
                .replay_edited(&work, None, &edit(id, dry_run, body), &actor)
                .await;
            let expected = match &result {
                Err(OpsError::Refused(m)) => refused && m.contains(says),
                Err(OpsError::Invalid(m) | OpsError::NotFound(m)) => !refused && m.contains(says),
                _ => false,
            };
            assert!(expected, "{id} {says:?} (dry run {dry_run}): {result:?}");
        }
    }
    // Nothing was published, changed or audited.
    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.parking), (0, 1));
    assert_eq!(
        env.record(CONSUMER, "inv-1").await.map(|r| r.status),
        Some(InboxStatus::PermanentFailed)
    );
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.inbox_audit").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discard_removes_exactly_the_listed_copies_and_keeps_their_rows() {
    let env = TestEnv::new().await;
    let topology = parked_inbox(&env, &["inv-a", "inv-b", "inv-c"], &[])
        .await
        .topology;
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let lot = ParkingLot::connect(&amqp_url(), &topology.queue, &topology.parking_queue)
        .await
        .expect("parking lot");
    let mut rows = Vec::new();
    for id in ["inv-a", "inv-b", "inv-c"] {
        rows.push(row_json(&env, id).await);
    }
    let request = RedriveRequest {
        discard: true,
        message_ids: vec!["inv-a".into(), "inv-b".into()],
        ..RedriveRequest::default()
    };

    // Preview first: what would go, nothing gone.
    let dry = ops
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
    assert_eq!(dry.action(ParkedAction::WouldDiscard), 2, "{dry:#?}");
    assert_eq!(dry.action(ParkedAction::Left), 1, "inv-c is not listed");
    assert_eq!(dry.action(ParkedAction::Discarded), 0);
    assert_eq!(env.depths(&topology).await.parking, 3);
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.inbox_audit").await, 0);

    // A discard is not a redrive: force (or drop_processed) is refused with it.
    let forced = ops
        .redrive(
            &lot,
            &RedriveRequest {
                force: true,
                ..request.clone()
            },
            Some(&operator()),
            &NoProgress,
        )
        .await;
    assert!(matches!(forced, Err(OpsError::Invalid(_))), "{forced:?}");

    let done = ops
        .redrive(&lot, &request, Some(&operator()), &NoProgress)
        .await
        .expect("discard");
    assert_eq!(done.action(ParkedAction::Discarded), 2, "{done:#?}");
    assert_eq!(done.action(ParkedAction::Moved), 0);
    lot.close().await;
    assert_eq!(env.depths(&topology).await.work, 0, "nothing moved");
    let left = env.take_parked(&topology, 1).await;
    assert_eq!(left.len(), 1);
    assert_eq!(header(&left[0], parking_headers::INBOX_KEY), Some("inv-c"));
    // The rows are as they were (parked, with their evidence) but for when their copy was
    // discarded; one audit row per discard.
    for (id, before) in ["inv-a", "inv-b", "inv-c"].iter().zip(&rows) {
        let mut after = row_json(&env, id).await;
        let discarded = after["discarded_at"].take();
        assert_eq!(discarded.is_null(), *id == "inv-c", "{id}: {discarded}");
        assert_eq!(&after, before, "{id} otherwise unchanged");
    }
    for id in ["inv-a", "inv-b"] {
        let audit = audit_rows(&env, id).await;
        assert_eq!(audit.len(), 1, "{id}: {audit:?}");
        assert_eq!(audit[0].0, DISCARD);
        assert_eq!(audit[0].1["status"], json!("PERMANENT_FAILED"));
    }
    assert!(audit_rows(&env, "inv-c").await.is_empty());
}
