//! Payload privacy against the real servers: per-type storage, redaction before storing,
//! encrypted payloads that round-trip through key rotation, crypto-shredding that leaves dedup
//! working, and a consumer running under its least-privilege role.

use std::{sync::Arc, time::Duration};

use inbox_ops::{NoProgress, Operations, retention::CleanupRequest};
use inbox_testkit::env::{Rule, TestEnv, database_url, message, random_hex, wait_for};
use rabbit_inbox::{
    InboxStatus, PayloadStorage, Topology,
    broker::OutgoingMessage,
    envelope::TENANT_HEADER,
    privacy::{Keyring, PayloadPrivacy, PrivacyError, REDACTED, open_payload},
    retention::RetentionPolicy,
    roles::{RoleKind, grant_statements},
};
use serde_json::json;
use sqlx::{AssertSqlSafe, postgres::PgPoolOptions};

fn tenant_message(id: &str, tenant: &str, body: serde_json::Value) -> OutgoingMessage {
    let mut m = message(Some(id), "Payment", &body);
    m.headers.insert(TENANT_HEADER.into(), json!(tenant));
    m
}

async fn stored(env: &TestEnv, consumer: &str, id: &str) -> rabbit_inbox::privacy::StoredPayload {
    let mut conn = env.pool.acquire().await.expect("connection");
    env.store
        .find_stored_payload(&mut conn, consumer, id)
        .await
        .expect("readable")
        .expect("payload kept")
}

#[tokio::test]
async fn encrypted_payloads_round_trip_across_rotation_and_shredding_keeps_dedup() {
    let env = TestEnv::new().await;
    let topology = env.topology("payments");
    let keyring = Arc::new(Keyring::new());
    keyring.add("main-1", [11; 32]).expect("key");
    keyring
        .add_tenant_key("acme", "acme-1", [22; 32])
        .expect("tenant key");
    let mut config = env.config("svc", topology.clone());
    config.payload_storage = PayloadStorage::Always;
    config.privacy = PayloadPrivacy::default().encrypt_with(keyring.clone());
    env.declare(&config).await;
    let (handler, _) = env.handler();
    let running = env.start(config, handler);

    let body = |n: i64| json!({ "card": "4111-1111", "n": n });
    env.publish(&topology, &tenant_message("z-1", "zeta", body(1)))
        .await;
    env.publish(&topology, &tenant_message("a-1", "acme", body(2)))
        .await;
    env.wait_for_record("svc", "a-1", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    env.wait_for_record("svc", "z-1", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;

    let zeta = stored(&env, "svc", "z-1").await;
    assert_eq!(zeta.key_id.as_deref(), Some("main-1"));
    assert!(
        !zeta.bytes.windows(4).any(|w| w == b"4111"),
        "stored encrypted"
    );
    let opened = open_payload(Some(&keyring), &zeta, "svc", "z-1").expect("opens");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&opened).expect("json"),
        body(1)
    );
    assert!(matches!(
        open_payload(None, &zeta, "svc", "z-1"),
        Err(PrivacyError::NoKeyring { .. })
    ));

    // Rotation: new writes use main-2, main-1's payloads stay readable.
    keyring.add("main-2", [33; 32]).expect("key");
    keyring.activate("main-2").expect("active");
    env.publish(&topology, &tenant_message("z-2", "zeta", body(3)))
        .await;
    env.wait_for_record("svc", "z-2", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    let newer = stored(&env, "svc", "z-2").await;
    assert_eq!(newer.key_id.as_deref(), Some("main-2"));
    assert!(open_payload(Some(&keyring), &newer, "svc", "z-2").is_ok());
    assert!(open_payload(Some(&keyring), &zeta, "svc", "z-1").is_ok());

    // Shredding acme: its payload is gone for good, a duplicate is still suppressed.
    let acme = stored(&env, "svc", "a-1").await;
    assert_eq!(acme.key_id.as_deref(), Some("acme-1"));
    keyring.destroy("acme-1");
    let err = open_payload(Some(&keyring), &acme, "svc", "a-1").expect_err("shredded");
    assert!(err.to_string().contains("key destroyed"), "{err}");
    let before = running.snapshot().duplicates;
    env.publish(&topology, &tenant_message("a-1", "acme", body(2)))
        .await;
    wait_for("duplicate suppressed", async || {
        running.snapshot().duplicates > before
    })
    .await;
    assert_eq!(env.effects("a-1").await, 1, "the effect ran once");
    // A new acme message is processed, with no payload (never clear text, never another key)
    // and no headers in clear either.
    env.publish(&topology, &tenant_message("a-2", "acme", body(4)))
        .await;
    env.wait_for_record("svc", "a-2", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE message_id = 'a-2' \
             AND payload IS NULL AND payload_key_id IS NULL AND headers = '{}'::jsonb"
        )
        .await,
        1
    );
    running.stop().await;
}

#[tokio::test]
async fn storage_per_type_and_redaction_before_anything_is_stored() {
    let env = TestEnv::new().await;
    let topology = env.topology("mixed");
    let mut config = env.config("svc", topology.clone());
    config.retry.max_attempts = 1;
    config.payload_storage = PayloadStorage::FailedOnly;
    config.privacy = PayloadPrivacy::default()
        .store("Audit", PayloadStorage::Always)
        .store("Secret", PayloadStorage::Never)
        .redact("*", &["/email"])
        .redact("Card", &["/card/number"])
        .redact_headers(&["X-User-Email"]);
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_type("Card", Rule::Permanent);
    plan.for_type("Secret", Rule::Permanent);
    let running = env.start(config, handler);

    // Every message also carries a personal header and a plain one.
    let with_headers = |mut m: rabbit_inbox::broker::OutgoingMessage| {
        m.headers
            .insert("x-user-email".into(), json!("c@example.com"));
        m.headers.insert("x-source".into(), json!("web"));
        m
    };
    let card = json!({ "email": "a@example.com", "card": { "number": "4111", "exp": "12/30" } });
    env.publish(
        &topology,
        &with_headers(message(Some("c-1"), "Card", &card)),
    )
    .await;
    env.publish(
        &topology,
        &with_headers(message(Some("s-1"), "Secret", &json!({ "ssn": "123" }))),
    )
    .await;
    env.publish(
        &topology,
        &with_headers(message(
            Some("a-1"),
            "Audit",
            &json!({ "email": "b@example.com", "x": 1 }),
        )),
    )
    .await;
    env.publish(
        &topology,
        &with_headers(message(Some("p-1"), "Plain", &json!({ "x": 2 }))),
    )
    .await;
    for (id, status) in [
        ("c-1", InboxStatus::PermanentFailed),
        ("s-1", InboxStatus::PermanentFailed),
        ("a-1", InboxStatus::Processed),
        ("p-1", InboxStatus::Processed),
    ] {
        env.wait_for_record("svc", id, "settled", |r| r.status == status)
            .await;
    }
    running.stop().await;

    // Failed Card: kept, with the configured fields redacted, hash over the original body.
    let kept = stored(&env, "svc", "c-1").await;
    let doc: serde_json::Value = serde_json::from_slice(&kept.bytes).expect("json");
    assert_eq!(doc["email"], REDACTED);
    assert_eq!(doc["card"]["number"], REDACTED);
    assert_eq!(doc["card"]["exp"], "12/30");
    let record = env.record("svc", "c-1").await.expect("row");
    assert_eq!(
        record.payload_sha256,
        inbox_testkit::env::sha256(rabbit_inbox::canonical_json::canonical_json(&card).as_bytes())
    );
    // Secret: never stored, not even on failure. Plain: processed under FailedOnly, not kept.
    // Audit: always kept, redacted by the `*` rule.
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE payload IS NULL \
             AND message_id IN ('s-1', 'p-1')"
        )
        .await,
        2
    );
    let audit: serde_json::Value =
        serde_json::from_slice(&stored(&env, "svc", "a-1").await.bytes).expect("json");
    assert_eq!(audit, json!({ "email": REDACTED, "x": 1 }));

    // Headers follow the body: kept (the configured names redacted) where it is kept, and
    // not at all where it is not.
    let headers = |id: &'static str| {
        let env = &env;
        async move {
            sqlx::query_scalar::<_, serde_json::Value>(sqlx::AssertSqlSafe(format!(
                "SELECT headers FROM \"{}\".message_inbox WHERE consumer_name = 'svc' \
                 AND message_id = $1",
                env.schema
            )))
            .bind(id)
            .fetch_one(&env.pool)
            .await
            .expect("row")
        }
    };
    for id in ["c-1", "a-1"] {
        let h = headers(id).await;
        assert_eq!(h["x-user-email"], REDACTED, "{id}: {h}");
        assert_eq!(h["x-source"], "web", "{id}: {h}");
    }
    for id in ["s-1", "p-1"] {
        assert_eq!(headers(id).await, json!({}), "{id}");
    }
}

/// Logs in, with up to `connections` connections, as a new role holding `kind`'s grants on
/// the test schema plus `also` (statements with `{role}` for the role's name).
async fn pool_of(
    env: &TestEnv,
    kind: RoleKind,
    also: &[&str],
    connections: u32,
) -> (TestRole, sqlx::PgPool) {
    let role = TestRole {
        name: format!("t_role_{}", random_hex()),
    };
    let mut setup = vec![format!("CREATE ROLE \"{}\" LOGIN", role.name)];
    setup.extend(grant_statements(&env.schema, kind, &role.name));
    setup.extend(also.iter().map(|sql| sql.replace("{role}", &role.name)));
    for sql in setup {
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&env.pool)
            .await
            .expect("role set up");
    }
    let options: sqlx::postgres::PgConnectOptions = database_url().parse().expect("DATABASE_URL");
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options.username(&role.name))
        .await
        .expect("the role logs in");
    (role, pool)
}

/// A LOGIN role with a random name, dropped (with its grants) when this goes away.
struct TestRole {
    name: String,
}

impl Drop for TestRole {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                let Ok(pool) = PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&database_url())
                    .await
                else {
                    eprintln!("cleanup: cannot drop role {name}");
                    return;
                };
                let sql = format!("DROP OWNED BY \"{name}\"; DROP ROLE IF EXISTS \"{name}\"");
                if let Err(e) = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&pool).await {
                    eprintln!("cleanup: dropping role {name}: {e}");
                }
            });
        })
        .join();
    }
}

#[tokio::test]
async fn the_consumer_works_under_its_least_privilege_role() {
    let env = TestEnv::new().await;
    let s = &env.schema;
    // The handler's own tables are the application's to grant.
    let handler_tables = format!(
        "GRANT SELECT, INSERT, UPDATE ON \"{s}\".effects, \"{s}\".handler_calls, \
         \"{s}\".external_ledger TO \"{{role}}\"; \
         GRANT USAGE ON ALL SEQUENCES IN SCHEMA \"{s}\" TO \"{{role}}\""
    );
    let (role, role_pool) = pool_of(&env, RoleKind::Consumer, &[&handler_tables], 6).await;

    let topology = env.topology("least");
    let config = env.config("svc", topology.clone());
    env.declare(&config).await;
    let (handler, plan) = env.handler();
    plan.for_id("retried", Rule::FailAttempts(1));
    plan.for_id("parked", Rule::Permanent);
    let running = env.start_with_pool(role_pool.clone(), config, handler);
    for i in 0..20 {
        env.publish(&topology, &inbox_testkit::env::thing(&format!("m-{i}"), i))
            .await;
    }
    env.publish(&topology, &inbox_testkit::env::thing("retried", 1))
        .await;
    env.publish(&topology, &inbox_testkit::env::thing("parked", 1))
        .await;
    env.publish(&topology, &inbox_testkit::env::thing("m-3", 3))
        .await;
    env.wait_for_record("svc", "retried", "processed after a retry", |r| {
        r.status == InboxStatus::Processed && r.processing_attempt == 2
    })
    .await;
    env.wait_for_record("svc", "parked", "parked", |r| {
        r.status == InboxStatus::PermanentFailed
    })
    .await;
    wait_for("all processed", async || {
        env.scalar("SELECT count(*) FROM {s}.message_inbox WHERE status = 'PROCESSED'")
            .await
            == 21
    })
    .await;
    wait_for("the duplicate is suppressed", async || {
        running.snapshot().duplicates == 1
    })
    .await;
    running.stop().await;
    assert_eq!(env.scalar("SELECT count(*) FROM {s}.effects").await, 21);

    // What the role may not do.
    for forbidden in [
        format!("DELETE FROM \"{s}\".message_inbox"),
        format!("DELETE FROM \"{s}\".inbox_tombstone"),
        format!("CREATE TABLE \"{s}\".sneaky (x int)"),
        format!("ALTER TABLE \"{s}\".message_inbox ADD COLUMN x int"),
        format!("UPDATE \"{s}\".inbox_audit SET actor = 'x'"),
    ] {
        let err = sqlx::raw_sql(AssertSqlSafe(forbidden.clone()))
            .execute(&role_pool)
            .await
            .expect_err("refused");
        assert!(
            err.to_string().contains("permission denied")
                || err.to_string().contains("must be owner"),
            "{forbidden}: {err}"
        );
    }

    // With the retention grants too, the same role cleans up.
    for sql in grant_statements(s, RoleKind::Retention, &role.name) {
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&env.pool)
            .await
            .expect("granted");
    }
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{s}\".message_inbox SET processed_at = processed_at - interval '40 days' \
         WHERE message_id LIKE 'm-%'"
    )))
    .execute(&env.pool)
    .await
    .expect("aged");
    let report = Operations::new(role_pool.clone(), s.clone())
        .cleanup(
            &CleanupRequest::new(
                "svc",
                RetentionPolicy::default(),
                env.config("svc", Topology::new("unused")).retry,
            ),
            &NoProgress,
        )
        .await
        .expect("cleanup under the role");
    assert_eq!(report.removed_processed, 20);
    role_pool.close().await;
}

/// Runs `sql` (with `{s}` for the schema) on `pool`: Ok, or the SQLSTATE it failed with.
async fn attempt(env: &TestEnv, pool: &sqlx::PgPool, sql: &str) -> Result<(), String> {
    let sql = sql.replace("{s}", &format!("\"{}\"", env.schema));
    match sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(e)) => Err(e.code().map(|c| c.into_owned()).unwrap_or_default()),
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn operator_and_admin_roles_can_do_what_they_are_for_and_no_more() {
    const DENIED: &str = "42501"; // insufficient_privilege
    let env = TestEnv::new().await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, last_failed_at, payload_sha256) \
         VALUES ('parked', 'svc', 'Thing', 1, 'PERMANENT_FAILED', 1, now(), '\\x00')",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("row");

    // The operator reads everything through the operations API, and changes nothing.
    let (_operator, operator) = pool_of(&env, RoleKind::Operator, &[], 2).await;
    let report = Operations::new(operator.clone(), env.schema.clone())
        .status(&inbox_ops::inspect::StatusQuery::default(), None)
        .await
        .expect("operator reads the status");
    assert!(
        report
            .lines
            .iter()
            .any(|l| l.status == InboxStatus::PermanentFailed)
    );
    for sql in [
        "SELECT count(*) FROM {s}.message_inbox",
        "SELECT count(*) FROM {s}.inbox_audit",
        "SELECT count(*) FROM {s}.inbox_tombstone",
    ] {
        assert_eq!(attempt(&env, &operator, sql).await, Ok(()), "{sql}");
    }
    for sql in [
        "UPDATE {s}.message_inbox SET status = 'RETRYABLE_FAILED'",
        "DELETE FROM {s}.message_inbox",
        "INSERT INTO {s}.inbox_audit (actor, action, consumer_name, message_id, reason) \
         VALUES ('x', 'reopen', 'svc', 'parked', 'y')",
        "CREATE TABLE {s}.mine (x int)",
    ] {
        assert_eq!(
            attempt(&env, &operator, sql).await,
            Err(DENIED.into()),
            "{sql}"
        );
    }

    // The admin runs the operations (an audited reopen here), but the audit trail stays
    // append-only and the schema's DDL stays with its owner.
    let (_admin, admin) = pool_of(&env, RoleKind::Admin, &[], 2).await;
    let actor = inbox_ops::Actor::new("alice", "fixed the handler").expect("actor");
    Operations::new(admin.clone(), env.schema.clone())
        .reopen("parked", "svc", &actor, false)
        .await
        .expect("admin reopens");
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.inbox_audit WHERE actor = 'alice'")
            .await,
        1
    );
    for sql in [
        "DELETE FROM {s}.inbox_audit",
        "UPDATE {s}.inbox_audit SET reason = 'nothing happened'",
        "TRUNCATE {s}.inbox_audit",
        "CREATE TABLE {s}.mine (x int)",
        "DROP TABLE {s}.message_inbox",
    ] {
        assert!(
            attempt(&env, &admin, sql).await.is_err(),
            "{sql} was allowed"
        );
    }
    assert_eq!(
        env.scalar("SELECT count(*) FROM {s}.inbox_audit").await,
        1,
        "the audit row survived"
    );
}

/// Calls the audit function `writer` with `action` on `pool`, as actor alice.
fn audit_call(writer: &str, action: &str) -> String {
    format!(
        "SELECT {{s}}.{writer}('{action}', 'alice', 'svc', 'm-1', 'because', NULL, '{{}}'::jsonb)"
    )
}

#[tokio::test]
async fn the_audit_trail_records_the_writing_role_and_server_time_and_refuses_forgeries() {
    const DENIED: &str = "42501"; // insufficient_privilege
    let env = TestEnv::new().await;
    let (consumer_role, consumer) = pool_of(&env, RoleKind::Consumer, &[], 2).await;
    let (retention_role, retention) = pool_of(&env, RoleKind::Retention, &[], 2).await;
    let (operator_role, operator) = pool_of(&env, RoleKind::Operator, &[], 2).await;
    let (admin_role, admin) = pool_of(&env, RoleKind::Admin, &[], 2).await;
    // A grant an older version of the grants gave (or an application adds by hand).
    let legacy_grant = format!(
        "GRANT INSERT ON \"{}\".inbox_audit TO \"{{role}}\"",
        env.schema
    );
    let (legacy_role, legacy) = pool_of(&env, RoleKind::Consumer, &[&legacy_grant], 1).await;
    let forged = "INSERT INTO {s}.inbox_audit (actor, action, consumer_name, message_id, reason, \
                  occurred_at) VALUES ('alice', 'reopen', 'svc', 'm-1', 'y', '2020-01-01')";
    for (name, pool) in [
        ("consumer", &consumer),
        ("retention", &retention),
        ("operator", &operator),
        ("admin", &admin),
        ("legacy", &legacy),
    ] {
        assert_eq!(
            attempt(&env, pool, forged).await,
            Err(DENIED.into()),
            "{name} inserted directly"
        );
    }

    // Each role records its own actions and no others: a writer it may not call, or an action
    // outside the writer's family, is refused.
    let allowed = [
        (&consumer, "inbox_audit_recovery", "recover_republish"),
        (&retention, "inbox_audit_retention", "cleanup"),
        (&operator, "inbox_audit_read", "payload_read"),
        (&admin, "inbox_audit_operation", "reopen"),
        (&admin, "inbox_audit_read", "payload_read"),
    ];
    for (pool, writer, action) in allowed {
        assert_eq!(
            attempt(&env, pool, &audit_call(writer, action)).await,
            Ok(()),
            "{writer}({action})"
        );
    }
    for (pool, writer, action) in [
        (&consumer, "inbox_audit_operation", "reopen"),
        (&consumer, "inbox_audit_recovery", "reopen"),
        (&consumer, "inbox_audit_recovery", "cleanup"),
        (&retention, "inbox_audit_operation", "forced_replay"),
        (&retention, "inbox_audit_retention", "redrive"),
        (&operator, "inbox_audit_operation", "reopen"),
        (&operator, "inbox_audit_read", "reopen"),
        (&admin, "inbox_audit_read", "cleanup"),
        (&admin, "inbox_audit_write", "reopen"),
    ] {
        let call = if writer == "inbox_audit_write" {
            "SELECT {s}.inbox_audit_write(ARRAY['reopen'], 'reopen', 'alice', 'svc', 'm-1', \
             'y', NULL, '{}'::jsonb)"
                .to_owned()
        } else {
            audit_call(writer, action)
        };
        assert_eq!(
            attempt(&env, pool, &call).await,
            Err(DENIED.into()),
            "{writer}({action}) was allowed"
        );
    }

    // Every row names the role that wrote it and carries the server's time, whatever the
    // writer passed: even the owner's direct insert cannot backdate a row.
    sqlx::raw_sql(AssertSqlSafe(
        forged.replace("{s}", &format!("\"{}\"", env.schema)),
    ))
    .execute(&env.pool)
    .await
    .expect("the owner inserts");
    let rows: Vec<(String, String, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT action, db_role, occurred_at > now() - interval '5 minutes' \
         FROM \"{}\".inbox_audit ORDER BY audit_id",
        env.schema
    )))
    .fetch_all(&env.pool)
    .await
    .expect("audit rows");
    let owner: String = sqlx::query_scalar("SELECT session_user::text")
        .fetch_one(&env.pool)
        .await
        .expect("owner");
    let expected: Vec<(String, String, bool)> = [
        ("recover_republish", &consumer_role.name),
        ("cleanup", &retention_role.name),
        ("payload_read", &operator_role.name),
        ("reopen", &admin_role.name),
        ("payload_read", &admin_role.name),
        ("reopen", &owner),
    ]
    .into_iter()
    .map(|(action, role)| (action.to_owned(), role.clone(), true))
    .collect();
    assert_eq!(rows, expected);

    // The library's writer goes through the same functions.
    let actor = inbox_ops::Actor::new("token-reader", "looked at a failure").expect("actor");
    let mut conn = operator.acquire().await.expect("connection");
    inbox_ops::audit::audit(
        &mut conn,
        &env.schema,
        &actor,
        inbox_ops::audit::PAYLOAD_READ,
        Some("svc"),
        Some("m-1"),
        json!({}),
    )
    .await
    .expect("the operator records its read");
    let refused = inbox_ops::audit::audit(
        &mut conn,
        &env.schema,
        &actor,
        inbox_ops::reopen::REOPEN,
        Some("svc"),
        Some("m-1"),
        json!({}),
    )
    .await
    .expect_err("the operator records no reopen");
    assert!(
        refused.to_string().contains("permission denied"),
        "{refused}"
    );
    drop(conn);
    drop(legacy_role);
}

#[tokio::test]
async fn operator_and_admin_reach_neither_application_tables_nor_the_migrations_ledger() {
    const DENIED: &str = "42501";
    let env = TestEnv::new().await;
    let (_operator, operator) = pool_of(&env, RoleKind::Operator, &[], 1).await;
    let (_admin, admin) = pool_of(&env, RoleKind::Admin, &[], 1).await;
    for (name, pool) in [("operator", &operator), ("admin", &admin)] {
        for sql in [
            // The application's own table in the same schema.
            "SELECT count(*) FROM {s}.effects",
            "INSERT INTO {s}.effects (message_id, consumer_name, message_type, attempt) \
             VALUES ('x', 'svc', 'T', 1)",
            // Marking a future migration as applied, or forgetting one.
            "INSERT INTO {s}._rabbit_inbox_migrations (version, description, success, \
             checksum, execution_time) VALUES (9999, 'future', true, '\\x00', 0)",
            "UPDATE {s}._rabbit_inbox_migrations SET success = false",
            "DELETE FROM {s}._rabbit_inbox_migrations",
            "SELECT description FROM {s}._rabbit_inbox_migrations",
        ] {
            assert_eq!(
                attempt(&env, pool, sql).await,
                Err(DENIED.into()),
                "{name}: {sql}"
            );
        }
        // The doctor's comparison of the applied migrations with the library's still runs.
        assert_eq!(
            attempt(
                &env,
                pool,
                "SELECT version, success, checksum FROM {s}._rabbit_inbox_migrations"
            )
            .await,
            Ok(()),
            "{name}"
        );
    }
}

const CARD: &str = "4111111111111111";

/// Fails every message the way handlers quote bodies: type `Decode` through
/// `InboxMessage::decode` (the card number where an integer belongs), the others with the card
/// number in their own message, and a safe detail when the body asks for one.
struct Quoting;

impl rabbit_inbox::Handler for Quoting {
    async fn handle(
        &self,
        msg: &rabbit_inbox::InboxMessage<'_>,
        _: &mut sqlx::PgConnection,
    ) -> Result<(), rabbit_inbox::HandlerError> {
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct Payment {
            amount: i64,
        }
        if msg.message_type() == "Decode" {
            let _: Payment = msg.decode()?;
            return Ok(());
        }
        let payload = &msg.envelope().payload;
        let error = rabbit_inbox::HandlerError::permanent(
            "card_declined",
            format!("card {} declined", payload["card"]),
        );
        Err(if payload["safe"] == true {
            error.with_safe_detail("declined by the issuer")
        } else {
            error
        })
    }
}

/// `last_error_message`, `last_error_safe`, whether a sealed message is kept, and the headers
/// column as text, of one row.
async fn error_columns(env: &TestEnv, id: &str) -> (Option<String>, Option<String>, bool, String) {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT last_error_message, last_error_safe, last_error_sealed IS NOT NULL, \
           headers::text FROM \"{}\".message_inbox WHERE consumer_name = 'svc' \
           AND message_id = $1",
        env.schema
    )))
    .bind(id)
    .fetch_one(&env.pool)
    .await
    .expect("row")
}

#[tokio::test]
async fn error_texts_never_carry_what_the_payload_policy_keeps_out() {
    let env = TestEnv::new().await;
    let topology = env.topology("errors");
    let mut config = env.config("svc", topology.clone());
    config.retry.max_attempts = 1;
    config.payload_storage = PayloadStorage::FailedOnly;
    config.privacy = PayloadPrivacy::default()
        .redact("Card", &["/card"])
        .store("Hidden", PayloadStorage::Never);
    env.declare(&config).await;
    let running = env.start(config, Quoting);
    let card = json!({ "card": CARD });
    let cases = [
        ("d-1", "Decode", json!({ "amount": CARD })),
        ("c-1", "Card", json!({ "card": CARD, "safe": true })),
        ("c-2", "Card", card.clone()),
        ("h-1", "Hidden", card.clone()),
        ("p-1", "Plain", card.clone()),
    ];
    for (id, ty, body) in &cases {
        env.publish(&topology, &message(Some(id), ty, body)).await;
    }
    for (id, _, _) in &cases {
        env.wait_for_record("svc", id, "parked", |r| {
            r.status == InboxStatus::PermanentFailed
        })
        .await;
    }
    running.stop().await;

    // A decode error names the field and the types, not the value: safe under any policy.
    let (decode, safe, sealed, _) = error_columns(&env, "d-1").await;
    let decode = decode.expect("message");
    assert!(
        decode.ends_with("Payment: at amount: invalid type: string, expected i64"),
        "{decode}"
    );
    assert_eq!(safe.as_deref(), Some(decode.as_str()));
    assert!(!sealed);
    // A type with redacted fields: the handler's free text cannot be redacted by pointer, so
    // only its safe detail, or a marker, is stored. Same for a type whose bodies are never
    // stored.
    assert_eq!(
        error_columns(&env, "c-1").await.0.as_deref(),
        Some("declined by the issuer")
    );
    assert_eq!(
        error_columns(&env, "c-2").await.0.as_deref(),
        Some(REDACTED)
    );
    assert_eq!(
        error_columns(&env, "h-1").await.0.as_deref(),
        Some(REDACTED)
    );
    // A type without rules keeps its body in clear, and the message with it.
    let plain = error_columns(&env, "p-1").await.0.expect("message");
    assert!(plain.contains(CARD), "{plain}");

    // What every reader is served: show and the failure groups.
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    for (id, _, _) in cases.iter().filter(|(id, _, _)| *id != "p-1") {
        let shown = ops
            .show(&inbox_ops::inspect::ShowQuery {
                message_id: (*id).to_owned(),
                consumer: Some("svc".into()),
                topology: None,
            })
            .await
            .expect("show");
        let text = serde_json::to_string(&shown.rows[0].last_error_message).expect("json");
        assert!(!text.contains("4111"), "{id}: {text}");
    }
    for group in ops.failure_groups(Some("svc")).await.expect("groups") {
        let sample = group.sample_error.unwrap_or_default();
        assert_eq!(
            sample.contains("4111"),
            group.message_type == "Plain",
            "{}: {sample}",
            group.message_type
        );
    }

    // Scrubbing by age takes the message with the body, and leaves the safe detail.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "UPDATE \"{}\".message_inbox SET status = 'PROCESSED', \
           processed_at = now() - interval '3 days' WHERE message_id IN ('p-1', 'c-1')",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("aged");
    let retention = RetentionPolicy {
        scrub_payload_after: Some(Duration::from_secs(86_400)),
        ..RetentionPolicy::default()
    };
    let report = ops
        .cleanup(
            &CleanupRequest::new(
                "svc",
                retention,
                env.config("svc", Topology::new("unused")).retry,
            ),
            &NoProgress,
        )
        .await
        .expect("cleanup");
    assert_eq!(report.scrubbed, 2, "{report:?}");
    assert_eq!(
        error_columns(&env, "p-1").await.0.as_deref(),
        Some(REDACTED)
    );
    assert_eq!(
        error_columns(&env, "c-1").await.0.as_deref(),
        Some("declined by the issuer")
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE last_error_message LIKE '%4111%' \
             OR payload IS NOT NULL AND message_id IN ('p-1', 'c-1')"
        )
        .await,
        0
    );
}

#[tokio::test]
async fn error_texts_and_headers_are_sealed_under_the_tenant_key_and_shredded_with_it() {
    let env = TestEnv::new().await;
    let topology = env.topology("sealed_errors");
    let keyring = Arc::new(Keyring::new());
    keyring.add("main-1", [5; 32]).expect("key");
    keyring
        .add_tenant_key("acme", "acme-1", [6; 32])
        .expect("tenant key");
    let mut config = env.config("svc", topology.clone());
    config.retry.max_attempts = 1;
    config.privacy = PayloadPrivacy::default()
        .redact_headers(&["x-api-key"])
        .encrypt_with(keyring.clone());
    env.declare(&config).await;
    let running = env.start(config, Quoting);
    for (id, body) in [
        ("c-1", json!({ "card": CARD, "safe": true })),
        ("c-2", json!({ "card": CARD })),
    ] {
        let mut m = tenant_message(id, "acme", body);
        m.kind = Some("Card".into());
        m.headers
            .insert("x-user-email".into(), json!("c@example.com"));
        m.headers.insert("x-api-key".into(), json!("k-123"));
        env.publish(&topology, &m).await;
    }
    for id in ["c-1", "c-2"] {
        env.wait_for_record("svc", id, "parked", |r| {
            r.status == InboxStatus::PermanentFailed
        })
        .await;
    }
    running.stop().await;

    // Nothing of the message in clear: the error shows its safe detail or the marker, the
    // headers column holds only the sealed object.
    let (c1, _, c1_sealed, c1_headers) = error_columns(&env, "c-1").await;
    assert_eq!(c1.as_deref(), Some("declined by the issuer"));
    assert!(c1_sealed);
    let (c2, _, c2_sealed, c2_headers) = error_columns(&env, "c-2").await;
    assert_eq!(c2.as_deref(), Some(rabbit_inbox::privacy::SEALED));
    assert!(c2_sealed);
    for headers in [&c1_headers, &c2_headers] {
        assert!(
            headers.contains(rabbit_inbox::privacy::SEALED_HEADERS),
            "{headers}"
        );
        assert!(!headers.contains("example.com"), "{headers}");
    }
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM {s}.message_inbox WHERE last_error_key_id = 'acme-1' \
             AND payload_key_id = 'acme-1'"
        )
        .await,
        2
    );

    // The keyring's holder reads all of it; without the keyring, what is in clear.
    let show = async |ops: &Operations, id: &str| {
        ops.show(&inbox_ops::inspect::ShowQuery {
            message_id: id.to_owned(),
            consumer: Some("svc".into()),
            topology: None,
        })
        .await
        .expect("show")
        .rows
        .remove(0)
    };
    let with_key =
        Operations::new(env.pool.clone(), env.schema.clone()).with_keyring(keyring.clone());
    let row = show(&with_key, "c-2").await;
    let opened = row.last_error_message.expect("message");
    assert!(opened.contains(CARD), "{opened}");
    assert_eq!(row.headers["x-user-email"], "c@example.com");
    assert_eq!(
        row.headers["x-api-key"], REDACTED,
        "redacted before sealing"
    );
    let without = Operations::new(env.pool.clone(), env.schema.clone());
    let row = show(&without, "c-2").await;
    assert_eq!(
        row.last_error_message.as_deref(),
        Some(rabbit_inbox::privacy::SEALED)
    );
    assert!(row.last_error_sealed.is_some());
    assert!(row.headers.get("x-user-email").is_none(), "{}", row.headers);

    // Shredding the tenant shreds its error texts and headers too.
    keyring.destroy("acme-1");
    let row = show(&with_key, "c-1").await;
    assert_eq!(
        row.last_error_message.as_deref(),
        Some("declined by the issuer")
    );
    assert!(
        row.last_error_sealed
            .as_deref()
            .is_some_and(|r| r.contains("key destroyed")),
        "{:?}",
        row.last_error_sealed
    );
    let headers = row.headers.to_string();
    assert!(
        !headers.contains("example.com") && headers.contains("key destroyed"),
        "{headers}"
    );

    // A row without a key id where encryption is configured is an error, never clear text.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO \"{}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, status, processing_attempt, payload_sha256, payload, headers) \
         VALUES ('clear', 'svc', 'Card', 1, 'PERMANENT_FAILED', 1, '\\x00', \
           convert_to('{{\"card\": \"{CARD}\"}}', 'UTF8'), '{{\"x-user-email\": \"d@example.com\"}}')",
        env.schema
    )))
    .execute(&env.pool)
    .await
    .expect("row in clear");
    let row = show(&with_key, "clear").await;
    let served = serde_json::to_string(&(&row.payload, &row.headers)).expect("json");
    assert!(
        !served.contains(CARD) && !served.contains("example.com"),
        "{served}"
    );
    assert!(
        served.contains("in clear although encryption is configured"),
        "{served}"
    );
}
