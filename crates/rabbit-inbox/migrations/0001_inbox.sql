-- The inbox ledger. Unqualified names: the migrator runs with search_path set
-- to the configured schema, so one migration serves every schema.

CREATE TABLE message_inbox (
    -- TEXT, not UUID: producers we do not control send arbitrary ids.
    message_id            TEXT        NOT NULL CHECK (length(message_id) BETWEEN 1 AND 255),
    consumer_name         TEXT        NOT NULL CHECK (length(consumer_name) BETWEEN 1 AND 255),
    message_type          TEXT        NOT NULL,
    message_version       INTEGER     NOT NULL,
    aggregate_type        TEXT,
    aggregate_id          TEXT,
    status                TEXT        NOT NULL CHECK (status IN (
                              'PROCESSING', 'PROCESSED', 'RETRYABLE_FAILED',
                              'PERMANENT_FAILED', 'POISONED')),
    processing_attempt    INTEGER     NOT NULL DEFAULT 0,
    -- Deliveries of this key seen by the consumer, duplicates included.
    delivery_count        INTEGER     NOT NULL DEFAULT 1,
    first_received_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_received_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    processing_started_at TIMESTAMPTZ,
    processed_at          TIMESTAMPTZ,
    first_failed_at       TIMESTAMPTZ,
    last_failed_at        TIMESTAMPTZ,
    -- SHA-256 of the body: a redelivery with the same id and another body is a producer bug.
    payload_sha256        BYTEA       NOT NULL,
    payload_conflicts     INTEGER     NOT NULL DEFAULT 0,
    last_conflict_sha256  BYTEA,
    last_conflict_at      TIMESTAMPTZ,
    -- Raw body, kept for failed messages by default (it may not be valid JSON or UTF-8).
    payload               BYTEA,
    headers               JSONB       NOT NULL DEFAULT '{}'::jsonb,
    last_error_code       TEXT,
    last_error_message    TEXT,
    correlation_id        TEXT,
    causation_id          TEXT,
    trace_id              TEXT,
    tenant_id             TEXT,
    PRIMARY KEY (message_id, consumer_name)
) WITH (fillfactor = 90);

CREATE INDEX idx_message_inbox_status
    ON message_inbox (consumer_name, status, first_received_at);

CREATE INDEX idx_message_inbox_aggregate
    ON message_inbox (aggregate_type, aggregate_id, first_received_at);

-- Append-only record of operator actions (replay, reopen, purge): who, when, what, why.
CREATE TABLE inbox_audit (
    audit_id      BIGSERIAL   PRIMARY KEY,
    occurred_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor         TEXT        NOT NULL,
    action        TEXT        NOT NULL,
    consumer_name TEXT,
    message_id    TEXT,
    reason        TEXT        NOT NULL,
    details       JSONB       NOT NULL DEFAULT '{}'::jsonb
);

CREATE INDEX idx_inbox_audit_message ON inbox_audit (consumer_name, message_id);

CREATE FUNCTION inbox_audit_is_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'inbox_audit is append-only';
END;
$$;

CREATE TRIGGER inbox_audit_append_only
    BEFORE UPDATE OR DELETE ON inbox_audit
    FOR EACH ROW EXECUTE FUNCTION inbox_audit_is_append_only();
