//! The tool side of a parking lot: read parked copies one at a time (`basic.get`, unacked
//! until decided), put back the ones left alone, and move the others to the work queue as the
//! producer sent them. Used by `redrive` and `status`.

use chrono::{DateTime, Utc};
use lapin::{
    Acker, BasicProperties, Channel, Connection,
    options::{BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable, ShortString},
};
use serde::Serialize;

use super::{
    addresses::connect,
    delivery::amqp_message,
    publish::{confirm_channel, publish_confirmed},
};
use crate::{
    envelope::AmqpMessage,
    error::{AmqpResult, BrokerError},
    status::parking_headers,
};

/// Headers a consumer adds to a parked copy to say why; a redriven message goes back without
/// them.
const REASON_HEADERS: [&str; 6] = [
    parking_headers::STATUS,
    parking_headers::ERROR_CODE,
    parking_headers::ERROR,
    parking_headers::CONSUMER,
    parking_headers::INBOX_KEY,
    parking_headers::PARKED_AT,
];

/// Longest wait for the confirm of a republished message.
const CONFIRM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// A queue and the messages it holds (`None`: the queue does not exist).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct QueueDepth {
    /// Queue name.
    pub queue: String,
    /// Ready messages.
    pub messages: Option<u32>,
}

/// A connection to one work queue's parking lot.
pub struct ParkingLot {
    connection: Connection,
    /// `basic.get` and the acks and nacks of what it got.
    reading: Channel,
    /// Confirmed publishes to the work queue.
    publishing: Channel,
    work_queue: String,
    parking_queue: String,
    /// The user the connection authenticated as: the only `user-id` the broker lets it send.
    user: String,
}

impl std::fmt::Debug for ParkingLot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParkingLot")
            .field("work_queue", &self.work_queue)
            .field("parking_queue", &self.parking_queue)
            .finish_non_exhaustive()
    }
}

/// A parked copy, held (unacked) until it is put back or removed.
pub struct ParkedMessage {
    acker: Acker,
    properties: BasicProperties,
    message: AmqpMessage,
}

impl std::fmt::Debug for ParkedMessage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParkedMessage")
            .field("message_id", &self.message.message_id)
            .finish_non_exhaustive()
    }
}

/// How a republished message differs from the producer's original.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Republished {
    /// The producer's `expiration` was put back.
    pub expiration_restored: bool,
    /// The producer set a `user-id` that could not be put back (it is not the publishing
    /// connection's user, which the broker would refuse); it stays in
    /// `x-inbox-original-user-id`.
    pub user_id_kept_in_header: bool,
}

impl ParkedMessage {
    /// The message as the consumer would see it.
    pub fn message(&self) -> &AmqpMessage {
        &self.message
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.message.headers.get(name).and_then(|v| v.as_str())
    }

    /// The inbox key the consumer recorded it under (`x-inbox-message-id`).
    pub fn inbox_key(&self) -> Option<&str> {
        self.header(parking_headers::INBOX_KEY)
    }

    /// The consumer that parked it (`x-inbox-consumer`).
    pub fn consumer(&self) -> Option<&str> {
        self.header(parking_headers::CONSUMER)
    }

    /// The error code it was parked with.
    pub fn error_code(&self) -> Option<&str> {
        self.header(parking_headers::ERROR_CODE)
    }

    /// When it was parked.
    pub fn parked_at(&self) -> Option<DateTime<Utc>> {
        self.message
            .headers
            .get(parking_headers::PARKED_AT)
            .and_then(|v| v.as_i64())
            .and_then(DateTime::from_timestamp_millis)
    }
}

impl ParkingLot {
    /// Connects for the parking lot `parking_queue` of the work queue `work_queue`.
    pub async fn connect(
        amqp_url: &str,
        work_queue: &str,
        parking_queue: &str,
    ) -> Result<Self, BrokerError> {
        let connection = connect(amqp_url, "inboxctl parking lot").await?;
        let reading = connection.create_channel().await.amqp()?;
        let publishing = confirm_channel(&connection).await?;
        let user = connection.status().username();
        Ok(Self {
            connection,
            reading,
            publishing,
            work_queue: work_queue.to_owned(),
            parking_queue: parking_queue.to_owned(),
            user,
        })
    }

    /// The work queue.
    pub fn work_queue(&self) -> &str {
        &self.work_queue
    }

    /// The parking queue.
    pub fn parking_queue(&self) -> &str {
        &self.parking_queue
    }

    /// Messages ready in `queue`, `None` if it does not exist. A passive declare of a missing
    /// queue closes its channel, so each check gets a channel of its own.
    async fn depth(&self, queue: &str) -> Result<Option<u32>, BrokerError> {
        let channel = self.connection.create_channel().await.amqp()?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let depth = match channel
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
        {
            Ok(q) => Some(q.message_count()),
            Err(e) if is_not_found(&e) => return Ok(None),
            Err(e) => return Err(BrokerError::from_client(e)),
        };
        let _ = channel.close(200, "done".into()).await;
        Ok(depth)
    }

    /// Ready messages in the work queue and in the parking lot (held copies not counted).
    pub async fn depths(&self) -> Result<(QueueDepth, QueueDepth), BrokerError> {
        Ok((
            QueueDepth {
                queue: self.work_queue.clone(),
                messages: self.depth(&self.work_queue).await?,
            },
            QueueDepth {
                queue: self.parking_queue.clone(),
                messages: self.depth(&self.parking_queue).await?,
            },
        ))
    }

    /// The next parked copy, held until [`ParkingLot::put_back`] or [`ParkingLot::remove`]
    /// (or until the connection closes, which puts it back). Held copies are not handed out
    /// again, so one pass reads each copy once.
    pub async fn next(&self) -> Result<Option<ParkedMessage>, BrokerError> {
        let got = self
            .reading
            .basic_get(
                self.parking_queue.as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await
            .amqp()?;
        Ok(got.map(|get| ParkedMessage {
            message: amqp_message(&get.delivery),
            acker: get.delivery.acker.clone(),
            properties: get.delivery.properties.clone(),
        }))
    }

    /// Returns a held copy to the parking lot, in its place.
    pub async fn put_back(&self, parked: ParkedMessage) -> Result<(), BrokerError> {
        parked
            .acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await
            .amqp()?;
        Ok(())
    }

    /// Removes a held copy from the parking lot (acks it).
    pub async fn remove(&self, parked: ParkedMessage) -> Result<(), BrokerError> {
        parked.acker.ack(BasicAckOptions::default()).await.amqp()?;
        Ok(())
    }

    /// Publishes the producer's message again to the work queue, through the default exchange
    /// (so no other queue bound to the producer's exchange gets a copy), and waits for the
    /// broker's confirm. The reason headers go; the `expiration` and `user-id` the copy could
    /// not carry come back (a `user-id` only if it is this connection's user).
    ///
    /// Gives up after 15 s: a broker under a memory or disk alarm blocks
    /// publishers, and the caller holds a row lock meanwhile.
    pub async fn republish(&self, parked: &ParkedMessage) -> Result<Republished, BrokerError> {
        let (properties, republished) = restored(&parked.properties, &self.user);
        let publish = publish_confirmed(
            &self.publishing,
            "",
            &self.work_queue,
            &parked.message.body,
            properties,
        );
        tokio::time::timeout(CONFIRM_TIMEOUT, publish)
            .await
            .map_err(|_| {
                BrokerError::NotConfirmed(format!(
                    "queue {:?} (no confirm within {CONFIRM_TIMEOUT:?})",
                    self.work_queue
                ))
            })??;
        Ok(republished)
    }

    /// Closes the connection; copies still held go back to the parking lot.
    pub async fn close(self) {
        let _ = self.connection.close(200, "bye".into()).await;
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(
        e.kind(),
        lapin::ErrorKind::ProtocolError(amqp) if matches!(
            amqp.kind(),
            lapin::protocol::AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::NOTFOUND)
        )
    )
}

/// The properties of a parked copy as the producer sent them, for a publishing connection of
/// `user`.
fn restored(parked: &BasicProperties, user: &str) -> (BasicProperties, Republished) {
    let mut republished = Republished::default();
    let mut headers = FieldTable::default();
    let mut expiration = None;
    let mut user_id = None;
    for (name, value) in parked
        .headers()
        .as_ref()
        .map(|h| h.inner().iter())
        .into_iter()
        .flatten()
    {
        let text = match value {
            AMQPValue::LongString(s) => Some(s.to_string()),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            _ => None,
        };
        match name.as_str() {
            n if REASON_HEADERS.contains(&n) => {}
            parking_headers::ORIGINAL_EXPIRATION if text.is_some() => expiration = text,
            parking_headers::ORIGINAL_USER_ID if text.as_deref() == Some(user) => user_id = text,
            parking_headers::ORIGINAL_USER_ID => {
                republished.user_id_kept_in_header = true;
                headers.insert(name.clone(), value.clone());
            }
            _ => {
                headers.insert(name.clone(), value.clone());
            }
        }
    }
    let mut properties = parked.clone().with_headers(headers);
    if let Some(e) = expiration.and_then(|e| ShortString::try_new(e).ok()) {
        properties = properties.with_expiration(e);
        republished.expiration_restored = true;
    }
    if let Some(u) = user_id.and_then(|u| ShortString::try_new(u).ok()) {
        properties = properties.with_user_id(u);
    }
    (properties, republished)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::headers::long_string;

    fn parked(user_id: &str) -> BasicProperties {
        let mut h = FieldTable::default();
        for (k, v) in [
            (parking_headers::STATUS, "POISONED"),
            (parking_headers::ERROR_CODE, "boom"),
            (parking_headers::ERROR, "it failed"),
            (parking_headers::CONSUMER, "svc"),
            (parking_headers::INBOX_KEY, "m-1"),
            (parking_headers::ORIGINAL_EXCHANGE, "orders"),
            (parking_headers::ORIGINAL_EXPIRATION, "60000"),
            (parking_headers::ORIGINAL_USER_ID, user_id),
            ("x-tenant-id", "t1"),
        ] {
            h.insert(k.into(), long_string(v));
        }
        h.insert(parking_headers::PARKED_AT.into(), AMQPValue::LongLongInt(1));
        BasicProperties::default()
            .with_headers(h)
            .with_message_id("m-1".into())
    }

    #[test]
    fn restored_drops_reasons_and_restores_the_producers_properties() {
        let (p, r) = restored(&parked("guest"), "guest");
        let h = p.headers().clone().unwrap_or_default();
        let names: Vec<&str> = h.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            vec![parking_headers::ORIGINAL_EXCHANGE, "x-tenant-id"]
        );
        assert_eq!(p.expiration().as_ref().map(|s| s.as_str()), Some("60000"));
        assert_eq!(p.user_id().as_ref().map(|s| s.as_str()), Some("guest"));
        assert_eq!(p.message_id().as_ref().map(|s| s.as_str()), Some("m-1"));
        assert!(r.expiration_restored && !r.user_id_kept_in_header);
    }

    #[test]
    fn a_foreign_user_id_stays_in_its_header() {
        let (p, r) = restored(&parked("billing"), "guest");
        assert_eq!(p.user_id(), &None);
        assert!(r.user_id_kept_in_header);
        let h = p.headers().clone().unwrap_or_default();
        assert!(h.contains_key(parking_headers::ORIGINAL_USER_ID));
    }
}
