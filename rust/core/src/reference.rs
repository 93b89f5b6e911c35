//! The CPU reference of the data path: `cuda/SPEC.md` as code. The CUDA kernels must match these
//! functions bit for bit (outputs, hot state, LRU order, counters, heat, status, copied bytes).
//!
//! Two kinds of bad input, as SPEC.md sorts them: corrupt state (a table entry out of range, a hot
//! block named twice...) is skipped and flagged in `status`, as the kernels do; a malformed
//! argument (a length, a state row, a row outside its slab) is refused with `InvalidArgument` before
//! anything is written, since the caller can be told.

use std::collections::HashMap;

use crate::error::{invalid, Result};
use crate::lru_stamps;

/// Sizes shared by all state tensors.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub block_size: usize,
    /// Pages per request row (`P`).
    pub pages: usize,
    /// Hot rows per request and group (`H`).
    pub hot_rows: usize,
    pub groups: usize,
    pub row_bytes: usize,
}

impl Geometry {
    pub fn hot_blocks(&self) -> usize {
        self.hot_rows.div_ceil(self.block_size)
    }
}

/// The resolver's state tensors for `S` request rows, as flat row-major slices.
pub struct ResolveState<'a> {
    pub seq_lens: &'a [i32],
    pub block_table: &'a [i32],
    pub host_table: &'a [i32],
    pub hot_blocks: &'a [i32],
    /// `[S]`, or empty (no request flagged): nonzero where the core says every page of the request is resident.
    /// A flagged request reads everything in place and never uses its hot region; a selected page it has no
    /// block for is corrupt state (`BAD_TABLE`), as one outside the slab is.
    pub resident: &'a [u8],
    pub hot_pos: &'a mut [i32],
    /// `[S, G, H]`: the LRU as stamps, ascending `(stamp, slot)` least recently used first (`lru_stamps`).
    pub hot_stamp: &'a mut [i64],
    /// `[S, G]`: successful steps of each region since its reset; the next one stamps with `clock + 1`.
    pub hot_clock: &'a mut [i64],
    pub heat: &'a mut [i32],
    pub status: &'a mut [i32],
    pub counters: &'a mut [i64],
}

/// One layer's GPU slab and host pool, as rows of `row_bytes`.
pub struct LayerSlabs<'a> {
    pub gpu: &'a mut [u8],
    pub host: &'a mut [u8],
}

/// The status bits of SPEC.md.
pub const STATUS_OVERFLOW: i32 = 1;
pub const STATUS_NO_HOST_COPY: i32 = 2;
pub const STATUS_BAD_TABLE: i32 = 4;
pub const STATUS_BAD_HOT: i32 = 8;

/// A successful request's new hot state for its group: the hot_pos row, the stamps (slot, stamp) of U's slots
/// (the others keep theirs) and the region's clock.
struct HotUpdate {
    pos: Vec<i32>,
    stamps: Vec<(usize, i64)>,
    clock: i64,
}

/// What resolving one request will change, computed before anything is written.
struct RequestOutcome {
    row: usize,
    /// (flat output index, value) for every element of the request.
    outputs: Vec<(usize, i32)>,
    heat_pages: Vec<usize>,
    status: i32,
    /// The new hot state when the request succeeds, and (GPU row, host row) copies.
    hot: Option<HotUpdate>,
    copies: Vec<(usize, usize)>,
    hits: i64,
}

fn check_len(name: &str, len: usize, want: usize) -> Result<()> {
    if len != want {
        return invalid(format!("{name} has {len} elements, expected {want}"));
    }
    Ok(())
}

impl ResolveState<'_> {
    fn validate(&self, geo: &Geometry) -> Result<usize> {
        if geo.block_size == 0 || geo.row_bytes == 0 || geo.row_bytes % 16 != 0 {
            return invalid(format!(
                "block_size ({}) must be positive and row_bytes ({}) a positive multiple of 16",
                geo.block_size, geo.row_bytes
            ));
        }
        if geo.hot_rows == 0 {
            return invalid("hot_rows must be positive");
        }
        let s = self.seq_lens.len();
        let (p, g, h) = (geo.pages, geo.groups, geo.hot_rows);
        check_len("block_table", self.block_table.len(), s * p)?;
        check_len("host_table", self.host_table.len(), s * p)?;
        check_len("hot_blocks", self.hot_blocks.len(), s * geo.hot_blocks())?;
        if !self.resident.is_empty() {
            check_len("resident", self.resident.len(), s)?;
        }
        check_len("hot_pos", self.hot_pos.len(), s * g * h)?;
        check_len("hot_stamp", self.hot_stamp.len(), s * g * h)?;
        check_len("hot_clock", self.hot_clock.len(), s * g)?;
        check_len("heat", self.heat.len(), s * p)?;
        check_len("status", self.status.len(), s)?;
        check_len("counters", self.counters.len(), 3)?;
        Ok(s)
    }
}

fn slab_rows(layers: &[LayerSlabs<'_>], geo: &Geometry) -> Result<(usize, usize)> {
    let Some(first) = layers.first() else {
        return invalid("resolve needs the layers of its group");
    };
    let rows = |len: usize, what: &str| -> Result<usize> {
        if len % geo.row_bytes != 0 {
            return invalid(format!(
                "{what} slab of {len} bytes is not whole rows of {} bytes",
                geo.row_bytes
            ));
        }
        Ok(len / geo.row_bytes)
    };
    let (g, h) = (rows(first.gpu.len(), "GPU")?, rows(first.host.len(), "host")?);
    for l in layers {
        if rows(l.gpu.len(), "GPU")? != g || rows(l.host.len(), "host")? != h {
            return invalid("every layer's slab must have the same number of rows");
        }
    }
    Ok((g, h))
}

/// One resolver launch's input: `topk` is `[rows, top_k]`, `row_state` `[rows]` (negative: padding row).
pub struct Batch<'a> {
    pub topk: &'a [i32],
    pub top_k: usize,
    pub row_state: &'a [i32],
}

/// `resolve` of SPEC.md for group `group`; `layers` are that group's layers (their hot rows are filled).
///
/// Malformed arguments (lengths, a group or state row out of range) are refused before anything is
/// written; corrupt state is skipped and flagged in `status`, exactly as the kernel does.
pub fn resolve(
    geo: &Geometry,
    st: &mut ResolveState<'_>,
    batch: &Batch<'_>,
    group: usize,
    layers: &mut [LayerSlabs<'_>],
    out: &mut [i32],
) -> Result<()> {
    let Batch { topk, top_k, row_state } = *batch;
    let s = st.validate(geo)?;
    let rows = row_state.len();
    check_len("topk", topk.len(), rows * top_k)?;
    check_len("row_ids", out.len(), rows * top_k)?;
    if group >= geo.groups {
        return invalid(format!("group {group} out of range (groups = {})", geo.groups));
    }
    let (gpu_rows, host_rows) = slab_rows(layers, geo)?;
    let blocks = Blocks { gpu: gpu_rows / geo.block_size, host: host_rows / geo.block_size };
    // Batch rows of each request, requests in order of their first row.
    let mut by_state: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut index: HashMap<usize, usize> = HashMap::new();
    for (i, &r) in row_state.iter().enumerate() {
        if r >= s as i32 {
            return invalid(format!("row_state[{i}] = {r} is not a state row (there are {s})"));
        }
        if r >= 0 {
            let slot = *index.entry(r as usize).or_insert_with(|| {
                by_state.push((r as usize, Vec::new()));
                by_state.len() - 1
            });
            by_state[slot].1.push(i);
        }
    }
    let outcomes: Vec<RequestOutcome> = by_state
        .iter()
        .map(|(r, batch_rows)| resolve_request(geo, st, topk, top_k, *r, batch_rows, group, blocks))
        .collect();
    // Everything decided: write.
    out.fill(-1);
    let (g, h, rb) = (geo.groups, geo.hot_rows, geo.row_bytes);
    for o in outcomes {
        for (i, v) in o.outputs {
            out[i] = v;
        }
        for page in o.heat_pages {
            st.heat[o.row * geo.pages + page] += 1;
        }
        st.status[o.row] |= o.status;
        let Some(HotUpdate { pos, stamps, clock }) = o.hot else { continue };
        let base = (o.row * g + group) * h;
        st.hot_pos[base..base + h].copy_from_slice(&pos);
        for (slot, stamp) in stamps {
            st.hot_stamp[base + slot] = stamp;
        }
        st.hot_clock[o.row * g + group] = clock;
        let misses = o.copies.len() as i64;
        for &(dst, src) in &o.copies {
            for l in layers.iter_mut() {
                l.gpu[dst * rb..(dst + 1) * rb].copy_from_slice(&l.host[src * rb..(src + 1) * rb]);
            }
        }
        st.counters[0] += o.hits;
        st.counters[1] += misses;
        st.counters[2] += misses * (rb * layers.len()) as i64;
    }
    Ok(())
}

/// Whole blocks in the GPU slab and in the host pool: the valid block ids are below these.
#[derive(Clone, Copy)]
struct Blocks {
    gpu: usize,
    host: usize,
}

#[allow(clippy::too_many_arguments)]
fn resolve_request(
    geo: &Geometry,
    st: &ResolveState<'_>,
    topk: &[i32],
    top_k: usize,
    r: usize,
    batch_rows: &[usize],
    group: usize,
    blocks: Blocks,
) -> RequestOutcome {
    let (bs, p, h) = (geo.block_size, geo.pages, geo.hot_rows);
    let mut outcome = RequestOutcome {
        row: r,
        outputs: Vec::new(),
        heat_pages: Vec::new(),
        status: 0,
        hot: None,
        copies: Vec::new(),
        hits: 0,
    };
    let max_len = (p * bs) as i64;
    let mut seq_len = st.seq_lens[r] as i64;
    if !(0..=max_len).contains(&seq_len) {
        outcome.status |= STATUS_BAD_TABLE;
        seq_len = seq_len.clamp(0, max_len);
    }
    // A flagged request's null block is as bad as one outside the slab: nothing of it reaches U.
    let lowest_block = if st.resident.get(r).is_some_and(|&f| f != 0) { 1 } else { 0 };
    let mut seen: HashMap<i32, ()> = HashMap::new();
    let mut union: Vec<i32> = Vec::new();
    // The request index (row-major over the request's rows) of each position of U's first occurrence.
    let mut q_first: Vec<u32> = Vec::new();
    let mut unresolved: Vec<(usize, i32)> = Vec::new();
    for (o, &i) in batch_rows.iter().enumerate() {
        for j in 0..top_k {
            let flat = i * top_k + j;
            let pos = topk[flat];
            if pos < 0 || pos as i64 >= seq_len {
                outcome.outputs.push((flat, -1));
                continue;
            }
            let (page, off) = (pos as usize / bs, pos as usize % bs);
            let first = seen.insert(pos, ()).is_none();
            if first {
                outcome.heat_pages.push(page);
            }
            let block = st.block_table[r * p + page];
            if block == 0 && lowest_block == 0 {
                if first {
                    union.push(pos);
                    q_first.push((o * top_k + j) as u32);
                }
                unresolved.push((flat, pos));
            } else if block > 0 && (block as usize) < blocks.gpu {
                outcome.outputs.push((flat, (block as usize * bs + off) as i32));
            } else {
                outcome.status |= STATUS_BAD_TABLE;
                outcome.outputs.push((flat, -1));
            }
        }
    }
    if union.is_empty() {
        return outcome;
    }
    let hb = geo.hot_blocks();
    let hot_blocks = &st.hot_blocks[r * hb..(r + 1) * hb];
    let fail = |mut outcome: RequestOutcome, status: i32| {
        outcome.status |= status;
        outcome.outputs.extend(unresolved.iter().map(|&(flat, _)| (flat, -1)));
        outcome
    };
    if union.len() > h || hot_blocks[0] == 0 {
        return fail(outcome, STATUS_OVERFLOW);
    }
    // A block named twice would give two slots one GPU row: two misses copied into one row, in an order
    // the kernel does not fix. (Blocks shared with another request are the core's to prevent: SPEC.md.)
    let mut named = std::collections::HashSet::with_capacity(hb);
    if hot_blocks.iter().any(|&b| b <= 0 || b as usize >= blocks.gpu || !named.insert(b)) {
        return fail(outcome, STATUS_BAD_HOT);
    }
    let base = (r * geo.groups + group) * h;
    let hot_pos = &st.hot_pos[base..base + h];
    let hot_stamp = &st.hot_stamp[base..base + h];
    // Slot of each selected position that a slot holds; a selected position held twice is corrupt (other
    // duplicates are harmless until they are selected).
    let wanted: HashMap<i32, ()> = union.iter().map(|&pos| (pos, ())).collect();
    let mut slot_of: HashMap<i32, usize> = HashMap::with_capacity(h);
    for (slot, &pos) in hot_pos.iter().enumerate() {
        if wanted.contains_key(&pos) && slot_of.insert(pos, slot).is_some() {
            return fail(outcome, STATUS_BAD_HOT);
        }
    }
    let misses: Vec<i32> = union.iter().copied().filter(|pos| !slot_of.contains_key(pos)).collect();
    let mut hosts = Vec::with_capacity(misses.len());
    let mut host_status = 0;
    for &pos in &misses {
        let (page, off) = (pos as usize / bs, pos as usize % bs);
        let hblock = st.host_table[r * p + page];
        if hblock < 0 {
            host_status |= STATUS_NO_HOST_COPY;
        } else if hblock as usize >= blocks.host {
            host_status |= STATUS_BAD_TABLE;
        } else {
            hosts.push(hblock as usize * bs + off);
        }
    }
    if host_status != 0 {
        return fail(outcome, host_status);
    }
    let hit_slots: std::collections::HashSet<usize> = slot_of.values().copied().collect();
    let evictable = lru_stamps::evictions(hot_stamp, &hit_slots, misses.len());
    let hot_row = |slot: usize| hot_blocks[slot / bs] as usize * bs + slot % bs;
    let mut new_pos = hot_pos.to_vec();
    for (k, &pos) in misses.iter().enumerate() {
        let slot = evictable[k];
        new_pos[slot] = pos;
        slot_of.insert(pos, slot);
        outcome.copies.push((hot_row(slot), hosts[k]));
    }
    // Step 6: what was selected becomes most recent, in U's order; the other slots keep their stamps.
    let clock = st.hot_clock[r * geo.groups + group].wrapping_add(1);
    let stamps =
        union.iter().zip(&q_first).map(|(pos, &q)| (slot_of[pos], lru_stamps::stamp(clock, q))).collect();
    outcome.outputs.extend(unresolved.iter().map(|&(flat, pos)| (flat, hot_row(slot_of[&pos]) as i32)));
    outcome.hits = (union.len() - misses.len()) as i64;
    outcome.hot = Some(HotUpdate { pos: new_pos, stamps, clock });
    outcome
}

/// `gather` of SPEC.md for one layer: `out` is `[rows * top_k, row_bytes]`.
pub fn gather(row_ids: &[i32], slab: &[u8], row_bytes: usize, out: &mut [u8]) -> Result<()> {
    if row_bytes == 0 {
        return invalid("row_bytes must be positive");
    }
    check_len("dense output", out.len(), row_ids.len() * row_bytes)?;
    let rows = slab.len() / row_bytes;
    if let Some(&bad) = row_ids.iter().find(|&&r| r >= 0 && r as usize >= rows) {
        return invalid(format!("row id {bad} is outside the slab of {rows} rows"));
    }
    for (i, &r) in row_ids.iter().enumerate() {
        let dst = &mut out[i * row_bytes..(i + 1) * row_bytes];
        if r < 0 {
            dst.fill(0);
        } else {
            dst.copy_from_slice(&slab[r as usize * row_bytes..(r as usize + 1) * row_bytes]);
        }
    }
    Ok(())
}

/// Direction of a copy between the GPU slab and the host pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    DeviceToHost,
    HostToDevice,
}

/// `copy_rows` (`unit = 1`) and `copy_blocks` (`unit = block_size`) of SPEC.md: pairs of (GPU, host)
/// indices in units of `unit` rows, for every layer; pairs with a negative entry are skipped. An entry
/// outside its slab or pool, or two pairs with one destination, are refused.
pub fn copy_units(
    pairs: &[i64],
    unit: usize,
    row_bytes: usize,
    direction: Direction,
    layers: &mut [LayerSlabs<'_>],
) -> Result<()> {
    if pairs.len() % 2 != 0 {
        return invalid("pairs must have shape [n, 2]");
    }
    let bytes = unit * row_bytes;
    if bytes == 0 {
        return invalid("copies need a positive unit and row size");
    }
    let live = || pairs.chunks_exact(2).map(|p| (p[0], p[1])).filter(|&(g, h)| g >= 0 && h >= 0);
    for l in layers.iter() {
        for (g, h) in live() {
            // Compared in units, so a huge index cannot overflow into a passing bound.
            if g as u64 >= (l.gpu.len() / bytes) as u64 || h as u64 >= (l.host.len() / bytes) as u64 {
                return invalid(format!("copy pair ({g}, {h}) is outside the slab or the host pool"));
            }
        }
    }
    let mut destinations = std::collections::HashSet::new();
    for (g, h) in live() {
        let dst = if direction == Direction::DeviceToHost { h } else { g };
        if !destinations.insert(dst) {
            return invalid(format!("two copy pairs write unit {dst}: destinations must be distinct"));
        }
    }
    for l in layers.iter_mut() {
        for (g, h) in live() {
            let (g, h) = (g as usize * bytes, h as usize * bytes);
            match direction {
                Direction::DeviceToHost => l.host[h..h + bytes].copy_from_slice(&l.gpu[g..g + bytes]),
                Direction::HostToDevice => l.gpu[g..g + bytes].copy_from_slice(&l.host[h..h + bytes]),
            }
        }
    }
    Ok(())
}

/// `invalidate` of SPEC.md: pairs of (state row, position). Emptied slots take the stamp one below the
/// region's smallest (`lru_stamps::front`), so they come first, ascending by slot.
pub fn invalidate(geo: &Geometry, hot_pos: &mut [i32], hot_stamp: &mut [i64], pairs: &[i32]) -> Result<()> {
    let h = geo.hot_rows;
    if h == 0 || geo.groups == 0 || hot_pos.len() % (geo.groups * h) != 0 {
        return invalid("hot_pos must be [rows, groups, hot_rows] with groups and hot_rows positive");
    }
    let rows = hot_pos.len() / (geo.groups * h);
    check_len("hot_stamp", hot_stamp.len(), hot_pos.len())?;
    if pairs.len() % 2 != 0 {
        return invalid("pairs must have shape [n, 2]");
    }
    if let Some(p) = pairs.chunks_exact(2).find(|p| p[0] >= rows as i32) {
        return invalid(format!("state row {} is outside 0..{rows}", p[0]));
    }
    for r in 0..rows {
        let targets: std::collections::HashSet<i32> =
            pairs.chunks_exact(2).filter(|p| p[0] == r as i32 && p[1] >= 0).map(|p| p[1]).collect();
        if targets.is_empty() {
            continue;
        }
        for g in 0..geo.groups {
            let base = (r * geo.groups + g) * h;
            let stamps = &mut hot_stamp[base..base + h];
            let front = lru_stamps::front(stamps);
            for (slot, pos) in hot_pos[base..base + h].iter_mut().enumerate() {
                if targets.contains(pos) {
                    *pos = -1;
                    stamps[slot] = front;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "reference_tests.rs"]
mod tests;
