//! What the scheduler side hands the worker each step. Everything in a plan is a final value (the state
//! after the step), so a worker that applies it in the documented order needs no history.
//!
//! A plan crosses to the worker as one flat byte string ([`StepPlan::encode`]): it pickles, crosses
//! processes, and is applied by one call ([`crate::worker::apply_plan`] on CPU, one kernel on a device)
//! without any per-entry work in Python.

use crate::block_pool::BlockId;
use crate::codec;
use crate::error::{invalid, Result};
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
    /// The pressure policy may release this page (it is clean and outside the tail): the worker's heat
    /// summary ranks only these.
    pub releasable: bool,
}

/// A state row whose hot region changed: the worker resets its slots (all empty, LRU in slot order) and
/// sets its blocks (empty: the row holds no hot region now).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HotUpdate {
    pub row: u32,
    pub blocks: Vec<BlockId>,
}

/// A row's length after the step, and the request it serves (so that a worker always knows which request a
/// row with a positive length belongs to: admission and resumption set both); also whether every page of the
/// request is resident (none read through the hot region), which lets `resolve` take its resident path. The
/// manager gives a row's entry whenever its length or that flag changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLength {
    pub row: u32,
    pub len: u32,
    pub request: u64,
    pub resident: bool,
}

/// A request of the step: it writes positions `start .. start + tokens` through state row `row`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub request: u64,
    pub row: u32,
    pub start: u32,
    pub tokens: u32,
}

/// A residency change, for logs and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    pub request: u64,
    pub from: Residency,
    pub to: Residency,
}

/// One step's work for the worker, applied in this order before the forward pass:
/// 1. `cleared_rows`: reset (tables null, no hot region, length 0, no request);
/// 2. `seq_lens` (with the request each row serves), `table_updates`, `hot_updates`;
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
    pub seq_lens: Vec<RowLength>,
    pub table_updates: Vec<TableUpdate>,
    pub hot_updates: Vec<HotUpdate>,
    pub restores: Vec<Restore>,
    pub materialize: Vec<PageCopy>,
    /// The step's requests, in the order the scheduler gave them.
    pub scheduled: Vec<Scheduled>,
    pub transitions: Vec<Transition>,
    /// Pages released under pressure in this step.
    pub released_pages: u32,
    /// Released pages whose blocks were reused in this step (they became host-only).
    pub lost_pages: u32,
}

const MAGIC: u32 = u32::from_le_bytes(*b"HSPL");
/// 2: each length entry carries flags (bit 0: the row's request is resident).
const VERSION: u32 = 2;

impl StepPlan {
    pub fn is_short(&self) -> bool {
        self.missing_blocks > 0
    }

    /// The flat form: header, `u32` sections in the order of the fields, then the `u64` sections
    /// (transfer ids, row-length request ids, scheduled request ids, transition request ids). `SPEC.md` ("apply") gives the
    /// layout a device kernel reads.
    pub fn encode(&self) -> Vec<u8> {
        let hot_blocks = self.hot_updates.iter().map(|h| h.blocks.len()).max().unwrap_or(0);
        let words = 16
            + self.cleared_rows.len()
            + 3 * self.seq_lens.len()
            + 5 * self.table_updates.len()
            + (2 + hot_blocks) * self.hot_updates.len()
            + 2 * (self.restores.len() + self.materialize.len())
            + 3 * self.scheduled.len()
            + 2 * self.transitions.len();
        let longs =
            self.materialize.len() + self.seq_lens.len() + self.scheduled.len() + self.transitions.len();
        let mut w = codec::Writer::with_capacity(4 * words + 8 * longs + 8);
        for v in
            [MAGIC, VERSION, self.missing_blocks, self.released_pages, self.lost_pages, hot_blocks as u32]
        {
            w.u32(v);
        }
        for n in [
            self.cleared_rows.len(),
            self.seq_lens.len(),
            self.table_updates.len(),
            self.hot_updates.len(),
            self.restores.len(),
            self.materialize.len(),
            self.scheduled.len(),
            self.transitions.len(),
        ] {
            w.u32(n as u32);
        }
        self.cleared_rows.iter().for_each(|&r| w.u32(r));
        for s in &self.seq_lens {
            w.u32(s.row);
            w.u32(s.len);
            w.u32(s.resident as u32);
        }
        for u in &self.table_updates {
            for v in [u.row, u.page, u.gpu_block, u.host_block as u32, u.releasable as u32] {
                w.u32(v);
            }
        }
        for h in &self.hot_updates {
            w.u32(h.row);
            w.u32(h.blocks.len() as u32);
            (0..hot_blocks).for_each(|i| w.u32(h.blocks.get(i).copied().unwrap_or(0)));
        }
        for c in &self.restores {
            w.u32(c.gpu_block);
            w.u32(c.host_block);
        }
        for c in &self.materialize {
            w.u32(c.gpu_block);
            w.u32(c.host_block);
        }
        for s in &self.scheduled {
            for v in [s.row, s.start, s.tokens] {
                w.u32(v);
            }
        }
        let code = |r: Residency| Residency::ALL.iter().position(|&x| x == r).expect("listed") as u32;
        for t in &self.transitions {
            w.u32(code(t.from));
            w.u32(code(t.to));
        }
        w.align8();
        self.materialize.iter().for_each(|c| w.u64(c.transfer));
        self.seq_lens.iter().for_each(|s| w.u64(s.request));
        self.scheduled.iter().for_each(|s| w.u64(s.request));
        self.transitions.iter().for_each(|t| w.u64(t.request));
        w.finish()
    }

    /// The inverse of [`Self::encode`]; refuses anything it did not write.
    pub fn decode(buf: &[u8]) -> Result<StepPlan> {
        let mut r = codec::Reader::new(buf, "step plan", MAGIC, VERSION)?;
        let (missing_blocks, released_pages, lost_pages) = (r.u32()?, r.u32()?, r.u32()?);
        let hot_blocks = r.count(1)?;
        let n_cleared = r.count(1)?;
        let n_seq = r.count(3)?;
        let n_table = r.count(5)?;
        let n_hot = r.count(2 + hot_blocks)?;
        let n_restore = r.count(2)?;
        let n_mat = r.count(2)?;
        let n_sched = r.count(3)?;
        let n_trans = r.count(2)?;
        let mut plan = StepPlan { missing_blocks, released_pages, lost_pages, ..StepPlan::default() };
        plan.cleared_rows = (0..n_cleared).map(|_| r.u32()).collect::<Result<_>>()?;
        let mut lens = Vec::with_capacity(n_seq);
        for _ in 0..n_seq {
            let (row, len, flags) = (r.u32()?, r.u32()?, r.u32()?);
            if flags > 1 {
                return invalid(format!("length flags {flags:#x} are not defined"));
            }
            lens.push((row, len, flags == 1));
        }
        for _ in 0..n_table {
            let (row, page, gpu_block, host_block, flags) =
                (r.u32()?, r.u32()?, r.u32()?, r.u32()? as i32, r.u32()?);
            if flags > 1 {
                return invalid(format!("table update flags {flags:#x} are not defined"));
            }
            plan.table_updates.push(TableUpdate { row, page, gpu_block, host_block, releasable: flags == 1 });
        }
        for _ in 0..n_hot {
            let (row, n) = (r.u32()?, r.u32()? as usize);
            if n != 0 && n != hot_blocks {
                return invalid(format!(
                    "a hot update of {n} blocks in a plan of {hot_blocks}-block hot regions"
                ));
            }
            let slots = (0..hot_blocks).map(|_| r.u32()).collect::<Result<Vec<_>>>()?;
            if slots[n..].iter().any(|&slot| slot != 0) {
                return invalid("a cleared hot update's slots are not zero");
            }
            plan.hot_updates.push(HotUpdate { row, blocks: slots[..n].to_vec() });
        }
        if plan.hot_updates.iter().map(|h| h.blocks.len()).max().unwrap_or(0) != hot_blocks {
            return invalid(format!(
                "the plan's hot regions are {hot_blocks} blocks wide, but none is that long"
            ));
        }
        plan.restores = (0..n_restore)
            .map(|_| Ok(Restore { gpu_block: r.u32()?, host_block: r.u32()? }))
            .collect::<Result<_>>()?;
        let copies = (0..n_mat).map(|_| Ok((r.u32()?, r.u32()?))).collect::<Result<Vec<_>>>()?;
        let sched = (0..n_sched).map(|_| Ok((r.u32()?, r.u32()?, r.u32()?))).collect::<Result<Vec<_>>>()?;
        let residency = |code: u32| {
            Residency::ALL
                .get(code as usize)
                .copied()
                .map_or_else(|| invalid(format!("residency code {code} is not defined")), Ok)
        };
        let trans = (0..n_trans)
            .map(|_| Ok((residency(r.u32()?)?, residency(r.u32()?)?)))
            .collect::<Result<Vec<_>>>()?;
        r.align8()?;
        for (gpu_block, host_block) in copies {
            plan.materialize.push(PageCopy { transfer: r.u64()?, gpu_block, host_block });
        }
        for (row, len, resident) in lens {
            plan.seq_lens.push(RowLength { row, len, request: r.u64()?, resident });
        }
        for (row, start, tokens) in sched {
            plan.scheduled.push(Scheduled { request: r.u64()?, row, start, tokens });
        }
        for (from, to) in trans {
            plan.transitions.push(Transition { request: r.u64()?, from, to });
        }
        r.finish()?;
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StepPlan {
        StepPlan {
            missing_blocks: 0,
            cleared_rows: vec![3],
            seq_lens: vec![
                RowLength { row: 0, len: 130, request: 9, resident: true },
                RowLength { row: 1, len: 7, request: 1 << 63, resident: false },
            ],
            table_updates: vec![
                TableUpdate { row: 0, page: 2, gpu_block: 9, host_block: -1, releasable: false },
                TableUpdate { row: 1, page: 0, gpu_block: 0, host_block: 4, releasable: true },
            ],
            hot_updates: vec![HotUpdate { row: 1, blocks: vec![5, 6] }, HotUpdate { row: 2, blocks: vec![] }],
            restores: vec![Restore { gpu_block: 7, host_block: 1 }],
            materialize: vec![PageCopy { transfer: u64::MAX, gpu_block: 8, host_block: 2 }],
            scheduled: vec![Scheduled { request: 1 << 40, row: 0, start: 129, tokens: 1 }],
            transitions: vec![Transition { request: 5, from: Residency::Full, to: Residency::Mixed }],
            released_pages: 2,
            lost_pages: 1,
        }
    }

    #[test]
    fn encode_then_decode_is_the_identity() {
        for plan in [sample(), StepPlan::default(), StepPlan { missing_blocks: 3, ..StepPlan::default() }] {
            let bytes = plan.encode();
            assert_eq!(StepPlan::decode(&bytes).unwrap(), plan);
        }
    }

    #[test]
    fn decode_refuses_anything_else() {
        let bytes = sample().encode();
        for cut in [0, 4, 8, bytes.len() / 2, bytes.len() - 1] {
            assert!(StepPlan::decode(&bytes[..cut]).is_err(), "truncated at {cut}");
        }
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 8]);
        assert!(StepPlan::decode(&longer).is_err());
        let mut bad_magic = bytes.clone();
        bad_magic[0] ^= 1;
        assert!(StepPlan::decode(&bad_magic).is_err());
        let mut huge = bytes.clone();
        huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes()); // the cleared-rows count
        assert!(StepPlan::decode(&huge).is_err());
        let mut bad_flags = bytes.clone();
        let flags = 4 * (14 + 1 + 2); // the first length entry's flags: after the header and the cleared row
        assert_eq!(bad_flags[flags..flags + 4], 1u32.to_le_bytes());
        bad_flags[flags] = 3;
        assert!(StepPlan::decode(&bad_flags).is_err());
    }

    #[test]
    fn decode_accepts_only_what_encode_writes() {
        // Every single-bit change of an encoded plan (padding and a cleared hot update's slots included) is
        // either refused or the encoding of the plan it decodes to: one plan, one encoding.
        let bytes = sample().encode(); // a cleared hot update among them
        codec::assert_one_encoding(&bytes, |b| StepPlan::decode(b).ok().map(|p| p.encode()));
    }
}
