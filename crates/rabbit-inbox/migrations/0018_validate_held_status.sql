-- Validates the status check of 0017 in a transaction of its own (see 0009).
ALTER TABLE message_inbox VALIDATE CONSTRAINT message_inbox_status_check;
