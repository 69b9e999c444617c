//! Retention check: the dedup window against the redelivery horizon.

use super::{
    check::{Area, Check, Severity},
    check_ids as ids,
    request::DoctorRequest,
};
use crate::operations::Operations;

impl Operations {
    pub(super) fn check_retention(&self, request: &DoctorRequest) -> Check {
        let Some(retention) = &request.retention else {
            return Check::pass(
                ids::RETENTION_WINDOW,
                Area::Retention,
                "no retention configured: rows are kept until removed by hand",
            );
        };
        let horizon = retention.redelivery_horizon(&request.retry);
        let verdict = retention
            .validate()
            .and_then(|()| retention.check_window(&request.retry));
        match verdict {
            Ok(()) => Check::pass(
                ids::RETENTION_WINDOW,
                Area::Retention,
                format!(
                    "dedup window {} covers the redelivery horizon {}",
                    rabbit_inbox::retention::human(retention.processed),
                    rabbit_inbox::retention::human(horizon)
                ),
            ),
            Err(e) => Check::new(
                ids::RETENTION_WINDOW,
                Area::Retention,
                Severity::Fail,
                "retention is shorter than the redelivery horizon: a late copy would apply its \
                 effect again",
            )
            .detail(e.to_string())
            .hint("lengthen the retention (or shorten the replay window / retry tiers)"),
        }
    }
}
