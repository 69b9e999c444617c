//! Edit and replay: a parked message whose body was wrong (a producer bug, a value the handler
//! rightly refused) is resolved by a corrected copy that replaces it.
//!
//! The corrected copy is a new message: published to the consumer's work queue with the
//! original's stored headers and properties, under a new id, and a header
//! [`REPLACES_HEADER`] naming the original. The original row becomes PROCESSED (its effect is
//! the replacement's, so a late copy of it is a duplicate) with `replaced_by` naming the
//! replacement, and its parked copy is removed. The row and its stored payload stay, as
//! evidence; the audit entry keeps both bodies' hashes and the JSON paths that changed, never
//! a body value (bodies fall under the consumer's privacy policy, which also governs how the
//! consumer stores the replacement).
//!
//! The new id is derived, not drawn: a UUID v5 ([`REPLACEMENT_NAMESPACE`]) of the original id
//! and the SHA-256 of the edited body's canonical JSON ([`replacement_id`]). The same edit
//! replayed twice has the same id, and the inbox applies it once.
//!
//! The replacement is identified by its AMQP `message-id`: this is for consumers that take
//! their dedup key from it (the default). A consumer keyed on a header or on payload fields
//! would derive the original's key from the copy unless the edit changes it.

use std::{collections::BTreeSet, time::Duration};

use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, PgConnection, Row};
use uuid::Uuid;

use crate::{
    actor::Actor,
    audit::audit,
    error::OpsError,
    operations::Operations,
    progress::NoProgress,
    recover::{RECOVERY_HEADER, Unrepublishable, publish},
    redrive::{ParkedAction, RedriveRequest},
};
use rabbit_inbox::{
    broker::{Broker, OutgoingMessage, ParkingLot},
    canonical_json::canonical_json,
    ledger_sql::PROCESSED,
    status::{InboxStatus, parking_headers},
};

/// Audit action of a parked message replaced by an edited copy.
pub const REPLAY_EDITED: &str = "replay_edited";

/// Header of a replacement: the inbox key of the message it replaces.
pub const REPLACES_HEADER: &str = "x-inbox-replaces";

/// Namespace of the UUID v5 ids of replacements (see [`replacement_id`]). Fixed: changing it
/// would give a replayed edit another id, which the inbox would not recognise as the same.
pub const REPLACEMENT_NAMESPACE: Uuid = Uuid::from_u128(0xcf4a_a3dc_a897_4cd5_b27f_a38e_f346_bfaa);

/// Most changed paths written to the audit entry; the entry also counts them all.
const MAX_AUDITED_PATHS: usize = 1000;

/// Longest a diff may take before it settles for a coarser one.
const DIFF_TIMEOUT: Duration = Duration::from_secs(2);

/// Headers that describe the original's trip through the broker and the inbox, not the
/// message: a replacement is a new message and goes without them.
const TRIP_HEADERS: [&str; 9] = [
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    parking_headers::RETRY_ATTEMPT,
    RECOVERY_HEADER,
];

/// The id of the replacement of `original_id` by a body whose hash is `edited_sha256` (the
/// SHA-256 of its canonical JSON, or of its bytes when it is not JSON): a UUID v5 in
/// [`REPLACEMENT_NAMESPACE`] of the original id, a zero byte and the hash.
pub fn replacement_id(original_id: &str, edited_sha256: &[u8; 32]) -> String {
    let mut name = Vec::with_capacity(original_id.len() + 1 + edited_sha256.len());
    name.extend_from_slice(original_id.as_bytes());
    name.push(0);
    name.extend_from_slice(edited_sha256);
    Uuid::new_v5(&REPLACEMENT_NAMESPACE, &name).to_string()
}

/// Where a replacement goes: the consumer's work queue (through the default exchange, so no
/// other queue bound to the producer's exchange gets a copy), on a connection in
/// publisher-confirm mode.
#[derive(Clone, Copy, Debug)]
pub struct WorkQueue<'a> {
    broker: &'a Broker,
    queue: &'a str,
}

impl<'a> WorkQueue<'a> {
    /// The work queue `queue`, published to through `broker`.
    pub fn new(broker: &'a Broker, queue: &'a str) -> Self {
        Self { broker, queue }
    }

    /// The queue's name.
    pub fn queue(&self) -> &str {
        self.queue
    }
}

/// A parked message to replace by an edited copy.
#[derive(Clone, Debug, Default)]
pub struct ReplayEditedRequest {
    /// The consumer whose row it is.
    pub consumer: String,
    /// The parked message's inbox key.
    pub message_id: String,
    /// The edited body, as it is to be published (JSON when the original was JSON).
    pub body: Vec<u8>,
    /// Compute the diff and the new id only; publish and change nothing.
    pub dry_run: bool,
}

/// How a line of the diff relates the original to the edit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DiffOp {
    /// In both.
    Keep,
    /// Only in the original.
    Remove,
    /// Only in the edit.
    Add,
}

/// One line of the diff, without its line break.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DiffLine {
    /// `keep`, `remove` or `add`.
    pub op: DiffOp,
    /// The line.
    pub text: String,
}

/// What [`Operations::replay_edited`] did (or, in a dry run, would do).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReplayEditedReport {
    /// The replaced message's inbox key.
    pub original_id: String,
    /// The replacement's id ([`replacement_id`]).
    pub replacement_id: String,
    /// The consumer.
    pub consumer: String,
    /// SHA-256 (hex) of the original body's canonical JSON (of its bytes when not JSON).
    pub original_sha256: String,
    /// SHA-256 (hex) of the edited body's canonical JSON (of its bytes when not JSON).
    pub edited_sha256: String,
    /// JSON pointers of the values that differ (`""`: the whole body, when either is not
    /// JSON). Also in the audit entry; the values are not.
    pub changed_paths: Vec<String>,
    /// Line diff of the original against the edit, both pretty-printed when JSON. Holds body
    /// values: shown to the operator, never audited.
    pub diff: Vec<DiffLine>,
    /// Nothing was published or changed.
    pub dry_run: bool,
    /// The replacement was published, and confirmed by the broker.
    pub published: bool,
    /// The original's parked copy was removed from the parking lot.
    pub parked_copy_removed: bool,
    /// The `replay_edited` audit entry written.
    pub audit_id: Option<i64>,
    /// What is left for the operator, if anything (the parked copy could not be removed).
    pub follow_up: Option<String>,
}

/// Everything a replay needs, read and checked.
struct Prepared {
    report: ReplayEditedReport,
    status: InboxStatus,
    message_type: String,
    correlation_id: Option<String>,
    headers: serde_json::Map<String, Value>,
}

/// SHA-256 of a body as the inbox hashes it by default: its canonical JSON, or its bytes.
fn body_sha256(json: Option<&Value>, bytes: &[u8]) -> [u8; 32] {
    match json {
        Some(v) => Sha256::digest(canonical_json(v).as_bytes()).into(),
        None => Sha256::digest(bytes).into(),
    }
}

/// The JSON pointers at which `edited` differs from `original`: a member or element present
/// on one side only, or a value that differs (numbers compared as canonical JSON: `1.0` is
/// `1`).
fn changed_paths(original: &Value, edited: &Value) -> Vec<String> {
    fn escape(key: &str) -> String {
        key.replace('~', "~0").replace('/', "~1")
    }
    fn walk(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for key in keys {
                    let p = format!("{path}/{}", escape(key));
                    match (x.get(key), y.get(key)) {
                        (Some(u), Some(v)) => walk(u, v, &p, out),
                        _ => out.push(p),
                    }
                }
            }
            (Value::Array(x), Value::Array(y)) => {
                for i in 0..x.len().max(y.len()) {
                    let p = format!("{path}/{i}");
                    match (x.get(i), y.get(i)) {
                        (Some(u), Some(v)) => walk(u, v, &p, out),
                        _ => out.push(p),
                    }
                }
            }
            _ if canonical_json(a) == canonical_json(b) => {}
            _ => out.push(path.to_owned()),
        }
    }
    let mut out = Vec::new();
    walk(original, edited, "", &mut out);
    out
}

/// Line diff of `original` against `edited`.
fn line_diff(original: &str, edited: &str) -> Vec<DiffLine> {
    similar::TextDiff::configure()
        .timeout(DIFF_TIMEOUT)
        .diff_lines(original, edited)
        .iter_all_changes()
        .map(|change| {
            let text = change.value();
            let text = text.strip_suffix('\n').unwrap_or(text);
            DiffLine {
                op: match change.tag() {
                    similar::ChangeTag::Equal => DiffOp::Keep,
                    similar::ChangeTag::Delete => DiffOp::Remove,
                    similar::ChangeTag::Insert => DiffOp::Add,
                },
                text: text.strip_suffix('\r').unwrap_or(text).to_owned(),
            }
        })
        .collect()
}

/// A body as diffed: pretty-printed JSON, or its text.
fn diffable(json: Option<&Value>, bytes: &[u8]) -> String {
    json.and_then(|v| serde_json::to_string_pretty(v).ok())
        .unwrap_or_else(|| String::from_utf8_lossy(bytes).into_owned())
}

impl Operations {
    /// Replaces a parked message (PERMANENT_FAILED, POISONED, MANUAL_REVIEW) by an edited copy
    /// (see the module docs): publishes `request.body` through `publisher` with the original's
    /// stored headers and properties, under the id [`replacement_id`] and with
    /// [`REPLACES_HEADER`], confirmed; then marks the row PROCESSED with `replaced_by` and
    /// writes the `replay_edited` audit entry in one transaction; then, with a `lot`, removes
    /// the original's parked copy (audited as a redrive `drop_processed` of that message).
    /// A dry run is [`Operations::replay_edited_preview`]: no broker is touched.
    ///
    /// Refused ([`OpsError::Refused`]): the row is not parked, was already replaced, or its
    /// stored body or headers cannot be read here (not kept, redacted, sealed with a key this
    /// process does not hold). Invalid ([`OpsError::Invalid`]): no such row, an empty body, a
    /// body that is not JSON where the original was, a body that edits nothing.
    pub async fn replay_edited(
        &self,
        publisher: &WorkQueue<'_>,
        lot: Option<&ParkingLot>,
        request: &ReplayEditedRequest,
        actor: &Actor,
    ) -> Result<ReplayEditedReport, OpsError> {
        if request.dry_run {
            return self.replay_edited_preview(request).await;
        }
        if let Some(lot) = lot
            && lot.work_queue() != publisher.queue()
        {
            return Err(OpsError::Invalid(format!(
                "the parking lot is {:?}'s, the replacement goes to {:?}: they must be the same \
                 consumer's",
                lot.work_queue(),
                publisher.queue()
            )));
        }
        let mut tx = self.pool.begin().await?;
        // The row stays locked from the check to the commit, with the publish confirmed in
        // between: no other operator reopens or replaces it meanwhile. The publish comes
        // before the row is marked: killed in between, the row is still parked and nothing
        // says it was replaced, and replaying the same edit publishes the same id again,
        // which the inbox deduplicates. The other order could leave a row marked replaced by
        // a message that was never sent.
        let prepared = self.prepare_replay(&mut tx, request, true).await?;
        let mut report = ReplayEditedReport {
            dry_run: false,
            ..prepared.report
        };
        let mut headers = prepared.headers;
        headers.insert(REPLACES_HEADER.into(), json!(request.message_id));
        let replacement = OutgoingMessage {
            message_id: Some(report.replacement_id.clone()),
            kind: Some(prepared.message_type),
            correlation_id: prepared.correlation_id,
            headers,
            body: request.body.clone(),
        };
        publish(publisher.broker, publisher.queue, &replacement).await?;
        report.published = true;
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {} SET status = {PROCESSED}, processed_at = now(), replaced_by = $3 \
             WHERE consumer_name = $1 AND message_id = $2",
            self.schema.qualify("message_inbox")
        )))
        .persistent(false)
        .bind(&request.consumer)
        .bind(&request.message_id)
        .bind(&report.replacement_id)
        .execute(&mut *tx)
        .await?;
        let audited_paths: Vec<&String> = report
            .changed_paths
            .iter()
            .take(MAX_AUDITED_PATHS)
            .collect();
        let audit_id = audit(
            &mut tx,
            &self.schema,
            actor,
            REPLAY_EDITED,
            Some(&request.consumer),
            Some(&request.message_id),
            json!({
                "replacement_id": report.replacement_id,
                "original_sha256": report.original_sha256,
                "edited_sha256": report.edited_sha256,
                "changed_paths": audited_paths,
                "changed_paths_total": report.changed_paths.len(),
                "previous_status": prepared.status,
                "work_queue": publisher.queue(),
            }),
        )
        .await?;
        tx.commit().await?;
        report.audit_id = Some(audit_id);

        let drop_copy = format!(
            "redrive with drop_processed for message {:?} of consumer {:?} (inboxctl redrive \
             --queue {} --consumer {} --drop-processed --message-id {})",
            request.message_id,
            request.consumer,
            publisher.queue(),
            request.consumer,
            request.message_id
        );
        let Some(lot) = lot else {
            report.follow_up = Some(format!(
                "no parking lot was given: if the original's copy is parked, remove it with a \
                 {drop_copy}"
            ));
            return Ok(report);
        };
        // The row is PROCESSED now: the redrive walker classes its copy `processed` and, asked
        // to drop those, removes it (audited) before acking it.
        let removal = RedriveRequest {
            consumer: Some(request.consumer.clone()),
            message_ids: vec![request.message_id.clone()],
            drop_processed: true,
            ..RedriveRequest::default()
        };
        match self.redrive(lot, &removal, Some(actor), &NoProgress).await {
            Ok(r) => report.parked_copy_removed = r.action(ParkedAction::Removed) > 0,
            Err(e) => {
                tracing::warn!(error = %e, message_id = %request.message_id,
                    "replayed, but the original's parked copy could not be removed");
                report.follow_up = Some(format!(
                    "the original's parked copy could not be removed ({e}): remove it with a \
                     {drop_copy}"
                ));
            }
        }
        Ok(report)
    }

    /// What [`Operations::replay_edited`] would do: the checks, the diff, the hashes and the
    /// new id. Needs neither a broker nor an actor, whatever `request.dry_run` says.
    pub async fn replay_edited_preview(
        &self,
        request: &ReplayEditedRequest,
    ) -> Result<ReplayEditedReport, OpsError> {
        let mut conn = self.pool.acquire().await?;
        Ok(self.prepare_replay(&mut conn, request, false).await?.report)
    }

    /// Reads the row (locked with `lock`) and its kept message, checks both and the edit, and
    /// computes the report of a dry run.
    async fn prepare_replay(
        &self,
        conn: &mut PgConnection,
        request: &ReplayEditedRequest,
        lock: bool,
    ) -> Result<Prepared, OpsError> {
        let (id, consumer) = (request.message_id.as_str(), request.consumer.as_str());
        if id.trim().is_empty() || consumer.trim().is_empty() {
            return Err(OpsError::Invalid(
                "a consumer and a message id are required".into(),
            ));
        }
        if request.body.is_empty() {
            return Err(OpsError::Invalid("the edited body is empty".into()));
        }
        let row = sqlx::query(AssertSqlSafe(format!(
            "SELECT status, replaced_by, message_type, correlation_id FROM {} \
             WHERE consumer_name = $1 AND message_id = $2{}",
            self.schema.qualify("message_inbox"),
            if lock { " FOR UPDATE" } else { "" }
        )))
        .persistent(false)
        .bind(consumer)
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(row) = row else {
            let removed: Option<chrono::DateTime<chrono::Utc>> =
                sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT removed_at FROM {} WHERE consumer_name = $1 AND message_id = $2",
                    self.schema.qualify("inbox_tombstone")
                )))
                .persistent(false)
                .bind(consumer)
                .bind(id)
                .fetch_optional(&mut *conn)
                .await?;
            return Err(match removed {
                Some(at) => OpsError::Refused(format!(
                    "retention removed the row of {id} for {consumer} on {at}, and its body with \
                     it: there is nothing to edit; the producer must send a corrected message"
                )),
                None => {
                    OpsError::NotFound(format!("no inbox row for {id} and consumer {consumer}"))
                }
            });
        };
        let status: InboxStatus = row.try_get::<String, _>("status")?.parse()?;
        if let Some(by) = row.try_get::<Option<String>, _>("replaced_by")? {
            return Err(OpsError::Refused(format!(
                "{id} was already replaced by {by}: look at that message (inboxctl show {by}); \
                 if it failed too, edit and replay it instead"
            )));
        }
        if !status.is_parked() {
            let why = match status {
                InboxStatus::Processed => "its effect is applied, there is nothing to replace",
                InboxStatus::RetryableFailed | InboxStatus::Processing => {
                    "it is still being retried; wait until it is parked"
                }
                _ => "this version does not replace it",
            };
            return Err(OpsError::Refused(format!(
                "{id} is {status}: {why}. Only a parked message (PERMANENT_FAILED, POISONED, \
                 MANUAL_REVIEW) is replaced by an edited copy"
            )));
        }
        let kept = match self.kept_message(conn, consumer, id).await? {
            Ok(kept) => kept,
            Err(Unrepublishable::Sealed(why)) => {
                return Err(OpsError::Refused(format!(
                    "the stored body of {id} cannot be read here ({why}): replay it where the \
                     consumer's keyring is loaded"
                )));
            }
            Err(Unrepublishable::Lost(why)) => {
                return Err(OpsError::Refused(format!(
                    "{id} cannot be replayed from what the inbox kept ({why}): the producer \
                     must send a corrected message"
                )));
            }
        };
        let original_json: Option<Value> = serde_json::from_slice(&kept.body).ok();
        let edited_json = match (
            &original_json,
            serde_json::from_slice::<Value>(&request.body),
        ) {
            (_, Ok(v)) => Some(v),
            (Some(_), Err(e)) => {
                return Err(OpsError::Invalid(format!(
                    "the edited body is not valid JSON ({e}); the original is JSON, so its \
                     replacement must be too"
                )));
            }
            (None, Err(_)) => None,
        };
        let original_sha256 = body_sha256(original_json.as_ref(), &kept.body);
        let edited_sha256 = body_sha256(edited_json.as_ref(), &request.body);
        if original_sha256 == edited_sha256 {
            return Err(OpsError::Invalid(format!(
                "nothing edited: the body is {id}'s own (key order, whitespace and number forms \
                 do not count)"
            )));
        }
        let changed = match (&original_json, &edited_json) {
            (Some(a), Some(b)) => changed_paths(a, b),
            _ => vec![String::new()],
        };
        let diff = line_diff(
            &diffable(original_json.as_ref(), &kept.body),
            &diffable(
                edited_json.as_ref().filter(|_| original_json.is_some()),
                &request.body,
            ),
        );
        let mut headers = kept.headers;
        headers.retain(|name, _| !TRIP_HEADERS.contains(&name.as_str()));
        Ok(Prepared {
            report: ReplayEditedReport {
                original_id: id.to_owned(),
                replacement_id: replacement_id(id, &edited_sha256),
                consumer: consumer.to_owned(),
                original_sha256: hex::encode(original_sha256),
                edited_sha256: hex::encode(edited_sha256),
                changed_paths: changed,
                diff,
                dry_run: true,
                published: false,
                parked_copy_removed: false,
                audit_id: None,
                follow_up: None,
            },
            status,
            message_type: row.try_get("message_type")?,
            correlation_id: row.try_get("correlation_id")?,
            headers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(body: &str) -> [u8; 32] {
        let v: Value = serde_json::from_str(body).expect("JSON");
        body_sha256(Some(&v), body.as_bytes())
    }

    #[test]
    fn the_replacement_id_depends_on_the_original_and_the_edit_only() {
        let a = replacement_id("inv-1", &sha(r#"{"amount": 42, "currency": "EUR"}"#));
        // The same edit, written otherwise: the same id.
        assert_eq!(
            a,
            replacement_id("inv-1", &sha(r#"{"currency":"EUR","amount":42.0}"#))
        );
        assert_ne!(
            a,
            replacement_id("inv-2", &sha(r#"{"amount":42,"currency":"EUR"}"#))
        );
        assert_ne!(
            a,
            replacement_id("inv-1", &sha(r#"{"amount":43,"currency":"EUR"}"#))
        );
        let uuid = Uuid::parse_str(&a).expect("a UUID");
        assert_eq!(uuid.get_version_num(), 5);
        // Fixed forever: a replayed edit must keep its id across versions.
        assert_eq!(
            replacement_id("m-1", &[0u8; 32]),
            Uuid::new_v5(
                &Uuid::parse_str("cf4aa3dc-a897-4cd5-b27f-a38ef346bfaa").expect("namespace"),
                &[b"m-1".as_slice(), &[0u8; 33]].concat()
            )
            .to_string()
        );
    }

    #[test]
    fn changed_paths_are_json_pointers_to_what_differs() {
        let original = json!({
            "amount": 42, "lines": [{"sku": "a"}, {"sku": "b"}], "a/b": 1, "same": {"x": 1.0},
            "gone": true
        });
        let edited = json!({
            "amount": 41, "lines": [{"sku": "a"}, {"sku": "c"}, {"sku": "d"}], "a/b": 2,
            "same": {"x": 1}, "new": null
        });
        assert_eq!(
            changed_paths(&original, &edited),
            [
                "/a~1b",
                "/amount",
                "/gone",
                "/lines/1/sku",
                "/lines/2",
                "/new"
            ]
        );
        assert_eq!(changed_paths(&json!(1), &json!("1")), [""]);
        assert!(changed_paths(&original, &original).is_empty());
    }

    #[test]
    fn the_diff_keeps_removes_and_adds_lines() {
        let a = diffable(Some(&json!({"amount": 42, "id": "x"})), b"");
        let b = diffable(Some(&json!({"amount": 41, "id": "x"})), b"");
        let diff = line_diff(&a, &b);
        let ops: Vec<(DiffOp, &str)> = diff.iter().map(|l| (l.op, l.text.as_str())).collect();
        assert_eq!(
            ops,
            [
                (DiffOp::Keep, "{"),
                (DiffOp::Remove, "  \"amount\": 42,"),
                (DiffOp::Add, "  \"amount\": 41,"),
                (DiffOp::Keep, "  \"id\": \"x\""),
                (DiffOp::Keep, "}"),
            ]
        );
        assert_eq!(
            serde_json::to_value(&diff[1]).ok(),
            Some(json!({"op": "remove", "text": "  \"amount\": 42,"}))
        );
    }
}
