//! `hisparse._core.BlockRows`: the binding of `hisparse_core::block_rows` (vLLM's per-request block rows,
//! recorded as vLLM changes them, and its per-step scans). Conversions only.

use std::sync::Mutex;

use hisparse_core::block_rows::{BlockRows as CoreBlockRows, Mirror, Row, HOST_ONLY};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple, PyType};

use crate::errors::{invalid, PyResultExt};

/// A row's block ids as Python gives them: ``None`` for a page read from the host.
fn block_ids(ids: Vec<Option<u32>>) -> PyResult<Vec<u32>> {
    ids.into_iter().map(block_id).collect()
}

fn block_id(id: Option<u32>) -> PyResult<u32> {
    match id {
        None => Ok(HOST_ONLY),
        Some(HOST_ONLY) => Err(invalid(format!("block id {HOST_ONLY} is reserved"))),
        Some(id) => Ok(id),
    }
}

/// ``group``: a resident group's index, or ``None`` for the host row.
fn row(group: Option<usize>) -> Row {
    group.map_or(Row::Host, Row::Resident)
}

/// vLLM's block rows per request: every resident group's (residency changes applied) and the host's.
#[pyclass(frozen, module = "hisparse._core")]
pub struct BlockRows {
    inner: Mutex<CoreBlockRows>,
}

impl BlockRows {
    fn with<R>(&self, f: impl FnOnce(&mut CoreBlockRows) -> R) -> R {
        f(&mut crate::locked(&self.inner))
    }
}

#[pymethods]
impl BlockRows {
    /// Rows for ``groups`` resident groups of ``block_size``-token pages.
    #[new]
    fn new(groups: usize, block_size: u32) -> PyResult<Self> {
        Ok(Self { inner: Mutex::new(CoreBlockRows::new(groups, block_size).py()?) })
    }

    /// Replaces a row whole (``group`` ``None``: the host row); ``None`` in ``ids`` is a page read from the host.
    fn set(&self, request: &str, group: Option<usize>, ids: Vec<Option<u32>>) -> PyResult<()> {
        let ids = block_ids(ids)?;
        self.with(|r| r.set(request, row(group), ids)).py()
    }

    /// Appends pages to a row.
    fn extend(&self, request: &str, group: Option<usize>, ids: Vec<Option<u32>>) -> PyResult<()> {
        let ids = block_ids(ids)?;
        self.with(|r| r.extend(request, row(group), &ids)).py()
    }

    /// One page of a row changed; the page must exist.
    fn set_page(&self, request: &str, group: Option<usize>, page: usize, id: Option<u32>) -> PyResult<()> {
        let id = block_id(id)?;
        self.with(|r| r.set_page(request, row(group), page, id)).py()
    }

    /// A row was given back; a request with no row left is forgotten.
    fn clear(&self, request: &str, group: Option<usize>) -> PyResult<()> {
        self.with(|r| r.clear(request, row(group))).py()
    }

    /// Forgets every row.
    fn clear_all(&self) {
        self.with(|r| r.clear_all());
    }

    /// A row as recorded (``None``: read from the host); empty when never reported.
    fn row(&self, request: &str, group: Option<usize>) -> Vec<Option<u32>> {
        self.with(|r| r.row(request, row(group)).iter().map(|&id| (id != HOST_ONLY).then_some(id)).collect())
    }

    /// How many pages a row holds (``len(row(...))`` without building the row).
    fn row_len(&self, request: &str, group: Option<usize>) -> usize {
        self.with(|r| r.row(request, row(group)).len())
    }

    /// Every resident group's block of each page, page by page (``len(pages) x groups`` ids, ``None`` where a
    /// group reads the page from the host or has no block for it).
    fn blocks_at(&self, request: &str, pages: Vec<usize>) -> Vec<Option<u32>> {
        let ids = self.with(|r| r.blocks_at(request, &pages));
        ids.into_iter().map(|id| (id != HOST_ONLY).then_some(id)).collect()
    }

    /// For each ``(request, first token, tokens)``, the spans of its token rows to mirror to the host (the
    /// core's ``BlockRows::mirrors``), as instances of ``cls`` (vLLM's ``SparseKVRowMirror``, a dataclass of
    /// ``source_starts``, ``destination_start`` and ``num_rows``): a dict of request id to a tuple of them.
    /// They are made as unpickling makes them, ``object.__new__`` and the fields set in the instance's
    /// ``__dict__``: the frozen dataclass's ``__init__`` alone costs more than the scan. One new row per
    /// request per decode step, so the scan is a lookup per request: the GIL is kept, and the request ids are
    /// read in place and reused as the dict's keys (their hashes cached), not copied.
    fn mirrors<'py>(
        &self,
        py: Python<'py>,
        windows: Vec<(Bound<'py, PyString>, u64, u64)>,
        cls: &Bound<'py, PyType>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let new = py.get_type::<PyAny>().getattr(intern!(py, "__new__"))?;
        let make = |m: Mirror| -> PyResult<Bound<'py, PyAny>> {
            let mirror = new.call1((cls,))?;
            let fields = mirror.getattr(intern!(py, "__dict__"))?.cast_into::<PyDict>()?;
            fields.set_item(intern!(py, "source_starts"), PyTuple::new(py, m.sources)?)?;
            fields.set_item(intern!(py, "destination_start"), m.destination)?;
            fields.set_item(intern!(py, "num_rows"), m.rows)?;
            Ok(mirror)
        };
        let out = PyDict::new(py);
        self.with(|rows| {
            for (request, start, count) in windows {
                let spans = rows.mirrors(request.to_str()?, start, count);
                let made = spans.into_iter().map(make).collect::<PyResult<Vec<_>>>()?;
                out.set_item(request, PyTuple::new(py, made)?)?;
            }
            Ok(out)
        })
    }

    /// Whether every ``(request, tokens)`` reads nothing from the host in a step ending at ``tokens``.
    fn all_resident(&self, py: Python<'_>, requests: Vec<(String, u64)>) -> bool {
        py.detach(|| self.with(|r| requests.iter().all(|(request, tokens)| r.all_resident(request, *tokens))))
    }

    fn __len__(&self) -> usize {
        self.with(|r| r.len())
    }
}
