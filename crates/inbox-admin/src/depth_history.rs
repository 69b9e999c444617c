//! Queue depths over time: the work queue (ready, unacknowledged, consumers), its retry tiers
//! (summed) and its parking lot, read by the server itself every [`SAMPLE_INTERVAL`] (`depths`' sampler) and kept
//! for a day, so the console's depth chart has the night's history when it is opened, not only
//! what the page saw while open ("is it stuck?" starts with the ready and unacked counts).
//!
//! Read through the management API (`AdminState::management_url`, as the doctor reads the
//! topology), whose counts the broker refreshes every few seconds; when it does not answer,
//! through passive declares on one AMQP connection, which give ready counts only. A read whose
//! newest sample is older than [`FRESH`] takes one first, so a page refreshing every few
//! seconds sees the queues move live (and a server without the background sampler,
//! the application without a listener, still answers). A sample the broker did not answer is kept with no figures,
//! a gap in the chart.

use std::{
    collections::VecDeque,
    sync::{Mutex, PoisonError},
    time::Duration,
};

use chrono::{DateTime, Utc};
use inbox_ops::management::{ManagementClient, QueueCounts};
use rabbit_inbox::{RetryPolicy, Topology, broker::Broker};
use serde::Serialize;
use utoipa::ToSchema;

use crate::state::BROKER_TIMEOUT;

/// How often the server samples the depths.
pub(crate) const SAMPLE_INTERVAL: Duration = Duration::from_secs(15);
/// A read takes a sample of its own when the newest one is older than this.
pub(crate) const FRESH: Duration = Duration::from_secs(4);
/// How long samples are kept.
pub(crate) const KEEP: Duration = Duration::from_secs(24 * 3600);
/// At most this many samples per answer (a day at 15 s is 5,760): the last of each slot.
const MAX_POINTS: usize = 720;

/// The queues at one instant; `None` where the broker did not answer (or, through AMQP, for
/// what passive declares do not tell).
#[derive(Clone, Copy, Debug, Default, Serialize, ToSchema)]
pub(crate) struct DepthSample {
    /// When.
    at: DateTime<Utc>,
    /// `management` or `amqp`; `None` when neither answered.
    via: Option<&'static str>,
    /// Work queue: messages ready.
    work: Option<u64>,
    /// Work queue: messages delivered and not yet acked (held by consumers).
    work_unacked: Option<u64>,
    /// Work queue: consumers subscribed.
    work_consumers: Option<u64>,
    /// Retry tiers: messages waiting, summed.
    retry: Option<u64>,
    /// Parking lot: messages.
    parking: Option<u64>,
}

/// What the samples are read through, opened on first use and again after a failure.
#[derive(Default)]
struct Readers {
    management: Option<ManagementClient>,
    broker: Option<Broker>,
}

/// The samples and what they are read through.
#[derive(Default)]
pub(crate) struct DepthHistory {
    samples: Mutex<VecDeque<DepthSample>>,
    /// Also serialises sampling: one reader at a time, and a reader that waited for another
    /// uses its fresh sample.
    readers: tokio::sync::Mutex<Readers>,
}

impl std::fmt::Debug for DepthHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DepthHistory").finish_non_exhaustive()
    }
}

impl DepthHistory {
    fn newest(&self) -> Option<DepthSample> {
        let samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        samples.back().copied()
    }

    fn is_fresh(&self, now: DateTime<Utc>, within: Duration) -> bool {
        self.newest()
            .is_some_and(|s| (now - s.at).to_std().is_ok_and(|age| age < within))
    }

    /// Reads the depths unless a sample younger than `within` exists.
    pub(crate) async fn sample_unless_fresh(
        &self,
        amqp_url: &str,
        management_url: Option<&str>,
        topology: &Topology,
        retry: &RetryPolicy,
        within: Duration,
    ) {
        let mut readers = self.readers.lock().await;
        if self.is_fresh(Utc::now(), within) {
            return;
        }
        // Each request to the API has its own timeout; the whole read is bounded too, so a slow
        // API (several answers just under it) does not hold a page's refresh.
        let management = tokio::time::timeout(
            2 * BROKER_TIMEOUT,
            through_management(&mut readers, amqp_url, management_url, topology, retry),
        )
        .await
        .ok()
        .flatten();
        let mut sample = match management {
            Some(s) if s.work.is_some() && s.retry.is_some() && s.parking.is_some() => s,
            // The API answered without some counts (a queue declared a moment ago has none
            // until the broker's next statistics round): the ready counts through AMQP, what
            // the API did say kept.
            Some(partial) => {
                let ready = through_amqp(&mut readers, amqp_url, topology, retry).await;
                DepthSample {
                    work_unacked: partial.work_unacked,
                    work_consumers: partial.work_consumers,
                    ..ready
                }
            }
            None => through_amqp(&mut readers, amqp_url, topology, retry).await,
        };
        sample.at = Utc::now();
        let mut samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        samples.push_back(sample);
        while samples
            .front()
            .is_some_and(|s| (sample.at - s.at).to_std().is_ok_and(|age| age > KEEP))
        {
            samples.pop_front();
        }
    }

    /// The samples of the last `window`, at most [`MAX_POINTS`] of them.
    pub(crate) fn recent(&self, now: DateTime<Utc>, window: Duration) -> Vec<DepthSample> {
        let from = now - chrono::Duration::from_std(window).unwrap_or(chrono::Duration::MAX);
        let samples = self.samples.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = (window.as_millis() / MAX_POINTS as u128).max(1) as i64;
        let mut out: Vec<DepthSample> = Vec::new();
        for s in samples.iter().filter(|s| s.at >= from) {
            let same_slot = out.last().is_some_and(|last| {
                last.at.timestamp_millis() / slot == s.at.timestamp_millis() / slot
            });
            if same_slot {
                out.pop();
            }
            out.push(*s);
        }
        out
    }
}

/// The counts from the management API; `None` when it does not answer.
async fn through_management(
    readers: &mut Readers,
    amqp_url: &str,
    management_url: Option<&str>,
    topology: &Topology,
    retry: &RetryPolicy,
) -> Option<DepthSample> {
    if readers.management.is_none() {
        match ManagementClient::new(amqp_url, management_url) {
            Ok(client) => readers.management = Some(client),
            Err(e) => tracing::debug!(error = %e, "queue depths: no management API client"),
        }
    }
    let client = readers.management.as_ref()?;
    let counts = async |queue: &str| -> Option<Option<QueueCounts>> {
        match client.queue_counts(queue).await {
            Ok(counts) => Some(counts),
            Err(e) => {
                tracing::debug!(error = %e, "queue depths: the management API did not answer");
                None
            }
        }
    };
    let work = counts(&topology.queue).await?;
    let mut retrying = Some(0u64);
    for tier in topology.retry_tier_queues(retry) {
        let ready = counts(&tier).await?.and_then(|c| c.ready);
        retrying = retrying.zip(ready).map(|(sum, n)| sum + n);
    }
    let parking = counts(&topology.parking_queue).await?;
    Some(DepthSample {
        via: Some("management"),
        work: work.and_then(|c| c.ready),
        work_unacked: work.and_then(|c| c.unacknowledged),
        work_consumers: work.and_then(|c| c.consumers),
        retry: retrying,
        parking: parking.and_then(|c| c.ready),
        ..DepthSample::default()
    })
}

/// Ready counts from passive declares on one AMQP connection; no figures when the broker does
/// not answer.
async fn through_amqp(
    readers: &mut Readers,
    amqp_url: &str,
    topology: &Topology,
    retry: &RetryPolicy,
) -> DepthSample {
    if readers.broker.is_none() {
        let connect = Broker::connect(amqp_url, "inbox-admin queue depths");
        match tokio::time::timeout(BROKER_TIMEOUT, connect).await {
            Ok(Ok(connected)) => readers.broker = Some(connected),
            Ok(Err(e)) => tracing::debug!(error = %e, "queue depths: connecting failed"),
            Err(_) => tracing::debug!("queue depths: connecting timed out"),
        }
    }
    let depths = match readers.broker.as_ref() {
        Some(b) => {
            match tokio::time::timeout(BROKER_TIMEOUT, b.queue_depths(topology, retry)).await {
                Ok(Ok(depths)) => Some(depths),
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "queue depths: reading failed");
                    None
                }
                Err(_) => None,
            }
        }
        None => None,
    };
    if depths.is_none() {
        // A failed passive declare closes the channel: start afresh next time.
        readers.broker = None;
    }
    DepthSample {
        via: depths.map(|_| "amqp"),
        work: depths.map(|d| u64::from(d.work)),
        retry: depths.map(|d| u64::from(d.retry)),
        parking: depths.map(|d| u64::from(d.parking)),
        ..DepthSample::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(ats: &[i64]) -> DepthHistory {
        let history = DepthHistory::default();
        history
            .samples
            .lock()
            .expect("not poisoned")
            .extend(ats.iter().map(|&secs| DepthSample {
                at: DateTime::from_timestamp(secs, 0).expect("an instant"),
                work: u64::try_from(secs).ok(),
                ..DepthSample::default()
            }));
        history
    }

    #[test]
    fn an_answer_keeps_the_window_and_the_last_sample_of_each_slot() {
        let now = DateTime::from_timestamp(100_000, 0).expect("an instant");
        // Every 5 s over two hours: 1,440 samples.
        let history = history(&(100_000 - 7_200..=100_000).step_by(5).collect::<Vec<_>>());
        let hour = history.recent(now, Duration::from_secs(3600));
        assert!(hour.first().expect("samples").at >= now - chrono::Duration::hours(1));
        assert_eq!(hour.last().expect("samples").at, now, "the newest is kept");
        // 5 s slots for an hour: one sample per slot, 720 of them (plus the slot of `now`).
        assert!(hour.len() <= MAX_POINTS + 1, "{}", hour.len());
        assert!(hour.len() >= MAX_POINTS, "{}", hour.len());
        assert!(hour.windows(2).all(|w| w[0].at < w[1].at));
        // A day asked of two hours' samples: 2 minute slots, 60 or 61 of them.
        let day = history.recent(now, Duration::from_secs(24 * 3600));
        assert!((60..=61).contains(&day.len()), "{}", day.len());
        assert_eq!(day.last().expect("samples").at, now);
    }

    #[test]
    fn freshness_is_measured_from_the_newest_sample() {
        let history = history(&[1_000]);
        let at = |secs| DateTime::from_timestamp(secs, 0).expect("an instant");
        assert!(history.is_fresh(at(1_003), FRESH));
        assert!(!history.is_fresh(at(1_004), FRESH));
        assert!(!DepthHistory::default().is_fresh(at(1_000), FRESH));
    }
}
