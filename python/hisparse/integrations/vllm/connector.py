"""``HiSparseConnector``: vLLM 0.33's HiSparse connector with hisparse's coordinator (package docstring).

The class keeps vLLM's name on purpose: vLLM switches its HiSparse path (layout, spec managers, worker
binding, hot-buffer attention) on by that name (``config/vllm.py:1876``), and ``kv_connector_module_path``
makes the factory load this class instead of vLLM's (``kv_connector/factory.py:106``).

Scheduler role: :class:`~hisparse.integrations.vllm.coordinator.HisparseCoordinator` replaces vLLM's
coordinator. Worker role (``policy: coldest``): a :class:`~hisparse.integrations.vllm.heat.SelectionHeat`
counts what the resolver selects. vLLM resolves each index group's top-K once, in its leader runtime's
``HiSparseRuntime._resolve_residency`` (``runtime.py``, on the group's copy stream, inside the forward that
vLLM captures in CUDA graphs); the counted leaders become :class:`_CountingRuntime`, which runs vLLM's
resolve and then counts the same top-K, so the count is captured with it. The summaries ride back in
:class:`HisparseWorkerMetadata`.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from . import check_vllm_version

# Before vLLM's modules: on another version they may fail to import with a less helpful message.
check_vllm_version()

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (  # noqa: E402
    HiSparseConnector as VllmHiSparseConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (  # noqa: E402
    HiSparseConnectorMetadata,
    HiSparseConnectorWorkerMetadata,
)
from vllm.v1.hisparse.runtime import HiSparseRuntime  # noqa: E402
from vllm.v1.hisparse.types import ACTIVE_TAIL_PAGES  # noqa: E402

from ...errors import ConfigError, InvalidArgumentError  # noqa: E402
from ...heat import HeatOptions  # noqa: E402
from .coordinator import POLICIES, HisparseCoordinator, build_coordinator, slots_past_end  # noqa: E402
from .heat import HeatReport, SelectionHeat, joins_batch  # noqa: E402

#: Every key ``kv_connector_extra_config`` may hold: vLLM's HiSparse reads ``host_pool_gib``, hisparse the rest
#: (``heat_interval``, ``heat_coldest``, ``heat_hottest``, ``heat_layer_stride``: :class:`HeatOptions`).
EXTRA_CONFIG_KEYS = ("host_pool_gib", "policy", *HeatOptions.KEYS)
#: The share of the host's available memory a pool may take: vLLM's own rule where it pins the pool
#: (``check_hisparse_host_memory``, ``v1/hisparse/runtime.py``).
HOST_MEMORY_SHARE = 0.95
#: What the scheduler holds per host block: vLLM's ``KVCacheBlock`` in the host ``BlockPool`` measured 136
#: bytes (tracemalloc, 200,000 blocks), rounded up for the coordinator's per-block state.
SCHEDULER_BYTES_PER_HOST_BLOCK = 256
#: 1 PiB: more memory than any one host has (vLLM's planner takes minutes over sizes like 1e30 GiB).
MAX_HOST_POOL_GIB = 2**20

logger = logging.getLogger(__name__)


@dataclass
class HisparseWorkerMetadata(HiSparseConnectorWorkerMetadata):
    """vLLM's worker -> scheduler metadata plus a heat summary when one reached the host this step. Bytes,
    strings and ints: it pickles across vLLM's multi-process executor."""

    heat: HeatReport | None = None

    def aggregate(self, other: Any) -> HisparseWorkerMetadata:
        merged = super().aggregate(other)
        # Tensor-parallel ranks resolve the same top-K, so their heat agrees: keep one.
        heat = self.heat if self.heat is not None else getattr(other, "heat", None)
        return HisparseWorkerMetadata(merged.enqueued_transfer_counts, merged.completed_transfer_counts,
                                      merged.completed_host_copy_dst_ids, heat)


class _CountingRuntime(HiSparseRuntime):
    """A leader runtime that counts the top-K it has just resolved (module docstring). Only the class of
    vLLM's runtime object changes; its state is vLLM's."""

    selection_heat: SelectionHeat

    def _resolve_residency(self, **kwargs: Any) -> None:
        super()._resolve_residency(**kwargs)
        self.selection_heat.count(kwargs["topk_indices"], kwargs["req_id_per_token"], self.request_state_indices)


def count_heat_in_resolver(leader_runtimes: list[Any], heat: SelectionHeat) -> int:
    """Makes the counted index groups' leader runtimes count into ``heat``; returns how many count."""
    counted = 0
    for index, runtime in enumerate(leader_runtimes):
        if not heat.counted(index):
            continue
        if type(runtime) is not HiSparseRuntime and not isinstance(runtime, _CountingRuntime):
            raise ConfigError(f"cannot count heat in a {type(runtime).__name__}: vLLM's HiSparseRuntime expected")
        runtime.__class__ = _CountingRuntime
        runtime.selection_heat = heat
        counted += 1
    return counted


def _extra(vllm_config: Any) -> dict:
    return vllm_config.kv_transfer_config.kv_connector_extra_config or {}


def check_extra_keys(vllm_config: Any) -> None:
    """A misspelt key would silently leave its option at the default (``polcy: fifo`` would run ``coldest``)."""
    unknown = sorted(set(_extra(vllm_config)) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config has unknown keys {unknown}; HiSparseConnector takes "
                          f"{list(EXTRA_CONFIG_KEYS)}")


def policy_option(vllm_config: Any) -> str:
    policy = _extra(vllm_config).get("policy", "coldest")
    if policy not in POLICIES:
        raise ConfigError(f"kv_connector_extra_config.policy must be one of {POLICIES}, not {policy!r}")
    return policy


def heat_options(vllm_config: Any) -> HeatOptions:
    """The heat options of ``kv_connector_extra_config`` (``heat_interval``...), defaults for the absent ones."""
    try:
        return HeatOptions.from_config(_extra(vllm_config))
    except InvalidArgumentError as e:
        raise ConfigError(f"kv_connector_extra_config: {e}") from None


def host_pool_option(vllm_config: Any) -> float:
    """``host_pool_gib``, checked before vLLM sizes anything from it (a NaN or an infinity would fail deep in
    its planner, ``1e30`` make the scheduler allocate until it runs out of memory, ``true`` read as 1 GiB)."""
    gib = _extra(vllm_config).get("host_pool_gib")
    if isinstance(gib, bool) or not isinstance(gib, int | float) or not math.isfinite(gib) or not \
            0 < gib <= MAX_HOST_POOL_GIB:
        raise ConfigError(f"kv_connector_extra_config.host_pool_gib must be a number of GiB above 0 and at most "
                          f"{MAX_HOST_POOL_GIB:,} (1 PiB), not {gib!r}")
    return float(gib)


def check_options(vllm_config: Any) -> None:
    """Every ``kv_connector_extra_config`` option, each refused with a ``ConfigError`` naming its key."""
    check_extra_keys(vllm_config)
    policy_option(vllm_config)
    heat_options(vllm_config)
    host_pool_option(vllm_config)


def _available_host_bytes() -> int:
    import psutil  # vLLM's dependency

    return psutil.virtual_memory().available


def check_host_memory(vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
    """What this process would hold of the host pool fits in this host's memory, as vLLM requires: the worker
    pins the whole pool; the scheduler keeps a record of each of its blocks (a scheduler may plan for a pool
    far larger than its own host, which holds only the workers' pools)."""
    gib = host_pool_option(vllm_config)
    if role == KVConnectorRole.WORKER:
        what, needed = "the pinned pool", int(gib * 2**30)
    else:
        blocks = getattr(kv_cache_config, "hisparse_host_num_blocks", None) or 0
        what, needed = f"the scheduler's record of its {blocks:,} blocks", blocks * SCHEDULER_BYTES_PER_HOST_BLOCK
    available = _available_host_bytes()
    if needed > HOST_MEMORY_SHARE * available:
        raise ConfigError(f"kv_connector_extra_config.host_pool_gib = {gib:g}: {what} needs {needed / 2**30:,.1f} "
                          f"GiB of host memory, more than {HOST_MEMORY_SHARE:.0%} of the {available / 2**30:,.1f} "
                          f"GiB available; lower host_pool_gib")


def build_selection_heat(residency: Any, block_size: int, vllm_config: Any) -> SelectionHeat:
    """The worker's heat over vLLM's residency table of one resident group (``[state rows, pages]``)."""
    return SelectionHeat(residency, block_size, tail_pages=ACTIVE_TAIL_PAGES, options=heat_options(vllm_config))


class HiSparseConnector(VllmHiSparseConnector):
    """vLLM's ``HiSparseConnector`` whose scheduler side runs :class:`HisparseCoordinator` and whose worker
    side counts selection heat (module docstring)."""

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """vLLM asks this while it resolves the KV cache layout, before it sizes anything from the options:
        the first moment they can be refused with a clear error."""
        check_vllm_version()
        check_options(vllm_config)
        return super().get_required_kvcache_layout(vllm_config)

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        check_vllm_version()  # also when the class was imported before (e.g. by this submodule's path)
        check_options(vllm_config)  # in every role, not only where an option is used
        check_host_memory(vllm_config, role, kv_cache_config)
        self.policy = policy_option(vllm_config)
        unused = sorted(set(_extra(vllm_config)).intersection(HeatOptions.KEYS)) if self.policy == "fifo" else []
        if unused and role == KVConnectorRole.SCHEDULER:
            logger.warning("hisparse: %s set, but policy fifo (vLLM's release order) counts no selection heat; "
                           "they apply under policy coldest", ", ".join(unused))
        self._admission_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        self._slots_past_end = slots_past_end(vllm_config)
        self.selection_heat: SelectionHeat | None = None
        # Per scheduled step, oldest first: requests that started with a host import pending (a synchronous
        # load by another connector; ``update_connector_output``), and whether the oldest step's output
        # reached update_connector_output.
        self._sync_imports: deque[tuple[str, ...]] = deque()
        self._output_taken = False
        super().__init__(vllm_config, role, kv_cache_config)

    # ------------------------------------------------------------------ scheduler role

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        assert self.connector_scheduler is not None, "the scheduler role binds the KV cache manager"
        coordinator = build_coordinator(kv_cache_manager, self.policy)
        coordinator.requests = self.connector_scheduler.requests
        if isinstance(coordinator, HisparseCoordinator):
            coordinator.chunk_tokens = self._admission_tokens
            coordinator.slots_past_end = self._slots_past_end
        self.connector_scheduler.bind_coordinator(coordinator)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: what the workers held is forgotten (host prefixes,
        transfers and host copies in flight, per-request host state: ``forget_worker_state``), which the pool
        reset has normally done already. False (vLLM then reports the reset failed) while a request still holds
        blocks. A new worker needs nothing re-sent: every request comes back preempted, so vLLM sends its
        block table, and the coordinator its residency row, hot region and host copies, from scratch."""
        if self.coordinator is None:
            return None
        return self.coordinator.forget_worker_state()

    @property
    def coordinator(self):
        return self.connector_scheduler.coordinator if self.connector_scheduler is not None else None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Nothing is loaded from outside vLLM; None (wait) when admitting the request now would leave too
        little headroom for the running ones (``HisparseCoordinator.admit``)."""
        if self.connector_scheduler is not None and self.coordinator is not None:
            # vLLM ignores the answer for a request that reads no prefix cache (prompt_logprobs,
            # scheduler.py:1143): it starts now whatever we say, and the refusal still holds the queue behind it.
            can_wait = not request.skip_reading_prefix_cache
            if not self.coordinator.admit(request, num_computed_tokens, self._admission_tokens,
                                          can_wait=can_wait) and can_wait:
                return None, False
        return 0, False

    def build_connector_meta(self, scheduler_output: Any) -> HiSparseConnectorMetadata:
        """vLLM's ``HiSparseConnectorScheduler.build_connector_meta`` (``connector.py:124``), the same calls in
        the same order and the same metadata, with the coordinator's per-request scans replaced by the Rust
        core's or by ones that touch only requests whose step changes something (``bookkeeping.py``)."""
        scheduler = self.connector_scheduler
        coordinator = scheduler.coordinator
        # HiSparse rebinds worker state every step: the load must run before the forward.
        scheduler_output.has_sync_kv_loads = True
        new_reqs = scheduler_output.scheduled_new_reqs
        cached = scheduler_output.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        scheduled = scheduler_output.num_scheduled_tokens
        requests = scheduler.requests
        # Rows of unverified drafts are rewritten: mirror them again.
        back = ({rid: requests[rid].num_output_placeholders for rid in scheduled}
                if scheduler.async_speculative else None)
        self._finish_loaded_imports(coordinator, new_reqs, cached)
        # vLLM's views come after advance_scheduled, which changes rows only when it adopts GPU copies: then
        # they are taken again. Only the requests not quiet in the core (``Bookkeeping.settle``) are read here.
        row_mirrors, resident, busy = coordinator.scan(scheduled, computed, scheduler.draft_kv_lookahead, back)
        changes = coordinator.rows.changes
        coordinator.advance_scheduled(coordinator.with_residency_work(
            [(rid, min(computed[rid] + scheduled[rid], requests[rid].num_tokens)) for rid in busy]))
        command = coordinator.build_offload_command()
        host_block_copies = coordinator.take_host_block_copies()
        source_group = coordinator.host_group_id
        source_block_ids = [block for r in new_reqs for block in r.block_ids[source_group]]
        source_block_ids += [block for new_block_ids in cached.new_block_ids if new_block_ids is not None
                             for block in new_block_ids[source_group]]
        if coordinator.rows.changes != changes:
            row_mirrors, resident, _ = coordinator.scan(scheduled, computed, scheduler.draft_kv_lookahead, back)
        updates = coordinator.take_residency_updates(busy)
        coordinator.settle(busy)
        coordinator.end_pass()
        return HiSparseConnectorMetadata(command, host_block_copies, tuple(source_block_ids), row_mirrors, resident,
                                         updates)

    def _finish_loaded_imports(self, coordinator: Any, new_reqs: Any, cached: Any) -> None:
        """Finishes, before this step's transfers are planned, the host import of each request that starts
        in it with its load still pending (a synchronous load, which never reports ``finished_recving``) and
        whose imported host pages hold their data already: restores of the pages it reads resident (vLLM's
        import tail) then run before the forward that first reads them. Beside HiSparse, vLLM's
        ``OffloadingConnector`` loads only the groups it offloads (the indexer keys), within the prefix
        HiSparse's host pool holds (``_max_loadable_tokens``), so its imports are of pages published on the
        host already; finished after the step, as vLLM would have it, the tail page is read before it is
        restored. An import into host pages another connector is still writing is finished after the step
        (``update_connector_output``)."""
        imports = coordinator.pending_imports()
        if not imports:  # usually none: then no request can have started with one pending
            self._sync_imports.append(())
            return
        started = [r.req_id for r in new_reqs]
        started += [rid for rid in cached.req_ids if rid in cached.resumed_req_ids]
        after_step = []
        for rid in started:
            if rid not in imports:
                continue
            if coordinator.host_pages_hold_data(rid, imports[rid]):
                coordinator.finish_host_import(rid, failed=False)
            else:
                after_step.append(rid)
        self._sync_imports.append(tuple(after_step))

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM's, which finishes the host imports of the loads reported in ``finished_recving``, then the
        imports of requests that started in this output's step with their load still pending: loads that
        complete before the forward (vLLM's ``OffloadingConnector`` within ``sync_load_budget_bytes``), which
        never report ``finished_recving``. Beside HiSparse that connector loads only the indexer keys, of a
        prefix whose host pages HiSparse holds already (``_max_loadable_tokens`` bounds it there), but vLLM
        records every external load as an import into those pages, and left unfinished it keeps them invalid:
        the request never publishes its own pages past the loaded prefix, so the next turn of a conversation
        misses them (``tests/test_vllm_agent.py``). Those ``_finish_loaded_imports`` found with their host pages
        still being written are finished here, once the step has run, as vLLM's own import path would have it."""
        super().update_connector_output(connector_output)
        self._finish_step_imports()
        self._output_taken = True
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HisparseWorkerMetadata) and meta.heat is not None:
            self.coordinator.report_heat(meta.heat)

    def _finish_step_imports(self) -> None:
        """Finishes the imports left for after the oldest step in flight (``_finish_loaded_imports``)."""
        if self._sync_imports:
            for request_id in self._sync_imports.popleft():
                self.coordinator.finish_host_import(request_id, failed=False)  # a no-op once finished or freed

    def get_kv_connector_stats(self) -> Any:
        """vLLM's scheduler asks this once for every model output, after ``update_connector_output`` when the
        output has a connector part (``update_from_output``). A step that scheduled no token and whose workers
        report nothing comes back as vLLM's empty output, with none: its entry of ``_sync_imports`` (empty:
        no request starts in a step without tokens) goes here, or every later step's imports would be
        finished one output late, and a new import of a request re-admitted meanwhile before its pages hold
        data."""
        if self.connector_scheduler is not None:
            if not self._output_taken:
                self._finish_step_imports()
            self._output_taken = False
        return super().get_kv_connector_stats()

    # ------------------------------------------------------------------ worker role

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        if self.policy != "coldest":
            return  # fifo makes vLLM's decisions: nothing consumes heat
        worker = self.connector_worker
        if worker.residency is None:
            raise ConfigError("vLLM's HiSparse worker has no residency table: no resident cache group?")
        self.selection_heat = build_selection_heat(worker.residency[0], worker.kernel_block_size, self._vllm_config)
        count_heat_in_resolver(list(worker.leader_runtimes), self.selection_heat)

    def reset_capture_state(self) -> None:
        super().reset_capture_state()
        if self.selection_heat is not None:
            self.selection_heat.reset()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        if self.selection_heat is not None:
            meta = self._get_connector_metadata()
            self.selection_heat.begin_step(kwargs.get("request_ids") or (), kwargs.get("request_state_indices"),
                                           meta.residency_updates, joins_batch(kwargs.get("scheduler_output")))

    def build_connector_worker_meta(self) -> Any:
        meta = super().build_connector_worker_meta()
        if self.selection_heat is None:
            return meta
        report = self.selection_heat.end_step()
        if meta is None:
            return None if report is None else HisparseWorkerMetadata({}, {}, (), report)
        # Ours even without a report: vLLM aggregates the ranks' metadata with the first rank's aggregate(),
        # and vLLM's class would drop a report that another rank's summary brought this step (a summary
        # reaches the host when its copy has passed, which need not be the same step on every rank).
        return HisparseWorkerMetadata(meta.enqueued_transfer_counts, meta.completed_transfer_counts,
                                      meta.completed_host_copy_dst_ids, report)
