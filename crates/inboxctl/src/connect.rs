//! Connecting with errors that say which server, at which address, and how to start it.

use anyhow::anyhow;
use rabbit_inbox::{BrokerError, broker::Broker};
use std::time::Duration;

use sqlx::{
    ConnectOptions, PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};

/// Address part of a URL, without credentials.
fn address(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.rsplit_once('@').map_or(rest, |(_, host)| host)
}

/// Pool size for a command that runs a consumer with `lanes` lanes (0 for none): each lane
/// holds one connection while it runs, and the handler and the tool need a few more.
pub fn pool_size(lanes: usize) -> u32 {
    u32::try_from(lanes)
        .unwrap_or(u32::MAX)
        .saturating_add(6)
        .max(8)
}

/// A pool of at most `max_connections` to PostgreSQL at `url`, with an error that names the
/// server (without its password) and how to start it.
pub async fn postgres(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = url
        .parse()
        .map_err(|e| anyhow!("invalid DATABASE_URL {}: {e}", address(url)))?;
    // Bulk statements (benchmark prefill, verification) are slow by design; warn only for
    // what is slow for an operator.
    let options = options.log_slow_statements(log::LevelFilter::Warn, Duration::from_secs(10));
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(|e| match e {
            // The server answered; its certificate, or ours, was refused.
            sqlx::Error::Tls(_) => anyhow!(
                "TLS with PostgreSQL at {} failed ({e}).\n  Check sslmode, sslrootcert, sslcert \
                 and sslkey in DATABASE_URL (or PGSSLMODE, PGSSLROOTCERT, ...).",
                address(url)
            ),
            e => anyhow!(
                "cannot reach PostgreSQL at {} ({e}).\n  Start it with: \
                 pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n  \
                 or point DATABASE_URL at a running server.",
                address(url)
            ),
        })
}

/// The broker addresses of an AMQP URL list, without credentials.
fn broker_addresses(url: &str) -> String {
    rabbit_inbox::broker::AmqpAddresses::parse(url)
        .map_or_else(|_| address(url).to_owned(), |a| a.to_string())
}

/// A broker error with what to do about it: the TLS files when they are the problem, else how
/// to start the broker.
fn broker_unreachable(url: &str, e: BrokerError, hint: &str) -> anyhow::Error {
    match e {
        BrokerError::TlsFile { .. } | BrokerError::TlsSettings(_) => {
            anyhow!(
                "{e}\n  (set by --amqp-ca-file, --amqp-client-cert, --amqp-client-key or AMQP_URL)"
            )
        }
        BrokerError::TlsHandshake { .. } => anyhow!(
            "{e}\n  Check --amqp-ca-file (AMQP_CA_FILE) against the CA that signed the broker's \
             certificate, the host in AMQP_URL against the names the certificate holds, and \
             --amqp-client-cert/--amqp-client-key if the broker requires a client certificate."
        ),
        e => anyhow!(
            "cannot reach RabbitMQ at {} ({e}).\n  Start it with: rabbitmq-server -detached\n  {hint}",
            broker_addresses(url)
        ),
    }
}

/// A tool-side connection to RabbitMQ at `url`, named after the running program (what the
/// management UI shows), with an error that names the broker and how to start it.
pub async fn rabbitmq(url: &str) -> anyhow::Result<Broker> {
    Broker::connect(url, &program_name()).await.map_err(|e| {
        broker_unreachable(
            url,
            e,
            "or point AMQP_URL at a running broker (several nodes: comma-separated URLs).",
        )
    })
}

/// The parking lot of `work_queue`, with an error that names the broker and how to start it.
pub async fn parking_lot(
    url: &str,
    work_queue: &str,
    parking_queue: &str,
) -> anyhow::Result<rabbit_inbox::broker::ParkingLot> {
    rabbit_inbox::broker::ParkingLot::connect(url, work_queue, parking_queue)
        .await
        .map_err(|e| broker_unreachable(url, e, "or point AMQP_URL at a running broker."))
}

/// The running executable's name (`inboxctl`, `inbox-lab`), for connection names.
fn program_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "inboxctl".into())
}

#[cfg(test)]
mod tests {
    use super::{address, pool_size};

    #[test]
    fn address_hides_credentials() {
        assert_eq!(
            address("amqp://guest:secret@10.0.0.1:5672/%2f"),
            "10.0.0.1:5672/%2f"
        );
        assert_eq!(address("postgres://127.0.0.1:5432/db"), "127.0.0.1:5432/db");
    }

    #[test]
    fn pool_has_room_beyond_the_lanes() {
        assert_eq!(pool_size(0), 8);
        assert_eq!(pool_size(2), 8);
        for lanes in [2, 8, 16, 256] {
            assert!(pool_size(lanes) as usize > lanes, "{lanes}");
        }
    }
}
