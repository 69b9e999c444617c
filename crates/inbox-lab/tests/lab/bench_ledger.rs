//! `inbox-lab bench-ledger` end to end on a small scale: both layouts fill, run their four
//! phases, retention removes rows in each, the pin keeps today's deleted rows as dead tuples,
//! and the partitioned claim never puts a key in two generations. Rates are not asserted
//! (that is the benchmark's to measure, not a test's).

use std::{
    hash::{BuildHasher, RandomState},
    time::SystemTime,
};

use inbox_testkit::{amqp_url, database_url};
use tokio::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_layouts_report_their_phases_and_the_partitioned_claim_keeps_one_row_per_key() {
    let h = RandomState::new().hash_one((SystemTime::now(), std::process::id()));
    let schema = format!("t_ledger_{h:016x}");
    let out = Command::new(crate::bins::inbox_lab())
        .args(["bench-ledger", "--rows", "200000", "--phase-secs", "2"])
        .args(["--pin-secs", "3", "--schema", &schema, "--json"])
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url())
        .env_remove("RUST_LOG")
        .output()
        .await
        .expect("inbox-lab runs");
    let pool = sqlx::PgPool::connect(&database_url()).await.expect("pg");
    let left: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(&schema)
            .fetch_one(&pool)
            .await
            .expect("query");
    assert!(
        out.status.success(),
        "bench-ledger failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!left, "the scratch schema {schema} is left behind");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    let layouts = report["layouts"].as_array().expect("layouts");
    assert_eq!(layouts.len(), 2, "{report:#}");
    for layout in layouts {
        let phases = layout["phases"].as_array().expect("phases");
        let names: Vec<&str> = phases.iter().filter_map(|p| p["name"].as_str()).collect();
        assert_eq!(
            names,
            ["alone", "retention", "pinned", "after"],
            "{layout:#}"
        );
        assert!(
            phases
                .iter()
                .all(|p| p["load"]["tx_per_s"].as_f64() > Some(0.0)),
            "every phase ran the load: {layout:#}"
        );
        let removed: u64 = phases
            .iter()
            .filter_map(|p| p["rows_removed"].as_u64())
            .sum();
        assert!(removed > 0, "retention removed nothing: {layout:#}");
        assert_eq!(layout["keys_in_two_generations"], 0, "{layout:#}");
    }
    let (table, generations) = (&layouts[0], &layouts[1]);
    assert_eq!(table["layout"], "Table");
    assert_eq!(generations["layout"], "Generations");
    // Rows deleted while the snapshot is held stay dead until it ends.
    let pinned = &table["phases"][2];
    assert!(
        pinned["dead_tuples"].as_i64() >= pinned["rows_removed"].as_i64(),
        "{pinned:#}"
    );
    // The partitioned ledger dropped a generation in the pinned phase, tombstones written.
    let actions = generations["phases"][2]["actions"].to_string();
    assert!(
        actions.contains("drop g") && actions.contains("tombstones for g"),
        "{actions}"
    );
    pool.close().await;
}
