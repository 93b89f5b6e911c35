//! What the scheduler side hands the worker each step. Everything in a plan is a final value (the state
//! after the step), so a worker that applies it in the documented order needs no history.

use crate::block_pool::BlockId;
use crate::host_pool::HostBlockId;
use crate::page::{Residency, TransferId};

/// A whole-page copy between a GPU block and a host block (every layer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCopy {
    pub transfer: TransferId,
    pub gpu_block: BlockId,
    pub host_block: HostBlockId,
}

/// A whole-page copy from a host block into a GPU block (every layer), done before the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restore {
    pub gpu_block: BlockId,
    pub host_block: HostBlockId,
}

/// The final block-table entry of one page of one state row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableUpdate {
    pub row: u32,
    pub page: u32,
    /// 0 when the page is read through the hot region.
    pub gpu_block: BlockId,
    /// -1 when the page has no durable host copy.
    pub host_block: i32,
}

/// A state row whose hot region changed: the worker resets its slots (all empty, LRU in slot order) and
/// sets its blocks (empty: the row holds no hot region now).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HotUpdate {
    pub row: u32,
    pub blocks: Vec<BlockId>,
}

/// A residency change, for logs and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    pub request: u64,
    pub from: Residency,
    pub to: Residency,
}

/// One step's work for the worker, applied in this order before the forward pass:
/// 1. `cleared_rows`: reset (tables null, no hot region, length 0);
/// 2. `seq_lens`, `table_updates`, `hot_updates`;
/// 3. `restores` (host -> GPU) must land before the forward reads them;
/// 4. `materialize` (GPU -> host) may overlap the forward: it reads only complete pages. Report each
///    transfer's end through `complete` (late, out of order, or failed is fine).
///
/// `missing_blocks > 0` means the step could not be backed even after releasing everything the policy
/// may release: nothing else in the plan is set and the manager's state is unchanged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub missing_blocks: u32,
    pub cleared_rows: Vec<u32>,
    pub seq_lens: Vec<(u32, u32)>,
    pub table_updates: Vec<TableUpdate>,
    pub hot_updates: Vec<HotUpdate>,
    pub restores: Vec<Restore>,
    pub materialize: Vec<PageCopy>,
    pub transitions: Vec<Transition>,
    /// Pages released under pressure in this step.
    pub released_pages: u32,
    /// Released pages whose blocks were reused in this step (they became host-only).
    pub lost_pages: u32,
}

impl StepPlan {
    pub fn is_short(&self) -> bool {
        self.missing_blocks > 0
    }
}
