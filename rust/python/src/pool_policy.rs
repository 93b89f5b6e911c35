//! `hisparse._core.PoolPolicy`: the binding of `hisparse_core::pool_policy` (release and reuse order over a
//! block pool that vLLM owns, and the admission and transition decisions on vLLM's counts). Conversions
//! only; the orders and the decisions are made in the core.

use std::sync::Mutex;

use hisparse_core::pool_policy::{Admission, PoolPolicy as CorePoolPolicy, PoolShape, PoolState};
use hisparse_core::HeatSummary;
use pyo3::prelude::*;

use crate::errors::PyResultExt;

/// Per-request selection heat and the release order derived from it; and the
/// admission and transition decisions for a pool of the shape it was built with.
#[pyclass(frozen, module = "hisparse._core")]
pub struct PoolPolicy {
    inner: Mutex<CorePoolPolicy>,
    /// Set once at construction: the decisions on vLLM's counts (stateless, so read without the lock).
    shape: PoolShape,
}

impl PoolPolicy {
    fn with<R>(&self, f: impl FnOnce(&mut CorePoolPolicy) -> R) -> R {
        f(&mut crate::locked(&self.inner))
    }
}

#[pymethods]
impl PoolPolicy {
    /// The pool's shape, in blocks of vLLM's shared GPU pool: ``block_size`` (tokens per page),
    /// ``blocks_per_page`` (resident groups), ``hot_blocks`` (a hot region, every hot group's),
    /// ``admission_pages`` (vLLM's ``max_admission_blocks_per_request``), ``tail_pages`` (vLLM's
    /// ``ACTIVE_TAIL_PAGES``), ``low_watermark`` (its coordinator's ``transition_watermark``). All 0 by
    /// default: a policy that only orders releases.
    #[new]
    #[pyo3(signature = (*, block_size=0, blocks_per_page=0, hot_blocks=0, admission_pages=0, tail_pages=0,
                        low_watermark=0))]
    fn new(
        block_size: usize,
        blocks_per_page: usize,
        hot_blocks: usize,
        admission_pages: usize,
        tail_pages: usize,
        low_watermark: usize,
    ) -> Self {
        let shape =
            PoolShape { block_size, blocks_per_page, hot_blocks, admission_pages, tail_pages, low_watermark };
        Self { inner: Mutex::new(CorePoolPolicy::new()), shape }
    }

    /// Takes an encoded heat summary from vLLM's worker (``heat.HeatReport``): its request ``i`` is
    /// ``request_ids[i]``, and each request it lists replaces what was known of it (its release order). A
    /// malformed summary, or one naming a request past ``request_ids``, changes nothing.
    fn report(&self, py: Python<'_>, summary: &Bound<'_, PyAny>, request_ids: Vec<String>) -> PyResult<()> {
        let raw = crate::args::bytes(summary, "summary")?;
        let summary = py.detach(|| HeatSummary::decode(&raw)).py()?;
        self.with(|p| p.report(&summary, &request_ids)).py()
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

    /// Whether releasing ``releasable_pages`` pages frees more blocks than a hot region costs.
    fn worth_transition(&self, releasable_pages: usize) -> bool {
        self.shape.worth_transition(releasable_pages)
    }

    /// For a request not reading through a hot region yet: ``"take"`` one, ``"stay"`` as it is (the pool is
    /// not low), ``"declined"`` (low, but releasing its pages would not pay for the region) or
    /// ``"postponed"`` (the pool cannot grant the region and the next step's blocks without vLLM preempting
    /// someone). ``fills_window``: it holds the resident pages admission reserved for it;
    /// ``admission_waiting``: an admission was deferred this step (counts as a low pool);
    /// ``releasable_pages``: its pages outside the tail not released yet; ``next_blocks``: the blocks its
    /// next step allocates for new pages.
    fn transition(
        &self,
        fills_window: bool,
        free_blocks: usize,
        admission_waiting: bool,
        releasable_pages: usize,
        next_blocks: usize,
    ) -> &'static str {
        self.shape
            .transition(fills_window, free_blocks, admission_waiting, releasable_pages, next_blocks)
            .name()
    }

    /// Whether a request that never grows past ``longest_tokens`` can never be moved to a hot region.
    fn never_takes_hot_region(&self, longest_tokens: usize) -> bool {
        self.shape.never_takes_hot_region(longest_tokens)
    }

    /// Whether a waiting request of ``tokens`` (``computed_tokens`` of them a prefix hit, scheduled up to
    /// ``chunk_tokens`` a step, ``short``: never takes a hot region) may start in a pool of ``free_blocks``
    /// with ``running`` requests holding blocks (``reading_host`` of them through their hot regions),
    /// ``owed_hot_blocks`` still owed to hot regions asked for, and ``may_take_hot`` when a running request may
    /// still take one (``pool_policy.rs``).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (tokens, computed_tokens, chunk_tokens, short, *, free_blocks, running, reading_host,
                        owed_hot_blocks, may_take_hot))]
    fn has_headroom(
        &self,
        tokens: usize,
        computed_tokens: usize,
        chunk_tokens: usize,
        short: bool,
        free_blocks: usize,
        running: usize,
        reading_host: usize,
        owed_hot_blocks: usize,
        may_take_hot: bool,
    ) -> bool {
        let ask = Admission { tokens, computed_tokens, chunk_tokens, short };
        let pool = PoolState { free_blocks, running, reading_host, owed_hot_blocks, may_take_hot };
        self.shape.has_headroom(&ask, &pool)
    }
}
