//! Error types of the library. Handler errors live in [`crate::handler`].

/// Invalid configuration, reported before anything touches the database or the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The schema name is not a plain lowercase identifier.
    #[error(
        "invalid schema name {0:?}: use lowercase letters, digits and '_', starting with a letter or '_', at most 63 bytes, not starting with 'pg_'"
    )]
    InvalidSchemaName(String),
    /// A setting is out of its range.
    #[error("invalid setting {name}: {reason}")]
    InvalidSetting {
        /// The setting's name.
        name: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The dedup retention is shorter than the time a copy of a message can still arrive; the
    /// message says which setting, the horizon, and what to set.
    #[error("unsafe retention window: {0}")]
    UnsafeRetentionWindow(String),
    /// The pool allows fewer connections than the pieces sharing it may hold at once: some of
    /// them would wait for a connection on every batch or tick (and time out).
    #[error(
        "the pool allows {max_connections} connections, and what shares it may hold \
         {required} at once ({shares}); set max_connections to at least {required}, run fewer \
         lanes, or turn off what the service does not need"
    )]
    PoolTooSmall {
        /// The pool's `max_connections`.
        max_connections: u32,
        /// The connections its users may hold at once.
        required: u32,
        /// Who holds how many, e.g. `consumer 2 lanes + 1 = 3, relay 2`.
        shares: String,
    },
}

/// A failure talking to the inbox tables.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// PostgreSQL returned an error or could not be reached.
    #[error("inbox database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The embedded migrations could not be applied.
    #[error("inbox migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A value read back from the inbox does not fit the model (e.g. an unknown status).
    #[error("inbox row is corrupt: {0}")]
    Corrupt(String),
}

/// A failure talking to RabbitMQ.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The connection or a channel operation failed.
    #[error(transparent)]
    Amqp(#[from] AmqpError),
    /// The broker negatively confirmed a publish, or returned it as unroutable.
    #[error("RabbitMQ did not accept the message published to {0}")]
    NotConfirmed(String),
    /// A broker address (an entry of the AMQP URL list) is not a valid AMQP URL.
    #[error("invalid AMQP address {0}")]
    InvalidAddress(String),
    /// A TLS file (CA, client certificate or key) cannot be used.
    #[error("TLS {what} {}: {reason}", path.display())]
    TlsFile {
        /// `CA file`, `client certificate` or `client key`.
        what: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// Why it cannot be used.
        reason: String,
    },
    /// The TLS handshake with a broker address failed: its certificate was refused (unknown
    /// CA, another host name, expired) or it refused ours.
    #[error("TLS with RabbitMQ at {node} failed: {reason}")]
    TlsHandshake {
        /// `host:port`.
        node: String,
        /// What rustls reported.
        reason: String,
    },
    /// The TLS settings do not fit together (a certificate without its key, files for a plain
    /// `amqp://` URL).
    #[error("TLS settings: {0}")]
    TlsSettings(String),
    /// A broker address did not accept a connection in time (a paused or partitioned node).
    #[error("RabbitMQ at {0} did not accept a connection in time")]
    ConnectTimeout(String),
    /// A name or property that AMQP carries as a short string is longer than 255 bytes.
    #[error("{what} is {len} bytes long; AMQP carries at most 255")]
    TooLong {
        /// Which field (`message-id`, `header name "…"`, `routing key`, ...).
        what: String,
        /// Its length in bytes.
        len: usize,
    },
}

/// A failure the AMQP client reported: the broker refused an operation or closed the channel
/// or connection, or the connection itself failed.
///
/// Its message says what happened in the broker's words (the reply text names the queue or
/// exchange) and what to do where that is clear; [`std::error::Error::source`] is the client's
/// own error. The client library is not part of this crate's API, so neither is its error type.
#[derive(Debug)]
#[non_exhaustive]
pub struct AmqpError {
    inner: lapin::Error,
}

impl AmqpError {
    pub(crate) fn new(inner: lapin::Error) -> Self {
        Self { inner }
    }

    /// The client's error, for the broker module's classification (not found, fatal...).
    pub(crate) fn client(&self) -> &lapin::Error {
        &self.inner
    }

    /// The broker's reply code (`404`, `406`, `320`...) when the broker closed the channel
    /// or connection; `None` for a failure on this side (network, closed connection).
    pub fn reply_code(&self) -> Option<u16> {
        match self.inner.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
            _ => None,
        }
    }
}

impl std::fmt::Display for AmqpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use lapin::{
            ErrorKind,
            protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError},
        };
        match self.inner.kind() {
            ErrorKind::ProtocolError(amqp) => {
                let reply = amqp.get_message().as_str();
                match amqp.kind() {
                    AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => write!(
                        f,
                        "RabbitMQ has no such queue or exchange ({reply}); declare it, or check \
                         the name and the virtual host"
                    ),
                    AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                    | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED) => write!(
                        f,
                        "RabbitMQ refused access ({reply}); check the user, its password and \
                         its permissions on the virtual host"
                    ),
                    AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => write!(
                        f,
                        "RabbitMQ refused the operation ({reply}); if a queue or exchange \
                         exists with other settings, declare it with the same ones or delete it"
                    ),
                    AMQPErrorKind::Soft(AMQPSoftError::RESOURCELOCKED) => write!(
                        f,
                        "RabbitMQ refused the operation ({reply}); another connection holds \
                         the queue exclusively"
                    ),
                    AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED) => write!(
                        f,
                        "RabbitMQ closed the connection ({reply}); a node stopped or an \
                         operator closed it: the next attempt reconnects"
                    ),
                    AMQPErrorKind::Soft(_) => {
                        write!(f, "RabbitMQ closed the channel ({reply})")
                    }
                    AMQPErrorKind::Hard(_) => {
                        write!(f, "RabbitMQ closed the connection ({reply})")
                    }
                }
            }
            ErrorKind::IOError(io) => write!(
                f,
                "the connection to RabbitMQ failed ({io}); check that the broker runs and is \
                 reachable at the configured address"
            ),
            ErrorKind::MissingHeartbeatError => write!(
                f,
                "RabbitMQ sent no heartbeat in time; the connection is considered lost and the \
                 next attempt reconnects"
            ),
            ErrorKind::InvalidChannelState(..)
            | ErrorKind::InvalidConnectionState(_)
            | ErrorKind::InvalidChannel(_) => write!(
                f,
                "the AMQP channel or connection is closed ({}); the next attempt reopens it",
                self.inner
            ),
            ErrorKind::AuthProviderError(why) => {
                write!(
                    f,
                    "authenticating to RabbitMQ failed ({why}); check the credentials"
                )
            }
            _ => write!(f, "AMQP client error: {}", self.inner),
        }
    }
}

impl std::error::Error for AmqpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.inner)
    }
}

/// Crate-internal conversion of the client's results: a `From` impl would put the client's
/// error type in the public API.
pub(crate) trait AmqpResult<T> {
    /// The client's error as a [`BrokerError::Amqp`].
    fn amqp(self) -> Result<T, BrokerError>;
}

impl<T> AmqpResult<T> for Result<T, lapin::Error> {
    fn amqp(self) -> Result<T, BrokerError> {
        self.map_err(BrokerError::from_client)
    }
}

impl BrokerError {
    /// The client's error as a [`BrokerError::Amqp`].
    pub(crate) fn from_client(e: lapin::Error) -> Self {
        Self::Amqp(AmqpError::new(e))
    }
}

/// Why a consumer stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The inbox store failed in a way the consumer cannot recover from.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The broker failed in a way the consumer cannot recover from.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}
