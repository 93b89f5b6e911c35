"""Selection-heat summaries, worker side (torch only: the same code on CPU tensors and on the GPU).

The resolver counts, per request state row and page, how often the indexer selected a row of the page
(``heat[row, page]``, ``cuda/SPEC.md``). Every ``heat_interval`` steps the worker sends the scheduler, per
request, up to ``limit`` (page, heat) pairs, coldest first, among the request's resident pages that have a
durable host copy (the pages the scheduler may release), then halves every count so that old selections
fade. The scheduler's :class:`~hisparse._core.PoolPolicy` turns summaries into release and reuse order.

A summary is ``(pages, heat, full)``: ``full`` when the limit cut it short, in which case every candidate page
it does not list was at least as hot as the hottest it lists.

This is the coldest half of ``DataPath.heat_summary``'s ranking, over tensors the caller hands in: vLLM's
worker keeps vLLM's tables, not a ``DataPath``. It should become that one ranking (and its encoding) once the
GPU worker counts heat; today only the CPU harness calls it.
"""

from __future__ import annotations

import torch

Summary = tuple[tuple[int, ...], tuple[int, ...], bool]


def summarize_heat(
    heat: torch.Tensor, candidates: torch.Tensor, rows: dict[str, int], limit: int
) -> dict[str, Summary]:
    """``heat`` int32 ``[S, P]``; ``candidates`` bool ``[S, P]`` (resident, with a durable host copy);
    ``rows``: request id -> state row. Halves ``heat`` in place afterwards (decay)."""
    out: dict[str, Summary] = {}
    if rows:
        ids = list(rows)
        index = torch.as_tensor([rows[r] for r in ids], dtype=torch.long, device=heat.device)
        h = heat.index_select(0, index).to(torch.int64)
        mask = candidates.index_select(0, index)
        # Non-candidates sort after every candidate; ties keep page order (stable).
        key = torch.where(mask, h, torch.iinfo(torch.int64).max)
        order = torch.sort(key, dim=1, stable=True).indices[:, :limit]
        counts = mask.sum(dim=1)
        top_heat = torch.gather(h, 1, order)
        for i, rid in enumerate(ids):
            n = min(int(counts[i]), limit)
            out[rid] = (tuple(order[i, :n].tolist()), tuple(top_heat[i, :n].tolist()), int(counts[i]) > limit)
    heat.div_(2, rounding_mode="floor")
    return out
