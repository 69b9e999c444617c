//! Why an operation failed: the one error type of every operation.

use rabbit_inbox::{BrokerError, error::StoreError};

/// Why an operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// The request itself is wrong (missing actor or reason, bad filter).
    #[error("{0}")]
    Invalid(String),
    /// The message it names has no row, tombstone or audit entry for that consumer.
    #[error("{0}")]
    NotFound(String),
    /// The operation would be unsafe and was refused; the message says what would force it.
    #[error("refused: {0}")]
    Refused(String),
    /// The inbox could not be read or written.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The broker could not be reached or refused an action.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// The schema holds no inbox (its tables were never migrated there, or the schema is
    /// another one): see
    /// [`Operations::require_inbox`](crate::Operations::require_inbox).
    #[error("no inbox in schema {schema} (run `inboxctl migrate --schema {schema}`)")]
    NoInbox {
        /// The schema asked for.
        schema: String,
    },
}

impl From<sqlx::Error> for OpsError {
    fn from(e: sqlx::Error) -> Self {
        Self::Store(StoreError::Database(e))
    }
}
