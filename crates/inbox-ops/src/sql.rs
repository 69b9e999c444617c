//! The SQL text the operations build: statements formatted from the schema's qualified table
//! names (never from a request's values, which are bound), and the fragments several of them
//! share. Statuses are spliced from the core's [`rabbit_inbox::ledger_sql`] sets, and from the
//! ones below where the operations need another grouping.

use rabbit_inbox::{ledger_sql::Statuses, status::InboxStatus};
use sqlx::AssertSqlSafe;

/// The open statuses: a row being worked on or waiting for its retry, which a delivery or
/// recovery still moves on.
pub(crate) const OPEN: Statuses =
    Statuses(&[InboxStatus::Processing, InboxStatus::RetryableFailed]);

/// The parked statuses a failure sets (the consumer parked the copy itself); not
/// MANUAL_REVIEW, where recovery sets a row aside for an operator.
pub(crate) const PARKED_BY_FAILURE: Statuses =
    Statuses(&[InboxStatus::PermanentFailed, InboxStatus::Poisoned]);

/// A statement formatted from qualified table names and fixed text only.
pub(crate) fn sql(text: String) -> AssertSqlSafe<String> {
    AssertSqlSafe(text)
}

/// Common table expressions naming the consumers with rows in `table` (narrowed by `extra`,
/// a condition followed by `AND`, or nothing) as `{name} (consumer_name)`: the one in the
/// placeholder `consumer` if it is not NULL and has such rows, else every one, found by
/// skipping through an index that leads with `consumer_name` (one probe per consumer,
/// whatever the number of rows). The statement must be `WITH RECURSIVE`.
pub(crate) fn consumers_of(name: &str, table: &str, extra: &str, consumer: &str) -> String {
    format!(
        "{name}_all (consumer_name) AS ( \
           (SELECT consumer_name FROM {table} WHERE {extra} {consumer}::text IS NULL \
             ORDER BY consumer_name LIMIT 1) \
           UNION ALL \
           SELECT (SELECT n.consumer_name FROM {table} n \
                    WHERE {extra} n.consumer_name > c.consumer_name \
                    ORDER BY n.consumer_name LIMIT 1) \
           FROM {name}_all c WHERE c.consumer_name IS NOT NULL), \
         {name} (consumer_name) AS ( \
           SELECT consumer_name FROM {name}_all \
             WHERE {consumer}::text IS NULL AND consumer_name IS NOT NULL \
           UNION ALL \
           SELECT {consumer}::text WHERE {consumer}::text IS NOT NULL \
             AND EXISTS (SELECT FROM {table} WHERE {extra} consumer_name = {consumer}))"
    )
}
