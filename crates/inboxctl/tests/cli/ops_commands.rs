//! The operations commands, run as an operator runs them, on the inbox of a small ledger
//! service (its own handler, table and consumer name): `status`, `list`, `show`, `failures`,
//! `redrive` (dry run, then a run SIGKILLed midway, then a run that finishes) and `reopen`.
//! After the fix the ledger holds every entry exactly once and the parking lot is empty.

use std::{
    process::Output,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use inbox_testkit::{amqp_url, database_url, env::wait_for, unique_suffix};
use rabbit_inbox::{
    Consumer, ConsumerConfig, Handler, HandlerError, InboxMessage, RetryPolicy, SchemaName,
    Topology, broker::Broker, broker::OutgoingMessage,
};
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use crate::common::{Cleanup, command, inboxctl};

const CONSUMER: &str = "ledger-writer";
const ENTRIES: usize = 40;

/// Writes one ledger row per entry; refuses every entry while `broken` is set.
#[derive(Clone)]
struct LedgerWriter {
    schema: SchemaName,
    broken: Arc<AtomicBool>,
}

impl Handler for LedgerWriter {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(HandlerError::permanent(
                "ledger_rejected",
                "the ledger rejects entries until the fix is deployed",
            ));
        }
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO \"{}\".ledger (entry_id) VALUES ($1)",
            self.schema
        )))
        .bind(msg.message_id())
        .execute(&mut *tx)
        .await?;
        Ok(())
    }
}

fn retry() -> RetryPolicy {
    RetryPolicy::fixed(Duration::from_millis(200))
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "JSON output ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_commands_on_a_ledger_service() {
    let id = unique_suffix();
    let schema = SchemaName::new(format!("t_ops_{id}")).expect("schema name");
    let topology = Topology::new(format!("t-ops-{id}-ledger"));
    let _cleanup = Cleanup::schema(schema.as_str()).queues(&topology, retry());
    let pool = PgPool::connect(&database_url()).await.expect("PostgreSQL");
    rabbit_inbox::migrate(&pool, &schema)
        .await
        .expect("migrate");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".ledger (seq BIGSERIAL PRIMARY KEY, entry_id TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .expect("ledger table");
    let mut config = ConsumerConfig::new(CONSUMER, topology.clone());
    config.schema = schema.clone();
    config.retry = retry();
    config.max_batch_delay = Duration::from_millis(10);
    let broker = Broker::connect(&amqp_url(), "ops test")
        .await
        .expect("RabbitMQ");
    broker
        .declare(&topology, &config.retry)
        .await
        .expect("declare");
    let depths = async || {
        broker
            .queue_depths(&topology, &retry())
            .await
            .expect("depths")
    };

    let broken = Arc::new(AtomicBool::new(true));
    let handler = LedgerWriter {
        schema: schema.clone(),
        broken: broken.clone(),
    };
    let start = |handler: LedgerWriter| {
        let consumer =
            Consumer::new(amqp_url(), pool.clone(), config.clone(), handler).expect("valid config");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run(async move {
            let _ = stopped.await;
        }));
        (stop, task)
    };
    let (stop, task) = start(handler.clone());
    let ids: Vec<String> = (0..ENTRIES).map(|i| format!("entry-{i:02}")).collect();
    for id in &ids {
        let m = OutgoingMessage {
            message_id: Some(id.clone()),
            kind: Some("LedgerEntry".into()),
            body: json!({ "entry": id, "cents": 100 })
                .to_string()
                .into_bytes(),
            ..OutgoingMessage::default()
        };
        broker
            .publish("", &topology.queue, &m)
            .await
            .expect("publish");
    }
    wait_for("every entry parked", async || {
        depths().await.parking == ENTRIES as u32
    })
    .await;
    let _ = stop.send(());
    task.await.expect("consumer task").expect("consumer ran");

    let s = schema.as_str();
    let q = topology.queue.as_str();
    let common = ["--schema", s, "--json"];
    let with = |extra: &[&'static str]| -> Vec<String> {
        common
            .iter()
            .chain(extra)
            .map(|a| (*a).to_owned())
            .collect()
    };
    let run = async |args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        inboxctl(&refs).await
    };

    // status
    let mut args = vec!["status".to_owned(), "--queue".into(), q.into()];
    args.extend(with(&[]));
    let out = run(args).await;
    assert!(out.status.success(), "{out:?}");
    let status = json_of(&out);
    let failed = status["lines"]
        .as_array()
        .expect("lines")
        .iter()
        .find(|l| l["status"] == "PERMANENT_FAILED")
        .expect("a PERMANENT_FAILED line");
    assert_eq!(failed["rows"], ENTRIES);
    assert_eq!(failed["consumer"], CONSUMER);
    assert_eq!(status["broker"]["parking"]["messages"], ENTRIES);

    // list, two pages
    let mut args = vec!["list".to_owned(), "--limit".into(), "25".into()];
    args.extend(with(&[]));
    let page = json_of(&run(args).await);
    assert_eq!(page["rows"].as_array().map(Vec::len), Some(25));
    let cursor = page["next_cursor"]
        .as_str()
        .expect("a next page")
        .to_owned();
    let mut args = vec![
        "list".to_owned(),
        "--limit".into(),
        "25".into(),
        "--cursor".into(),
        cursor,
    ];
    args.extend(with(&[]));
    let page = json_of(&run(args).await);
    assert_eq!(page["rows"].as_array().map(Vec::len), Some(ENTRIES - 25));
    assert_eq!(page["next_cursor"], Value::Null);

    // show and failures
    let mut args = vec![
        "show".to_owned(),
        "entry-07".into(),
        "--queue".into(),
        q.into(),
    ];
    args.extend(with(&[]));
    let shown = json_of(&run(args).await);
    assert_eq!(shown["rows"][0]["status"], "PERMANENT_FAILED");
    assert_eq!(
        shown["rows"][0]["location"]["queue"],
        topology.parking_queue
    );
    assert!(
        shown["rows"][0]["payload"]["data"]
            .as_str()
            .is_some_and(|p| p.contains("entry-07"))
    );
    let mut args = vec!["show".to_owned(), "no-such-entry".into()];
    args.extend(with(&[]));
    assert_eq!(run(args).await.status.code(), Some(1));
    let mut args = vec!["failures".to_owned()];
    args.extend(with(&[]));
    let groups = json_of(&run(args).await);
    assert_eq!(groups[0]["error_code"], "ledger_rejected");
    assert_eq!(groups[0]["rows"], ENTRIES);

    // redrive: a dry run, a refusal without an actor
    let mut args = vec![
        "redrive".to_owned(),
        "--queue".into(),
        q.into(),
        "--dry-run".into(),
    ];
    args.extend(with(&[]));
    let dry = json_of(&run(args).await);
    assert_eq!(dry["classes"]["reopen"], ENTRIES);
    assert_eq!(dry["actions"]["would_move"], ENTRIES);
    let out = inboxctl(&["redrive", "--schema", s, "--queue", q]).await;
    assert!(!out.status.success(), "moving needs an actor");
    assert_eq!(depths().await.parking, ENTRIES as u32);

    // The fix is deployed. A slow redrive is SIGKILLed midway, then run again.
    broken.store(false, Ordering::SeqCst);
    let mut slow = command()
        .args([
            "redrive",
            "--schema",
            s,
            "--queue",
            q,
            "--rate",
            "20",
            "--actor",
            "alice",
            "--reason",
            "ledger fix deployed",
        ])
        .kill_on_drop(true)
        .spawn()
        .expect("redrive starts");
    wait_for("the slow redrive to move some", async || {
        depths().await.work >= 5
    })
    .await;
    slow.start_kill().expect("SIGKILL");
    let _ = slow.wait().await;
    let d = depths().await;
    assert!(
        d.work > 0 && d.work < ENTRIES as u32,
        "killed midway: {d:?}"
    );
    let out = inboxctl(&[
        "redrive",
        "--schema",
        s,
        "--queue",
        q,
        "--json",
        "--actor",
        "alice",
        "--reason",
        "ledger fix deployed, second run",
    ])
    .await;
    assert!(out.status.success(), "{out:?}");
    let report = json_of(&out);
    let moved = report["actions"]["moved"].as_u64().expect("moved");
    assert_eq!(Some(moved), report["parked_at_start"].as_u64(), "{report}");
    assert_eq!(report["actions"].get("refused"), None, "{report}");
    // Nothing lost: every entry is in the work queue at least once.
    assert!(
        u64::from(d.work) + moved >= ENTRIES as u64,
        "{d:?} {report}"
    );
    assert_eq!(depths().await.parking, 0);

    // The consumer processes what was moved: every entry once.
    let (stop, task) = start(handler);
    wait_for("every entry in the ledger", async || {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(DISTINCT entry_id) FROM \"{s}\".ledger"
        )))
        .fetch_one(&pool)
        .await
        .expect("ledger count");
        n == ENTRIES as i64
    })
    .await;
    wait_for("queues drained", async || {
        let d = depths().await;
        (d.work, d.retry, d.parking) == (0, 0, 0)
    })
    .await;
    let _ = stop.send(());
    task.await.expect("consumer task").expect("consumer ran");
    let (rows, distinct): (i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT count(*), count(DISTINCT entry_id) FROM \"{s}\".ledger"
    )))
    .fetch_one(&pool)
    .await
    .expect("ledger");
    assert_eq!(
        (rows, distinct),
        (ENTRIES as i64, ENTRIES as i64),
        "each entry exactly once"
    );

    // reopen: refused for a PROCESSED row, a forced replay with --force-replay; both audited
    // only when done.
    let reopen = |force: bool| {
        let mut a = vec![
            "reopen",
            "entry-03",
            "--schema",
            s,
            "--consumer",
            CONSUMER,
            "--actor",
            "bob",
            "--reason",
            "auditor asked for a re-run",
            "--ticket",
            "CHG-9",
        ];
        if force {
            a.push("--force-replay");
        }
        a.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    assert_eq!(run(reopen(false)).await.status.code(), Some(1));
    let out = run(reopen(true)).await;
    assert!(out.status.success(), "{out:?}");
    let audit: Vec<(String, String, Option<String>)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT action, actor, ticket FROM \"{s}\".inbox_audit WHERE message_id = 'entry-03' \
         ORDER BY audit_id"
    )))
    .fetch_all(&pool)
    .await
    .expect("audit");
    assert_eq!(
        audit.last(),
        Some(&(
            "forced_replay".to_owned(),
            "bob".to_owned(),
            Some("CHG-9".to_owned())
        ))
    );
    assert!(audit.iter().any(|(a, _, _)| a == "reopen"), "{audit:?}");
    broker.close().await;
    pool.close().await;
}
