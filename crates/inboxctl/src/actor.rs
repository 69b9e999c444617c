//! Who asks for a change, and why: the arguments every mutating command takes.

use clap::Args;
use inbox_ops::Actor;

/// `--actor`, `--reason`, `--ticket`.
#[derive(Args, Clone, Debug)]
pub(crate) struct ActorArgs {
    /// Who asks for the change (written to the audit trail).
    #[arg(long, env = "INBOX_ACTOR")]
    pub(crate) actor: Option<String>,
    /// Why (written to the audit trail).
    #[arg(long)]
    pub(crate) reason: Option<String>,
    /// A ticket to cite beside the reason (incident, change request).
    #[arg(long)]
    pub(crate) ticket: Option<String>,
}

impl ActorArgs {
    /// The actor; an error naming the missing flag if there is none.
    pub(crate) fn required(&self) -> anyhow::Result<Actor> {
        let (Some(name), Some(reason)) = (&self.actor, &self.reason) else {
            anyhow::bail!("this change is audited: pass --actor <who> and --reason <why>");
        };
        let actor = Actor::new(name, reason)?;
        Ok(match &self.ticket {
            Some(t) => actor.with_ticket(t)?,
            None => actor,
        })
    }
}
