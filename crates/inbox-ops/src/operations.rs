//! The handle every operation is a method of: one inbox schema, its pool and (for encrypted
//! payloads) its keyring. Each operation's module adds its own `impl Operations` block.

use std::sync::Arc;

use sqlx::PgPool;

use crate::error::OpsError;
use rabbit_inbox::{error::StoreError, privacy::Keyring, schema::SchemaName};

/// The operations on one inbox schema. Cheap to clone; holds a pool, not a connection.
#[derive(Clone, Debug)]
pub struct Operations {
    pub(crate) pool: PgPool,
    pub(crate) schema: SchemaName,
    pub(crate) keyring: Option<Arc<Keyring>>,
    /// The header ordered consumers carry their sequence numbers in, if known.
    pub(crate) sequence_header: Option<String>,
    #[cfg(feature = "fault-injection")]
    pub(crate) redrive_faults: Arc<crate::fault::RedriveFaults>,
}

impl Operations {
    /// Operations on the inbox in `schema`.
    pub fn new(pool: PgPool, schema: SchemaName) -> Self {
        Self {
            pool,
            schema,
            keyring: None,
            sequence_header: None,
            #[cfg(feature = "fault-injection")]
            redrive_faults: Arc::default(),
        }
    }

    /// Opens encrypted payloads with `keyring` (the consumer's, see
    /// [`rabbit_inbox::privacy::PayloadPrivacy::encrypt_with`]): `show` returns them decrypted and
    /// `recover` can republish them. Without it they stay sealed: `show` says which key sealed
    /// them and `recover` leaves their rows unchanged.
    pub fn with_keyring(mut self, keyring: Arc<Keyring>) -> Self {
        self.keyring = Some(keyring);
        self
    }

    /// The pool the operations run on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The inbox's schema.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// Whether the schema holds an inbox (its `message_inbox` table exists).
    pub async fn inbox_exists(&self) -> Result<bool, OpsError> {
        Ok(sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(self.schema.qualify("message_inbox"))
            .fetch_one(&self.pool)
            .await?)
    }

    /// [`OpsError::NoInbox`] unless the schema holds an inbox: what a front end checks before
    /// reading, so that a wrong or unmigrated schema is named as such, not reported as the
    /// database's error about a missing relation.
    pub async fn require_inbox(&self) -> Result<(), OpsError> {
        if self.inbox_exists().await? {
            Ok(())
        } else {
            Err(OpsError::NoInbox {
                schema: self.schema.as_str().to_owned(),
            })
        }
    }

    /// `error`, or [`OpsError::NoInbox`] when it is a database error and the schema holds no
    /// inbox: how a failure of an operation is told once it happened (no extra statement on
    /// the way to a success).
    pub async fn explain(&self, error: OpsError) -> OpsError {
        match &error {
            OpsError::Store(StoreError::Database(sqlx::Error::Database(_))) => {
                match self.inbox_exists().await {
                    Ok(false) => OpsError::NoInbox {
                        schema: self.schema.as_str().to_owned(),
                    },
                    _ => error,
                }
            }
            _ => error,
        }
    }

    /// Kills to inject into `redrive` (tests); shared by this value's clones.
    #[cfg(feature = "fault-injection")]
    pub fn redrive_faults(&self) -> Arc<crate::fault::RedriveFaults> {
        self.redrive_faults.clone()
    }
}
