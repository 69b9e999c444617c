//! The consumer's health against the real servers: ready once it connects and consumes; not
//! ready, with the session's error and its time, while a dropped broker connection is being
//! reopened; ready again after, the error kept.

use std::time::Duration;

use inbox_testkit::env::{DEADLINE, Running, TestEnv, amqp_url, thing};
use rabbit_inbox::{Consumer, InboxStatus};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_while_consuming_not_ready_while_the_connection_is_down_then_ready_again() {
    let env = TestEnv::new().await;
    let topology = env.topology("health");
    let mut config = env.config("svc", topology.clone());
    // Long enough to observe the gap between the loss and the next session.
    config.reconnect_initial_delay = Duration::from_secs(2);
    config.reconnect_max_delay = Duration::from_secs(4);
    let (handler, _plan) = env.handler();
    let consumer = Consumer::new(amqp_url(), env.pool.clone(), config, handler).expect("valid");
    let health = consumer.health();
    let faults = consumer.faults();
    let initial = health.snapshot();
    assert!(initial.live && !initial.ready && !initial.connected);

    let running = Running::spawn(consumer);
    let ready = tokio::time::timeout(DEADLINE, health.wait_for(|s| s.ready))
        .await
        .expect("ready once it consumes");
    assert!(ready.connected && ready.consuming && ready.consuming_since.is_some());
    assert_eq!(ready.sessions, 1);
    assert!(ready.last_session_error.is_none());

    let before_loss = chrono::Utc::now();
    faults.drop_connection_on_receipt_of("breaker", 1);
    env.publish(&topology, &thing("breaker", 1)).await;
    let down = tokio::time::timeout(DEADLINE, health.wait_for(|s| !s.ready))
        .await
        .expect("not ready once the connection drops");
    assert!(down.live, "an outage is not a reason to restart");
    assert!(!down.connected && !down.consuming, "{down:?}");
    let error = down.last_session_error.expect("the loss is named");
    assert!(!error.error.is_empty());
    assert!(error.at >= before_loss, "{error:?}");
    let json = serde_json::to_value(health.snapshot()).expect("serializes");
    assert_eq!(json["ready"], false);
    assert!(json["last_session_error"]["at"].is_string(), "{json}");

    let again = tokio::time::timeout(DEADLINE, health.wait_for(|s| s.ready))
        .await
        .expect("ready again once it reconnects");
    assert_eq!(again.sessions, 2);
    assert_eq!(
        again.last_session_error,
        Some(error),
        "the last error stays"
    );
    env.wait_for_record("svc", "breaker", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    running.stop().await;
    let stopped = health.snapshot();
    assert!(!stopped.ready && !stopped.connected && stopped.stopping);
    assert_eq!(env.effects("breaker").await, 1);
}
