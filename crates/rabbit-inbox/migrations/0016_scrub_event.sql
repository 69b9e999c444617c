-- A message's history also says when retention scrubbed what the row held of its message (the
-- body, headers and error text of a PROCESSED row; key, metadata and hash stay), and the
-- scrub reaches the history too: the error texts of its failed attempts become '[redacted]',
-- as the row's own does (without a safe detail). Written by a trigger that fires only on
-- statements setting those columns and only when a PROCESSED row loses them, so the claim
-- that commits PROCESSED (under a policy that keeps no body for processed rows) writes
-- nothing.
ALTER TABLE inbox_event DROP CONSTRAINT inbox_event_kind_check;
-- NOT VALID: every existing row passed the narrower check, so nothing is scanned under the
-- lock; new rows are checked.
ALTER TABLE inbox_event ADD CONSTRAINT inbox_event_kind_check
    CHECK (kind IN ('failed', 'duplicate', 'conflict', 'scrubbed')) NOT VALID;

CREATE FUNCTION inbox_event_scrubbed() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    UPDATE inbox_event SET error_message = '[redacted]'
    WHERE consumer_name = NEW.consumer_name AND message_id = NEW.message_id
      AND error_message IS NOT NULL AND error_message <> '[redacted]';
    INSERT INTO inbox_event (message_id, consumer_name, kind, status)
    VALUES (NEW.message_id, NEW.consumer_name, 'scrubbed', NEW.status);
    RETURN NULL;
END
$$;

CREATE TRIGGER message_inbox_event_on_scrub
    AFTER UPDATE OF payload, headers, last_error_message, last_error_sealed ON message_inbox
    FOR EACH ROW WHEN (OLD.status = 'PROCESSED' AND NEW.status = 'PROCESSED'
                       AND NEW.payload IS NULL AND NEW.headers = '{}'::jsonb
                       AND NEW.last_error_sealed IS NULL
                       AND (OLD.payload IS NOT NULL OR OLD.headers <> '{}'::jsonb
                            OR OLD.last_error_sealed IS NOT NULL
                            OR OLD.last_error_message IS DISTINCT FROM NEW.last_error_message))
    EXECUTE FUNCTION inbox_event_scrubbed();

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION inbox_event_scrubbed() SET search_path = %I, pg_temp',
                   current_schema());
    REVOKE EXECUTE ON FUNCTION inbox_event_scrubbed() FROM PUBLIC;
END;
$$;
