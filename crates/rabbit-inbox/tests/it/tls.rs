//! TLS to RabbitMQ (`amqps://`), PostgreSQL (`sslmode`) and the management API (HTTPS), against
//! the real TLS listeners that `scripts/tls-endpoints.sh start` runs beside the default servers
//! (certificates and addresses from its `env`: `RABBIT_INBOX_TLS_DIR`,
//! `RABBIT_INBOX_TLS_AMQP_URL`, `RABBIT_INBOX_TLS_MANAGEMENT_URL`,
//! `RABBIT_INBOX_TLS_DATABASE_URL`; its defaults otherwise). Each test is skipped, with a note,
//! when the endpoints are not running; `scripts/test` starts them.
//!
//! The servers hold a certificate for `localhost` and `127.0.0.1` signed by the script's CA;
//! they also listen on 127.0.0.2, a name the certificate does not hold. The broker requires a
//! client certificate (`fail_if_no_peer_cert`), and so does PostgreSQL's database `inbox_mtls`.

// Shared with the other integration tests; not every helper is used here.

use std::{net::TcpStream, path::PathBuf, time::Duration};

use inbox_ops::management::{ManagementClient, ManagementError};
use inbox_ops::{
    Operations,
    doctor::{DoctorRequest, Severity, check_ids as ids},
};
use inbox_testkit::env::{Running, random_hex, thing, wait_for};
use rabbit_inbox::{
    BrokerError, ConfigError, Consumer, HandlerError, InboxMessage, InboxStatus, SchemaName,
    Topology, broker::AmqpTls, broker::Broker, store::InboxStore,
};
use sqlx::{PgConnection, PgPool, postgres::PgPoolOptions};

/// The script's endpoints.
struct Endpoints {
    dir: PathBuf,
    amqp_url: String,
    management_url: String,
    database_url: String,
}

fn var(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The endpoints if they answer, else `None` after saying how to start them.
fn endpoints() -> Option<Endpoints> {
    let e = Endpoints {
        dir: PathBuf::from(var("RABBIT_INBOX_TLS_DIR", "/tmp/rabbit-inbox-tls")),
        amqp_url: var(
            "RABBIT_INBOX_TLS_AMQP_URL",
            "amqps://guest:guest@localhost:5691/%2f",
        ),
        management_url: var(
            "RABBIT_INBOX_TLS_MANAGEMENT_URL",
            "https://guest:guest@localhost:15691",
        ),
        database_url: var(
            "RABBIT_INBOX_TLS_DATABASE_URL",
            "postgres://postgres@localhost:5442/postgres",
        ),
    };
    let listening = |url: &str| {
        let url = reqwest::Url::parse(url).ok()?;
        let port = url.port()?;
        TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_secs(2),
        )
        .ok()
    };
    let ready = e.dir.join("certs/ca.pem").exists()
        && listening(&e.amqp_url).is_some()
        && listening(&e.management_url).is_some()
        && listening(&e.database_url).is_some();
    if ready {
        Some(e)
    } else {
        inbox_testkit::missing(
            "the TLS endpoints",
            "start them with scripts/tls-endpoints.sh start \
             (and eval \"$(scripts/tls-endpoints.sh env)\")",
        );
        None
    }
}

impl Endpoints {
    fn cert(&self, name: &str) -> PathBuf {
        self.dir.join("certs").join(name)
    }

    /// The broker URL with `ca` as CA file and, if given, the client certificate `client`
    /// (`client.pem` and `client.key`).
    fn amqp(&self, ca: &str, client: Option<&str>) -> String {
        AmqpTls {
            ca_file: Some(self.cert(ca)),
            client_cert: client.map(|c| self.cert(&format!("{c}.pem"))),
            client_key: client.map(|c| self.cert(&format!("{c}.key"))),
        }
        .apply_to(&self.amqp_url)
        .expect("valid URL")
    }

    /// The database URL with `query` (sslmode and friends) and `host` in place of `localhost`.
    fn database(&self, host: &str, database: &str, query: &str) -> String {
        let mut url = reqwest::Url::parse(&self.database_url).expect("database URL");
        url.set_host(Some(host)).expect("host");
        url.set_path(database);
        url.set_query(Some(query));
        url.to_string()
    }

    fn root_cert(&self, ca: &str) -> String {
        format!("sslrootcert={}", self.cert(ca).display())
    }
}

/// `url` with its host replaced.
fn on_host(url: &str, host: &str) -> String {
    let mut url = reqwest::Url::parse(url).expect("URL");
    url.set_host(Some(host)).expect("host");
    url.to_string()
}

async fn connect_broker(url: &str) -> Result<Broker, BrokerError> {
    let broker = Broker::connect(url, "rabbit-inbox tls test").await?;
    Ok(broker)
}

/// Whether the error (and its causes) says the certificate was refused.
fn refused_certificate(e: &dyn std::error::Error, what: &str) -> bool {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    eprintln!("{what}: {text}");
    text.to_lowercase().contains(&what.to_lowercase())
}

// --- RabbitMQ ---------------------------------------------------------------------------

#[tokio::test]
async fn amqps_verifies_the_broker_against_the_ca_file_and_presents_the_client_certificate() {
    let Some(tls) = endpoints() else { return };
    let broker = connect_broker(&tls.amqp("ca.pem", Some("client")))
        .await
        .expect("verified against the CA, client certificate accepted");
    broker.close().await;
}

#[tokio::test]
async fn amqps_refuses_a_broker_certificate_from_another_ca() {
    let Some(tls) = endpoints() else { return };
    let Err(e) = connect_broker(&tls.amqp("other-ca.pem", Some("client"))).await else {
        panic!("a broker certificate the CA file did not sign was accepted");
    };
    assert!(matches!(e, BrokerError::TlsHandshake { .. }), "{e}");
    assert!(refused_certificate(&e, "UnknownIssuer"), "{e}");
}

#[tokio::test]
async fn amqps_refuses_a_host_name_the_broker_certificate_does_not_hold() {
    let Some(tls) = endpoints() else { return };
    let url = on_host(&tls.amqp("ca.pem", Some("client")), "127.0.0.2");
    let Err(e) = connect_broker(&url).await else {
        panic!("connected to 127.0.0.2 with a certificate for localhost and 127.0.0.1");
    };
    assert!(refused_certificate(&e, "not valid for name"), "{e}");
}

#[tokio::test]
async fn amqps_mutual_tls_needs_a_client_certificate_the_broker_trusts() {
    let Some(tls) = endpoints() else { return };
    // fail_if_no_peer_cert: no certificate, no connection.
    let Err(e) = connect_broker(&tls.amqp("ca.pem", None)).await else {
        panic!("the broker requires a client certificate");
    };
    // Under TLS 1.3 the client finishes its side of the handshake first, so the broker's
    // refusal arrives as its alert or, when the socket is closed before that is read, a reset.
    assert!(
        refused_certificate(&e, "CertificateRequired") || refused_certificate(&e, "reset"),
        "{e}"
    );
    assert!(
        connect_broker(&tls.amqp("ca.pem", Some("other-client")))
            .await
            .is_err(),
        "a client certificate from an untrusted CA was accepted"
    );
    connect_broker(&tls.amqp("ca.pem", Some("client")))
        .await
        .expect("the CA's client certificate is accepted")
        .close()
        .await;
}

#[tokio::test]
async fn a_bad_tls_file_is_named_when_the_consumer_is_built() {
    let Some(tls) = endpoints() else { return };
    let pool = PgPoolOptions::new()
        .connect_lazy(&inbox_testkit::env::database_url())
        .expect("lazy pool");
    let config = rabbit_inbox::ConsumerConfig::new("tls-test", Topology::new("tls-unused"));
    let missing = tls.dir.join("certs/missing-ca.pem");
    let url = AmqpTls {
        ca_file: Some(missing.clone()),
        ..AmqpTls::default()
    }
    .apply_to(&tls.amqp_url)
    .expect("valid URL");
    let Err(e) = Consumer::new(url, pool.clone(), config.clone(), Accept) else {
        panic!("a missing CA file was accepted");
    };
    let shown = e.to_string();
    assert!(matches!(e, ConfigError::InvalidSetting { .. }), "{shown}");
    assert!(shown.contains(&missing.display().to_string()), "{shown}");
    // The key of another certificate: the error names the key file.
    let url = AmqpTls {
        ca_file: Some(tls.cert("ca.pem")),
        client_cert: Some(tls.cert("client.pem")),
        client_key: Some(tls.cert("other-client.key")),
    }
    .apply_to(&tls.amqp_url)
    .expect("valid URL");
    let Err(e) = Consumer::new(url, pool, config, Accept) else {
        panic!("a key that does not belong to the certificate was accepted");
    };
    assert!(e.to_string().contains("other-client.key"), "{e}");
}

// --- PostgreSQL -------------------------------------------------------------------------

async fn connect_database(url: &str) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
}

/// Whether the pool's connection is encrypted, as the server sees it.
async fn encrypted(pool: &PgPool) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(pool)
        .await
        .expect("pg_stat_ssl")
}

#[tokio::test]
async fn postgres_verify_full_against_the_root_certificate() {
    let Some(tls) = endpoints() else { return };
    let url = tls.database(
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&{}", tls.root_cert("ca.pem")),
    );
    let pool = connect_database(&url).await.expect("verified connection");
    assert!(encrypted(&pool).await);
    // require: encrypted, the certificate unchecked.
    let pool = connect_database(&tls.database("localhost", "postgres", "sslmode=require"))
        .await
        .expect("sslmode=require");
    assert!(encrypted(&pool).await);
}

#[tokio::test]
async fn postgres_refuses_a_server_certificate_from_another_ca() {
    let Some(tls) = endpoints() else { return };
    for mode in ["verify-ca", "verify-full"] {
        let url = tls.database(
            "localhost",
            "postgres",
            &format!("sslmode={mode}&{}", tls.root_cert("other-ca.pem")),
        );
        let Err(e) = connect_database(&url).await else {
            panic!("{mode}: a server certificate the root certificate did not sign was accepted");
        };
        assert!(refused_certificate(&e, "UnknownIssuer"), "{mode}: {e}");
    }
}

#[tokio::test]
async fn postgres_verify_full_refuses_a_host_name_the_certificate_does_not_hold() {
    let Some(tls) = endpoints() else { return };
    let root = tls.root_cert("ca.pem");
    let url = tls.database(
        "127.0.0.2",
        "postgres",
        &format!("sslmode=verify-full&{root}"),
    );
    let Err(e) = connect_database(&url).await else {
        panic!("verify-full connected to 127.0.0.2 with a certificate for localhost");
    };
    assert!(refused_certificate(&e, "not valid for name"), "{e}");
    // verify-ca checks the chain only: the same address is accepted, so the refusal above is
    // the name's.
    let url = tls.database(
        "127.0.0.2",
        "postgres",
        &format!("sslmode=verify-ca&{root}"),
    );
    connect_database(&url)
        .await
        .expect("verify-ca ignores the name");
}

#[tokio::test]
async fn postgres_mutual_tls_with_a_client_certificate() {
    let Some(tls) = endpoints() else { return };
    let root = tls.root_cert("ca.pem");
    let without = tls.database(
        "localhost",
        "inbox_mtls",
        &format!("sslmode=verify-full&{root}"),
    );
    assert!(
        connect_database(&without).await.is_err(),
        "database inbox_mtls requires a client certificate"
    );
    let with = tls.database(
        "localhost",
        "inbox_mtls",
        &format!(
            "sslmode=verify-full&{root}&sslcert={}&sslkey={}",
            tls.cert("client.pem").display(),
            tls.cert("client.key").display()
        ),
    );
    let pool = connect_database(&with)
        .await
        .expect("client certificate accepted");
    assert!(encrypted(&pool).await);
}

// --- Management API ---------------------------------------------------------------------

#[tokio::test]
async fn management_api_over_https_verified_against_the_ca_file() {
    let Some(tls) = endpoints() else { return };
    let client = ManagementClient::new(&tls.amqp("ca.pem", None), Some(&tls.management_url))
        .expect("client");
    let version = client.broker_version().await.expect("HTTPS verified");
    assert!(!version.is_empty());
}

#[tokio::test]
async fn management_api_refuses_a_certificate_from_another_ca() {
    let Some(tls) = endpoints() else { return };
    let client = ManagementClient::new(&tls.amqp("other-ca.pem", None), Some(&tls.management_url))
        .expect("client");
    let Err(e) = client.broker_version().await else {
        panic!("a certificate the CA file did not sign was accepted");
    };
    assert!(matches!(e, ManagementError::Unreachable { .. }), "{e}");
    assert!(refused_certificate(&e, "UnknownIssuer"), "{e}");
}

#[tokio::test]
async fn management_api_refuses_a_host_name_the_certificate_does_not_hold() {
    let Some(tls) = endpoints() else { return };
    let url = on_host(&tls.management_url, "127.0.0.2");
    let client = ManagementClient::new(&tls.amqp("ca.pem", None), Some(&url)).expect("client");
    let Err(e) = client.broker_version().await else {
        panic!("connected to 127.0.0.2 with a certificate for localhost and 127.0.0.1");
    };
    assert!(refused_certificate(&e, "not valid for name"), "{e}");
}

// --- End to end -------------------------------------------------------------------------

/// Accepts every message; the inbox row is the effect looked at.
#[derive(Clone)]
struct Accept;

impl rabbit_inbox::Handler for Accept {
    async fn handle(&self, _: &InboxMessage<'_>, _: &mut PgConnection) -> Result<(), HandlerError> {
        Ok(())
    }
}

#[tokio::test]
async fn the_consumer_processes_and_acks_over_amqps_and_verify_full() {
    let Some(tls) = endpoints() else { return };
    let amqp_url = tls.amqp("ca.pem", Some("client"));
    let database_url = tls.database(
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&{}", tls.root_cert("ca.pem")),
    );
    let id = random_hex();
    let schema = SchemaName::new(format!("t_{id}")).expect("schema name");
    let pool = PgPoolOptions::new()
        .max_connections(6)
        .connect(&database_url)
        .await
        .expect("PostgreSQL over TLS");
    rabbit_inbox::migrate(&pool, &schema)
        .await
        .expect("migrations");
    let mut config =
        rabbit_inbox::ConsumerConfig::new("tls-consumer", Topology::new(format!("t-{id}")));
    config.schema = schema.clone();
    config.retry = inbox_testkit::env::test_retry();
    config.max_batch_delay = Duration::from_millis(10);
    let broker = connect_broker(&amqp_url).await.expect("broker over TLS");
    broker
        .declare(&config.topology, &config.retry)
        .await
        .expect("declared");
    broker
        .publish("", &config.topology.queue, &thing("tls-1", 1))
        .await
        .expect("published");

    let running = Running::spawn(
        Consumer::new(amqp_url.clone(), pool.clone(), config.clone(), Accept).expect("consumer"),
    );
    let store = InboxStore::new(schema.clone());
    wait_for("the message processed", async || {
        let mut conn = pool.acquire().await.expect("connection");
        store
            .find(&mut conn, "tls-consumer", "tls-1")
            .await
            .expect("inbox row")
            .is_some_and(|r| r.status == InboxStatus::Processed)
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(stats.processed, 1, "{stats:?}");
    // Acked: nothing came back to the queue when the consumer closed its connection.
    let depths = broker
        .queue_depths(&config.topology, &config.retry)
        .await
        .expect("depths");
    assert_eq!((depths.work, depths.retry, depths.parking), (0, 0, 0));

    // The doctor reads the topology through the management API over HTTPS and the parking lot
    // over amqps, with the same files.
    let mut request = DoctorRequest::for_consumer(&config, amqp_url.clone());
    request.management_url = Some(tls.management_url.clone());
    let report = Operations::new(pool.clone(), schema.clone())
        .doctor(&request)
        .await;
    assert_eq!(report.worst, Severity::Pass, "{report:#?}");
    for id in [ids::WORK_QUEUE, ids::RETRY_TIERS, ids::PARKED_WITHOUT_ROW] {
        assert_eq!(
            report.severity(id),
            Some(Severity::Pass),
            "{id}: {report:#?}"
        );
    }

    broker
        .delete(&config.topology, &config.retry)
        .await
        .expect("queues deleted");
    broker.close().await;
    rabbit_inbox::schema::drop_schema(&pool, &schema)
        .await
        .expect("schema dropped");
    pool.close().await;
}
