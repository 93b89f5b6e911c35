"""The worker side of the data path: the GPU slab, the host pool, the resolver's state tensors, and one API
that runs the CUDA kernels on CUDA tensors and the Rust CPU reference (the specification,
``cuda/SPEC.md``) on CPU tensors.

A :class:`DataPath` mirrors the manager's tables from the :class:`~hisparse._core.StepPlan` s it applies;
it never asks the manager anything, exactly like a worker process would.

On CPU tensors the Rust reference reads and writes the tensors' memory directly, with the GIL released:
no other thread may resize, free or write a tensor passed to this module while the call runs. Every
tensor's dtype, device, contiguity and shape are checked here, and no tensor that is written may overlap
any other tensor of the same call (Rust would hold aliasing ``&mut`` slices); this module is the only guard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import _core
from .errors import InvalidArgumentError

STATE_FIELDS = (
    "seq_lens",
    "block_table",
    "host_table",
    "hot_blocks",
    "hot_pos",
    "hot_lru",
    "heat",
    "status",
    "counters",
)


def _buf(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(address, elements) of a CPU tensor, after checking everything the Rust side relies on."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"{name} is on {t.device}; the reference path takes CPU tensors")
    if t.dtype != dtype:
        raise InvalidArgumentError(f"{name} must be {dtype}, not {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise InvalidArgumentError(f"{name} must have shape {list(shape)}, not {list(t.shape)}")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{name} must be contiguous")
    return t.data_ptr(), t.numel()


def _rows_view(t: torch.Tensor, name: str, row_bytes: int) -> tuple[int, int]:
    buf = _buf(t, name, torch.uint8)
    if t.dim() != 2 or t.shape[1] != row_bytes:
        raise InvalidArgumentError(f"{name} must be [rows, {row_bytes}] uint8, not {list(t.shape)}")
    return buf


def _check_disjoint(written: dict[str, torch.Tensor], read: dict[str, torch.Tensor]) -> None:
    """Refuses a call in which a tensor that is written overlaps any other tensor of the call.

    Rust views each buffer as a slice, and a ``&mut`` slice overlapping any other slice is undefined
    behaviour. Byte ranges are compared, not storages: the layers of one slab are disjoint views of one
    storage. Tensors only read may overlap each other. Call after ``_buf``, so that every tensor is
    contiguous and its range is exactly ``numel * element_size`` bytes.
    """
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name in written, name)
        for name, t in [*written.items(), *read.items()]
        if t.numel()  # an empty slice aliases nothing
    )
    # Sweep in order of start address: a span overlaps an earlier one iff it starts before the earlier
    # spans' furthest end; only overlaps involving a written span count, so track both furthest ends.
    furthest = furthest_written = None
    for span in spans:
        start, end, writes, name = span
        other = furthest if writes else furthest_written
        if other is not None and start < other[1]:
            raise InvalidArgumentError(f"{other[3]} and {name} overlap in memory, and one of them is written")
        if furthest is None or end > furthest[1]:
            furthest = span
        if writes and (furthest_written is None or end > furthest_written[1]):
            furthest_written = span


def _geometry(state: dict[str, torch.Tensor], block_size: int, row_bytes: int) -> tuple[int, int, int, int, int]:
    pages = state["block_table"].shape[1]
    _, groups, hot_rows = state["hot_pos"].shape
    return block_size, pages, hot_rows, groups, row_bytes


def resolve_reference(
    *,
    topk: torch.Tensor,
    row_state: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    host_table: torch.Tensor,
    hot_blocks: torch.Tensor,
    hot_pos: torch.Tensor,
    hot_lru: torch.Tensor,
    heat: torch.Tensor,
    status: torch.Tensor,
    counters: torch.Tensor,
    gpu_layers: Sequence[torch.Tensor],
    host_layers: Sequence[torch.Tensor],
    group: int,
    block_size: int,
    out: torch.Tensor,
) -> None:
    """``resolve`` of SPEC.md on CPU tensors (the keywords of :func:`hisparse.kernels.ops.resolve`, less
    ``miss_plan`` / ``miss_count``, which only the CUDA resolver records).

    ``gpu_layers`` / ``host_layers`` are the group's layers, each ``[rows, row_bytes]`` uint8.
    """
    if topk.dim() != 2:
        raise InvalidArgumentError(f"topk must be [rows, top_k], not {list(topk.shape)}")
    if len(gpu_layers) != len(host_layers) or not gpu_layers:
        raise InvalidArgumentError("give the same positive number of GPU and host layers")
    if hot_pos.dim() != 3 or block_table.dim() != 2:
        raise InvalidArgumentError("block_table must be [S, P] and hot_pos [S, G, H]")
    rows, top_k = topk.shape
    s, groups = block_table.shape[0], hot_pos.shape[1]
    if not 0 <= group < groups:
        raise InvalidArgumentError(f"group {group} is out of range: the state has {groups} index groups")
    if seq_lens.shape != (s,) or status.shape != (s,):
        raise InvalidArgumentError("seq_lens and status must be [S]")
    read = dict(seq_lens=seq_lens, block_table=block_table, host_table=host_table, hot_blocks=hot_blocks)
    written = dict(hot_pos=hot_pos, hot_lru=hot_lru, heat=heat, status=status, counters=counters)
    state = {**read, **written}
    bufs = [_buf(t, name, torch.int64 if name == "counters" else torch.int32) for name, t in state.items()]
    row_bytes = gpu_layers[0].shape[-1]
    gpu = {f"gpu layer {i}": t for i, t in enumerate(gpu_layers)}
    host = {f"host layer {i}": t for i, t in enumerate(host_layers)}
    gpu_bufs = [_rows_view(t, name, row_bytes) for name, t in gpu.items()]
    host_bufs = [_rows_view(t, name, row_bytes) for name, t in host.items()]
    topk_buf = _buf(topk, "topk", torch.int32)
    row_state_buf = _buf(row_state, "row_state", torch.int32, (rows,))
    out_buf = _buf(out, "out", torch.int32, (rows, top_k))
    # Rust takes every layer, the host ones too, as a mutable slice.
    _check_disjoint({**written, **gpu, **host, "out": out}, {**read, "topk": topk, "row_state": row_state})
    _core._ref_resolve(
        _geometry(state, block_size, row_bytes),
        bufs,
        topk_buf,
        top_k,
        row_state_buf,
        group,
        gpu_bufs,
        host_bufs,
        out_buf,
    )


@dataclass(frozen=True)
class Layout:
    """Sizes of one data path. ``layer_groups[l]`` is the index group of sparse layer ``l``."""

    num_gpu_blocks: int
    num_host_blocks: int
    block_size: int
    max_model_len: int
    max_running: int
    hot_rows: int
    row_bytes: int
    layer_groups: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        for name in ("num_gpu_blocks", "num_host_blocks", "block_size", "max_model_len", "max_running",
                     "hot_rows", "row_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, not {value!r}")
        if self.row_bytes % 16:  # the kernels move rows in 16-byte vectors
            raise InvalidArgumentError(f"row_bytes ({self.row_bytes}) must be a multiple of 16")
        if not self.layer_groups or sorted(set(self.layer_groups)) != list(range(max(self.layer_groups) + 1)):
            raise InvalidArgumentError("layer_groups must name every group from 0 up")
        from .kernels.launch import check_datapath  # what a kernel launch would refuse, refused now

        check_datapath(hot_rows=self.hot_rows, block_size=self.block_size, gpu_blocks=self.num_gpu_blocks,
                       host_blocks=self.num_host_blocks, max_model_len=self.max_model_len, row_bytes=self.row_bytes,
                       batch_rows=self.max_running, layers=self.num_layers, groups=self.num_groups)

    @property
    def num_layers(self) -> int:
        return len(self.layer_groups)

    @property
    def num_groups(self) -> int:
        return max(self.layer_groups) + 1

    @property
    def max_pages(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def hot_blocks(self) -> int:
        return math.ceil(self.hot_rows / self.block_size)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page for every layer: one GPU block, one host block."""
        return self.block_size * self.row_bytes * self.num_layers

    def layers_of(self, group: int) -> list[int]:
        return [layer for layer, g in enumerate(self.layer_groups) if g == group]


def _adopt(layout: Layout, gpu: torch.Tensor | Sequence[torch.Tensor], host: torch.Tensor) -> torch.device:
    """Checks an engine's own slab and host pool against ``layout``; returns the slab's device."""
    rows, rb = layout.num_gpu_blocks * layout.block_size, layout.row_bytes
    want_host = (layout.num_layers, layout.num_host_blocks * layout.block_size, rb)
    if isinstance(gpu, torch.Tensor):
        checks = [("gpu", gpu, (layout.num_layers, rows, rb))]
    else:
        if len(gpu) != layout.num_layers:
            raise InvalidArgumentError(f"give {layout.num_layers} layer tensors, not {len(gpu)}")
        checks = [(f"gpu layer {i}", t, (rows, rb)) for i, t in enumerate(gpu)]
    for name, t, want in [*checks, ("host", host, want_host)]:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != want:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidArgumentError(f"{name} must be a uint8 tensor of shape {list(want)}, not {got}")
        if not t.is_contiguous():
            raise InvalidArgumentError(f"{name} must be contiguous")
    device = checks[0][1].device
    if any(t.device != device for _, t, _ in checks):
        raise InvalidArgumentError("every layer of the slab must be on one device")
    if host.device.type != "cpu":
        raise InvalidArgumentError(f"the host pool must be in CPU memory, not on {host.device}")
    if device.type == "cuda" and not host.is_pinned():
        raise InvalidArgumentError("the host pool must be pinned when the slab is on CUDA")
    # Layers sharing memory would overwrite each other; refused here already rather than at the first copy.
    slabs = {name: t for name, t, _ in checks} | ({"host": host} if device.type == "cpu" else {})
    _check_disjoint(slabs, {})
    return device


class DataPath:
    """Slab, host pool and resolver state for one worker, on CPU or CUDA.

    The slab and the host pool are allocated here, or adopted from an engine that owns them: ``gpu`` one
    uint8 tensor ``[layers, num_gpu_blocks * bs, row_bytes]`` or one ``[num_gpu_blocks * bs, row_bytes]``
    tensor per layer (a block id addresses the same rows in every layer), ``host`` ``[layers,
    num_host_blocks * bs, row_bytes]`` in CPU memory, pinned when the slab is on CUDA.
    """

    def __init__(
        self,
        layout: Layout,
        device: str | torch.device = "cpu",
        *,
        gpu: torch.Tensor | Sequence[torch.Tensor] | None = None,
        host: torch.Tensor | None = None,
    ):
        if (gpu is None) != (host is None):
            raise InvalidArgumentError("adopt both the slab and the host pool, or neither")
        self.layout = layout
        self.device = _adopt(layout, gpu, host) if gpu is not None else torch.device(device)
        lay, dev = layout, self.device
        s, p, g, h = lay.max_running, lay.max_pages, lay.num_groups, lay.hot_rows
        i32 = dict(dtype=torch.int32, device=dev)
        if gpu is not None:
            self.gpu = gpu if isinstance(gpu, torch.Tensor) else list(gpu)
            self.host = host
        else:
            self.gpu = torch.zeros(lay.num_layers, lay.num_gpu_blocks * lay.block_size, lay.row_bytes,
                                   dtype=torch.uint8, device=dev)
            self.host = torch.zeros(lay.num_layers, lay.num_host_blocks * lay.block_size, lay.row_bytes,
                                    dtype=torch.uint8, pin_memory=dev.type == "cuda")
        self.state: dict[str, torch.Tensor] = {
            "seq_lens": torch.zeros(s, **i32),
            "block_table": torch.zeros(s, p, **i32),
            "host_table": torch.full((s, p), -1, **i32),
            "hot_blocks": torch.zeros(s, lay.hot_blocks, **i32),
            "hot_pos": torch.full((s, g, h), -1, **i32),
            "hot_lru": torch.arange(h, **i32).repeat(s, g, 1),
            "heat": torch.zeros(s, p, **i32),
            "status": torch.zeros(s, **i32),
            "counters": torch.zeros(3, dtype=torch.int64, device=dev),
        }

    # ------------------------------------------------------------------ applying plans

    def apply(self, plan: _core.StepPlan) -> list[int]:
        """Applies a plan in its documented order and runs its copies; returns the transfer ids started.

        On CPU the copies are done when this returns; the caller reports them to the manager whenever it
        likes (late or out of order is fine).
        """
        self._check_plan(plan)
        st, dev = self.state, self.device
        for row in plan.cleared_rows:
            st["seq_lens"][row] = 0
            st["block_table"][row] = 0
            st["host_table"][row] = -1
            st["heat"][row] = 0
            st["status"][row] = 0
            self._reset_hot(row, [])
        if plan.seq_lens:
            rows, lens = zip(*plan.seq_lens, strict=True)
            st["seq_lens"][list(rows)] = torch.tensor(lens, dtype=torch.int32, device=dev)
        updates = plan.table_updates
        if updates:
            t = torch.tensor(updates, dtype=torch.int64)
            idx = (t[:, 0].to(dev), t[:, 1].to(dev))
            st["block_table"][idx] = t[:, 2].to(torch.int32).to(dev)
            st["host_table"][idx] = t[:, 3].to(torch.int32).to(dev)
        for row, blocks in plan.hot_updates:
            self._reset_hot(row, blocks)
        if plan.restores:
            self.copy_blocks(plan.restores, to_host=False)
        copies = plan.materialize
        if copies:
            self.copy_blocks([(g, h) for _, g, h in copies], to_host=True)
        return [t for t, _, _ in copies]

    def _check_plan(self, plan: _core.StepPlan) -> None:
        """Checks every index ``apply`` will use against the layout, so that a plan from a manager sized
        differently is refused before anything is written (torch would fail halfway, or wrap negatives)."""
        lay = self.layout

        def check(what: str, value: int, low: int, end: int) -> None:
            if not low <= value < end:
                raise InvalidArgumentError(
                    f"the plan's {what} {value} is outside {low}..{end - 1} of this data path's layout "
                    "(is the manager configured larger than the Layout?)"
                )

        rows, pages, gpu_blocks, host_blocks = lay.max_running, lay.max_pages, lay.num_gpu_blocks, lay.num_host_blocks
        for row in plan.cleared_rows:
            check("cleared row", row, 0, rows)
        for row, seq_len in plan.seq_lens:
            check("state row", row, 0, rows)
            check("seq_len", seq_len, 0, lay.max_model_len + 1)
        for row, page, gpu, host in plan.table_updates:
            check("state row", row, 0, rows)
            check("page", page, 0, pages)
            check("GPU block", gpu, 0, gpu_blocks)
            check("host block", host, -1, host_blocks)
        for row, blocks in plan.hot_updates:
            check("state row", row, 0, rows)
            check("hot region length", len(blocks), 0, lay.hot_blocks + 1)
            for block in blocks:
                check("hot GPU block", block, 0, gpu_blocks)
        for gpu, host in [*plan.restores, *((g, h) for _, g, h in plan.materialize)]:
            check("copied GPU block", gpu, 0, gpu_blocks)
            check("copied host block", host, 0, host_blocks)

    def _reset_hot(self, row: int, blocks: Sequence[int]) -> None:
        st = self.state
        st["hot_blocks"][row] = 0
        if blocks:
            st["hot_blocks"][row, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
        st["hot_pos"][row] = -1
        st["hot_lru"][row] = torch.arange(self.layout.hot_rows, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ the kernels

    def resolve(self, topk: torch.Tensor, row_state: torch.Tensor, group: int = 0) -> torch.Tensor:
        """Row ids into every layer of ``group`` for ``topk`` [rows, top_k] positions (see SPEC.md)."""
        groups = self.layout.num_groups
        if not 0 <= group < groups:  # checked first: an unknown group has no layers to complain about
            raise InvalidArgumentError(f"group {group} is out of range: the layout has {groups} index groups")
        out = torch.empty(topk.shape, dtype=torch.int32, device=self.device)
        layers = self.layout.layers_of(group)
        kwargs = dict(
            topk=topk,
            row_state=row_state,
            **self.state,
            gpu_layers=[self.gpu[layer] for layer in layers],
            host_layers=[self.host[layer] for layer in layers],
            group=group,
            block_size=self.layout.block_size,
            out=out,
        )
        if self.device.type == "cuda":
            from .kernels import ops

            ops.resolve(**kwargs)
        else:
            resolve_reference(**kwargs)
        return out

    def gather(self, row_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """Dense rows [rows, top_k, row_bytes] of one layer; zeros for -1."""
        if not 0 <= layer < self.layout.num_layers:  # a negative index would silently read another layer
            raise InvalidArgumentError(f"layer {layer} is out of range: the layout has {self.layout.num_layers} layers")
        out = torch.empty(*row_ids.shape, self.layout.row_bytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cuda":
            from .kernels import ops

            ops.gather(row_ids=row_ids, slab=self.gpu[layer], out=out)
            return out
        slab = self.gpu[layer]
        row_ids_buf, slab_buf = _buf(row_ids, "row_ids", torch.int32), _buf(slab, "slab", torch.uint8)
        out_buf = _buf(out, "out", torch.uint8)
        _check_disjoint({"out": out}, {"row_ids": row_ids, "slab": slab})
        _core._ref_gather(row_ids_buf, slab_buf, self.layout.row_bytes, out_buf)
        return out

    def _copy(self, pairs: Sequence[tuple[int, int]], unit: int, to_host: bool) -> None:
        if not pairs:
            return
        lay = self.layout
        t = torch.tensor(list(pairs), dtype=torch.int64)
        if t.dim() != 2 or t.shape[1] != 2:
            raise InvalidArgumentError("pairs must be (gpu, host) pairs")
        if self.device.type == "cuda":
            from .kernels import ops

            layers = dict(gpu_layers=list(self.gpu), host_layers=list(self.host), to_host=to_host)
            if unit == 1:
                ops.copy_rows(pairs=t.to(self.device), **layers)
            else:
                pairs32 = t.to(torch.int32).to(self.device)
                ops.copy_blocks(pairs=pairs32, block_size=lay.block_size, **layers)
            return
        gpu = {f"gpu layer {i}": g for i, g in enumerate(self.gpu)}
        host = {f"host layer {i}": h for i, h in enumerate(self.host)}
        gpu_bufs = [_rows_view(g, name, lay.row_bytes) for name, g in gpu.items()]
        host_bufs = [_rows_view(h, name, lay.row_bytes) for name, h in host.items()]
        pairs_buf = _buf(t, "pairs", torch.int64)
        # Rust takes both sides of every layer as mutable slices, whichever way the copy goes.
        _check_disjoint({**gpu, **host}, {"pairs": t})
        _core._ref_copy(pairs_buf, unit, lay.row_bytes, to_host, gpu_bufs, host_bufs)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]], to_host: bool) -> None:
        """Whole pages, every layer: materialize (``to_host``) or restore."""
        self._copy(pairs, self.layout.block_size, to_host)

    def mirror(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies written rows (GPU row, host row) to the host pool, every layer."""
        self._copy(pairs, 1, True)

    def invalidate(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Empties the hot slots holding (state row, position), whose host rows were rewritten."""
        if not pairs:
            return
        t = torch.tensor(list(pairs), dtype=torch.int32)
        if t.dim() != 2 or t.shape[1] != 2:
            raise InvalidArgumentError("pairs must be (state row, position) pairs")
        if self.device.type == "cuda":
            from .kernels import ops

            ops.invalidate(pairs=t.to(self.device), hot_pos=self.state["hot_pos"], hot_lru=self.state["hot_lru"])
            return
        lay, hot = self.layout, {name: self.state[name] for name in ("hot_pos", "hot_lru")}
        bufs = [_buf(v, name, torch.int32) for name, v in {**hot, "pairs": t}.items()]
        _check_disjoint(hot, {"pairs": t})
        _core._ref_invalidate(_geometry(self.state, lay.block_size, lay.row_bytes), *bufs)

    # ------------------------------------------------------------------ helpers for engines and tests

    def token_rows(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        """GPU rows where the KV of ``positions`` of state row ``row`` is written (the slot mapping)."""
        bs = self.layout.block_size
        blocks = self.state["block_table"][row, positions // bs]
        if bool((blocks == 0).any()):
            raise InvalidArgumentError(f"row {row}: some positions have no resident block to write")
        return blocks * bs + positions % bs

    def take_heat(self, rows: Sequence[int]) -> dict[int, tuple[list[int], list[int]]]:
        """The selection heat of ``rows`` since the last call, as (pages, counts) of the pages that were
        selected, and cleared. One gather and one transfer of only the non-zero entries, whatever the
        context length."""
        if not rows:
            return {}
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.device)
        if bool(((index < 0) | (index >= self.layout.max_running)).any()):
            raise InvalidArgumentError(f"rows {list(rows)} outside 0..{self.layout.max_running}")
        heat = self.state["heat"].index_select(0, index)
        self.state["heat"].index_fill_(0, index, 0)
        hits = heat.nonzero()
        counts = heat[hits[:, 0], hits[:, 1]].tolist()
        taken: dict[int, tuple[list[int], list[int]]] = {row: ([], []) for row in rows}
        for (i, page), count in zip(hits.tolist(), counts, strict=True):
            pages, values = taken[rows[i]]
            pages.append(page)
            values.append(count)
        return taken

    @property
    def counters(self) -> dict[str, int]:
        hits, misses, h2d = self.state["counters"].tolist()
        return {"hits": hits, "misses": misses, "h2d_bytes": h2d}
