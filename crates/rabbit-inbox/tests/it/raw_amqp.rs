//! A bare AMQP 0-9-1 publisher speaking raw frames over a `TcpStream`, for messages an AMQP
//! client would refuse to build or send: header values nested as deep as a frame allows,
//! content header frames at and past the size limits.

use std::{
    io::{Read, Write},
    net::TcpStream,
    time::Duration,
};

use inbox_testkit::amqp_url;

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

pub(crate) fn short_string(s: &str) -> Vec<u8> {
    let len = u8::try_from(s.len()).expect("a short string");
    [&[len][..], s.as_bytes()].concat()
}

pub(crate) fn long_bytes(b: &[u8]) -> Vec<u8> {
    let len = u32::try_from(b.len()).expect("fits");
    [&len.to_be_bytes()[..], b].concat()
}

/// A frame: type, channel, payload length, payload, frame end. 8 bytes more than `payload`.
pub(crate) fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
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

/// Property flags of [`content_header`]: content-type, headers, delivery-mode, message-id.
const FLAGS: u16 = (1 << 15) | (1 << 13) | (1 << 12) | (1 << 7);

/// A content header frame's payload: basic class, `body_len`, and the properties content-type
/// `application/json`, `headers` (an encoded field table's entries, without its length
/// prefix), delivery-mode 2 and `message_id`.
pub(crate) fn content_header(message_id: &str, headers: &[u8], body_len: usize) -> Vec<u8> {
    let body_len = u64::try_from(body_len).expect("fits");
    [
        &60u16.to_be_bytes()[..],
        &0u16.to_be_bytes(),
        &body_len.to_be_bytes(),
        &FLAGS.to_be_bytes(),
        &short_string("application/json"),
        &long_bytes(headers),
        &[2],
        &short_string(message_id),
    ]
    .concat()
}

/// A bare AMQP 0-9-1 connection with one confirm-mode channel, speaking raw frames.
pub(crate) struct RawPublisher {
    stream: TcpStream,
    /// The broker's `frame_max`, accepted as is.
    pub(crate) frame_max: usize,
}

/// Why the broker did not confirm a publish: it closed the connection (class 10, method 50)
/// with this reply text.
#[derive(Debug)]
pub(crate) struct Refused(pub(crate) String);

impl RawPublisher {
    pub(crate) fn connect() -> Self {
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
        p.expect_method(10, 10).expect("connection.start"); // connection.start
        let response = format!("\0{}\0{}", e.user, e.password);
        let start_ok = [
            &long_bytes(b"")[..],
            &short_string("PLAIN"),
            &long_bytes(response.as_bytes()),
            &short_string("en_US"),
        ]
        .concat();
        p.send(&method(0, 10, 11, &start_ok));
        let tune = p.expect_method(10, 30).expect("connection.tune");
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
        p.expect_method(10, 41).expect("connection.open-ok");
        p.send(&method(1, 20, 10, &short_string("")));
        p.expect_method(20, 11).expect("channel.open-ok");
        p.send(&method(1, 85, 10, &[0])); // confirm.select
        p.expect_method(85, 11).expect("confirm.select-ok");
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
    /// A `connection.close` instead is the broker's refusal.
    fn expect_method(&mut self, class: u16, id: u16) -> Result<Vec<u8>, Refused> {
        loop {
            let (kind, payload) = self.read_frame();
            if kind != 1 {
                continue;
            }
            let got = (
                u16::from_be_bytes([payload[0], payload[1]]),
                u16::from_be_bytes([payload[2], payload[3]]),
            );
            if got == (10, 50) {
                // reply-code (2 bytes), reply-text (short string), ...
                let len = usize::from(payload[6]);
                let text = String::from_utf8_lossy(&payload[7..7 + len]).into_owned();
                return Err(Refused(text));
            }
            assert_eq!(
                got,
                (class, id),
                "unexpected method: {:?}",
                String::from_utf8_lossy(&payload)
            );
            return Ok(payload[4..].to_vec());
        }
    }

    /// Publishes a content header frame with payload `header` and `body` to `queue` through
    /// the default exchange, and waits for the broker's confirm. No size check: the broker
    /// decides.
    pub(crate) fn publish(
        &mut self,
        queue: &str,
        header: &[u8],
        body: &[u8],
    ) -> Result<(), Refused> {
        let publish = [
            &0u16.to_be_bytes()[..],
            &short_string(""),
            &short_string(queue),
            &[0],
        ]
        .concat();
        let bytes = [
            method(1, 60, 40, &publish),
            frame(2, 1, header),
            frame(3, 1, body),
        ]
        .concat();
        self.send(&bytes);
        self.expect_method(60, 80).map(drop) // basic.ack
    }

    pub(crate) fn close(mut self) {
        let close = [
            &200u16.to_be_bytes()[..],
            &short_string("bye"),
            &[0, 0, 0, 0],
        ]
        .concat();
        self.send(&method(0, 10, 50, &close));
        self.expect_method(10, 51).expect("connection.close-ok");
    }
}
