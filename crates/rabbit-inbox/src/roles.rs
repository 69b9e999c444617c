//! Least-privilege grants on an inbox schema, as SQL to review and run (`inboxctl grants`).
//!
//! **Invariant:** the consumer role can claim, read and update inbox rows and append audit
//! rows, nothing more: no DELETE anywhere, no DDL, and `inbox_audit` is append-only for
//! everyone (a trigger refuses UPDATE and DELETE). Migrations run as the schema's owner, never
//! as one of these roles.

use crate::SchemaName;

/// Which grants a role gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleKind {
    /// A consumer instance: SELECT, INSERT, UPDATE on `message_inbox`; SELECT, INSERT on
    /// `inbox_audit` (recovery writes it); SELECT on `inbox_tombstone`.
    Consumer,
    /// Retention (`inboxctl cleanup`, or a consumer with `retention.interval`; grant it beside
    /// [`RoleKind::Consumer`]): removes expired inbox rows, writes and expires tombstones,
    /// archives, keeps its progress marks.
    Retention,
    /// Read-only inspection (`status`, `list`, `show`): SELECT on every inbox table.
    Operator,
    /// Every operation (redrive, reopen, recovery, cleanup): all table privileges in the
    /// schema, still no DDL (that stays with the owner that migrates).
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
            grant("SELECT, INSERT, UPDATE", "message_inbox");
            grant("SELECT, INSERT", "inbox_audit");
            grant("USAGE", "inbox_audit_audit_id_seq");
            grant("SELECT", "inbox_tombstone");
            // Handlers enqueue; a relay in the consumer's process claims and marks rows.
            grant("SELECT, INSERT, UPDATE", "outbox");
            grant("USAGE", "outbox_seq_seq");
            grant("SELECT, INSERT, UPDATE", "outbox_stream");
        }
        RoleKind::Retention => {
            grant("SELECT, UPDATE, DELETE", "message_inbox");
            grant("SELECT, INSERT, UPDATE, DELETE", "inbox_tombstone");
            grant("INSERT", "inbox_archive");
            grant("USAGE", "inbox_archive_archive_id_seq");
            grant("SELECT, INSERT, UPDATE", "inbox_retention_mark");
            grant("INSERT", "inbox_audit");
            grant("USAGE", "inbox_audit_audit_id_seq");
            // The relay's retention of sent rows.
            grant("SELECT, DELETE", "outbox");
        }
        RoleKind::Operator => {
            sql.push(format!("GRANT SELECT ON ALL TABLES IN SCHEMA {s} TO {to}"));
        }
        RoleKind::Admin => {
            sql.push(format!(
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {to}"
            ));
            sql.push(format!(
                "GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {s} TO {to}"
            ));
        }
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
