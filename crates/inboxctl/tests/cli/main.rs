//! The operator tool's integration tests, one binary: the built `inboxctl` run as an operator
//! runs it (`migrate`, `status`, `list`, `show`, `failures`, `redrive`, `reopen`,
//! `replay-edited`, `recover`, `cleanup`, `grants`, `ordering`, `doctor`, `serve`, and the settings
//! file), against the real PostgreSQL and
//! RabbitMQ (`DATABASE_URL`, `AMQP_URL`; see the test kit) and RabbitMQ's management API. Each
//! test works in its own schema and queues, removed afterwards.

mod cleanup_cli;
mod common;
mod doctor_cli;
mod ops_commands;
mod ordering_cli;
mod read_commands;
mod recover_cli;
mod replay_cli;
mod serve_cli;
mod settings_cli;
mod simultaneous_start;
