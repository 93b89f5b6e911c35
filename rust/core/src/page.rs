//! The life of one page of one request, as an explicit state machine.
//!
//! ```text
//!   Dirty ──start_copy──▶ Copying ──copy_done──▶ Clean ──release──▶ Released ──lose_block──▶ HostOnly
//!     ▲                      │                     ▲                   │                        │
//!     └──────copy_failed─────┘                     └──────repin────────┘                        │
//!                                                  ▲                                            │
//!                                                  └───────────────restore──────────────────────┘
//! ```
//!
//! Every transition checks its source state and returns the new one; an illegal transition is an
//! `Invariant` error, never a silent overwrite.

use crate::block_pool::BlockId;
use crate::error::{invariant, Result};
use crate::host_pool::HostBlockId;

pub type TransferId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageState {
    /// On the GPU only (the page being written, or a complete page not yet copied).
    Dirty { block: BlockId },
    /// A copy to the host is in flight; the block stays pinned until it ends.
    Copying { block: BlockId, host: HostBlockId, transfer: TransferId },
    /// On the GPU and durably on the host; pinned.
    Clean { block: BlockId, host: HostBlockId },
    /// Durably on the host, still read in place on the GPU, but the pool counts the block free.
    Released { block: BlockId, host: HostBlockId },
    /// On the host only: the block table holds the null block and reads go through the hot region.
    HostOnly { host: HostBlockId },
}

/// What a block table says about a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableEntry {
    /// The GPU block to read in place, or the null block 0.
    pub gpu_block: BlockId,
    /// The durable host block, or -1.
    pub host_block: i32,
}

impl PageState {
    pub fn name(&self) -> &'static str {
        match self {
            PageState::Dirty { .. } => "dirty",
            PageState::Copying { .. } => "copying",
            PageState::Clean { .. } => "clean",
            PageState::Released { .. } => "released",
            PageState::HostOnly { .. } => "host_only",
        }
    }

    /// The block this page keeps pinned, if any.
    pub fn pinned_block(&self) -> Option<BlockId> {
        match *self {
            PageState::Dirty { block }
            | PageState::Copying { block, .. }
            | PageState::Clean { block, .. } => Some(block),
            PageState::Released { .. } | PageState::HostOnly { .. } => None,
        }
    }

    /// The durable host copy, if any (an in-flight copy is not durable).
    pub fn durable_host(&self) -> Option<HostBlockId> {
        match *self {
            PageState::Clean { host, .. }
            | PageState::Released { host, .. }
            | PageState::HostOnly { host } => Some(host),
            PageState::Dirty { .. } | PageState::Copying { .. } => None,
        }
    }

    pub fn table_entry(&self) -> TableEntry {
        let gpu_block = match *self {
            PageState::Dirty { block }
            | PageState::Copying { block, .. }
            | PageState::Clean { block, .. }
            | PageState::Released { block, .. } => block,
            PageState::HostOnly { .. } => 0,
        };
        TableEntry { gpu_block, host_block: self.durable_host().map_or(-1, |h| h as i32) }
    }

    pub fn is_host_only(&self) -> bool {
        matches!(self, PageState::HostOnly { .. })
    }

    fn illegal<T>(&self, transition: &str) -> Result<T> {
        invariant(format!("illegal page transition {transition} from {}", self.name()))
    }

    pub fn start_copy(self, host: HostBlockId, transfer: TransferId) -> Result<Self> {
        match self {
            PageState::Dirty { block } => Ok(PageState::Copying { block, host, transfer }),
            _ => self.illegal("start_copy"),
        }
    }

    /// Marks a dirty page durable without a copy: its content is already on the host under the same hash.
    pub fn share_host(self, host: HostBlockId) -> Result<Self> {
        match self {
            PageState::Dirty { block } => Ok(PageState::Clean { block, host }),
            _ => self.illegal("share_host"),
        }
    }

    pub fn copy_done(self) -> Result<Self> {
        match self {
            PageState::Copying { block, host, .. } => Ok(PageState::Clean { block, host }),
            _ => self.illegal("copy_done"),
        }
    }

    pub fn copy_failed(self) -> Result<Self> {
        match self {
            PageState::Copying { block, .. } => Ok(PageState::Dirty { block }),
            _ => self.illegal("copy_failed"),
        }
    }

    pub fn release(self) -> Result<Self> {
        match self {
            PageState::Clean { block, host } => Ok(PageState::Released { block, host }),
            _ => self.illegal("release"),
        }
    }

    pub fn repin(self) -> Result<Self> {
        match self {
            PageState::Released { block, host } => Ok(PageState::Clean { block, host }),
            _ => self.illegal("repin"),
        }
    }

    pub fn lose_block(self) -> Result<Self> {
        match self {
            PageState::Released { host, .. } => Ok(PageState::HostOnly { host }),
            _ => self.illegal("lose_block"),
        }
    }

    pub fn restore(self, block: BlockId) -> Result<Self> {
        match self {
            PageState::HostOnly { host } => Ok(PageState::Clean { block, host }),
            _ => self.illegal("restore"),
        }
    }
}

/// Whether a request reads everything in place, part of it through its hot region, or all of its
/// history through it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    Full,
    Mixed,
    None,
}

impl Residency {
    pub const ALL: [Residency; 3] = [Residency::Full, Residency::Mixed, Residency::None];

    pub fn name(&self) -> &'static str {
        match self {
            Residency::Full => "full",
            Residency::Mixed => "mixed",
            Residency::None => "none",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_whole_cycle_and_a_refusal() {
        let p = PageState::Dirty { block: 5 };
        let p = p.start_copy(9, 1).unwrap();
        assert_eq!(p.table_entry(), TableEntry { gpu_block: 5, host_block: -1 });
        let p = p.copy_done().unwrap().release().unwrap();
        assert_eq!(p.pinned_block(), None);
        let p = p.lose_block().unwrap();
        assert_eq!(p.table_entry(), TableEntry { gpu_block: 0, host_block: 9 });
        assert!(p.release().is_err());
        assert_eq!(p.restore(6).unwrap(), PageState::Clean { block: 6, host: 9 });
    }
}
