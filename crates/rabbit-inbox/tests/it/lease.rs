//! Leased processing against the real servers: fencing refuses a worker whose lease was taken
//! over (its checkpoint, its completion), heartbeats keep a long handler's lease, failures
//! go through the retry tiers as in the transactional mode, panics and refused commits are
//! parked without effects.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use inbox_ops::{
    Actor, NoProgress, Operations,
    recover::{RecoverRequest, RecoveryAction},
};
use inbox_testkit::env::{Running, TestEnv, thing, wait_for};
use rabbit_inbox::{
    Consumer, ConsumerConfig, HandlerError, InboxMessage, InboxStatus, Lease, LeaseConfig,
    LeaseError, LeasedHandler, stats::ConsumerStats, stats::StatsSnapshot,
};
use sqlx::{AssertSqlSafe, PgConnection};

/// What the leased test handler does in `work` on an attempt.
#[derive(Clone, Copy, Debug)]
enum Work {
    /// Returns at once.
    Quick,
    /// Awaits this long (the heartbeat keeps running).
    Sleep(Duration),
    /// Blocks its thread this long, as a paused process would (no heartbeat either), then
    /// tries a fenced checkpoint.
    Freeze(Duration),
    /// Fails retryably.
    Fail,
    /// Panics.
    Panic,
    /// Returns, but the commit refuses permanently.
    RefuseCommit,
}

/// How each fenced checkpoint went: (attempt, token, Ok or the error text).
type Checkpoints = Arc<Mutex<Vec<(i32, i64, Result<(), String>)>>>;

#[derive(Clone)]
struct LeasedTestHandler {
    schema: String,
    /// The behaviour per attempt number (1-based); `Quick` past the list.
    plan: Vec<Work>,
    checkpoints: Checkpoints,
}

impl LeasedTestHandler {
    fn new(env: &TestEnv, plan: Vec<Work>) -> Self {
        Self {
            schema: env.schema.to_string(),
            plan,
            checkpoints: Arc::default(),
        }
    }

    async fn checkpoint(&self, msg: &InboxMessage<'_>, lease: &Lease) -> Result<(), LeaseError> {
        let sql = format!(
            "INSERT INTO \"{}\".handler_calls \
               (message_id, consumer_name, attempt, idempotency_key, death_count, redelivered) \
             VALUES ($1, $2, $3, 'checkpoint', $4, false)",
            self.schema
        );
        let (id, consumer, attempt, token) = (
            msg.message_id().to_owned(),
            msg.consumer_name().to_owned(),
            msg.attempt(),
            lease.token(),
        );
        let result = lease
            .fenced(move |tx| {
                Box::pin(async move {
                    sqlx::query(AssertSqlSafe(sql))
                        .bind(id)
                        .bind(consumer)
                        .bind(attempt)
                        .bind(token)
                        .execute(&mut *tx)
                        .await?;
                    Ok(())
                })
            })
            .await;
        self.checkpoints.lock().expect("lock").push((
            attempt,
            token,
            result.as_ref().map(|_| ()).map_err(ToString::to_string),
        ));
        result
    }
}

impl LeasedHandler for LeasedTestHandler {
    type Output = i64;

    async fn work(&self, msg: &InboxMessage<'_>, lease: &Lease) -> Result<i64, HandlerError> {
        let step = usize::try_from(msg.attempt() - 1)
            .ok()
            .and_then(|i| self.plan.get(i))
            .copied()
            .unwrap_or(Work::Quick);
        match step {
            Work::Quick => {}
            Work::Sleep(d) => tokio::time::sleep(d).await,
            Work::Freeze(d) => {
                std::thread::sleep(d);
                // A paused worker that wakes up carries on as if nothing happened; the fenced
                // write must refuse it. The error is recorded and then ignored on purpose: the
                // completion must be refused too.
                let _ = self.checkpoint(msg, lease).await;
                return Ok(lease.token());
            }
            Work::Fail => {
                return Err(HandlerError::retryable(
                    "test_retryable",
                    "planned failure in leased work",
                ));
            }
            Work::Panic => panic!("planned panic in leased work"),
            Work::RefuseCommit => {
                self.checkpoint(msg, lease).await?;
                return Ok(-1);
            }
        }
        self.checkpoint(msg, lease).await?;
        Ok(lease.token())
    }

    async fn commit(
        &self,
        msg: &InboxMessage<'_>,
        token: i64,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let inserted = sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".effects (message_id, consumer_name, message_type, attempt, body) \
             VALUES ($1, $2, $3, $4, $5)",
            self.schema
        )))
        .bind(msg.message_id())
        .bind(msg.consumer_name())
        .bind(msg.message_type())
        .bind(msg.attempt())
        .bind(format!("token {token}"))
        .execute(&mut *tx)
        .await;
        inserted?;
        if token < 0 {
            // After the effect row: the refusal must roll it back.
            return Err(HandlerError::permanent(
                "test_commit_refused",
                "planned refusal",
            ));
        }
        Ok(())
    }
}

/// One-second leases renewed every 200 ms.
fn lease() -> LeaseConfig {
    LeaseConfig {
        ttl: Duration::from_secs(1),
        heartbeat: Duration::from_millis(200),
    }
}

fn start(env: &TestEnv, config: ConsumerConfig, handler: LeasedTestHandler) -> Running {
    start_with(env, config, lease(), handler)
}

fn start_with(
    env: &TestEnv,
    config: ConsumerConfig,
    lease: LeaseConfig,
    handler: LeasedTestHandler,
) -> Running {
    Running::spawn(
        Consumer::leased(
            inbox_testkit::env::amqp_url(),
            env.pool.clone(),
            config,
            lease,
            handler,
        )
        .expect("valid config"),
    )
}

/// A consumer on a runtime (and pool) of its own, on its own thread: a handler that blocks
/// that thread pauses the whole consumer, heartbeat included, as a paused process would, and
/// nothing else in the test.
struct Isolated {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    stats: Arc<ConsumerStats>,
}

impl Isolated {
    fn start(config: ConsumerConfig, handler: LeasedTestHandler) -> Self {
        let (stats_tx, stats_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(4)
                    .connect(&inbox_testkit::env::database_url())
                    .await
                    .expect("PostgreSQL");
                let consumer = Consumer::leased(
                    inbox_testkit::env::amqp_url(),
                    pool,
                    config,
                    lease(),
                    handler,
                )
                .expect("valid config");
                stats_tx.send(consumer.stats()).expect("test waits");
                consumer
                    .run(async move {
                        let _ = stopped.await;
                    })
                    .await
                    .expect("consumer ran without a fatal error");
            });
        });
        let stats = stats_rx.recv().expect("consumer started");
        Self {
            stop: Some(stop),
            thread: Some(thread),
            stats,
        }
    }

    async fn stop(mut self) -> StatsSnapshot {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            tokio::task::spawn_blocking(move || thread.join())
                .await
                .expect("join")
                .expect("consumer thread did not panic");
        }
        self.stats.snapshot()
    }
}

/// The row's fencing token, lease owner and whether its lease has expired.
async fn lease_of(env: &TestEnv, consumer: &str, id: &str) -> (Option<i64>, Option<String>, bool) {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT fencing_token, lease_owner, coalesce(lease_expires_at < now(), false) \
         FROM \"{}\".message_inbox WHERE consumer_name = $1 AND message_id = $2",
        env.schema
    )))
    .bind(consumer)
    .bind(id)
    .fetch_one(&env.pool)
    .await
    .expect("row")
}

/// How a successor takes over from the paused worker.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Takeover {
    /// A copy of the message (a producer's republish) claims the expired lease directly.
    Redelivery,
    /// Recovery finds the expired lease and republishes the stored payload.
    Recovery,
}

/// Worker A claims the message and freezes past its TTL; worker B takes it over and completes
/// it. When A wakes up, its checkpoint and its completion are refused, its delivery is settled
/// as a duplicate of B's outcome, and the effect is applied once, by B.
async fn paused_worker_loses(takeover: Takeover) {
    let env = TestEnv::new().await;
    let topology = env.topology("lease");
    let mut config = env.config("leased-svc", topology.clone());
    config.lanes = 1;
    // A holds its one delivery unacked while frozen, so the broker sends the copy to B.
    config.prefetch = 1;
    env.declare(&config).await;
    // Long enough for B to take over and finish first, even on a busy machine.
    let frozen = Duration::from_secs(6);
    let a_handler = LeasedTestHandler::new(&env, vec![Work::Freeze(frozen)]);
    let a_checkpoints = a_handler.checkpoints.clone();
    let a = Isolated::start(config.clone(), a_handler);
    env.publish(&topology, &thing("m1", 1)).await;

    // A holds the lease; then it stops renewing (its thread is blocked) and the lease expires.
    let claimed = env
        .wait_for_record("leased-svc", "m1", "claimed", |r| {
            r.status == InboxStatus::Processing
        })
        .await;
    assert_eq!(claimed.processing_attempt, 1);
    let (token, owner, _) = lease_of(&env, "leased-svc", "m1").await;
    assert_eq!(token, Some(1));
    assert!(owner.is_some(), "a leased claim names its owner");
    wait_for("A's lease to expire", async || {
        lease_of(&env, "leased-svc", "m1").await.2
    })
    .await;

    let b_handler = LeasedTestHandler::new(&env, vec![]);
    let b_checkpoints = b_handler.checkpoints.clone();
    let b = start(&env, config.clone(), b_handler);
    match takeover {
        Takeover::Redelivery => env.publish(&topology, &thing("m1", 1)).await,
        Takeover::Recovery => {
            let ops = Operations::new(env.pool.clone(), env.schema.clone());
            let report = ops
                .recover(
                    &env.broker,
                    &Actor::new("test", "A froze").expect("actor"),
                    &RecoverRequest::for_consumer(&config, &Default::default()),
                    &NoProgress,
                )
                .await
                .expect("recovery runs");
            assert_eq!(report.found, 1, "{report:?}");
            assert_eq!(report.messages[0].action, RecoveryAction::Republished);
        }
    }
    let done = env
        .wait_for_record("leased-svc", "m1", "processed by B", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    assert_eq!(env.effects("m1").await, 1);
    let b_runs = b_checkpoints.lock().expect("lock").clone();
    assert_eq!(b_runs.len(), 1, "B ran once: {b_runs:?}");
    assert!(b_runs[0].2.is_ok(), "B's checkpoint committed: {b_runs:?}");
    assert!(b_runs[0].1 > 1, "B holds a later token: {b_runs:?}");

    // A wakes up: its checkpoint is refused with LeaseLost, its completion too.
    wait_for("A to wake up and try its checkpoint", async || {
        !a_checkpoints.lock().expect("lock").is_empty()
    })
    .await;
    let a_runs = a_checkpoints.lock().expect("lock").clone();
    assert_eq!(a_runs.len(), 1);
    let (attempt, token, result) = &a_runs[0];
    assert_eq!((*attempt, *token), (1, 1));
    let error = result.as_ref().expect_err("A's fenced write is refused");
    assert!(error.contains("lease on message m1 lost"), "{error}");
    let a_stats = a.stop().await;
    assert_eq!(a_stats.processed, 0, "A never reports its run as processed");
    assert_eq!(
        a_stats.duplicates, 1,
        "A's delivery is acked as a duplicate of B's run"
    );
    let b_stats = b.stop().await;
    assert_eq!(b_stats.processed, 1);

    // Exactly one effect, B's, and no checkpoint of A's token.
    assert_eq!(env.effects("m1").await, 1);
    let body = env
        .scalar("SELECT count(*) FROM {s}.effects WHERE message_id = 'm1' AND body = 'token 1'")
        .await;
    assert_eq!(body, 0, "nothing was committed under A's token");
    let a_checkpoint = env
        .scalar(
            "SELECT count(*) FROM {s}.handler_calls \
             WHERE idempotency_key = 'checkpoint' AND death_count = 1",
        )
        .await;
    assert_eq!(a_checkpoint, 0, "A's checkpoint did not commit");
    let row = env.record("leased-svc", "m1").await.expect("row");
    assert_eq!(row.status, InboxStatus::Processed);
    assert_eq!(row.processing_attempt, done.processing_attempt);
    let (token, owner, _) = lease_of(&env, "leased-svc", "m1").await;
    assert!(
        token > Some(1),
        "the row keeps the successor's token: {token:?}"
    );
    assert_eq!(owner, None, "a completed row holds no lease");
    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.retry, depths.parking), (0, 0, 0));
    if takeover == Takeover::Recovery {
        let audited = env
            .scalar(
                "SELECT count(*) FROM {s}.inbox_audit \
                 WHERE action = 'recover_republish' AND message_id = 'm1' \
                   AND details->>'cause' = 'lease_expired'",
            )
            .await;
        assert_eq!(audited, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_worker_cannot_commit_after_a_redelivery_took_over() {
    paused_worker_loses(Takeover::Redelivery).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_worker_cannot_commit_after_recovery_took_over() {
    paused_worker_loses(Takeover::Recovery).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeats_keep_a_long_handler_alive_past_the_ttl() {
    let env = TestEnv::new().await;
    let topology = env.topology("beat");
    let config = env.config("leased-svc", topology.clone());
    env.declare(&config).await;
    // Two-second leases renewed every 250 ms (room for a slow database), and two and a half
    // TTLs of work.
    let lease = LeaseConfig {
        ttl: Duration::from_secs(2),
        heartbeat: Duration::from_millis(250),
    };
    let handler = LeasedTestHandler::new(&env, vec![Work::Sleep(Duration::from_secs(5))]);
    let checkpoints = handler.checkpoints.clone();
    let running = start_with(&env, config.clone(), lease, handler);
    env.publish(&topology, &thing("long", 1)).await;
    env.wait_for_record("leased-svc", "long", "claimed", |r| {
        r.status == InboxStatus::Processing
    })
    .await;

    // Past the TTL: the lease is still live, a copy finds it in flight, recovery finds nothing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (token, _, expired) = lease_of(&env, "leased-svc", "long").await;
    assert_eq!(
        (token, expired),
        (Some(1), false),
        "the heartbeat renewed the lease"
    );
    env.publish(&topology, &thing("long", 1)).await;
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let report = ops
        .recover(
            &env.broker,
            &Actor::new("test", "nothing to recover").expect("actor"),
            &RecoverRequest::for_consumer(&config, &Default::default()),
            &NoProgress,
        )
        .await
        .expect("recovery runs");
    assert_eq!(
        report.found, 0,
        "a live lease is never recovered: {report:?}"
    );

    let row = env
        .wait_for_record("leased-svc", "long", "processed", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    assert_eq!(row.processing_attempt, 1, "never taken over");
    // The copy comes back from the retry tier and is acked as a duplicate.
    wait_for("the copy to be settled as a duplicate", async || {
        running.snapshot().duplicates == 1
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(stats.processed, 1);
    assert_eq!(env.effects("long").await, 1);
    let runs = checkpoints.lock().expect("lock").clone();
    assert_eq!(runs.len(), 1);
    assert!(runs[0].2.is_ok(), "{runs:?}");
    assert_eq!(lease_of(&env, "leased-svc", "long").await.0, Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leased_failures_retry_under_a_new_token_and_a_second_copy_does_not_rerun() {
    let env = TestEnv::new().await;
    let topology = env.topology("fail");
    let config = env.config("leased-svc", topology.clone());
    env.declare(&config).await;
    // The retry (attempt 2) takes a while, and a producer's copy arrives meanwhile: a second
    // copy meeting the reclaimed RETRYABLE_FAILED row must not run the effect again.
    let handler = LeasedTestHandler::new(
        &env,
        vec![Work::Fail, Work::Sleep(Duration::from_millis(800))],
    );
    let checkpoints = handler.checkpoints.clone();
    let running = start(&env, config, handler);
    env.publish(&topology, &thing("f1", 1)).await;
    env.wait_for_record("leased-svc", "f1", "reclaimed for attempt 2", |r| {
        r.status == InboxStatus::Processing && r.processing_attempt == 2
    })
    .await;
    env.publish(&topology, &thing("f1", 1)).await;
    let row = env
        .wait_for_record("leased-svc", "f1", "processed after a retry", |r| {
            r.status == InboxStatus::Processed
        })
        .await;
    assert_eq!(row.processing_attempt, 2);
    assert_eq!(row.last_error_code.as_deref(), Some("test_retryable"));
    wait_for("the copy settled as a duplicate", async || {
        running.snapshot().duplicates == 1
    })
    .await;
    let stats = running.stop().await;
    assert_eq!(stats.processed, 1);
    assert_eq!(env.effects("f1").await, 1);
    let runs = checkpoints.lock().expect("lock").clone();
    assert_eq!(
        runs.len(),
        1,
        "the failed attempt wrote no checkpoint: {runs:?}"
    );
    assert_eq!(
        (runs[0].0, runs[0].1),
        (2, 2),
        "attempt 2 runs under token 2"
    );
    let payload = env
        .scalar("SELECT count(*) FROM {s}.message_inbox WHERE payload IS NOT NULL")
        .await;
    assert_eq!(payload, 0, "the body kept for recovery goes once processed");
}

#[tokio::test]
async fn a_heartbeat_close_to_the_ttl_is_refused() {
    let config = ConsumerConfig::new("svc", rabbit_inbox::Topology::new("q"));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_lazy("postgres://postgres@127.0.0.1/postgres")
        .expect("lazy pool");
    let slow = LeaseConfig {
        ttl: Duration::from_secs(3),
        heartbeat: Duration::from_secs(2),
    };
    let handler = LeasedTestHandler {
        schema: "unused".into(),
        plan: vec![],
        checkpoints: Arc::default(),
    };
    let err = Consumer::leased("amqp://unused", pool, config, slow, handler).expect_err("refused");
    assert!(err.to_string().contains("lease.heartbeat"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_work_and_a_refused_commit_are_parked_without_effects() {
    let env = TestEnv::new().await;
    let topology = env.topology("park");
    let config = env.config("leased-svc", topology.clone());
    env.declare(&config).await;
    let panicking = start(
        &env,
        config.clone(),
        LeasedTestHandler::new(&env, vec![Work::Panic]),
    );
    env.publish(&topology, &thing("p1", 1)).await;
    let parked = env.take_parked(&topology, 1).await;
    assert_eq!(
        inbox_testkit::env::header(&parked[0], "x-inbox-error-code"),
        Some("handler_panicked")
    );
    panicking.stop().await;

    let refusing = start(
        &env,
        config.clone(),
        LeasedTestHandler::new(&env, vec![Work::RefuseCommit]),
    );
    env.publish(&topology, &thing("p2", 1)).await;
    let parked = env.take_parked(&topology, 1).await;
    assert_eq!(
        inbox_testkit::env::header(&parked[0], "x-inbox-error-code"),
        Some("test_commit_refused")
    );
    let stats = refusing.stop().await;
    assert_eq!((stats.parked, stats.processed), (1, 0));
    for (id, code) in [("p1", "handler_panicked"), ("p2", "test_commit_refused")] {
        let row = env.record("leased-svc", id).await.expect("row");
        assert_eq!(row.status, InboxStatus::PermanentFailed, "{id}");
        assert_eq!(row.last_error_code.as_deref(), Some(code), "{id}");
        assert_eq!(
            lease_of(&env, "leased-svc", id).await.1,
            None,
            "{id}: lease released"
        );
    }
    assert_eq!(env.effects("p1").await + env.effects("p2").await, 0);
}
