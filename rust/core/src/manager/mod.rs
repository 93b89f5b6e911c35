//! The residency manager: the scheduler-side state of every request's pages, and the one place where
//! pages change state.
//!
//! Per step the scheduler calls [`ResidencyManager::plan_step`] with the requests it runs and how many
//! tokens each adds. The manager allocates their pages, keeps a watermark of free blocks by releasing
//! clean pages (leasing a hot region to a request the first time it releases any), plans proactive copies
//! of complete pages to the host, and returns a [`StepPlan`]. The worker reports copies back through
//! [`ResidencyManager::apply_results`], with a [`crate::HeatSummary`] every few steps (see `heat.rs`).
//!
//! Cost per call grows with what changes in the step, never with context length: pages that can be
//! released are kept in per-request ordered sets, copies to plan in a queue, table updates in a list.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::block_pool::{BlockId, BlockPool, Reader};
use crate::config::{Config, PressurePolicy};
use crate::error::{invalid, invariant, CoreError, Resource, Result};
use crate::heat::HeatSummary;
use crate::host_pool::{HostBlockId, HostPool};
use crate::ids::{IdMap, IdSet};
use crate::page::{PageState, Residency, TransferId};
use crate::plan::{HotUpdate, PageCopy, Restore, RowLength, Scheduled, StepPlan, TableUpdate, Transition};
use releasable::Releasable;

#[derive(Clone, Debug)]
struct Page {
    state: PageState,
    hash: Option<u64>,
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
    /// Clean pages outside the tail: what the pressure policy may release, in the order it releases them
    /// (by the latest heat summary).
    releasable: Releasable,
    host_only: u32,
    released: u32,
    /// Restored whole when it came back and not scheduled since: no step has read the restored pages yet, so
    /// pressure does not move it to a hot region (releasing them would throw the restores away).
    unread: bool,
}

impl Request {
    fn row(&self) -> Option<u32> {
        match self.status {
            Status::Running { row } => Some(row),
            Status::Preempted => None,
        }
    }

    /// Running and reading through a hot region: its releasable pages cost nothing extra to release.
    fn holds_hot_region(&self) -> bool {
        self.hot.is_some() && self.row().is_some()
    }

    fn in_tail(&self, page: u32, tail_pages: u32) -> bool {
        page as usize + tail_pages as usize >= self.pages.len()
    }

    fn is_releasable(&self, page: u32, tail_pages: u32) -> bool {
        matches!(self.pages[page as usize].state, PageState::Clean { .. }) && !self.in_tail(page, tail_pages)
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

/// What `admit` and `resume` tell the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    pub row: u32,
    /// Tokens whose KV the request already has (host prefix hits or its own kept pages); compute the rest.
    pub cached_tokens: u32,
    pub residency: Residency,
    /// Pages this admission queued host -> GPU restores for (the next plan's restores carry them); adopted
    /// GPU copies are not counted. The request can run once they have landed.
    pub restored_pages: u32,
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
    requests: IdMap<u64, Request>,
    free_rows: Vec<u32>,
    next_order: u64,
    next_transfer: TransferId,
    copies: IdMap<TransferId, CopyOwner>,
    to_materialize: VecDeque<(u64, u32)>,
    /// Requests whose tokens of the last plan are written once the next plan starts.
    last_scheduled: Vec<u64>,
    /// What the last plan asked of the worker, for `resync` to ask again.
    last_plan: resync::LastPlan,
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
            requests: IdMap::default(),
            free_rows: (0..cfg.max_running).rev().collect(),
            next_order: 0,
            next_transfer: 1,
            copies: IdMap::default(),
            to_materialize: VecDeque::new(),
            last_scheduled: Vec::new(),
            last_plan: resync::LastPlan::default(),
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
}

mod admission;
mod feedback;
mod invariants;
mod leaving;
mod pages;
mod pressure;
mod releasable;
mod resync;
mod step;
mod views;

#[cfg(test)]
mod tests;
