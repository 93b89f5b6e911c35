"""Short requests admitted on a prefix hit are restored whole to resident pages, not given a hot region.

vLLM 0.33 gives every request that starts from a prefix hit a hot region (``HiSparseHotManager
.get_num_blocks_to_allocate``: a host import or a resumed host prefix). With GLM-5.3's layout and MTP 3 that is
160 blocks in each of 21 hot groups, 3,360 blocks, more than twice a 4K-token request's whole context, so a
workload of short multi-turn conversations runs a request or two at a time where vLLM with an offloading
connector alone runs five (``benches/vllm_agent.py --workload short``). A request too short ever to take a hot
region (``PoolShape::never_takes_hot_region``) is instead given a resident block for every page of its prefix:
the GPU copy of the page vLLM still holds, adopted as vLLM adopts copies for a request it gives a hot region,
or else a block of its own, which the worker fills from the page's host block before the forward that first
reads it: vLLM's own restore transfer (``SparseKVPageTransfer.restore``, which vLLM uses for an imported tail
page). The request then runs as any resident request does.

- A local hit (host pages the HiSparse host group holds) is restored in the step that admits it.
- An external load (the offloading connector's, asynchronous unless ``sync_load_budget_bytes`` is set) is
  restored once the load has completed (``complete_host_import``), before the request is scheduled again.
- A synchronous external load completes in the step that first reads its pages. It is restored whole only
  where HiSparse's host pool holds the whole prefix published already (``host_prefix_tokens``): its host pages
  then hold their data (vLLM's offloading connector loads only the groups it offloads, the indexer keys, and
  no further than that prefix: ``_max_loadable_tokens``), and its import is finished, and so restored, before
  the step's transfers are planned (``connector._finish_loaded_imports``). A load that writes the host pages
  during the step would be read before a restore could land: such a request keeps vLLM's hot region.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from .coordinator import HisparseCoordinator


class WrappedWhileNeeded:
    """``owner.name`` wrapped (``wrap(method)`` around the method in place when turned :meth:`on`) until turned
    :meth:`off`: for a method vLLM calls for every request every step, whose wrap matters only now and then.
    Turned off, the method in place before is given back, unless another wrap has been put over this one since
    (it then stays, calling through this one)."""

    def __init__(self, owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> None:
        self.owner, self.name, self.wrap = owner, name, wrap
        self._wrapper: Callable | None = None
        self._inner: Callable | None = None
        self._own_attribute = False  # whether the method in place was the owner's attribute, not its class's

    def on(self) -> None:
        if self._wrapper is None:
            self._own_attribute = self.name in vars(self.owner)
            self._inner = getattr(self.owner, self.name)
            self._wrapper = self.wrap(self._inner)
            setattr(self.owner, self.name, self._wrapper)

    def off(self) -> None:
        if self._wrapper is None:
            return
        if vars(self.owner).get(self.name) is self._wrapper:
            if self._own_attribute:
                setattr(self.owner, self.name, self._inner)
            else:
                delattr(self.owner, self.name)
        self._wrapper = self._inner = None


class WholeRestores:
    """The requests restored whole (``requests``), and the wraps on vLLM's manager objects that give them
    resident blocks instead of a hot region: ``KVCacheManager.allocate_slots`` decides at admission and fills
    every page, the KV cache coordinator's count asks a block for every page and none for a region, the hot
    managers' admissions ask for no region. Only these instances' methods change, and only for the requests
    in ``requests``.

    vLLM calls the allocation and the count for every scheduled request every step, so those two wraps are
    in place only while they can matter: the allocation's from when vLLM asks the connector for a short waiting
    request's prefix hit (:meth:`expect`; it admits a request only in the pass that asked, after every running
    request's allocation) to the end of that schedule pass (:meth:`end_pass`), and the count's while a request
    restored whole holds blocks."""

    def __init__(self, coordinator: HisparseCoordinator, kv_cache_manager: KVCacheManager,
                 is_short: Callable[[Any], bool]) -> None:
        self.coordinator = coordinator
        self.is_short = is_short
        self.requests: set[str] = set()
        # Pages of each that ``_fill`` gave a block of its own and ``restore`` has not planned yet.
        self._unrestored: dict[str, set[int]] = {}
        self.block_size = coordinator.resident_managers[0].block_size
        for manager in coordinator.hot_managers:
            for name in ("add_local_computed_blocks", "allocate_external_computed_blocks"):
                self._wrap_admission(manager, name)
        self._pools = kv_cache_manager.coordinator
        self._allocation = WrappedWhileNeeded(kv_cache_manager, "allocate_slots", self._restoring)
        self._count = WrappedWhileNeeded(self._pools, "get_num_blocks_to_allocate", self._counting)

    def _restoring(self, allocate):
        """vLLM's ``allocate_slots`` (``allocate``), which admits a short request on a prefix hit restored whole."""

        def allocate_slots(request, num_new_tokens, *args, **kwargs):
            local = kwargs.get("num_new_computed_tokens", 0)
            external = kwargs.get("num_external_computed_tokens", 0)
            request_id = request.request_id
            if (not local and not external) or request_id in self.requests or not self._restorable(
                    request, local, external, kwargs.get("delay_cache_blocks", False)):
                return allocate(request, num_new_tokens, *args, **kwargs)
            self._track(request_id)
            blocks = allocate(request, num_new_tokens, *args, **kwargs)
            if blocks is None:
                self.forget(request_id)
                return None
            self.coordinator.counters["restored_whole"] += 1
            self._fill(request_id, local // self.block_size)
            return blocks

        return allocate_slots

    def expect(self, request) -> None:
        """vLLM has asked the connector for the waiting ``request``'s prefix hit: its allocation, later in this
        schedule pass, may admit it restored whole if it is short."""
        if self.is_short(request):
            self._allocation.on()

    def end_pass(self) -> None:
        """The schedule pass is over: the next allocations are running requests' until vLLM asks again."""
        self._allocation.off()

    def _track(self, request_id: str) -> None:
        self.requests.add(request_id)
        self._count.on()

    def _restorable(self, request, local: int, external: int, load_async: bool) -> bool:
        """A short request whose prefix's host pages hold their data before its first forward (module docstring)."""
        if not self.is_short(request):
            return False
        return not external or load_async or self.coordinator.host_prefix_tokens(request) >= local + external

    def _wrap_admission(self, manager, name: str) -> None:
        """vLLM's admission methods of a hot manager ask for a region on any prefix hit: not for these."""
        method, requests = getattr(manager, name), self.requests

        def admitted(request_id: str, *args, **kwargs) -> None:
            method(request_id, *args, **kwargs)
            if request_id in requests:
                manager.hot_required.discard(request_id)

        setattr(manager, name, admitted)

    def _counting(self, count):
        """The KV cache coordinator's block count (``count``, vLLM's) for every request but these, and for these
        every page a block (the prefix's too) and no hot region. One wrap for all groups, not one per manager."""
        pools, requests = self._pools, self.requests
        resident, hot = set(map(id, self.coordinator.resident_managers)), set(map(id, self.coordinator.hot_managers))
        block_size = self.block_size

        def get_num_blocks_to_allocate(request_id: str, num_tokens: int, new_computed_blocks, num_encoder_tokens: int,
                                       total_computed_tokens: int, num_local_computed_tokens: int,
                                       num_tokens_main_model: int, apply_admission_cap: bool = False,
                                       prefill_end: int = 0) -> int:
            if request_id not in requests:
                return count(request_id, num_tokens, new_computed_blocks, num_encoder_tokens, total_computed_tokens,
                             num_local_computed_tokens, num_tokens_main_model, apply_admission_cap, prefill_end)
            if pools.retention_interval != 0:
                prefill_end = 0
            total = 0
            for i, manager in enumerate(pools.single_type_managers):
                if id(manager) in resident:
                    # Filled at admission, the row never holds a null page: only a page released to the host
                    # is dropped, and a request without a region releases none.
                    total += max(-(-num_tokens // block_size) - len(manager.req_to_blocks.get(request_id, ())), 0)
                elif id(manager) in hot:
                    total += manager.get_num_required_blocks(request_id) if request_id in manager.hot_required else 0
                else:  # vLLM's (a HiSparse model has no cross-attention group)
                    total += manager.get_num_blocks_to_allocate(
                        request_id, num_tokens, new_computed_blocks[i], total_computed_tokens,
                        num_local_computed_tokens, num_tokens_main_model, apply_admission_cap=apply_admission_cap,
                        prefill_end=prefill_end)
            return total

        return get_num_blocks_to_allocate

    def _fill(self, request_id: str, num_pages: int) -> None:
        """Gives each null page of the request's resident rows (its prefix, on the host only) a resident block:
        the GPU copy vLLM still holds of the page (``_adopt_copies``, as vLLM does for a request it gives a
        hot region; shared and pinned, it costs no block and no host read) or a block of its own, which
        ``get_num_blocks_to_allocate`` counted and ``restore`` fills from the host (the first ``num_pages``
        now; an external load's once it completes)."""
        coordinator = self.coordinator
        coordinator._adopt_copies(request_id)  # the committed prefix
        first = coordinator.resident_managers[0]
        coordinator.counters["pages_adopted"] += sum(
            1 for page, block in enumerate(first.req_to_blocks[request_id])
            if block.is_null and first.get_resident_page(request_id, page) is not None)
        recorder = coordinator._recorder
        filled: set[int] = set()
        for group, manager in enumerate(coordinator.resident_managers):
            row = manager.req_to_blocks[request_id]
            nulls = [page for page in range(len(row)) if manager.get_resident_page(request_id, page) is None]
            if not nulls:
                continue  # every page adopted or already resident: adoptions are recorded as they are made
            for page, block in zip(nulls, manager.block_pool.get_new_blocks(len(nulls)), strict=True):
                row[page] = block
            filled.update(nulls)
            recorder.reread(request_id, manager, group)
        self._unrestored[request_id] = filled
        self.restore(request_id, num_pages)

    def restore(self, request_id: str, num_pages: int) -> None:
        """Plans the restore from their host blocks of the pages among the request's first ``num_pages`` that
        ``_fill`` gave blocks of their own (a page already being copied is not planned twice)."""
        plan, counters = self.coordinator._plan_page_transfer, self.coordinator.counters
        unrestored = self._unrestored.get(request_id, set())
        for page in sorted(p for p in unrestored if p < num_pages):
            unrestored.discard(page)
            counters["pages_restored"] += plan(request_id, page, after_forward=False, restore=True)

    def forget(self, request_id: str) -> None:
        self.requests.discard(request_id)
        self._unrestored.pop(request_id, None)
        if not self.requests:
            self._count.off()
