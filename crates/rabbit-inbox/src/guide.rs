//! The user's guide: the README and the pages of `docs/` that face the API, one module per
//! page, so that every Rust example in them compiles as a doctest
//! (`cargo test -p rabbit-inbox --doc --all-features`). Read them on GitHub or in `docs/`;
//! links between pages resolve there, not here. Examples that need a broker and a database
//! are compiled, not run.
//!
//! Compiled only for documentation and doctests: the published library holds no guide.

#[doc = include_str!("../../../README.md")]
pub mod readme {}

#[doc = include_str!("../../../docs/handlers.md")]
pub mod handlers {}

#[doc = include_str!("../../../docs/messages.md")]
pub mod messages {}

#[doc = include_str!("../../../docs/configuration.md")]
pub mod configuration {}

#[doc = include_str!("../../../docs/outbox.md")]
pub mod outbox {}

#[doc = include_str!("../../../docs/scaling.md")]
pub mod scaling {}

#[doc = include_str!("../../../docs/operations.md")]
pub mod operations {}

#[doc = include_str!("../../../docs/security.md")]
pub mod security {}

#[doc = include_str!("../../../docs/observability.md")]
pub mod observability {}

#[doc = include_str!("../../../docs/testing.md")]
pub mod testing {}
