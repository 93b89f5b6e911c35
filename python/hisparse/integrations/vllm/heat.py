"""Selection heat in vLLM's worker: counted on the device where the resolver reads the top-K, ranked with the
data path's ranking, sent to the scheduler as the core's ``HeatSummary``.

:class:`SelectionHeat` is the whole worker side, on whatever device its tensors live: the GPU worker
(``connector.HiSparseConnector``) and the CPU harness (``tests/vllm_harness.py``) run the same code.

- :meth:`SelectionHeat.count`, inside the forward, per index group: ``heat[state row, page] += 1`` for each
  selected position of each query row. Fixed shapes, no host sync, no allocation that outlives the call:
  it is captured with the resolver in vLLM's CUDA graphs. Padding rows (batch row or state row < 0) and
  padding positions (< 0) land in one spare element past the table.
- :meth:`SelectionHeat.begin_step`, before the forward (eager): a state row that now serves another
  request starts cold, and the pages each row has come from the scheduler's residency updates (the same
  ones vLLM applies to its residency table). Rows are checked for a new owner in the steps a request joins
  the worker's batch (:func:`joins_batch`), the only ones in which vLLM's worker hands out a state row, and
  whenever the batch's request ids change.
- :meth:`SelectionHeat.end_step`, after the forward: when ``HeatOptions.due`` (every ``interval`` steps, sooner
  at first: steps 1, 2, 4, ...) it ranks the batch's rows with :func:`hisparse.heat.rank_heat` (DataPath's ranking) over
  the pages the scheduler may release or move (resident, outside the ``tail_pages`` vLLM keeps pinned),
  halves their counts (``heat.rs`` gives the decay rule), and copies the keys back through pinned memory
  behind an event; a later step sends the encoded summary once the event has passed. Nothing waits.

Counts are per query row: an MTP request's verification rows each count their selections (the core's
resolver counts a request's distinct positions once); the scheduler only compares pages of one request, so
this scales a request's heat without reordering what a single row selects. vLLM's prefill-sized batches
that read only resident pages skip the resolver (``index_group.py``), so prefill selections are not counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ...datapath import _to_device
from ...errors import InvalidArgumentError
from ...heat import HeatOptions, HeatSummaryInFlight, heat_ranks, rank_heat

__all__ = ["HeatReport", "SelectionHeat", "joins_batch"]


def joins_batch(scheduler_output: object) -> bool:
    """Whether a request joins vLLM's worker batch in this step (a new one, or one resumed after a
    preemption): the worker then gives it a state row, which may have served another request, while the batch's
    request ids can be those of the last forward, in the same order (every running request preempted by
    ``reset_prefix_cache(reset_running_requests=True)`` comes back on other rows). True when unknown (None)."""
    if scheduler_output is None:
        return True
    return bool(scheduler_output.scheduled_new_reqs or scheduler_output.scheduled_cached_reqs.resumed_req_ids)


@dataclass(frozen=True)
class HeatReport:
    """An encoded ``HeatSummary`` (``_core.decode_heat_summary`` reads it) whose request ``i`` is
    ``request_ids[i]``. Bytes and strings: it pickles across vLLM's multi-process executor."""

    summary: bytes
    request_ids: tuple[str, ...]


def _positive(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**24:
        raise InvalidArgumentError(f"{name} must be an integer in {low}..2**24, not {value!r}")
    return value


class SelectionHeat:
    """Heat of one worker's state rows (module docstring).

    ``residency``: vLLM's residency table of one resident group, int32 ``[S, P]`` by state row and page (0:
    read from the host), on the worker's device. ``tail_pages``: a request's last pages, which vLLM never
    releases (``ACTIVE_TAIL_PAGES``), left out of the ranking. ``options``: when summaries go out, what they
    rank, and which index groups count (:class:`~hisparse.heat.HeatOptions`)."""

    def __init__(self, residency: torch.Tensor, block_size: int, *, tail_pages: int,
                 options: HeatOptions | None = None):
        if not isinstance(residency, torch.Tensor) or residency.dim() != 2 or residency.dtype != torch.int32:
            raise InvalidArgumentError("residency must be vLLM's int32 [state rows, pages] residency table")
        if options is not None and not isinstance(options, HeatOptions):
            raise InvalidArgumentError(f"options must be HeatOptions, not {type(options).__name__}")
        self.block_size = _positive("block_size", block_size, 1)
        self.tail_pages = _positive("tail_pages", tail_pages, 0)
        self.options = options if options is not None else HeatOptions()
        self.residency = residency
        s, p = residency.shape
        dev = residency.device
        self._flat = torch.zeros(s * p + 1, dtype=torch.int32, device=dev)
        self.heat = self._flat[: s * p].view(s, p)
        # Per state row: the request it serves (a hash of its id; a row that changes hands starts cold) and
        # the pages it has (from the residency updates).
        self._owner = torch.zeros(s, dtype=torch.int64, device=dev)
        self._pages = torch.zeros(s, dtype=torch.int32, device=dev)
        self._page_index = torch.arange(p, device=dev)
        self._cuda = dev.type == "cuda"
        self._ids: tuple[str, ...] = ()
        self._owner_ids: tuple[str, ...] = ()  # the batch whose rows' owners were last checked
        self._rows: torch.Tensor | None = None
        self._steps = 0
        self._pending: deque[tuple[HeatSummaryInFlight, tuple[str, ...]]] = deque()

    def reset(self) -> None:
        """Forgets every count and row (after vLLM's CUDA-graph capture, whose dummy forwards count too)."""
        self._flat.zero_()
        self._owner.zero_()
        self._pages.zero_()
        self._owner_ids, self._ids, self._rows = (), (), None

    def counted(self, index_group: int) -> bool:
        """Whether :meth:`count` runs in this index group (by its position among the index groups)."""
        return index_group % self.options.layer_stride == 0

    # ------------------------------------------------------------------ in the forward (captured)

    def count(self, topk: torch.Tensor, batch_rows: torch.Tensor, state_rows: torch.Tensor) -> None:
        """``topk`` ``[T, K]`` selected positions (< 0 pads) of query row ``t``, which belongs to batch row
        ``batch_rows[t]`` (< 0: padding), whose state row is ``state_rows[batch row]`` (< 0: none)."""
        s, p = self.heat.shape
        rows = state_rows.index_select(0, batch_rows.clamp(min=0).to(torch.int64)).to(torch.int64)
        live = (batch_rows >= 0) & (rows >= 0)
        page = topk.to(torch.int64).div(self.block_size, rounding_mode="floor")
        ok = live[:, None] & (topk >= 0) & (page < p)
        flat = torch.where(ok, rows[:, None] * p + page, s * p).view(-1)
        self._flat.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.int32, device=flat.device))

    # ------------------------------------------------------------------ around the forward (eager)

    def begin_step(self, request_ids: Sequence[str], state_rows: torch.Tensor | None,
                   residency_updates: Mapping[str, object], joined: bool = True) -> None:
        """Before the forward: ``request_ids`` in batch order, ``state_rows`` their state rows (vLLM's
        ``idx_mapping``, at least ``len(request_ids)`` long), the step's residency updates (vLLM's
        ``SparseKVResidencyUpdate`` by request id), and whether a request joined the batch this step
        (:func:`joins_batch`; True checks every row's owner). The rows live on the device, so they are not
        compared with the last step's: that would wait for the device."""
        ids = tuple(request_ids)
        self._ids, self._rows = ids, None
        if not ids or state_rows is None:
            return
        dev = self.heat.device
        rows = state_rows[: len(ids)].to(device=dev, dtype=torch.int64, copy=True)  # this step's, kept
        self._rows = rows
        if joined or ids != self._owner_ids:
            # hash() is stable within this process, which is all the table needs; a collision would only
            # keep a row's heat across two requests.
            codes = _to_device(torch.tensor([hash(r) for r in ids], dtype=torch.int64), dev)
            changed = (self._owner.index_select(0, rows) != codes)
            self.heat.index_copy_(0, rows, torch.where(changed[:, None], 0, self.heat.index_select(0, rows)))
            self._pages.index_copy_(0, rows, torch.where(changed, 0, self._pages.index_select(0, rows)))
            self._owner.index_copy_(0, rows, codes)
            self._owner_ids = ids
        if residency_updates:
            at = {rid: i for i, rid in enumerate(ids)}
            pairs = [(at[rid], max(u.pages) + 1) for rid, u in residency_updates.items() if u.pages and rid in at]
            if pairs:
                host = torch.tensor(pairs, dtype=torch.int64)
                pairs_dev = _to_device(host, dev)
                upd_rows = rows.index_select(0, pairs_dev[:, 0])
                grown = torch.maximum(self._pages.index_select(0, upd_rows), pairs_dev[:, 1].to(torch.int32))
                self._pages.index_copy_(0, upd_rows, grown)

    def end_step(self) -> HeatReport | None:
        """After the forward: starts a summary when one is due, and returns the newest summary that has
        reached the host (None if none has)."""
        if self._rows is not None:
            self._steps += 1
            if self.options.due(self._steps):
                self._start_summary(self._ids, self._rows)
            self._rows = None
        report = None
        while self._pending and self._pending[0][0].ready():
            summary, ids = self._pending.popleft()
            report = HeatReport(summary.take(), ids)
        return report

    def _start_summary(self, ids: tuple[str, ...], rows: torch.Tensor) -> None:
        s, p = self.heat.shape
        heat = self.heat.index_select(0, rows)
        limit = self._pages.index_select(0, rows) - self.tail_pages
        eligible = (self.residency.index_select(0, rows) != 0) & (self._page_index[None, :] < limit[:, None])
        coldest, hottest = self.options.coldest, self.options.hottest
        ranked = rank_heat(heat, eligible, coldest, hottest)
        self.heat.index_copy_(0, rows, heat.clamp(min=0) >> 1)
        n = len(ids)
        # The summary's request i is batch row i; every row serves a request (a positive "length").
        batch = torch.arange(n, dtype=torch.int64, device=rows.device)
        serving = torch.ones(n, dtype=torch.int32, device=rows.device)
        inflight = HeatSummaryInFlight.copy_back((*ranked, batch, serving), (p, *heat_ranks(p, coldest, hottest)))
        self._pending.append((inflight, ids))
