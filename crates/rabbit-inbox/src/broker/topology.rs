//! Declaring a consumer's queues (and exchange) on the broker.

use std::time::Duration;

use lapin::{
    Channel, ExchangeKind,
    options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable},
};

use super::headers::long_string;
use crate::{
    config::{QueueType, Topology},
    error::BrokerError,
};

fn queue_args(topology: &Topology) -> FieldTable {
    let mut args = FieldTable::default();
    if topology.queue_type == QueueType::Quorum {
        args.insert("x-queue-type".into(), long_string("quorum"));
    }
    args
}

pub(super) async fn declare(
    channel: &Channel,
    topology: &Topology,
    retry_delay: Duration,
) -> Result<(), BrokerError> {
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    // Work queue: reject(requeue=false) dead-letters into the retry queue.
    let mut work = queue_args(topology);
    if topology.single_active_consumer {
        work.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    }
    work.insert("x-dead-letter-exchange".into(), long_string(""));
    work.insert(
        "x-dead-letter-routing-key".into(),
        long_string(&topology.retry_queue),
    );
    channel
        .queue_declare(topology.queue.as_str().into(), durable, work)
        .await?;
    // Retry queue: no consumer; messages expire after the delay and dead-letter back.
    let mut retry = queue_args(topology);
    let delay_ms = u32::try_from(retry_delay.as_millis()).unwrap_or(u32::MAX);
    retry.insert("x-message-ttl".into(), AMQPValue::LongUInt(delay_ms));
    retry.insert("x-dead-letter-exchange".into(), long_string(""));
    retry.insert(
        "x-dead-letter-routing-key".into(),
        long_string(&topology.queue),
    );
    channel
        .queue_declare(topology.retry_queue.as_str().into(), durable, retry)
        .await?;
    channel
        .queue_declare(
            topology.parking_queue.as_str().into(),
            durable,
            queue_args(topology),
        )
        .await?;
    if let Some(exchange) = &topology.exchange {
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
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
