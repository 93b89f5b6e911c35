//! Admission and resumption: a request gets a row, adopts GPU copies still readable, restores its tail
//! and leases its hot region, all or nothing.

use super::*;

impl ResidencyManager {
    /// Admits a request of `prompt_len` tokens whose full pages hash to `prefix_hashes` (a hash chain: each
    /// page's hash covers everything before it). Pages found durably on the host are not recomputed: they
    /// start host-only (adopting a still-readable GPU copy when one exists), and the request holds a hot
    /// region from the start, unless it comes back resident ([`Config::returns_resident`]): then they are
    /// restored whole. Refuses, naming the resource, when the request cannot be backed.
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
            .map(|(&host, &hash)| Page { state: PageState::HostOnly { host }, hash: Some(hash) })
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
            releasable: Releasable::default(),
            released: 0,
            unread: false,
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
    /// readable, restores its tail and leases its hot region (or restores every page, when it is not tiered
    /// or comes back resident with the blocks free). All or nothing.
    pub(super) fn start_running(&mut self, id: u64) -> Result<Admission> {
        let max_len = self.req(id)?.max_len;
        let tiered = self.cfg.tiered(max_len);
        let footprint = self.cfg.request_footprint(max_len) as u64;
        let usable = self.cfg.num_gpu_blocks as u64 - 1;
        if self.gpu_reserved + footprint > usable {
            return Err(CoreError::Capacity {
                resource: Resource::GpuBlocks,
                needed: footprint,
                available: usable - self.gpu_reserved,
                message: format!(
                    "the GPU pool cannot back request {id}: it keeps at least {footprint} blocks while it runs \
                     (tail {} + hot region {}), and {} of {usable} are committed; raise the GPU pool, lower hot_rows, \
                     or finish requests",
                    self.cfg.tail_pages,
                    if tiered { self.hot_cost() } else { 0 },
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
        let adopted: IdSet<u32> = adopt.iter().map(|&(p, _)| p).collect();
        // Adopted blocks leave the free list: take them out of the count before reclaiming.
        for &(_, b) in &adopt {
            self.pool.pin(b);
        }
        // Without tiers everything comes back whole, and so does a request that never fills its admission
        // window when its blocks are free now; otherwise the tail, and the rest reads through hot rows.
        let whole = (0..n).filter(|&p| !adopted.contains(&(p as u32))).count() as u32;
        let resident = self.cfg.returns_resident(max_len) && whole <= self.pool.num_free();
        let restore_from = if tiered && !resident { tail_start } else { 0 };
        let restores = (restore_from..n).filter(|&p| !adopted.contains(&(p as u32))).count() as u32;
        let needs_hot = (0..restore_from as u32).any(|p| !adopted.contains(&p));
        let needed = restores + if needs_hot { self.hot_cost() } else { 0 };
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
        let r = self.req_mut(id)?;
        r.status = Status::Running { row };
        r.unread = tiered && restore_from == 0 && restores > 0;
        self.pending.seq_lens.push(id);
        self.pending.hot_rows.push(id);
        // The row is fresh: every page's entry goes out, host-only ones included.
        self.pending.pages.extend((0..n as u32).map(|page| (id, page)));
        for (page, block) in adopt {
            let state = self.req(id)?.pages[page as usize].state.restore(block)?;
            self.set_page(id, page, state)?;
        }
        let mut restored_pages = 0;
        for page in restore_from..n {
            let state = self.req(id)?.pages[page].state;
            if let PageState::HostOnly { .. } = state {
                let block = self.take_block()?;
                self.set_page(id, page as u32, state.restore(block)?)?;
                self.pending.restores.push((id, page as u32, block));
                restored_pages += 1;
            }
        }
        if self.req(id)?.host_only > 0 {
            self.lease_hot(id)?;
        }
        let r = self.req(id)?;
        Ok(Admission {
            row,
            cached_tokens: r.seq_len,
            residency: r.residency(self.cfg.tail_pages),
            restored_pages,
        })
    }
}
