//! The outbox relay's publishing link: mandatory publishes with publisher confirms, a result per
//! message. A returned (unroutable) message is a failure, never a success: RabbitMQ confirms a
//! mandatory publish it could not route only after returning it, and lapin folds the return into
//! the confirm (`Confirmation::Ack(Some(returned))`).

use std::collections::HashSet;

use futures::future::join_all;
use lapin::{
    Channel, Confirmation, Connection, PublisherConfirm,
    options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions},
    types::FieldTable,
};
use tokio::time::Instant;

use super::{
    addresses::connect,
    headers::short,
    publish::OutgoingMessage,
    topology::{Exchange, declare_exchange},
};
use crate::error::{AmqpResult, BrokerError};

/// One message for [`ConfirmedLink::publish_all`].
pub(crate) struct Publication {
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) content_type: String,
    pub(crate) message: OutgoingMessage,
}

/// What the broker made of one publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PublishResult {
    /// Routed to at least one queue and confirmed.
    Confirmed,
    /// Unroutable: returned by the broker (no queue bound for the routing key).
    Returned(String),
    /// Negatively confirmed: the broker could not take it.
    Nacked,
    /// The exchange does not exist.
    ExchangeMissing,
    /// The message cannot be expressed in AMQP (a name over 255 bytes, say); it never will be.
    Unpublishable(String),
    /// No answer: the connection failed or the confirm did not come in time. The message may or
    /// may not have reached the broker; not the message's fault.
    Unconfirmed(String),
}

/// A batch sent by [`ConfirmedLink::send`] whose confirms may still be on their way. The
/// confirms do not borrow the link: they resolve while the link publishes the next batch.
pub(crate) struct Outstanding {
    /// Results known at sending (missing exchange, unpublishable, publish failed).
    results: Vec<Option<PublishResult>>,
    /// The confirms owed, by index into `results`.
    confirms: Vec<(usize, PublisherConfirm)>,
}

impl Outstanding {
    /// `n` publishes that failed before any confirm was owed.
    pub(crate) fn unconfirmed(n: usize, why: &str) -> Self {
        Self {
            results: (0..n)
                .map(|_| Some(PublishResult::Unconfirmed(why.to_owned())))
                .collect(),
            confirms: Vec::new(),
        }
    }

    /// Waits for the confirms until `deadline`. One result per item, in order, and whether a
    /// confirm did not come in time: a channel that does not confirm in time is not to be
    /// trusted with the next batch.
    pub(crate) async fn confirmed(self, deadline: Instant) -> (Vec<PublishResult>, bool) {
        let Outstanding {
            mut results,
            confirms,
        } = self;
        let (indexes, futures): (Vec<usize>, Vec<_>) = confirms.into_iter().unzip();
        let timed_out = match tokio::time::timeout_at(deadline, join_all(futures)).await {
            Ok(confirmed) => {
                for (i, confirmation) in indexes.into_iter().zip(confirmed) {
                    results[i] = Some(match confirmation {
                        Ok(Confirmation::Ack(None)) => PublishResult::Confirmed,
                        Ok(
                            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)),
                        ) => PublishResult::Returned(format!(
                            "{} {}",
                            returned.reply_code, returned.reply_text
                        )),
                        Ok(Confirmation::Nack(None)) => PublishResult::Nacked,
                        Ok(Confirmation::NotRequested) => {
                            PublishResult::Unconfirmed("confirms not enabled".into())
                        }
                        Err(e) => PublishResult::Unconfirmed(e.to_string()),
                    });
                }
                false
            }
            Err(_) => {
                for i in indexes {
                    results[i] = Some(PublishResult::Unconfirmed(
                        "no confirm within the time allowed".into(),
                    ));
                }
                true
            }
        };
        let results = results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| PublishResult::Unconfirmed("not published".into())))
            .collect();
        (results, timed_out)
    }
}

/// A connection and confirm channel, opened on first use and reopened after a failure.
///
/// Takes an AMQP URL or a cluster's comma-separated list (see [`super::AmqpAddresses`]),
/// connecting in `open`, the only place the relay connects.
pub(crate) struct ConfirmedLink {
    amqp_url: String,
    connection_name: String,
    /// Exchanges this link declares on each connection, and again when one goes missing.
    declared: Vec<Exchange>,
    link: Option<Link>,
}

/// Why [`ConfirmedLink::connect`] failed: the connection, or the declaration of one of the
/// link's exchanges (refused: another type or durability, no permission).
#[derive(Debug)]
pub(crate) struct ConnectFailed {
    /// The exchange being declared; `None` when the connection itself failed.
    pub(crate) exchange: Option<String>,
    pub(crate) error: BrokerError,
}

impl std::fmt::Display for ConnectFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.exchange {
            Some(exchange) => write!(f, "declaring exchange {exchange:?} failed: {}", self.error),
            None => self.error.fmt(f),
        }
    }
}

struct Link {
    connection: Connection,
    channel: Channel,
    /// Exchanges seen to exist on this connection. Checked before publishing to them, because a
    /// publish to a missing exchange closes the channel and fails every publish after it.
    exchanges: HashSet<String>,
    /// Whether the declared exchanges were declared on this connection.
    declared: bool,
}

impl ConfirmedLink {
    /// A link that declares `declared` on every connection it opens.
    pub(crate) fn new(amqp_url: &str, connection_name: &str, declared: Vec<Exchange>) -> Self {
        Self {
            amqp_url: amqp_url.to_owned(),
            connection_name: connection_name.to_owned(),
            declared,
            link: None,
        }
    }

    async fn open(&mut self) -> Result<&mut Link, BrokerError> {
        let usable = self
            .link
            .as_ref()
            .is_some_and(|l| l.channel.status().connected());
        if !usable {
            // Dropping the old link closes its connection.
            self.link = None;
            let connection = connect(&self.amqp_url, &self.connection_name).await?;
            let channel = confirm_channel(&connection).await?;
            self.link = Some(Link {
                connection,
                channel,
                exchanges: HashSet::new(),
                declared: false,
            });
        }
        self.link
            .as_mut()
            .ok_or_else(|| BrokerError::NotConfirmed("no publishing link".into()))
    }

    /// Opens the connection and confirm channel if they are not open, and declares the link's
    /// exchanges once per connection.
    pub(crate) async fn connect(&mut self) -> Result<(), ConnectFailed> {
        let declared = self.declared.clone();
        let link = self.open().await.map_err(|error| ConnectFailed {
            exchange: None,
            error,
        })?;
        if link.declared {
            return Ok(());
        }
        for exchange in &declared {
            if let Err(e) = declare_exchange(&link.channel, exchange).await {
                // The refusal closed the channel: the next use reopens the link.
                self.link = None;
                return Err(ConnectFailed {
                    exchange: Some(exchange.name.clone()),
                    error: e,
                });
            }
            link.exchanges.insert(exchange.name.clone());
        }
        link.declared = true;
        Ok(())
    }

    /// Those of `exchanges` that do not exist (checked passively, once per connection for
    /// the ones that do).
    pub(crate) async fn missing(
        &mut self,
        exchanges: &[String],
    ) -> Result<Vec<String>, BrokerError> {
        let mut missing = Vec::new();
        for exchange in exchanges {
            if !self.exists(exchange).await? {
                missing.push(exchange.clone());
            }
        }
        Ok(missing)
    }

    /// Drops the link (its connection closes); the next use reconnects. For a round abandoned
    /// midway, whose channel may still owe confirms.
    pub(crate) fn reset(&mut self) {
        self.link = None;
    }

    /// Publishes `items` in order (mandatory, persistent as built) without waiting for the
    /// confirms: they are awaited through the returned [`Outstanding`], so the next batch can be
    /// claimed and published meanwhile. A publish that fails outright drops the link (the next
    /// use reconnects); what follows it in `items` is not published.
    pub(crate) async fn send(&mut self, items: &[Publication]) -> Outstanding {
        let unconfirmed =
            |e: &dyn std::fmt::Display| Outstanding::unconfirmed(items.len(), &e.to_string());
        let missing = match self.check_exchanges(items).await {
            Ok(missing) => missing,
            Err(e) => {
                self.link = None;
                return unconfirmed(&e);
            }
        };
        let link = match self.open().await {
            Ok(link) => link,
            Err(e) => return unconfirmed(&e),
        };
        let mut results: Vec<Option<PublishResult>> = vec![None; items.len()];
        let mut confirms = Vec::with_capacity(items.len());
        let mut broken = None;
        for (i, item) in items.iter().enumerate() {
            if missing.contains(&item.exchange) {
                results[i] = Some(PublishResult::ExchangeMissing);
                continue;
            }
            if let Some(e) = &broken {
                results[i] = Some(PublishResult::Unconfirmed(format!("{e}")));
                continue;
            }
            // A row written before the outbox checked its content type could hold one AMQP
            // cannot carry: unpublishable, never a panic.
            let properties =
                match item.message.properties().and_then(|p| {
                    Ok(p.with_content_type(short("content type", &item.content_type)?))
                }) {
                    Ok(p) => p,
                    Err(e) => {
                        results[i] = Some(PublishResult::Unpublishable(e.to_string()));
                        continue;
                    }
                };
            let (exchange, routing_key) = match (
                short("exchange", &item.exchange),
                short("routing key", &item.routing_key),
            ) {
                (Ok(x), Ok(r)) => (x, r),
                (Err(e), _) | (_, Err(e)) => {
                    results[i] = Some(PublishResult::Unpublishable(e.to_string()));
                    continue;
                }
            };
            let published = link
                .channel
                .basic_publish(
                    exchange,
                    routing_key,
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &item.message.body,
                    properties,
                )
                .await;
            match published {
                Ok(confirm) => confirms.push((i, confirm)),
                Err(e) => {
                    results[i] = Some(PublishResult::Unconfirmed(e.to_string()));
                    broken = Some(e);
                }
            }
        }
        if broken.is_some() {
            self.link = None;
        }
        Outstanding { results, confirms }
    }

    /// The exchanges of `items` that do not exist, checked passively once per connection. A
    /// declared exchange found missing (deleted while the relay runs) is declared again.
    async fn check_exchanges(
        &mut self,
        items: &[Publication],
    ) -> Result<HashSet<String>, BrokerError> {
        let mut missing = HashSet::new();
        for item in items {
            let exchange = &item.exchange;
            // The default exchange always exists and cannot be declared.
            if exchange.is_empty() || missing.contains(exchange) {
                continue;
            }
            if short("exchange", exchange).is_err() {
                continue; // reported per item as unpublishable
            }
            if self.exists(exchange).await? {
                continue;
            }
            match self.declared.iter().find(|x| &x.name == exchange).cloned() {
                Some(declaration) => {
                    let link = self.open().await?;
                    declare_exchange(&link.channel, &declaration).await?;
                    link.exchanges.insert(exchange.clone());
                    tracing::info!(exchange = %exchange, kind = %declaration.kind, "declared exchange was missing; declared it again");
                }
                None => {
                    missing.insert(exchange.clone());
                }
            }
        }
        Ok(missing)
    }

    /// Whether `exchange` exists: a passive declare, remembered for the connection when it
    /// does. A missing one closes the channel; it is reopened, the connection stays.
    async fn exists(&mut self, exchange: &str) -> Result<bool, BrokerError> {
        let link = self.open().await?;
        if link.exchanges.contains(exchange) {
            return Ok(true);
        }
        let checked = link
            .channel
            .exchange_declare(
                short("exchange", exchange)?,
                // Ignored by a passive declare.
                lapin::ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        match checked {
            Ok(()) => {
                link.exchanges.insert(exchange.to_owned());
                Ok(true)
            }
            Err(e) if is_not_found(&e) => {
                link.channel = confirm_channel(&link.connection).await?;
                Ok(false)
            }
            Err(e) => Err(BrokerError::from_client(e)),
        }
    }

    /// Closes the connection.
    pub(crate) async fn close(&mut self) {
        if let Some(link) = self.link.take() {
            let _ = link.connection.close(200, "shutdown".into()).await;
        }
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => matches!(
            amqp.kind(),
            lapin::protocol::AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::NOTFOUND)
        ),
        _ => false,
    }
}

async fn confirm_channel(connection: &Connection) -> Result<Channel, BrokerError> {
    let channel = connection.create_channel().await.amqp()?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .amqp()?;
    Ok(channel)
}
