//! `hisparse._core`: a thin PyO3 layer over `hisparse-core`.
//!
//! Conversions and error mapping only; every decision lives in the core. Calls that do real work run with
//! the GIL released. Errors become the classes of `hisparse.errors` (defined in Python so they can also
//! derive from `ValueError` / `KeyError` where that is what they are).

mod pool_policy;

use std::slice;

use hisparse_core::manager::RequestInfo;
use hisparse_core::plan::StepPlan as CoreStepPlan;
use hisparse_core::reference::{self, Batch, Direction, Geometry, LayerSlabs, ResolveState};
use hisparse_core::{Config, CoreError, PressurePolicy, Resource};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn to_pyerr(e: CoreError) -> PyErr {
    Python::attach(|py| {
        let class = match &e {
            CoreError::Config(_) => "ConfigError",
            CoreError::Capacity { .. } => "CapacityError",
            CoreError::InvalidArgument(_) => "InvalidArgumentError",
            CoreError::UnknownRequest(_) => "UnknownRequestError",
            CoreError::Invariant(_) => "InvariantError",
        };
        let build = || -> PyResult<PyErr> {
            let cls = py.import("hisparse.errors")?.getattr(class)?;
            let err = cls.call1((e.to_string(),))?;
            match &e {
                CoreError::Capacity { resource, needed, available, .. } => {
                    let name = match resource {
                        Resource::GpuBlocks => "gpu",
                        Resource::HostBlocks => "host",
                        Resource::RequestSlots => "slots",
                    };
                    err.setattr("resource", name)?;
                    err.setattr("needed", *needed)?;
                    err.setattr("available", *available)?;
                }
                CoreError::UnknownRequest(id) => err.setattr("request_id", *id)?,
                _ => {}
            }
            Ok(PyErr::from_value(err))
        };
        build().unwrap_or_else(|import_err| {
            PyRuntimeError::new_err(format!("{e} (and hisparse.errors failed: {import_err})"))
        })
    })
}

/// Python ints are unbounded; a negative id or token count is a caller's mistake, not an overflow.
fn count(what: &str, v: i64) -> PyResult<u32> {
    u32::try_from(v)
        .map_err(|_| to_pyerr(CoreError::InvalidArgument(format!("{what} must be in 0..2^32, got {v}"))))
}

fn request(v: i64) -> PyResult<u64> {
    u64::try_from(v)
        .map_err(|_| to_pyerr(CoreError::InvalidArgument(format!("request ids are non-negative, got {v}"))))
}

trait PyResultExt<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> PyResultExt<T> for hisparse_core::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}

/// What `admit` and `resume` return.
#[pyclass(frozen, get_all, module = "hisparse._core")]
struct Admission {
    row: u32,
    cached_tokens: u32,
    residency: &'static str,
}

#[pymethods]
impl Admission {
    fn __repr__(&self) -> String {
        format!(
            "Admission(row={}, cached_tokens={}, residency={:?})",
            self.row, self.cached_tokens, self.residency
        )
    }
}

/// One step's plan. Lists are built on access, so a caller pays only for what it reads.
#[pyclass(frozen, module = "hisparse._core")]
struct StepPlan {
    inner: CoreStepPlan,
}

#[pymethods]
impl StepPlan {
    /// Blocks the step lacked even after releasing; 0 when the plan is good.
    #[getter]
    fn missing_blocks(&self) -> u32 {
        self.inner.missing_blocks
    }
    #[getter]
    fn ok(&self) -> bool {
        !self.inner.is_short()
    }
    #[getter]
    fn cleared_rows(&self) -> Vec<u32> {
        self.inner.cleared_rows.clone()
    }
    #[getter]
    fn seq_lens(&self) -> Vec<(u32, u32)> {
        self.inner.seq_lens.clone()
    }
    /// (row, page, gpu_block or 0, host_block or -1)
    #[getter]
    fn table_updates(&self) -> Vec<(u32, u32, u32, i32)> {
        self.inner.table_updates.iter().map(|u| (u.row, u.page, u.gpu_block, u.host_block)).collect()
    }
    /// (row, blocks); empty blocks: the row holds no hot region any more.
    #[getter]
    fn hot_updates(&self) -> Vec<(u32, Vec<u32>)> {
        self.inner.hot_updates.iter().map(|h| (h.row, h.blocks.clone())).collect()
    }
    /// (gpu_block, host_block) pages to copy host -> GPU before the forward.
    #[getter]
    fn restores(&self) -> Vec<(u32, u32)> {
        self.inner.restores.iter().map(|c| (c.gpu_block, c.host_block)).collect()
    }
    /// (transfer_id, gpu_block, host_block) pages to copy GPU -> host; report each through `complete`.
    #[getter]
    fn materialize(&self) -> Vec<(u64, u32, u32)> {
        self.inner.materialize.iter().map(|c| (c.transfer, c.gpu_block, c.host_block)).collect()
    }
    #[getter]
    fn transfer_ids(&self) -> Vec<u64> {
        self.inner.materialize.iter().map(|c| c.transfer).collect()
    }
    /// (request_id, from, to) residency changes.
    #[getter]
    fn transitions(&self) -> Vec<(u64, &'static str, &'static str)> {
        self.inner.transitions.iter().map(|t| (t.request, t.from.name(), t.to.name())).collect()
    }
    #[getter]
    fn released_pages(&self) -> u32 {
        self.inner.released_pages
    }
    #[getter]
    fn lost_pages(&self) -> u32 {
        self.inner.lost_pages
    }
    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "StepPlan(missing_blocks={}, table_updates={}, hot_updates={}, restores={}, materialize={}, released={}, lost={})",
            p.missing_blocks,
            p.table_updates.len(),
            p.hot_updates.len(),
            p.restores.len(),
            p.materialize.len(),
            p.released_pages,
            p.lost_pages
        )
    }
}

/// The scheduler-side residency manager. See `hisparse-core`'s `ResidencyManager`.
#[pyclass(module = "hisparse._core")]
struct ResidencyManager {
    inner: hisparse_core::ResidencyManager,
}

fn info_dict<'py>(py: Python<'py>, info: &RequestInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("row", info.row)?;
    d.set_item("seq_len", info.seq_len)?;
    d.set_item("residency", info.residency.name())?;
    d.set_item("num_pages", info.num_pages)?;
    d.set_item("host_only_pages", info.host_only_pages)?;
    d.set_item("released_pages", info.released_pages)?;
    d.set_item("hot_blocks", info.hot_blocks)?;
    Ok(d)
}

#[pymethods]
impl ResidencyManager {
    #[new]
    #[pyo3(signature = (
        *, num_gpu_blocks, block_size = 64, max_model_len, num_host_blocks = None, host_pool_gib = None,
        page_bytes = 0, max_running = 256, top_k = 2048, hot_rows = None, speculative_tokens = 0,
        num_index_groups = 1, tail_pages = 2, watermark = None, policy = "coldest", materialize_budget = 256
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_gpu_blocks: u32,
        block_size: u32,
        max_model_len: u32,
        num_host_blocks: Option<u32>,
        host_pool_gib: Option<f64>,
        page_bytes: u64,
        max_running: u32,
        top_k: u32,
        hot_rows: Option<u32>,
        speculative_tokens: u32,
        num_index_groups: u32,
        tail_pages: u32,
        watermark: Option<u32>,
        policy: &str,
        materialize_budget: u32,
    ) -> PyResult<Self> {
        let config_err = |m: String| to_pyerr(CoreError::Config(m));
        let num_host_blocks = match (num_host_blocks, host_pool_gib) {
            (Some(n), None) => n,
            (None, Some(gib)) if page_bytes > 0 && gib.is_finite() && gib > 0.0 => {
                let blocks = gib * (1u64 << 30) as f64 / page_bytes as f64;
                if blocks > u32::MAX as f64 {
                    return Err(config_err(format!("host_pool_gib {gib} is {blocks:.0} blocks: too many")));
                }
                blocks as u32
            }
            (None, Some(_)) => {
                return Err(config_err("host_pool_gib needs a positive page_bytes and size".into()))
            }
            _ => return Err(config_err("give exactly one of num_host_blocks and host_pool_gib".into())),
        };
        let hot_rows = match hot_rows {
            Some(rows) => rows,
            None => Config::default_hot_rows(top_k, speculative_tokens).py()?,
        };
        let policy = policy.parse::<PressurePolicy>().py()?;
        // Without tiers nobody leases a hot region, so it does not size the watermark.
        let hot_blocks = if policy.tiers() && block_size > 0 { hot_rows.div_ceil(block_size) } else { 0 };
        let cfg = Config {
            num_gpu_blocks,
            num_host_blocks,
            block_size,
            max_model_len,
            max_running,
            top_k,
            hot_rows,
            num_index_groups,
            tail_pages,
            watermark: watermark.unwrap_or_else(|| Config::default_watermark(num_gpu_blocks, hot_blocks)),
            policy,
            materialize_budget,
            page_bytes,
        };
        Ok(ResidencyManager { inner: hisparse_core::ResidencyManager::new(cfg).py()? })
    }

    #[pyo3(signature = (request_id, prompt_len, prefix_hashes = Vec::new(), max_len = None))]
    fn admit(
        &mut self,
        py: Python<'_>,
        request_id: i64,
        prompt_len: i64,
        prefix_hashes: Vec<u64>,
        max_len: Option<i64>,
    ) -> PyResult<Admission> {
        let (request_id, prompt_len) = (request(request_id)?, count("prompt_len", prompt_len)?);
        let max_len = max_len.map(|m| count("max_len", m)).transpose()?;
        let a = py.detach(|| self.inner.admit(request_id, prompt_len, &prefix_hashes, max_len)).py()?;
        Ok(Admission { row: a.row, cached_tokens: a.cached_tokens, residency: a.residency.name() })
    }

    fn resume(&mut self, py: Python<'_>, request_id: i64) -> PyResult<Admission> {
        let request_id = request(request_id)?;
        let a = py.detach(|| self.inner.resume(request_id)).py()?;
        Ok(Admission { row: a.row, cached_tokens: a.cached_tokens, residency: a.residency.name() })
    }

    /// `scheduled`: (request_id, new_tokens) pairs.
    fn plan_step(&mut self, py: Python<'_>, scheduled: Vec<(i64, i64)>) -> PyResult<StepPlan> {
        let scheduled = scheduled
            .into_iter()
            .map(|(id, tokens)| Ok((request(id)?, count("new token count", tokens)?)))
            .collect::<PyResult<Vec<_>>>()?;
        let inner = py.detach(|| self.inner.plan_step(&scheduled)).py()?;
        Ok(StepPlan { inner })
    }

    #[pyo3(signature = (transfer_ids, ok = true))]
    fn complete(&mut self, py: Python<'_>, transfer_ids: Vec<u64>, ok: bool) -> PyResult<()> {
        py.detach(|| self.inner.complete(&transfer_ids, ok)).py()
    }

    /// Page hashes continuing the admission chain (e.g. for generated tokens), published once durable.
    fn add_page_hashes(&mut self, py: Python<'_>, request_id: i64, hashes: Vec<u64>) -> PyResult<()> {
        let request_id = request(request_id)?;
        py.detach(|| self.inner.add_page_hashes(request_id, &hashes)).py()
    }

    /// `heat[i]` selections of page `pages[i]` since the last report (only pages that were selected).
    fn report_heat(
        &mut self,
        py: Python<'_>,
        request_id: i64,
        pages: Vec<u32>,
        heat: Vec<u32>,
    ) -> PyResult<()> {
        let request_id = request(request_id)?;
        py.detach(|| self.inner.report_heat(request_id, &pages, &heat)).py()
    }

    fn finish(&mut self, py: Python<'_>, request_id: i64) -> PyResult<()> {
        let request_id = request(request_id)?;
        py.detach(|| self.inner.finish(request_id)).py()
    }

    /// Returns the tokens kept on the host (resume continues from there).
    fn preempt(&mut self, py: Python<'_>, request_id: i64) -> PyResult<u32> {
        let request_id = request(request_id)?;
        py.detach(|| self.inner.preempt(request_id)).py()
    }

    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.check_invariants()).py()
    }

    fn __contains__(&self, request_id: i64) -> bool {
        u64::try_from(request_id).is_ok_and(|id| self.inner.contains(id))
    }

    fn request_ids(&self) -> Vec<u64> {
        self.inner.request_ids()
    }

    fn request_info<'py>(&self, py: Python<'py>, request_id: i64) -> PyResult<Bound<'py, PyDict>> {
        let request_id = request(request_id)?;
        info_dict(py, &self.inner.request_info(request_id).py()?)
    }

    /// (gpu_block or 0, host_block or -1) per page.
    fn block_table(&self, request_id: i64) -> PyResult<Vec<(u32, i32)>> {
        let request_id = request(request_id)?;
        self.inner.block_table(request_id).py()
    }

    fn page_states(&self, request_id: i64) -> PyResult<Vec<&'static str>> {
        let request_id = request(request_id)?;
        self.inner.page_states(request_id).py()
    }

    fn hot_blocks(&self, request_id: i64) -> PyResult<Vec<u32>> {
        let request_id = request(request_id)?;
        self.inner.hot_blocks(request_id).py()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        let items: [(&str, u64); 20] = [
            ("gpu_blocks", s.gpu_blocks as u64),
            ("gpu_free", s.gpu_free as u64),
            ("gpu_used", s.gpu_used as u64),
            ("gpu_hot", s.gpu_hot as u64),
            ("gpu_released", s.gpu_released as u64),
            ("host_blocks", s.host_blocks as u64),
            ("host_referenced", s.host_referenced as u64),
            ("host_cached", s.host_cached as u64),
            ("host_reserved", s.host_reserved),
            ("pending_transfers", s.pending_transfers as u64),
            ("running", s.running as u64),
            ("preempted", s.preempted as u64),
            ("full", s.full as u64),
            ("mixed", s.mixed as u64),
            ("none", s.none as u64),
            ("steady_state_concurrency", s.steady_state_concurrency as u64),
            ("total_released", s.total_released),
            ("total_lost", s.total_lost),
            ("total_materialized", s.total_materialized),
            ("total_restored", s.total_restored),
        ];
        for (k, v) in items {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    fn capacity_log(&self) -> String {
        self.inner.capacity_log()
    }

    fn steady_state_concurrency(&self) -> u32 {
        self.inner.steady_state_concurrency()
    }

    /// The validated configuration, defaults filled in.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.config();
        let d = PyDict::new(py);
        d.set_item("num_gpu_blocks", c.num_gpu_blocks)?;
        d.set_item("num_host_blocks", c.num_host_blocks)?;
        d.set_item("block_size", c.block_size)?;
        d.set_item("max_model_len", c.max_model_len)?;
        d.set_item("max_running", c.max_running)?;
        d.set_item("max_pages", c.max_pages())?;
        d.set_item("top_k", c.top_k)?;
        d.set_item("hot_rows", c.hot_rows)?;
        d.set_item("hot_blocks", c.hot_blocks())?;
        d.set_item("num_index_groups", c.num_index_groups)?;
        d.set_item("tail_pages", c.tail_pages)?;
        d.set_item("watermark", c.watermark)?;
        d.set_item("policy", c.policy.name())?;
        d.set_item("materialize_budget", c.materialize_budget)?;
        d.set_item("page_bytes", c.page_bytes)?;
        Ok(d)
    }
}

/// The CUDA sources, embedded so that a wheel carries exactly what `cuda/` holds.
const KERNEL_SOURCES: [(&str, &str); 3] = [
    ("common.cuh", include_str!("../../../cuda/common.cuh")),
    ("copy.cu", include_str!("../../../cuda/copy.cu")),
    ("resolve.cu", include_str!("../../../cuda/resolve.cu")),
];

#[pyfunction]
fn kernel_sources() -> Vec<(&'static str, &'static str)> {
    KERNEL_SOURCES.to_vec()
}

#[pyfunction]
#[pyo3(signature = (*, seq_len, block_size, hot_rows, tail_pages, groups))]
fn steady_state_blocks(seq_len: u64, block_size: u32, hot_rows: u32, tail_pages: u32, groups: u32) -> u64 {
    hisparse_core::steady_state_blocks(seq_len, block_size, hot_rows, tail_pages, groups)
}

// ------------------------------------------------------------------------------------------------------
// The CPU reference data path over raw buffers. `hisparse.datapath` checks every tensor's dtype, device,
// contiguity and shape before it calls these; the lengths below come from those checked shapes.

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

/// `state`: seq_lens, block_table, host_table, hot_blocks, hot_pos, hot_lru, heat, status, counters.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _ref_resolve(
    py: Python<'_>,
    geometry: (usize, usize, usize, usize, usize),
    state: [Buf; 9],
    topk: Buf,
    top_k: usize,
    row_state: Buf,
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
            hot_pos: view_mut(state[4]),
            hot_lru: view_mut(state[5]),
            heat: view_mut(state[6]),
            status: view_mut(state[7]),
            counters: view_mut(state[8]),
        };
        let mut layers = layer_views(&gpu_layers, &host_layers);
        let batch = Batch { topk: view(topk), top_k, row_state: view(row_state) };
        reference::resolve(&geo, &mut st, &batch, group, &mut layers, view_mut(out))
    })
    .py()
}

#[pyfunction]
fn _ref_gather(py: Python<'_>, row_ids: Buf, slab: Buf, row_bytes: usize, out: Buf) -> PyResult<()> {
    py.detach(|| unsafe { reference::gather(view(row_ids), view(slab), row_bytes, view_mut(out)) }).py()
}

/// `unit`: rows per pair element (1 for rows, block_size for whole blocks).
#[pyfunction]
fn _ref_copy(
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
fn _ref_invalidate(
    py: Python<'_>,
    geometry: (usize, usize, usize, usize, usize),
    hot_pos: Buf,
    hot_lru: Buf,
    pairs: Buf,
) -> PyResult<()> {
    let (block_size, pages, hot_rows, groups, row_bytes) = geometry;
    let geo = Geometry { block_size, pages, hot_rows, groups, row_bytes };
    py.detach(|| unsafe { reference::invalidate(&geo, view_mut(hot_pos), view_mut(hot_lru), view(pairs)) })
        .py()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ResidencyManager>()?;
    m.add_class::<StepPlan>()?;
    m.add_class::<Admission>()?;
    m.add_class::<pool_policy::PoolPolicy>()?;
    m.add_function(wrap_pyfunction!(steady_state_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_sources, m)?)?;
    m.add_function(wrap_pyfunction!(_ref_resolve, m)?)?;
    m.add_function(wrap_pyfunction!(_ref_gather, m)?)?;
    m.add_function(wrap_pyfunction!(_ref_copy, m)?)?;
    m.add_function(wrap_pyfunction!(_ref_invalidate, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
