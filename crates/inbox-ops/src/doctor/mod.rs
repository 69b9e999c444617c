//! Doctor: a live installation checked against the inbox review checklist, one row per check
//! with a severity and what to do about it.
//!
//! | area             | checks                                                              |
//! |------------------|---------------------------------------------------------------------|
//! | `schema`         | migrations current; primary key `(message_id, consumer_name)`; the  |
//! |                  | migrations' indexes present and valid; status check validated       |
//! | `broker`         | read from the broker (management HTTP API): work queue dead-letters |
//! |                  | to the first retry tier, tiers have a TTL and dead-letter back,     |
//! |                  | parking lot exists, queue types, quorum delivery limit and          |
//! |                  | at-least-once dead-lettering                                        |
//! | `retention`      | dedup window not shorter than the redelivery horizon                |
//! | `recovery`       | no stale PROCESSING rows, no lost retries (recovery's dry run)      |
//! | `reconciliation` | parking lot against parked rows, both ways (redrive's dry run), and |
//! |                  | by count (duplicates parked); payload conflicts (parked by design)  |
//! |                  | apart from other PROCESSED                                          |
//! | `privacy`        | stored payloads as the payload policy allows                        |
//!
//! Read-only: nothing is changed, and the parking lot is read as redrive's dry run reads it
//! (each copy held unacked for the pass, then put back in its place), under the parking lot's
//! lock, so a redrive never runs beside the pass and sees only part of the parking lot. A check that cannot run
//! (a database error) is a `fail` row saying why; a management API that does not answer is a
//! `warn` row (the topology was not checked), never an error of the whole run.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::operations::Operations;

pub mod check_ids;

mod check;
mod privacy;
mod reconciliation;
mod recovery;
mod request;
mod retention;
mod schema;
#[cfg(feature = "management")]
mod topology;

pub use check::{Area, Check, Severity};
pub use request::DoctorRequest;

use check_ids as ids;

/// What [`Operations::doctor`] found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DoctorReport {
    /// The inbox schema checked.
    pub schema: String,
    /// The consumer whose rows were checked; `None`: every consumer of the schema.
    pub consumer: Option<String>,
    /// The worst severity of all checks.
    pub worst: Severity,
    /// Checks per severity.
    pub counts: BTreeMap<&'static str, usize>,
    /// Every check, in checklist order.
    pub checks: Vec<Check>,
}

impl DoctorReport {
    fn new(schema: String, consumer: Option<String>, checks: Vec<Check>) -> Self {
        let worst = checks
            .iter()
            .map(|c| c.severity)
            .max()
            .unwrap_or(Severity::Pass);
        let mut counts = BTreeMap::new();
        for c in &checks {
            *counts.entry(c.severity.as_str()).or_default() += 1;
        }
        Self {
            schema,
            consumer,
            worst,
            counts,
            checks,
        }
    }

    /// The check with `id`, if it ran.
    pub fn check(&self, id: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.id == id)
    }

    /// The severity of the check with `id`, if it ran.
    pub fn severity(&self, id: &str) -> Option<Severity> {
        self.check(id).map(|c| c.severity)
    }
}

impl Operations {
    /// Checks the installation against the inbox review checklist (see the module docs).
    /// Never fails as a whole: what cannot be checked is a row of its own.
    pub async fn doctor(&self, request: &DoctorRequest) -> DoctorReport {
        let mut checks = Vec::new();
        checks.push(
            self.check_migrations()
                .await
                .unwrap_or_else(|e| Check::not_run(ids::MIGRATIONS, Area::Schema, e)),
        );
        checks.push(
            self.check_primary_keys()
                .await
                .unwrap_or_else(|e| Check::not_run(ids::PRIMARY_KEY, Area::Schema, e)),
        );
        checks.push(
            self.check_indexes()
                .await
                .unwrap_or_else(|e| Check::not_run(ids::INDEXES, Area::Schema, e)),
        );
        checks.push(
            self.check_status_constraint()
                .await
                .unwrap_or_else(|e| Check::not_run(ids::STATUS_CHECK, Area::Schema, e)),
        );
        #[cfg(feature = "management")]
        checks.extend(self.check_topology(request).await);
        #[cfg(not(feature = "management"))]
        checks.push(topology_not_checked());
        checks.push(self.check_retention(request));
        match self.check_recovery(request).await {
            Ok(rows) => checks.extend(rows),
            Err(e) => checks.push(Check::not_run(ids::STALE_PROCESSING, Area::Recovery, e)),
        }
        checks.extend(self.check_reconciliation(request).await);
        match self.check_privacy(request).await {
            Ok(rows) => checks.extend(rows),
            Err(e) => checks.push(Check::not_run(ids::PAYLOAD_STORAGE, Area::Privacy, e)),
        }
        DoctorReport::new(
            self.schema.as_str().to_owned(),
            request.consumer.clone(),
            checks,
        )
    }
}

/// The topology check of a build without the management API: a warning, never a failure.
#[cfg(not(feature = "management"))]
fn topology_not_checked() -> Check {
    Check::new(
        ids::TOPOLOGY,
        Area::Broker,
        Severity::Warn,
        "broker topology not checked: inbox-ops was built without its management API",
    )
    .hint("run inboxctl doctor (built with it), or enable the feature `management` of inbox-ops")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worst_severity_and_counts() {
        let report = DoctorReport::new(
            "s".into(),
            None,
            vec![
                Check::pass(ids::MIGRATIONS, Area::Schema, "ok"),
                Check::new(ids::TOPOLOGY, Area::Broker, Severity::Warn, "not checked"),
            ],
        );
        assert_eq!(report.worst, Severity::Warn);
        assert_eq!(report.counts.get("warn"), Some(&1));
        assert_eq!(report.severity(ids::MIGRATIONS), Some(Severity::Pass));
        assert!(Severity::Fail > Severity::Warn && Severity::Warn > Severity::Pass);
    }
}
