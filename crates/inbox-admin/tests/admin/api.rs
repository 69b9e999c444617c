//! The admin API over a real inbox: refusals (no token, wrong token, wrong scope, no reason),
//! reads, audited actions under the token's name, probes and metrics through a listening
//! server; the OpenAPI document naming every route, each route's answer checked against its
//! schema there, and the doctor's report in process.

use std::collections::BTreeSet;

use inbox_admin::Tokens;
use inbox_testkit::env::wait_for;
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};

use crate::{
    response_schema,
    util::{
        ADMIN_TOKEN, CONSUMER, Fixture, InProcess, LOCAL, READ_TOKEN, REFUSED_CODE, REFUSED_TYPE,
        get, post,
    },
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_refuses_the_unauthorized_and_audits_the_authorized() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        metrics::counter!("inbox_admin_test_total").increment(3);
    });
    let fx = Fixture::new(Some(handle)).await;
    let http = Client::new();
    let b = &fx.base;
    let status_url = format!("{b}/api/v1/status");

    // Refused: no token, an unknown token (401 with a Bearer challenge), a read token on an
    // action (403), an admin action without a reason (400).
    let response = http.get(&status_url).send().await.expect("request");
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        response
            .headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok()),
        Some("Bearer")
    );
    let (code, _) = get(&http, &status_url, Some("not-a-configured-token")).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    let redrive = format!("{b}/api/v1/redrive");
    let body = json!({ "dry_run": true, "reason": "check", "consumer": CONSUMER });
    let (code, _) = post(&http, &redrive, None, body.clone()).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    let (code, err) = post(&http, &redrive, Some(READ_TOKEN), body.clone()).await;
    assert_eq!(code, StatusCode::FORBIDDEN, "{err}");
    assert!(err["error"].as_str().is_some_and(|e| e.contains("grafana")));
    let reopen_1 = format!("{b}/api/v1/messages/{CONSUMER}/refund-1/reopen");
    let (code, _) = post(&http, &reopen_1, Some(READ_TOKEN), json!({ "reason": "x" })).await;
    assert_eq!(code, StatusCode::FORBIDDEN);
    let (code, err) = post(
        &http,
        &reopen_1,
        Some(ADMIN_TOKEN),
        json!({ "reason": " " }),
    )
    .await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{err}");
    assert!(fx.audit().await.is_empty(), "nothing refused was audited");
    assert_eq!(fx.depths().await.parking, 2, "nothing refused moved");

    // Reads, with the read token (and the admin token, which may read too).
    let (code, report) = get(&http, &status_url, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{report}");
    let line = |status: &str| {
        report["lines"]
            .as_array()
            .and_then(|l| {
                l.iter()
                    .find(|l| l["consumer"] == CONSUMER && l["status"] == status)
            })
            .cloned()
            .unwrap_or_else(|| panic!("a {status} line in {report}"))
    };
    assert_eq!(line("PERMANENT_FAILED")["rows"], 2);
    assert_eq!(line("PROCESSED")["processed_last_hour"], 3);
    assert_eq!(report["broker"]["parking"]["messages"], 2);
    let (code, _) = get(&http, &status_url, Some(ADMIN_TOKEN)).await;
    assert_eq!(code, StatusCode::OK);

    let (code, groups) = get(&http, &format!("{b}/api/v1/failures"), Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(groups.as_array().map(Vec::len), Some(1), "{groups}");
    assert_eq!(groups[0]["message_type"], REFUSED_TYPE);
    assert_eq!(groups[0]["error_code"], REFUSED_CODE);
    assert_eq!(groups[0]["rows"], 2);

    // A page at a time: two pages of one, then none.
    let list = format!("{b}/api/v1/messages?consumer={CONSUMER}&status=permanent_failed&limit=1");
    let (code, first) = get(&http, &list, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{first}");
    let cursor = first["next_cursor"].as_str().expect("a next page");
    let (_, second) = get(&http, &format!("{list}&cursor={cursor}"), Some(READ_TOKEN)).await;
    let ids: BTreeSet<_> = [&first, &second]
        .iter()
        .map(|p| p["rows"][0]["message_id"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(ids, BTreeSet::from(["refund-1".into(), "refund-2".into()]));
    let (code, err) = get(&http, &format!("{list}&status=NOPE"), Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{err}");

    let show = format!("{b}/api/v1/messages/{CONSUMER}/refund-1");
    let (code, detail) = get(&http, &show, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(detail["rows"][0]["status"], "PERMANENT_FAILED");
    assert_eq!(detail["rows"][0]["location"]["place"], "parking_lot");
    let (code, _) = get(
        &http,
        &format!("{b}/api/v1/messages/{CONSUMER}/nope"),
        Some(READ_TOKEN),
    )
    .await;
    assert_eq!(code, StatusCode::NOT_FOUND);

    // A dry run changes nothing and audits nothing.
    let (code, preview) = post(&http, &redrive, Some(ADMIN_TOKEN), body).await;
    assert_eq!(code, StatusCode::OK, "{preview}");
    assert_eq!(preview["dry_run"], true);
    assert_eq!(preview["classes"]["reopen"], 2, "{preview}");
    assert_eq!(preview["actions"]["would_move"], 2, "{preview}");
    assert!(fx.audit().await.is_empty());
    assert_eq!(fx.depths().await.parking, 2);

    // Actions, audited under the token's name with the reason; the secret is nowhere.
    let (code, reopened) = post(
        &http,
        &reopen_1,
        Some(ADMIN_TOKEN),
        json!({ "reason": "refunds supported since 2.4", "ticket": "INC-7" }),
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{reopened}");
    assert_eq!(reopened["previous_status"], "PERMANENT_FAILED");
    let (code, moved) = post(
        &http,
        &redrive,
        Some(ADMIN_TOKEN),
        json!({ "reason": "refunds supported since 2.4", "consumer": CONSUMER,
                "type": REFUSED_TYPE }),
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{moved}");
    assert_eq!(moved["actions"]["moved"], 2, "{moved}");
    let depths = fx.depths().await;
    assert_eq!((depths.parking, depths.work), (0, 2));
    let audit = fx.audit().await;
    assert!(audit.len() >= 3, "reopen + two moves: {audit:?}");
    for (actor, action, _, reason) in &audit {
        assert_eq!(actor, "alice", "{action}");
        assert_eq!(reason, "refunds supported since 2.4");
    }
    assert!(
        audit
            .iter()
            .any(|(_, action, id, _)| action == "reopen" && id.as_deref() == Some("refund-1"))
    );
    let dump: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT coalesce(string_agg(a::text, ' '), '') FROM \"{}\".inbox_audit a",
        fx.env.schema.as_str()
    )))
    .fetch_one(&fx.env.pool)
    .await
    .expect("audit text");
    assert!(!dump.contains(ADMIN_TOKEN), "the secret is not audited");
    let (_, detail) = get(&http, &show, Some(READ_TOKEN)).await;
    assert!(
        detail["audit"].as_array().is_some_and(|a| a
            .iter()
            .any(|e| e["actor"] == "alice" && e["ticket"] == "INC-7")),
        "{detail}"
    );

    // Recovery and the cleanup preview run too (nothing is lost, nothing expired).
    let (code, recovered) = post(
        &http,
        &format!("{b}/api/v1/recover"),
        Some(ADMIN_TOKEN),
        json!({ "consumer": CONSUMER, "reason": "check", "dry_run": true }),
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{recovered}");
    assert_eq!(recovered["dry_run"], true);
    let (code, cleanup) = post(
        &http,
        &format!("{b}/api/v1/cleanup/dry-run"),
        Some(ADMIN_TOKEN),
        json!({ "consumer": CONSUMER, "reason": "check" }),
    )
    .await;
    assert_eq!(code, StatusCode::OK, "{cleanup}");
    assert_eq!(
        (
            cleanup["dry_run"].clone(),
            cleanup["removed_processed"].clone()
        ),
        (json!(true), json!(0))
    );

    // Probes need no token; metrics need a read token.
    let (code, _) = get(&http, &format!("{b}/healthz"), None).await;
    assert_eq!(code, StatusCode::OK);
    let mut ready = Value::Null;
    wait_for("the first readiness check", async || {
        ready = get(&http, &format!("{b}/readyz"), None).await.1;
        !ready["checked_at"].is_null()
    })
    .await;
    assert_eq!(ready["database"]["ok"], true, "{ready}");
    assert_eq!(ready["insecure_http"], false);
    assert_eq!(ready["broker"]["ok"], true);
    let (code, _) = get(&http, &format!("{b}/metrics"), None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    let text = http
        .get(format!("{b}/metrics"))
        .bearer_auth(READ_TOKEN)
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(text.contains("inbox_admin_test_total 3"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_when_the_broker_is_unreachable_and_open_servers_stay_local() {
    let fx = Fixture::inbox().await;
    let http = Client::new();
    // Without tokens: only loopback, reads open, actions refused.
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0")
        .await
        .expect("port");
    let state = inbox_admin::AdminState {
        ops: inbox_ops::Operations::new(fx.env.pool.clone(), fx.env.schema.clone()),
        amqp_url: "amqp://guest:guest@127.0.0.1:1/%2f".into(),
        management_url: None,
        queues: None,
        tokens: Tokens::none(),
        metrics: None,
        prometheus_url: None,
        replay_window: None,
    };
    let e = inbox_admin::serve(listener, state, Default::default(), std::future::ready(()))
        .await
        .expect_err("a non-loopback address without tokens is refused");
    assert!(e.to_string().contains("without tokens"), "{e}");

    let (open, server) = fx.serve(Tokens::none(), None, "127.0.0.1:0").await;
    let (code, _) = get(&http, &format!("{open}/api/v1/status"), None).await;
    assert_eq!(code, StatusCode::OK);
    let (code, err) = post(
        &http,
        &format!("{open}/api/v1/redrive"),
        None,
        json!({ "reason": "x", "dry_run": true }),
    )
    .await;
    assert_eq!(code, StatusCode::FORBIDDEN, "{err}");
    server.abort();

    // A broker nobody listens for: not ready, and says which check failed.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("port");
    let addr = listener.local_addr().expect("addr");
    let state = inbox_admin::AdminState {
        ops: inbox_ops::Operations::new(fx.env.pool.clone(), fx.env.schema.clone()),
        amqp_url: "amqp://guest:guest@127.0.0.1:1/%2f".into(),
        management_url: None,
        queues: None,
        tokens: Tokens::none(),
        metrics: None,
        prometheus_url: None,
        replay_window: None,
    };
    let server = tokio::spawn(inbox_admin::serve(
        listener,
        state,
        Default::default(),
        std::future::pending(),
    ));
    let (mut code, mut ready) = (StatusCode::OK, Value::Null);
    wait_for("the first readiness check", async || {
        (code, ready) = get(&http, &format!("http://{addr}/readyz"), None).await;
        !ready["checked_at"].is_null()
    })
    .await;
    assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{ready}");
    assert_eq!(ready["database"]["ok"], true);
    assert_eq!(ready["broker"]["ok"], false);
    assert!(ready["broker"]["error"].is_string());
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_describes_every_route() {
    let fx = Fixture::inbox().await;
    let app = fx.app(crate::util::tokens());
    let (code, doc) = app.get("/api/v1/openapi.json", None).await;
    assert_eq!(code, StatusCode::OK);
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in ["get", "post", "put", "delete", "patch"] {
            if item.get(method).is_some() {
                documented.insert(format!("{} {path}", method.to_uppercase()));
            }
        }
    }
    let expected: BTreeSet<String> = [
        "GET /healthz",
        "GET /readyz",
        "GET /metrics",
        "GET /api/v1/status",
        "GET /api/v1/messages",
        "GET /api/v1/messages/{consumer}/{message_id}",
        "GET /api/v1/failures",
        "GET /api/v1/doctor",
        "POST /api/v1/doctor",
        "POST /api/v1/recover",
        "POST /api/v1/redrive",
        "POST /api/v1/messages/{consumer}/{message_id}/reopen",
        "POST /api/v1/cleanup/dry-run",
        "GET /api/v1/activity",
        "GET /api/v1/depths",
        "GET /api/v1/alerts",
        "GET /api/v1/messages/{consumer}/{message_id}/timeline",
        "GET /api/v1/audit",
        "POST /api/v1/discard",
        "POST /api/v1/jobs",
        "GET /api/v1/jobs/{id}",
        "POST /api/v1/messages/{consumer}/{message_id}/replay-edited",
        "GET /api/v1/consumers/{consumer}/blocked-keys",
        "POST /api/v1/consumers/{consumer}/blocked-keys/skip",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(documented, expected);
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
    // Each documented route is served: never the router's 404 or a 405 (an empty action body
    // is 4xx for its missing fields, an unknown job 404 for the job, not for a missing route).
    for route in &documented {
        let (method, path) = route.split_once(' ').expect("method and path");
        let path = path
            .replace("{consumer}", CONSUMER)
            .replace("{message_id}", "refund-1")
            .replace("{id}", "no-such-job");
        let (code, body) = if method == "GET" {
            app.get(&path, Some(ADMIN_TOKEN)).await
        } else {
            app.post(&path, Some(ADMIN_TOKEN), json!({})).await
        };
        assert_ne!(code, StatusCode::METHOD_NOT_ALLOWED, "{route}");
        if code == StatusCode::NOT_FOUND {
            assert_eq!(route, "GET /api/v1/jobs/{id}", "{route}: {body}");
            assert_eq!(body["error"], "no job \"no-such-job\"", "{body}");
        }
    }

    // Every 2xx response has a typed schema, down to each field.
    let untyped = response_schema::untyped_responses(&doc);
    assert!(
        untyped.is_empty(),
        "untyped responses:\n{}",
        untyped.join("\n")
    );

    // Each route answered for real (an action as a dry run where it has one, a bulk job that
    // selects nothing), its answer checked against its schema in the served document: valid,
    // and no field the schema does not declare.
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let app = InProcess::new(
        fx.state(crate::util::tokens(), Some(recorder.handle())),
        LOCAL,
        &Default::default(),
    );
    let mut checked = BTreeSet::new();
    let mut check = async |method: &str, route: &str, path: &str, token: &str, body: Value| {
        let (code, answer) = if method == "GET" {
            app.get(path, Some(token)).await
        } else {
            app.post(path, Some(token), body).await
        };
        assert!(code.is_success(), "{method} {path}: {code} {answer}");
        let faults = response_schema::response_faults(&doc, method, route, code.as_u16(), &answer);
        assert!(
            faults.is_empty(),
            "{method} {path} answered what its schema does not say:\n{}\n{answer:#}",
            faults.join("\n")
        );
        checked.insert(format!("{method} {route}"));
        answer
    };
    let message = "/api/v1/messages/{consumer}/{message_id}";
    let refund = |n: u8, then: &str| format!("/api/v1/messages/{CONSUMER}/refund-{n}{then}");
    let none = Value::Null;
    let shown = check("GET", message, &refund(1, ""), ADMIN_TOKEN, none.clone()).await;
    let original = shown["rows"][0]["payload"]["data"]
        .as_str()
        .expect("a kept body");
    let mut edited: Value = serde_json::from_str(original).expect("a JSON body");
    edited["amount"] = json!(12);
    let dry = |more: Value| {
        let mut body = json!({ "consumer": CONSUMER, "reason": "check", "dry_run": true });
        body.as_object_mut()
            .expect("an object")
            .extend(more.as_object().cloned().unwrap_or_default());
        body
    };
    let preview = check(
        "POST",
        &format!("{message}/replay-edited"),
        &refund(1, "/replay-edited"),
        ADMIN_TOKEN,
        dry(json!({ "body": edited.to_string() })),
    )
    .await;
    assert!(
        !preview["diff"].as_array().is_none_or(Vec::is_empty),
        "{preview}"
    );
    for action in ["/api/v1/redrive", "/api/v1/discard", "/api/v1/recover"] {
        check("POST", action, action, ADMIN_TOKEN, dry(json!({}))).await;
    }
    let cleanup = "/api/v1/cleanup/dry-run";
    check("POST", cleanup, cleanup, ADMIN_TOKEN, dry(json!({}))).await;
    let doctor = "/api/v1/doctor";
    check(
        "POST",
        doctor,
        doctor,
        READ_TOKEN,
        json!({ "consumer": CONSUMER }),
    )
    .await;
    let job = json!({ "action": "redrive", "reason": "check", "consumer": CONSUMER,
                      "type": "NothingOfThisType" });
    let started = check("POST", "/api/v1/jobs", "/api/v1/jobs", ADMIN_TOKEN, job).await;
    let job = format!("/api/v1/jobs/{}", started["id"].as_str().expect("an id"));
    wait_for("the job to finish", async || {
        app.get(&job, Some(ADMIN_TOKEN)).await.1["state"] != "running"
    })
    .await;
    let done = check("GET", "/api/v1/jobs/{id}", &job, ADMIN_TOKEN, none.clone()).await;
    assert_eq!(done["state"], "done", "{done}");
    let reopen = json!({ "reason": "check", "ticket": "INC-9" });
    check(
        "POST",
        &format!("{message}/reopen"),
        &refund(2, "/reopen"),
        ADMIN_TOKEN,
        reopen,
    )
    .await;
    // A blocked key, listed (its head's error text to an admin only) and skipped.
    fx.block_key("customer-7", 10).await;
    let blocked = "/api/v1/consumers/{consumer}/blocked-keys";
    let blocked_path = format!("/api/v1/consumers/{CONSUMER}/blocked-keys");
    for token in [READ_TOKEN, ADMIN_TOKEN] {
        check("GET", blocked, &blocked_path, token, none.clone()).await;
    }
    let skip = json!({ "order_key": "customer-7", "expected_head": "customer-7-head",
                       "reason": "check", "ticket": "INC-9" });
    let skipped = check(
        "POST",
        &format!("{blocked}/skip"),
        &format!("{blocked_path}/skip"),
        ADMIN_TOKEN,
        skip,
    )
    .await;
    assert_eq!(skipped["to_release"], 2, "{skipped}");
    // The reads, after the actions: audit entries and a reopened row to show.
    for (route, path, token) in [
        ("/api/v1/status", "/api/v1/status".to_owned(), READ_TOKEN),
        (
            "/api/v1/messages",
            format!("/api/v1/messages?consumer={CONSUMER}&limit=1"),
            READ_TOKEN,
        ),
        (message, refund(1, ""), READ_TOKEN),
        (message, refund(2, ""), ADMIN_TOKEN),
        (
            "/api/v1/failures",
            "/api/v1/failures".to_owned(),
            ADMIN_TOKEN,
        ),
        (
            "/api/v1/doctor",
            format!("/api/v1/doctor?consumer={CONSUMER}"),
            READ_TOKEN,
        ),
        (
            "/api/v1/activity",
            "/api/v1/activity".to_owned(),
            READ_TOKEN,
        ),
        ("/api/v1/depths", "/api/v1/depths".to_owned(), READ_TOKEN),
        ("/api/v1/alerts", "/api/v1/alerts".to_owned(), READ_TOKEN),
        ("/api/v1/audit", "/api/v1/audit".to_owned(), READ_TOKEN),
    ] {
        check("GET", route, &path, token, none.clone()).await;
    }
    let timeline = format!("{message}/timeline");
    for token in [READ_TOKEN, ADMIN_TOKEN] {
        check(
            "GET",
            &timeline,
            &refund(2, "/timeline"),
            token,
            none.clone(),
        )
        .await;
    }
    // The probes and metrics are text, but for `/readyz`.
    let (code, ready) = app.get("/readyz", None).await;
    let faults = response_schema::response_faults(&doc, "GET", "/readyz", code.as_u16(), &ready);
    assert!(
        faults.is_empty(),
        "/readyz: {}\n{ready:#}",
        faults.join("\n")
    );
    checked.insert("GET /readyz".to_owned());
    for text in ["/healthz", "/metrics"] {
        let (code, _) = app.get(text, Some(READ_TOKEN)).await;
        assert_eq!(code, StatusCode::OK, "{text}");
        let content = &doc["paths"][text]["get"]["responses"]["200"]["content"];
        let (media, body) = content
            .as_object()
            .and_then(|c| c.iter().next())
            .unwrap_or_else(|| panic!("{text}: no content"));
        assert!(media.starts_with("text/plain"), "{text}: {media}");
        assert_eq!(body["schema"]["type"], "string", "{text}: {body}");
        checked.insert(format!("GET {text}"));
    }
    assert_eq!(
        checked, documented,
        "every documented route's answer checked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_checks_the_served_inbox_with_a_read_token() {
    let fx = Fixture::inbox().await;
    let app = fx.app(crate::util::tokens());
    let url = format!("/api/v1/doctor?consumer={CONSUMER}");
    let (code, _) = app.get(&url, None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);

    let (code, report) = app.get(&url, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{report:#}");
    let severity = |id: &str| {
        report["checks"]
            .as_array()
            .and_then(|checks| checks.iter().find(|c| c["id"] == id))
            .map(|c| c["severity"].clone())
            .unwrap_or_else(|| panic!("no check {id}: {report:#}"))
    };
    assert_eq!(report["worst"], "pass", "{report:#}");
    assert_eq!(severity("broker.work_queue"), "pass");
    assert_eq!(severity("reconciliation.row_without_copy"), "pass");
    // The two parked refunds were read and put back.
    assert_eq!(fx.depths().await.parking, 2);

    // A dedup window shorter than the replay window is a failure.
    let (code, report) = app
        .get(&format!("{url}&processed_retention=1day"), Some(READ_TOKEN))
        .await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(report["worst"], "fail", "{report:#}");
    let (code, _) = app
        .get(&format!("{url}&payload_storage=some"), Some(READ_TOKEN))
        .await;
    assert_eq!(code, StatusCode::BAD_REQUEST);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenless_get_of_the_doctor_checks_the_ledger_only_and_post_touches_the_broker() {
    let fx = Fixture::inbox().await;
    let app = fx.app(Tokens::none());
    let ids = |report: &Value| -> Vec<String> {
        report["checks"]
            .as_array()
            .map(|checks| {
                checks
                    .iter()
                    .filter_map(|c| c["id"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    // What a cross-site page can make a browser send: a plain GET, no token.
    let (code, report) = app
        .get(&format!("/api/v1/doctor?consumer={CONSUMER}"), None)
        .await;
    assert_eq!(code, StatusCode::OK, "{report:#}");
    let checked = ids(&report);
    assert!(
        checked.iter().any(|id| id == "schema.migrations"),
        "{report:#}"
    );
    for broker in [
        "broker.work_queue",
        "broker.parking_lot",
        "reconciliation.row_without_copy",
        "reconciliation.parked_without_row",
    ] {
        assert!(
            !checked.iter().any(|id| id == broker),
            "{broker} ran on a tokenless GET: {report:#}"
        );
    }
    let skipped = report["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["id"] == "reconciliation.parking_lot"))
        .cloned()
        .unwrap_or_default();
    assert!(
        skipped["hint"].as_str().is_some_and(|h| h.contains("POST")),
        "says how to run the broker checks: {report:#}"
    );
    // A POST (JSON, which a cross-site form cannot send without the browser asking first)
    // runs every check.
    let (code, report) = app
        .post("/api/v1/doctor", None, json!({ "consumer": CONSUMER }))
        .await;
    assert_eq!(code, StatusCode::OK, "{report:#}");
    let checked = ids(&report);
    for id in [
        "reconciliation.row_without_copy",
        "reconciliation.parked_copies",
    ] {
        assert!(checked.iter().any(|c| c == id), "{id}: {report:#}");
    }
    assert_eq!(fx.depths().await.parking, 2);
}
