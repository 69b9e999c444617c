//! One row of the doctor's report: what was checked, how bad it is, what to do about it.

use std::fmt::Display;

use serde::Serialize;

/// Most example message ids in one row.
const MAX_EXAMPLES: usize = 5;

/// How bad a finding is. Ordered: the report's worst is the maximum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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

/// One checked item.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Check {
    /// Stable identifier (`schema.primary_key`, see [`check_ids`](super::check_ids)).
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
    pub(super) fn new(
        id: &'static str,
        area: Area,
        severity: Severity,
        summary: impl Into<String>,
    ) -> Self {
        Self {
            id,
            area,
            severity,
            summary: summary.into(),
            detail: None,
            hint: None,
        }
    }

    pub(super) fn pass(id: &'static str, area: Area, summary: impl Into<String>) -> Self {
        Self::new(id, area, Severity::Pass, summary)
    }

    pub(super) fn detail(mut self, detail: impl Into<String>) -> Self {
        let detail = detail.into();
        self.detail = (!detail.is_empty()).then_some(detail);
        self
    }

    pub(super) fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// A check that could not run: a failure, since nothing is known.
    pub(super) fn not_run(id: &'static str, area: Area, error: impl Display) -> Self {
        Self::new(id, area, Severity::Fail, "could not be checked").detail(error.to_string())
    }
}

/// `ids` as `a, b, c (and 7 more)`.
pub(super) fn examples(ids: &[String], total: u64) -> String {
    let shown: Vec<&str> = ids.iter().take(MAX_EXAMPLES).map(String::as_str).collect();
    let more = total.saturating_sub(shown.len() as u64);
    if more > 0 {
        format!("{} (and {more} more)", shown.join(", "))
    } else {
        shown.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_are_capped() {
        let ids: Vec<String> = (0..8).map(|i| format!("m{i}")).collect();
        assert_eq!(examples(&ids, 8), "m0, m1, m2, m3, m4 (and 3 more)");
        assert_eq!(examples(&ids[..2], 2), "m0, m1");
    }
}
