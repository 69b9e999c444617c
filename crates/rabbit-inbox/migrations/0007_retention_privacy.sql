-- Retention (archive, progress marks) and payload encryption.

-- The keyring key that sealed `payload` (AES-256-GCM envelope); NULL: stored in clear (or no
-- payload). Adding a nullable column without a default rewrites nothing.
ALTER TABLE message_inbox ADD COLUMN payload_key_id TEXT;

-- Rows retention moved out instead of deleting them (retention mode "archive"). The whole row
-- is kept as JSON (`payload` as hex text), so columns later migrations add to the inbox reach
-- the archive without a change here. Never expired by the library: the archive is the
-- application's to keep or drop.
CREATE TABLE inbox_archive (
    archive_id        BIGSERIAL   PRIMARY KEY,
    message_id        TEXT        NOT NULL,
    consumer_name     TEXT        NOT NULL,
    message_type      TEXT        NOT NULL,
    status            TEXT        NOT NULL,
    payload_sha256    BYTEA       NOT NULL,
    first_received_at TIMESTAMPTZ NOT NULL,
    processed_at      TIMESTAMPTZ,
    archived_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    row_data          JSONB       NOT NULL
);

CREATE INDEX idx_inbox_archive_key ON inbox_archive (consumer_name, message_id);

-- How far each retention pass has got: rows older than `done_until` were handled by an
-- earlier run, so the next run scans from there instead of from the oldest block of the
-- table (the BRIN index narrows a time range, not an open-ended one, cheaply).
CREATE TABLE inbox_retention_mark (
    consumer_name TEXT        NOT NULL,
    pass          TEXT        NOT NULL,
    done_until    TIMESTAMPTZ NOT NULL,
    updated_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_name, pass)
);
