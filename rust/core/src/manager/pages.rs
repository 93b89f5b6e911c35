//! The single place where a page changes state: counters, the releasable set and the table-update list
//! (entries and releasable flags) follow from here; also taking blocks from the pool and leasing hot regions.

use super::*;

impl ResidencyManager {
    pub(super) fn set_page(&mut self, id: u64, page: u32, next: PageState) -> Result<()> {
        let tail = self.cfg.tail_pages;
        let r = self.req_mut(id)?;
        let prev = r.pages[page as usize].state;
        r.pages[page as usize].state = next;
        let releasable = r.is_releasable(page, tail);
        let flag_changed = r.releasable.set(page, releasable);
        let table_changed = flag_changed || prev.table_entry() != next.table_entry();
        let was_resident = r.host_only == 0;
        r.host_only = r.host_only + next.is_host_only() as u32 - prev.is_host_only() as u32;
        let flag_flipped = was_resident != (r.host_only == 0);
        let was_released = matches!(prev, PageState::Released { .. }) as u32;
        r.released = r.released + matches!(next, PageState::Released { .. }) as u32 - was_released;
        if table_changed {
            self.pending.pages.push((id, page));
        }
        // The plan's length entry carries the resident flag: a row whose flag changes gives its entry again.
        if flag_flipped {
            self.pending.seq_lens.push(id);
        }
        Ok(())
    }

    /// Takes a block from the pool; released pages that were still reading it become host-only now.
    pub(super) fn take_block(&mut self) -> Result<BlockId> {
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

    pub(super) fn note_transition(&mut self, id: u64, before: Residency) -> Result<()> {
        let after = self.req(id)?.residency(self.cfg.tail_pages);
        if after != before {
            self.pending.transitions.push(Transition { request: id, from: before, to: after });
        }
        Ok(())
    }

    pub(super) fn release_page(&mut self, id: u64, page: u32) -> Result<()> {
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

    pub(super) fn lease_hot(&mut self, id: u64) -> Result<()> {
        if self.req(id)?.hot.is_some() {
            return invariant(format!("request {id} leased a second hot region"));
        }
        let blocks = (0..self.hot_cost()).map(|_| self.take_block()).collect::<Result<Vec<_>>>()?;
        self.req_mut(id)?.hot = Some(blocks);
        self.pending.hot_rows.push(id);
        Ok(())
    }

    pub(super) fn return_hot(&mut self, id: u64) -> Result<()> {
        if let Some(blocks) = self.req_mut(id)?.hot.take() {
            for b in blocks {
                self.pool.unpin(b)?;
            }
            self.pending.hot_rows.push(id);
        }
        Ok(())
    }
}
