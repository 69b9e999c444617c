//! A scratch inbox for the integration tests of the library and the operator crate, on the
//! real servers ([`crate::database_url`], [`crate::amqp_url`]).
//!
//! Every test gets a [`TestEnv`]: its own PostgreSQL schema (`t_<random hex>`) holding the inbox
//! and the test tables, and its own queue names (`t-<random hex>...`). Both are removed when
//! the environment is dropped, also when the test panics.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use rabbit_inbox::{
    BatchError, BatchHandler, Consumer, ConsumerConfig, ErrorKind, Handler, HandlerError,
    InboxMessage, RunError, Runner, SchemaName, Topology, broker::Broker, broker::OutgoingMessage,
    broker::ParkingLot, broker::QueueDepths, envelope::AmqpMessage, stats::ConsumerStats,
    stats::StatsSnapshot, store::InboxRecord, store::InboxStore,
};
use serde_json::{Map, Value};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, postgres::PgPoolOptions};
use tokio::{
    sync::{Notify, watch},
    task::JoinHandle,
};

/// How long any wait for a condition may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

pub use crate::{amqp_url, database_url};

/// 16 random hex digits (lowercase, so usable in schema names).
pub use crate::unique_suffix as random_hex;

/// Logs to the test output when `RUST_LOG` is set.
fn init_tracing() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).to_vec()
}

/// What [`InboxMessage::idempotency_key`] must return for `consumer` and `message_id`.
pub fn expected_idempotency_key(consumer: &str, message_id: &str) -> String {
    let mut bytes = consumer.as_bytes().to_vec();
    bytes.push(0);
    bytes.extend_from_slice(message_id.as_bytes());
    hex::encode(&sha256(&bytes)[..16])
}

/// A JSON message with AMQP message id `id` (if any) and type `kind`.
pub fn message(id: Option<&str>, kind: &str, body: &Value) -> OutgoingMessage {
    OutgoingMessage {
        message_id: id.map(str::to_owned),
        kind: Some(kind.to_owned()),
        correlation_id: None,
        headers: Map::new(),
        body: body.to_string().into_bytes(),
    }
}

/// A `Thing` message `{"id": id, "n": n}`.
pub fn thing(id: &str, n: i64) -> OutgoingMessage {
    message(Some(id), "Thing", &serde_json::json!({ "id": id, "n": n }))
}

/// A header of a received message as text.
pub fn header<'a>(msg: &'a AmqpMessage, name: &str) -> Option<&'a str> {
    msg.headers.get(name).and_then(Value::as_str)
}

/// Polls `check` every 50 ms until it holds, for at most [`DEADLINE`].
///
/// # Panics
/// After [`DEADLINE`], naming `what` was awaited.
pub async fn wait_for(what: &str, check: impl AsyncFnMut() -> bool) {
    crate::wait_for(what, DEADLINE, check).await;
}

/// Removes a test's schema and queues when dropped, from a thread with its own runtime so
/// that it also works while a panicking test unwinds.
#[derive(Debug)]
struct Cleanup {
    schema: SchemaName,
    topologies: Arc<Mutex<Vec<Topology>>>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let schema = self.schema.clone();
        let topologies = std::mem::take(&mut *lock(&self.topologies));
        let thread = std::thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("cleanup: cannot build a runtime: {e}");
                    return;
                }
            };
            runtime.block_on(async {
                for topology in &topologies {
                    // A fresh connection per topology: a failed delete closes the channel.
                    match Broker::connect(&amqp_url(), "rabbit-inbox test cleanup").await {
                        Ok(broker) => {
                            if let Err(e) = broker.delete(topology, &test_retry()).await {
                                eprintln!("cleanup: deleting {}: {e}", topology.queue);
                            }
                            broker.close().await;
                        }
                        Err(e) => eprintln!("cleanup: cannot reach RabbitMQ: {e}"),
                    }
                }
                let options = match database_url().parse::<sqlx::postgres::PgConnectOptions>() {
                    // Do not hang forever behind a transaction a panicking test left open.
                    Ok(o) => o.options([("lock_timeout", "20s")]),
                    Err(e) => {
                        eprintln!("cleanup: bad DATABASE_URL: {e}");
                        return;
                    }
                };
                match PgPoolOptions::new()
                    .max_connections(1)
                    .connect_with(options)
                    .await
                {
                    Ok(pool) => {
                        if let Err(e) = rabbit_inbox::schema::drop_schema(&pool, &schema).await {
                            eprintln!("cleanup: dropping schema {schema}: {e}");
                        }
                        pool.close().await;
                    }
                    Err(e) => eprintln!("cleanup: cannot reach PostgreSQL: {e}"),
                }
            });
        });
        let _ = thread.join();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One test's world: a schema with the inbox and the test tables, a broker connection, and
/// the queues it declared.
#[derive(Debug)]
pub struct TestEnv {
    /// A pool on the test database.
    pub pool: PgPool,
    /// The test's own schema (`t_<hex>`), holding the inbox and the test tables.
    pub schema: SchemaName,
    /// The ledger in that schema.
    pub store: InboxStore,
    /// A tool-side broker connection.
    pub broker: Broker,
    /// A unique suffix for names.
    pub id: String,
    topologies: Arc<Mutex<Vec<Topology>>>,
    // Last: runs after the pool and the broker connection are dropped.
    _cleanup: Cleanup,
}

impl TestEnv {
    /// A fresh schema with the inbox and the test tables, and a broker connection.
    pub async fn new() -> Self {
        init_tracing();
        let id = random_hex();
        let schema = SchemaName::new(format!("t_{id}")).expect("valid schema name");
        let topologies = Arc::new(Mutex::new(Vec::new()));
        // Armed before anything is created, so a failure below still cleans up.
        let cleanup = Cleanup {
            schema: schema.clone(),
            topologies: topologies.clone(),
        };
        let pool = PgPoolOptions::new()
            .max_connections(12)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&database_url())
            .await
            .expect("PostgreSQL is reachable");
        rabbit_inbox::migrate(&pool, &schema)
            .await
            .expect("inbox migrations apply");
        let s = schema.as_str();
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"
            -- One row per applied effect. No unique constraint: a double application shows.
            CREATE TABLE "{s}".effects (
                seq           BIGSERIAL PRIMARY KEY,
                message_id    TEXT NOT NULL,
                consumer_name TEXT NOT NULL,
                message_type  TEXT NOT NULL,
                attempt       INTEGER NOT NULL,
                body          TEXT NOT NULL,
                applied_at    TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
            );
            -- Every handler invocation, written outside the business transaction (like a call
            -- to an external system), so rolled-back attempts are visible too.
            CREATE TABLE "{s}".handler_calls (
                seq             BIGSERIAL PRIMARY KEY,
                message_id      TEXT NOT NULL,
                consumer_name   TEXT NOT NULL,
                attempt         INTEGER NOT NULL,
                idempotency_key TEXT NOT NULL,
                death_count     BIGINT NOT NULL,
                redelivered     BOOLEAN NOT NULL
            );
            -- An external system that deduplicates by idempotency key.
            CREATE TABLE "{s}".external_ledger (
                idempotency_key TEXT PRIMARY KEY,
                message_id      TEXT NOT NULL,
                calls           INTEGER NOT NULL
            );
            "#
        )))
        .execute(&pool)
        .await
        .expect("test tables are created");
        let broker = Broker::connect(&amqp_url(), &format!("rabbit-inbox test {id}"))
            .await
            .expect("RabbitMQ is reachable");
        Self {
            store: InboxStore::new(schema.clone()),
            pool,
            schema,
            broker,
            id,
            topologies,
            _cleanup: cleanup,
        }
    }

    /// A new topology `t-<id>-<name>` (with `.retry` and `.parking-lot`), deleted at the end.
    pub fn topology(&self, name: &str) -> Topology {
        self.register(Topology::new(format!("t-{}-{name}", self.id)))
    }

    /// The exchange name `t-<id>-<name>` for [`Topology::with_exchange`].
    pub fn exchange_name(&self, name: &str) -> String {
        format!("t-{}-{name}", self.id)
    }

    /// Registers a topology for deletion at the end.
    pub fn register(&self, topology: Topology) -> Topology {
        lock(&self.topologies).push(topology.clone());
        topology
    }

    /// Test defaults: this schema, fast retries and batching.
    pub fn config(&self, consumer_name: &str, topology: Topology) -> ConsumerConfig {
        let mut config = ConsumerConfig::new(consumer_name, topology);
        config.schema = self.schema.clone();
        config.retry.delays = test_retry().delays;
        config.retry.max_attempts = 5;
        config.max_batch_delay = Duration::from_millis(10);
        config.reconnect_initial_delay = Duration::from_millis(100);
        config.reconnect_max_delay = Duration::from_secs(1);
        config
    }

    /// Declares the consumer's queues (as the consumer will), so messages can be published
    /// before it starts.
    pub async fn declare(&self, config: &ConsumerConfig) {
        self.broker
            .declare(&config.topology, &config.retry)
            .await
            .expect("queues are declared");
    }

    /// Publishes to the work queue directly.
    pub async fn publish(&self, topology: &Topology, message: &OutgoingMessage) {
        self.broker
            .publish("", &topology.queue, message)
            .await
            .expect("publish is confirmed");
    }

    /// Ready and unacked messages of the work queue, its retry tiers and parking lot.
    pub async fn depths(&self, topology: &Topology) -> QueueDepths {
        self.broker
            .queue_depths(topology, &test_retry())
            .await
            .expect("queue depths")
    }

    /// Takes one message from `queue` (gets and acks it), `None` if the queue is empty: how a
    /// test reads what a queue received. Read through the library's parking-lot reader, which
    /// reads any queue by name and converts what it gets as the consumer converts a delivery.
    pub async fn take_one(&self, queue: &str) -> Option<AmqpMessage> {
        let reader = ParkingLot::connect(&amqp_url(), queue, queue)
            .await
            .expect("RabbitMQ is reachable");
        let taken = match reader.next().await.expect("basic.get") {
            Some(got) => {
                let message = got.message().clone();
                reader.remove(got).await.expect("basic.ack");
                Some(message)
            }
            None => None,
        };
        reader.close().await;
        taken
    }

    /// Waits until `n` messages are in the parking lot, then takes them all.
    pub async fn take_parked(&self, topology: &Topology, n: u32) -> Vec<AmqpMessage> {
        wait_for(&format!("{n} parked message(s)"), async || {
            self.depths(topology).await.parking >= n
        })
        .await;
        let mut parked = Vec::new();
        while let Some(m) = self.take_one(&topology.parking_queue).await {
            parked.push(m);
        }
        parked
    }

    /// A test handler writing to this schema, and its failure plan.
    pub fn handler(&self) -> (TestHandler, Arc<Plan>) {
        let plan = Arc::new(Plan::default());
        (
            TestHandler {
                schema: self.schema.clone(),
                pool: self.pool.clone(),
                plan: plan.clone(),
            },
            plan,
        )
    }

    /// Starts a consumer on this environment's pool.
    pub fn start<H: Handler>(&self, config: ConsumerConfig, handler: H) -> Running {
        self.start_with_pool(self.pool.clone(), config, handler)
    }

    /// Starts a consumer with the background work `beside` adds to its runner.
    pub fn start_beside<H: Handler>(
        &self,
        config: ConsumerConfig,
        handler: H,
        beside: impl FnOnce(Runner) -> Runner,
    ) -> Running {
        Running::spawn_beside(
            Consumer::new(amqp_url(), self.pool.clone(), config, handler).expect("valid config"),
            beside,
        )
    }

    /// Starts a consumer on `pool` instead of this environment's.
    pub fn start_with_pool<H: Handler>(
        &self,
        pool: PgPool,
        config: ConsumerConfig,
        handler: H,
    ) -> Running {
        Running::spawn(Consumer::new(amqp_url(), pool, config, handler).expect("valid config"))
    }

    /// Starts a consumer with a batch handler on this environment's pool.
    pub fn start_batch<H: BatchHandler>(&self, config: ConsumerConfig, handler: H) -> Running {
        Running::spawn(
            Consumer::with_batch_handler(amqp_url(), self.pool.clone(), config, handler)
                .expect("valid config"),
        )
    }

    /// A test batch handler writing to this schema, and its plan and call log.
    pub fn batch_handler(&self) -> (TestBatchHandler, Arc<BatchPlan>) {
        let plan = Arc::new(BatchPlan::default());
        (
            TestBatchHandler {
                schema: self.schema.clone(),
                plan: plan.clone(),
            },
            plan,
        )
    }
    /// The inbox row of `message_id` for `consumer`.
    pub async fn record(&self, consumer: &str, message_id: &str) -> Option<InboxRecord> {
        let mut conn = self.pool.acquire().await.expect("connection");
        self.store
            .find(&mut conn, consumer, message_id)
            .await
            .expect("inbox row readable")
    }

    /// Waits until the row of `message_id` exists and satisfies `check`, and returns it.
    pub async fn wait_for_record(
        &self,
        consumer: &str,
        message_id: &str,
        what: &str,
        check: impl Fn(&InboxRecord) -> bool,
    ) -> InboxRecord {
        let mut found = None;
        wait_for(&format!("inbox row {message_id}: {what}"), async || {
            found = self.record(consumer, message_id).await.filter(|r| check(r));
            found.is_some()
        })
        .await;
        found.expect("found")
    }

    /// Runs a scalar query; `{s}` in `sql` stands for the quoted schema.
    pub async fn scalar(&self, sql: &str) -> i64 {
        let sql = sql.replace("{s}", &format!("\"{}\"", self.schema));
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .expect("scalar query")
    }

    /// Effect rows of `message_id` (any consumer).
    pub async fn effects(&self, message_id: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{}\".effects WHERE message_id = $1",
            self.schema
        )))
        .bind(message_id)
        .fetch_one(&self.pool)
        .await
        .expect("count effects")
    }

    /// Handler invocations for `message_id` and `consumer`: (attempt, idempotency key,
    /// death count), in call order.
    pub async fn calls(&self, consumer: &str, message_id: &str) -> Vec<(i32, String, i64)> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT attempt, idempotency_key, death_count FROM \"{}\".handler_calls \
             WHERE consumer_name = $1 AND message_id = $2 ORDER BY seq",
            self.schema
        )))
        .bind(consumer)
        .bind(message_id)
        .fetch_all(&self.pool)
        .await
        .expect("read handler calls")
    }
}

/// A consumer running in a task.
#[derive(Debug)]
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), RunError>>>,
    /// The consumer's live counters.
    pub stats: Arc<ConsumerStats>,
    #[cfg(feature = "fault-injection")]
    /// The consumer's fault plan.
    pub faults: Arc<rabbit_inbox::fault::FaultPlan>,
}

impl Running {
    /// Runs `consumer` in a task.
    pub fn spawn<H: 'static>(consumer: Consumer<H>) -> Self {
        Self::spawn_beside(consumer, |runner| runner)
    }

    /// Runs `consumer` in a task, with the background work `beside` adds to its runner.
    pub fn spawn_beside<H: 'static>(
        consumer: Consumer<H>,
        beside: impl FnOnce(Runner) -> Runner,
    ) -> Self {
        let stats = consumer.stats();
        #[cfg(feature = "fault-injection")]
        let faults = consumer.faults();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let runner = beside(Runner::new().task("consumer", |stop| consumer.run(stop)));
        let task = tokio::spawn(runner.run(async move {
            // A dropped sender (a panicking test) stops the consumer too.
            let _ = stopped.await;
        }));
        Running {
            stop: Some(stop),
            task: Some(task),
            stats,
            #[cfg(feature = "fault-injection")]
            faults,
        }
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Stops the consumer: it settles what it holds and closes its connection, so anything
    /// not acked is back in its queue afterwards. Returns the final counters.
    pub async fn stop(mut self) -> StatsSnapshot {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(DEADLINE, task)
                .await
                .expect("consumer stops in time")
                .expect("consumer task did not panic")
                .expect("consumer ran without a fatal error");
        }
        self.stats.snapshot()
    }
}

/// How the test handler treats a message.
#[derive(Clone, Debug)]
pub enum Rule {
    /// Fail retryably, every time.
    Retryable,
    /// Fail permanently.
    Permanent,
    /// Fail retryably while the attempt number is at most this, then succeed.
    FailAttempts(i32),
    /// Signal `entered`, wait for `release`, then fail retryably. Used once.
    Gate(Arc<Gate>),
    /// Wait until the latch is open, then succeed. Holds every matching message.
    Hold(Arc<Latch>),
}

/// A rendezvous with a handler call, see [`Rule::Gate`].
#[derive(Debug, Default)]
pub struct Gate {
    /// Notified when the handler reaches the gate.
    pub entered: Notify,
    /// Notified by the test to let the handler go on.
    pub release: Notify,
}

/// A latch handler calls wait at (see [`Rule::Hold`]) until the test opens it.
#[derive(Debug)]
pub struct Latch {
    open: watch::Sender<bool>,
    arrivals: AtomicU64,
}

impl Default for Latch {
    fn default() -> Self {
        Self {
            open: watch::Sender::new(false),
            arrivals: AtomicU64::new(0),
        }
    }
}

impl Latch {
    /// Lets every waiting and future call through.
    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// How many handler calls have reached the latch so far.
    pub fn arrivals(&self) -> u64 {
        self.arrivals.load(Ordering::SeqCst)
    }

    async fn pass(&self) {
        self.arrivals.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|o| *o).await;
    }
}

/// Opens a latch when dropped, so a failing test does not leave a handler holding a transaction
/// (and its locks) while the cleanup drops the schema.
#[derive(Debug)]
pub struct OpenOnDrop(
    /// The latch.
    pub Arc<Latch>,
);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// The lane the consumer assigns to a message with lane key `key` (its aggregate id, else its
/// dedup key) out of `lanes`. Mirrors the consumer's hashing (`DefaultHasher` over the key), so
/// a test can put two aggregates on different lanes.
pub fn lane_of(key: &str, lanes: usize) -> usize {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    (h.finish() % lanes as u64) as usize
}

/// `(messages_ready, messages_unacknowledged)` of `queue` as the broker reports them through
/// `rabbitmqctl`; `None` when `rabbitmqctl` cannot run here or does not list the queue (e.g.
/// RabbitMQ runs in a container or `AMQP_URL` points elsewhere).
pub async fn rabbitmqctl_counts(queue: &str) -> Option<(u64, u64)> {
    let queue = queue.to_owned();
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new("rabbitmqctl")
            .args([
                "-q",
                "list_queues",
                "name",
                "messages_ready",
                "messages_unacknowledged",
            ])
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|line| {
                let mut cols = line.split('\t');
                if cols.next()? != queue {
                    return None;
                }
                Some((cols.next()?.parse().ok()?, cols.next()?.parse().ok()?))
            })
    })
    .await
    .ok()
    .flatten()
}

/// Failure rules of a [`TestHandler`], changeable while it runs.
#[derive(Debug, Default)]
pub struct Plan {
    by_id: Mutex<HashMap<String, Rule>>,
    by_type: Mutex<HashMap<String, Rule>>,
}

impl Plan {
    /// `rule` for the message `message_id`.
    pub fn for_id(&self, message_id: &str, rule: Rule) {
        lock(&self.by_id).insert(message_id.to_owned(), rule);
    }

    /// `rule` for every message of `message_type` without a rule of its own.
    pub fn for_type(&self, message_type: &str, rule: Rule) {
        lock(&self.by_type).insert(message_type.to_owned(), rule);
    }

    /// No rule for `message_id` any more.
    pub fn clear_id(&self, message_id: &str) {
        lock(&self.by_id).remove(message_id);
    }

    fn rule(&self, msg: &InboxMessage<'_>) -> Option<Rule> {
        let mut by_id = lock(&self.by_id);
        let rule = match by_id.get(msg.message_id()) {
            // A gate holds once.
            Some(Rule::Gate(_)) => by_id.remove(msg.message_id()),
            Some(rule) => Some(rule.clone()),
            None => None,
        };
        drop(by_id);
        rule.or_else(|| lock(&self.by_type).get(msg.message_type()).cloned())
    }
}

/// Applies each message by inserting one row into `effects` inside the transaction, after
/// noting the call in `handler_calls` and `external_ledger` outside it. Fails as its
/// [`Plan`] says, after the effect row is written, so a failure must roll the effect back.
#[derive(Debug, Clone)]
pub struct TestHandler {
    schema: SchemaName,
    pool: PgPool,
    plan: Arc<Plan>,
}

impl Handler for TestHandler {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let s = &self.schema;
        let key = msg.idempotency_key();
        // The "external call": not part of the transaction.
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{s}\".handler_calls \
               (message_id, consumer_name, attempt, idempotency_key, death_count, redelivered) \
             VALUES ($1, $2, $3, $4, $5, $6)"
        )))
        .bind(msg.message_id())
        .bind(msg.consumer_name())
        .bind(msg.attempt())
        .bind(&key)
        .bind(i64::try_from(msg.envelope().death_count).unwrap_or(i64::MAX))
        .bind(msg.envelope().redelivered)
        .execute(&self.pool)
        .await
        .map_err(|e| HandlerError::retryable("test_external", e.to_string()))?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{s}\".external_ledger (idempotency_key, message_id, calls) \
             VALUES ($1, $2, 1) ON CONFLICT (idempotency_key) \
             DO UPDATE SET calls = external_ledger.calls + 1"
        )))
        .bind(&key)
        .bind(msg.message_id())
        .execute(&self.pool)
        .await
        .map_err(|e| HandlerError::retryable("test_external", e.to_string()))?;

        // The business effect, in the transaction.
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{s}\".effects (message_id, consumer_name, message_type, attempt, body) \
             VALUES ($1, $2, $3, $4, $5)"
        )))
        .bind(msg.message_id())
        .bind(msg.consumer_name())
        .bind(msg.message_type())
        .bind(msg.attempt())
        .bind(String::from_utf8_lossy(&msg.envelope().body).into_owned())
        .execute(&mut *tx)
        .await?;

        match self.plan.rule(msg) {
            None => Ok(()),
            Some(Rule::Retryable) => Err(HandlerError::retryable(
                "test_retryable",
                format!("planned retryable failure of {}", msg.message_id()),
            )),
            Some(Rule::Permanent) => Err(HandlerError::permanent(
                "test_permanent",
                format!("planned permanent failure of {}", msg.message_id()),
            )),
            Some(Rule::FailAttempts(n)) if msg.attempt() <= n => Err(HandlerError::retryable(
                "test_retryable",
                format!("planned failure of attempt {}", msg.attempt()),
            )),
            Some(Rule::FailAttempts(_)) => Ok(()),
            Some(Rule::Gate(gate)) => {
                gate.entered.notify_one();
                gate.release.notified().await;
                Err(HandlerError::retryable(
                    "test_gate",
                    "planned failure after the gate opened",
                ))
            }
            Some(Rule::Hold(latch)) => {
                latch.pass().await;
                Ok(())
            }
        }
    }
}

/// How the test batch handler fails a batch that holds a message.
#[derive(Clone, Copy, Debug)]
pub enum BatchRule {
    /// Blame the message: `BatchError::Message` with its index (code `test_blamed`).
    Blame(ErrorKind),
    /// Fail the whole batch without saying why: `BatchError::Batch` (code `test_unattributed`).
    Unattributed(ErrorKind),
}

/// Failure rules and call log of a [`TestBatchHandler`].
#[derive(Debug, Default)]
pub struct BatchPlan {
    rules: Mutex<HashMap<String, BatchRule>>,
    calls: Mutex<Vec<Vec<String>>>,
}

impl BatchPlan {
    /// `rule` for the message `message_id`.
    pub fn for_id(&self, message_id: &str, rule: BatchRule) {
        lock(&self.rules).insert(message_id.to_owned(), rule);
    }

    /// The message ids of every `handle_batch` call, in call order.
    pub fn calls(&self) -> Vec<Vec<String>> {
        lock(&self.calls).clone()
    }

    /// The failure for a batch: by the rule of its first message that has one.
    fn failure(&self, msgs: &[InboxMessage<'_>]) -> Option<BatchError> {
        let rules = lock(&self.rules);
        msgs.iter().enumerate().find_map(|(index, msg)| {
            let error = |kind, code: &'static str, text: String| match kind {
                ErrorKind::Retryable => HandlerError::retryable(code, text),
                ErrorKind::Permanent => HandlerError::permanent(code, text),
                other => panic!("no rule makes a {other:?} error"),
            };
            Some(match *rules.get(msg.message_id())? {
                BatchRule::Blame(kind) => BatchError::Message {
                    index,
                    error: error(
                        kind,
                        "test_blamed",
                        format!("planned failure of {}", msg.message_id()),
                    ),
                },
                BatchRule::Unattributed(kind) => BatchError::Batch(error(
                    kind,
                    "test_unattributed",
                    format!("planned failure of a batch of {}", msgs.len()),
                )),
            })
        })
    }
}

/// Applies a whole batch with one set-based statement (`INSERT .. SELECT FROM UNNEST(..)`),
/// one `effects` row per message, then fails as its [`BatchPlan`] says, so a failure must roll
/// the effects back. Logs every call's message ids.
#[derive(Debug, Clone)]
pub struct TestBatchHandler {
    schema: SchemaName,
    plan: Arc<BatchPlan>,
}

impl BatchHandler for TestBatchHandler {
    async fn handle_batch(
        &self,
        msgs: &[InboxMessage<'_>],
        tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        lock(&self.plan.calls).push(msgs.iter().map(|m| m.message_id().to_owned()).collect());
        let ids: Vec<&str> = msgs.iter().map(|m| m.message_id()).collect();
        let types: Vec<&str> = msgs.iter().map(|m| m.message_type()).collect();
        let attempts: Vec<i32> = msgs.iter().map(|m| m.attempt()).collect();
        let bodies: Vec<String> = msgs
            .iter()
            .map(|m| String::from_utf8_lossy(&m.envelope().body).into_owned())
            .collect();
        let consumer = msgs.first().map_or("", |m| m.consumer_name());
        let s = &self.schema;
        let inserted = sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{s}\".effects (message_id, consumer_name, message_type, attempt, body) \
             SELECT u.message_id, $5, u.message_type, u.attempt, u.body \
             FROM UNNEST($1::text[], $2::text[], $3::int4[], $4::text[]) \
               AS u(message_id, message_type, attempt, body)"
        )))
        .bind(&ids)
        .bind(&types)
        .bind(&attempts)
        .bind(&bodies)
        .bind(consumer)
        .execute(&mut *tx)
        .await
        .map_err(|e| BatchError::Batch(e.into()))?
        .rows_affected();
        if inserted != msgs.len() as u64 {
            return Err(BatchError::Batch(HandlerError::permanent(
                "test_short_insert",
                format!("inserted {inserted} effects for {} messages", msgs.len()),
            )));
        }
        match self.plan.failure(msgs) {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// The retry tiers of [`TestEnv::config`] (one fast tier), which [`TestEnv::depths`] and the
/// cleanup assume.
pub fn test_retry() -> rabbit_inbox::RetryPolicy {
    rabbit_inbox::RetryPolicy::fixed(Duration::from_millis(200))
}
