//! Several broker addresses, and quorum queues on the local three-node cluster that
//! `scripts/rabbitmq-cluster.sh start` runs (nodes on ports 5681-5683, or the URLs in
//! `RABBIT_INBOX_CLUSTER_URLS`). The cluster tests are skipped, with a note, when the cluster is
//! not running; `scripts/test` starts it.

// Shared with the other integration tests; not every helper is used here.

use std::{path::PathBuf, process::Command, time::Duration};

use inbox_testkit::env::{Running, TestEnv, amqp_url, thing, wait_for};
use rabbit_inbox::{
    ConfigError, Consumer, InboxStatus, QueueType, RetryPolicy, Topology, broker::Broker,
    broker::OutgoingMessage,
};

fn cluster_urls() -> Vec<String> {
    match std::env::var("RABBIT_INBOX_CLUSTER_URLS") {
        Ok(list) => list.split(',').map(str::to_owned).collect(),
        Err(_) => (1..=3)
            .map(|n| format!("amqp://guest:guest@127.0.0.1:{}/%2f", 5680 + n))
            .collect(),
    }
}

/// The cluster's URLs if node 1 answers, else `None` after saying how to start it.
async fn cluster() -> Option<Vec<String>> {
    let urls = cluster_urls();
    match Broker::connect(&urls[0], "rabbit-inbox test probe").await {
        Ok(b) => {
            b.close().await;
            Some(urls)
        }
        Err(e) => {
            inbox_testkit::missing(
                &format!("the local RabbitMQ cluster ({e})"),
                "start it with scripts/rabbitmq-cluster.sh start",
            );
            None
        }
    }
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/rabbitmq-cluster.sh")
}

/// Runs the cluster script; panics with its output when it fails.
fn run_script(args: &[&str]) -> String {
    let out = Command::new(script())
        .args(args)
        .output()
        .expect("cluster script runs");
    assert!(
        out.status.success(),
        "rabbitmq-cluster.sh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn rabbitmqctl(node: usize, args: &[&str]) -> String {
    let name = format!("inbox-c{node}@localhost");
    let out = Command::new("rabbitmqctl")
        .args(["-q", "-n", &name])
        .args(args)
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl -n {name} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Brings node `n` back when dropped, also when the test fails while it is down.
struct NodeDown(usize);

impl Drop for NodeDown {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .args(["start-node", &self.0.to_string()])
            .output();
    }
}

/// Publishes `messages` to `queue` through `url` with confirms, republishing the whole batch
/// on a new connection when a confirm does not come (a leader election in progress): the
/// copies that made it are duplicates the inbox recognises.
async fn publish_until_confirmed(url: &str, queue: &str, messages: &[OutgoingMessage]) {
    let batch: Vec<(&str, &OutgoingMessage)> = messages.iter().map(|m| (queue, m)).collect();
    wait_for("a confirmed publish to the cluster", async || {
        let Ok(broker) = Broker::connect(url, "rabbit-inbox test publisher").await else {
            return false;
        };
        let sent = tokio::time::timeout(Duration::from_secs(10), broker.publish_batch("", &batch))
            .await
            .is_ok_and(|r| r.is_ok());
        broker.close().await;
        sent
    })
    .await;
}

/// Deletes the topology from the cluster when dropped.
struct ClusterQueues {
    url: String,
    topology: Topology,
    retry: RetryPolicy,
}

impl Drop for ClusterQueues {
    fn drop(&mut self) {
        let (url, topology, retry) = (self.url.clone(), self.topology.clone(), self.retry.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                if let Ok(b) = Broker::connect(&url, "rabbit-inbox test cleanup").await {
                    let _ = b.delete(&topology, &retry).await;
                    b.close().await;
                }
            });
        })
        .join();
    }
}

#[tokio::test]
async fn a_bad_address_in_the_list_is_refused_when_the_consumer_is_built() {
    let env = TestEnv::new().await;
    let config = env.config("addresses", env.topology("bad-address"));
    let (handler, _) = env.handler();
    let list = format!("{},http://127.0.0.1:5672/", amqp_url());
    match Consumer::new(list, env.pool.clone(), config, handler) {
        Err(ConfigError::InvalidSetting { name, reason }) => {
            assert_eq!(name, "amqp_url");
            assert!(reason.contains("http"), "{reason}");
        }
        Err(other) => panic!("unexpected error: {other}"),
        Ok(_) => panic!("an http:// address must be refused"),
    }
}

#[tokio::test]
async fn an_unreachable_first_address_is_passed_over_and_the_connection_names_its_node() {
    let env = TestEnv::new().await;
    let consumer_name = format!("addr-{}", env.id);
    let config = env.config(&consumer_name, env.topology("fallback"));
    env.declare(&config).await;
    let (handler, _) = env.handler();
    // Nothing listens on port 1: refused at once, and the next address is taken.
    let list = format!("amqp://guest:guest@127.0.0.1:1/%2f,{}", amqp_url());
    let running = Running::spawn(
        Consumer::new(list, env.pool.clone(), config.clone(), handler).expect("valid config"),
    );
    for i in 0..20 {
        env.publish(&config.topology, &thing(&format!("m{i}"), i))
            .await;
    }
    wait_for("20 effects", async || {
        env.scalar("SELECT count(DISTINCT message_id) FROM {s}.effects")
            .await
            == 20
    })
    .await;
    let out = Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "client_properties"])
        .output()
        .expect("rabbitmqctl runs");
    let listed = String::from_utf8_lossy(&out.stdout);
    let port = rabbit_inbox::broker::AmqpAddresses::parse(&amqp_url())
        .expect("valid")
        .nodes()
        .next()
        .expect("one")
        .to_owned();
    let wanted = format!("rabbit-inbox {consumer_name} @ {port}");
    assert!(
        listed.contains(&wanted),
        "no connection named {wanted:?} in:\n{listed}"
    );
    running.stop().await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.effects").await,
        20,
        "each effect once"
    );
}

/// A consumer given every node's address, on quorum queues: its node is stopped
/// (`stop_app`), then the node it failed over to is SIGKILLed, while messages keep arriving.
/// Every message is applied exactly once, every row is PROCESSED, the queues end empty.
#[tokio::test]
async fn quorum_consumer_fails_over_through_a_node_stop_and_a_node_kill() {
    let Some(urls) = cluster().await else {
        return;
    };
    let env = TestEnv::new().await;
    let consumer_name = format!("cluster-{}", env.id);
    let mut config = env.config(
        &consumer_name,
        Topology::new(format!("t-{}-cluster", env.id)),
    );
    config.use_quorum_queues(None);
    assert_eq!(config.topology.queue_type, QueueType::Quorum);
    // Node 3 is never taken down: the test publishes and inspects through it.
    let node3 = urls[2].clone();
    let _queues = ClusterQueues {
        url: node3.clone(),
        topology: config.topology.clone(),
        retry: config.retry.clone(),
    };
    let (handler, _) = env.handler();
    let running = Running::spawn(
        Consumer::new(urls.join(","), env.pool.clone(), config.clone(), handler)
            .expect("valid config"),
    );
    let batch = |from: i64| -> Vec<OutgoingMessage> {
        (from..from + 150)
            .map(|i| thing(&format!("c{i}"), i))
            .collect()
    };
    let applied = async |n: i64| {
        wait_for(&format!("{n} distinct effects"), async || {
            env.scalar("SELECT count(DISTINCT message_id) FROM {s}.effects")
                .await
                >= n
        })
        .await;
    };
    publish_until_confirmed(&node3, &config.topology.queue, &batch(0)).await;
    applied(50).await;
    // Declared by the consumer as the hardening settings say: quorum, at-least-once
    // dead-lettering (with reject-publish overflow), a delivery limit on the work queue.
    let listed = rabbitmqctl(3, &["list_queues", "name", "type", "arguments"]);
    let line = |queue: &str| {
        listed
            .lines()
            .find(|l| l.split_whitespace().next() == Some(queue))
            .unwrap_or_else(|| panic!("{queue} not listed:\n{listed}"))
            .to_owned()
    };
    let work = line(&config.topology.queue);
    for wanted in [
        "quorum",
        "at-least-once",
        "reject-publish",
        "x-delivery-limit",
    ] {
        assert!(work.contains(wanted), "work queue lacks {wanted}: {work}");
    }
    for tier in config.topology.retry_tier_queues(&config.retry) {
        let tier = line(&tier);
        assert!(
            tier.contains("quorum") && tier.contains("at-least-once"),
            "{tier}"
        );
    }
    assert!(line(&config.topology.parking_queue).contains("quorum"));

    // The consumer took the first address: node 1. Stop its application.
    let stopped = NodeDown(1);
    rabbitmqctl(1, &["stop_app"]);
    publish_until_confirmed(&node3, &config.topology.queue, &batch(150)).await;
    applied(300).await;
    drop(stopped);

    // It failed over to node 2 (node 1 was down when it reconnected). Kill that node.
    let killed = NodeDown(2);
    let pid: i32 = run_script(&["pid", "2"]).parse().expect("a pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("SIGKILL node 2");
    publish_until_confirmed(&node3, &config.topology.queue, &batch(300)).await;
    applied(450).await;
    drop(killed);

    let snapshot = running.stop().await;
    assert!(
        snapshot.sessions >= 3,
        "the consumer reconnected after each failure: {} sessions",
        snapshot.sessions
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM (SELECT message_id FROM {s}.effects \
             GROUP BY message_id HAVING count(*) > 1) d"
        )
        .await,
        0,
        "no message applied twice"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.effects").await, 450);
    let processed = InboxStatus::Processed.as_str();
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM {{s}}.message_inbox WHERE status = '{processed}'"
        ))
        .await,
        450
    );
    let broker = Broker::connect(&node3, "rabbit-inbox test depths")
        .await
        .expect("node 3 is up");
    let depths = broker
        .queue_depths(&config.topology, &config.retry)
        .await
        .expect("depths");
    broker.close().await;
    assert_eq!((depths.work, depths.retry, depths.parking), (0, 0, 0));
}
