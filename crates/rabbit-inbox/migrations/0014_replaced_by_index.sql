-- no-transaction
-- The replacement of an edited replay names its original through this index (one lookup).
CREATE INDEX CONCURRENTLY IF NOT EXISTS idx_message_inbox_replaced_by
    ON message_inbox (consumer_name, replaced_by) WHERE replaced_by IS NOT NULL;
