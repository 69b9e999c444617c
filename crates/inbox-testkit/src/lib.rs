//! What the workspace's integration tests share: where the servers are, names no other test
//! uses, waiting for a condition, and what a test does when a part it needs is missing.
//!
//! Tests talk to real servers; isolation comes from unique names ([`unique_suffix`]), not from
//! fresh servers. [`mod@env`] holds a scratch inbox (its own schema and queues, removed when
//! dropped) with test handlers, for the library's and the operator crate's tests.

pub mod env;

use std::{
    hash::{BuildHasher, RandomState},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant, SystemTime},
};

/// Set by `scripts/test`: a test whose dependency is missing fails instead of skipping.
pub const REQUIRE_ALL: &str = "RABBIT_INBOX_REQUIRE_ALL";

/// PostgreSQL for the tests: `DATABASE_URL`, or the local server.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// RabbitMQ for the tests: `AMQP_URL`, or the local broker.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// 16 lowercase hex digits, different on every call in every process: the suffix of a test's
/// schema, queue and exchange names.
pub fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let h = RandomState::new().hash_one((n, SystemTime::now(), std::process::id()));
    format!("{h:016x}")
}

/// A part the test needs is missing (`what`, and `how` to provide it). Under `scripts/test`
/// (`RABBIT_INBOX_REQUIRE_ALL` set) the test fails saying so; under a plain `cargo test` it
/// prints a note and the caller returns early, skipping the test.
///
/// # Panics
/// When `RABBIT_INBOX_REQUIRE_ALL` is set: a skipped test would pass unseen.
pub fn missing(what: &str, how: &str) {
    if std::env::var_os(REQUIRE_ALL).is_some() {
        panic!("missing: {what} ({how}); {REQUIRE_ALL} is set, so this test may not skip");
    }
    eprintln!("SKIPPED: {what} ({how})");
}

/// Polls `check` every 50 ms until it holds.
///
/// # Panics
/// After `timeout`, naming `what` was awaited.
pub async fn wait_for(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::unique_suffix;

    #[test]
    fn suffixes_differ_and_fit_a_schema_name() {
        let (a, b) = (unique_suffix(), unique_suffix());
        assert_ne!(a, b);
        assert!(
            a.len() == 16
                && a.bytes()
                    .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
    }
}
