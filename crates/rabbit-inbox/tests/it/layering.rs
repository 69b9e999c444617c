//! The core's modules form layers that only point down (ARCHITECTURE.md): each module
//! imports only modules listed before it here, and inside a folder module each file only the
//! files listed before it. The lists are the architecture; an import that runs back up (into a
//! later module, or into a facade above the file: the crate root's or a folder's re-exports)
//! fails this test, naming the file and the import.

use std::path::Path;

use inbox_testkit::layering::Layers;

/// Bottom to top. A module may use the ones before it, never the ones after.
const LAYERS: &[&str] = &[
    // Leaves: errors, canonical JSON, retry budget, schema names and migrations.
    "error",
    "canonical_json",
    "json_error",
    "db_error",
    "backoff",
    "advisory_lock",
    "retry",
    "schema",
    // The state machine's vocabulary.
    "status",
    // Its words as SQL: the ledger's tables, status sets and shared conditions.
    "ledger_sql",
    // What a message is, what is kept of it, what is counted.
    "dedup",
    "roles",
    "retention",
    "envelope",
    "telemetry",
    "privacy",
    "session_loss",
    "stats",
    "health",
    // The ledger and the broker, side by side.
    "store",
    "ordering",
    "broker",
    // The outbox, then what application code implements.
    "outbox",
    "handler",
    "router",
    "config",
    // The runtime.
    "processor",
    "lease",
    "fault",
    "consumer",
    // The consumer's path without a broker, for applications' handler tests.
    "testing",
    // Beside the runtime, never inside it.
    "runner",
    "sampler",
];

/// Pairs that the order alone would allow but the architecture does not: the processor and
/// leased processing turn batches into durable outcomes without speaking to the broker (only
/// the settler acts on outcomes), background work is run beside the runtime, not by it, and
/// the test kit reports broker actions as data without a broker.
const FORBIDDEN: &[(&str, &str)] = &[
    ("processor", "broker"),
    ("lease", "broker"),
    ("consumer", "sampler"),
    ("consumer", "runner"),
    ("testing", "broker"),
];

/// The files of each folder module, bottom to top; its `mod.rs` is the facade above them.
const FOLDERS: &[(&str, &[&str])] = &[
    // What an ordered consumer orders by, the decision, the per-key rows.
    ("ordering", &["policy", "gate", "ledger"]),
    (
        "broker",
        &[
            // Addresses and how to reach them.
            "tls",
            "addresses",
            // AMQP's encodings and the queues.
            "headers",
            "frames",
            "topology",
            // What a delivery is, and what a session is told.
            "delivery",
            "settings",
            // Publishing, then what builds on it.
            "publish",
            "confirmed",
            "parking",
            // The consumer runtime's side: settling, then the session that owns the settler.
            "settle",
            "session",
        ],
    ),
    (
        "lease",
        &["sql", "config", "fencing", "handler", "processor"],
    ),
    ("outbox", &["ids", "store", "listener", "amqp", "relay"]),
    ("telemetry", &["config", "metrics", "trace", "failure_log"]),
];

#[test]
fn the_core_modules_import_only_the_layers_below_them() {
    Layers {
        src: Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        order: LAYERS,
        folders: FOLDERS,
        forbidden: FORBIDDEN,
    }
    .assert_holds();
}
