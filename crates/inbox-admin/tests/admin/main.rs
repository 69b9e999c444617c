//! The admin server's integration tests, one binary: the API, its exposure to a network and
//! the dashboard in headless Chromium, over a real inbox on the real PostgreSQL and RabbitMQ
//! (`DATABASE_URL`, `AMQP_URL`; see the test kit). Each test works in its own schema and
//! queues, removed afterwards, also when it fails.

mod api;
mod browser;
mod console;
mod console_api;
mod console_statuses;
mod dashboard;
mod exposure;
mod layering;
mod ordering_api;
mod prometheus;
mod response_schema;
mod util;
