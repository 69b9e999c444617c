//! The service's business tables and the exactly-once check that reads them.

use rabbit_inbox::{SchemaName, StoreError, schema::SchemaLock};
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Row, SqlSafeStr, SqlStr};

/// Creates the business tables in `schema` (idempotent). The inbox has its own migrations.
///
/// Under the schema's [`SchemaLock`], like the inbox's: `CREATE ... IF NOT EXISTS` run by two
/// instances at once lets one of them fail.
pub async fn migrate(pool: &PgPool, schema: &SchemaName) -> Result<(), StoreError> {
    let mut lock = SchemaLock::acquire(pool, schema).await?;
    let created = create_tables(lock.connection(), schema).await;
    let released = lock.release().await;
    created?;
    released
}

async fn create_tables(conn: &mut PgConnection, schema: &SchemaName) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(format!(
        r#"
        CREATE SCHEMA IF NOT EXISTS "{schema}";
        CREATE TABLE IF NOT EXISTS "{schema}".orders (
            order_id            TEXT PRIMARY KEY,
            customer_id         TEXT NOT NULL,
            total_cents         BIGINT NOT NULL CHECK (total_cents >= 0),
            paid_cents          BIGINT NOT NULL DEFAULT 0,
            status              TEXT NOT NULL CHECK (status IN ('PLACED', 'PAID', 'CANCELLED')),
            version             INTEGER NOT NULL DEFAULT 1,
            placed_by_message   TEXT NOT NULL,
            updated_at          TIMESTAMPTZ NOT NULL DEFAULT now()
        );
        -- Deliberately no unique constraint on message_id: a double-applied payment must be
        -- visible here, not hidden by an error.
        CREATE TABLE IF NOT EXISTS "{schema}".payment_history (
            payment_id   BIGSERIAL PRIMARY KEY,
            order_id     TEXT NOT NULL REFERENCES "{schema}".orders (order_id),
            amount_cents BIGINT NOT NULL,
            message_id   TEXT NOT NULL,
            applied_at   TIMESTAMPTZ NOT NULL DEFAULT now()
        );
        CREATE INDEX IF NOT EXISTS payment_history_message ON "{schema}".payment_history (message_id);
        CREATE INDEX IF NOT EXISTS payment_history_order ON "{schema}".payment_history (order_id);
        -- Every applied message that carries a sequence number (header x-sequence), one row
        -- per application: per aggregate, the serials give the order the applications
        -- committed in (an ordered consumer applies one aggregate's messages one at a time).
        -- Deliberately no unique constraint: a number applied twice must be visible here.
        CREATE TABLE IF NOT EXISTS "{schema}".order_journal (
            serial          BIGSERIAL PRIMARY KEY,
            aggregate_id    TEXT NOT NULL,
            sequence_number BIGINT NOT NULL,
            message_id      TEXT NOT NULL,
            message_type    TEXT NOT NULL,
            applied_at      TIMESTAMPTZ NOT NULL DEFAULT now()
        );
        CREATE INDEX IF NOT EXISTS order_journal_aggregate
            ON "{schema}".order_journal (aggregate_id, serial);
        -- Failures an OrderStep is to meet, set up by whoever drives the service (the chaos
        -- run): 'retry_once' fails the step retryably until a retry tier returns it;
        -- 'refuse' fails it
        -- permanently for as long as the row exists (deleting it is the fix before a redrive).
        CREATE TABLE IF NOT EXISTS "{schema}".order_step_faults (
            order_id TEXT NOT NULL,
            step     BIGINT NOT NULL,
            fault    TEXT NOT NULL CHECK (fault IN ('retry_once', 'refuse')),
            PRIMARY KEY (order_id, step)
        );
        "#
    )))
    .execute(conn)
    .await?;
    Ok(())
}

/// A failure an `OrderStep` is to meet (table `order_step_faults`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepFault {
    /// The step fails retryably (`step_not_ready`) until a retry tier returns it (its
    /// delivery carries the broker's `x-death`): the retry applies it.
    RetryOnce,
    /// The step fails permanently (`step_refused`) for as long as the fault is set, so it is
    /// parked; clearing the fault ([`clear_step_fault`]) and redriving it applies it.
    Refuse,
}

impl StepFault {
    /// As stored in `order_step_faults.fault`.
    pub fn as_str(self) -> &'static str {
        match self {
            StepFault::RetryOnce => "retry_once",
            StepFault::Refuse => "refuse",
        }
    }

    fn parse(stored: &str) -> Option<Self> {
        match stored {
            "retry_once" => Some(StepFault::RetryOnce),
            "refuse" => Some(StepFault::Refuse),
            _ => None,
        }
    }
}

/// Sets the failure step `step` of order `order_id` is to meet (replacing any other).
pub async fn set_step_fault(
    pool: &PgPool,
    schema: &SchemaName,
    order_id: &str,
    step: i64,
    fault: StepFault,
) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".order_step_faults (order_id, step, fault) VALUES ($1, $2, $3) \
         ON CONFLICT (order_id, step) DO UPDATE SET fault = EXCLUDED.fault"
    )))
    .bind(order_id)
    .bind(step)
    .bind(fault.as_str())
    .execute(pool)
    .await?;
    Ok(())
}

/// Clears the failure of step `step` of order `order_id`: the fix an operator makes before
/// redriving a refused step. `false` when none was set.
pub async fn clear_step_fault(
    pool: &PgPool,
    schema: &SchemaName,
    order_id: &str,
    step: i64,
) -> Result<bool, sqlx::Error> {
    let deleted = sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM \"{schema}\".order_step_faults WHERE order_id = $1 AND step = $2"
    )))
    .bind(order_id)
    .bind(step)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(deleted > 0)
}

pub(crate) enum Transition {
    Applied,
    NotFound,
    Refused(String),
}

/// A payment that was applied, and whether it completed the order (PLACED -> PAID, which the
/// guarded update lets happen once per order).
pub(crate) struct Paid {
    pub(crate) completed: bool,
    pub(crate) customer_id: String,
    pub(crate) total: i64,
    pub(crate) paid: i64,
}

pub(crate) struct Tables {
    insert_order: SqlStr,
    pay: SqlStr,
    history: SqlStr,
    cancel: SqlStr,
    status: SqlStr,
    journal: SqlStr,
    step_fault: SqlStr,
}

impl Tables {
    pub(crate) fn new(schema: &SchemaName) -> Self {
        let q = |s: String| AssertSqlSafe(s).into_sql_str();
        Self {
            insert_order: q(format!(
                "INSERT INTO \"{schema}\".orders (order_id, customer_id, total_cents, status, placed_by_message) \
                 VALUES ($1, $2, $3, 'PLACED', $4) ON CONFLICT (order_id) DO NOTHING"
            )),
            // Guarded: a payment only applies to an order that can take it.
            pay: q(format!(
                "UPDATE \"{schema}\".orders SET paid_cents = paid_cents + $2, \
                   status = CASE WHEN paid_cents + $2 >= total_cents THEN 'PAID' ELSE status END, \
                   version = version + 1, updated_at = now() \
                 WHERE order_id = $1 AND status = 'PLACED' \
                 RETURNING status, customer_id, total_cents, paid_cents"
            )),
            history: q(format!(
                "INSERT INTO \"{schema}\".payment_history (order_id, amount_cents, message_id) VALUES ($1, $2, $3)"
            )),
            cancel: q(format!(
                "UPDATE \"{schema}\".orders SET status = 'CANCELLED', version = version + 1, updated_at = now() \
                 WHERE order_id = $1 AND status = 'PLACED'"
            )),
            status: q(format!(
                "SELECT status FROM \"{schema}\".orders WHERE order_id = $1"
            )),
            journal: q(format!(
                "INSERT INTO \"{schema}\".order_journal \
                   (aggregate_id, sequence_number, message_id, message_type) \
                 VALUES ($1, $2, $3, $4)"
            )),
            step_fault: q(format!(
                "SELECT fault FROM \"{schema}\".order_step_faults WHERE order_id = $1 AND step = $2"
            )),
        }
    }

    pub(crate) async fn insert_order(
        &self,
        tx: &mut PgConnection,
        order_id: &str,
        customer_id: &str,
        total: i64,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(self.insert_order.clone())
            .bind(order_id)
            .bind(customer_id)
            .bind(total)
            .bind(message_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    pub(crate) async fn add_payment(
        &self,
        tx: &mut PgConnection,
        order_id: &str,
        amount: i64,
        message_id: &str,
    ) -> Result<Result<Paid, Transition>, sqlx::Error> {
        let updated = sqlx::query(self.pay.clone())
            .bind(order_id)
            .bind(amount)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = updated else {
            return self.refusal(tx, order_id).await.map(Err);
        };
        sqlx::query(self.history.clone())
            .bind(order_id)
            .bind(amount)
            .bind(message_id)
            .execute(&mut *tx)
            .await?;
        Ok(Ok(Paid {
            completed: row.try_get::<&str, _>("status")? == "PAID",
            customer_id: row.try_get("customer_id")?,
            total: row.try_get("total_cents")?,
            paid: row.try_get("paid_cents")?,
        }))
    }

    /// Journals an applied message of aggregate `aggregate_id` with sequence number
    /// `sequence`.
    pub(crate) async fn journal(
        &self,
        tx: &mut PgConnection,
        aggregate_id: &str,
        sequence: i64,
        message_id: &str,
        message_type: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(self.journal.clone())
            .bind(aggregate_id)
            .bind(sequence)
            .bind(message_id)
            .bind(message_type)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    /// The failure step `step` of order `order_id` is to meet, if any.
    pub(crate) async fn step_fault(
        &self,
        tx: &mut PgConnection,
        order_id: &str,
        step: i64,
    ) -> Result<Option<StepFault>, sqlx::Error> {
        let stored: Option<String> = sqlx::query_scalar(self.step_fault.clone())
            .bind(order_id)
            .bind(step)
            .fetch_optional(&mut *tx)
            .await?;
        Ok(stored.as_deref().and_then(StepFault::parse))
    }

    pub(crate) async fn cancel(
        &self,
        tx: &mut PgConnection,
        order_id: &str,
    ) -> Result<Transition, sqlx::Error> {
        let updated = sqlx::query(self.cancel.clone())
            .bind(order_id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if updated == 0 {
            return self.refusal(tx, order_id).await;
        }
        Ok(Transition::Applied)
    }

    async fn refusal(
        &self,
        tx: &mut PgConnection,
        order_id: &str,
    ) -> Result<Transition, sqlx::Error> {
        let status: Option<String> = sqlx::query_scalar(self.status.clone())
            .bind(order_id)
            .fetch_optional(&mut *tx)
            .await?;
        Ok(match status {
            None => Transition::NotFound,
            // The guarded update found no PLACED row, yet one is there now: the order's
            // transaction committed between the two statements (each takes its own snapshot
            // under READ COMMITTED). It did not exist for the update, so the message is retried
            // like one that came before its order, not refused.
            Some(s) if s == "PLACED" => Transition::NotFound,
            Some(s) => Transition::Refused(s),
        })
    }
}

/// The exactly-once check, counted from the database (not from consumer counters).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verification {
    /// Inbox rows of this consumer by status.
    pub processed: i64,
    /// RETRYABLE_FAILED rows (waiting for a retry).
    pub retryable: i64,
    /// PERMANENT_FAILED + POISONED rows (parked).
    pub parked: i64,
    /// PROCESSING rows.
    pub processing: i64,
    /// Orders created.
    pub orders: i64,
    /// Payment rows.
    pub payment_rows: i64,
    /// Message ids with more than one payment row: double-applied payments.
    pub double_applied: i64,
    /// Payment rows whose message is not PROCESSED in the inbox: effects without a ledger entry.
    pub effects_without_ledger: i64,
    /// PROCESSED payment messages without a payment row: ledger entries without an effect.
    pub ledger_without_effect: i64,
    /// Orders whose paid total differs from the sum of their payment rows.
    pub paid_mismatches: i64,
    /// PAID orders.
    pub paid_orders: i64,
    /// `OrderPaid` messages in the outbox.
    pub order_paid_events: i64,
    /// PAID orders without an `OrderPaid` in the outbox: an emitted message lost.
    pub paid_without_event: i64,
    /// Orders with more than one `OrderPaid`, or one without being PAID.
    pub wrong_events: i64,
    /// Messages poisoned as `order_not_found` although their order exists: the order arrived
    /// after the message's retry budget ran out (it was held up), so the message waits in the
    /// parking lot for a redrive.
    pub poisoned_before_their_order: i64,
}

impl Verification {
    /// Every effect applied exactly once for every PROCESSED message, and only for those.
    pub fn exactly_once(&self) -> bool {
        self.double_applied == 0
            && self.effects_without_ledger == 0
            && self.ledger_without_effect == 0
            && self.paid_mismatches == 0
            && self.paid_without_event == 0
            && self.wrong_events == 0
    }
}

/// Checks the service's effects against the inbox in `schema`.
pub async fn verify(pool: &PgPool, schema: &SchemaName) -> Result<Verification, sqlx::Error> {
    let sql = format!(
        r#"
        WITH inbox AS (SELECT * FROM "{s}".message_inbox WHERE consumer_name = $1)
        SELECT
          (SELECT count(*) FROM inbox WHERE status = 'PROCESSED') AS processed,
          (SELECT count(*) FROM inbox WHERE status = 'RETRYABLE_FAILED') AS retryable,
          (SELECT count(*) FROM inbox WHERE status IN ('PERMANENT_FAILED', 'POISONED')) AS parked,
          (SELECT count(*) FROM inbox WHERE status = 'PROCESSING') AS processing,
          (SELECT count(*) FROM "{s}".orders) AS orders,
          (SELECT count(*) FROM "{s}".payment_history) AS payment_rows,
          (SELECT count(*) FROM (SELECT message_id FROM "{s}".payment_history
             GROUP BY message_id HAVING count(*) > 1) d) AS double_applied,
          (SELECT count(*) FROM "{s}".payment_history p WHERE NOT EXISTS (
             SELECT 1 FROM inbox i WHERE i.message_id = p.message_id AND i.status = 'PROCESSED')
          ) AS effects_without_ledger,
          (SELECT count(*) FROM inbox i WHERE i.status = 'PROCESSED'
             AND i.message_type = 'PaymentReceived' AND NOT EXISTS (
             SELECT 1 FROM "{s}".payment_history p WHERE p.message_id = i.message_id)
          ) AS ledger_without_effect,
          (SELECT count(*) FROM "{s}".orders o
             LEFT JOIN (SELECT order_id, sum(amount_cents) AS paid FROM "{s}".payment_history
                        GROUP BY order_id) p USING (order_id)
             WHERE o.paid_cents <> coalesce(p.paid, 0)
          ) AS paid_mismatches,
          (SELECT count(*) FROM "{s}".orders WHERE status = 'PAID') AS paid_orders,
          (SELECT count(*) FROM "{s}".outbox WHERE message_type = 'OrderPaid') AS order_paid_events,
          (SELECT count(*) FROM "{s}".orders o WHERE o.status = 'PAID' AND NOT EXISTS (
             SELECT 1 FROM "{s}".outbox e WHERE e.message_type = 'OrderPaid'
               AND e.aggregate_id = o.order_id)
          ) AS paid_without_event,
          (SELECT count(*) FROM (SELECT e.aggregate_id FROM "{s}".outbox e
             LEFT JOIN "{s}".orders o ON o.order_id = e.aggregate_id
             WHERE e.message_type = 'OrderPaid'
             GROUP BY e.aggregate_id
             HAVING count(*) > 1 OR bool_or(o.status IS DISTINCT FROM 'PAID')) w
          ) AS wrong_events,
          (SELECT count(*) FROM inbox i WHERE i.status = 'POISONED'
             AND i.last_error_code = 'order_not_found' AND EXISTS (
             SELECT 1 FROM "{s}".orders o WHERE o.order_id = i.aggregate_id)
          ) AS poisoned_before_their_order
        "#,
        s = schema
    );
    let row = sqlx::query(AssertSqlSafe(sql))
        .bind(crate::CONSUMER_NAME)
        .fetch_one(pool)
        .await?;
    Ok(Verification {
        processed: row.try_get("processed")?,
        retryable: row.try_get("retryable")?,
        parked: row.try_get("parked")?,
        processing: row.try_get("processing")?,
        orders: row.try_get("orders")?,
        payment_rows: row.try_get("payment_rows")?,
        double_applied: row.try_get("double_applied")?,
        effects_without_ledger: row.try_get("effects_without_ledger")?,
        ledger_without_effect: row.try_get("ledger_without_effect")?,
        paid_mismatches: row.try_get("paid_mismatches")?,
        paid_orders: row.try_get("paid_orders")?,
        order_paid_events: row.try_get("order_paid_events")?,
        paid_without_event: row.try_get("paid_without_event")?,
        wrong_events: row.try_get("wrong_events")?,
        poisoned_before_their_order: row.try_get("poisoned_before_their_order")?,
    })
}
