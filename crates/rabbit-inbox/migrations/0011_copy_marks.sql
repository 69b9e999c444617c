-- Which copy of a message the broker holds for its row, so later copies are not copied again.
--
-- parked_copy_at: when the parking-lot copy of a parked row was confirmed. A later delivery
-- of the same message (same body) is then acked as a duplicate and counted in
-- parked_duplicates instead of being parked again; without the mark (the confirm never came)
-- a copy is parked again, so nothing is lost.
-- retry_copy_attempt, retry_due_at: a RETRYABLE_FAILED row whose retry-tier copy for that
-- attempt was confirmed, and when it is due back. Until then other copies are acked as
-- duplicates (retry_duplicates) instead of running early and spending the retry budget.
-- Nullable without defaults, and the counters with a constant default: no table rewrite, and
-- the hot path (claims that commit PROCESSED) writes none of them.
ALTER TABLE message_inbox
    ADD COLUMN parked_copy_at     TIMESTAMPTZ,
    ADD COLUMN parked_duplicates  INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN retry_copy_attempt INTEGER,
    ADD COLUMN retry_due_at       TIMESTAMPTZ,
    ADD COLUMN retry_duplicates   INTEGER NOT NULL DEFAULT 0;

-- A mark describes the copy of the row's current status and attempt. Any change of either
-- (a new failure, a reclaim, a reopen, recovery) voids it, whichever code path makes it, so a
-- stale mark can never make a delivery look like a duplicate of a copy that is gone.
CREATE FUNCTION message_inbox_void_copy_marks() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status IS DISTINCT FROM OLD.status
       OR NEW.processing_attempt IS DISTINCT FROM OLD.processing_attempt THEN
        NEW.parked_copy_at := NULL;
        NEW.retry_copy_attempt := NULL;
        NEW.retry_due_at := NULL;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER message_inbox_copy_marks
    BEFORE UPDATE OF status, processing_attempt ON message_inbox
    FOR EACH ROW EXECUTE FUNCTION message_inbox_void_copy_marks();
