//! Privacy checks: stored payloads against the payload policy.

use std::collections::BTreeMap;

use sqlx::{AssertSqlSafe, Row};

use super::{
    check::{Area, Check, Severity},
    check_ids as ids,
    request::DoctorRequest,
};
use crate::{error::OpsError, operations::Operations};
use rabbit_inbox::{ledger_sql::PROCESSED, privacy::PayloadStorage};

impl Operations {
    pub(super) async fn check_privacy(
        &self,
        request: &DoctorRequest,
    ) -> Result<Vec<Check>, OpsError> {
        // One pass over the rows that keep a payload (a scan of the table).
        let rows = sqlx::query(AssertSqlSafe(format!(
            "SELECT message_type, status = {PROCESSED} AS processed, count(*) AS kept, \
               count(*) FILTER (WHERE payload_key_id IS NULL) AS clear \
             FROM {} WHERE payload IS NOT NULL AND ($1::text IS NULL OR consumer_name = $1) \
             GROUP BY 1, 2 ORDER BY 1, 2",
            self.schema.qualify("message_inbox")
        )))
        .persistent(false)
        .bind(request.consumer.as_deref())
        .fetch_all(&self.pool)
        .await?;
        let mut over_kept: BTreeMap<String, i64> = BTreeMap::new();
        let mut clear: BTreeMap<String, i64> = BTreeMap::new();
        for r in &rows {
            let message_type: String = r.try_get("message_type")?;
            let processed: bool = r.try_get("processed")?;
            let kept: i64 = r.try_get("kept")?;
            let in_clear: i64 = r.try_get("clear")?;
            let allowed = match request.storage_of(&message_type) {
                PayloadStorage::Always => true,
                PayloadStorage::FailedOnly => !processed,
                // A setting this doctor does not know allows nothing it can vouch for.
                PayloadStorage::Never | _ => false,
            };
            if !allowed {
                *over_kept.entry(message_type.clone()).or_default() += kept;
            }
            if request.payload_encrypted && in_clear > 0 {
                *clear.entry(message_type).or_default() += in_clear;
            }
        }
        let per_type = |m: &BTreeMap<String, i64>| {
            m.iter()
                .map(|(t, n)| format!("{t}: {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let storage = if over_kept.is_empty() {
            Check::pass(
                ids::PAYLOAD_STORAGE,
                Area::Privacy,
                "stored payloads match the payload policy",
            )
        } else {
            Check::new(
                ids::PAYLOAD_STORAGE,
                Area::Privacy,
                Severity::Warn,
                format!(
                    "{} row(s) keep a full payload their type's policy does not allow",
                    over_kept.values().sum::<i64>()
                ),
            )
            .detail(per_type(&over_kept))
            .hint(
                "written under an earlier policy or by another version: retention's payload \
                 scrub removes them (inboxctl cleanup --scrub-after ...), or NULL the payload \
                 column of those rows",
            )
        };
        let encryption = if !request.payload_encrypted {
            Check::pass(
                ids::PAYLOAD_ENCRYPTION,
                Area::Privacy,
                "payload encryption not configured",
            )
        } else if clear.is_empty() {
            Check::pass(
                ids::PAYLOAD_ENCRYPTION,
                Area::Privacy,
                "every stored payload is encrypted",
            )
        } else {
            Check::new(
                ids::PAYLOAD_ENCRYPTION,
                Area::Privacy,
                Severity::Warn,
                format!(
                    "{} stored payload(s) in clear although encryption is configured",
                    clear.values().sum::<i64>()
                ),
            )
            .detail(per_type(&clear))
            .hint(
                "written before encryption was enabled: scrub them with retention, or let them \
                 age out",
            )
        };
        Ok(vec![storage, encryption])
    }
}
