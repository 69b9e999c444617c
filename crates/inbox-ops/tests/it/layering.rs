//! The operator crate's modules form layers that only point down: the vocabulary every
//! operation speaks at the bottom, then the operations, each above what it builds on, then
//! the doctor (which runs their dry runs) and the service builder. The root only re-exports;
//! a module names the module that defines what it imports.

use std::path::PathBuf;

use inbox_testkit::layering::Layers;

/// Bottom to top. A module may use the ones before it, never the ones after.
const ORDER: &[&str] = &[
    // The vocabulary: errors, the text a request carries, who asks, progress, the handle.
    "error",
    "text",
    "actor",
    "progress",
    "fault",
    "operations",
    "sql",
    // The audit trail, which every change writes and the reads show.
    "audit",
    // Reads.
    "activity",
    "history",
    "alerts",
    "inspect",
    // Actions: reopen is the step a redrive takes per row; replay republishes as recovery does,
    // and so does the release of held messages.
    "reopen",
    "redrive",
    "recover",
    "release",
    "replay",
    "retention",
    // Ordered processing: the blocked keys and skipping their heads.
    "ordering",
    // The broker's management API, read by the doctor.
    "management",
    // Checks over all of the above, then the builder of a service with its background work.
    "doctor",
    "service",
];

/// The doctor's files, bottom to top: what a check is and asks, then the checks by area.
const DOCTOR: &[&str] = &[
    "check_ids",
    "check",
    "request",
    "schema",
    "retention",
    "privacy",
    "recovery",
    "reconciliation",
    "topology",
];

/// The doctor only reads: it runs the dry runs of redrive and recovery, never an operation
/// that only changes rows.
const FORBIDDEN: &[(&str, &str)] = &[
    ("doctor", "reopen"),
    ("doctor", "replay"),
    ("doctor", "retention"),
    ("doctor", "ordering"),
];

fn layers() -> Layers<'static> {
    Layers {
        src: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src"),
        order: ORDER,
        folders: &[("doctor", DOCTOR)],
        forbidden: FORBIDDEN,
    }
}

#[test]
fn modules_import_only_the_layers_below_them() {
    layers().assert_holds();
}
