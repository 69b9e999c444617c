-- no-transaction
-- The held messages of a key, in order: the consumer and the release task read the first, the
-- blocked-keys view counts them. Only HELD rows are in it.
CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_message_inbox_held
    ON message_inbox (consumer_name, order_key, order_position) WHERE status = 'HELD';
