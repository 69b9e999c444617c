//! Publishing with publisher confirms: [`Publisher`], the consumer runtime's own publishing
//! connection, and [`Broker`]: the connection tools and tests use to declare, publish and
//! inspect.

use std::time::Duration;

use lapin::{
    BasicProperties, Channel, Confirmation, Connection,
    options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions},
    types::FieldTable,
};
use serde_json::{Map, Value};

use super::{
    addresses::connect,
    headers::{json_to_table, short},
    topology::{Exchange, Topology, declare, declare_exchange},
};
use crate::{
    error::{AmqpResult, BrokerError},
    retry::RetryPolicy,
};

/// A message to publish (producer side: examples, demos, tests, replays).
#[derive(Clone, Debug, Default)]
pub struct OutgoingMessage {
    /// AMQP `message-id`.
    pub message_id: Option<String>,
    /// AMQP `type`.
    pub kind: Option<String>,
    /// AMQP `correlation-id`.
    pub correlation_id: Option<String>,
    /// Application headers (JSON values are mapped to AMQP field values).
    pub headers: Map<String, Value>,
    /// Body.
    pub body: Vec<u8>,
}

impl OutgoingMessage {
    /// AMQP properties: persistent, JSON, with the id, type, correlation id and headers.
    pub(super) fn properties(&self) -> Result<BasicProperties, BrokerError> {
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_headers(json_to_table(&self.headers)?);
        if let Some(id) = &self.message_id {
            properties = properties.with_message_id(short("message-id", id)?);
        }
        if let Some(kind) = &self.kind {
            properties = properties.with_type(short("type", kind)?);
        }
        if let Some(c) = &self.correlation_id {
            properties = properties.with_correlation_id(short("correlation-id", c)?);
        }
        Ok(properties)
    }
}

/// Whether `message` can be expressed in AMQP (short strings within 255 bytes, headers
/// convertible): checked when a message is written to the outbox, so the relay never holds a
/// row it cannot publish.
pub(crate) fn check_publishable(message: &OutgoingMessage) -> Result<(), BrokerError> {
    message.properties().map(|_| ())
}

/// Queue depths of a topology, see [`Broker::queue_depths`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueDepths {
    /// Ready messages in the work queue.
    pub work: u32,
    /// Messages waiting in the retry queues (all tiers).
    pub retry: u32,
    /// Messages in the parking lot.
    pub parking: u32,
}

/// A connection to RabbitMQ for declaring topology, publishing with confirms and inspecting
/// queues. The consumer runtime opens its own connections.
pub struct Broker {
    connection: Connection,
    channel: Channel,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("connected", &self.connection.status().connected())
            .finish_non_exhaustive()
    }
}

impl Broker {
    /// Connects and opens a channel in publisher-confirm mode.
    pub async fn connect(amqp_url: &str, connection_name: &str) -> Result<Self, BrokerError> {
        let connection = connect(amqp_url, connection_name).await?;
        let channel = connection.create_channel().await.amqp()?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .amqp()?;
        Ok(Self {
            connection,
            channel,
        })
    }

    /// Declares the work queue, one retry queue per tier of `retry`, the parking queue (and
    /// the exchange, if any). Idempotent; a queue that exists with other arguments is an error
    /// (PRECONDITION_FAILED).
    pub async fn declare(
        &self,
        topology: &Topology,
        retry: &RetryPolicy,
    ) -> Result<(), BrokerError> {
        declare(&self.channel, topology, retry).await
    }

    /// Declares a durable topic exchange, such as the one a service's outbox publishes its
    /// events to. Idempotent.
    pub async fn declare_exchange(&self, exchange: &str) -> Result<(), BrokerError> {
        self.declare_exchange_as(&Exchange::topic(exchange)).await
    }

    /// Declares `exchange` with its type and durability. Idempotent; an exchange that exists
    /// with another type or durability is an error (PRECONDITION_FAILED).
    pub async fn declare_exchange_as(&self, exchange: &Exchange) -> Result<(), BrokerError> {
        declare_exchange(&self.channel, exchange).await
    }

    /// Publishes and waits for the broker's confirm. Unroutable messages are errors.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &OutgoingMessage,
    ) -> Result<(), BrokerError> {
        publish_confirmed(
            &self.channel,
            exchange,
            routing_key,
            &message.body,
            message.properties()?,
        )
        .await
    }

    /// Publishes many `(routing key, message)` pairs, keeping up to 512 confirms in flight,
    /// and returns once the broker has confirmed all of them. Order is preserved.
    pub async fn publish_batch(
        &self,
        exchange: &str,
        messages: &[(&str, &OutgoingMessage)],
    ) -> Result<(), BrokerError> {
        let expiring: Vec<_> = messages.iter().map(|&(k, m)| (k, m, None)).collect();
        self.publish_batch_expiring(exchange, &expiring).await
    }

    /// [`Broker::publish_batch`] with a per-message TTL: the AMQP `expiration` of each
    /// message, in milliseconds as AMQP carries it (`"60000"`), where given.
    pub async fn publish_batch_expiring(
        &self,
        exchange: &str,
        messages: &[(&str, &OutgoingMessage, Option<&str>)],
    ) -> Result<(), BrokerError> {
        for chunk in messages.chunks(512) {
            let mut confirms = Vec::with_capacity(chunk.len());
            for &(routing_key, message, expiration) in chunk {
                let mut properties = message.properties()?;
                if let Some(ttl) = expiration {
                    properties = properties.with_expiration(short("expiration", ttl)?);
                }
                let confirm = self
                    .channel
                    .basic_publish(
                        short("exchange", exchange)?,
                        short("routing key", routing_key)?,
                        BasicPublishOptions {
                            mandatory: true,
                            ..BasicPublishOptions::default()
                        },
                        &message.body,
                        properties,
                    )
                    .await
                    .amqp()?;
                confirms.push(confirm);
            }
            for confirm in confirms {
                if !matches!(confirm.await.amqp()?, Confirmation::Ack(None)) {
                    return Err(BrokerError::NotConfirmed(format!("exchange {exchange:?}")));
                }
            }
        }
        Ok(())
    }

    /// Ready-message counts of the topology's queues; `retry` sums the tiers of `retry`.
    pub async fn queue_depths(
        &self,
        topology: &Topology,
        retry: &RetryPolicy,
    ) -> Result<QueueDepths, BrokerError> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let depth = async |queue: &str| -> Result<u32, BrokerError> {
            Ok(self
                .channel
                .queue_declare(queue.into(), passive, FieldTable::default())
                .await
                .amqp()?
                .message_count())
        };
        let mut retrying = 0u32;
        for tier in topology.retry_tier_queues(retry) {
            retrying = retrying.saturating_add(depth(&tier).await?);
        }
        Ok(QueueDepths {
            work: depth(&topology.queue).await?,
            retry: retrying,
            parking: depth(&topology.parking_queue).await?,
        })
    }

    /// Deletes the topology's queues for good, messages and all: the work queue, the retry
    /// tiers of `retry`, the parking lot, and the topology's exchange if it names one. For
    /// removing a consumer's queues: tearing down a test or a demo, or decommissioning a
    /// consumer. Not part of running a consumer: the consumer runtime never calls it. Also
    /// deletes a queue named `retry_queue` itself, the single retry queue of earlier versions.
    pub async fn delete(
        &self,
        topology: &Topology,
        retry: &RetryPolicy,
    ) -> Result<(), BrokerError> {
        let mut queues = vec![topology.queue.clone()];
        queues.extend(topology.retry_tier_queues(retry));
        queues.push(topology.retry_queue.clone());
        queues.push(topology.parking_queue.clone());
        for q in &queues {
            self.channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await
                .amqp()?;
        }
        if let Some(exchange) = &topology.exchange {
            self.channel
                .exchange_delete(exchange.as_str().into(), Default::default())
                .await
                .amqp()?;
        }
        Ok(())
    }

    /// Closes the connection.
    pub async fn close(self) {
        let _ = self.connection.close(200, "bye".into()).await;
    }
}

/// The consumer runtime's publishing side (retry tiers, parking lot): a connection of its own,
/// because RabbitMQ blocks publishing connections under a memory or disk alarm and acks on the
/// consuming connection must not stall with it; and a confirm channel, reopened when the
/// broker closes it (a refused publish closes the channel with 406).
pub(crate) struct Publisher {
    amqp_url: String,
    connection_name: String,
    link: tokio::sync::Mutex<Option<PublishLink>>,
}

struct PublishLink {
    connection: Connection,
    channel: Channel,
}

pub(super) async fn confirm_channel(connection: &Connection) -> Result<Channel, BrokerError> {
    let channel = connection.create_channel().await.amqp()?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .amqp()?;
    Ok(channel)
}

impl Publisher {
    /// Connects now, so that a broker refusing the connection fails the session's start.
    pub(crate) async fn open(amqp_url: &str, connection_name: &str) -> Result<Self, BrokerError> {
        let publisher = Self {
            amqp_url: amqp_url.to_owned(),
            connection_name: connection_name.to_owned(),
            link: tokio::sync::Mutex::default(),
        };
        publisher.channel().await?;
        Ok(publisher)
    }

    /// The confirm channel; reopened (and the connection with it, if that is gone) when closed.
    async fn channel(&self) -> Result<Channel, BrokerError> {
        let mut link = self.link.lock().await;
        if let Some(open) = link.as_mut() {
            if open.channel.status().connected() {
                return Ok(open.channel.clone());
            }
            if open.connection.status().connected() {
                tracing::debug!("publishing channel closed by the broker; reopening it");
                open.channel = confirm_channel(&open.connection).await?;
                return Ok(open.channel.clone());
            }
        }
        // Dropping the old link closes its connection.
        *link = None;
        let connection = connect(&self.amqp_url, &self.connection_name).await?;
        let channel = confirm_channel(&connection).await?;
        *link = Some(PublishLink {
            connection,
            channel: channel.clone(),
        });
        Ok(channel)
    }

    /// Publishes to `queue` through the default exchange (mandatory) and waits for the
    /// broker's confirm, at most `timeout`. Nacked, returned and unconfirmed publishes are
    /// errors.
    pub(crate) async fn publish_to_queue(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
        timeout: Duration,
    ) -> Result<(), BrokerError> {
        let publish = async {
            let channel = self.channel().await?;
            publish_confirmed(&channel, "", queue, body, properties).await
        };
        tokio::time::timeout(timeout, publish)
            .await
            .unwrap_or_else(|_| {
                Err(BrokerError::NotConfirmed(format!(
                    "queue {queue:?} (no confirm within {timeout:?})"
                )))
            })
    }

    /// Closes the publishing connection.
    pub(crate) async fn close(&self) {
        if let Some(link) = self.link.lock().await.take() {
            let _ = link.connection.close(200, "shutdown".into()).await;
        }
    }
}

pub(super) async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), BrokerError> {
    let confirm = channel
        .basic_publish(
            short("exchange", exchange)?,
            short("routing key", routing_key)?,
            BasicPublishOptions {
                mandatory: true,
                ..BasicPublishOptions::default()
            },
            body,
            properties,
        )
        .await
        .amqp()?
        .await
        .amqp()?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) | Confirmation::Nack(_) | Confirmation::NotRequested => {
            Err(BrokerError::NotConfirmed(format!(
                "exchange {exchange:?}, routing key {routing_key:?}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn overlong_short_strings_are_errors_not_panics() {
        let long = "x".repeat(256);
        let id = OutgoingMessage {
            message_id: Some(long.clone()),
            ..OutgoingMessage::default()
        };
        assert!(matches!(
            id.properties(),
            Err(BrokerError::TooLong { len: 256, ref what }) if what == "message-id"
        ));
        let mut nested = Map::new();
        nested.insert("outer".into(), json!({ long.clone(): 1 }));
        let header = OutgoingMessage {
            headers: nested,
            ..OutgoingMessage::default()
        };
        assert!(matches!(
            header.properties(),
            Err(BrokerError::TooLong { len: 256, .. })
        ));
        let fits = OutgoingMessage {
            message_id: Some("x".repeat(255)),
            ..OutgoingMessage::default()
        };
        assert!(fits.properties().is_ok());
    }
}
