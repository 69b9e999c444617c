//! No single delivery can stop a queue unnoticed. A delivery that ends every broker session it
//! reaches, for a reason the library cannot see (here: the connection closed as it arrives,
//! by fault injection), comes back first on each new session. The consumer must name it in a
//! warning (its id and properties, never its body), count the repeated losses, and still get
//! every message processed once when the fault stops.

use inbox_testkit::env::{TestEnv, thing};
use metrics_util::registry::Registry;
use rabbit_inbox::{InboxStatus, telemetry::metrics as m};

use crate::capture::{Counters, capture_logs};

// One thread: the log subscriber and the recorder are this thread's, and so the consumer's.
#[tokio::test]
async fn a_delivery_that_ends_every_session_it_reaches_is_named_and_counted() {
    let (captured, _logs) = capture_logs("rabbit_inbox=info");
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
