//! How long a lease lasts and how often it is renewed.

use std::time::Duration;

use crate::error::ConfigError;

/// Timing of leased processing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// How long a claim stays the worker's without a heartbeat. A worker silent for longer
    /// may be taken over.
    pub ttl: Duration,
    /// How often the worker extends its lease while the handler runs. At most a third of
    /// `ttl`, so that a live worker renews at least twice before its lease could expire.
    pub heartbeat: Duration,
}

impl Default for LeaseConfig {
    /// 60 s leases, renewed every 10 s.
    fn default() -> Self {
        Self::new(Duration::from_secs(60))
    }
}

impl LeaseConfig {
    /// Leases of `ttl`, renewed every sixth of it.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            heartbeat: ttl / 6,
        }
    }

    /// Checks the timing; [`crate::Consumer::leased`] calls this.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |name, reason: &str| {
            Err(ConfigError::InvalidSetting {
                name,
                reason: reason.to_owned(),
            })
        };
        if self.ttl < Duration::from_millis(100) || self.ttl > Duration::from_secs(86_400) {
            return invalid("lease.ttl", "must be between 100 ms and 24 h");
        }
        if self.heartbeat.is_zero() || self.heartbeat.saturating_mul(3) > self.ttl {
            return invalid(
                "lease.heartbeat",
                "must be positive and at most a third of lease.ttl, so a live worker renews its \
                 lease at least twice before it could expire",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_must_be_well_shorter_than_the_ttl() {
        assert!(LeaseConfig::default().validate().is_ok());
        assert!(LeaseConfig::new(Duration::from_secs(1)).validate().is_ok());
        let slow = LeaseConfig {
            ttl: Duration::from_secs(10),
            heartbeat: Duration::from_secs(4),
        };
        let err = slow.validate().expect_err("heartbeat over ttl / 3");
        assert!(err.to_string().contains("lease.heartbeat"), "{err}");
        assert!(
            LeaseConfig::new(Duration::from_millis(10))
                .validate()
                .is_err()
        );
    }
}
