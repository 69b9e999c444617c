//! Header values nested as deep as a frame allows. RabbitMQ accepts a content header up to the
//! negotiated `frame_max` however deep its field tables and arrays nest; parsed recursively,
//! such a header overflows the stack of lapin's I/O thread and aborts the process, and every
//! instance it is redelivered to after it. Each deep message is published here as raw frames
//! (an AMQP client would have to build and encode the deep value first), at the largest depth
//! that fits in `frame_max`, and must end parked as `headers_too_deep` with an inbox row while
//! the consumer keeps running.

// Shared with the other integration tests; not every helper is used here.
#[allow(dead_code)]
mod util;

use std::{
    io::{Read, Write},
    net::TcpStream,
    time::Duration,
};

use rabbit_inbox::{AmqpMessage, HEADER_TOO_DEEP, InboxStatus, MAX_HEADER_DEPTH, parking_headers};
use serde_json::Value;
use util::{TestEnv, amqp_url, header, thing};

/// Where and as whom the raw publisher connects, from the test AMQP URL.
struct Endpoint {
    address: String,
    user: String,
    password: String,
    vhost: String,
}

fn endpoint() -> Endpoint {
    let url = amqp_url();
    let rest = url.strip_prefix("amqp://").expect("an amqp:// URL");
    let (credentials, rest) = rest.split_once('@').unwrap_or(("guest:guest", rest));
    let (user, password) = credentials.split_once(':').unwrap_or((credentials, ""));
    let (address, vhost) = rest.split_once('/').unwrap_or((rest, ""));
    let vhost = match vhost.replace("%2f", "/").replace("%2F", "/") {
        v if v.is_empty() => "/".to_owned(),
        v => v,
    };
    let address = if address.contains(':') {
        address.to_owned()
    } else {
        format!("{address}:5672")
    };
    Endpoint {
        address,
        user: user.to_owned(),
        password: password.to_owned(),
        vhost,
    }
}

fn short_string(s: &str) -> Vec<u8> {
    let len = u8::try_from(s.len()).expect("a short string");
    [&[len][..], s.as_bytes()].concat()
}

fn long_bytes(b: &[u8]) -> Vec<u8> {
    let len = u32::try_from(b.len()).expect("fits");
    [&len.to_be_bytes()[..], b].concat()
}

fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&long_bytes(payload));
    f.push(0xce);
    f
}

fn method(channel: u16, class: u16, id: u16, args: &[u8]) -> Vec<u8> {
    let payload = [&class.to_be_bytes()[..], &id.to_be_bytes(), args].concat();
    frame(1, channel, &payload)
}

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

    /// The content header frame's payload: basic class, body size, and the properties
    /// content-type, headers (`deep`, then `x-aggregate-id`), delivery-mode and message-id.
    fn content_header(&self) -> Vec<u8> {
        let flags: u16 = (1 << 15) | (1 << 13) | (1 << 12) | (1 << 7);
        let headers = [
            &short_string("deep")[..],
            &self.nesting.value(self.levels),
            &short_string("x-aggregate-id"),
            b"S",
            &long_bytes(b"o-1"),
        ]
        .concat();
        let body_len = u64::try_from(self.body().len()).expect("fits");
        [
            &60u16.to_be_bytes()[..],
            &0u16.to_be_bytes(),
            &body_len.to_be_bytes(),
            &flags.to_be_bytes(),
            &short_string("application/json"),
            &long_bytes(&headers),
            &[2],
            &short_string(&self.id),
        ]
        .concat()
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

/// A bare AMQP 0-9-1 connection with one confirm-mode channel, speaking raw frames.
struct RawPublisher {
    stream: TcpStream,
    frame_max: usize,
}

impl RawPublisher {
    fn connect() -> Self {
        let e = endpoint();
        let stream = TcpStream::connect(&e.address).expect("RabbitMQ is reachable");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut p = RawPublisher {
            stream,
            frame_max: 0,
        };
        p.send(b"AMQP\x00\x00\x09\x01");
        p.expect_method(10, 10); // connection.start
        let response = format!("\0{}\0{}", e.user, e.password);
        let start_ok = [
            &long_bytes(b"")[..],
            &short_string("PLAIN"),
            &long_bytes(response.as_bytes()),
            &short_string("en_US"),
        ]
        .concat();
        p.send(&method(0, 10, 11, &start_ok));
        let tune = p.expect_method(10, 30);
        let channel_max = u16::from_be_bytes([tune[0], tune[1]]);
        let frame_max = u32::from_be_bytes([tune[2], tune[3], tune[4], tune[5]]);
        p.frame_max = usize::try_from(frame_max).expect("fits");
        let tune_ok = [
            &channel_max.to_be_bytes()[..],
            &frame_max.to_be_bytes(),
            &0u16.to_be_bytes(),
        ]
        .concat();
        p.send(&method(0, 10, 31, &tune_ok));
        let open = [&short_string(&e.vhost)[..], &short_string(""), &[0]].concat();
        p.send(&method(0, 10, 40, &open));
        p.expect_method(10, 41);
        p.send(&method(1, 20, 10, &short_string("")));
        p.expect_method(20, 11);
        p.send(&method(1, 85, 10, &[0])); // confirm.select
        p.expect_method(85, 11);
        p
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write to RabbitMQ");
    }

    /// The next frame: (type, payload).
    fn read_frame(&mut self) -> (u8, Vec<u8>) {
        let mut head = [0u8; 7];
        self.stream.read_exact(&mut head).expect("a frame");
        let len = u32::from_be_bytes([head[3], head[4], head[5], head[6]]);
        let mut payload = vec![0u8; usize::try_from(len).expect("fits") + 1];
        self.stream.read_exact(&mut payload).expect("a frame body");
        payload.pop();
        (head[0], payload)
    }

    /// Reads up to the next method frame, which must be `class.id`; returns its arguments.
    fn expect_method(&mut self, class: u16, id: u16) -> Vec<u8> {
        loop {
            let (kind, payload) = self.read_frame();
            if kind != 1 {
                continue;
            }
            let got = (
                u16::from_be_bytes([payload[0], payload[1]]),
                u16::from_be_bytes([payload[2], payload[3]]),
            );
            assert_eq!(
                got,
                (class, id),
                "unexpected method: {:?}",
                String::from_utf8_lossy(&payload)
            );
            return payload[4..].to_vec();
        }
    }

    /// Publishes `m` to `queue` through the default exchange and waits for the broker's
    /// confirm.
    fn publish(&mut self, queue: &str, m: &DeepMessage) {
        let header = frame(2, 1, &m.content_header());
        assert!(header.len() <= self.frame_max, "header frame too large");
        let publish = [
            &0u16.to_be_bytes()[..],
            &short_string(""),
            &short_string(queue),
            &[0],
        ]
        .concat();
        let bytes = [method(1, 60, 40, &publish), header, frame(3, 1, &m.body())].concat();
        self.send(&bytes);
        self.expect_method(60, 80); // basic.ack
    }

    fn close(mut self) {
        let close = [
            &200u16.to_be_bytes()[..],
            &short_string("bye"),
            &[0, 0, 0, 0],
        ]
        .concat();
        self.send(&method(0, 10, 50, &close));
        self.expect_method(10, 51);
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
        for m in &deep {
            publisher.publish(&queue, m);
        }
        // At the bound: accepted.
        publisher.publish(
            &queue,
            &DeepMessage {
                id: "at-the-bound".into(),
                nesting: Nesting::Arrays,
                levels: MAX_HEADER_DEPTH - 1,
            },
        );
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
