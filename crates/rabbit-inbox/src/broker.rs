//! Everything that speaks AMQP. The only module that imports lapin.
//!
//! Architecture invariant: [`settle`] is the one function that acks, rejects or nacks a
//! delivery, and it takes an [`Outcome`], which only the processor produces after the outcome
//! is durable. Lapin's `Acker` never leaves this module.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use futures::StreamExt;

use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
    message::Delivery,
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions,
        BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
        QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    },
    types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString},
};
use serde_json::{Map, Number, Value};

use crate::{
    config::{QueueType, Topology},
    envelope::{AmqpMessage, Envelope},
    error::BrokerError,
    processor::Outcome,
    stats::ConsumerStats,
};

/// Headers the consumer adds to a parked message. Replay tools read them.
pub mod parking_headers {
    /// Inbox status of the row (`PERMANENT_FAILED`, `POISONED`, ...).
    pub const STATUS: &str = "x-inbox-status";
    /// Stable error code.
    pub const ERROR_CODE: &str = "x-inbox-error-code";
    /// Error message (truncated).
    pub const ERROR: &str = "x-inbox-error";
    /// Consumer that parked it.
    pub const CONSUMER: &str = "x-inbox-consumer";
    /// Inbox key of the row (a synthetic `invalid:` key for messages without a usable id).
    pub const INBOX_KEY: &str = "x-inbox-message-id";
    /// Unix milliseconds when it was parked.
    pub const PARKED_AT: &str = "x-inbox-parked-at";
    /// Exchange and routing key it first arrived with, for replay.
    pub const ORIGINAL_EXCHANGE: &str = "x-inbox-original-exchange";
    /// See [`ORIGINAL_EXCHANGE`].
    pub const ORIGINAL_ROUTING_KEY: &str = "x-inbox-original-routing-key";
}

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
    fn properties(&self) -> Result<BasicProperties, BrokerError> {
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

/// Queue depths of a topology, see [`Broker::queue_depths`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueDepths {
    /// Ready messages in the work queue.
    pub work: u32,
    /// Messages waiting in the retry queue.
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

impl Broker {
    /// Connects and opens a channel in publisher-confirm mode.
    pub async fn connect(amqp_url: &str, connection_name: &str) -> Result<Self, BrokerError> {
        let connection = connect(amqp_url, connection_name).await?;
        let channel = connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self {
            connection,
            channel,
        })
    }

    /// Declares the work, retry and parking queues (and the exchange, if any). Idempotent; a
    /// queue that exists with other arguments is an error (PRECONDITION_FAILED).
    pub async fn declare(
        &self,
        topology: &Topology,
        retry_delay: Duration,
    ) -> Result<(), BrokerError> {
        declare(&self.channel, topology, retry_delay).await
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
        for chunk in messages.chunks(512) {
            let mut confirms = Vec::with_capacity(chunk.len());
            for &(routing_key, message) in chunk {
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
                        message.properties()?,
                    )
                    .await?;
                confirms.push(confirm);
            }
            for confirm in confirms {
                if !matches!(confirm.await?, Confirmation::Ack(None)) {
                    return Err(BrokerError::NotConfirmed(format!("exchange {exchange:?}")));
                }
            }
        }
        Ok(())
    }

    /// Ready-message counts of the topology's queues.
    pub async fn queue_depths(&self, topology: &Topology) -> Result<QueueDepths, BrokerError> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let depth = async |queue: &str| -> Result<u32, BrokerError> {
            Ok(self
                .channel
                .queue_declare(queue.into(), passive, FieldTable::default())
                .await?
                .message_count())
        };
        Ok(QueueDepths {
            work: depth(&topology.queue).await?,
            retry: depth(&topology.retry_queue).await?,
            parking: depth(&topology.parking_queue).await?,
        })
    }

    /// Fetches one message from `queue` and acks it: for tools that drain a queue into a
    /// report (parking-lot inspection, tests). Returns the message and its headers.
    pub async fn take_one(&self, queue: &str) -> Result<Option<AmqpMessage>, BrokerError> {
        let got = self
            .channel
            .basic_get(queue.into(), lapin::options::BasicGetOptions::default())
            .await?;
        match got {
            None => Ok(None),
            Some(get) => {
                let message = amqp_message(&get.delivery);
                get.delivery.acker.ack(BasicAckOptions::default()).await?;
                Ok(Some(message))
            }
        }
    }

    /// Deletes the topology's queues (tests and demos that own them).
    pub async fn delete(&self, topology: &Topology) -> Result<(), BrokerError> {
        for q in [
            &topology.queue,
            &topology.retry_queue,
            &topology.parking_queue,
        ] {
            self.channel
                .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        if let Some(exchange) = &topology.exchange {
            self.channel
                .exchange_delete(exchange.as_str().into(), Default::default())
                .await?;
        }
        Ok(())
    }

    /// Closes the connection.
    pub async fn close(self) {
        let _ = self.connection.close(200, "bye".into()).await;
    }
}

async fn connect(amqp_url: &str, name: &str) -> Result<Connection, BrokerError> {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    Ok(Connection::connect(amqp_url, props).await?)
}

fn queue_args(topology: &Topology) -> FieldTable {
    let mut args = FieldTable::default();
    if topology.queue_type == QueueType::Quorum {
        args.insert("x-queue-type".into(), long_string("quorum"));
    }
    args
}

async fn declare(
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

async fn publish_confirmed(
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
        .await?
        .await?;
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) | Confirmation::Nack(_) | Confirmation::NotRequested => {
            Err(BrokerError::NotConfirmed(format!(
                "exchange {exchange:?}, routing key {routing_key:?}"
            )))
        }
    }
}

/// A delivery waiting for its outcome. Holds the acker; only [`settle`] uses it.
pub(crate) struct PendingDelivery {
    delivery: Delivery,
    received_at: Instant,
}

impl PendingDelivery {
    /// Splits a lapin delivery into its broker handle and a broker-neutral message.
    pub(crate) fn new(mut delivery: Delivery) -> (Self, AmqpMessage) {
        // Move the body out first, so it is not copied.
        let body = std::mem::take(&mut delivery.data);
        let mut message = amqp_message(&delivery);
        message.body = body;
        let received_at = Instant::now();
        (
            Self {
                delivery,
                received_at,
            },
            message,
        )
    }

    pub(crate) fn tag(&self) -> u64 {
        self.delivery.delivery_tag
    }
}

fn amqp_message(delivery: &Delivery) -> AmqpMessage {
    let p = &delivery.properties;
    AmqpMessage {
        message_id: p.message_id().as_ref().map(|s| s.as_str().to_owned()),
        kind: p.kind().as_ref().map(|s| s.as_str().to_owned()),
        content_type: p.content_type().as_ref().map(|s| s.as_str().to_owned()),
        correlation_id: p.correlation_id().as_ref().map(|s| s.as_str().to_owned()),
        headers: p.headers().as_ref().map(table_to_json).unwrap_or_default(),
        body: delivery.data.clone(),
        redelivered: delivery.redelivered,
    }
}

/// Where parked messages go: a confirm-mode channel and the parking queue's name.
struct ParkingLot {
    channel: Channel,
    queue: Arc<str>,
    consumer: Arc<str>,
}

/// One broker connection of the consumer runtime: a consuming channel with prefetch, and a
/// confirm-mode channel for parking.
pub(crate) struct Session {
    connection: Arc<Connection>,
    channel: Channel,
    deliveries: lapin::Consumer,
    settler: Arc<Settler>,
}

/// Whether a broker error is a configuration mismatch that retrying cannot fix (a queue
/// declared elsewhere with other arguments, a missing permission).
pub(crate) fn is_fatal(e: &BrokerError) -> bool {
    match e {
        BrokerError::Amqp(e) => match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => matches!(
                amqp.kind(),
                lapin::protocol::AMQPErrorKind::Soft(
                    lapin::protocol::AMQPSoftError::PRECONDITIONFAILED
                        | lapin::protocol::AMQPSoftError::ACCESSREFUSED
                ) | lapin::protocol::AMQPErrorKind::Hard(
                    lapin::protocol::AMQPHardError::NOTALLOWED
                )
            ),
            _ => false,
        },
        // Producer-side input errors; the consumer's parking path only republishes names
        // that already came through AMQP, so they never stop a consumer.
        BrokerError::NotConfirmed(_) | BrokerError::TooLong { .. } => false,
    }
}

impl Session {
    pub(crate) async fn open(
        amqp_url: &str,
        config: &crate::ConsumerConfig,
    ) -> Result<Self, BrokerError> {
        let connection =
            connect(amqp_url, &format!("rabbit-inbox {}", config.consumer_name)).await?;
        let channel = connection.create_channel().await?;
        declare(&channel, &config.topology, config.retry.retry_delay).await?;
        channel
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await?;
        let parking_channel = connection.create_channel().await?;
        parking_channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        let deliveries = channel
            .basic_consume(
                config.topology.queue.as_str().into(),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Self {
            connection: Arc::new(connection),
            channel: channel.clone(),
            settler: Arc::new(Settler {
                acks: AckTracker {
                    channel: channel.clone(),
                    state: tokio::sync::Mutex::default(),
                },
                parking: ParkingLot {
                    channel: parking_channel,
                    queue: config.topology.parking_queue.as_str().into(),
                    consumer: config.consumer_name.as_str().into(),
                },
            }),
            deliveries,
        })
    }

    /// The next delivery; `None` when the consumer was cancelled by the broker or the
    /// connection closed.
    pub(crate) async fn next_delivery(
        &mut self,
    ) -> Option<Result<(PendingDelivery, AmqpMessage), BrokerError>> {
        match self.deliveries.next().await? {
            Ok(delivery) => Some(Ok(PendingDelivery::new(delivery))),
            Err(e) => Some(Err(e.into())),
        }
    }

    pub(crate) fn settler(&self) -> Arc<Settler> {
        self.settler.clone()
    }

    /// A handle that can drop this session's connection (fault injection).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn connection(&self) -> Arc<Connection> {
        self.connection.clone()
    }

    /// Stops new deliveries; deliveries already received can still be settled.
    pub(crate) async fn cancel(&self) {
        let tag = self.deliveries.tag();
        if let Err(e) = self
            .channel
            .basic_cancel(tag, lapin::options::BasicCancelOptions::default())
            .await
        {
            tracing::debug!(error = %e, "basic.cancel failed");
        }
    }

    /// Closes channels and connection cleanly. Unsettled deliveries return to the queue.
    pub(crate) async fn close(self) {
        let _ = self.channel.close(200, "shutdown".into()).await;
        let _ = self.connection.close(200, "shutdown".into()).await;
    }
}

/// A connection handle, for fault injection.
#[cfg(feature = "fault-injection")]
pub(crate) type ConnectionHandle = Connection;

/// Closes a session's connection between commit and ack (fault injection).
#[cfg(feature = "fault-injection")]
pub(crate) async fn drop_connection(connection: &Connection) {
    let _ = connection
        .close(
            320,
            "fault injection: connection dropped after commit".into(),
        )
        .await;
}

/// Longest wait for one settlement (a parking publish waits for its confirm). Past it the
/// channel is treated as broken; the broker redelivers what was not settled.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(15);

/// What a session needs to settle deliveries: its ack tracker and its parking lot.
pub(crate) struct Settler {
    acks: AckTracker,
    parking: ParkingLot,
}

/// Acks with `multiple=true`, but only over the contiguous prefix of delivery tags whose
/// outcome is durable. A multiple-ack settles *every* earlier unsettled tag on the channel, so
/// while any earlier delivery is still being processed (or its reject/park has not been sent),
/// the tags after it wait.
struct AckTracker {
    channel: Channel,
    state: tokio::sync::Mutex<AckState>,
}

#[derive(Default)]
struct AckState {
    /// Delivered, outcome not yet settled.
    pending: BTreeSet<u64>,
    /// Ready to ack (durable), not yet acked, with their receive instants.
    ready: BTreeMap<u64, Instant>,
}

impl AckState {
    /// Moves `acked` tags to ready; returns the tag a multiple-ack may cover now, if any.
    fn complete(&mut self, settled: &[u64], acked: &[(u64, Instant)]) -> Option<u64> {
        for tag in settled {
            self.pending.remove(tag);
        }
        for &(tag, at) in acked {
            self.pending.remove(&tag);
            self.ready.insert(tag, at);
        }
        let bound = self.pending.first().copied().unwrap_or(u64::MAX);
        self.ready.range(..bound).next_back().map(|(&tag, _)| tag)
    }

    /// Removes and returns the ready entries up to `through`.
    fn take_through(&mut self, through: u64) -> Vec<Instant> {
        let rest = self.ready.split_off(&(through + 1));
        std::mem::replace(&mut self.ready, rest)
            .into_values()
            .collect()
    }
}

impl Settler {
    /// Registers a delivery as outstanding. Called in delivery order, before processing.
    pub(crate) async fn register(&self, pending: &PendingDelivery) {
        self.acks.state.lock().await.pending.insert(pending.tag());
    }

    /// Settles a processed batch by its durable outcomes; the one function that acks, rejects or
    /// nacks. Rejects, requeues and parks go first, one by one; the acks then go as one
    /// multiple-ack over the settled prefix. Returns how many deliveries could not be settled
    /// (the broker will redeliver them and the inbox will recognise them).
    pub(crate) async fn settle_batch(
        &self,
        batch: Vec<(PendingDelivery, &Outcome, &Envelope)>,
        stats: &ConsumerStats,
    ) -> usize {
        let mut settled = Vec::new();
        let mut to_ack = Vec::new();
        let mut unsettled = 0;
        for (pending, outcome, envelope) in batch {
            if matches!(outcome, Outcome::Processed | Outcome::Duplicate) {
                to_ack.push((pending.tag(), pending.received_at));
                continue;
            }
            let tag = pending.tag();
            let received_at = pending.received_at;
            let individual = settle_one(pending, outcome, envelope, &self.parking);
            match tokio::time::timeout(SETTLE_TIMEOUT, individual).await {
                Ok(Ok(true)) => {
                    stats.record_latencies([received_at.elapsed()]);
                    settled.push(tag);
                }
                // Left pending on purpose: no later multiple-ack may cover it.
                result => {
                    tracing::debug!(delivery_tag = tag, ?result, "delivery not settled");
                    unsettled += 1;
                }
            }
        }
        let mut state = self.acks.state.lock().await;
        if let Some(through) = state.complete(&settled, &to_ack) {
            let ack = self
                .acks
                .channel
                .basic_ack(through, BasicAckOptions { multiple: true });
            match tokio::time::timeout(SETTLE_TIMEOUT, ack).await {
                Ok(Ok(())) => {
                    let now = Instant::now();
                    stats.record_latencies(
                        state
                            .take_through(through)
                            .into_iter()
                            .map(|at| now.duration_since(at)),
                    );
                }
                result => {
                    tracing::debug!(through, ?result, "multiple-ack failed");
                    unsettled += to_ack.len();
                }
            }
        }
        if unsettled > 0 {
            stats.record_settle_failures(unsettled as u64);
        }
        unsettled
    }
}

/// Rejects, requeues or parks one delivery.
async fn settle_one(
    pending: PendingDelivery,
    outcome: &Outcome,
    envelope: &Envelope,
    parking: &ParkingLot,
) -> Result<bool, BrokerError> {
    let acker = &pending.delivery.acker;
    match outcome {
        Outcome::Processed | Outcome::Duplicate => {
            Ok(acker.ack(BasicAckOptions::default()).await?)
        }
        // Dead-letters into the retry queue, which returns it after the delay.
        Outcome::RetryScheduled { .. } | Outcome::InFlightElsewhere => {
            Ok(acker.reject(BasicRejectOptions { requeue: false }).await?)
        }
        Outcome::Unrecorded { .. } => Ok(acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await?),
        Outcome::Parked {
            status,
            code,
            message,
        } => {
            let properties = parked_properties(
                &pending.delivery,
                envelope,
                parking,
                status.as_str(),
                code,
                message,
            );
            let published = publish_confirmed(
                &parking.channel,
                "",
                &parking.queue,
                &envelope.body,
                properties,
            )
            .await;
            match published {
                Ok(()) => Ok(acker.ack(BasicAckOptions::default()).await?),
                Err(e) => {
                    // Not parked: keep the message. It comes back and is parked again.
                    tracing::warn!(error = %e, message_id = %envelope.message_id, "parking failed; requeueing");
                    let _ = acker
                        .nack(BasicNackOptions {
                            multiple: false,
                            requeue: true,
                        })
                        .await;
                    Ok(false)
                }
            }
        }
    }
}

fn parked_properties(
    delivery: &Delivery,
    envelope: &Envelope,
    parking: &ParkingLot,
    status: &str,
    code: &str,
    message: &str,
) -> BasicProperties {
    let mut headers = delivery.properties.headers().clone().unwrap_or_default();
    let parked_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default();
    let error: String = message.chars().take(1000).collect();
    for (k, v) in [
        (parking_headers::STATUS, long_string(status)),
        (parking_headers::ERROR_CODE, long_string(code)),
        (parking_headers::ERROR, long_string(&error)),
        (parking_headers::CONSUMER, long_string(&parking.consumer)),
        (
            parking_headers::INBOX_KEY,
            long_string(&envelope.message_id),
        ),
        (
            parking_headers::PARKED_AT,
            AMQPValue::LongLongInt(parked_at),
        ),
        (
            parking_headers::ORIGINAL_EXCHANGE,
            long_string(delivery.exchange.as_str()),
        ),
        (
            parking_headers::ORIGINAL_ROUTING_KEY,
            long_string(delivery.routing_key.as_str()),
        ),
    ] {
        headers.insert(k.into(), v);
    }
    delivery
        .properties
        .clone()
        .with_headers(headers)
        .with_delivery_mode(2)
}

fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// AMQP header table to JSON. Byte arrays become hex strings, decimals numbers, timestamps
/// Unix seconds; strings that are not UTF-8 are converted lossily.
pub(crate) fn table_to_json(table: &FieldTable) -> Map<String, Value> {
    table
        .inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), value_to_json(v)))
        .collect()
}

/// The header conversion applied to every delivery, exposed for fuzzing.
#[doc(hidden)]
pub fn headers_to_json(table: &FieldTable) -> Map<String, Value> {
    table_to_json(table)
}

fn value_to_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => Value::from(*n),
        AMQPValue::ShortShortUInt(n) => Value::from(*n),
        AMQPValue::ShortInt(n) => Value::from(*n),
        AMQPValue::ShortUInt(n) => Value::from(*n),
        AMQPValue::LongInt(n) => Value::from(*n),
        AMQPValue::LongUInt(n) => Value::from(*n),
        AMQPValue::LongLongInt(n) => Value::from(*n),
        AMQPValue::Float(f) => Number::from_f64(f64::from(*f)).map_or(Value::Null, Value::Number),
        AMQPValue::Double(f) => Number::from_f64(*f).map_or(Value::Null, Value::Number),
        AMQPValue::DecimalValue(d) => {
            Number::from_f64(f64::from(d.value) / 10f64.powi(i32::from(d.scale)))
                .map_or(Value::Null, Value::Number)
        }
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::LongString(s) => {
            Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        AMQPValue::Timestamp(t) => Value::from(*t),
        AMQPValue::FieldTable(t) => Value::Object(table_to_json(t)),
        AMQPValue::ByteArray(b) => Value::String(hex::encode(b.as_slice())),
        AMQPValue::Void => Value::Null,
    }
}

/// JSON to an AMQP header table (for publishing).
/// `text` as an AMQP short string. `ShortString::from` panics past 255 bytes; a producer
/// handing us a long id or header name gets an error instead.
fn short(what: &str, text: &str) -> Result<ShortString, BrokerError> {
    ShortString::try_new(text).map_err(|_| BrokerError::TooLong {
        what: what.to_owned(),
        len: text.len(),
    })
}

pub(crate) fn json_to_table(map: &Map<String, Value>) -> Result<FieldTable, BrokerError> {
    let mut table = FieldTable::default();
    for (k, v) in map {
        let name = short(&format!("header name {:?}", truncate_chars(k, 40)), k)?;
        table.insert(name, json_to_value(v)?);
    }
    Ok(table)
}

/// The first `n` characters of `s`, for error messages.
fn truncate_chars(s: &str, n: usize) -> &str {
    s.char_indices().nth(n).map_or(s, |(i, _)| &s[..i])
}

fn json_to_value(v: &Value) -> Result<AMQPValue, BrokerError> {
    Ok(match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => AMQPValue::LongLongInt(i),
            (None, Some(f)) => AMQPValue::Double(f),
            (None, None) => long_string(&n.to_string()),
        },
        Value::String(s) => long_string(s),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(json_to_value).collect::<Result<Vec<_>, _>>()?,
        )),
        Value::Object(o) => AMQPValue::FieldTable(json_to_table(o)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn multiple_ack_covers_only_the_settled_prefix() {
        let now = Instant::now();
        let mut s = AckState::default();
        s.pending.extend(1..=6);
        // Batch {4,5,6} finishes first: 1..=3 still pending, nothing may be acked.
        assert_eq!(s.complete(&[], &[(4, now), (5, now), (6, now)]), None);
        // 2 is rejected individually, 1 still pending.
        assert_eq!(s.complete(&[2], &[]), None);
        // 1 and 3 done: the prefix reaches 6.
        assert_eq!(s.complete(&[], &[(1, now), (3, now)]), Some(6));
        assert_eq!(s.take_through(6).len(), 5);
        assert!(s.ready.is_empty());
    }

    #[test]
    fn a_pending_tag_stops_the_prefix_below_it() {
        let now = Instant::now();
        let mut s = AckState::default();
        s.pending.extend(1..=5);
        assert_eq!(s.complete(&[], &[(1, now), (2, now), (4, now)]), Some(2));
        assert_eq!(s.take_through(2).len(), 2);
        assert_eq!(s.ready.keys().copied().collect::<Vec<_>>(), vec![4]);
        assert_eq!(s.complete(&[], &[(5, now)]), None);
        assert_eq!(s.complete(&[3], &[]), Some(5));
    }

    #[test]
    fn headers_round_trip_through_amqp_values() {
        let headers = json!({
            "s": "text", "i": -3, "f": 1.5, "b": true, "n": null,
            "a": [1, "two"], "t": {"nested": {"deep": 1}}
        });
        let map = headers.as_object().cloned().unwrap_or_default();
        assert_eq!(
            table_to_json(&json_to_table(&map).expect("short names")),
            map
        );
    }

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

    #[test]
    fn odd_amqp_values_become_json() {
        let mut t = FieldTable::default();
        t.insert(
            "bytes".into(),
            AMQPValue::ByteArray(vec![0xde, 0xad].into()),
        );
        t.insert(
            "dec".into(),
            AMQPValue::DecimalValue(lapin::types::DecimalValue {
                scale: 2,
                value: 150,
            }),
        );
        t.insert(
            "bad".into(),
            AMQPValue::LongString(LongString::from(vec![0xff, b'a'])),
        );
        let j = table_to_json(&t);
        assert_eq!(j["bytes"], "dead");
        assert_eq!(j["dec"], 1.5);
        assert_eq!(j["bad"], "\u{fffd}a");
    }
}
