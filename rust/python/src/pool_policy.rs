//! `hisparse._core.PoolPolicy`: the binding of `hisparse_core::pool_policy` (release and reuse order over a
//! block pool that vLLM owns). Conversions only; the orders are decided in the core.

use std::sync::Mutex;

use hisparse_core::pool_policy::{self, PoolPolicy as CorePoolPolicy};
use hisparse_core::HeatSummary;
use pyo3::prelude::*;

use crate::errors::PyResultExt;

/// A listed request's free-queue moves: (request id, pages to the front, pages to the back).
type Moves = (String, Vec<u32>, Vec<u32>);

/// Per-request selection heat, and the release order and free-queue moves derived from it.
#[pyclass(frozen, module = "hisparse._core")]
pub struct PoolPolicy {
    inner: Mutex<CorePoolPolicy>,
}

impl PoolPolicy {
    fn with<R>(&self, f: impl FnOnce(&mut CorePoolPolicy) -> R) -> R {
        // A panic inside the core would poison the lock; the state it guards is still consistent
        // (every method either completes or changes nothing), so keep serving.
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut guard)
    }
}

#[pymethods]
impl PoolPolicy {
    #[new]
    fn new() -> Self {
        Self { inner: Mutex::new(CorePoolPolicy::new()) }
    }

    /// Takes an encoded heat summary from vLLM's worker (``heat.HeatReport``): its request ``i`` is
    /// ``request_ids[i]``, and each request it lists replaces what was known of it; ``hottest``: how many
    /// hottest pages the worker asked for per request. Returns, per listed request, ``(request_id, front,
    /// back)``: its listed pages never selected (to move to the front of the free queue) and its selected
    /// pages to move to the back, each in release order. A malformed summary, or one naming a request past
    /// ``request_ids``, changes nothing.
    fn report(
        &self,
        py: Python<'_>,
        summary: &Bound<'_, PyAny>,
        request_ids: Vec<String>,
        hottest: usize,
    ) -> PyResult<Vec<Moves>> {
        let raw = crate::args::bytes(summary, "summary")?;
        let summary = py.detach(|| HeatSummary::decode(&raw)).py()?;
        let moves = self.with(|p| p.report(&summary, &request_ids, hottest)).py()?;
        Ok(moves.into_iter().map(|m| (request_ids[m.request].clone(), m.front, m.back)).collect())
    }

    /// ``pages`` in the order to release them: the last summary's coldest, then the pages it did not list
    /// (oldest first), then its hottest; without a summary, oldest first.
    fn release_order(&self, request: &str, mut pages: Vec<u32>) -> Vec<u32> {
        self.with(|p| p.release_order(request, &mut pages));
        pages
    }

    /// Forgets a request.
    fn forget(&self, request: &str) {
        self.with(|p| p.forget(request));
    }

    fn __len__(&self) -> usize {
        self.with(|p| p.len())
    }

    /// Whether releasing ``releasable_pages`` pages of ``blocks_per_page`` blocks frees more than the
    /// ``hot_blocks`` a hot region costs.
    #[staticmethod]
    fn worth_transition(releasable_pages: usize, blocks_per_page: usize, hot_blocks: usize) -> bool {
        pool_policy::worth_transition(releasable_pages, blocks_per_page, hot_blocks)
    }
}
