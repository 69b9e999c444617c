//! `inboxctl grants`: the least-privilege grants of a role kind, as SQL to review and run.

use std::process::ExitCode;

use clap::Args;
use rabbit_inbox::roles::{RoleKind, grant_statements};

use crate::report::{InboxArgs, table};

#[derive(Args)]
pub(crate) struct GrantsArgs {
    #[command(flatten)]
    inbox: InboxArgs,
    /// Role kind: consumer, retention, operator or admin.
    #[arg(long)]
    role: RoleKind,
    /// The (existing) PostgreSQL role to grant to.
    #[arg(long)]
    grantee: String,
}

pub(crate) fn run(args: GrantsArgs) -> anyhow::Result<ExitCode> {
    let statements = grant_statements(&args.inbox.schema()?, args.role, &args.grantee);
    if args.inbox.json {
        args.inbox.print(&statements, |_| table(["sql"]))?;
    } else {
        // Plain SQL, so the output can go straight to psql.
        println!(
            "-- {} grants for {} on schema {}",
            args.role.as_str(),
            args.grantee,
            args.inbox.schema
        );
        for sql in statements {
            println!("{sql};");
        }
    }
    Ok(ExitCode::SUCCESS)
}
