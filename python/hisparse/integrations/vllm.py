"""hisparse behind vLLM 0.33's KV-connector API (``KVConnectorBase_V1``).

Load it through ``kv_connector_module_path``::

    --kv-transfer-config '{"kv_connector": "HiSparseHooksConnector",
                           "kv_connector_module_path": "hisparse.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"num_host_blocks": 65536, "top_k": 2048,
                                                         "hot_rows": 4096, "row_bytes": 656,
                                                         "layer_groups": [0, 0, 0, 1, ...]}}'

The connector maps vLLM's calls onto :mod:`hisparse.hooks`:

=============================================  ===================================================
vLLM calls (scheduler process)                 hooks
=============================================  ===================================================
``update_state_after_alloc(request, ...)``     remembers the request (its sampling parameters)
``build_connector_meta(scheduler_output)``     ``finish`` the finished and the preempted requests
                                               (vLLM recomputes those), ``admit`` the new and the
                                               resumed ones, then ``plan_step``; the
                                               :class:`~hisparse.hooks.WorkerStep` is the metadata
``update_connector_output(output)``            ``apply_results`` (the worker metadata)
``request_finished(request, block_ids)``       ``finish``
``get_num_new_matched_tokens``                 ``(0, False)``: nothing is loaded from outside
vLLM calls (each worker)                       hooks
``register_kv_caches(kv_caches)``              ``WorkerHooks.register`` (the layers' caches as the
                                               slab, a pinned host pool)
``start_load_kv(forward_context)``             ``apply`` (restores land before the forward)
``wait_for_layer_load`` / ``save_kv_layer``    nothing: restores are synchronous, page copies are
                                               planned by the core
``wait_for_save()``                            ``end_step`` (mirror written rows, heat, copies)
``build_connector_worker_meta()``              the :class:`~hisparse.hooks.StepResults`
=============================================  ===================================================

The attention backend calls :meth:`HiSparseHooksConnector.resolve` with each index group's top-K and reads
rows with :meth:`HiSparseHooksConnector.gather`. hisparse's core owns the GPU blocks of the sparse layers: the
block ids vLLM's allocator hands out for them are not used. Limits of this adapter: the hooks refuse a plan
made before the last step's results came back (run with ``async_scheduling`` off); vLLM's prefix cache does
not hold these layers (run with prefix caching off: the core's host prefix reuse needs a load path through
``get_num_new_matched_tokens`` that this adapter does not take); no speculative decoding (the core does not
take positions back).

This module imports without vLLM: the class then derives from a stand-in with the same method names.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..datapath import Layout
from ..errors import CapacityError, ConfigError
from ..hooks import SchedulerHooks, StepResults, WorkerHooks, WorkerStep

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )

    HAVE_VLLM = True
except Exception:  # noqa: BLE001 - vLLM missing, or present but unusable here
    HAVE_VLLM = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's scheduler -> worker metadata base."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stand-in for vLLM's worker -> scheduler metadata base."""

        def aggregate(self, other):
            raise NotImplementedError

    class KVConnectorBase_V1:  # type: ignore[no-redef]  # noqa: N801 - vLLM's name
        """Stand-in for vLLM's ``KVConnectorBase_V1`` when vLLM is not installed."""

        def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
            self._connector_metadata = None
            self._vllm_config = vllm_config
            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            self._kv_cache_config = kv_cache_config
            self._role = role

        @property
        def role(self) -> KVConnectorRole:
            return self._role

        def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> KVConnectorMetadata:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None


__all__ = [
    "HAVE_VLLM",
    "HiSparseHooksConnector",
    "HiSparseHooksMetadata",
    "HiSparseHooksWorkerMetadata",
    "Settings",
    "settings_from",
]


@dataclass
class HiSparseHooksMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: the step plan (None when nothing was scheduled)."""

    step: WorkerStep | None


@dataclass
class HiSparseHooksWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step. Every tensor-parallel worker runs the same copies and selections,
    so aggregating keeps one of them."""

    results: StepResults

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self


@dataclass(frozen=True)
class Settings:
    """Everything both halves need, from vLLM's config and ``kv_connector_extra_config``."""

    layout: Layout
    top_k: int
    num_host_blocks: int
    policy: str = "coldest"
    watermark: int | None = None

    def scheduler_kwargs(self) -> dict:
        lay = self.layout
        return dict(num_gpu_blocks=lay.num_gpu_blocks, num_host_blocks=self.num_host_blocks,
                    block_size=lay.block_size, max_model_len=lay.max_model_len, max_running=lay.max_running,
                    top_k=self.top_k, hot_rows=lay.hot_rows, num_index_groups=lay.num_groups,
                    page_bytes=lay.page_bytes, policy=self.policy, watermark=self.watermark)


def settings_from(extra: dict, *, block_size: int, max_model_len: int, max_running: int,
                  num_gpu_blocks: int) -> Settings:
    """``extra`` (``kv_connector_extra_config``): ``row_bytes``, ``layer_groups`` (index group per sparse
    layer), ``top_k``, optional ``hot_rows`` (default 2 x top_k), ``num_host_blocks`` or ``host_pool_gib``,
    ``policy`` and ``watermark``."""
    try:
        row_bytes = int(extra["row_bytes"])
        groups = tuple(int(g) for g in extra["layer_groups"])
        top_k = int(extra["top_k"])
    except KeyError as e:
        raise ConfigError(f"kv_connector_extra_config needs {e.args[0]!r}") from None
    hot_rows = int(extra.get("hot_rows", 2 * top_k))
    layout = Layout(num_gpu_blocks=num_gpu_blocks, num_host_blocks=1, block_size=block_size,
                    max_model_len=max_model_len, max_running=max_running, hot_rows=hot_rows, row_bytes=row_bytes,
                    layer_groups=groups)
    if "num_host_blocks" in extra:
        host = int(extra["num_host_blocks"])
    elif "host_pool_gib" in extra:
        host = int(float(extra["host_pool_gib"]) * (1 << 30) // layout.page_bytes)
    else:
        raise ConfigError("kv_connector_extra_config needs num_host_blocks or host_pool_gib")
    layout = Layout(**{**layout.__dict__, "num_host_blocks": host})
    return Settings(layout, top_k, host, extra.get("policy", "coldest"), extra.get("watermark"))


def _settings(vllm_config: Any, kv_cache_config: Any) -> Settings:
    extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
    return settings_from(
        extra,
        block_size=int(vllm_config.cache_config.block_size),
        max_model_len=int(vllm_config.model_config.max_model_len),
        max_running=int(vllm_config.scheduler_config.max_num_seqs),
        num_gpu_blocks=int(extra.get("num_gpu_blocks", getattr(kv_cache_config, "num_blocks", 0))),
    )


def _layer_index(name: str) -> int:
    found = re.findall(r"\d+", name)
    return int(found[0]) if found else 0


class HiSparseHooksConnector(KVConnectorBase_V1):
    """A ``KVConnectorBase_V1`` over :class:`~hisparse.hooks.SchedulerHooks` (scheduler role) and
    :class:`~hisparse.hooks.WorkerHooks` (worker role); see the module docstring for the mapping."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = _settings(vllm_config, kv_cache_config)
        self.scheduler: SchedulerHooks | None = None
        self.worker: WorkerHooks | None = None
        self._requests: dict[str, Any] = {}
        self._results: StepResults | None = None
        self._layer_of: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerHooks(**self.settings.scheduler_kwargs())

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """The sparse layers' caches (in layer order) become the slab; a pinned host pool is allocated."""
        lay = self.settings.layout
        names = sorted(kv_caches, key=_layer_index)
        if len(names) != lay.num_layers:
            raise ConfigError(f"{len(names)} KV caches registered; layer_groups names {lay.num_layers} layers")
        layers = [kv_caches[n].view(torch.uint8).reshape(-1, lay.row_bytes) for n in names]
        self._layer_of = {n: i for i, n in enumerate(names)}
        pinned = layers[0].device.type == "cuda"
        host = torch.zeros(lay.num_layers, lay.num_host_blocks * lay.block_size, lay.row_bytes, dtype=torch.uint8,
                           pin_memory=pinned)
        self.worker = WorkerHooks.register(lay, layers, host)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Applies the step plan before the forward (host -> GPU restores land here)."""
        meta = self._get_connector_metadata()
        step = getattr(meta, "step", None)
        if step is None or self.worker is None:
            return
        if not step.ok:
            raise CapacityError(f"hisparse could not back this step ({step.missing_blocks} blocks missing); "
                                f"schedule with SchedulerHooks.capacity() in mind")
        self.worker.apply(step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        """Ends the step: mirrors written rows, collects heat and finished copies."""
        if self.worker is not None and self.worker.in_step is not None:
            self._results = self.worker.end_step(flush=True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        results, self._results = self._results, None
        return HiSparseHooksWorkerMetadata(results) if results is not None else None

    def resolve(self, layer_name: str, topk: torch.Tensor, request_ids: list[str | None]) -> torch.Tensor:
        """For the attention backend: row ids of ``topk`` for the index group of ``layer_name``."""
        assert self.worker is not None, "register_kv_caches() first"
        layer = self._layer_of[layer_name]
        return self.worker.resolve(topk, request_ids, self.settings.layout.layer_groups[layer])

    def gather(self, layer_name: str, row_ids: torch.Tensor) -> torch.Tensor:
        assert self.worker is not None, "register_kv_caches() first"
        return self.worker.gather(row_ids, self._layer_of[layer_name])

    def shutdown(self):
        return None

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        self._requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """Finished, preempted, new and resumed requests first, then the step's plan."""
        hooks = self.scheduler
        assert hooks is not None, "the scheduler role builds metadata"
        for rid in sorted(getattr(scheduler_output, "finished_req_ids", None) or ()):
            self._finish(rid)
        # vLLM recomputes a preempted request: the core drops it and admits it again when it comes back.
        for rid in sorted(getattr(scheduler_output, "preempted_req_ids", None) or ()):
            if rid in hooks:
                hooks.finish(rid)
        for new in scheduler_output.scheduled_new_reqs:
            if new.num_computed_tokens:
                raise ConfigError(
                    f"request {new.req_id} starts with {new.num_computed_tokens} tokens from vLLM's own prefix "
                    f"cache, which does not hold the sparse layers here: run with prefix caching disabled"
                )
            self._admit(new.req_id, len(new.prompt_token_ids or ()))
        cached = scheduler_output.scheduled_cached_reqs
        all_tokens = getattr(cached, "all_token_ids", None) or {}
        for rid in sorted(getattr(cached, "resumed_req_ids", None) or ()):
            if rid not in hooks:
                self._admit(rid, len(all_tokens.get(rid, ())))
        scheduled = list(scheduler_output.num_scheduled_tokens.items())
        return HiSparseHooksMetadata(hooks.plan_step(scheduled) if scheduled else None)

    def _admit(self, request_id: str, prompt_len: int) -> None:
        request = self._requests.get(request_id)
        max_len = self.settings.layout.max_model_len
        max_tokens = getattr(getattr(request, "sampling_params", None), "max_tokens", None)
        if prompt_len and max_tokens:
            max_len = min(max_len, prompt_len + int(max_tokens))
        self.scheduler.admit(request_id, max(1, min(prompt_len, max_len)), (), max_len)

    def update_connector_output(self, connector_output: Any):
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, HiSparseHooksWorkerMetadata) and self.scheduler is not None:
            self.scheduler.apply_results(meta.results)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._finish(request.request_id)
        return False, None

    def _finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        if self.scheduler is not None and request_id in self.scheduler:
            self.scheduler.finish(request_id)

    def metrics(self) -> dict:
        """The hooks' metrics (scheduler role)."""
        return self.scheduler.metrics() if self.scheduler is not None else {}
