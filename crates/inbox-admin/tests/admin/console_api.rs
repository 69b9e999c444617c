//! The routes behind the console, in process over a real inbox: activity series, alerts (from
//! the ledger and from a Prometheus), a message's timeline with and without the payload scope,
//! the audit trail's filters, discard, bulk jobs with progress, and edit-and-replay; each with
//! its refusals, and each mutating action found in the audit trail.

use axum::{Json, Router, http::StatusCode, routing::get};
use std::sync::Arc;

use inbox_testkit::env::{Latch, OpenOnDrop, Rule, message, wait_for};
use serde_json::{Value, json};

use crate::util::{
    ADMIN_TOKEN, CAPTURE_TYPE, CONSUMER, Fixture, InProcess, NEGATIVE_CODE, OrderHandler,
    PAYLOAD_TOKEN, READ_TOKEN, REFUSED_CODE, tokens,
};

/// Sums `field` over every bucket of `consumer` in an activity report.
fn total(report: &Value, consumer: &str, field: &str) -> u64 {
    crate::util::activity_buckets(report, consumer)
        .map(|b| b[field].as_u64().expect("a count"))
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activity_counts_what_the_ledger_recorded_and_refuses_bad_windows() {
    let fx = Fixture::inbox().await;
    let app = fx.app(tokens());
    let url = format!("/api/v1/activity?consumer={CONSUMER}&window=1h&bucket=1m");
    let (code, _) = app.get(&url, None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    let (code, report) = app.get(&url, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{report}");
    assert_eq!(report["bucket_secs"], 60);
    assert_eq!(total(&report, CONSUMER, "processed"), 3, "{report:#}");
    assert_eq!(total(&report, CONSUMER, "parked"), 2, "{report:#}");
    assert_eq!(total(&report, CONSUMER, "duplicates"), 0, "{report:#}");

    for bad in [
        "window=soon",
        "window=30days",
        "bucket=1s&window=7days",
        "bucket=0s",
    ] {
        let (code, err) = app
            .get(&format!("/api/v1/activity?{bad}"), Some(READ_TOKEN))
            .await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "{bad}: {err}");
        assert!(err["error"].is_string(), "{bad}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_come_from_the_ledger_or_from_prometheus() {
    let fx = Fixture::inbox().await;
    let app = fx.app(tokens());
    let (code, answer) = app.get("/api/v1/alerts", Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    assert_eq!(answer["source"], "ledger");
    let names = |answer: &Value| -> Vec<String> {
        answer["alerts"]
            .as_array()
            .expect("alerts")
            .iter()
            .map(|a| a["name"].as_str().expect("a name").to_owned())
            .collect()
    };
    assert!(
        !names(&answer).contains(&"InboxStaleProcessing".to_owned()),
        "{answer}"
    );

    // A row left PROCESSING for an hour: its consumer died mid-attempt.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".message_inbox (message_id, consumer_name, message_type, message_version, \
           payload_sha256, status, \
           processing_started_at, first_received_at, last_received_at) \
         VALUES ('stuck-1', '{CONSUMER}', 'OrderPlaced', 1, sha256('stuck'::bytea), 'PROCESSING', \
           now() - interval '1 hour', \
           now() - interval '1 hour', now() - interval '1 hour')",
        fx.env.schema
    )))
    .execute(&fx.env.pool)
    .await
    .expect("stale row");
    let (_, answer) = app.get("/api/v1/alerts", Some(READ_TOKEN)).await;
    let stale = answer["alerts"]
        .as_array()
        .expect("alerts")
        .iter()
        .find(|a| a["name"] == "InboxStaleProcessing")
        .unwrap_or_else(|| panic!("no stale alert: {answer:#}"));
    assert_eq!(stale["consumer"], CONSUMER);
    assert_eq!(stale["state"], "firing");

    // With a Prometheus: its alerts named Inbox*, as it reports them; none of the others.
    let prometheus = Router::new().route(
        "/api/v1/alerts",
        get(|| async {
            Json(json!({ "status": "success", "data": { "alerts": [
                { "labels": { "alertname": "InboxParkingLotGrowing", "severity": "warning",
                              "consumer": "orders" },
                  "annotations": { "summary": "parking lot grows" }, "state": "pending" },
                { "labels": { "alertname": "NodeDiskFull" }, "annotations": {},
                  "state": "firing" }
            ]}}))
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let addr = listener.local_addr().expect("address");
    let server = tokio::spawn(async move {
        axum::serve(listener, prometheus).await.expect("serves");
    });
    let mut state = fx.state(tokens(), None);
    state.prometheus_url = Some(format!("http://{addr}/"));
    let with_prometheus = InProcess::new(state, crate::util::LOCAL, &Default::default());
    let (code, answer) = with_prometheus
        .get("/api/v1/alerts", Some(READ_TOKEN))
        .await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    assert_eq!(answer["source"], "prometheus");
    assert_eq!(names(&answer), ["InboxParkingLotGrowing"], "{answer}");
    assert_eq!(answer["alerts"][0]["state"], "pending");
    assert_eq!(answer["alerts"][0]["summary"], "parking lot grows");
    server.abort();

    // Prometheus down: said so, without its address or the client's error text.
    let mut state = fx.state(tokens(), None);
    state.prometheus_url = Some("http://127.0.0.1:1".into());
    let unreachable = InProcess::new(state, crate::util::LOCAL, &Default::default());
    let (code, answer) = unreachable.get("/api/v1/alerts", Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    assert_eq!(answer["alerts"], json!([]));
    let error = answer["error"].as_str().expect("an error");
    assert!(!error.contains("127.0.0.1"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeline_shows_error_texts_only_to_the_payload_scope_and_audits_the_read() {
    let fx = Fixture::inbox().await;
    let app = fx.app(tokens());
    let url = format!("/api/v1/messages/{CONSUMER}/refund-1/timeline");
    let (code, _) = app.get(&url, None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);

    let (code, hidden) = app.get(&url, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{hidden}");
    assert_eq!(hidden["payload_hidden"], true);
    assert_eq!(hidden["status"], "PERMANENT_FAILED");
    let entries = hidden["entries"].as_array().expect("entries");
    let kinds: Vec<&str> = entries
        .iter()
        .map(|e| e["kind"].as_str().expect("a kind"))
        .collect();
    assert_eq!(kinds.first(), Some(&"received"), "{kinds:?}");
    // Refused for good on its first attempt: that attempt is the parking.
    let parked = entries
        .iter()
        .find(|e| e["kind"] == "parked")
        .unwrap_or_else(|| panic!("not parked: {kinds:?}"));
    assert_eq!(parked["error_code"], REFUSED_CODE);
    assert_eq!(parked["attempt"], 1);
    assert!(entries.iter().all(|e| e["error_message"].is_null()));
    assert!(
        fx.audit().await.is_empty(),
        "nothing shown, nothing audited"
    );

    let (code, shown) = app.get(&url, Some(PAYLOAD_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{shown}");
    assert_eq!(shown["payload_hidden"], false);
    assert!(
        shown["entries"]
            .as_array()
            .expect("entries")
            .iter()
            .any(|e| e["error_message"] == "refunds are not supported yet"),
        "{shown:#}"
    );
    let audit = fx.audit().await;
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(
        (audit[0].0.as_str(), audit[0].1.as_str()),
        ("support", "payload_read")
    );
    assert_eq!(audit[0].2.as_deref(), Some("refund-1"));

    let (code, err) = app
        .get(
            &format!("/api/v1/messages/{CONSUMER}/never-seen/timeline"),
            Some(READ_TOKEN),
        )
        .await;
    assert_eq!(code, StatusCode::NOT_FOUND, "{err}");
    assert!(
        err["error"]
            .as_str()
            .is_some_and(|e| e.contains("never-seen")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discard_previews_then_removes_only_the_named_copies_under_audit() {
    let fx = Fixture::inbox().await;
    let app = fx.app(tokens());
    let body = |dry_run: bool| {
        json!({ "consumer": CONSUMER, "message_ids": ["refund-1"], "dry_run": dry_run,
                "reason": "customer refunded by hand", "ticket": "OPS-77" })
    };
    let (code, _) = app
        .post("/api/v1/discard", Some(READ_TOKEN), body(false))
        .await;
    assert_eq!(code, StatusCode::FORBIDDEN);
    let (code, err) = app
        .post(
            "/api/v1/discard",
            Some(ADMIN_TOKEN),
            json!({ "consumer": CONSUMER, "reason": "x", "force": true }),
        )
        .await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{err}");

    let (code, preview) = app
        .post("/api/v1/discard", Some(ADMIN_TOKEN), body(true))
        .await;
    assert_eq!(code, StatusCode::OK, "{preview}");
    assert_eq!(preview["actions"]["would_discard"], 1, "{preview:#}");
    assert_eq!(fx.depths().await.parking, 2, "a preview changes nothing");
    assert!(fx.audit().await.is_empty());

    let (code, done) = app
        .post("/api/v1/discard", Some(ADMIN_TOKEN), body(false))
        .await;
    assert_eq!(code, StatusCode::OK, "{done}");
    assert_eq!(done["actions"]["discarded"], 1, "{done:#}");
    assert_eq!(fx.depths().await.parking, 1);
    let audit = fx.audit().await;
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].0, "alice");
    assert_eq!(audit[0].1, "discard");
    assert_eq!(audit[0].2.as_deref(), Some("refund-1"));
    // The row stays parked, as evidence, and says its copy was discarded.
    let kept = fx
        .env
        .scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE message_id = 'refund-1' \
             AND status = 'PERMANENT_FAILED' AND discarded_at IS NOT NULL",
        )
        .await;
    assert_eq!(kept, 1);

    // The audit trail's filters find it, and only it.
    let (code, trail) = app
        .get("/api/v1/audit?actor=alice&action=discard", Some(READ_TOKEN))
        .await;
    assert_eq!(code, StatusCode::OK, "{trail}");
    assert_eq!(trail.as_array().map(Vec::len), Some(1), "{trail}");
    assert_eq!(trail[0]["ticket"], "OPS-77");
    let (_, none) = app
        .get("/api/v1/audit?action=redrive", Some(READ_TOKEN))
        .await;
    assert_eq!(none, json!([]));
    let (code, _) = app
        .get("/api/v1/audit?since=yesterday-ish", Some(READ_TOKEN))
        .await;
    assert_eq!(code, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_redrive_runs_as_a_job_with_progress_and_an_audited_outcome() {
    let fx = Fixture::inbox().await;
    let app = fx.app(tokens());
    let body = json!({ "action": "redrive", "consumer": CONSUMER, "error_code": REFUSED_CODE,
                       "reason": "refunds are supported now", "ticket": "OPS-9" });
    let (code, _) = app
        .post("/api/v1/jobs", Some(READ_TOKEN), body.clone())
        .await;
    assert_eq!(code, StatusCode::FORBIDDEN);
    let mut preview = body.clone();
    preview["dry_run"] = json!(true);
    let (code, err) = app.post("/api/v1/jobs", Some(ADMIN_TOKEN), preview).await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{err}");
    let (code, err) = app
        .post(
            "/api/v1/jobs",
            Some(ADMIN_TOKEN),
            json!({ "action": "shred", "reason": "x" }),
        )
        .await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{err}");
    assert!(fx.audit().await.is_empty());

    let (code, started) = app.post("/api/v1/jobs", Some(ADMIN_TOKEN), body).await;
    assert_eq!(code, StatusCode::ACCEPTED, "{started}");
    assert_eq!(started["actor"], "alice");
    let job_url = format!("/api/v1/jobs/{}", started["id"].as_str().expect("an id"));
    let mut job = Value::Null;
    wait_for("the job to finish", async || {
        job = app.get(&job_url, Some(ADMIN_TOKEN)).await.1;
        job["state"] != "running"
    })
    .await;
    assert_eq!(job["state"], "done", "{job:#}");
    assert_eq!(job["total"], 2, "{job:#}");
    assert_eq!(job["done"], 2, "{job:#}");
    assert_eq!(job["report"]["actions"]["moved"], 2, "{job:#}");
    assert!(job["finished_at"].is_string());
    let depths = fx.depths().await;
    assert_eq!((depths.parking, depths.work), (0, 2));
    let audit = fx.audit().await;
    assert_eq!(audit.len(), 2, "{audit:?}");
    // Each moved copy's row was reopened under the job's actor before its copy moved.
    assert!(
        audit.iter().all(|a| a.0 == "alice" && a.1 == "reopen"),
        "{audit:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_body_is_previewed_then_replayed_as_a_new_message() {
    let fx = Fixture::inbox().await;
    let app = fx.app(tokens());
    let capture = message(
        Some("capture-7"),
        CAPTURE_TYPE,
        &json!({ "capture": "capture-7", "amount": -1250, "currency": "EUR" }),
    );
    fx.env.publish(&fx.topology, &capture).await;
    let consumer = fx
        .env
        .start(fx.env.config(CONSUMER, fx.topology.clone()), OrderHandler);
    wait_for("the capture parked", async || {
        fx.depths().await.parking == 3
    })
    .await;
    let url = format!("/api/v1/messages/{CONSUMER}/capture-7/replay-edited");
    let edited = r#"{"capture": "capture-7", "amount": 1250, "currency": "EUR"}"#;
    let body = |text: &str, dry_run: bool| {
        json!({ "body": text, "dry_run": dry_run, "reason": "sign flipped by the producer",
                "ticket": "PAY-12" })
    };

    let (code, _) = app
        .post(&url, Some(PAYLOAD_TOKEN), body(edited, true))
        .await;
    assert_eq!(
        code,
        StatusCode::FORBIDDEN,
        "payload readers may not replay"
    );
    for (bad, why) in [
        (
            r#"{"capture": "capture-7", "amount": -1250, "currency": "EUR"}"#,
            "unchanged",
        ),
        (r#"{"amount": 12"#, "not JSON"),
        ("", "empty"),
    ] {
        let (code, err) = app.post(&url, Some(ADMIN_TOKEN), body(bad, true)).await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "{why}: {err}");
    }
    let (code, err) = app
        .post(
            &format!("/api/v1/messages/{CONSUMER}/order-1/replay-edited"),
            Some(ADMIN_TOKEN),
            body(r#"{"order": "order-9"}"#, true),
        )
        .await;
    assert_eq!(code, StatusCode::CONFLICT, "a processed row: {err}");
    assert!(fx.audit().await.is_empty());

    let (code, preview) = app.post(&url, Some(ADMIN_TOKEN), body(edited, true)).await;
    assert_eq!(code, StatusCode::OK, "{preview:#}");
    assert_eq!(preview["published"], false);
    assert_eq!(preview["changed_paths"], json!(["/amount"]));
    let replacement = preview["replacement_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    assert_ne!(replacement, "capture-7");
    assert!(
        preview["diff"]
            .as_array()
            .expect("diff")
            .iter()
            .any(|l| l["op"] == "add" && l["text"].as_str().is_some_and(|t| t.contains("1250"))),
        "{preview:#}"
    );
    let audit = fx.audit().await;
    assert_eq!(audit.len(), 1, "the preview's read of the body: {audit:?}");
    assert_eq!(audit[0].1, "payload_read");
    assert_eq!(fx.depths().await.parking, 3, "a preview changes nothing");

    let (code, done) = app.post(&url, Some(ADMIN_TOKEN), body(edited, false)).await;
    assert_eq!(code, StatusCode::OK, "{done:#}");
    assert_eq!(done["published"], true);
    assert_eq!(
        done["replacement_id"],
        replacement.as_str(),
        "deterministic"
    );
    assert_eq!(done["parked_copy_removed"], true, "{done:#}");
    wait_for("the replacement processed", async || {
        fx.env
            .scalar(&format!(
                "SELECT count(*) FROM {{s}}.message_inbox WHERE message_id = '{replacement}' \
                 AND status = 'PROCESSED'"
            ))
            .await
            == 1
    })
    .await;
    consumer.stop().await;
    assert_eq!(fx.depths().await.parking, 2);
    let original = fx
        .env
        .scalar(&format!(
            "SELECT count(*) FROM {{s}}.message_inbox WHERE message_id = 'capture-7' \
             AND status = 'PROCESSED' AND replaced_by = '{replacement}'"
        ))
        .await;
    assert_eq!(
        original, 1,
        "the original is resolved as replaced, not deleted"
    );
    let fx_audit = fx.audit().await;
    // The replay, then the removal of the original's parked copy, both under alice's name.
    let actions: Vec<(&str, &str)> = fx_audit
        .iter()
        .map(|a| (a.0.as_str(), a.1.as_str()))
        .collect();
    assert_eq!(
        actions,
        [
            ("alice", "payload_read"),
            ("alice", "replay_edited"),
            ("alice", "redrive_drop_processed")
        ]
    );

    // Both rows point at each other in the timelines.
    let (_, timeline) = app
        .get(
            &format!("/api/v1/messages/{CONSUMER}/capture-7/timeline"),
            Some(READ_TOKEN),
        )
        .await;
    assert_eq!(
        timeline["replaced_by"],
        replacement.as_str(),
        "{timeline:#}"
    );
    let kinds: Vec<&str> = timeline["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["kind"].as_str().expect("a kind"))
        .collect();
    assert!(
        kinds.contains(&"parked") && kinds.contains(&"audit"),
        "{kinds:?}"
    );
    assert!(
        timeline["entries"]
            .as_array()
            .expect("entries")
            .iter()
            .any(|e| e["error_code"] == NEGATIVE_CODE),
        "{timeline:#}"
    );
    let (_, timeline) = app
        .get(
            &format!("/api/v1/messages/{CONSUMER}/{replacement}/timeline"),
            Some(READ_TOKEN),
        )
        .await;
    assert_eq!(timeline["replaces"], "capture-7", "{timeline:#}");
    assert!(
        timeline["entries"]
            .as_array()
            .expect("entries")
            .iter()
            .any(|e| e["kind"] == "processed"),
        "{timeline:#}"
    );

    // Once replaced, a second replay is refused.
    let (code, err) = app.post(&url, Some(ADMIN_TOKEN), body(edited, false)).await;
    assert_eq!(code, StatusCode::CONFLICT, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_depths_are_sampled_by_the_server_and_kept_for_the_chart() {
    // Served: the server samples the queues on its own from the start.
    let fx = Fixture::new(None).await;
    let http = reqwest::Client::new();
    // Ten minutes: slots under a second, so no sample of the test is folded into another.
    let url = format!("{}/api/v1/depths?window=10m", fx.base);
    let (code, _) = crate::util::get(&http, &url, None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let asked = chrono::Utc::now();
    let (code, answer) = crate::util::get(&http, &url, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    assert_eq!(answer["queues"]["work"], fx.topology.queue.as_str());
    assert_eq!(
        answer["queues"]["parking"],
        fx.topology.parking_queue.as_str()
    );
    assert_eq!(
        answer["queues"]["retry"],
        json!(
            fx.topology
                .retry_tier_queues(&inbox_testkit::env::test_retry())
        )
    );
    let first = answer["samples"][0].clone();
    let at: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(first["at"].clone()).expect("an instant");
    assert!(
        at < asked,
        "taken before any read, by the server: {answer:#}"
    );
    // Through the management API once the broker has counted the new queues (it refreshes
    // its counts every few seconds; until then the ready counts come through AMQP).
    assert!(first["via"].is_string(), "{answer:#}");
    let newest = |answer: &Value| answer["samples"].as_array().and_then(|s| s.last()).cloned();
    let mut answer = Value::Null;
    wait_for("the two parked refunds counted", async || {
        answer = crate::util::get(&http, &url, Some(READ_TOKEN)).await.1;
        newest(&answer).is_some_and(|s| {
            (
                &s["via"],
                &s["work"],
                &s["work_unacked"],
                &s["retry"],
                &s["parking"],
            ) == (
                &json!("management"),
                &json!(0),
                &json!(0),
                &json!(0),
                &json!(2),
            )
        })
    })
    .await;

    // "Is it stuck?": three orders held by a consumer whose handler does not return are
    // unacked, with one consumer on the queue.
    let latch = Arc::new(Latch::default());
    let _release = OpenOnDrop(latch.clone());
    let (handler, plan) = fx.env.handler();
    for n in 0..3 {
        let id = format!("held-{n}");
        plan.for_id(&id, Rule::Hold(latch.clone()));
        let order = message(Some(&id), "OrderPlaced", &json!({ "order": id }));
        fx.env.publish(&fx.topology, &order).await;
    }
    let consumer = fx
        .env
        .start(fx.env.config(CONSUMER, fx.topology.clone()), handler);
    wait_for("three orders held unacked by one consumer", async || {
        answer = crate::util::get(&http, &url, Some(READ_TOKEN)).await.1;
        newest(&answer).is_some_and(|s| {
            (&s["work"], &s["work_unacked"], &s["work_consumers"])
                == (&json!(0), &json!(3), &json!(1))
        })
    })
    .await;
    let samples = answer["samples"].as_array().expect("samples");
    assert!(samples.len() >= 3, "{answer:#}");
    assert_eq!(samples[0]["at"], first["at"], "the first sample is kept");
    latch.open();
    consumer.stop().await;

    for bad in ["window=25h", "window=0s", "window=soon"] {
        let (code, err) = crate::util::get(
            &http,
            &format!("{}/api/v1/depths?{bad}", fx.base),
            Some(READ_TOKEN),
        )
        .await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "{bad}: {err}");
    }

    // Without the management API: ready counts through AMQP, said so.
    let mut state = fx.state(tokens(), None);
    state.management_url = Some("http://127.0.0.1:1".into());
    let amqp_only = InProcess::new(state, crate::util::LOCAL, &Default::default());
    let (code, answer) = amqp_only.get("/api/v1/depths", Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    let sample = &answer["samples"][0];
    assert_eq!(
        (&sample["via"], &sample["parking"], &sample["work_unacked"]),
        (&json!("amqp"), &json!(2), &Value::Null),
        "{answer:#}"
    );

    // A management API that accepts connections and never answers: the sample falls back to
    // ready counts through AMQP instead of waiting on it.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let silent_addr = silent.local_addr().expect("address");
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let mut state = fx.state(tokens(), None);
    state.management_url = Some(format!("http://{silent_addr}"));
    let hanging = InProcess::new(state, crate::util::LOCAL, &Default::default());
    let (code, answer) = hanging.get("/api/v1/depths", Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    assert_eq!(answer["samples"][0]["via"], "amqp", "{answer:#}");
    assert_eq!(answer["samples"][0]["parking"], 2, "{answer:#}");
    hold.abort();

    // A broker that does not answer at all: a sample without figures (a gap), not an error.
    let mut state = fx.state(tokens(), None);
    state.amqp_url = "amqp://guest:guest@127.0.0.1:1/%2f".into();
    state.management_url = Some("http://127.0.0.1:1".into());
    let unreachable = InProcess::new(state, crate::util::LOCAL, &Default::default());
    let (code, answer) = unreachable.get("/api/v1/depths", Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    let gap = &answer["samples"][0];
    assert!(gap["at"].is_string(), "{answer:#}");
    assert_eq!(
        (&gap["via"], &gap["work"], &gap["parking"]),
        (&Value::Null, &Value::Null, &Value::Null),
        "{answer:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_trail_of_a_job_is_that_jobs_rows_only() {
    let fx = Fixture::inbox().await;
    let app = fx.app(tokens());
    // Two jobs by one token, one after the other: one copy each.
    let mut jobs = Vec::new();
    for id in ["refund-1", "refund-2"] {
        let body = json!({ "action": "redrive", "message_ids": [id],
                           "reason": "refunds are supported now" });
        let (code, started) = app.post("/api/v1/jobs", Some(ADMIN_TOKEN), body).await;
        assert_eq!(code, StatusCode::ACCEPTED, "{started}");
        let job_id = started["id"].as_str().expect("an id").to_owned();
        let mut job = Value::Null;
        wait_for("the job to finish", async || {
            job = app
                .get(&format!("/api/v1/jobs/{job_id}"), Some(ADMIN_TOKEN))
                .await
                .1;
            job["state"] != "running"
        })
        .await;
        assert_eq!(job["report"]["actions"]["moved"], 1, "{job:#}");
        jobs.push((job_id, id, job));
    }
    assert_eq!(fx.audit().await.len(), 2);
    for (job_id, message_id, job) in &jobs {
        // Found by the job's id, with the console's actor and time filters as well.
        for query in [
            format!("job={job_id}"),
            format!(
                "job={job_id}&actor=alice&since={}",
                job["started_at"]
                    .as_str()
                    .expect("a start")
                    .replace('+', "%2B")
            ),
        ] {
            let (code, audit) = app
                .get(&format!("/api/v1/audit?{query}"), Some(READ_TOKEN))
                .await;
            assert_eq!(code, StatusCode::OK, "{audit}");
            let rows = audit.as_array().expect("a list");
            assert_eq!(rows.len(), 1, "{query}: {audit:#}");
            assert_eq!(rows[0]["message_id"], *message_id, "{audit:#}");
            assert_eq!(rows[0]["details"]["job"], job_id.as_str(), "{audit:#}");
        }
    }
}
