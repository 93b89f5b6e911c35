"""``HiSparseConnector``: vLLM 0.33's HiSparse connector with hisparse's coordinator (package docstring).

The class keeps vLLM's name on purpose: vLLM switches its HiSparse path (layout, spec managers, worker
binding, hot-buffer attention) on by that name (``config/vllm.py:1876``), and ``kv_connector_module_path``
makes the factory load this class instead of vLLM's (``kv_connector/factory.py:106``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
    HiSparseConnector as VllmHiSparseConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import (
    HiSparseConnectorWorkerMetadata,
)

from ...errors import ConfigError
from .coordinator import POLICIES, build_coordinator
from .heat import Summary


@dataclass
class HisparseWorkerMetadata(HiSparseConnectorWorkerMetadata):
    """vLLM's worker -> scheduler metadata plus heat summaries (request id -> ``heat.Summary``). Plain
    dataclasses of ints: it pickles across vLLM's multi-process executor."""

    heat: dict[str, Summary] = field(default_factory=dict)

    def aggregate(self, other: Any) -> HisparseWorkerMetadata:
        merged = super().aggregate(other)
        # Tensor-parallel ranks resolve the same top-K, so their heat agrees: keep the first one per request.
        heat = {**getattr(other, "heat", {}), **self.heat}
        return HisparseWorkerMetadata(merged.enqueued_transfer_counts, merged.completed_transfer_counts,
                                      merged.completed_host_copy_dst_ids, heat)


def _policy(vllm_config: Any) -> str:
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    policy = extra.get("policy", "coldest")
    if policy not in POLICIES:
        raise ConfigError(f"kv_connector_extra_config.policy must be one of {POLICIES}, not {policy!r}")
    return policy


class HiSparseConnector(VllmHiSparseConnector):
    """vLLM's ``HiSparseConnector`` whose scheduler side runs :class:`HisparseCoordinator`."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        self.policy = _policy(vllm_config)
        self._admission_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        super().__init__(vllm_config, role, kv_cache_config)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        assert self.connector_scheduler is not None, "the scheduler role binds the KV cache manager"
        self.connector_scheduler.bind_coordinator(build_coordinator(kv_cache_manager, self.policy))

    @property
    def coordinator(self):
        return self.connector_scheduler.coordinator if self.connector_scheduler is not None else None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Nothing is loaded from outside vLLM; None (wait) when admitting the request now would leave too
        little headroom for the running ones (``HisparseCoordinator.admit``)."""
        if self.connector_scheduler is not None and self.coordinator is not None:
            if not self.coordinator.admit(request.request_id, request.num_tokens, num_computed_tokens,
                                          self._admission_tokens):
                return None, False
        return 0, False

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HisparseWorkerMetadata) and meta.heat:
            self.coordinator.report_heat(meta.heat)
