//! `hisparse._core.PoolPolicy`: the binding of `hisparse_core::pool_policy` (release and reuse order over a
//! block pool that vLLM owns, and the admission and transition decisions on vLLM's counts). Conversions
//! only; the orders and the decisions are made in the core.

use std::sync::Mutex;

use hisparse_core::pool_policy::{
    Admission, AdmissionPass, PoolPolicy as CorePoolPolicy, PoolShape, PoolState,
};
use hisparse_core::HeatSummary;
use pyo3::prelude::*;

use crate::args::{boolean, bytes, int, ints, opt_int, strings};
use crate::errors::PyResultExt;

/// Per-request selection heat and the release order derived from it; and the
/// admission and transition decisions for a pool of the shape it was built with.
#[pyclass(frozen, module = "hisparse._core")]
pub struct PoolPolicy {
    inner: Mutex<CorePoolPolicy>,
    /// Set once at construction: the decisions on vLLM's counts (stateless, so read without the lock).
    shape: PoolShape,
    /// The current schedule pass's admissions.
    admissions: Mutex<AdmissionPass>,
}

impl PoolPolicy {
    fn with<R>(&self, f: impl FnOnce(&mut CorePoolPolicy) -> R) -> R {
        f(&mut crate::locked(&self.inner))
    }

    fn pass<R>(&self, f: impl FnOnce(&mut AdmissionPass) -> R) -> R {
        f(&mut crate::locked(&self.admissions))
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
    #[pyo3(signature = (*, block_size=None, blocks_per_page=None, hot_blocks=None, admission_pages=None,
                        tail_pages=None, low_watermark=None))]
    fn new(
        block_size: Option<&Bound<'_, PyAny>>,
        blocks_per_page: Option<&Bound<'_, PyAny>>,
        hot_blocks: Option<&Bound<'_, PyAny>>,
        admission_pages: Option<&Bound<'_, PyAny>>,
        tail_pages: Option<&Bound<'_, PyAny>>,
        low_watermark: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let count = |v, name| opt_int::<usize>(v, name).map(Option::unwrap_or_default);
        let shape = PoolShape {
            block_size: count(block_size, "block_size")?,
            blocks_per_page: count(blocks_per_page, "blocks_per_page")?,
            hot_blocks: count(hot_blocks, "hot_blocks")?,
            admission_pages: count(admission_pages, "admission_pages")?,
            tail_pages: count(tail_pages, "tail_pages")?,
            low_watermark: count(low_watermark, "low_watermark")?,
        };
        Ok(Self { inner: Mutex::new(CorePoolPolicy::new()), shape, admissions: Mutex::default() })
    }

    /// Takes an encoded heat summary from vLLM's worker (``heat.HeatReport``): its request ``i`` is
    /// ``request_ids[i]``, and each request it lists replaces what was known of it (its release order). A
    /// malformed summary, or one naming a request past ``request_ids``, changes nothing.
    fn report(
        &self,
        py: Python<'_>,
        summary: &Bound<'_, PyAny>,
        request_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let raw = bytes(summary, "summary")?;
        let request_ids = strings(request_ids, "request_ids")?;
        let summary = py.detach(|| HeatSummary::decode(&raw)).py()?;
        self.with(|p| p.report(&summary, &request_ids)).py()
    }

    /// ``pages`` in the order to release them: the last summary's coldest, then the pages it did not list
    /// (oldest first), then its hottest; without a summary, oldest first.
    fn release_order(&self, request: &str, pages: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let mut pages = ints::<u32>(pages, "pages")?;
        self.with(|p| p.release_order(request, &mut pages));
        Ok(pages)
    }

    /// Forgets a request.
    fn forget(&self, request: &str) {
        self.with(|p| p.forget(request));
    }

    fn __len__(&self) -> usize {
        self.with(|p| p.len())
    }

    /// Whether releasing ``releasable_pages`` pages frees more blocks than a hot region costs.
    fn worth_transition(&self, releasable_pages: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.shape.worth_transition(int(releasable_pages, "releasable_pages")?))
    }

    /// For a request not reading through a hot region yet: ``"take"`` one, ``"stay"`` as it is (the pool is
    /// not low, and no admission was refused in this schedule pass), ``"declined"`` (low, but releasing its
    /// pages would not pay for the region) or ``"postponed"`` (the pool cannot grant the region and the next
    /// step's blocks without vLLM preempting someone). ``fills_window``: it holds the resident pages
    /// admission reserved for it; ``row_pages``: its rows' length, ``released_pages`` of them released
    /// already; ``step_end``: its tokens computed once this step has run, ``tokens_left`` past them, and
    /// ``chunk_tokens`` the most a step schedules (0: no limit), which set its next step's growth;
    /// ``longest_tokens``: the most tokens it can reach (None: unbounded), so that one that never takes a
    /// region is not moved when its window fills.
    #[allow(clippy::too_many_arguments)]
    fn transition(
        &self,
        fills_window: &Bound<'_, PyAny>,
        free_blocks: &Bound<'_, PyAny>,
        row_pages: &Bound<'_, PyAny>,
        released_pages: &Bound<'_, PyAny>,
        step_end: &Bound<'_, PyAny>,
        tokens_left: &Bound<'_, PyAny>,
        chunk_tokens: &Bound<'_, PyAny>,
        longest_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<&'static str> {
        let shape = &self.shape;
        let (fills_window, free_blocks) =
            (boolean(fills_window, "fills_window")?, int(free_blocks, "free_blocks")?);
        let releasable =
            shape.releasable_pages(int(row_pages, "row_pages")?, int(released_pages, "released_pages")?);
        let next_blocks = shape.next_step_blocks(
            int(step_end, "step_end")?,
            int(tokens_left, "tokens_left")?,
            int(chunk_tokens, "chunk_tokens")?,
        );
        let longest_tokens = opt_int(Some(longest_tokens), "longest_tokens")?;
        let decision = self.pass(|p| {
            p.transition(shape, fills_window, free_blocks, releasable, next_blocks, longest_tokens)
        });
        Ok(decision.name())
    }

    /// Whether a request that never grows past ``longest_tokens`` can never be moved to a hot region.
    fn never_takes_hot_region(&self, longest_tokens: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.shape.never_takes_hot_region(int(longest_tokens, "longest_tokens")?))
    }

    /// Whether this schedule pass still admits: no request was refused in it (first come, first served).
    fn admitting(&self) -> bool {
        self.pass(|p| p.admitting())
    }

    /// Whether a waiting request of ``tokens`` (``computed_tokens`` of them a prefix hit, scheduled up to
    /// ``chunk_tokens`` a step, growing to ``longest_tokens`` at most, None: unbounded) may start now, in a
    /// pool of ``free_blocks`` with ``running`` requests holding blocks (``reading_host`` of them through
    /// their hot regions), ``owed_hot_blocks`` still owed to hot regions asked for, and ``may_take_hot`` when
    /// a running request may still take one: not once a request was refused in this pass, which a refusal
    /// holds until :meth:`end_pass` (``pool_policy.rs``).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (tokens, computed_tokens, chunk_tokens, longest_tokens, *, free_blocks, running, reading_host,
                        owed_hot_blocks, may_take_hot))]
    fn admit(
        &self,
        tokens: &Bound<'_, PyAny>,
        computed_tokens: &Bound<'_, PyAny>,
        chunk_tokens: &Bound<'_, PyAny>,
        longest_tokens: &Bound<'_, PyAny>,
        free_blocks: &Bound<'_, PyAny>,
        running: &Bound<'_, PyAny>,
        reading_host: &Bound<'_, PyAny>,
        owed_hot_blocks: &Bound<'_, PyAny>,
        may_take_hot: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let ask = Admission {
            tokens: int(tokens, "tokens")?,
            computed_tokens: int(computed_tokens, "computed_tokens")?,
            chunk_tokens: int(chunk_tokens, "chunk_tokens")?,
            longest_tokens: opt_int(Some(longest_tokens), "longest_tokens")?,
        };
        let pool = PoolState {
            free_blocks: int(free_blocks, "free_blocks")?,
            running: int(running, "running")?,
            reading_host: int(reading_host, "reading_host")?,
            owed_hot_blocks: int(owed_hot_blocks, "owed_hot_blocks")?,
            may_take_hot: boolean(may_take_hot, "may_take_hot")?,
        };
        Ok(self.pass(|p| p.admit(&self.shape, &ask, &pool)))
    }

    /// The schedule pass is over: the next one admits afresh.
    fn end_pass(&self) {
        self.pass(|p| p.end());
    }
}
