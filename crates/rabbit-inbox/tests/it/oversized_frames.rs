//! Content header frames at the size limits. RabbitMQ (3.10.8, `frame_max` 131,072) accepts a
//! content header frame whose PAYLOAD is up to `frame_max` bytes, so up to `frame_max + 8`
//! bytes on the wire with the frame's 7-byte header and end octet, and closes the producer's
//! connection with `FRAME_ERROR` beyond (measured with this file's raw publisher: a payload of
//! 131,072 bytes is confirmed, one of 131,073 refused as `{frame_too_large,131073,131064}`).
//! Dead-lettering then adds `x-death` headers: such a message comes out of a retry tier as a
//! frame of 131,409 bytes. The published lapin refused any frame over `frame_max` bytes in all
//! (`FRAME-ERROR: frame too large`), so each of these messages closed the consumer's
//! connection, came back first on the next one, and stopped the queue for good. With
//! `forks/lapin` each is parked under its own message id as `headers_too_large`, its parked
//! copy without the oversized headers, and the queue goes on.
//!
//! The messages are written as raw frames: lapin, as a producer, does not check the size of
//! the header frame it sends, but the exact sizes are easiest to build by hand.

// Shared with the other integration tests; not every helper is used here.

use crate::raw_amqp::{RawPublisher, content_header, long_bytes, short_string};
use inbox_ops::{
    Actor, NoProgress, Operations,
    redrive::{ParkedAction, RedriveRequest},
};
use inbox_testkit::env::{TestEnv, amqp_url, header, thing};
use rabbit_inbox::{InboxStatus, Topology, envelope::AmqpMessage, status::parking_headers};

/// A message whose content header frame is exactly `frame_len` bytes on the wire: a small
/// `x-aggregate-id` header and a `pad` header that takes up the rest.
struct Sized {
    id: String,
    frame_len: usize,
}

impl Sized {
    /// Named after its frame's size relative to `frame_max`: `header-frame-max+8`.
    fn new(frame_max: usize, frame_len: usize) -> Self {
        let offset =
            i64::try_from(frame_len).expect("fits") - i64::try_from(frame_max).expect("fits");
        Self {
            id: format!("header-frame-max{offset:+}"),
            frame_len,
        }
    }

    fn body(&self) -> Vec<u8> {
        format!(r#"{{"id":"{}","n":1}}"#, self.id).into_bytes()
    }

    fn headers(&self, pad: usize) -> Vec<u8> {
        [
            &short_string("x-aggregate-id")[..],
            b"S",
            &long_bytes(b"o-1"),
            &short_string("pad"),
            b"S",
            &long_bytes(&vec![b'p'; pad]),
        ]
        .concat()
    }

    /// The content header frame's payload: 8 bytes less than the frame.
    fn content_header(&self) -> Vec<u8> {
        let without_pad = content_header(&self.id, &self.headers(0), self.body().len()).len();
        let payload = content_header(
            &self.id,
            &self.headers(self.frame_len - 8 - without_pad),
            self.body().len(),
        );
        assert_eq!(payload.len() + 8, self.frame_len);
        payload
    }
}

/// Publishes one message per header frame size from `frame_max - 7` to `frame_max + 8` bytes
/// (all accepted), then one of `frame_max + 9` (refused by the broker, on a connection of its
/// own). Returns `frame_max` and the accepted messages.
async fn publish_boundary_sizes(topology: &Topology) -> (usize, Vec<Sized>) {
    let queue = topology.queue.clone();
    tokio::task::spawn_blocking(move || {
        let mut publisher = RawPublisher::connect();
        let frame_max = publisher.frame_max;
        let accepted: Vec<Sized> = (frame_max - 7..=frame_max + 8)
            .map(|len| Sized::new(frame_max, len))
            .collect();
        for m in &accepted {
            publisher
                .publish(&queue, &m.content_header(), &m.body())
                .unwrap_or_else(|e| panic!("{}: the broker accepts it, got {e:?}", m.id));
        }
        publisher.close();

        // A payload one byte over frame_max: the broker closes the producer's connection, and
        // the consumer never sees it.
        let beyond = Sized::new(frame_max, frame_max + 9);
        let refused = RawPublisher::connect()
            .publish(&queue, &beyond.content_header(), &beyond.body())
            .expect_err("the broker refuses a payload over frame_max");
        assert!(refused.0.contains("FRAME_ERROR"), "{refused:?}");
        (frame_max, accepted)
    })
    .await
    .expect("raw publisher")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_frames_at_the_size_limits_are_parked_under_their_own_id() {
    let env = TestEnv::new().await;
    let topology = env.topology("frames");
    let config = env.config("svc", topology.clone());
    env.declare(&config).await;

    let (frame_max, hostile) = publish_boundary_sizes(&topology).await;
    assert_eq!(hostile.len(), 16);
    // Published after the hostile messages: behind them in the queue.
    env.publish(&topology, &thing("after", 1)).await;

    let (handler, _plan) = env.handler();
    let running = env.start(config, handler);
    env.wait_for_record("svc", "after", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    assert_eq!(env.effects("after").await, 1);

    let parked = env.take_parked(&topology, 16).await;
    assert_eq!(parked.len(), 16, "each parked once");
    for m in &hostile {
        let copy: &AmqpMessage = parked
            .iter()
            .find(|p| p.message_id.as_deref() == Some(m.id.as_str()))
            .unwrap_or_else(|| panic!("{} is parked", m.id));
        assert_eq!(
            header(copy, parking_headers::INBOX_KEY),
            Some(m.id.as_str())
        );
        assert_eq!(
            header(copy, parking_headers::ERROR_CODE),
            Some("headers_too_large"),
            "{}",
            m.id
        );
        assert_eq!(
            header(copy, parking_headers::STATUS),
            Some("PERMANENT_FAILED")
        );
        // The copy could not carry the pad and still fit in a frame: it is dropped, and
        // noted with the size of the headers the producer sent.
        assert!(!copy.headers.contains_key("pad"), "{}", m.id);
        let dropped = &copy.headers[parking_headers::HEADERS_DROPPED];
        assert_eq!(dropped["count"], 1, "{}: {dropped}", m.id);
        assert!(
            dropped["bytes"].as_u64().expect("a size") > (frame_max as u64) - 200,
            "{}: {dropped}",
            m.id
        );
        assert_eq!(
            header(copy, "x-aggregate-id"),
            Some("o-1"),
            "small headers stay"
        );
        assert_eq!(copy.body, m.body(), "the body is parked unchanged");

        let row = env
            .record("svc", &m.id)
            .await
            .expect("a row under its own id");
        assert_eq!(row.status, InboxStatus::PermanentFailed);
        assert_eq!(row.last_error_code.as_deref(), Some("headers_too_large"));
        assert_eq!(row.delivery_count, 1, "{}: parked once, not looping", m.id);
        let error = row.last_error_message.unwrap_or_default();
        assert!(
            error.contains("too large to republish") && error.contains("omitted"),
            "{}: {error}",
            m.id
        );
    }
    assert!(env.record("svc", "header-frame-max+9").await.is_none());

    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.parking), (0, 0), "{depths:?}");
    let stats = running.stop().await;
    assert_eq!(stats.sessions, 1, "one session: never torn down");
    assert_eq!(stats.parked, 16);
    assert_eq!(stats.processed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_copy_without_its_oversized_headers_can_be_redriven() {
    let env = TestEnv::new().await;
    let topology = env.topology("frames-redrive");
    let config = env.config("svc", topology.clone());
    env.declare(&config).await;
    let queue = topology.queue.clone();
    let largest = tokio::task::spawn_blocking(move || {
        let mut publisher = RawPublisher::connect();
        let largest = Sized::new(publisher.frame_max, publisher.frame_max + 8);
        publisher
            .publish(&queue, &largest.content_header(), &largest.body())
            .expect("accepted");
        publisher.close();
        largest
    })
    .await
    .expect("raw publisher");

    let (handler, _plan) = env.handler();
    let running = env.start(config, handler);
    env.wait_for_record("svc", &largest.id, "parked", |r| {
        r.status == InboxStatus::PermanentFailed
    })
    .await;
    inbox_testkit::env::wait_for("the parked copy", async || {
        env.depths(&topology).await.parking == 1
    })
    .await;

    // The operator accepts the message without the headers the copy could not carry.
    let ops = Operations::new(env.pool.clone(), env.schema.clone());
    let lot = rabbit_inbox::broker::ParkingLot::connect(
        &amqp_url(),
        &topology.queue,
        &topology.parking_queue,
    )
    .await
    .expect("parking lot");
    let actor = Actor::new("alice", "headers not needed").expect("valid actor");
    let done = ops
        .redrive(&lot, &RedriveRequest::default(), Some(&actor), &NoProgress)
        .await
        .expect("redrive");
    lot.close().await;
    assert_eq!(done.action(ParkedAction::Moved), 1, "{done:#?}");
    env.wait_for_record("svc", &largest.id, "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    assert_eq!(env.effects(&largest.id).await, 1);
    let depths = env.depths(&topology).await;
    assert_eq!((depths.work, depths.parking), (0, 0), "{depths:?}");
    let stats = running.stop().await;
    assert_eq!(stats.sessions, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_the_broker_grows_past_frame_max_while_dead_lettering_is_parked() {
    let env = TestEnv::new().await;
    let topology = env.topology("frames-grown");
    let config = env.config("svc", topology.clone());
    env.declare(&config).await;
    // Through the first retry tier: its TTL dead-letters the message to the work queue, and
    // the broker adds its x-death headers to a header that already fills the frame.
    let tier = topology.retry_tier_queues(&config.retry)[0].clone();
    let largest = tokio::task::spawn_blocking(move || {
        let mut publisher = RawPublisher::connect();
        let largest = Sized::new(publisher.frame_max, publisher.frame_max + 8);
        publisher
            .publish(&tier, &largest.content_header(), &largest.body())
            .expect("accepted");
        publisher.close();
        largest
    })
    .await
    .expect("raw publisher");
    env.publish(&topology, &thing("after", 1)).await;

    let (handler, _plan) = env.handler();
    let running = env.start(config, handler);
    env.wait_for_record("svc", &largest.id, "parked", |r| {
        r.status == InboxStatus::PermanentFailed
    })
    .await;
    env.wait_for_record("svc", "after", "processed", |r| {
        r.status == InboxStatus::Processed
    })
    .await;
    let parked = env.take_parked(&topology, 1).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(
        header(&parked[0], parking_headers::ERROR_CODE),
        Some("headers_too_large")
    );
    let stats = running.stop().await;
    assert_eq!(stats.sessions, 1, "one session: never torn down");
}
