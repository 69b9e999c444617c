//! A real inbox for the admin server to serve: the test kit's scratch inbox (its own schema and
//! queues, removed when dropped, also when a test panics), filled by a real consumer that
//! processes `OrderPlaced` and permanently refuses `RefundRequested` (parked). Served on a free
//! loopback port, or driven in process without a socket where a test is about what the
//! application answers rather than how the listener behaves.

use std::{net::SocketAddr, path::PathBuf};

use axum::{
    Router,
    body::Body,
    extract::ConnectInfo,
    http::{Request, Response, StatusCode, header, request},
};
use inbox_admin::{AdminState, PrometheusHandle, Scope, ServeOptions, Tokens};
use inbox_ops::Operations;
use inbox_testkit::{
    amqp_url,
    env::{TestEnv, message, test_retry, wait_for},
};
use rabbit_inbox::{Handler, HandlerError, InboxMessage, Topology, broker::QueueDepths};
use reqwest::Client;
use serde_json::Value;
use sqlx::PgConnection;
use tower::ServiceExt as _;

pub(crate) const CONSUMER: &str = "orders";
pub(crate) const READ_TOKEN: &str = "9b1f3c7e5a2d4f6081c3e5a7b9d1f3e5";
pub(crate) const PAYLOAD_TOKEN: &str = "4c8e2a6f0b3d5e7a9c1e3f5b7d9a2c4e";
pub(crate) const ADMIN_TOKEN: &str = "e7d5c3b1a9f8e6d4c2b0a8f6e4d2c0b9";
pub(crate) const REFUSED_TYPE: &str = "RefundRequested";
pub(crate) const REFUSED_CODE: &str = "refund_unsupported";
/// The error code of the parked heads of [`Fixture::block_key`].
pub(crate) const AMENDMENT_CODE: &str = "amendment_unsupported";
/// A type whose body the handler checks: a negative amount is refused permanently.
pub(crate) const CAPTURE_TYPE: &str = "PaymentCaptured";
pub(crate) const NEGATIVE_CODE: &str = "negative_amount";

/// Where in-process requests are addressed: a loopback address nothing needs to listen on.
pub(crate) const LOCAL: &str = "127.0.0.1:9480";

/// Processes everything but refunds, which it refuses permanently, and payment captures with a
/// negative amount (a body an operator can correct).
#[derive(Clone)]
pub(crate) struct OrderHandler;

impl Handler for OrderHandler {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        _tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        if msg.message_type() == REFUSED_TYPE {
            return Err(HandlerError::permanent(
                REFUSED_CODE,
                "refunds are not supported yet",
            ));
        }
        if msg.message_type() == CAPTURE_TYPE {
            let body: Value = msg.decode()?;
            if body["amount"].as_i64().is_none_or(|amount| amount < 0) {
                return Err(HandlerError::permanent(
                    NEGATIVE_CODE,
                    "a capture needs a non-negative amount",
                ));
            }
        }
        Ok(())
    }
}

/// The fixture's tokens: `grafana` (read), `support` (read:payload), `alice` (admin).
pub(crate) fn tokens() -> Tokens {
    let mut tokens = Tokens::none();
    tokens
        .add(Scope::Read, "grafana", READ_TOKEN)
        .expect("read token");
    tokens
        .add(Scope::ReadPayload, "support", PAYLOAD_TOKEN)
        .expect("read:payload token");
    tokens
        .add(Scope::Admin, "alice", ADMIN_TOKEN)
        .expect("admin token");
    tokens
}

/// `GET url` over HTTP, with `token` as the bearer if given: the status and the JSON body
/// (`null` when the body is not JSON).
pub(crate) async fn get(http: &Client, url: &str, token: Option<&str>) -> (StatusCode, Value) {
    let mut request = http.get(url);
    if let Some(t) = token {
        request = request.bearer_auth(t);
    }
    let response = request.send().await.expect("request");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// `POST url` over HTTP with a JSON `body`, like [`get`].
pub(crate) async fn post(
    http: &Client,
    url: &str,
    token: Option<&str>,
    body: Value,
) -> (StatusCode, Value) {
    let mut request = http.post(url).json(&body);
    if let Some(t) = token {
        request = request.bearer_auth(t);
    }
    let response = request.send().await.expect("request");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The inbox, its queues and, when served, the admin server. The schema and queues go when
/// it is dropped.
pub(crate) struct Fixture {
    pub(crate) env: TestEnv,
    pub(crate) topology: Topology,
    /// `http://127.0.0.1:<port>` of the fixture's own server (empty when not served).
    pub(crate) base: String,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        // Before the scratch inbox goes: nothing answers from a dropped schema.
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

impl Fixture {
    /// [`Fixture::inbox`], served with [`tokens`] and `metrics` at `/metrics`.
    pub(crate) async fn new(metrics: Option<PrometheusHandle>) -> Self {
        let mut fixture = Self::inbox().await;
        let (base, server) = fixture.serve(tokens(), metrics, "127.0.0.1:0").await;
        fixture.base = base;
        fixture.server = Some(server);
        fixture
    }

    /// Three processed orders and two parked refunds (`refund-1`, `refund-2`), not served.
    pub(crate) async fn inbox() -> Self {
        let env = TestEnv::new().await;
        let topology = env.topology("orders");
        let config = env.config(CONSUMER, topology.clone());
        env.declare(&config).await;
        for (id, kind) in [
            ("order-1", "OrderPlaced"),
            ("order-2", "OrderPlaced"),
            ("refund-1", REFUSED_TYPE),
            ("order-3", "OrderPlaced"),
            ("refund-2", REFUSED_TYPE),
        ] {
            let order = message(Some(id), kind, &serde_json::json!({ "order": id }));
            env.publish(&topology, &order).await;
        }
        let consumer = env.start(config, OrderHandler);
        let fixture = Self {
            env,
            topology,
            base: String::new(),
            server: None,
        };
        wait_for("two parked refunds", async || {
            let d = fixture.depths().await;
            d.parking == 2 && d.work == 0
        })
        .await;
        consumer.stop().await;
        fixture
    }

    /// Starts another admin server over this inbox.
    pub(crate) async fn serve(
        &self,
        tokens: Tokens,
        metrics: Option<PrometheusHandle>,
        addr: &str,
    ) -> (String, tokio::task::JoinHandle<()>) {
        let (local, server) = self
            .serve_with(tokens, metrics, addr, ServeOptions::default())
            .await;
        (format!("http://{local}"), server)
    }

    /// The state of an admin server over this inbox.
    pub(crate) fn state(&self, tokens: Tokens, metrics: Option<PrometheusHandle>) -> AdminState {
        AdminState {
            ops: Operations::new(self.env.pool.clone(), self.env.schema.clone()),
            amqp_url: amqp_url(),
            management_url: None,
            queues: Some((self.topology.clone(), test_retry())),
            tokens,
            metrics,
            prometheus_url: None,
            replay_window: None,
        }
    }

    /// Starts another admin server over this inbox with `options`; returns its address.
    pub(crate) async fn serve_with(
        &self,
        tokens: Tokens,
        metrics: Option<PrometheusHandle>,
        addr: &str,
        options: ServeOptions,
    ) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("a free port");
        let local: SocketAddr = listener.local_addr().expect("address");
        let state = self.state(tokens, metrics);
        let server = tokio::spawn(async move {
            inbox_admin::serve(listener, state, options, std::future::pending())
                .await
                .expect("admin server runs");
        });
        (local, server)
    }

    /// The application over this inbox with `tokens`, in process, as a loopback server at
    /// [`LOCAL`] with the default options would answer.
    pub(crate) fn app(&self, tokens: Tokens) -> InProcess {
        InProcess::new(self.state(tokens, None), LOCAL, &ServeOptions::default())
    }

    pub(crate) async fn depths(&self) -> QueueDepths {
        self.env.depths(&self.topology).await
    }

    /// Blocks the ordering key `key` of [`CONSUMER`], as an ordered consumer leaves it when a
    /// message fails: its head `<key>-head` (PERMANENT_FAILED, [`AMENDMENT_CODE`]) since
    /// `minutes` ago, and two messages held behind it (`<key>-2`, `<key>-3`).
    pub(crate) async fn block_key(&self, key: &str, minutes: u32) {
        let s = format!("\"{}\"", self.env.schema.as_str());
        let row = |id: String, status: &str, position: &str| {
            format!(
                "INSERT INTO {s}.message_inbox (message_id, consumer_name, message_type, \
                   message_version, status, payload_sha256, order_key, order_position, \
                   first_received_at, aggregate_id, last_error_code, last_error_message) \
                 VALUES ('{id}', '{CONSUMER}', 'OrderAmended', 1, '{status}', \
                   sha256('{id}'::bytea), '{key}', {position}, \
                   now() - interval '{minutes} minutes', '{key}', {code}, {message});",
                code = if status == "HELD" {
                    "NULL".into()
                } else {
                    format!("'{AMENDMENT_CODE}'")
                },
                message = if status == "HELD" {
                    "NULL"
                } else {
                    "'amendments are not supported yet'"
                },
            )
        };
        let sql = [
            row(format!("{key}-head"), "PERMANENT_FAILED", "NULL"),
            row(format!("{key}-2"), "HELD", "nextval('{s}.inbox_order_position_seq')"),
            row(format!("{key}-3"), "HELD", "nextval('{s}.inbox_order_position_seq')"),
            format!(
                "INSERT INTO {s}.inbox_order_key (consumer_name, order_key, head_message_id, \
                   blocked_since) \
                 VALUES ('{CONSUMER}', '{key}', '{key}-head', now() - interval '{minutes} minutes');"
            ),
        ]
        .concat()
        .replace("{s}", &s);
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.env.pool)
            .await
            .expect("a blocked key");
    }

    /// Holds two messages of the ordering key `key` of [`CONSUMER`] (sequence numbers `first`
    /// and `first + 1`) while it waits for `next`, since `minutes` ago: a sequence gap.
    pub(crate) async fn hold_after_gap(&self, key: &str, next: i64, first: i64, minutes: u32) {
        let s = format!("\"{}\"", self.env.schema.as_str());
        let mut sql = String::new();
        for n in [first, first + 1] {
            sql.push_str(&format!(
                "INSERT INTO {s}.message_inbox (message_id, consumer_name, message_type, \
                   message_version, status, payload_sha256, order_key, order_position, \
                   first_received_at, aggregate_id) \
                 VALUES ('{key}-{n}', '{CONSUMER}', 'OrderAmended', 1, 'HELD', \
                   sha256('{key}-{n}'::bytea), '{key}', {n}, \
                   now() - interval '{minutes} minutes', '{key}');"
            ));
        }
        sql.push_str(&format!(
            "INSERT INTO {s}.inbox_order_key (consumer_name, order_key, next_sequence, gap_since) \
             VALUES ('{CONSUMER}', '{key}', {next}, now() - interval '{minutes} minutes');"
        ));
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&self.env.pool)
            .await
            .expect("a key waiting on a gap");
    }

    /// `(actor, action, message_id, reason)` of every audit row, oldest first.
    pub(crate) async fn audit(&self) -> Vec<(String, String, Option<String>, String)> {
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT actor, action, message_id, reason FROM \"{}\".inbox_audit ORDER BY audit_id",
            self.env.schema.as_str()
        )))
        .fetch_all(&self.env.pool)
        .await
        .expect("audit rows")
    }
}

/// The admin application driven in process with `tower::ServiceExt::oneshot`: the routes,
/// guards and headers without a socket.
pub(crate) struct InProcess {
    app: Router,
    /// The address it answers as, and requests' `Host`.
    pub(crate) addr: SocketAddr,
}

impl InProcess {
    /// `state` as a server on `addr` with `options` answers it.
    pub(crate) fn new(state: AdminState, addr: &str, options: &ServeOptions) -> Self {
        let addr = addr.parse().expect("a socket address");
        let app = inbox_admin::app(state, addr, options).expect("the options are accepted");
        Self { app, addr }
    }

    /// A request for `path` addressed to this server, with `token` as the bearer if given.
    pub(crate) fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
    ) -> request::Builder {
        let builder = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, self.addr.to_string());
        match token {
            Some(t) => builder.header(header::AUTHORIZATION, format!("Bearer {t}")),
            None => builder,
        }
    }

    /// The answer to `request`, which arrives as the listener hands it over: from a loopback
    /// peer.
    pub(crate) async fn send(&self, mut request: Request<Body>) -> Response<Body> {
        let peer: SocketAddr = ([127, 0, 0, 1], 50_000).into();
        request.extensions_mut().insert(ConnectInfo(peer));
        self.app
            .clone()
            .oneshot(request)
            .await
            .unwrap_or_else(|never| match never {})
    }

    /// `GET path`: the status and the JSON body (`null` when the body is not JSON).
    pub(crate) async fn get(&self, path: &str, token: Option<&str>) -> (StatusCode, Value) {
        let request = self.request("GET", path, token).body(Body::empty());
        json_of(self.send(request.expect("a request")).await).await
    }

    /// `POST path` with a JSON `body`, like [`InProcess::get`].
    pub(crate) async fn post(
        &self,
        path: &str,
        token: Option<&str>,
        body: Value,
    ) -> (StatusCode, Value) {
        let request = self
            .request("POST", path, token)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()));
        json_of(self.send(request.expect("a request")).await).await
    }

    /// `GET path` with `Host: host` (what a browser sends after DNS rebinding): the status
    /// code and the body as text.
    pub(crate) async fn get_for_host(
        &self,
        path: &str,
        host: &str,
        token: Option<&str>,
    ) -> (u16, String) {
        let mut request = self
            .request("GET", path, token)
            .body(Body::empty())
            .expect("a request");
        request
            .headers_mut()
            .insert(header::HOST, host.parse().expect("a header value"));
        let response = self.send(request).await;
        (response.status().as_u16(), text_of(response).await)
    }
}

/// The body of `response` as text.
pub(crate) async fn text_of(response: Response<Body>) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .expect("the body");
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The status of `response` and its body as JSON (`null` when it is not JSON).
pub(crate) async fn json_of(response: Response<Body>) -> (StatusCode, Value) {
    let status = response.status();
    let text = text_of(response).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// A temporary directory, removed when dropped.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    /// `<temp>/<prefix>-<pid>-<random>`, created.
    pub(crate) fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "{prefix}-{}-{}",
            std::process::id(),
            inbox_testkit::unique_suffix()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A helper program (chromedriver, Prometheus) listening on a free loopback port, killed when
/// dropped.
pub(crate) struct LocalProcess {
    child: std::process::Child,
    /// The port it was told to listen on.
    pub(crate) port: u16,
    /// `http://127.0.0.1:<port>`.
    pub(crate) url: String,
}

impl LocalProcess {
    /// Picks a free port and starts `program` with the arguments `args` makes of it, its output
    /// discarded.
    pub(crate) fn spawn(program: &std::path::Path, args: impl FnOnce(u16) -> Vec<String>) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = std::process::Command::new(program)
            .args(args(port))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{} starts: {e}", program.display()));
        Self {
            child,
            port,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for LocalProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The buckets of `consumer` in an activity report.
pub(crate) fn activity_buckets<'a>(
    report: &'a Value,
    consumer: &'a str,
) -> impl Iterator<Item = &'a Value> {
    report["consumers"]
        .as_array()
        .expect("consumers")
        .iter()
        .filter(move |c| c["consumer"] == consumer)
        .flat_map(|c| c["buckets"].as_array().expect("buckets").iter())
}
