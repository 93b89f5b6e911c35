//! Bringing a rebuilt worker to the current state. A worker whose process died and came back (a crashed
//! tensor-parallel rank, an elastic restart) holds no state the core can trust: its tables, hot regions and
//! copies in flight are gone. The core answers with one plan that sets everything from scratch.

use super::*;

/// What the last plan asked of its worker that a worker dying before its results came back may not have
/// done: its restores (host -> GPU) and the tokens it scheduled.
#[derive(Debug, Default)]
pub(super) struct LastPlan {
    pub scheduled: Vec<Scheduled>,
    pub restores: Vec<(u64, u32, BlockId)>,
}

impl ResidencyManager {
    /// A plan that brings a worker with no state of its own to the current state: every row cleared, then
    /// every running request's length, whole table and (empty) hot region. Copies to the host still in
    /// flight count as failed and are started again in this plan (new transfer ids; reports of the old ones
    /// are refused from now on). With `redo_last_step` (its results never came back) the last plan's
    /// restores and scheduled tokens are in it again, for requests that still run where they ran. Blocks,
    /// pages and host copies are untouched: nothing is lost, and no block is needed.
    pub fn resync(&mut self, redo_last_step: bool) -> Result<StepPlan> {
        let mut in_flight: Vec<TransferId> = self.copies.keys().copied().collect();
        in_flight.sort_unstable(); // the order they are copied again in
        self.end_copies(&in_flight, false)?;
        self.pending.cleared_rows = (0..self.cfg.max_running).collect();
        for (&id, r) in &self.requests {
            if r.row().is_some() {
                self.pending.seq_lens.push(id);
                self.pending.hot_rows.push(id);
                self.pending.pages.extend((0..r.pages.len() as u32).map(|page| (id, page)));
            }
        }
        let mut scheduled = Vec::new();
        if redo_last_step {
            let last = std::mem::take(&mut self.last_plan);
            self.pending.restores.extend(last.restores);
            scheduled = last
                .scheduled
                .into_iter()
                .filter(|s| {
                    self.requests.get(&s.request).is_some_and(|r| {
                        r.row() == Some(s.row) && r.seq_len as u64 == s.start as u64 + s.tokens as u64
                    })
                })
                .collect();
        }
        let materialize = self.plan_materialize()?;
        Ok(self.drain_pending(materialize, scheduled))
    }
}
