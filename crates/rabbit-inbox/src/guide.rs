//! The user's guide (the pages of `docs/` that face the API), here so that every example in
//! it compiles as a doctest.
