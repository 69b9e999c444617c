//! Probes of an admin server exposed to a network, over a real inbox (PostgreSQL and
//! RabbitMQ). On a listening server: HTTPS verified against its own certificate and refused by
//! clients that do not trust it, clear text refused off loopback, readiness without a broker
//! connection per request, slow and surplus connections. In process, where the listener plays
//! no part: the Host check (DNS rebinding), the payload scope and its audit, bounded and
//! validated input answered in JSON, no database error text in responses, throttled failed
//! authentications, and the security headers.

use std::{
    net::SocketAddr,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{body::Body, http::header};
use inbox_admin::{ServeOptions, TlsFiles, Tokens};
use inbox_testkit::env::wait_for;
use reqwest::{Client, StatusCode};
use serde_json::{Value, json};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use crate::util::{
    self, ADMIN_TOKEN, CONSUMER, Fixture, InProcess, PAYLOAD_TOKEN, READ_TOKEN, TempDir, get,
};

/// Sends `request` as written (a browser after DNS rebinding sends what it likes in `Host`)
/// and returns the status code and body of the answer.
async fn raw(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("request sent");
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("the server answers and closes")
        .expect("read");
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let code = answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("an HTTP answer: {answer:?}"));
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

fn get_request(path: &str, host: &str, token: Option<&str>) -> String {
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n")
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA named `name` (`name.pem`, `name.key`) in `dir`.
fn ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
        ],
    );
}

/// A server certificate for `localhost` only, signed by `ca`: `server.pem`, `server.key`.
fn server_cert(dir: &Path, ca: &str) -> TlsFiles {
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n\
         keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .expect("extensions file");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "server.ext",
            "-out",
            "server.pem",
        ],
    );
    TlsFiles {
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
    }
}

fn trusting(dir: &Path, ca: &str, localhost: SocketAddr) -> Client {
    let pem = std::fs::read(dir.join(format!("{ca}.pem"))).expect("CA file");
    Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(&pem).expect("CA certificate")])
        .resolve("localhost", localhost)
        .build()
        .expect("client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_is_verified_against_its_certificate_and_clear_text_is_refused_off_loopback() {
    let fx = Fixture::inbox().await;
    let dir = TempDir::new("inbox-admin-tls");
    ca(&dir.0, "ca");
    ca(&dir.0, "other-ca");
    let files = server_cert(&dir.0, "ca");
    let options = ServeOptions {
        tls: Some(files.clone()),
        ..ServeOptions::default()
    };
    let (addr, server) = fx
        .serve_with(util::tokens(), None, "127.0.0.1:0", options)
        .await;
    let port = addr.port();

    // A client that trusts the CA reaches it by the name in the certificate.
    let verified = trusting(&dir.0, "ca", addr);
    let response = verified
        .get(format!("https://localhost:{port}/api/v1/status"))
        .bearer_auth(READ_TOKEN)
        .send()
        .await
        .expect("a verified TLS connection");
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response
            .headers()
            .get("strict-transport-security")
            .is_some(),
        "HSTS over TLS"
    );

    // Refused: another CA, a name the certificate does not hold, clear text on the TLS port.
    let e = trusting(&dir.0, "other-ca", addr)
        .get(format!("https://localhost:{port}/healthz"))
        .send()
        .await
        .expect_err("a certificate from an untrusted CA is refused");
    assert!(e.is_connect(), "{e:?}");
    let e = verified
        .get(format!("https://127.0.0.1:{port}/healthz"))
        .send()
        .await
        .expect_err("a certificate for another name is refused");
    assert!(e.is_connect(), "{e:?}");
    assert!(
        Client::new()
            .get(format!("http://127.0.0.1:{port}/healthz"))
            .send()
            .await
            .is_err(),
        "no clear-text answer on the TLS port"
    );
    server.abort();

    // Off loopback: clear text is refused unless explicitly allowed, and then reported.
    let listener = TcpListener::bind("0.0.0.0:0").await.expect("port");
    let e = inbox_admin::serve(
        listener,
        fx.state(util::tokens(), None),
        ServeOptions {
            allowed_hosts: vec!["admin.test".into()],
            ..ServeOptions::default()
        },
        std::future::ready(()),
    )
    .await
    .expect_err("0.0.0.0 without TLS is refused");
    assert!(e.to_string().contains("clear-text"), "{e}");
    let listener = TcpListener::bind("0.0.0.0:0").await.expect("port");
    let e = inbox_admin::serve(
        listener,
        fx.state(util::tokens(), None),
        ServeOptions {
            tls: Some(files),
            ..ServeOptions::default()
        },
        std::future::ready(()),
    )
    .await
    .expect_err("0.0.0.0 names no host: allowed hosts are required");
    assert!(e.to_string().contains("--allowed-host"), "{e}");
    let options = ServeOptions {
        insecure_http: true,
        allowed_hosts: vec!["admin.test".into()],
        ..ServeOptions::default()
    };
    let (addr, server) = fx
        .serve_with(util::tokens(), None, "0.0.0.0:0", options)
        .await;
    let local = SocketAddr::from(([127, 0, 0, 1], addr.port()));
    let mut ready = Value::Null;
    wait_for("the first readiness check", async || {
        let (_, body) = raw(local, &get_request("/readyz", "admin.test", None)).await;
        ready = serde_json::from_str(&body).unwrap_or(Value::Null);
        !ready["checked_at"].is_null()
    })
    .await;
    assert_eq!(ready["insecure_http"], true, "{ready}");
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_for_another_host_are_refused_with_and_without_tokens() {
    let fx = Fixture::inbox().await;
    let with_tokens = fx.app(util::tokens());
    let open = fx.app(Tokens::none());
    for (app, token) in [(&with_tokens, Some(READ_TOKEN)), (&open, None)] {
        let addr = app.addr;
        for path in ["/api/v1/messages", "/api/v1/status", "/"] {
            let (code, body) = app.get_for_host(path, "rebind.evil.example", token).await;
            assert_eq!(code, 421, "{path}: {body}");
            assert!(!body.contains("refund-"), "{body}");
            let (code, _) = app
                .get_for_host(path, &format!("rebind.evil.example:{}", addr.port()), token)
                .await;
            assert_eq!(code, 421, "{path}");
            for host in [format!("localhost:{}", addr.port()), addr.to_string()] {
                let (code, body) = app.get_for_host(path, &host, token).await;
                assert_eq!(code, 200, "{path} for {host}: {body}");
            }
        }
        // An absolute URI names the host too.
        let absolute = app
            .request("GET", "http://rebind.evil.example/api/v1/status", None)
            .body(Body::empty())
            .expect("a request");
        assert_eq!(app.send(absolute).await.status().as_u16(), 421);
    }
    // A name the operator allowed (a proxy in front) is answered.
    let options = ServeOptions {
        allowed_hosts: vec!["admin.example.com".into()],
        ..ServeOptions::default()
    };
    let allowed = InProcess::new(fx.state(util::tokens(), None), util::LOCAL, &options);
    let (code, _) = allowed
        .get_for_host("/api/v1/status", "admin.example.com", Some(READ_TOKEN))
        .await;
    assert_eq!(code, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_need_the_payload_scope_and_each_read_is_audited() {
    let fx = Fixture::inbox().await;
    let app = fx.app(util::tokens());
    let show = format!("/api/v1/messages/{CONSUMER}/refund-1");
    let failures = "/api/v1/failures";
    let payload_reads = async || {
        fx.audit()
            .await
            .into_iter()
            .filter(|(_, action, _, _)| action == "payload_read")
            .map(|(actor, _, id, _)| (actor, id.unwrap_or_default()))
            .collect::<Vec<_>>()
    };

    // A read token sees the metadata, not the contents; nothing is audited.
    let (code, detail) = app.get(&show, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{detail}");
    let row = &detail["rows"][0];
    assert_eq!(detail["payload_hidden"], true);
    assert_eq!(row["status"], "PERMANENT_FAILED");
    assert_eq!(row["last_error_code"], util::REFUSED_CODE);
    assert!(
        row["payload"].is_null() && row["headers"].is_null(),
        "{row}"
    );
    assert!(row["last_error_message"].is_null(), "{row}");
    assert!(
        !detail.to_string().contains("not supported yet"),
        "{detail}"
    );
    let (_, groups) = app.get(failures, Some(READ_TOKEN)).await;
    assert!(groups[0]["sample_error"].is_null(), "{groups}");
    assert!(payload_reads().await.is_empty());

    // read:payload sees them, audited under the token's name before they are returned.
    let (code, detail) = app.get(&show, Some(PAYLOAD_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{detail}");
    let row = &detail["rows"][0];
    assert_eq!(detail["payload_hidden"], false);
    assert!(
        row["payload"]["data"]
            .as_str()
            .is_some_and(|d| d.contains("refund-1")),
        "{row}"
    );
    assert!(row["last_error_message"].is_string(), "{row}");
    let (_, groups) = app.get(failures, Some(PAYLOAD_TOKEN)).await;
    assert!(groups[0]["sample_error"].is_string(), "{groups}");
    assert_eq!(
        payload_reads().await,
        vec![("support".to_owned(), "refund-1".to_owned())]
    );
    // It is still no admin token.
    let (code, _) = app
        .post(
            "/api/v1/redrive",
            Some(PAYLOAD_TOKEN),
            json!({ "reason": "x", "dry_run": true }),
        )
        .await;
    assert_eq!(code, StatusCode::FORBIDDEN);

    // admin implies read:payload, audited the same way.
    let (_, detail) = app.get(&show, Some(ADMIN_TOKEN)).await;
    assert_eq!(detail["payload_hidden"], false);
    assert_eq!(payload_reads().await.len(), 2);
    assert_eq!(payload_reads().await[1].0, "alice");

    // Without tokens (loopback only) there is no name to audit: contents stay hidden.
    let open = fx.app(Tokens::none());
    let (code, detail) = open.get(&show, None).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(detail["payload_hidden"], true);
    assert!(detail["rows"][0]["payload"].is_null());
    assert_eq!(payload_reads().await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_opens_no_broker_connection_per_request() {
    let fx = Fixture::inbox().await;
    // A "broker" that counts the connections it gets and drops them.
    let broker = TcpListener::bind("127.0.0.1:0").await.expect("port");
    let broker_addr = broker.local_addr().expect("addr");
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    let counter = tokio::spawn(async move {
        while let Ok((stream, _)) = broker.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            drop(stream);
        }
    });
    let mut state = fx.state(Tokens::none(), None);
    state.amqp_url = format!("amqp://guest:guest@{broker_addr}/%2f");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("port");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(inbox_admin::serve(
        listener,
        state,
        ServeOptions::default(),
        std::future::pending(),
    ));
    let http = Client::new();
    for _ in 0..200 {
        let (code, ready) = get(&http, &format!("http://{addr}/readyz"), None).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{ready}");
    }
    let opened = connections.load(Ordering::SeqCst);
    assert!(
        opened <= 2,
        "200 readiness probes opened {opened} broker connections"
    );
    server.abort();
    counter.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_are_closed_and_connections_are_bounded() {
    let fx = Fixture::inbox().await;
    let options = ServeOptions {
        header_read_timeout: Duration::from_secs(1),
        max_connections: 8,
        ..ServeOptions::default()
    };
    let (addr, server) = fx
        .serve_with(util::tokens(), None, "127.0.0.1:0", options)
        .await;
    let started = tokio::time::Instant::now();
    let mut slow = Vec::new();
    for _ in 0..12 {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\n").as_bytes())
            .await
            .expect("half a request");
        slow.push(stream);
    }
    for stream in &mut slow {
        let mut rest = Vec::new();
        let read =
            tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await;
        assert!(
            read.is_ok(),
            "a half-sent request was still open after {:?}",
            started.elapsed()
        );
    }
    // The slots are free again.
    let (code, _) = raw(addr, &get_request("/healthz", &addr.to_string(), None)).await;
    assert_eq!(code, 200);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_are_bounded_validated_and_answered_in_json() {
    let fx = Fixture::inbox().await;
    let app = fx.app(util::tokens());
    let reopen = format!("/api/v1/messages/{CONSUMER}/refund-1/reopen");
    let redrive = "/api/v1/redrive";
    let bad = |code: StatusCode, body: &Value, what: &str| {
        assert_eq!(code, StatusCode::BAD_REQUEST, "{what}: {body}");
        assert!(
            body["error"].is_string(),
            "{what}: a JSON error, got {body}"
        );
    };

    let (code, body) = app
        .post(
            &reopen,
            Some(ADMIN_TOKEN),
            json!({ "reason": "r".repeat(1001) }),
        )
        .await;
    bad(code, &body, "a 1,001-character reason");
    assert!(body["error"].as_str().is_some_and(|e| e.contains("reason")));
    let (code, body) = app
        .post(
            &reopen,
            Some(ADMIN_TOKEN),
            json!({ "reason": "fixed", "ticket": "t".repeat(201) }),
        )
        .await;
    bad(code, &body, "a 201-character ticket");
    let (code, body) = app
        .post(&reopen, Some(ADMIN_TOKEN), json!({ "ticket": "INC-1" }))
        .await;
    bad(code, &body, "no reason");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("reason")),
        "{body}"
    );
    for (rate, limit) in [
        (json!(1e-300), json!(null)),
        (json!(0), json!(null)),
        (json!(1e300), json!(null)),
        (json!(1), json!(0)),
    ] {
        let (code, body) = app
            .post(
                redrive,
                Some(ADMIN_TOKEN),
                json!({ "reason": "r", "dry_run": true, "rate_per_sec": rate, "limit": limit }),
            )
            .await;
        bad(code, &body, &format!("rate {rate}, limit {limit}"));
    }
    for limit in [json!(0), json!(1_000_000_000_000u64), json!(-1)] {
        let (code, body) = app
            .post(
                "/api/v1/recover",
                Some(ADMIN_TOKEN),
                json!({ "consumer": CONSUMER, "reason": "r", "dry_run": true, "limit": limit }),
            )
            .await;
        bad(code, &body, &format!("recover limit {limit}"));
    }
    let (code, body) = app
        .post(
            "/api/v1/cleanup/dry-run",
            Some(ADMIN_TOKEN),
            json!({ "consumer": CONSUMER, "reason": "r", "processed_retention": "1000000years" }),
        )
        .await;
    bad(code, &body, "a million years of retention");
    let request = app
        .request("POST", &reopen, Some(ADMIN_TOKEN))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from("{\"reason\": "))
        .expect("a request");
    let (code, body) = util::json_of(app.send(request).await).await;
    bad(code, &body, "broken JSON");
    let request = app
        .request("POST", &reopen, Some(ADMIN_TOKEN))
        .body(Body::from("reason=fixed"))
        .expect("a request");
    let (code, body) = util::json_of(app.send(request).await).await;
    bad(code, &body, "not JSON");
    for query in ["limit=abc", "limit=0", "count_processed=maybe"] {
        let path = if query.starts_with("count") {
            "status"
        } else {
            "messages"
        };
        let (code, body) = app
            .get(&format!("/api/v1/{path}?{query}"), Some(READ_TOKEN))
            .await;
        bad(code, &body, query);
    }
    let (code, body) = app.get("/api/v1/nothing-here", Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::NOT_FOUND);
    assert!(body["error"].is_string(), "{body}");

    // Nothing refused was written, and the server still answers.
    assert!(fx.audit().await.is_empty(), "{:?}", fx.audit().await);
    assert_eq!(app.get("/healthz", None).await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_errors_are_logged_under_a_request_id_not_returned() {
    let fx = Fixture::inbox().await;
    // A database that refuses the server's role: PostgreSQL's error names the role.
    let role = format!("{}_nobody", fx.env.schema.as_str());
    let refused = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy_with(
            inbox_testkit::database_url()
                .parse::<sqlx::postgres::PgConnectOptions>()
                .expect("DATABASE_URL")
                .username(&role),
        );
    let mut state = fx.state(util::tokens(), None);
    state.ops = inbox_ops::Operations::new(refused, fx.env.schema.clone());
    let app = InProcess::new(state, util::LOCAL, &ServeOptions::default());
    for path in ["status", "messages", "failures"] {
        let request = app
            .request("GET", &format!("/api/v1/{path}"), Some(READ_TOKEN))
            .body(Body::empty())
            .expect("a request");
        let response = app.send(request).await;
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE, "{path}");
        let id = response
            .headers()
            .get(inbox_admin::REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .expect("a request id");
        let body: Value = serde_json::from_str(&util::text_of(response).await).expect("JSON");
        let text = body["error"].as_str().unwrap_or_default();
        assert_eq!(body["request_id"], id.as_str(), "{body}");
        assert!(text.contains(&id), "{body}");
        for leak in [
            "relation",
            "does not exist",
            role.as_str(),
            "SQL",
            "message_inbox",
        ] {
            assert!(!text.contains(leak), "{leak:?} in {body}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_failed_authentications_from_one_address_are_slowed() {
    let fx = Fixture::inbox().await;
    let app = fx.app(util::tokens());
    let status = "/api/v1/status";
    // A missing header (a dashboard before its token is entered) is not a failed guess.
    for _ in 0..10 {
        assert_eq!(app.get(status, None).await.0, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(app.get(status, Some(READ_TOKEN)).await.0, StatusCode::OK);
    // The next failed attempt is refused; a valid token from the same address still passes.
    guess_until_throttled(&app, status).await;
    assert_eq!(app.get(status, Some(READ_TOKEN)).await.0, StatusCode::OK);
    // Other servers (other counters) and probes are unaffected.
    assert_eq!(app.get("/healthz", None).await.0, StatusCode::OK);
    let other = fx.app(util::tokens());
    assert_eq!(other.get(status, Some(READ_TOKEN)).await.0, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_carry_nosniff_no_store_and_the_dashboard_a_policy() {
    let fx = Fixture::inbox().await;
    let app = fx.app(util::tokens());
    let get = async |path: &str, token: Option<&str>| {
        let request = app
            .request("GET", path, token)
            .body(Body::empty())
            .expect("a request");
        app.send(request).await
    };
    let header = |r: &axum::http::Response<Body>, name: &str| {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    for (path, token) in [
        ("/api/v1/status", Some(READ_TOKEN)),
        ("/api/v1/status", None),
        ("/api/v1/failures", Some(READ_TOKEN)),
        ("/readyz", None),
        ("/api/v1/openapi.json", None),
    ] {
        let r = get(path, token).await;
        assert_eq!(header(&r, "x-content-type-options"), "nosniff", "{path}");
        assert_eq!(header(&r, "cache-control"), "no-store", "{path}");
        assert!(!header(&r, "x-request-id").is_empty(), "{path}");
    }
    let page = get("/", None).await;
    let policy = header(&page, "content-security-policy");
    assert!(policy.contains("script-src 'self'"), "{policy}");
    assert!(policy.contains("frame-ancestors 'none'"), "{policy}");
    assert!(
        !policy.contains("unsafe-inline") && !policy.contains("unsafe-eval"),
        "{policy}"
    );
    assert_eq!(header(&page, "x-content-type-options"), "nosniff");
    for (asset, kind) in [
        ("/assets/js/main.js", "text/javascript"),
        ("/assets/js/statuses.js", "text/javascript"),
        ("/assets/app.css", "text/css"),
        ("/assets/uplot.js", "text/javascript"),
        ("/assets/uplot.css", "text/css"),
        ("/healthz", "text/plain"),
    ] {
        let r = get(asset, None).await;
        assert_eq!(r.status(), StatusCode::OK, "{asset}");
        assert_eq!(header(&r, "x-content-type-options"), "nosniff", "{asset}");
        assert!(header(&r, "content-type").starts_with(kind), "{asset}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_token_passes_where_failed_guesses_from_its_address_are_throttled() {
    let fx = Fixture::inbox().await;
    let app = fx.app(util::tokens());
    let status = "/api/v1/status";
    // One client behind a shared address guesses until it is throttled...
    guess_until_throttled(&app, status).await;
    // ...and everyone else at that address with a valid token is still served.
    assert_eq!(app.get(status, Some(READ_TOKEN)).await.0, StatusCode::OK);
    let (code, _) = app
        .post(
            "/api/v1/redrive",
            Some(ADMIN_TOKEN),
            json!({ "reason": "checking", "dry_run": true }),
        )
        .await;
    assert_eq!(code, StatusCode::OK);
    // Without a token, the throttled address is still refused.
    assert_eq!(app.get(status, None).await.0, StatusCode::TOO_MANY_REQUESTS);
}

/// `text` in base64url without padding (a list cursor's encoding).
fn base64url(text: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let bytes = text.as_bytes();
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_byte_or_a_time_postgresql_cannot_hold_is_a_400_naming_the_field() {
    let fx = Fixture::inbox().await;
    let app = fx.app(util::tokens());
    let refused = |what: &str, field: &str, code: StatusCode, body: &Value| {
        assert_eq!(code, StatusCode::BAD_REQUEST, "{what}: {body}");
        let error = body["error"].as_str().unwrap_or_default();
        assert!(error.contains(field), "{what}: names {field:?}: {body}");
    };
    // Path segments.
    for (method, path) in [
        ("GET", "/api/v1/messages/{c}/{m}"),
        ("GET", "/api/v1/messages/{c}/{m}/timeline"),
        ("POST", "/api/v1/messages/{c}/{m}/reopen"),
        ("POST", "/api/v1/messages/{c}/{m}/replay-edited"),
    ] {
        for (field, c, m) in [
            ("message_id", CONSUMER, "refund%001"),
            ("consumer", "orders%00", "refund-1"),
        ] {
            let path = path.replace("{c}", c).replace("{m}", m);
            let (code, body) = if method == "GET" {
                app.get(&path, Some(ADMIN_TOKEN)).await
            } else {
                let body = json!({ "reason": "fixed", "body": "{}", "dry_run": true });
                app.post(&path, Some(ADMIN_TOKEN), body).await
            };
            refused(&format!("{method} {path}"), field, code, &body);
        }
    }
    // Query parameters.
    for (path, field) in [
        ("/api/v1/status", "consumer"),
        ("/api/v1/failures", "consumer"),
        ("/api/v1/doctor", "consumer"),
        ("/api/v1/activity", "consumer"),
        ("/api/v1/audit", "consumer"),
        ("/api/v1/audit", "actor"),
        ("/api/v1/audit", "action"),
        ("/api/v1/messages", "message_id"),
        ("/api/v1/messages", "consumer"),
        ("/api/v1/messages", "correlation_id"),
        ("/api/v1/messages", "type"),
        ("/api/v1/messages", "error_code"),
        ("/api/v1/messages", "aggregate_type"),
        ("/api/v1/messages", "aggregate_id"),
        ("/api/v1/messages", "tenant"),
        ("/api/v1/messages", "cursor"),
    ] {
        let path = format!("{path}?{field}=a%00b");
        let (code, body) = app.get(&path, Some(READ_TOKEN)).await;
        refused(&path, field, code, &body);
    }
    // Cursors PostgreSQL cannot follow: a key with a NUL, a time before 4713 BC or after
    // year 294276.
    let micros_per_year = 365.2425 * 86_400.0 * 1e6;
    for (what, cursor) in [
        (
            "a NUL in the key",
            r#"{"t":0,"m":"a\u0000b","c":"orders"}"#.to_owned(),
        ),
        (
            "the year -5000",
            format!(
                r#"{{"t":{},"m":"a","c":"orders"}}"#,
                (-6970.0 * micros_per_year) as i64
            ),
        ),
        (
            "the year 300000",
            format!(r#"{{"t":{},"m":"a","c":"orders"}}"#, i64::MAX),
        ),
    ] {
        let path = format!("/api/v1/messages?cursor={}", base64url(&cursor));
        let (code, body) = app.get(&path, Some(READ_TOKEN)).await;
        refused(what, "cursor", code, &body);
    }
    // Bodies.
    let nul = "a\u{0}b";
    for (path, body, field) in [
        (
            "/api/v1/redrive",
            json!({ "reason": nul, "dry_run": true }),
            "reason",
        ),
        (
            "/api/v1/redrive",
            json!({ "reason": "r", "ticket": nul, "dry_run": true }),
            "ticket",
        ),
        (
            "/api/v1/redrive",
            json!({ "reason": "r", "consumer": nul, "dry_run": true }),
            "consumer",
        ),
        (
            "/api/v1/redrive",
            json!({ "reason": "r", "type": nul, "dry_run": true }),
            "type",
        ),
        (
            "/api/v1/redrive",
            json!({ "reason": "r", "error_code": nul, "dry_run": true }),
            "error_code",
        ),
        (
            "/api/v1/redrive",
            json!({ "reason": "r", "message_ids": ["ok", nul], "dry_run": true }),
            "message_ids",
        ),
        (
            "/api/v1/discard",
            json!({ "reason": nul, "dry_run": true }),
            "reason",
        ),
        (
            "/api/v1/discard",
            json!({ "reason": "r", "consumer": nul, "dry_run": true }),
            "consumer",
        ),
        (
            "/api/v1/jobs",
            json!({ "action": "redrive", "reason": nul }),
            "reason",
        ),
        (
            "/api/v1/jobs",
            json!({ "action": "discard", "reason": "r", "message_ids": [nul] }),
            "message_ids",
        ),
        (
            "/api/v1/recover",
            json!({ "consumer": nul, "reason": "r", "dry_run": true }),
            "consumer",
        ),
        (
            "/api/v1/recover",
            json!({ "consumer": CONSUMER, "reason": nul, "dry_run": true }),
            "reason",
        ),
        (
            "/api/v1/cleanup/dry-run",
            json!({ "consumer": nul, "reason": "r" }),
            "consumer",
        ),
        (
            "/api/v1/cleanup/dry-run",
            json!({ "consumer": CONSUMER, "reason": nul }),
            "reason",
        ),
        ("/api/v1/doctor", json!({ "consumer": nul }), "consumer"),
    ] {
        let (code, answer) = app.post(path, Some(ADMIN_TOKEN), body.clone()).await;
        refused(&format!("POST {path} {body}"), field, code, &answer);
    }
    for (field, body) in [
        ("reason", json!({ "reason": nul })),
        ("ticket", json!({ "reason": "r", "ticket": nul })),
    ] {
        let path = format!("/api/v1/messages/{CONSUMER}/refund-1/reopen");
        let (code, answer) = app.post(&path, Some(ADMIN_TOKEN), body).await;
        refused(&path, field, code, &answer);
        let path = format!("/api/v1/messages/{CONSUMER}/refund-1/replay-edited");
        let mut edit = json!({ "body": "{\"order\": \"x\"}", "dry_run": true });
        edit[field] = json!(nul);
        if field == "ticket" {
            edit["reason"] = json!("r");
        }
        let (code, answer) = app.post(&path, Some(ADMIN_TOKEN), edit).await;
        refused(&path, field, code, &answer);
    }
    // Nothing refused was written, and the server still answers.
    assert!(fx.audit().await.is_empty(), "{:?}", fx.audit().await);
    assert_eq!(
        app.get("/api/v1/status", Some(READ_TOKEN)).await.0,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_without_an_inbox_is_named_in_the_error() {
    let fx = Fixture::inbox().await;
    let missing = rabbit_inbox::SchemaName::new(format!("{}_missing", fx.env.schema.as_str()))
        .expect("schema name");
    let mut state = fx.state(util::tokens(), None);
    state.ops = inbox_ops::Operations::new(fx.env.pool.clone(), missing.clone());
    let app = InProcess::new(state, util::LOCAL, &ServeOptions::default());
    for path in [
        "/api/v1/status",
        "/api/v1/messages",
        "/api/v1/failures",
        "/api/v1/audit",
        "/api/v1/messages/orders/refund-1",
    ] {
        let (code, body) = app.get(path, Some(ADMIN_TOKEN)).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{path}: {body}");
        let text = body["error"].as_str().unwrap_or_default();
        assert!(
            text.contains(&format!("no inbox in schema {missing}"))
                && text.contains(&format!("inboxctl migrate --schema {missing}")),
            "{path}: {body}"
        );
        for leak in ["relation", "does not exist", "SQL"] {
            assert!(!text.contains(leak), "{leak:?} in {body}");
        }
    }
}

/// Fails authentication from the test's address until the throttle refuses it: the budget of
/// guesses answered 401, then a 429 with `Retry-After`.
async fn guess_until_throttled(app: &util::InProcess, path: &str) {
    for n in 0..inbox_admin::MAX_FAILURES {
        let guess = format!("{:032x}", u128::from(n) + 1);
        assert_eq!(
            app.get(path, Some(&guess)).await.0,
            StatusCode::UNAUTHORIZED
        );
    }
    let request = app
        .request("GET", path, Some(&format!("{:032x}", 99)))
        .body(Body::empty())
        .expect("a request");
    let response = app.send(request).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(response.headers().get("retry-after").is_some());
}
