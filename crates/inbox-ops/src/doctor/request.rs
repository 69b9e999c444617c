//! What the doctor checks the installation against.

use std::{collections::BTreeMap, time::Duration};

use rabbit_inbox::{
    ConsumerConfig, broker::Topology, privacy::PayloadStorage, retention::RetentionPolicy,
    retry::RetryPolicy,
};

/// What the installation is supposed to be: the consumer's configuration, as far as the
/// checks need it, and where the broker is.
#[derive(Clone, Debug)]
pub struct DoctorRequest {
    /// Check this consumer's rows; `None`: every consumer of the schema.
    pub consumer: Option<String>,
    /// The broker: an AMQP URL, or a cluster's as a comma-separated list. `None`: broker and
    /// reconciliation checks are skipped (a warn row).
    pub amqp_url: Option<String>,
    /// The management HTTP API (`http://user:password@host:15672`, several separated by
    /// commas, or `https://`); `None`: each AMQP URL's host, `http://host:15672` (`https://host:15671`
    /// for `amqps://`), with the first URL's credentials.
    /// The first address that answers is read. Read only with the feature `management`.
    pub management_url: Option<String>,
    /// The consumer's queues. `None`: broker and reconciliation checks are skipped.
    pub topology: Option<Topology>,
    /// The consumer's retry tiers and attempt budget.
    pub retry: RetryPolicy,
    /// The consumer's prefetch (the quorum delivery limit must exceed attempts + prefetch).
    pub prefetch: u16,
    /// The retention the consumer (or `inboxctl cleanup`) applies; `None`: none, rows are
    /// kept until removed by hand.
    pub retention: Option<RetentionPolicy>,
    /// Which bodies are kept for types without their own entry.
    pub payload_storage: PayloadStorage,
    /// Which bodies are kept, per message type.
    pub payload_storage_by_type: BTreeMap<String, PayloadStorage>,
    /// Stored payloads are supposed to be encrypted.
    pub payload_encrypted: bool,
    /// Added to a retry tier's delay before a retry counts as lost.
    pub recovery_grace: Duration,
}

impl Default for DoctorRequest {
    /// Every consumer, no broker, the library's retry and payload defaults, no retention.
    fn default() -> Self {
        Self {
            consumer: None,
            amqp_url: None,
            management_url: None,
            topology: None,
            retry: RetryPolicy::default(),
            prefetch: 1000,
            retention: None,
            payload_storage: PayloadStorage::default(),
            payload_storage_by_type: BTreeMap::new(),
            payload_encrypted: false,
            recovery_grace: Duration::from_secs(60),
        }
    }
}

impl DoctorRequest {
    /// The checks of the consumer configured by `config`, on the broker at `amqp_url`. The
    /// retention policy and the recovery grace are not part of a consumer's configuration:
    /// they keep their defaults unless set.
    pub fn for_consumer(config: &ConsumerConfig, amqp_url: impl Into<String>) -> Self {
        Self {
            consumer: Some(config.consumer_name.clone()),
            amqp_url: Some(amqp_url.into()),
            topology: Some(config.topology.clone()),
            retry: config.retry.clone(),
            prefetch: config.prefetch,
            payload_storage: config.payload_storage,
            payload_storage_by_type: config.privacy.storage.clone(),
            payload_encrypted: config.privacy.encryption.is_some(),
            ..Self::default()
        }
    }

    pub(super) fn storage_of(&self, message_type: &str) -> PayloadStorage {
        self.payload_storage_by_type
            .get(message_type)
            .copied()
            .unwrap_or(self.payload_storage)
    }
}
