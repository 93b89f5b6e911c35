//! `ResidencyManager`: the core's manager behind a mutex, safe to share between threads.
//!
//! Every call converts and checks its arguments with the GIL held, then releases the GIL and takes the
//! lock (detach, then lock: a thread waiting for the lock never holds the GIL, so it cannot deadlock with
//! one that needs the GIL). Calls from several threads are serialized; read-only ones (`stats`,
//! `capacity_log`, `request_info`...) wait for a mutating call to finish instead of failing.

use std::sync::Mutex;

use hisparse_core::manager::RequestInfo;
use hisparse_core::{CoreError, HeatSummary, Options, PressurePolicy};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args::{self, Hash};
use crate::errors::{to_pyerr, PyResultExt};
use crate::plan::StepPlan;

type Core = hisparse_core::ResidencyManager;

/// What `admit` and `resume` return.
#[pyclass(frozen, get_all, module = "hisparse._core")]
pub struct Admission {
    row: u32,
    cached_tokens: u32,
    residency: &'static str,
    restored_pages: u32,
}

#[pymethods]
impl Admission {
    fn __repr__(&self) -> String {
        format!(
            "Admission(row={}, cached_tokens={}, residency={:?}, restored_pages={})",
            self.row, self.cached_tokens, self.residency, self.restored_pages
        )
    }
}

impl From<hisparse_core::Admission> for Admission {
    fn from(a: hisparse_core::Admission) -> Self {
        Admission {
            row: a.row,
            cached_tokens: a.cached_tokens,
            residency: a.residency.name(),
            restored_pages: a.restored_pages,
        }
    }
}

/// The scheduler-side residency manager (see the core's `ResidencyManager`). One instance may be shared
/// by threads: calls are serialized, and none fails because another is running.
#[pyclass(frozen, module = "hisparse._core")]
pub struct ResidencyManager {
    inner: Mutex<Core>,
}

impl ResidencyManager {
    /// Runs `f` on the core with the GIL released and the lock held.
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Core) -> hisparse_core::Result<R> + Send,
    ) -> PyResult<R> {
        py.detach(|| match self.inner.lock() {
            Ok(mut core) => f(&mut core),
            Err(_) => Err(CoreError::Invariant(
                "an earlier call panicked inside the manager; build a new one".into(),
            )),
        })
        .map_err(to_pyerr)
    }
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
    /// Validates the configuration and builds an empty manager. Give exactly one of `num_host_blocks` and
    /// `host_pool_gib` (with `page_bytes`). Defaults: `hot_rows` 2 x top_k, or (q + 1) x top_k with q
    /// speculative tokens; `watermark` one hot region or a tenth of the pool, whichever is larger;
    /// `admission_pages` (the resident pages admission reserves for a request, vLLM's
    /// `max_admission_blocks_per_request`) 0: none. A request that never fills it comes back from the host
    /// restored whole when its blocks are free, instead of reading its history through a hot region.
    #[new]
    #[pyo3(signature = (
        *, num_gpu_blocks, max_model_len, block_size = None, num_host_blocks = None, host_pool_gib = None,
        page_bytes = None, max_running = None, top_k = None, hot_rows = None, speculative_tokens = None,
        num_index_groups = None, tail_pages = None, watermark = None, policy = None, materialize_budget = None,
        admission_pages = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_gpu_blocks: &Bound<'_, PyAny>,
        max_model_len: &Bound<'_, PyAny>,
        block_size: Option<&Bound<'_, PyAny>>,
        num_host_blocks: Option<&Bound<'_, PyAny>>,
        host_pool_gib: Option<&Bound<'_, PyAny>>,
        page_bytes: Option<&Bound<'_, PyAny>>,
        max_running: Option<&Bound<'_, PyAny>>,
        top_k: Option<&Bound<'_, PyAny>>,
        hot_rows: Option<&Bound<'_, PyAny>>,
        speculative_tokens: Option<&Bound<'_, PyAny>>,
        num_index_groups: Option<&Bound<'_, PyAny>>,
        tail_pages: Option<&Bound<'_, PyAny>>,
        watermark: Option<&Bound<'_, PyAny>>,
        policy: Option<&Bound<'_, PyAny>>,
        materialize_budget: Option<&Bound<'_, PyAny>>,
        admission_pages: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let d = Options::default();
        let policy = match policy.filter(|p| !p.is_none()) {
            None => d.policy,
            Some(p) => {
                let name: String = p
                    .extract()
                    .map_err(|_| crate::errors::invalid(format!("policy must be a name, not {p}")))?;
                name.parse::<PressurePolicy>().py()?
            }
        };
        let options = Options {
            num_gpu_blocks: args::int(num_gpu_blocks, "num_gpu_blocks")?,
            max_model_len: args::int(max_model_len, "max_model_len")?,
            block_size: args::opt_int(block_size, "block_size")?.unwrap_or(d.block_size),
            num_host_blocks: args::opt_int(num_host_blocks, "num_host_blocks")?,
            host_pool_gib: host_pool_gib
                .filter(|v| !v.is_none())
                .map(|v| args::number(v, "host_pool_gib")) // its range is the configuration's to check
                .transpose()?,
            page_bytes: args::opt_int(page_bytes, "page_bytes")?.unwrap_or(d.page_bytes),
            max_running: args::opt_int(max_running, "max_running")?.unwrap_or(d.max_running),
            top_k: args::opt_int(top_k, "top_k")?.unwrap_or(d.top_k),
            hot_rows: args::opt_int(hot_rows, "hot_rows")?,
            speculative_tokens: args::opt_int(speculative_tokens, "speculative_tokens")?
                .unwrap_or(d.speculative_tokens),
            num_index_groups: args::opt_int(num_index_groups, "num_index_groups")?
                .unwrap_or(d.num_index_groups),
            tail_pages: args::opt_int(tail_pages, "tail_pages")?.unwrap_or(d.tail_pages),
            watermark: args::opt_int(watermark, "watermark")?,
            policy,
            materialize_budget: args::opt_int(materialize_budget, "materialize_budget")?
                .unwrap_or(d.materialize_budget),
            admission_pages: args::opt_int(admission_pages, "admission_pages")?.unwrap_or(d.admission_pages),
        };
        let cfg = options.build().py()?;
        Ok(ResidencyManager { inner: Mutex::new(Core::new(cfg).py()?) })
    }

    /// Admits a request of `prompt_len` tokens whose full pages hash to `prefix_hashes` (a chain: each
    /// page's hash covers everything before it; any int in -2**63..2**64). Pages found durably on the host
    /// are not computed again. Raises `CapacityError` (`.resource` says which) when it cannot be backed
    /// now; nothing changed then.
    #[pyo3(signature = (request_id, prompt_len, prefix_hashes = None, max_len = None))]
    fn admit(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        prompt_len: &Bound<'_, PyAny>,
        prefix_hashes: Option<&Bound<'_, PyAny>>,
        max_len: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Admission> {
        let id: u64 = args::int(request_id, "request_id")?;
        let prompt_len: u32 = args::int(prompt_len, "prompt_len")?;
        let hashes: Vec<u64> = match prefix_hashes.filter(|h| !h.is_none()) {
            Some(h) => args::ints::<Hash>(h, "prefix_hashes")?.into_iter().map(|h| h.0).collect(),
            None => Vec::new(),
        };
        let max_len: Option<u32> = args::opt_int(max_len, "max_len")?;
        self.with(py, |m| m.admit(id, prompt_len, &hashes, max_len)).map(Admission::from)
    }

    /// Brings a preempted request back from its kept host pages (no recomputation of them).
    fn resume(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<Admission> {
        let id: u64 = args::int(request_id, "request_id")?;
        self.with(py, |m| m.resume(id)).map(Admission::from)
    }

    /// Plans one step: `scheduled` is a sequence of (request_id, new_tokens). A short plan (`ok` False)
    /// changed nothing.
    fn plan_step(&self, py: Python<'_>, scheduled: &Bound<'_, PyAny>) -> PyResult<StepPlan> {
        let scheduled = args::pairs::<u64, u32>(scheduled, "scheduled", ("request_id", "new_tokens"))?;
        self.with(py, |m| m.plan_step(&scheduled)).map(StepPlan::from)
    }

    /// The plan that brings a rebuilt worker (no state of its own) to the current state: every row cleared
    /// and set again, copies in flight failed and started again under new ids; with `redo_last_step` (the
    /// last plan's results never came back) that plan's restores and scheduled tokens again.
    fn resync(&self, py: Python<'_>, redo_last_step: &Bound<'_, PyAny>) -> PyResult<StepPlan> {
        let redo = args::boolean(redo_last_step, "redo_last_step")?;
        self.with(py, |m| m.resync(redo)).map(StepPlan::from)
    }

    /// Ends copies to the host (`ok` False: they failed, the pages are copied again later). Unknown or
    /// repeated ids are refused and nothing changes.
    #[pyo3(signature = (transfer_ids, ok = None))]
    fn complete(
        &self,
        py: Python<'_>,
        transfer_ids: &Bound<'_, PyAny>,
        ok: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let ids: Vec<u64> = args::ints(transfer_ids, "transfer_ids")?;
        let ok = ok.map(|v| args::boolean(v, "ok")).transpose()?.unwrap_or(true);
        self.with(py, |m| m.complete(&ids, ok))
    }

    /// One worker report, atomically: `completed` and `failed` transfer ids and an encoded heat summary
    /// (`bytes` from `DataPath.heat_summary`, or None). A refused report changed nothing.
    #[pyo3(signature = (completed = None, failed = None, heat = None))]
    fn apply_results(
        &self,
        py: Python<'_>,
        completed: Option<&Bound<'_, PyAny>>,
        failed: Option<&Bound<'_, PyAny>>,
        heat: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let list = |v: Option<&Bound<'_, PyAny>>, name| -> PyResult<Vec<u64>> {
            v.filter(|v| !v.is_none()).map_or(Ok(Vec::new()), |v| args::ints(v, name))
        };
        let (completed, failed) = (list(completed, "completed")?, list(failed, "failed")?);
        let heat = match heat.filter(|h| !h.is_none()) {
            Some(h) => {
                let raw = args::bytes(h, "heat")?;
                py.detach(|| HeatSummary::decode(&raw)).py()?
            }
            None => HeatSummary::default(),
        };
        self.with(py, |m| m.apply_results(&completed, &failed, &heat))
    }

    /// Page hashes continuing the admission chain (e.g. for generated tokens), published once durable.
    fn add_page_hashes(
        &self,
        py: Python<'_>,
        request_id: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id: u64 = args::int(request_id, "request_id")?;
        let hashes: Vec<u64> = args::ints::<Hash>(hashes, "hashes")?.into_iter().map(|h| h.0).collect();
        self.with(py, |m| m.add_page_hashes(id, &hashes))
    }

    /// Ends a request (finished or aborted): every block and host reference it holds goes back.
    fn finish(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id: u64 = args::int(request_id, "request_id")?;
        self.with(py, |m| m.finish(id))
    }

    /// Stops a running request; returns the tokens kept on the host (`resume` continues from there).
    fn preempt(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id: u64 = args::int(request_id, "request_id")?;
        self.with(py, |m| m.preempt(id))
    }

    /// Recomputes every invariant from scratch; raises `InvariantError` naming the first one broken.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |m| m.check_invariants())
    }

    fn __contains__(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        // Membership of anything that is not a valid id is simply False.
        let Ok(id) = args::int::<u64>(request_id, "request_id") else { return Ok(false) };
        self.with(py, |m| Ok(m.contains(id)))
    }

    /// Every known request id (running and preempted), oldest first.
    fn request_ids(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.with(py, |m| Ok(m.request_ids()))
    }

    /// `row` (None when preempted), `seq_len`, `residency`, `num_pages`, `host_only_pages`,
    /// `released_pages`, `hot_blocks`.
    fn request_info<'py>(
        &self,
        py: Python<'py>,
        request_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let id: u64 = args::int(request_id, "request_id")?;
        let info = self.with(py, |m| m.request_info(id))?;
        info_dict(py, &info)
    }

    /// (gpu_block or 0, host_block or -1) per page.
    fn block_table(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, i32)>> {
        let id: u64 = args::int(request_id, "request_id")?;
        self.with(py, |m| m.block_table(id))
    }

    /// The state name of each page (`dirty`, `copying`, `clean`, `released`, `host_only`).
    fn page_states(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<&'static str>> {
        let id: u64 = args::int(request_id, "request_id")?;
        self.with(py, |m| m.page_states(id))
    }

    /// The GPU blocks of the request's hot region (empty when it holds none).
    fn hot_blocks(&self, py: Python<'_>, request_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let id: u64 = args::int(request_id, "request_id")?;
        self.with(py, |m| m.hot_blocks(id))
    }

    /// Pool and request counters (GPU blocks free/used/hot/released, host blocks, running requests by
    /// residency, totals of releases, losses, copies and restores).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, |m| Ok(m.stats()))?;
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

    /// One line for logs, in the spirit of vLLM's KV cache capacity line, host pool included.
    fn capacity_log(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |m| Ok(m.capacity_log()))
    }

    /// How many requests could run at once in steady state (tail + hot region each on the GPU).
    fn steady_state_concurrency(&self, py: Python<'_>) -> PyResult<u32> {
        self.with(py, |m| Ok(m.steady_state_concurrency()))
    }

    /// The validated configuration, defaults filled in.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.with(py, |m| Ok(m.config().clone()))?;
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
        d.set_item("admission_pages", c.admission_pages)?;
        Ok(d)
    }
}
