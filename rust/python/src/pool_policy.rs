//! `hisparse._core.PoolPolicy`: the binding of `hisparse_core::pool_policy` (release and reuse order over a
//! block pool that vLLM owns). Conversions only; the orders are decided in the core.

use std::sync::Mutex;

use hisparse_core::pool_policy::{self, PoolPolicy as CorePoolPolicy};
use pyo3::prelude::*;

/// Per-request selection heat, and the release / refresh orders derived from it.
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

    /// Replaces a request's heat with a summary: ``pages[i]`` had ``heat[i]``, coldest first; ``full`` when
    /// the summary stopped at its size limit (unlisted pages are then hotter than every listed one).
    fn report(&self, request: &str, pages: Vec<u32>, heat: Vec<u32>, full: bool) -> PyResult<()> {
        if pages.len() != heat.len() {
            return Err(crate::errors::invalid(format!(
                "{} pages but {} heat values",
                pages.len(),
                heat.len()
            )));
        }
        self.with(|p| p.report(request, &pages, &heat, full));
        Ok(())
    }

    /// ``pages`` in the order to release them: coldest first, equal heat newest first.
    fn release_order(&self, request: &str, mut pages: Vec<u32>) -> Vec<u32> {
        self.with(|p| p.release_order(request, &mut pages));
        pages
    }

    /// The released pages the last summary saw selected, coldest first (to move to the free queue's tail).
    fn refresh_order(&self, request: &str, released: Vec<u32>) -> Vec<u32> {
        self.with(|p| p.refresh_order(request, &released))
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
