//! The consumer runtime's broker connections: a consuming channel with prefetch, and a
//! publishing connection of its own for retry and parking copies; deliveries as they arrive.

use std::sync::Arc;

use futures::StreamExt;
use lapin::{
    Channel, Connection,
    options::{BasicConsumeOptions, BasicQosOptions},
    types::{FieldTable, ShortString},
};

use super::{
    addresses::connect, delivery::PendingDelivery, publish::Publisher, settings::SessionSettings,
    settle::Settler, topology::declare,
};
use crate::{
    envelope::AmqpMessage,
    error::{AmqpResult, BrokerError},
};

/// One broker session of the consumer runtime: a consuming connection and channel with
/// prefetch, and a [`Publisher`] on a connection of its own (a memory or disk alarm blocks
/// publishing connections; acks must not wait for it).
pub(crate) struct Session {
    connection: Arc<Connection>,
    channel: Channel,
    deliveries: lapin::Consumer,
    settler: Arc<Settler>,
    publisher: Arc<Publisher>,
    /// The consuming connection's negotiated `frame_max`.
    frame_max: u32,
}

/// Whether a broker error is a configuration mismatch that retrying cannot fix (a queue
/// declared elsewhere with other arguments, a missing permission).
pub(crate) fn is_fatal(e: &BrokerError) -> bool {
    match e {
        BrokerError::Amqp(e) => match e.client().kind() {
            lapin::ErrorKind::ProtocolError(amqp) => matches!(
                amqp.kind(),
                lapin::protocol::AMQPErrorKind::Soft(
                    lapin::protocol::AMQPSoftError::PRECONDITIONFAILED
                        | lapin::protocol::AMQPSoftError::ACCESSREFUSED
                ) | lapin::protocol::AMQPErrorKind::Hard(
                    lapin::protocol::AMQPHardError::NOTALLOWED
                )
            ),
            _ => false,
        },
        // Producer-side input errors; the consumer's parking path only republishes names
        // that already came through AMQP, so they never stop a consumer.
        BrokerError::NotConfirmed(_) | BrokerError::TooLong { .. } => false,
        // A node that did not answer: the next attempt tries every address again.
        BrokerError::ConnectTimeout(_) => false,
        // Checked when the consumer is built; retrying cannot fix it.
        BrokerError::InvalidAddress(_) | BrokerError::TlsSettings(_) => true,
        // Readable when the consumer was built: a certificate being renewed may be back by
        // the next attempt.
        BrokerError::TlsFile { .. } => false,
        // Either side may be renewing its certificate; the next attempt may pass.
        BrokerError::TlsHandshake { .. } => false,
    }
}

impl Session {
    pub(crate) async fn open(
        amqp_url: &str,
        config: &SessionSettings<'_>,
    ) -> Result<Self, BrokerError> {
        let connection =
            connect(amqp_url, &format!("rabbit-inbox {}", config.consumer_name)).await?;
        let channel = connection.create_channel().await.amqp()?;
        declare(&channel, config.topology, config.retry).await?;
        channel
            .basic_qos(config.prefetch, BasicQosOptions::default())
            .await
            .amqp()?;
        let publisher = Arc::new(
            Publisher::open(
                amqp_url,
                &format!("rabbit-inbox {} publisher", config.consumer_name),
            )
            .await?,
        );
        let deliveries = channel
            .basic_consume(
                config.topology.queue.as_str().into(),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .amqp()?;
        let frame_max = connection.configuration().frame_max();
        Ok(Self {
            connection: Arc::new(connection),
            channel: channel.clone(),
            settler: Arc::new(Settler::new(
                channel.clone(),
                publisher.clone(),
                config,
                frame_max,
            )),
            deliveries,
            publisher,
            frame_max,
        })
    }

    /// The next delivery; `None` when the consumer was cancelled by the broker or the
    /// connection closed.
    pub(crate) async fn next_delivery(
        &mut self,
    ) -> Option<Result<(PendingDelivery, AmqpMessage), BrokerError>> {
        match self.deliveries.next().await? {
            Ok(delivery) => Some(Ok(PendingDelivery::new(delivery, self.frame_max))),
            Err(e) => Some(Err(BrokerError::from_client(e))),
        }
    }

    pub(crate) fn settler(&self) -> Arc<Settler> {
        self.settler.clone()
    }

    /// A handle that can drop this session's connection (fault injection).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn connection(&self) -> Arc<Connection> {
        self.connection.clone()
    }

    /// Stops new deliveries; deliveries already received can still be settled.
    pub(crate) async fn cancel(&self) {
        let tag = self.deliveries.tag();
        if let Err(e) = self
            .channel
            .basic_cancel(tag, lapin::options::BasicCancelOptions::default())
            .await
        {
            tracing::debug!(error = %e, "basic.cancel failed");
        }
    }

    /// Closes channels and connections cleanly. Unsettled deliveries return to the queue.
    /// (A session dropped without this closes its connections too.)
    pub(crate) async fn close(self) {
        let _ = self.channel.close(200, "shutdown".into()).await;
        let _ = self.connection.close(200, "shutdown".into()).await;
        self.publisher.close().await;
    }
}

/// A connection handle, for fault injection.
#[cfg(feature = "fault-injection")]
pub(crate) type ConnectionHandle = Connection;

/// Closes a session's connection between commit and ack (fault injection).
#[cfg(feature = "fault-injection")]
pub(crate) async fn drop_connection(connection: &Connection) {
    let _ = connection
        .close(
            320,
            "fault injection: connection dropped after commit".into(),
        )
        .await;
}
