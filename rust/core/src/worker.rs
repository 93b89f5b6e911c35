//! `apply` of `cuda/SPEC.md`: what a worker does with a [`StepPlan`] before the forward, on its state
//! tensors, its slab and its host pool. The CPU reference of the device path, and the CPU path itself.
//!
//! Every entry is checked against the tensors' sizes before anything is written, so a plan from a
//! manager configured larger than the worker's layout, or a corrupted one, is refused whole.

use crate::error::{invalid, Result};
use crate::plan::{Restore, StepPlan};
use crate::reference::{copy_units, Direction, LayerSlabs};

/// The worker's state tensors for `S` rows, `P` pages, `HB` hot blocks, `G` groups and `H` hot rows,
/// as flat row-major slices. `row_request` holds each row's request id (its bits; meaningful while the
/// row's `seq_lens` entry is positive: both are set together), `resident` its request's resident flag (set
/// with them).
pub struct WorkerState<'a> {
    pub seq_lens: &'a mut [i32],
    pub block_table: &'a mut [i32],
    pub host_table: &'a mut [i32],
    pub releasable: &'a mut [u8],
    pub row_request: &'a mut [i64],
    pub resident: &'a mut [u8],
    pub hot_blocks: &'a mut [i32],
    pub hot_pos: &'a mut [i32],
    /// `[S, G, H]` and `[S, G]`: the LRU as stamps and each region's clock (`crate::lru_stamps`).
    pub hot_stamp: &'a mut [i64],
    pub hot_clock: &'a mut [i64],
    pub heat: &'a mut [i32],
    pub status: &'a mut [i32],
}

/// Sizes the state does not carry in its lengths.
#[derive(Clone, Copy, Debug)]
pub struct WorkerGeometry {
    pub pages: usize,
    pub block_size: usize,
    pub groups: usize,
    pub hot_rows: usize,
    pub row_bytes: usize,
}

impl WorkerState<'_> {
    fn rows(&self, geo: &WorkerGeometry) -> Result<usize> {
        let s = self.seq_lens.len();
        let (p, gh) = (geo.pages, geo.groups * geo.hot_rows);
        let hb = geo.hot_rows.div_ceil(geo.block_size.max(1));
        let lens = [
            ("block_table", self.block_table.len(), s * p),
            ("host_table", self.host_table.len(), s * p),
            ("releasable", self.releasable.len(), s * p),
            ("heat", self.heat.len(), s * p),
            ("row_request", self.row_request.len(), s),
            ("resident", self.resident.len(), s),
            ("status", self.status.len(), s),
            ("hot_blocks", self.hot_blocks.len(), s * hb),
            ("hot_pos", self.hot_pos.len(), s * gh),
            ("hot_stamp", self.hot_stamp.len(), s * gh),
            ("hot_clock", self.hot_clock.len(), s * geo.groups),
        ];
        if let Some((name, got, want)) = lens.iter().find(|(_, got, want)| got != want) {
            return invalid(format!("{name} has {got} elements, expected {want}"));
        }
        if geo.block_size == 0 || geo.hot_rows == 0 || geo.groups == 0 {
            return invalid("block_size, hot_rows and groups must be positive");
        }
        Ok(s)
    }

    fn reset_hot(&mut self, row: usize, geo: &WorkerGeometry, blocks: &[u32]) {
        let hb = self.hot_blocks.len() / self.seq_lens.len();
        let slots = &mut self.hot_blocks[row * hb..(row + 1) * hb];
        slots.fill(0);
        slots.iter_mut().zip(blocks).for_each(|(s, &b)| *s = b as i32);
        let gh = geo.groups * geo.hot_rows;
        self.hot_pos[row * gh..(row + 1) * gh].fill(-1);
        // A fresh region: every stamp 0 (slot order), its clock 0.
        self.hot_stamp[row * gh..(row + 1) * gh].fill(0);
        self.hot_clock[row * geo.groups..(row + 1) * geo.groups].fill(0);
    }
}

/// Refuses a plan that would index outside the state, the slab (`gpu_blocks`) or the host pool
/// (`host_blocks`), or whose copies write one destination twice.
pub fn check_plan(
    plan: &StepPlan,
    s: usize,
    geo: &WorkerGeometry,
    gpu_blocks: usize,
    host_blocks: usize,
) -> Result<()> {
    let hb = geo.hot_rows.div_ceil(geo.block_size);
    let within = |what: &str, v: i64, low: i64, end: usize| -> Result<()> {
        if v < low || v >= end as i64 {
            return invalid(format!(
                "the plan's {what} {v} is outside {low}..{} of this worker's layout (is the manager configured \
                 larger than the Layout?)",
                end as i64 - 1
            ));
        }
        Ok(())
    };
    if plan.is_short() {
        return invalid(format!("a short plan ({} blocks missing) must not be applied", plan.missing_blocks));
    }
    // One entry per row (or page) and section: a device applies a section's entries in parallel, so two
    // entries for one place would leave either, or a mix.
    let once = |what: &str, keys: Vec<(u32, u32)>| match repeated(keys) {
        Some(k) => invalid(format!("the plan has two {what} entries for {k:?}")),
        None => Ok(()),
    };
    once("cleared row", plan.cleared_rows.iter().map(|&r| (r, 0)).collect())?;
    once("seq_len", plan.seq_lens.iter().map(|l| (l.row, 0)).collect())?;
    once("table (row, page)", plan.table_updates.iter().map(|u| (u.row, u.page)).collect())?;
    once("hot region row", plan.hot_updates.iter().map(|h| (h.row, 0)).collect())?;
    once("scheduled row", plan.scheduled.iter().map(|s| (s.row, 0)).collect())?;
    for h in &plan.hot_updates {
        once("hot block of one row", h.blocks.iter().map(|&b| (h.row, b)).collect())?;
    }
    for &row in &plan.cleared_rows {
        within("cleared row", row as i64, 0, s)?;
    }
    for l in &plan.seq_lens {
        within("state row", l.row as i64, 0, s)?;
        within("seq_len", l.len as i64, 0, geo.pages * geo.block_size + 1)?;
    }
    for u in &plan.table_updates {
        within("state row", u.row as i64, 0, s)?;
        within("page", u.page as i64, 0, geo.pages)?;
        within("GPU block", u.gpu_block as i64, 0, gpu_blocks)?;
        within("host block", u.host_block as i64, -1, host_blocks)?;
    }
    for h in &plan.hot_updates {
        within("state row", h.row as i64, 0, s)?;
        if !h.blocks.is_empty() && h.blocks.len() != hb {
            return invalid(format!(
                "the plan gives row {} {} hot blocks; this layout has {hb}",
                h.row,
                h.blocks.len()
            ));
        }
        for &b in &h.blocks {
            within("hot GPU block", b as i64, 1, gpu_blocks)?;
        }
    }
    // A scheduled request writes positions start .. start + tokens of its row: the plan must also give
    // that row's length after the step as exactly start + tokens, for the same request. Lengths are
    // bounded by the table above, so neither path can write a position (or a row) the plan does not own,
    // and no size derived from the counts exceeds what the layout implies.
    let mut lengths: Vec<(u32, u32, u64)> = plan.seq_lens.iter().map(|l| (l.row, l.len, l.request)).collect();
    lengths.sort_unstable(); // one per row (checked above)
    for sch in &plan.scheduled {
        within("scheduled row", sch.row as i64, 0, s)?;
        let end = sch.start as u64 + sch.tokens as u64;
        let given = lengths.binary_search_by_key(&sch.row, |&(row, _, _)| row).ok().map(|i| lengths[i]);
        if given.map(|(_, len, request)| (len as u64, request)) != Some((end, sch.request)) {
            return invalid(format!(
                "the plan schedules request {} to write positions {}..{end} of row {}, but does not give that \
                 row's length as {end} for that request",
                sch.request, sch.start, sch.row
            ));
        }
    }
    // A restore lands in a block the plan's own table gives the page it restores.
    for c in &plan.restores {
        within("restored GPU block", c.gpu_block as i64, 1, gpu_blocks)?;
        within("restored host block", c.host_block as i64, 0, host_blocks)?;
    }
    if let Some(block) = repeated(plan.restores.iter().map(|c| c.gpu_block).collect()) {
        return invalid(format!("the plan restores two pages into GPU block {block}"));
    }
    let mut tables: Vec<(u32, i32)> =
        plan.table_updates.iter().map(|u| (u.gpu_block, u.host_block)).collect();
    tables.sort_unstable();
    let named = |c: &&Restore| tables.binary_search(&(c.gpu_block, c.host_block as i32)).is_ok();
    if let Some(c) = plan.restores.iter().find(|c| !named(c)) {
        return invalid(format!(
            "the plan restores host block {} into GPU block {}, which none of its table entries names",
            c.host_block, c.gpu_block
        ));
    }
    for c in &plan.materialize {
        within("copied GPU block", c.gpu_block as i64, 1, gpu_blocks)?;
        within("copied host block", c.host_block as i64, 0, host_blocks)?;
    }
    if let Some(block) = repeated(plan.materialize.iter().map(|c| c.host_block).collect()) {
        return invalid(format!("the plan copies two pages into host block {block}"));
    }
    Ok(())
}

/// The smallest key that occurs twice. Sorting, not hashing: the keys come from outside (a plan's bytes),
/// and std's SipHash costs more than the sort on the few hundred entries of a decode step's plan.
fn repeated<K: Ord + Copy>(mut keys: Vec<K>) -> Option<K> {
    keys.sort_unstable();
    keys.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// Applies `plan` in SPEC.md's order: cleared rows, the rows' requests, lengths, table entries and
/// releasable flags, hot regions, then the copies (restores host -> GPU, then page copies GPU -> host).
pub fn apply_plan(
    plan: &StepPlan,
    geo: &WorkerGeometry,
    st: &mut WorkerState<'_>,
    layers: &mut [LayerSlabs<'_>],
) -> Result<()> {
    let s = st.rows(geo)?;
    let unit_bytes = geo.block_size * geo.row_bytes;
    if unit_bytes == 0 || layers.is_empty() {
        return invalid("apply needs a positive row size and at least one layer");
    }
    let gpu_blocks = layers[0].gpu.len() / unit_bytes;
    let host_blocks = layers[0].host.len() / unit_bytes;
    if layers
        .iter()
        .any(|l| l.gpu.len() != gpu_blocks * unit_bytes || l.host.len() != host_blocks * unit_bytes)
    {
        return invalid("every layer's slab and host pool must be whole blocks of the same size");
    }
    check_plan(plan, s, geo, gpu_blocks, host_blocks)?;
    let p = geo.pages;
    for &row in &plan.cleared_rows {
        let r = row as usize;
        st.seq_lens[r] = 0;
        st.row_request[r] = -1;
        st.resident[r] = 0;
        st.status[r] = 0;
        st.block_table[r * p..(r + 1) * p].fill(0);
        st.host_table[r * p..(r + 1) * p].fill(-1);
        st.releasable[r * p..(r + 1) * p].fill(0);
        st.heat[r * p..(r + 1) * p].fill(0);
        st.reset_hot(r, geo, &[]);
    }
    for l in &plan.seq_lens {
        st.seq_lens[l.row as usize] = l.len as i32;
        st.row_request[l.row as usize] = l.request as i64;
        st.resident[l.row as usize] = l.resident as u8;
    }
    for u in &plan.table_updates {
        let i = u.row as usize * p + u.page as usize;
        st.block_table[i] = u.gpu_block as i32;
        st.host_table[i] = u.host_block;
        st.releasable[i] = u.releasable as u8;
    }
    for h in &plan.hot_updates {
        st.reset_hot(h.row as usize, geo, &h.blocks);
    }
    let pairs = |copies: &mut dyn Iterator<Item = (u32, u32)>| -> Vec<i64> {
        copies.flat_map(|(g, h)| [g as i64, h as i64]).collect()
    };
    let restores = pairs(&mut plan.restores.iter().map(|c| (c.gpu_block, c.host_block)));
    copy_units(&restores, geo.block_size, geo.row_bytes, Direction::HostToDevice, layers)?;
    let copies = pairs(&mut plan.materialize.iter().map(|c| (c.gpu_block, c.host_block)));
    copy_units(&copies, geo.block_size, geo.row_bytes, Direction::DeviceToHost, layers)
}

/// The slot mapping of a plan: the GPU row of every token its scheduled requests write, request after
/// request in the plan's order, read from `block_table` ([S, P], as applied). Refuses a token whose page has no
/// resident block (a table out of step with the plan).
pub fn slot_mapping(
    plan: &StepPlan,
    block_table: &[i32],
    pages: usize,
    block_size: usize,
) -> Result<Vec<i64>> {
    // A plan writes each slot of the table at most once: more tokens than that is a plan out of step.
    let total: u64 = plan.scheduled.iter().map(|s| s.tokens as u64).sum();
    if total > (block_table.len() * block_size) as u64 {
        return invalid(format!("the plan writes {total} tokens, more than the block table's rows"));
    }
    let mut out = Vec::with_capacity(total as usize);
    for s in &plan.scheduled {
        let (row, bs) = (s.row as usize, block_size as u64);
        for pos in s.start as u64..s.start as u64 + s.tokens as u64 {
            let page = (pos / bs) as usize;
            let block =
                (page < pages).then(|| block_table.get(row * pages + page)).flatten().copied().unwrap_or(0);
            if block <= 0 {
                return invalid(format!("row {row} writes position {pos}, whose page has no resident block"));
            }
            out.push(block as i64 * bs as i64 + (pos % bs) as i64);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{HotUpdate, PageCopy, Restore, RowLength, Scheduled, TableUpdate};

    const GEO: WorkerGeometry =
        WorkerGeometry { pages: 4, block_size: 2, groups: 2, hot_rows: 4, row_bytes: 16 };
    const S: usize = 2;

    struct Tensors {
        i32s: [Vec<i32>; 6],
        /// hot_stamp, hot_clock
        hot_stamp: Vec<i64>,
        hot_clock: Vec<i64>,
        releasable: Vec<u8>,
        row_request: Vec<i64>,
        resident: Vec<u8>,
        gpu: Vec<u8>,
        host: Vec<u8>,
    }

    impl Tensors {
        fn new() -> Self {
            let (p, gh) = (S * GEO.pages, S * GEO.groups * GEO.hot_rows);
            Tensors {
                // seq_lens, block_table, host_table, hot_blocks, hot_pos, heat (+ status below)
                i32s: [vec![0; S], vec![0; p], vec![-1; p], vec![0; S * 2], vec![-1; gh], vec![3; p]],
                // not a fresh region's: apply must reset them
                hot_stamp: vec![9; gh],
                hot_clock: vec![5; S * GEO.groups],
                releasable: vec![0; p],
                row_request: vec![-1; S],
                resident: vec![0; S],
                // 6 GPU blocks and 5 host blocks of 2 rows of 16 bytes; each byte says where it is.
                gpu: (0..6 * 32).map(|i| i as u8).collect(),
                host: (0..5 * 32).map(|i| 200 - i as u8).collect(),
            }
        }

        fn apply(&mut self, plan: &StepPlan) -> Result<()> {
            let mut status = vec![0; S];
            let [seq_lens, block_table, host_table, hot_blocks, hot_pos, heat] = &mut self.i32s;
            let mut st = WorkerState {
                seq_lens,
                block_table,
                host_table,
                releasable: &mut self.releasable,
                row_request: &mut self.row_request,
                resident: &mut self.resident,
                hot_blocks,
                hot_pos,
                hot_stamp: &mut self.hot_stamp,
                hot_clock: &mut self.hot_clock,
                heat,
                status: &mut status,
            };
            let mut layers = [LayerSlabs { gpu: &mut self.gpu, host: &mut self.host }];
            apply_plan(plan, &GEO, &mut st, &mut layers)
        }
    }

    fn plan() -> StepPlan {
        StepPlan {
            scheduled: vec![Scheduled { request: u64::MAX - 1, row: 1, start: 0, tokens: 5 }],
            seq_lens: vec![RowLength { row: 1, len: 5, request: u64::MAX - 1, resident: true }],
            table_updates: vec![
                TableUpdate { row: 1, page: 0, gpu_block: 3, host_block: 2, releasable: true },
                TableUpdate { row: 1, page: 2, gpu_block: 4, host_block: -1, releasable: false },
            ],
            hot_updates: vec![HotUpdate { row: 1, blocks: vec![1, 2] }],
            restores: vec![Restore { gpu_block: 3, host_block: 2 }],
            materialize: vec![PageCopy { transfer: 1, gpu_block: 4, host_block: 0 }],
            ..StepPlan::default()
        }
    }

    #[test]
    fn applies_tables_hot_regions_and_copies() {
        let mut t = Tensors::new();
        let (gpu0, host0) = (t.gpu.clone(), t.host.clone());
        t.apply(&plan()).unwrap();
        let [seq_lens, block_table, host_table, hot_blocks, hot_pos, _] = &t.i32s;
        assert_eq!(seq_lens, &[0, 5]);
        assert_eq!((t.row_request[1] as u64, &t.resident), (u64::MAX - 1, &vec![0, 1]));
        assert_eq!(block_table[4..], [3, 0, 4, 0]);
        assert_eq!(host_table[4..], [2, -1, -1, -1]);
        assert_eq!(t.releasable[4..], [1, 0, 0, 0]);
        assert_eq!(hot_blocks, &[0, 0, 1, 2]);
        assert_eq!(hot_pos[8..], [-1; 8]);
        // Row 1's regions are fresh (stamps 0: slot order, clocks 0); row 0's are untouched.
        assert_eq!((&t.hot_stamp[..8], &t.hot_stamp[8..]), (&[9; 8][..], &[0; 8][..]));
        assert_eq!(t.hot_clock, [5, 5, 0, 0]);
        assert_eq!(t.gpu[96..128], host0[64..96]); // block 3 restored from host block 2
        assert_eq!(t.host[0..32], gpu0[128..160]); // block 4 copied to host block 0
                                                   // Clearing the row resets every table, the heat and the hot region.
        t.apply(&StepPlan { cleared_rows: vec![1], ..StepPlan::default() }).unwrap();
        let [seq_lens, block_table, host_table, hot_blocks, hot_pos, heat] = &t.i32s;
        assert_eq!((seq_lens[1], t.row_request[1], t.resident[1]), (0, -1, 0));
        assert_eq!(
            (&block_table[4..], &host_table[4..], &heat[4..]),
            (&[0; 4][..], &[-1; 4][..], &[0; 4][..])
        );
        assert_eq!(
            (&t.releasable[4..], &hot_blocks[2..], &hot_pos[8..]),
            (&[0; 4][..], &[0; 2][..], &[-1; 8][..])
        );
    }

    #[test]
    fn the_slot_mapping_follows_the_applied_tables() {
        let mut t = Tensors::new();
        let plan = plan(); // row 1 writes positions 0..5: pages 0 (block 3) and 2 (block 4) are resident
        t.apply(&plan).unwrap();
        let table = &t.i32s[1];
        assert!(slot_mapping(&plan, table, GEO.pages, GEO.block_size).is_err()); // page 1 has no block
        let mut t2 = Tensors::new();
        let mut full = plan.clone();
        full.table_updates.push(TableUpdate {
            row: 1,
            page: 1,
            gpu_block: 5,
            host_block: -1,
            releasable: false,
        });
        t2.apply(&full).unwrap();
        assert_eq!(slot_mapping(&full, &t2.i32s[1], GEO.pages, GEO.block_size).unwrap(), [6, 7, 10, 11, 8]);
    }

    #[test]
    fn refuses_a_plan_outside_the_layout_and_changes_nothing() {
        let bad = [
            StepPlan { cleared_rows: vec![2], ..plan() },
            StepPlan { seq_lens: vec![RowLength { row: 0, len: 9, request: 1, resident: false }], ..plan() },
            StepPlan { hot_updates: vec![HotUpdate { row: 0, blocks: vec![1] }], ..plan() },
            StepPlan { hot_updates: vec![HotUpdate { row: 0, blocks: vec![0, 1] }], ..plan() },
            StepPlan { hot_updates: vec![HotUpdate { row: 0, blocks: vec![2, 2] }], ..plan() },
            StepPlan { cleared_rows: vec![0, 0], ..plan() },
            StepPlan {
                seq_lens: vec![
                    RowLength { row: 1, len: 3, request: 1, resident: false },
                    RowLength { row: 1, len: 5, request: 1, resident: false },
                ],
                ..plan()
            },
            StepPlan {
                table_updates: vec![
                    TableUpdate { row: 1, page: 0, gpu_block: 3, host_block: 2, releasable: true },
                    TableUpdate { row: 1, page: 0, gpu_block: 4, host_block: -1, releasable: false },
                ],
                ..plan()
            },
            StepPlan { restores: vec![Restore { gpu_block: 6, host_block: 0 }], ..plan() },
            StepPlan {
                restores: vec![
                    Restore { gpu_block: 3, host_block: 0 },
                    Restore { gpu_block: 3, host_block: 1 },
                ],
                ..plan()
            },
            StepPlan {
                materialize: vec![
                    PageCopy { transfer: 1, gpu_block: 1, host_block: 4 },
                    PageCopy { transfer: 2, gpu_block: 2, host_block: 4 },
                ],
                ..plan()
            },
            StepPlan { missing_blocks: 1, ..StepPlan::default() },
            // Scheduled positions the plan's lengths do not own: wrapped, huge, another request's, none.
            StepPlan {
                scheduled: vec![Scheduled { request: u64::MAX - 1, row: 1, start: u32::MAX - 1, tokens: 7 }],
                ..plan()
            },
            StepPlan {
                scheduled: vec![Scheduled { request: u64::MAX - 1, row: 1, start: 0, tokens: u32::MAX }],
                ..plan()
            },
            StepPlan { scheduled: vec![Scheduled { request: 7, row: 1, start: 0, tokens: 5 }], ..plan() },
            StepPlan { seq_lens: vec![], ..plan() },
            StepPlan { restores: vec![Restore { gpu_block: 5, host_block: 2 }], ..plan() },
        ];
        let mut t = Tensors::new();
        let before = (t.i32s.clone(), t.releasable.clone(), t.gpu.clone(), t.host.clone());
        for (i, p) in bad.iter().enumerate() {
            assert!(t.apply(p).is_err(), "plan {i} was applied");
            assert_eq!(
                (t.i32s.clone(), t.releasable.clone(), t.gpu.clone(), t.host.clone()),
                before,
                "plan {i}"
            );
        }
    }
}
