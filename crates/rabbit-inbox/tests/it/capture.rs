//! What a test reads of the library's logs and metrics: both installed for the test's thread
//! only (a current-thread runtime, so the consumer's tasks run on it too).

use std::{
    io::Write,
    sync::{Arc, Mutex, PoisonError},
};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{AtomicStorage, Registry};
use tracing_subscriber::{Layer, layer::SubscriberExt};

/// Installs, for this thread, a subscriber writing the events `filter` selects (an
/// `EnvFilter` directive such as `rabbit_inbox=info`) to the returned capture, until the
/// guard drops.
pub(crate) fn capture_logs(filter: &str) -> (Captured, tracing::subscriber::DefaultGuard) {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_filter(tracing_subscriber::EnvFilter::new(filter)),
    );
    (captured, inbox_testkit::set_scoped_subscriber(subscriber))
}

/// Collects what the fmt layer writes.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(PoisonError::into_inner)).into_owned()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Keeps the counters the consumer records on this thread.
pub(crate) struct Counters(pub(crate) Registry<Key, AtomicStorage>);

impl Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        self.0
            .get_or_create_counter(key, |c| Counter::from_arc(c.clone()))
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

impl Counters {
    pub(crate) fn get(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let labels: Vec<metrics::Label> = labels
            .iter()
            .map(|(k, v)| metrics::Label::new((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.0
            .get_counter_handles()
            .get(&Key::from_parts(name.to_owned(), labels))
            .map_or(0, |c| c.load(std::sync::atomic::Ordering::Relaxed))
    }
}
