// The statuses of an inbox row, as the ledger's `status` column and the API spell them: the
// console's only list of them. A test of the admin crate checks this table against the core's
// `InboxStatus` (its names, which one is processed and which ones are parked), so the two
// cannot drift apart.

// [status, what it means for the row]
const TABLE = [
  ["PROCESSING", "in progress"],
  ["PROCESSED", "processed"],
  ["RETRYABLE_FAILED", "in progress"],
  ["PERMANENT_FAILED", "parked"],
  ["POISONED", "parked"],
  ["MANUAL_REVIEW", "parked"],
  ["HELD", "in progress"],
];

const having = (meaning) => TABLE.filter(([, m]) => m === meaning).map(([status]) => status);

/** Every status, in the core's order. */
export const STATUSES = Object.freeze(TABLE.map(([status]) => status));

/** The status of a row whose business effect committed. */
export const PROCESSED = having("processed")[0];

/** The statuses of parked rows: their copies belong in the parking lot. */
export const PARKED = Object.freeze(having("parked"));

export function isParked(status) {
  return PARKED.includes(status);
}

/**
 * The message search's status filter, as [value, label]: each value is the API's
 * comma-separated `status` parameter (empty: the open rows, or every status with an id).
 */
export const SEARCH_CHOICES = Object.freeze([
  ["", "open (any, with an id)"],
  ...having("in progress").map((status) => [status, status]),
  [PARKED.join(","), "parked"],
  ...PARKED.map((status) => [status, status]),
  [PROCESSED, PROCESSED],
  [STATUSES.join(","), "any"],
]);
