//! Settling deliveries by their durable outcomes: acks (as multiple-acks over the settled
//! prefix), retry rejects, requeues and parking.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use lapin::{
    BasicProperties, Channel,
    message::Delivery,
    options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions},
    types::AMQPValue,
};

use super::{headers::long_string, publish::publish_confirmed, session::PendingDelivery};
use crate::{envelope::Envelope, error::BrokerError, processor::Outcome, stats::ConsumerStats};

/// Headers the consumer adds to a parked message. Replay tools read them.
pub mod parking_headers {
    /// Inbox status of the row (`PERMANENT_FAILED`, `POISONED`, ...).
    pub const STATUS: &str = "x-inbox-status";
    /// Stable error code.
    pub const ERROR_CODE: &str = "x-inbox-error-code";
    /// Error message (truncated).
    pub const ERROR: &str = "x-inbox-error";
    /// Consumer that parked it.
    pub const CONSUMER: &str = "x-inbox-consumer";
    /// Inbox key of the row (a synthetic `invalid:` key for messages without a usable id).
    pub const INBOX_KEY: &str = "x-inbox-message-id";
    /// Unix milliseconds when it was parked.
    pub const PARKED_AT: &str = "x-inbox-parked-at";
    /// Exchange and routing key it first arrived with, for replay.
    pub const ORIGINAL_EXCHANGE: &str = "x-inbox-original-exchange";
    /// See [`ORIGINAL_EXCHANGE`].
    pub const ORIGINAL_ROUTING_KEY: &str = "x-inbox-original-routing-key";
}

/// Where parked messages go: a confirm-mode channel and the parking queue's name.
struct ParkingLot {
    channel: Channel,
    queue: Arc<str>,
    consumer: Arc<str>,
}

/// Longest wait for one settlement (a parking publish waits for its confirm). Past it the
/// channel is treated as broken; the broker redelivers what was not settled.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(15);

/// What a session needs to settle deliveries: its ack tracker and its parking lot.
pub(crate) struct Settler {
    acks: AckTracker,
    parking: ParkingLot,
}

/// Acks with `multiple=true`, but only over the contiguous prefix of delivery tags whose
/// outcome is durable. A multiple-ack settles *every* earlier unsettled tag on the channel, so
/// while any earlier delivery is still being processed (or its reject/park has not been sent),
/// the tags after it wait.
struct AckTracker {
    channel: Channel,
    state: tokio::sync::Mutex<AckState>,
}

#[derive(Default)]
struct AckState {
    /// Delivered, outcome not yet settled.
    pending: BTreeSet<u64>,
    /// Ready to ack (durable), not yet acked, with their receive instants.
    ready: BTreeMap<u64, Instant>,
}

impl AckState {
    /// Moves `acked` tags to ready; returns the tag a multiple-ack may cover now, if any.
    fn complete(&mut self, settled: &[u64], acked: &[(u64, Instant)]) -> Option<u64> {
        for tag in settled {
            self.pending.remove(tag);
        }
        for &(tag, at) in acked {
            self.pending.remove(&tag);
            self.ready.insert(tag, at);
        }
        let bound = self.pending.first().copied().unwrap_or(u64::MAX);
        self.ready.range(..bound).next_back().map(|(&tag, _)| tag)
    }

    /// Removes and returns the ready entries up to `through`.
    fn take_through(&mut self, through: u64) -> Vec<Instant> {
        let rest = self.ready.split_off(&(through + 1));
        std::mem::replace(&mut self.ready, rest)
            .into_values()
            .collect()
    }
}

impl Settler {
    /// A settler acking on `channel` and parking through the confirm-mode `parking_channel`.
    pub(super) fn new(
        channel: Channel,
        parking_channel: Channel,
        parking_queue: &str,
        consumer: &str,
    ) -> Self {
        Self {
            acks: AckTracker {
                channel,
                state: tokio::sync::Mutex::default(),
            },
            parking: ParkingLot {
                channel: parking_channel,
                queue: parking_queue.into(),
                consumer: consumer.into(),
            },
        }
    }

    /// Registers a delivery as outstanding. Called in delivery order, before processing.
    pub(crate) async fn register(&self, pending: &PendingDelivery) {
        self.acks.state.lock().await.pending.insert(pending.tag());
    }

    /// Settles a processed batch by its durable outcomes; the one function that acks, rejects or
    /// nacks. Rejects, requeues and parks go first, one by one; the acks then go as one
    /// multiple-ack over the settled prefix. Returns how many deliveries could not be settled
    /// (the broker will redeliver them and the inbox will recognise them).
    pub(crate) async fn settle_batch(
        &self,
        batch: Vec<(PendingDelivery, &Outcome, &Envelope)>,
        stats: &ConsumerStats,
    ) -> usize {
        let mut settled = Vec::new();
        let mut to_ack = Vec::new();
        let mut unsettled = 0;
        for (pending, outcome, envelope) in batch {
            if matches!(outcome, Outcome::Processed | Outcome::Duplicate) {
                to_ack.push((pending.tag(), pending.received_at));
                continue;
            }
            let tag = pending.tag();
            let received_at = pending.received_at;
            let individual = settle_one(pending, outcome, envelope, &self.parking);
            match tokio::time::timeout(SETTLE_TIMEOUT, individual).await {
                Ok(Ok(true)) => {
                    stats.record_latencies([received_at.elapsed()]);
                    settled.push(tag);
                }
                // Left pending on purpose: no later multiple-ack may cover it.
                result => {
                    tracing::debug!(delivery_tag = tag, ?result, "delivery not settled");
                    unsettled += 1;
                }
            }
        }
        let mut state = self.acks.state.lock().await;
        if let Some(through) = state.complete(&settled, &to_ack) {
            let ack = self
                .acks
                .channel
                .basic_ack(through, BasicAckOptions { multiple: true });
            match tokio::time::timeout(SETTLE_TIMEOUT, ack).await {
                Ok(Ok(())) => {
                    let now = Instant::now();
                    stats.record_latencies(
                        state
                            .take_through(through)
                            .into_iter()
                            .map(|at| now.duration_since(at)),
                    );
                }
                result => {
                    tracing::debug!(through, ?result, "multiple-ack failed");
                    unsettled += to_ack.len();
                }
            }
        }
        if unsettled > 0 {
            stats.record_settle_failures(unsettled as u64);
        }
        unsettled
    }
}

/// Rejects, requeues or parks one delivery.
async fn settle_one(
    pending: PendingDelivery,
    outcome: &Outcome,
    envelope: &Envelope,
    parking: &ParkingLot,
) -> Result<bool, BrokerError> {
    let acker = &pending.delivery.acker;
    match outcome {
        Outcome::Processed | Outcome::Duplicate => {
            Ok(acker.ack(BasicAckOptions::default()).await?)
        }
        // Dead-letters into the retry queue, which returns it after the delay.
        Outcome::RetryScheduled { .. } | Outcome::InFlightElsewhere => {
            Ok(acker.reject(BasicRejectOptions { requeue: false }).await?)
        }
        Outcome::Unrecorded { .. } => Ok(acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await?),
        Outcome::Parked {
            status,
            code,
            message,
        } => {
            let properties = parked_properties(
                &pending.delivery,
                envelope,
                parking,
                status.as_str(),
                code,
                message,
            );
            let published = publish_confirmed(
                &parking.channel,
                "",
                &parking.queue,
                &envelope.body,
                properties,
            )
            .await;
            match published {
                Ok(()) => Ok(acker.ack(BasicAckOptions::default()).await?),
                Err(e) => {
                    // Not parked: keep the message. It comes back and is parked again.
                    tracing::warn!(error = %e, message_id = %envelope.message_id, "parking failed; requeueing");
                    let _ = acker
                        .nack(BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        })
                        .await;
                    Ok(false)
                }
            }
        }
    }
}

fn parked_properties(
    delivery: &Delivery,
    envelope: &Envelope,
    parking: &ParkingLot,
    status: &str,
    code: &str,
    message: &str,
) -> BasicProperties {
    // Not a plain clone: a value nested too deep is a marker that cannot be encoded as is.
    let mut headers = delivery
        .properties
        .headers()
        .as_ref()
        .map(super::headers::republishable)
        .unwrap_or_default();
    let parked_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default();
    let error: String = message.chars().take(1000).collect();
    for (k, v) in [
        (parking_headers::STATUS, long_string(status)),
        (parking_headers::ERROR_CODE, long_string(code)),
        (parking_headers::ERROR, long_string(&error)),
        (parking_headers::CONSUMER, long_string(&parking.consumer)),
        (
            parking_headers::INBOX_KEY,
            long_string(&envelope.message_id),
        ),
        (
            parking_headers::PARKED_AT,
            AMQPValue::LongLongInt(parked_at),
        ),
        (
            parking_headers::ORIGINAL_EXCHANGE,
            long_string(delivery.exchange.as_str()),
        ),
        (
            parking_headers::ORIGINAL_ROUTING_KEY,
            long_string(delivery.routing_key.as_str()),
        ),
    ] {
        headers.insert(k.into(), v);
    }
    delivery
        .properties
        .clone()
        .with_headers(headers)
        .with_delivery_mode(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multiple_ack_covers_only_the_settled_prefix() {
        let now = Instant::now();
        let mut s = AckState::default();
        s.pending.extend(1..=6);
        // Batch {4,5,6} finishes first: 1..=3 still pending, nothing may be acked.
        assert_eq!(s.complete(&[], &[(4, now), (5, now), (6, now)]), None);
        // 2 is rejected individually, 1 still pending.
        assert_eq!(s.complete(&[2], &[]), None);
        // 1 and 3 done: the prefix reaches 6.
        assert_eq!(s.complete(&[], &[(1, now), (3, now)]), Some(6));
        assert_eq!(s.take_through(6).len(), 5);
        assert!(s.ready.is_empty());
    }

    #[test]
    fn a_pending_tag_stops_the_prefix_below_it() {
        let now = Instant::now();
        let mut s = AckState::default();
        s.pending.extend(1..=5);
        assert_eq!(s.complete(&[], &[(1, now), (2, now), (4, now)]), Some(2));
        assert_eq!(s.take_through(2).len(), 2);
        assert_eq!(s.ready.keys().copied().collect::<Vec<_>>(), vec![4]);
        assert_eq!(s.complete(&[], &[(5, now)]), None);
        assert_eq!(s.complete(&[3], &[]), Some(5));
    }
}
