//! `hisparse._core.ReuseWatch`: the binding of `hisparse_core::reuse_watch` (vLLM's released GPU blocks still
//! read, and its GPU copies indexed for host prefix hits, by block id). Conversions only.

use std::sync::Mutex;

use hisparse_core::reuse_watch::ReuseWatch as CoreReuseWatch;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::PyResultExt;

/// Per GPU block id of one pool: the pages still reading it once released, and the host page hash it holds
/// a GPU copy of.
#[pyclass(frozen, module = "hisparse._core")]
pub struct ReuseWatch {
    inner: Mutex<CoreReuseWatch>,
}

impl ReuseWatch {
    fn with<R>(&self, f: impl FnOnce(&mut CoreReuseWatch) -> R) -> R {
        f(&mut crate::locked(&self.inner))
    }
}

#[pymethods]
impl ReuseWatch {
    /// Tables for a pool of ``blocks`` blocks.
    #[new]
    fn new(blocks: usize) -> Self {
        Self { inner: Mutex::new(CoreReuseWatch::new(blocks)) }
    }

    /// ``request``'s ``page`` still reads these released blocks.
    fn own(&self, blocks: Vec<u32>, request: &str, page: u32) -> PyResult<()> {
        self.with(|w| w.own(&blocks, request, page)).py()
    }

    /// ``request``'s ``page`` no longer reads these blocks.
    fn disown(&self, blocks: Vec<u32>, request: &str, page: u32) -> PyResult<()> {
        self.with(|w| w.disown(&blocks, request, page)).py()
    }

    /// These blocks hold the GPU copy of the host page ``hash``.
    fn index(&self, blocks: Vec<u32>, hash: &[u8]) -> PyResult<()> {
        self.with(|w| w.index(&blocks, hash)).py()
    }

    /// These blocks' copy index entries go.
    fn unindex(&self, blocks: Vec<u32>) -> PyResult<()> {
        self.with(|w| w.unindex(&blocks)).py()
    }

    /// The pool handed ``block`` out: ``(hash or None, [(request, page), ...])`` taken from it, or ``None``
    /// when it had neither.
    #[allow(clippy::type_complexity)]
    fn reused<'py>(
        &self,
        py: Python<'py>,
        block: u32,
    ) -> PyResult<Option<(Option<Bound<'py, PyBytes>>, Vec<(String, u32)>)>> {
        let Some(reused) = self.with(|w| w.reused(block)).py()? else { return Ok(None) };
        let copy = reused.copy.map(|hash| PyBytes::new(py, &hash));
        Ok(Some((copy, reused.owners.into_iter().map(|(r, p)| (r.into(), p)).collect())))
    }

    /// The pages still reading ``block``, in the order they released it.
    fn owners(&self, block: u32) -> PyResult<Vec<(String, u32)>> {
        self.with(|w| w.owners(block).map(|o| o.iter().map(|(r, p)| (r.to_string(), *p)).collect())).py()
    }

    /// Block id -> host page hash, for every block indexed as a GPU copy.
    fn indexed<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        self.with(|w| -> PyResult<()> {
            for (block, hash) in w.indexed() {
                dict.set_item(block, PyBytes::new(py, hash))?;
            }
            Ok(())
        })?;
        Ok(dict)
    }

    /// Forgets everything (the pools were reset).
    fn clear(&self) {
        self.with(CoreReuseWatch::clear);
    }
}
