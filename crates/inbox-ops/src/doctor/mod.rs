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

use std::{collections::BTreeMap, fmt::Display, time::Duration};

use serde::Serialize;

use super::Operations;
use rabbit_inbox::{
    ConsumerConfig, broker::Topology, privacy::PayloadStorage, retention::RetentionPolicy,
    retry::RetryPolicy,
};

mod privacy;
mod reconciliation;
mod recovery;
mod retention;
mod schema;
#[cfg(feature = "management")]
mod topology;

/// Most example message ids in one row.
const MAX_EXAMPLES: usize = 5;

/// Most rows recovery's dry run lists per consumer.
const RECOVERY_SCAN_LIMIT: usize = 10_000;

/// How bad a finding is. Ordered: the report's worst is the maximum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Severity {
    /// As the checklist wants it.
    Pass,
    /// Not checked, or a risk worth a look; nothing is known to be lost or applied twice.
    Warn,
    /// Broken: messages can be lost, stuck or applied twice until it is fixed.
    Fail,
}

impl Severity {
    /// Its name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Pass => "pass",
            Severity::Warn => "warn",
            Severity::Fail => "fail",
        }
    }
}

/// The part of the installation a check looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Area {
    /// Tables, keys, indexes and constraints of the inbox schema.
    Schema,
    /// Queues as the broker has them declared.
    Broker,
    /// The retention policy against the redelivery horizon.
    Retention,
    /// Rows whose path through the broker was lost.
    Recovery,
    /// Parking lot and parked rows against each other.
    Reconciliation,
    /// Stored payloads against the payload policy.
    Privacy,
}

impl Area {
    /// Its name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Area::Schema => "schema",
            Area::Broker => "broker",
            Area::Retention => "retention",
            Area::Recovery => "recovery",
            Area::Reconciliation => "reconciliation",
            Area::Privacy => "privacy",
        }
    }
}

/// Identifiers of the checks, stable for scripts and tests.
pub mod check_ids {
    /// Every library migration applied, none unknown or failed.
    pub const MIGRATIONS: &str = "schema.migrations";
    /// `message_inbox` (and `inbox_tombstone`) keyed by `(message_id, consumer_name)`.
    pub const PRIMARY_KEY: &str = "schema.primary_key";
    /// The indexes the migrations create are present and valid.
    pub const INDEXES: &str = "schema.indexes";
    /// The status check constraint is present, complete and validated.
    pub const STATUS_CHECK: &str = "schema.status_check";
    /// The topology could not be read (no management API, no queue given).
    pub const TOPOLOGY: &str = "broker.topology";
    /// The work queue and its dead-letter route.
    pub const WORK_QUEUE: &str = "broker.work_queue";
    /// The retry tiers: TTL and dead-letter route back.
    pub const RETRY_TIERS: &str = "broker.retry_tiers";
    /// The parking lot.
    pub const PARKING_LOT: &str = "broker.parking_lot";
    /// The dedup window against the redelivery horizon.
    pub const RETENTION_WINDOW: &str = "retention.window";
    /// PROCESSING rows whose lease expired or that went stale.
    pub const STALE_PROCESSING: &str = "recovery.stale_processing";
    /// RETRYABLE_FAILED rows whose retry copy never came back.
    pub const LOST_RETRIES: &str = "recovery.lost_retries";
    /// The parking lot could not be read.
    pub const PARKING_LOT_READ: &str = "reconciliation.parking_lot";
    /// Parked copies the inbox has neither a row nor a tombstone for.
    pub const PARKED_WITHOUT_ROW: &str = "reconciliation.parked_without_row";
    /// Parked rows without their copy in the parking lot.
    pub const ROW_WITHOUT_COPY: &str = "reconciliation.row_without_copy";
    /// Copies of PROCESSED messages in the parking lot (payload conflicts aside).
    pub const PROCESSED_IN_PARKING_LOT: &str = "reconciliation.processed_in_parking_lot";
    /// Parked payload conflicts: a producer reused a message id with another body.
    pub const PAYLOAD_CONFLICTS: &str = "reconciliation.payload_conflicts";
    /// More copies in the parking lot than the parked rows (one each) and the payload
    /// conflicts account for: duplicates parked.
    pub const PARKED_COPIES: &str = "reconciliation.parked_copies";
    /// Payloads kept although the storage policy says not to.
    pub const PAYLOAD_STORAGE: &str = "privacy.payload_storage";
    /// Payloads kept in clear although encryption is configured.
    pub const PAYLOAD_ENCRYPTION: &str = "privacy.encryption";
}

use check_ids as ids;

/// One checked item.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Stable identifier (`schema.primary_key`, see [`check_ids`]).
    pub id: &'static str,
    /// Area.
    pub area: Area,
    /// Pass, warn or fail.
    pub severity: Severity,
    /// One line: what was found.
    pub summary: String,
    /// Details: counts, example ids, the values read.
    pub detail: Option<String>,
    /// What to do about it (for warn and fail).
    pub hint: Option<String>,
}

impl Check {
    fn new(id: &'static str, area: Area, severity: Severity, summary: impl Into<String>) -> Self {
        Self {
            id,
            area,
            severity,
            summary: summary.into(),
            detail: None,
            hint: None,
        }
    }

    fn pass(id: &'static str, area: Area, summary: impl Into<String>) -> Self {
        Self::new(id, area, Severity::Pass, summary)
    }

    fn detail(mut self, detail: impl Into<String>) -> Self {
        let detail = detail.into();
        self.detail = (!detail.is_empty()).then_some(detail);
        self
    }

    fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// A check that could not run: a failure, since nothing is known.
    fn not_run(id: &'static str, area: Area, error: impl Display) -> Self {
        Self::new(id, area, Severity::Fail, "could not be checked").detail(error.to_string())
    }
}

/// What [`Operations::doctor`] found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
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

/// What the installation is supposed to be: the consumer's configuration, as far as the
/// checks need it, and where the broker is.
#[derive(Clone, Debug)]
pub struct DoctorRequest {
    /// Check this consumer's rows; `None`: every consumer of the schema.
    pub consumer: Option<String>,
    /// The broker: an AMQP URL, or a cluster's as a comma-separated list. `None`: broker and
    /// reconciliation checks are skipped (a warn row).
    pub amqp_url: Option<String>,
    /// The management HTTP API (`http://user:password@host:15672`, several separated by
    /// commas, or `https://`); `None`: each AMQP URL's host, `http://host:15672` (`https://host:15671`
    /// for `amqps://`), with the first URL's credentials.
    /// The first address that answers is read. Read only with the feature `management`.
    pub management_url: Option<String>,
    /// The consumer's queues. `None`: broker and reconciliation checks are skipped.
    pub topology: Option<Topology>,
    /// The consumer's retry tiers and attempt budget.
    pub retry: RetryPolicy,
    /// The consumer's prefetch (the quorum delivery limit must exceed attempts + prefetch).
    pub prefetch: u16,
    /// The retention the consumer (or `inboxctl cleanup`) applies; `None`: none, rows are
    /// kept until removed by hand.
    pub retention: Option<RetentionPolicy>,
    /// Which bodies are kept for types without their own entry.
    pub payload_storage: PayloadStorage,
    /// Which bodies are kept, per message type.
    pub payload_storage_by_type: BTreeMap<String, PayloadStorage>,
    /// Stored payloads are supposed to be encrypted.
    pub payload_encrypted: bool,
    /// Added to a retry tier's delay before a retry counts as lost.
    pub recovery_grace: Duration,
}

impl Default for DoctorRequest {
    /// Every consumer, no broker, the library's retry and payload defaults, no retention.
    fn default() -> Self {
        Self {
            consumer: None,
            amqp_url: None,
            management_url: None,
            topology: None,
            retry: RetryPolicy::default(),
            prefetch: 1000,
            retention: None,
            payload_storage: PayloadStorage::default(),
            payload_storage_by_type: BTreeMap::new(),
            payload_encrypted: false,
            recovery_grace: Duration::from_secs(60),
        }
    }
}

impl DoctorRequest {
    /// The checks of the consumer configured by `config`, on the broker at `amqp_url`. The
    /// retention policy and the recovery grace are not part of a consumer's configuration:
    /// they keep their defaults unless set.
    pub fn for_consumer(config: &ConsumerConfig, amqp_url: impl Into<String>) -> Self {
        Self {
            consumer: Some(config.consumer_name.clone()),
            amqp_url: Some(amqp_url.into()),
            topology: Some(config.topology.clone()),
            retry: config.retry.clone(),
            prefetch: config.prefetch,
            payload_storage: config.payload_storage,
            payload_storage_by_type: config.privacy.storage.clone(),
            payload_encrypted: config.privacy.encryption.is_some(),
            ..Self::default()
        }
    }

    fn storage_of(&self, message_type: &str) -> PayloadStorage {
        self.payload_storage_by_type
            .get(message_type)
            .copied()
            .unwrap_or(self.payload_storage)
    }
}

/// `ids` as `a, b, c (and 7 more)`.
fn examples(ids: &[String], total: u64) -> String {
    let shown: Vec<&str> = ids.iter().take(MAX_EXAMPLES).map(String::as_str).collect();
    let more = total.saturating_sub(shown.len() as u64);
    if more > 0 {
        format!("{} (and {more} more)", shown.join(", "))
    } else {
        shown.join(", ")
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

    #[test]
    fn examples_are_capped() {
        let ids: Vec<String> = (0..8).map(|i| format!("m{i}")).collect();
        assert_eq!(examples(&ids, 8), "m0, m1, m2, m3, m4 (and 3 more)");
        assert_eq!(examples(&ids[..2], 2), "m0, m1");
    }
}
