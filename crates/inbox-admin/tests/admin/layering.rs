//! The admin server's modules form layers that only point down: the error shape, the tokens
//! and the listener at the bottom, what the server serves and keeps above them, the helpers
//! the handlers share, then the handlers and the routes over them. The root only wires them
//! together; a module names the module that defines what it imports.

use std::path::PathBuf;

use inbox_testkit::layering::Layers;

/// Bottom to top. A module may use the ones before it, never the ones after.
const ORDER: &[&str] = &[
    // The API's error shape, the tokens, the Host check and the listener.
    "error",
    "auth",
    "host",
    "listen",
    // What the server serves, and what it keeps beside it.
    "state",
    "throttle",
    "readiness",
    "jobs",
    "prometheus",
    "depth_history",
    "server",
    // What the handlers share.
    "request",
    "redrive_body",
    // Middleware and handlers.
    "guard",
    "missing_inbox",
    "health",
    "depths",
    "api",
    "ordering",
    "console",
    "dashboard",
    // The application over all of them.
    "routes",
];

/// The console's endpoints and the API's are siblings: what both need lives below them.
const FORBIDDEN: &[(&str, &str)] = &[("console", "api"), ("console", "ordering")];

#[test]
fn modules_import_only_the_layers_below_them() {
    Layers {
        src: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src"),
        order: ORDER,
        folders: &[],
        forbidden: FORBIDDEN,
    }
    .assert_holds();
}
