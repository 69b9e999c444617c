//! The integration tests of rabbit-inbox, one binary, against the real PostgreSQL and RabbitMQ
//! (`DATABASE_URL`, `AMQP_URL`; see the test kit). Each test works in its own schema and
//! queues, removed afterwards.

mod raw_amqp;

mod broker_hardening;
mod business_tables;
mod capture;
mod cluster;
mod copies;
mod deep_headers;
mod delivery_spans;
mod hardening;
mod health;
mod hostile_fields;
mod inbox;
mod layering;
mod lease;
mod ledger_ownership;
mod malformed;
mod metric_catalog;
#[cfg(feature = "testing")]
mod ordering;
mod outbox;
mod oversized_frames;
mod privacy;
mod public_api;
mod router;
mod session_losses;
mod simultaneous_migrate;
// The handler test kit exists only with its feature (`--all-features`, as the tests run).
#[cfg(feature = "testing")]
mod testing_kit;
mod tls;
