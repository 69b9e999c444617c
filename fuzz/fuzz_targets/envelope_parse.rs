//! Arbitrary deliveries through `parse`, under every dedup strategy.

#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use rabbit_inbox::AmqpMessage;
use rabbit_inbox_fuzz::{Body, ContentType, Json, Name, check, rule_sets, to_map};

#[derive(Debug, Arbitrary)]
struct Input {
    message_id: Option<String>,
    kind: Option<String>,
    content_type: Option<ContentType>,
    correlation_id: Option<String>,
    headers: Vec<(Name, Json)>,
    body: Body,
    redelivered: bool,
    /// Name for the header strategy and pointers for the payload strategy.
    header: String,
    pointers: Vec<String>,
}

fuzz_target!(|input: Input| {
    let msg = AmqpMessage {
        message_id: input.message_id,
        kind: input.kind,
        content_type: input.content_type.map(|c| c.0),
        correlation_id: input.correlation_id,
        headers: to_map(&input.headers),
        headers_truncated: None,
        body: input.body.to_bytes(),
        redelivered: input.redelivered,
    };
    for rules in rule_sets(&input.header, &input.pointers) {
        check(&msg, &rules);
    }
});
