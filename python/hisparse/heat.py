"""Selection heat on the worker: one home for its options, its schedule, its ranking and the summary on its
way to the scheduler.

The resolver counts how often each page is selected (``heat[row, page]``); every ``interval`` steps the
worker ranks each request's releasable pages by those counts, sends the ``coldest`` and ``hottest`` of them
to the scheduler as the core's ``HeatSummary`` and halves every count (old heat fades: ``heat.rs`` gives the
rule). :class:`~hisparse.hooks.WorkerHooks` (over a ``DataPath``) and vLLM's worker
(:class:`~hisparse.integrations.vllm.heat.SelectionHeat`, over vLLM's residency table) both take a
:class:`HeatOptions` and rank with :func:`rank_heat`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from . import _core
from .errors import InvalidArgumentError

__all__ = ["HeatOptions", "HeatSummaryInFlight", "heat_ranks", "rank_heat"]


@dataclass(frozen=True)
class HeatOptions:
    """How the worker counts and reports heat; checked once, here.

    ``interval``: steps between summaries (and halvings of the counts); ``coldest`` / ``hottest``: the coldest
    and hottest releasable pages each summary ranks per request (the policy releases the coldest first and the
    hottest last); ``layer_stride``: vLLM's worker counts in every ``layer_stride``-th index group (each
    counted group costs a few small kernels per decode step; the hooks' resolver counts every group)."""

    interval: int = 32
    coldest: int = 128
    hottest: int = 32
    layer_stride: int = 8

    #: Each option's name in a configuration (vLLM's ``kv_connector_extra_config``), and its smallest value.
    KEYS: ClassVar[dict[str, int]] = {"heat_interval": 1, "heat_coldest": 0, "heat_hottest": 0, "heat_layer_stride": 1}

    def __post_init__(self) -> None:
        for f in fields(self):
            value, low = getattr(self, f.name), self.KEYS[f"heat_{f.name}"]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**24:
                raise InvalidArgumentError(f"heat_{f.name} must be an integer from {low} to 2**24 - 1, not {value!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> HeatOptions:
        """The options under their configuration names (``heat_interval``...); absent ones take the defaults."""
        return cls(**{f.name: config[f"heat_{f.name}"] for f in fields(cls) if f"heat_{f.name}" in config})

    def due(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) ends with a summary: every ``interval`` steps, and sooner at
        the start (steps 1, 2, 4, ...), when a worker has nothing ranked yet."""
        return step % self.interval == 0 or (step < self.interval and not step & (step - 1))


def heat_ranks(pages: int, coldest: int, hottest: int) -> tuple[int, int]:
    """How many coldest and hottest keys :func:`rank_heat` returns per row of ``pages`` pages."""
    return min(coldest, pages), min(hottest, pages)


def rank_heat(heat: torch.Tensor, eligible: torch.Tensor, coldest: int, hottest: int) -> tuple[torch.Tensor, ...]:
    """The ranking of ``heat_summary`` over plain tensors, on whatever device they live (no host sync).

    ``heat`` int32 ``[R, P]``, ``eligible`` bool ``[R, P]`` (the pages a row may rank). Returns
    ``(cold_keys, cold_counts, hot_keys, hot_counts)`` as ``heat::from_ranked_keys`` takes them: keys
    ``heat * P + page`` (negative heat reads as 0), the coldest ascending, the hottest descending, each
    ``[R, min(k, P)]``, and how many of each row's keys are eligible. The hottest that are also among the
    coldest are dropped when the keys are encoded. ``DataPath`` ranks its state with it, and vLLM's worker
    (``integrations.vllm.heat``) its selection counts."""
    p = heat.shape[1]
    pages = torch.arange(p, device=heat.device)
    # (heat, page) packed into one key, so that ranking by key ranks by heat then page; ineligible pages
    # rank past either end.
    key = heat.clamp(min=0).to(torch.int64) * p + pages[None, :]
    kc, kh = heat_ranks(p, coldest, hottest)
    cold = torch.topk(torch.where(eligible, key, torch.iinfo(torch.int64).max), kc, dim=1, largest=False).values
    hot = torch.topk(torch.where(eligible, key, torch.iinfo(torch.int64).min), kh, dim=1).values
    n = eligible.sum(dim=1)
    return cold, n.clamp(max=kc), hot, n.clamp(max=kh)


class HeatSummaryInFlight:
    """A heat summary on its way to the host: ``ready()`` says whether ``take()`` would not wait."""

    def __init__(self, encoded: bytes | None = None):
        self._encoded = encoded
        self._host: tuple[torch.Tensor, ...] = ()
        self._event = None
        self._shape = (0, 0, 0)

    @classmethod
    def copy_back(cls, tensors: tuple[torch.Tensor, ...], shape: tuple[int, int, int]) -> HeatSummaryInFlight:
        """Copies the ranked keys and counts (coldest, hottest), row requests and row lengths to pinned memory
        without waiting; ``shape`` is (pages, coldest, hottest)."""
        out = cls()
        device = tensors[0].device
        pin = device.type == "cuda"
        out._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors)
        if not pin:
            for host, t in zip(out._host, tensors, strict=True):
                host.copy_(t)
        else:
            # On the tensors' device (the current device may be another): the copies and their event on its
            # current stream, after the ranking.
            with torch.cuda.device(device):
                for host, t in zip(out._host, tensors, strict=True):
                    host.copy_(t, non_blocking=True)
                out._event = torch.cuda.Event()
                out._event.record(torch.cuda.current_stream(device))
        out._shape = shape
        return out

    def ready(self) -> bool:
        return self._encoded is not None or self._event is None or self._event.query()

    def take(self) -> bytes:
        if self._encoded is None:
            if self._event is not None:
                self._event.synchronize()
            # Its own contiguous CPU tensors: (address, elements) is all the encoder needs.
            bufs = [(t.data_ptr(), t.numel()) for t in self._host]
            self._encoded = _core._encode_heat_summary(bufs, *self._shape)
            self._host = ()
        return self._encoded
