//! No type of the AMQP client (lapin and the crates under it) is part of the library's public
//! API, or the client's version would be ours.
//!
//! The compiler knows which types public items expose: with `-Zpublic-dependency` every
//! dependency not marked public is private, and the `exported_private_dependencies` lint
//! reports each private type named in a public signature, field, variant or trait impl
//! (`impl From<lapin::Error> for BrokerError` included). The test runs that check with the
//! installed toolchain (unstable flags allowed by `RUSTC_BOOTSTRAP`), in a target directory of its own, and fails on a report naming the
//! client. It also expects the report to name sqlx, whose connection the store's methods take
//! on purpose: a check that sees nothing would prove nothing.

use std::{path::Path, process::Command};

/// The client and the crates whose types its API is made of.
const CLIENT_CRATES: &[&str] = &["'lapin'", "'amq_protocol", "'async_rs'", "'tcp_stream'"];

#[test]
fn no_amqp_client_type_is_in_the_public_api() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let workspace = crate_dir
        .parent()
        .and_then(Path::parent)
        .expect("the crate is two levels under the workspace");
    // The flag is unstable: `RUSTC_BOOTSTRAP` lets the installed toolchain take it, so the
    // check needs no second toolchain.
    let out = Command::new(env!("CARGO"))
        .args([
            "check",
            "-Zpublic-dependency",
            "--locked",
            "-p",
            "rabbit-inbox",
            "--all-features",
            "--lib",
            "--message-format=json",
        ])
        .current_dir(workspace)
        .env(
            "CARGO_TARGET_DIR",
            workspace.join("target").join("public-api"),
        )
        .env("RUSTC_BOOTSTRAP", "1")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .output()
        .expect("cargo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the check did not build:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let reports: Vec<String> = stdout
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| {
            m["reason"] == "compiler-message"
                && m["target"]["name"] == "rabbit_inbox"
                && m["message"]["code"]["code"] == "exported_private_dependencies"
        })
        .map(|m| {
            let span = &m["message"]["spans"][0];
            format!(
                "{}:{}: {}",
                span["file_name"].as_str().unwrap_or("?"),
                span["line_start"],
                m["message"]["message"].as_str().unwrap_or("?")
            )
        })
        .collect();
    assert!(
        reports.iter().any(|r| r.contains("'sqlx")),
        "the check reported no private type at all, not even sqlx's: it does not work\n{stdout}"
    );
    let leaks: Vec<&String> = reports
        .iter()
        .filter(|r| CLIENT_CRATES.iter().any(|c| r.contains(c)))
        .collect();
    assert!(
        leaks.is_empty(),
        "AMQP client types in the public API (wrap them in a type of ours, or keep the item \
         crate-private):\n{}",
        leaks
            .iter()
            .map(|r| r.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}
