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
//! - [`PoolPolicy::refresh_order`]: after a summary, the released pages it knows to be still selected, in
//!   that same order: the caller moves them to the tail of the free queue in turn, so the never-selected
//!   are reused first and the hottest last.
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
    /// Heat of each listed page, to tell selected pages from never-selected ones.
    heat: HashMap<u32, u32>,
    /// Whether the pages the summary did not list are known to be selected: they were at least as hot as
    /// its hottest coldest page, and that one was selected.
    unlisted_selected: bool,
}

impl Ranking {
    fn from_summary(summary: &HeatSummary, i: usize) -> Self {
        let mut r = Ranking::default();
        let mut coldest_max = None;
        for (k, (heat, page)) in summary.coldest(i).enumerate() {
            r.listed.insert(page, (COLDEST, k as u32));
            r.heat.insert(page, heat);
            coldest_max = Some(heat);
        }
        for (k, (heat, page)) in summary.hottest(i).enumerate() {
            r.listed.insert(page, (HOTTEST, k as u32));
            r.heat.insert(page, heat);
        }
        r.unlisted_selected = coldest_max.is_some_and(|h| h > 0);
        r
    }

    fn rank(&self, page: u32) -> Rank {
        self.listed.get(&page).copied().unwrap_or((UNLISTED, page))
    }

    fn selected(&self, page: u32) -> bool {
        match self.heat.get(&page) {
            Some(&h) => h > 0,
            None => self.unlisted_selected,
        }
    }
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
    /// lists replaces what was known of that request. Returns the indices of the requests it listed, in
    /// its order. A summary naming an index past `request_ids` is refused whole.
    pub fn report(&mut self, summary: &HeatSummary, request_ids: &[String]) -> Result<Vec<usize>> {
        summary.validate()?;
        let mut listed = Vec::with_capacity(summary.len());
        for &index in &summary.requests {
            match usize::try_from(index).ok().filter(|&i| i < request_ids.len()) {
                Some(i) => listed.push(i),
                None => {
                    return invalid(format!(
                        "a heat summary names request {index} of a batch of {}",
                        request_ids.len()
                    ))
                }
            }
        }
        for (i, &index) in listed.iter().enumerate() {
            self.requests.insert(request_ids[index].clone(), Ranking::from_summary(summary, i));
        }
        Ok(listed)
    }

    /// `pages` in the order to release them (module docs); without a summary, oldest first.
    pub fn release_order(&self, request: &str, pages: &mut [u32]) {
        match self.requests.get(request) {
            Some(r) => pages.sort_unstable_by_key(|&p| r.rank(p)),
            None => pages.sort_unstable(),
        }
    }

    /// Of the released pages still readable, those the last summary knows to be selected, in release order.
    pub fn refresh_order(&self, request: &str, released: &[u32]) -> Vec<u32> {
        let Some(r) = self.requests.get(request) else { return Vec::new() };
        let mut hot: Vec<u32> = released.iter().copied().filter(|&p| r.selected(p)).collect();
        hot.sort_unstable_by_key(|&p| r.rank(p));
        hot
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
    fn without_heat_the_oldest_go_first_and_nothing_is_refreshed() {
        let p = PoolPolicy::new();
        let mut pages = vec![3, 9, 1, 5];
        p.release_order("a", &mut pages);
        assert_eq!(pages, vec![1, 3, 5, 9]);
        assert!(p.refresh_order("a", &[1, 3]).is_empty());
    }

    #[test]
    fn coldest_then_unlisted_then_hottest_as_the_cores_policy() {
        let mut summary = HeatSummary::default();
        // Pages 4 and 2 never or hardly selected; 0 (a sink) and 7 the hottest.
        summary.push(1, vec![(0, 4), (3, 2)], vec![(90, 0), (9, 7)]);
        let mut p = PoolPolicy::new();
        assert_eq!(p.report(&summary, &ids(&["x", "a"])).unwrap(), vec![1]);
        let mut pages = vec![0, 2, 4, 5, 7, 8];
        p.release_order("a", &mut pages);
        assert_eq!(pages, vec![4, 2, 5, 8, 7, 0]);
        // Unlisted pages were at least as hot as page 2 (heat 3): selected, so refreshed; page 4 is not.
        assert_eq!(p.refresh_order("a", &[0, 4, 5, 2, 7]), vec![2, 5, 7, 0]);
        assert_eq!(p.len(), 1);
        p.forget("a");
        assert!(p.is_empty());
    }

    #[test]
    fn unlisted_pages_are_not_known_selected_when_every_coldest_page_is_cold() {
        let mut summary = HeatSummary::default();
        summary.push(0, vec![(0, 1), (0, 2)], vec![(5, 3)]);
        let mut p = PoolPolicy::new();
        p.report(&summary, &ids(&["a"])).unwrap();
        assert_eq!(p.refresh_order("a", &[1, 2, 3, 9]), vec![3]);
        // A later summary replaces the earlier one.
        let mut later = HeatSummary::default();
        later.push(0, vec![(2, 3)], vec![]);
        p.report(&later, &ids(&["a"])).unwrap();
        assert_eq!(p.refresh_order("a", &[1, 2, 3, 9]), vec![3, 1, 2, 9]);
    }

    #[test]
    fn a_summary_naming_a_request_outside_the_batch_is_refused_whole() {
        let mut summary = HeatSummary::default();
        summary.push(0, vec![(0, 1)], vec![]);
        summary.push(2, vec![(0, 1)], vec![]);
        let mut p = PoolPolicy::new();
        assert!(p.report(&summary, &ids(&["a", "b"])).is_err());
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
