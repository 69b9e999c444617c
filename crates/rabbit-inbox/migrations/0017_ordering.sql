-- Ordered processing (opt-in per consumer, see docs/ordering.md). A key's messages are held
-- behind a failed or parked head: recorded HELD with their bodies, acked, and released in
-- their order once the head is resolved. Without the policy nothing here is written.

ALTER TABLE message_inbox DROP CONSTRAINT message_inbox_status_check;
-- NOT VALID: every existing row passed the narrower check; 0018 validates it without blocking
-- writers.
ALTER TABLE message_inbox ADD CONSTRAINT message_inbox_status_check CHECK (status IN (
    'PROCESSING', 'PROCESSED', 'RETRYABLE_FAILED', 'PERMANENT_FAILED', 'POISONED',
    'MANUAL_REVIEW', 'HELD')) NOT VALID;

-- Nullable without defaults: no rewrite. Set on rows of ordered consumers that failed or
-- were held: the ordering key, the message's place in the key's order (its business sequence
-- number, or the order it was held in), and when the release task last published a copy of a
-- HELD row to the work queue.
ALTER TABLE message_inbox ADD COLUMN order_key TEXT;
ALTER TABLE message_inbox ADD COLUMN order_position BIGINT;
ALTER TABLE message_inbox ADD COLUMN released_at TIMESTAMPTZ;

-- One row per ordering key that has blocked (or, with sequence numbers, per key seen). Its
-- held messages are the HELD rows of message_inbox with its order_key.
CREATE TABLE inbox_order_key (
    consumer_name   TEXT        NOT NULL,
    order_key       TEXT        NOT NULL,
    -- The failed or parked message the key waits for; NULL while the key is not blocked.
    head_message_id TEXT,
    blocked_since   TIMESTAMPTZ,
    -- With sequence numbers: the number the key waits for next.
    next_sequence   BIGINT,
    -- With sequence numbers: since when a later number has been held for a missing one.
    gap_since       TIMESTAMPTZ,
    -- When the gap's timeout was acted on (alerted, and the policy applied).
    gap_reported_at TIMESTAMPTZ,
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, order_key)
);

-- The blocked keys: few rows of a table that can hold every key.
CREATE INDEX idx_inbox_order_key_blocked ON inbox_order_key (consumer_name, blocked_since)
    WHERE head_message_id IS NOT NULL;

-- Positions of messages held in arrival order (without sequence numbers).
CREATE SEQUENCE inbox_order_position_seq;

-- The actions this adds: an operator skips a key's head (it stays parked, the rest proceed);
-- the release task acts on a sequence gap that outlived its timeout.
CREATE OR REPLACE FUNCTION inbox_audit_operation(p_action TEXT, p_actor TEXT, p_consumer TEXT,
                                                 p_message_id TEXT, p_reason TEXT,
                                                 p_ticket TEXT, p_details JSONB)
RETURNS BIGINT
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT inbox_audit_write(ARRAY['reopen', 'forced_replay', 'redrive',
                                   'redrive_drop_processed', 'redrive_drop_redriven',
                                   'replay_edited', 'discard', 'skip_head'], p_action,
                             p_actor, p_consumer, p_message_id, p_reason, p_ticket, p_details)
$$;

CREATE OR REPLACE FUNCTION inbox_audit_recovery(p_action TEXT, p_actor TEXT, p_consumer TEXT,
                                                p_message_id TEXT, p_reason TEXT,
                                                p_ticket TEXT, p_details JSONB)
RETURNS BIGINT
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT inbox_audit_write(ARRAY['recover_republish', 'recover_manual_review',
                                   'sequence_gap_released', 'sequence_gap_parked'], p_action,
                             p_actor, p_consumer, p_message_id, p_reason, p_ticket, p_details)
$$;

DO $$
BEGIN
    EXECUTE format('ALTER FUNCTION inbox_audit_operation(text, text, text, text, text, text, '
                   'jsonb) SET search_path = %I, pg_temp', current_schema());
    EXECUTE format('ALTER FUNCTION inbox_audit_recovery(text, text, text, text, text, text, '
                   'jsonb) SET search_path = %I, pg_temp', current_schema());
END;
$$;
