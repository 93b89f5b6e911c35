//! `hisparse._core.PageBook`: the binding of `hisparse_core::page_book` (vLLM's HiSparse page lifecycle),
//! with its effects made on vLLM's objects: the GPU and host pools' calls here, by block id; the rest
//! through the coordinator's `_engine_*` methods (`integrations/vllm/bookkeeping.py`). Conversions only.
//!
//! The book reads and changes the coordinator's `BlockRows` under that object's lock, held for the call:
//! nothing vLLM does within one (pool calls, row changes, its prefix cache) reaches back into either, and a
//! call that did would fail rather than wait on itself (`try_lock`).

use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use hisparse_core::block_rows::{BlockRows as CoreBlockRows, HOST_ONLY};
use hisparse_core::page_book::{Engine, Hash, PageBook as CorePageBook};
use hisparse_core::CoreError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySet, PyTuple};

use crate::args::{boolean, int, pairs};
use crate::block_rows::BlockRows;
use crate::errors::{invalid, to_pyerr, InvariantError, PyResultExt};

/// The engine's error: a Python exception raised by a call into vLLM, or the core's.
struct Failure(PyErr);

impl From<CoreError> for Failure {
    fn from(e: CoreError) -> Self {
        Failure(to_pyerr(e))
    }
}

impl From<PyErr> for Failure {
    fn from(e: PyErr) -> Self {
        Failure(e)
    }
}

trait Raise<T> {
    fn raise(self) -> PyResult<T>;
}

impl<T> Raise<T> for Result<T, Failure> {
    fn raise(self) -> PyResult<T> {
        self.map_err(|Failure(e)| e)
    }
}

/// vLLM's objects the book's effects are made on.
struct Refs {
    coordinator: Py<PyAny>,
    /// The requests known to read through their hot regions (the coordinator's set).
    reads_host: Py<PySet>,
    gpu_pool: Py<PyAny>,
    gpu_blocks: Py<PyList>,
    host_pool: Py<PyAny>,
    host_blocks: Py<PyList>,
    resident: Vec<Py<PyAny>>,
    hot: Vec<Py<PyAny>>,
}

/// The [`Engine`] over vLLM's objects, for one call.
struct Vllm<'a, 'py> {
    py: Python<'py>,
    refs: &'a Refs,
}

impl<'py> Vllm<'_, 'py> {
    fn blocks(&self, list: &Py<PyList>, ids: &[u32]) -> PyResult<Bound<'py, PyList>> {
        let list = list.bind(self.py);
        let found = ids.iter().map(|&id| list.get_item(id as usize)).collect::<PyResult<Vec<_>>>()?;
        PyList::new(self.py, found)
    }

    fn gpu(&self, ids: &[u32]) -> PyResult<Bound<'py, PyList>> {
        self.blocks(&self.refs.gpu_blocks, ids)
    }

    fn host(&self, ids: &[u32]) -> PyResult<Bound<'py, PyList>> {
        self.blocks(&self.refs.host_blocks, ids)
    }

    fn coordinator(&self) -> &Bound<'py, PyAny> {
        self.refs.coordinator.bind(self.py)
    }
}

impl Engine for Vllm<'_, '_> {
    type Payload = Py<PyAny>;
    type Error = Failure;

    fn touch_gpu(&mut self, blocks: &[u32]) -> Result<(), Failure> {
        self.refs.gpu_pool.bind(self.py).call_method1(intern!(self.py, "touch"), (self.gpu(blocks)?,))?;
        Ok(())
    }

    fn touch_host(&mut self, blocks: &[u32]) -> Result<(), Failure> {
        self.refs.host_pool.bind(self.py).call_method1(intern!(self.py, "touch"), (self.host(blocks)?,))?;
        Ok(())
    }

    fn release_pins(&mut self, blocks: &[u32]) -> Result<(), Failure> {
        // vLLM gives them back a group at a time; where every block stays held by its request the frees
        // only count down, so one call does for all, and a page whose request is gone goes back block by
        // block, in vLLM's queue order.
        let (pool, list) = (self.refs.gpu_pool.bind(self.py), self.gpu(blocks)?);
        let mut held = true;
        for block in list.iter() {
            held &= block.getattr(intern!(self.py, "ref_cnt"))?.extract::<i64>()? > 1;
        }
        if held {
            pool.call_method1(intern!(self.py, "free_blocks"), (list,))?;
        } else {
            for block in list.iter() {
                pool.call_method1(intern!(self.py, "free_blocks"), (PyList::new(self.py, [block])?,))?;
            }
        }
        Ok(())
    }

    fn free_host(&mut self, blocks: &[u32]) -> Result<(), Failure> {
        self.refs
            .host_pool
            .bind(self.py)
            .call_method1(intern!(self.py, "free_blocks"), (self.host(blocks)?,))?;
        Ok(())
    }

    fn unpin(&mut self, blocks: &[u32]) -> Result<(), Failure> {
        // The coordinator's callback, which hands the block to `block_reused`: vLLM's pool calls it.
        let reused = self.coordinator().getattr(intern!(self.py, "_on_block_reused"))?;
        self.refs
            .gpu_pool
            .bind(self.py)
            .call_method1(intern!(self.py, "unpin_blocks"), (self.gpu(blocks)?, reused))?;
        Ok(())
    }

    fn host_hash(&mut self, block: u32) -> Result<Option<Hash>, Failure> {
        let block = self.refs.host_blocks.bind(self.py).get_item(block as usize)?;
        if block.getattr(intern!(self.py, "is_null"))?.is_truthy()? {
            return Ok(None);
        }
        let hash = block.getattr(intern!(self.py, "block_hash"))?;
        if hash.is_none() {
            return Ok(None);
        }
        let bytes =
            hash.cast::<PyBytes>().map_err(|_| invalid(format!("a block hash is not bytes: {hash}")))?;
        Ok(Some(Arc::from(bytes.as_bytes())))
    }

    fn can_read_from_host(&mut self, request: &str) -> Result<bool, Failure> {
        // Known yes answers first (they hold until the request is freed), without a call into Python.
        if self.refs.reads_host.bind(self.py).contains(request)? {
            return Ok(true);
        }
        Ok(self
            .coordinator()
            .call_method1(intern!(self.py, "_can_read_from_host"), (request,))?
            .is_truthy()?)
    }

    fn drop_resident_page(&mut self, request: &str, page: u32, group: Option<usize>) -> Result<(), Failure> {
        let name = intern!(self.py, "drop_resident_page");
        match group {
            Some(group) => {
                self.refs.resident[group].bind(self.py).call_method1(name, (request, page))?;
            }
            None => {
                for manager in &self.refs.resident {
                    manager.bind(self.py).call_method1(name, (request, page))?;
                }
            }
        }
        Ok(())
    }

    fn adopt(&mut self, request: &str, page: u32, group: usize, block: u32) -> Result<bool, Failure> {
        let block = self.refs.gpu_blocks.bind(self.py).get_item(block as usize)?;
        let manager = self.refs.resident[group].bind(self.py);
        Ok(manager
            .call_method1(intern!(self.py, "adopt_resident_page"), (request, page, block))?
            .is_truthy()?)
    }

    fn require_hot(&mut self, request: &str) -> Result<(), Failure> {
        for manager in &self.refs.hot {
            manager.bind(self.py).call_method1(intern!(self.py, "require_hot"), (request,))?;
        }
        Ok(())
    }

    fn publish(&mut self, payload: &Py<PyAny>, tokens: u64) -> Result<(), Failure> {
        self.coordinator().call_method1(intern!(self.py, "_engine_publish"), (payload, tokens))?;
        Ok(())
    }

    fn finished(&mut self, payload: &Py<PyAny>) -> Result<bool, Failure> {
        let request = payload.bind(self.py).getattr(intern!(self.py, "request"))?;
        Ok(request.call_method0(intern!(self.py, "is_finished"))?.is_truthy()?)
    }

    fn detach(&mut self, request: &str, payload: &mut Py<PyAny>, pages: usize) -> Result<(), Failure> {
        self.coordinator().call_method1(intern!(self.py, "_engine_detach"), (request, &*payload, pages))?;
        Ok(())
    }

    fn publish_detached(&mut self, payload: &Py<PyAny>, full_pages: usize) -> Result<(), Failure> {
        self.coordinator()
            .call_method1(intern!(self.py, "_engine_publish_detached"), (payload, full_pages))?;
        Ok(())
    }

    fn release_order(&mut self, request: &str, pages: Vec<u32>) -> Result<Vec<u32>, Failure> {
        let ordered =
            self.coordinator().call_method1(intern!(self.py, "_release_order"), (request, pages))?;
        Ok(crate::args::ints(&ordered, "release order")?)
    }

    fn publish_order(&mut self, requests: Vec<Arc<str>>) -> Result<Vec<Arc<str>>, Failure> {
        // vLLM's coordinator adds them to a set in this order and walks the set: a set built the same way,
        // in this process (string hashes are per process), walks in the same order.
        let set = PySet::empty(self.py)?;
        for request in &requests {
            set.add(&**request)?;
        }
        let mut ordered = Vec::with_capacity(requests.len());
        for name in set.iter() {
            let name = name.extract::<String>()?;
            let found = requests.iter().find(|r| ***r == *name);
            ordered.push(Arc::clone(
                found.ok_or_else(|| InvariantError::new_err("a set of names grew a name"))?,
            ));
        }
        Ok(ordered)
    }

    fn without_region(&mut self, request: &str, released: usize) -> Result<(), Failure> {
        self.coordinator().call_method1(intern!(self.py, "_without_region"), (request, released))?;
        Ok(())
    }
}

fn try_locked<'a, T>(inner: &'a Mutex<T>, what: &str) -> PyResult<MutexGuard<'a, T>> {
    match inner.try_lock() {
        Ok(guard) => Ok(guard),
        Err(TryLockError::Poisoned(e)) => Ok(e.into_inner()),
        Err(TryLockError::WouldBlock) => Err(InvariantError::new_err(format!(
            "{what} was called into while it was in use (a re-entrant call)"
        ))),
    }
}

/// vLLM's HiSparse page lifecycle (the core's ``PageBook``), its effects made on vLLM's objects.
#[pyclass(frozen, module = "hisparse._core")]
pub struct PageBook {
    inner: Mutex<CorePageBook<Py<PyAny>>>,
    rows: Py<BlockRows>,
    refs: Refs,
}

impl PageBook {
    /// Runs `f` over the book and the rows, with an engine over vLLM's objects.
    fn run<'py, R>(
        slf: &Bound<'py, Self>,
        f: impl FnOnce(&mut CorePageBook<Py<PyAny>>, &mut CoreBlockRows, &mut Vllm<'_, 'py>) -> Result<R, Failure>,
    ) -> PyResult<R> {
        let this = slf.get();
        let mut book = try_locked(&this.inner, "the page book")?;
        let rows = this.rows.bind(slf.py()).get();
        let mut rows = try_locked(rows.inner(), "the block rows")?;
        let mut engine = Vllm { py: slf.py(), refs: &this.refs };
        f(&mut book, &mut rows, &mut engine).raise()
    }

    fn read<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&CorePageBook<Py<PyAny>>, &CoreBlockRows) -> R,
    ) -> PyResult<R> {
        let book = try_locked(&self.inner, "the page book")?;
        let rows = try_locked(self.rows.bind(py).get().inner(), "the block rows")?;
        Ok(f(&book, &rows))
    }

    fn with<R>(&self, f: impl FnOnce(&mut CorePageBook<Py<PyAny>>) -> R) -> PyResult<R> {
        let mut book = try_locked(&self.inner, "the page book")?;
        Ok(f(&mut book))
    }
}

fn page(v: &Bound<'_, PyAny>) -> PyResult<u32> {
    int(v, "page")
}

/// ``(request, tokens)`` pairs, each with the Python object it was read from.
fn steps<'py>(v: &Bound<'py, PyAny>) -> PyResult<Vec<(Bound<'py, PyAny>, String, u64)>> {
    let mut steps = Vec::new();
    for item in v.try_iter()? {
        let item = item?;
        let (request, tokens): (String, Bound<'py, PyAny>) =
            item.extract().map_err(|_| invalid(format!("a step must be (request, tokens), not {item}")))?;
        let tokens = int(&tokens, "tokens")?;
        steps.push((item, request, tokens));
    }
    Ok(steps)
}

#[pymethods]
impl PageBook {
    /// The book of ``rows`` (the coordinator's ``BlockRows``), its effects made through ``coordinator`` and on
    /// ``gpu_pool`` (which the resident groups share) and ``host_pool``; pages of ``block_size`` tokens, at
    /// most ``max_planned`` transfers planned and not yet sent.
    #[new]
    #[pyo3(signature = (rows, coordinator, reads_host, gpu_pool, host_pool, resident_managers, hot_managers, block_size, max_planned))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        rows: Py<BlockRows>,
        coordinator: Py<PyAny>,
        reads_host: &Bound<'_, PyAny>,
        gpu_pool: &Bound<'_, PyAny>,
        host_pool: &Bound<'_, PyAny>,
        resident_managers: &Bound<'_, PyAny>,
        hot_managers: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        max_planned: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let book =
            CorePageBook::new(int(block_size, "block_size")?, int(max_planned, "max_planned")?).py()?;
        let list = |v: &Bound<'_, PyAny>| -> PyResult<Vec<Py<PyAny>>> {
            v.try_iter()?.map(|item| item.map(Bound::unbind)).collect()
        };
        let blocks = |pool: &Bound<'_, PyAny>| -> PyResult<Py<PyList>> {
            let blocks = pool.getattr(intern!(pool.py(), "blocks"))?;
            Ok(blocks
                .cast_into::<PyList>()
                .map_err(|_| invalid("a pool's blocks must be a list".into()))?
                .unbind())
        };
        let resident = list(resident_managers)?;
        if resident.len() != rows.bind(gpu_pool.py()).get().resident_groups() {
            return Err(invalid(format!("{} resident managers for rows of other groups", resident.len())));
        }
        Ok(Self {
            inner: Mutex::new(book),
            rows,
            refs: Refs {
                coordinator,
                reads_host: reads_host
                    .cast::<PySet>()
                    .map_err(|_| invalid("reads_host must be a set".into()))?
                    .clone()
                    .unbind(),
                gpu_blocks: blocks(gpu_pool)?,
                gpu_pool: gpu_pool.clone().unbind(),
                host_blocks: blocks(host_pool)?,
                host_pool: host_pool.clone().unbind(),
                resident,
                hot: list(hot_managers)?,
            },
        })
    }

    /// The request's first ``pages`` host pages are a prefix hit it now holds.
    fn commit_computed(&self, request: &str, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let pages = int(pages, "pages")?;
        self.with(|b| b.commit_computed(request, pages))
    }

    fn record_import(&self, request: &str, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let tokens = int(tokens, "tokens")?;
        self.with(|b| b.record_import(request, tokens))
    }

    /// The tokens of the request's import still being loaded, forgotten (None: none is).
    fn take_import(&self, request: &str) -> PyResult<Option<u64>> {
        self.with(|b| {
            let tokens = b.import_tokens(request);
            b.forget_import(request);
            tokens
        })
    }

    /// Request -> tokens of every import still being loaded.
    fn imports<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let imports: Vec<(String, u64)> =
            self.with(|b| b.imports().map(|(r, t)| (r.to_owned(), t)).collect())?;
        let out = PyDict::new(py);
        for (request, tokens) in imports {
            out.set_item(request, tokens)?;
        }
        Ok(out)
    }

    fn complete_import(slf: &Bound<'_, Self>, request: &str, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let tokens = int(tokens, "tokens")?;
        Self::run(slf, |b, r, e| b.complete_import(r, e, request, tokens))
    }

    /// Plans the page's host copy (a restore: from the host); whether it did.
    fn plan(
        slf: &Bound<'_, Self>,
        request: &str,
        page: &Bound<'_, PyAny>,
        after_forward: &Bound<'_, PyAny>,
        restore: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let (p, after, restore) =
            (self::page(page)?, boolean(after_forward, "after_forward")?, boolean(restore, "restore")?);
        Self::run(slf, |b, r, e| b.plan(r, e, request, p, after, restore))
    }

    /// vLLM's per-step work for each ``(request, tokens computed once the step has run)`` in order
    /// (``PageBook::advance``); returns how many pages were released.
    fn advance(
        slf: &Bound<'_, Self>,
        steps: &Bound<'_, PyAny>,
        reprefill: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let reprefill = int(reprefill, "reprefill")?;
        let parsed: Vec<(String, u64)> = self::steps(steps)?.into_iter().map(|(_, r, t)| (r, t)).collect();
        Self::run(slf, |b, r, e| b.advance(r, e, &parsed, reprefill))
    }

    /// The transfers planned since the last call, in order: ``(id, host block, resident blocks, after_forward,
    /// restore)`` each.
    fn take_planned<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let planned = self.with(|b| b.take_planned())?;
        let items = planned
            .into_iter()
            .map(|p| {
                (p.id, p.host, PyTuple::new(py, p.resident.iter())?, p.after_forward, p.restore)
                    .into_pyobject(py)
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// Transfers planned and not yet sent.
    #[getter]
    fn planned(&self) -> PyResult<usize> {
        self.with(|b| b.planned())
    }

    /// Transfers in flight.
    #[getter]
    fn in_flight(&self) -> PyResult<usize> {
        self.with(|b| b.in_flight())
    }

    #[getter]
    fn next_transfer(&self) -> PyResult<u64> {
        self.with(|b| b.next_transfer())
    }

    /// Every transfer in flight, by id: ``(id, request, page, host block, resident blocks, pins released,
    /// live, detached)`` (live: of the request's live record; detached: a finished request's prefix waits on it).
    fn transfers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let transfers = self.with(|b| b.transfers())?;
        let items = transfers
            .into_iter()
            .map(|t| {
                let resident = PyTuple::new(py, t.resident.iter())?;
                (t.id, &*t.request, t.page, t.host, resident, t.pins_released, t.live, t.detached)
                    .into_pyobject(py)
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, items)
    }

    /// The workers' reports (vLLM's ``enqueued_transfer_counts`` and ``completed_transfer_counts``).
    fn update_transfers(
        slf: &Bound<'_, Self>,
        enqueued: &Bound<'_, PyAny>,
        completed: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let items = |v: &Bound<'_, PyAny>, name: &str| -> PyResult<Vec<(u64, u64)>> {
            match v.cast::<PyDict>() {
                Ok(d) => pairs(&d.items().into_any(), name, ("transfer id", "count")),
                Err(_) => pairs(v, name, ("transfer id", "count")),
            }
        };
        let (enqueued, completed) = (items(enqueued, "enqueued")?, items(completed, "completed")?);
        Self::run(slf, |b, r, e| b.update_transfers(r, e, &enqueued, &completed))
    }

    /// Sets (``payload``: vLLM's ``_PendingPublication``, of ``tokens`` computed) or drops (None) the request's
    /// pending publication.
    #[pyo3(signature = (request, payload, tokens=None))]
    fn set_publication(
        &self,
        request: &str,
        payload: Option<Py<PyAny>>,
        tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let publication = match payload {
            None => None,
            Some(payload) => {
                let tokens = tokens.ok_or_else(|| invalid("a publication needs its tokens".into()))?;
                Some((payload, int(tokens, "tokens")?))
            }
        };
        self.with(|b| b.set_publication(request, publication))
    }

    /// ``(durable prefix pages, host pages whose GPU copies are indexed)``, or None for a request with no record.
    fn publication_facts(&self, request: &str) -> PyResult<Option<(usize, usize)>> {
        self.with(|b| b.publication_facts(request))
    }

    fn publish_if_ready(slf: &Bound<'_, Self>, request: &str) -> PyResult<()> {
        Self::run(slf, |b, r, e| b.publish_if_ready(r, e, request))
    }

    /// Adopts the GPU copies of the request's prefix-hit pages; ``done`` ends its adoption. Returns how many
    /// blocks were adopted.
    fn adopt(slf: &Bound<'_, Self>, request: &str, done: &Bound<'_, PyAny>) -> PyResult<usize> {
        let done = boolean(done, "done")?;
        Self::run(slf, |b, r, e| b.adopt(r, e, request, done))
    }

    /// The request's clean pinned pages outside its tail, increasing.
    fn releasable(&self, py: Python<'_>, request: &str) -> PyResult<Vec<u32>> {
        self.read(py, |b, r| b.releasable(r, request))
    }

    /// Releases ``pages`` in this order (those that can be); returns how many were.
    fn unpin(slf: &Bound<'_, Self>, request: &str, pages: &Bound<'_, PyAny>) -> PyResult<usize> {
        let pages = crate::args::ints::<u32>(pages, "pages")?;
        Self::run(slf, |b, r, e| b.unpin(r, e, request, &pages))
    }

    /// vLLM's pool handed out ``block`` (a ``KVCacheBlock``, or its id): what the callback of every release
    /// (the coordinator's ``_on_block_reused``) reports.
    fn block_reused(slf: &Bound<'_, Self>, block: &Bound<'_, PyAny>) -> PyResult<()> {
        let id: u32 = match block.getattr_opt(intern!(slf.py(), "block_id"))? {
            Some(id) => int(&id, "block_id")?,
            None => int(block, "block")?,
        };
        Self::run(slf, |b, r, e| b.block_reused(r, e, id))
    }

    /// The residency updates the workers lack for ``requests``: ``(request, pages, block ids by group)`` for
    /// each that has one, block ids ``null`` where a group reads the page from the host.
    fn residency_updates<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyAny>,
        null: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let null: u32 = int(null, "null")?;
        let names = crate::args::strings(requests, "requests")?;
        let (updates, ids, groups) = Self::run(slf, |b, r, _| {
            let updates = b.residency_updates(r, names.iter().map(String::as_str));
            let ids: Vec<Vec<u32>> = updates
                .iter()
                .map(|(i, pages)| {
                    r.blocks_at(&names[*i], &pages.iter().map(|&p| p as usize).collect::<Vec<_>>())
                })
                .collect();
            Ok((updates, ids, r.groups()))
        })?;
        let mut out = Vec::with_capacity(updates.len());
        for ((i, pages), ids) in updates.into_iter().zip(ids) {
            let filled = |g: usize| {
                ids.iter().skip(g).step_by(groups).map(|&id| if id == HOST_ONLY { null } else { id })
            };
            let lists = (0..groups).map(|g| PyList::new(py, filled(g))).collect::<PyResult<Vec<_>>>()?;
            out.push(
                (names[i].as_str(), PyList::new(py, pages)?, PyTuple::new(py, lists)?).into_pyobject(py)?,
            );
        }
        PyList::new(py, out)
    }

    /// The ``(request, tokens)`` steps of ``requests`` with bookkeeping to do (``PageBook::needs_work``).
    fn with_work<'py>(
        slf: &Bound<'py, Self>,
        requests: &Bound<'py, PyAny>,
        reprefill: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let reprefill = int(reprefill, "reprefill")?;
        let steps = self::steps(requests)?;
        let busy = Self::run(slf, |b, r, e| {
            let mut busy = Vec::with_capacity(steps.len());
            for (_, request, tokens) in &steps {
                busy.push(b.needs_work(r, e, request, *tokens, reprefill)?);
            }
            Ok(busy)
        })?;
        PyList::new(
            slf.py(),
            steps.into_iter().zip(busy).filter(|(_, busy)| *busy).map(|((item, ..), _)| item),
        )
    }

    /// The step end below which the request needs no bookkeeping (``PageBook::quiet_below``).
    fn quiet_below(&self, py: Python<'_>, request: &str, reads_host: bool, reprefill: u64) -> PyResult<u64> {
        self.read(py, |b, r| b.quiet_below(r, request, reads_host, reprefill))
    }

    /// Marks each of ``requests`` quiet in the rows below the step end it needs no bookkeeping under
    /// (``reads_host``: the requests known to read through their hot regions).
    fn settle(
        slf: &Bound<'_, Self>,
        requests: &Bound<'_, PyAny>,
        reads_host: &Bound<'_, PyAny>,
        reprefill: u64,
    ) -> PyResult<()> {
        let mut marks = Vec::new();
        for request in requests.try_iter()? {
            let request = request?;
            let name: String = request.extract()?;
            marks.push((reads_host.contains(&request)?, name));
        }
        Self::run(slf, |b, r, _| {
            for (reads_host, request) in &marks {
                let below = b.quiet_below(r, request, *reads_host, reprefill);
                if below > 0 {
                    r.quiet(request, below);
                }
            }
            Ok(())
        })
    }

    /// The request is freed (finished or preempted).
    fn free(slf: &Bound<'_, Self>, request: &str) -> PyResult<()> {
        Self::run(slf, |b, r, e| b.free(r, e, request))
    }

    /// Forgets everything (a reset), the detached publications' leases included: the caller gives them back
    /// (``detached``).
    fn forget_all(&self) -> PyResult<()> {
        self.with(|b| b.forget_all())
    }

    /// ``(request, payload)`` of each detached publication (a finished request whose copies are in flight).
    fn detached(&self, py: Python<'_>) -> PyResult<Vec<(String, Py<PyAny>)>> {
        self.with(|b| b.detached().map(|(r, p)| (r.to_owned(), p.clone_ref(py))).collect())
    }

    fn knows(&self, request: &str) -> PyResult<bool> {
        self.with(|b| b.knows(request))
    }

    /// The request's page states as a dict (None without a record): for checks and tests.
    fn pages<'py>(&self, py: Python<'py>, request: &str) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(p) = self.with(|b| b.pages(request))? else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("valid", p.valid)?;
        d.set_item("ready_prefix", p.ready_prefix)?;
        d.set_item("copying", PyDict::from_sequence(&PyList::new(py, p.copying)?.into_any())?)?;
        d.set_item("pinned_clean", p.pinned_clean)?;
        d.set_item("released", p.released)?;
        d.set_item("stale", p.stale)?;
        d.set_item("synced", p.synced)?;
        d.set_item("to_adopt", p.to_adopt)?;
        d.set_item("copies_recorded", p.copies_recorded)?;
        d.set_item("publication", p.publication)?;
        Ok(Some(d))
    }

    /// The requests with a record.
    fn requests(&self) -> PyResult<Vec<String>> {
        self.with(|b| b.requests().map(str::to_owned).collect())
    }

    /// Released block -> the ``(request, page)`` pairs still reading it.
    fn owners<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let owners: Vec<(u32, Vec<(String, u32)>)> = self.with(|b| {
            b.owners()
                .map(|(block, o)| (block, o.iter().map(|(r, p)| (r.to_string(), *p)).collect()))
                .collect()
        })?;
        let out = PyDict::new(py);
        for (block, o) in owners {
            out.set_item(block, o)?;
        }
        Ok(out)
    }

    /// Host block key -> the GPU blocks of its indexed copy.
    fn copies<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let copies: Vec<(Vec<u8>, Vec<u32>)> =
            self.with(|b| b.copies().map(|(h, c)| (h.to_vec(), c.to_vec())).collect())?;
        let out = PyDict::new(py);
        for (hash, blocks) in copies {
            out.set_item(PyBytes::new(py, &hash), PyTuple::new(py, blocks)?)?;
        }
        Ok(out)
    }

    /// Indexed GPU block -> the key of the copy it holds.
    fn copy_keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let keys: Vec<(u32, Vec<u8>)> =
            self.with(|b| b.copy_keys().map(|(block, h)| (block, h.to_vec())).collect())?;
        let out = PyDict::new(py);
        for (block, hash) in keys {
            out.set_item(block, PyBytes::new(py, &hash))?;
        }
        Ok(out)
    }

    fn __len__(&self) -> PyResult<usize> {
        self.with(|b| b.len())
    }
}
