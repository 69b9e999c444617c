//! Noticing a delivery that ends every broker session it reaches.
//!
//! Whatever the library cannot see can end a session: the client library refusing a frame, a
//! connection error, a crash of the session while a delivery is unsettled. The broker then
//! requeues the unsettled deliveries, hands them to the next session first, and the same thing
//! happens again: valid messages behind them wait, nothing is recorded, and from outside the
//! consumer merely reconnects now and then. [`SessionLosses`] remembers, from one lost session
//! to the next, the error it ended with and the deliveries it left unsettled; a loss that
//! repeats either is logged loudly, naming the delivery, and counted
//! ([`crate::ConsumerStats`], [`crate::telemetry::metrics::REPEATED_SESSION_LOSSES`]).

use std::{collections::HashMap, time::Duration};

/// What is logged of a delivery that was unsettled when its session was lost: its identity and
/// properties, never its body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeliverySummary {
    /// The inbox key it parsed to: the same for every redelivery of the message.
    pub(crate) inbox_key: String,
    /// The AMQP `message-id` property.
    pub(crate) message_id: Option<String>,
    /// The delivery tag on the lost session's channel.
    pub(crate) delivery_tag: u64,
    /// The broker's redelivered flag.
    pub(crate) redelivered: bool,
    /// Its message type.
    pub(crate) message_type: String,
    /// Bytes of its content header frame's payload (properties and headers).
    pub(crate) header_bytes: usize,
    /// Bytes of its body.
    pub(crate) body_bytes: usize,
}

/// How a lost session repeated the one before it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Repeats {
    /// Consecutive lost sessions, this one included, that ended with this one's error (1: the
    /// previous ended otherwise, or lived long enough to count as healthy).
    pub(crate) same_error: u32,
    /// Deliveries unsettled in this lost session and in the one before it, each with the
    /// number of consecutive lost sessions it was unsettled in (at least 2).
    pub(crate) same_deliveries: Vec<(DeliverySummary, u32)>,
}

/// The lost sessions of one consumer, as far as they repeat.
#[derive(Debug)]
pub(crate) struct SessionLosses {
    /// A session that lived this long ended healthy: its loss starts a new error streak.
    healthy_after: Duration,
    /// The previous loss's error and how many consecutive losses had it.
    last_error: Option<(String, u32)>,
    /// Inbox keys unsettled at the previous loss, and in how many consecutive losses.
    unsettled: HashMap<String, u32>,
}

impl Repeats {
    /// The `cause` labels of [`crate::telemetry::metrics::REPEATED_SESSION_LOSSES`] this loss
    /// counts under.
    pub(crate) fn causes(&self) -> impl Iterator<Item = &'static str> {
        [
            (self.same_error > 1).then_some(crate::telemetry::metrics::SAME_ERROR),
            (!self.same_deliveries.is_empty()).then_some(crate::telemetry::metrics::SAME_DELIVERY),
        ]
        .into_iter()
        .flatten()
    }
}

impl SessionLosses {
    /// Sessions count as healthy once they lived `healthy_after`.
    pub(crate) fn new(healthy_after: Duration) -> Self {
        Self {
            healthy_after,
            last_error: None,
            unsettled: HashMap::new(),
        }
    }

    /// Records a session that lived `lived` and was lost with `reason`, leaving `unsettled`
    /// deliveries behind: logs what repeats the previous loss, and returns it.
    pub(crate) fn lost(
        &mut self,
        reason: &str,
        lived: Duration,
        unsettled: &[DeliverySummary],
    ) -> Repeats {
        let repeats = self.track(reason, lived, unsettled);
        if repeats.same_error > 1 {
            tracing::error!(
                %reason,
                consecutive = repeats.same_error,
                "broker session lost again with the same error; something the consumer cannot \
                 get past (a message the client library refuses, a broker that closes the \
                 connection) may be stopping the queue"
            );
        }
        for (d, consecutive) in &repeats.same_deliveries {
            tracing::warn!(
                inbox_key = %d.inbox_key,
                message_id = d.message_id.as_deref().unwrap_or(""),
                delivery_tag = d.delivery_tag,
                redelivered = d.redelivered,
                message_type = %d.message_type,
                header_bytes = d.header_bytes,
                body_bytes = d.body_bytes,
                consecutive,
                %reason,
                "delivery unsettled in consecutive lost broker sessions; it may be what ends them"
            );
        }
        repeats
    }

    /// [`SessionLosses::lost`] without the logging.
    fn track(&mut self, reason: &str, lived: Duration, unsettled: &[DeliverySummary]) -> Repeats {
        let same_error = match self.last_error.take() {
            Some((last, n)) if last == reason && lived < self.healthy_after => n + 1,
            _ => 1,
        };
        self.last_error = Some((reason.to_owned(), same_error));

        let mut now = HashMap::with_capacity(unsettled.len());
        let mut same_deliveries = Vec::new();
        for d in unsettled {
            // One message may be unsettled twice in one session (a duplicate delivery).
            if now.contains_key(&d.inbox_key) {
                continue;
            }
            let consecutive = self.unsettled.get(&d.inbox_key).map_or(1, |n| n + 1);
            now.insert(d.inbox_key.clone(), consecutive);
            if consecutive > 1 {
                same_deliveries.push((d.clone(), consecutive));
            }
        }
        self.unsettled = now;
        Repeats {
            same_error,
            same_deliveries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(key: &str, tag: u64) -> DeliverySummary {
        DeliverySummary {
            inbox_key: key.into(),
            message_id: Some(key.into()),
            delivery_tag: tag,
            redelivered: tag > 1,
            message_type: "Thing".into(),
            header_bytes: 40,
            body_bytes: 12,
        }
    }

    const SHORT: Duration = Duration::from_millis(5);

    #[test]
    fn a_delivery_unsettled_in_consecutive_losses_is_named() {
        let mut losses = SessionLosses::new(Duration::from_secs(10));
        let first = losses.track("closed", SHORT, &[delivery("a", 1), delivery("b", 2)]);
        assert_eq!(
            first,
            Repeats {
                same_error: 1,
                same_deliveries: vec![]
            }
        );
        // b was settled this time; a came back and was lost with the session again.
        let second = losses.track("reset", SHORT, &[delivery("a", 1), delivery("c", 2)]);
        assert_eq!(second.same_error, 1, "another error");
        assert_eq!(second.same_deliveries, vec![(delivery("a", 1), 2)]);
        let third = losses.track("reset", SHORT, &[delivery("a", 3), delivery("a", 4)]);
        assert_eq!(third.same_error, 2);
        assert_eq!(third.same_deliveries, vec![(delivery("a", 3), 3)]);
        // Settled at last: the streak ends.
        let fourth = losses.track("reset", SHORT, &[delivery("c", 1)]);
        assert_eq!(fourth.same_deliveries, vec![]);
        let fifth = losses.track("reset", SHORT, &[delivery("a", 1)]);
        assert_eq!(fifth.same_deliveries, vec![], "not consecutive");
    }

    #[test]
    fn the_same_error_counts_until_a_session_lives_long_enough() {
        let mut losses = SessionLosses::new(Duration::from_secs(10));
        let frame_error = "FRAME-ERROR: frame too large: 131073 bytes";
        for n in 1..=3 {
            assert_eq!(losses.track(frame_error, SHORT, &[]).same_error, n);
        }
        // A session that lived past the healthy age ends the streak, even with the same error.
        let healthy = losses.track(frame_error, Duration::from_secs(11), &[]);
        assert_eq!(healthy.same_error, 1);
        assert_eq!(losses.track(frame_error, SHORT, &[]).same_error, 2);
        assert_eq!(losses.track("other", SHORT, &[]).same_error, 1);
    }
}
