//! Residency policy over a block pool that another engine owns (vLLM's `BlockPool`).
//!
//! When vLLM hands out every block id, hisparse no longer allocates: it decides. Released pages stay
//! readable until the pool reuses their blocks, and the pool reuses in the order pages were released (a
//! FIFO free queue). So *which* pages are released, and *in what order*, is the reuse order, and that is
//! what the `coldest` policy sets from the selection heat the resolver reports:
//!
//! - [`PoolPolicy::release_order`]: a request's clean pages, coldest first (reused first); pages of equal
//!   heat newest first, so that a shared prefix keeps its head longest.
//! - [`PoolPolicy::refresh_order`]: after a heat summary, the released pages that are still read, coldest
//!   first: the caller moves them to the tail of the free queue in that order, so the hottest go last.
//! - [`worth_transition`]: a request moves to reading through a hot region only when the pages it would
//!   release free more blocks than the region costs.
//!
//! A heat summary lists up to `C` pairs (page, heat), coldest first, among the request's resident pages
//! with a durable host copy; when it is full, every page it does not list was at least as hot as the
//! hottest it lists (so, when that is zero, nothing is known of them).
//! `fifo` never reports heat, so every order degenerates to vLLM's (newest first, nothing refreshed).

use std::collections::HashMap;

/// Heat a page has when no summary mentioned it yet: as cold as a page can be.
const UNKNOWN: u32 = 0;

#[derive(Debug, Default)]
struct RequestHeat {
    /// Last reported heat by page.
    heat: HashMap<u32, u32>,
    /// Heat of a page the last summary did not list: the hottest listed heat when the summary was full
    /// (unlisted pages were at least that hot), else `UNKNOWN`.
    floor: u32,
}

impl RequestHeat {
    /// Sort key: reported heat, or the floor for an unlisted page.
    fn key(&self, page: u32) -> u32 {
        self.heat.get(&page).copied().unwrap_or(self.floor)
    }
}

/// Per-request selection heat and the orders derived from it (module docs).
#[derive(Debug, Default)]
pub struct PoolPolicy {
    requests: HashMap<String, RequestHeat>,
}

impl PoolPolicy {
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces what is known of a request's heat with a summary: `pages[i]` had `heat[i]`, coldest first,
    /// and `full` says the summary stopped at its size limit.
    pub fn report(&mut self, request: &str, pages: &[u32], heat: &[u32], full: bool) {
        let entry = self.requests.entry(request.to_owned()).or_default();
        entry.heat.clear();
        entry.heat.extend(pages.iter().copied().zip(heat.iter().copied()));
        entry.floor = if full { heat.iter().copied().max().unwrap_or(UNKNOWN) } else { UNKNOWN };
    }

    /// `pages` in the order to release them: coldest first, equal heat newest first.
    pub fn release_order(&self, request: &str, pages: &mut [u32]) {
        match self.requests.get(request) {
            Some(r) => pages.sort_unstable_by_key(|&p| (r.key(p), std::cmp::Reverse(p))),
            None => pages.sort_unstable_by_key(|&p| std::cmp::Reverse(p)),
        }
    }

    /// Of the released pages still readable, those the last summary saw selected (heat above zero, or left
    /// out of a full summary whose hottest page was selected), coldest first. Moving them to the back of the free queue in this order
    /// leaves the unselected ones to be reused first and the hottest last.
    pub fn refresh_order(&self, request: &str, released: &[u32]) -> Vec<u32> {
        let Some(r) = self.requests.get(request) else { return Vec::new() };
        let mut hot: Vec<u32> = released.iter().copied().filter(|&p| r.key(p) > UNKNOWN).collect();
        hot.sort_unstable_by_key(|&p| (r.key(p), p));
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

    #[test]
    fn without_heat_the_order_is_vllms() {
        let p = PoolPolicy::new();
        let mut pages = vec![3, 9, 1, 5];
        p.release_order("a", &mut pages);
        assert_eq!(pages, vec![9, 5, 3, 1]);
        assert!(p.refresh_order("a", &[1, 3]).is_empty());
    }

    #[test]
    fn coldest_pages_go_first_and_hot_released_pages_are_refreshed_hottest_last() {
        let mut p = PoolPolicy::new();
        p.report("a", &[4, 2, 7], &[0, 3, 9], false);
        let mut pages = vec![2, 4, 7, 8];
        p.release_order("a", &mut pages);
        // 8 was not listed by a summary that was not full: it is cold (never selected).
        assert_eq!(pages, vec![8, 4, 2, 7]);
        assert_eq!(p.refresh_order("a", &[2, 4, 7, 8]), vec![2, 7]);
    }

    #[test]
    fn a_full_summary_makes_unlisted_pages_at_least_as_hot_as_its_hottest() {
        let mut p = PoolPolicy::new();
        p.report("a", &[1, 2], &[0, 1], true);
        let mut pages = vec![1, 2, 3];
        p.release_order("a", &mut pages);
        assert_eq!(pages, vec![1, 3, 2]);
        assert_eq!(p.refresh_order("a", &[1, 2, 3]), vec![2, 3]);
        // Nothing listed was selected: nothing is known of the rest either, so nothing moves.
        p.report("a", &[1, 2], &[0, 0], true);
        assert!(p.refresh_order("a", &[1, 2, 3]).is_empty());
        p.forget("a");
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
