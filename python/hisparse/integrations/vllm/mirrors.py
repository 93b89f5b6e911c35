"""vLLM's per-step row mirrors, packed: ``HiSparseConnectorMetadata.row_mirrors`` without a Python object per
request or mirror on the scheduler's side.

vLLM's connector sends, every step, a dict of each scheduled request's ``SparseKVRowMirror`` tuple (the rows
its forward writes, to be copied to the host). Building those objects was the largest single part of our
connector's cost per request (``benches/vllm_step.py``), and pickling them to each worker costs again. The core
packs them instead (``BlockRows.scan``: a few byte strings), and :class:`RowMirrors` is the read-only mapping
vLLM's worker reads (``_flatten_row_mirrors``: ``row_mirrors.get(request_id, ())``), making a request's mirrors
when they are read, in the worker, where vLLM turns them into arrays again (``_set_row_mirrors``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from vllm.v1.hisparse.types import SparseKVRowMirror

from ..._core import unpack_row_mirrors


class RowMirrors(Mapping):
    """Request id -> tuple of ``SparseKVRowMirror``, as vLLM's ``row_mirrors`` dict, held as the core packs it:
    ``ids`` (every scheduled request, in order, mirrors or not) and native-endian arrays: ``counts`` (u32 per
    request), then per mirror ``groups`` i64 source starts, an i64 destination start and an i64 row count.
    Pickles as those bytes. The first read makes every request's mirrors at once, in the core
    (``unpack_row_mirrors``): the worker reads them all."""

    __slots__ = ("_ids", "_packed", "_groups", "_mirrors")

    def __init__(self, ids: list[str], counts: bytes, sources: bytes, destinations: bytes, rows: bytes,
                 groups: int) -> None:
        self._ids = ids
        self._packed = (counts, sources, destinations, rows)
        self._groups = groups
        self._mirrors: dict[str, tuple[SparseKVRowMirror, ...]] | None = None

    def _made(self) -> dict[str, tuple[SparseKVRowMirror, ...]]:
        if self._mirrors is None:
            self._mirrors = unpack_row_mirrors(SparseKVRowMirror, self._ids, *self._packed, self._groups)
        return self._mirrors

    def __getitem__(self, request_id: str) -> tuple[SparseKVRowMirror, ...]:
        return self._made()[request_id]

    def get(self, request_id: str, default=None):
        return self._made().get(request_id, default)  # vLLM's worker reads each request this way

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def __reduce__(self):
        return RowMirrors, (self._ids, *self._packed, self._groups)

    def __repr__(self) -> str:
        return f"RowMirrors({self._made()!r})"
