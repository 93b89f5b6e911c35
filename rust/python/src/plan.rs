//! `StepPlan`: one step's plan as a frozen value. It pickles as its flat encoding (the form that crosses
//! processes and is applied by one call on the worker); the list views below are built on access, for
//! tests, logs and engines that want to look inside.

use hisparse_core::plan::StepPlan as CorePlan;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};

use crate::args;
use crate::errors::PyResultExt;

#[pyclass(frozen, module = "hisparse._core")]
pub struct StepPlan {
    pub inner: CorePlan,
}

impl From<CorePlan> for StepPlan {
    fn from(inner: CorePlan) -> Self {
        StepPlan { inner }
    }
}

#[pymethods]
impl StepPlan {
    /// Blocks the step lacked even after releasing; 0 when the plan is good.
    #[getter]
    fn missing_blocks(&self) -> u32 {
        self.inner.missing_blocks
    }
    /// False for a short plan: it changed nothing and must not be applied.
    #[getter]
    fn ok(&self) -> bool {
        !self.inner.is_short()
    }
    #[getter]
    fn cleared_rows(&self) -> Vec<u32> {
        self.inner.cleared_rows.clone()
    }
    /// (row, seq_len, request_id): a row's length and the request it serves.
    #[getter]
    fn seq_lens(&self) -> Vec<(u32, u32, u64)> {
        self.inner.seq_lens.iter().map(|l| (l.row, l.len, l.request)).collect()
    }
    /// (row, resident) of every length entry, in the same order: whether every page of the row's request is
    /// resident (resolve's resident path; SPEC.md).
    #[getter]
    fn resident_rows(&self) -> Vec<(u32, bool)> {
        self.inner.seq_lens.iter().map(|l| (l.row, l.resident)).collect()
    }
    /// (row, page, gpu_block or 0, host_block or -1, releasable)
    #[getter]
    fn table_updates(&self) -> Vec<(u32, u32, u32, i32, bool)> {
        self.inner
            .table_updates
            .iter()
            .map(|u| (u.row, u.page, u.gpu_block, u.host_block, u.releasable))
            .collect()
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
    /// The transfer ids of `materialize`, in order.
    #[getter]
    fn transfer_ids(&self) -> Vec<u64> {
        self.inner.materialize.iter().map(|c| c.transfer).collect()
    }
    /// (request_id, row, start, new_tokens) of each scheduled request, in the order given to `plan_step`.
    #[getter]
    fn scheduled(&self) -> Vec<(u64, u32, u32, u32)> {
        self.inner.scheduled.iter().map(|s| (s.request, s.row, s.start, s.tokens)).collect()
    }
    /// How many tokens the scheduled requests write in all.
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.inner.scheduled.iter().map(|s| s.tokens as u64).sum()
    }
    /// How many requests the plan schedules.
    #[getter]
    fn num_scheduled(&self) -> usize {
        self.inner.scheduled.len()
    }
    /// The state row of each scheduled request, in the order given to `plan_step`.
    #[getter]
    fn rows(&self) -> Vec<u32> {
        self.inner.scheduled.iter().map(|s| s.row).collect()
    }
    /// (request_id, from, to) residency changes.
    #[getter]
    fn transitions(&self) -> Vec<(u64, &'static str, &'static str)> {
        self.inner.transitions.iter().map(|t| (t.request, t.from.name(), t.to.name())).collect()
    }
    #[getter]
    fn num_transitions(&self) -> usize {
        self.inner.transitions.len()
    }
    #[getter]
    fn released_pages(&self) -> u32 {
        self.inner.released_pages
    }
    #[getter]
    fn lost_pages(&self) -> u32 {
        self.inner.lost_pages
    }

    /// The flat encoding (see `cuda/SPEC.md`, "apply"); `StepPlan.from_bytes` reads it back.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.encode())
    }

    #[classmethod]
    fn from_bytes(_cls: &Bound<'_, PyType>, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<Self> {
        let raw = args::bytes(data, "data")?;
        py.detach(|| CorePlan::decode(&raw)).py().map(StepPlan::from)
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyAny>, (Bound<'py, PyBytes>,))> {
        let from_bytes = slf.get_type().getattr("from_bytes")?;
        Ok((from_bytes, (slf.get().to_bytes(slf.py()),)))
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<StepPlan>().is_ok_and(|o| o.get().inner == self.inner)
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "StepPlan(missing_blocks={}, scheduled={}, table_updates={}, hot_updates={}, restores={}, materialize={}, \
             released={}, lost={})",
            p.missing_blocks,
            p.scheduled.len(),
            p.table_updates.len(),
            p.hot_updates.len(),
            p.restores.len(),
            p.materialize.len(),
            p.released_pages,
            p.lost_pages
        )
    }
}
