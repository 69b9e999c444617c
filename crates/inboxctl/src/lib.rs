//! The pieces of `inboxctl` other command lines reuse (the unpublished `inbox-lab` binary and
//! the reliability runs): the connection flags, connecting with errors that say which server
//! failed and what to do, the Prometheus and OTLP export, and the duration syntax of the flags.
//! The operator commands themselves live in the binary.

pub mod connect;
mod servers;
pub mod settings;
pub mod telemetry;
pub mod when;

pub use servers::Servers;

/// The error and its causes, skipping causes whose text the previous message already holds.
pub fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}
