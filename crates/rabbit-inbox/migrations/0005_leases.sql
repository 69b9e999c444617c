-- Leased processing and recovery of stale and lost messages.
--
-- A leased claim commits the row as PROCESSING with an owner, an expiry the owner's heartbeat
-- extends, and a fencing token that grows by one on every (re)claim of the row: completion and
-- the effects written through the lease commit only while the token is still the row's.
-- Nullable, without defaults: the transactional hot path writes none of these columns and pays
-- nothing for them (a NULL costs a bit in the row's null bitmap).
ALTER TABLE message_inbox
    ADD COLUMN lease_owner       TEXT,
    ADD COLUMN lease_expires_at  TIMESTAMPTZ,
    ADD COLUMN fencing_token     BIGINT,
    -- When recovery last republished the row or moved it aside: a republished copy gets a full
    -- retry window before the row counts as lost again.
    ADD COLUMN last_recovered_at TIMESTAMPTZ;

-- MANUAL_REVIEW: recovery found the row stale or its retry lost and set it aside for an
-- operator (policy manual-review, or no payload kept to republish). Its copies are parked.
-- The new check is a superset of the old one, so it is added NOT VALID (no scan under this
-- migration's lock) and validated by a later migration that does not block writes.
ALTER TABLE message_inbox DROP CONSTRAINT message_inbox_status_check;
ALTER TABLE message_inbox ADD CONSTRAINT message_inbox_status_check CHECK (status IN (
    'PROCESSING', 'PROCESSED', 'RETRYABLE_FAILED', 'PERMANENT_FAILED', 'POISONED',
    'MANUAL_REVIEW')) NOT VALID;
