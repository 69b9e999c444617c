//! The latest result of the readiness check: what `/readyz` answers from, written by the
//! background check.

use std::sync::RwLock;

use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

use crate::state::BROKER_TIMEOUT;

/// One dependency's last check. The error is generic; its text is in the server's log.
#[derive(Clone, Debug, Serialize, ToSchema)]
#[schema(as = ReadinessCheck)]
pub(crate) struct Check {
    /// It answered.
    pub(crate) ok: bool,
    /// Why not: `unreachable`, `no answer in time` or `not checked yet`.
    error: Option<&'static str>,
}

impl Check {
    pub(crate) fn of<E: std::fmt::Display>(
        what: &str,
        result: Result<Result<(), E>, tokio::time::error::Elapsed>,
    ) -> Self {
        let error = match result {
            Ok(Ok(())) => None,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "readiness: {what} is unreachable");
                Some("unreachable")
            }
            Err(_) => {
                tracing::warn!("readiness: {what} did not answer within {BROKER_TIMEOUT:?}");
                Some("no answer in time")
            }
        };
        Self {
            ok: error.is_none(),
            error,
        }
    }

    const fn pending() -> Self {
        Self {
            ok: false,
            error: Some("not checked yet"),
        }
    }
}

#[derive(Clone, Debug, Serialize, ToSchema)]
pub(crate) struct Snapshot {
    /// PostgreSQL.
    pub(crate) database: Check,
    /// RabbitMQ.
    pub(crate) broker: Check,
    /// When the checks ran.
    pub(crate) checked_at: Option<DateTime<Utc>>,
}

/// The latest readiness check, shared between the background task and `/readyz`.
#[derive(Debug)]
pub(crate) struct Readiness {
    latest: RwLock<Snapshot>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self {
            latest: RwLock::new(Snapshot {
                database: Check::pending(),
                broker: Check::pending(),
                checked_at: None,
            }),
        }
    }
}

impl Readiness {
    pub(crate) fn latest(&self) -> Snapshot {
        self.latest
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn set(&self, snapshot: Snapshot) {
        *self
            .latest
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = snapshot;
    }
}
