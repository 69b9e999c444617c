//! The ordering decision for one batch transaction: which messages of ordered keys run now,
//! which are held behind their key's head or a sequence gap, which held copies may go on.
//! Pure: the caller reads the keys' states under their locks and writes what this decides.

use std::collections::HashMap;

use crate::status::SEQUENCE_PASSED;

/// How a message of an ordered key reached the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// A new row (claimed by this transaction), or a row to run again (a retry, a redrive).
    Fresh,
    /// A copy of a HELD row, at its position in the key's order.
    HeldCopy(i64),
}

/// One message of an ordered key, in batch order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Candidate<'a> {
    /// Position in the batch (delivery order).
    pub(crate) index: usize,
    pub(crate) message_id: &'a str,
    pub(crate) key: &'a str,
    /// Its business sequence number, with sequence numbers on.
    pub(crate) sequence: Option<i64>,
    pub(crate) arrival: Arrival,
}

/// What the ledger says of a key, read under its lock.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct KeyState {
    /// The failed or parked message the key waits for.
    pub(crate) head: Option<String>,
    /// With sequence numbers: the head's number, when its row records one.
    pub(crate) head_position: Option<i64>,
    /// With sequence numbers: the number the key waits for (`None`: the policy's first).
    pub(crate) next_sequence: Option<i64>,
    /// The position of the key's first HELD row, if any.
    pub(crate) first_held: Option<i64>,
}

/// What happens to a candidate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Runs now. `head`: it is the key's head, whose success unblocks the key.
    Run { head: bool },
    /// Recorded HELD (and acked). `position`: its sequence number (`None`: a position in
    /// arrival order is given). `behind`: a head this batch found failing, to record as the
    /// key's head in this transaction. `gap`: held for a missing sequence number.
    Hold {
        position: Option<i64>,
        behind: Option<String>,
        gap: bool,
        /// The key's head itself, come back before its number's turn: held at its number,
        /// and the key no longer waits for it.
        was_head: bool,
    },
    /// A copy of a HELD row whose turn has not come: acked, the row stays HELD.
    StillHeld,
    /// Parked without blocking the key (a sequence number the key has passed).
    Refuse { code: &'static str, message: String },
}

/// Decides each candidate (in batch order). `states`: per key; `round_heads`: per key, the
/// batch position and id of a message of the key that failed earlier in this round (its
/// failure is not recorded yet, but nothing after it may run); `first`: the policy's first
/// sequence number.
pub(crate) fn decide(
    candidates: &[Candidate<'_>],
    states: &HashMap<&str, KeyState>,
    round_heads: &HashMap<&str, (usize, &str)>,
    first: i64,
) -> Vec<(usize, Decision)> {
    let mut walks: HashMap<&str, Walk> = HashMap::new();
    let mut decisions = Vec::with_capacity(candidates.len());
    for c in candidates {
        let state = states.get(c.key).cloned().unwrap_or_default();
        let walk = walks.entry(c.key).or_insert_with(|| Walk {
            next: state.next_sequence.unwrap_or(first),
            holding: state.first_held.is_some(),
            released: false,
        });
        let round_head = round_heads
            .get(c.key)
            .filter(|(at, _)| *at < c.index)
            .map(|(_, id)| *id);
        let head = state.head.as_deref().or(round_head);
        let decision = match c.arrival {
            Arrival::HeldCopy(_) if head.is_some_and(|h| h != c.message_id) => Decision::StillHeld,
            Arrival::HeldCopy(position) => walk.held_copy(position, c.sequence, &state),
            Arrival::Fresh => {
                // A head found failing in this round is recorded with the holds behind it.
                let behind = round_head.filter(|_| state.head.is_none());
                // With sequence numbers a head blocks only the numbers after its own.
                let head = head.filter(|h| {
                    *h == c.message_id
                        || !matches!((c.sequence, state.head_position),
                            (Some(s), Some(hp)) if s == walk.next && s < hp)
                });
                walk.fresh(c, head, behind)
            }
        };
        decisions.push((c.index, decision));
    }
    decisions
}

/// A key's course through one batch: its next sequence number, whether anything of it is
/// held, whether a held copy of it runs in this batch.
struct Walk {
    next: i64,
    holding: bool,
    released: bool,
}

impl Walk {
    /// A copy of a HELD row, its key not blocked by another head.
    fn held_copy(&mut self, position: i64, sequence: Option<i64>, state: &KeyState) -> Decision {
        if sequence.is_some() {
            return if position == self.next {
                self.next = position + 1;
                Decision::Run { head: false }
            } else if position < self.next {
                passed(position, self.next)
            } else {
                Decision::StillHeld
            };
        }
        // In arrival order: the first held row only, one per batch.
        if Some(position) == state.first_held && !self.released {
            self.released = true;
            Decision::Run { head: false }
        } else {
            Decision::StillHeld
        }
    }

    /// A new message or a retry of one, under its key's `head` (if any).
    fn fresh(&mut self, c: &Candidate<'_>, head: Option<&str>, behind: Option<&str>) -> Decision {
        if head == Some(c.message_id) {
            return match c.sequence {
                // Numbers before it are missing: it waits at its number like any other.
                Some(s) if s > self.next => Decision::Hold {
                    position: Some(s),
                    behind: None,
                    gap: true,
                    was_head: true,
                },
                Some(s) if s < self.next => passed(s, self.next),
                Some(s) => {
                    self.next = s + 1;
                    Decision::Run { head: true }
                }
                None => Decision::Run { head: true },
            };
        }
        if head.is_some() {
            self.holding = true;
            return Decision::Hold {
                position: c.sequence,
                behind: behind.map(str::to_owned),
                gap: false,
                was_head: false,
            };
        }
        match c.sequence {
            Some(s) if s == self.next => {
                self.next = s + 1;
                Decision::Run { head: false }
            }
            Some(s) if s > self.next => Decision::Hold {
                position: Some(s),
                behind: None,
                gap: true,
                was_head: false,
            },
            Some(s) => passed(s, self.next),
            None if self.holding => Decision::Hold {
                position: None,
                behind: None,
                gap: false,
                was_head: false,
            },
            None => Decision::Run { head: false },
        }
    }
}

fn passed(sequence: i64, next: i64) -> Decision {
    Decision::Refuse {
        code: SEQUENCE_PASSED,
        message: format!(
            "sequence number {sequence} is behind its key, which is at {next} (a number sent \
             twice, or one that arrived after the key went past its gap): not applied out of \
             order; redrive it to apply it anyway"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh<'a>(index: usize, id: &'a str, key: &'a str, seq: Option<i64>) -> Candidate<'a> {
        Candidate {
            index,
            message_id: id,
            key,
            sequence: seq,
            arrival: Arrival::Fresh,
        }
    }

    fn held<'a>(index: usize, id: &'a str, key: &'a str, at: i64, seq: bool) -> Candidate<'a> {
        Candidate {
            index,
            message_id: id,
            key,
            sequence: seq.then_some(at),
            arrival: Arrival::HeldCopy(at),
        }
    }

    const RUN: Decision = Decision::Run { head: false };

    fn hold(position: Option<i64>, behind: Option<&str>, gap: bool) -> Decision {
        Decision::Hold {
            position,
            behind: behind.map(str::to_owned),
            gap,
            was_head: false,
        }
    }

    #[test]
    fn an_unblocked_key_runs_and_a_blocked_one_holds_except_its_head() {
        let states = HashMap::from([(
            "k2",
            KeyState {
                head: Some("h".into()),
                ..KeyState::default()
            },
        )]);
        let d = decide(
            &[
                fresh(0, "a", "k1", None),
                fresh(1, "b", "k2", None),
                fresh(2, "h", "k2", None),
            ],
            &states,
            &HashMap::new(),
            1,
        );
        assert_eq!(
            d,
            vec![
                (0, RUN),
                (1, hold(None, None, false)),
                (2, Decision::Run { head: true })
            ]
        );
    }

    #[test]
    fn held_messages_keep_later_arrivals_behind_them_until_released_in_order() {
        let states = HashMap::from([(
            "k",
            KeyState {
                first_held: Some(10),
                ..KeyState::default()
            },
        )]);
        let d = decide(
            &[
                held(0, "x", "k", 12, false),
                held(1, "y", "k", 10, false),
                fresh(2, "z", "k", None),
            ],
            &states,
            &HashMap::new(),
            1,
        );
        assert_eq!(
            d,
            vec![
                (0, Decision::StillHeld),
                (1, RUN),
                (2, hold(None, None, false))
            ]
        );
    }

    #[test]
    fn a_failure_earlier_in_the_round_holds_what_follows_it_only() {
        let heads = HashMap::from([("k", (1, "f"))]);
        let d = decide(
            &[fresh(0, "a", "k", None), fresh(2, "b", "k", None)],
            &HashMap::new(),
            &heads,
            1,
        );
        assert_eq!(d, vec![(0, RUN), (2, hold(None, Some("f"), false))]);
    }

    #[test]
    fn sequence_numbers_run_in_turn_hold_a_gap_and_refuse_a_passed_number() {
        let states = HashMap::from([(
            "k",
            KeyState {
                next_sequence: Some(5),
                ..KeyState::default()
            },
        )]);
        let d = decide(
            &[
                fresh(0, "a", "k", Some(5)),
                fresh(1, "b", "k", Some(6)),
                fresh(2, "c", "k", Some(8)),
                fresh(3, "d", "k", Some(4)),
                fresh(4, "e", "new", Some(2)),
                fresh(5, "f", "new", Some(1)),
            ],
            &states,
            &HashMap::new(),
            1,
        );
        assert_eq!(d[0], (0, RUN));
        assert_eq!(d[1], (1, RUN));
        assert_eq!(d[2], (2, hold(Some(8), None, true)));
        assert!(matches!(&d[3].1, Decision::Refuse { code, .. } if *code == SEQUENCE_PASSED));
        // A key's first number is the policy's; a later one waits for it.
        assert_eq!(d[4], (4, hold(Some(2), None, true)));
        assert_eq!(d[5], (5, RUN));
    }

    #[test]
    fn a_held_copy_runs_when_its_number_is_next_and_never_while_a_head_blocks() {
        let open = HashMap::from([(
            "k",
            KeyState {
                next_sequence: Some(7),
                first_held: Some(7),
                ..KeyState::default()
            },
        )]);
        let d = decide(
            &[held(0, "a", "k", 8, true), held(1, "b", "k", 7, true)],
            &open,
            &HashMap::new(),
            1,
        );
        assert_eq!(d, vec![(0, Decision::StillHeld), (1, RUN)]);
        let blocked = HashMap::from([(
            "k",
            KeyState {
                head: Some("h".into()),
                head_position: None,
                next_sequence: Some(7),
                first_held: Some(7),
            },
        )]);
        let d = decide(&[held(0, "b", "k", 7, true)], &blocked, &HashMap::new(), 1);
        assert_eq!(d, vec![(0, Decision::StillHeld)]);
    }

    #[test]
    fn with_sequence_numbers_a_head_blocks_only_the_numbers_after_its_own() {
        let states = HashMap::from([(
            "k",
            KeyState {
                head: Some("h6".into()),
                head_position: Some(6),
                next_sequence: Some(5),
                ..KeyState::default()
            },
        )]);
        // 5 is before the head: it runs; 7 is after: held. The head itself, back from its
        // retry while 5 was missing, would wait at its number (here 5 ran first in the batch).
        let d = decide(
            &[
                fresh(0, "m5", "k", Some(5)),
                fresh(1, "m7", "k", Some(7)),
                fresh(2, "h6", "k", Some(6)),
            ],
            &states,
            &HashMap::new(),
            1,
        );
        assert_eq!(d[0], (0, RUN));
        assert_eq!(d[1], (1, hold(Some(7), None, false)));
        assert_eq!(d[2], (2, Decision::Run { head: true }));
        let early = decide(&[fresh(0, "h6", "k", Some(6))], &states, &HashMap::new(), 1);
        assert_eq!(
            early,
            vec![(
                0,
                Decision::Hold {
                    position: Some(6),
                    behind: None,
                    gap: true,
                    was_head: true
                }
            )]
        );
    }
}
