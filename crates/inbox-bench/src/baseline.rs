//! The two baselines, written directly against lapin and sqlx: the broker's ceiling (consume
//! and ack, no database) and the textbook inbox recipe (one transaction and one ack per
//! message).

use std::time::Instant;

use futures::StreamExt;
use hdrhistogram::Histogram;
use lapin::{
    Connection, ConnectionProperties,
    options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};
use rabbit_inbox::{
    EnvelopeRules, InboxStatus, SchemaName, envelope::AmqpMessage, store::Claim, store::Failure,
    store::InboxStore,
};
use sqlx::PgPool;

use crate::{
    BenchError,
    workload::{CONSUMER, History},
};

/// Latency histogram in microseconds.
pub(crate) fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("constant bounds are valid")
}

/// The first of a cluster's comma-separated URLs: a plain lapin client, as the baselines are,
/// connects to one node.
pub(crate) fn first_url(amqp_url: &str) -> &str {
    amqp_url.split(',').next().unwrap_or(amqp_url).trim()
}

async fn open(
    amqp_url: &str,
    queue: &str,
    prefetch: u16,
) -> Result<(Connection, lapin::Channel, lapin::Consumer), BenchError> {
    let conn = Connection::connect(first_url(amqp_url), ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((conn, channel, consumer))
}

/// Consumes `count` deliveries, acking with `multiple=true` every `ack_every`.
pub(crate) async fn ceiling(
    amqp_url: &str,
    queue: &str,
    count: usize,
    prefetch: u16,
    ack_every: usize,
    latency: &mut Histogram<u64>,
) -> Result<(), BenchError> {
    let (conn, channel, mut consumer) = open(amqp_url, queue, prefetch).await?;
    let mut unacked: Vec<Instant> = Vec::with_capacity(ack_every);
    let mut seen = 0;
    while seen < count {
        let delivery = consumer.next().await.ok_or(BenchError::StreamEnded)??;
        unacked.push(Instant::now());
        seen += 1;
        if unacked.len() >= ack_every || seen == count {
            channel
                .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: true })
                .await?;
            for at in unacked.drain(..) {
                latency.saturating_record(at.elapsed().as_micros().max(1) as u64);
            }
        }
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// The textbook recipe: per delivery, begin; insert-first claim; if new, apply the effect and
/// mark PROCESSED; commit; ack that one delivery.
pub(crate) async fn textbook(
    amqp_url: &str,
    pool: &PgPool,
    schema: &SchemaName,
    queue: &str,
    count: usize,
    prefetch: u16,
    latency: &mut Histogram<u64>,
) -> Result<(), BenchError> {
    let (conn, _channel, mut consumer) = open(amqp_url, queue, prefetch).await?;
    let store = InboxStore::new(schema.clone());
    let history = History::new(schema);
    let rules = EnvelopeRules::default();
    for _ in 0..count {
        let delivery = consumer.next().await.ok_or(BenchError::StreamEnded)??;
        let received = Instant::now();
        let envelope = rabbit_inbox::envelope::parse(
            AmqpMessage {
                message_id: delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string()),
                body: delivery.data.clone(),
                ..AmqpMessage::default()
            },
            &rules,
        )
        .map_err(|e| BenchError::Invalid(e.detail))?;
        let mut tx = pool.begin().await?;
        if store.try_claim(&mut tx, CONSUMER, &envelope, false).await? == Claim::Claimed {
            if envelope.payload["fail"].as_bool() == Some(true) {
                // The effect fails: roll back, record the failure in its own transaction.
                tx.rollback().await?;
                let failure = Failure {
                    status: InboxStatus::PermanentFailed,
                    code: "bench_failure",
                    message: "marked to fail",
                    safe_detail: None,
                    max_attempts: 1,
                    store_payload: false,
                };
                let mut conn = pool.acquire().await?;
                store
                    .record_failure(&mut conn, CONSUMER, &envelope, failure)
                    .await?;
                delivery.acker.ack(BasicAckOptions::default()).await?;
                latency.saturating_record(received.elapsed().as_micros().max(1) as u64);
                continue;
            }
            let seq = envelope.payload["seq"].as_i64().unwrap_or_default();
            history
                .insert_one(&mut tx, &envelope.message_id, seq)
                .await?;
            store
                .mark_processed(&mut tx, CONSUMER, &[envelope.message_id.as_str()], false)
                .await?;
        }
        tx.commit().await?;
        delivery.acker.ack(BasicAckOptions::default()).await?;
        latency.saturating_record(received.elapsed().as_micros().max(1) as u64);
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}
