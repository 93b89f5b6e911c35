//! `hisparse._core.PublishGate`: the check vLLM's KV cache manager lands on when it asks the HiSparse host group
//! to publish a request's pages, for every scheduled request every step. Most of those calls can publish
//! nothing new: the request's page count is the one its coordinator last found so (`_publishes_nothing`),
//! marked here. The gate's `cache_blocks` answers those without a Python frame and hands the others to the
//! coordinator's `publish_when_ready`.
//!
//! vLLM calls between its allocations for each request, so whatever the gate reads is cold by then: reading
//! the mark by request id (the request's attribute, then a dict entry and its value) took about 0.3 us a call
//! at 128 requests (timed inside the gate in a probe build, over `benches/vllm_step.py`'s trace). vLLM asks for the same requests in the same order pass after
//! pass, so the gate keeps the last pass's requests in call order with the handle of each one's mark
//! (`hisparse_core::slab`): a call at the position where the last pass had the same request object reads its
//! mark through the handle, in a dense vector, without reading the request.

use std::sync::Mutex;

use hisparse_core::slab::{Handle, NamedSlab};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use pyo3::{PyTraverseError, PyVisit};

use crate::args::int;
use crate::errors::invalid;

#[derive(Default)]
struct Marks {
    /// Request id -> the page count its publication was found to publish nothing at.
    pages: NamedSlab<u64>,
    /// The requests of the calls of the last pass, and of this one so far, in call order, each with its
    /// mark's handle when it had one. Holding the requests keeps them alive, so a request at the same address
    /// is the same request; each is let go once a pass no longer calls for it at its place (`end_pass`, which
    /// the connector calls at the end of every schedule pass).
    calls: Vec<(Py<PyAny>, Option<Handle>)>,
    /// Calls so far in this pass.
    made: usize,
}

#[pyclass(frozen, module = "hisparse._core")]
pub struct PublishGate {
    marks: Mutex<Marks>,
    page_tokens: u64,
    /// Whose `publish_when_ready` runs otherwise, looked up at each call (it may be wrapped).
    owner: Py<PyAny>,
}

impl PublishGate {
    /// ``owner.publish_when_ready`` with vLLM's arguments.
    fn publish(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        retention_interval: Option<&Bound<'_, PyAny>>,
        replay_boundaries: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let kwargs = PyDict::new(py);
        kwargs.set_item(intern!(py, "replay_boundaries"), replay_boundaries)?;
        self.owner
            .bind(py)
            .getattr(intern!(py, "publish_when_ready"))?
            .call((request, num_tokens, retention_interval), Some(&kwargs))?;
        Ok(())
    }
}

#[pymethods]
impl PublishGate {
    /// A gate for pages of ``page_tokens`` tokens, falling through to ``owner.publish_when_ready``.
    #[new]
    fn new(page_tokens: &Bound<'_, PyAny>, owner: Bound<'_, PyAny>) -> PyResult<Self> {
        let page_tokens = int::<u64>(page_tokens, "page_tokens")?;
        if page_tokens == 0 {
            return Err(invalid("page_tokens must be positive".into()));
        }
        Ok(Self { marks: Mutex::default(), page_tokens, owner: owner.unbind() })
    }

    /// vLLM's ``cache_blocks`` of the host group: nothing when ``request`` is marked with ``num_tokens``' page
    /// count, else ``owner.publish_when_ready`` with the same arguments.
    #[pyo3(signature = (request, num_tokens, retention_interval=None, *, replay_boundaries))]
    fn cache_blocks(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_tokens: &Bound<'_, PyAny>,
        retention_interval: Option<&Bound<'_, PyAny>>,
        replay_boundaries: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let pages = int::<u64>(num_tokens, "num_tokens")? / self.page_tokens;
        // Nothing Python runs while the marks are locked (reading the id, the owner's call, freeing a request
        // let go): it may call back into the gate.
        let unknown = {
            let mut marks = crate::locked(&self.marks);
            let position = marks.made;
            marks.made += 1;
            let marked = match marks.calls.get(position) {
                Some((last, Some(handle))) if last.as_ptr() == request.as_ptr() => {
                    marks.pages.by_handle(*handle).copied()
                }
                _ => None, // another request there, or no mark then or since: read by id
            };
            match marked {
                Some(marked) if marked == pages => return Ok(()),
                Some(_) => None,
                None => Some(position),
            }
        };
        if let Some(position) = unknown {
            let id = request.getattr(intern!(py, "request_id"))?;
            let id = id.cast::<PyString>()?.to_str()?;
            let (known, let_go) = {
                let mut marks = crate::locked(&self.marks);
                let found = marks.pages.find(id);
                let known = found.is_some_and(|(_, &marked)| marked == pages);
                let entry = (request.clone().unbind(), found.map(|(handle, _)| handle));
                let let_go = if position < marks.calls.len() {
                    Some(std::mem::replace(&mut marks.calls[position], entry))
                } else {
                    // The pass's calls up to here, or fewer if it ended meanwhile: nothing else to replace.
                    (position == marks.calls.len()).then(|| marks.calls.push(entry));
                    None
                };
                (known, let_go)
            };
            drop(let_go);
            if known {
                return Ok(());
            }
        }
        self.publish(py, request, num_tokens, retention_interval, replay_boundaries)
    }

    /// ``request_id`` publishes nothing until its page count is other than ``pages``.
    fn mark(&self, request_id: &str, pages: &Bound<'_, PyAny>) -> PyResult<()> {
        let pages = int::<u64>(pages, "pages")?;
        *crate::locked(&self.marks).pages.get_or_insert_with(request_id, || pages) = pages;
        Ok(())
    }

    /// ``request_id``'s next call goes to ``publish_when_ready`` whatever its page count.
    fn unmark(&self, request_id: &str) {
        crate::locked(&self.marks).pages.remove(request_id);
    }

    /// Every request's next call goes to ``publish_when_ready``.
    fn unmark_all(&self) {
        crate::locked(&self.marks).pages.clear();
    }

    /// The schedule pass ended: the next call is the next pass's first. The requests of calls this pass
    /// did not make again are let go.
    fn end_pass(&self) {
        let let_go = {
            let mut marks = crate::locked(&self.marks);
            let made = std::mem::take(&mut marks.made).min(marks.calls.len());
            marks.calls.split_off(made)
        };
        drop(let_go); // unlocked (cache_blocks)
    }

    /// The page count ``request_id`` is marked with, if any.
    fn marked(&self, request_id: &str) -> Option<u64> {
        crate::locked(&self.marks).pages.get(request_id).copied()
    }

    fn __len__(&self) -> usize {
        crate::locked(&self.marks).pages.len()
    }

    /// The coordinator holds its gate and the gate its coordinator, and the requests of the last pass: the
    /// collector follows these. (Never locked when the collector runs: nothing Python runs under the lock.)
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.owner)?;
        if let Ok(marks) = self.marks.try_lock() {
            for (request, _) in &marks.calls {
                visit.call(request)?;
            }
        }
        Ok(())
    }
}
