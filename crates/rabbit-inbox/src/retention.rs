//! Retention policy: how long inbox rows, their payloads and their tombstones are kept, and
//! the window check that keeps deduplication intact.
//!
//! **Invariant:** a PROCESSED row is kept at least as long as a copy of its message can still
//! arrive: the retry schedule plus the parking-lot replay window
//! ([`RetentionPolicy::redelivery_horizon`]). A shorter setting is refused at consumer start-up
//! and by cleanup (unless forced, audited), because a copy that finds no row runs its effect
//! again. Rows that still have a retry path (PROCESSING, RETRYABLE_FAILED) are never removed.

use std::{collections::BTreeMap, time::Duration};

use crate::{error::ConfigError, retry::RetryPolicy};

/// What retention does with an expired row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RetentionMode {
    /// Delete it (a tombstone stays).
    #[default]
    Delete,
    /// Move it to `inbox_archive` (a tombstone stays too).
    Archive,
}

/// Retention of one message type, overriding the defaults for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeRetention {
    /// PROCESSED rows of this type are removed this long after they were processed.
    pub processed: Duration,
    /// Their payloads and headers are removed this long after (`None`: the default).
    pub scrub_payload_after: Option<Duration>,
}

/// How long the inbox keeps what (README "Retention").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// PROCESSED rows are removed this long after they were processed: the dedup window.
    pub processed: Duration,
    /// Parked rows (PERMANENT_FAILED, POISONED) are removed this long after their last
    /// failure; `None` keeps them until an operator acts.
    pub parked: Option<Duration>,
    /// Payloads and headers of PROCESSED rows are removed this long after processing, well
    /// before the row (key, hash and metadata) is.
    pub scrub_payload_after: Option<Duration>,
    /// Per message type overrides of `processed` and `scrub_payload_after`.
    pub per_type: BTreeMap<String, TypeRetention>,
    /// Tombstones of removed rows are kept this long after removal.
    pub tombstones: Duration,
    /// How long after a message was parked an operator may still replay it from the parking
    /// lot. Part of the redelivery horizon.
    pub parking_replay_window: Duration,
    /// Delete or archive.
    pub mode: RetentionMode,
    /// Rows per statement: each batch is its own short transaction.
    pub batch_size: u32,
    /// How often a retention task beside the consumer cleans up (`None`: only by hand,
    /// `inboxctl cleanup`).
    pub interval: Option<Duration>,
}

const DAY: Duration = Duration::from_secs(86_400);

impl Default for RetentionPolicy {
    /// Rows 30 days, payloads 3 days, parked rows kept, tombstones 180 days, replays for 14
    /// days, batches of 5000, no timer.
    fn default() -> Self {
        Self {
            processed: 30 * DAY,
            parked: None,
            scrub_payload_after: Some(3 * DAY),
            per_type: BTreeMap::new(),
            tombstones: 180 * DAY,
            parking_replay_window: 14 * DAY,
            mode: RetentionMode::Delete,
            batch_size: 5000,
            interval: None,
        }
    }
}

/// Written in the largest units (`7days 2m 36s`).
pub fn human(d: Duration) -> String {
    humantime::format_duration(Duration::from_secs(d.as_secs())).to_string()
}

impl RetentionPolicy {
    /// The longest time after its first receipt that a copy of a message can still arrive:
    /// the wait of every retry tier a message passes through before it is poisoned, plus the
    /// parking-lot replay window.
    pub fn redelivery_horizon(&self, retry: &RetryPolicy) -> Duration {
        self.retry_span(retry) + self.parking_replay_window
    }

    fn retry_span(&self, retry: &RetryPolicy) -> Duration {
        (1..retry.max_attempts)
            .filter_map(|attempt| retry.delays.get(retry.tier_of_attempt(attempt)))
            .sum()
    }

    /// The settings themselves (ranges, order), without the window check.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |name, reason: String| Err(ConfigError::InvalidSetting { name, reason });
        if self.batch_size == 0 || self.batch_size > 100_000 {
            return invalid("retention.batch_size", "must be 1 to 100000".into());
        }
        if self.processed.is_zero() || self.tombstones.is_zero() {
            return invalid(
                "retention",
                "processed and tombstone retention must be positive".into(),
            );
        }
        if self.tombstones < self.processed {
            return invalid(
                "retention.tombstones",
                format!(
                    "tombstones ({}) must be kept at least as long as rows ({}): they recognise \
                     replays of removed rows",
                    human(self.tombstones),
                    human(self.processed)
                ),
            );
        }
        if self.interval.is_some_and(|i| i.is_zero()) {
            return invalid("retention.interval", "must be positive".into());
        }
        let scrubs = std::iter::once((self.scrub_payload_after, self.processed)).chain(
            self.per_type.values().map(|t| {
                (
                    t.scrub_payload_after.or(self.scrub_payload_after),
                    t.processed,
                )
            }),
        );
        for (scrub, rows) in scrubs {
            if scrub.is_some_and(|s| s >= rows) {
                return invalid(
                    "retention.scrub_payload_after",
                    "must be shorter than the row's retention (payloads go first)".into(),
                );
            }
        }
        Ok(())
    }

    /// Refuses a dedup window shorter than the redelivery horizon of `retry`, naming the
    /// setting, the horizon and what to change.
    pub fn check_window(&self, retry: &RetryPolicy) -> Result<(), ConfigError> {
        let horizon = self.redelivery_horizon(retry);
        let explain = |setting: String, kept: Duration, what: &str| {
            ConfigError::UnsafeRetentionWindow(format!(
                "{setting} = {} is shorter than the longest redelivery horizon {} (retry tiers \
                 {} over {} attempts + parking-lot replay window {}): {what}; set {setting} to \
                 at least {}, or shorten retention.parking_replay_window",
                human(kept),
                human(horizon),
                human(self.retry_span(retry)),
                retry.max_attempts,
                human(self.parking_replay_window),
                human(horizon),
            ))
        };
        let duplicate = "a copy arriving after its row is removed would run its effect again";
        if self.processed < horizon {
            return Err(explain(
                "retention.processed".into(),
                self.processed,
                duplicate,
            ));
        }
        for (ty, t) in &self.per_type {
            if t.processed < horizon {
                return Err(explain(
                    format!("retention.per_type[{ty:?}].processed"),
                    t.processed,
                    duplicate,
                ));
            }
        }
        if let Some(parked) = self.parked
            && parked < self.parking_replay_window
        {
            return Err(ConfigError::UnsafeRetentionWindow(format!(
                "retention.parked = {} is shorter than retention.parking_replay_window = {}: a \
                 parked message replayed within the window would find no row (its redrive is \
                 refused as a possible re-application); set retention.parked to at least {}",
                human(parked),
                human(self.parking_replay_window),
                human(self.parking_replay_window),
            )));
        }
        Ok(())
    }

    /// Row retention of PROCESSED rows of `message_type`.
    pub fn processed_for(&self, message_type: &str) -> Duration {
        self.per_type
            .get(message_type)
            .map_or(self.processed, |t| t.processed)
    }

    /// Payload retention of PROCESSED rows of `message_type`.
    pub fn scrub_for(&self, message_type: &str) -> Option<Duration> {
        self.per_type
            .get(message_type)
            .and_then(|t| t.scrub_payload_after)
            .or(self.scrub_payload_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn horizon_sums_the_tiers_a_message_passes_and_the_replay_window() {
        let p = RetentionPolicy {
            parking_replay_window: Duration::from_secs(100),
            ..RetentionPolicy::default()
        };
        // 5 attempts, tiers 1s 5s 30s 2m 10m: waits after attempts 1 to 4.
        assert_eq!(
            p.redelivery_horizon(&RetryPolicy::default()),
            Duration::from_secs(1 + 5 + 30 + 120 + 100)
        );
        let mut r = RetryPolicy::fixed(Duration::from_secs(10));
        r.max_attempts = 4;
        assert_eq!(p.redelivery_horizon(&r), Duration::from_secs(30 + 100));
    }

    #[test]
    fn a_window_shorter_than_the_horizon_is_refused_and_says_what_to_set() {
        let retry = RetryPolicy::default();
        assert!(RetentionPolicy::default().check_window(&retry).is_ok());
        let short = RetentionPolicy {
            processed: DAY,
            tombstones: DAY,
            scrub_payload_after: None,
            ..RetentionPolicy::default()
        };
        let err = short.check_window(&retry).expect_err("unsafe").to_string();
        assert!(err.contains("retention.processed = 1day"), "{err}");
        assert!(err.contains("at least 14days 2m 36s"), "{err}");

        let mut per_type = RetentionPolicy::default();
        per_type.per_type.insert(
            "audit.ping".into(),
            TypeRetention {
                processed: Duration::from_secs(3600),
                scrub_payload_after: None,
            },
        );
        let err = per_type
            .check_window(&retry)
            .expect_err("unsafe")
            .to_string();
        assert!(err.contains("per_type[\"audit.ping\"]"), "{err}");

        let parked = RetentionPolicy {
            parked: Some(DAY),
            ..RetentionPolicy::default()
        };
        let err = parked.check_window(&retry).expect_err("unsafe").to_string();
        assert!(err.contains("retention.parked"), "{err}");
    }

    #[test]
    fn settings_are_checked() {
        assert!(RetentionPolicy::default().validate().is_ok());
        let p = RetentionPolicy {
            scrub_payload_after: Some(40 * DAY),
            ..RetentionPolicy::default()
        };
        assert!(p.validate().is_err(), "payload kept longer than the row");
        let p = RetentionPolicy {
            tombstones: DAY,
            ..RetentionPolicy::default()
        };
        assert!(p.validate().is_err(), "tombstones shorter than rows");
        let p = RetentionPolicy {
            batch_size: 0,
            ..RetentionPolicy::default()
        };
        assert!(p.validate().is_err());
    }
}
