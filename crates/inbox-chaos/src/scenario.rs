//! A realistic message stream for the example service: orders with payments, exact and logical
//! duplicates, payments that arrive before their order, cancellations, and poison messages;
//! optionally hostile inputs (see [`Hostile`]). Deterministic for a seed, so a run can be
//! replayed.

use order_service::messages::{
    order_cancelled, order_placed, order_step, payment_received, routing_key,
};
use std::collections::{HashMap, HashSet};

use rabbit_inbox::{
    broker::OutgoingMessage,
    envelope::{
        self, AGGREGATE_ID_HEADER, AmqpMessage, CAUSATION_HEADER, EnvelopeRules, TENANT_HEADER,
        TRACEPARENT_HEADER, TYPE_HEADER, VERSION_HEADER,
    },
};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use serde_json::Value;

/// Levels of the deep header: past the consumer's bound of 64 levels, and shallow enough for
/// the AMQP client's encoder, which recurses, to publish from this process's default thread
/// stack. (The deepest header a frame allows is the library's own integration test, which
/// writes raw frames.)
pub const DEEP_HEADER_LEVELS: usize = 100;

/// Bytes of each oversized producer field: past PostgreSQL's B-tree row limit (about 2.7 KB).
const OVERSIZED_FIELD_BYTES: usize = 5_000;

/// Per-message TTL of the expiring poison messages, in milliseconds.
pub const EXPIRATION_MS: u64 = 20_000;

/// Orders per burst of back-to-back duplicates ([`Hostile::DuplicateBursts`]), one at a
/// random point of each such stretch of the stream.
const BURST_EVERY: usize = 100;

/// Orders per repeated invalid message ([`Hostile::RepeatedInvalid`]).
const REPEAT_EVERY: usize = 200;

/// Orders per valid payment followed by an invalid copy ([`Hostile::ValidThenInvalid`]).
const PAIR_EVERY: usize = 200;

/// Hostile inputs the stream (or the run) can carry on top of the ordinary stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Hostile {
    /// A header nested 100 arrays deep: parked as `headers_too_deep`.
    DeepHeaders,
    /// A 5 KB incompressible `x-aggregate-id`, alone and with long causation, tenant,
    /// traceparent and type headers and a 255-byte correlation id: parked with a row.
    OversizedFields,
    /// Permanently failing messages with a per-message TTL (`expiration`): their parked copies
    /// must outlive it in the parking lot.
    Expiration,
    /// A non-JSON body and an unsupported `x-message-version` under the ids of valid messages:
    /// parked as payload conflicts, the valid messages' effects and rows unchanged.
    InvalidCopies,
    /// Every consumer process starts at the same instant on a fresh schema (no stream input).
    SimultaneousStart,
    /// A message the handler refuses permanently, published 2 or 3 times back to back (some
    /// once more at the end of the stream): one parked copy, the others acked as its
    /// duplicates and counted on the row.
    DuplicateBursts,
    /// A non-JSON body under an id, and an identical message without an id (one synthetic
    /// key), each published several times: one parked row and copy, every copy counted.
    RepeatedInvalid,
    /// A valid payment followed at once by an invalid copy under its id: the payment applied
    /// once, the copy parked as a payload conflict.
    ValidThenInvalid,
}

#[cfg(test)]
impl Hostile {
    /// Every kind.
    pub const ALL: [Hostile; 8] = [
        Hostile::DeepHeaders,
        Hostile::OversizedFields,
        Hostile::Expiration,
        Hostile::InvalidCopies,
        Hostile::SimultaneousStart,
        Hostile::DuplicateBursts,
        Hostile::RepeatedInvalid,
        Hostile::ValidThenInvalid,
    ];
}

/// One message to publish.
#[derive(Debug)]
pub struct Published {
    /// Where to.
    pub routing_key: String,
    /// What.
    pub message: OutgoingMessage,
    /// AMQP `expiration` (per-message TTL, milliseconds), if any.
    pub expiration: Option<String>,
}

impl Drop for Published {
    /// Headers are taken apart iteratively: dropping a deeply nested JSON value recursively
    /// would overflow the stack.
    fn drop(&mut self) {
        let mut values: Vec<Value> = std::mem::take(&mut self.message.headers)
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        while let Some(v) = values.pop() {
            match v {
                Value::Array(a) => values.extend(a),
                Value::Object(o) => values.extend(o.into_iter().map(|(_, v)| v)),
                _ => {}
            }
        }
    }
}

/// A hostile message of the stream and the outcome it must have.
#[derive(Debug)]
pub struct HostileMessage {
    /// What is wrong with it.
    pub kind: Hostile,
    /// Its AMQP message id (the parked copy keeps it).
    pub message_id: String,
    /// Parked as a payload conflict without a row of its own, rather than parked with a row.
    pub conflict: bool,
}

/// What the database must show once the stream is consumed.
#[derive(Debug, Default)]
pub struct Expected {
    /// Orders created.
    pub orders: i64,
    /// Payments applied (one row each).
    pub payments: i64,
    /// Inbox rows parked (PERMANENT_FAILED or POISONED).
    pub parked_rows: i64,
    /// Copies parked without a row of their own (same id, other body).
    pub conflicts: i64,
}

/// The generated stream and what consuming it must leave in the database.
#[derive(Debug)]
pub struct Scenario {
    /// The messages, in publishing order.
    pub messages: Vec<Published>,
    /// Distinct inbox keys (including the synthetic keys of id-less messages).
    pub unique_keys: usize,
    /// Exact duplicates injected (same id, same body).
    pub duplicates: usize,
    /// Payments published before their order.
    pub out_of_order: usize,
    /// The database's expected state.
    pub expected: Expected,
    /// A payment whose commit is followed by a dropped connection (crash before ack).
    pub crash_after_commit_of: String,
    /// The hostile messages in the stream.
    pub hostile: Vec<HostileMessage>,
}

impl Scenario {
    /// The ordinary stream, without hostile inputs.
    pub fn generate(orders: usize, seed: u64) -> Self {
        Self::generate_with(orders, seed, &[])
    }

    /// The stream with the `hostile` inputs added; the ordinary part is the same as without.
    pub fn generate_with(orders: usize, seed: u64, hostile: &[Hostile]) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        // Hostile material from a stream of its own, so the ordinary part does not depend on it.
        let mut hostile_rng = StdRng::seed_from_u64(seed ^ 0x4057_11e5);
        let wants = |kind: Hostile| hostile.contains(&kind);
        let run = format!("{seed:016x}");
        let mut s = Scenario {
            messages: Vec::new(),
            unique_keys: 0,
            duplicates: 0,
            out_of_order: 0,
            expected: Expected::default(),
            crash_after_commit_of: String::new(),
            hostile: Vec::new(),
        };
        // Hostile ids count on their own, so the ordinary ids do not shift with them.
        let mut hostile_n = 0u64;
        let mut hostile_id = |kind: &str| {
            hostile_n += 1;
            format!("{run}-hostile-{kind}-{hostile_n}")
        };
        let mut id = 0u64;
        let mut next_id = |kind: &str| {
            id += 1;
            format!("{run}-{kind}-{id}")
        };
        let mut late = Vec::new();
        // Repeated and paired inputs, at seeded points of the ordinary stream: from a generator
        // of their own, so neither the ordinary part nor the other hostile material shifts.
        let mut mix_rng = StdRng::seed_from_u64(seed ^ 0x0b57_a11e);
        let bursts_at = spots(
            &mut mix_rng,
            orders,
            BURST_EVERY,
            wants(Hostile::DuplicateBursts),
        );
        let repeats_at = spots(
            &mut mix_rng,
            orders,
            REPEAT_EVERY,
            wants(Hostile::RepeatedInvalid),
        );
        let pairs_at = spots(
            &mut mix_rng,
            orders,
            PAIR_EVERY,
            wants(Hostile::ValidThenInvalid),
        );
        let (mut bursts, mut repeats, mut pairs) = (0usize, 0usize, 0usize);
        // A pair waits for the next paid order whose messages come in order.
        let mut pair_wanted = false;
        // Copies published a few orders after their first ones: (order index, message).
        let mut deferred: Vec<(usize, OutgoingMessage)> = Vec::new();
        let mut paid_orders = Vec::new();
        let mut first_placed = None;
        // An early paid order's OrderPlaced and first payment, for invalid copies: early, so
        // the valid messages are settled long before their copies arrive at the end (a copy
        // that arrives first takes the key, and the valid message becomes the conflict).
        let mut early_paid = None;

        if wants(Hostile::Expiration) {
            // First in the stream, so they are parked early and their copies have to outlive
            // the TTL in the parking lot for most of the run.
            let mut bad_json = payment_received(&hostile_id("ttl-bad-json"), "nowhere", 1);
            bad_json.body = b"{\"order_id\": \"nowhere\", \"amount\": ".to_vec();
            let mut future_version = payment_received(&hostile_id("ttl-v9"), "nowhere", 1);
            future_version
                .headers
                .insert(VERSION_HEADER.into(), 9.into());
            let mut unknown = order_cancelled(&hostile_id("ttl-shipped"), "nowhere");
            unknown.kind = Some("OrderShipped".into());
            for m in [bad_json, future_version, unknown] {
                s.push_hostile(Hostile::Expiration, m, Some(EXPIRATION_MS.to_string()));
            }
        }

        for k in 0..orders {
            for (_, m) in deferred.extract_if(.., |(due, _)| *due <= k) {
                s.push(m);
            }
            let order_id = format!("ord-{run}-{k}");
            let total: i64 = rng.random_range(1_000..100_000);
            let first: i64 = rng.random_range(1..total);
            let placed = order_placed(
                &next_id("placed"),
                &order_id,
                &format!("cust-{}", k % 97),
                total,
            );
            first_placed.get_or_insert_with(|| placed.clone());
            let pay1 = payment_received(&next_id("pay"), &order_id, first);
            let pay2 = payment_received(&next_id("pay"), &order_id, total - first);
            let last_payment = pay2.clone();
            s.expected.orders += 1;
            let roll: f64 = rng.random();
            let paid_in_order = roll >= 0.08;
            let batch = if roll < 0.03 {
                vec![placed, order_cancelled(&next_id("cancel"), &order_id)]
            } else if roll < 0.08 {
                s.out_of_order += 2;
                s.expected.payments += 2;
                vec![pay1, pay2, placed]
            } else {
                if s.crash_after_commit_of.is_empty() {
                    s.crash_after_commit_of = pay1.message_id.clone().unwrap_or_default();
                }
                s.expected.payments += 2;
                paid_orders.push(order_id.clone());
                if paid_orders.len() == 2 {
                    // The second: the first order's OrderPlaced gets a reused id below.
                    early_paid = Some((placed.clone(), pay1.clone()));
                }
                vec![placed, pay1, pay2]
            };
            for m in batch {
                s.unique_keys += 1;
                if rng.random_bool(0.10) {
                    s.duplicates += 1;
                    // Some duplicates follow at once, others come late, like a replay.
                    if rng.random_bool(0.5) {
                        s.push(m.clone());
                    } else {
                        late.push(m.clone());
                    }
                }
                s.push(m);
            }
            pair_wanted |= pairs_at.contains(&k);
            // Past the first two paid orders, which the other hostile inputs use.
            if pair_wanted && paid_in_order && paid_orders.len() > 2 {
                pair_wanted = false;
                pairs += 1;
                s.push_invalid_copy(last_payment, pairs % 2 == 1);
            }
            if bursts_at.contains(&k) {
                bursts += 1;
                let m = if bursts % 2 == 1 {
                    let mut m = order_cancelled(&hostile_id("burst-shipped"), "nowhere");
                    m.kind = Some("OrderShipped".into());
                    m
                } else {
                    payment_received(&hostile_id("burst-negative"), "nowhere", -5)
                };
                s.push_hostile(Hostile::DuplicateBursts, m.clone(), None);
                for _ in 1..mix_rng.random_range(2..=3) {
                    s.duplicates += 1;
                    s.push(m.clone());
                }
                if mix_rng.random_bool(0.5) {
                    s.duplicates += 1;
                    deferred.push((k + mix_rng.random_range(5..50), m));
                }
            }
            if repeats_at.contains(&k) {
                repeats += 1;
                let m = if repeats % 2 == 1 {
                    let id = hostile_id("repeat-bad-json");
                    let mut m = payment_received(&id, "nowhere", 1);
                    m.body =
                        format!("{{\"order_id\": \"nowhere\", \"amount\": 1 -- {id}").into_bytes();
                    s.push_hostile(Hostile::RepeatedInvalid, m.clone(), None);
                    m
                } else {
                    // Identical copies without an id share the synthetic key of their body.
                    let mut m = payment_received("unused", "nowhere", 1);
                    m.message_id = None;
                    m.body = format!(
                        "{{\"order_id\":\"{}\",\"amount\":1}}",
                        hostile_id("repeat-no-id")
                    )
                    .into_bytes();
                    s.unique_keys += 1;
                    s.expected.parked_rows += 1;
                    s.push(m.clone());
                    m
                };
                // Two back to back, the others a few orders later.
                s.duplicates += 1;
                s.push(m.clone());
                for _ in 2..mix_rng.random_range(3..=4) {
                    s.duplicates += 1;
                    deferred.push((k + mix_rng.random_range(5..50), m.clone()));
                }
            }
            if rng.random_bool(0.02) {
                // Logical duplicate: another message id for the same order; a no-op.
                s.unique_keys += 1;
                s.push(order_placed(
                    &next_id("placed-again"),
                    &order_id,
                    "someone-else",
                    total,
                ));
            }
        }

        // Poison, about one of each kind per 200 orders.
        for _ in 0..(orders / 200).max(1) {
            let mut bad_json = payment_received(&next_id("bad-json"), "nowhere", 1);
            bad_json.body = format!(
                "{{\"order_id\": \"nowhere\", \"amount\": 1 -- {}",
                next_id("x")
            )
            .into_bytes();
            let mut no_id = payment_received("unused", "nowhere", 1);
            no_id.message_id = None;
            no_id.body =
                format!("{{\"order_id\":\"{}\",\"amount\":1}}", next_id("no-id")).into_bytes();
            let mut future_version = payment_received(&next_id("v9"), "nowhere", 1);
            future_version
                .headers
                .insert(VERSION_HEADER.into(), 9.into());
            let mut unknown = order_cancelled(&next_id("shipped"), "nowhere");
            unknown.kind = Some("OrderShipped".into());
            // Retried until the budget is spent, then POISONED.
            let orphan =
                payment_received(&next_id("orphan-pay"), &format!("ord-{run}-missing"), 100);
            for m in [bad_json, no_id, future_version, unknown, orphan] {
                s.unique_keys += 1;
                s.expected.parked_rows += 1;
                s.push(m);
            }
        }
        for (_, m) in deferred {
            s.push(m);
        }
        if wants(Hostile::DeepHeaders) {
            let mut deep = payment_received(&hostile_id("deep-headers"), "nowhere", 1);
            // Built level by level: `json!` and serde would recurse as deep as the value.
            let mut value = Value::from(1);
            for _ in 0..DEEP_HEADER_LEVELS {
                value = Value::Array(vec![value]);
            }
            deep.headers.insert("x-deep".into(), value);
            s.push_hostile(Hostile::DeepHeaders, deep, None);
        }
        if wants(Hostile::OversizedFields) {
            // Each carries the oversized aggregate id, which no version of the inbox can index,
            // so each must be parked with a row; the others ride along to be bounded too.
            let mut huge = || random_hex(&mut hostile_rng, OVERSIZED_FIELD_BYTES);
            let long_correlation = "c".repeat(255);
            for extra in [
                None,
                Some(CAUSATION_HEADER),
                Some(TENANT_HEADER),
                Some(TRACEPARENT_HEADER),
                Some(TYPE_HEADER),
            ] {
                let label = extra.unwrap_or("aggregate-id");
                let mut m = payment_received(&hostile_id(&format!("long-{label}")), "nowhere", 1);
                m.correlation_id = Some(long_correlation.clone());
                m.headers.insert(AGGREGATE_ID_HEADER.into(), huge().into());
                if let Some(header) = extra {
                    m.headers.insert(header.into(), huge().into());
                }
                if extra == Some(TYPE_HEADER) {
                    // The type then comes from the header (AMQP's `type` is at most 255 bytes).
                    m.kind = None;
                }
                s.push_hostile(Hostile::OversizedFields, m, None);
            }
        }
        if wants(Hostile::InvalidCopies)
            && let Some((placed, pay)) = early_paid
        {
            let mut not_json = placed;
            not_json.body = b"<order>not json</order>".to_vec();
            // A version-9 body of its own: with the original's exact bytes the copy would be
            // a plain duplicate by payload hash, whatever its version header says.
            let mut unsupported = pay;
            unsupported.headers.insert(VERSION_HEADER.into(), 9.into());
            let mut body: serde_json::Map<String, Value> =
                serde_json::from_slice(&unsupported.body).unwrap_or_default();
            body.insert("amount_minor_units".into(), 3.into());
            unsupported.body = Value::Object(body).to_string().into_bytes();
            for m in [not_json, unsupported] {
                s.expected.conflicts += 1;
                s.hostile.push(HostileMessage {
                    kind: Hostile::InvalidCopies,
                    message_id: m.message_id.clone().unwrap_or_default(),
                    conflict: true,
                });
                late.push(m);
            }
        }
        // Cancelling a paid order is an invalid transition: parked.
        if let Some(order_id) = paid_orders.first() {
            s.unique_keys += 1;
            s.expected.parked_rows += 1;
            late.push(order_cancelled(&next_id("cancel-paid"), order_id));
        }
        // A producer reusing an id with another body: reported, parked, not applied.
        if let Some(mut reused) = first_placed {
            reused.body = b"{\"order_id\":\"reused\",\"customer_id\":\"x\",\"total\":1}".to_vec();
            s.expected.conflicts += 1;
            late.push(reused);
        }
        for m in late {
            s.push(m);
        }
        s
    }

    fn push(&mut self, message: OutgoingMessage) {
        self.push_expiring(message, None);
    }

    fn push_expiring(&mut self, message: OutgoingMessage, expiration: Option<String>) {
        let routing_key = routing_key(message.kind.as_deref().unwrap_or_default()).to_owned();
        self.messages.push(Published {
            routing_key,
            message,
            expiration,
        });
    }

    /// An invalid copy of the valid `message`, published right after it under its id: a body
    /// that is not JSON, or (`not_json` false) another body with an unsupported version.
    fn push_invalid_copy(&mut self, message: OutgoingMessage, not_json: bool) {
        let mut copy = message;
        if not_json {
            copy.body = b"amount=1&currency=EUR".to_vec();
        } else {
            copy.headers.insert(VERSION_HEADER.into(), 9.into());
            let mut body: serde_json::Map<String, Value> =
                serde_json::from_slice(&copy.body).unwrap_or_default();
            body.insert("amount_minor_units".into(), 3.into());
            copy.body = Value::Object(body).to_string().into_bytes();
        }
        self.expected.conflicts += 1;
        self.hostile.push(HostileMessage {
            kind: Hostile::ValidThenInvalid,
            message_id: copy.message_id.clone().unwrap_or_default(),
            conflict: true,
        });
        self.push(copy);
    }

    /// Copies published under each inbox key, as the consumer under `rules` derives it (the
    /// synthetic key of a message without a usable id included).
    pub fn published_copies(&self, rules: &EnvelopeRules) -> HashMap<String, usize> {
        published_copies(&self.messages, rules)
    }

    /// The valid messages that an invalid copy follows ([`Hostile::ValidThenInvalid`]): each
    /// must be applied once.
    pub fn valid_before_invalid(&self) -> impl Iterator<Item = &str> {
        self.hostile
            .iter()
            .filter(|h| h.kind == Hostile::ValidThenInvalid)
            .map(|h| h.message_id.as_str())
    }

    /// A hostile message with an inbox key of its own, which must end parked with a row.
    fn push_hostile(
        &mut self,
        kind: Hostile,
        message: OutgoingMessage,
        expiration: Option<String>,
    ) {
        self.unique_keys += 1;
        self.expected.parked_rows += 1;
        self.hostile.push(HostileMessage {
            kind,
            message_id: message.message_id.clone().unwrap_or_default(),
            conflict: false,
        });
        self.push_expiring(message, expiration);
    }
}

/// Orders whose steps the ordered stream interleaves at any point: each order's steps are
/// close together in the queue, so competing consumers take neighbouring steps of one order.
const ORDERED_WINDOW: usize = 16;

/// Share of the ordered stream's steps that fail until retried ([`order_service::StepFault::RetryOnce`]).
const RETRIED_SHARE: f64 = 0.02;

/// Share of the ordered stream's orders with a refused step ([`order_service::StepFault::Refuse`]).
const REFUSED_SHARE: f64 = 0.02;

/// Share of the ordered stream's steps published twice (an exact duplicate, at once or at the
/// end of the stream).
const ORDERED_DUPLICATE_SHARE: f64 = 0.05;

/// One step of one order in the ordered stream.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Step {
    /// The order (its `x-aggregate-id`).
    pub order_id: String,
    /// Its number in the order's sequence (`x-sequence`).
    pub step: i64,
    /// The step's message id.
    pub message_id: String,
}

/// The ordered run's stream: for each order, `OrderStep`s 1..=`steps` carrying their number
/// in `x-sequence`, published in each order's sequence and interleaved across a few orders at
/// a time, with exact duplicates; and the steps that are to fail. Deterministic for a seed.
#[derive(Debug)]
pub struct OrderedStream {
    /// The messages, in publishing order.
    pub messages: Vec<Published>,
    /// The orders' ids.
    pub orders: Vec<String>,
    /// Steps per order.
    pub steps: i64,
    /// Exact duplicates injected (same id, same body).
    pub duplicates: usize,
    /// Steps that fail retryably until a retry returns them ([`order_service::StepFault::RetryOnce`]).
    pub retried: Vec<Step>,
    /// Steps refused ([`order_service::StepFault::Refuse`]: parked, blocking their order)
    /// until their fault is cleared and they are redriven; at least one in a stream.
    pub redriven: Vec<Step>,
    /// Steps refused as well, whose order an operator lets go on without them: skipped heads,
    /// never applied; at least one in a stream of two orders. At most one refused step
    /// (redriven or skipped) per order.
    pub skipped: Vec<Step>,
}

impl OrderedStream {
    /// `orders` orders of `steps` steps each, from `seed`.
    pub fn generate(orders: usize, steps: i64, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x05de_5e9e);
        let run = format!("{seed:016x}");
        let order_ids: Vec<String> = (0..orders).map(|k| format!("ord-{run}-{k}")).collect();
        let step_of = |k: usize, step: i64| Step {
            order_id: order_ids[k].clone(),
            step,
            message_id: format!("{run}-step-{k}-{step}"),
        };
        let mut stream = OrderedStream {
            messages: Vec::new(),
            orders: order_ids.clone(),
            steps,
            duplicates: 0,
            retried: Vec::new(),
            redriven: Vec::new(),
            skipped: Vec::new(),
        };
        let mut late = Vec::new();
        let mut next = vec![1i64; orders];
        let mut window: Vec<usize> = (0..orders.min(ORDERED_WINDOW)).collect();
        let mut waiting = window.len()..orders;
        while !window.is_empty() {
            let slot = rng.random_range(0..window.len());
            let k = window[slot];
            let s = step_of(k, next[k]);
            let m = order_step(&s.message_id, &s.order_id, s.step);
            if rng.random_bool(ORDERED_DUPLICATE_SHARE) {
                stream.duplicates += 1;
                if rng.random_bool(0.5) {
                    stream.push(m.clone());
                } else {
                    late.push(m.clone());
                }
            }
            stream.push(m);
            next[k] += 1;
            if next[k] > steps {
                match waiting.next() {
                    Some(following) => window[slot] = following,
                    None => {
                        window.swap_remove(slot);
                    }
                }
            }
        }
        for m in late {
            stream.push(m);
        }
        stream.choose_failures(&mut rng, &step_of);
        stream
    }

    /// Picks the steps that fail: some until retried, and a refused one in a few orders, to
    /// be redriven or skipped by turns.
    fn choose_failures(&mut self, rng: &mut StdRng, step_of: &dyn Fn(usize, i64) -> Step) {
        let (orders, steps) = (self.orders.len(), self.steps);
        let mut refused: Vec<Step> = Vec::new();
        for k in 0..orders {
            let step = rng
                .random_bool(REFUSED_SHARE)
                .then(|| rng.random_range(1..=steps));
            if let Some(step) = step {
                refused.push(step_of(k, step));
            }
            for n in 1..=steps {
                if Some(n) != step && rng.random_bool(RETRIED_SHARE) {
                    self.retried.push(step_of(k, n));
                }
            }
        }
        // One to redrive and one to skip, at least, in every stream that has room for them.
        for k in [0, orders.saturating_sub(1)] {
            if refused.len() < orders.min(2)
                && !refused.iter().any(|r| r.order_id == self.orders[k])
            {
                let s = step_of(k, (steps + 1) / 2);
                self.retried.retain(|r| *r != s);
                refused.push(s);
            }
        }
        for (i, s) in refused.into_iter().enumerate() {
            if i % 2 == 0 {
                self.redriven.push(s);
            } else {
                self.skipped.push(s);
            }
        }
    }

    /// Distinct messages (each order's steps).
    pub fn unique_keys(&self) -> usize {
        self.orders.len() * usize::try_from(self.steps).unwrap_or(0)
    }

    fn push(&mut self, message: OutgoingMessage) {
        let routing_key = routing_key(message.kind.as_deref().unwrap_or_default()).to_owned();
        self.messages.push(Published {
            routing_key,
            message,
            expiration: None,
        });
    }
}

/// Copies of `messages` published under each inbox key, as a consumer under `rules` derives it
/// (the synthetic key of a message without a usable id included).
pub fn published_copies(messages: &[Published], rules: &EnvelopeRules) -> HashMap<String, usize> {
    let mut copies = HashMap::new();
    for m in messages {
        let delivered = AmqpMessage {
            message_id: m.message.message_id.clone(),
            kind: m.message.kind.clone(),
            content_type: Some("application/json".into()),
            correlation_id: m.message.correlation_id.clone(),
            headers: m.message.headers.clone(),
            headers_truncated: None,
            body: m.message.body.clone(),
            redelivered: false,
        };
        let key = match envelope::parse(delivered, rules) {
            Ok(e) => e.message_id,
            Err(invalid) => invalid.envelope.message_id,
        };
        *copies.entry(key).or_insert(0) += 1;
    }
    copies
}

/// One order index in each stretch of `every` orders, at a random point of it; none unless `on`.
fn spots(rng: &mut StdRng, orders: usize, every: usize, on: bool) -> HashSet<usize> {
    if !on {
        return HashSet::new();
    }
    (0..orders)
        .step_by(every)
        .map(|start| start + rng.random_range(0..every.min(orders - start)))
        .collect()
}

/// `len` random hex digits: incompressible enough that PostgreSQL's TOAST compression cannot
/// bring the value under the index row limit.
fn random_hex(rng: &mut StdRng, len: usize) -> String {
    (0..len)
        .map(|_| char::from_digit(rng.random_range(0..16), 16).unwrap_or('0'))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let a = Scenario::generate(300, 7);
        let b = Scenario::generate(300, 7);
        assert_eq!(a.messages.len(), b.messages.len());
        assert!(
            a.messages
                .iter()
                .zip(&b.messages)
                .all(|(x, y)| x.message.body == y.message.body
                    && x.message.message_id == y.message.message_id)
        );
        assert!(a.duplicates > 0 && a.out_of_order > 0);
        assert!(!a.crash_after_commit_of.is_empty());
        assert_eq!(
            a.messages.len(),
            a.unique_keys + a.duplicates + a.expected.conflicts as usize
        );
    }

    /// Nesting depth of a JSON value, counted iteratively.
    fn depth(v: &Value) -> usize {
        let mut deepest = 0;
        let mut stack = vec![(v, 0)];
        while let Some((v, d)) = stack.pop() {
            deepest = deepest.max(d);
            match v {
                Value::Array(a) => stack.extend(a.iter().map(|c| (c, d + 1))),
                Value::Object(o) => stack.extend(o.values().map(|c| (c, d + 1))),
                _ => {}
            }
        }
        deepest
    }

    fn deepest_header(s: &Scenario) -> usize {
        s.messages
            .iter()
            .flat_map(|m| m.message.headers.values())
            .map(depth)
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn hostile_inputs_are_counted_and_leave_the_ordinary_stream_alone() {
        let plain = Scenario::generate(300, 7);
        assert!(plain.hostile.is_empty());
        assert!(plain.messages.iter().all(|m| m.expiration.is_none()));
        // The inputs published once each; the repeated ones have a test of their own.
        let all = Scenario::generate_with(300, 7, &Hostile::ALL[..5]);
        assert_eq!(
            all.messages.len(),
            all.unique_keys + all.duplicates + all.expected.conflicts as usize
        );
        let with_row = all.hostile.iter().filter(|h| !h.conflict).count();
        let conflicts = all.hostile.iter().filter(|h| h.conflict).count();
        assert_eq!(with_row, 1 + 5 + 3, "deep, oversized, expiring");
        assert_eq!(conflicts, 2);
        assert_eq!(all.unique_keys, plain.unique_keys + with_row);
        assert_eq!(
            all.expected.parked_rows,
            plain.expected.parked_rows + with_row as i64
        );
        assert_eq!(all.expected.conflicts, plain.expected.conflicts + 2);
        assert_eq!(all.expected.payments, plain.expected.payments);
        assert_eq!(deepest_header(&all), DEEP_HEADER_LEVELS);
        // The invalid copies reuse ids of messages that are valid in the stream.
        for copy in all.hostile.iter().filter(|h| h.conflict) {
            let same_id = all
                .messages
                .iter()
                .filter(|m| m.message.message_id.as_deref() == Some(&copy.message_id))
                .count();
            assert!(same_id >= 2, "{} has a valid original", copy.message_id);
            let bodies: HashSet<_> = all
                .messages
                .iter()
                .filter(|m| m.message.message_id.as_deref() == Some(&copy.message_id))
                .map(|m| &m.message.body)
                .collect();
            assert_eq!(
                bodies.len(),
                2,
                "the copy's body differs from the original's"
            );
        }
        // Every oversized message carries the unindexable aggregate id.
        let oversized: Vec<_> = all
            .hostile
            .iter()
            .filter(|h| h.kind == Hostile::OversizedFields)
            .collect();
        assert_eq!(oversized.len(), 5);
        for h in oversized {
            let m = all
                .messages
                .iter()
                .find(|m| m.message.message_id.as_deref() == Some(&h.message_id))
                .expect("published");
            let id = m.message.headers[AGGREGATE_ID_HEADER]
                .as_str()
                .unwrap_or("");
            assert!(id.len() >= 4096);
        }
        let expiring = all
            .messages
            .iter()
            .filter(|m| m.expiration.is_some())
            .count();
        assert_eq!(expiring, 3);
        // The ordinary messages come in the same order, with the same ids and bodies.
        let key = |m: &Published| (m.message.message_id.clone(), m.message.body.clone());
        let mut hostile_stream = all.messages.iter().map(key);
        for m in &plain.messages {
            let wanted = key(m);
            assert!(hostile_stream.any(|k| k == wanted), "{:?} kept", wanted.0);
        }
        assert_eq!(all.messages.len(), plain.messages.len() + all.hostile.len());
    }

    #[test]
    fn deep_headers_can_be_left_out() {
        let without: Vec<Hostile> = Hostile::ALL
            .into_iter()
            .filter(|h| *h != Hostile::DeepHeaders)
            .collect();
        let s = Scenario::generate_with(300, 7, &without);
        assert!(deepest_header(&s) < 3);
        assert!(s.hostile.iter().all(|h| h.kind != Hostile::DeepHeaders));
        let once = |h: &&HostileMessage| {
            !matches!(
                h.kind,
                Hostile::DuplicateBursts | Hostile::RepeatedInvalid | Hostile::ValidThenInvalid
            )
        };
        assert_eq!(s.hostile.iter().filter(once).count(), 5 + 3 + 2);
    }

    /// Where each message of the stream with this AMQP id is, by position.
    fn positions(s: &Scenario, id: &str) -> Vec<usize> {
        s.messages
            .iter()
            .enumerate()
            .filter(|(_, m)| m.message.message_id.as_deref() == Some(id))
            .map(|(i, _)| i)
            .collect()
    }

    #[test]
    fn repeated_inputs_are_mixed_in_and_every_copy_has_its_key() {
        let plain = Scenario::generate(1_000, 7);
        let all = Scenario::generate_with(1_000, 7, &Hostile::ALL);
        assert_eq!(
            all.messages.len(),
            all.unique_keys + all.duplicates + all.expected.conflicts as usize
        );
        // The keys the consumer derives are the stream's unique keys, and every copy has one.
        let rules = EnvelopeRules::default();
        for s in [&plain, &all] {
            let copies = s.published_copies(&rules);
            assert_eq!(copies.len(), s.unique_keys);
            assert_eq!(copies.values().sum::<usize>(), s.messages.len());
        }
        let copies = all.published_copies(&rules);
        let of_kind = |kind: Hostile| {
            all.hostile
                .iter()
                .filter(move |h| h.kind == kind)
                .map(|h| h.message_id.as_str())
        };
        // Bursts: two or three copies back to back, some once more later.
        let bursts: Vec<&str> = of_kind(Hostile::DuplicateBursts).collect();
        assert_eq!(bursts.len(), 10, "one per 100 orders");
        for id in &bursts {
            let at = positions(&all, id);
            assert!((2..=4).contains(&at.len()), "{id}: {at:?}");
            assert_eq!(at[1], at[0] + 1, "{id} back to back");
            assert_eq!(copies[*id], at.len());
        }
        assert!(bursts.iter().any(|id| positions(&all, id).len() == 4));
        assert!(bursts.iter().any(|id| positions(&all, id).len() == 2));
        // Repeated invalid messages: under their id, or under one synthetic key without one.
        for id in of_kind(Hostile::RepeatedInvalid) {
            let at = positions(&all, id);
            assert!((3..=4).contains(&at.len()), "{id}: {at:?}");
            assert_eq!(at[1], at[0] + 1);
            assert!(at[2] > at[1] + 1, "{id}: a later copy in another batch");
        }
        let synthetic: Vec<usize> = copies
            .iter()
            .filter(|(k, n)| k.starts_with("invalid:") && **n >= 3)
            .map(|(_, n)| *n)
            .collect();
        assert_eq!(
            synthetic.len() + of_kind(Hostile::RepeatedInvalid).count(),
            5,
            "one per 200 orders"
        );
        assert!(!synthetic.is_empty());
        // Each pair: a valid payment, then at once another body under its id.
        let pairs: Vec<&str> = of_kind(Hostile::ValidThenInvalid).collect();
        assert!(pairs.len() >= 4, "{pairs:?}");
        for id in &pairs {
            let at = positions(&all, id);
            let valid = &all.messages[at[0]].message;
            assert_eq!(valid.kind.as_deref(), Some("PaymentReceived"));
            assert!(serde_json::from_slice::<Value>(&valid.body).is_ok());
            let next = at
                .iter()
                .copied()
                .find(|&i| all.messages[i].message.body != valid.body)
                .expect("an invalid copy");
            assert!(
                all.messages[at[0]..next]
                    .iter()
                    .all(|m| m.message.message_id.as_deref() == Some(id)),
                "{id}: the invalid copy follows the valid one at once"
            );
        }
        // Mixed into the stream, not appended; a small share of it; the rest unchanged.
        let last_ordinary = all
            .messages
            .iter()
            .rposition(|m| m.message.kind.as_deref() == Some("OrderPlaced"))
            .expect("orders");
        assert!(positions(&all, bursts[0])[0] < last_ordinary / 2);
        let added = all.messages.len() - plain.messages.len();
        assert!(added * 100 < plain.messages.len() * 3, "{added} added");
        let key = |m: &Published| (m.message.message_id.clone(), m.message.body.clone());
        let mut stream = all.messages.iter().map(key);
        for m in &plain.messages {
            let wanted = key(m);
            assert!(stream.any(|k| k == wanted), "{:?} kept", wanted.0);
        }
        assert_eq!(all.expected.payments, plain.expected.payments);
    }

    #[test]
    fn ordered_stream_publishes_each_order_in_sequence() {
        let s = OrderedStream::generate(200, 10, 7);
        assert_eq!(s.unique_keys(), 2_000);
        assert_eq!(s.messages.len(), s.unique_keys() + s.duplicates);
        assert!(s.duplicates > 0);
        // First copies: every step once, each order's in its sequence, the number in the
        // header, under the order's aggregate id.
        let mut seen = HashSet::new();
        let mut last: HashMap<String, i64> = HashMap::new();
        for m in &s.messages {
            let id = m.message.message_id.clone().expect("id");
            if !seen.insert(id) {
                continue;
            }
            let order = m.message.headers[AGGREGATE_ID_HEADER]
                .as_str()
                .expect("aggregate")
                .to_owned();
            let step = m.message.headers[order_service::SEQUENCE_HEADER]
                .as_i64()
                .expect("sequence");
            let before = last.insert(order.clone(), step).unwrap_or(0);
            assert_eq!(step, before + 1, "{order}: step {step} after {before}");
        }
        assert_eq!(seen.len(), s.unique_keys());
        assert!(last.values().all(|&n| n == 10));
        // Interleaved: the first order's steps are spread among others'.
        let firsts: Vec<usize> = s
            .messages
            .iter()
            .enumerate()
            .filter(|(_, m)| m.message.headers[AGGREGATE_ID_HEADER] == s.orders[0].as_str())
            .map(|(i, _)| i)
            .collect();
        assert!(firsts.last().expect("steps") - firsts[0] > 10);
        // Failures: at most one refused step per order, never also retried; some refused
        // steps are redriven, others skipped.
        assert!(!s.redriven.is_empty() && !s.skipped.is_empty() && !s.retried.is_empty());
        let refused: Vec<&Step> = s.redriven.iter().chain(&s.skipped).collect();
        let refused_orders: HashSet<&str> = refused.iter().map(|r| r.order_id.as_str()).collect();
        assert_eq!(refused_orders.len(), refused.len());
        assert!(s.retried.iter().all(|r| !refused.contains(&r)));
        let again = OrderedStream::generate(200, 10, 7);
        assert_eq!(again.redriven, s.redriven);
        assert_eq!(again.skipped, s.skipped);
        assert_eq!(again.retried, s.retried);
        assert_eq!(again.messages.len(), s.messages.len());
    }

    #[test]
    fn a_small_ordered_stream_still_refuses_steps() {
        let one = OrderedStream::generate(1, 3, 1);
        assert_eq!(one.redriven.len(), 1);
        assert_eq!(one.redriven[0].step, 2);
        assert!(
            one.skipped.is_empty(),
            "one order: nothing to go on without"
        );
        assert!(one.retried.iter().all(|r| r.step != 2));
        let two = OrderedStream::generate(2, 3, 1);
        assert_eq!((two.redriven.len(), two.skipped.len()), (1, 1));
        assert_ne!(two.redriven[0].order_id, two.skipped[0].order_id);
    }
}
