//! The CPU reference data path over raw buffers. `hisparse.datapath` checks every tensor's dtype, device,
//! contiguity and shape before it calls these; the lengths below come from those checked shapes.

use std::slice;

use hisparse_core::heat::{self, HeatTables};
use hisparse_core::reference::{self, Batch, Direction, Geometry, LayerSlabs, ResolveState};
use hisparse_core::worker::{self, WorkerGeometry, WorkerState};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

use crate::errors::PyResultExt;
use crate::plan::StepPlan;

/// A buffer as (address, length in elements).
type Buf = (usize, usize);

unsafe fn view<'a, T>(b: Buf) -> &'a [T] {
    if b.1 == 0 {
        &[]
    } else {
        slice::from_raw_parts(b.0 as *const T, b.1)
    }
}

unsafe fn view_mut<'a, T>(b: Buf) -> &'a mut [T] {
    if b.1 == 0 {
        &mut []
    } else {
        slice::from_raw_parts_mut(b.0 as *mut T, b.1)
    }
}

unsafe fn layer_views<'a>(gpu: &[Buf], host: &[Buf]) -> Vec<LayerSlabs<'a>> {
    gpu.iter().zip(host).map(|(&g, &h)| LayerSlabs { gpu: view_mut(g), host: view_mut(h) }).collect()
}

/// `state`: seq_lens, block_table, host_table, hot_blocks, hot_pos, hot_stamp, hot_clock, heat, status, counters;
/// `resident`: `[S]` flags, or (0, 0) for none.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn _ref_resolve(
    py: Python<'_>,
    geometry: (usize, usize, usize, usize, usize),
    state: [Buf; 10],
    topk: Buf,
    top_k: usize,
    row_state: Buf,
    resident: Buf,
    group: usize,
    gpu_layers: Vec<Buf>,
    host_layers: Vec<Buf>,
    out: Buf,
) -> PyResult<()> {
    let (block_size, pages, hot_rows, groups, row_bytes) = geometry;
    let geo = Geometry { block_size, pages, hot_rows, groups, row_bytes };
    py.detach(|| unsafe {
        let mut st = ResolveState {
            seq_lens: view(state[0]),
            block_table: view(state[1]),
            host_table: view(state[2]),
            hot_blocks: view(state[3]),
            resident: view(resident),
            hot_pos: view_mut(state[4]),
            hot_stamp: view_mut(state[5]),
            hot_clock: view_mut(state[6]),
            heat: view_mut(state[7]),
            status: view_mut(state[8]),
            counters: view_mut(state[9]),
        };
        let mut layers = layer_views(&gpu_layers, &host_layers);
        let batch = Batch { topk: view(topk), top_k, row_state: view(row_state) };
        reference::resolve(&geo, &mut st, &batch, group, &mut layers, view_mut(out))
    })
    .py()
}

#[pyfunction]
pub fn _ref_gather(py: Python<'_>, row_ids: Buf, slab: Buf, row_bytes: usize, out: Buf) -> PyResult<()> {
    py.detach(|| unsafe { reference::gather(view(row_ids), view(slab), row_bytes, view_mut(out)) }).py()
}

/// `unit`: rows per pair element (1 for rows, block_size for whole blocks).
#[pyfunction]
pub fn _ref_copy(
    py: Python<'_>,
    pairs: Buf,
    unit: usize,
    row_bytes: usize,
    to_host: bool,
    gpu_layers: Vec<Buf>,
    host_layers: Vec<Buf>,
) -> PyResult<()> {
    let direction = if to_host { Direction::DeviceToHost } else { Direction::HostToDevice };
    py.detach(|| unsafe {
        let mut layers = layer_views(&gpu_layers, &host_layers);
        reference::copy_units(view(pairs), unit, row_bytes, direction, &mut layers)
    })
    .py()
}

#[pyfunction]
pub fn _ref_invalidate(
    py: Python<'_>,
    geometry: (usize, usize, usize, usize, usize),
    hot_pos: Buf,
    hot_stamp: Buf,
    pairs: Buf,
) -> PyResult<()> {
    let (block_size, pages, hot_rows, groups, row_bytes) = geometry;
    let geo = Geometry { block_size, pages, hot_rows, groups, row_bytes };
    py.detach(|| unsafe { reference::invalidate(&geo, view_mut(hot_pos), view_mut(hot_stamp), view(pairs)) })
        .py()
}

/// What `_ref_apply` writes, checked once by `hisparse.datapath` and kept for as long as the tensors are:
/// `apply` runs every step, and converting a dozen (address, length) pairs from Python each time would
/// cost more than applying a decode step's plan. `state`: seq_lens, block_table, host_table, releasable,
/// row_request, hot_blocks, hot_pos, hot_stamp, hot_clock, heat, status. `geometry`: (pages, block_size, groups,
/// hot_rows, row_bytes).
#[pyclass(frozen, module = "hisparse._core")]
pub struct ApplyBuffers {
    geo: WorkerGeometry,
    state: [Buf; 12],
    gpu: Vec<Buf>,
    host: Vec<Buf>,
}

#[pymethods]
impl ApplyBuffers {
    #[new]
    fn new(
        geometry: (usize, usize, usize, usize, usize),
        state: [Buf; 12],
        gpu: Vec<Buf>,
        host: Vec<Buf>,
    ) -> Self {
        let (pages, block_size, groups, hot_rows, row_bytes) = geometry;
        ApplyBuffers {
            geo: WorkerGeometry { pages, block_size, groups, hot_rows, row_bytes },
            state,
            gpu,
            host,
        }
    }
}

#[pyfunction]
/// Applies the plan; returns its slot mapping (i64 GPU rows, little-endian), or None when some token it
/// schedules has no resident page (`_ref_slot_mapping` then says which).
pub fn _ref_apply<'py>(
    py: Python<'py>,
    plan: &Bound<'py, StepPlan>,
    buffers: &Bound<'py, ApplyBuffers>,
) -> PyResult<Option<Bound<'py, PyByteArray>>> {
    let plan = &plan.get().inner;
    let ApplyBuffers { geo, state, gpu: gpu_layers, host: host_layers } = buffers.get();
    let slots = py
        .detach(|| unsafe {
            let mut st = WorkerState {
                seq_lens: view_mut(state[0]),
                block_table: view_mut(state[1]),
                host_table: view_mut(state[2]),
                releasable: view_mut(state[3]),
                row_request: view_mut(state[4]),
                resident: view_mut(state[5]),
                hot_blocks: view_mut(state[6]),
                hot_pos: view_mut(state[7]),
                hot_stamp: view_mut(state[8]),
                hot_clock: view_mut(state[9]),
                heat: view_mut(state[10]),
                status: view_mut(state[11]),
            };
            let mut layers = layer_views(gpu_layers, host_layers);
            worker::apply_plan(plan, geo, &mut st, &mut layers)?;
            Ok(worker::slot_mapping(plan, st.block_table, geo.pages, geo.block_size).ok())
        })
        .py()?;
    Ok(slots.map(|s| PyByteArray::new(py, &s.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())))
}

/// `tables`: seq_lens, releasable, row_request, heat. Returns the encoded summary.
#[pyfunction]
pub fn _ref_heat_summary<'py>(
    py: Python<'py>,
    tables: [Buf; 4],
    pages: usize,
    block_size: usize,
    coldest: usize,
    hottest: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let encoded = py
        .detach(|| unsafe {
            let mut t = HeatTables {
                seq_lens: view(tables[0]),
                releasable: view(tables[1]),
                row_request: view(tables[2]),
                heat: view_mut(tables[3]),
            };
            heat::summarize(&mut t, pages, block_size, coldest, hottest).map(|s| s.encode())
        })
        .py()?;
    Ok(PyBytes::new(py, &encoded))
}

/// `bufs`: cold keys [S, coldest] i64, cold counts [S] i64, hot keys [S, hottest] i64 (hottest first), hot
/// counts [S] i64, `row_request` [S] i64, `seq_lens` [S] i32: see `heat::from_ranked_keys`. Returns the
/// encoded summary.
#[pyfunction]
pub fn _encode_heat_summary<'py>(
    py: Python<'py>,
    bufs: [Buf; 6],
    pages: usize,
    coldest: usize,
    hottest: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let encoded = py
        .detach(|| unsafe {
            let keys = heat::RankedKeys {
                cold_keys: view(bufs[0]),
                cold_counts: view(bufs[1]),
                hot_keys: view(bufs[2]),
                hot_counts: view(bufs[3]),
                row_request: view(bufs[4]),
                seq_lens: view(bufs[5]),
            };
            heat::from_ranked_keys(&keys, pages, coldest, hottest).map(|s| s.encode())
        })
        .py()?;
    Ok(PyBytes::new(py, &encoded))
}

/// The plan's slot mapping from an applied `block_table` ([S, P] i32): i64 GPU rows, little-endian.
#[pyfunction]
pub fn _ref_slot_mapping<'py>(
    py: Python<'py>,
    plan: &Bound<'py, StepPlan>,
    block_table: Buf,
    pages: usize,
    block_size: usize,
) -> PyResult<Bound<'py, PyByteArray>> {
    let plan = &plan.get().inner;
    let slots =
        py.detach(|| unsafe { worker::slot_mapping(plan, view(block_table), pages, block_size) }).py()?;
    let bytes: Vec<u8> = slots.iter().flat_map(|s| s.to_le_bytes()).collect();
    Ok(PyByteArray::new(py, &bytes))
}

/// Checks a plan against a worker's geometry without applying it (the device path's host-side check).
#[pyfunction]
pub fn _check_plan(
    py: Python<'_>,
    plan: &Bound<'_, StepPlan>,
    geometry: (usize, usize, usize, usize, usize),
    rows: usize,
    gpu_blocks: usize,
    host_blocks: usize,
) -> PyResult<()> {
    let (pages, block_size, groups, hot_rows, row_bytes) = geometry;
    let geo = WorkerGeometry { pages, block_size, groups, hot_rows, row_bytes };
    let plan = &plan.get().inner;
    py.detach(|| worker::check_plan(plan, rows, &geo, gpu_blocks, host_blocks)).py()
}

/// One request's ranking in a heat summary: (request_id, coldest [(heat, page), ...], hottest [...]).
type Ranking = (u64, Vec<(u32, u32)>, Vec<(u32, u32)>);

/// The entries of an encoded heat summary, for tests and logs.
#[pyfunction]
pub fn decode_heat_summary(data: &Bound<'_, PyAny>) -> PyResult<Vec<Ranking>> {
    let raw = crate::args::bytes(data, "data")?;
    let s = heat::HeatSummary::decode(&raw).py()?;
    Ok(s.requests
        .iter()
        .enumerate()
        .map(|(i, &id)| (id, s.coldest(i).collect(), s.hottest(i).collect()))
        .collect())
}
