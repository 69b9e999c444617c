//! The user's guide, compiled against this service's dependencies: the README and the pages
//! of `docs/` that face the API, one module per page, so that every Rust example in them
//! compiles as a doctest with exactly the dependency list the README tells a service to write
//! (`scripts/package-proof.sh` runs them against the packaged crates). Read the pages on
//! GitHub or in `docs/`; links between them resolve there, not here. Examples that need a
//! broker and a database are compiled, not run.
//!
//! Compiled only for doctests: the service's binary holds no guide.

#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub mod readme {}

#[cfg(doctest)]
#[doc = include_str!("../../../docs/handlers.md")]
pub mod handlers {}

#[cfg(doctest)]
#[doc = include_str!("../../../docs/messages.md")]
pub mod messages {}

#[cfg(doctest)]
#[doc = include_str!("../../../docs/configuration.md")]
pub mod configuration {}

#[cfg(doctest)]
#[doc = include_str!("../../../docs/outbox.md")]
pub mod outbox {}

#[cfg(doctest)]
#[doc = include_str!("../../../docs/scaling.md")]
pub mod scaling {}

#[cfg(doctest)]
#[doc = include_str!("../../../docs/operations.md")]
pub mod operations {}

#[cfg(doctest)]
#[doc = include_str!("../../../docs/security.md")]
pub mod security {}

#[cfg(doctest)]
#[doc = include_str!("../../../docs/observability.md")]
pub mod observability {}

#[cfg(doctest)]
#[doc = include_str!("../../../docs/testing.md")]
pub mod testing {}
