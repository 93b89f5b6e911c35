//! The step: growth, proactive copies to the host, relief back to full residency, and the plan.

use super::*;

impl ResidencyManager {
    /// Plans one step: `scheduled` lists (request, tokens it adds this step).
    pub fn plan_step(&mut self, scheduled: &[(u64, u32)]) -> Result<StepPlan> {
        let bs = self.cfg.block_size;
        let mut seen = IdSet::with_capacity_and_hasher(scheduled.len(), Default::default());
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
        let mut rows = Vec::with_capacity(scheduled.len());
        for &(request, tokens) in scheduled {
            let r = self.req(request)?;
            let row = r.row().expect("checked running above");
            rows.push(Scheduled { request, row, start: r.seq_len, tokens });
            self.grow(request, tokens)?;
        }
        self.last_scheduled = prefer;
        self.relieve()?;
        let materialize = self.plan_materialize()?;
        Ok(self.drain_pending(materialize, rows))
    }

    /// Tokens of the previous plan are written now: queue the pages they completed for a host copy.
    pub(super) fn note_written(&mut self) {
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
    pub(super) fn fifo_stragglers(&self) -> Vec<(u64, u32)> {
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
    pub(super) fn newest_first(&self, id: u64) -> Vec<u32> {
        let mut pages: Vec<u32> = self.requests[&id].releasable.pages().iter().collect();
        pages.reverse();
        pages
    }

    pub(super) fn grow(&mut self, id: u64, tokens: u32) -> Result<()> {
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
            r.pages.push(Page { state: PageState::Dirty { block }, hash });
            self.pending.pages.push((id, page as u32));
        }
        // Pages that just left the tail may now be released (and the worker's flag says so).
        let r = self.requests.get_mut(&id).expect("checked above");
        r.seq_len = new_len;
        r.unread = false;
        for page in old_pages.saturating_sub(tail) as u32..new_pages.saturating_sub(tail) as u32 {
            if r.is_releasable(page, tail as u32) && r.releasable.set(page, true) {
                self.pending.pages.push((id, page));
            }
        }
        self.pending.seq_lens.push(id);
        // Growth moves the tail: a request with host-only history can go from none to mixed.
        self.note_transition(id, before)
    }

    /// Requests that hold a hot region, oldest first.
    pub(super) fn hot_holders(&self) -> Vec<u64> {
        let mut holders: Vec<(u64, u64)> = self
            .requests
            .iter()
            .filter(|(_, r)| r.holds_hot_region())
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
    pub(super) fn relieve(&mut self) -> Result<()> {
        let hot_cost = self.hot_cost() as i64;
        let slack = self.cfg.watermark as i64 + 2 * hot_cost;
        // No holder's room exceeds the free blocks and a returned hot region: under pressure, none has room,
        // and the holders are not even listed.
        if self.pool.num_unread_free() as i64 + hot_cost < slack {
            return Ok(());
        }
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
    pub(super) fn repin_released(&mut self, id: u64) -> Result<()> {
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

    pub(super) fn plan_materialize(&mut self) -> Result<Vec<PageCopy>> {
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

    /// The plan: what is pending, the copies to the host and the scheduled requests; remembered as the last
    /// plan (its restores and scheduled tokens, for `resync` to ask again).
    pub(super) fn drain_pending(
        &mut self,
        materialize: Vec<PageCopy>,
        scheduled: Vec<Scheduled>,
    ) -> StepPlan {
        let p = std::mem::take(&mut self.pending);
        // A row can be cleared twice between plans (one request leaves it, the next is admitted into it and
        // leaves too): clearing once says the same.
        let mut cleared = p.cleared_rows;
        cleared.sort_unstable();
        cleared.dedup();
        let mut plan = StepPlan {
            cleared_rows: cleared,
            transitions: p.transitions,
            released_pages: p.released,
            lost_pages: p.lost,
            materialize,
            scheduled,
            ..StepPlan::default()
        };
        let running = |id: &u64| self.requests.get(id).and_then(|r| Some((r, r.row()?)));
        let mut restores = p.restores;
        restores.sort_unstable();
        restores.dedup();
        // A restored page still read from its block, pinned or since released (the pool counts the block free,
        // but nothing reuses it while the page reads it): one whose block went elsewhere reads the host now.
        restores.retain(|&(id, page, block)| {
            let state = running(&id).and_then(|(r, _)| r.pages.get(page as usize)).map(|p| p.state);
            match state {
                Some(PageState::Clean { block: b, host } | PageState::Released { block: b, host })
                    if b == block =>
                {
                    plan.restores.push(Restore { gpu_block: block, host_block: host });
                    true
                }
                _ => false,
            }
        });
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
                // What the releasable set holds (the invariants audit checks they agree), read from the
                // page at hand rather than looked up in a set that grows with context.
                releasable: r.is_releasable(page, self.cfg.tail_pages),
            });
        }
        self.last_plan = resync::LastPlan { scheduled: plan.scheduled.clone(), restores };
        let mut seq_lens = p.seq_lens;
        seq_lens.sort_unstable();
        seq_lens.dedup();
        plan.seq_lens = seq_lens
            .iter()
            .filter_map(|&id| {
                running(&id).map(|(r, row)| RowLength {
                    row,
                    len: r.seq_len,
                    request: id,
                    resident: r.host_only == 0,
                })
            })
            .collect();
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
}
