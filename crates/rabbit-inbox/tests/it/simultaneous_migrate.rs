//! Instances that start at the same moment (a rolling deploy, a scaled-out service) migrate the
//! same fresh schema at once. Every one of them must succeed, and the schema must hold the
//! inbox once.

use std::{
    hash::{BuildHasher, RandomState},
    time::{Duration, SystemTime},
};

use inbox_testkit::DropSchemaOnDrop;
use rabbit_inbox::{SchemaName, schema::MIGRATOR, schema::SchemaLock};
use sqlx::{PgPool, postgres::PgPoolOptions};
use tokio::sync::Barrier;

/// Instances started together in each round.
const INSTANCES: usize = 6;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A schema name no other test uses.
fn fresh_schema() -> SchemaName {
    let h = RandomState::new().hash_one((SystemTime::now(), std::process::id()));
    SchemaName::new(format!("t_sim_{h:016x}")).expect("valid schema name")
}

/// A pool of its own, as a separate process would have.
async fn instance_pool() -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&database_url())
        .await
        .expect("PostgreSQL is reachable")
}

/// How many relations named `name` the schema holds.
async fn relations(pool: &PgPool, schema: &SchemaName, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = $2",
    )
    .bind(schema.as_str())
    .bind(name)
    .fetch_one(pool)
    .await
    .expect("catalog query")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn simultaneous_migrations_of_a_fresh_schema_all_succeed() {
    // Several rounds: each is a fresh schema, and one round may by chance not overlap.
    for round in 0..3 {
        let schema = fresh_schema();
        let _cleanup = DropSchemaOnDrop(schema.clone());
        let mut pools = Vec::new();
        for _ in 0..INSTANCES {
            pools.push(instance_pool().await);
        }
        // One future per instance, polled together: each runs on its own connection, so the
        // statements reach the server interleaved as from separate processes.
        let start = Barrier::new(INSTANCES);
        let results = futures::future::join_all(pools.iter().map(|pool| {
            let (start, schema) = (&start, &schema);
            async move {
                start.wait().await;
                rabbit_inbox::migrate(pool, schema).await
            }
        }))
        .await;
        let failures: Vec<String> = results
            .into_iter()
            .filter_map(|r| r.err().map(|e| e.to_string()))
            .collect();
        assert!(
            failures.is_empty(),
            "round {round}: {} of {INSTANCES} simultaneous migrations failed: {failures:?}",
            failures.len()
        );

        let pool = &pools[0];
        for table in ["message_inbox", "inbox_audit", "_rabbit_inbox_migrations"] {
            assert_eq!(relations(pool, &schema, table).await, 1, "{table}");
        }
        let applied: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM \"{schema}\"._rabbit_inbox_migrations WHERE success"
        )))
        .fetch_one(pool)
        .await
        .expect("migrations table");
        assert_eq!(applied, MIGRATOR.migrations.len() as i64);
        for pool in pools {
            pool.close().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_index_build_completes_while_other_instances_wait_for_the_schema_lock() {
    let schema = fresh_schema();
    let _cleanup = DropSchemaOnDrop(schema.clone());
    let pool = instance_pool().await;
    rabbit_inbox::migrate(&pool, &schema)
        .await
        .expect("first migration");

    let mut holder = SchemaLock::acquire(&pool, &schema)
        .await
        .expect("schema lock");
    // Other instances start meanwhile: one migrates (spawned, as a service's start-up may
    // be), the others take the lock for their own DDL.
    let mut waiters = vec![tokio::spawn({
        let schema = schema.clone();
        async move {
            let pool = instance_pool().await;
            rabbit_inbox::migrate(&pool, &schema).await
        }
    })];
    for _ in 0..3 {
        let schema = schema.clone();
        waiters.push(tokio::spawn(async move {
            let pool = instance_pool().await;
            SchemaLock::acquire(&pool, &schema).await?.release().await
        }));
    }
    // Long enough for every waiter to be connected and waiting.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "a waiter got the lock while it was held"
    );

    // What a `-- no-transaction` migration does. It waits for every transaction running when
    // it starts; a waiter blocked inside one would deadlock with it.
    let built = tokio::time::timeout(
        Duration::from_secs(20),
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE INDEX CONCURRENTLY idx_test_tenant ON \"{schema}\".message_inbox (tenant_id)"
        )))
        .execute(holder.connection()),
    )
    .await
    .expect("the index build does not hang");
    built.expect("the index build completes under the schema lock");
    holder.release().await.expect("release");

    for waiter in waiters {
        tokio::time::timeout(Duration::from_secs(20), waiter)
            .await
            .expect("every waiter gets the lock once it is released")
            .expect("waiter task")
            .expect("waiter's migration or lock");
    }
    assert_eq!(relations(&pool, &schema, "idx_test_tenant").await, 1);
    pool.close().await;
}

#[tokio::test]
async fn schema_lock_dropped_without_release_is_released_with_its_session() {
    let schema = fresh_schema();
    let _cleanup = DropSchemaOnDrop(schema.clone());
    let (first, second) = (instance_pool().await, instance_pool().await);
    let lock = SchemaLock::acquire(&first, &schema)
        .await
        .expect("schema lock");
    // An error path: the lock goes out of scope without `release`.
    drop(lock);
    let again = tokio::time::timeout(
        Duration::from_secs(10),
        SchemaLock::acquire(&second, &schema),
    )
    .await
    .expect("the lock is free again once its holder is dropped")
    .expect("schema lock");
    again.release().await.expect("release");
}
