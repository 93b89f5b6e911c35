//! `hisparse._core.ReleasedPages`: `hisparse_core::released` as vLLM's HiSparse coordinator uses it. The object
//! is also the callback vLLM's block pool calls for every released block it hands out again (the `on_reuse`
//! of `BlockPool.unpin_blocks`): a block nobody reads returns without a Python frame; one that indexes a GPU
//! copy, or that a page is read from, calls the coordinator's `_drop_copy` and `_lose_page` as vLLM's
//! `_on_block_reused` does.

use std::sync::Mutex;

use hisparse_core::released::ReleasedPages as CoreReleasedPages;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use pyo3::{PyTraverseError, PyVisit};

use crate::args::int;

/// Who still reads a released page's GPU blocks (``hisparse_core::released``), and the callback of their
/// reuse.
#[pyclass(frozen, module = "hisparse._core")]
pub struct ReleasedPages {
    inner: Mutex<CoreReleasedPages>,
    /// The coordinator, whose ``_drop_copy`` and ``_lose_page`` a reuse calls.
    owner: Py<PyAny>,
    /// The coordinator's ``_copy_by_block``: block id -> the host hash its GPU copy is indexed under.
    copies: Py<PyDict>,
}

impl ReleasedPages {
    fn with<R>(&self, f: impl FnOnce(&mut CoreReleasedPages) -> R) -> R {
        f(&mut crate::locked(&self.inner))
    }
}

#[pymethods]
impl ReleasedPages {
    #[new]
    fn new(owner: Bound<'_, PyAny>, copies: Bound<'_, PyDict>) -> Self {
        Self { inner: Mutex::default(), owner: owner.unbind(), copies: copies.unbind() }
    }

    /// ``request_id``'s ``page`` went back to the pool on ``blocks`` (vLLM's blocks, one per resident group).
    fn release(
        &self,
        py: Python<'_>,
        request_id: &str,
        page: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let page = int::<u32>(page, "page")?;
        let mut ids = Vec::with_capacity(blocks.len().unwrap_or(0));
        for block in blocks.try_iter()? {
            ids.push(int::<u32>(&block?.getattr(intern!(py, "block_id"))?, "block_id")?);
        }
        self.with(|r| r.release(request_id, page, &ids));
        Ok(())
    }

    /// vLLM's block pool handed ``block`` out again: its GPU copy is dropped (``owner._drop_copy``), then each
    /// page read from it is lost (``owner._lose_page``), in the order they were released.
    fn __call__(&self, py: Python<'_>, block: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = block.getattr(intern!(py, "block_id"))?;
        let owner = self.owner.bind(py);
        let copies = self.copies.bind(py);
        if !copies.is_empty() {
            if let Some(host_hash) = copies.get_item(&id)? {
                owner.call_method1(intern!(py, "_drop_copy"), (host_hash,))?;
            }
        }
        let id = int::<u32>(&id, "block_id")?;
        let lost = self.with(|r| r.reused(id)); // unlocked again before any call out: they may call back
        for (request_id, page) in lost {
            owner.call_method1(intern!(py, "_lose_page"), (&*request_id, page))?;
        }
        Ok(())
    }

    /// ``request_id`` no longer reads ``page``, on any block it was released on.
    fn forget(&self, request_id: &str, page: &Bound<'_, PyAny>) -> PyResult<()> {
        let page = int::<u32>(page, "page")?;
        self.with(|r| r.forget(request_id, page));
        Ok(())
    }

    /// ``request_id`` was freed: it reads none of its released pages.
    fn forget_request(&self, request_id: &str) {
        self.with(|r| r.forget_request(request_id));
    }

    /// Forgets every reader (the pools were reset).
    fn clear(&self) {
        self.with(CoreReleasedPages::clear);
    }

    /// ``request_id``'s released pages, each with the block ids it was released on, by page.
    fn pages(&self, request_id: &str) -> Vec<(u32, Vec<u32>)> {
        self.with(|r| r.pages(request_id))
    }

    /// Released blocks someone still reads.
    fn __len__(&self) -> usize {
        self.with(|r| r.len())
    }

    /// The coordinator holds this object and this object the coordinator: the cycle is the collector's to find.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.owner)?;
        visit.call(&self.copies)
    }
}
