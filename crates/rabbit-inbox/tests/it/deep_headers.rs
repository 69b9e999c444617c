//! Header values nested as deep as a frame allows. RabbitMQ accepts a content header up to the
//! negotiated `frame_max` however deep its field tables and arrays nest; parsed recursively,
//! such a header overflows the stack of lapin's I/O thread and aborts the process, and every
//! instance it is redelivered to after it. Each deep message is published here as raw frames
//! (an AMQP client would have to build and encode the deep value first), at the largest depth
//! that fits in `frame_max`, and must end parked as `headers_too_deep` with an inbox row while
//! the consumer keeps running.

// Shared with the other integration tests; not every helper is used here.

// Shared with oversized_frames.rs; not every helper is used here.

use crate::raw_amqp::{RawPublisher, content_header, frame, long_bytes, short_string};
use inbox_testkit::env::{TestEnv, header, thing};
use rabbit_inbox::{
    InboxStatus, envelope::AmqpMessage, envelope::HEADER_TOO_DEEP, envelope::MAX_HEADER_DEPTH,
    status::parking_headers,
};
use serde_json::Value;

/// How the deep header nests.
#[derive(Clone, Copy, Debug)]
enum Nesting {
    /// Field arrays of one element: 5 bytes a level, the deepest per byte.
    Arrays,
    /// Field tables of one entry with an empty name: 6 bytes a level.
    Tables,
}

impl Nesting {
    fn bytes_per_level(self) -> usize {
        match self {
            Nesting::Arrays => 5,
            Nesting::Tables => 6,
        }
    }

    /// A field value: `levels` arrays or tables nested in one another around a void.
    fn value(self, levels: usize) -> Vec<u8> {
        let mut value = vec![b'V'];
        for _ in 0..levels {
            value = match self {
                Nesting::Arrays => [&[b'A'][..], &long_bytes(&value)].concat(),
                Nesting::Tables => {
                    [&[b'F'][..], &long_bytes(&[&[0u8][..], &value].concat())].concat()
                }
            };
        }
        value
    }
}

/// A message whose header `deep` nests `levels` tables or arrays below the headers table.
struct DeepMessage {
    id: String,
    nesting: Nesting,
    levels: usize,
}

impl DeepMessage {
    fn body(&self) -> Vec<u8> {
        format!(r#"{{"id":"{}","n":1}}"#, self.id).into_bytes()
    }

    /// The content header frame's payload: the headers `deep`, then `x-aggregate-id`.
    fn content_header(&self) -> Vec<u8> {
        let headers = [
            &short_string("deep")[..],
            &self.nesting.value(self.levels),
            &short_string("x-aggregate-id"),
            b"S",
            &long_bytes(b"o-1"),
        ]
        .concat();
        content_header(&self.id, &headers, self.body().len())
    }

    /// The deepest nesting whose content header frame still fits in `frame_max`.
    fn deepest(id: &str, nesting: Nesting, frame_max: usize) -> Self {
        let frame_len = |levels| {
            let m = DeepMessage {
                id: id.to_owned(),
                nesting,
                levels,
            };
            frame(2, 1, &m.content_header()).len()
        };
        let levels = (frame_max - frame_len(0)) / nesting.bytes_per_level();
        assert!(frame_len(levels) <= frame_max);
        assert!(frame_len(levels + 1) > frame_max, "not the deepest");
        DeepMessage {
            id: id.to_owned(),
            nesting,
            levels,
        }
    }
}

/// Levels of arrays and objects down the first entries of header `deep`, the headers object
/// included, and the value at the bottom. Iterative: the value may be deep.
fn depth_of_deep(m: &AmqpMessage) -> (usize, Value) {
    let mut levels = 1;
    let mut v = m.headers.get("deep").expect("header deep is kept");
    loop {
        let next = match v {
            Value::Array(a) => a.first(),
            Value::Object(o) => o.values().next(),
            _ => None,
        };
        match next {
            Some(n) => {
                levels += 1;
                v = n;
            }
            None => {
                return (
                    levels + usize::from(v.is_array() || v.is_object()),
                    v.clone(),
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_nesting_as_deep_as_a_frame_allows_is_parked_and_the_consumer_survives() {
    let env = TestEnv::new().await;
    let topology = env.topology("deep");
    let config = env.config("svc", topology.clone());
    env.declare(&config).await;

    let queue = topology.queue.clone();
    let (frame_max, deep) = tokio::task::spawn_blocking(move || {
        let mut publisher = RawPublisher::connect();
        let frame_max = publisher.frame_max;
        let deep = [
            DeepMessage::deepest("deep-arrays", Nesting::Arrays, frame_max),
            DeepMessage::deepest("deep-tables", Nesting::Tables, frame_max),
            // Parsed in full by any client, but one level past the bound.
            DeepMessage {
                id: "past-the-bound".into(),
                nesting: Nesting::Tables,
                levels: MAX_HEADER_DEPTH,
            },
        ];
        // At the bound: accepted.
        let at_the_bound = DeepMessage {
            id: "at-the-bound".into(),
            nesting: Nesting::Arrays,
            levels: MAX_HEADER_DEPTH - 1,
        };
        for m in deep.iter().chain([&at_the_bound]) {
            publisher
                .publish(&queue, &m.content_header(), &m.body())
                .expect("confirmed");
        }
        publisher.close();
        (frame_max, deep)
    })
    .await
    .expect("raw publisher");
    assert!(frame_max >= 4096, "frame_max {frame_max}");
    assert!(
        deep[0].levels > 20_000,
        "the default frame_max holds over 20,000 nested arrays, got {}",
        deep[0].levels
    );

    let (handler, _plan) = env.handler();
    let running = env.start(config, handler);

    let parked = env.take_parked(&topology, 3).await;
    assert_eq!(parked.len(), 3);
    for m in &deep {
        let copy = parked
            .iter()
            .find(|p| p.message_id.as_deref() == Some(m.id.as_str()))
            .unwrap_or_else(|| panic!("{} is parked", m.id));
        assert_eq!(
            header(copy, parking_headers::ERROR_CODE),
            Some("headers_too_deep"),
            "{}",
            m.id
        );
        assert_eq!(
            header(copy, parking_headers::STATUS),
            Some("PERMANENT_FAILED")
        );
        let error = header(copy, parking_headers::ERROR).expect("a reason");
        assert!(
            error.contains(&MAX_HEADER_DEPTH.to_string()) && error.contains("\"deep\""),
            "{error}"
        );
        // The copy keeps the headers up to the bound, the marker in place of the rest.
        assert_eq!(
            depth_of_deep(copy),
            (MAX_HEADER_DEPTH, Value::String(HEADER_TOO_DEEP.into())),
            "{}",
            m.id
        );
        assert_eq!(header(copy, "x-aggregate-id"), Some("o-1"));
        assert_eq!(copy.body, m.body(), "the body is parked unchanged");

        let key = header(copy, parking_headers::INBOX_KEY).expect("inbox key");
        assert_eq!(key, m.id, "recorded under its own message id");
        let row = env.record("svc", key).await.expect("an inbox row");
        assert_eq!(row.status, InboxStatus::PermanentFailed);
        assert_eq!(row.last_error_code.as_deref(), Some("headers_too_deep"));
        assert_eq!(row.delivery_count, 1, "parked once, not looping");
    }

    env.wait_for_record("svc", "at-the-bound", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;

    // Still consuming: a normal message published afterwards is processed.
    env.publish(&topology, &thing("after", 1)).await;
    env.wait_for_record("svc", "after", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    assert_eq!(env.effects("after").await, 1);
    assert_eq!(env.effects("at-the-bound").await, 1);

    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.parking), (0, 0), "{depths:?}");
    let stats = running.stop().await;
    assert_eq!(stats.sessions, 1, "one session: never torn down");
    assert_eq!(stats.parked, 3);
}
