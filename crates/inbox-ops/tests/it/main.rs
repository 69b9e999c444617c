//! The integration tests of inbox-ops, one binary, against the real PostgreSQL and RabbitMQ
//! (`DATABASE_URL`, `AMQP_URL`; see the test kit). Each test works in its own schema and
//! queues, removed afterwards.

// Reads the broker's topology through the management API.
#[cfg(feature = "management")]
mod doctor;
mod history;
mod layering;
mod ops_inspect;
mod ops_recover;
mod ops_redrive;
mod ordering_ops;
mod ordering_release;
mod replay;
mod retention;
mod service;
