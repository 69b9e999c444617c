//! The log lines of failed messages: each parked or poisoned message at WARN, each scheduled
//! retry at the configured level, never a payload value. A storm must not flood the log: per
//! consumer at most [`crate::TelemetryConfig::failure_log_per_minute`] lines a minute, and one
//! summary line for each minute in which lines were left out, with the counts.

use std::{
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};

use tracing::Level;

use super::config::TelemetryConfig;
use crate::status::InboxStatus;

/// The window the line budget is counted over.
const WINDOW: Duration = Duration::from_secs(60);

/// One failed message, as logged: the library's words and the handler's safe detail only.
pub(crate) struct FailureLine<'a> {
    pub(crate) message_id: &'a str,
    pub(crate) message_type: &'a str,
    pub(crate) code: &'a str,
    /// [`crate::HandlerError::with_safe_detail`], or the library's own detail for invalid input.
    pub(crate) safe_detail: Option<&'a str>,
    pub(crate) attempt: Option<i32>,
    /// Where the copy goes: the parking lot or a retry tier.
    pub(crate) queue: &'a str,
}

/// A consumer's failure log, shared by its lanes.
pub(crate) struct FailureLog {
    consumer: String,
    retry_level: Level,
    per_minute: u32,
    window: Mutex<Window>,
}

struct Window {
    started: Instant,
    logged: u32,
    parked: u64,
    retries: u64,
    left_out: u64,
}

impl FailureLog {
    pub(crate) fn new(consumer: &str, config: &TelemetryConfig) -> Self {
        Self {
            consumer: consumer.to_owned(),
            retry_level: config.retry_log_level,
            per_minute: config.failure_log_per_minute,
            window: Mutex::new(Window {
                started: Instant::now(),
                logged: 0,
                parked: 0,
                retries: 0,
                left_out: 0,
            }),
        }
    }

    /// A message parked (PERMANENT_FAILED, POISONED) or a conflicting copy parked.
    pub(crate) fn parked(&self, status: InboxStatus, line: &FailureLine<'_>) {
        if !self.admit(true) {
            return;
        }
        tracing::warn!(
            consumer = %self.consumer,
            message_id = line.message_id,
            message_type = line.message_type,
            status = status.as_str(),
            code = line.code,
            detail = line.safe_detail.unwrap_or(""),
            attempt = line.attempt,
            parked_in = line.queue,
            "message parked; it is not processed until an operator redrives it (inboxctl failures, inboxctl redrive)"
        );
    }

    /// A retryable failure whose copy goes to a retry tier.
    pub(crate) fn retry_scheduled(&self, delay: Duration, line: &FailureLine<'_>) {
        let enabled = match self.retry_level {
            Level::ERROR => tracing::enabled!(Level::ERROR),
            Level::WARN => tracing::enabled!(Level::WARN),
            Level::INFO => tracing::enabled!(Level::INFO),
            Level::DEBUG => tracing::enabled!(Level::DEBUG),
            _ => tracing::enabled!(Level::TRACE),
        };
        if !enabled || !self.admit(false) {
            return;
        }
        macro_rules! retry_line {
            ($level:expr) => {
                tracing::event!(
                    $level,
                    consumer = %self.consumer,
                    message_id = line.message_id,
                    message_type = line.message_type,
                    code = line.code,
                    detail = line.safe_detail.unwrap_or(""),
                    attempt = line.attempt,
                    retry_queue = line.queue,
                    retry_in = ?delay,
                    "message failed; retried after its tier's delay"
                )
            };
        }
        match self.retry_level {
            Level::ERROR => retry_line!(Level::ERROR),
            Level::WARN => retry_line!(Level::WARN),
            Level::INFO => retry_line!(Level::INFO),
            Level::DEBUG => retry_line!(Level::DEBUG),
            _ => retry_line!(Level::TRACE),
        }
    }

    /// Says what the last window left out, once it is over. Called after every batch, so a
    /// storm's tail is summed up as soon as the consumer does anything again.
    pub(crate) fn flush(&self) {
        let mut window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        if window.started.elapsed() >= WINDOW {
            self.roll(&mut window);
        }
    }

    /// Counts a line and says whether it may be written.
    fn admit(&self, parked: bool) -> bool {
        let mut window = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        if window.started.elapsed() >= WINDOW {
            self.roll(&mut window);
        }
        if parked {
            window.parked += 1;
        } else {
            window.retries += 1;
        }
        if window.logged < self.per_minute {
            window.logged += 1;
            true
        } else {
            window.left_out += 1;
            false
        }
    }

    fn roll(&self, window: &mut Window) {
        if window.left_out > 0 {
            tracing::warn!(
                consumer = %self.consumer,
                parked = window.parked,
                retries = window.retries,
                left_out = window.left_out,
                window_secs = window.started.elapsed().as_secs(),
                "failed messages in the last window: {} parked, {} retries scheduled; {} of them not logged one by one \
                 (at most {} lines a minute; see inboxctl failures and the rabbit_inbox_outcomes_total metric)",
                window.parked,
                window.retries,
                window.left_out,
                self.per_minute
            );
        }
        *window = Window {
            started: Instant::now(),
            logged: 0,
            parked: 0,
            retries: 0,
            left_out: 0,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_admits_a_minutes_lines_and_counts_the_rest() {
        let config = TelemetryConfig {
            failure_log_per_minute: 3,
            ..TelemetryConfig::default()
        };
        let log = FailureLog::new("orders", &config);
        let admitted: Vec<bool> = (0..5).map(|i| log.admit(i % 2 == 0)).collect();
        assert_eq!(admitted, [true, true, true, false, false]);
        let window = log.window.lock().expect("unpoisoned");
        assert_eq!((window.parked, window.retries, window.left_out), (3, 2, 2));
    }

    #[test]
    fn a_new_window_starts_with_a_fresh_budget() {
        let config = TelemetryConfig {
            failure_log_per_minute: 1,
            ..TelemetryConfig::default()
        };
        let log = FailureLog::new("orders", &config);
        assert!(log.admit(true));
        assert!(!log.admit(true));
        {
            let mut window = log.window.lock().expect("unpoisoned");
            window.started = window
                .started
                .checked_sub(WINDOW)
                .expect("a minute after boot");
        }
        log.flush();
        assert_eq!(log.window.lock().expect("unpoisoned").left_out, 0);
        assert!(log.admit(true));
    }
}
