-- A message's history and the operator's edit-and-replay.
--
-- inbox_event: what happened to a row between its first receipt and now that the row itself
-- keeps only the latest of: each failed attempt (its status after the failure, its error code
-- and the error text the privacy policy lets anyone read), each batch of duplicate deliveries
-- dropped against it, each conflicting body. Written by triggers, so every code path that
-- records a failure or notes a redelivery writes it in the same statement, and the hot path
-- (claims that commit PROCESSED) writes none: the UPDATE trigger fires only on statements
-- that set these columns, and the INSERT trigger's condition is false for a fresh claim.
-- Rows go with their inbox row (retention leaves the tombstone, not the history).
CREATE TABLE inbox_event (
    event_id      BIGSERIAL   PRIMARY KEY,
    message_id    TEXT        NOT NULL,
    consumer_name TEXT        NOT NULL,
    occurred_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    kind          TEXT        NOT NULL CHECK (kind IN ('failed', 'duplicate', 'conflict')),
    -- failed: the attempt number; duplicate, conflict: how many deliveries.
    attempt       INTEGER,
    deliveries    INTEGER     NOT NULL DEFAULT 1,
    status        TEXT,
    error_code    TEXT,
    error_message TEXT,
    FOREIGN KEY (message_id, consumer_name)
        REFERENCES message_inbox (message_id, consumer_name) ON DELETE CASCADE
);

CREATE INDEX idx_inbox_event_message ON inbox_event (consumer_name, message_id, occurred_at);
-- The overview's per-minute series read the last hour or day of one consumer.
CREATE INDEX idx_inbox_event_recent ON inbox_event (consumer_name, occurred_at);

-- SECURITY DEFINER: whichever role writes the row (a consumer, an admin), its history is written
-- by the schema's owner, so no role needs a grant on inbox_event beyond reading it.
CREATE FUNCTION inbox_event_record() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.last_failed_at IS DISTINCT FROM OLD.last_failed_at THEN
        INSERT INTO inbox_event (message_id, consumer_name, kind, attempt, status, error_code,
                                 error_message)
        VALUES (NEW.message_id, NEW.consumer_name, 'failed', NEW.processing_attempt,
                NEW.status, NEW.last_error_code, NEW.last_error_message);
    ELSIF NEW.delivery_count > OLD.delivery_count
          AND NOT (NEW.status = 'PROCESSING' AND NEW.processing_started_at = now()) THEN
        -- A redelivery noted against a row. Not one this transaction claimed for a new
        -- attempt (a retry's delivery is counted as a delivery too, but it is no duplicate).
        INSERT INTO inbox_event (message_id, consumer_name, kind, deliveries, status)
        VALUES (NEW.message_id, NEW.consumer_name, 'duplicate',
                NEW.delivery_count - OLD.delivery_count, NEW.status);
    END IF;
    IF TG_OP = 'UPDATE' AND NEW.payload_conflicts > OLD.payload_conflicts THEN
        INSERT INTO inbox_event (message_id, consumer_name, kind, deliveries, status)
        VALUES (NEW.message_id, NEW.consumer_name, 'conflict',
                NEW.payload_conflicts - OLD.payload_conflicts, NEW.status);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER message_inbox_event_on_insert
    AFTER INSERT ON message_inbox
    FOR EACH ROW WHEN (NEW.last_failed_at IS NOT NULL)
    EXECUTE FUNCTION inbox_event_record();

CREATE TRIGGER message_inbox_event_on_update
    AFTER UPDATE OF last_failed_at, delivery_count, payload_conflicts ON message_inbox
    FOR EACH ROW WHEN (NEW.last_failed_at IS DISTINCT FROM OLD.last_failed_at
                       OR NEW.delivery_count > OLD.delivery_count
                       OR NEW.payload_conflicts > OLD.payload_conflicts)
    EXECUTE FUNCTION inbox_event_record();

-- Edit and replay: a parked row whose body was wrong is resolved by a corrected copy published
-- under a new id. The row becomes PROCESSED (its effect is the replacement's, so a late copy
-- of it is a duplicate) and names the replacement; the replacement's row is found through the
-- partial index of migration 0014. Nullable without a default: no rewrite.
ALTER TABLE message_inbox ADD COLUMN replaced_by TEXT;

-- A discard removes a parked row's copy from the parking lot on purpose (audited); the row stays
-- parked as evidence and says when its copy went, so reconciliation does not report it lost.
ALTER TABLE message_inbox ADD COLUMN discarded_at TIMESTAMPTZ;

-- The operator actions this adds: replay of an edited body, and discarding parked copies.
CREATE OR REPLACE FUNCTION inbox_audit_operation(p_action TEXT, p_actor TEXT, p_consumer TEXT,
                                                 p_message_id TEXT, p_reason TEXT,
                                                 p_ticket TEXT, p_details JSONB)
RETURNS BIGINT
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT inbox_audit_write(ARRAY['reopen', 'forced_replay', 'redrive',
                                   'redrive_drop_processed', 'redrive_drop_redriven',
                                   'replay_edited', 'discard'], p_action,
                             p_actor, p_consumer, p_message_id, p_reason, p_ticket, p_details)
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION inbox_audit_operation(text, text, text, text, text, text, '
                   'jsonb) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION inbox_event_record() SET search_path = %I, pg_temp',
                   current_schema());
    REVOKE EXECUTE ON FUNCTION inbox_event_record() FROM PUBLIC;
END;
$$;
