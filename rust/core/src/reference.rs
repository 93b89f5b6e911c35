//! The CPU reference of the data path: `cuda/SPEC.md` as code. The CUDA kernels must match these
//! functions bit for bit (outputs, hot state, LRU order, counters, heat, copied bytes).
//!
//! Everything is validated before anything is written, so a bad input leaves every buffer as it was.

use std::collections::HashMap;

use crate::error::{invalid, Result};

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
    pub hot_pos: &'a mut [i32],
    pub hot_lru: &'a mut [i32],
    pub heat: &'a mut [i32],
    pub status: &'a mut [i32],
    pub counters: &'a mut [i64],
}

/// One layer's GPU slab and host pool, as rows of `row_bytes`.
pub struct LayerSlabs<'a> {
    pub gpu: &'a mut [u8],
    pub host: &'a mut [u8],
}

pub const STATUS_OVERFLOW: i32 = 1;
pub const STATUS_NO_HOST_COPY: i32 = 2;

/// What resolving one request will change, computed before anything is written.
struct RequestOutcome {
    row: usize,
    /// (flat output index, value) for every element of the request.
    outputs: Vec<(usize, i32)>,
    heat_pages: Vec<usize>,
    status: i32,
    /// New (hot_pos, hot_lru) rows, and (GPU row, host row) copies, when the request succeeds.
    hot: Option<(Vec<i32>, Vec<i32>)>,
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
        let s = self.seq_lens.len();
        let (p, g, h) = (geo.pages, geo.groups, geo.hot_rows);
        check_len("block_table", self.block_table.len(), s * p)?;
        check_len("host_table", self.host_table.len(), s * p)?;
        check_len("hot_blocks", self.hot_blocks.len(), s * geo.hot_blocks())?;
        check_len("hot_pos", self.hot_pos.len(), s * g * h)?;
        check_len("hot_lru", self.hot_lru.len(), s * g * h)?;
        check_len("heat", self.heat.len(), s * p)?;
        check_len("status", self.status.len(), s)?;
        check_len("counters", self.counters.len(), 3)?;
        if geo.block_size == 0 || geo.row_bytes == 0 || geo.row_bytes % 16 != 0 {
            return invalid(format!("row_bytes ({}) must be a positive multiple of 16", geo.row_bytes));
        }
        for (r, &len) in self.seq_lens.iter().enumerate() {
            if len < 0 || len as usize > p * geo.block_size {
                return invalid(format!("seq_lens[{r}] = {len} is outside 0..={}", p * geo.block_size));
            }
        }
        Ok(s)
    }
}

fn slab_rows(layers: &[LayerSlabs<'_>], geo: &Geometry) -> Result<(usize, usize)> {
    let Some(first) = layers.first() else {
        return Ok((0, 0));
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

/// One resolver launch's input: `topk` is `[rows, top_k]`, `row_state` `[rows]` (-1: padding row).
pub struct Batch<'a> {
    pub topk: &'a [i32],
    pub top_k: usize,
    pub row_state: &'a [i32],
}

/// `resolve` of SPEC.md for group `group`; `layers` are that group's layers (their hot rows are filled).
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
    // Batch rows of each request, requests in order of their first row.
    let mut by_state: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut index: HashMap<usize, usize> = HashMap::new();
    for (i, &r) in row_state.iter().enumerate() {
        if r < -1 || r >= s as i32 {
            return invalid(format!("row_state[{i}] = {r} is outside -1..{s}"));
        }
        if r >= 0 {
            let slot = *index.entry(r as usize).or_insert_with(|| {
                by_state.push((r as usize, Vec::new()));
                by_state.len() - 1
            });
            by_state[slot].1.push(i);
        }
    }
    let mut outcomes = Vec::with_capacity(by_state.len());
    for (r, batch_rows) in &by_state {
        outcomes.push(resolve_request(geo, st, topk, top_k, *r, batch_rows, group, gpu_rows, host_rows)?);
    }
    // Everything checked: write.
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
        let Some((pos, lru)) = o.hot else { continue };
        let base = (o.row * g + group) * h;
        st.hot_pos[base..base + h].copy_from_slice(&pos);
        st.hot_lru[base..base + h].copy_from_slice(&lru);
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

#[allow(clippy::too_many_arguments)]
fn resolve_request(
    geo: &Geometry,
    st: &ResolveState<'_>,
    topk: &[i32],
    top_k: usize,
    r: usize,
    batch_rows: &[usize],
    group: usize,
    gpu_rows: usize,
    host_rows: usize,
) -> Result<RequestOutcome> {
    let (bs, p, h) = (geo.block_size, geo.pages, geo.hot_rows);
    let seq_len = st.seq_lens[r] as i64;
    let mut outcome = RequestOutcome {
        row: r,
        outputs: Vec::new(),
        heat_pages: Vec::new(),
        status: 0,
        hot: None,
        copies: Vec::new(),
        hits: 0,
    };
    let mut seen: HashMap<i32, ()> = HashMap::new();
    let mut union: Vec<i32> = Vec::new();
    let mut unresolved: Vec<(usize, i32)> = Vec::new();
    for &i in batch_rows {
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
            if block != 0 {
                let row = block as usize * bs + off;
                if block < 0 || row >= gpu_rows {
                    return invalid(format!("block_table[{r}, {page}] = {block} is outside the GPU slab"));
                }
                outcome.outputs.push((flat, row as i32));
            } else {
                if first {
                    union.push(pos);
                }
                unresolved.push((flat, pos));
            }
        }
    }
    if union.is_empty() {
        return Ok(outcome);
    }
    let hb = geo.hot_blocks();
    let hot_blocks = &st.hot_blocks[r * hb..(r + 1) * hb];
    let fail = |outcome: &mut RequestOutcome, status: i32| {
        outcome.status |= status;
        outcome.outputs.extend(unresolved.iter().map(|&(flat, _)| (flat, -1)));
    };
    if union.len() > h || hot_blocks[0] == 0 {
        fail(&mut outcome, STATUS_OVERFLOW);
        return Ok(outcome);
    }
    for (i, &b) in hot_blocks.iter().enumerate() {
        if b <= 0 || (b as usize + 1) * bs > gpu_rows {
            return invalid(format!("hot_blocks[{r}, {i}] = {b} is outside the GPU slab"));
        }
    }
    let base = (r * geo.groups + group) * h;
    let hot_pos = &st.hot_pos[base..base + h];
    let hot_lru = &st.hot_lru[base..base + h];
    let mut slot_of: HashMap<i32, usize> = HashMap::with_capacity(h);
    for (slot, &pos) in hot_pos.iter().enumerate() {
        if pos >= 0 && slot_of.insert(pos, slot).is_some() {
            return invalid(format!("hot_pos[{r}, {group}] holds position {pos} twice"));
        }
    }
    let mut lru_seen = vec![false; h];
    for &slot in hot_lru {
        if slot < 0 || slot as usize >= h || std::mem::replace(&mut lru_seen[slot as usize], true) {
            return invalid(format!("hot_lru[{r}, {group}] is not a permutation of 0..{h}"));
        }
    }
    let misses: Vec<i32> = union.iter().copied().filter(|pos| !slot_of.contains_key(pos)).collect();
    let mut hosts = Vec::with_capacity(misses.len());
    for &pos in &misses {
        let (page, off) = (pos as usize / bs, pos as usize % bs);
        let hblock = st.host_table[r * p + page];
        if hblock < 0 {
            fail(&mut outcome, STATUS_NO_HOST_COPY);
            return Ok(outcome);
        }
        let row = hblock as usize * bs + off;
        if row >= host_rows {
            return invalid(format!("host_table[{r}, {page}] = {hblock} is outside the host pool"));
        }
        hosts.push(row);
    }
    let hit_slots: std::collections::HashSet<usize> =
        union.iter().filter_map(|pos| slot_of.get(pos).copied()).collect();
    let evictable: Vec<usize> =
        hot_lru.iter().map(|&s| s as usize).filter(|s| !hit_slots.contains(s)).collect();
    let hot_row = |slot: usize| hot_blocks[slot / bs] as usize * bs + slot % bs;
    let mut new_pos = hot_pos.to_vec();
    for (k, &pos) in misses.iter().enumerate() {
        let slot = evictable[k];
        if let Some(&old) = hot_pos.get(slot).filter(|&&old| old >= 0) {
            slot_of.remove(&old);
        }
        new_pos[slot] = pos;
        slot_of.insert(pos, slot);
        outcome.copies.push((hot_row(slot), hosts[k]));
    }
    let mut new_lru: Vec<i32> = evictable[misses.len()..].iter().map(|&s| s as i32).collect();
    new_lru.extend(union.iter().map(|pos| slot_of[pos] as i32));
    outcome.outputs.extend(unresolved.iter().map(|&(flat, pos)| (flat, hot_row(slot_of[&pos]) as i32)));
    outcome.hits = (union.len() - misses.len()) as i64;
    outcome.hot = Some((new_pos, new_lru));
    Ok(outcome)
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
/// indices in units of `unit` rows, for every layer; pairs with a negative entry are skipped.
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
    for l in layers.iter() {
        for pair in pairs.chunks_exact(2) {
            let (g, h) = (pair[0], pair[1]);
            if g < 0 || h < 0 {
                continue;
            }
            // Compared in units, so a huge index cannot overflow into a passing bound.
            if g as u64 >= (l.gpu.len() / bytes) as u64 || h as u64 >= (l.host.len() / bytes) as u64 {
                return invalid(format!("copy pair ({g}, {h}) is outside the slab or the host pool"));
            }
        }
    }
    for l in layers.iter_mut() {
        for pair in pairs.chunks_exact(2) {
            let (g, h) = (pair[0], pair[1]);
            if g < 0 || h < 0 {
                continue;
            }
            let (g, h) = (g as usize * bytes, h as usize * bytes);
            match direction {
                Direction::DeviceToHost => l.host[h..h + bytes].copy_from_slice(&l.gpu[g..g + bytes]),
                Direction::HostToDevice => l.gpu[g..g + bytes].copy_from_slice(&l.host[h..h + bytes]),
            }
        }
    }
    Ok(())
}

/// `invalidate` of SPEC.md: pairs of (state row, position).
pub fn invalidate(geo: &Geometry, hot_pos: &mut [i32], hot_lru: &mut [i32], pairs: &[i32]) -> Result<()> {
    let h = geo.hot_rows;
    let rows = hot_pos.len() / (geo.groups * h).max(1);
    check_len("hot_lru", hot_lru.len(), hot_pos.len())?;
    if pairs.len() % 2 != 0 {
        return invalid("pairs must have shape [n, 2]");
    }
    if let Some(p) = pairs.chunks_exact(2).find(|p| p[0] >= rows as i32) {
        return invalid(format!("state row {} is outside 0..{rows}", p[0]));
    }
    for r in 0..rows {
        let targets: Vec<i32> = pairs.chunks_exact(2).filter(|p| p[0] == r as i32).map(|p| p[1]).collect();
        if targets.is_empty() {
            continue;
        }
        for g in 0..geo.groups {
            let base = (r * geo.groups + g) * h;
            let pos = &mut hot_pos[base..base + h];
            let mut emptied = Vec::new();
            for &t in &targets {
                if let Some(slot) = pos.iter().position(|&p| p == t && t >= 0) {
                    pos[slot] = -1;
                    emptied.push(slot as i32);
                }
            }
            if emptied.is_empty() {
                continue;
            }
            let lru = &mut hot_lru[base..base + h];
            let rest: Vec<i32> = lru.iter().copied().filter(|s| !emptied.contains(s)).collect();
            lru[..emptied.len()].copy_from_slice(&emptied);
            lru[emptied.len()..].copy_from_slice(&rest);
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "reference_tests.rs"]
mod tests;
