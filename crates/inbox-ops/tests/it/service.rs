//! The service builder against the real servers: a built service processes messages, is ready
//! while it consumes and stops within its shutdown timeout; a pool too small for what shares
//! it is refused at build with the numbers; a consumer that cannot stop in time is named and
//! abandoned; a task that ends shows in the service's health.

use std::{sync::Arc, time::Duration};

use inbox_ops::Service;
use inbox_testkit::env::{
    DEADLINE, Latch, OpenOnDrop, Rule, TestEnv, amqp_url, database_url, thing, wait_for,
};
use rabbit_inbox::{ConfigError, InboxStatus, RunError};
use sqlx::postgres::PgPoolOptions;
use tokio::sync::oneshot;

/// Runs `service` in a task; the sender stops it.
fn spawn(
    service: Service,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), RunError>>,
) {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(service.run(async move {
        let _ = stopped.await;
    }));
    (stop, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_built_service_processes_messages_is_ready_and_stops_within_its_timeout() {
    let env = TestEnv::new().await;
    let topology = env.topology("svc");
    let config = env.config("svc", topology.clone());
    let (handler, _plan) = env.handler();
    let service = Service::builder(amqp_url(), env.pool.clone(), config)
        .handler(handler)
        .sampler_interval(Duration::from_millis(200))
        .shutdown_timeout(Duration::from_secs(10))
        .build()
        .expect("the defaults fit the test pool");
    let shares = service.pool_shares().clone();
    assert_eq!(
        (shares.lanes, shares.relay, shares.required()),
        (2, 2, 8),
        "2 lanes + 1, relay 2, sampler, retention and recovery 1 each"
    );
    let health = service.health();
    let stats = service.stats();
    assert!(!health.is_ready(), "not ready before it runs");
    let (stop, task) = spawn(service);

    let ready = tokio::time::timeout(DEADLINE, health.wait_for(|s| s.ready))
        .await
        .expect("ready once it consumes");
    assert!(ready.connected && ready.consuming && ready.live);
    let names: Vec<&str> = ready.tasks.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["consumer", "relay", "sampler", "retention", "recovery"]
    );
    assert!(ready.tasks.iter().all(|t| t.running));

    for i in 0..5 {
        env.publish(&topology, &thing(&format!("m{i}"), i)).await;
    }
    for i in 0..5 {
        env.wait_for_record("svc", &format!("m{i}"), "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    }
    wait_for("all five acked", async || stats.settled() >= 5).await;

    let asked = tokio::time::Instant::now();
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("stops within its shutdown timeout")
        .expect("no panic")
        .expect("a clean stop");
    assert!(asked.elapsed() < Duration::from_secs(10));
    for i in 0..5 {
        assert_eq!(env.effects(&format!("m{i}")).await, 1);
    }
    let stopped = health.snapshot();
    assert!(!stopped.ready && stopped.stopping && !stopped.connected);
    assert!(
        stopped
            .tasks
            .iter()
            .all(|t| !t.running && t.error.is_none()),
        "{stopped:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_too_small_for_what_shares_it_is_refused_at_build_with_the_numbers() {
    let env = TestEnv::new().await;
    let mut config = env.config("svc", env.topology("small"));
    config.lanes = 4;
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect_lazy(&database_url())
        .expect("a lazy pool");
    let (handler, _plan) = env.handler();
    let builder = Service::builder(amqp_url(), pool.clone(), config.clone()).handler(handler);
    let err = builder
        .build()
        .expect_err("4 lanes + 1 + relay 2 + 3 tasks need 10");
    let ConfigError::PoolTooSmall {
        max_connections,
        required,
        shares,
    } = &err
    else {
        panic!("expected PoolTooSmall, got {err}");
    };
    assert_eq!((*max_connections, *required), (8, 10));
    assert_eq!(
        shares,
        "consumer 4 lanes + 1 = 5, relay 2, sampler 1, retention 1, recovery 1"
    );
    let shown = err.to_string();
    assert!(
        shown.contains("allows 8 connections") && shown.contains("at least 10"),
        "{shown}"
    );

    // Without the relay and the sampler the same pool is enough.
    let (handler, _plan) = env.handler();
    Service::builder(amqp_url(), pool, config)
        .handler(handler)
        .without_relay()
        .without_sampler()
        .build()
        .expect("4 lanes + 1 + retention + recovery = 7 fit in 8");

    let (handler, _plan) = env.handler();
    let err = Service::builder(
        amqp_url(),
        env.pool.clone(),
        env.config("svc", env.topology("u")),
    )
    .handler(handler)
    .retention(rabbit_inbox::retention::RetentionPolicy {
        processed: Duration::from_secs(60),
        scrub_payload_after: None,
        ..Default::default()
    })
    .build()
    .expect_err("a dedup window shorter than the redelivery horizon");
    assert!(
        matches!(err, ConfigError::UnsafeRetentionWindow(_)),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_cannot_stop_in_time_is_named_and_its_delivery_comes_back() {
    let env = TestEnv::new().await;
    let topology = env.topology("stuck");
    let config = env.config("svc", topology.clone());
    let (handler, plan) = env.handler();
    let latch = Arc::new(Latch::default());
    let _open = OpenOnDrop(latch.clone());
    plan.for_id("held", Rule::Hold(latch.clone()));
    let timeout = Duration::from_millis(500);
    let service = Service::builder(amqp_url(), env.pool.clone(), config)
        .handler(handler)
        .without_relay()
        .shutdown_timeout(timeout)
        .build()
        .expect("valid");
    let health = service.health();
    let (stop, task) = spawn(service);
    tokio::time::timeout(DEADLINE, health.wait_for(|s| s.ready))
        .await
        .expect("ready");
    env.publish(&topology, &thing("held", 1)).await;
    wait_for("the handler holds the message", async || {
        latch.arrivals() >= 1
    })
    .await;

    let asked = tokio::time::Instant::now();
    let _ = stop.send(());
    let err = tokio::time::timeout(DEADLINE, task)
        .await
        .expect("the run ends at the timeout")
        .expect("no panic")
        .expect_err("the consumer could not stop");
    let waited = asked.elapsed();
    assert!(
        waited >= timeout && waited < timeout + Duration::from_secs(5),
        "{waited:?}"
    );
    let RunError::ShutdownTimedOut { unfinished, .. } = &err else {
        panic!("expected a timeout, got {err}");
    };
    assert_eq!(unfinished, &["consumer"], "{err}");
    assert!(
        err.to_string().starts_with("consumer did not stop"),
        "{err}"
    );

    // Abandoned unsettled: once its connection is gone the broker hands the message out again,
    // and a consumer that can process it does, once.
    latch.open();
    plan.clear_id("held");
    let (handler, _plan) = env.handler();
    let running = env.start(env.config("svc", topology.clone()), handler);
    env.wait_for_record("svc", "held", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    running.stop().await;
    assert_eq!(env.effects("held").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_ends_shows_in_the_health_and_stops_the_service() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("ends"));
    let (handler, _plan) = env.handler();
    let builder = Service::builder(amqp_url(), env.pool.clone(), config)
        .handler(handler)
        .without_relay();
    // The task waits for the service to be ready, then fails, as a probe server whose port is
    // taken would.
    let (ready_tx, ready_rx) = oneshot::channel::<()>();
    let service = builder.build().expect("valid");
    let health = service.health();
    let service = service.task("probes", move |_stop| async move {
        let _ = ready_rx.await;
        Err::<(), _>(std::io::Error::other("address in use"))
    });
    let task = tokio::spawn(service.run(std::future::pending()));
    tokio::time::timeout(DEADLINE, health.wait_for(|s| s.ready))
        .await
        .expect("ready");
    let _ = ready_tx.send(());
    let err = tokio::time::timeout(DEADLINE, task)
        .await
        .expect("the service stops")
        .expect("no panic")
        .expect_err("the task's error ends the run");
    assert_eq!(err.tasks(), ["probes"]);
    let s = health.snapshot();
    assert!(!s.live && !s.ready);
    let probes = s.tasks.iter().find(|t| t.name == "probes").expect("listed");
    assert!(!probes.running && probes.ended_at.is_some());
    assert_eq!(probes.error.as_deref(), Some("address in use"));
}
