-- Validates the status check of 0005 in a transaction of its own: VALIDATE CONSTRAINT takes a
-- SHARE UPDATE EXCLUSIVE lock, so consumers keep writing while the table is scanned.
ALTER TABLE message_inbox VALIDATE CONSTRAINT message_inbox_status_check;
