//! The selection of parked copies a bulk action takes: the body of `POST /api/v1/redrive`
//! and `POST /api/v1/discard`, and of the console's background jobs.

use inbox_ops::redrive::{MAX_REDRIVE_RATE, MIN_REDRIVE_RATE, RedriveRequest};
use serde::Deserialize;
use utoipa::ToSchema;

use crate::{
    error::{ApiError, storable},
    request::{given, instant},
};

/// Body of `POST /api/v1/redrive` and `POST /api/v1/discard`.
#[derive(Debug, Deserialize, ToSchema)]
pub(crate) struct RedriveBody {
    /// Why (written to the audit trail).
    pub(crate) reason: String,
    /// Ticket to cite beside the reason.
    pub(crate) ticket: Option<String>,
    /// Classify and count only; nothing moves.
    #[serde(default)]
    pub(crate) dry_run: bool,
    /// Only copies parked by this consumer.
    consumer: Option<String>,
    /// Only this message type.
    #[serde(rename = "type")]
    #[schema(rename = "type")]
    message_type: Option<String>,
    /// Only this error code.
    error_code: Option<String>,
    /// Only these message ids (a search result's); empty or absent: any.
    #[serde(default)]
    message_ids: Vec<String>,
    /// Only copies parked at or after (RFC 3339, or a duration ago such as `2h`).
    since: Option<String>,
    /// Only copies parked before.
    until: Option<String>,
    /// At most this many moves per second, 0.001 to 100000.
    rate_per_sec: Option<f64>,
    /// At most this many copies moved.
    limit: Option<u64>,
    /// Also replay copies whose row retention removed, and copies the inbox does not know
    /// (audited as forced). Redrive only.
    #[serde(default)]
    force: bool,
    /// Remove copies whose row is PROCESSED instead of leaving them. Redrive only.
    #[serde(default)]
    drop_processed: bool,
}

/// Most message ids one bulk request may name.
const MAX_MESSAGE_IDS: usize = 1000;

impl RedriveBody {
    /// The operation's request: a redrive, or with `discard` a removal of parked copies.
    pub(crate) fn request(&self, discard: bool) -> Result<RedriveRequest, ApiError> {
        if let Some(rate) = self.rate_per_sec
            && !(MIN_REDRIVE_RATE..=MAX_REDRIVE_RATE).contains(&rate)
        {
            return Err(ApiError::bad_request(format!(
                "rate_per_sec must be from {MIN_REDRIVE_RATE} to {MAX_REDRIVE_RATE}"
            )));
        }
        if self.limit == Some(0) {
            return Err(ApiError::bad_request("limit must be at least 1"));
        }
        if discard && (self.force || self.drop_processed) {
            return Err(ApiError::bad_request(
                "force and drop_processed are redrive options; a discard removes parked \
                 copies of parked rows only",
            ));
        }
        if self.message_ids.len() > MAX_MESSAGE_IDS {
            return Err(ApiError::bad_request(format!(
                "at most {MAX_MESSAGE_IDS} message ids per request"
            )));
        }
        for (name, value) in [
            ("consumer", &self.consumer),
            ("type", &self.message_type),
            ("error_code", &self.error_code),
        ] {
            storable(name, value.as_deref().unwrap_or_default())?;
        }
        for id in &self.message_ids {
            storable("message_ids", id)?;
        }
        Ok(RedriveRequest {
            dry_run: self.dry_run,
            consumer: given(&self.consumer).map(str::to_owned),
            message_type: given(&self.message_type).map(str::to_owned),
            error_code: given(&self.error_code).map(str::to_owned),
            message_ids: self
                .message_ids
                .iter()
                .map(|id| id.trim())
                .filter(|id| !id.is_empty())
                .map(str::to_owned)
                .collect(),
            since: given(&self.since)
                .map(|s| instant("since", s))
                .transpose()?,
            until: given(&self.until)
                .map(|s| instant("until", s))
                .transpose()?,
            rate_per_sec: self.rate_per_sec,
            limit: self.limit,
            force: self.force,
            drop_processed: self.drop_processed,
            discard,
            job: None,
        })
    }
}
