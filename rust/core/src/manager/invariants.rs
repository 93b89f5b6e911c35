//! A from-scratch audit of the manager's state: everything the incremental bookkeeping maintains is
//! recomputed here and compared. Tests call it after every operation; engines may call it in debug runs.

use std::collections::{HashMap, HashSet};

use super::{CopyOwner, PageState, ResidencyManager, Status};
use crate::block_pool::Reader;
use crate::error::{invariant, Result};

impl ResidencyManager {
    /// Checks every invariant; the error names the first one broken.
    pub fn check_invariants(&self) -> Result<()> {
        let cfg = &self.cfg;
        let mut pins: HashMap<u32, u32> = HashMap::new();
        let mut host_refs: HashMap<u32, u32> = HashMap::new();
        let mut readers: HashSet<(u32, Reader)> = HashSet::new();
        let mut rows = HashSet::new();
        let mut host_reserved = 0u64;
        let mut gpu_reserved = 0u64;
        // Blocks only one owner may hold: pages still being written or copied, and hot regions.
        let mut exclusive: Vec<u32> = Vec::new();
        for (&id, r) in &self.requests {
            host_reserved += r.max_len.div_ceil(cfg.block_size) as u64;
            let n = r.pages.len();
            match r.status {
                Status::Running { row } => {
                    gpu_reserved += cfg.request_footprint(r.max_len) as u64;
                    if row >= cfg.max_running || !rows.insert(row) || self.free_rows.contains(&row) {
                        return invariant(format!("request {id}: row {row} is not its own"));
                    }
                    if n != r.seq_len.div_ceil(cfg.block_size) as usize {
                        return invariant(format!("request {id}: {n} pages for {} tokens", r.seq_len));
                    }
                }
                Status::Preempted => {
                    if r.hot.is_some() || r.pages.iter().any(|p| !p.state.is_host_only()) {
                        return invariant(format!("preempted request {id} holds GPU blocks"));
                    }
                }
            }
            if r.complete_pages as usize > n {
                return invariant(format!("request {id}: {} complete pages of {n}", r.complete_pages));
            }
            let mut host_only = 0;
            let mut released = 0;
            let mut releasable = std::collections::BTreeSet::new();
            for (i, p) in r.pages.iter().enumerate() {
                let page = i as u32;
                let in_tail = r.in_tail(page, cfg.tail_pages);
                if let Some(b) = p.state.pinned_block() {
                    *pins.entry(b).or_default() += 1;
                    if matches!(p.state, PageState::Dirty { .. } | PageState::Copying { .. }) {
                        exclusive.push(b);
                    }
                }
                if let Some(h) = p.state.durable_host() {
                    *host_refs.entry(h).or_default() += 1;
                }
                match p.state {
                    PageState::Copying { host, transfer, .. } => {
                        *host_refs.entry(host).or_default() += 1;
                        match self.copies.get(&transfer) {
                            Some(CopyOwner::Page { request, page: pg }) if *request == id && *pg == page => {}
                            _ => {
                                return invariant(format!(
                                    "request {id} page {page}: copy {transfer} not owned"
                                ))
                            }
                        }
                        if page >= r.complete_pages {
                            return invariant(format!(
                                "request {id} page {page} copied before it was complete"
                            ));
                        }
                    }
                    PageState::Clean { .. } if !in_tail => {
                        releasable.insert(page);
                    }
                    PageState::Released { block, .. } => {
                        released += 1;
                        readers.insert((block, Reader { request: id, page }));
                    }
                    PageState::HostOnly { .. } => {
                        host_only += 1;
                        if in_tail && r.row().is_some() {
                            return invariant(format!("request {id}: tail page {page} is host-only"));
                        }
                    }
                    _ => {}
                }
            }
            if (host_only > 0 || released > 0) && r.row().is_some() && r.hot.is_none() {
                return invariant(format!("request {id} reads through a hot region it does not hold"));
            }
            if host_only != r.host_only
                || released != r.released
                || !releasable.iter().copied().eq(r.releasable.pages().iter())
            {
                return invariant(format!("request {id}: page counters disagree with its pages"));
            }
            if !r.releasable.is_consistent() {
                return invariant(format!("request {id}: its pressure order disagrees with its pages"));
            }
            if let Some(hot) = &r.hot {
                if hot.len() != cfg.hot_blocks() as usize {
                    return invariant(format!("request {id}: hot region of {} blocks", hot.len()));
                }
                for &b in hot {
                    *pins.entry(b).or_default() += 1;
                    exclusive.push(b);
                }
            }
        }
        for owner in self.copies.values() {
            if let CopyOwner::Orphan { block, host, .. } = *owner {
                *pins.entry(block).or_default() += 1;
                *host_refs.entry(host).or_default() += 1;
                host_reserved += 1;
            }
        }
        for &b in &exclusive {
            if pins.get(&b) != Some(&1) || !self.pool.readers(b).is_empty() {
                return invariant(format!("block {b} is written by one owner but shared or still read"));
            }
        }
        let mut free = 0;
        for b in 0..cfg.num_gpu_blocks {
            let want = pins.get(&b).copied().unwrap_or(0);
            if b == 0 {
                if want > 0 || self.pool.is_free(0) || self.pool.ref_count(0) > 0 {
                    return invariant("the null block is in use");
                }
                continue;
            }
            if self.pool.ref_count(b) != want {
                return invariant(format!(
                    "block {b}: {} pins recorded, {want} held",
                    self.pool.ref_count(b)
                ));
            }
            if self.pool.is_free(b) != (want == 0) {
                return invariant(format!("block {b}: free list membership disagrees with its pins"));
            }
            free += self.pool.is_free(b) as u32;
            for reader in self.pool.readers(b) {
                if !readers.remove(&(b, *reader)) {
                    return invariant(format!("block {b}: reader {reader:?} does not read it"));
                }
            }
        }
        if let Some((b, reader)) = readers.iter().next() {
            return invariant(format!("block {b}: {reader:?} reads it unrecorded"));
        }
        if free != self.pool.num_free() {
            return invariant("free list length disagrees with free blocks");
        }
        let released = (1..cfg.num_gpu_blocks)
            .filter(|&b| self.pool.is_free(b) && !self.pool.readers(b).is_empty())
            .count() as u32;
        if released != self.pool.num_released() {
            return invariant("the released-block count drifted");
        }
        for h in 0..cfg.num_host_blocks {
            let want = host_refs.get(&h).copied().unwrap_or(0);
            if self.host.ref_count(h) != want {
                return invariant(format!(
                    "host block {h}: {} refs recorded, {want} held",
                    self.host.ref_count(h)
                ));
            }
        }
        if host_reserved != self.host.reserved() {
            return invariant("host reservations disagree with admitted requests");
        }
        if gpu_reserved != self.gpu_reserved {
            return invariant("GPU reservations disagree with running requests");
        }
        if self.free_rows.len() + rows.len() != cfg.max_running as usize {
            return invariant("request rows leaked");
        }
        Ok(())
    }
}
