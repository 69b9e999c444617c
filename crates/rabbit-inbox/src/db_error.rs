//! What a PostgreSQL error means for the message that caused it.
//!
//! A deterministic error (bad data, a violated constraint, an invalid statement, a value over a
//! limit) fails the same way on every retry: it is a permanent failure of that one message,
//! recorded and parked. Only an outage (connection lost, server shutting down, out of
//! resources) says nothing about the message: it is requeued and comes back when the database
//! does. Deadlocks and serialization failures are resolved by running the transaction again.
//! A statement that names a table, column, function, type or schema that does not exist, or
//! one the role may not use, says the deployment is wrong (a missing migration, a
//! `search_path` that resolves a name in the wrong schema, a missing grant), not the message:
//! every message would fail the same way, so none is charged or parked; the deliveries are
//! requeued with back-off until the deployment is fixed.

/// The class of a database error, by SQLSTATE (or by the kind of client error).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DbErrorClass {
    /// Deadlock or serialization failure (40P01, 40001): run the transaction again.
    Transient,
    /// "current transaction is aborted" (25P02): an earlier statement of the same transaction
    /// failed and someone carried on; or the transaction is gone (25P01, and 25006 on the
    /// runtime's read-only-by-default connections: a handler ended it). The culprit is
    /// whoever ran that earlier statement, not necessarily the one that got the error.
    Aborted,
    /// Data exception, integrity violation, syntax or access rule, program limit (classes 22,
    /// 23, 42, 54, except the deployment faults below): the same message fails the same way
    /// again.
    Deterministic,
    /// The service's SQL or grants do not match the database: undefined table (42P01), column
    /// (42703), function (42883), object or type (42704), schema (3F000), or insufficient
    /// privilege (42501). No message can be processed until the deployment is fixed.
    Deployment,
    /// The database cannot serve now: connection errors (08), insufficient resources (53),
    /// operator intervention (57P0x), and every client-side I/O or pool error.
    Outage,
    /// Anything else (a statement timeout, an internal error): may work next time.
    Other,
}

impl DbErrorClass {
    /// Classifies a SQLSTATE.
    pub(crate) fn of_sqlstate(code: &str) -> Self {
        match code {
            "40001" | "40P01" => DbErrorClass::Transient,
            "25P02" | "25P01" | "25006" => DbErrorClass::Aborted,
            c if is_deployment_fault(c) => DbErrorClass::Deployment,
            c if c.starts_with("57P0") => DbErrorClass::Outage,
            c => match c.get(..2) {
                Some("22" | "23" | "42" | "54") => DbErrorClass::Deterministic,
                Some("08" | "53") => DbErrorClass::Outage,
                _ => DbErrorClass::Other,
            },
        }
    }

    /// Classifies an sqlx error.
    pub(crate) fn of(e: &sqlx::Error) -> Self {
        match e {
            sqlx::Error::Database(db) => db
                .code()
                .map_or(DbErrorClass::Other, |c| Self::of_sqlstate(&c)),
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::BeginFailed => DbErrorClass::Outage,
            _ => DbErrorClass::Other,
        }
    }
}

/// SQLSTATEs that say the deployment, not the message, is wrong (see [`DbErrorClass::Deployment`]).
pub(crate) const DEPLOYMENT_SQLSTATES: [&str; 6] = ["42P01", "42703", "42883", "42704", "3F000", "42501"];

fn is_deployment_fault(sqlstate: &str) -> bool {
    DEPLOYMENT_SQLSTATES.contains(&sqlstate)
}

/// The SQLSTATE of a database error, if it has one.
pub(crate) fn sqlstate(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// The error code recorded for a deterministic database error of `sqlstate`'s class.
pub(crate) fn deterministic_code(sqlstate: &str) -> &'static str {
    match sqlstate.get(..2) {
        Some("23") => "db_constraint",
        Some("22") => "db_invalid_data",
        Some("42") => "db_invalid_statement",
        Some("54") => "db_limit_exceeded",
        _ => "db_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified_by_class() {
        use DbErrorClass::*;
        for (code, class) in [
            ("40001", Transient),
            ("40P01", Transient),
            ("25P02", Aborted),
            ("25006", Aborted),
            ("22001", Deterministic),
            ("23505", Deterministic),
            ("23503", Deterministic),
            ("42601", Deterministic),
            ("42804", Deterministic),
            ("42P01", Deployment),
            ("42703", Deployment),
            ("42883", Deployment),
            ("42704", Deployment),
            ("3F000", Deployment),
            ("42501", Deployment),
            ("54000", Deterministic),
            ("08006", Outage),
            ("53300", Outage),
            ("57P01", Outage),
            ("57P03", Outage),
            ("57014", Other),
            ("XX000", Other),
        ] {
            assert_eq!(DbErrorClass::of_sqlstate(code), class, "{code}");
        }
        assert_eq!(deterministic_code("23505"), "db_constraint");
        assert_eq!(deterministic_code("54000"), "db_limit_exceeded");
    }
}
