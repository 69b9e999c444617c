//! What application code implements: a [`Handler`] gets the message and the open transaction's
//! connection, and says how it went. It has no way to ack; the consumer settles deliveries only
//! after the outcome is durable.

use std::{
    any::Any,
    borrow::Cow,
    future::Future,
    panic::AssertUnwindSafe,
    sync::atomic::{AtomicU32, Ordering},
};

use futures::FutureExt;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::PgConnection;

use crate::{
    db_error::{DbErrorClass, deterministic_code},
    envelope::{Envelope, MessageTypes},
    outbox::{Enqueued, Outbox, OutboxError, OutboxMessage, child_traceparent, emitted_message_id},
    status::{DEPLOYMENT_FAULT, HANDLER_PANICKED},
};

/// A message as a handler sees it: the envelope plus the consumer's view of it.
#[derive(Debug, Clone, Copy)]
pub struct InboxMessage<'a> {
    pub(crate) envelope: &'a Envelope,
    pub(crate) consumer_name: &'a str,
    pub(crate) attempt: i32,
    pub(crate) outbox: &'a Outbox,
    /// Messages emitted so far in this run of the handler (the next one's position).
    pub(crate) emitted: &'a AtomicU32,
}

impl<'a> InboxMessage<'a> {
    /// The parsed envelope.
    pub fn envelope(&self) -> &'a Envelope {
        self.envelope
    }

    /// The dedup key.
    pub fn message_id(&self) -> &str {
        &self.envelope.message_id
    }

    /// The message type.
    pub fn message_type(&self) -> &str {
        &self.envelope.message_type
    }

    /// 1 on the first attempt, then one more per retry.
    pub fn attempt(&self) -> i32 {
        self.attempt
    }

    /// The consumer processing this message.
    pub fn consumer_name(&self) -> &str {
        self.consumer_name
    }

    /// A stable key for calls to external systems (HTTP `Idempotency-Key` and the like): the
    /// same for every delivery and retry of this message to this consumer, different across
    /// consumers. The inbox cannot make an external call atomic with the commit; the external
    /// system's idempotency can.
    pub fn idempotency_key(&self) -> String {
        let mut h = Sha256::new();
        h.update(self.consumer_name.as_bytes());
        h.update([0u8]);
        h.update(self.envelope.message_id.as_bytes());
        hex::encode(&h.finalize()[..16])
    }

    /// The outbox of the consumer's schema, writing through `tx`, the handler's transaction:
    /// what it enqueues is published after the commit that also records this message, and
    /// never if the transaction rolls back. Ids are derived from this message's key, the
    /// consumer and the position among the messages this run emits, so a replay emits the same
    /// ids (see [`MessageOutbox::enqueue`]). Emit in a deterministic order.
    pub fn outbox<'c>(&'c self, tx: &'c mut PgConnection) -> MessageOutbox<'c> {
        MessageOutbox {
            tx,
            outbox: self.outbox,
            incoming: self.envelope,
            consumer: self.consumer_name,
            position: self.emitted,
        }
    }

    /// Deserializes the JSON payload. A mismatch is a permanent error (`payload_mismatch`):
    /// retrying will not change the body. Its message names the field path, the kind of value
    /// found and what the type expected, never the value itself (nor an unknown variant or
    /// field name, nor a map key that does not look like a field name), so it is stored as
    /// safe detail whatever the privacy policy.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, HandlerError> {
        crate::json_error::decode(&self.envelope.payload).map_err(|e| {
            let text = format!("payload does not match {}: {e}", std::any::type_name::<T>());
            HandlerError::permanent("payload_mismatch", text.clone()).with_safe_detail(text)
        })
    }
}

/// Whether a failed message may succeed later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// May succeed later (a dependency is down, an entity has not arrived yet): retried through
    /// the broker's retry queue until the attempt budget is spent, then poisoned.
    Retryable,
    /// Will never succeed (invalid contract, business rule violated): parked at once.
    Permanent,
}

/// A handler's failure: its kind, a stable code and a message for operators.
///
/// The message may quote the payload, so it is stored as the payload is (see the README's
/// "Payload privacy"): in clear only where the body may be, sealed under the tenant's key when
/// encryption is on, withheld for a type with redaction rules or never-stored bodies, scrubbed
/// by retention. [`HandlerError::with_safe_detail`] adds text that is stored as it is whatever
/// the policy says, for what an operator must see without a key.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code}: {message}")]
pub struct HandlerError {
    kind: ErrorKind,
    code: Cow<'static, str>,
    message: String,
    /// Stored as it is, beside or instead of the message.
    safe_detail: Option<String>,
    /// Set when the error came from the database: how the runtime should treat it beyond
    /// `kind` (run the transaction again, requeue during an outage, find the real culprit).
    db_class: Option<DbErrorClass>,
}

impl HandlerError {
    /// A failure that may go away on retry.
    pub fn retryable(code: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Retryable,
            code: code.into(),
            message: message.into(),
            safe_detail: None,
            db_class: None,
        }
    }

    /// A failure that retrying cannot fix.
    pub fn permanent(code: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Permanent,
            code: code.into(),
            message: message.into(),
            safe_detail: None,
            db_class: None,
        }
    }

    /// The permanent failure of a handler that panicked, with the panic's message.
    pub(crate) fn panicked(panic: &(dyn Any + Send)) -> Self {
        let text = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        Self::permanent(HANDLER_PANICKED, format!("the handler panicked: {text}"))
    }

    /// Adds `detail`, stored in `last_error_message` as it is whatever the privacy policy says
    /// (the message itself follows the policy of the payload). Put there only what may be read
    /// by anyone who can read the inbox: an order number, the rule that refused the message, a
    /// field path; never a value from the payload or its headers. When the policy stores the
    /// message, the stored text is the message (include the detail in it if you want both).
    #[must_use]
    pub fn with_safe_detail(mut self, detail: impl Into<String>) -> Self {
        self.safe_detail = Some(detail.into());
        self
    }

    /// The detail stored whatever the policy, see [`HandlerError::with_safe_detail`].
    pub fn safe_detail(&self) -> Option<&str> {
        self.safe_detail.as_deref()
    }

    pub(crate) fn db_class(&self) -> Option<DbErrorClass> {
        self.db_class
    }

    /// The SQLSTATE of a deployment fault (see [`DbErrorClass::Deployment`]).
    pub(crate) fn deployment_sqlstate(&self) -> Option<&str> {
        (self.db_class == Some(DbErrorClass::Deployment))
            .then(|| self.safe_detail.as_deref()?.strip_prefix("SQLSTATE "))
            .flatten()
    }

    /// Retryable or permanent.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Stable code, stored in `last_error_code`.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// Human-readable message, stored (truncated) in `last_error_message` where the privacy
    /// policy lets the payload be stored in clear, sealed with it where it is encrypted.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// Database errors inside a handler. Deterministic ones (SQLSTATE classes 22, 23, 42, 54: bad
/// data, a violated constraint, an invalid statement, a value over a limit) are permanent: the
/// same statement fails again. A deployment fault (an undefined table, column, function, type
/// or schema, or a missing privilege) is not the message's: it is never recorded, the
/// deliveries are requeued with back-off and an ERROR is logged until the deployment is
/// fixed. The runtime treats the rest by their class, beyond `kind`:
/// deadlocks and serialization failures run the transaction again without charging an
/// attempt, an outage requeues the message without charging it, and "transaction aborted"
/// (25P02) blames whichever message's statement failed first. Anything else is retryable.
impl From<sqlx::Error> for HandlerError {
    fn from(e: sqlx::Error) -> Self {
        let class = DbErrorClass::of(&e);
        let mut error = match (&e, class) {
            (sqlx::Error::Database(db), DbErrorClass::Deterministic) => {
                let code = db
                    .code()
                    .map(|c| deterministic_code(&c))
                    .unwrap_or("db_error");
                // PostgreSQL's message may quote the value it refused; what is safe to show
                // whatever the policy is where it failed.
                let mut safe = format!("SQLSTATE {}", db.code().unwrap_or_default());
                for (what, name) in [("table", db.table()), ("constraint", db.constraint())] {
                    if let Some(name) = name {
                        safe.push_str(&format!(", {what} {name}"));
                    }
                }
                HandlerError::permanent(code, db.message().to_owned()).with_safe_detail(safe)
            }
            // Never recorded against a message: the runtime requeues it (see `DbErrorClass`).
            (sqlx::Error::Database(db), DbErrorClass::Deployment) => {
                HandlerError::retryable(DEPLOYMENT_FAULT, db.message().to_owned())
                    .with_safe_detail(format!("SQLSTATE {}", db.code().unwrap_or_default()))
            }
            _ => HandlerError::retryable("db_error", e.to_string()),
        };
        error.db_class = Some(class);
        error
    }
}

/// Application logic for one consumer.
///
/// Business writes go through `tx`, the connection of the transaction that also holds the
/// inbox row: they commit or roll back together. A handler runs once per message per
/// transaction attempt; when a batch is retried after another message failed, the rolled-back
/// work runs again in the new transaction, so handlers must keep their effects inside `tx`
/// (use [`InboxMessage::idempotency_key`] for anything outside).
pub trait Handler: Send + Sync + 'static {
    /// Applies `msg`'s business effect inside the open transaction.
    fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Refuses a message before any handler of its batch runs: decoding, required fields,
    /// rules on the payload alone. It gets no connection, so a refusal here has no effect to
    /// undo: the batch's refusals are all known up front, the batch runs again once without
    /// them, and they are recorded as failed exactly as a failure of [`Handler::handle`]
    /// (retryable or permanent) would be. A failure inside `handle` instead rolls back the
    /// work of the messages before it and runs them again, in groups under savepoints: put
    /// every refusal that needs no database here. It runs again whenever the batch does, so
    /// keep it free of side effects. The default accepts every message.
    fn check(&self, msg: &InboxMessage<'_>) -> Result<(), HandlerError> {
        let _ = msg;
        Ok(())
    }

    /// The message types this handler takes, when it knows them (a [`crate::router::Router`]
    /// does). The consumer checks before it connects that each can reach the handler (a
    /// version within [`crate::EnvelopeRules::supported_versions`], a name within the
    /// message type's field limit) and refuses to start otherwise.
    fn message_types(&self) -> Option<MessageTypes> {
        None
    }

    /// Whether the handler takes no type outside [`Handler::message_types`]. The consumer then
    /// refuses the others when it parses a delivery, as invalid (`unknown_message_type`):
    /// recorded and parked without a business transaction (see
    /// [`crate::EnvelopeRules::accepted_types`]).
    fn refuses_other_types(&self) -> bool {
        false
    }
}

/// A batch handler's failure.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// The message at `index` (into the slice the handler got) failed. The batch is rolled
    /// back and run again without it, in groups under savepoints; it is recorded as failed.
    #[error("message {index} of the batch failed: {error}")]
    Message {
        /// Index into the handler's slice.
        index: usize,
        /// The failure.
        error: HandlerError,
    },
    /// Several messages failed (a set-based handler that validates the whole batch): the batch
    /// is rolled back and run again once without all of them. Indexes into the handler's slice;
    /// an empty list is treated like [`BatchError::Batch`].
    #[error("{} messages of the batch failed", .0.len())]
    Messages(Vec<(usize, HandlerError)>),
    /// The batch failed and the handler cannot say which message caused it. The messages are
    /// run again one per call to find out.
    #[error("batch failed: {0}")]
    Batch(HandlerError),
}

/// Application logic that handles a whole batch at once, so business writes can be set-based
/// (one `INSERT .. SELECT FROM UNNEST(..)` for the batch). Same guarantees as [`Handler`]: the
/// writes go through `tx`, which also holds the batch's inbox rows.
///
/// `msgs` holds only messages whose effect is due (duplicates are already filtered out), in
/// delivery order. After a failure the batch runs again without the failing message, so keep
/// effects inside `tx`; after a single-message failure ([`BatchError::Message`]) it runs in
/// groups of 8 under savepoints, so `msgs` can then be a part of the batch. Name every refused
/// message at once with [`BatchError::Messages`] to keep whole batches.
pub trait BatchHandler: Send + Sync + 'static {
    /// Applies the effects of `msgs` inside the open transaction.
    fn handle_batch(
        &self,
        msgs: &[InboxMessage<'_>],
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), BatchError>> + Send;

    /// The message types this handler takes, when it knows them (a [`crate::router::Router`]
    /// does). The consumer checks before it connects that each can reach the handler (a
    /// version within [`crate::EnvelopeRules::supported_versions`], a name within the
    /// message type's field limit) and refuses to start otherwise.
    fn message_types(&self) -> Option<MessageTypes> {
        None
    }

    /// Whether the handler takes no type outside [`BatchHandler::message_types`]. The consumer then
    /// refuses the others when it parses a delivery, as invalid (`unknown_message_type`):
    /// recorded and parked without a business transaction (see
    /// [`crate::EnvelopeRules::accepted_types`]).
    fn refuses_other_types(&self) -> bool {
        false
    }
}

/// Runs a per-message [`Handler`] over a batch, one message after the other, in one
/// transaction, after [`Handler::check`] has passed every one of them.
#[derive(Debug)]
pub struct PerMessage<H>(pub H);

impl<H: Handler> BatchHandler for PerMessage<H> {
    async fn handle_batch(
        &self,
        msgs: &[InboxMessage<'_>],
        tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        // Every refusal named before any effect: the batch runs again once without them.
        let refused: Vec<(usize, HandlerError)> = msgs
            .iter()
            .enumerate()
            .filter_map(|(index, msg)| {
                match std::panic::catch_unwind(AssertUnwindSafe(|| self.0.check(msg))) {
                    Ok(Ok(())) => None,
                    Ok(Err(error)) => Some((index, error)),
                    Err(panic) => Some((index, HandlerError::panicked(&*panic))),
                }
            })
            .collect();
        if !refused.is_empty() {
            return Err(BatchError::Messages(refused));
        }
        for (index, msg) in msgs.iter().enumerate() {
            // A panic is this message's failure; the others of the batch are innocent.
            let error = match AssertUnwindSafe(self.0.handle(msg, tx))
                .catch_unwind()
                .await
            {
                Ok(Ok(())) => continue,
                Ok(Err(error)) => error,
                Err(panic) => HandlerError::panicked(&*panic),
            };
            return Err(BatchError::Message { index, error });
        }
        Ok(())
    }

    fn message_types(&self) -> Option<MessageTypes> {
        self.0.message_types()
    }

    fn refuses_other_types(&self) -> bool {
        self.0.refuses_other_types()
    }
}

/// A handler's outbox failure: an invalid message is the handler's bug (permanent); a database
/// error is classified like any other.
impl From<OutboxError> for HandlerError {
    fn from(e: OutboxError) -> Self {
        match e {
            OutboxError::Invalid(text) => HandlerError::permanent("outbox_invalid_message", text),
            OutboxError::Database(e) => e.into(),
        }
    }
}

/// A handler's outbox: writes through the handler's transaction, with ids derived from the
/// incoming message's key, the consumer and the message's position among those it emits.
/// Obtained from [`crate::InboxMessage::outbox`].
pub struct MessageOutbox<'c> {
    pub(crate) tx: &'c mut PgConnection,
    pub(crate) outbox: &'c Outbox,
    pub(crate) incoming: &'c Envelope,
    pub(crate) consumer: &'c str,
    /// Shared by every handle of one handler run, so two handles never reuse a position.
    pub(crate) position: &'c AtomicU32,
}

impl std::fmt::Debug for MessageOutbox<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageOutbox")
            .field("consumer", &self.consumer)
            .field("incoming", &self.incoming.message_id)
            .finish_non_exhaustive()
    }
}

impl MessageOutbox<'_> {
    /// Writes `message`, emitted while handling the incoming message. Unless set on `message`:
    /// the id is [`emitted_message_id`]`(consumer, incoming key, position)`, the causation id
    /// the incoming message's id, the correlation id the incoming one's (else its id), and
    /// the trace context a child of the incoming `traceparent`. A replay of the incoming
    /// message emits the same ids (`Enqueued::inserted` is then false if the rows are kept).
    pub async fn enqueue(&mut self, mut message: OutboxMessage) -> Result<Enqueued, HandlerError> {
        let position = self.position.fetch_add(1, Ordering::Relaxed);
        let incoming = self.incoming;
        let id = message
            .message_id
            .take()
            .unwrap_or_else(|| emitted_message_id(self.consumer, &incoming.message_id, position));
        message
            .causation_id
            .get_or_insert_with(|| incoming.message_id.clone());
        if message.correlation_id.is_none() {
            message.correlation_id = Some(
                incoming
                    .correlation_id
                    .clone()
                    .unwrap_or_else(|| incoming.message_id.clone()),
            );
        }
        if message.traceparent.is_none() {
            message.traceparent = incoming.traceparent.as_deref().and_then(child_traceparent);
            if message.traceparent.is_some() {
                message.tracestate = incoming
                    .headers
                    .get("tracestate")
                    .and_then(Value::as_str)
                    .map(str::to_owned);
            }
        }
        Ok(self.outbox.write(self.tx, &message, id).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{AmqpMessage, EnvelopeRules, parse};

    fn key(consumer: &str, id: &str) -> String {
        let envelope = parse(
            AmqpMessage {
                message_id: Some(id.into()),
                body: b"{\"n\":1}".to_vec(),
                ..AmqpMessage::default()
            },
            &EnvelopeRules::default(),
        )
        .expect("valid");
        let outbox = Outbox::new(crate::schema::SchemaName::default());
        let emitted = AtomicU32::new(0);
        InboxMessage {
            envelope: &envelope,
            consumer_name: consumer,
            attempt: 1,
            outbox: &outbox,
            emitted: &emitted,
        }
        .idempotency_key()
    }

    #[test]
    fn idempotency_key_is_stable_per_consumer_and_message() {
        assert_eq!(key("a", "m1"), key("a", "m1"));
        assert_ne!(key("a", "m1"), key("b", "m1"));
        assert_ne!(key("a", "m1"), key("a", "m2"));
    }

    #[test]
    fn decode_mismatch_is_permanent() {
        #[derive(Debug, serde::Deserialize)]
        #[allow(dead_code)]
        struct Wants {
            order_id: String,
        }
        let envelope = parse(
            AmqpMessage {
                message_id: Some("m1".into()),
                body: b"{\"n\":1}".to_vec(),
                ..AmqpMessage::default()
            },
            &EnvelopeRules::default(),
        )
        .expect("valid");
        let outbox = Outbox::new(crate::schema::SchemaName::default());
        let emitted = AtomicU32::new(0);
        let msg = InboxMessage {
            envelope: &envelope,
            consumer_name: "a",
            attempt: 1,
            outbox: &outbox,
            emitted: &emitted,
        };
        let err = msg.decode::<Wants>().expect_err("mismatch");
        assert_eq!(err.kind(), ErrorKind::Permanent);
    }
}
