//! The hot region's LRU as stamps (`../shared/research/resolve-design.md`, proposal 1): the rules that
//! `cuda/SPEC.md` states, which `reference.rs` and the kernels follow, and the proof that they evict exactly what
//! the permutation SPEC.md specified before (a list of the slots, least recently used first) evicted.
//!
//! Each slot holds an `i64` stamp; the LRU order is ascending `(stamp, slot)`, so a fresh region (all 0) is slot
//! order. A resolve step that succeeds gives each slot of U the stamp `clock << 32 | q_first`, where `clock` is
//! the group's step count after this step (every earlier stamp is smaller) and `q_first` the request index of the
//! position's first occurrence (U's order, so within the step the stamps follow U's order). Misses take the `|M|`
//! oldest slots that no hit holds. `invalidate` gives its emptied slots `min - 1`, `min` the smallest stamp of the
//! region: they come first, ascending by slot. Every stamp value is a legal state, and a step writes the stamps
//! of U's slots only: no O(H) check or rewrite.
//!
//! `q_first` takes the low 32 bits: a request's rows x top-K stays below 2^31 (the launcher keeps R * K there), so
//! no request index reaches the clock's bits, however many rows a request has. (15 bits, as the design study has
//! it, would hold rows x top-K <= 32,768, which nothing enforces.) The clock counts the steps since the region was
//! reset (`apply`), far below 2^31; the arithmetic wraps like the kernels' if it ever were not.
//!
//! `tests` runs the stamps and the permutation model through random resolve and invalidate sequences and compares
//! every eviction choice and the whole order.

use std::collections::HashSet;

/// Bits of a stamp below the clock: the request index of the first occurrence.
pub const Q_BITS: u32 = 32;

/// The stamp a successful step with clock `clock` (the count after the step) gives a slot of U whose position
/// first occurs at request index `q_first`.
pub fn stamp(clock: i64, q_first: u32) -> i64 {
    ((clock as u64) << Q_BITS | u64::from(q_first)) as i64
}

/// The slots least recently used first: ascending `(stamp, slot)`.
pub fn order(stamps: &[i64]) -> Vec<usize> {
    let mut slots: Vec<usize> = (0..stamps.len()).collect();
    slots.sort_by_key(|&s| (stamps[s], s));
    slots
}

/// SPEC's `E[0 .. misses)`: the `misses` oldest slots that hold no hit, oldest first.
pub fn evictions(stamps: &[i64], hit_slots: &HashSet<usize>, misses: usize) -> Vec<usize> {
    order(stamps).into_iter().filter(|s| !hit_slots.contains(s)).take(misses).collect()
}

/// The stamp `invalidate` gives emptied slots: one below the region's smallest, so they come first (ahead of a
/// slot stamped `i64::MIN`, which only corrupt state holds, they come by slot: the subtraction saturates).
pub fn front(stamps: &[i64]) -> i64 {
    stamps.iter().copied().min().unwrap_or(0).saturating_sub(1)
}

/// One group's LRU over `H` slots, as stamps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StampLru {
    pub stamps: Vec<i64>,
    /// Successful steps that touched the region (the next one stamps with `clock + 1`).
    pub clock: i64,
}

impl StampLru {
    /// A fresh region: every stamp 0, slot order.
    pub fn fresh(hot_rows: usize) -> Self {
        StampLru { stamps: vec![0; hot_rows], clock: 0 }
    }

    pub fn order(&self) -> Vec<usize> {
        order(&self.stamps)
    }

    pub fn evictions(&self, hit_slots: &HashSet<usize>, misses: usize) -> Vec<usize> {
        evictions(&self.stamps, hit_slots, misses)
    }

    /// A successful step: `u` holds U's slots (hits' and the slots misses took) with the request index of
    /// each position's first occurrence, in U's order (ascending `q_first`).
    pub fn touch(&mut self, u: &[(usize, u32)]) {
        if u.is_empty() {
            return;
        }
        self.clock = self.clock.wrapping_add(1);
        for &(slot, q_first) in u {
            self.stamps[slot] = stamp(self.clock, q_first);
        }
    }

    /// `invalidate`'s emptied slots move to the front, ascending by slot.
    pub fn empty(&mut self, emptied: &[usize]) {
        if emptied.is_empty() {
            return;
        }
        let front = front(&self.stamps);
        for &s in emptied {
            self.stamps[s] = front;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The permutation model of one group's hot state (positions, and the slots least recently used first) that
    /// SPEC.md specified before the stamps: steps 5-6 of resolve, and invalidate's emptied slots to the front.
    struct Permutation {
        hot_pos: Vec<i32>,
        lru: Vec<usize>,
    }

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            // splitmix64
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Random resolve and invalidate steps on both models from a fresh region; every eviction choice and the
    /// order after every step must agree.
    fn run_sequence(seed: u64, hot_rows: usize, positions: i32, steps: usize) {
        let mut rng = Rng(seed);
        let mut perm = Permutation { hot_pos: vec![-1; hot_rows], lru: (0..hot_rows).collect() };
        let mut stamps = StampLru::fresh(hot_rows);
        let mut stamp_pos = vec![-1; hot_rows];
        assert_eq!(stamps.order(), perm.lru);
        for step in 0..steps {
            if rng.below(4) == 0 {
                // invalidate some positions (held or not)
                let targets: HashSet<i32> =
                    (0..1 + rng.below(3)).map(|_| rng.below(positions as usize) as i32).collect();
                let emptied: Vec<usize> =
                    (0..hot_rows).filter(|&s| targets.contains(&perm.hot_pos[s])).collect();
                for &s in &emptied {
                    perm.hot_pos[s] = -1;
                    stamp_pos[s] = -1;
                }
                if !emptied.is_empty() {
                    let mut order = emptied.clone();
                    order.extend(perm.lru.iter().copied().filter(|s| !emptied.contains(s)));
                    perm.lru = order;
                }
                stamps.empty(&emptied);
            } else {
                // resolve: U = up to H distinct positions in order of first occurrence, each with the request
                // index of that occurrence (increasing, with gaps: resident positions and repeats in between)
                let n = rng.below(hot_rows + 1);
                let mut u: Vec<i32> = Vec::new();
                let mut q_first = Vec::new();
                let mut q = rng.below(3) as u32;
                while u.len() < n {
                    let pos = rng.below(positions as usize) as i32;
                    if !u.contains(&pos) {
                        u.push(pos);
                        q_first.push(q);
                    }
                    q += 1 + rng.below(3) as u32;
                }
                let slot_of = |hot_pos: &[i32], pos: i32| hot_pos.iter().position(|&p| p == pos);
                let hits: HashSet<usize> = u.iter().filter_map(|&p| slot_of(&perm.hot_pos, p)).collect();
                let misses: Vec<i32> =
                    u.iter().copied().filter(|&p| slot_of(&perm.hot_pos, p).is_none()).collect();
                // the permutation model (SPEC steps 5-6)
                let e: Vec<usize> = perm.lru.iter().copied().filter(|s| !hits.contains(s)).collect();
                let chosen = stamps.evictions(&hits, misses.len());
                assert_eq!(chosen, e[..misses.len()], "seed {seed}, step {step}: a different eviction");
                for (k, &pos) in misses.iter().enumerate() {
                    perm.hot_pos[e[k]] = pos;
                    stamp_pos[chosen[k]] = pos;
                }
                let mut lru: Vec<usize> = e[misses.len()..].to_vec();
                lru.extend(u.iter().map(|&p| slot_of(&perm.hot_pos, p).unwrap()));
                perm.lru = lru;
                let touched: Vec<(usize, u32)> =
                    u.iter().zip(&q_first).map(|(&p, &q)| (slot_of(&stamp_pos, p).unwrap(), q)).collect();
                stamps.touch(&touched);
            }
            assert_eq!(stamp_pos, perm.hot_pos, "seed {seed}, step {step}");
            assert_eq!(stamps.order(), perm.lru, "seed {seed}, step {step}: the orders differ");
        }
    }

    #[test]
    fn stamps_evict_and_order_exactly_as_the_permutation_on_random_sequences() {
        for seed in 0..400 {
            for hot_rows in [1, 2, 3, 8, 33] {
                // positions: as many as H (hits once the region fills), a few more (mixed), many more (mostly misses)
                for positions in [hot_rows as i32, hot_rows as i32 + 3, 4 * hot_rows as i32 + 7] {
                    run_sequence(
                        seed * 1_000 + hot_rows as u64 * 10 + positions as u64,
                        hot_rows,
                        positions,
                        40,
                    );
                }
            }
        }
    }

    #[test]
    fn ties_break_by_slot_fresh_same_step_and_invalidated() {
        let mut lru = StampLru::fresh(4);
        assert_eq!(lru.order(), [0, 1, 2, 3]); // fresh: all 0, slot order
        lru.touch(&[(3, 0), (1, 5)]); // one step: U's order, by q_first
        assert_eq!(lru.order(), [0, 2, 3, 1]);
        lru.empty(&[3, 0]); // emptied: the front, ascending by slot, however they were given
        assert_eq!(lru.order(), [0, 3, 2, 1]);
        assert_eq!(lru.stamps[0], lru.stamps[3]);
        lru.empty(&[2]); // before the slots emptied earlier
        assert_eq!(lru.order(), [2, 0, 3, 1]);
        assert_eq!(lru.evictions(&HashSet::from([2, 3]), 2), [0, 1]);
    }
}
