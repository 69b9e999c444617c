//! Settling deliveries by their durable outcomes: acks (as multiple-acks over the settled
//! prefix), copies to a retry tier or the parking lot (confirmed, then acked), requeues.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use lapin::{
    BasicProperties, Channel,
    message::Delivery,
    options::{BasicAckOptions, BasicNackOptions},
    types::{AMQPValue, FieldTable},
};

use super::{
    delivery::PendingDelivery, frames, headers::long_string, publish::Publisher,
    settings::SessionSettings,
};
use crate::{
    backoff::Backoff,
    envelope::Envelope,
    retry::RetryPolicy,
    stats::ConsumerStats,
    status::{ConfirmedCopy, ConfirmedCopyKind, Outcome, parking_headers},
};

/// Longest wait for one settlement (a copy waits for its confirm). Past it the publish counts
/// as failed, or the consuming channel as broken; the broker redelivers what was not settled.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(15);

/// What a session needs to settle deliveries: its ack tracker, the publisher for retry and
/// parking copies, and where those go.
pub(crate) struct Settler {
    acks: AckTracker,
    publisher: Arc<Publisher>,
    parking_queue: Arc<str>,
    retry_tiers: Vec<String>,
    retry: RetryPolicy,
    consumer: Arc<str>,
    publish_backoff: Backoff,
    /// The broker's `frame_max`, which every copy's content header must fit in.
    frame_max: u32,
}

/// Acks with `multiple=true`, but only over the contiguous prefix of delivery tags whose
/// outcome is durable. A multiple-ack settles *every* earlier unsettled tag on the channel, so
/// while any earlier delivery is still being processed (or its copy has not been confirmed),
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

/// What an outcome asks of the broker for its delivery.
#[expect(
    clippy::large_enum_variant,
    reason = "one at a time, moved straight into a `Copy`; boxing would add an allocation per copy"
)]
enum Settlement<'a> {
    /// Ack it (with the settled prefix).
    Ack,
    /// Requeue it now: it could not be processed.
    Requeue,
    /// Copy it to `queue`, and ack it once the copy is confirmed, noting `note` on its row.
    Copy {
        queue: &'a str,
        properties: BasicProperties,
        note: Option<ConfirmedCopy>,
    },
}

/// A delivery to copy to another queue before it is acked.
struct Copy<'a> {
    pending: PendingDelivery,
    queue: &'a str,
    properties: BasicProperties,
    body: &'a [u8],
    /// What to note on the row once the copy is confirmed (`None`: nothing).
    note: Option<ConfirmedCopy>,
}

impl Settler {
    /// A settler acking on the consuming `channel` and publishing copies through `publisher`,
    /// each cut to fit in `frame_max`.
    pub(super) fn new(
        channel: Channel,
        publisher: Arc<Publisher>,
        config: &SessionSettings<'_>,
        frame_max: u32,
    ) -> Self {
        Self {
            acks: AckTracker {
                channel,
                state: tokio::sync::Mutex::default(),
            },
            publisher,
            parking_queue: config.topology.parking_queue.as_str().into(),
            retry_tiers: config.topology.retry_tier_queues(config.retry),
            retry: config.retry.clone(),
            consumer: config.consumer_name.into(),
            publish_backoff: Backoff::new(
                config.reconnect_initial_delay,
                config.reconnect_max_delay,
            ),
            frame_max,
        }
    }

    /// Registers a delivery as outstanding. Called in delivery order, before processing.
    pub(crate) async fn register(&self, pending: &PendingDelivery) {
        self.acks.state.lock().await.pending.insert(pending.tag());
    }

    /// Delivery tags not settled with the broker yet: without an outcome, or acked only in
    /// intent (the multiple-ack that would cover them did not go through).
    pub(crate) async fn unsettled(&self) -> BTreeSet<u64> {
        let state = self.acks.state.lock().await;
        state
            .pending
            .iter()
            .chain(state.ready.keys())
            .copied()
            .collect()
    }

    /// The delay of the retry tier a message whose attempt `attempt` failed goes to.
    fn retry_delay(&self, attempt: i32) -> Duration {
        self.retry
            .delays
            .get(self.retry.tier_of_attempt(attempt))
            .copied()
            .unwrap_or_default()
    }

    /// The retry queue for a message whose attempt `attempt` failed.
    fn retry_tier(&self, attempt: i32) -> &str {
        let tier = self.retry.tier_of_attempt(attempt);
        self.retry_tiers
            .get(tier)
            .or(self.retry_tiers.last())
            .map_or("", String::as_str)
    }

    /// Settles a processed batch by its durable outcomes; the one function that acks or nacks.
    /// Requeues go first, one by one; retry and parking copies are published together and
    /// confirmed, and `note_copies` records the confirmed ones on their rows (so that later
    /// copies of those messages are recognised as duplicates of a copy the broker holds);
    /// the acks (of processed deliveries and of confirmed copies) then go as one
    /// multiple-ack over the settled prefix. A copy the broker does not confirm is requeued
    /// after a back-off, and the session goes on. Returns how many deliveries could not be
    /// settled (the broker will redeliver them and the inbox will recognise them).
    pub(crate) async fn settle_batch(
        &self,
        batch: Vec<(PendingDelivery, &Outcome, &Envelope)>,
        stats: &ConsumerStats,
        note_copies: impl AsyncFnOnce(Vec<ConfirmedCopy>),
    ) -> usize {
        let mut settled = Vec::new();
        let mut to_ack = Vec::new();
        let mut copies = Vec::new();
        let mut unsettled = 0;
        for (pending, outcome, envelope) in batch {
            match self.settlement(&pending, outcome, envelope) {
                Settlement::Ack => to_ack.push((pending.tag(), pending.received_at)),
                // Cannot be processed now: back to the queue (the lane waited already).
                Settlement::Requeue => match requeue(&pending).await {
                    Ok(()) => {
                        stats.record_latencies([pending.received_at.elapsed()]);
                        settled.push(pending.tag());
                    }
                    Err(()) => unsettled += 1,
                },
                Settlement::Copy {
                    queue,
                    properties,
                    note,
                } => copies.push(self.fitted_copy(pending, queue, properties, envelope, note)),
            }
        }

        let (confirmed, failed) = self.publish_copies(copies, &mut to_ack).await;
        // Noted before the acks: a delivery redelivered after a lost ack must find its copy
        // noted. Only after the confirm: a noted copy the broker never took would turn the
        // next delivery of the message into a dropped duplicate.
        if !confirmed.is_empty() {
            note_copies(confirmed).await;
        }
        let published = !to_ack.is_empty();
        unsettled += self.ack_settled(&settled, &to_ack, stats).await;
        unsettled += self.requeue_not_copied(failed, published, stats).await;
        if unsettled > 0 {
            stats.record_settle_failures(unsettled as u64);
        }
        unsettled
    }

    /// What `outcome` asks of the broker for `pending`: an ack, a requeue, or a copy (to a
    /// retry tier or the parking lot) before the ack.
    fn settlement(
        &self,
        pending: &PendingDelivery,
        outcome: &Outcome,
        envelope: &Envelope,
    ) -> Settlement<'_> {
        match outcome {
            Outcome::Processed
            | Outcome::Duplicate
            | Outcome::CopyPending { .. }
            | Outcome::Held => Settlement::Ack,
            Outcome::Unrecorded { .. } => Settlement::Requeue,
            Outcome::RetryScheduled { attempt, .. } => {
                let mut scheduled = FieldTable::default();
                scheduled.insert(
                    parking_headers::RETRY_ATTEMPT.into(),
                    AMQPValue::LongLongInt(i64::from(*attempt)),
                );
                Settlement::Copy {
                    queue: self.retry_tier(*attempt),
                    properties: copy_properties(&pending.delivery, scheduled),
                    note: Some(ConfirmedCopy {
                        message_id: envelope.message_id.clone(),
                        attempt: *attempt,
                        kind: ConfirmedCopyKind::Retry(self.retry_delay(*attempt)),
                    }),
                }
            }
            // Not the row's retry: the row is another consumer's, and nothing is noted.
            // Attempt 0 names no scheduled retry, so a scheduled copy passing through here
            // does not come back as one.
            Outcome::InFlightElsewhere => {
                let mut unscheduled = FieldTable::default();
                unscheduled.insert(
                    parking_headers::RETRY_ATTEMPT.into(),
                    AMQPValue::LongLongInt(0),
                );
                Settlement::Copy {
                    queue: self.retry_tier(1),
                    properties: copy_properties(&pending.delivery, unscheduled),
                    note: None,
                }
            }
            Outcome::Parked {
                status,
                code,
                message,
                attempt,
            } => Settlement::Copy {
                queue: &self.parking_queue,
                properties: copy_properties(
                    &pending.delivery,
                    self.reason_headers(envelope, status.as_str(), code, message),
                ),
                note: attempt.map(|attempt| ConfirmedCopy {
                    message_id: envelope.message_id.clone(),
                    attempt,
                    kind: ConfirmedCopyKind::Parked,
                }),
            },
        }
    }

    /// The copy of `pending` to publish to `queue`, its headers cut to fit in `frame_max`.
    fn fitted_copy<'a>(
        &self,
        pending: PendingDelivery,
        queue: &'a str,
        properties: BasicProperties,
        envelope: &'a Envelope,
        note: Option<ConfirmedCopy>,
    ) -> Copy<'a> {
        // A copy the broker would refuse would come back, and be refused, for ever.
        let (properties, dropped) = frames::fit(properties, self.frame_max);
        if dropped.count > 0 {
            tracing::warn!(
                delivery_tag = pending.tag(),
                inbox_key = %envelope.message_id,
                dropped_headers = dropped.count,
                dropped_bytes = dropped.bytes,
                queue,
                "the copy would not fit in a frame; the largest headers are left out of it"
            );
        }
        Copy {
            pending,
            queue,
            properties,
            body: &envelope.body,
            note,
        }
    }

    /// Publishes `copies` all at once (one confirm round trip for the batch). A confirmed
    /// copy's delivery joins `to_ack` and its note is returned; the deliveries of the copies
    /// not confirmed are returned beside the notes.
    async fn publish_copies(
        &self,
        copies: Vec<Copy<'_>>,
        to_ack: &mut Vec<(u64, Instant)>,
    ) -> (Vec<ConfirmedCopy>, Vec<PendingDelivery>) {
        let results = futures::future::join_all(copies.iter().map(|c| {
            self.publisher
                .publish_to_queue(c.queue, c.body, c.properties.clone(), SETTLE_TIMEOUT)
        }))
        .await;
        let mut failed = Vec::new();
        let mut confirmed = Vec::new();
        for (copy, result) in copies.into_iter().zip(results) {
            match result {
                Ok(()) => {
                    to_ack.push((copy.pending.tag(), copy.pending.received_at));
                    confirmed.extend(copy.note);
                }
                Err(e) => {
                    tracing::warn!(error = %e, queue = copy.queue, delivery_tag = copy.pending.tag(), "copy not confirmed; the delivery is requeued after a back-off");
                    failed.push(copy.pending);
                }
            }
        }
        (confirmed, failed)
    }

    /// Requeues the deliveries whose copies `failed`, after the publish back-off; with none
    /// failed, a batch that `published` resets the back-off. Returns how many could not be
    /// settled.
    async fn requeue_not_copied(
        &self,
        failed: Vec<PendingDelivery>,
        published: bool,
        stats: &ConsumerStats,
    ) -> usize {
        if failed.is_empty() {
            if published {
                self.publish_backoff.succeeded();
            }
            return 0;
        }
        // Not copied: keep the message. It comes back and its copy is published again;
        // the wait keeps a broker that refuses copies from becoming a hot loop, and the
        // consuming channel (and session) stays.
        let delay = self.publish_backoff.failed();
        tracing::warn!(failed = failed.len(), retry_in = ?delay, "publishing copies failed; requeueing after back-off");
        tokio::time::sleep(delay).await;
        let mut unsettled = 0;
        let mut requeued = Vec::new();
        for pending in failed {
            match requeue(&pending).await {
                Ok(()) => {
                    stats.record_latencies([pending.received_at.elapsed()]);
                    requeued.push(pending.tag());
                }
                Err(()) => unsettled += 1,
            }
        }
        unsettled + self.ack_settled(&requeued, &[], stats).await
    }

    /// Records `settled` (settled individually) and `to_ack`, then sends the multiple-ack the
    /// settled prefix allows. Returns how many of `to_ack` could not be acked.
    async fn ack_settled(
        &self,
        settled: &[u64],
        to_ack: &[(u64, Instant)],
        stats: &ConsumerStats,
    ) -> usize {
        let mut state = self.acks.state.lock().await;
        let Some(through) = state.complete(settled, to_ack) else {
            return 0;
        };
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
                0
            }
            result => {
                tracing::debug!(through, ?result, "multiple-ack failed");
                to_ack.len()
            }
        }
    }

    /// The reason headers of a parked copy.
    fn reason_headers(
        &self,
        envelope: &Envelope,
        status: &str,
        code: &str,
        message: &str,
    ) -> FieldTable {
        let parked_at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or_default();
        let error: String = message.chars().take(1000).collect();
        let mut headers = FieldTable::default();
        for (k, v) in [
            (parking_headers::STATUS, long_string(status)),
            (parking_headers::ERROR_CODE, long_string(code)),
            (parking_headers::ERROR, long_string(&error)),
            (parking_headers::CONSUMER, long_string(&self.consumer)),
            (
                parking_headers::INBOX_KEY,
                long_string(&envelope.message_id),
            ),
            (
                parking_headers::PARKED_AT,
                AMQPValue::LongLongInt(parked_at),
            ),
        ] {
            headers.insert(k.into(), v);
        }
        headers
    }
}

/// Requeues one delivery (never with `multiple`: that would requeue every earlier unsettled
/// delivery of the channel, whatever its outcome).
async fn requeue(pending: &PendingDelivery) -> Result<(), ()> {
    let nack = pending.delivery.acker.nack(BasicNackOptions {
        multiple: false,
        requeue: true,
    });
    match tokio::time::timeout(SETTLE_TIMEOUT, nack).await {
        Ok(Ok(_)) => Ok(()),
        result => {
            tracing::debug!(delivery_tag = pending.tag(), ?result, "requeue failed");
            Err(())
        }
    }
}

/// Properties of a copy of `delivery` published by the consumer (retry tier, parking lot):
/// the producer's, persistent, with `extra` headers, and without `expiration` and `user-id`,
/// whose originals move to `x-inbox-original-*` headers. The first delivery's exchange and
/// routing key are kept in headers too; a header already there (set on an earlier copy) wins.
fn copy_properties(delivery: &Delivery, extra: FieldTable) -> BasicProperties {
    let p = &delivery.properties;
    // Not a plain clone: a value nested too deep is a marker that cannot be encoded as is.
    let mut headers = p
        .headers()
        .as_ref()
        .map(super::headers::republishable)
        .unwrap_or_default();
    let mut keep = |name: &str, value: AMQPValue| {
        if !headers.contains_key(name) {
            headers.insert(name.into(), value);
        }
    };
    keep(
        parking_headers::ORIGINAL_EXCHANGE,
        long_string(delivery.exchange.as_str()),
    );
    keep(
        parking_headers::ORIGINAL_ROUTING_KEY,
        long_string(delivery.routing_key.as_str()),
    );
    if let Some(expiration) = p.expiration() {
        headers.insert(
            parking_headers::ORIGINAL_EXPIRATION.into(),
            long_string(expiration.as_str()),
        );
    }
    if let Some(user_id) = p.user_id() {
        headers.insert(
            parking_headers::ORIGINAL_USER_ID.into(),
            long_string(user_id.as_str()),
        );
    }
    for (k, v) in &extra {
        headers.insert(k.clone(), v.clone());
    }
    // Rebuilt field by field: lapin's properties cannot unset a field.
    let mut copy = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(2);
    if let Some(v) = p.content_type() {
        copy = copy.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        copy = copy.with_content_encoding(v.clone());
    }
    if let Some(v) = p.priority() {
        copy = copy.with_priority(*v);
    }
    if let Some(v) = p.correlation_id() {
        copy = copy.with_correlation_id(v.clone());
    }
    if let Some(v) = p.reply_to() {
        copy = copy.with_reply_to(v.clone());
    }
    if let Some(v) = p.message_id() {
        copy = copy.with_message_id(v.clone());
    }
    if let Some(v) = p.timestamp() {
        copy = copy.with_timestamp(*v);
    }
    if let Some(v) = p.kind() {
        copy = copy.with_type(v.clone());
    }
    if let Some(v) = p.app_id() {
        copy = copy.with_app_id(v.clone());
    }
    if let Some(v) = p.cluster_id() {
        copy = copy.with_cluster_id(v.clone());
    }
    copy
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
