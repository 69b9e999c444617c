//! The chaos run on a RabbitMQ cluster (`inbox-lab chaos --cluster`): the nodes of the local
//! three-node cluster that `scripts/rabbitmq-cluster.sh` runs, node failures to inject (a
//! SIGKILL of a node's process, `rabbitmqctl stop_app`), and a publisher that keeps publishing
//! through them, with confirms, republishing whatever was not confirmed.

use std::{
    path::PathBuf,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use nix::{sys::signal::Signal, unistd::Pid};
use tokio::process::Command;

use crate::scenario::Published;

/// Options of a run on the cluster.
#[derive(Args, Clone, Debug)]
pub struct ClusterArgs {
    /// Run against the local three-node cluster of `--cluster-script` (quorum queues, every
    /// node's address given to the consumers), adding node kills and node stops, with the
    /// stream published while the consumers run.
    #[arg(long)]
    pub cluster: bool,
    /// The script that runs the local cluster (`start`, `urls`, `pid N`, `node N`,
    /// `start-node N`).
    #[arg(long, default_value = "scripts/rabbitmq-cluster.sh")]
    pub cluster_script: PathBuf,
    /// Nodes to SIGKILL during a cluster run, each restarted after `--node-down-secs`.
    #[arg(long, default_value_t = 3)]
    pub node_kills: usize,
    /// Nodes to stop (`rabbitmqctl stop_app`) during a cluster run, each started again after
    /// `--node-down-secs`.
    #[arg(long, default_value_t = 3)]
    pub node_stops: usize,
    /// How long a killed or stopped node stays down.
    #[arg(long, default_value_t = 5)]
    pub node_down_secs: u64,
    /// Messages per second the publisher of a cluster run publishes while the consumers run.
    #[arg(long, default_value_t = 1000)]
    pub publish_rate: u32,
}

/// How a node was taken down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeFault {
    /// SIGKILL the node.
    Kill,
    /// Stop the node's application cleanly.
    Stop,
}

/// The local cluster, driven through its script.
#[derive(Debug)]
pub struct Cluster {
    script: PathBuf,
    nodes: usize,
    /// The node that is down, how, and since when; at most one at a time, so a majority of
    /// every quorum queue stays up.
    down: Option<(usize, NodeFault, Instant)>,
    down_for: Duration,
}

impl Cluster {
    /// The three-node cluster the script runs.
    pub fn new(args: &ClusterArgs) -> Self {
        Self {
            script: args.cluster_script.clone(),
            nodes: 3,
            down: None,
            down_for: Duration::from_secs(args.node_down_secs),
        }
    }

    async fn script(&self, args: &[&str]) -> anyhow::Result<String> {
        let shown = format!("{} {}", self.script.display(), args.join(" "));
        let out = Command::new(&self.script)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .await
            .with_context(|| format!("running {shown} (is the cluster script there?)"))?;
        if !out.status.success() {
            anyhow::bail!(
                "{shown} failed with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// The nodes' AMQP URLs, comma-separated; fails with how to start the cluster if node 1
    /// does not answer.
    pub async fn urls(&self) -> anyhow::Result<String> {
        let name = self.script(&["node", "1"]).await?;
        let up = Command::new("rabbitmqctl")
            .args(["-q", "-n", &name, "await_startup", "--timeout", "5"])
            .stdin(Stdio::null())
            .output()
            .await
            .context("running rabbitmqctl")?;
        if !up.status.success() {
            anyhow::bail!(
                "the local cluster is not running (node {name} does not answer); start it with: {} start",
                self.script.display()
            );
        }
        self.script(&["urls"]).await
    }

    /// The Erlang node name of a node that is up, for `rabbitmqctl -n`.
    pub async fn running_node(&self) -> anyhow::Result<String> {
        let n = (1..=self.nodes)
            .find(|n| self.down.is_none_or(|(d, _, _)| d != *n))
            .unwrap_or(1);
        self.script(&["node", &n.to_string()]).await
    }

    /// The node that is down, if any.
    pub fn down(&self) -> Option<(usize, NodeFault)> {
        self.down.map(|(n, f, _)| (n, f))
    }

    /// Takes node `n` down (bringing back the one that is down first).
    pub async fn take_down(&mut self, n: usize, fault: NodeFault) -> anyhow::Result<()> {
        self.bring_back().await?;
        let node = self.script(&["node", &n.to_string()]).await?;
        match fault {
            NodeFault::Kill => {
                let pid: i32 = self
                    .script(&["pid", &n.to_string()])
                    .await?
                    .parse()
                    .with_context(|| format!("the process id of {node}"))?;
                nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL)
                    .with_context(|| format!("SIGKILL to {node} (pid {pid})"))?;
            }
            NodeFault::Stop => {
                let out = Command::new("rabbitmqctl")
                    .args(["-q", "-n", &node, "stop_app"])
                    .stdin(Stdio::null())
                    .output()
                    .await
                    .context("running rabbitmqctl stop_app")?;
                if !out.status.success() {
                    anyhow::bail!(
                        "rabbitmqctl -n {node} stop_app failed: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                }
            }
        }
        self.down = Some((n, fault, Instant::now()));
        Ok(())
    }

    /// Brings back the node that is down once it has been down long enough.
    pub async fn bring_back_when_due(&mut self) -> anyhow::Result<()> {
        match self.down {
            Some((_, _, since)) if since.elapsed() >= self.down_for => self.bring_back().await,
            _ => Ok(()),
        }
    }

    /// Brings back the node that is down, if any, and waits until it runs.
    pub async fn bring_back(&mut self) -> anyhow::Result<()> {
        if let Some((n, _, _)) = self.down {
            self.script(&["start-node", &n.to_string()]).await?;
            self.down = None;
        }
        Ok(())
    }

    /// How many nodes it has.
    pub fn nodes(&self) -> usize {
        self.nodes
    }
}

/// What the publisher of a cluster run did.
#[derive(Debug, Default)]
pub struct PublisherFigures {
    /// Messages of the stream confirmed by the broker (each counted once).
    pub confirmed: u64,
    /// Publishes that were not confirmed (a node died, a connection closed, a nack) and were
    /// published again: the downstream inbox dedups the copies that had made it.
    pub republished: u64,
    /// Reconnects of the publisher.
    pub reconnects: u64,
}

/// A publisher running in a task; see [`spawn_publisher`].
#[derive(Debug)]
pub struct PacedPublisher {
    /// The task; its figures when it ends.
    pub task: tokio::task::JoinHandle<anyhow::Result<PublisherFigures>>,
    /// Messages confirmed so far.
    pub confirmed: Arc<AtomicU64>,
    /// Set when every message is confirmed.
    pub done: Arc<AtomicBool>,
}

/// Publishes `messages` to `exchange` in order at about `rate` per second, in small confirmed
/// batches. A batch that fails (the connection died with its node, a nack, no confirm within
/// the timeout) is published again, whole, on a new connection to whichever node answers.
pub fn spawn_publisher(
    amqp_url: String,
    exchange: String,
    messages: Vec<Published>,
    rate: u32,
) -> PacedPublisher {
    let confirmed = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let (c, d) = (confirmed.clone(), done.clone());
    let task = tokio::spawn(async move {
        let figures = publish_paced(&amqp_url, &exchange, &messages, rate.max(1), &c).await;
        d.store(true, Ordering::SeqCst);
        figures
    });
    PacedPublisher {
        task,
        confirmed,
        done,
    }
}

async fn publish_paced(
    amqp_url: &str,
    exchange: &str,
    messages: &[Published],
    rate: u32,
    confirmed: &AtomicU64,
) -> anyhow::Result<PublisherFigures> {
    const TICK: Duration = Duration::from_millis(100);
    const CONFIRM_TIMEOUT: Duration = Duration::from_secs(15);
    let per_tick = (rate as usize / 10).max(1);
    let mut figures = PublisherFigures::default();
    let mut broker: Option<rabbit_inbox::broker::Broker> = None;
    let mut next = 0;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let give_up = Instant::now() + Duration::from_secs(600);
    while next < messages.len() {
        tick.tick().await;
        let chunk = &messages[next..(next + per_tick).min(messages.len())];
        if broker.is_none() {
            match rabbit_inbox::broker::Broker::connect(amqp_url, "inbox-lab chaos publisher").await
            {
                Ok(b) => {
                    figures.reconnects += 1;
                    broker = Some(b);
                }
                Err(e) => {
                    if Instant::now() > give_up {
                        anyhow::bail!("the publisher could not reach any node for 10 min: {e}");
                    }
                    continue;
                }
            }
        }
        let Some(b) = broker.as_ref() else {
            continue;
        };
        let batch: Vec<(&str, &rabbit_inbox::broker::OutgoingMessage, Option<&str>)> = chunk
            .iter()
            .map(|m| (m.routing_key.as_str(), &m.message, m.expiration.as_deref()))
            .collect();
        let sent =
            tokio::time::timeout(CONFIRM_TIMEOUT, b.publish_batch_expiring(exchange, &batch));
        match sent.await {
            Ok(Ok(())) => {
                next += chunk.len();
                figures.confirmed += chunk.len() as u64;
                confirmed.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
            _ => {
                // Some of the chunk may have been routed; the copies are duplicates that the
                // consumers' inbox recognises.
                figures.republished += chunk.len() as u64;
                if let Some(b) = broker.take() {
                    b.close().await;
                }
            }
        }
    }
    if let Some(b) = broker {
        b.close().await;
    }
    // The first connection is not a reconnect.
    figures.reconnects = figures.reconnects.saturating_sub(1);
    Ok(figures)
}
