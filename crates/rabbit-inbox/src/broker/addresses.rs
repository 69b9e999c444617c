//! Several broker addresses: the nodes of one RabbitMQ cluster, tried in order.
//!
//! Every connection the library opens goes through [`connect`], so the consumer, its
//! publisher, the outbox relay and the operator tools all take a comma-separated list where
//! they take an AMQP URL (`AMQP_URL=amqp://a:5672,amqp://b:5672`). An `amqps://` entry connects
//! over TLS with the files its query names (see [`super::tls`]).

use std::{fmt, str::FromStr, time::Duration};

use lapin::{Connection, ConnectionProperties, uri::AMQPScheme, uri::AMQPUri};

use super::tls::{AmqpTls, TlsFiles, redacted};
use crate::error::{AmqpResult, BrokerError, ConfigError};

/// How long one address may take to accept a connection before the next is tried. A node that
/// is partitioned away or paused does not refuse; it just never answers.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One or more AMQP URLs of the same broker (the nodes of a cluster), in the order they are
/// tried. Parsed from a comma-separated list; each entry must be a valid `amqp://` or
/// `amqps://` URL. An `amqps://` entry may name TLS files in its query (`cacertfile`,
/// `certfile`, `keyfile`; see [`AmqpTls`]), which are read and checked here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AmqpAddresses {
    nodes: Vec<Node>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Node {
    uri: AMQPUri,
    /// `host:port`, shown in the connection name and in logs (never the credentials).
    label: String,
    /// The TLS files of an `amqps://` entry, read.
    tls: Option<TlsFiles>,
}

impl AmqpAddresses {
    /// Parses a comma-separated list of AMQP URLs. Blank entries are ignored; at least one
    /// URL is required.
    pub fn parse(list: &str) -> Result<Self, BrokerError> {
        let mut nodes = Vec::new();
        for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let uri = AMQPUri::from_str(entry).map_err(|reason| {
                BrokerError::InvalidAddress(format!("{}: {reason}", redacted(entry)))
            })?;
            let label = format!("{}:{}", uri.authority.host, uri.authority.port);
            let files = url::Url::parse(entry)
                .map(|url| AmqpTls::from_url(&url))
                .unwrap_or_default();
            let tls = match uri.scheme {
                AMQPScheme::AMQPS => Some(files.load()?),
                AMQPScheme::AMQP if files.is_empty() => None,
                AMQPScheme::AMQP => {
                    return Err(BrokerError::TlsSettings(format!(
                        "{label}: TLS files are given for a plain amqp:// URL; use amqps://"
                    )));
                }
            };
            nodes.push(Node { uri, label, tls });
        }
        if nodes.is_empty() {
            return Err(BrokerError::InvalidAddress(
                "no AMQP URL given (expected amqp://user:pass@host:port/vhost, several separated by commas)"
                    .into(),
            ));
        }
        Ok(Self { nodes })
    }

    /// The TLS files of the first `amqps://` address, for another client of the same broker
    /// (the management API).
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.nodes.iter().find_map(|n| n.tls.as_ref())
    }

    /// The addresses' `host:port`, in the order they are tried.
    pub fn nodes(&self) -> impl Iterator<Item = &str> {
        self.nodes.iter().map(|n| n.label.as_str())
    }

    /// Connects to the first address that accepts, naming the connection `{name} @ host:port`
    /// so that the broker's connection list shows the node in use. The error is the last
    /// address's when none accepts; callers retry with their back-off.
    pub(crate) async fn connect(&self, name: &str) -> Result<Connection, BrokerError> {
        let mut last = None;
        for (i, node) in self.nodes.iter().enumerate() {
            let props = ConnectionProperties::default()
                .with_connection_name(format!("{name} @ {}", node.label).into());
            let tls = node
                .tls
                .as_ref()
                .map(TlsFiles::lapin_config)
                .unwrap_or_default();
            let attempt = Connection::connect_uri_with_config(
                node.uri.clone(),
                props,
                tls,
                lapin::runtime::default_runtime().amqp()?,
            );
            let error = match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
                Ok(Ok(connection)) => {
                    if i > 0 {
                        tracing::info!(node = %node.label, "connected to a fallback broker address");
                    }
                    return Ok(connection);
                }
                Ok(Err(e)) => {
                    tls_refusal(&e, &node.label).unwrap_or_else(|| BrokerError::from_client(e))
                }
                Err(_) => BrokerError::ConnectTimeout(node.label.clone()),
            };
            if self.nodes.len() > 1 {
                tracing::warn!(node = %node.label, error = %error, "broker address unreachable; trying the next");
            }
            last = Some(error);
        }
        Err(last.unwrap_or_else(|| BrokerError::InvalidAddress("no AMQP URL given".into())))
    }
}

impl FromStr for AmqpAddresses {
    type Err = BrokerError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for AmqpAddresses {
    /// The `host:port` list, without credentials.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let labels: Vec<&str> = self.nodes().collect();
        f.write_str(&labels.join(","))
    }
}

/// The TLS handshake's failure, if that is what `e` is: a certificate refused by either side.
fn tls_refusal(e: &lapin::Error, node: &str) -> Option<BrokerError> {
    let lapin::ErrorKind::IOError(io) = e.kind() else {
        return None;
    };
    let tls = io.get_ref()?.downcast_ref::<rustls::Error>()?;
    Some(BrokerError::TlsHandshake {
        node: node.to_owned(),
        reason: tls.to_string(),
    })
}

/// Opens a connection named `name` to the first reachable of `amqp_url`'s addresses (one URL
/// or several, comma-separated; see [`AmqpAddresses`]).
pub(super) async fn connect(amqp_url: &str, name: &str) -> Result<Connection, BrokerError> {
    AmqpAddresses::parse(amqp_url)?.connect(name).await
}

/// A bad broker address is a configuration error, reported when the consumer (or relay) is
/// built rather than on every reconnect.
pub(crate) fn check_addresses(amqp_url: &str) -> Result<(), ConfigError> {
    AmqpAddresses::parse(amqp_url)
        .map(drop)
        .map_err(|e| ConfigError::InvalidSetting {
            name: "amqp_url",
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_comma_separated_list_in_order() {
        let a = AmqpAddresses::parse(
            "amqp://guest:guest@127.0.0.1:5681/%2f, amqp://guest:guest@127.0.0.1:5682/%2f,,",
        )
        .expect("valid");
        assert_eq!(
            a.nodes().collect::<Vec<_>>(),
            ["127.0.0.1:5681", "127.0.0.1:5682"]
        );
        assert_eq!(a.to_string(), "127.0.0.1:5681,127.0.0.1:5682");
    }

    #[test]
    fn a_single_url_is_a_list_of_one() {
        let a = AmqpAddresses::parse("amqp://127.0.0.1:5672/%2f").expect("valid");
        assert_eq!(a.nodes().count(), 1);
    }

    #[test]
    fn refuses_an_empty_list_and_a_bad_entry_without_showing_the_password() {
        assert!(matches!(
            AmqpAddresses::parse(" , "),
            Err(BrokerError::InvalidAddress(_))
        ));
        let err = AmqpAddresses::parse("amqp://127.0.0.1:5672,http://alice:secret@host:1/")
            .expect_err("http is not AMQP");
        let shown = err.to_string();
        assert!(shown.contains("alice:***@host"), "{shown}");
        assert!(!shown.contains("secret"), "{shown}");
    }
}
