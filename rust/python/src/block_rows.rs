//! `hisparse._core.BlockRows`: the binding of `hisparse_core::block_rows` (vLLM's per-request block rows,
//! recorded as vLLM changes them, and its per-step scans). Conversions only.

use std::sync::Mutex;

use hisparse_core::block_rows::{BlockRows as CoreBlockRows, Row, Step, HOST_ONLY};
use hisparse_core::slab::Handle;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple, PyType};
use pyo3::{ffi, intern};

use crate::args::{int, int_named, opt_int, opt_ints};
use crate::errors::{invalid, PyResultExt};

/// A row's block ids as Python gives them: ``None`` for a page read from the host.
fn block_ids(ids: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    opt_ints::<u32>(ids, "ids")?.into_iter().map(block_id).collect()
}

fn block_id(id: Option<u32>) -> PyResult<u32> {
    match id {
        None => Ok(HOST_ONLY),
        Some(HOST_ONLY) => Err(invalid(format!("block id {HOST_ONLY} is reserved"))),
        Some(id) => Ok(id),
    }
}

/// ``v`` as a ``dict`` (what the scans read in place), an error naming ``name`` otherwise.
fn dict<'a, 'py>(v: &'a Bound<'py, PyAny>, name: &str) -> PyResult<&'a Bound<'py, PyDict>> {
    v.cast::<PyDict>().map_err(|_| invalid(format!("{name} must be a dict, not {}", v.get_type())))
}

/// ``dict[request]`` (the dict named ``name``) as a count.
fn item<'py>(dict: &Bound<'py, PyDict>, request: &Bound<'py, PyString>, name: &str) -> PyResult<u64> {
    match dict.get_item(request)? {
        Some(value) => int_named(&value, &|| format!("{name}[{request}]")),
        None => Err(invalid(format!("{name} has no entry for request {request}"))),
    }
}

/// Each ``(request, tokens scheduled, tokens computed before)`` of a step, in ``scheduled``'s order.
fn steps<'py>(
    scheduled: &Bound<'py, PyDict>,
    computed: &Bound<'py, PyDict>,
) -> PyResult<Vec<(Bound<'py, PyString>, u64, u64)>> {
    // A loop, not a collect into `PyResult<Vec<_>>`, which cannot size the vector ahead.
    let mut steps = Vec::with_capacity(scheduled.len());
    for (request, count) in scheduled.iter() {
        let request = request.cast_into::<PyString>().map_err(|e| {
            invalid(format!("scheduled's keys must be request ids (str), not {}", e.into_inner()))
        })?;
        let start = item(computed, &request, "computed")?;
        let count = int_named(&count, &|| format!("scheduled[{request}]"))?;
        steps.push((request, count, start));
    }
    Ok(steps)
}

/// ``group``: a resident group's index, or ``None`` for the host row.
fn row(group: Option<&Bound<'_, PyAny>>) -> PyResult<Row> {
    Ok(opt_int::<usize>(group, "group")?.map_or(Row::Host, Row::Resident))
}

/// vLLM's block rows per request: every resident group's (residency changes applied) and the host's.
#[pyclass(frozen, module = "hisparse._core")]
pub struct BlockRows {
    inner: Mutex<CoreBlockRows>,
    /// The last scan's requests, in order, with the handle of each one's rows: vLLM schedules its running
    /// requests in the same order step after step (the same id strings), so the next scan finds most rows
    /// by position, without a lookup by name (``hisparse_core::slab``). Holding the strings keeps them alive,
    /// so a string at the same address is the same request.
    last_scan: Mutex<Vec<(Py<PyString>, Option<Handle>)>>,
}

impl BlockRows {
    fn with<R>(&self, f: impl FnOnce(&mut CoreBlockRows) -> R) -> R {
        f(&mut crate::locked(&self.inner))
    }

    /// The rows, for the page book, which changes them in its calls (``page_book.rs``).
    pub(crate) fn inner(&self) -> &Mutex<CoreBlockRows> {
        &self.inner
    }

    pub(crate) fn resident_groups(&self) -> usize {
        self.with(|r| r.groups())
    }
}

#[pymethods]
impl BlockRows {
    /// Rows for ``groups`` resident groups of ``block_size``-token pages.
    #[new]
    fn new(groups: &Bound<'_, PyAny>, block_size: &Bound<'_, PyAny>) -> PyResult<Self> {
        let rows = CoreBlockRows::new(int(groups, "groups")?, int(block_size, "block_size")?).py()?;
        Ok(Self { inner: Mutex::new(rows), last_scan: Mutex::new(Vec::new()) })
    }

    /// Replaces a row whole (``group`` ``None``: the host row); ``None`` in ``ids`` is a page read from the host.
    fn set(&self, request: &str, group: Option<&Bound<'_, PyAny>>, ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let (row, ids) = (row(group)?, block_ids(ids)?);
        self.with(|r| r.set(request, row, ids)).py()
    }

    /// Appends pages to a row.
    fn extend(
        &self,
        request: &str,
        group: Option<&Bound<'_, PyAny>>,
        ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (row, ids) = (row(group)?, block_ids(ids)?);
        self.with(|r| r.extend(request, row, &ids)).py()
    }

    /// One page of a row changed; the page must exist.
    fn set_page(
        &self,
        request: &str,
        group: Option<&Bound<'_, PyAny>>,
        page: &Bound<'_, PyAny>,
        id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (row, page, id) = (row(group)?, int(page, "page")?, block_id(opt_int(id, "id")?)?);
        self.with(|r| r.set_page(request, row, page, id)).py()
    }

    /// Records what one allocation appended to ``request``'s rows, every group in one call: ``new_blocks`` is
    /// vLLM's tuple of each KV cache group's new blocks, ``groups`` a ``(kv group, manager, group)`` per recorded
    /// row (``group`` ``None``: the host row). A grown row is caught up from its manager's ``req_to_blocks``
    /// (the core's ``BlockRows::growth_start``); returns ``(manager, group)`` of each that cannot be (its row
    /// also changed in a way not reported), for the caller to set whole.
    fn grow<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyString>,
        new_blocks: &Bound<'py, PyAny>,
        groups: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let name = request.to_str()?;
        let stale = PyList::empty(py);
        for entry in groups.try_iter()? {
            let entry = entry?;
            let (kv_group, manager, group) =
                entry.extract::<(usize, Bound<'py, PyAny>, Bound<'py, PyAny>)>()?;
            let added = new_blocks.get_item(kv_group)?.len()?;
            if added == 0 {
                continue;
            }
            let vllm_row = manager.getattr(intern!(py, "req_to_blocks"))?.get_item(request)?;
            let now = vllm_row.len()?;
            let which = row(Some(&group))?;
            let Some(start) = self.with(|r| r.growth_start(name, which, added, now)).py()? else {
                stale.append((manager, group))?;
                continue;
            };
            let mut ids = Vec::with_capacity(now - start);
            for page in start..now {
                let block = vllm_row.get_item(page)?;
                let null = block.getattr(intern!(py, "is_null"))?.is_truthy()?;
                let id = if null {
                    None
                } else {
                    Some(int(&block.getattr(intern!(py, "block_id"))?, "block_id")?)
                };
                ids.push(block_id(id)?);
            }
            self.with(|r| r.extend(name, which, &ids)).py()?;
        }
        Ok(stale)
    }

    /// The engine stopped reading the page from the GPU: read from the host in every resident row that has
    /// it (what vLLM's ``drop_resident_page`` does to each group's row); nothing for a request without rows.
    fn drop_page(&self, request: &str, page: &Bound<'_, PyAny>) -> PyResult<()> {
        let page = int(page, "page")?;
        self.with(|r| r.drop_page(request, page));
        Ok(())
    }

    /// A row was given back; a request with no row left is forgotten.
    fn clear(&self, request: &str, group: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let row = row(group)?;
        self.with(|r| r.clear(request, row)).py()
    }

    /// Forgets every row.
    fn clear_all(&self) {
        self.with(|r| r.clear_all());
    }

    /// A row as recorded (``None``: read from the host); empty when never reported.
    fn row(&self, request: &str, group: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<u32>>> {
        let row = row(group)?;
        let ids = self.with(|r| r.row(request, row)).py()?;
        Ok(ids.into_iter().map(|id| (id != HOST_ONLY).then_some(id)).collect())
    }

    /// How many pages a row holds (``len(row(...))`` without building the row).
    fn row_len(&self, request: &str, group: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
        let row = row(group)?;
        self.with(|r| r.row_len(request, row)).py()
    }

    /// ``request`` needs no bookkeeping in a step ending below ``tokens`` until one of its rows changes or it
    /// is woken (the core's ``BlockRows::quiet``).
    fn quiet(&self, request: &str, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let tokens = int(tokens, "tokens")?;
        self.with(|r| r.quiet(request, tokens));
        Ok(())
    }

    /// Something outside the rows changed what ``request``'s next step needs.
    fn wake(&self, request: &str) {
        self.with(|r| r.wake(request));
    }

    /// How many times a row has changed: whether any did between two calls.
    #[getter]
    fn changes(&self) -> u64 {
        self.with(|r| r.changes())
    }

    /// vLLM's per-step views of the scheduled requests (``scheduled``: request -> tokens this step;
    /// ``computed``: request -> tokens computed before it), in one pass: each one's row mirrors (the core's
    /// ``BlockRows::mirrors`` over the step's rows, from ``back[request]`` rows before them when ``back`` is
    /// given, through ``lookahead`` rows after), packed; whether every one reads only resident pages; and,
    /// in ``scheduled``'s order, those whose step may need the engine's bookkeeping: not marked quiet below
    /// the step's end (``quiet``). The mirrors come as ``(ids, counts, sources, destinations, rows)``:
    /// the request ids in ``scheduled``'s order (the same string objects), then native-endian arrays as
    /// bytes, ``counts`` a u32 per request (its mirrors, in order), and per mirror ``groups`` i64 source
    /// starts, an i64 destination start and an i64 row count. No Python object is made per request or
    /// mirror: ``hisparse.integrations.vllm.mirrors.RowMirrors`` reads them as vLLM's mapping where it is
    /// read (vLLM's worker). One new row per request per decode step, so the scan is a lookup per request
    /// (by position, where the last scan had the same request there: ``last_scan``): the GIL is kept.
    #[pyo3(signature = (scheduled, computed, lookahead=None, back=None))]
    fn scan<'py>(
        &self,
        py: Python<'py>,
        scheduled: &Bound<'py, PyAny>,
        computed: &Bound<'py, PyAny>,
        lookahead: Option<&Bound<'py, PyAny>>,
        back: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyTuple>, bool, Bound<'py, PyList>)> {
        let lookahead = opt_int::<u64>(lookahead, "lookahead")?.unwrap_or(0);
        let back = back.filter(|b| !b.is_none()).map(|b| dict(b, "back")).transpose()?;
        let requests = steps(dict(scheduled, "scheduled")?, dict(computed, "computed")?)?;
        let mut last_scan = crate::locked(&self.last_scan);
        let mut batch = Vec::with_capacity(requests.len());
        for (i, (request, count, start)) in requests.iter().enumerate() {
            let first = match &back {
                Some(back) => start.saturating_sub(item(back, request, "back")?),
                None => *start,
            };
            let kept = last_scan.get(i).filter(|(last, _)| last.as_ptr() == request.as_ptr());
            batch.push(Step {
                request: request.to_str()?,
                handle: kept.and_then(|&(_, handle)| handle),
                mirror_from: first,
                mirror_rows: count.saturating_add(start - first).saturating_add(lookahead),
                end: start.saturating_add(*count),
            });
        }
        let scan = self.with(|rows| rows.scan(&batch));
        *last_scan = requests
            .iter()
            .zip(&scan.handles)
            .map(|((request, ..), &handle)| (request.clone().unbind(), handle))
            .collect();
        let ids = PyList::new(py, requests.iter().map(|(request, _, _)| request))?;
        let busy = PyList::new(py, scan.busy.iter().map(|&i| &requests[i].0))?;
        let wide = |values: &[u64]| packed(py, values.iter().map(|&v| (v as i64).to_ne_bytes()));
        let mirrors = PyTuple::new(
            py,
            [
                ids.into_any(),
                packed(py, scan.counts.iter().map(|n| n.to_ne_bytes()))?,
                wide(&scan.sources)?,
                wide(&scan.destinations)?,
                packed(py, scan.rows.iter().map(|&n| i64::from(n).to_ne_bytes()))?,
            ],
        )?;
        Ok((mirrors, scan.all_resident, busy))
    }

    fn __len__(&self) -> usize {
        self.with(|r| r.len())
    }
}

/// Native-endian fixed-width integers as ``bytes`` (what [`ints`] reads back), written in place.
fn packed<'py, const N: usize>(
    py: Python<'py>,
    values: impl ExactSizeIterator<Item = [u8; N]>,
) -> PyResult<Bound<'py, PyAny>> {
    let bytes = PyBytes::new_with(py, values.len() * N, |buf| {
        for (slot, value) in buf.chunks_exact_mut(N).zip(values) {
            slot.copy_from_slice(&value);
        }
        Ok(())
    })?;
    Ok(bytes.into_any())
}

/// Native-endian fixed-width integers out of ``bytes``; an error naming ``what`` when the length is not a
/// whole number of them.
fn packed_ints<const N: usize, T>(what: &str, bytes: &[u8], from: fn([u8; N]) -> T) -> PyResult<Vec<T>> {
    if bytes.len() % N != 0 {
        return Err(invalid(format!(
            "{what}: {} bytes is not a whole number of {N}-byte integers",
            bytes.len()
        )));
    }
    Ok(bytes.chunks_exact(N).map(|c| from(c.try_into().expect("chunks of N bytes"))).collect())
}

/// ``BlockRows.scan``'s packed mirrors (``ids``, ``counts``, ``sources``, ``destinations``, ``rows``, with
/// ``groups`` source starts a mirror) as vLLM's ``row_mirrors`` dict: request id -> tuple of ``cls``
/// (``SparseKVRowMirror``, a frozen dataclass of ``source_starts``, ``destination_start`` and ``num_rows``).
/// Made as unpickling makes them, ``object.__new__`` and each field set past the frozen ``__setattr__``: the
/// dataclass's ``__init__`` alone costs more than the rest.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn unpack_row_mirrors<'py>(
    py: Python<'py>,
    cls: &Bound<'py, PyType>,
    ids: &Bound<'py, PyList>,
    counts: &[u8],
    sources: &[u8],
    destinations: &[u8],
    rows: &[u8],
    groups: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyDict>> {
    let groups = int::<usize>(groups, "groups")?;
    let counts = packed_ints("counts", counts, u32::from_ne_bytes)?;
    let sources = packed_ints("sources", sources, i64::from_ne_bytes)?;
    let destinations = packed_ints("destinations", destinations, i64::from_ne_bytes)?;
    let rows = packed_ints("rows", rows, i64::from_ne_bytes)?;
    let mirrors: usize = counts.iter().map(|&n| n as usize).sum();
    if groups == 0
        || counts.len() != ids.len()
        || destinations.len() != mirrors
        || rows.len() != mirrors
        || Some(sources.len()) != mirrors.checked_mul(groups)
    {
        return Err(invalid(format!(
            "row mirrors packed inconsistently: {} requests, {} counts, {mirrors} mirrors, {} destinations, \
             {} row counts, {} source starts in {groups} groups",
            ids.len(),
            counts.len(),
            destinations.len(),
            rows.len(),
            sources.len()
        )));
    }
    let new = py.get_type::<PyAny>().getattr(intern!(py, "__new__"))?;
    let fields = [intern!(py, "source_starts"), intern!(py, "destination_start"), intern!(py, "num_rows")];
    let out = PyDict::new(py);
    let mut m = 0;
    for (request, &n) in ids.iter().zip(&counts) {
        let mut made = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let mirror = new.call1((cls,))?;
            let values = [
                PyTuple::new(py, &sources[m * groups..(m + 1) * groups])?.into_any(),
                destinations[m].into_pyobject(py)?.into_any(),
                rows[m].into_pyobject(py)?.into_any(),
            ];
            for (name, value) in fields.iter().zip(values) {
                // SAFETY: three live objects. The setter is object's own, which the frozen class's __setattr__
                // (raising for every assignment) keeps from being reached through setattr.
                if unsafe { ffi::PyObject_GenericSetAttr(mirror.as_ptr(), name.as_ptr(), value.as_ptr()) } < 0
                {
                    return Err(PyErr::fetch(py));
                }
            }
            made.push(mirror);
            m += 1;
        }
        out.set_item(request, PyTuple::new(py, made)?)?;
    }
    Ok(out)
}
