-- Operator actions and the evidence they rely on.

-- An operator action may cite a ticket (incident, change request) beside its reason.
ALTER TABLE inbox_audit ADD COLUMN ticket TEXT;

-- What is left of a row that retention removed: enough to recognize the message when it comes
-- back (a parking-lot replay, a forced republish), so a replay that would apply its effect a
-- second time is detected and refused without an explicit force. Small (no payload, no
-- headers), so it can be kept far longer than the row.
CREATE TABLE inbox_tombstone (
    message_id        TEXT        NOT NULL,
    consumer_name     TEXT        NOT NULL,
    payload_sha256    BYTEA       NOT NULL,
    final_status      TEXT        NOT NULL,
    message_type      TEXT        NOT NULL,
    first_received_at TIMESTAMPTZ NOT NULL,
    processed_at      TIMESTAMPTZ,
    removed_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (message_id, consumer_name)
);

-- Tombstones are themselves expired by age.
CREATE INDEX idx_inbox_tombstone_removed_at ON inbox_tombstone USING brin (removed_at);
