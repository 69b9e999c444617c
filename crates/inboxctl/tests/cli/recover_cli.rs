//! `inboxctl recover` on a populated inbox of a small test-only service (its own handler,
//! table and consumer name): a retry whose copy was lost is found by the dry run, republished
//! by the real run (audited), and then processed; refusals and failures exit non-zero.

use std::{process::Output, time::Duration};

use inbox_testkit::{amqp_url, database_url, env::wait_for, unique_suffix};
use rabbit_inbox::{
    Consumer, ConsumerConfig, Handler, HandlerError, InboxMessage, InboxStatus, RetryPolicy,
    SchemaName, Topology, broker::Broker, broker::OutgoingMessage, store::InboxStore,
};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use crate::common::{Cleanup, inboxctl};

const CONSUMER: &str = "ledger-svc";

fn retry() -> RetryPolicy {
    RetryPolicy::fixed(Duration::from_secs(2))
}

/// The test service: one ledger row per entry; entry "lost" fails its first attempt.
struct Ledger(SchemaName);

impl Handler for Ledger {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        if msg.message_id() == "lost" && msg.attempt() == 1 {
            return Err(HandlerError::retryable("ledger_busy", "ledger busy"));
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".ledger (id, attempt) VALUES ($1, $2)",
            self.0
        )))
        .bind(msg.message_id())
        .bind(msg.attempt())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

struct Service {
    pool: PgPool,
    config: ConsumerConfig,
}

impl Service {
    /// Runs the consumer until `until` holds (for at most 30 s), then stops it.
    async fn consume_until(&self, what: &str, until: impl AsyncFn() -> bool) {
        let consumer = Consumer::new(
            amqp_url(),
            self.pool.clone(),
            self.config.clone(),
            Ledger(self.config.schema.clone()),
        )
        .expect("valid config");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run(async move {
            let _ = stopped.await;
        }));
        wait_for(what, until).await;
        let _ = stop.send(());
        task.await
            .expect("consumer task")
            .expect("consumer ran cleanly");
    }

    async fn status(&self, id: &str) -> Option<InboxStatus> {
        let mut conn = self.pool.acquire().await.expect("connection");
        InboxStore::new(self.config.schema.clone())
            .find(&mut conn, CONSUMER, id)
            .await
            .expect("row readable")
            .map(|r| r.status)
    }

    async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(
            sql.replace("{s}", &format!("\"{}\"", self.config.schema)),
        ))
        .fetch_one(&self.pool)
        .await
        .expect("count")
    }
}

fn json(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "inboxctl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON on stdout")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_finds_republishes_and_audits_a_lost_retry() {
    let id = unique_suffix();
    let schema = SchemaName::new(format!("t_rcli_{id}")).expect("schema");
    let topology = Topology::new(format!("t-rcli-{id}"));
    let _cleanup = Cleanup::schema(schema.as_str()).queues(&topology, retry());
    let pool = PgPool::connect(&database_url()).await.expect("PostgreSQL");
    rabbit_inbox::migrate(&pool, &schema)
        .await
        .expect("migrate");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".ledger (id TEXT PRIMARY KEY, attempt INT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .expect("service table");
    let mut config = ConsumerConfig::new(CONSUMER, topology.clone());
    config.schema = schema.clone();
    config.retry = retry();
    config.max_batch_delay = Duration::from_millis(10);
    let service = Service { pool, config };

    // A populated inbox: five entries processed, one failed with its retry copy in the tier.
    let broker = Broker::connect(&amqp_url(), "recover cli test")
        .await
        .expect("RabbitMQ");
    broker.declare(&topology, &retry()).await.expect("declare");
    for id in ["a", "b", "c", "d", "e", "lost"] {
        let message = OutgoingMessage {
            message_id: Some(id.into()),
            kind: Some("LedgerEntry".into()),
            body: format!("{{\"id\":\"{id}\"}}").into_bytes(),
            ..OutgoingMessage::default()
        };
        broker
            .publish("", &topology.queue, &message)
            .await
            .expect("publish");
    }
    service
        .consume_until("five processed, one retrying", async || {
            let retrying = broker
                .queue_depths(&topology, &retry())
                .await
                .is_ok_and(|d| d.retry == 1);
            retrying && service.count("SELECT count(*) FROM {s}.ledger").await == 5
        })
        .await;
    // The tier queue is deleted and declared again: the copy in it is gone.
    broker.delete(&topology, &retry()).await.expect("delete");
    broker.declare(&topology, &retry()).await.expect("declare");
    tokio::time::sleep(Duration::from_millis(2500)).await;

    let schema_arg = schema.to_string();
    let base = [
        "recover",
        "--schema",
        &schema_arg,
        "--consumer",
        CONSUMER,
        "--queue",
        &topology.queue,
        "--retry-delays",
        "2s",
        "--grace",
        "200ms",
    ];
    let with = |extra: &[&'static str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        args
    };

    // Refused without an actor and a reason.
    let refused = inboxctl(&with(&["--json"])).await;
    assert!(
        !refused.status.success(),
        "an actor and a reason are required"
    );
    let blank = inboxctl(&with(&["--actor", " ", "--reason", "x", "--json"])).await;
    assert!(!blank.status.success());
    assert!(String::from_utf8_lossy(&blank.stderr).contains("actor name is required"));

    let audit = "SELECT count(*) FROM {s}.inbox_audit WHERE action = 'recover_republish' \
                 AND message_id = 'lost' AND actor = 'ops-alice' AND ticket = 'CHG-9'";
    let dry = json(
        &inboxctl(&with(&[
            "--dry-run",
            "--actor",
            "ops-alice",
            "--reason",
            "tier deleted",
            "--json",
        ]))
        .await,
    );
    assert_eq!(dry["dry_run"], true);
    assert_eq!(dry["found"], 1, "{dry}");
    assert_eq!(dry["messages"][0]["message_id"], "lost");
    assert_eq!(dry["messages"][0]["cause"], "retry_lost");
    assert_eq!(dry["messages"][0]["action"], "republished");
    assert_eq!(service.count(audit).await, 0, "a dry run changes nothing");

    let done = json(
        &inboxctl(&with(&[
            "--actor",
            "ops-alice",
            "--reason",
            "tier deleted",
            "--ticket",
            "CHG-9",
            "--json",
        ]))
        .await,
    );
    assert_eq!(
        (done["found"].as_u64(), done["republished"].as_u64()),
        (Some(1), Some(1)),
        "{done}"
    );
    assert_eq!(service.count(audit).await, 1);
    assert_eq!(
        service.status("lost").await,
        Some(InboxStatus::RetryableFailed)
    );
    let depths = broker
        .queue_depths(&topology, &retry())
        .await
        .expect("depths");
    assert_eq!(depths.work, 1, "the copy is back in the work queue");

    // Nothing left to recover; the table lists the totals.
    let again = inboxctl(&with(&["--actor", "ops-alice", "--reason", "check"])).await;
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("0 found"));

    // The republished copy is processed, once.
    service
        .consume_until("the recovered entry processed", async || {
            service.status("lost").await == Some(InboxStatus::Processed)
        })
        .await;
    assert_eq!(
        service
            .count("SELECT count(*) FROM {s}.ledger WHERE id = 'lost' AND attempt = 2")
            .await,
        1
    );
    assert_eq!(service.count("SELECT count(*) FROM {s}.ledger").await, 6);

    // A work queue that does not exist: the publish is refused, the row is left, exit 1.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{schema}\".message_inbox SET status = 'RETRYABLE_FAILED', \
           last_failed_at = now() - interval '1 hour', last_recovered_at = NULL, \
           payload = convert_to('{{\"id\":\"a\"}}', 'UTF8') \
         WHERE message_id = 'a'"
    )))
    .execute(&service.pool)
    .await
    .expect("make a row look lost");
    let mut args = with(&["--actor", "ops-alice", "--reason", "wrong queue", "--json"]);
    args[6] = "no-such-queue-rcli";
    let failed = inboxctl(&args).await;
    assert_eq!(
        failed.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&failed.stderr)
    );
    assert_eq!(
        service.status("a").await,
        Some(InboxStatus::RetryableFailed)
    );
    broker.close().await;
}
