//! What the workspace's integration tests share: where the servers are, names no other test
//! uses, waiting for a condition, and what a test does when a part it needs is missing.
//!
//! Tests talk to real servers; isolation comes from unique names ([`unique_suffix`]), not from
//! fresh servers. [`mod@env`] holds a scratch inbox (its own schema and queues, removed when
//! dropped) with test handlers, for the library's and the operator crate's tests.
//! [`layering`] checks that a crate's modules import only the layers below them.

pub mod env;
pub mod layering;

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

/// Makes `subscriber` this thread's default until the guard drops, for a test that captures
/// spans or logs while other tests of the binary run on other threads.
///
/// `tracing` caches per callsite whether any subscriber is interested, process-wide. While a
/// single subscriber is registered it asks only the current thread's default, so a callsite
/// first reached by another test's thread would be cached as uninteresting and this test's
/// subscriber would never see it. A second registered subscriber, kept for the process's
/// life, makes every registration ask all of them.
pub fn set_scoped_subscriber(
    subscriber: impl tracing::Subscriber + Send + Sync + 'static,
) -> tracing::subscriber::DefaultGuard {
    static ALWAYS_REGISTERED: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    ALWAYS_REGISTERED
        .get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default()));
    tracing::subscriber::set_default(subscriber)
}

#[cfg(test)]
mod tests {
    use super::{set_scoped_subscriber, unique_suffix};

    /// Counts the events it is offered.
    struct Counting(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl tracing::Subscriber for Counting {
        fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, _: &tracing::Event<'_>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }

    #[test]
    fn a_callsite_first_reached_on_another_thread_still_reaches_the_scoped_subscriber() {
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let _guard = set_scoped_subscriber(Counting(seen.clone()));
        // The same callsite, reached first on a thread without a subscriber of its own.
        let emit = || tracing::info!("reached");
        std::thread::scope(|s| {
            s.spawn(emit);
        });
        emit();
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

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

/// Drops a schema when dropped, also while a panicking test unwinds: from a thread with a
/// runtime of its own, since the test's runtime may be gone.
#[derive(Debug)]
pub struct DropSchemaOnDrop(pub rabbit_inbox::SchemaName);

impl Drop for DropSchemaOnDrop {
    fn drop(&mut self) {
        let schema = self.0.clone();
        let _ = std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("cleanup: cannot build a runtime: {e}");
                    return;
                }
            };
            runtime.block_on(async {
                match sqlx::PgPool::connect(&database_url()).await {
                    Ok(pool) => {
                        if let Err(e) = rabbit_inbox::schema::drop_schema(&pool, &schema).await {
                            eprintln!("cleanup: dropping schema {schema}: {e}");
                        }
                        pool.close().await;
                    }
                    Err(e) => eprintln!("cleanup: cannot reach PostgreSQL: {e}"),
                }
            });
        })
        .join();
    }
}
