-- An audit trail nobody can forge: every row records the database role that wrote it and the
-- server's time, and each role writes only the actions it performs.

-- The login role of the session that wrote the row (`session_user`: SET ROLE does not change
-- it, and only a superuser can). NULL on rows written before this migration.
ALTER TABLE inbox_audit ADD COLUMN db_role TEXT;

-- Whatever an INSERT says, the row gets the writer's session role and the server's clock. Only
-- the table's owner (so the audit functions below, which run as the owner) and superusers may
-- insert; a direct INSERT by any other role is refused, also under grants made before.
CREATE FUNCTION inbox_audit_stamp() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_user <> (SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = TG_RELID)
       AND NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
        RAISE EXCEPTION 'inbox_audit is written through its audit functions only'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    NEW.db_role := session_user;
    NEW.occurred_at := now();
    RETURN NEW;
END;
$$;

CREATE TRIGGER inbox_audit_stamp
    BEFORE INSERT ON inbox_audit
    FOR EACH ROW EXECUTE FUNCTION inbox_audit_stamp();

-- The one insert, for the writers below; not callable by anyone else.
CREATE FUNCTION inbox_audit_write(allowed TEXT[], p_action TEXT, p_actor TEXT, p_consumer TEXT,
                                  p_message_id TEXT, p_reason TEXT, p_ticket TEXT, p_details JSONB)
RETURNS BIGINT
LANGUAGE plpgsql AS $$
DECLARE
    written BIGINT;
BEGIN
    IF p_action IS NULL OR NOT (p_action = ANY (allowed)) THEN
        RAISE EXCEPTION 'audit action % is not among %', p_action, allowed
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    INSERT INTO inbox_audit (actor, action, consumer_name, message_id, reason, ticket, details)
    VALUES (p_actor, p_action, p_consumer, p_message_id, p_reason, p_ticket,
            coalesce(p_details, '{}'::jsonb))
    RETURNING audit_id INTO written;
    RETURN written;
END;
$$;

-- One writer per family of actions; a role gets EXECUTE on the families it performs
-- (`roles::grant_statements`), so the privilege itself says which actions it may record.
-- Recovery (the consumer's timer, or an operator).
CREATE FUNCTION inbox_audit_recovery(p_action TEXT, p_actor TEXT, p_consumer TEXT,
                                     p_message_id TEXT, p_reason TEXT, p_ticket TEXT,
                                     p_details JSONB)
RETURNS BIGINT
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT inbox_audit_write(ARRAY['recover_republish', 'recover_manual_review'], p_action,
                             p_actor, p_consumer, p_message_id, p_reason, p_ticket, p_details)
$$;

-- Retention.
CREATE FUNCTION inbox_audit_retention(p_action TEXT, p_actor TEXT, p_consumer TEXT,
                                      p_message_id TEXT, p_reason TEXT, p_ticket TEXT,
                                      p_details JSONB)
RETURNS BIGINT
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT inbox_audit_write(ARRAY['cleanup', 'cleanup_forced'], p_action,
                             p_actor, p_consumer, p_message_id, p_reason, p_ticket, p_details)
$$;

-- The operator's changes (admin).
CREATE FUNCTION inbox_audit_operation(p_action TEXT, p_actor TEXT, p_consumer TEXT,
                                      p_message_id TEXT, p_reason TEXT, p_ticket TEXT,
                                      p_details JSONB)
RETURNS BIGINT
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT inbox_audit_write(ARRAY['reopen', 'forced_replay', 'redrive',
                                   'redrive_drop_processed', 'redrive_drop_redriven'], p_action,
                             p_actor, p_consumer, p_message_id, p_reason, p_ticket, p_details)
$$;

-- Reads of stored payloads (read and admin).
CREATE FUNCTION inbox_audit_read(p_action TEXT, p_actor TEXT, p_consumer TEXT,
                                 p_message_id TEXT, p_reason TEXT, p_ticket TEXT,
                                 p_details JSONB)
RETURNS BIGINT
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT inbox_audit_write(ARRAY['payload_read'], p_action,
                             p_actor, p_consumer, p_message_id, p_reason, p_ticket, p_details)
$$;

-- Functions are executable by PUBLIC unless revoked. A SECURITY DEFINER function resolves names
-- through a fixed search_path (this schema, then pg_temp last, so a caller's temporary table
-- cannot stand in for inbox_audit).
DO $$
DECLARE
    f TEXT;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'inbox_audit_write(text[], text, text, text, text, text, text, jsonb)',
        'inbox_audit_recovery(text, text, text, text, text, text, jsonb)',
        'inbox_audit_retention(text, text, text, text, text, text, jsonb)',
        'inbox_audit_operation(text, text, text, text, text, text, jsonb)',
        'inbox_audit_read(text, text, text, text, text, text, jsonb)'
    ] LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END;
$$;

-- Grants made by earlier versions of `inboxctl grants` gave the consumer and retention roles
-- INSERT on inbox_audit and the admin role every table privilege in the schema, the migrations
-- ledger included. The trigger above refuses their direct audit inserts; the ledger's write
-- privileges are taken back here (the owner's stay: it migrates).
DO $$
DECLARE
    r RECORD;
BEGIN
    FOR r IN
        SELECT DISTINCT c.relname, a.grantee
        FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
        WHERE c.relnamespace = current_schema()::regnamespace
          AND c.relname IN ('inbox_audit', '_rabbit_inbox_migrations')
          AND a.grantee <> c.relowner
          AND a.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE')
    LOOP
        EXECUTE format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON %I FROM %s', r.relname,
                       CASE WHEN r.grantee = 0 THEN 'PUBLIC'
                            ELSE quote_ident(pg_get_userbyid(r.grantee)) END);
    END LOOP;
END;
$$;

-- Error messages follow the payload's privacy policy. `last_error_message` holds only what
-- anyone who can read the inbox may see: the handler's message where the policy stores bodies
-- of its type in clear, otherwise its safe detail (`last_error_safe`) or a marker. With
-- encryption on, the message is sealed under the tenant's key (`last_error_sealed`, key id in
-- `last_error_key_id`), so shredding the tenant shreds its error texts too. Nullable columns
-- without a default: adding them rewrites nothing.
ALTER TABLE message_inbox ADD COLUMN last_error_safe TEXT;
ALTER TABLE message_inbox ADD COLUMN last_error_sealed BYTEA;
ALTER TABLE message_inbox ADD COLUMN last_error_key_id TEXT;
