//! Payload privacy: which bodies the inbox keeps (per message type), which JSON fields it blanks
//! before storing one, and envelope encryption of what it stores.
//!
//! **Invariant:** the dedup hash (`payload_sha256`) is always computed over the original
//! canonical body, before redaction or encryption, so a duplicate is recognised whatever is
//! kept of the payload, also after its key was destroyed. The payload column only ever holds
//! what the policy allows: a body whose type has redaction rules but which is not JSON (so
//! cannot be redacted) is not stored at all, and a tenant without a usable key gets no payload
//! rather than a clear-text one.
//!
//! Stored payloads are sealed with AES-256-GCM under a fresh data key per payload; the data key
//! is wrapped by a key of the [`Keyring`], whose id is stored with the row
//! (`payload_key_id`). The ciphertext is bound to its row (consumer and message id are the
//! additional authenticated data), so it cannot be copied to another row. [`open_payload`] is
//! the one function that turns a stored payload back into the body.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{Arc, PoisonError, RwLock},
};

use aes_gcm::{
    Aes256Gcm, Nonce,
    aead::{Aead, AeadCore, KeyInit, OsRng, Payload, rand_core::RngCore},
};
use zeroize::{Zeroize, Zeroizing};

use base64::{Engine, engine::general_purpose::STANDARD as BASE64};
use sha2::{Digest, Sha256};

use crate::{canonical_json::canonical_sha256, envelope::Envelope};

/// Which bodies the inbox keeps (section "payload storage" of the README).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PayloadStorage {
    /// Keep bodies of failed and parked messages only; processed rows keep metadata and hash.
    #[default]
    FailedOnly,
    /// Keep every body.
    Always,
    /// Keep no body (hash and metadata only).
    Never,
}

/// Value written in place of a redacted JSON field, and in `last_error_message` in place of
/// a handler's message the policy does not store in clear.
pub const REDACTED: &str = "[redacted]";

/// `last_error_message` of a row whose error message is sealed (`last_error_sealed`) and that
/// has no safe detail to show instead.
pub const SEALED: &str = "[sealed]";

/// The one member of a stored headers object when encryption is on:
/// `{"x-inbox-sealed": {"key_id": .., "sealed": <base64>}}`; [`open_headers`] opens it.
pub const SEALED_HEADERS: &str = "x-inbox-sealed";

/// Why a stored payload cannot be turned back into its body, or a key not be added.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PrivacyError {
    /// The key that sealed the payload was destroyed (crypto-shredding): the payload is gone
    /// for good, by design.
    #[error("payload unreadable: key destroyed ({key_id})")]
    KeyDestroyed {
        /// The destroyed key.
        key_id: String,
    },
    /// The keyring does not hold the key that sealed the payload.
    #[error("payload unreadable: key {key_id:?} is not in the keyring")]
    UnknownKey {
        /// The missing key.
        key_id: String,
    },
    /// The payload is sealed but no keyring was given.
    #[error("payload is encrypted with key {key_id:?}; a keyring is needed to read it")]
    NoKeyring {
        /// The key that sealed it.
        key_id: String,
    },
    /// The sealed bytes are malformed, or were changed or moved to another row.
    #[error("sealed payload failed authentication (corrupt, altered, or from another row)")]
    Corrupt,
    /// A key cannot be added or activated.
    #[error("keyring: {0}")]
    Keyring(String),
    /// Encryption is configured (a keyring was given) but the row holds this field in clear,
    /// without a key id: written before encryption was turned on, or by something else than
    /// the library. Not served as if it were sealed.
    #[error("stored in clear although encryption is configured (no key id)")]
    NotSealed,
}

/// Storage policy, redaction and encryption of stored payloads, per message type. Part of
/// [`crate::ConsumerConfig`]; [`crate::ConsumerConfig::payload_storage`] is the default for
/// types without an entry in [`PayloadPrivacy::storage`].
#[derive(Clone, Debug, Default)]
pub struct PayloadPrivacy {
    /// Which bodies to keep, by message type.
    pub storage: BTreeMap<String, PayloadStorage>,
    /// JSON pointers (`/card/number`, `/items/0/email`) whose values are replaced by
    /// [`REDACTED`] before a body is stored, by message type; the entry `*` applies to every
    /// type.
    pub redact: BTreeMap<String, Vec<String>>,
    /// Application headers (names compared case-insensitively) whose values are replaced by
    /// [`REDACTED`] before the headers are stored, for every type.
    pub redact_headers: Vec<String>,
    /// Seal every stored payload with this keyring.
    pub encryption: Option<Arc<Keyring>>,
}

impl PayloadPrivacy {
    /// Keep bodies of `message_type` as `storage` says.
    pub fn store(mut self, message_type: impl Into<String>, storage: PayloadStorage) -> Self {
        self.storage.insert(message_type.into(), storage);
        self
    }

    /// Redact `pointers` in bodies of `message_type` (`*`: every type).
    pub fn redact(mut self, message_type: impl Into<String>, pointers: &[&str]) -> Self {
        self.redact
            .entry(message_type.into())
            .or_default()
            .extend(pointers.iter().map(|p| (*p).to_owned()));
        self
    }

    /// Redact the values of headers `names` (every type) before the headers are stored.
    pub fn redact_headers(mut self, names: &[&str]) -> Self {
        self.redact_headers
            .extend(names.iter().map(|n| (*n).to_owned()));
        self
    }

    /// Encrypt stored payloads with `keyring`.
    pub fn encrypt_with(mut self, keyring: Arc<Keyring>) -> Self {
        self.encryption = Some(keyring);
        self
    }

    /// The first setting that is invalid, if any: pointers must start with `/`.
    pub(crate) fn invalid_pointer(&self) -> Option<&str> {
        self.redact
            .values()
            .flatten()
            .find(|p| !p.starts_with('/'))
            .map(String::as_str)
    }
}

/// When a body would be stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// With a row that commits PROCESSED.
    Processed,
    /// With a failure record.
    Failed,
}

/// What goes into the `payload` and `payload_key_id` columns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Sealed {
    pub(crate) payload: Option<Vec<u8>>,
    pub(crate) key_id: Option<String>,
}

/// The store's side of [`PayloadPrivacy`]: the default storage plus the per-type rules.
#[derive(Clone, Debug)]
pub(crate) struct PayloadRules {
    default: PayloadStorage,
    privacy: PayloadPrivacy,
}

impl PayloadRules {
    pub(crate) fn new(default: PayloadStorage, privacy: PayloadPrivacy) -> Self {
        Self { default, privacy }
    }

    /// The storage policy of `message_type`.
    pub(crate) fn storage_of(&self, message_type: &str) -> PayloadStorage {
        self.privacy
            .storage
            .get(message_type)
            .copied()
            .unwrap_or(self.default)
    }

    /// Whether a body of `message_type` is kept in `phase`.
    pub(crate) fn keeps(&self, message_type: &str, phase: Phase) -> bool {
        match (self.storage_of(message_type), phase) {
            (PayloadStorage::Always, _) => true,
            (PayloadStorage::FailedOnly, Phase::Failed) => true,
            (PayloadStorage::FailedOnly, Phase::Processed) | (PayloadStorage::Never, _) => false,
        }
    }

    /// What to store for `envelope` in `phase`: nothing, the (redacted) body, or the sealed one.
    pub(crate) fn seal(&self, consumer: &str, envelope: &Envelope, phase: Phase) -> Sealed {
        if !self.keeps(&envelope.message_type, phase) {
            return Sealed::default();
        }
        let Some(body) = self.redacted(&envelope.message_type, &envelope.body) else {
            return Sealed::default();
        };
        let Some(keyring) = &self.privacy.encryption else {
            return Sealed {
                payload: Some(body),
                key_id: None,
            };
        };
        let aad = row_aad(consumer, &envelope.message_id);
        match keyring.seal(envelope.tenant_id.as_deref(), &body, &aad) {
            Ok((key_id, payload)) => Sealed {
                payload: Some(payload),
                key_id: Some(key_id),
            },
            Err(e) => {
                // No clear-text fallback: that would undo the tenant's shredding.
                tracing::debug!(message_id = %envelope.message_id, error = %e, "payload not stored");
                Sealed::default()
            }
        }
    }

    /// The application headers to store beside `sealed` (what [`PayloadRules::seal`] gave for
    /// the same envelope and phase), with the configured names redacted. Headers are part of
    /// the message, so they follow its body: none when the policy keeps no body in this phase,
    /// and none in clear when encryption is configured but the body was not sealed (no usable
    /// tenant key: storing them would undo the shredding).
    pub(crate) fn headers(
        &self,
        envelope: &Envelope,
        phase: Phase,
        sealed: &Sealed,
    ) -> Option<serde_json::Map<String, serde_json::Value>> {
        if !self.keeps(&envelope.message_type, phase)
            || (self.privacy.encryption.is_some() && sealed.key_id.is_none())
        {
            return None;
        }
        let mut headers = envelope.headers.clone();
        for (name, value) in headers.iter_mut() {
            if self
                .privacy
                .redact_headers
                .iter()
                .any(|r| r.eq_ignore_ascii_case(name))
            {
                *value = serde_json::Value::String(REDACTED.to_owned());
            }
        }
        Some(headers)
    }

    /// The stored headers (`storable`, what [`PayloadRules::headers`] gave) as they go into the
    /// column: as they are without encryption, sealed under the tenant's key with it
    /// (`{SEALED_HEADERS: {key_id, sealed}}`), nothing when there is no usable key.
    pub(crate) fn seal_headers(
        &self,
        consumer: &str,
        envelope: &Envelope,
        storable: serde_json::Value,
    ) -> serde_json::Value {
        let empty = serde_json::Value::Object(serde_json::Map::new());
        let Some(keyring) = &self.privacy.encryption else {
            return storable;
        };
        if storable == empty {
            return empty;
        }
        let Ok(clear) = serde_json::to_vec(&storable) else {
            return empty;
        };
        let aad = headers_aad(consumer, &envelope.message_id);
        match keyring.seal(envelope.tenant_id.as_deref(), &clear, &aad) {
            Ok((key_id, sealed)) => serde_json::json!({
                SEALED_HEADERS: { "key_id": key_id, "sealed": BASE64.encode(sealed) }
            }),
            // No clear-text fallback, as for the body.
            Err(_) => empty,
        }
    }

    /// What goes into the error columns for a failure of `envelope` with `message`
    /// (truncated already) and the handler's `safe` detail. The message follows the body's
    /// policy: in clear where a body of its type is stored in clear, sealed under the
    /// tenant's key when encryption is on, withheld for a type whose bodies are never stored
    /// or have fields redacted (free text cannot be redacted by pointer). `safe` is stored as
    /// it is, and shown in place of a message that is sealed or withheld.
    pub(crate) fn error(
        &self,
        consumer: &str,
        envelope: &Envelope,
        message: &str,
        safe: Option<&str>,
    ) -> StoredError {
        let withheld = |marker: &str| StoredError {
            message: safe.unwrap_or(marker).to_owned(),
            safe: safe.map(str::to_owned),
            sealed: None,
            key_id: None,
        };
        if !self.keeps(&envelope.message_type, Phase::Failed)
            || self.has_redaction_rules(&envelope.message_type)
        {
            return withheld(REDACTED);
        }
        let Some(keyring) = &self.privacy.encryption else {
            return StoredError::clear(message, safe);
        };
        let aad = error_aad(consumer, &envelope.message_id);
        match keyring.seal(envelope.tenant_id.as_deref(), message.as_bytes(), &aad) {
            Ok((key_id, sealed)) => StoredError {
                sealed: Some(sealed),
                key_id: Some(key_id),
                ..withheld(SEALED)
            },
            Err(_) => withheld(REDACTED),
        }
    }

    fn has_redaction_rules(&self, message_type: &str) -> bool {
        ["*", message_type]
            .iter()
            .any(|t| self.privacy.redact.get(*t).is_some_and(|p| !p.is_empty()))
    }

    /// `body` with the configured fields of `message_type` redacted; `None` when there are
    /// rules but the body is not a JSON document they can apply to.
    fn redacted(&self, message_type: &str, body: &[u8]) -> Option<Vec<u8>> {
        let pointers: Vec<&String> = ["*", message_type]
            .iter()
            .filter_map(|t| self.privacy.redact.get(*t))
            .flatten()
            .collect();
        if pointers.is_empty() {
            return Some(body.to_vec());
        }
        let mut doc: serde_json::Value = serde_json::from_slice(body).ok()?;
        for pointer in pointers {
            if let Some(value) = doc.pointer_mut(pointer) {
                *value = serde_json::Value::String(REDACTED.to_owned());
            }
        }
        serde_json::to_vec(&doc).ok()
    }
}

/// What goes into the error columns of a failure: `last_error_message` (what anyone who can
/// read the inbox sees), `last_error_safe`, `last_error_sealed` and `last_error_key_id`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct StoredError {
    pub(crate) message: String,
    pub(crate) safe: Option<String>,
    pub(crate) sealed: Option<Vec<u8>>,
    pub(crate) key_id: Option<String>,
}

impl StoredError {
    /// The message in clear (no policy, or one that stores the body in clear).
    pub(crate) fn clear(message: &str, safe: Option<&str>) -> Self {
        Self {
            message: message.to_owned(),
            safe: safe.map(str::to_owned),
            sealed: None,
            key_id: None,
        }
    }
}

/// A stored payload as read from the inbox: the bytes and the key that sealed them, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredPayload {
    /// The `payload` column.
    pub bytes: Vec<u8>,
    /// The `payload_key_id` column: `None` for a payload stored in clear.
    pub key_id: Option<String>,
}

/// Whether `body` is the message whose dedup hash is `recorded` (over its canonical JSON or
/// its raw bytes, as the consumer hashed it), and not a redacted copy of it.
pub fn is_original_body(body: &[u8], recorded: &[u8]) -> bool {
    let raw: [u8; 32] = Sha256::digest(body).into();
    recorded == raw
        || serde_json::from_slice::<serde_json::Value>(body)
            .is_ok_and(|v| canonical_sha256(&v) == recorded)
}

/// The body a stored payload holds (redacted as configured when it was stored): decrypted when
/// it was sealed. `consumer` and `message_id` are the row's; a sealed payload opens only with
/// its own row's.
///
/// ```
/// use rabbit_inbox::privacy::{Keyring, PrivacyError, StoredPayload, open_payload};
/// let clear = StoredPayload { bytes: b"{}".to_vec(), key_id: None };
/// assert_eq!(open_payload(None, &clear, "svc", "m-1").unwrap(), b"{}");
/// let sealed = StoredPayload { bytes: vec![1, 2, 3], key_id: Some("k1".into()) };
/// assert!(matches!(open_payload(None, &sealed, "svc", "m-1"), Err(PrivacyError::NoKeyring { .. })));
/// ```
pub fn open_payload(
    keyring: Option<&Keyring>,
    stored: &StoredPayload,
    consumer: &str,
    message_id: &str,
) -> Result<Vec<u8>, PrivacyError> {
    open_sealed(
        keyring,
        &stored.bytes,
        stored.key_id.as_deref(),
        &row_aad(consumer, message_id),
    )
}

/// The error message a row's `last_error_sealed` holds (sealed under `key_id`).
pub fn open_error(
    keyring: Option<&Keyring>,
    sealed: &[u8],
    key_id: &str,
    consumer: &str,
    message_id: &str,
) -> Result<String, PrivacyError> {
    let bytes = open_sealed(
        keyring,
        sealed,
        Some(key_id),
        &error_aad(consumer, message_id),
    )?;
    String::from_utf8(bytes).map_err(|_| PrivacyError::Corrupt)
}

/// The headers a row's `headers` column holds: opened when sealed
/// (`{SEALED_HEADERS: {key_id, sealed}}`), as they are when stored in clear without a keyring.
/// With a keyring (encryption configured) headers stored in clear are
/// [`PrivacyError::NotSealed`]; an empty object is no headers either way.
pub fn open_headers(
    keyring: Option<&Keyring>,
    stored: &serde_json::Value,
    consumer: &str,
    message_id: &str,
) -> Result<serde_json::Value, PrivacyError> {
    let sealed = stored
        .as_object()
        .filter(|m| m.len() == 1)
        .and_then(|m| m.get(SEALED_HEADERS));
    let Some(sealed) = sealed else {
        return match stored.as_object() {
            Some(m) if !m.is_empty() && keyring.is_some() => Err(PrivacyError::NotSealed),
            _ => Ok(stored.clone()),
        };
    };
    let key_id = sealed
        .get("key_id")
        .and_then(serde_json::Value::as_str)
        .ok_or(PrivacyError::Corrupt)?;
    let bytes = sealed
        .get("sealed")
        .and_then(serde_json::Value::as_str)
        .and_then(|b| BASE64.decode(b).ok())
        .ok_or(PrivacyError::Corrupt)?;
    let clear = open_sealed(
        keyring,
        &bytes,
        Some(key_id),
        &headers_aad(consumer, message_id),
    )?;
    serde_json::from_slice(&clear).map_err(|_| PrivacyError::Corrupt)
}

/// Opens `bytes` sealed under `key_id`; bytes without a key id are clear text, which is
/// refused when a keyring is given (encryption is configured, so the row should be sealed).
fn open_sealed(
    keyring: Option<&Keyring>,
    bytes: &[u8],
    key_id: Option<&str>,
    aad: &[u8],
) -> Result<Vec<u8>, PrivacyError> {
    match (key_id, keyring) {
        (None, None) => Ok(bytes.to_vec()),
        (None, Some(_)) => Err(PrivacyError::NotSealed),
        (Some(key_id), None) => Err(PrivacyError::NoKeyring {
            key_id: key_id.to_owned(),
        }),
        (Some(key_id), Some(keyring)) => keyring.open(key_id, bytes, aad),
    }
}

/// A cipher over `key` (32 bytes), read in place: no copy of the key is left behind, and the
/// cipher's key schedule is wiped when it is dropped (the `aes` crate's `zeroize` feature).
fn cipher(key: &[u8]) -> Result<Aes256Gcm, PrivacyError> {
    Aes256Gcm::new_from_slice(key).map_err(|_| PrivacyError::Corrupt)
}

fn nonce_of(bytes: &[u8]) -> Result<Nonce<aes_gcm::aead::consts::U12>, PrivacyError> {
    <[u8; NONCE_LEN]>::try_from(bytes)
        .map(Nonce::from)
        .map_err(|_| PrivacyError::Corrupt)
}

fn row_aad(consumer: &str, message_id: &str) -> Vec<u8> {
    format!("rabbit-inbox payload v1\0{consumer}\0{message_id}").into_bytes()
}

/// The headers' and the error message's own contexts: neither can be passed off as the
/// other, or as the body.
fn headers_aad(consumer: &str, message_id: &str) -> Vec<u8> {
    format!("rabbit-inbox headers v1\0{consumer}\0{message_id}").into_bytes()
}

fn error_aad(consumer: &str, message_id: &str) -> Vec<u8> {
    format!("rabbit-inbox error v1\0{consumer}\0{message_id}").into_bytes()
}

/// Format version of a sealed payload.
const SEALED_V1: u8 = 1;
const NONCE_LEN: usize = 12;
/// A 32-byte data key plus its 16-byte tag.
const WRAPPED_KEY_LEN: usize = 48;

/// Key-encryption keys by id: one active key for new writes (optionally one per tenant), older
/// keys kept to read what they sealed, destroyed keys remembered so reads say so.
///
/// Rotation: [`Keyring::add`] a new key and [`Keyring::activate`] it; payloads sealed before
/// stay readable as long as their key is in the ring. Crypto-shredding: give a tenant its own
/// key ([`Keyring::add_tenant_key`]) and [`Keyring::destroy`] it; its payloads are then
/// unreadable ([`PrivacyError::KeyDestroyed`]) while their rows, hashes and dedup remain.
/// The ring is shared (`Arc`) between the consumer and operator tools and changes in place.
/// It holds key material in memory only: where keys live (a KMS, a secret store) and that a
/// destroyed key is gone there too is the application's part.
#[derive(Default)]
pub struct Keyring {
    inner: RwLock<Ring>,
}

/// Key material: on the heap, so the map's rehashing moves only the pointer, and wiped when
/// dropped.
type KeyBytes = Box<Zeroizing<[u8; 32]>>;

#[derive(Default)]
struct Ring {
    keys: HashMap<String, KeyBytes>,
    active: Option<String>,
    tenants: HashMap<String, String>,
    destroyed: HashSet<String>,
}

impl Ring {
    /// Drops `key_id`'s material, wiped (dropping a [`KeyBytes`] zeroes it).
    fn forget(&mut self, key_id: &str) {
        drop(self.keys.remove(key_id));
    }
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ring = self.read();
        let mut ids: Vec<&String> = ring.keys.keys().collect();
        ids.sort();
        f.debug_struct("Keyring")
            .field("keys", &ids)
            .field("active", &ring.active)
            .field("destroyed", &ring.destroyed.len())
            .finish_non_exhaustive()
    }
}

impl Keyring {
    /// An empty ring.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Ring> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Ring> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a 256-bit key under `key_id`. The first key added becomes the active one.
    pub fn add(&self, key_id: impl Into<String>, key: [u8; 32]) -> Result<(), PrivacyError> {
        let key_id = key_id.into();
        let mut ring = self.write();
        if key_id.is_empty() || key_id.len() > 255 {
            return Err(PrivacyError::Keyring("a key id is 1 to 255 bytes".into()));
        }
        if ring.destroyed.contains(&key_id) {
            return Err(PrivacyError::Keyring(format!(
                "key {key_id:?} was destroyed; ids are never reused"
            )));
        }
        if ring.keys.contains_key(&key_id) {
            return Err(PrivacyError::Keyring(format!("key {key_id:?} exists")));
        }
        let mut key = key;
        ring.keys
            .insert(key_id.clone(), Box::new(Zeroizing::new(key)));
        // The argument's copy on this stack frame.
        key.zeroize();
        ring.active.get_or_insert(key_id);
        Ok(())
    }

    /// New writes (of tenants without a key of their own) use `key_id` from now on.
    pub fn activate(&self, key_id: &str) -> Result<(), PrivacyError> {
        let mut ring = self.write();
        if !ring.keys.contains_key(key_id) {
            return Err(PrivacyError::Keyring(format!("no key {key_id:?}")));
        }
        ring.active = Some(key_id.to_owned());
        Ok(())
    }

    /// Adds `key` under `key_id` and makes it `tenant`'s active key (its payloads are sealed
    /// with it, so destroying it shreds the tenant's payloads only). Adding a tenant another
    /// key rotates it; the old one stays readable.
    pub fn add_tenant_key(
        &self,
        tenant: impl Into<String>,
        key_id: impl Into<String>,
        key: [u8; 32],
    ) -> Result<(), PrivacyError> {
        let key_id = key_id.into();
        self.add(key_id.clone(), key)?;
        let mut ring = self.write();
        // A tenant key is never the default for everyone else.
        if ring.active.as_deref() == Some(key_id.as_str()) {
            ring.active = None;
        }
        ring.tenants.insert(tenant.into(), key_id);
        Ok(())
    }

    /// Destroys a key: its material is dropped and its id remembered, so payloads it sealed
    /// report [`PrivacyError::KeyDestroyed`]. Irreversible. A tenant whose key is destroyed
    /// gets no stored payloads afterwards (never clear text, never another key).
    pub fn destroy(&self, key_id: &str) {
        let mut ring = self.write();
        ring.forget(key_id);
        ring.destroyed.insert(key_id.to_owned());
        if ring.active.as_deref() == Some(key_id) {
            ring.active = None;
        }
    }

    /// Ids destroyed before this process started (from the application's key store), so
    /// their payloads read as destroyed rather than unknown.
    pub fn mark_destroyed(&self, key_ids: impl IntoIterator<Item = impl Into<String>>) {
        let mut ring = self.write();
        for id in key_ids {
            let id = id.into();
            ring.forget(&id);
            ring.destroyed.insert(id);
        }
    }

    /// The key new writes of `tenant` use.
    fn writing_key(&self, tenant: Option<&str>) -> Result<(String, Aes256Gcm), PrivacyError> {
        let ring = self.read();
        let id = match tenant.and_then(|t| ring.tenants.get(t)) {
            Some(id) => id,
            None => ring
                .active
                .as_ref()
                .ok_or_else(|| PrivacyError::Keyring("no active key".into()))?,
        };
        if ring.destroyed.contains(id) {
            return Err(PrivacyError::KeyDestroyed { key_id: id.clone() });
        }
        let key = ring
            .keys
            .get(id)
            .ok_or_else(|| PrivacyError::UnknownKey { key_id: id.clone() })?;
        Ok((id.clone(), cipher(&key[..])?))
    }

    fn reading_key(&self, key_id: &str) -> Result<Aes256Gcm, PrivacyError> {
        let ring = self.read();
        if ring.destroyed.contains(key_id) {
            return Err(PrivacyError::KeyDestroyed {
                key_id: key_id.to_owned(),
            });
        }
        ring.keys
            .get(key_id)
            .map(|k| cipher(&k[..]))
            .ok_or_else(|| PrivacyError::UnknownKey {
                key_id: key_id.to_owned(),
            })?
    }

    /// Seals `body`: a fresh data key encrypts it, the ring's key for `tenant` wraps the data
    /// key. Returns the wrapping key's id and `version | wrap nonce | wrapped data key | nonce |
    /// ciphertext`.
    pub(crate) fn seal(
        &self,
        tenant: Option<&str>,
        body: &[u8],
        aad: &[u8],
    ) -> Result<(String, Vec<u8>), PrivacyError> {
        let (key_id, kek) = self.writing_key(tenant)?;
        let mut dek = Zeroizing::new([0u8; 32]);
        OsRng.fill_bytes(&mut dek[..]);
        let wrap_nonce = Aes256Gcm::generate_nonce(OsRng);
        let wrapped = kek
            .encrypt(
                &wrap_nonce,
                Payload {
                    msg: &dek[..],
                    aad: key_id.as_bytes(),
                },
            )
            .map_err(|_| PrivacyError::Corrupt)?;
        let nonce = Aes256Gcm::generate_nonce(OsRng);
        let ciphertext = cipher(&dek[..])?
            .encrypt(&nonce, Payload { msg: body, aad })
            .map_err(|_| PrivacyError::Corrupt)?;
        let mut out = Vec::with_capacity(1 + 2 * NONCE_LEN + WRAPPED_KEY_LEN + ciphertext.len());
        out.push(SEALED_V1);
        out.extend_from_slice(&wrap_nonce);
        out.extend_from_slice(&wrapped);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&ciphertext);
        Ok((key_id, out))
    }

    fn open(&self, key_id: &str, sealed: &[u8], aad: &[u8]) -> Result<Vec<u8>, PrivacyError> {
        let kek = self.reading_key(key_id)?;
        let (version, rest) = sealed.split_first().ok_or(PrivacyError::Corrupt)?;
        if *version != SEALED_V1 || rest.len() < 2 * NONCE_LEN + WRAPPED_KEY_LEN {
            return Err(PrivacyError::Corrupt);
        }
        let (wrap_nonce, rest) = rest.split_at(NONCE_LEN);
        let (wrapped, rest) = rest.split_at(WRAPPED_KEY_LEN);
        let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
        let dek = Zeroizing::new(
            kek.decrypt(
                &nonce_of(wrap_nonce)?,
                Payload {
                    msg: wrapped,
                    aad: key_id.as_bytes(),
                },
            )
            .map_err(|_| PrivacyError::Corrupt)?,
        );
        if dek.len() != 32 {
            return Err(PrivacyError::Corrupt);
        }
        cipher(&dek)?
            .decrypt(
                &nonce_of(nonce)?,
                Payload {
                    msg: ciphertext,
                    aad,
                },
            )
            .map_err(|_| PrivacyError::Corrupt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(ty: &str, tenant: Option<&str>, body: &[u8]) -> Envelope {
        let mut msg = crate::envelope::AmqpMessage {
            message_id: Some("m-1".into()),
            kind: Some(ty.into()),
            body: body.to_vec(),
            ..Default::default()
        };
        if let Some(t) = tenant {
            msg.headers
                .insert(crate::envelope::TENANT_HEADER.into(), serde_json::json!(t));
        }
        crate::envelope::parse(msg, &crate::envelope::EnvelopeRules::default()).expect("valid")
    }

    fn stored(sealed: &Sealed) -> StoredPayload {
        StoredPayload {
            bytes: sealed.payload.clone().expect("stored"),
            key_id: sealed.key_id.clone(),
        }
    }

    #[test]
    fn storage_is_chosen_per_type() {
        let rules = PayloadRules::new(
            PayloadStorage::FailedOnly,
            PayloadPrivacy::default()
                .store("a", PayloadStorage::Always)
                .store("n", PayloadStorage::Never),
        );
        assert!(rules.keeps("a", Phase::Processed));
        assert!(!rules.keeps("other", Phase::Processed));
        assert!(rules.keeps("other", Phase::Failed));
        assert!(!rules.keeps("n", Phase::Failed));
    }

    #[test]
    fn redaction_blanks_fields_and_refuses_what_it_cannot_redact() {
        let rules = PayloadRules::new(
            PayloadStorage::Always,
            PayloadPrivacy::default()
                .redact("*", &["/email"])
                .redact("card", &["/card/number", "/missing"]),
        );
        let e = envelope(
            "card",
            None,
            br#"{"email":"a@b.c","card":{"number":"4111","exp":"12/30"}}"#,
        );
        let sealed = rules.seal("svc", &e, Phase::Processed);
        let doc: serde_json::Value =
            serde_json::from_slice(&sealed.payload.expect("stored")).expect("json");
        assert_eq!(doc["email"], REDACTED);
        assert_eq!(doc["card"]["number"], REDACTED);
        assert_eq!(doc["card"]["exp"], "12/30");
        assert_eq!(sealed.key_id, None);
        // The hash is the original body's.
        assert_eq!(
            e.payload_sha256,
            envelope(
                "card",
                None,
                br#"{"email":"a@b.c","card":{"number":"4111","exp":"12/30"}}"#
            )
            .payload_sha256
        );
    }

    #[test]
    fn sealed_payloads_open_with_their_row_and_key_only() {
        let ring = Arc::new(Keyring::new());
        ring.add("k1", [7; 32]).expect("added");
        let rules = PayloadRules::new(
            PayloadStorage::Always,
            PayloadPrivacy::default().encrypt_with(ring.clone()),
        );
        let e = envelope("t", None, br#"{"secret":1}"#);
        let sealed = rules.seal("svc", &e, Phase::Processed);
        assert_eq!(sealed.key_id.as_deref(), Some("k1"));
        let s = stored(&sealed);
        assert!(!s.bytes.windows(6).any(|w| w == b"secret"));
        assert_eq!(
            open_payload(Some(&ring), &s, "svc", "m-1").expect("opens"),
            br#"{"secret":1}"#
        );
        assert_eq!(
            open_payload(Some(&ring), &s, "svc", "m-2"),
            Err(PrivacyError::Corrupt)
        );
        let mut tampered = s.clone();
        let last = tampered.bytes.len() - 1;
        tampered.bytes[last] ^= 1;
        assert_eq!(
            open_payload(Some(&ring), &tampered, "svc", "m-1"),
            Err(PrivacyError::Corrupt)
        );

        // Rotation: new writes use k2, k1's payloads stay readable.
        ring.add("k2", [9; 32]).expect("added");
        ring.activate("k2").expect("active");
        let newer = rules.seal("svc", &e, Phase::Processed);
        assert_eq!(newer.key_id.as_deref(), Some("k2"));
        assert!(open_payload(Some(&ring), &s, "svc", "m-1").is_ok());
        assert!(open_payload(Some(&ring), &stored(&newer), "svc", "m-1").is_ok());
    }

    #[test]
    fn destroying_a_tenant_key_shreds_that_tenant_only() {
        let ring = Arc::new(Keyring::new());
        ring.add("main", [1; 32]).expect("added");
        ring.add_tenant_key("acme", "acme-1", [2; 32])
            .expect("added");
        let rules = PayloadRules::new(
            PayloadStorage::Always,
            PayloadPrivacy::default().encrypt_with(ring.clone()),
        );
        let acme = rules.seal("svc", &envelope("t", Some("acme"), b"{}"), Phase::Processed);
        let other = rules.seal("svc", &envelope("t", Some("zeta"), b"{}"), Phase::Processed);
        assert_eq!(acme.key_id.as_deref(), Some("acme-1"));
        assert_eq!(other.key_id.as_deref(), Some("main"));
        ring.destroy("acme-1");
        assert_eq!(
            open_payload(Some(&ring), &stored(&acme), "svc", "m-1"),
            Err(PrivacyError::KeyDestroyed {
                key_id: "acme-1".into()
            })
        );
        assert!(open_payload(Some(&ring), &stored(&other), "svc", "m-1").is_ok());
        // No clear-text fallback for the shredded tenant.
        let after = rules.seal("svc", &envelope("t", Some("acme"), b"{}"), Phase::Processed);
        assert_eq!(after, Sealed::default());
        assert!(ring.add("acme-1", [3; 32]).is_err(), "ids are not reused");
    }
}
