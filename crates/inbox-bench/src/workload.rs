//! The benchmark's messages, its business effect (one history row per message) and the
//! exactly-once check.

use rabbit_inbox::{
    BatchError, BatchHandler, Handler, HandlerError, InboxMessage, InboxStatus, SchemaName,
    broker::OutgoingMessage, envelope::AGGREGATE_ID_HEADER, ledger_sql::PROCESSED,
};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, SqlSafeStr, SqlStr};

/// Consumer name of every mode: they all share one inbox design.
pub(crate) const CONSUMER: &str = "bench";

pub(crate) struct Workload {
    /// The deliveries in order, without their aggregate id: [`Workload::delivery`] adds it
    /// while publishing, so that the harness holds no more memory during a run than without.
    messages: Vec<OutgoingMessage>,
    /// The seq of each delivery (a duplicate repeats its original's).
    seqs: Vec<usize>,
    pub(crate) unique: usize,
    /// Every `fail_every`-th unique message (by seq, from 0) is marked to fail permanently
    /// (`"fail": true`); `None`: none is.
    fail_every: Option<usize>,
    /// Aggregates the messages are spread over (`x-aggregate-id` = seq % keys); 0: no
    /// aggregate id.
    keys: usize,
    /// What every message id of this workload starts with (ids differ between seeds).
    pub(crate) id_prefix: String,
}

/// What should become of one unique message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expected {
    /// Its effect applied once, its row PROCESSED.
    Applied,
    /// Refused by the handler: no effect, its row PERMANENT_FAILED.
    Failed,
    /// Behind a failed message of its key (ordered consumers): no effect, its row HELD.
    Held,
}

impl Expected {
    fn status(self) -> InboxStatus {
        match self {
            Expected::Applied => InboxStatus::Processed,
            Expected::Failed => InboxStatus::PermanentFailed,
            Expected::Held => InboxStatus::Held,
        }
    }
}

impl Workload {
    /// `count` messages of about `payload_size` bytes; a `duplicate_share` of them repeat an
    /// earlier message (same id, same body) at a random later position.
    /// A `failure_share` of the unique messages carry `"fail": true`, which the handlers
    /// refuse permanently (spread evenly, to measure the cost of re-running a batch).
    /// Message `seq` belongs to aggregate `seq % keys` (header `x-aggregate-id`; none when
    /// `keys` is 0).
    pub(crate) fn new(
        count: usize,
        payload_size: usize,
        duplicate_share: f64,
        failure_share: f64,
        keys: usize,
        seed: u64,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let duplicates = ((count as f64) * duplicate_share.clamp(0.0, 0.9)).round() as usize;
        let unique = count - duplicates;
        let fail_every =
            (failure_share > 0.0).then(|| (1.0 / failure_share).round().max(1.0) as usize);
        let originals: Vec<OutgoingMessage> = (0..unique)
            .map(|seq| {
                let id = format!("{seed:x}-{seq}");
                let fail = fail_every.is_some_and(|every| seq % every == 0);
                let body = json!({"seq": seq, "id": id, "fail": fail, "pad": ""}).to_string();
                let pad = "x".repeat(payload_size.saturating_sub(body.len()));
                OutgoingMessage {
                    message_id: Some(id.clone()),
                    kind: Some("BenchEvent".into()),
                    body: json!({"seq": seq, "id": id, "fail": fail, "pad": pad})
                        .to_string()
                        .into_bytes(),
                    ..OutgoingMessage::default()
                }
            })
            .collect();
        // Originals keep their order; each duplicate lands somewhere after its original.
        let mut keyed: Vec<(f64, usize)> = (0..unique).map(|seq| (seq as f64, seq)).collect();
        for _ in 0..duplicates {
            let original = rng.random_range(0..unique.max(1));
            let at = rng.random_range(original as f64 + 0.5..unique as f64 + 0.5);
            keyed.push((at, original));
        }
        keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
        let seqs: Vec<usize> = keyed.into_iter().map(|(_, seq)| seq).collect();
        let messages = seqs.iter().map(|&seq| originals[seq].clone()).collect();
        Self {
            messages,
            seqs,
            unique,
            fail_every,
            keys,
            id_prefix: format!("{seed:x}-"),
        }
    }

    /// Deliveries in the workload.
    pub(crate) fn len(&self) -> usize {
        self.messages.len()
    }

    /// Delivery `index` as published: with its `x-aggregate-id`, when the workload has keys.
    pub(crate) fn delivery(&self, index: usize) -> OutgoingMessage {
        let mut message = self.messages[index].clone();
        if self.keys > 0 {
            let key = self.seqs[index] % self.keys;
            message
                .headers
                .insert(AGGREGATE_ID_HEADER.into(), json!(key.to_string()));
        }
        message
    }

    /// The id of unique message `seq`.
    fn id_of(&self, seq: usize) -> String {
        format!("{}{seq}", self.id_prefix)
    }

    /// What should become of each unique message, by seq. Unordered, every message marked
    /// to fail is refused and every other applied. `ordered` (by aggregate): a key's first
    /// refused message blocks it, and every later message of that key is held, marked to fail
    /// or not (nothing releases them in a benchmark).
    pub(crate) fn expected(&self, ordered: bool) -> Vec<Expected> {
        let mut blocked = vec![false; self.keys];
        (0..self.unique)
            .map(|seq| {
                let key = (self.keys > 0).then(|| seq % self.keys);
                let blocked = key.filter(|_| ordered).map(|k| &mut blocked[k]);
                let fail = self.fail_every.is_some_and(|every| seq % every == 0);
                match (blocked, fail) {
                    (Some(blocked), _) if *blocked => Expected::Held,
                    (Some(blocked), true) => {
                        *blocked = true;
                        Expected::Failed
                    }
                    (None, true) => Expected::Failed,
                    (_, false) => Expected::Applied,
                }
            })
            .collect()
    }
}

/// SQL of the business effect, built once per schema.
#[derive(Clone)]
pub(crate) struct History {
    insert_one: SqlStr,
    insert_many: SqlStr,
}

impl History {
    pub(crate) fn new(schema: &SchemaName) -> Self {
        let t = format!("\"{schema}\".bench_history");
        Self {
            insert_one: AssertSqlSafe(format!("INSERT INTO {t} (message_id, seq) VALUES ($1, $2)"))
                .into_sql_str(),
            insert_many: AssertSqlSafe(format!(
                "INSERT INTO {t} (message_id, seq) SELECT * FROM UNNEST($1::text[], $2::int8[])"
            ))
            .into_sql_str(),
        }
    }

    pub(crate) async fn insert_one(
        &self,
        conn: &mut PgConnection,
        message_id: &str,
        seq: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(self.insert_one.clone())
            .bind(message_id)
            .bind(seq)
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// The message's sequence number, or its permanent failure.
fn seq_of(msg: &InboxMessage<'_>) -> Result<i64, HandlerError> {
    let payload = &msg.envelope().payload;
    if payload["fail"].as_bool() == Some(true) {
        return Err(HandlerError::permanent("bench_failure", "marked to fail"));
    }
    payload["seq"]
        .as_i64()
        .ok_or_else(|| HandlerError::permanent("no_seq", "payload has no integer seq"))
}

/// One statement per message; messages marked to fail are refused in `check` (before any
/// effect of their batch), or, with `late`, by `handle` itself.
pub(crate) struct PerMessageEffect {
    pub(crate) history: History,
    pub(crate) late: bool,
}

impl Handler for PerMessageEffect {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        self.history
            .insert_one(tx, msg.message_id(), seq_of(msg)?)
            .await?;
        Ok(())
    }

    fn check(&self, msg: &InboxMessage<'_>) -> Result<(), HandlerError> {
        if self.late {
            return Ok(());
        }
        seq_of(msg).map(|_| ())
    }
}

/// One statement per batch.
pub(crate) struct BatchEffect(pub(crate) History);

impl BatchHandler for BatchEffect {
    async fn handle_batch(
        &self,
        msgs: &[InboxMessage<'_>],
        tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        let mut ids = Vec::with_capacity(msgs.len());
        let mut seqs = Vec::with_capacity(msgs.len());
        let mut failed = Vec::new();
        for (index, m) in msgs.iter().enumerate() {
            match seq_of(m) {
                Ok(seq) => {
                    ids.push(m.message_id());
                    seqs.push(seq);
                }
                Err(error) => failed.push((index, error)),
            }
        }
        // A set-based handler validates the whole batch and names every message it refuses.
        if !failed.is_empty() {
            return Err(BatchError::Messages(failed));
        }
        sqlx::query(self.0.insert_many.clone())
            .bind(&ids)
            .bind(&seqs)
            .execute(tx)
            .await
            .map_err(|e| BatchError::Batch(e.into()))?;
        Ok(())
    }
}

/// Fresh inbox and history table in `schema`.
pub(crate) async fn reset_schema(
    pool: &PgPool,
    schema: &SchemaName,
) -> Result<(), crate::BenchError> {
    rabbit_inbox::schema::drop_schema(pool, schema).await?;
    rabbit_inbox::migrate(pool, schema).await?;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".bench_history (message_id TEXT NOT NULL, seq BIGINT NOT NULL)"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// Empties the business table, keeping the inbox as it is.
pub(crate) async fn reset_history(pool: &PgPool, schema: &SchemaName) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "TRUNCATE \"{schema}\".bench_history"
    )))
    .execute(pool)
    .await?;
    Ok(())
}

/// What the database says of one run's messages, against what should have become of them
/// ([`Workload::expected`]).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Check {
    /// Messages whose effect was applied more than once.
    applied_twice: i64,
    /// Messages to apply whose effect is missing.
    missing: i64,
    /// Messages applied although an earlier message of their key had failed (ordered runs:
    /// an applied seq above its key's first failing seq).
    applied_behind_failure: i64,
    /// Messages marked to fail whose effect was applied.
    applied_failing: i64,
    /// Effects of no message of this run.
    stray: i64,
    /// Messages whose inbox row is missing or has another status than expected.
    wrong_status: i64,
    /// Inbox rows left HELD.
    pub(crate) held: i64,
}

impl Check {
    /// Exactly-once held: every count but `held` is zero.
    pub(crate) fn passed(&self) -> bool {
        [
            self.applied_twice,
            self.missing,
            self.applied_behind_failure,
            self.applied_failing,
            self.stray,
            self.wrong_status,
        ]
        .iter()
        .all(|&n| n == 0)
    }
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} applied twice, {} not applied, {} applied behind a failure of their key, \
             {} applied though marked to fail, {} effects of unknown messages, \
             {} inbox rows missing or in the wrong status, {} held",
            self.applied_twice,
            self.missing,
            self.applied_behind_failure,
            self.applied_failing,
            self.stray,
            self.wrong_status,
            self.held
        )
    }
}

/// Checks every unique message of `workload` against what should have become of it
/// (`ordered`: behind its key's first failure it is held): effects from the history table,
/// statuses from the inbox.
pub(crate) async fn check(
    pool: &PgPool,
    schema: &SchemaName,
    workload: &Workload,
    ordered: bool,
) -> Result<Check, sqlx::Error> {
    let expected = workload.expected(ordered);
    let ids: Vec<String> = (0..expected.len()).map(|seq| workload.id_of(seq)).collect();
    let statuses: Vec<&str> = expected.iter().map(|e| e.status().as_str()).collect();
    let (applied, held, failed) = (
        InboxStatus::Processed.as_str(),
        InboxStatus::Held.as_str(),
        InboxStatus::PermanentFailed.as_str(),
    );
    let counts: (i64, i64, i64, i64, i64, i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "WITH expected AS (SELECT * FROM UNNEST($2::text[], $3::text[]) AS e(message_id, status)), \
           applied AS (SELECT message_id, count(*) AS n FROM \"{schema}\".bench_history \
                       GROUP BY message_id) \
         SELECT (SELECT count(*) FROM applied WHERE n > 1), \
           (SELECT count(*) FROM expected e WHERE e.status = '{applied}' \
              AND NOT EXISTS (SELECT 1 FROM applied a WHERE a.message_id = e.message_id)), \
           (SELECT count(*) FROM expected e JOIN applied a USING (message_id) \
              WHERE e.status = '{held}'), \
           (SELECT count(*) FROM expected e JOIN applied a USING (message_id) \
              WHERE e.status = '{failed}'), \
           (SELECT count(*) FROM applied a \
              WHERE NOT EXISTS (SELECT 1 FROM expected e WHERE e.message_id = a.message_id)), \
           (SELECT count(*) FROM expected e LEFT JOIN \"{schema}\".message_inbox m \
              ON m.consumer_name = $1 AND m.message_id = e.message_id \
              WHERE m.status IS DISTINCT FROM e.status), \
           (SELECT count(*) FROM \"{schema}\".message_inbox \
              WHERE consumer_name = $1 AND status = '{held}' AND message_id LIKE $4)"
    )))
    .bind(CONSUMER)
    .bind(&ids)
    .bind(&statuses)
    .bind(format!("{}%", workload.id_prefix))
    .fetch_one(pool)
    .await?;
    let (
        applied_twice,
        missing,
        applied_behind_failure,
        applied_failing,
        stray,
        wrong_status,
        held,
    ) = counts;
    Ok(Check {
        applied_twice,
        missing,
        applied_behind_failure,
        applied_failing,
        stray,
        wrong_status,
        held,
    })
}

/// Fills the inbox with `rows` old PROCESSED rows of the same consumer, in chunks.
pub(crate) async fn prefill(
    pool: &PgPool,
    schema: &SchemaName,
    rows: u64,
) -> Result<(), sqlx::Error> {
    let chunk = 500_000u64;
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{schema}\".message_inbox (message_id, consumer_name, message_type, \
               message_version, status, processing_attempt, processed_at, payload_sha256) \
             SELECT 'prefill-' || g, $1, 'BenchEvent', 1, {PROCESSED}, 1, now(), \
               sha256(g::text::bytea) \
             FROM generate_series($2::int8, $3::int8) AS g"
        )))
        .bind(CONSUMER)
        .bind((done + 1) as i64)
        .bind((done + n) as i64)
        .execute(pool)
        .await?;
        done += n;
    }
    sqlx::raw_sql(AssertSqlSafe(format!(
        "VACUUM ANALYZE \"{schema}\".message_inbox"
    )))
    .execute(pool)
    .await?;
    // Write the fill out now, so its checkpoint does not land in the measured runs. Needs
    // superuser or pg_checkpoint; without it the runs only get noisier.
    if let Err(e) = sqlx::raw_sql("CHECKPOINT").execute(pool).await {
        tracing::warn!("CHECKPOINT after the prefill failed: {e}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_follow_their_original() {
        let w = Workload::new(1000, 320, 0.1, 0.0, 0, 3);
        assert_eq!(w.len(), 1000);
        assert_eq!(w.unique, 900);
        let mut seen = std::collections::HashSet::new();
        for (index, m) in w.messages.iter().enumerate() {
            let seq = serde_json::from_slice::<serde_json::Value>(&m.body).expect("json")["seq"]
                .as_u64()
                .expect("seq");
            // A copy never comes before its original: originals appear in seq order.
            if seen.insert(seq) {
                assert_eq!(seq as usize, seen.len() - 1, "original out of order");
            }
            assert_eq!(w.seqs[index], seq as usize);
            assert!(
                w.delivery(index).headers.is_empty(),
                "keys 0: no aggregate id"
            );
        }
        assert_eq!(seen.len(), 900);
        let size = w.messages[0].body.len();
        assert!((320..340).contains(&size), "{size}");
    }

    #[test]
    fn every_delivery_names_its_aggregate() {
        let w = Workload::new(500, 320, 0.2, 0.0, 7, 1);
        for index in 0..w.len() {
            let m = w.delivery(index);
            let seq = serde_json::from_slice::<serde_json::Value>(&m.body).expect("json")["seq"]
                .as_u64()
                .expect("seq") as usize;
            assert_eq!(m.headers[AGGREGATE_ID_HEADER], json!((seq % 7).to_string()));
        }
    }

    #[test]
    fn unordered_only_the_marked_messages_fail() {
        let w = Workload::new(100, 320, 0.0, 0.1, 7, 1);
        let expected = w.expected(false);
        for (seq, e) in expected.iter().enumerate() {
            let want = if seq % 10 == 0 {
                Expected::Failed
            } else {
                Expected::Applied
            };
            assert_eq!(*e, want, "seq {seq}");
        }
    }

    #[test]
    fn ordered_a_keys_first_failure_holds_the_rest_of_the_key() {
        let (keys, count) = (7, 200);
        let w = Workload::new(count, 320, 0.0, 0.1, keys, 1);
        let expected = w.expected(true);
        for key in 0..keys {
            // 7 and 10 are coprime: every key has a failing message among its first ten.
            let first_fail = (key..count)
                .step_by(keys)
                .find(|s| s % 10 == 0)
                .expect("fails");
            for seq in (key..count).step_by(keys) {
                let want = match seq.cmp(&first_fail) {
                    std::cmp::Ordering::Less => Expected::Applied,
                    std::cmp::Ordering::Equal => Expected::Failed,
                    std::cmp::Ordering::Greater => Expected::Held,
                };
                assert_eq!(expected[seq], want, "key {key} seq {seq}");
            }
        }
        // Without failures nothing is held.
        let clean = Workload::new(count, 320, 0.0, 0.0, keys, 1).expected(true);
        assert!(clean.iter().all(|e| *e == Expected::Applied));
    }
}
