//! The residency manager: the scheduler-side state of every request's pages, and the one place where
//! pages change state.
//!
//! Per step the scheduler calls [`ResidencyManager::plan_step`] with the requests it runs and how many
//! tokens each adds. The manager allocates their pages, keeps a watermark of free blocks by releasing
//! clean pages (leasing a hot region to a request the first time it releases any), plans proactive copies
//! of complete pages to the host, and returns a [`StepPlan`]. The worker reports copies back through
//! [`ResidencyManager::complete`] and selection heat through [`ResidencyManager::report_heat`].
//!
//! Cost per call grows with what changes in the step, never with context length: pages that can be
//! released are kept in per-request ordered sets, copies to plan in a queue, table updates in a list.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};

use crate::block_pool::{BlockId, BlockPool, Reader};
use crate::config::{Config, PressurePolicy};
use crate::error::{invalid, invariant, CoreError, Resource, Result};
use crate::host_pool::{HostBlockId, HostPool};
use crate::page::{PageState, Residency, TransferId};
use crate::plan::{HotUpdate, PageCopy, Restore, StepPlan, TableUpdate, Transition};

#[derive(Clone, Debug)]
struct Page {
    state: PageState,
    hash: Option<u64>,
    heat: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Running {
        row: u32,
    },
    /// Holds only host-only pages (its durable prefix); no row, no GPU blocks.
    Preempted,
}

#[derive(Clone, Debug)]
struct Request {
    order: u64,
    status: Status,
    pages: Vec<Page>,
    /// Tokens backed by pages (including those the current step writes).
    seq_len: u32,
    /// Pages known complete and written, already queued for a host copy if they needed one.
    complete_pages: u32,
    max_len: u32,
    hashes: Vec<u64>,
    hot: Option<Vec<BlockId>>,
    /// Clean pages outside the tail, by (heat, page): what the pressure policy may release.
    releasable: BTreeSet<(u32, u32)>,
    host_only: u32,
    released: u32,
}

impl Request {
    fn row(&self) -> Option<u32> {
        match self.status {
            Status::Running { row } => Some(row),
            Status::Preempted => None,
        }
    }

    fn in_tail(&self, page: u32, tail_pages: u32) -> bool {
        page as usize + tail_pages as usize >= self.pages.len()
    }

    fn residency(&self, tail_pages: u32) -> Residency {
        let outside_tail = self.pages.len().saturating_sub(tail_pages as usize) as u32;
        if self.host_only == 0 {
            Residency::Full
        } else if self.host_only >= outside_tail {
            Residency::None
        } else {
            Residency::Mixed
        }
    }
}

/// Who waits for an in-flight copy: a page, or nobody any more (its request finished or was preempted)
/// while the copy still reads the block, which therefore stays pinned until the copy ends.
#[derive(Clone, Copy, Debug)]
enum CopyOwner {
    Page {
        request: u64,
        page: u32,
    },
    /// An orphan's host block carries a host reservation of its own until the copy ends, so admission
    /// never promises that block to anyone meanwhile.
    Orphan {
        block: BlockId,
        host: HostBlockId,
        hash: Option<u64>,
    },
}

/// The pressure dry run's view of the pool: free blocks and the pins left on blocks it released pages of
/// (a page shared by several requests frees its block only when the last of them lets go).
#[derive(Clone)]
struct DryRun {
    free: i64,
    pins: HashMap<BlockId, u32>,
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

/// A request's releasable pages in pressure order, from some point on.
type Cursor<'a> = (u64, std::iter::Skip<std::collections::btree_set::Iter<'a, (u32, u32)>>);
type ColdHeap = BinaryHeap<Reverse<(u32, u32, u64, usize)>>;

fn add_cursor<'a>(
    requests: &'a HashMap<u64, Request>,
    id: u64,
    skip: usize,
    cursors: &mut Vec<Cursor<'a>>,
    heap: &mut ColdHeap,
) {
    let r = &requests[&id];
    let mut it = r.releasable.iter().skip(skip);
    if let Some(&(heat, page)) = it.next() {
        heap.push(Reverse((heat, page, r.order, cursors.len())));
    }
    cursors.push((id, it));
}

/// What `admit` and `resume` tell the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    pub row: u32,
    /// Tokens whose KV the request already has (host prefix hits or its own kept pages); compute the rest.
    pub cached_tokens: u32,
    pub residency: Residency,
}

/// A per-request snapshot for metrics and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestInfo {
    pub row: Option<u32>,
    pub seq_len: u32,
    pub residency: Residency,
    pub num_pages: u32,
    pub host_only_pages: u32,
    pub released_pages: u32,
    pub hot_blocks: u32,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    pub gpu_blocks: u32,
    pub gpu_free: u32,
    pub gpu_used: u32,
    pub gpu_hot: u32,
    pub gpu_released: u32,
    pub host_blocks: u32,
    pub host_referenced: u32,
    pub host_cached: u32,
    pub host_reserved: u64,
    pub pending_transfers: u32,
    pub running: u32,
    pub preempted: u32,
    pub full: u32,
    pub mixed: u32,
    pub none: u32,
    pub steady_state_concurrency: u32,
    pub total_released: u64,
    pub total_lost: u64,
    pub total_materialized: u64,
    pub total_restored: u64,
}

/// One pressure action, decided in a dry run and then carried out in order.
#[derive(Clone, Copy, Debug)]
enum Action {
    Release { request: u64, page: u32 },
    LeaseHot { request: u64 },
}

/// Whatever the next plan must carry; filled by admit, finish, preempt, complete and plan_step.
#[derive(Debug, Default)]
struct Pending {
    cleared_rows: Vec<u32>,
    pages: Vec<(u64, u32)>,
    hot_rows: Vec<u64>,
    seq_lens: Vec<u64>,
    /// Pages restored from the host; resolved when the plan is drained, so a request that finished or was
    /// preempted in between contributes no copy into a block that is no longer its own.
    restores: Vec<(u64, u32, BlockId)>,
    transitions: Vec<Transition>,
    released: u32,
    lost: u32,
}

pub struct ResidencyManager {
    cfg: Config,
    pool: BlockPool,
    host: HostPool,
    requests: HashMap<u64, Request>,
    free_rows: Vec<u32>,
    next_order: u64,
    next_transfer: TransferId,
    copies: HashMap<TransferId, CopyOwner>,
    to_materialize: VecDeque<(u64, u32)>,
    /// Requests whose tokens of the last plan are written once the next plan starts.
    last_scheduled: Vec<u64>,
    /// GPU blocks reserved for every running request's minimum footprint (tail + hot region).
    gpu_reserved: u64,
    pending: Pending,
    stats: Stats,
}

impl ResidencyManager {
    pub fn new(cfg: Config) -> Result<Self> {
        cfg.validate()?;
        Ok(ResidencyManager {
            pool: BlockPool::new(cfg.num_gpu_blocks),
            host: HostPool::new(cfg.num_host_blocks),
            requests: HashMap::new(),
            free_rows: (0..cfg.max_running).rev().collect(),
            next_order: 0,
            next_transfer: 1,
            copies: HashMap::new(),
            to_materialize: VecDeque::new(),
            last_scheduled: Vec::new(),
            gpu_reserved: 0,
            pending: Pending::default(),
            stats: Stats::default(),
            cfg,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn hot_cost(&self) -> u32 {
        self.cfg.hot_blocks()
    }

    fn req(&self, id: u64) -> Result<&Request> {
        self.requests.get(&id).ok_or(CoreError::UnknownRequest(id))
    }

    fn req_mut(&mut self, id: u64) -> Result<&mut Request> {
        self.requests.get_mut(&id).ok_or(CoreError::UnknownRequest(id))
    }

    // ----------------------------------------------------------------------------------------------
    // The single place where a page changes state: counters, the releasable set and the table-update
    // list follow from here.

    fn set_page(&mut self, id: u64, page: u32, next: PageState) -> Result<()> {
        let tail = self.cfg.tail_pages;
        let r = self.req_mut(id)?;
        let p = &mut r.pages[page as usize];
        let prev = p.state;
        let table_changed = prev.table_entry() != next.table_entry();
        p.state = next;
        let heat = p.heat;
        if matches!(prev, PageState::Clean { .. }) {
            r.releasable.remove(&(heat, page));
        }
        if matches!(next, PageState::Clean { .. }) && !r.in_tail(page, tail) {
            r.releasable.insert((heat, page));
        }
        r.host_only = r.host_only + next.is_host_only() as u32 - prev.is_host_only() as u32;
        let was_released = matches!(prev, PageState::Released { .. }) as u32;
        r.released = r.released + matches!(next, PageState::Released { .. }) as u32 - was_released;
        if table_changed {
            self.pending.pages.push((id, page));
        }
        Ok(())
    }

    /// Takes a block from the pool; released pages that were still reading it become host-only now.
    fn take_block(&mut self) -> Result<BlockId> {
        let Some((block, readers)) = self.pool.allocate() else {
            return invariant("the pool ran dry after the step was checked to fit");
        };
        for Reader { request, page } in readers {
            let before = self.req(request)?.residency(self.cfg.tail_pages);
            let state = self.req(request)?.pages[page as usize].state.lose_block()?;
            self.set_page(request, page, state)?;
            self.note_transition(request, before)?;
            self.pending.lost += 1;
            self.stats.total_lost += 1;
        }
        Ok(block)
    }

    fn note_transition(&mut self, id: u64, before: Residency) -> Result<()> {
        let after = self.req(id)?.residency(self.cfg.tail_pages);
        if after != before {
            self.pending.transitions.push(Transition { request: id, from: before, to: after });
        }
        Ok(())
    }

    fn release_page(&mut self, id: u64, page: u32) -> Result<()> {
        let state = self.req(id)?.pages[page as usize].state;
        let released = state.release()?;
        let PageState::Released { block, .. } = released else { unreachable!() };
        self.pool.add_reader(block, Reader { request: id, page });
        self.pool.unpin(block)?;
        self.set_page(id, page, released)?;
        self.pending.released += 1;
        self.stats.total_released += 1;
        Ok(())
    }

    fn lease_hot(&mut self, id: u64) -> Result<()> {
        if self.req(id)?.hot.is_some() {
            return invariant(format!("request {id} leased a second hot region"));
        }
        let blocks = (0..self.hot_cost()).map(|_| self.take_block()).collect::<Result<Vec<_>>>()?;
        self.req_mut(id)?.hot = Some(blocks);
        self.pending.hot_rows.push(id);
        Ok(())
    }

    fn return_hot(&mut self, id: u64) -> Result<()> {
        if let Some(blocks) = self.req_mut(id)?.hot.take() {
            for b in blocks {
                self.pool.unpin(b)?;
            }
            self.pending.hot_rows.push(id);
        }
        Ok(())
    }

    // ----------------------------------------------------------------------------------------------
    // Pressure: decide in a dry run (no mutation), then carry out.

    /// Plans the releases (and hot leases) that bring free blocks to `needed + watermark`, or as close as
    /// the policy allows, after releasing `base`. Returns the actions and the free blocks they leave.
    fn plan_pressure(&self, needed: u32, prefer: &[u64], base: &[(u64, u32)]) -> (Vec<Action>, i64) {
        let hot_cost = self.hot_cost() as i64;
        let target = needed as i64 + self.cfg.watermark as i64;
        let mut run = DryRun { free: self.pool.num_free() as i64, pins: HashMap::new(), actions: Vec::new() };
        for &(id, page) in base {
            run.release(self, id, page);
        }
        if run.free >= target {
            return (run.actions, run.free);
        }
        // A merge of the requests' releasable sets, coldest first: a heap of each request's next page.
        let mut cursors: Vec<Cursor<'_>> = Vec::new();
        let mut heap = ColdHeap::new();
        if self.cfg.policy == PressurePolicy::Coldest {
            // Pages of requests that already hold a hot region cost nothing extra to release.
            for id in self.hot_holders() {
                add_cursor(&self.requests, id, 0, &mut cursors, &mut heap);
            }
        }
        let mut tried: HashSet<u64> = HashSet::new();
        while run.free < target {
            if let Some(Reverse((_, page, order, i))) = heap.pop() {
                run.release(self, cursors[i].0, page);
                if let Some(&(heat, next)) = cursors[i].1.next() {
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
                _ => self.requests[&id].releasable.iter().map(|&(_, p)| p).collect(),
            };
            // Pages shared with other requests free nothing when this one lets go: count what it really frees.
            let gain = own.iter().filter(|&&page| run.pins_left(self, id, page) == 1).count() as i64;
            if gain <= hot_cost {
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
                add_cursor(&self.requests, id, upfront, &mut cursors, &mut heap);
            }
        }
        (run.actions, run.free)
    }

    /// The request whose transition to mixed residency frees the most blocks net of its hot region;
    /// the scheduler's `prefer` order first under `fifo` (vLLM transitions the request that asks).
    fn pick_transition(&self, done: &HashSet<u64>, prefer: &[u64]) -> Option<u64> {
        if !self.cfg.policy.tiers() {
            return None;
        }
        let hot_cost = self.hot_cost() as usize;
        let eligible = |id: &u64| {
            let r = &self.requests[id];
            !done.contains(id) && r.hot.is_none() && r.row().is_some() && r.releasable.len() > hot_cost
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

    fn apply_pressure(&mut self, actions: &[Action]) -> Result<()> {
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
    fn reclaim(&mut self, needed: u32, prefer: &[u64], base: &[(u64, u32)]) -> Result<u32> {
        let (actions, free_after) = self.plan_pressure(needed, prefer, base);
        if free_after < needed as i64 {
            return Ok((needed as i64 - free_after) as u32);
        }
        self.apply_pressure(&actions)?;
        Ok(0)
    }

    // ----------------------------------------------------------------------------------------------
    // Admission.

    /// Admits a request of `prompt_len` tokens whose full pages hash to `prefix_hashes` (a hash chain: each
    /// page's hash covers everything before it). Pages found durably on the host are not recomputed: they
    /// start host-only (adopting a still-readable GPU copy when one exists), and the request holds a hot
    /// region from the start. Refuses, naming the resource, when the request cannot be backed.
    pub fn admit(
        &mut self,
        id: u64,
        prompt_len: u32,
        prefix_hashes: &[u64],
        max_len: Option<u32>,
    ) -> Result<Admission> {
        if self.requests.contains_key(&id) {
            return invalid(format!("request {id} is already admitted"));
        }
        let max_len = max_len.unwrap_or(self.cfg.max_model_len);
        if prompt_len == 0 || prompt_len > max_len || max_len > self.cfg.max_model_len {
            return invalid(format!(
                "need 0 < prompt_len ({prompt_len}) <= max_len ({max_len}) <= max_model_len ({})",
                self.cfg.max_model_len
            ));
        }
        if prefix_hashes.len() as u64 * self.cfg.block_size as u64 > max_len as u64 {
            return invalid(format!("{} page hashes exceed max_len {max_len}", prefix_hashes.len()));
        }
        let host_need = max_len.div_ceil(self.cfg.block_size) as u64;
        if self.host.reserved() + host_need > self.host.num_blocks() as u64 {
            return Err(CoreError::Capacity {
                resource: Resource::HostBlocks,
                needed: host_need,
                available: (self.host.num_blocks() as u64).saturating_sub(self.host.reserved()),
                message: format!(
                    "the host pool cannot back request {id}: it needs {host_need} host blocks at its max_len, \
                     {} of {} are reserved by admitted requests; raise host_pool_gib or finish requests",
                    self.host.reserved(),
                    self.host.num_blocks()
                ),
            });
        }
        // The last token is always computed, so at most (prompt_len - 1) / bs pages come from the cache.
        let max_hits = ((prompt_len - 1) / self.cfg.block_size) as usize;
        let mut hits = Vec::new();
        for &hash in prefix_hashes.iter().take(max_hits) {
            match self.host.lookup(hash) {
                Some(h) => hits.push(h),
                None => break,
            }
        }
        let pages: Vec<Page> = hits
            .iter()
            .zip(prefix_hashes)
            .map(|(&host, &hash)| Page { state: PageState::HostOnly { host }, hash: Some(hash), heat: 0 })
            .collect();
        let order = self.next_order;
        let request = Request {
            order,
            status: Status::Preempted,
            complete_pages: pages.len() as u32,
            seq_len: pages.len() as u32 * self.cfg.block_size,
            host_only: pages.len() as u32,
            pages,
            max_len,
            hashes: prefix_hashes.to_vec(),
            hot: None,
            releasable: BTreeSet::new(),
            released: 0,
        };
        self.requests.insert(id, request);
        match self.start_running(id) {
            Ok(admission) => {
                for &h in &hits {
                    self.host.incref(h);
                }
                let reserved = self.host.try_reserve(host_need);
                debug_assert!(reserved);
                self.next_order += 1;
                Ok(admission)
            }
            Err(e) => {
                self.requests.remove(&id);
                Err(e)
            }
        }
    }

    /// Brings a preempted request back, from its kept host pages (residency `None`, no recomputation of
    /// them).
    pub fn resume(&mut self, id: u64) -> Result<Admission> {
        if self.req(id)?.status != Status::Preempted {
            return invalid(format!("request {id} is running, not preempted"));
        }
        self.start_running(id)
    }

    /// Gives a request (admitted or preempted, all pages host-only) a row, adopts GPU copies still
    /// readable, restores its tail and leases its hot region. All or nothing.
    fn start_running(&mut self, id: u64) -> Result<Admission> {
        let footprint = self.cfg.min_gpu_footprint() as u64;
        let usable = self.cfg.num_gpu_blocks as u64 - 1;
        if self.gpu_reserved + footprint > usable {
            return Err(CoreError::Capacity {
                resource: Resource::GpuBlocks,
                needed: footprint,
                available: usable - self.gpu_reserved,
                message: format!(
                    "the GPU pool cannot back request {id}: every running request keeps at least {footprint} blocks \
                     (tail {} + hot region {}), and {} of {usable} are committed; raise the GPU pool, lower hot_rows, \
                     or finish requests",
                    self.cfg.tail_pages,
                    self.hot_cost(),
                    self.gpu_reserved
                ),
            });
        }
        let Some(&row) = self.free_rows.last() else {
            return Err(CoreError::Capacity {
                resource: Resource::RequestSlots,
                needed: 1,
                available: 0,
                message: format!("all {} request slots are running; raise max_running", self.cfg.max_running),
            });
        };
        let r = self.req(id)?;
        let n = r.pages.len();
        let tail_start = n.saturating_sub(self.cfg.tail_pages as usize);
        // Adoptable pages: host-only pages whose GPU copy is still findable by hash and not yet reused.
        let adopt: Vec<(u32, BlockId)> = r
            .pages
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((i as u32, self.pool.lookup(p.hash?)?)))
            .collect();
        let adopted: HashSet<u32> = adopt.iter().map(|&(p, _)| p).collect();
        // Without tiers everything comes back whole; with them the tail, and the rest reads through hot rows.
        let restore_from = if self.cfg.policy.tiers() { tail_start } else { 0 };
        let restores = (restore_from..n).filter(|&p| !adopted.contains(&(p as u32))).count() as u32;
        let needs_hot = (0..restore_from as u32).any(|p| !adopted.contains(&p));
        let needed = restores + if needs_hot { self.hot_cost() } else { 0 };
        // Adopted blocks leave the free list: take them out of the count before reclaiming.
        for &(_, b) in &adopt {
            self.pool.pin(b);
        }
        let missing = self.reclaim(needed, &[], &[])?;
        if missing > 0 {
            for &(_, b) in &adopt {
                self.pool.unpin(b).expect("just pinned");
            }
            return Err(CoreError::Capacity {
                resource: Resource::GpuBlocks,
                needed: needed as u64,
                available: (needed - missing) as u64,
                message: format!(
                    "the GPU pool cannot back request {id} now: it needs {needed} blocks (tail restores and a hot \
                     region) and {missing} are missing even after releasing every clean page"
                ),
            });
        }
        self.free_rows.pop();
        self.gpu_reserved += footprint;
        self.req_mut(id)?.status = Status::Running { row };
        self.pending.seq_lens.push(id);
        self.pending.hot_rows.push(id);
        // The row is fresh: every page's entry goes out, host-only ones included.
        self.pending.pages.extend((0..n as u32).map(|page| (id, page)));
        for (page, block) in adopt {
            let state = self.req(id)?.pages[page as usize].state.restore(block)?;
            self.set_page(id, page, state)?;
        }
        for page in restore_from..n {
            let state = self.req(id)?.pages[page].state;
            if let PageState::HostOnly { .. } = state {
                let block = self.take_block()?;
                self.set_page(id, page as u32, state.restore(block)?)?;
                self.pending.restores.push((id, page as u32, block));
            }
        }
        if self.req(id)?.host_only > 0 {
            self.lease_hot(id)?;
        }
        let r = self.req(id)?;
        Ok(Admission { row, cached_tokens: r.seq_len, residency: r.residency(self.cfg.tail_pages) })
    }

    // ----------------------------------------------------------------------------------------------
    // The step.

    /// Plans one step: `scheduled` lists (request, tokens it adds this step).
    pub fn plan_step(&mut self, scheduled: &[(u64, u32)]) -> Result<StepPlan> {
        let bs = self.cfg.block_size;
        let mut seen = HashSet::with_capacity(scheduled.len());
        let mut needed = 0u32;
        for &(id, tokens) in scheduled {
            let r = self.req(id)?;
            if r.row().is_none() {
                return invalid(format!("request {id} is preempted: resume it before scheduling it"));
            }
            if !seen.insert(id) {
                return invalid(format!("request {id} is scheduled twice in one step"));
            }
            let new_len = r.seq_len as u64 + tokens as u64;
            if new_len > r.max_len as u64 {
                return invalid(format!(
                    "request {id} would reach {new_len} tokens, beyond its max_len {}",
                    r.max_len
                ));
            }
            needed += (new_len as u32).div_ceil(bs) - r.pages.len() as u32;
        }
        let prefer: Vec<u64> = scheduled.iter().map(|&(id, _)| id).collect();
        let missing = self.reclaim(needed, &prefer, &self.fifo_stragglers())?;
        if missing > 0 {
            return Ok(StepPlan { missing_blocks: missing, ..StepPlan::default() });
        }
        self.note_written();
        for &(id, tokens) in scheduled {
            self.grow(id, tokens)?;
        }
        self.last_scheduled = prefer;
        self.relieve()?;
        let materialize = self.plan_materialize()?;
        Ok(StepPlan { materialize, ..self.drain_pending() })
    }

    /// Tokens of the previous plan are written now: queue the pages they completed for a host copy.
    fn note_written(&mut self) {
        let bs = self.cfg.block_size;
        for id in std::mem::take(&mut self.last_scheduled) {
            let Some(r) = self.requests.get_mut(&id) else {
                continue;
            };
            let complete = r.seq_len / bs;
            for page in r.complete_pages..complete {
                self.to_materialize.push_back((id, page));
            }
            r.complete_pages = r.complete_pages.max(complete);
        }
    }

    /// Under `fifo`, a request in mixed residency releases every page as soon as it is clean and cold.
    fn fifo_stragglers(&self) -> Vec<(u64, u32)> {
        if self.cfg.policy != PressurePolicy::Fifo {
            return Vec::new();
        }
        let holders = self.hot_holders();
        holders
            .into_iter()
            .flat_map(|id| self.newest_first(id).into_iter().map(move |page| (id, page)))
            .collect()
    }

    /// A request's releasable pages, newest first: the order in which vLLM lets them go.
    fn newest_first(&self, id: u64) -> Vec<u32> {
        let mut pages: Vec<u32> = self.requests[&id].releasable.iter().map(|&(_, p)| p).collect();
        pages.sort_unstable_by(|a, b| b.cmp(a));
        pages
    }

    fn grow(&mut self, id: u64, tokens: u32) -> Result<()> {
        let bs = self.cfg.block_size;
        let tail = self.cfg.tail_pages as usize;
        let r = self.req(id)?;
        let before = r.residency(self.cfg.tail_pages);
        let new_len = r.seq_len + tokens;
        let old_pages = r.pages.len();
        let new_pages = new_len.div_ceil(bs) as usize;
        for page in old_pages..new_pages {
            let block = self.take_block()?;
            let r = self.req_mut(id)?;
            let hash = r.hashes.get(page).copied();
            r.pages.push(Page { state: PageState::Dirty { block }, hash, heat: 0 });
            self.pending.pages.push((id, page as u32));
        }
        // Pages that just left the tail may now be released.
        let r = self.req_mut(id)?;
        r.seq_len = new_len;
        for page in old_pages.saturating_sub(tail)..new_pages.saturating_sub(tail) {
            let p = &r.pages[page];
            if matches!(p.state, PageState::Clean { .. }) {
                r.releasable.insert((p.heat, page as u32));
            }
        }
        self.pending.seq_lens.push(id);
        // Growth moves the tail: a request with host-only history can go from none to mixed.
        self.note_transition(id, before)
    }

    /// Requests that hold a hot region, oldest first.
    fn hot_holders(&self) -> Vec<u64> {
        let mut holders: Vec<(u64, u64)> = self
            .requests
            .iter()
            .filter(|(_, r)| r.hot.is_some() && r.row().is_some())
            .map(|(&id, r)| (r.order, id))
            .collect();
        holders.sort_unstable();
        holders.into_iter().map(|(_, id)| id).collect()
    }

    /// When the pool has room again, requests go back to full residency, oldest first: host-only pages
    /// are restored (up to the copy budget per step, so a long history comes back over several steps),
    /// and once none is left, released pages are pinned again and the hot region returned. Only blocks
    /// nobody reads count as room, and a hot region's worth of slack stays above the watermark so the
    /// next step does not flip back.
    fn relieve(&mut self) -> Result<()> {
        let hot_cost = self.hot_cost() as i64;
        let slack = self.cfg.watermark as i64 + 2 * hot_cost;
        let mut budget = self.cfg.materialize_budget;
        for id in self.hot_holders() {
            let r = self.req(id)?;
            let restoring = r.host_only.min(budget);
            let completes = restoring == r.host_only;
            let room = self.pool.num_unread_free() as i64 - restoring as i64 + completes as i64 * hot_cost;
            if room < slack || (!completes && restoring == 0) {
                continue;
            }
            budget -= restoring;
            let before = r.residency(self.cfg.tail_pages);
            if completes {
                // Pinned first, so that taking blocks for the restores cannot reuse its own released pages.
                self.repin_released(id)?;
            }
            let r = self.req(id)?;
            let host_only: Vec<u32> = (0..r.pages.len() as u32)
                .filter(|&p| r.pages[p as usize].state.is_host_only())
                .take(restoring as usize)
                .collect();
            for page in host_only {
                let state = self.req(id)?.pages[page as usize].state;
                let block = self.take_block()?;
                self.set_page(id, page, state.restore(block)?)?;
                self.pending.restores.push((id, page, block));
            }
            if completes {
                self.return_hot(id)?;
            }
            self.note_transition(id, before)?;
        }
        Ok(())
    }

    /// Pins a request's released pages again (before its hot region goes back).
    fn repin_released(&mut self, id: u64) -> Result<()> {
        let r = self.req(id)?;
        let released: Vec<u32> = (0..r.pages.len() as u32)
            .filter(|&p| matches!(r.pages[p as usize].state, PageState::Released { .. }))
            .collect();
        for page in released {
            let state = self.req(id)?.pages[page as usize].state;
            let PageState::Released { block, .. } = state else {
                return invariant(format!("request {id} page {page} changed while being pinned again"));
            };
            self.pool.remove_reader(block, Reader { request: id, page })?;
            self.pool.pin(block);
            self.set_page(id, page, state.repin()?)?;
        }
        Ok(())
    }

    fn plan_materialize(&mut self) -> Result<Vec<PageCopy>> {
        let mut out = Vec::new();
        while out.len() < self.cfg.materialize_budget as usize {
            let Some((id, page)) = self.to_materialize.pop_front() else {
                break;
            };
            let Some(r) = self.requests.get(&id) else {
                continue;
            };
            let Some(p) = r.pages.get(page as usize) else {
                continue;
            };
            // Stale entries (page dropped, or a new request reusing the id) must not copy a page still written.
            if page >= r.complete_pages || !matches!(p.state, PageState::Dirty { .. }) {
                continue;
            }
            // Identical content is already durable: share it instead of copying.
            if let Some(h) = p.hash.and_then(|hash| self.host.lookup(hash)) {
                self.host.incref(h);
                let state = p.state.share_host(h)?;
                self.set_page(id, page, state)?;
                continue;
            }
            let Some(h) = self.host.allocate() else {
                self.to_materialize.push_front((id, page));
                break;
            };
            let transfer = self.next_transfer;
            self.next_transfer += 1;
            let state = p.state.start_copy(h, transfer)?;
            let PageState::Copying { block, .. } = state else { unreachable!() };
            self.set_page(id, page, state)?;
            self.copies.insert(transfer, CopyOwner::Page { request: id, page });
            out.push(PageCopy { transfer, gpu_block: block, host_block: h });
            self.stats.total_materialized += 1;
        }
        Ok(out)
    }

    fn drain_pending(&mut self) -> StepPlan {
        let p = std::mem::take(&mut self.pending);
        let mut plan = StepPlan {
            cleared_rows: p.cleared_rows,
            transitions: p.transitions,
            released_pages: p.released,
            lost_pages: p.lost,
            ..StepPlan::default()
        };
        let running = |id: &u64| self.requests.get(id).and_then(|r| Some((r, r.row()?)));
        let mut restores = p.restores;
        restores.sort_unstable();
        restores.dedup();
        for (id, page, block) in restores {
            let Some((r, _)) = running(&id) else { continue };
            if let Some(PageState::Clean { block: b, host }) = r.pages.get(page as usize).map(|p| p.state) {
                if b == block {
                    plan.restores.push(Restore { gpu_block: block, host_block: host });
                }
            }
        }
        self.stats.total_restored += plan.restores.len() as u64;
        let mut pages = p.pages;
        pages.sort_unstable();
        pages.dedup();
        for (id, page) in pages {
            let Some((r, row)) = running(&id) else { continue };
            let Some(pg) = r.pages.get(page as usize) else { continue };
            let e = pg.state.table_entry();
            plan.table_updates.push(TableUpdate {
                row,
                page,
                gpu_block: e.gpu_block,
                host_block: e.host_block,
            });
        }
        let mut seq_lens = p.seq_lens;
        seq_lens.sort_unstable();
        seq_lens.dedup();
        plan.seq_lens = seq_lens.iter().filter_map(&running).map(|(r, row)| (row, r.seq_len)).collect();
        let mut hot_rows = p.hot_rows;
        hot_rows.sort_unstable();
        hot_rows.dedup();
        plan.hot_updates = hot_rows
            .iter()
            .filter_map(&running)
            .map(|(r, row)| HotUpdate { row, blocks: r.hot.clone().unwrap_or_default() })
            .collect();
        plan
    }

    // ----------------------------------------------------------------------------------------------
    // Worker feedback.

    /// Ends copies to the host. `ok = false` returns the pages to dirty; they are copied again later.
    /// Unknown or repeated ids are refused before anything changes.
    pub fn complete(&mut self, transfers: &[TransferId], ok: bool) -> Result<()> {
        let mut seen = HashSet::with_capacity(transfers.len());
        for t in transfers {
            if !self.copies.contains_key(t) || !seen.insert(*t) {
                return invalid(format!("transfer {t} is not in flight (unknown, or completed already)"));
            }
        }
        for t in transfers {
            match self.copies.remove(t).expect("checked above") {
                CopyOwner::Page { request, page } => self.end_page_copy(request, page, ok)?,
                CopyOwner::Orphan { block, host, hash } => {
                    self.host.unreserve(1);
                    if let (true, Some(hash)) = (ok, hash) {
                        if self.host.publish(host, hash).is_none() {
                            self.pool.publish(block, hash);
                        }
                    }
                    self.host.decref(host)?;
                    self.pool.unpin(block)?;
                }
            }
        }
        Ok(())
    }

    fn end_page_copy(&mut self, id: u64, page: u32, ok: bool) -> Result<()> {
        let p = &self.req(id)?.pages[page as usize];
        let (state, hash) = (p.state, p.hash);
        let PageState::Copying { block, host, .. } = state else {
            return invariant(format!("request {id} page {page} finished a copy it never started"));
        };
        if !ok {
            self.host.decref(host)?;
            self.set_page(id, page, state.copy_failed()?)?;
            self.to_materialize.push_back((id, page));
            return Ok(());
        }
        let mut clean = state.copy_done()?;
        if let Some(hash) = hash {
            match self.host.publish(host, hash) {
                // Someone made the same content durable first: share theirs, free ours.
                Some(existing) => {
                    self.host.incref(existing);
                    self.host.decref(host)?;
                    clean = PageState::Clean { block, host: existing };
                }
                None => self.pool.publish(block, hash),
            }
        }
        self.set_page(id, page, clean)
    }

    /// Appends page hashes (continuing the chain given at admission), e.g. for pages of generated tokens,
    /// so the next turn of a conversation finds them. Durable pages are published at once; the others
    /// when their copy ends.
    pub fn add_page_hashes(&mut self, id: u64, hashes: &[u64]) -> Result<()> {
        let r = self.req(id)?;
        let total = r.hashes.len() + hashes.len();
        if total as u64 * self.cfg.block_size as u64 > r.max_len as u64 {
            return invalid(format!("{total} page hashes exceed request {id}'s max_len {}", r.max_len));
        }
        let first = r.hashes.len();
        self.req_mut(id)?.hashes.extend_from_slice(hashes);
        for (i, &hash) in hashes.iter().enumerate() {
            let page = first + i;
            let Some(p) = self.req_mut(id)?.pages.get_mut(page) else { break };
            if p.hash.is_some() {
                continue;
            }
            p.hash = Some(hash);
            let state = p.state;
            if let Some(host) = state.durable_host() {
                let block = state.table_entry().gpu_block;
                if self.host.publish(host, hash).is_none() && block != 0 {
                    self.pool.publish(block, hash);
                }
            }
        }
        Ok(())
    }

    /// Adds selection heat, `heat[i]` to page `pages[i]`, as the resolver counted it: only the pages that
    /// were selected, so the cost follows the selection, not the context. A released page that was
    /// selected is kept longer before its block is reused.
    pub fn report_heat(&mut self, id: u64, pages: &[u32], heat: &[u32]) -> Result<()> {
        let r = self.req(id)?;
        if pages.len() != heat.len() {
            return invalid(format!("{} pages but {} heat values", pages.len(), heat.len()));
        }
        if let Some(&bad) = pages.iter().find(|&&p| p as usize >= r.pages.len()) {
            return invalid(format!("page {bad} of a request of {} pages", r.pages.len()));
        }
        let r = self.requests.get_mut(&id).expect("checked");
        for (&page, &h) in pages.iter().zip(heat).filter(|(_, &h)| h > 0) {
            let p = &mut r.pages[page as usize];
            let key = (p.heat, page);
            p.heat = p.heat.saturating_add(h);
            if r.releasable.remove(&key) {
                r.releasable.insert((p.heat, page));
            }
            if let PageState::Released { block, .. } = p.state {
                self.pool.touch(block);
            }
        }
        Ok(())
    }

    // ----------------------------------------------------------------------------------------------
    // Leaving.

    /// Ends a request: every block and host reference it holds goes back. Published pages stay findable
    /// (on the host, and on the GPU until the block is reused).
    pub fn finish(&mut self, id: u64) -> Result<()> {
        self.drop_pages(id, 0)?;
        let r = self.requests.remove(&id).ok_or(CoreError::UnknownRequest(id))?;
        self.host.unreserve(r.max_len.div_ceil(self.cfg.block_size) as u64);
        Ok(())
    }

    /// Stops a request and frees its GPU blocks. Its durable prefix stays on the host (held by the
    /// request) so [`Self::resume`] continues from there; returns the tokens kept.
    pub fn preempt(&mut self, id: u64) -> Result<u32> {
        let r = self.req(id)?;
        if r.row().is_none() {
            return invalid(format!("request {id} is already preempted"));
        }
        let kept = r.pages.iter().take_while(|p| p.state.durable_host().is_some()).count() as u32;
        self.drop_pages(id, kept)?;
        for page in 0..kept {
            let state = self.req(id)?.pages[page as usize].state;
            self.let_go_of_block(id, page, state)?;
            let state = match state {
                PageState::Clean { .. } => state.release()?.lose_block()?,
                PageState::Released { .. } => state.lose_block()?,
                _ => state,
            };
            self.set_page(id, page, state)?;
        }
        let bs = self.cfg.block_size;
        let r = self.req_mut(id)?;
        r.seq_len = kept * bs;
        r.complete_pages = kept;
        Ok(kept * bs)
    }

    /// Gives up the GPU block a clean or released page holds: the pin of a clean page, the reader entry of
    /// a released one. The page's state is the caller's to change.
    fn let_go_of_block(&mut self, id: u64, page: u32, state: PageState) -> Result<()> {
        match state {
            PageState::Clean { block, .. } => self.pool.unpin(block),
            PageState::Released { block, .. } => self.pool.remove_reader(block, Reader { request: id, page }),
            _ => Ok(()),
        }
    }

    /// Drops pages `from..` and the request's row, hot region and GPU reservation.
    fn drop_pages(&mut self, id: u64, from: u32) -> Result<()> {
        let r = self.req(id)?;
        let Some(row) = r.row() else {
            // A preempted request holds only host-only pages.
            for p in &r.pages[from as usize..].to_vec() {
                if let Some(h) = p.state.durable_host() {
                    self.host.decref(h)?;
                }
            }
            self.req_mut(id)?.pages.truncate(from as usize);
            return Ok(());
        };
        let dropped: Vec<(u32, Page)> =
            r.pages.iter().enumerate().skip(from as usize).map(|(i, p)| (i as u32, p.clone())).collect();
        for (page, p) in dropped {
            match p.state {
                PageState::Dirty { block } => self.pool.unpin(block)?,
                PageState::Copying { block, host, transfer } => {
                    self.host.reserve_held(1);
                    self.copies.insert(transfer, CopyOwner::Orphan { block, host, hash: p.hash });
                }
                PageState::Clean { host, .. } | PageState::Released { host, .. } => {
                    self.let_go_of_block(id, page, p.state)?;
                    self.host.decref(host)?;
                }
                PageState::HostOnly { host } => self.host.decref(host)?,
            }
        }
        self.return_hot(id)?;
        let r = self.req_mut(id)?;
        r.pages.truncate(from as usize);
        r.host_only = r.pages.iter().filter(|p| p.state.is_host_only()).count() as u32;
        r.released = r.pages.iter().filter(|p| matches!(p.state, PageState::Released { .. })).count() as u32;
        r.releasable.retain(|&(_, page)| page < from);
        r.status = Status::Preempted;
        self.free_rows.push(row);
        self.gpu_reserved -= self.cfg.min_gpu_footprint() as u64;
        self.pending.cleared_rows.push(row);
        self.last_scheduled.retain(|&rid| rid != id);
        Ok(())
    }

    // ----------------------------------------------------------------------------------------------
    // Views.

    pub fn contains(&self, id: u64) -> bool {
        self.requests.contains_key(&id)
    }

    pub fn request_info(&self, id: u64) -> Result<RequestInfo> {
        let r = self.req(id)?;
        Ok(RequestInfo {
            row: r.row(),
            seq_len: r.seq_len,
            residency: r.residency(self.cfg.tail_pages),
            num_pages: r.pages.len() as u32,
            host_only_pages: r.host_only,
            released_pages: r.released,
            hot_blocks: r.hot.as_ref().map_or(0, |h| h.len() as u32),
        })
    }

    /// The request's block table as (GPU block or 0, durable host block or -1) per page.
    pub fn block_table(&self, id: u64) -> Result<Vec<(u32, i32)>> {
        let entries = self.req(id)?.pages.iter().map(|p| p.state.table_entry());
        Ok(entries.map(|e| (e.gpu_block, e.host_block)).collect())
    }

    pub fn page_states(&self, id: u64) -> Result<Vec<&'static str>> {
        Ok(self.req(id)?.pages.iter().map(|p| p.state.name()).collect())
    }

    pub fn hot_blocks(&self, id: u64) -> Result<Vec<BlockId>> {
        Ok(self.req(id)?.hot.clone().unwrap_or_default())
    }

    pub fn request_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.requests.keys().copied().collect();
        ids.sort_unstable_by_key(|id| self.requests[id].order);
        ids
    }

    /// How many requests could run at once in steady state: each keeps its tail and a hot region on the
    /// GPU, and reserves its pages at max_model_len on the host.
    pub fn steady_state_concurrency(&self) -> u32 {
        let per_request =
            if self.cfg.policy.tiers() { self.cfg.min_gpu_footprint() } else { self.cfg.max_pages() };
        let gpu = (self.cfg.num_gpu_blocks - 1 - self.cfg.watermark) / per_request;
        let host = self.cfg.num_host_blocks / self.cfg.max_pages();
        gpu.min(host).min(self.cfg.max_running)
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.gpu_blocks = self.cfg.num_gpu_blocks;
        s.gpu_free = self.pool.num_free();
        s.gpu_used = self.cfg.num_gpu_blocks - 1 - s.gpu_free;
        s.gpu_released = self.pool.num_released();
        s.host_blocks = self.host.num_blocks();
        s.host_referenced = self.host.num_referenced();
        s.host_cached = self.host.num_cached();
        s.host_reserved = self.host.reserved();
        s.pending_transfers = self.copies.len() as u32;
        s.steady_state_concurrency = self.steady_state_concurrency();
        for r in self.requests.values() {
            if r.row().is_none() {
                s.preempted += 1;
                continue;
            }
            s.running += 1;
            s.gpu_hot += r.hot.as_ref().map_or(0, |h| h.len() as u32);
            match r.residency(self.cfg.tail_pages) {
                Residency::Full => s.full += 1,
                Residency::Mixed => s.mixed += 1,
                Residency::None => s.none += 1,
            }
        }
        s
    }

    /// One line for logs, in the spirit of vLLM's KV cache capacity line, with the host pool included.
    pub fn capacity_log(&self) -> String {
        let s = self.stats();
        let gib = |blocks: u64| blocks as f64 * self.cfg.page_bytes as f64 / (1u64 << 30) as f64;
        format!(
            "hisparse: GPU {used}/{total} blocks used ({hot} hot, {rel} released, {free} free); host {href}/{htot} \
             blocks referenced ({hgib:.2}/{htgib:.2} GiB, {hc} cached); running {run} (full {f}, mixed {m}, none {n}), \
             preempted {p}; {pend} copies in flight; steady-state concurrency {ss}",
            used = s.gpu_used,
            total = s.gpu_blocks - 1,
            hot = s.gpu_hot,
            rel = s.gpu_released,
            free = s.gpu_free,
            href = s.host_referenced,
            htot = s.host_blocks,
            hgib = gib(s.host_referenced as u64),
            htgib = gib(s.host_blocks as u64),
            hc = s.host_cached,
            run = s.running,
            f = s.full,
            m = s.mixed,
            n = s.none,
            p = s.preempted,
            pend = s.pending_transfers,
            ss = s.steady_state_concurrency,
        )
    }
}

#[path = "invariants.rs"]
mod invariants;

#[cfg(test)]
#[path = "manager_tests.rs"]
mod tests;
