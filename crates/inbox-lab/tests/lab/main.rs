//! The lab's integration tests, one binary: the example consumer (`inbox-lab consume`) beside
//! the operator tool (`inboxctl relay`, `serve`, `status`) as separate processes, against the
//! real servers.

mod bench_ledger;
mod bench_sustained;
mod bins;
mod metrics_endpoint;
mod outbox_chain;
mod tls_cli;
