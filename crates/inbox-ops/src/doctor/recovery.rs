//! Recovery checks: stale PROCESSING rows and lost retries, from recovery's dry run.

use std::collections::BTreeSet;

use sqlx::AssertSqlSafe;

use super::{
    check::{Area, Check, Severity, examples},
    check_ids as ids,
    request::DoctorRequest,
};
use crate::{
    error::OpsError,
    operations::Operations,
    recover::{RecoverRequest, RecoveryCause, RecoveryPolicy},
    sql::OPEN,
};

/// Most rows recovery's dry run lists per consumer.
const RECOVERY_SCAN_LIMIT: usize = 10_000;

impl Operations {
    pub(super) async fn consumers_with_open_rows(
        &self,
        request: &DoctorRequest,
    ) -> Result<Vec<String>, OpsError> {
        if let Some(c) = &request.consumer {
            return Ok(vec![c.clone()]);
        }
        Ok(sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT DISTINCT consumer_name FROM {} \
             WHERE status IN ({OPEN}) ORDER BY 1",
            self.schema.qualify("message_inbox")
        )))
        .persistent(false)
        .fetch_all(&self.pool)
        .await?)
    }

    pub(super) async fn check_recovery(
        &self,
        request: &DoctorRequest,
    ) -> Result<Vec<Check>, OpsError> {
        let work_queue = request
            .topology
            .as_ref()
            .map_or_else(|| "<queue>".to_owned(), |t| t.queue.clone());
        let mut stale: Vec<String> = Vec::new();
        let mut lost: Vec<String> = Vec::new();
        let (mut stale_n, mut lost_n) = (0u64, 0u64);
        let mut consumers_stale = BTreeSet::new();
        let mut consumers_lost = BTreeSet::new();
        for consumer in self.consumers_with_open_rows(request).await? {
            let preview = self
                .recover_preview(&RecoverRequest {
                    consumer: consumer.clone(),
                    work_queue: work_queue.clone(),
                    policy: RecoveryPolicy::Retry,
                    retry: request.retry.clone(),
                    grace: request.recovery_grace,
                    limit: RECOVERY_SCAN_LIMIT,
                    dry_run: true,
                })
                .await?;
            for m in preview.messages {
                if m.cause == RecoveryCause::RetryLost {
                    lost_n += 1;
                    consumers_lost.insert(consumer.clone());
                    lost.push(m.message_id);
                } else {
                    stale_n += 1;
                    consumers_stale.insert(consumer.clone());
                    stale.push(m.message_id);
                }
            }
        }
        let command = |consumers: &BTreeSet<String>| {
            let consumer = consumers.iter().next().map_or("<consumer>", String::as_str);
            format!(
                "inboxctl recover --schema {} --consumer {consumer} --queue {work_queue} \
                 --actor <you> --reason <why> (try --dry-run first)",
                self.schema
            )
        };
        let stale_check = if stale_n == 0 {
            Check::pass(
                ids::STALE_PROCESSING,
                Area::Recovery,
                "no stale PROCESSING rows",
            )
        } else {
            // Recovery on the consumer's timer may be about to take them over: a warning.
            Check::new(
                ids::STALE_PROCESSING,
                Area::Recovery,
                Severity::Warn,
                format!("{stale_n} PROCESSING row(s) with an expired lease or gone stale"),
            )
            .detail(format!(
                "{}; consumers: {}",
                examples(&stale, stale_n),
                consumers_stale
                    .iter()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .hint(command(&consumers_stale))
        };
        let lost_check = if lost_n == 0 {
            Check::pass(ids::LOST_RETRIES, Area::Recovery, "no lost retries")
        } else {
            Check::new(
                ids::LOST_RETRIES,
                Area::Recovery,
                Severity::Fail,
                format!(
                    "{lost_n} RETRYABLE_FAILED row(s) whose retry never came back (tier delay \
                     + {} grace passed)",
                    rabbit_inbox::retention::human(request.recovery_grace)
                ),
            )
            .detail(format!(
                "{}; consumers: {}",
                examples(&lost, lost_n),
                consumers_lost
                    .iter()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .hint(command(&consumers_lost))
        };
        Ok(vec![stale_check, lost_check])
    }
}
