//! The pattern the docs give for business tables: they live in the service's own schema, and
//! the pool's connections name it in `search_path`, so handlers write unqualified table names.
//! The inbox names its own schema in every statement, trigger and function, so such a
//! `search_path` (one that does not contain the inbox) changes nothing for the ledger.

use std::time::Duration;

use inbox_testkit::DropSchemaOnDrop;
use inbox_testkit::env::{TestEnv, message, wait_for};
use rabbit_inbox::{Handler, HandlerError, InboxMessage, InboxStatus, SchemaName};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection};

/// Writes one `deposits` row per message, naming the table unqualified; `refuse` fails
/// permanently and `later` retryably on its first attempt.
struct Deposits;

impl Handler for Deposits {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        #[derive(serde::Deserialize)]
        struct Deposit {
            account: String,
            amount: i64,
        }
        let d: Deposit = msg.decode()?;
        if d.account == "refuse" {
            return Err(HandlerError::permanent(
                "refused",
                "account refuses deposits",
            ));
        }
        if d.account == "later" && msg.attempt() == 1 {
            return Err(HandlerError::retryable("not_yet", "account not open yet"));
        }
        sqlx::query("INSERT INTO deposits (message_id, account, amount) VALUES ($1, $2, $3)")
            .bind(msg.message_id())
            .bind(&d.account)
            .bind(d.amount)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn business_tables_named_through_search_path_leave_the_ledger_untouched() {
    let env = TestEnv::new().await;
    let business = format!("{}_payments", env.schema);
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA \"{business}\";
         CREATE TABLE \"{business}\".deposits (
             message_id TEXT NOT NULL, account TEXT NOT NULL, amount BIGINT NOT NULL)"
    )))
    .execute(&env.pool)
    .await
    .expect("business schema");
    let _drop = DropSchemaOnDrop(SchemaName::new(business.clone()).expect("schema name"));
    // The service's pool: its business schema alone on the search_path (not `public`, not the
    // inbox's schema).
    let options: PgConnectOptions = inbox_testkit::database_url()
        .parse::<PgConnectOptions>()
        .expect("DATABASE_URL")
        .options([("search_path", business.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .expect("service pool");

    let config = env.config("payments", env.topology("payments"));
    let topology = config.topology.clone();
    env.declare(&config).await;
    let consumer = env.start_with_pool(pool, config, Deposits);
    let deposit = |id: &str, account: &str| {
        message(
            Some(id),
            "DepositMade",
            &json!({"account": account, "amount": 100}),
        )
    };
    for (id, account) in [
        ("d-1", "alice"),
        ("d-1", "alice"),
        ("d-2", "refuse"),
        ("d-3", "later"),
        ("d-4", "not json"),
    ] {
        let mut m = deposit(id, account);
        if account == "not json" {
            m.body = b"{ not json".to_vec();
        }
        env.publish(&topology, &m).await;
    }
    let processed = |r: &rabbit_inbox::store::InboxRecord| r.status == InboxStatus::Processed;
    env.wait_for_record("payments", "d-1", "PROCESSED", processed)
        .await;
    env.wait_for_record("payments", "d-3", "PROCESSED after a retry", processed)
        .await;
    env.wait_for_record("payments", "d-2", "PERMANENT_FAILED", |r| {
        r.status == InboxStatus::PermanentFailed
    })
    .await;
    env.wait_for_record("payments", "d-4", "PERMANENT_FAILED (invalid JSON)", |r| {
        r.status == InboxStatus::PermanentFailed
    })
    .await;
    // The duplicate of d-1 is counted on its row (the delivery history is written by the
    // inbox's triggers, which run under the service's search_path too).
    wait_for("d-1's second delivery counted", async || {
        env.record("payments", "d-1")
            .await
            .is_some_and(|r| r.delivery_count == 2)
    })
    .await;
    let stats = consumer.stop().await;
    assert_eq!(stats.duplicates, 1, "{stats:?}");

    let deposits: Vec<(String, String)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT message_id, account FROM \"{business}\".deposits ORDER BY message_id"
    )))
    .fetch_all(&env.pool)
    .await
    .expect("deposits");
    assert_eq!(
        deposits,
        [
            ("d-1".to_owned(), "alice".to_owned()),
            ("d-3".to_owned(), "later".to_owned())
        ]
    );
    let history = env
        .scalar(&format!(
            "SELECT count(*) FROM \"{}\".inbox_event WHERE message_id IN ('d-1', 'd-2', 'd-3')",
            env.schema
        ))
        .await;
    assert!(history > 0, "the inbox's triggers wrote no history");
    // Nothing of the ledger leaked into the business schema.
    let leaked = env
        .scalar(&format!(
            "SELECT count(*) FROM pg_tables WHERE schemaname = '{business}' AND tablename <> 'deposits'"
        ))
        .await;
    assert_eq!(leaked, 0);
}
