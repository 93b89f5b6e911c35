//! Worker feedback: copies that ended, page hashes for generated tokens, selection heat.

use super::*;

impl ResidencyManager {
    /// Ends copies to the host. `ok = false` returns the pages to dirty; they are copied again later.
    /// Unknown or repeated ids are refused before anything changes.
    pub fn complete(&mut self, transfers: &[TransferId], ok: bool) -> Result<()> {
        self.check_in_flight(transfers)?;
        self.end_copies(transfers, ok)
    }

    /// Everything a worker reports after a step, as one atomic call: the copies that ended (`completed`)
    /// and failed (`failed`), and a heat summary (empty when none was taken). Everything is checked before
    /// anything changes, so a refused report changed nothing and can be sent again, corrected. Heat of a
    /// request that finished or was preempted meanwhile, or of pages it no longer has, is stale, not wrong:
    /// it is skipped.
    pub fn apply_results(
        &mut self,
        completed: &[TransferId],
        failed: &[TransferId],
        heat: &HeatSummary,
    ) -> Result<()> {
        let all: Vec<TransferId> = completed.iter().chain(failed).copied().collect();
        self.check_in_flight(&all)?;
        heat.validate()?;
        self.end_copies(failed, false)?;
        self.end_copies(completed, true)?;
        for (i, &id) in heat.requests.iter().enumerate() {
            let Some(r) = self.requests.get_mut(&id).filter(|r| r.row().is_some()) else { continue };
            let pages = r.pages.len() as u32;
            let coldest: Vec<(u32, u32)> = heat.coldest(i).filter(|&(_, page)| page < pages).collect();
            let hottest: Vec<(u32, u32)> = heat.hottest(i).filter(|&(_, page)| page < pages).collect();
            r.releasable.set_summary(&coldest, &hottest);
        }
        Ok(())
    }

    fn check_in_flight(&self, transfers: &[TransferId]) -> Result<()> {
        let mut seen = IdSet::with_capacity_and_hasher(transfers.len(), Default::default());
        for t in transfers {
            if !self.copies.contains_key(t) || !seen.insert(*t) {
                return invalid(format!(
                    "transfer {t} is not in flight (unknown, reported twice, or completed already)"
                ));
            }
        }
        Ok(())
    }

    pub(super) fn end_copies(&mut self, transfers: &[TransferId], ok: bool) -> Result<()> {
        for t in transfers {
            let Some(owner) = self.copies.remove(t) else {
                return invariant(format!("transfer {t} ended twice after it was checked"));
            };
            match owner {
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
}
