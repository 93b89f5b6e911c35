//! Residency policy over a block pool that another engine owns (vLLM's `BlockPool`).
//!
//! When vLLM hands out every block id, hisparse no longer allocates: it decides. Released pages stay
//! readable until the pool reuses their blocks, and the pool reuses in the order pages were released (a
//! FIFO free queue). So *which* pages are released, and *in what order*, is the reuse order, and that is
//! what the `coldest` policy sets from the selection heat the resolver reports, as the core's own
//! `coldest` pressure policy does (`manager::Request::pressure_order`), from the same [`HeatSummary`]:
//!
//! - [`PoolPolicy::release_order`]: the summary's coldest pages first (coldest first), then the pages it
//!   did not list (oldest first), then its hottest (the least hot first): never-selected pages go first,
//!   the hottest (attention sinks, the recent window) stay longest.
//! - [`PoolPolicy::report`]: with each summary, the released pages to move in vLLM's free queue: those the
//!   summary found never selected to its front (reused first), its selected hottest to its back (reused
//!   last, the hottest after the others), and when the summary lists every page of the request (nothing
//!   unlisted sits between its tiers) every selected page to the back, in release order. The rest keep
//!   their release order. This is O(what the summary lists) per request, not O(released pages): moving
//!   every still-selected released page would touch most of a long request's pages (blocks of every
//!   resident group) every interval.
//! - [`worth_transition`]: a request moves to reading through a hot region only when the pages it would
//!   release free more blocks than the region costs.
//!
//! A summary comes from vLLM's worker (`hisparse.integrations.vllm.heat`) with the request ids of its
//! batch: its `requests` are indices into them. `fifo` never reports heat.

use std::collections::HashMap;

use crate::error::{invalid, Result};
use crate::heat::HeatSummary;

/// Where a page stands in a request's release order: its tier, then its rank inside the tier.
type Rank = (u8, u32);
const COLDEST: u8 = 0;
const UNLISTED: u8 = 1;
const HOTTEST: u8 = 2;

/// What the last summary said of one request.
#[derive(Debug, Default)]
struct Ranking {
    /// Listed page -> its rank (tier and position in the summary's order).
    listed: HashMap<u32, Rank>,
}

impl Ranking {
    fn rank(&self, page: u32) -> Rank {
        self.listed.get(&page).copied().unwrap_or((UNLISTED, page))
    }
}

/// The free-queue moves a summary asks for one request (module docs), each in release order.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Moves {
    /// Index of the request in the ids given with the summary.
    pub request: usize,
    /// Listed pages never selected: to the front of the free queue.
    pub front: Vec<u32>,
    /// Selected pages: to the back, the hottest last.
    pub back: Vec<u32>,
}

/// Per-request selection heat and the orders derived from it (module docs).
#[derive(Debug, Default)]
pub struct PoolPolicy {
    requests: HashMap<String, Ranking>,
}

impl PoolPolicy {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes a worker's summary: `summary.requests[i]` is an index into `request_ids`, and each request it
    /// lists replaces what was known of that request. `hottest` is how many hottest pages the worker asked
    /// for per request: a request with fewer had every page listed. Returns the moves it asks for, one per
    /// listed request in its order (the caller applies them to the pages that are released and still
    /// readable). A summary naming an index past `request_ids` is refused whole.
    pub fn report(
        &mut self,
        summary: &HeatSummary,
        request_ids: &[String],
        hottest: usize,
    ) -> Result<Vec<Moves>> {
        summary.validate()?;
        let mut moves = Vec::with_capacity(summary.len());
        for &index in &summary.requests {
            match usize::try_from(index).ok().filter(|&i| i < request_ids.len()) {
                Some(request) => moves.push(Moves { request, ..Moves::default() }),
                None => {
                    return invalid(format!(
                        "a heat summary names request {index} of a batch of {}",
                        request_ids.len()
                    ))
                }
            }
        }
        for (i, m) in moves.iter_mut().enumerate() {
            let mut r = Ranking::default();
            let complete = summary.hottest(i).count() < hottest;
            for (k, (heat, page)) in summary.coldest(i).enumerate() {
                r.listed.insert(page, (COLDEST, k as u32));
                if heat == 0 {
                    m.front.push(page);
                } else if complete {
                    m.back.push(page);
                }
            }
            for (k, (heat, page)) in summary.hottest(i).enumerate() {
                r.listed.insert(page, (HOTTEST, k as u32));
                if heat == 0 {
                    m.front.push(page);
                } else {
                    m.back.push(page);
                }
            }
            self.requests.insert(request_ids[m.request].clone(), r);
        }
        Ok(moves)
    }

    /// `pages` in the order to release them (module docs); without a summary, oldest first.
    pub fn release_order(&self, request: &str, pages: &mut [u32]) {
        match self.requests.get(request) {
            Some(r) => pages.sort_unstable_by_key(|&p| r.rank(p)),
            None => pages.sort_unstable(),
        }
    }

    /// Forgets a request (finished, preempted or dropped).
    pub fn forget(&mut self, request: &str) {
        self.requests.remove(request);
    }

    /// Requests with heat on record.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
}

/// Whether a request should take a hot region: releasing `releasable_pages` pages of `blocks_per_page`
/// blocks each must free more than the `hot_blocks` the region costs, or the move loses capacity.
pub fn worth_transition(releasable_pages: usize, blocks_per_page: usize, hot_blocks: usize) -> bool {
    releasable_pages.saturating_mul(blocks_per_page) > hot_blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn without_heat_the_oldest_go_first() {
        let p = PoolPolicy::new();
        let mut pages = vec![3, 9, 1, 5];
        p.release_order("a", &mut pages);
        assert_eq!(pages, vec![1, 3, 5, 9]);
    }

    #[test]
    fn coldest_then_unlisted_then_hottest_as_the_cores_policy() {
        let mut summary = HeatSummary::default();
        // Pages 4 and 6 never selected, 2 hardly; 0 (a sink) and 7 the hottest (two asked for: others are
        // unlisted, so page 2 stays where it is). "x" had three pages, all listed: its selected ones go back.
        summary.push(1, vec![(0, 4), (0, 6), (3, 2)], vec![(9, 7), (90, 0)]);
        summary.push(0, vec![(0, 9), (2, 5)], vec![(4, 1)]);
        let mut p = PoolPolicy::new();
        let moves = p.report(&summary, &ids(&["x", "a"]), 2).unwrap();
        assert_eq!(
            moves,
            vec![
                Moves { request: 1, front: vec![4, 6], back: vec![7, 0] },
                Moves { request: 0, front: vec![9], back: vec![5, 1] },
            ]
        );
        let mut pages = vec![0, 2, 4, 5, 6, 7, 8];
        p.release_order("a", &mut pages);
        assert_eq!(pages, vec![4, 6, 2, 5, 8, 7, 0]);
        assert_eq!(p.len(), 2);
        p.forget("a");
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn a_later_summary_replaces_an_earlier_one() {
        let mut first = HeatSummary::default();
        first.push(0, vec![(0, 1)], vec![(5, 3)]);
        let mut later = HeatSummary::default();
        later.push(0, vec![(0, 3)], vec![(5, 1)]);
        let mut p = PoolPolicy::new();
        p.report(&first, &ids(&["a"]), 1).unwrap();
        p.report(&later, &ids(&["a"]), 1).unwrap();
        let mut pages = vec![1, 2, 3];
        p.release_order("a", &mut pages);
        assert_eq!(pages, vec![3, 2, 1]);
    }

    #[test]
    fn a_summary_naming_a_request_outside_the_batch_is_refused_whole() {
        let mut summary = HeatSummary::default();
        summary.push(0, vec![(0, 1)], vec![]);
        summary.push(2, vec![(0, 1)], vec![]);
        let mut p = PoolPolicy::new();
        assert!(p.report(&summary, &ids(&["a", "b"]), 1).is_err());
        assert!(p.is_empty());
    }

    #[test]
    fn transition_only_when_it_frees_more_than_it_costs() {
        // DeepSeek-V3.2 under vLLM: 6 resident groups, a hot region of 6 x 64 blocks.
        assert!(!worth_transition(30, 6, 384));
        assert!(!worth_transition(64, 6, 384));
        assert!(worth_transition(65, 6, 384));
    }
}
