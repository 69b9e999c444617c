//! Who asks for a change, and why: what every operation that changes a row or moves a message
//! takes and writes to the audit trail.

use crate::{error::OpsError, text::bounded};

/// Longest actor name accepted, in characters.
pub const MAX_ACTOR_CHARS: usize = 200;
/// Longest reason accepted, in characters: the audit trail is append-only, so what is written
/// there stays; a reason is a sentence or two, not a document.
pub const MAX_REASON_CHARS: usize = 1000;
/// Longest ticket reference accepted, in characters.
pub const MAX_TICKET_CHARS: usize = 200;

/// Who asks for a change, and why. Required by every operation that changes a row or moves a
/// message, and written to `inbox_audit`. Its name, reason and ticket are bounded
/// ([`MAX_ACTOR_CHARS`], [`MAX_REASON_CHARS`], [`MAX_TICKET_CHARS`]) whatever the front end.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Actor {
    name: String,
    reason: String,
    ticket: Option<String>,
}

impl Actor {
    /// An operator (or a token's name) with the reason for the action. Both must be non-blank
    /// and within their bounds.
    pub fn new(name: impl Into<String>, reason: impl Into<String>) -> Result<Self, OpsError> {
        let (name, reason) = (name.into(), reason.into());
        if name.trim().is_empty() {
            return Err(OpsError::Invalid("an actor name is required".into()));
        }
        if reason.trim().is_empty() {
            return Err(OpsError::Invalid("a reason is required".into()));
        }
        bounded("actor name", &name, MAX_ACTOR_CHARS)?;
        bounded("reason", &reason, MAX_REASON_CHARS)?;
        Ok(Self {
            name,
            reason,
            ticket: None,
        })
    }

    /// Cites a ticket (incident, change request) beside the reason; a blank one cites none.
    pub fn with_ticket(mut self, ticket: impl Into<String>) -> Result<Self, OpsError> {
        let ticket = ticket.into();
        bounded("ticket", &ticket, MAX_TICKET_CHARS)?;
        self.ticket = (!ticket.trim().is_empty()).then_some(ticket);
        Ok(self)
    }

    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Why the action is taken.
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The cited ticket, if any.
    pub fn ticket(&self) -> Option<&str> {
        self.ticket.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actor_needs_a_name_and_a_reason() {
        assert!(Actor::new("", "fix deployed").is_err());
        assert!(Actor::new("alice", "  ").is_err());
        let a = Actor::new("alice", "fix deployed")
            .expect("valid")
            .with_ticket("")
            .expect("no ticket");
        assert_eq!(a.ticket(), None);
        assert_eq!(
            a.with_ticket("INC-42").expect("valid ticket").ticket(),
            Some("INC-42")
        );
    }

    #[test]
    fn actor_reason_and_ticket_are_bounded() {
        let longest = "r".repeat(MAX_REASON_CHARS);
        let actor = Actor::new("alice", &longest).expect("the longest reason");
        assert!(Actor::new("alice", format!("{longest}r")).is_err());
        assert!(Actor::new("a".repeat(MAX_ACTOR_CHARS + 1), "why").is_err());
        assert!(
            actor
                .clone()
                .with_ticket("t".repeat(MAX_TICKET_CHARS))
                .is_ok()
        );
        let e = actor
            .with_ticket("t".repeat(MAX_TICKET_CHARS + 1))
            .expect_err("too long");
        assert!(e.to_string().contains("ticket"), "{e}");
    }
}
