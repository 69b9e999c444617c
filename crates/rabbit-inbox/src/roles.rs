//! Least-privilege grants on an inbox schema, as SQL to review and run (`inboxctl grants`).
//!
//! **Invariant:** the consumer role can claim, read and update inbox rows and record its
//! recoveries, nothing more: no DELETE anywhere, no DDL. `inbox_audit` is append-only for
//! everyone (triggers refuse UPDATE, DELETE and TRUNCATE) and no role inserts into it directly:
//! each writes through the `SECURITY DEFINER` audit function of the actions it performs
//! ([`AuditWriter`]), and the row records the writer's `session_user` and the server's time.
//! No role reaches tables outside the library's list (the application's own tables in the same
//! schema are the application's to grant) nor writes the migrations ledger. Migrations run as
//! the schema's owner, never as one of these roles.

use crate::{
    ledger_sql::tables,
    schema::{MIGRATIONS_TABLE, SchemaName},
};

/// Which grants a role gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RoleKind {
    /// A consumer instance: SELECT, INSERT, UPDATE on `message_inbox` and the outbox; SELECT on
    /// `inbox_tombstone`; records its recoveries ([`AuditWriter::Recovery`]).
    Consumer,
    /// Retention (`inboxctl cleanup`, or a consumer with `retention.interval`; grant it beside
    /// [`RoleKind::Consumer`]): removes expired inbox rows, writes and expires tombstones,
    /// archives, keeps its progress marks, records its runs ([`AuditWriter::Retention`]).
    Retention,
    /// Read-only inspection (`status`, `list`, `show`, the admin server's read tokens): SELECT
    /// on the inbox tables; records the payloads it reads ([`AuditWriter::Read`]).
    Operator,
    /// Every operation (redrive, reopen, recovery, cleanup): reads and writes the inbox tables
    /// and records every action, still no DDL (that stays with the owner that migrates), no
    /// write to the audit trail but through its functions, no application table.
    Admin,
}

impl RoleKind {
    /// Every kind, in the order the documentation lists them.
    pub const ALL: [RoleKind; 4] = [
        RoleKind::Consumer,
        RoleKind::Retention,
        RoleKind::Operator,
        RoleKind::Admin,
    ];

    /// The kind's name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            RoleKind::Consumer => "consumer",
            RoleKind::Retention => "retention",
            RoleKind::Operator => "operator",
            RoleKind::Admin => "admin",
        }
    }
}

impl std::str::FromStr for RoleKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        RoleKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                format!("unknown role kind {s:?}: consumer, retention, operator or admin")
            })
    }
}

/// The audit functions of migration `0010`, one per family of actions (`SECURITY DEFINER`,
/// owned by the schema's owner; a role may call those its kind has EXECUTE on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuditWriter {
    /// `recover_republish`, `recover_manual_review`, `sequence_gap_released`,
    /// `sequence_gap_parked` (the last two from migration `0017`).
    Recovery,
    /// `cleanup`, `cleanup_forced`.
    Retention,
    /// `reopen`, `forced_replay`, `redrive`, `redrive_drop_processed`, `redrive_drop_redriven`,
    /// `replay_edited`, `discard` (migration `0013`), `skip_head` (migration `0017`).
    Operation,
    /// `payload_read`.
    Read,
}

impl AuditWriter {
    /// The function's name (unqualified).
    pub fn function(self) -> &'static str {
        match self {
            AuditWriter::Recovery => "inbox_audit_recovery",
            AuditWriter::Retention => "inbox_audit_retention",
            AuditWriter::Operation => "inbox_audit_operation",
            AuditWriter::Read => "inbox_audit_read",
        }
    }

    /// The writer that records `action`; `None` for an action no function accepts.
    pub fn for_action(action: &str) -> Option<AuditWriter> {
        Some(match action {
            "recover_republish"
            | "recover_manual_review"
            | "sequence_gap_released"
            | "sequence_gap_parked" => AuditWriter::Recovery,
            "cleanup" | "cleanup_forced" => AuditWriter::Retention,
            "reopen"
            | "forced_replay"
            | "redrive"
            | "redrive_drop_processed"
            | "redrive_drop_redriven"
            | "replay_edited"
            | "discard"
            | "skip_head" => AuditWriter::Operation,
            "payload_read" => AuditWriter::Read,
            _ => return None,
        })
    }

    /// The writers `kind` may call.
    pub fn of(kind: RoleKind) -> &'static [AuditWriter] {
        match kind {
            RoleKind::Consumer => &[AuditWriter::Recovery],
            RoleKind::Retention => &[AuditWriter::Retention],
            RoleKind::Operator => &[AuditWriter::Read],
            RoleKind::Admin => &[
                AuditWriter::Recovery,
                AuditWriter::Retention,
                AuditWriter::Operation,
                AuditWriter::Read,
            ],
        }
    }
}

/// The argument types every audit function takes: action, actor, consumer, message id, reason,
/// ticket, details.
const AUDIT_ARGS: &str = "text, text, text, text, text, text, jsonb";

/// The library's tables an operator reads (and an admin writes). Tables an application keeps
/// in the same schema are not among them.
const INBOX_TABLES: [&str; 8] = [
    tables::MESSAGE_INBOX,
    tables::INBOX_ORDER_KEY,
    tables::INBOX_EVENT,
    tables::INBOX_TOMBSTONE,
    tables::INBOX_ARCHIVE,
    tables::INBOX_RETENTION_MARK,
    tables::OUTBOX,
    tables::OUTBOX_STREAM,
];

/// Columns of the migrations ledger the doctor compares with the library's migrations.
const LEDGER_COLUMNS: &str = "version, success, checksum";

/// `name` as a quoted SQL identifier (any text is safe inside).
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The statements that give `grantee` (an existing role) the privileges of `kind` on the inbox
/// in `schema`. Run them as the schema's owner. Grants on the application's business tables
/// are the application's to add.
pub fn grant_statements(schema: &SchemaName, kind: RoleKind, grantee: &str) -> Vec<String> {
    let s = ident(schema.as_str());
    let to = ident(grantee);
    let table = |t: &str| format!("{s}.{}", ident(t));
    let mut sql = vec![format!("GRANT USAGE ON SCHEMA {s} TO {to}")];
    let mut grant = |privileges: &str, t: &str| {
        sql.push(format!("GRANT {privileges} ON {} TO {to}", table(t)));
    };
    match kind {
        RoleKind::Consumer => {
            grant("SELECT, INSERT, UPDATE", tables::MESSAGE_INBOX);
            grant("SELECT", tables::INBOX_TOMBSTONE);
            // An ordered consumer blocks, holds and releases its keys.
            grant("SELECT, INSERT, UPDATE", tables::INBOX_ORDER_KEY);
            grant("USAGE", "inbox_order_position_seq");
            // Handlers enqueue; a relay in the consumer's process claims and marks rows.
            grant("SELECT, INSERT, UPDATE", tables::OUTBOX);
            grant("USAGE", "outbox_seq_seq");
            grant("SELECT, INSERT, UPDATE", tables::OUTBOX_STREAM);
        }
        RoleKind::Retention => {
            grant("SELECT, UPDATE, DELETE", tables::MESSAGE_INBOX);
            grant("SELECT, INSERT, UPDATE, DELETE", tables::INBOX_TOMBSTONE);
            grant("INSERT", tables::INBOX_ARCHIVE);
            grant("USAGE", "inbox_archive_archive_id_seq");
            grant("SELECT, INSERT, UPDATE", tables::INBOX_RETENTION_MARK);
            // The relay's retention of sent rows.
            grant("SELECT, DELETE", tables::OUTBOX);
        }
        RoleKind::Operator => {
            for t in INBOX_TABLES.iter().chain(&[tables::INBOX_AUDIT]) {
                grant("SELECT", t);
            }
            // The doctor compares the applied migrations with the library's; nothing more.
            grant(&format!("SELECT ({LEDGER_COLUMNS})"), MIGRATIONS_TABLE);
        }
        RoleKind::Admin => {
            for t in INBOX_TABLES {
                grant("SELECT, INSERT, UPDATE, DELETE", t);
            }
            grant("SELECT", tables::INBOX_AUDIT);
            grant(&format!("SELECT ({LEDGER_COLUMNS})"), MIGRATIONS_TABLE);
            grant("USAGE", "inbox_archive_archive_id_seq");
            grant("USAGE", "outbox_seq_seq");
            grant("USAGE", "inbox_order_position_seq");
        }
    }
    for writer in AuditWriter::of(kind) {
        sql.push(format!(
            "GRANT EXECUTE ON FUNCTION {s}.{}({AUDIT_ARGS}) TO {to}",
            ident(writer.function())
        ));
    }
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_consumer_gets_no_delete_and_no_ddl() {
        let schema = SchemaName::new("svc_inbox").expect("valid");
        let sql = grant_statements(&schema, RoleKind::Consumer, "svc").join(";\n");
        assert!(sql.contains("GRANT SELECT, INSERT, UPDATE ON \"svc_inbox\".\"message_inbox\""));
        for forbidden in ["DELETE", "CREATE", "ALL PRIVILEGES", "TRUNCATE"] {
            assert!(!sql.contains(forbidden), "{forbidden} in {sql}");
        }
    }

    #[test]
    fn grantee_names_are_quoted() {
        let schema = SchemaName::new("s").expect("valid");
        let sql = grant_statements(&schema, RoleKind::Operator, "x\"; DROP TABLE y; --");
        assert!(
            sql[1].ends_with("TO \"x\"\"; DROP TABLE y; --\""),
            "{}",
            sql[1]
        );
        assert_eq!("retention".parse(), Ok(RoleKind::Retention));
        assert!("root".parse::<RoleKind>().is_err());
    }
}
