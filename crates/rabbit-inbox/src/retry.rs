//! The retry budget: how many attempts a message gets and how long it waits in which retry
//! tier between them.

use std::time::Duration;

/// Retry budget and timing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts before a retryable failure becomes POISONED and is parked.
    pub max_attempts: i32,
    /// Retry tiers: after failed attempt `n` a message waits `delays[n - 1]` (the last delay
    /// for every attempt past the list) in that tier's own retry queue, then comes back.
    /// Strictly increasing. One queue per tier, because a per-message TTL in one queue would
    /// hold short delays behind a long one at its head.
    pub delays: Vec<Duration>,
    /// A committed PROCESSING row older than this is taken over as abandoned.
    pub stale_processing_after: Duration,
}

impl Default for RetryPolicy {
    /// 5 attempts; retries after 1 s, 5 s, 30 s, 2 min, 10 min.
    fn default() -> Self {
        Self::tiered(
            [1, 5, 30, 120, 600]
                .into_iter()
                .map(Duration::from_secs)
                .collect(),
        )
    }
}

impl RetryPolicy {
    /// The default budget with tiers `delays`.
    pub fn tiered(delays: Vec<Duration>) -> Self {
        Self {
            max_attempts: 5,
            delays,
            stale_processing_after: Duration::from_secs(300),
        }
    }

    /// The default budget with one retry tier: every retry waits `delay`.
    pub fn fixed(delay: Duration) -> Self {
        Self::tiered(vec![delay])
    }

    /// Index into [`RetryPolicy::delays`] of the tier a message goes to after failed attempt
    /// `attempt` (1-based); clamped to the last tier.
    pub fn tier_of_attempt(&self, attempt: i32) -> usize {
        let n = usize::try_from(attempt.max(1)).unwrap_or(1);
        n.min(self.delays.len()).saturating_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attempts_map_to_tiers_clamped_at_the_last() {
        let r = RetryPolicy::default();
        assert_eq!(r.tier_of_attempt(1), 0);
        assert_eq!(r.tier_of_attempt(2), 1);
        assert_eq!(r.tier_of_attempt(5), 4);
        assert_eq!(r.tier_of_attempt(50), 4);
        assert_eq!(r.tier_of_attempt(0), 0);
        assert_eq!(
            RetryPolicy::fixed(Duration::from_secs(3)).tier_of_attempt(7),
            0
        );
    }
}
