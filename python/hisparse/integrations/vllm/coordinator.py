"""hisparse's residency policy as vLLM 0.33's ``HiSparseCoordinator`` (scheduler process).

vLLM's coordinator keeps the bookkeeping we keep too (pages dirty -> clean -> unpinned -> lost when the pool
reuses the block, publication of host prefixes, adoption of GPU copies, spills and imports). We override
the decisions that are policy (package docstring):

``update_residency``  when a request moves to reading through a hot region. vLLM: as soon as the pool runs
                      low (or the request fills its admission window). Here, under ``coldest``: the same
                      triggers, but a low pool moves a request only if its releasable pages free more blocks
                      than its hot region costs (``PoolPolicy.transition``), and only once the pool
                      can grant the region without vLLM preempting anyone. Filling the admission window
                      still always moves it: pinned pages past the window could outgrow the pool.
``_unpin_clean_pages`` the order clean pages are released in, which is the order vLLM's FIFO free queue
                      reuses them: vLLM's is newest first; ``coldest`` is the core's order from the last
                      heat summary (its coldest pages, then the unlisted oldest first, then its hottest).
``admit``             (new) admission headroom, asked through the connector's ``get_num_new_matched_tokens``
                      (an answer of None makes vLLM leave the request waiting this step): a new request is
                      admitted only while the pool keeps, after its peak need (every indexer page, two
                      admission windows of resident pages, its hot region), the hot regions owed to requests
                      already asked to transition, one more hot region while a running request has none,
                      and room to grow (a page for every running request that keeps its pages, an indexer
                      block for every one reading through its hot region, whose pages go back as they are
                      copied, and one page for those together). vLLM admits against unpinned pages
                      as if they were free, then preempts running requests when their hot regions and
                      tail pages do not fit. A deferred admission counts as a low pool for this step's
                      transitions, so requests worth moving free room for the waiting one, and the rest of
                      the queue waits behind it (vLLM's first come, first served). A request too short ever
                      to take a hot region is counted without one.
``report_heat``       (new) a heat summary from the workers (``heat.HeatReport``, the core's ``HeatSummary``):
                      the released pages it found never selected move to the front of vLLM's free queue,
                      its hottest to the back, so the pool reuses never-selected pages first and the hottest
                      last.

``fifo`` overrides nothing: every decision is vLLM's, which is what the parity test checks step by step.

Not policy, and under either: ``forget_worker_state`` (run before vLLM's pool reset and by the connector's
``reset_cache``) lets ``Scheduler.reset_prefix_cache(reset_running_requests=True, ...)`` succeed with
transfers in flight, vLLM's recovery when a worker died and was replaced (vLLM's own coordinator keeps their
pins until a dead worker reports them, so the reset raises).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import TYPE_CHECKING

from vllm.v1.hisparse.coordinator import HiSparseCoordinator
from vllm.v1.hisparse.types import ACTIVE_TAIL_PAGES, SparseKVRowMirror

from ..._core import PoolPolicy
from ...errors import ConfigError, InvalidArgumentError
from .heat import HeatReport

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

POLICIES = ("coldest", "fifo")


def longest_tokens(request) -> int | None:
    """The most tokens a vLLM request can reach (prompt + max_tokens), or None when that is not bounded."""
    return None if request.max_tokens is None else request.num_prompt_tokens + request.max_tokens

logger = logging.getLogger(__name__)

#: Released pages a step moves in vLLM's free queue for heat (each page: one block per resident group). A
#: summary lists up to 160 pages per request; moved at once, it made its step several times the median
#: (``benches/vllm_step.py``); this many per step spread it over a few steps of a summary interval.
HEAT_MOVES_PER_STEP = 1024


class HisparseCoordinator(HiSparseCoordinator):
    """``HiSparseCoordinator`` with hisparse's policy (module docstring)."""

    def __init__(self, *args, policy: str = "coldest", **kwargs) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, not {policy!r}")
        super().__init__(*args, **kwargs)
        self.policy = policy
        self.blocks_per_page = len(self.resident_managers)
        self.hot_cost = sum(manager.blocks_per_request for manager in self.hot_managers)
        # The release order, and the admission and transition decisions on this pool's counts (pool_policy.rs).
        self.order = PoolPolicy(
            block_size=self.resident_managers[0].block_size if self.resident_managers else 0,
            blocks_per_page=self.blocks_per_page, hot_blocks=self.hot_cost,
            admission_pages=min((m.max_admission_blocks_per_request for m in self.resident_managers), default=0),
            tail_pages=ACTIVE_TAIL_PAGES, low_watermark=self.transition_watermark)
        self.counters: Counter[str] = Counter()
        # Set when an admission was deferred during this schedule(); read by this step's transitions.
        self._deferred = False
        # Requests known to hold their hot regions (``_can_read_from_host``).
        self._reads_host: set[str] = set()
        # The request last found reading a host-only page (``all_context_pages_resident``).
        self._reads_host_hint: str | None = None
        # vLLM's requests by id (the connector scheduler's map, bound by the connector): their longest lengths.
        self.requests: dict = {}
        # Transfer ids below this were dropped by a reset (``forget_worker_state``); 0: none was.
        self._forgotten_below = 0
        # The latest heat summary's free-queue moves not made yet: (request, pages, to the front), oldest first.
        self._heat_moves: deque[tuple[str, list[int], bool]] = deque()
        self.heat_moves_per_step = HEAT_MOVES_PER_STEP

    # ------------------------------------------------------------------ when to take a hot region

    def update_residency(self, request_id: str) -> None:
        if self.policy == "fifo" or not self.resident_managers:
            return super().update_residency(request_id)
        state = self._get_request_state(request_id)
        if state.pages_to_adopt:
            host_blocks = self.host_manager.req_to_blocks.get(request_id, ())
            self._adopt_copies(request_id, state, host_blocks[: state.pages_to_adopt])
            state.pages_to_adopt = 0
        if self._can_read_from_host(request_id):
            self._unpin_clean_pages(request_id, state)
            return
        pages = len(self.resident_managers[0].req_to_blocks.get(request_id, ()))
        decision = self.order.transition(self._fills_admission_window(request_id), self.gpu_pool.get_num_free_blocks(),
                                         self._deferred, max(0, pages - ACTIVE_TAIL_PAGES - len(state.unpinned_pages)))
        if decision != "take":
            if decision != "stay":
                self.counters[f"transitions_{decision}"] += 1
            return
        self.counters["transitions"] += 1
        for manager in self.hot_managers:
            manager.require_hot(request_id)

    # ------------------------------------------------------------------ admission headroom

    def admit(self, request_id: str, num_tokens: int, num_computed_tokens: int, admission_tokens: int,
              can_wait: bool = True, longest: int | None = None) -> bool:
        """Whether a waiting request of ``num_tokens``, ``num_computed_tokens`` of them a prefix hit, may start
        now, its prompt being scheduled ``admission_tokens`` at a time (module docstring). ``fifo`` always says
        yes, as vLLM does; so does an engine with no request holding blocks (which could never make room).
        Once one request is refused, every later one waits behind it until the next ``schedule()``: vLLM's
        waiting queue stays first come, first served, as when its allocator cannot place the head (a refused
        long request would otherwise be overtaken by every shorter one for as long as they keep coming).
        ``can_wait`` is false for a request vLLM starts whatever we answer: its refusal is counted apart.
        ``longest``: the most tokens the request can reach (prompt + max_tokens), when known."""
        num_running = len(self.resident_managers[0].req_to_blocks) if self.resident_managers else 0
        if self.policy == "fifo" or num_running == 0:
            return True
        short = longest is not None and not num_computed_tokens and self._never_takes_hot_region(longest)
        if not self._deferred and self._has_headroom(num_tokens, num_computed_tokens, admission_tokens,
                                                     num_running, short):
            return True
        self.counters["admissions_deferred" if can_wait else "admissions_forced"] += 1
        self._deferred = True
        return False

    def _never_takes_hot_region(self, longest: int) -> bool:
        """Whether a request that never grows past ``longest`` tokens can never be moved to a hot region
        (``update_residency``; ``PoolShape::never_takes_hot_region``). Short requests are most requests; no
        region need be kept for them."""
        return self.order.never_takes_hot_region(longest)

    def _may_take_hot_region(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        longest = longest_tokens(request) if request is not None else None
        return longest is None or not self._never_takes_hot_region(longest)

    def _has_headroom(self, num_tokens: int, num_computed_tokens: int, admission_tokens: int,
                      num_running: int, short: bool) -> bool:
        """The counts ``PoolShape::has_headroom`` decides on, gathered from vLLM's managers."""
        owed = sum(manager.get_num_required_blocks(rid) for manager in self.hot_managers
                   for rid in manager.hot_required)
        running = self.resident_managers[0].req_to_blocks
        reading_host = sum(1 for rid in running if self._can_read_from_host(rid))
        may_take_hot = any(not self._can_read_from_host(rid) and self._may_take_hot_region(rid) for rid in running)
        return self.order.has_headroom(num_tokens, num_computed_tokens, admission_tokens, short,
                                       free_blocks=self.gpu_pool.get_num_free_blocks(), running=num_running,
                                       reading_host=reading_host, owed_hot_blocks=owed, may_take_hot=may_take_hot)

    def advance_scheduled(self, requests) -> None:
        super().advance_scheduled(requests)
        self._deferred = False

    # ------------------------------------------------------------------ per-step bookkeeping, O(what changed)
    #
    # vLLM's connector runs every per-step scan over every scheduled request; these give the same results
    # while touching only requests whose step changes something (``connector.build_connector_meta`` calls
    # them in vLLM's order; ``tests/test_vllm_integration.py`` compares every metadata field with vLLM's).

    def _can_read_from_host(self, request_id: str) -> bool:
        # Once true it stays true until the request is freed: hot regions are only given back by
        # pop_blocks_for_free, which frees the request here first (free() forgets it).
        if request_id in self._reads_host:
            return True
        if super()._can_read_from_host(request_id):
            self._reads_host.add(request_id)
            return True
        return False

    def with_residency_work(self, requests) -> list[tuple[str, int]]:
        """The ``(request, tokens computed after the step)`` pairs for which ``advance_scheduled`` does
        anything: a sealed page without a host copy planned (``plan_prefix_materialization``'s range is not
        empty), or a residency decision that is not a no-op (a prefix to adopt, clean pages still pinned, or
        no hot region yet). The others are steady decodes already reading through a hot region."""
        if not self.resident_managers:
            return []
        block_size = self.host_manager.block_size
        reprefill = self.num_reprefillable_tokens
        imports = self._pending_imports
        states = self.request_states
        resident = self.resident_managers[0].req_to_blocks
        out = []
        for request_id, num_tokens in requests:
            state = states.get(request_id)
            if state is None:
                out.append((request_id, num_tokens))
                continue
            sealed = max(0, num_tokens - reprefill) // block_size
            first = state.ready_prefix_pages
            if imports:
                first = max(first, -(-imports.get(request_id, 0) // block_size))
            # A clean page still pinned is released only once it leaves the tail (_resident_page_blocks):
            # a pinned page in the tail, the usual case, is no work. Counted by membership, not by iterating
            # the set, whose table keeps the size it had when the request last held many pinned pages.
            pinned = state.pinned_clean
            unpinnable = False
            if pinned:
                pages = len(resident.get(request_id, ()))
                in_tail = sum(page in pinned for page in range(max(0, pages - ACTIVE_TAIL_PAGES), pages))
                unpinnable = len(pinned) > in_tail
            if first < sealed or state.pages_to_adopt or unpinnable or not self._can_read_from_host(request_id):
                out.append((request_id, num_tokens))
        return out

    def row_mirrors(self, requests) -> dict[str, tuple[SparseKVRowMirror, ...]]:
        """``build_row_mirrors`` of each ``(request, first token, tokens)`` on its own, in one pass: what
        vLLM's connector sends per request (one new row per decode step, so this is what changed)."""
        out: dict[str, tuple[SparseKVRowMirror, ...]] = {}
        if not self.resident_managers or self.host_manager is None:
            return {request_id: () for request_id, _, _ in requests}
        block_size = self.resident_managers[0].block_size
        tables = [(m.req_to_blocks, m.residency_changes) for m in self.resident_managers]
        host_tables = self.host_manager.req_to_blocks
        for request_id, start, count in requests:
            host_blocks = host_tables.get(request_id)
            rows = [(blocks.get(request_id), changes.get(request_id)) for blocks, changes in tables]
            if host_blocks is None or any(row is None for row, _ in rows):
                out[request_id] = ()
                continue
            mirrors = []
            position, end = start, start + count
            while position < end:
                page, offset = divmod(position, block_size)
                num_rows = min(block_size - offset, end - position)
                position += num_rows
                sources = []
                for row, changes in rows:
                    if page >= len(row):
                        break
                    block = row[page]
                    if changes:
                        block = changes.get(page, block)
                    if block.is_null:
                        break
                    sources.append(block.block_id * block_size + offset)
                else:
                    if page < len(host_blocks) and not (host := host_blocks[page]).is_null:
                        mirrors.append(SparseKVRowMirror(tuple(sources), host.block_id * block_size + offset,
                                                         num_rows))
            out[request_id] = tuple(mirrors)
        return out

    def all_context_pages_resident(self, requests) -> bool:
        """vLLM's answer (``coordinator.py:676``: every scheduled request has the blocks of its context and reads
        only resident pages), which holds of all the requests together, so their order is free: the request
        last found reading from the host goes first (under pressure it usually still is, and the answer is
        then False at once), and a row is searched for a host-only page without being copied, stopping at the
        first. Requests found fully resident are cached in vLLM's set, as vLLM does."""
        if not self.resident_managers:
            return False
        first = self.resident_managers[0]
        block_size = first.block_size
        requests = list(requests)
        hint = self._reads_host_hint
        at = next((i for i, (request_id, _, _) in enumerate(requests) if request_id == hint), 0) if hint else 0
        if at:
            requests[0], requests[at] = requests[at], requests[0]
        for request_id, num_computed_tokens, num_scheduled_tokens in requests:
            if len(first.req_to_blocks.get(request_id, ())) < -(-(num_computed_tokens + num_scheduled_tokens)
                                                                 // block_size):
                return False
            if request_id in self._resident_requests:
                continue
            if self._has_host_only_page(request_id):
                self._reads_host_hint = request_id
                return False
            self._resident_requests.add(request_id)
        return True

    def _has_host_only_page(self, request_id: str) -> bool:
        """Whether a resident group's row, with its residency changes (``get_residency_row``), holds a null
        block."""
        for manager in self.resident_managers:
            row = manager.req_to_blocks.get(request_id, ())
            changes = manager.residency_changes.get(request_id)
            if changes:
                if any(block.is_null and page < len(row) for page, block in changes.items()):
                    return True
                if any(block.is_null and changes.get(page, block).is_null for page, block in enumerate(row)):
                    return True
            elif any(block.is_null for block in row):
                return True
        return False

    def publish_when_ready(self, request, num_computed_tokens, retention_interval, *, replay_boundaries) -> None:
        # Called for every request after every step. When the durable prefix publishes nothing new, records
        # no new GPU copy and covers every computed page, vLLM's version ends where it began (its pending
        # publication cleared): skip the publication object and the host manager's call.
        manager = self.host_manager
        state = self.request_states.get(request.request_id) if manager is not None else None
        if state is not None and self.resident_managers:
            block_size = manager.block_size
            num_pages = num_computed_tokens // block_size
            ready = state.ready_prefix_pages
            if ready >= num_pages:
                num_tokens = min(num_computed_tokens, ready * block_size)
                hashed = len(request.block_hashes) * manager.block_pool.hash_block_size
                cached = manager.num_cached_block.get(request.request_id, 0)
                host_blocks = manager.req_to_blocks.get(request.request_id)
                recorded = not host_blocks or state.copies_recorded_blocks >= min(num_tokens // block_size,
                                                                                   len(host_blocks))
                if recorded and (not manager.kv_cache_spec.prefix_cacheable
                                 or cached >= min(num_tokens, hashed) // block_size):
                    state.publication = None
                    return
        super().publish_when_ready(request, num_computed_tokens, retention_interval,
                                   replay_boundaries=replay_boundaries)

    # ------------------------------------------------------------------ release (= reuse) order

    def _unpin_clean_pages(self, request_id, state) -> None:
        if self.policy == "fifo":
            return super()._unpin_clean_pages(request_id, state)
        if not state.pinned_clean:
            return
        for page_idx in self.order.release_order(request_id, list(state.pinned_clean)):
            if self._unpin_page(request_id, state, page_idx):
                self.counters["released"] += 1

    def report_heat(self, report: HeatReport) -> None:
        """A heat summary from the workers (``heat.py``): remember it, and queue the moves of each request's
        released pages it found never selected to the front of the free queue (reused first) and of its
        selected hottest to the back (reused last; ``PoolPolicy.report``). Only what the summary lists is looked
        at: O(coldest + hottest) per request. The moves are made by :meth:`move_heat`, a bounded number per
        step, so a summary does not land on one step; a newer summary replaces the moves an older one left."""
        if self.policy == "fifo":
            return
        try:
            moves = self.order.report(report.summary, list(report.request_ids), report.hottest)
        except InvalidArgumentError as e:
            # Heat only orders releases; a summary the core refuses must not take vLLM's engine down.
            logger.warning("hisparse: a heat summary from the workers was refused: %s", e)
            self.counters["heat_refused"] += 1
            return
        self.counters["heat_moves_superseded"] += sum(len(pages) for _, pages, _ in self._heat_moves)
        self._heat_moves.clear()
        for request_id, front, back in moves:
            self._heat_moves.append((request_id, list(front), True))
            self._heat_moves.append((request_id, list(back), False))

    def move_heat(self) -> None:
        """Makes up to ``heat_moves_per_step`` of the queued free-queue moves (pages listed; each moves every
        resident group's block), oldest first; a request finished or preempted since its summary is skipped."""
        budget = self.heat_moves_per_step
        while budget > 0 and self._heat_moves:
            request_id, pages, front = self._heat_moves.popleft()
            if len(pages) > budget:
                self._heat_moves.appendleft((request_id, pages[budget:], front))
                pages = pages[:budget]
            budget -= len(pages)
            state = self.request_states.get(request_id)
            if state is None:  # finished or preempted since the summary was taken
                self.order.forget(request_id)
                continue
            released = state.unpinned_pages
            self._move_released(request_id, [p for p in pages if p in released], front=front)

    def _move_released(self, request_id: str, pages: list[int], *, front: bool) -> None:
        """Moves released pages (every resident group's block), in ``pages`` order, to the front or the back of
        vLLM's free queue. A block that is not in the queue (reused already, or adopted by another request)
        stays where it is; the reuse watcher ``unpin_blocks`` registered stays, so reuse is still noticed."""
        if not pages:
            return
        queue = self.gpu_pool.free_block_queue
        moved = []
        for page_idx in pages:
            for manager in self.resident_managers:
                block = manager.get_resident_page(request_id, page_idx)
                if block is not None and block.ref_cnt == 0 and block.prev_free_block is not None:
                    queue.remove(block)
                    moved.append(block)
        # remove() and the insert below each count the block once: the pool's free count is unchanged.
        if front:
            queue.prepend_n(moved)
        else:
            queue.append_n(moved)
        self.counters["moved_to_front" if front else "moved_to_back"] += len(moved)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._reads_host.discard(request_id)
        self.order.forget(request_id)

    # ------------------------------------------------------------------ a reset: what the workers held is gone

    def forget_worker_state(self) -> bool:
        """Forgets everything the workers were asked to hold or do, for a reset of vLLM's prefix cache
        (``Scheduler.reset_prefix_cache``, vLLM's recovery when the KV its workers hold is gone: a worker
        process that died and was replaced has lost its GPU cache, its pinned host pool, its residency tables
        and hot buffers, and the transfers and host copies it had in flight, which will never be reported).
        vLLM's coordinator keeps those transfers' and copies' pins until a worker reports them, so vLLM's pools
        never count as free and the reset fails (``RuntimeError`` when running requests were preempted for
        it). Here their pins are given back, detached host publications waiting on them are dropped unpublished,
        and the GPU copies indexed for host prefix hits are forgotten: vLLM's reset then clears both pools'
        hashes, so no host prefix and no GPU page the old worker held is read again; every request computes
        its KV anew. Transfer ids are not reused (``next_spill_id`` goes on), so a late report of a dropped
        transfer names no transfer and is ignored (counted in ``late_transfer_reports``). On a live worker
        (a reset after a weight update), the dropped transfers were submitted in earlier steps, which vLLM's
        worker orders before the next steps' host writes (``host_write_event``).

        Only once every block in use is held by these pins alone (every running request preempted or finished,
        and no block free deferred behind a step in flight): otherwise vLLM's reset fails anyway, and nothing
        changes here; returns whether it forgot (True also when there was nothing to forget)."""
        if self.host_manager is None or any(manager.req_to_blocks for manager in self.managers):
            return False
        host_pool = self.host_manager.block_pool
        gpu_pins: Counter[int] = Counter()
        host_pins: Counter[int] = Counter()
        detached = {}  # a finished request's publication, shared by its transfers: leased once
        for pending in self.pending_spills.values():
            if not pending.enqueue_applied:
                gpu_pins.update(block.block_id for block in pending.resident_blocks)
            host_pins[pending.host_block.block_id] += 1
            publication = pending.request_state.publication
            if publication is not None and publication.detached_blocks is not None:
                detached[id(publication)] = publication.detached_blocks
        for blocks in detached.values():
            host_pins.update(block.block_id for block in blocks)
        for source, copy in self._retained_copies.values():
            host_pins.update((source.block_id, copy.block_id))
        for pool, pins in ((self.gpu_pool, gpu_pins), (host_pool, host_pins)):
            if pool is not None and any(block.ref_cnt != pins[block.block_id] for block in pool.blocks
                                        if block.ref_cnt and not block.is_null):
                return False
        for pending in self.pending_spills.values():
            if not pending.enqueue_applied:
                for manager, block in zip(self.resident_managers, pending.resident_blocks, strict=True):
                    manager.block_pool.free_blocks([block])
            host_pool.free_blocks([pending.host_block])
            state = pending.request_state
            state.pending_pages.pop(pending.page[1], None)
            publication = state.publication
            if publication is not None and publication.detached_blocks is not None:
                # A finished request's prefix waiting on these copies: its lease is given back unpublished.
                host_pool.free_blocks(reversed(publication.detached_blocks))
                state.publication = None
        for source, copy in self._retained_copies.values():
            host_pool.free_blocks([copy, source])
        self.counters["transfers_dropped"] += len(self.pending_spills)
        self.counters["host_copies_dropped"] += len(self._retained_copies)
        self._forgotten_below = self.next_spill_id
        self.pending_spills.clear()
        self.spills_to_send = []
        self._retained_copies.clear()
        self._pending_imports.clear()
        self.copies.clear()
        self._copy_by_block.clear()
        self._owners.clear()
        self.request_states.clear()
        self._resident_requests.clear()
        self._reads_host.clear()
        self._reads_host_hint = None
        return True

    def update_spills(self, enqueued_counts, completed_counts) -> None:
        # vLLM's ignores ids it does not track; those forget_worker_state dropped are counted.
        if self._forgotten_below:
            self.counters["late_transfer_reports"] += sum(
                1 for ids in (enqueued_counts, completed_counts) for transfer_id in ids
                if transfer_id < self._forgotten_below and transfer_id not in self.pending_spills)
        super().update_spills(enqueued_counts, completed_counts)

    def reset_before_pools(self, kv_cache_manager: KVCacheManager) -> None:
        """Makes vLLM's pool reset (``KVCacheCoordinator.reset_prefix_cache``, which ``reset_prefix_cache``
        runs after preempting and before the connector's ``reset_cache``) call :meth:`forget_worker_state`
        first: by the time vLLM asks the connector, the pins of transfers in flight have already made the
        pools' reset fail. Only this instance's method changes."""
        pools = kv_cache_manager.coordinator
        reset_pools = pools.reset_prefix_cache

        def reset_prefix_cache() -> bool:
            self.forget_worker_state()
            return reset_pools()

        pools.reset_prefix_cache = reset_prefix_cache


def build_coordinator(kv_cache_manager: KVCacheManager, policy: str) -> HisparseCoordinator:
    """What ``get_hisparse_coordinator`` (``v1/hisparse/coordinator.py:900``) builds, with our class."""
    managers = tuple(kv_cache_manager.coordinator.single_type_managers)
    for manager in managers:
        existing = getattr(manager, "coordinator", None)
        if existing is not None:
            if not isinstance(existing, HisparseCoordinator):
                raise ConfigError("vLLM's own HiSparse coordinator is already bound to this KV cache manager")
            return existing
    coordinator = HisparseCoordinator(
        kv_cache_manager.kv_cache_config,
        managers,
        kv_cache_manager.max_model_len,
        num_reprefillable_tokens=kv_cache_manager.coordinator.num_reprefillable_tokens,
        policy=policy,
    )
    if coordinator.host_manager is None:
        raise ConfigError("no HiSparse cache group is configured: is the model a DSA model with index_topk?")
    coordinator.reset_before_pools(kv_cache_manager)
    return coordinator
