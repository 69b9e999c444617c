//! A realistic message stream for the example service: orders with payments, exact and logical
//! duplicates, payments that arrive before their order, cancellations, and poison messages.
//! Deterministic for a seed, so a run can be replayed.

use order_service::messages::{order_cancelled, order_placed, payment_received, routing_key};
use rabbit_inbox::{OutgoingMessage, VERSION_HEADER};
use rand::{RngExt, SeedableRng, rngs::StdRng};

/// One message to publish.
pub(crate) struct Published {
    pub(crate) routing_key: String,
    pub(crate) message: OutgoingMessage,
}

/// What the database must show once the stream is consumed.
#[derive(Debug, Default)]
pub(crate) struct Expected {
    /// Orders created.
    pub(crate) orders: i64,
    /// Payments applied (one row each).
    pub(crate) payments: i64,
    /// Inbox rows parked (PERMANENT_FAILED or POISONED).
    pub(crate) parked_rows: i64,
    /// Copies parked without a row of their own (same id, other body).
    pub(crate) conflicts: i64,
}

pub(crate) struct Scenario {
    pub(crate) messages: Vec<Published>,
    /// Distinct inbox keys (including the synthetic keys of id-less messages).
    pub(crate) unique_keys: usize,
    /// Exact duplicates injected (same id, same body).
    pub(crate) duplicates: usize,
    /// Payments published before their order.
    pub(crate) out_of_order: usize,
    pub(crate) expected: Expected,
    /// A payment whose commit is followed by a dropped connection (crash before ack).
    pub(crate) crash_after_commit_of: String,
}

impl Scenario {
    pub(crate) fn generate(orders: usize, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let run = format!("{seed:016x}");
        let mut s = Scenario {
            messages: Vec::new(),
            unique_keys: 0,
            duplicates: 0,
            out_of_order: 0,
            expected: Expected::default(),
            crash_after_commit_of: String::new(),
        };
        let mut id = 0u64;
        let mut next_id = |kind: &str| {
            id += 1;
            format!("{run}-{kind}-{id}")
        };
        let mut late = Vec::new();
        let mut paid_orders = Vec::new();
        let mut first_placed = None;

        for k in 0..orders {
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
            s.expected.orders += 1;
            let roll: f64 = rng.random();
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
        let routing_key = routing_key(message.kind.as_deref().unwrap_or_default()).to_owned();
        self.messages.push(Published {
            routing_key,
            message,
        });
    }
}

#[cfg(test)]
mod tests {
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
}
