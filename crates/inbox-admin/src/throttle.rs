//! Failed authentications counted per address: after [`MAX_FAILURES`] within
//! [`FAILURE_WINDOW`], that address's requests without a valid token get 429 for the rest of
//! the window. A valid token always passes: the callers behind one address (a NAT, a proxy)
//! are not locked out by one of them guessing. The counter holds at most
//! [`MAX_TRACKED_ADDRESSES`] addresses (IPv6 by /64, the block one host usually owns),
//! dropping the oldest when full.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Mutex, PoisonError},
    time::{Duration, Instant},
};

/// Failed authentications from one address before its further failed attempts are refused
/// for the window.
pub const MAX_FAILURES: u32 = 5;
/// How long failures are counted (from the first), and an address's failed attempts refused
/// after too many.
pub const FAILURE_WINDOW: Duration = Duration::from_secs(60);
/// Addresses whose failures are remembered at most.
pub const MAX_TRACKED_ADDRESSES: usize = 4096;

/// Failed authentications per address, bounded.
#[derive(Debug, Default)]
pub(crate) struct FailureThrottle {
    failures: Mutex<HashMap<IpAddr, (u32, Instant)>>,
}

/// The key an address is counted under: an IPv6 address by its /64.
fn key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut segments = v6.segments();
                segments[4..].fill(0);
                IpAddr::V6(segments.into())
            }
        },
        v4 => v4,
    }
}

impl FailureThrottle {
    /// How long `ip`'s requests without a valid token are still refused, if they are.
    pub(crate) fn refused_for(&self, ip: IpAddr) -> Option<Duration> {
        let failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let (count, since) = failures.get(&key(ip))?;
        let left = FAILURE_WINDOW.checked_sub(since.elapsed())?;
        (*count >= MAX_FAILURES).then_some(left)
    }

    /// Counts a failed authentication from `ip`.
    pub(crate) fn failed(&self, ip: IpAddr) {
        let mut failures = self.failures.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        if failures.len() >= MAX_TRACKED_ADDRESSES && !failures.contains_key(&key(ip)) {
            failures.retain(|_, (_, since)| now.duration_since(*since) < FAILURE_WINDOW);
            if failures.len() >= MAX_TRACKED_ADDRESSES
                && let Some(oldest) = failures
                    .iter()
                    .min_by_key(|(_, (_, since))| *since)
                    .map(|(ip, _)| *ip)
            {
                failures.remove(&oldest);
            }
        }
        let entry = failures.entry(key(ip)).or_insert((0, now));
        if now.duration_since(entry.1) >= FAILURE_WINDOW {
            *entry = (0, now);
        }
        entry.0 = entry.0.saturating_add(1);
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        self.failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_refused_after_repeated_failures_and_others_are_not() {
        let throttle = FailureThrottle::default();
        let attacker: IpAddr = "2001:db8::1".parse().expect("ip");
        for _ in 0..MAX_FAILURES - 1 {
            throttle.failed(attacker);
        }
        assert_eq!(throttle.refused_for(attacker), None);
        throttle.failed(attacker);
        assert!(throttle.refused_for(attacker).is_some());
        // Same /64: the same host.
        assert!(
            throttle
                .refused_for("2001:db8::ffff".parse().expect("ip"))
                .is_some()
        );
        assert_eq!(throttle.refused_for("192.0.2.1".parse().expect("ip")), None);
    }

    #[test]
    fn refusal_ends_with_the_window() {
        let throttle = FailureThrottle::default();
        let ip: IpAddr = "192.0.2.7".parse().expect("ip");
        for _ in 0..MAX_FAILURES {
            throttle.failed(ip);
        }
        let left = throttle.refused_for(ip).expect("refused");
        assert!(left <= FAILURE_WINDOW);
    }

    #[test]
    fn the_counter_is_bounded() {
        let throttle = FailureThrottle::default();
        for n in 0..(MAX_TRACKED_ADDRESSES as u32 + 100) {
            throttle.failed(IpAddr::V4(n.into()));
        }
        assert!(throttle.tracked() <= MAX_TRACKED_ADDRESSES);
    }
}
