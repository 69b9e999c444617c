//! Declaring a consumer's queues (and exchange) on the broker.

use lapin::{
    Channel, ExchangeKind,
    options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable},
};

use super::headers::long_string;
use crate::{
    config::{QueueType, RetryPolicy, Topology},
    error::BrokerError,
};

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
        .await?;
    // Retry tiers: no consumer; messages expire after the tier's delay and dead-letter back.
    for (tier, delay) in tiers.iter().zip(&retry.delays) {
        let mut args = dead_lettering_args(topology, &topology.queue);
        let delay_ms = u32::try_from(delay.as_millis()).unwrap_or(u32::MAX);
        args.insert("x-message-ttl".into(), AMQPValue::LongUInt(delay_ms));
        channel
            .queue_declare(tier.as_str().into(), durable, args)
            .await?;
    }
    channel
        .queue_declare(
            topology.parking_queue.as_str().into(),
            durable,
            queue_args(topology),
        )
        .await?;
    if let Some(exchange) = &topology.exchange {
        declare_exchange(channel, exchange).await?;
        for key in &topology.binding_keys {
            channel
                .queue_bind(
                    topology.queue.as_str().into(),
                    exchange.as_str().into(),
                    key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
    }
    Ok(())
}

/// Declares a durable topic exchange (idempotent).
pub(super) async fn declare_exchange(channel: &Channel, exchange: &str) -> Result<(), BrokerError> {
    channel
        .exchange_declare(
            super::headers::short("exchange", exchange)?,
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(())
}
