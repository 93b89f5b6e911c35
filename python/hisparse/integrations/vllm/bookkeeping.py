"""vLLM 0.33's ``HiSparseCoordinator`` with its state kept in the Rust core: vLLM's block rows and its page
lifecycle.

Every decision here is vLLM's: this is ``policy: fifo``, and the base of ``coldest``'s coordinator
(``coordinator.py``), which changes decisions only. What changes is where vLLM's bookkeeping lives and what
it costs. vLLM's coordinator keeps its pages' states in Python sets per request, its transfers in flight, the
GPU blocks released pages are still read from and the GPU copies of published host pages in Python dicts,
rescans every scheduled request's rows every step (``build_row_mirrors``, ``all_context_pages_resident``),
and walks each page's blocks group by group (six groups on DeepSeek-V3.2). Here:

- the rows live in the core (``BlockRows``, ``rust/core/src/block_rows.rs``): vLLM's managers remain the one
  allocator of block ids, and the core records each row as they change it (``_RowRecorder``: new blocks
  after each allocation, a whole row after an admission or an import, a copied-on-write host page; the
  book records the pages it drops and adopts itself), so the scans run in Rust over integers, for the whole
  batch in one call;
- the page lifecycle lives in the core too (``PageBook``, ``rust/core/src/page_book.rs``): pages being
  copied, clean, held, released and lost, the transfers in flight, the owners of released blocks and the
  index of GPU copies, with vLLM's transitions run there in vLLM's order, and every effect on vLLM's objects
  (its pools, its managers' rows, its host prefix cache) made as vLLM makes it, through the ``_engine_*``
  methods below or the pools directly;
- the per-step work skips requests whose step changes nothing: the core keeps a request found to need none
  of it until it seals a page quiet (``settle``) until one of its rows changes or an event wakes it, and
  sorts each step's batch in the call that mirrors it (``scan``); ``publish_when_ready`` remembers a request
  steady within its page;
- the row mirrors go to the workers packed (``mirrors.RowMirrors``): no Python object per request is made or
  pickled on the scheduler's side.

``tests/test_vllm_integration.py`` runs the same traces with vLLM's own coordinator and compares every
scheduler decision and metadata field step by step; ``check_rows`` (run after every step by the test harness)
compares every recorded row with vLLM's, and ``tests/test_vllm_lifecycle.py`` checks the page lifecycle's
invariants on both (``lifecycle``).

Not policy either, and here for both policies: ``forget_worker_state`` lets
``Scheduler.reset_prefix_cache(reset_running_requests=True, ...)`` succeed with transfers in flight, vLLM's
recovery when a worker died and was replaced (vLLM's own coordinator keeps their pins until a dead worker
reports them, so the reset raises).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.hisparse.coordinator import HiSparseCoordinator, _PendingPublication
from vllm.v1.hisparse.types import (
    SparseKVOffloadCommand,
    SparseKVPageTransfer,
    SparseKVResidencyUpdate,
    SparseKVRowMirror,
)

from ..._core import BlockRows, PageBook, PublishGate
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


class _RowRecorder:
    """Keeps ``BlockRows`` equal to vLLM's rows by wrapping, on vLLM's manager objects, the methods that change
    a row in place (rare: admissions, imports, copy-on-write, frees). Rows grow every ``block_size`` tokens
    through the KV cache coordinator's ``allocate_new_blocks``, wrapped once for all groups
    (``Bookkeeping.bind``). The pages the book drops (lost) or adopts, it records itself; vLLM's ``free``
    drops its request's pages too, unrecorded, as its rows are given back next (``pop_blocks_for_free``). A
    record that cannot be applied (it would mean a change made elsewhere) re-reads the row from vLLM, counted
    in ``rows_reread``."""

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

    def allocated(self, request_id: str, new_blocks: tuple[list, ...], group_ids: list[tuple[int, Any, int | None]]
                  ) -> None:
        """Records what one ``allocate_new_blocks`` appended to the request's rows, every group in one core call
        (``BlockRows.grow``: a group's new blocks are the last of its row; the host group's may start with a
        copy-on-write block that replaced a page in place, recorded by ``_apply_cow``)."""
        for manager, group in self.rows.grow(request_id, new_blocks, group_ids):
            self.book.counters["rows_reread"] += 1
            self.reread(request_id, manager, group)


class _InFlight(Mapping):
    """vLLM's ``pending_spills`` as the book holds them, read-only: transfer id -> the rest of its
    ``PageBook.transfers`` entry. vLLM's connector reads its length for its stats."""

    def __init__(self, book: PageBook) -> None:
        self._book = book

    def _all(self) -> dict[int, tuple]:
        return {t[0]: t[1:] for t in self._book.transfers()}

    def __len__(self) -> int:
        return self._book.in_flight

    def __getitem__(self, transfer_id: int) -> tuple:
        return self._all()[transfer_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._all())


class Bookkeeping(HiSparseCoordinator):
    """``HiSparseCoordinator`` whose state lives in the core (module docstring): exactly vLLM's decisions, at a
    fraction of the cost."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not self.resident_managers or self.host_manager is None:
            raise ConfigError("HiSparse needs resident cache groups and a host group (a DSA model with index_topk)")
        if any(manager.block_pool is not self.gpu_pool for manager in self.resident_managers):
            # vLLM's layout has one: a page's blocks are touched, freed and released in one call.
            raise ConfigError("the HiSparse resident groups do not share one GPU block pool")
        self.counters: Counter[str] = Counter()
        host = self.host_manager
        self.rows = BlockRows(len(self.resident_managers), host.block_size)
        # Requests known to hold their hot regions (``_can_read_from_host``), which the book reads too.
        self._reads_host: set[str] = set()
        self.book = PageBook(self.rows, self, self._reads_host, self.gpu_pool, host.block_pool,
                             self.resident_managers, self.hot_managers, host.block_size, self.max_spill_pages)
        # vLLM's state, now the book's: what vLLM's connector reads of it stays readable.
        del self.spills_to_send, self.request_states, self.copies, self._copy_by_block, self._owners
        del self._pending_imports, self._resident_requests
        self.pending_spills = _InFlight(self.book)
        # The callback of every page the book releases, which vLLM's pool calls as it hands the block out.
        self._on_block_reused = self.book.block_reused
        self._recorder = _RowRecorder(self)
        self._null_block_id = self.gpu_pool.null_block.block_id
        # Constants of publish_when_ready's test, read every step.
        self._host_block_size = host.block_size
        self._host_prefix_cacheable = host.kv_cache_spec.prefix_cacheable
        self._hash_block_size = host.block_pool.hash_block_size
        # Requests whose publish_when_ready publishes nothing until another page is computed, marked with their
        # pages in the gate vLLM's host group calls for each (``bind``).
        self._gate: PublishGate | None = None
        # vLLM's requests by id (the connector scheduler's map, bound by the connector): their longest lengths.
        self.requests: dict = {}
        # Transfer ids below this were dropped by a reset (``forget_worker_state``); 0: none was.
        self._forgotten_below = 0

    @property
    def next_spill_id(self) -> int:
        """The next transfer's id (vLLM's counter, kept by the book)."""
        return self.book.next_transfer

    @next_spill_id.setter
    def next_spill_id(self, value: int) -> None:
        if value != 0:  # vLLM's __init__ sets where the count starts; the book counts from there
            raise AttributeError("transfer ids are counted by the page book")

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

    def lifecycle(self) -> dict:
        """The page lifecycle as the book holds it, for checks and tests: ``requests`` (request -> its page
        states, ``PageBook.pages``), ``transfers`` (``PageBook.transfers``), ``owners``, ``copies`` and
        ``copy_keys`` (the copy index's inverse)."""
        book = self.book
        return {"requests": {r: book.pages(r) for r in book.requests()}, "transfers": book.transfers(),
                "owners": book.owners(), "copies": book.copies(), "copy_keys": book.copy_keys()}

    # ------------------------------------------------------------------ vLLM's decisions (``coldest`` overrides)

    def admit(self, request: Any, num_computed_tokens: int, admission_tokens: int, can_wait: bool = True) -> bool:
        """vLLM admits every request it can allocate for (``coordinator.HisparseCoordinator.admit``)."""
        return True

    def report_heat(self, report: Any) -> None:
        """vLLM's release order ignores selection heat."""

    def _release_order(self, request_id: str, pages: list[int]) -> list[int]:
        """The order a request reading through its hot region releases its clean pages out of the tail in
        (``pages``, increasing): vLLM's, tail first, so a prefix loses its tail pages before its head."""
        return pages[::-1]

    def _without_region(self, request_id: str, released: int) -> None:
        """A scheduled request not reading through a hot region, ``released`` of whose pages are released: vLLM's
        asks for one once the pool runs low or the request fills its admission window (allocated on a later
        pass)."""
        if (self.gpu_pool.get_num_free_blocks() < self.transition_watermark
                or self._fills_admission_window(request_id)):
            for manager in self.hot_managers:
                manager.require_hot(request_id)

    # ------------------------------------------------------------------ per-step work, O(what changed)
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
        anything: a sealed page without a host copy planned, or a residency decision that is not a no-op (a
        prefix to adopt, clean pages still pinned, or no hot region yet; ``PageBook::needs_work``). The others
        are steady decodes already reading through a hot region."""
        return self.book.with_work(requests, self.num_reprefillable_tokens)

    def advance_scheduled(self, requests) -> None:
        # vLLM's, for every request in one core call (``PageBook::advance``): its copies planned, then its
        # residency (vLLM's ``update_residency``: adoption, then _release_order's or _without_region's).
        self.counters["released"] += self.book.advance(requests, self.num_reprefillable_tokens)

    def _plan_page_transfer(self, request_id: str, page_idx: int, *, after_forward: bool,
                            restore: bool = False) -> bool:
        return self.book.plan(request_id, page_idx, after_forward, restore)

    def build_offload_command(self) -> SparseKVOffloadCommand:
        return SparseKVOffloadCommand(page_transfers=[
            SparseKVPageTransfer(transfer_id=transfer_id, host_block_id=host, resident_block_ids=resident,
                                 after_forward=after_forward, restore=restore)
            for transfer_id, host, resident, after_forward, restore in self.book.take_planned()])

    def has_pending_work(self) -> bool:
        return bool(self.book.planned or self.book.in_flight or self._retained_copies)

    def has_pending_reclamation(self) -> bool:
        # vLLM's: an in-flight copy frees a host block, or GPU blocks (its page released) when it completes.
        host_blocks, book = self.host_manager.block_pool.blocks, self.book
        return any(host_blocks[host].ref_cnt == 1 or (book.knows(request_id) and self._can_read_from_host(request_id))
                   for _, request_id, _, host, *_ in book.transfers())

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
        lost, admissions, imports). ``check_rows`` checks the marks."""
        self.book.settle(request_ids, self._reads_host, self.num_reprefillable_tokens)

    def _quiet_below(self, request_id: str) -> int:
        """The step end (tokens) below which ``request_id`` needs no per-request bookkeeping as it stands; 0 when
        its next step may need some."""
        return self.book.quiet_below(request_id, request_id in self._reads_host, self.num_reprefillable_tokens)

    def scan(self, scheduled: dict[str, int], computed: dict[str, int], lookahead: int = 0,
             back: dict[str, int] | None = None) -> tuple[Mapping[str, tuple[SparseKVRowMirror, ...]], bool, list[str]]:
        """One core call over the scheduled requests (request -> tokens this step, request -> tokens computed
        before it) and the recorded rows, which count their pages read from the host: vLLM's
        ``build_row_mirrors`` of each on its own (over its step's rows, from ``back[request]`` rows before
        them, through ``lookahead`` after), packed (``mirrors.RowMirrors``); ``all_context_pages_resident``
        (``coordinator.py:676``: every one has the blocks of its context and reads only resident pages); and
        those that may have per-request bookkeeping to do this step, in their order: all but those
        :meth:`settle` found quiet below the step's end, whose rows have not changed since."""
        packed, resident, busy = self.rows.scan(scheduled, computed, lookahead, back)
        return RowMirrors(*packed, len(self.resident_managers)), resident, busy

    def take_residency_updates(self, request_ids):
        """vLLM's, for the scheduled requests that have an update to take (pages made stale, or pages the
        worker has not been sent; a decode within its last page has none), with each update's block ids read
        from the core's rows."""
        return {request_id: SparseKVResidencyUpdate(pages=pages, block_ids=ids)
                for request_id, pages, ids in self.book.residency_updates(request_ids, self._null_block_id)}

    # ------------------------------------------------------------------ prefix hits, imports, publication

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None:
        pages = min(num_host_pages, len(self.host_manager.req_to_blocks.get(request_id, ())))
        self.book.commit_computed(request_id, pages)
        self.rows.wake(request_id)

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        self.book.record_import(request_id, num_tokens)
        self.rows.wake(request_id)

    def pending_imports(self) -> dict[str, int]:
        """Request -> prefix tokens an external load is still writing (vLLM's ``_pending_imports``)."""
        return self.book.imports()

    def finish_host_import(self, request_id: str, *, failed: bool) -> None:
        num_tokens = self.book.take_import(request_id)
        if num_tokens is not None and not failed:
            self.complete_host_import(request_id, num_tokens)
        self.rows.wake(request_id)

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        self.book.complete_import(request_id, num_computed_tokens)
        self.rows.wake(request_id)

    def _adopt_copies(self, request_id: str) -> None:
        """Adopts the GPU copies of the request's prefix-hit pages, leaving its adoption open
        (``restore.py``: vLLM's per-step residency ends it)."""
        self.book.adopt(request_id, False)

    def publish_when_ready(self, request, num_computed_tokens, retention_interval, *, replay_boundaries) -> None:
        # Called for every request after every step, but for one steady within its page (``bind``'s
        # cache_blocks: nothing below can have changed, ``_publishes_nothing``). When the durable prefix
        # publishes nothing new and records no new GPU copy, vLLM's version only leaves its pending
        # publication: none once every computed page is durable, else one of this step's pages, which the
        # copies still in flight publish as they complete. Here that is all it does, without the host
        # manager's calls. The publication left is the first of its page count: a later step's publishes the
        # same pages (its tokens only count up to the durable prefix, within them), with the same retention
        # and replay boundaries (of the prompt).
        request_id, book = request.request_id, self.book
        num_pages = num_computed_tokens // self._host_block_size
        facts = book.publication_facts(request_id)
        nothing = facts is not None and self._publishes_nothing(request, *facts, num_pages)
        if not nothing:
            self._unmark(request_id)
        elif facts[0] >= num_pages:
            book.set_publication(request_id, None)
            return
        book.set_publication(request_id, _PendingPublication(request, num_computed_tokens, num_pages,
                                                             retention_interval, replay_boundaries),
                             num_computed_tokens)
        if not nothing:
            book.publish_if_ready(request_id)

    def _publishes_nothing(self, request, ready_prefix_pages: int, copies_recorded: int, num_pages: int) -> bool:
        """Whether vLLM's ``publish_when_ready`` of ``num_pages`` computed pages would publish nothing and
        record no GPU copy: it publishes the computed pages that are durable (the ready prefix), and these
        are cached and recorded already. The recorded pages and cached blocks only grow while the request's
        record lives, and the ready prefix changes only where vLLM publishes it in the same call: a copy's
        completion or an import's, and ``commit_computed_blocks`` before the request's first step. So once the
        host row and the block hashes reach past the computed pages, the answer holds until another page is
        computed: marked in the gate (until the record goes: ``free``); an answer for fewer pages than that
        is not, and any older one is dropped."""
        durable = min(ready_prefix_pages, num_pages)
        request_id = request.request_id
        manager = self.host_manager
        host_blocks = len(manager.req_to_blocks.get(request_id, ()))
        if host_blocks and copies_recorded < min(durable, host_blocks):
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

    # vLLM's effects the book asks for by name (``rust/python/src/page_book.rs``): the host prefix cache's.

    def _engine_publish(self, publication: _PendingPublication, num_tokens: int) -> None:
        self.host_manager.publish_blocks(publication.request, num_tokens,
                                         retention_interval=publication.retention_interval,
                                         replay_boundaries=publication.replay_boundaries)

    def _engine_detach(self, request_id: str, publication: _PendingPublication, num_pages: int) -> None:
        # Completed pages need leases too: another allocation may evict them before the remaining copies
        # finish and the prefix publishes.
        manager = self.host_manager
        publication.detached_blocks = manager.req_to_blocks[request_id][:num_pages]
        publication.num_cached_blocks = manager.num_cached_block.get(request_id, 0)
        manager.block_pool.touch(publication.detached_blocks)

    def _engine_publish_detached(self, publication: _PendingPublication, num_full_blocks: int) -> None:
        manager = self.host_manager
        blocks = publication.detached_blocks
        manager.block_pool.cache_full_blocks(
            request=publication.request, blocks=blocks, num_cached_blocks=publication.num_cached_blocks,
            num_full_blocks=num_full_blocks, block_size=manager.block_size,
            kv_cache_group_id=manager.kv_cache_group_id)
        manager.block_pool.free_blocks(reversed(blocks))

    # ------------------------------------------------------------------ transfers

    def update_spills(self, enqueued_counts, completed_counts) -> None:
        # vLLM's ignores ids it does not track; those forget_worker_state dropped are counted.
        if self._forgotten_below:
            known = {t[0] for t in self.book.transfers()}
            self.counters["late_transfer_reports"] += sum(
                1 for ids in (enqueued_counts, completed_counts) for transfer_id in ids
                if transfer_id < self._forgotten_below and transfer_id not in known)
        if enqueued_counts or completed_counts:  # a transfer changes only in a step that reports it
            self.book.update_transfers(enqueued_counts, completed_counts)

    def free(self, request_id: str) -> None:
        self.book.free(request_id)
        self._reads_host.discard(request_id)
        self._unmark(request_id)
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
        its KV anew. Transfer ids are not reused, so a late report of a dropped transfer names no transfer
        and is ignored (counted in ``late_transfer_reports``). On a live worker (a reset after a weight
        update), the dropped transfers were submitted in earlier steps, which vLLM's worker orders before the
        next steps' host writes (``host_write_event``).

        Only once every block in use is held by these pins alone (every running request preempted or finished,
        and no block free deferred behind a step in flight): otherwise vLLM's reset fails anyway, and nothing
        changes here; returns whether it forgot (True also when there was nothing to forget). Under async
        scheduling vLLM defers the frees of requests preempted while a step is in flight until that step's
        output is processed (``Scheduler.deferred_frees``, for every connector that loads KV, its own HiSparse
        included), so a reset that preempts running requests then fails in vLLM; the scheduler's deferred
        blocks are not the coordinator's to free."""
        if any(manager.req_to_blocks for manager in self.managers):
            return False
        book, host_pool = self.book, self.host_manager.block_pool
        transfers = book.transfers()
        detached = dict(book.detached())  # request -> its publication, leased once for its transfers
        gpu_pins: Counter[int] = Counter()
        host_pins: Counter[int] = Counter()
        for _, _, _, host, resident, pins_released, *_ in transfers:
            if not pins_released:
                gpu_pins.update(resident)
            host_pins[host] += 1
        for publication in detached.values():
            host_pins.update(block.block_id for block in publication.detached_blocks)
        for source, copy in self._retained_copies.values():
            host_pins.update((source.block_id, copy.block_id))
        for pool, pins in ((self.gpu_pool, gpu_pins), (host_pool, host_pins)):
            if any(block.ref_cnt != pins[block.block_id] for block in pool.blocks
                   if block.ref_cnt and not block.is_null):
                return False
        gpu_blocks, host_blocks = self.gpu_pool.blocks, host_pool.blocks
        for _, request_id, _, host, resident, pins_released, *_ in transfers:
            if not pins_released:
                for block_id in resident:
                    self.gpu_pool.free_blocks([gpu_blocks[block_id]])
            host_pool.free_blocks([host_blocks[host]])
            publication = detached.pop(request_id, None)
            if publication is not None:
                # A finished request's prefix waiting on these copies: its lease is given back unpublished.
                host_pool.free_blocks(reversed(publication.detached_blocks))
        book.forget_all()
        for source, copy in self._retained_copies.values():
            host_pool.free_blocks([copy, source])
        self.counters["transfers_dropped"] += len(transfers)
        self.counters["host_copies_dropped"] += len(self._retained_copies)
        self._forgotten_below = book.next_transfer
        self._retained_copies.clear()
        self._reads_host.clear()
        if self._gate is not None:
            self._gate.unmark_all()
        self.rows.clear_all()
        return True
