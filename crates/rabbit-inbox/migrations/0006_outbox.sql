-- The outbox: messages written in the business transaction, published by the relay after the
-- commit. Unqualified names (search_path = the configured schema). New tables only, so the
-- indexes below lock nothing in use.

CREATE TABLE outbox (
    -- Insertion order. Not commit order: the relay never reads "rows after seq N", it claims
    -- rows by status, so a transaction that commits late with a low seq is not skipped.
    seq              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id       TEXT        NOT NULL UNIQUE CHECK (length(message_id) BETWEEN 1 AND 255),
    exchange         TEXT        NOT NULL CHECK (length(exchange) <= 255),
    routing_key      TEXT        NOT NULL CHECK (length(routing_key) <= 255),
    message_type     TEXT        NOT NULL CHECK (length(message_type) BETWEEN 1 AND 255),
    message_version  INTEGER     NOT NULL DEFAULT 1,
    aggregate_type   TEXT,
    aggregate_id     TEXT,
    -- Rows with an ordering key are published one after the other, in stream_position order.
    ordering_key     TEXT        CHECK (length(ordering_key) <= 255),
    -- Taken from outbox_stream under its row lock, so it follows commit order per key.
    stream_position  BIGINT,
    correlation_id   TEXT,
    causation_id     TEXT,
    traceparent      TEXT,
    tracestate       TEXT,
    headers          JSONB       NOT NULL DEFAULT '{}'::jsonb,
    content_type     TEXT        NOT NULL DEFAULT 'application/json',
    payload          BYTEA       NOT NULL,
    status           TEXT        NOT NULL DEFAULT 'PENDING'
                                 CHECK (status IN ('PENDING', 'SENT', 'FAILED')),
    -- Failed publishes so far (returned, nacked, exchange missing); outages are not counted.
    attempts         INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The lease of the relay publishing the row; lease_epoch is its fencing token, raised by
    -- every claim and checked when the row is marked.
    lease_owner      TEXT,
    lease_epoch      BIGINT      NOT NULL DEFAULT 0,
    lease_until      TIMESTAMPTZ,
    last_error_code  TEXT,
    last_error       TEXT,
    enqueued_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    sent_at          TIMESTAMPTZ,
    CHECK ((ordering_key IS NULL) = (stream_position IS NULL)),
    UNIQUE (ordering_key, stream_position)
);

-- What the relay claims: pending rows only, so the index stays small however many are sent.
CREATE INDEX outbox_pending ON outbox (seq) WHERE status = 'PENDING';
CREATE INDEX outbox_failed ON outbox (seq) WHERE status = 'FAILED';
-- Retention of sent rows.
CREATE INDEX outbox_sent_at ON outbox USING brin (sent_at);

-- The last position handed out per ordering key. Its row lock, held by the enqueuing
-- transaction until it ends, serializes the transactions that emit for one key.
CREATE TABLE outbox_stream (
    ordering_key  TEXT   PRIMARY KEY,
    last_position BIGINT NOT NULL
);
