//! Reconciliation: the parking lot against the parked rows, both ways, from redrive's
//! dry-run classification, and by count: the parking lot should hold one copy per parked row
//! that has one (its confirmed parked copy; discarded rows have none) plus each copy parked as
//! a payload conflict. Fewer is a lost copy (`row_without_copy`, a failure); more are
//! duplicates parked (`parked_copies`, a warning: a redrive takes each back and the inbox
//! drops all but one). Copies without a parked row (unknown, PROCESSED, removed by retention)
//! are counted by their own checks, not here.
//!
//! The pass holds the parking lot's lock (see [`crate::redrive`]): it waits for a redrive's
//! pass to end (at most `DOCTOR_LOT_PATIENCE`), and a redrive waits for it.

use chrono::{DateTime, Utc};
use sqlx::{AssertSqlSafe, Row};

use super::{
    check::{Area, Check, Severity, examples},
    check_ids as ids,
    request::DoctorRequest,
};
use crate::{
    error::OpsError,
    operations::Operations,
    progress::NoProgress,
    redrive::{DOCTOR_LOT_PATIENCE, ParkedClass, ParkedKeys, RedriveRequest},
    sql::PARKED_BY_FAILURE,
};
use rabbit_inbox::{broker::ParkingLot, broker::Topology};

impl Operations {
    pub(super) async fn check_reconciliation(&self, request: &DoctorRequest) -> Vec<Check> {
        let area = Area::Reconciliation;
        let (Some(amqp_url), Some(topology)) = (&request.amqp_url, &request.topology) else {
            return vec![
                Check::new(
                    ids::PARKING_LOT_READ,
                    area,
                    Severity::Warn,
                    "parking lot not reconciled: no work queue given",
                )
                .hint("give the consumer's work queue (inboxctl doctor --queue <queue>)"),
            ];
        };
        let lot =
            match ParkingLot::connect(amqp_url, &topology.queue, &topology.parking_queue).await {
                Ok(lot) => lot,
                Err(e) => {
                    return vec![
                        Check::new(
                            ids::PARKING_LOT_READ,
                            area,
                            Severity::Warn,
                            "parking lot not reconciled: the broker could not be reached",
                        )
                        .detail(e.to_string()),
                    ];
                }
            };
        let result = self.reconcile(&lot, request, topology).await;
        lot.close().await;
        result.unwrap_or_else(|e| {
            vec![
                Check::new(
                    ids::PARKING_LOT_READ,
                    area,
                    Severity::Warn,
                    "parking lot not reconciled",
                )
                .detail(e.to_string()),
            ]
        })
    }

    pub(super) async fn reconcile(
        &self,
        lot: &ParkingLot,
        request: &DoctorRequest,
        topology: &Topology,
    ) -> Result<Vec<Check>, OpsError> {
        let area = Area::Reconciliation;
        // Rows parked after this instant may still be on their way to the parking lot.
        let started: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
            .fetch_one(&self.pool)
            .await?;
        let mut seen = ParkedKeys::default();
        let dry_run = RedriveRequest {
            dry_run: true,
            consumer: request.consumer.clone(),
            ..RedriveRequest::default()
        };
        let report = self
            .redrive_seeing(
                lot,
                &dry_run,
                None,
                &NoProgress,
                Some(&mut seen),
                Some(DOCTOR_LOT_PATIENCE),
            )
            .await?;
        let ids_of = |class: ParkedClass| -> Vec<String> {
            report
                .findings
                .iter()
                .filter(|f| f.class == class)
                .filter(|f| {
                    class != ParkedClass::Processed
                        || f.message_id
                            .as_ref()
                            .is_none_or(|id| !seen.processed_conflicts.contains(id))
                })
                .map(|f| f.message_id.clone().unwrap_or_else(|| "(no key)".into()))
                .collect()
        };
        let redrive = format!(
            "inboxctl redrive --schema {} --queue {}",
            self.schema, topology.queue
        );
        let mut rows = Vec::new();

        let unknown = report.class(ParkedClass::Unknown);
        let would_reapply = report.class(ParkedClass::WouldReapply);
        let removed_note = if would_reapply > 0 {
            format!(
                "; {would_reapply} more whose rows retention removed (tombstone kept: a replay \
                 would apply them again)"
            )
        } else {
            String::new()
        };
        rows.push(if unknown == 0 {
            Check::pass(
                ids::PARKED_WITHOUT_ROW,
                area,
                format!(
                    "every one of {} parked message(s) has its inbox row or tombstone",
                    report.examined
                ),
            )
            .detail(removed_note.trim_start_matches("; "))
        } else {
            Check::new(
                ids::PARKED_WITHOUT_ROW,
                area,
                Severity::Fail,
                format!(
                    "{unknown} parked message(s) without an inbox row or tombstone (of {} \
                     read)",
                    report.examined
                ),
            )
            .detail(format!(
                "{}{removed_note}",
                examples(&ids_of(ParkedClass::Unknown), unknown)
            ))
            .hint(format!(
                "the inbox cannot tell whether they were processed: look at each ({redrive} \
                 --dry-run); replay with --force once known safe"
            ))
        });

        let conflicts = seen.processed_conflicts.len() as u64;
        let processed = report
            .class(ParkedClass::Processed)
            .saturating_sub(conflicts);
        rows.push(if processed == 0 {
            Check::pass(
                ids::PROCESSED_IN_PARKING_LOT,
                area,
                "no PROCESSED message in the parking lot",
            )
        } else {
            Check::new(
                ids::PROCESSED_IN_PARKING_LOT,
                area,
                Severity::Fail,
                format!(
                    "{processed} message(s) in the parking lot whose row is PROCESSED (the \
                     effect is applied)"
                ),
            )
            .detail(examples(&ids_of(ParkedClass::Processed), processed))
            .hint(format!(
                "a copy parked after its effect committed (not a payload conflict): find out \
                 why, then remove them ({redrive} --drop-processed --actor <you> --reason <why>)"
            ))
        });

        rows.push(if conflicts == 0 {
            Check::pass(
                ids::PAYLOAD_CONFLICTS,
                area,
                "no payload conflict in the parking lot",
            )
        } else {
            Check::new(
                ids::PAYLOAD_CONFLICTS,
                area,
                Severity::Warn,
                format!(
                    "{conflicts} parked copy(ies) of PROCESSED messages are payload conflicts: a \
                     producer reused a message id with another body"
                ),
            )
            .detail(examples(&seen.processed_conflicts, conflicts))
            .hint(format!(
                "parked by design (the first body's effect is applied): fix the producer, \
                 compare the bodies (inboxctl show <id>), then remove the copies ({redrive} \
                 --drop-processed --actor <you> --reason <why>)"
            ))
        });

        let parked_rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT consumer_name, message_id FROM {} \
             WHERE status IN ({PARKED_BY_FAILURE}) AND discarded_at IS NULL \
               AND ($1::text IS NULL OR consumer_name = $1) \
               AND coalesce(last_failed_at, last_received_at) < $2 \
             ORDER BY first_received_at",
            self.schema.qualify("message_inbox")
        )))
        .persistent(false)
        .bind(request.consumer.as_deref())
        .bind(started)
        .fetch_all(&self.pool)
        .await?;
        let mut missing = Vec::new();
        for r in &parked_rows {
            let key: (String, String) = (r.try_get("consumer_name")?, r.try_get("message_id")?);
            if !seen.keys.contains(&key) {
                missing.push(key.1);
            }
        }
        let scope = if request.consumer.is_some() {
            ""
        } else {
            " (rows of every consumer of the schema: give --consumer when consumers with \
             other queues share it)"
        };
        rows.push(if missing.is_empty() {
            Check::pass(
                ids::ROW_WITHOUT_COPY,
                area,
                format!(
                    "every one of {} parked row(s) has its copy in the parking lot",
                    parked_rows.len()
                ),
            )
        } else {
            let n = missing.len() as u64;
            Check::new(
                ids::ROW_WITHOUT_COPY,
                area,
                Severity::Fail,
                format!(
                    "{n} parked row(s) (PERMANENT_FAILED, POISONED) without their copy in {}{scope}",
                    topology.parking_queue
                ),
            )
            .detail(examples(&missing, n))
            .hint(
                "the parked copy was lost (queue purged or deleted): a redrive cannot bring \
                 these back; republish them from the producer, or reopen each row \
                 (inboxctl reopen) and publish again",
            )
        });

        // By count: one copy per parked row that has one, plus the payload conflicts.
        let with_copy = seen.parked_copies.len() as u64;
        let own: u64 = seen.parked_copies.values().sum();
        let conflicts = seen.conflict_copies;
        let (copies, accounted) = (own + conflicts, with_copy + conflicts);
        let mut duplicated: Vec<(&str, u64)> = seen
            .parked_copies
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|((_, id), n)| (id.as_str(), *n))
            .collect();
        duplicated.sort_unstable();
        let lot_name = &topology.parking_queue;
        rows.push(if duplicated.is_empty() {
            Check::pass(
                ids::PARKED_COPIES,
                area,
                format!(
                    "{copies} copies in {lot_name}: one per parked row with a copy \
                     ({with_copy}) plus {conflicts} payload-conflict copy(ies)"
                ),
            )
        } else {
            let extra = copies - accounted;
            let shown: Vec<String> = duplicated
                .iter()
                .map(|(id, n)| format!("{id} ({n} copies)"))
                .collect();
            Check::new(
                ids::PARKED_COPIES,
                area,
                Severity::Warn,
                format!(
                    "{copies} copies in {lot_name} where the parked rows account for \
                     {accounted} ({with_copy} parked row(s), one copy each, plus {conflicts} \
                     payload-conflict copy(ies)): {extra} more, duplicates of {} parked \
                     message(s)",
                    duplicated.len()
                ),
            )
            .detail(examples(&shown, duplicated.len() as u64))
            .hint(format!(
                "duplicates parked (a copy parked again before its first was noted, or \
                 redelivered by the broker): nothing is lost or applied twice. A redrive takes \
                 every copy back, each once, and the inbox drops all but the first as \
                 duplicates ({redrive} --actor <you> --reason <why>)"
            ))
        });
        Ok(rows)
    }
}
