-- Every index is paid for on the hot path: each claimed row is one entry per index. The
-- overwhelming majority of rows are PROCESSED and are only ever looked up by primary key
-- (dedup) or deleted by age (retention), so the secondary indexes leave them out.

-- Rows an operator or the runtime looks for: stuck PROCESSING, failed, poisoned.
DROP INDEX idx_message_inbox_status;
CREATE INDEX idx_message_inbox_open
    ON message_inbox (consumer_name, status, first_received_at)
    WHERE status <> 'PROCESSED';

-- Retention deletes PROCESSED rows by processed_at. Rows are processed in time order, so a
-- BRIN index (a few pages, almost free to maintain) finds old ones without a full scan.
CREATE INDEX idx_message_inbox_processed_at
    ON message_inbox USING brin (processed_at);

-- Messages without an aggregate have nothing to look up by aggregate.
DROP INDEX idx_message_inbox_aggregate;
CREATE INDEX idx_message_inbox_aggregate
    ON message_inbox (aggregate_type, aggregate_id, first_received_at)
    WHERE aggregate_id IS NOT NULL;
