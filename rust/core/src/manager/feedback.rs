//! Worker feedback: copies that ended, page hashes for generated tokens, selection heat.

use super::*;

impl ResidencyManager {
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

    pub(super) fn end_page_copy(&mut self, id: u64, page: u32, ok: bool) -> Result<()> {
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
}
