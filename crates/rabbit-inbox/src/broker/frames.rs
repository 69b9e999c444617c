//! The size of a message's content header frame, which carries its properties and headers:
//! what a delivery's takes, whether a copy of it fits, and cutting a copy's headers until it
//! does.
//!
//! RabbitMQ accepts a content header frame whose payload is up to `frame_max` bytes, and
//! closes the connection of a publisher that sends a larger one (it delivers larger ones
//! itself, after dead-lettering added `x-death` headers; the patched lapin, `forks/lapin`,
//! takes every frame). A retry or parking copy carries the producer's headers plus the
//! consumer's `x-inbox-*` ones, so a delivery whose header already fills the frame could not be
//! copied at all: its copy would be refused, the delivery requeued, and so on.

use lapin::{
    BasicProperties,
    protocol::basic::gen_properties,
    types::{AMQPValue, FieldTable, ShortString},
};

use crate::status::parking_headers;

/// Bytes of a content header frame's payload before the properties: class id, weight, body
/// size.
const HEADER_PREFIX: usize = 12;
/// A frame's bytes around its payload: type, channel, payload size, frame end.
const FRAME_OVERHEAD: usize = 8;
/// Room a copy needs in its frame beyond the producer's header: the `x-inbox-*` headers of a
/// parked copy (the error text alone may take 4,000 bytes of UTF-8), and the `x-death`
/// entries the broker adds on the way through the retry tiers.
const COPY_HEADROOM: usize = 8 * 1024;

/// Whether header `name` is one the broker adds when it dead-letters a message.
fn added_by_dead_lettering(name: &str) -> bool {
    name == "x-death" || name.starts_with("x-first-death-") || name.starts_with("x-last-death-")
}

/// Bytes of the content header frame payload that carries `properties` without the headers
/// the broker added when dead-lettering: what the producer sent, which [`too_large_to_copy`]
/// judges (its headroom covers what dead-lettering adds, so a message that passed once still
/// passes when it comes back from a retry tier).
pub(super) fn producer_header_len(properties: &BasicProperties) -> usize {
    let Some(headers) = properties.headers() else {
        return content_header_len(properties);
    };
    if !headers
        .inner()
        .keys()
        .any(|name| added_by_dead_lettering(name.as_str()))
    {
        return content_header_len(properties);
    }
    let mut own = FieldTable::default();
    for (name, value) in headers.inner() {
        if !added_by_dead_lettering(name.as_str()) {
            own.insert(name.clone(), value.clone());
        }
    }
    content_header_len(&properties.clone().with_headers(own))
}

/// Bytes of the content header frame payload that carries `properties`.
pub(super) fn content_header_len(properties: &BasicProperties) -> usize {
    // Written to a buffer that grows, so it cannot run out of room; a failure counts as too
    // large.
    gen_properties(properties)(Vec::new().into())
        .map_or(usize::MAX, |written| written.write.len())
        .saturating_add(HEADER_PREFIX)
}

/// The largest content header payload a copy published on a connection with `frame_max` may
/// have: the whole frame within `frame_max`, as the AMQP specification counts it, so any peer
/// accepts it (0 means no limit).
fn copy_limit(frame_max: u32) -> usize {
    match usize::try_from(frame_max) {
        Ok(0) | Err(_) => usize::MAX,
        Ok(max) => max.saturating_sub(FRAME_OVERHEAD),
    }
}

/// Why a delivery whose content header payload is `header_len` bytes as its producer sent it
/// ([`producer_header_len`]) cannot be copied whole on a connection with `frame_max`: its
/// header leaves less than the room a copy's own headers and dead-lettering's need. `None`
/// when it can.
pub(crate) fn too_large_to_copy(header_len: usize, frame_max: u32) -> Option<String> {
    let limit = copy_limit(frame_max);
    // A small frame_max cannot spare the full headroom.
    let room = COPY_HEADROOM.min(limit / 2);
    (header_len > limit.saturating_sub(room)).then(|| {
        format!(
            "the content header is {header_len} bytes as sent, and a retry or parking copy \
             must fit in frame_max ({frame_max} bytes) with {room} bytes of x-inbox-* \
             headers: too large to republish, so the parked copy goes without the largest \
             headers ({})",
            parking_headers::HEADERS_DROPPED
        )
    })
}

/// What [`fit`] dropped from a copy.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Dropped {
    /// Headers dropped.
    pub(super) count: usize,
    /// Their encoded size, names included.
    pub(super) bytes: usize,
}

/// `copy` cut to fit in a frame of `frame_max`: while its content header is too large, the
/// largest of the producer's headers is dropped (the `x-inbox-*` ones a copy needs stay,
/// except the error text, which goes last), and [`parking_headers::HEADERS_DROPPED`] notes how
/// many and their size. Unchanged when it fits.
pub(super) fn fit(copy: BasicProperties, frame_max: u32) -> (BasicProperties, Dropped) {
    let limit = copy_limit(frame_max);
    let mut len = content_header_len(&copy);
    if len <= limit {
        return (copy, Dropped::default());
    }
    let headers = copy.headers().clone().unwrap_or_default();
    let mut candidates: Vec<(bool, usize, &ShortString)> = headers
        .inner()
        .iter()
        .filter(|(name, _)| droppable(name.as_str()))
        .map(|(name, value)| {
            let last = name.as_str() == parking_headers::ERROR;
            (last, entry_len(name, value), name)
        })
        .collect();
    // Producer headers first, largest first; the error text last.
    candidates.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    // The note itself takes a few bytes.
    let note_len = entry_len(
        &parking_headers::HEADERS_DROPPED.into(),
        &note(&Dropped {
            count: usize::MAX,
            bytes: usize::MAX,
        }),
    );
    let mut dropped = Dropped::default();
    let mut gone = std::collections::HashSet::new();
    for (_, entry, name) in candidates {
        if len.saturating_add(note_len) <= limit {
            break;
        }
        gone.insert(name);
        len = len.saturating_sub(entry);
        dropped.count += 1;
        dropped.bytes += entry;
    }
    // FieldTable has no removal: the kept entries go into a new one.
    let mut kept = FieldTable::default();
    for (name, value) in headers.inner() {
        if !gone.contains(name) {
            kept.insert(name.clone(), value.clone());
        }
    }
    kept.insert(parking_headers::HEADERS_DROPPED.into(), note(&dropped));
    (copy.with_headers(kept), dropped)
}

/// Whether [`fit`] may drop header `name`: any but the `x-inbox-*` headers a copy needs to be
/// recognised, redriven and restored.
fn droppable(name: &str) -> bool {
    !name.starts_with("x-inbox-") || name == parking_headers::ERROR
}

/// The [`parking_headers::HEADERS_DROPPED`] value: `{count, bytes}`.
fn note(dropped: &Dropped) -> AMQPValue {
    let mut table = FieldTable::default();
    for (k, v) in [("count", dropped.count), ("bytes", dropped.bytes)] {
        table.insert(
            k.into(),
            AMQPValue::LongLongInt(i64::try_from(v).unwrap_or(i64::MAX)),
        );
    }
    AMQPValue::FieldTable(table)
}

/// Encoded bytes of one header table entry: the name as a short string, the typed value.
fn entry_len(name: &ShortString, value: &AMQPValue) -> usize {
    let mut one = FieldTable::default();
    one.insert(name.clone(), value.clone());
    // A table is its 4-byte length and its entries.
    let props = BasicProperties::default().with_headers(one);
    content_header_len(&props).saturating_sub(content_header_len(&BasicProperties::default()) + 4)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::headers::long_string;

    fn with_headers(entries: &[(&str, usize)]) -> BasicProperties {
        let mut headers = FieldTable::default();
        for &(name, len) in entries {
            headers.insert(name.into(), long_string(&"h".repeat(len)));
        }
        BasicProperties::default()
            .with_message_id("m-1".into())
            .with_headers(headers)
    }

    #[test]
    fn the_content_header_length_is_its_encoding() {
        // Class, weight, body size, flags: 14 bytes, then the message id (1 + 3).
        let bare = BasicProperties::default().with_message_id("m-1".into());
        assert_eq!(content_header_len(&bare), 18);
        // A table of one entry: length 4, name 1 + 1, type 1, long string 4 + 10; plus the
        // headers flag costs nothing (same 2 bytes of flags).
        assert_eq!(content_header_len(&with_headers(&[("a", 10)])), 18 + 21);
        assert_eq!(entry_len(&"a".into(), &long_string(&"h".repeat(10))), 17);
    }

    #[test]
    fn a_header_that_leaves_no_room_for_a_copy_is_too_large_to_copy() {
        let frame_max = 131_072;
        let limit = frame_max as usize - FRAME_OVERHEAD;
        assert_eq!(too_large_to_copy(limit - COPY_HEADROOM, frame_max), None);
        let detail = too_large_to_copy(limit - COPY_HEADROOM + 1, frame_max).expect("too large");
        assert!(detail.contains("too large to republish"), "{detail}");
        assert!(too_large_to_copy(limit + 8, frame_max).is_some());
        // The smallest frame_max RabbitMQ allows still takes a modest header.
        assert_eq!(too_large_to_copy(1000, 4096), None);
        assert!(too_large_to_copy(3000, 4096).is_some());
        assert_eq!(too_large_to_copy(usize::MAX / 2, 0), None, "no limit");
    }

    #[test]
    fn what_dead_lettering_added_is_not_the_producers() {
        let sent = with_headers(&[("pad", 100_000)]);
        let mut headers = sent.headers().clone().unwrap_or_default();
        for name in ["x-death", "x-first-death-queue", "x-last-death-reason"] {
            headers.insert(name.into(), long_string(&"d".repeat(300)));
        }
        let returned = sent.clone().with_headers(headers);
        assert!(content_header_len(&returned) > content_header_len(&sent) + 900);
        assert_eq!(producer_header_len(&returned), content_header_len(&sent));
        assert_eq!(producer_header_len(&sent), content_header_len(&sent));
    }

    #[test]
    fn a_copy_that_fits_is_unchanged() {
        let copy = with_headers(&[("x-aggregate-id", 3), ("pad", 1000)]);
        let (fitted, dropped) = fit(copy.clone(), 4096);
        assert_eq!(fitted, copy);
        assert_eq!(dropped, Dropped::default());
    }

    #[test]
    fn the_largest_producer_headers_go_until_the_copy_fits() {
        let copy = with_headers(&[
            ("x-aggregate-id", 3),
            ("big", 100_000),
            ("bigger", 120_000),
            ("small", 100),
            (parking_headers::STATUS, 16),
            (parking_headers::INBOX_KEY, 255),
            (parking_headers::ERROR, 4000),
        ]);
        let frame_max = 131_072;
        let (fitted, dropped) = fit(copy, frame_max);
        assert!(content_header_len(&fitted) <= frame_max as usize - 8);
        let headers = fitted.headers().clone().unwrap_or_default();
        let names: Vec<&str> = headers.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(
            names,
            vec![
                "big",
                "small",
                "x-aggregate-id",
                parking_headers::ERROR,
                parking_headers::HEADERS_DROPPED,
                parking_headers::INBOX_KEY,
                parking_headers::STATUS,
            ],
            "only the largest had to go"
        );
        assert_eq!(dropped.count, 1);
        assert_eq!(dropped.bytes, 1 + 6 + 1 + 4 + 120_000);
        let AMQPValue::FieldTable(note) = &headers.inner()[parking_headers::HEADERS_DROPPED] else {
            panic!("a table")
        };
        assert_eq!(note.inner()["count"], AMQPValue::LongLongInt(1));
        assert_eq!(note.inner()["bytes"], AMQPValue::LongLongInt(120_012));

        // On the smallest frame, every producer header goes, and the error text after them.
        let copy = with_headers(&[
            ("a", 1000),
            ("b", 1000),
            (parking_headers::STATUS, 16),
            (parking_headers::ERROR, 4000),
        ]);
        let (fitted, dropped) = fit(copy, 4096);
        assert!(content_header_len(&fitted) <= 4096 - 8);
        let headers = fitted.headers().clone().unwrap_or_default();
        let names: Vec<&str> = headers.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(
            names,
            vec![parking_headers::HEADERS_DROPPED, parking_headers::STATUS]
        );
        assert_eq!(dropped.count, 3);
    }
}
