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
//! - [`PoolPolicy::report`]: each summary replaces what was known of the requests it lists. Pages already
//!   released keep their place in the queue: moving them by later summaries (never-selected to the front,
//!   the hottest to the back) changed no measurable read (`vllm_pressure.py --selection locality`: 1,261,271
//!   rows from the host with the moves, 1,261,330 without; `vllm_agent.py` at c = 16: 849,511 with, 844,004
//!   without), and each step paid for the moves a summary left.
//! - [`worth_transition`]: a request moves to reading through a hot region only when the pages it would
//!   release free more blocks than the region costs.
//! - [`PoolShape`]: the admission and transition decisions on vLLM's counts ([`PoolShape::transition`],
//!   [`PoolShape::has_headroom`], [`PoolShape::never_takes_hot_region`]), and the arithmetic of their inputs
//!   ([`PoolShape::releasable_pages`], [`PoolShape::next_step_blocks`]): the vLLM adapter gathers the counts
//!   from vLLM's managers and asks here.
//! - [`AdmissionPass`]: what one schedule pass's admissions decide together: first come, first served, and a
//!   request left waiting counts as a low pool for the pass's transitions.
//!
//! A summary comes from vLLM's worker (`hisparse.integrations.vllm.heat`) with the request ids of its
//! batch: its `requests` are indices into them. `fifo` never reports heat.

use crate::error::{invalid, Result};
use crate::heat::HeatSummary;
use crate::ids::IdMap;

/// Where a page stands in a request's release order: its tier, then its rank inside the tier.
type Rank = (u8, u32);
const COLDEST: u8 = 0;
const UNLISTED: u8 = 1;
const HOTTEST: u8 = 2;

/// What the last summary said of one request.
#[derive(Debug, Default)]
struct Ranking {
    /// Listed page -> its rank (tier and position in the summary's order).
    listed: IdMap<u32, Rank>,
}

impl Ranking {
    fn rank(&self, page: u32) -> Rank {
        self.listed.get(&page).copied().unwrap_or((UNLISTED, page))
    }
}

/// vLLM's HiSparse layout as the decisions see it; every count is in blocks of vLLM's shared GPU pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolShape {
    /// Tokens per page (vLLM's block size).
    pub block_size: usize,
    /// Blocks a page holds while resident: one per resident group.
    pub blocks_per_page: usize,
    /// Blocks a hot region costs, every hot group's together.
    pub hot_blocks: usize,
    /// Resident pages admission reserves for a request (vLLM's `max_admission_blocks_per_request`): one
    /// that holds them all moves to its hot region whatever the pool holds, unless it never takes one.
    pub admission_pages: usize,
    /// Pages at a request's tail that are never released (vLLM's `ACTIVE_TAIL_PAGES`).
    pub tail_pages: usize,
    /// Free blocks under which vLLM counts the pool as low (its coordinator's `transition_watermark`).
    pub low_watermark: usize,
}

/// A waiting request, as [`PoolShape::has_headroom`] counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Admission {
    /// Its tokens (prompt, and output so far when it resumes).
    pub tokens: usize,
    /// Of them, a prefix hit.
    pub computed_tokens: usize,
    /// The most tokens a step schedules for it (vLLM's `max_num_batched_tokens`): its admission window.
    pub chunk_tokens: usize,
    /// The most tokens it can reach (prompt, output and the KV slots allocated past its end); None when
    /// that is not bounded. One too short ever to take a hot region ([`PoolShape::never_takes_hot_region`])
    /// never reads from the host: every page of it stays resident, a prefix hit of it restored whole.
    pub longest_tokens: Option<usize>,
}

/// vLLM's pool as an admission finds it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolState {
    /// Free blocks (vLLM counts released, still readable pages as free).
    pub free_blocks: usize,
    /// Requests holding blocks.
    pub running: usize,
    /// Of them, those reading through their hot region already: their new pages are released once
    /// copied, so they grow by an indexer block a page, where the others keep every block of every page.
    pub reading_host: usize,
    /// Blocks still owed to the hot regions of requests already asked to take one.
    pub owed_hot_blocks: usize,
    /// Some running request has no hot region yet and may still take one.
    pub may_take_hot: bool,
}

/// What [`PoolShape::transition`] decides for a request that does not read through a hot region yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The pool is not low and the request is within its admission window: nothing to do.
    Stay,
    /// The pool is low, but releasing the request's pages would free no more than its region costs.
    Declined,
    /// Worth it, but the pool cannot grant the region now without vLLM preempting someone: wait for room.
    Postponed,
    /// Take a hot region.
    Take,
}

impl Transition {
    pub fn name(self) -> &'static str {
        match self {
            Transition::Stay => "stay",
            Transition::Declined => "declined",
            Transition::Postponed => "postponed",
            Transition::Take => "take",
        }
    }
}

impl PoolShape {
    fn pages(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size.max(1))
    }

    /// Whether releasing `releasable_pages` pages frees more blocks than a hot region costs ([`worth_transition`]).
    pub fn worth_transition(&self, releasable_pages: usize) -> bool {
        worth_transition(releasable_pages, self.blocks_per_page, self.hot_blocks)
    }

    /// Under `coldest`, for a request not reading through a hot region yet: `fills_window` (it holds the
    /// resident pages admission reserved for it), `free_blocks` in vLLM's pool, `admission_waiting` (an
    /// admission was deferred this step, which counts as a low pool), `releasable_pages` (its pages outside
    /// the tail not released yet), `next_blocks` (what its next step allocates for new pages), and
    /// `longest_tokens` (the most it can reach; None: unbounded). Filling the admission window moves it
    /// (pinned pages past the window could outgrow the pool), unless it never takes a region
    /// ([`Self::never_takes_hot_region`]: admission counted its every page); a low pool moves it only when
    /// that pays. Either waits until the pool can grant the region with the next step's blocks
    /// (its pages go back only once their copies complete, steps later): vLLM would preempt someone for
    /// them, and a request running alone preempts itself, starts over and fills its window again, forever
    /// when nothing of it is reused.
    pub fn transition(
        &self,
        fills_window: bool,
        free_blocks: usize,
        admission_waiting: bool,
        releasable_pages: usize,
        next_blocks: usize,
        longest_tokens: Option<usize>,
    ) -> Transition {
        if !fills_window || self.keeps_every_page(longest_tokens) {
            if free_blocks >= self.low_watermark && !admission_waiting {
                return Transition::Stay;
            }
            if !self.worth_transition(releasable_pages) {
                return Transition::Declined;
            }
        }
        if free_blocks < self.hot_blocks.saturating_add(next_blocks) {
            Transition::Postponed
        } else {
            Transition::Take
        }
    }

    /// The pages a request of `row_pages` (its rows' length) could release by taking a hot region: those
    /// outside its tail not released already (`released_pages`).
    pub fn releasable_pages(&self, row_pages: usize, released_pages: usize) -> usize {
        row_pages.saturating_sub(self.tail_pages).saturating_sub(released_pages)
    }

    /// The blocks a request's next step allocates for new pages, every resident group's and the indexer's
    /// for each: its next prefill chunk's (at most `chunk_tokens` of the `tokens_left` past `step_end`, the
    /// tokens it has computed once the current step has run; `chunk_tokens` 0: no limit), or a decode's one
    /// page; at least one page, the next step's growth a decision must leave room for.
    pub fn next_step_blocks(&self, step_end: usize, tokens_left: usize, chunk_tokens: usize) -> usize {
        let tokens = match (tokens_left, chunk_tokens) {
            (0, _) => 1,
            (left, 0) => left,
            (left, chunk) => left.min(chunk),
        };
        let pages = self.pages(step_end.saturating_add(tokens)) - self.pages(step_end);
        pages.max(1).saturating_mul(self.blocks_per_page + 1)
    }

    /// Whether a request that never grows past `longest_tokens` is never to be moved to a hot region: its
    /// releasable pages never free more blocks than a region costs, so a region never pays for itself, at
    /// its admission window or after it. It keeps every page resident, which admission counts
    /// ([`Self::has_headroom`]), so it may hold more pages than its window ([`Self::transition`]'s caller
    /// does not move it when the window fills). Reading through a region would peak at its window and the
    /// region, more blocks than all its pages: where vLLM moves it at its window, a pool that holds two such
    /// requests resident holds only one beside a region (`benches/vllm_capacity.py`, `region_costlier`).
    pub fn never_takes_hot_region(&self, longest_tokens: usize) -> bool {
        !self.worth_transition(self.pages(longest_tokens).saturating_sub(self.tail_pages))
    }

    /// [`Self::never_takes_hot_region`] of a length that may be unbounded (None: it may take one).
    fn keeps_every_page(&self, longest_tokens: Option<usize>) -> bool {
        longest_tokens.is_some_and(|longest| self.never_takes_hot_region(longest))
    }

    /// Whether `ask` may start now: the pool keeps, after its peak need, the hot regions owed to requests
    /// already asked to transition, one more hot region while a running request may still take one, and room
    /// to grow: a page for every running request that keeps its pages, and an indexer block for every one
    /// that reads through its hot region plus one page for them all (their pages go back to the pool as they
    /// are copied, so only the few crossing a page boundary at once hold a page more). Its peak need is
    /// counted as if nothing of its prefix were on the GPU: every indexer page (one block each), its admission
    /// window of resident pages and one chunk more (the next chunk is allocated, with the hot region, before
    /// the window that filled up is released; vLLM's window is the tokens in flight, two chunks under async
    /// scheduling, one without; `admission_pages` 0: one chunk), and a hot region when it will read through
    /// one: a prompt longer than its window, a prefix hit (its pages may be on the host only, and vLLM gives
    /// any prefix hit a hot region), or a pool left low enough to move it at once. A request that never
    /// takes a region ([`Self::never_takes_hot_region`]) reads through none: every page of it is resident,
    /// past its window too, its prefix hit restored whole. Its growth is reserved as any running request's
    /// that keeps its pages, a page: where running requests outgrow the pool, vLLM preempts (counting its
    /// longest length instead admitted fewer and took more steps on long answers).
    pub fn has_headroom(&self, ask: &Admission, pool: &PoolState) -> bool {
        // In u128: a product or sum of usize counts cannot wrap (the engine's counts are far smaller, but
        // a count near usize::MAX must not turn a refusal into an admission).
        let wide = |n: usize| n as u128;
        let free = wide(pool.free_blocks);
        let pages = self.pages(ask.tokens);
        let need = if self.keeps_every_page(ask.longest_tokens) {
            wide(pages) * (wide(self.blocks_per_page) + 1)
        } else {
            let new_pages = pages.saturating_sub(ask.computed_tokens / self.block_size.max(1));
            let chunk = self.pages(ask.chunk_tokens);
            let window = if self.admission_pages > 0 { self.admission_pages } else { chunk };
            let peak = wide(new_pages).min(wide(window) + wide(chunk));
            let need = wide(pages) + peak * wide(self.blocks_per_page);
            let region =
                new_pages > window || ask.computed_tokens > 0 || free < need + wide(self.low_watermark);
            need + if region { wide(self.hot_blocks) } else { 0 }
        };
        let spare_hot = if pool.may_take_hot { self.hot_blocks } else { 0 };
        let page = wide(self.blocks_per_page) + 1;
        let reading_host = pool.reading_host.min(pool.running);
        let growth = wide(pool.running - reading_host) * page
            + wide(reading_host)
            + u128::from(reading_host > 0) * page;
        let reserve = wide(pool.owed_hot_blocks) + wide(spare_hot) + growth;
        free >= need + reserve
    }
}

/// One schedule pass's admissions, in vLLM's waiting-queue order. Once a request is refused, every later one
/// waits behind it until the pass ends, as when vLLM's allocator cannot place the head of its queue: a refused
/// long request would otherwise be overtaken by every shorter one for as long as they keep coming. And the
/// refusal counts as a low pool for the pass's transitions ([`Self::transition`]), so that the requests worth
/// moving to their hot regions free room for the one waiting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdmissionPass {
    refused: bool,
}

impl AdmissionPass {
    /// Whether this pass still admits: no request was refused in it. Asked first, so that the caller gathers
    /// the pool's counts only for an admission that may be granted.
    pub fn admitting(&self) -> bool {
        !self.refused
    }

    /// Whether `ask` starts now: no request was refused before it in this pass, and the pool keeps its
    /// headroom ([`PoolShape::has_headroom`]). A refusal holds the rest of the pass.
    pub fn admit(&mut self, shape: &PoolShape, ask: &Admission, pool: &PoolState) -> bool {
        let admitted = !self.refused && shape.has_headroom(ask, pool);
        self.refused |= !admitted;
        admitted
    }

    /// [`PoolShape::transition`] in this pass, where a request left waiting counts as a low pool.
    pub fn transition(
        &self,
        shape: &PoolShape,
        fills_window: bool,
        free_blocks: usize,
        releasable_pages: usize,
        next_blocks: usize,
        longest_tokens: Option<usize>,
    ) -> Transition {
        shape.transition(
            fills_window,
            free_blocks,
            self.refused,
            releasable_pages,
            next_blocks,
            longest_tokens,
        )
    }

    /// The pass is over: the next one admits afresh.
    pub fn end(&mut self) {
        self.refused = false;
    }
}

/// Per-request selection heat and the orders derived from it (module docs). The decisions on vLLM's counts
/// are [`PoolShape`]'s, which keeps no state, and a schedule pass's [`AdmissionPass`]'s.
#[derive(Debug, Default)]
pub struct PoolPolicy {
    requests: IdMap<String, Ranking>,
}

impl PoolPolicy {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes a worker's summary: `summary.requests[i]` is an index into `request_ids`, and each request it
    /// lists replaces what was known of that request. A summary naming an index past `request_ids` is
    /// refused whole.
    pub fn report(&mut self, summary: &HeatSummary, request_ids: &[String]) -> Result<()> {
        summary.validate()?;
        if let Some(&index) =
            summary.requests.iter().find(|&&i| usize::try_from(i).map_or(true, |i| i >= request_ids.len()))
        {
            return invalid(format!(
                "a heat summary names request {index} of a batch of {}",
                request_ids.len()
            ));
        }
        for (i, &index) in summary.requests.iter().enumerate() {
            let listed = (summary.offsets[i + 1] - summary.offsets[i]) as usize;
            let mut r = Ranking { listed: IdMap::with_capacity_and_hasher(listed, Default::default()) };
            for (k, (_, page)) in summary.coldest(i).enumerate() {
                r.listed.insert(page, (COLDEST, k as u32));
            }
            for (k, (_, page)) in summary.hottest(i).enumerate() {
                r.listed.insert(page, (HOTTEST, k as u32));
            }
            self.requests.insert(request_ids[index as usize].clone(), r);
        }
        Ok(())
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
        // Pages 4 and 6 never selected, 2 hardly; 0 (a sink) and 7 the hottest; 5 and 8 unlisted.
        summary.push(1, vec![(0, 4), (0, 6), (3, 2)], vec![(9, 7), (90, 0)]);
        summary.push(0, vec![(0, 9), (2, 5)], vec![(4, 1)]);
        let mut p = PoolPolicy::new();
        p.report(&summary, &ids(&["x", "a"])).unwrap();
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
        p.report(&first, &ids(&["a"])).unwrap();
        p.report(&later, &ids(&["a"])).unwrap();
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
        assert!(p.report(&summary, &ids(&["a", "b"])).is_err());
        assert!(p.is_empty());
    }

    /// DeepSeek-V3.2 under vLLM (block 64, 6 resident groups, a hot region of 6 x 64 blocks), a pool of
    /// 4,000 blocks, a 128-page admission window, vLLM's 2 tail pages and a watermark of a tenth.
    const DSV32: PoolShape = PoolShape {
        block_size: 64,
        blocks_per_page: 6,
        hot_blocks: 384,
        admission_pages: 128,
        tail_pages: 2,
        low_watermark: 400,
    };

    #[test]
    fn a_request_moves_when_its_window_fills_or_when_a_low_pool_gains_by_it() {
        let s = DSV32;
        // Filling the admission window moves it whatever its pages would free...
        assert_eq!(s.transition(true, 4000, false, 0, 7, None), Transition::Take);
        // ...once the pool holds the region and the next step's blocks (a 32-page chunk here).
        assert_eq!(s.transition(true, 607, false, 0, 224, None), Transition::Postponed);
        assert_eq!(s.transition(true, 608, false, 0, 224, None), Transition::Take);
        // A pool above the watermark with nobody waiting: nothing to do.
        assert_eq!(s.transition(false, 400, false, 100, 7, None), Transition::Stay);
        // Low (or an admission waiting): only when releasing frees more than the region costs...
        assert_eq!(s.transition(false, 399, false, 64, 7, None), Transition::Declined);
        assert_eq!(s.transition(false, 4000, true, 64, 7, None), Transition::Declined);
        assert_eq!(s.transition(false, 399, false, 65, 7, None), Transition::Take);
        assert_eq!(s.transition(false, 4000, true, 65, 7, None), Transition::Take);
        // ...and the pool can grant the region and the next step's blocks without vLLM preempting anyone.
        assert_eq!(s.transition(false, 390, false, 65, 7, None), Transition::Postponed);
        assert_eq!(s.transition(false, 391, false, 65, 7, None), Transition::Take);
    }

    #[test]
    fn a_transitions_inputs_are_its_pages_outside_the_tail_and_its_next_steps_growth() {
        let s = DSV32;
        assert_eq!(s.releasable_pages(100, 30), 68);
        assert_eq!(s.releasable_pages(100, 98), 0);
        assert_eq!(s.releasable_pages(1, 0), 0);
        // A decode within its page, or at a page boundary: one page of 6 resident blocks and an indexer block.
        assert_eq!(s.next_step_blocks(1000, 0, 2048), 7);
        assert_eq!(s.next_step_blocks(1024, 0, 2048), 7);
        // A prefill chunk of 2,048 tokens from a page boundary: 32 pages; 200 tokens left from 1,000: 3 pages
        // (1,000 sits in page 15, allocated already; 1,199 in page 18).
        assert_eq!(s.next_step_blocks(1024, 10_000, 2048), 32 * 7);
        assert_eq!(s.next_step_blocks(1000, 200, 2048), 3 * 7);
        // Without a chunk limit, the whole prompt left.
        assert_eq!(s.next_step_blocks(0, 64 * 100, 0), 100 * 7);
        assert_eq!(s.next_step_blocks(usize::MAX - 1, 10, 0), 7);
    }

    #[test]
    fn short_requests_never_take_a_hot_region() {
        let s = DSV32;
        // tests/test_vllm_defaults.py's short requests: prompts of 100-400 tokens, 64 more generated.
        assert!((100..=400).all(|prompt| s.never_takes_hot_region(prompt + 64)));
        // 66 pages, 64 releasable outside the tail: 384 blocks, no more than the region.
        assert!(s.never_takes_hot_region(66 * 64));
        assert!(!s.never_takes_hot_region(66 * 64 + 1));
        // Past its admission window (128 pages) with too few releasable pages to pay for a region: it keeps
        // them all (vLLM would move it at the window, to peak at 128 pages and the region).
        let wide = PoolShape { hot_blocks: 10_000, ..s };
        assert!(wide.never_takes_hot_region(1668 * 64));
        assert!(!wide.never_takes_hot_region(1668 * 64 + 1));
        assert_eq!(wide.transition(true, 20_000, false, 0, 7, Some(1668 * 64)), Transition::Stay);
        assert_eq!(wide.transition(true, 300, false, 1666, 7, Some(1668 * 64)), Transition::Declined);
        assert_eq!(wide.transition(true, 20_000, false, 0, 7, Some(1668 * 64 + 1)), Transition::Take);
        assert_eq!(wide.transition(true, 20_000, false, 0, 7, None), Transition::Take);
    }

    #[test]
    fn admission_keeps_room_for_the_running_requests() {
        let s = DSV32;
        let empty = PoolState { free_blocks: 4000, ..PoolState::default() };
        // 3,000 tokens in one 8,192-token window: 47 indexer pages and 47 x 6 resident blocks = 329; into a
        // pool then still above the watermark, no hot region.
        let ask = Admission { tokens: 3000, computed_tokens: 0, chunk_tokens: 8192, longest_tokens: None };
        assert!(s.has_headroom(&ask, &PoolState { free_blocks: 329 + 400, ..empty }));
        // Less, and the pool it leaves is low: it would move at once, so its region counts too.
        assert!(s.has_headroom(&ask, &PoolState { free_blocks: 329 + 384, ..empty }));
        assert!(!s.has_headroom(&ask, &PoolState { free_blocks: 329 + 383, ..empty }));
        // Unless it never takes one: then the region is never counted.
        let short = Admission { longest_tokens: Some(3000), ..ask };
        assert!(s.has_headroom(&short, &PoolState { free_blocks: 329, ..empty }));
        assert!(!s.has_headroom(&short, &PoolState { free_blocks: 328, ..empty }));
        // A prefix hit, or a prompt longer than its admission window, reads through a hot region: it is counted.
        let hit = Admission { computed_tokens: 1024, ..ask };
        let hit_need = 47 + (47 - 16) * 6 + 384;
        assert!(s.has_headroom(&hit, &PoolState { free_blocks: hit_need, ..empty }));
        assert!(!s.has_headroom(&hit, &PoolState { free_blocks: hit_need - 1, ..empty }));
        // 188 pages in 32-page chunks: it fills its 128-page window, then takes its region and the next chunk
        // before anything is released (under async scheduling the window is two chunks, not one: counting
        // one, a request admitted into a pool that held two was preempted once its prefill filled it).
        let long = Admission { tokens: 12_000, chunk_tokens: 2048, ..ask };
        let long_need = 188 + (128 + 32) * 6 + 384;
        assert!(s.has_headroom(&long, &PoolState { free_blocks: long_need, ..empty }));
        assert!(!s.has_headroom(&long, &PoolState { free_blocks: long_need - 1, ..empty }));
        // A prompt within its window keeps its pages, unless the pool it leaves is low.
        let within = Admission { tokens: 8000, chunk_tokens: 2048, ..ask };
        assert!(s.has_headroom(&within, &PoolState { free_blocks: 125 * 7 + 400, ..empty }));
        assert!(!s.has_headroom(&within, &PoolState { free_blocks: 125 * 7 + 383, ..empty }));
        // Without a window (admission_pages 0), one chunk stands for it.
        let unknown = PoolShape { admission_pages: 0, ..s };
        let one_chunk_need = 188 + 2 * 32 * 6 + 384;
        assert!(unknown.has_headroom(&long, &PoolState { free_blocks: one_chunk_need, ..empty }));
        assert!(!unknown.has_headroom(&long, &PoolState { free_blocks: one_chunk_need - 1, ..empty }));
        // Running requests: a page of growth each, the hot regions owed, and one more while one may take it.
        let pool = PoolState {
            free_blocks: 4000,
            running: 3,
            reading_host: 0,
            owed_hot_blocks: 384,
            may_take_hot: true,
        };
        let reserve = 3 * 7 + 384 + 384;
        assert!(s.has_headroom(&short, &PoolState { free_blocks: 329 + reserve, ..pool }));
        assert!(!s.has_headroom(&short, &PoolState { free_blocks: 329 + reserve - 1, ..pool }));
        let none_may = PoolState { may_take_hot: false, ..pool };
        assert!(s.has_headroom(&short, &PoolState { free_blocks: 329 + reserve - 384, ..none_may }));
        // Two of them read through their hot regions: an indexer block each, and one page for both.
        let two_host = PoolState { reading_host: 2, ..pool };
        let reserve = 7 + 2 + 7 + 384 + 384;
        assert!(s.has_headroom(&short, &PoolState { free_blocks: 329 + reserve, ..two_host }));
        assert!(!s.has_headroom(&short, &PoolState { free_blocks: 329 + reserve - 1, ..two_host }));
        // A pool that cannot hold even the request's pages.
        assert!(!s.has_headroom(&short, &PoolState { free_blocks: 0, ..empty }));
        // A short request's prefix hit is restored whole: its pages count, and no region.
        let short_hit = Admission { computed_tokens: 1024, ..short };
        assert!(s.has_headroom(&short_hit, &PoolState { free_blocks: 329, ..empty }));
        assert!(!s.has_headroom(&short_hit, &PoolState { free_blocks: 328, ..empty }));
        // Its every page counts, past its window too: 188 pages of 7 blocks, where reading through a region
        // would peak at 188 indexer blocks, its window and a chunk of 6 and the region.
        let wide = PoolShape { hot_blocks: 10_000, ..s };
        let longer = Admission { longest_tokens: Some(200 * 64), ..long };
        assert!(wide.has_headroom(&longer, &PoolState { free_blocks: 188 * 7, ..empty }));
        assert!(!wide.has_headroom(&longer, &PoolState { free_blocks: 188 * 7 - 1, ..empty }));
        let unbounded = Admission { longest_tokens: None, ..longer };
        assert!(!wide.has_headroom(&unbounded, &PoolState { free_blocks: 188 + 160 * 6 + 9_999, ..empty }));
    }

    #[test]
    fn a_refused_admission_holds_the_rest_of_its_pass_and_counts_as_a_low_pool() {
        let s = DSV32;
        let short =
            Admission { tokens: 3000, computed_tokens: 0, chunk_tokens: 8192, longest_tokens: Some(3000) };
        let long = Admission { tokens: 60_000, longest_tokens: None, ..short };
        let pool = PoolState { free_blocks: 1000, ..PoolState::default() };
        let mut pass = AdmissionPass::default();
        assert!(pass.admitting() && pass.admit(&s, &short, &pool));
        // A pool above the watermark: a request within its window stays as it is.
        assert_eq!(pass.transition(&s, false, 1000, 65, 7, None), Transition::Stay);
        // The long one does not fit; the short one behind it would, but waits its turn.
        assert!(!pass.admit(&s, &long, &pool));
        assert!(!pass.admitting());
        assert!(!pass.admit(&s, &short, &pool));
        // Meanwhile a request whose pages pay for its region moves, to make room; one whose do not, stays.
        assert_eq!(pass.transition(&s, false, 1000, 65, 7, None), Transition::Take);
        assert_eq!(pass.transition(&s, false, 1000, 64, 7, None), Transition::Declined);
        // The next pass admits afresh, in queue order.
        pass.end();
        assert!(pass.admitting() && pass.admit(&s, &short, &pool));
        assert_eq!(pass.transition(&s, false, 1000, 65, 7, None), Transition::Stay);
    }

    #[test]
    fn counts_near_the_limit_do_not_wrap_into_the_opposite_answer() {
        let s = DSV32;
        assert_eq!(s.transition(true, 100, false, 0, usize::MAX, None), Transition::Postponed);
        let ask =
            Admission { tokens: 3000, computed_tokens: 0, chunk_tokens: 8192, longest_tokens: Some(3000) };
        let pool = PoolState { free_blocks: 4000, ..PoolState::default() };
        assert!(s.has_headroom(&ask, &pool));
        assert!(s.has_headroom(&ask, &PoolState { free_blocks: usize::MAX, ..pool }));
        assert!(!s.has_headroom(&ask, &PoolState { owed_hot_blocks: usize::MAX, ..pool }));
        assert!(!s.has_headroom(&ask, &PoolState { running: 1 << 63, ..pool }));
        let huge = Admission { tokens: usize::MAX, chunk_tokens: usize::MAX, longest_tokens: None, ..ask };
        assert!(!s.has_headroom(&huge, &pool));
    }

    #[test]
    fn transition_only_when_it_frees_more_than_it_costs() {
        // DeepSeek-V3.2 under vLLM: 6 resident groups, a hot region of 6 x 64 blocks.
        assert!(!worth_transition(30, 6, 384));
        assert!(!worth_transition(64, 6, 384));
        assert!(worth_transition(65, 6, 384));
        assert!(!DSV32.worth_transition(64) && DSV32.worth_transition(65));
    }
}
