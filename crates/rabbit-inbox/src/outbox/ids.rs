//! Identities of emitted messages: deterministic message ids for what a handler emits, and the
//! W3C trace context a message carries on.

use uuid::Uuid;

/// Namespace of the name-based (version 5) ids of emitted messages.
const EMITTED_NAMESPACE: Uuid = Uuid::from_u128(0x6f1c_2f0e_8a4b_4c1d_9e52_7b0d_3a41_c8e5);

/// The id of the `position`-th message (0-based) a handler emits for the incoming message
/// `incoming_key` as consumer `consumer`: a UUID v5 over the three. A forced replay of the
/// incoming message emits the same ids again, so the downstream inbox dedups them.
pub fn emitted_message_id(consumer: &str, incoming_key: &str, position: u32) -> String {
    let mut name = Vec::with_capacity(consumer.len() + incoming_key.len() + 12);
    name.extend_from_slice(consumer.as_bytes());
    name.push(0);
    name.extend_from_slice(incoming_key.as_bytes());
    name.push(0);
    name.extend_from_slice(position.to_string().as_bytes());
    Uuid::new_v5(&EMITTED_NAMESPACE, &name).to_string()
}

/// A random id (UUID v4) for a message enqueued outside a handler without an id of its own.
pub(crate) fn random_message_id() -> String {
    Uuid::new_v4().to_string()
}

/// The `traceparent` of a message emitted while handling one that carried `incoming`: the same
/// trace id and flags, a new parent id (the emitting operation). `None` if `incoming` is not a
/// version-00 W3C traceparent.
pub(crate) fn child_traceparent(incoming: &str) -> Option<String> {
    let mut parts = incoming.split('-');
    let (version, trace_id, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    if parts.next().is_some()
        || version != "00"
        || !hex(trace_id, 32)
        || !hex(parent, 16)
        || !hex(flags, 2)
        || trace_id.bytes().all(|b| b == b'0')
    {
        return None;
    }
    let span = loop {
        let bytes = Uuid::new_v4().into_bytes();
        // A span id of all zeros is invalid.
        if bytes[..8].iter().any(|&b| b != 0) {
            break hex::encode(&bytes[..8]);
        }
    };
    Some(format!(
        "00-{}-{span}-{}",
        trace_id.to_ascii_lowercase(),
        flags.to_ascii_lowercase()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emitted_ids_are_deterministic_and_distinct() {
        let a = emitted_message_id("order-service", "m-1", 0);
        assert_eq!(a, emitted_message_id("order-service", "m-1", 0));
        assert_ne!(a, emitted_message_id("order-service", "m-1", 1));
        assert_ne!(a, emitted_message_id("shipping", "m-1", 0));
        assert_ne!(a, emitted_message_id("order-service", "m-2", 0));
        // The separator keeps ("a", "b\0c") and ("a\0b", "c") apart.
        assert_ne!(
            emitted_message_id("a", "bc", 0),
            emitted_message_id("ab", "c", 0)
        );
        assert_eq!(
            Uuid::parse_str(&a).map(|u| u.get_version_num()).ok(),
            Some(5)
        );
    }

    #[test]
    fn child_traceparent_keeps_the_trace_and_takes_a_new_parent() {
        let incoming = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let child = child_traceparent(incoming).expect("valid");
        assert!(child.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
        assert!(child.ends_with("-01"));
        assert_eq!(child.len(), incoming.len());
        assert_ne!(child, incoming);
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e473z-00f067aa0ba902b7-01",
        ] {
            assert_eq!(child_traceparent(bad), None, "{bad}");
        }
    }
}
