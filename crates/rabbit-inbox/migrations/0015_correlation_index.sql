-- no-transaction
-- Correlation ids are searched in the console: one lookup, not a scan.
CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_message_inbox_correlation
    ON message_inbox (correlation_id) WHERE correlation_id IS NOT NULL;
