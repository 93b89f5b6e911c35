"""vLLM 0.33's ``HiSparseCoordinator`` with its per-step scans run over the core's record of vLLM's block rows.

Every decision here is vLLM's: this is ``policy: fifo``, and the base of ``coldest``'s coordinator
(``coordinator.py``), which changes decisions only. What changes is the cost of vLLM's bookkeeping. vLLM's
connector rescans every scheduled request's rows in Python every step (``build_row_mirrors``,
``all_context_pages_resident``) and walks every request's publication state after every step
(``publish_when_ready``); here:

- the rows live in the Rust core too (``BlockRows``, ``rust/core/src/block_rows.rs``): vLLM's managers
  remain the one allocator of block ids, and the core records each row as they change it (``_RowRecorder``:
  new blocks after each allocation, a whole row after an admission or an import, one page when it is
  adopted or copied on write, a lost page in every group at once, nothing once freed), so the scans run in
  Rust over integers, for the whole batch in one call;
- the scans that read vLLM's per-request state skip requests whose step changes nothing: the core keeps
  a request found to need none of them until it seals a page quiet (``settle``) until one of its rows
  changes or an event wakes it, and sorts each step's batch in the call that mirrors it (``scan``), so a
  decode within its last page is not read in Python at all; ``publish_when_ready`` remembers a request
  steady within its page;
- the row mirrors go to the workers packed (``mirrors.RowMirrors``): no Python object per request is made or
  pickled on the scheduler's side.

``tests/test_vllm_integration.py`` runs the same traces with vLLM's scans and compares every scheduler decision
and metadata field step by step; ``check_rows`` (run after every step by the test harness) compares every
recorded row with vLLM's.

Not policy either, and here for both policies: ``forget_worker_state`` lets
``Scheduler.reset_prefix_cache(reset_running_requests=True, ...)`` succeed with transfers in flight, vLLM's
recovery when a worker died and was replaced (vLLM's own coordinator keeps their pins until a dead worker
reports them, so the reset raises).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.hisparse.coordinator import HiSparseCoordinator, _PendingPublication, _PendingSpill
from vllm.v1.hisparse.types import (
    ACTIVE_TAIL_PAGES,
    SparseKVPageTransfer,
    SparseKVResidencyUpdate,
    SparseKVRowMirror,
)

from ..._core import BlockRows, PublishGate
from ...errors import ConfigError, InvalidArgumentError, InvariantError
from .mirrors import RowMirrors

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager


def block_ids(blocks) -> list[int | None]:
    """vLLM blocks as the core records them: a null block (a page read from the host) is ``None``."""
    return [None if block.is_null else block.block_id for block in blocks]


def vllm_row(manager: Any, group: int | None, request_id: str) -> list:
    """The row of ``request_id`` as vLLM holds it, which the core's ``group`` records: a resident group's with
    its residency changes applied, the host group's as it is."""
    if group is None:
        return manager.req_to_blocks.get(request_id, [])
    return manager.get_residency_row(request_id)


def _pins_past_tail(state: Any, pages: int) -> bool:
    """Whether the request (of ``pages`` resident pages) holds a clean page pinned outside its tail: work for
    ``update_residency``, which releases one only once it leaves the tail (``_resident_page_blocks``); a
    pinned page in the tail, the usual case, is none. The intersection looks up the tail's pages in the set,
    rather than iterating the set, whose table keeps the size it had when the request last held many."""
    pinned = state.pinned_clean
    return len(pinned) > len(pinned.intersection(range(max(0, pages - ACTIVE_TAIL_PAGES), pages)))


class _RowRecorder:
    """Keeps ``BlockRows`` equal to vLLM's rows by wrapping, on vLLM's manager objects, the methods that change
    a row in place (rare: admissions, imports, adoptions, copy-on-write, frees). Rows grow every ``block_size``
    tokens through the KV cache coordinator's ``allocate_new_blocks``, wrapped once for all groups
    (``Bookkeeping.bind``). A lost page, dropped by vLLM's coordinator in every group, is recorded once for all
    (``Bookkeeping._lose_page``); vLLM's ``free`` drops its request's pages too, unrecorded, as its rows are
    given back next (``pop_blocks_for_free``). A record that cannot be applied (it would mean a change made
    elsewhere) re-reads the row from vLLM, counted in ``rows_reread``."""

    def __init__(self, book: Bookkeeping) -> None:
        self.book = book
        self.rows = book.rows
        self.groups: list[tuple[Any, int | None]] = [(m, g) for g, m in enumerate(book.resident_managers)]
        self.groups.append((book.host_manager, None))
        for manager, group in self.groups:
            self._wrap(manager, group)

    def reread(self, request_id: str, manager: Any, group: int | None) -> None:
        self.rows.set(request_id, group, block_ids(vllm_row(manager, group, request_id)))

    def _wrap(self, manager: Any, group: int | None) -> None:
        reread = self.reread

        def after(name: str, record) -> None:
            method = getattr(manager, name)

            def recorded(request_id: str, *args, **kwargs):
                result = method(request_id, *args, **kwargs)
                try:
                    record(request_id, result, *args)
                except InvalidArgumentError:
                    self.book.counters["rows_reread"] += 1
                    reread(request_id, manager, group)
                return result

            setattr(manager, name, recorded)

        whole_row = lambda request_id, _result, *_: reread(request_id, manager, group)  # noqa: E731
        after("add_local_computed_blocks", whole_row)
        after("allocate_external_computed_blocks", whole_row)
        after("pop_blocks_for_free", lambda request_id, *_: self.rows.clear(request_id, group))
        if group is None:
            after("_apply_cow", lambda request_id, _r, page, _source, cow: self.rows.set_page(
                request_id, None, page, cow.block_id))
        else:
            after("adopt_resident_page", lambda request_id, adopted, page, block: adopted and self.rows.set_page(
                request_id, group, page, block.block_id))

    def allocated(self, request_id: str, new_blocks: tuple[list, ...], group_ids: list[tuple[int, Any, int | None]]
                  ) -> None:
        """Records what one ``allocate_new_blocks`` appended to the request's rows, every group in one core call
        (``BlockRows.grow``: a group's new blocks are the last of its row; the host group's may start with a
        copy-on-write block that replaced a page in place, recorded by ``_apply_cow``)."""
        for manager, group in self.rows.grow(request_id, new_blocks, group_ids):
            self.book.counters["rows_reread"] += 1
            self.reread(request_id, manager, group)


class Bookkeeping(HiSparseCoordinator):
    """``HiSparseCoordinator`` whose per-step scans run in the core or skip what did not change (module
    docstring): exactly vLLM's decisions, at a fraction of the cost."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counters: Counter[str] = Counter()
        block_size = self.resident_managers[0].block_size if self.resident_managers else 1
        self.rows = BlockRows(max(1, len(self.resident_managers)), block_size)
        self._recorder = _RowRecorder(self) if self.resident_managers and self.host_manager is not None else None
        if self._recorder is not None:
            if any(manager.block_pool is not self.gpu_pool for manager in self.resident_managers):
                # vLLM's layout has one: a page's blocks are touched, freed and released in one call.
                raise ConfigError("the HiSparse resident groups do not share one GPU block pool")
            self._gpu_blocks = self.gpu_pool.blocks  # by block id
            self._null_block_id = self.gpu_pool.null_block.block_id
            # Constants of publish_when_ready's test, read every step.
            host = self.host_manager
            self._host_block_size = host.block_size
            self._host_prefix_cacheable = host.kv_cache_spec.prefix_cacheable
            self._hash_block_size = host.block_pool.hash_block_size
        # Requests whose publish_when_ready publishes nothing until another page is computed, marked with their
        # pages in the gate vLLM's host group calls for each (``bind``); None without resident groups.
        self._gate: PublishGate | None = None
        # Requests known to hold their hot regions (``_can_read_from_host``).
        self._reads_host: set[str] = set()
        # vLLM's requests by id (the connector scheduler's map, bound by the connector): their longest lengths.
        self.requests: dict = {}
        # Transfer ids below this were dropped by a reset (``forget_worker_state``); 0: none was.
        self._forgotten_below = 0

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        """Hooks into the KV cache manager's coordinator: its allocations grow the recorded rows, and its pool
        reset (``KVCacheCoordinator.reset_prefix_cache``, which ``reset_prefix_cache`` runs after preempting
        and before the connector's ``reset_cache``) calls :meth:`forget_worker_state` first, since by the time
        vLLM asks the connector, the pins of transfers in flight have already made the pools' reset fail.
        Only this instance's methods change."""
        pools = kv_cache_manager.coordinator
        reset_pools = pools.reset_prefix_cache

        def reset_prefix_cache() -> bool:
            self.forget_worker_state()
            return reset_pools()

        pools.reset_prefix_cache = reset_prefix_cache
        if self._recorder is None:
            return
        by_manager = {id(manager): group for manager, group in self._recorder.groups}
        group_ids = [(kv_group, manager, by_manager[id(manager)]) for kv_group, manager
                     in enumerate(pools.single_type_managers) if id(manager) in by_manager]
        allocate, recorder = pools.allocate_new_blocks, self._recorder

        def allocate_new_blocks(request_id: str, num_tokens: int, num_tokens_main_model: int,
                                num_encoder_tokens: int = 0):
            new_blocks = allocate(request_id, num_tokens, num_tokens_main_model, num_encoder_tokens)
            if any(new_blocks):
                recorder.allocated(request_id, new_blocks, group_ids)
            return new_blocks

        pools.allocate_new_blocks = allocate_new_blocks
        # vLLM's KV cache manager hands every request's step to the host group's cache_blocks, which only
        # forwards it to publish_when_ready: here a request whose page count publishes nothing new returns in
        # that first call, in the core (``PublishGate``, over the marks ``_publishes_nothing`` leaves in it).
        self._gate = PublishGate(self._host_block_size, self)
        self.host_manager.cache_blocks = self._gate.cache_blocks

    def check_rows(self) -> None:
        """Every recorded row equals vLLM's (``InvariantError`` naming the first that does not), and no request
        vLLM has forgotten is still recorded. For tests: O(every row)."""
        if self._recorder is None:
            return
        held = set()
        for manager, group in self._recorder.groups:
            for request_id in manager.req_to_blocks:
                held.add(request_id)
                if self.rows.row(request_id, group) != block_ids(vllm_row(manager, group, request_id)):
                    raise InvariantError(f"request {request_id!r}: recorded row of group {group} differs from vLLM's")
                if group is not None and self.rows.row_len(request_id, group) != self.rows.row_len(request_id, 0):
                    raise InvariantError(f"request {request_id!r}: resident rows of different lengths")
        if len(self.rows) > len(held):
            raise InvariantError(f"{len(self.rows)} requests recorded, vLLM holds rows of {len(held)}")
        for request_id in held:
            # A quiet mark is sound: no higher than settle would set it now (0 when not quiet).
            below = self._quiet_below(request_id)
            if not self.rows.scan({request_id: 0}, {request_id: below})[2]:
                raise InvariantError(f"request {request_id!r} is marked quiet past {below} tokens")

    # ------------------------------------------------------------------ vLLM's decisions (``coldest`` overrides)

    def admit(self, request: Any, num_computed_tokens: int, admission_tokens: int, can_wait: bool = True) -> bool:
        """vLLM admits every request it can allocate for (``coordinator.HisparseCoordinator.admit``)."""
        return True

    def report_heat(self, report: Any) -> None:
        """vLLM's release order ignores selection heat."""

    # ------------------------------------------------------------------ per-step scans, O(what changed)
    #
    # vLLM's connector runs every per-step scan over every scheduled request; these give the same results
    # while touching only requests whose step changes something, or run in the core
    # (``connector.build_connector_meta`` calls them in vLLM's order).

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
        reads_host = self._reads_host
        out = []
        for request_id, num_tokens in requests:
            state = states.get(request_id)
            if state is None:
                out.append((request_id, num_tokens))
                continue
            first = state.ready_prefix_pages
            if imports:
                first = max(first, -(-imports.get(request_id, 0) // block_size))
            if first < max(0, num_tokens - reprefill) // block_size or state.pages_to_adopt:
                out.append((request_id, num_tokens))
                continue
            if state.pinned_clean and _pins_past_tail(state, len(resident.get(request_id, ()))):
                out.append((request_id, num_tokens))
                continue
            if request_id not in reads_host and not self._can_read_from_host(request_id):
                out.append((request_id, num_tokens))
        return out

    def host_pages_hold_data(self, request_id: str, num_tokens: int) -> bool:
        """Whether every host page of the request's first ``num_tokens`` holds its data already: each is a
        published block of the host pool's prefix cache (hashed only once its copy completed), not one a load
        is still writing."""
        pages = -(-num_tokens // self.host_manager.block_size)
        blocks = self.host_manager.req_to_blocks.get(request_id, ())
        return len(blocks) >= pages and all(not b.is_null and b.block_hash is not None for b in blocks[:pages])

    def settle(self, request_ids) -> None:
        """Marks quiet in the core each of these requests (given this step's bookkeeping) that needs no more of
        it, neither ``advance_scheduled`` (:meth:`with_residency_work`) nor ``take_residency_updates``, in the
        steps that seal no new page: it reads through its hot region, and has no prefix to adopt, no import
        pending, no residency change the worker lacks, and no clean page pinned outside its tail. A change of
        its rows wakes it in the core; so do the events that change this state otherwise (pages made clean or
        lost, admissions, imports: ``_page_became_clean``, ``_lose_page``...). ``check_rows`` checks the marks."""
        for request_id in request_ids:
            below = self._quiet_below(request_id)
            if below:
                self.rows.quiet(request_id, below)

    def _quiet_below(self, request_id: str) -> int:
        """The step end (tokens) below which ``request_id`` needs no per-request bookkeeping as it stands; 0 when
        its next step may need some whatever its end."""
        state = self.request_states.get(request_id)
        if (state is None or request_id not in self._reads_host or state.pages_to_adopt or state.stale_pages
                or request_id in self._pending_imports):
            return 0
        pages = len(self.resident_managers[0].req_to_blocks.get(request_id, ()))
        if state.synced_pages < pages or (state.pinned_clean and _pins_past_tail(state, pages)):
            return 0
        # with_residency_work's first test: no page past the ready prefix is sealed.
        return (state.ready_prefix_pages + 1) * self.host_manager.block_size + self.num_reprefillable_tokens

    def scan(self, scheduled: dict[str, int], computed: dict[str, int], lookahead: int = 0,
             back: dict[str, int] | None = None) -> tuple[Mapping[str, tuple[SparseKVRowMirror, ...]], bool, list[str]]:
        """One core call over the scheduled requests (request -> tokens this step, request -> tokens computed
        before it) and the recorded rows, which count their pages read from the host: vLLM's
        ``build_row_mirrors`` of each on its own (over its step's rows, from ``back[request]`` rows before
        them, through ``lookahead`` after), packed (``mirrors.RowMirrors``); ``all_context_pages_resident``
        (``coordinator.py:676``: every one has the blocks of its context and reads only resident pages); and
        those that may have per-request bookkeeping to do this step, in their order: all but those
        :meth:`settle` found quiet below the step's end, whose rows have not changed since."""
        if self._recorder is None:
            return {request_id: () for request_id in scheduled}, False, list(scheduled)
        packed, resident, busy = self.rows.scan(scheduled, computed, lookahead, back)
        return RowMirrors(*packed, len(self.resident_managers)), resident, busy

    # ------------------------------------------------------------------ a page's blocks, from the core's rows
    #
    # vLLM's steps in a page's life (planning its host copy, releasing it, indexing its GPU copy for prefix
    # hits) look the page up in each resident group's row, one call a group (six for DeepSeek-V3.2), and touch
    # or release its blocks one group at a time; the page's blocks sit side by side in the core's rows, and
    # the groups share one pool (checked in ``__init__``): one lookup, and one pool call where vLLM makes one
    # a group with the same effect (``touch`` and ``unpin_blocks`` of a list are those of its blocks in turn,
    # ``free_blocks`` of a list too where it frees none).
    # vLLM reaches these only with resident groups (its callers return first without), so with the rows.

    def _page_blocks(self, request_id: str, page_idx: int) -> list | None:
        """The page's GPU block in every resident group (vLLM's ``get_resident_page`` of each), or None when a
        group has none or reads it from the host."""
        return self.rows.page_blocks(request_id, page_idx, self._gpu_blocks)

    def _resident_page_blocks(self, request_id: str, page_idx: int) -> list | None:
        # vLLM's: None for a page in the tail or not on the GPU. Every resident row has the same length
        # (``check_rows``), the first's stands for all.
        if page_idx >= len(self.resident_managers[0].req_to_blocks.get(request_id, ())) - ACTIVE_TAIL_PAGES:
            return None
        return self._page_blocks(request_id, page_idx)

    def _releasable_clean(self, request_id: str, state) -> list[int]:
        """The request's clean pinned pages ``_unpin_page`` can release: those outside its tail (a page in the
        tail stays pinned until it leaves it, ``_resident_page_blocks``), so that the release order is taken
        over these alone."""
        first_tail = len(self.resident_managers[0].req_to_blocks.get(request_id, ())) - ACTIVE_TAIL_PAGES
        return [page_idx for page_idx in state.pinned_clean if page_idx < first_tail]

    def _unpin_clean_pages(self, request_id: str, state) -> None:
        # vLLM's: tail first, so a prefix loses its tail pages before its head.
        for page_idx in sorted(self._releasable_clean(request_id, state), reverse=True):
            self._unpin_page(request_id, state, page_idx)

    def _unpin_page(self, request_id: str, state, page_idx: int) -> bool:
        if page_idx in state.pending_pages or page_idx not in state.valid_pages:
            return False
        blocks = self._resident_page_blocks(request_id, page_idx)
        if blocks is None:
            return False
        owner = (request_id, page_idx)
        for block in blocks:
            self._owners.setdefault(block.block_id, set()).add(owner)
        self.gpu_pool.unpin_blocks(blocks, self._on_block_reused)
        state.pinned_clean.discard(page_idx)
        state.unpinned_pages.add(page_idx)
        return True

    def _apply_enqueued_spills(self) -> None:
        # vLLM's gives back a copied page's pins (each transfer's reference to its blocks, taken when planned)
        # one group at a time, each to its group's pool: here one pool (``__init__``) and a block a group. Where
        # every block stays held by its request, the frees only count down, so one call does for all; a page
        # whose request is gone goes back block by block, in vLLM's queue order.
        pool = self.gpu_pool
        for pending in self.pending_spills.values():
            if (pending.enqueue_applied or not pending.expected_worker_completions
                    or pending.worker_completions < pending.expected_worker_completions):
                continue
            blocks = pending.resident_blocks
            if all(block.ref_cnt > 1 for block in blocks):
                pool.free_blocks(blocks)
            else:
                for block in blocks:
                    pool.free_blocks([block])
            pending.enqueue_applied = True

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        # vLLM's, whose test that every group holds the page on the GPU is _plan_page_transfer's first (it
        # plans nothing and changes nothing when one does not).
        page_tokens = self._host_block_size
        state = self._get_request_state(request_id)
        first = max(state.ready_prefix_pages, -(-self._pending_imports.get(request_id, 0) // page_tokens))
        budget = self.max_spill_pages - len(self.spills_to_send)
        for page_idx in range(first, num_computed_tokens // page_tokens):
            if budget <= 0:
                break
            if (page_idx not in state.pending_pages and page_idx not in state.valid_pages
                    and self._plan_page_transfer(request_id, page_idx, after_forward=True)):
                budget -= 1

    def _plan_page_transfer(self, request_id: str, page_idx: int, *, after_forward: bool,
                            restore: bool = False) -> bool:
        state = self._get_request_state(request_id)
        if page_idx in state.pending_pages:
            return False
        host_blocks = self.host_manager.req_to_blocks.get(request_id, ())
        host_block = host_blocks[page_idx] if page_idx < len(host_blocks) else None
        blocks = None if host_block is None or host_block.is_null else self._page_blocks(request_id, page_idx)
        if blocks is None:
            return False
        self.host_manager.block_pool.touch([host_block])
        self.gpu_pool.touch(blocks)
        transfer_id = self.next_spill_id
        self.next_spill_id += 1
        resident = tuple(block.block_id for block in blocks)
        self.spills_to_send.append(SparseKVPageTransfer(
            transfer_id=transfer_id, host_block_id=host_block.block_id, resident_block_ids=resident,
            after_forward=after_forward, restore=restore))
        self.pending_spills[transfer_id] = _PendingSpill(
            transfer_id=transfer_id, page=(request_id, page_idx), request_state=state, host_block=host_block,
            resident_blocks=tuple(blocks), restore=restore)
        state.pending_pages[page_idx] = transfer_id
        return True

    def _record_copy(self, request_id: str, page_idx: int, host_block) -> None:
        # vLLM's: index the page's GPU blocks under its host block's hash, for later prefix hits.
        host_hash = host_block.block_hash
        if host_block.is_null or host_hash is None:
            return
        blocks = self._page_blocks(request_id, page_idx)
        if blocks is None:
            return
        self._drop_copy(host_hash)
        self.copies[host_hash] = tuple(blocks)
        for block in blocks:
            self._copy_by_block[block.block_id] = host_hash

    def take_residency_updates(self, request_ids):
        """vLLM's, for the scheduled requests that have an update to take (pages made stale, or pages the
        worker has not been sent; a decode within its last page has none), with each update's block ids read
        from the core's rows (one call a request for every group) instead of each group's row in Python."""
        if self._recorder is None or not self.resident_managers:
            return super().take_residency_updates(request_ids)
        rows, null = self.resident_managers[0].req_to_blocks, self._null_block_id
        updates = {}
        for request_id in request_ids:
            state = self._get_request_state(request_id)
            num_pages = len(rows.get(request_id, ()))
            start = state.synced_pages
            if not state.stale_pages and start >= num_pages:
                continue
            pages = [*sorted(state.stale_pages), *range(start, num_pages)]
            updates[request_id] = SparseKVResidencyUpdate(pages=pages,
                                                          block_ids=self.rows.blocks_by_group(request_id, pages, null))
            state.stale_pages.clear()
            state.synced_pages = num_pages
        return updates

    def publish_when_ready(self, request, num_computed_tokens, retention_interval, *, replay_boundaries) -> None:
        # Called for every request after every step, but for one steady within its page (``bind``'s
        # cache_blocks: nothing below can have changed, ``_publishes_nothing``). When the durable prefix
        # publishes nothing new and records no new GPU copy, vLLM's version only leaves its pending
        # publication: none once every computed page is durable, else one of this step's pages, which the
        # copies still in flight publish as they complete (``_complete_host_writes``). Here that is all it
        # does, without the host manager's calls. The publication left is the first of its page count: a
        # later step's publishes the same pages (its tokens only count up to the durable prefix, within
        # them), with the same retention and replay boundaries (of the prompt).
        request_id = request.request_id
        state = self.request_states.get(request_id)
        if state is not None and self._recorder is not None:
            num_pages = num_computed_tokens // self._host_block_size
            if self._publishes_nothing(request, state, num_pages):
                state.publication = None if state.ready_prefix_pages >= num_pages else _PendingPublication(
                    request, num_computed_tokens, num_pages, retention_interval, replay_boundaries)
                return
        self._unmark(request_id)
        super().publish_when_ready(request, num_computed_tokens, retention_interval,
                                   replay_boundaries=replay_boundaries)

    def _publishes_nothing(self, request, state, num_pages: int) -> bool:
        """Whether vLLM's ``publish_when_ready`` of ``num_pages`` computed pages would publish nothing and
        record no GPU copy: it publishes the computed pages that are durable (the ready prefix), and these
        are cached and recorded already. The recorded pages and cached blocks only grow while ``state`` lives,
        and the ready prefix changes only where vLLM publishes it in the same call: a copy's completion
        (``_complete_host_writes``) or an import's (``complete_host_import``), and ``commit_computed_blocks``
        before the request's first step. So once the host row and the block hashes reach past the computed
        pages, the answer holds until another page is computed: marked in the gate (until the state goes:
        ``free``); an answer for fewer pages than that is not, and any older one is dropped."""
        durable = min(state.ready_prefix_pages, num_pages)
        request_id = request.request_id
        manager = self.host_manager
        host_blocks = len(manager.req_to_blocks.get(request_id, ()))
        if host_blocks and state.copies_recorded_blocks < min(durable, host_blocks):
            return False
        hashed = len(request.block_hashes) * self._hash_block_size // self._host_block_size
        if self._host_prefix_cacheable and manager.num_cached_block.get(request_id, 0) < min(durable, hashed):
            return False
        if host_blocks >= num_pages and hashed >= num_pages:
            self._gate.mark(request_id, num_pages)
        else:
            self._unmark(request_id)
        return True

    def _unmark(self, request_id: str) -> None:
        if self._gate is not None:
            self._gate.unmark(request_id)

    def end_pass(self) -> None:
        """The schedule pass's last call (``build_connector_meta``): the gate's next call is the next pass's."""
        if self._gate is not None:
            self._gate.end_pass()

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._reads_host.discard(request_id)
        self._unmark(request_id)
        self.rows.wake(request_id)

    # What changes the state ``settle`` reads other than through the rows: the request is woken.

    def _page_became_clean(self, request_id: str, state, page_idx: int) -> None:
        super()._page_became_clean(request_id, state, page_idx)
        self.rows.wake(request_id)

    def _lose_page(self, request_id: str, page_idx: int) -> None:
        # vLLM's drops the page in each resident group (a request it still tracks): recorded here in one call.
        tracked = request_id in self.request_states
        super()._lose_page(request_id, page_idx)
        if tracked:
            self.rows.drop_page(request_id, page_idx)  # which wakes it

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None:
        super().commit_computed_blocks(request_id, num_host_pages)
        self.rows.wake(request_id)

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        super().record_pending_host_import(request_id, num_tokens)
        self.rows.wake(request_id)

    def finish_host_import(self, request_id: str, *, failed: bool) -> None:
        super().finish_host_import(request_id, failed=failed)
        self.rows.wake(request_id)

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        super().complete_host_import(request_id, num_computed_tokens)
        self.rows.wake(request_id)

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
        changes here; returns whether it forgot (True also when there was nothing to forget). Under async
        scheduling vLLM defers the frees of requests preempted while a step is in flight until that step's
        output is processed (``Scheduler.deferred_frees``, for every connector that loads KV, its own HiSparse
        included), so a reset that preempts running requests then fails in vLLM; the scheduler's deferred
        blocks are not the coordinator's to free."""
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
        if self._gate is not None:
            self._gate.unmark_all()
        self.rows.clear_all()
        return True

    def update_spills(self, enqueued_counts, completed_counts) -> None:
        # vLLM's ignores ids it does not track; those forget_worker_state dropped are counted.
        if self._forgotten_below:
            self.counters["late_transfer_reports"] += sum(
                1 for ids in (enqueued_counts, completed_counts) for transfer_id in ids
                if transfer_id < self._forgotten_below and transfer_id not in self.pending_spills)
        # vLLM's walks every transfer in flight twice per step, to find those whose counts completed them; a
        # transfer completes only in a step that reports it. So vLLM's runs over the reported ones alone, in
        # its order (by id, the order they were planned in), and its removals are applied to the whole table.
        everything = self.pending_spills
        reported = sorted(transfer_id for transfer_id in {*enqueued_counts, *completed_counts}
                          if transfer_id in everything)
        self.pending_spills = {transfer_id: everything[transfer_id] for transfer_id in reported}
        try:
            super().update_spills(enqueued_counts, completed_counts)
        finally:
            left, self.pending_spills = self.pending_spills, everything
            for transfer_id in reported:
                if transfer_id not in left:
                    del everything[transfer_id]
            everything.update(left)  # none is new: completing a copy plans no transfer (kept if one did)
