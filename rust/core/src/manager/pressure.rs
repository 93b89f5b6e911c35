//! Pressure: which pages to release (and which requests lease a hot region) to keep the watermark,
//! decided in a dry run that mutates nothing, then carried out.

use super::releasable::Order;
use super::*;
use crate::pool_policy::worth_transition;

/// The pressure dry run's view of the pool: free blocks and the pins left on blocks it released pages of
/// (a page shared by several requests frees its block only when the last of them lets go).
#[derive(Clone)]
struct DryRun {
    free: i64,
    pins: IdMap<BlockId, u32>,
    actions: Vec<Action>,
}

impl DryRun {
    fn block(m: &ResidencyManager, request: u64, page: u32) -> BlockId {
        m.requests[&request].pages[page as usize].state.table_entry().gpu_block
    }

    /// Pins left on the page's block in this dry run.
    fn pins_left(&self, m: &ResidencyManager, request: u64, page: u32) -> u32 {
        let block = Self::block(m, request, page);
        self.pins.get(&block).copied().unwrap_or_else(|| m.pool.ref_count(block))
    }

    fn release(&mut self, m: &ResidencyManager, request: u64, page: u32) {
        let block = Self::block(m, request, page);
        let left = self.pins.entry(block).or_insert_with(|| m.pool.ref_count(block));
        *left -= 1;
        if *left == 0 {
            self.free += 1;
        }
        self.actions.push(Action::Release { request, page });
    }
}

/// One request in the pressure merge, and its releasable pages in pressure order after the one it has in
/// the heap: opened when the merge first takes one of its pages (most requests give none in a step).
struct Cursor<'a> {
    id: u64,
    order: Option<Order<'a>>,
}
type ColdHeap = BinaryHeap<Reverse<(u32, u32, u64, usize)>>;

impl ResidencyManager {
    /// Plans the releases (and hot leases) that bring free blocks to `needed + watermark`, or as close as
    /// the policy allows, after releasing `base`. Returns the actions and the free blocks they leave.
    pub(super) fn plan_pressure(
        &self,
        needed: u32,
        prefer: &[u64],
        base: &[(u64, u32)],
    ) -> (Vec<Action>, i64) {
        let hot_cost = self.hot_cost() as i64;
        let target = needed as i64 + self.cfg.watermark as i64;
        let mut run =
            DryRun { free: self.pool.num_free() as i64, pins: IdMap::default(), actions: Vec::new() };
        for &(id, page) in base {
            run.release(self, id, page);
        }
        if run.free >= target {
            return (run.actions, run.free);
        }
        // A merge of the requests' releasable sets, coldest first: a heap of each request's next page. It
        // starts from the front of its order each request keeps, so a step reads one field per hot-region
        // holder and walks the pages only of the requests it releases from.
        let mut cursors: Vec<Cursor<'_>> = Vec::new();
        let mut heap = ColdHeap::new();
        if self.cfg.policy == PressurePolicy::Coldest {
            // Pages of requests that already hold a hot region cost nothing extra to release. Any order of
            // them will do: no two requests share an `order`, so the heap's keys never tie.
            for (&id, r) in self.requests.iter().filter(|(_, r)| r.holds_hot_region()) {
                if let Some((heat, page)) = r.releasable.front() {
                    heap.push(Reverse((heat, page, r.order, cursors.len())));
                }
                cursors.push(Cursor { id, order: None });
            }
        }
        let mut tried: IdSet<u64> = IdSet::default();
        while run.free < target {
            if let Some(Reverse((_, page, order, i))) = heap.pop() {
                let Cursor { id, order: pages } = &mut cursors[i];
                run.release(self, *id, page);
                let pages = pages.get_or_insert_with(|| {
                    // Opened at its front: the page just taken.
                    let mut pages = self.requests[id].releasable.order();
                    pages.next();
                    pages
                });
                if let Some((heat, next)) = pages.next() {
                    heap.push(Reverse((heat, next, order, i)));
                }
                continue;
            }
            let Some(id) = self.pick_transition(&tried, prefer) else {
                break;
            };
            tried.insert(id);
            let own: Vec<u32> = match self.cfg.policy {
                PressurePolicy::Fifo => self.newest_first(id),
                // Only a prefix of its pressure order matters: the move pays once hot_cost + 1 of its pages
                // free a block, and below it releases upfront at most hot_cost pages that do (the pool's
                // free count never drops below 0). So a long history is not walked.
                _ => {
                    let mut prefix = Vec::new();
                    let mut frees = 0;
                    for (_, page) in self.requests[&id].releasable.order() {
                        if frees > hot_cost {
                            break;
                        }
                        frees += (run.pins_left(self, id, page) == 1) as i64;
                        prefix.push(page);
                    }
                    prefix
                }
            };
            // Pages shared with other requests free nothing when this one lets go: count what it really frees.
            let gain = own.iter().filter(|&&page| run.pins_left(self, id, page) == 1).count();
            if !worth_transition(gain, 1, hot_cost as usize) {
                continue;
            }
            // Release its own pages first while the pool cannot pay for its hot region; under fifo all of them.
            let before = run.clone();
            let mut upfront = 0;
            for &page in &own {
                if self.cfg.policy == PressurePolicy::Coldest && run.free >= hot_cost {
                    break;
                }
                run.release(self, id, page);
                upfront += 1;
            }
            if run.free < hot_cost {
                // Its pages are shared with others: releasing them frees too little. Leave it full.
                run = before;
                continue;
            }
            run.actions.push(Action::LeaseHot { request: id });
            run.free -= hot_cost;
            if self.cfg.policy == PressurePolicy::Coldest {
                // Its pages after those released upfront join the merge.
                let r = &self.requests[&id];
                let mut pages = r.releasable.order();
                if let Some((heat, page)) = pages.nth(upfront) {
                    heap.push(Reverse((heat, page, r.order, cursors.len())));
                }
                cursors.push(Cursor { id, order: Some(pages) });
            }
        }
        (run.actions, run.free)
    }

    /// The request whose transition to mixed residency frees the most blocks net of its hot region;
    /// the scheduler's `prefer` order first under `fifo` (vLLM transitions the request that asks).
    pub(super) fn pick_transition(&self, done: &IdSet<u64>, prefer: &[u64]) -> Option<u64> {
        if !self.cfg.policy.tiers() {
            return None;
        }
        let hot_cost = self.hot_cost() as usize;
        let eligible = |id: &u64| {
            let r = &self.requests[id];
            !done.contains(id)
                && r.hot.is_none()
                && !r.unread
                && r.row().is_some()
                && worth_transition(r.releasable.len(), 1, hot_cost)
        };
        if self.cfg.policy == PressurePolicy::Fifo {
            if let Some(&id) = prefer.iter().find(|id| self.requests.contains_key(id) && eligible(id)) {
                return Some(id);
            }
        }
        self.requests
            .iter()
            .filter(|(id, _)| eligible(id))
            .max_by_key(|(_, r)| (r.releasable.len(), std::cmp::Reverse(r.order)))
            .map(|(&id, _)| id)
    }

    pub(super) fn apply_pressure(&mut self, actions: &[Action]) -> Result<()> {
        for &action in actions {
            match action {
                Action::Release { request, page } => {
                    let before = self.req(request)?.residency(self.cfg.tail_pages);
                    self.release_page(request, page)?;
                    self.note_transition(request, before)?;
                }
                Action::LeaseHot { request } => self.lease_hot(request)?,
            }
        }
        Ok(())
    }

    /// Makes `needed` blocks obtainable, releasing pages if the watermark asks for it. Returns the blocks
    /// still missing (nothing changed then), or 0.
    pub(super) fn reclaim(&mut self, needed: u32, prefer: &[u64], base: &[(u64, u32)]) -> Result<u32> {
        let (actions, free_after) = self.plan_pressure(needed, prefer, base);
        if free_after < needed as i64 {
            return Ok((needed as i64 - free_after) as u32);
        }
        self.apply_pressure(&actions)?;
        Ok(0)
    }
}
