//! Broker-side hardening against the real servers: parked copies that survive the producer's
//! properties, tiered retries on classic and quorum queues, and a parking lot that refuses
//! copies without the consumer reconnecting in a loop.

// Shared with the other integration tests; not every helper is used here.

use std::time::Duration;

use inbox_testkit::env::{Rule, TestEnv, amqp_url, header, thing, wait_for};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties,
    options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions},
    types::FieldTable,
};
use rabbit_inbox::{ConsumerConfig, InboxStatus, QueueType, RetryPolicy, status::parking_headers};
use tokio::time::Instant;

/// Runs `rabbitmqctl args`; panics when it fails.
fn rabbitmqctl(args: &[&str]) -> String {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A RabbitMQ user with full permissions on `/`, deleted when dropped.
struct TempUser {
    name: String,
    password: String,
}

impl TempUser {
    fn create(name: String) -> Self {
        let password = format!("pw-{}", inbox_testkit::env::random_hex());
        rabbitmqctl(&["add_user", &name, &password]);
        let user = Self { name, password };
        rabbitmqctl(&["set_permissions", "-p", "/", &user.name, ".*", ".*", ".*"]);
        user
    }

    /// The test's AMQP URL with this user's credentials.
    fn url(&self) -> String {
        let url = amqp_url();
        let (scheme, rest) = url.split_once("://").expect("URL has a scheme");
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{}:{}@{host}", self.name, self.password)
    }
}

impl Drop for TempUser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("rabbitmqctl")
            .args(["delete_user", &self.name])
            .output();
    }
}

/// Queues the environment's cleanup does not know (retry tiers other than its default),
/// deleted when dropped.
struct DeleteOnDrop(Vec<String>);

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        for queue in &self.0 {
            let _ = std::process::Command::new("rabbitmqctl")
                .args(["delete_queue", queue])
                .output();
        }
    }
}

async fn channel(url: &str) -> (Connection, Channel) {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("RabbitMQ is reachable");
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    (connection, channel)
}

/// Publishes `message` to `queue` with extra AMQP properties, confirmed.
async fn publish_with(
    channel: &Channel,
    queue: &str,
    message: &rabbit_inbox::broker::OutgoingMessage,
    extra: impl FnOnce(BasicProperties) -> BasicProperties,
) {
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(message.message_id.as_deref().expect("an id").into())
        .with_type(message.kind.as_deref().expect("a type").into());
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            &message.body,
            extra(properties),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert_eq!(confirm, Confirmation::Ack(None), "publish confirmed");
}

/// Messages in `queue` (passive declare).
async fn depth(channel: &Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue exists")
        .message_count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_copy_does_not_inherit_expiration_or_user_id() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("park-props"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("expiring", Rule::Permanent);
    plan.for_id("foreign-user", Rule::Permanent);
    let consumer = env.start(config, handler);

    let producer = TempUser::create(format!("t-{}-producer", env.id));
    let (guest_conn, guest) = channel(&amqp_url()).await;
    let (producer_conn, as_producer) = channel(&producer.url()).await;
    publish_with(&guest, &topology.queue, &thing("expiring", 1), |p| {
        p.with_expiration("2000".into())
    })
    .await;
    publish_with(
        &as_producer,
        &topology.queue,
        &thing("foreign-user", 2),
        |p| p.with_user_id(producer.name.as_str().into()),
    )
    .await;

    for id in ["expiring", "foreign-user"] {
        env.wait_for_record("svc", id, "PERMANENT_FAILED", |r| {
            r.status == InboxStatus::PermanentFailed
        })
        .await;
    }
    // Both parked (the broker took the copy of the other user's message).
    wait_for("two parked copies", async || {
        env.depths(&topology).await.parking >= 2
    })
    .await;
    // Past the producer's expiration: a copy that inherited it would be gone by now.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let stats = consumer.stop().await;
    let parked = env.take_parked(&topology, 2).await;

    assert_eq!(parked.len(), 2, "both copies are still in the parking lot");
    let find = |id: &str| {
        parked
            .iter()
            .find(|m| m.message_id.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("{id} parked"))
    };
    let expiring = find("expiring");
    assert_eq!(
        header(expiring, parking_headers::ORIGINAL_EXPIRATION),
        Some("2000")
    );
    assert_eq!(header(expiring, parking_headers::ORIGINAL_USER_ID), None);
    assert_eq!(
        header(expiring, parking_headers::STATUS),
        Some("PERMANENT_FAILED")
    );
    let foreign = find("foreign-user");
    assert_eq!(
        header(foreign, parking_headers::ORIGINAL_USER_ID),
        Some(producer.name.as_str())
    );
    assert_eq!(header(foreign, parking_headers::ORIGINAL_EXPIRATION), None);
    assert_eq!(
        header(foreign, parking_headers::ORIGINAL_ROUTING_KEY),
        Some(topology.queue.as_str())
    );
    assert_eq!(stats.sessions, 1, "the session was never torn down");
    assert_eq!(stats.settle_failures, 0);
    assert_eq!(stats.parked, 2, "each parked once: {stats:?}");
    assert_eq!(env.depths(&topology).await.work, 0);
    let _ = guest_conn.close(200, "bye".into()).await;
    let _ = producer_conn.close(200, "bye".into()).await;
}

/// A message failing retryably twice, then succeeding, waits in the first tier after attempt
/// 1 and in the second after attempt 2.
async fn retries_go_through_the_tier_of_their_attempt(queue_type: QueueType) {
    let env = TestEnv::new().await;
    let name = match queue_type {
        QueueType::Classic => "tiers-classic",
        QueueType::Quorum => "tiers-quorum",
        other => panic!("no test topology for {other:?}"),
    };
    let mut topology = env.topology(name);
    topology.queue_type = queue_type;
    let mut config: ConsumerConfig = env.config("svc", topology.clone());
    let (short, long) = (Duration::from_millis(500), Duration::from_millis(2500));
    config.retry = RetryPolicy {
        max_attempts: 5,
        ..RetryPolicy::tiered(vec![short, long])
    };
    let tiers = topology.retry_tier_queues(&config.retry);
    assert_eq!(
        tiers,
        [
            format!("{}.500ms", topology.retry_queue),
            format!("{}.2500ms", topology.retry_queue)
        ]
    );
    let _tiers_cleanup = DeleteOnDrop(tiers.clone());
    env.declare(&config).await;
    if queue_type == QueueType::Quorum {
        let listed = rabbitmqctl(&["-q", "list_queues", "name", "arguments"]);
        for queue in [&topology.queue, &tiers[0], &tiers[1]] {
            let line = listed
                .lines()
                .find(|l| l.split('\t').next() == Some(queue.as_str()))
                .unwrap_or_else(|| panic!("{queue} listed"));
            assert!(
                line.contains("at-least-once") && line.contains("reject-publish"),
                "{queue} dead-letters at least once: {line}"
            );
        }
    }
    let (handler, plan) = env.handler();
    plan.for_id("m1", Rule::FailAttempts(2));
    let consumer = env.start(config.clone(), handler);
    let (conn, observer) = channel(&amqp_url()).await;
    env.publish(&topology, &thing("m1", 1)).await;

    // Which tier holds the message, as it moves.
    let mut seen: Vec<usize> = Vec::new();
    let deadline = Instant::now() + inbox_testkit::env::DEADLINE;
    loop {
        for (i, tier) in tiers.iter().enumerate() {
            if depth(&observer, tier).await > 0 && seen.last() != Some(&i) {
                seen.push(i);
            }
        }
        let row = env.record("svc", "m1").await;
        if row.is_some_and(|r| r.status == InboxStatus::Processed) {
            break;
        }
        assert!(Instant::now() < deadline, "m1 not processed in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let row = env.record("svc", "m1").await.expect("row");
    let stats = consumer.stop().await;

    // Exactly tier 1, then tier 2. (Copy locks were once keyed without the schema, so another
    // test's inbox with the same consumer name and message id sent this copy round tier 1
    // again under a full parallel run.)
    assert_eq!(seen, [0, 1], "waited in tier 1, then in tier 2");
    assert_eq!(row.processing_attempt, 3);
    let first = row.first_failed_at.expect("failed once");
    let second = row.last_failed_at.expect("failed twice");
    let done = row.processed_at.expect("processed");
    let waited_first = (second - first).to_std().expect("ordered");
    let waited_second = (done - second).to_std().expect("ordered");
    assert!(
        waited_first >= short - Duration::from_millis(50) && waited_first < long,
        "after attempt 1 it waited the first tier's delay: {waited_first:?}"
    );
    assert!(
        waited_second >= long - Duration::from_millis(50),
        "after attempt 2 it waited the second tier's delay: {waited_second:?}"
    );
    assert_eq!(env.effects("m1").await, 1);
    // Two failed attempts, each recorded once, and two retries.
    let failed = env
        .scalar(&format!(
            "SELECT count(*) FROM \"{}\".inbox_event WHERE message_id = 'm1' AND kind = 'failed'",
            env.schema
        ))
        .await;
    assert_eq!(failed, 2);
    assert_eq!(stats.retried, 2, "{stats:?}");
    assert_eq!(stats.sessions, 1);
    let depths = env
        .broker
        .queue_depths(&topology, &config.retry)
        .await
        .expect("depths");
    assert_eq!((depths.work, depths.retry, depths.parking), (0, 0, 0));
    let _ = conn.close(200, "bye".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_go_through_the_tier_of_their_attempt_on_classic_queues() {
    retries_go_through_the_tier_of_their_attempt(QueueType::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_go_through_the_tier_of_their_attempt_on_quorum_queues() {
    retries_go_through_the_tier_of_their_attempt(QueueType::Quorum).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_parking_backs_off_without_reconnecting() {
    let env = TestEnv::new().await;
    let config = env.config("svc", env.topology("park-refused"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("m1", Rule::Permanent);
    let consumer = env.start(config.clone(), handler);
    wait_for("the consumer's session", async || {
        consumer.snapshot().sessions == 1
    })
    .await;

    // The parking lot goes away: every parking publish is returned as unroutable.
    let (conn, admin) = channel(&amqp_url()).await;
    admin
        .queue_delete(
            topology.parking_queue.as_str().into(),
            QueueDeleteOptions::default(),
        )
        .await
        .expect("delete the parking lot");
    env.publish(&topology, &thing("m1", 1)).await;
    env.wait_for_record("svc", "m1", "PERMANENT_FAILED", |r| {
        r.status == InboxStatus::PermanentFailed
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let during = consumer.snapshot();
    assert_eq!(
        during.sessions, 1,
        "a refused parking publish does not end the session: {during:?}"
    );
    // Back-off from 100 ms doubling to 1 s: about seven tries in four seconds, not a hot loop.
    assert!(
        during.received <= 12,
        "deliveries of m1 in 4 s: {}",
        during.received
    );

    // The parking lot is back: the next try parks the message, once.
    env.declare(&config).await;
    let parked = env.take_parked(&topology, 1).await;
    let stats = consumer.stop().await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].message_id.as_deref(), Some("m1"));
    assert_eq!(
        header(&parked[0], parking_headers::STATUS),
        Some("PERMANENT_FAILED")
    );
    assert_eq!(stats.sessions, 1);
    assert_eq!(env.depths(&topology).await.work, 0, "nothing left behind");
    let row = env.record("svc", "m1").await.expect("row");
    assert_eq!(row.status, InboxStatus::PermanentFailed);
    let _ = conn.close(200, "bye".into()).await;
}
