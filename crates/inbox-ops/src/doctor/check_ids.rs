//! Identifiers of the checks, stable for scripts and tests.

/// Every library migration applied, none unknown or failed.
pub const MIGRATIONS: &str = "schema.migrations";
/// `message_inbox` (and `inbox_tombstone`) keyed by `(message_id, consumer_name)`.
pub const PRIMARY_KEY: &str = "schema.primary_key";
/// The indexes the migrations create are present and valid.
pub const INDEXES: &str = "schema.indexes";
/// The status check constraint is present, complete and validated.
pub const STATUS_CHECK: &str = "schema.status_check";
/// The topology could not be read (no management API, no queue given).
pub const TOPOLOGY: &str = "broker.topology";
/// The work queue and its dead-letter route.
pub const WORK_QUEUE: &str = "broker.work_queue";
/// The retry tiers: TTL and dead-letter route back.
pub const RETRY_TIERS: &str = "broker.retry_tiers";
/// The parking lot.
pub const PARKING_LOT: &str = "broker.parking_lot";
/// The dedup window against the redelivery horizon.
pub const RETENTION_WINDOW: &str = "retention.window";
/// PROCESSING rows whose lease expired or that went stale.
pub const STALE_PROCESSING: &str = "recovery.stale_processing";
/// RETRYABLE_FAILED rows whose retry copy never came back.
pub const LOST_RETRIES: &str = "recovery.lost_retries";
/// The parking lot could not be read.
pub const PARKING_LOT_READ: &str = "reconciliation.parking_lot";
/// Parked copies the inbox has neither a row nor a tombstone for.
pub const PARKED_WITHOUT_ROW: &str = "reconciliation.parked_without_row";
/// Parked rows without their copy in the parking lot.
pub const ROW_WITHOUT_COPY: &str = "reconciliation.row_without_copy";
/// Copies of PROCESSED messages in the parking lot (payload conflicts aside).
pub const PROCESSED_IN_PARKING_LOT: &str = "reconciliation.processed_in_parking_lot";
/// Parked payload conflicts: a producer reused a message id with another body.
pub const PAYLOAD_CONFLICTS: &str = "reconciliation.payload_conflicts";
/// More copies in the parking lot than the parked rows (one each) and the payload
/// conflicts account for: duplicates parked.
pub const PARKED_COPIES: &str = "reconciliation.parked_copies";
/// Payloads kept although the storage policy says not to.
pub const PAYLOAD_STORAGE: &str = "privacy.payload_storage";
/// Payloads kept in clear although encryption is configured.
pub const PAYLOAD_ENCRYPTION: &str = "privacy.encryption";
