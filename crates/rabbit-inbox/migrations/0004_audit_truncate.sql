-- inbox_audit is append-only: the row trigger of 0001 refuses UPDATE and DELETE, but TRUNCATE
-- fires no row triggers. A statement trigger closes that gap.
CREATE TRIGGER inbox_audit_no_truncate
    BEFORE TRUNCATE ON inbox_audit
    FOR EACH STATEMENT EXECUTE FUNCTION inbox_audit_is_append_only();
