//! The benchmark's messages, its business effect (one history row per message) and the
//! exactly-once check.

use rabbit_inbox::{
    BatchError, BatchHandler, Handler, HandlerError, InboxMessage, SchemaName,
    broker::OutgoingMessage,
    ledger_sql::{PERMANENT_FAILED, PROCESSED},
};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, SqlSafeStr, SqlStr};

/// Consumer name of every mode: they all share one inbox design.
pub(crate) const CONSUMER: &str = "bench";

pub(crate) struct Workload {
    pub(crate) messages: Vec<OutgoingMessage>,
    pub(crate) unique: usize,
    /// Unique messages marked to fail permanently (`"fail": true`).
    pub(crate) failing: usize,
    /// What every message id of this workload starts with (ids differ between seeds).
    pub(crate) id_prefix: String,
}

impl Workload {
    /// `count` messages of about `payload_size` bytes; a `duplicate_share` of them repeat an
    /// earlier message (same id, same body) at a random later position.
    /// A `failure_share` of the unique messages carry `"fail": true`, which the handlers
    /// refuse permanently (spread evenly, to measure the cost of re-running a batch).
    pub(crate) fn new(
        count: usize,
        payload_size: usize,
        duplicate_share: f64,
        failure_share: f64,
        seed: u64,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let duplicates = ((count as f64) * duplicate_share.clamp(0.0, 0.9)).round() as usize;
        let unique = count - duplicates;
        let every = if failure_share > 0.0 {
            (1.0 / failure_share).round().max(1.0) as usize
        } else {
            usize::MAX
        };
        let failing = if every == usize::MAX {
            0
        } else {
            unique.div_ceil(every)
        };
        let originals: Vec<OutgoingMessage> = (0..unique)
            .map(|seq| {
                let id = format!("{seed:x}-{seq}");
                let fail = every != usize::MAX && seq % every == 0;
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
        let mut keyed: Vec<(f64, &OutgoingMessage)> = originals
            .iter()
            .enumerate()
            .map(|(i, m)| (i as f64, m))
            .collect();
        for _ in 0..duplicates {
            let original = rng.random_range(0..unique.max(1));
            let at = rng.random_range(original as f64 + 0.5..unique as f64 + 0.5);
            keyed.push((at, &originals[original]));
        }
        keyed.sort_by(|a, b| a.0.total_cmp(&b.0));
        let out = keyed.into_iter().map(|(_, m)| m.clone()).collect();
        Self {
            messages: out,
            unique,
            failing,
            id_prefix: format!("{seed:x}-"),
        }
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

/// One statement per message.
pub(crate) struct PerMessageEffect(pub(crate) History);

impl Handler for PerMessageEffect {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        self.0
            .insert_one(tx, msg.message_id(), seq_of(msg)?)
            .await?;
        Ok(())
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

/// Every unique message that should succeed applied exactly once and PROCESSED; every one
/// marked to fail PERMANENT_FAILED with no effect.
pub(crate) async fn exactly_once(
    pool: &PgPool,
    schema: &SchemaName,
    workload: &Workload,
) -> Result<bool, sqlx::Error> {
    let (rows, distinct, processed, failed): (i64, i64, i64, i64) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM \"{schema}\".bench_history), \
                (SELECT count(DISTINCT message_id) FROM \"{schema}\".bench_history), \
                (SELECT count(*) FROM \"{schema}\".message_inbox \
                   WHERE consumer_name = $1 AND status = {PROCESSED} AND message_id LIKE $2), \
                (SELECT count(*) FROM \"{schema}\".message_inbox \
                   WHERE consumer_name = $1 AND status = {PERMANENT_FAILED} \
                     AND message_id LIKE $2)"
        )))
        .bind(CONSUMER)
        .bind(format!("{}%", workload.id_prefix))
        .fetch_one(pool)
        .await?;
    let applied = (workload.unique - workload.failing) as i64;
    Ok(rows == applied
        && distinct == applied
        && processed == applied
        && failed == workload.failing as i64)
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
        let w = Workload::new(1000, 320, 0.1, 0.0, 3);
        assert_eq!(w.messages.len(), 1000);
        assert_eq!(w.unique, 900);
        let mut seen = std::collections::HashSet::new();
        for m in &w.messages {
            let seq = serde_json::from_slice::<serde_json::Value>(&m.body).expect("json")["seq"]
                .as_u64()
                .expect("seq");
            // A copy never comes before its original: originals appear in seq order.
            if seen.insert(seq) {
                assert_eq!(seq as usize, seen.len() - 1, "original out of order");
            }
        }
        assert_eq!(seen.len(), 900);
        let size = w.messages[0].body.len();
        assert!((320..340).contains(&size), "{size}");
    }
}
