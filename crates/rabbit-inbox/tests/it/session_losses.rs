//! No single delivery can stop a queue unnoticed. A delivery that ends every broker session it
//! reaches, for a reason the library cannot see (here: the connection closed as it arrives,
//! by fault injection), comes back first on each new session. The consumer must name it in a
//! warning (its id and properties, never its body), count the repeated losses, and still get
//! every message processed once when the fault stops.

// Shared with the other integration tests; not every helper is used here.

use std::{
    io::Write,
    sync::{Arc, Mutex, PoisonError},
};

use inbox_testkit::env::{TestEnv, thing};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_util::registry::{AtomicStorage, Registry};
use rabbit_inbox::{InboxStatus, telemetry::metrics as m};
use tracing_subscriber::{Layer, layer::SubscriberExt};

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

// One thread: the log subscriber and the recorder are this thread's, and so the consumer's.
#[tokio::test]
async fn a_delivery_that_ends_every_session_it_reaches_is_named_and_counted() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .with_filter(tracing_subscriber::EnvFilter::new("rabbit_inbox=info")),
    );
    let _logs = inbox_testkit::set_scoped_subscriber(subscriber);
    let counters = Counters(Registry::atomic());
    let _metrics = metrics::set_default_local_recorder(&counters);

    let env = TestEnv::new().await;
    let topology = env.topology("losses");
    let config = env.config("svc", topology.clone());
    env.declare(&config).await;
    let (handler, _plan) = env.handler();
    let running = env.start(config, handler);
    running.faults.drop_connection_on_receipt_of("killer", 3);

    let mut killer = thing("killer", 1);
    killer.body = br#"{"id":"killer","n":1,"card":"BODY-MARKER"}"#.to_vec();
    env.publish(&topology, &killer).await;
    env.publish(&topology, &thing("after", 1)).await;

    for id in ["killer", "after"] {
        env.wait_for_record("svc", id, "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    }
    // Acked only once the fault has run out: every earlier session lost its channel first.
    // (The work queue's ready count says nothing here: a delivery in hand is not ready.)
    inbox_testkit::env::wait_for("both acked", async || running.stats.settled() >= 2).await;
    let stats = running.stop().await;
    assert_eq!(
        env.effects("killer").await,
        1,
        "once, through three lost sessions"
    );
    assert_eq!(env.effects("after").await, 1);
    assert_eq!(stats.sessions, 4, "three lost, one that lived");
    // The first loss repeats nothing; the second and third had killer unsettled again.
    assert_eq!(stats.repeated_session_losses, 2);
    assert_eq!(
        counters.get(
            m::REPEATED_SESSION_LOSSES,
            &[("consumer", "svc"), ("cause", m::SAME_DELIVERY)]
        ),
        2
    );

    let log = captured.text();
    let named: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("delivery unsettled in consecutive lost broker sessions"))
        .filter(|l| l.contains("inbox_key=killer"))
        .collect();
    assert_eq!(named.len(), 2, "{log}");
    for (line, consecutive) in named.iter().zip([2, 3]) {
        assert!(line.contains(" WARN "), "{line}");
        for field in [
            "message_id=\"killer\"".to_owned(),
            "delivery_tag=".to_owned(),
            "redelivered=true".to_owned(),
            "message_type=Thing".to_owned(),
            "header_bytes=".to_owned(),
            format!("body_bytes={}", killer.body.len()),
            format!("consecutive={consecutive}"),
        ] {
            assert!(line.contains(&field), "{field} in {line}");
        }
    }
    assert!(
        !log.contains("BODY-MARKER"),
        "a body reached the log: {log}"
    );
}
