//! The read commands on what an operator meets: a message that failed, was redriven and is
//! now processed (`show` tells its present, not its past), and a schema that holds no inbox
//! (every command says so instead of printing PostgreSQL's error).

use inbox_testkit::{
    env::{Rule, TestEnv, message},
    unique_suffix,
};
use rabbit_inbox::InboxStatus;
use serde_json::json;

use crate::common::inboxctl;

const CONSUMER: &str = "invoicer";

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The first cell of a table line (`│ field ┆ value │`), trimmed.
fn field(line: &str) -> Option<&str> {
    line.split(['│', '┆']).nth(1).map(str::trim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_of_a_redriven_processed_row_tells_the_failure_as_past() {
    let env = TestEnv::new().await;
    let topology = env.topology("invoices");
    let config = env.config(CONSUMER, topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("inv-7", Rule::Retryable);
    let running = env.start(config.clone(), handler);
    let invoice = message(
        Some("inv-7"),
        "InvoiceIssued",
        &json!({ "invoice": "inv-7", "amount": 42 }),
    );
    env.publish(&topology, &invoice).await;
    let poisoned = env
        .wait_for_record(CONSUMER, "inv-7", "poisoned", |r| {
            r.status == InboxStatus::Poisoned
        })
        .await;
    assert_eq!(poisoned.processing_attempt, 5);
    inbox_testkit::env::wait_for("the parked copy", async || {
        env.depths(&topology).await.parking == 1
    })
    .await;

    // The fix is deployed; the operator redrives and the consumer processes the message.
    plan.clear_id("inv-7");
    let schema = env.schema.as_str().to_owned();
    let out = inboxctl(&[
        "redrive",
        "--schema",
        &schema,
        "--queue",
        &topology.queue,
        "--actor",
        "alice",
        "--reason",
        "fix deployed",
    ])
    .await;
    assert!(out.status.success(), "{out:?}");
    env.wait_for_record(CONSUMER, "inv-7", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    running.stop().await;

    let out = inboxctl(&["show", "inv-7", "--schema", &schema, "--consumer", CONSUMER]).await;
    assert!(out.status.success(), "{out:?}");
    let shown = text(&out.stdout);
    let line = |name: &str| {
        shown
            .lines()
            .find(|l| field(l) == Some(name))
            .unwrap_or_else(|| panic!("a {name:?} line in\n{shown}"))
            .to_owned()
    };
    assert!(line("status").contains("PROCESSED"), "{shown}");
    // The failure is history, told as such; nothing reads as failing now.
    assert!(
        line("last failure before it was processed").contains("test_retryable"),
        "{shown}"
    );
    for failing in ["error code", "error"] {
        assert!(
            !shown.lines().any(|l| field(l) == Some(failing)),
            "no current {failing:?} on a PROCESSED row:\n{shown}"
        );
    }
    // Attempts as recorded: one since the redrive reopened the row, five before it.
    let attempts = line("attempts");
    assert!(
        attempts.contains("1 since") && attempts.contains("5 before"),
        "{attempts}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_commands_on_a_schema_without_an_inbox_say_so() {
    let schema = format!("t_no_inbox_{}", unique_suffix());
    for args in [
        vec!["status", "--schema", &schema],
        vec!["list", "--schema", &schema],
        vec!["show", "inv-1", "--schema", &schema],
        vec!["failures", "--schema", &schema],
        vec!["status", "--schema", &schema, "--json"],
    ] {
        let out = inboxctl(&args).await;
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(4), "{args:?}: {out:?}");
        assert!(
            stderr.contains(&format!("no inbox in schema {schema}"))
                && stderr.contains(&format!("inboxctl migrate --schema {schema}"))
                && stderr.contains("INBOX_SCHEMA"),
            "{args:?}: {stderr}"
        );
        assert!(
            !stderr.contains("relation") && !stderr.contains("does not exist"),
            "no raw SQL error: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{args:?}: {}", text(&out.stdout));
    }
}
