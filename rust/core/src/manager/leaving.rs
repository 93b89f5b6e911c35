//! Leaving: finish and preempt, and the one place that drops a request's pages and row.

use super::*;

impl ResidencyManager {
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
    pub(super) fn let_go_of_block(&mut self, id: u64, page: u32, state: PageState) -> Result<()> {
        match state {
            PageState::Clean { block, .. } => self.pool.unpin(block),
            PageState::Released { block, .. } => self.pool.remove_reader(block, Reader { request: id, page }),
            _ => Ok(()),
        }
    }

    /// Drops pages `from..` and the request's row, hot region and GPU reservation.
    pub(super) fn drop_pages(&mut self, id: u64, from: u32) -> Result<()> {
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
        r.releasable.truncate(from);
        r.status = Status::Preempted;
        self.free_rows.push(row);
        self.gpu_reserved -= self.cfg.request_footprint(self.req(id)?.max_len) as u64;
        self.pending.cleared_rows.push(row);
        self.last_scheduled.retain(|&rid| rid != id);
        Ok(())
    }
}
