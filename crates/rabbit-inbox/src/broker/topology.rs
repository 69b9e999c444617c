//! Declaring a consumer's queues (and exchange) on the broker, and the exchanges an outbox
//! publishes to.

use lapin::{
    Channel,
    options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable},
};

use super::headers::long_string;
use std::time::Duration;

use crate::{
    error::{AmqpResult, BrokerError},
    retry::RetryPolicy,
};

/// The queues a consumer declares and uses.
///
/// ```text
/// exchange --binding--> queue --consumer: publish (confirmed), then ack--> <retry_queue>.<delay>
///                         ^     (one queue per retry tier, TTL = its delay)      |
///                         +------------------- dead-letter ----------------------+
/// queue --broker-side dead-lettering (e.g. x-delivery-limit)--> first retry tier
/// consumer --publish with reason headers (confirmed), then ack--> parking-lot queue
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// The work queue.
    pub queue: String,
    /// Exchange producers publish to; declared as a durable topic exchange and bound to the
    /// work queue with `binding_keys`. `None`: producers publish to the queue directly.
    pub exchange: Option<String>,
    /// Routing keys bound from `exchange` to the work queue.
    pub binding_keys: Vec<String>,
    /// Base name of the delayed-retry queues: one queue per delay of
    /// [`RetryPolicy::delays`], named `<retry_queue>.<delay>` (e.g. `orders.retry.5s`, see
    /// [`Topology::retry_tier_queue`]). Messages wait there for the tier's delay, then
    /// dead-letter back to the work queue.
    pub retry_queue: String,
    /// Where permanently failed and poisoned messages are kept, with the reason in headers.
    pub parking_queue: String,
    /// Queue type of all three queues.
    pub queue_type: QueueType,
    /// Declare the work queue with `x-single-active-consumer`: of several instances on the
    /// queue, the broker delivers to one at a time and fails over to the next when it goes
    /// away. Keeps one queue's delivery order across instances, at the cost of one active
    /// consumer per queue (scale out with several queues, e.g. a consistent-hash exchange).
    pub single_active_consumer: bool,
    /// `x-delivery-limit` of a quorum work queue: after this many returns to the queue
    /// (requeues, lost sessions) the broker dead-letters the message into the first retry tier.
    /// Must exceed `retry.max_attempts + prefetch` (checked by [`crate::ConsumerConfig::validate`]).
    /// `None` declares no limit: unlimited on RabbitMQ 3.x, while RabbitMQ 4 applies its
    /// default of 20 to quorum queues, so set it explicitly there.
    pub delivery_limit: Option<u32>,
}

/// RabbitMQ queue type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// Classic durable queues.
    #[default]
    Classic,
    /// Quorum queues (replicated; for clusters).
    Quorum,
}

impl Topology {
    /// A work queue `queue` with `<queue>.retry` and `<queue>.parking-lot`, fed directly.
    pub fn new(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            retry_queue: format!("{queue}.retry"),
            parking_queue: format!("{queue}.parking-lot"),
            queue,
            exchange: None,
            binding_keys: Vec::new(),
            queue_type: QueueType::Classic,
            single_active_consumer: false,
            delivery_limit: None,
        }
    }

    /// The retry queue of the tier with `delay`: `<retry_queue>.<delay>`, the delay written
    /// in the largest whole unit (`200ms`, `5s`, `2m`, `1h`).
    pub fn retry_tier_queue(&self, delay: Duration) -> String {
        format!("{}.{}", self.retry_queue, delay_label(delay))
    }

    /// The retry queues of `retry`'s tiers, in tier order.
    pub fn retry_tier_queues(&self, retry: &RetryPolicy) -> Vec<String> {
        retry
            .delays
            .iter()
            .map(|d| self.retry_tier_queue(*d))
            .collect()
    }

    /// Declare all three queues as quorum queues (replicated across a cluster's nodes), with
    /// at-least-once dead-lettering between them.
    pub fn with_quorum_queues(mut self) -> Self {
        self.queue_type = QueueType::Quorum;
        self
    }

    /// Declare a quorum work queue with `x-delivery-limit` (see [`Topology::delivery_limit`]).
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Declare the work queue with a single active consumer (see
    /// [`Topology::single_active_consumer`]).
    pub fn with_single_active_consumer(mut self) -> Self {
        self.single_active_consumer = true;
        self
    }

    /// Also declare `exchange` (topic) and bind the work queue with `binding_keys`.
    pub fn with_exchange(mut self, exchange: impl Into<String>, binding_keys: &[&str]) -> Self {
        self.exchange = Some(exchange.into());
        self.binding_keys = binding_keys.iter().map(|k| (*k).to_owned()).collect();
        self
    }
}

/// `delay` in its largest whole unit: `200ms`, `5s`, `2m`, `1h`.
fn delay_label(delay: Duration) -> String {
    let ms = delay.as_millis();
    if !ms.is_multiple_of(1000) {
        return format!("{ms}ms");
    }
    let s = ms / 1000;
    if s.is_multiple_of(3600) && s > 0 {
        format!("{}h", s / 3600)
    } else if s.is_multiple_of(60) && s > 0 {
        format!("{}m", s / 60)
    } else {
        format!("{s}s")
    }
}

fn queue_args(topology: &Topology) -> FieldTable {
    let mut args = FieldTable::default();
    if topology.queue_type == QueueType::Quorum {
        args.insert("x-queue-type".into(), long_string("quorum"));
    }
    args
}

/// Arguments of a queue that dead-letters to `target` through the default exchange.
fn dead_lettering_args(topology: &Topology, target: &str) -> FieldTable {
    let mut args = queue_args(topology);
    args.insert("x-dead-letter-exchange".into(), long_string(""));
    args.insert("x-dead-letter-routing-key".into(), long_string(target));
    if topology.queue_type == QueueType::Quorum {
        // Quorum queues dead-letter at most once by default: a message whose target does not
        // take it is dropped. At-least-once keeps it until the target confirms; RabbitMQ
        // honours it only together with reject-publish overflow.
        args.insert(
            "x-dead-letter-strategy".into(),
            long_string("at-least-once"),
        );
        args.insert("x-overflow".into(), long_string("reject-publish"));
    }
    args
}

pub(super) async fn declare(
    channel: &Channel,
    topology: &Topology,
    retry: &RetryPolicy,
) -> Result<(), BrokerError> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let tiers = topology.retry_tier_queues(retry);
    // Work queue: the consumer publishes retries to their tier itself; the queue's own
    // dead-letter route into the first tier catches what the broker dead-letters (a quorum
    // queue's delivery limit, a producer's per-message TTL), so that still has a retry path.
    let first_tier = tiers.first().map_or(topology.retry_queue.as_str(), |t| t);
    let mut work = dead_lettering_args(topology, first_tier);
    if topology.single_active_consumer {
        work.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    if let Some(limit) = topology.delivery_limit {
        work.insert("x-delivery-limit".into(), AMQPValue::LongUInt(limit));
    }
    channel
        .queue_declare(topology.queue.as_str().into(), durable, work)
        .await
        .amqp()?;
    // Retry tiers: no consumer; messages expire after the tier's delay and dead-letter back.
    for (tier, delay) in tiers.iter().zip(&retry.delays) {
        let mut args = dead_lettering_args(topology, &topology.queue);
        let delay_ms = u32::try_from(delay.as_millis()).unwrap_or(u32::MAX);
        args.insert("x-message-ttl".into(), AMQPValue::LongUInt(delay_ms));
        channel
            .queue_declare(tier.as_str().into(), durable, args)
            .await
            .amqp()?;
    }
    channel
        .queue_declare(
            topology.parking_queue.as_str().into(),
            durable,
            queue_args(topology),
        )
        .await
        .amqp()?;
    if let Some(exchange) = &topology.exchange {
        declare_exchange(channel, &Exchange::topic(exchange.as_str())).await?;
        for key in &topology.binding_keys {
            channel
                .queue_bind(
                    topology.queue.as_str().into(),
                    exchange.as_str().into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .amqp()?;
        }
    }
    Ok(())
}

/// The type of an exchange: how it routes a message to the queues bound to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ExchangeKind {
    /// To the queues bound with the message's routing key.
    Direct,
    /// To the queues whose binding pattern (`orders.*`, `#`) matches the routing key.
    Topic,
    /// To every queue bound, whatever the routing key.
    Fanout,
    /// By header values instead of the routing key.
    Headers,
}

impl ExchangeKind {
    /// The AMQP name of the type: `direct`, `topic`, `fanout`, `headers`.
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Headers => "headers",
        }
    }

    fn client(self) -> lapin::ExchangeKind {
        match self {
            ExchangeKind::Direct => lapin::ExchangeKind::Direct,
            ExchangeKind::Topic => lapin::ExchangeKind::Topic,
            ExchangeKind::Fanout => lapin::ExchangeKind::Fanout,
            ExchangeKind::Headers => lapin::ExchangeKind::Headers,
        }
    }
}

impl std::fmt::Display for ExchangeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An exchange to declare: its name, type and durability. Declaring is idempotent; an
/// exchange that exists with another type or durability is refused by the broker
/// (PRECONDITION_FAILED), and left as it is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Exchange {
    /// The exchange's name (at most 255 bytes).
    pub name: String,
    /// How it routes.
    pub kind: ExchangeKind,
    /// Whether it survives a broker restart.
    pub durable: bool,
}

impl Exchange {
    /// A durable exchange of `kind` named `name`.
    pub fn new(name: impl Into<String>, kind: ExchangeKind) -> Self {
        Self {
            name: name.into(),
            kind,
            durable: true,
        }
    }

    /// A durable topic exchange named `name`, the usual kind for events.
    pub fn topic(name: impl Into<String>) -> Self {
        Self::new(name, ExchangeKind::Topic)
    }

    /// The same exchange, not durable: gone after a broker restart.
    pub fn transient(mut self) -> Self {
        self.durable = false;
        self
    }
}

/// Declares `exchange` (idempotent).
pub(super) async fn declare_exchange(
    channel: &Channel,
    exchange: &Exchange,
) -> Result<(), BrokerError> {
    channel
        .exchange_declare(
            super::headers::short("exchange", &exchange.name)?,
            exchange.kind.client(),
            ExchangeDeclareOptions {
                durable: exchange.durable,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .amqp()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_queues_are_named_by_their_delay_in_its_largest_whole_unit() {
        assert_eq!(delay_label(Duration::from_millis(200)), "200ms");
        assert_eq!(delay_label(Duration::from_millis(1500)), "1500ms");
        assert_eq!(delay_label(Duration::from_secs(90)), "90s");
        assert_eq!(delay_label(Duration::from_secs(7200)), "2h");
    }
}
