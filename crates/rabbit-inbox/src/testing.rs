//! Handler tests without a broker (feature `testing`): a [`TestConsumer`] runs a handler
//! against the real inbox in PostgreSQL through the consumer's own path (envelope parsing,
//! claim, business transaction, failure classification and recording) and reports what the
//! consumer would then do with the delivery as data ([`BrokerAction`]), instead of doing it.
//!
//! ```text
//! TestMessage --envelope::parse--> Processor::process (the consumer's, one transaction per
//!   batch) --> Outcome --> BrokerAction (not sent) + confirmed copy noted --> InboxRecord
//! ```
//!
//! Settlement is mimicked as a broker that confirms every copy: where the consumer would
//! publish a retry or parking copy, the kit notes that copy on the row exactly as the consumer
//! does after the broker's confirm ([`crate::store::InboxStore::note_confirmed_copies`]), so the
//! ledger ends as a real consumer leaves it and a later copy of the message meets the same
//! row (a duplicate of the parked copy, say). A copy the broker refuses, a lost connection, a
//! delivery whose headers leave no room in a frame for the copy's headers: the kit cannot meet
//! them, having no broker.
//!
//! [`ScratchSchema`] gives each test an inbox of its own (tests run in parallel), migrated,
//! and dropped on request.

use std::{
    collections::{HashSet, VecDeque},
    fmt,
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use serde_json::{Map, Value};
use sqlx::{
    AssertSqlSafe, PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use tokio::sync::Mutex;

use crate::{
    config::ConsumerConfig,
    envelope::{
        self, AGGREGATE_ID_HEADER, AGGREGATE_TYPE_HEADER, AmqpMessage, CAUSATION_HEADER, Envelope,
        TENANT_HEADER, TRACEPARENT_HEADER, VERSION_HEADER,
    },
    error::{ConfigError, StoreError},
    handler::{BatchHandler, Handler, PerMessage},
    processor::{LaneConnection, Parsed, Process, Processor},
    schema::{self, SchemaName},
    stats::{ConsumerStats, StatsSnapshot},
    status::{ConfirmedCopy, ConfirmedCopyKind, InboxStatus, Outcome, parking_headers},
    store::InboxRecord,
};

/// A message to deliver to a [`TestConsumer`], as a producer would publish it. Built with a
/// fresh id (a UUID v4); every property and header the consumer reads can be set.
///
/// ```
/// use rabbit_inbox::testing::TestMessage;
///
/// let msg = TestMessage::json("OrderPlaced", serde_json::json!({"order": 7}))
///     .id("order-7-placed")
///     .aggregate("Order", "7")
///     .version(2)
///     .header("x-tenant-id", "acme");
/// assert_eq!(msg.message_id(), Some("order-7-placed"));
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TestMessage(AmqpMessage);

impl TestMessage {
    /// A JSON message of `message_type` (the AMQP `type` property) with a fresh id.
    pub fn json(message_type: impl Into<String>, body: Value) -> Self {
        Self::bytes(message_type, body.to_string().into_bytes()).content_type("application/json")
    }

    /// A message of `message_type` whose body is `body` as it is: for bodies that are not
    /// JSON, or JSON written a particular way.
    pub fn bytes(message_type: impl Into<String>, body: impl Into<Vec<u8>>) -> Self {
        Self(AmqpMessage {
            message_id: Some(uuid::Uuid::new_v4().to_string()),
            kind: Some(message_type.into()),
            body: body.into(),
            ..AmqpMessage::default()
        })
    }

    /// Sets the AMQP `message-id` property (the dedup key by default).
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.0.message_id = Some(id.into());
        self
    }

    /// Removes the AMQP `message-id` property: such a message is invalid under the default
    /// dedup strategy, and is recorded under a synthetic `invalid:` key.
    pub fn without_id(mut self) -> Self {
        self.0.message_id = None;
        self
    }

    /// Sets the AMQP `type` property (`None`: unset, so the type comes from headers, else
    /// `unknown`).
    pub fn message_type(mut self, message_type: Option<&str>) -> Self {
        self.0.kind = message_type.map(str::to_owned);
        self
    }

    /// Sets the AMQP `content-type` property.
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.0.content_type = Some(content_type.into());
        self
    }

    /// Sets the AMQP `correlation-id` property.
    pub fn correlation_id(mut self, id: impl Into<String>) -> Self {
        self.0.correlation_id = Some(id.into());
        self
    }

    /// Sets an application header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        self.0.headers.insert(name.into(), value.into());
        self
    }

    /// Sets the message version (`x-message-version`).
    pub fn version(self, version: i32) -> Self {
        self.header(VERSION_HEADER, version)
    }

    /// Sets the aggregate type and id (`x-aggregate-type`, `x-aggregate-id`).
    pub fn aggregate(self, aggregate_type: impl Into<String>, id: impl Into<String>) -> Self {
        self.header(AGGREGATE_TYPE_HEADER, aggregate_type.into())
            .header(AGGREGATE_ID_HEADER, id.into())
    }

    /// Sets the id of the message that caused this one (`x-causation-id`).
    pub fn causation_id(self, id: impl Into<String>) -> Self {
        self.header(CAUSATION_HEADER, id.into())
    }

    /// Sets the tenant (`x-tenant-id`).
    pub fn tenant(self, tenant: impl Into<String>) -> Self {
        self.header(TENANT_HEADER, tenant.into())
    }

    /// Sets the W3C trace context (`traceparent`).
    pub fn traceparent(self, traceparent: impl Into<String>) -> Self {
        self.header(TRACEPARENT_HEADER, traceparent.into())
    }

    /// Sets the broker's redelivered flag (the delivery was handed out before and not acked).
    pub fn redelivered(mut self, redelivered: bool) -> Self {
        self.0.redelivered = redelivered;
        self
    }

    /// The AMQP `message-id` property.
    pub fn message_id(&self) -> Option<&str> {
        self.0.message_id.as_deref()
    }

    /// The message as the broker would hand it to the consumer.
    pub fn as_amqp(&self) -> &AmqpMessage {
        &self.0
    }

    /// See [`TestMessage::as_amqp`].
    pub fn into_amqp(self) -> AmqpMessage {
        self.0
    }

    /// The copy a retry tier hands back: this message with the attempt the consumer scheduled
    /// (`x-inbox-retry-attempt`) and the broker's `x-death` entry for the tier it expired
    /// from.
    fn retry_copy(&self, attempt: i32, tier: &str) -> Self {
        let mut copy = self.clone();
        copy.0.redelivered = false;
        copy.0.headers.insert(
            parking_headers::RETRY_ATTEMPT.into(),
            Value::from(i64::from(attempt)),
        );
        let mut deaths = match copy.0.headers.remove("x-death") {
            Some(Value::Array(deaths)) => deaths,
            _ => Vec::new(),
        };
        let same_tier = |d: &Value| d.get("queue").and_then(Value::as_str) == Some(tier);
        match deaths.iter_mut().find(|d| same_tier(d)) {
            Some(Value::Object(death)) => {
                let count = death.get("count").and_then(Value::as_u64).unwrap_or(0);
                death.insert("count".into(), Value::from(count + 1));
            }
            _ => {
                let mut death = Map::new();
                death.insert("count".into(), Value::from(1));
                death.insert("queue".into(), Value::from(tier));
                death.insert("reason".into(), Value::from("expired"));
                // The broker puts the latest death first.
                deaths.insert(0, Value::Object(death));
            }
        }
        copy.0
            .headers
            .insert("x-death".into(), Value::Array(deaths));
        copy
    }
}

impl From<AmqpMessage> for TestMessage {
    fn from(message: AmqpMessage) -> Self {
        Self(message)
    }
}

/// What the consumer would do with a delivery after its outcome is recorded. The kit does
/// none of it: no broker is contacted.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BrokerAction {
    /// Ack the delivery (processed, a duplicate, or a duplicate of a copy the broker holds).
    Ack,
    /// Publish a copy to a retry tier (confirmed), then ack; the copy comes back to the work
    /// queue after `delay` ([`Delivered::retry_copy`]).
    Retry {
        /// The tier's queue.
        queue: String,
        /// The tier's delay.
        delay: Duration,
        /// The attempt whose failure scheduled the retry (the copy's
        /// `x-inbox-retry-attempt`); 0 for a delivery sent round a tier because another
        /// consumer holds the row.
        attempt: i32,
    },
    /// Publish a copy to the parking lot with the reason in `x-inbox-*` headers (confirmed),
    /// then ack.
    Park {
        /// The parking-lot queue.
        queue: String,
        /// The row's status, in `x-inbox-status`.
        status: InboxStatus,
        /// The error code, in `x-inbox-error-code`.
        code: String,
    },
    /// Nothing durable was written: requeue the delivery after a back-off
    /// (`basic.nack(requeue=true)`), and it comes back.
    Requeue,
}

impl fmt::Display for BrokerAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BrokerAction::Ack => f.write_str("would ack"),
            BrokerAction::Retry {
                queue,
                delay,
                attempt,
            } => write!(
                f,
                "would publish to retry tier {queue} ({}, attempt {attempt}), then ack",
                humantime::format_duration(*delay)
            ),
            BrokerAction::Park {
                queue,
                status,
                code,
            } => write!(f, "would park in {queue} ({status}, {code}), then ack"),
            BrokerAction::Requeue => f.write_str("would requeue after a back-off"),
        }
    }
}

/// One delivery's result: its outcome, what the consumer would do with it, and its inbox row
/// as the consumer would leave it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Delivered {
    /// The key the delivery is recorded under: its dedup key, or a synthetic `invalid:<sha256>`
    /// key for a message without a usable one.
    pub inbox_key: String,
    /// The durable outcome, as the consumer's processor returned it.
    pub outcome: Outcome,
    /// What the consumer would do next.
    pub broker_action: BrokerAction,
    /// The copy the kit noted on the row as confirmed (a retry or the row's parked copy), as
    /// the consumer does after the broker's confirm.
    pub noted_copy: Option<ConfirmedCopy>,
    /// The inbox row after settlement; `None` when nothing was recorded.
    pub record: Option<InboxRecord>,
    message: TestMessage,
}

impl Delivered {
    /// The copy that comes back from the retry tier when the outcome scheduled a retry:
    /// deliver it to run the next attempt. `None` for any other outcome.
    pub fn retry_copy(&self) -> Option<TestMessage> {
        match &self.broker_action {
            BrokerAction::Retry { queue, attempt, .. } => {
                Some(self.message.retry_copy(*attempt, queue))
            }
            _ => None,
        }
    }

    /// The inbox row's status, if there is a row.
    pub fn status(&self) -> Option<InboxStatus> {
        self.record.as_ref().map(|r| r.status)
    }
}

/// The consumer's processing path with no broker: delivers [`TestMessage`]s to a handler in
/// the consumer's own transaction and ledger, and reports each one's [`Delivered`].
///
/// Deliveries go through one lane, one batch at a time, as in a consumer with one lane: a
/// batch is cut at [`ConsumerConfig::batch_size`], and a second copy of a key in one call
/// waits for the next batch, after the first one's settlement. The lane keeps one database
/// connection from the pool between deliveries, and reads rows on it, so a pool of one
/// connection is enough unless the handler takes connections of its own.
///
/// Run [`crate::migrate`] on the configuration's schema first, or use a [`ScratchSchema`]; on a
/// schema without the inbox every delivery is [`Outcome::Unrecorded`] (a deployment fault).
pub struct TestConsumer<H> {
    processor: Processor<H>,
    lane: Mutex<LaneConnection>,
    config: ConsumerConfig,
    stats: Arc<ConsumerStats>,
}

impl<H> fmt::Debug for TestConsumer<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestConsumer")
            .field("consumer", &self.config.consumer_name)
            .field("schema", &self.config.schema)
            .finish_non_exhaustive()
    }
}

impl<H: Handler> TestConsumer<PerMessage<H>> {
    /// A test consumer running `handler` once per message, with the inbox (and the handler's
    /// tables) in `pool`. Checks `config` as [`crate::Consumer::new`] does.
    pub fn new(pool: PgPool, config: ConsumerConfig, handler: H) -> Result<Self, ConfigError> {
        TestConsumer::with_batch_handler(pool, config, PerMessage(handler))
    }
}

impl<H: BatchHandler> TestConsumer<H> {
    /// Like [`TestConsumer::new`], with a handler that gets each batch's messages at once.
    pub fn with_batch_handler(
        pool: PgPool,
        config: ConsumerConfig,
        handler: H,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let stats = Arc::new(ConsumerStats::new(&config.consumer_name, &config.telemetry));
        Ok(Self {
            processor: Processor::new(pool.clone(), Arc::new(handler), &config, stats.clone()),
            lane: Mutex::new(LaneConnection::new(pool)),
            config,
            stats,
        })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &ConsumerConfig {
        &self.config
    }

    /// The consumer's counters over the deliveries so far (received, processed, duplicates,
    /// retried, parked, unrecorded).
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Delivers one message and settles it as the consumer would, with a broker that confirms
    /// every copy. Fails only when the row cannot be read back afterwards.
    pub async fn deliver(&self, message: TestMessage) -> Result<Delivered, StoreError> {
        let mut delivered = self.deliver_batch([message]).await?;
        delivered.pop().ok_or_else(|| {
            StoreError::Corrupt("a delivery of one message gave no result".to_owned())
        })
    }

    /// Delivers `messages` as one lane receives them at once: in batches of up to
    /// `batch_size`, each processed in one transaction and then settled. Returns one result
    /// per message, in order.
    pub async fn deliver_batch(
        &self,
        messages: impl IntoIterator<Item = TestMessage>,
    ) -> Result<Vec<Delivered>, StoreError> {
        let mut lane = self.lane.lock().await;
        let mut queue: VecDeque<Delivery> = messages
            .into_iter()
            .enumerate()
            .map(|(i, message)| {
                let parsed = envelope::parse(message.0.clone(), &self.config.envelope);
                (i, message, Parsed::from(parsed))
            })
            .collect();
        let mut results: Vec<Option<Delivered>> = (0..queue.len()).map(|_| None).collect();
        self.stats.record_received(queue.len() as u64);
        // Later copies of a key held back from the last batch: they go first in the next one.
        let mut held: Vec<Delivery> = Vec::new();
        // Keys whose delivery was requeued: the later copies of this call follow it back.
        let mut requeued: HashSet<String> = HashSet::new();
        while !held.is_empty() || !queue.is_empty() {
            let (batch, following) = self.next_batch(&mut queue, &mut held, &requeued);
            let parsed: Vec<Parsed> = batch.iter().map(|(_, _, p)| p.clone()).collect();
            let mut outcomes = self.processor.process(&parsed, &mut lane).await;
            let mut items: Vec<Delivery> = batch;
            for item in following {
                outcomes.push(Outcome::Unrecorded {
                    error: "an earlier delivery of this message was requeued; this copy follows it"
                        .into(),
                });
                items.push(item);
            }
            let settled = self.settle(&items, &outcomes, &mut lane).await;
            for (((i, message, parsed), outcome), settled) in
                items.into_iter().zip(outcomes).zip(settled)
            {
                if matches!(outcome, Outcome::Unrecorded { .. }) {
                    requeued.insert(parsed.key().to_owned());
                }
                let delivered = self
                    .delivered(&mut lane, message, parsed, outcome, settled)
                    .await?;
                results[i] = Some(delivered);
            }
        }
        results
            .into_iter()
            .map(|r| {
                r.ok_or_else(|| StoreError::Corrupt("a delivery was left without a result".into()))
            })
            .collect()
    }

    /// The next batch, as a lane forms it: the copies `held` back first, then the `queue`, up
    /// to `batch_size`. Later copies of a key in it are held back again; the copies of
    /// `requeued` keys are split off to follow their first copy back (second).
    fn next_batch(
        &self,
        queue: &mut VecDeque<Delivery>,
        held: &mut Vec<Delivery>,
        requeued: &HashSet<String>,
    ) -> (Vec<Delivery>, Vec<Delivery>) {
        let mut batch = std::mem::take(held);
        while batch.len() < self.config.batch_size.max(1) {
            let Some(next) = queue.pop_front() else { break };
            batch.push(next);
        }
        let mut seen = HashSet::new();
        let (batch, later): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .partition(|(_, _, parsed)| seen.insert(parsed.key().to_owned()));
        *held = later;
        let (following, batch): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .partition(|(_, _, parsed)| requeued.contains(parsed.key()));
        (batch, following)
    }

    /// Settles a processed batch as the consumer would, with a broker that confirms every
    /// copy: counts the outcomes, notes the copies on their rows, releases the copy locks.
    /// Returns each delivery's broker action and noted copy.
    async fn settle(
        &self,
        items: &[Delivery],
        outcomes: &[Outcome],
        lane: &mut LaneConnection,
    ) -> Vec<(BrokerAction, Option<ConfirmedCopy>)> {
        let envelopes: Vec<&Envelope> = items.iter().map(|(_, _, p)| &p.envelope).collect();
        self.stats.record_outcomes(outcomes, &envelopes);
        let settled: Vec<(BrokerAction, Option<ConfirmedCopy>)> = envelopes
            .iter()
            .zip(outcomes)
            .map(|(envelope, outcome)| self.settlement(envelope, outcome))
            .collect();
        let copies: Vec<ConfirmedCopy> = settled
            .iter()
            .filter_map(|(_, copy)| copy.clone())
            .collect();
        if !copies.is_empty() {
            let (store, consumer) = self.processor.store();
            lane.note_confirmed_copies(store, consumer, &copies).await;
        }
        lane.release_copy_locks().await;
        self.processor.flush_failure_log();
        settled
    }

    /// The result of one settled delivery, with its row read back.
    async fn delivered(
        &self,
        lane: &mut LaneConnection,
        message: TestMessage,
        parsed: Parsed,
        outcome: Outcome,
        (broker_action, noted_copy): (BrokerAction, Option<ConfirmedCopy>),
    ) -> Result<Delivered, StoreError> {
        let inbox_key = parsed.envelope.message_id;
        let record = match self.read_record(lane, &inbox_key).await {
            Ok(record) => record,
            // The database is gone: what was recorded is unknown, and so is the row.
            Err(_) if matches!(outcome, Outcome::Unrecorded { .. }) => None,
            Err(e) => return Err(e),
        };
        Ok(Delivered {
            inbox_key,
            outcome,
            broker_action,
            noted_copy,
            record,
            message,
        })
    }

    /// The inbox row of `inbox_key` for this consumer, read on the lane's connection.
    pub async fn record(&self, inbox_key: &str) -> Result<Option<InboxRecord>, StoreError> {
        let mut lane = self.lane.lock().await;
        self.read_record(&mut lane, inbox_key).await
    }

    async fn read_record(
        &self,
        lane: &mut LaneConnection,
        inbox_key: &str,
    ) -> Result<Option<InboxRecord>, StoreError> {
        let (store, consumer) = self.processor.store();
        let found = match lane.connection().await {
            Ok(conn) => store.find(conn, consumer, inbox_key).await,
            Err(e) => Err(e.into()),
        };
        if found.is_err() {
            // As the lane does after a database error: the next use takes a fresh connection.
            lane.discard();
        }
        found
    }

    /// The broker action the consumer's settler takes for `outcome`, and the copy it notes on
    /// the row once the broker confirms it (every copy, here).
    fn settlement(
        &self,
        envelope: &Envelope,
        outcome: &Outcome,
    ) -> (BrokerAction, Option<ConfirmedCopy>) {
        let retry = &self.config.retry;
        let tier = |attempt: i32| {
            let index = retry.tier_of_attempt(attempt);
            let queue = self
                .config
                .topology
                .retry_tier_queues(retry)
                .get(index)
                .cloned()
                .unwrap_or_default();
            let delay = retry.delays.get(index).copied().unwrap_or_default();
            (queue, delay)
        };
        match outcome {
            Outcome::Processed
            | Outcome::Duplicate
            | Outcome::CopyPending { .. }
            | Outcome::Held => (BrokerAction::Ack, None),
            Outcome::RetryScheduled { attempt, .. } => {
                let (queue, delay) = tier(*attempt);
                (
                    BrokerAction::Retry {
                        queue,
                        delay,
                        attempt: *attempt,
                    },
                    Some(ConfirmedCopy {
                        message_id: envelope.message_id.clone(),
                        attempt: *attempt,
                        kind: ConfirmedCopyKind::Retry(delay),
                    }),
                )
            }
            // Round the first tier, naming no scheduled attempt; nothing is noted.
            Outcome::InFlightElsewhere => {
                let (queue, delay) = tier(1);
                (
                    BrokerAction::Retry {
                        queue,
                        delay,
                        attempt: 0,
                    },
                    None,
                )
            }
            Outcome::Parked {
                status,
                code,
                attempt,
                ..
            } => (
                BrokerAction::Park {
                    queue: self.config.topology.parking_queue.clone(),
                    status: *status,
                    code: code.clone(),
                },
                // Only the row's own copy is noted; a conflicting copy is parked every time.
                attempt.map(|attempt| ConfirmedCopy {
                    message_id: envelope.message_id.clone(),
                    attempt,
                    kind: ConfirmedCopyKind::Parked,
                }),
            ),
            // Requeued, and anything a later version adds: nothing is noted.
            _ => (BrokerAction::Requeue, None),
        }
    }
}

/// A message to deliver: its position in the call, the message, and how it parsed.
type Delivery = (usize, TestMessage, Parsed);

/// A PostgreSQL schema of one test's own (`inbox_test_<32 hex digits>`), with the inbox
/// migrated into it, and a pool whose connections look there first: tables a test creates
/// without a schema name go into it, next to the inbox, and a handler's unqualified queries
/// find them (then `public`, for the application's own tables). Tests running in parallel
/// each get their own.
///
/// Not dropped on drop (that would need a runtime): call [`ScratchSchema::remove`] at the end
/// of the test. A test that fails before it leaves its schema behind, to look at.
#[derive(Debug)]
pub struct ScratchSchema {
    name: SchemaName,
    pool: PgPool,
}

impl ScratchSchema {
    /// Creates and migrates a new schema on the database at `database_url`, and a pool of up
    /// to 5 connections whose `search_path` is that schema, then `public`.
    pub async fn create(database_url: &str) -> Result<Self, StoreError> {
        let name = SchemaName::new(format!("inbox_test_{}", uuid::Uuid::new_v4().simple()))
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let options = PgConnectOptions::from_str(database_url)?
            .options([("search_path", format!("{name},public"))]);
        let pool = PgPoolOptions::new()
            .max_connections(5)
            .connect_with(options)
            .await?;
        schema::migrate(&pool, &name).await?;
        Ok(Self { name, pool })
    }

    /// The schema; set it as the configuration's `schema`.
    pub fn name(&self) -> &SchemaName {
        &self.name
    }

    /// The pool on the scratch schema (a clone shares its connections).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs `sql` (one or more statements) on the scratch schema: the test's own tables.
    pub async fn execute(&self, sql: &str) -> Result<(), StoreError> {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Drops the schema and everything in it. Waits for a migration of the schema in
    /// progress, and for locks a transaction of the test still holds on its tables.
    pub async fn remove(self) -> Result<(), StoreError> {
        schema::drop_schema(&self.pool, &self.name).await
    }
}
