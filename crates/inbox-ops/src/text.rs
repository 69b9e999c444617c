//! The text a request carries into the inbox (an actor's name, a reason, a ticket): what
//! PostgreSQL's text type can store, within the bounds the audit trail keeps.

use crate::error::OpsError;

/// Refuses `text` if it holds a NUL character: PostgreSQL's text cannot store one, so it is
/// a wrong request (naming `what`), not a database failure.
pub fn no_nul(what: &str, text: &str) -> Result<(), OpsError> {
    if text.contains('\0') {
        return Err(OpsError::Invalid(format!(
            "the {what} contains a NUL character, which the inbox cannot store"
        )));
    }
    Ok(())
}

/// Refuses `text` unless it is storable and at most `max` characters long.
pub(crate) fn bounded(what: &str, text: &str, max: usize) -> Result<(), OpsError> {
    no_nul(what, text)?;
    let n = text.chars().count();
    if n > max {
        return Err(OpsError::Invalid(format!(
            "the {what} is {n} characters long; at most {max} are accepted"
        )));
    }
    Ok(())
}
