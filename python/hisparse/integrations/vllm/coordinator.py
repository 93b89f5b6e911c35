"""hisparse's residency policy as vLLM 0.33's ``HiSparseCoordinator`` (scheduler process).

The bookkeeping is vLLM's, run in the core (pages dirty -> copying -> clean -> released -> lost when the pool
reuses the block, publication of host prefixes, adoption of GPU copies, spills and imports: ``PageBook``, under
:class:`~.bookkeeping.Bookkeeping`). We override the decisions that are policy (package docstring):

``_without_region``   when a request moves to reading through a hot region. vLLM: as soon as the pool runs
                      low (or the request fills its admission window). Here, under ``coldest``: the same
                      triggers, but a low pool moves a request only if its releasable pages free more blocks
                      than its hot region costs (``PoolPolicy.transition``). Filling the admission window
                      moves it (pinned pages past the window could outgrow the pool), unless a region could
                      never pay for itself: one whose releasable pages, at its longest, never free more
                      blocks than the region costs keeps every page resident, counted so at admission (vLLM
                      moves it, to peak at its window and the region, more than its pages). Either waits
                      until the pool can grant the region and the request's next step's blocks: vLLM would
                      preempt for them, and a request running alone preempts itself and starts over.
``_release_order``    the order clean pages are released in, which is the order vLLM's FIFO free queue
                      reuses them: vLLM's is newest first; ``coldest`` is the core's order from the last
                      heat summary (its coldest pages, then the unlisted oldest first, then its hottest).
``admit``             (new) admission headroom, asked through the connector's ``get_num_new_matched_tokens``
                      (an answer of None makes vLLM leave the request waiting this step): a new request is
                      admitted only while the pool keeps, after its peak need (every indexer page, its
                      admission window of resident pages and one chunk more, its hot region), the hot regions
                      owed to requests already asked to transition, one more hot region while a running
                      request has none, and room to grow (a page for every running request that keeps its
                      pages, an indexer block for every one reading through its hot region, whose pages go
                      back as they are copied, and one page for those together). vLLM admits against unpinned
                      pages as if they were free, then preempts running requests when their hot regions and
                      tail pages do not fit. A deferred admission counts as a low pool for this step's
                      transitions, so requests worth moving free room for the waiting one, and the rest of the
                      queue waits behind it (vLLM's first come, first served). A request too short ever to
                      take a hot region is counted without one, its prefix hit as resident pages. Once a
                      connector beside hisparse has loaded into the host pool, the prefix the pool holds
                      counts as a hit (``loadable_prefix``): that connector loads the rest back.
``bind``              (new) a short request admitted on a prefix hit is restored whole to resident pages
                      (``restore.WholeRestores``) where vLLM gives it a hot region.
``report_heat``       (new) a heat summary from the workers (``heat.HeatReport``, the core's ``HeatSummary``):
                      the release order of the requests it lists, from then on. Pages released already keep
                      their place in vLLM's free queue: reordering them by each summary measured no fewer
                      host reads (``pool_policy.rs``).

``fifo`` overrides nothing: it is :class:`~.bookkeeping.Bookkeeping`, this class's base, whose decisions are
all vLLM's (the parity test checks it step by step) and whose state (vLLM's block rows and page lifecycle)
lives in the core. ``build_coordinator`` picks the class once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.v1.hisparse.types import ACTIVE_TAIL_PAGES

from ..._core import PoolPolicy
from ...errors import ConfigError, InvalidArgumentError
from .bookkeeping import Bookkeeping
from .heat import HeatReport
from .restore import WholeRestores

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

def longest_tokens(request) -> int | None:
    """The most tokens a vLLM request can reach (prompt + max_tokens), or None when that is not bounded."""
    return None if request.max_tokens is None else request.num_prompt_tokens + request.max_tokens


def slots_past_end(vllm_config) -> int:
    """The KV slots vLLM allocates past a request's last token, with speculative decoding: a step's drafts and
    lookahead, as its scheduler bounds a request's full sequence (``Scheduler._request_remaining_blocks``), and
    under async scheduling the drafts of the step still in flight too, which it counts computed already (a step
    is scheduled while two tokens remain). 0 without drafts."""
    spec = vllm_config.num_speculative_tokens
    if not spec:
        return 0
    in_flight = spec if vllm_config.scheduler_config.async_scheduling is not False else 0  # None: not yet known
    return 1 + spec + vllm_config.num_lookahead_tokens + in_flight

logger = logging.getLogger(__name__)

class HisparseCoordinator(Bookkeeping):
    """vLLM's bookkeeping with hisparse's ``coldest`` decisions (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # the resident groups share one pool, whose free blocks we count
        self.hot_cost = sum(manager.blocks_per_request for manager in self.hot_managers)
        # The release order, and the admission and transition decisions on this pool's counts (pool_policy.rs).
        self.order = PoolPolicy(
            block_size=self.resident_managers[0].block_size if self.resident_managers else 0,
            blocks_per_page=len(self.resident_managers), hot_blocks=self.hot_cost,
            admission_pages=min((m.max_admission_blocks_per_request for m in self.resident_managers), default=0),
            tail_pages=ACTIVE_TAIL_PAGES, low_watermark=self.transition_watermark)
        # vLLM's token budget per step, the longest prefill chunk (set by the connector), and each request's
        # tokens computed once this step has run (advance_scheduled): what its next step allocates.
        self.chunk_tokens = 0
        # KV slots vLLM allocates past a request's last token (set by the connector: ``slots_past_end``). A
        # request is short only if its rows, these slots included, never free enough to pay for a region.
        self.slots_past_end = 0
        self._step_ends: dict[str, int] = {}
        # Short requests admitted on a prefix hit, restored whole rather than given a hot region (bind).
        self.restores: WholeRestores | None = None
        # vLLM's KV cache coordinator (bind), and whether a connector has loaded into the host pool yet.
        self._pools = None
        self._external_loads = False

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind(kv_cache_manager)
        self._pools = kv_cache_manager.coordinator
        if self.hot_managers:
            self.restores = WholeRestores(self, kv_cache_manager, self._is_short)

    def _longest(self, request) -> int | None:
        """The most KV slots ``request`` can hold (``longest_tokens`` and the slots past its end), or None."""
        longest = longest_tokens(request)
        return None if longest is None else longest + self.slots_past_end

    def _is_short(self, request) -> bool:
        return self._never_takes_hot_region(self._longest(request))

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        super().record_pending_host_import(request_id, num_tokens)
        self._external_loads = True

    def loadable_prefix(self, request) -> int:
        """The tokens of ``request``'s prefix HiSparse's host pool holds, once another connector has loaded
        into the pool (vLLM's ``OffloadingConnector`` beside HiSparse loads back the groups HiSparse does not
        hold, the indexer keys, up to that prefix: ``_max_loadable_tokens``); 0 before, or with no such hit.
        ``MultiConnector`` asks hisparse first, so a later turn whose indexer keys left the GPU reaches
        :meth:`admit` with no local hit, and would be counted as a whole new prefill (an admission window of
        resident pages and a chunk more) where it needs a hot region, its indexer blocks and its new pages."""
        return self.host_prefix_tokens(request) if self._external_loads else 0

    def host_prefix_tokens(self, request) -> int:
        """The tokens of ``request``'s prefix whose pages HiSparse's host pool holds published (their copies
        complete), as vLLM's prefix cache finds them."""
        if not request.block_hashes or self.host_group_id is None:
            return 0
        find = getattr(self._pools, "find_longest_cache_hit_per_group", None)
        if find is None:
            return 0
        return find(request.block_hashes, request.num_tokens - 1)[1][self.host_group_id]

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        super().complete_host_import(request_id, num_computed_tokens)
        if self.restores is not None and request_id in self.restores.requests:
            self.restores.restore(request_id, -(-num_computed_tokens // self.restores.block_size))

    # ------------------------------------------------------------------ when to take a hot region

    def _without_region(self, request_id: str, released: int) -> None:
        pages = len(self.resident_managers[0].req_to_blocks.get(request_id, ()))
        request = self.requests.get(request_id)
        # Its tokens computed once this step has run, and those left past them (a request resumed after a
        # preemption prefills its outputs too): the core counts the blocks its next step allocates.
        end = self._step_ends.get(request_id, 0 if request is None else request.num_computed_tokens)
        left = 0 if request is None else max(0, request.num_tokens - end)
        decision = self.order.transition(self._fills_admission_window(request_id), self.gpu_pool.get_num_free_blocks(),
                                         pages, released, end, left, self.chunk_tokens,
                                         None if request is None else self._longest(request))
        if decision != "take":
            if decision != "stay":
                self.counters[f"transitions_{decision}"] += 1
            return
        self.counters["transitions"] += 1
        for manager in self.hot_managers:
            manager.require_hot(request_id)

    # ------------------------------------------------------------------ admission headroom

    def admit(self, request, num_computed_tokens: int, admission_tokens: int, can_wait: bool = True) -> bool:
        """Whether the waiting vLLM ``request``, ``num_computed_tokens`` of it a local prefix hit, may start now,
        its prompt being scheduled ``admission_tokens`` at a time (module docstring). Yes in an engine with no
        request holding blocks (which could never make room).
        Once one request is refused, every later one waits behind it until the next ``schedule()``
        (``AdmissionPass`` in ``pool_policy.rs``: vLLM's waiting queue stays first come, first served).
        ``can_wait`` is false for a request vLLM starts whatever we answer: its refusal is counted apart."""
        admitted = self._admits(request, num_computed_tokens, admission_tokens, can_wait)
        if self.restores is not None and (admitted or not can_wait):
            self.restores.expect(request)  # vLLM allocates for it later in this pass
        return admitted

    def _admits(self, request, num_computed_tokens: int, admission_tokens: int, can_wait: bool) -> bool:
        num_running = len(self.resident_managers[0].req_to_blocks) if self.resident_managers else 0
        if num_running == 0:
            return True
        if self.order.admitting():  # no request refused before it in this pass
            if can_wait and (loadable := self.loadable_prefix(request)) > num_computed_tokens:
                num_computed_tokens = loadable  # loaded back beside us
                self.counters["admissions_counting_loads"] += 1
            if self._admit(request.num_tokens, num_computed_tokens, admission_tokens, num_running,
                           self._longest(request)):
                return True
        self.counters["admissions_deferred" if can_wait else "admissions_forced"] += 1
        return False

    def _never_takes_hot_region(self, longest: int | None) -> bool:
        """Whether a request that never grows past ``longest`` tokens (None: unbounded) can never be moved to a
        hot region (``_without_region``; ``PoolShape::never_takes_hot_region``). Short requests are most
        requests; no region need be kept for them."""
        return longest is not None and self.order.never_takes_hot_region(longest)

    def _may_take_hot_region(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        return request is None or not self._is_short(request)

    def _admit(self, num_tokens: int, num_computed_tokens: int, admission_tokens: int,
               num_running: int, longest: int | None) -> bool:
        """The core's admission (``AdmissionPass::admit``) on the counts ``PoolShape::has_headroom`` decides on,
        gathered from vLLM's managers. Asked for each admission until one is refused in the pass (under
        pressure, once a pass), so it reads only the requests not known to read through their hot regions
        (under pressure, few): one that does holds every region whole until it is freed
        (``_can_read_from_host``), so it owes no block and reads from the host. vLLM keeps every request it
        asked for a region in ``hot_required`` until it is freed (those restored whole, which never hold one,
        leave it earlier: ``restore.py``)."""
        reads_host = self._reads_host
        owed = sum(manager.get_num_required_blocks(rid) for manager in self.hot_managers
                   for rid in manager.hot_required - reads_host)
        running = self.resident_managers[0].req_to_blocks
        resident_only = [rid for rid in running.keys() - reads_host if not self._can_read_from_host(rid)]
        reading_host = len(running) - len(resident_only)
        may_take_hot = any(self._may_take_hot_region(rid) for rid in resident_only)
        return self.order.admit(num_tokens, num_computed_tokens, admission_tokens, longest,
                                free_blocks=self.gpu_pool.get_num_free_blocks(), running=num_running,
                                reading_host=reading_host, owed_hot_blocks=owed, may_take_hot=may_take_hot)

    def advance_scheduled(self, requests) -> None:
        # The connector's last call of a schedule pass (``build_connector_meta``): the pass's state ends here.
        self._step_ends = dict(requests)
        super().advance_scheduled(self._step_ends.items())
        self.order.end_pass()
        if self.restores is not None:
            self.restores.end_pass()

    # ------------------------------------------------------------------ release (= reuse) order

    def _release_order(self, request_id: str, pages: list[int]) -> list[int]:
        return self.order.release_order(request_id, pages)

    def report_heat(self, report: HeatReport) -> None:
        """A heat summary from the workers (``heat.py``): the release order of each request it lists, until
        the next summary lists it (``PoolPolicy.report``). A request freed since the summary was taken (a
        step in flight, async scheduling) is forgotten at once."""
        try:
            self.order.report(report.summary, list(report.request_ids))
        except InvalidArgumentError as e:
            # Heat only orders releases; a summary the core refuses must not take vLLM's engine down.
            logger.warning("hisparse: a heat summary from the workers was refused: %s", e)
            self.counters["heat_refused"] += 1
            return
        self.counters["heat_summaries"] += 1
        for request_id in report.request_ids:
            if not self.book.knows(request_id):
                self.order.forget(request_id)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.order.forget(request_id)
        if self.restores is not None:
            self.restores.forget(request_id)


#: The coordinator class of each ``policy``.
COORDINATORS: dict[str, type[Bookkeeping]] = {"coldest": HisparseCoordinator, "fifo": Bookkeeping}
POLICIES = tuple(COORDINATORS)


def build_coordinator(kv_cache_manager: KVCacheManager, policy: str) -> Bookkeeping:
    """What ``get_hisparse_coordinator`` (``v1/hisparse/coordinator.py:900``) builds, with the ``policy``'s class
    (:data:`COORDINATORS`)."""
    if policy not in COORDINATORS:
        raise ConfigError(f"policy must be one of {POLICIES}, not {policy!r}")
    managers = tuple(kv_cache_manager.coordinator.single_type_managers)
    for manager in managers:
        existing = getattr(manager, "coordinator", None)
        if existing is not None:
            if type(existing) is not COORDINATORS[policy]:
                raise ConfigError(f"another HiSparse coordinator ({type(existing).__name__}) is already bound to "
                                  "this KV cache manager")
            return existing
    coordinator = COORDINATORS[policy](
        kv_cache_manager.kv_cache_config,
        managers,
        kv_cache_manager.max_model_len,
        num_reprefillable_tokens=kv_cache_manager.coordinator.num_reprefillable_tokens,
    )
    if coordinator.host_manager is None:
        raise ConfigError("no HiSparse cache group is configured: is the model a DSA model with index_topk?")
    coordinator.bind(kv_cache_manager)
    return coordinator
