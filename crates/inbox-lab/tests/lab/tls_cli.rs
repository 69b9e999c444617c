//! `inboxctl` over TLS, against the endpoints of `scripts/tls-endpoints.sh start` (addresses
//! and certificates from its `env`, its defaults otherwise): `--amqp-ca-file`,
//! `--amqp-client-cert`, `--amqp-client-key` (and their variables) reach every broker
//! connection, `DATABASE_URL`'s `sslmode`/`sslrootcert` the database's, and a bad file is named
//! in the error. Skipped, with a note, when the endpoints are not running; `scripts/test` starts them.

use std::{net::TcpStream, path::PathBuf, process::Output, time::Duration};

use rabbit_inbox::{SchemaName, broker::AmqpTls, broker::Broker};
use sqlx::PgPool;
use tokio::process::Command;

fn var(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

struct Endpoints {
    certs: PathBuf,
    /// Without TLS files: the flags add them.
    amqp_url: String,
    /// `sslmode=verify-full` against the script's CA.
    database_url: String,
}

fn endpoints() -> Option<Endpoints> {
    let dir = PathBuf::from(var("RABBIT_INBOX_TLS_DIR", "/tmp/rabbit-inbox-tls"));
    let amqp_url = var(
        "RABBIT_INBOX_TLS_AMQP_URL",
        "amqps://guest:guest@localhost:5691/%2f",
    );
    let database_url = var(
        "RABBIT_INBOX_TLS_DATABASE_URL",
        "postgres://postgres@localhost:5442/postgres",
    );
    let answers = |url: &str| {
        reqwest::Url::parse(url)
            .ok()
            .and_then(|u| u.port())
            .and_then(|port| {
                TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(2))
                    .ok()
            })
            .is_some()
    };
    let certs = dir.join("certs");
    if !(certs.join("ca.pem").exists() && answers(&amqp_url) && answers(&database_url)) {
        inbox_testkit::missing(
            "the TLS endpoints",
            "start them with scripts/tls-endpoints.sh start \
             (and eval \"$(scripts/tls-endpoints.sh env)\")",
        );
        return None;
    }
    let database_url = format!(
        "{database_url}?sslmode=verify-full&sslrootcert={}",
        certs.join("ca.pem").display()
    );
    Some(Endpoints {
        certs,
        amqp_url,
        database_url,
    })
}

impl Endpoints {
    fn cert(&self, name: &str) -> String {
        self.certs.join(name).display().to_string()
    }

    /// The library's URL with the CA file and the client certificate, for setup and cleanup.
    fn library_amqp_url(&self) -> String {
        AmqpTls {
            ca_file: Some(self.certs.join("ca.pem")),
            client_cert: Some(self.certs.join("client.pem")),
            client_key: Some(self.certs.join("client.key")),
        }
        .apply_to(&self.amqp_url)
        .expect("valid URL")
    }

    /// `inboxctl args` (or `inbox-lab args` for its commands) with the TLS endpoints' URLs and `env`, and nothing from the caller's
    /// environment that could change it.
    async fn inboxctl(&self, args: &[&str], env: &[(&str, String)]) -> Output {
        let mut command = Command::new(crate::bins::with_command(args[0]));
        command
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .env("AMQP_URL", &self.amqp_url)
            .env_remove("RUST_LOG")
            .env_remove("INBOX_SCHEMA");
        for name in ["AMQP_CA_FILE", "AMQP_CLIENT_CERT", "AMQP_CLIENT_KEY"] {
            command.env_remove(name);
        }
        for (name, value) in env {
            command.env(name, value);
        }
        let output = tokio::time::timeout(Duration::from_secs(60), command.output())
            .await
            .expect("inboxctl finishes")
            .expect("inboxctl runs");
        eprintln!(
            "inboxctl {args:?}: {}\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Drops the schema and deletes the queues and exchange (over TLS) when dropped, also when the
/// test panics.
struct Cleanup {
    amqp_url: String,
    database_url: String,
    schema: SchemaName,
    queue: String,
    exchange: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let amqp_url = self.amqp_url.clone();
        let database_url = self.database_url.clone();
        let config = order_service::config(self.schema.clone(), &self.queue, &self.exchange);
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                if let Ok(broker) = Broker::connect(&amqp_url, "test cleanup").await {
                    let _ = broker.delete(&config.topology, &config.retry).await;
                    broker.close().await;
                }
                if let Ok(pool) = PgPool::connect(&database_url).await {
                    let _ = rabbit_inbox::schema::drop_schema(&pool, &config.schema).await;
                    pool.close().await;
                }
            });
        })
        .join();
    }
}

#[tokio::test]
async fn tls_flags_and_variables_reach_the_broker_and_the_database() {
    let Some(tls) = endpoints() else { return };
    let id = inbox_testkit::unique_suffix();
    let schema = format!("t_{id}");
    let (queue, exchange) = (format!("t-{id}"), format!("t-{id}.orders"));
    let _cleanup = Cleanup {
        amqp_url: tls.library_amqp_url(),
        database_url: tls.database_url.clone(),
        schema: SchemaName::new(&schema).expect("schema name"),
        queue: queue.clone(),
        exchange: exchange.clone(),
    };
    let service = [
        "--schema",
        schema.as_str(),
        "--queue",
        queue.as_str(),
        "--exchange",
        exchange.as_str(),
    ];

    // PostgreSQL over verify-full, from DATABASE_URL.
    let migrated = tls.inboxctl(&["migrate", "--schema", &schema], &[]).await;
    assert!(migrated.status.success());

    // The broker (which requires a client certificate) through the flags.
    let (ca, cert, key) = (
        tls.cert("ca.pem"),
        tls.cert("client.pem"),
        tls.cert("client.key"),
    );
    let flags = [
        "--amqp-ca-file",
        ca.as_str(),
        "--amqp-client-cert",
        cert.as_str(),
        "--amqp-client-key",
        key.as_str(),
    ];
    let mut publish = vec!["publish", "--orders", "1"];
    publish.extend(service);
    let published = tls
        .inboxctl(&[publish.clone(), flags.to_vec()].concat(), &[])
        .await;
    assert!(published.status.success());
    assert!(String::from_utf8_lossy(&published.stdout).contains("published"));

    // The same through the variables, read back by `status` (broker and database).
    let env = [
        ("AMQP_CA_FILE", ca.clone()),
        ("AMQP_CLIENT_CERT", cert.clone()),
        ("AMQP_CLIENT_KEY", key.clone()),
    ];
    let status = tls
        .inboxctl(&["status", "--schema", &schema, "--queue", &queue], &env)
        .await;
    assert!(status.status.success());
    assert!(
        String::from_utf8_lossy(&status.stdout).contains(&format!("queue {queue}")),
        "status shows the queue"
    );

    // Without the client certificate the broker refuses the connection.
    let refused = tls
        .inboxctl(
            &[publish.clone(), vec!["--amqp-ca-file", &ca]].concat(),
            &[],
        )
        .await;
    assert_eq!(refused.status.code(), Some(2));

    // A CA that did not sign the broker's certificate.
    let other_ca = tls.cert("other-ca.pem");
    let mut wrong_ca = flags.to_vec();
    wrong_ca[1] = &other_ca;
    let refused = tls
        .inboxctl(&[publish.clone(), wrong_ca].concat(), &[])
        .await;
    assert_eq!(refused.status.code(), Some(2));
    let shown = stderr(&refused);
    assert!(shown.contains("UnknownIssuer"), "{shown}");
    assert!(shown.contains("Check --amqp-ca-file"), "{shown}");
    assert!(!shown.contains("Start it with"), "{shown}");

    // A file that is not there: named, and no advice to start the broker.
    let missing = tls.cert("missing-ca.pem");
    let mut bad_file = flags.to_vec();
    bad_file[1] = &missing;
    let refused = tls.inboxctl(&[publish, bad_file].concat(), &[]).await;
    assert_eq!(refused.status.code(), Some(2));
    let shown = stderr(&refused);
    assert!(shown.contains(&format!("CA file {missing}")), "{shown}");
    assert!(!shown.contains("Start it with"), "{shown}");
}
