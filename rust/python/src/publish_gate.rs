//! `hisparse._core.PublishGate`: the check vLLM's KV cache manager lands on when it asks the HiSparse host group
//! to publish a request's pages, for every scheduled request every step. Most of those calls can publish
//! nothing new: the request's page count is the one its coordinator last found so (`_publishes_nothing`,
//! kept in a dict it owns). The gate's `cache_blocks` answers those without a Python frame and hands the
//! others to the coordinator's `publish_when_ready`.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args::int;
use crate::errors::invalid;

#[pyclass(frozen, module = "hisparse._core")]
pub struct PublishGate {
    /// Request id -> the page count found to publish nothing (the coordinator's, shared).
    published: Py<PyDict>,
    page_tokens: u64,
    /// Whose `publish_when_ready` runs otherwise, looked up at each call (it may be wrapped).
    owner: Py<PyAny>,
}

#[pymethods]
impl PublishGate {
    /// A gate over ``published`` for pages of ``page_tokens`` tokens, falling through to
    /// ``owner.publish_when_ready``.
    #[new]
    fn new(
        published: Bound<'_, PyDict>,
        page_tokens: &Bound<'_, PyAny>,
        owner: Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let page_tokens = int::<u64>(page_tokens, "page_tokens")?;
        if page_tokens == 0 {
            return Err(invalid("page_tokens must be positive".into()));
        }
        Ok(Self { published: published.unbind(), page_tokens, owner: owner.unbind() })
    }

    /// vLLM's ``cache_blocks`` of the host group: nothing when ``published[request.request_id]`` is
    /// ``num_tokens``' page count, else ``owner.publish_when_ready`` with the same arguments.
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
        let request_id = request.getattr(intern!(py, "request_id"))?;
        if let Some(known) = self.published.bind(py).get_item(&request_id)? {
            if known.extract::<u64>().is_ok_and(|known| known == pages) {
                return Ok(());
            }
        }
        let kwargs = PyDict::new(py);
        kwargs.set_item(intern!(py, "replay_boundaries"), replay_boundaries)?;
        self.owner
            .bind(py)
            .getattr(intern!(py, "publish_when_ready"))?
            .call((request, num_tokens, retention_interval), Some(&kwargs))?;
        Ok(())
    }
}
