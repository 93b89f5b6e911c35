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

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import _core
from .errors import ConfigError, InvalidArgumentError
from .heat import HeatOptions, HeatSummaryInFlight, heat_ranks, rank_heat

#: The resolver's state (cuda/SPEC.md), in the order ``resolve`` takes it.
RESOLVE_FIELDS = ("seq_lens", "block_table", "host_table", "hot_blocks", "hot_pos", "hot_stamp", "hot_clock", "heat",
                  "status", "counters")
#: What ``apply`` writes, in the order ``_core._ref_apply`` takes it.
APPLY_FIELDS = ("seq_lens", "block_table", "host_table", "releasable", "row_request", "resident", "hot_blocks",
                "hot_pos", "hot_stamp", "hot_clock", "heat", "status")
#: What ``heat_summary`` reads (and decays), in the order ``_core._ref_heat_summary`` takes it.
HEAT_FIELDS = ("seq_lens", "releasable", "row_request", "heat")
_DTYPES = {"releasable": torch.uint8, "resident": torch.uint8, "row_request": torch.int64, "counters": torch.int64,
           "hot_stamp": torch.int64, "hot_clock": torch.int64}


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
    hot_stamp: torch.Tensor,
    hot_clock: torch.Tensor,
    heat: torch.Tensor,
    status: torch.Tensor,
    counters: torch.Tensor,
    gpu_layers: Sequence[torch.Tensor],
    host_layers: Sequence[torch.Tensor],
    group: int,
    block_size: int,
    out: torch.Tensor,
    resident: torch.Tensor | None = None,
) -> None:
    """``resolve`` of SPEC.md on CPU tensors (the keywords of :func:`hisparse.kernels.ops.resolve`, less
    ``miss_plan`` / ``miss_count``, which only the CUDA resolver records).

    ``gpu_layers`` / ``host_layers`` are the group's layers, each ``[rows, row_bytes]`` uint8; ``resident``
    (uint8 [S]) flags the requests whose every page is resident, None none.
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
    written = dict(hot_pos=hot_pos, hot_stamp=hot_stamp, hot_clock=hot_clock, heat=heat, status=status,
                   counters=counters)
    state = {**read, **written}
    bufs = [_buf(t, name, _DTYPES.get(name, torch.int32)) for name, t in state.items()]
    row_bytes = gpu_layers[0].shape[-1]
    gpu = {f"gpu layer {i}": t for i, t in enumerate(gpu_layers)}
    host = {f"host layer {i}": t for i, t in enumerate(host_layers)}
    gpu_bufs = [_rows_view(t, name, row_bytes) for name, t in gpu.items()]
    host_bufs = [_rows_view(t, name, row_bytes) for name, t in host.items()]
    topk_buf = _buf(topk, "topk", torch.int32)
    row_state_buf = _buf(row_state, "row_state", torch.int32, (rows,))
    resident_buf = (0, 0)  # no request flagged
    if resident is not None:
        resident_buf = _buf(resident, "resident", torch.uint8, (s,))
        read["resident"] = resident
    out_buf = _buf(out, "out", torch.int32, (rows, top_k))
    # Rust takes every layer, the host ones too, as a mutable slice.
    _check_disjoint({**written, **gpu, **host, "out": out}, {**read, "topk": topk, "row_state": row_state})
    _core._ref_resolve(
        _geometry(state, block_size, row_bytes),
        bufs,
        topk_buf,
        top_k,
        row_state_buf,
        resident_buf,
        group,
        gpu_bufs,
        host_bufs,
        out_buf,
    )


def _device(device: object) -> torch.device:
    """``cpu`` or an available CUDA device."""
    try:
        dev = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise InvalidArgumentError(f"device must be 'cpu' or a CUDA device, not {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"a data path lives on the CPU or a CUDA device, not {dev.type!r}")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"{dev} is not available here ({torch.cuda.device_count()} CUDA devices)")
    return dev


def _describe(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return f"a {v.dtype} tensor of shape {list(v.shape)}"
    return f"{type(v).__name__} {v!r}"


def _index(v: object, name: str, end: int) -> int:
    """An int in ``0 .. end - 1`` (never a bool, a float, or a negative index that Python would wrap)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < end:
        raise InvalidArgumentError(f"{name} must be an integer in 0..{end - 1}, not {_describe(v)}")
    return v


def _positions(positions: object, low: int, end: int, device: torch.device) -> torch.Tensor:
    """Token positions as int64 on ``device``, each in ``low .. end - 1``: an integer tensor (or a sequence of
    ints), never floats, never a value that a cast would wrap. Checked where they are: positions on the host
    cost the device nothing; positions already on a device are read back to be checked (a wait)."""
    t = positions if isinstance(positions, torch.Tensor) else _as_int64(positions, "positions")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.dim() != 1:
        raise InvalidArgumentError(f"positions must be a 1-D integer tensor, not {_describe(t)}")
    t = _int64(t, "positions")
    if t.numel():
        lo, hi = t.aminmax()
        if int(lo) < low or int(hi) >= end:
            raise InvalidArgumentError(f"positions must be in {low}..{end - 1} (got {int(lo)}..{int(hi)})")
    return _to_device(t, device)


def _int64(t: torch.Tensor, name: str) -> torch.Tensor:
    """An integer tensor as int64, where it is, refusing a uint64 value beyond int64's range: the cast would wrap
    it to a negative number, which reads as padding or fails a range check with a value never given. A uint64
    tensor on a device is read back to be checked (a wait)."""
    if t.dtype == torch.uint64 and t.numel() and bool((t.view(torch.int64) < 0).any()):
        raise InvalidArgumentError(f"{name} holds a value beyond the int64 range")
    return t.to(torch.int64)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting: through pinned memory (a copy from pageable
    memory would block), which torch's caching host allocator keeps from reuse until the copy has run."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


#: More elements than any call takes (the core's own bound on a sequence argument).
_MAX_SEQUENCE = 1 << 24


def _bounded_list(values: object, name: str) -> list:
    """The elements of an iterable, refused past ``_MAX_SEQUENCE`` while reading (never collected whole)."""
    try:
        items = list(itertools.islice(values, _MAX_SEQUENCE + 1))  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a sequence, not {_describe(values)}") from None
    if len(items) > _MAX_SEQUENCE:
        raise InvalidArgumentError(f"{name} has more than {_MAX_SEQUENCE} elements")
    return items


def _as_int64(values: object, name: str) -> torch.Tensor:
    """A sequence of Python ints as an int64 tensor, refusing bools, floats and values beyond int64."""
    items = _bounded_list(values, name)
    flat = [x for item in items for x in (item if isinstance(item, (tuple, list)) else (item,))]
    if any(isinstance(x, bool) or not isinstance(x, int) for x in flat):
        raise InvalidArgumentError(f"{name} must hold integers only")
    if any(not -(2**63) <= x < 2**63 for x in flat):
        raise InvalidArgumentError(f"{name} holds a value outside the int64 range")
    try:
        return torch.tensor(items, dtype=torch.int64)
    except ValueError:  # ragged
        raise InvalidArgumentError(f"{name} must be a sequence of equal-length tuples of integers") from None


def _pairs(pairs: object, name: str, limits: tuple[int, int], distinct: int | None = None) -> torch.Tensor:
    """``pairs`` as an int64 [n, 2] CPU tensor whose columns are within ``0 .. limits[c] - 1`` (negative
    entries are padding, skipped by every copy); with ``distinct`` = c, no value repeats in column c (a copy's
    destinations, which must not be written twice)."""
    t = pairs if isinstance(pairs, torch.Tensor) else _as_int64(pairs, name)
    if t.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.int64)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.dim() != 2 or t.shape[1] != 2:
        raise InvalidArgumentError(f"{name} must be [n, 2] integer pairs, not {_describe(t)}")
    t = _int64(t.cpu(), name)
    for c, end in enumerate(limits):
        if int(t[:, c].max()) >= end:
            raise InvalidArgumentError(f"{name} column {c} must be below {end}, got {int(t[:, c].max())}")
    if distinct is not None:
        live = t[(t >= 0).all(dim=1), distinct]
        if live.unique().numel() != live.numel():
            raise InvalidArgumentError(f"{name} writes one destination twice")
    return t.contiguous()


class _State(dict):
    """The state tensors by name; counts replacements, so that checks made once stay valid until one."""

    version = 0

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.version += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.version += 1
        super().__delitem__(key)

    def update(self, *args, **kwargs) -> None:
        self.version += 1
        super().update(*args, **kwargs)


class _PlanSections:
    """The sections of an encoded plan (``StepPlan.to_bytes``, SPEC.md "apply") as tensor spans, so that the
    device path scatters whole sections without looking at any entry in Python."""

    HEADER = 14  # magic, version, missing, released, lost, hot_blocks, then 8 counts

    def __init__(self, data: bytes):
        raw = bytearray(data)
        words = torch.frombuffer(raw, dtype=torch.int32)
        header = words[: self.HEADER].tolist()
        self.hot_blocks = header[5]
        counts = dict(zip(("cleared", "seq_lens", "table", "hot", "restores", "materialize", "scheduled",
                           "transitions"), header[6:], strict=True))
        widths = dict(cleared=1, seq_lens=3, table=5, hot=2 + self.hot_blocks, restores=2, materialize=2,
                      scheduled=3, transitions=2)
        self.spans: dict[str, tuple[int, int]] = {}
        at = self.HEADER
        for name, n in counts.items():
            self.spans[name] = (at, at + n * widths[name])
            at += n * widths[name]
        at += at % 2  # the u64 sections start at an 8-byte boundary
        self.words = words[: at]
        tail = len(raw) - 4 * at
        self.longs = (torch.frombuffer(raw, dtype=torch.int64, offset=4 * at) if tail
                      else torch.zeros(0, dtype=torch.int64))
        self.long_spans: dict[str, tuple[int, int]] = {}
        lat = 0
        for name in ("materialize", "seq_lens", "scheduled", "transitions"):
            self.long_spans[name] = (lat, lat + counts[name])
            lat += counts[name]


@dataclass(frozen=True)
class Layout:
    """Sizes of one data path. ``layer_groups[l]`` is the index group of sparse layer ``l``;
    ``rows_per_request``: the batch rows one request resolves together (1 + speculative tokens), which sizes
    resolve's hash table (more rows still resolve exactly, more slowly)."""

    num_gpu_blocks: int
    num_host_blocks: int
    block_size: int
    max_model_len: int
    max_running: int
    hot_rows: int
    row_bytes: int
    layer_groups: tuple[int, ...] = (0,)
    rows_per_request: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.layer_groups, list):  # frozen, so kept as a tuple (a list would make it unhashable)
            object.__setattr__(self, "layer_groups", tuple(self.layer_groups))
        for name in ("num_gpu_blocks", "num_host_blocks", "block_size", "max_model_len", "max_running",
                     "hot_rows", "row_bytes", "rows_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive integer, not {value!r}")
        if self.row_bytes % 16:  # the kernels move rows in 16-byte vectors
            raise InvalidArgumentError(f"row_bytes ({self.row_bytes}) must be a multiple of 16")
        groups = self.layer_groups
        if not isinstance(groups, (tuple, list)) or not groups or any(
                isinstance(g, bool) or not isinstance(g, int) for g in groups) or sorted(set(groups)) != list(
                range(max(groups) + 1)):
            raise InvalidArgumentError(f"layer_groups must name every group from 0 up, not {groups!r}")
        from .kernels.launch import check_datapath  # what a kernel launch would refuse, refused now

        check_datapath(hot_rows=self.hot_rows, block_size=self.block_size, gpu_blocks=self.num_gpu_blocks,
                       host_blocks=self.num_host_blocks, max_model_len=self.max_model_len, row_bytes=self.row_bytes,
                       batch_rows=self.max_running * self.rows_per_request, rows_per_request=self.rows_per_request,
                       layers=self.num_layers, groups=self.num_groups)

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
        if not isinstance(gpu, (list, tuple)):
            raise InvalidArgumentError(f"gpu must be a tensor or a list of layer tensors, not {type(gpu).__name__}")
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
        if not isinstance(layout, Layout):
            raise InvalidArgumentError(f"layout must be a Layout, not {type(layout).__name__}")
        if (gpu is None) != (host is None):
            raise InvalidArgumentError("adopt both the slab and the host pool, or neither")
        self.layout = layout
        self.device = _adopt(layout, gpu, host) if gpu is not None else _device(device)
        lay, dev = layout, self.device
        s, p, g, h = lay.max_running, lay.max_pages, lay.num_groups, lay.hot_rows
        i32 = dict(dtype=torch.int32, device=dev)
        if gpu is not None:
            self.gpu = gpu
            self.host = host
        else:
            self.gpu = torch.zeros(lay.num_layers, lay.num_gpu_blocks * lay.block_size, lay.row_bytes,
                                   dtype=torch.uint8, device=dev)
            self.host = torch.zeros(lay.num_layers, lay.num_host_blocks * lay.block_size, lay.row_bytes,
                                    dtype=torch.uint8, pin_memory=dev.type == "cuda")
        self.state: dict[str, torch.Tensor] = _State({
            "seq_lens": torch.zeros(s, **i32),
            "block_table": torch.zeros(s, p, **i32),
            "host_table": torch.full((s, p), -1, **i32),
            "hot_blocks": torch.zeros(s, lay.hot_blocks, **i32),
            "hot_pos": torch.full((s, g, h), -1, **i32),
            # The LRU as stamps (SPEC.md): all 0 is slot order; each region's clock counts its steps.
            "hot_stamp": torch.zeros(s, g, h, dtype=torch.int64, device=dev),
            "hot_clock": torch.zeros(s, g, dtype=torch.int64, device=dev),
            "heat": torch.zeros(s, p, **i32),
            "status": torch.zeros(s, **i32),
            "counters": torch.zeros(3, dtype=torch.int64, device=dev),
            # What only apply and heat_summary use: the pages the core may release, and each row's request.
            "releasable": torch.zeros(s, p, dtype=torch.uint8, device=dev),
            "row_request": torch.full((s,), -1, dtype=torch.int64, device=dev),
            # Rows whose request has every page resident (the plan's length entries): resolve's resident path.
            "resident": torch.zeros(s, dtype=torch.uint8, device=dev),
        })
        self._geometry = (lay.max_pages, lay.block_size, lay.num_groups, lay.hot_rows, lay.row_bytes)
        self._cpu = dev.type == "cpu"
        self._mover: tuple | None = None  # the side-stream page mover, built on the first CUDA apply
        self._slots: tuple = (None, None)  # (plan, its slot mapping on CPU) of the last apply
        self._checked_apply: tuple | None = None

    # ------------------------------------------------------------------ applying plans

    def apply(self, plan: _core.StepPlan) -> torch.cuda.Event | None:
        """Applies a plan in SPEC.md's order (tables, hot regions, restores, then page copies to the host).

        On CPU one Rust call does it all and the copies are done when it returns (returns None). On CUDA the
        plan's flat form crosses once, through pinned memory, and torch scatters it on the current stream; the
        page copies run as DMA on two side streams, one per direction (``kernels.transfer.PageMover``):
        restores land before the next forward, and the returned event (None without page copies) passes once
        the copies to the host are durable. Nothing waits for the device. Either way every entry is checked
        against the layout first: a plan from a manager sized differently is refused before anything is written.
        """
        if not isinstance(plan, _core.StepPlan):
            raise InvalidArgumentError(f"apply() takes a StepPlan, not {type(plan).__name__}")
        if not self._cpu:
            return self._apply_torch(plan)
        # Inline on purpose: this runs every step, often with caches a forward has just evicted.
        c, state = self._checked_apply, self.state
        if c is None or c[0] is not state or c[1] is not self.gpu or c[2] is not self.host or c[3] is None or \
                c[3] != getattr(state, "version", None):
            c = self._check_apply_buffers()
        self._slots = (plan, _core._ref_apply(plan, c[4]))
        return None

    def _worker_geometry(self) -> tuple[int, int, int, int, int]:
        return self._geometry

    def _layer_bufs(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list, list]:
        gpu = {f"gpu layer {i}": g for i, g in enumerate(self.gpu)}
        host = {f"host layer {i}": h for i, h in enumerate(self.host)}
        rb = self.layout.row_bytes
        return (gpu, host, [_rows_view(g, name, rb) for name, g in gpu.items()],
                [_rows_view(h, name, rb) for name, h in host.items()])

    def _check_apply_buffers(self) -> tuple:
        """Checks the buffers of ``_ref_apply`` and keeps them, with what they were checked for: ``apply`` checks
        again only when a tensor was replaced (an assignment to ``gpu``, ``host`` or an entry of ``state``),
        since checking a dozen tensors every step would cost more than applying a decode step's plan. Tensors
        must not be resized in place while a DataPath uses them. A state replaced by a plain dict has no
        version: then every call checks."""
        version = self.state.version if isinstance(self.state, _State) else None
        state = {name: self.state[name] for name in APPLY_FIELDS}
        bufs = [_buf(t, name, _DTYPES.get(name, torch.int32)) for name, t in state.items()]
        gpu, host, gpu_bufs, host_bufs = self._layer_bufs()
        # Rust takes every state tensor and both sides of every layer as mutable slices.
        _check_disjoint({**state, **gpu, **host}, {})
        # The tuple keeps every tensor alive as long as the buffers that point into them.
        buffers = _core.ApplyBuffers(self._geometry, bufs, gpu_bufs, host_bufs)
        self._checked_apply = (self.state, self.gpu, self.host, version, buffers, state, gpu, host)
        return self._checked_apply

    def _apply_torch(self, plan: _core.StepPlan) -> torch.cuda.Event | None:
        """The device path: the same result as ``_ref_apply`` with torch ops, checked on the host first."""
        lay, st, dev = self.layout, self.state, self.device
        _core._check_plan(plan, self._worker_geometry(), lay.max_running, lay.num_gpu_blocks, lay.num_host_blocks)
        self._slots = (plan, None)
        s = _PlanSections(plan.to_bytes())
        words, longs = _to_device(s.words, dev), _to_device(s.longs, dev)

        def section(name: str, width: int) -> torch.Tensor:
            a, b = s.spans[name]
            return words[a:b].view(-1, width).to(torch.int64)

        rows = section("cleared", 1)[:, 0]
        if rows.numel():
            for name, value in (("seq_lens", 0), ("block_table", 0), ("host_table", -1), ("releasable", 0),
                                ("row_request", -1), ("resident", 0), ("heat", 0), ("status", 0), ("hot_blocks", 0),
                                ("hot_pos", -1), ("hot_stamp", 0), ("hot_clock", 0)):
                st[name].index_fill_(0, rows, value)
        lens = section("seq_lens", 3)
        if lens.numel():
            a, b = s.long_spans["seq_lens"]
            st["seq_lens"].index_copy_(0, lens[:, 0], lens[:, 1].to(torch.int32))
            st["row_request"].index_copy_(0, lens[:, 0], longs[a:b])
            st["resident"].index_copy_(0, lens[:, 0], lens[:, 2].to(torch.uint8))
        table = section("table", 5)
        if table.numel():
            flat = table[:, 0] * lay.max_pages + table[:, 1]
            st["block_table"].view(-1).index_copy_(0, flat, table[:, 2].to(torch.int32))
            st["host_table"].view(-1).index_copy_(0, flat, table[:, 3].to(torch.int32))
            st["releasable"].view(-1).index_copy_(0, flat, table[:, 4].to(torch.uint8))
        hot = section("hot", 2 + s.hot_blocks)
        if hot.numel():
            rows = hot[:, 0]
            blocks = torch.zeros(rows.numel(), lay.hot_blocks, dtype=torch.int32, device=dev)
            blocks[:, : s.hot_blocks] = hot[:, 2:].to(torch.int32)
            st["hot_blocks"].index_copy_(0, rows, blocks)
            st["hot_pos"].index_fill_(0, rows, -1)
            st["hot_stamp"].index_fill_(0, rows, 0)
            st["hot_clock"].index_fill_(0, rows, 0)
        if dev.type == "cuda":
            mover = self._page_mover()
            mover.restore(plan.restores)
            copies = [(gpu, host) for _, gpu, host in plan.materialize]
            return mover.materialize(copies) if copies else None
        # The same scatter on CPU tensors (how the tests compare it with the reference): copies in Rust.
        self._copy(section("restores", 2), lay.block_size, to_host=False)
        self._copy(section("materialize", 2), lay.block_size, to_host=True)
        return None

    @property
    def gpu(self) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The slab: one tensor, or a tuple of one per layer. Replaced whole (``dp.gpu = [...]``), it is checked
        again at the next use; a tuple, so that no layer can be swapped unseen in place."""
        return self._gpu

    @gpu.setter
    def gpu(self, slab: torch.Tensor | Sequence[torch.Tensor]) -> None:
        if not isinstance(slab, (torch.Tensor, list, tuple)):
            raise InvalidArgumentError(f"gpu must be a tensor or a list of layer tensors, not {type(slab).__name__}")
        self._gpu = self._layers("gpu", slab if isinstance(slab, torch.Tensor) else tuple(slab))

    @property
    def host(self) -> torch.Tensor:
        """The host pool, ``[layers, rows, row_bytes]``; replaced whole, it is checked again at the next use."""
        return self._host

    @host.setter
    def host(self, pool: torch.Tensor) -> None:
        if not isinstance(pool, torch.Tensor):
            raise InvalidArgumentError(f"host must be a tensor, not {type(pool).__name__}")
        self._host = self._layers("host", pool)

    def _layers(self, name: str, layers):
        """``layers`` if it holds one layer per layer of the layout (a copy stops at the shorter side: a missing
        layer would be marked copied and never be): the rest of its checks come at the next use."""
        count = len(layers) if not isinstance(layers, torch.Tensor) or layers.dim() else 0
        if count != self.layout.num_layers:
            raise InvalidArgumentError(f"{name} must hold {self.layout.num_layers} layers, not {count}")
        return layers

    def _page_mover(self):
        """The page mover (side streams) of this slab and pool (built again if either was replaced)."""
        from .kernels.transfer import PageMover

        key = (self.gpu, self.host)
        cached = self._mover
        if cached is None or any(a is not b for a, b in zip(cached[0], key, strict=True)):
            cached = (key, PageMover(list(self.gpu), list(self.host), self.layout.block_size))
            self._mover = cached
        return cached[1]

    def slot_mapping(self, plan: _core.StepPlan) -> torch.Tensor:
        """The GPU row of every token ``plan``'s scheduled requests write, request after request in the plan's
        order (an engine's slot mapping), int64 on this data path's device; ``plan`` must be the one applied
        last. One call, whatever the batch: in Rust on CPU, a few whole-tensor ops on a device (no wait)."""
        if not isinstance(plan, _core.StepPlan):
            raise InvalidArgumentError(f"slot_mapping() takes a StepPlan, not {type(plan).__name__}")
        lay = self.layout
        applied, raw = self._slots
        # Only a plan that ``apply`` checked whole (its scheduled positions within the lengths it gives its
        # rows) may map slots: the device path reads the plan as it is.
        if applied is not plan and applied != plan:
            raise InvalidArgumentError("slot_mapping() takes the plan applied last")
        if not self._cpu:
            return self._slot_mapping_torch(plan)
        if raw is None:  # the apply found a token without a resident block: ask for the reason
            table = _buf(self.state["block_table"], "block_table", torch.int32)
            raw = _core._ref_slot_mapping(plan, table, lay.max_pages, lay.block_size)
        return torch.frombuffer(raw, dtype=torch.int64) if raw else torch.zeros(0, dtype=torch.int64)

    def _slot_mapping_torch(self, plan: _core.StepPlan) -> torch.Tensor:
        """The device path of ``slot_mapping`` (no check that every page is resident: it would wait)."""
        lay, dev = self.layout, self.device
        s = _PlanSections(plan.to_bytes())
        a, b = s.spans["scheduled"]
        sched = _to_device(s.words[a:b].view(-1, 3).to(torch.int64), dev)
        total = plan.num_tokens
        rows, starts, tokens = sched[:, 0], sched[:, 1], sched[:, 2]
        which = torch.repeat_interleave(torch.arange(len(rows), device=dev), tokens, output_size=total)
        first = torch.cumsum(tokens, 0) - tokens  # each request's first token in the output
        pos = starts[which] + torch.arange(total, device=dev) - first[which]
        blocks = self.state["block_table"][rows[which], pos // lay.block_size].to(torch.int64)
        # A page without a block (a table out of step; the CPU path refuses it) is written nowhere: -1, the
        # slot engines skip, never a row of the null block.
        return torch.where(blocks > 0, blocks * lay.block_size + pos % lay.block_size, -1)

    def heat_summary(self, coldest: int = HeatOptions.coldest, hottest: int = HeatOptions.hottest) -> bytes:
        """The ``coldest`` coldest and the ``hottest`` hottest releasable pages of every running row, encoded for
        :meth:`ResidencyManager.apply_results`; then every count of those rows is halved (``heat.rs`` gives the
        decay rule). One pass over the heat table; nothing per page in Python. On a device this waits for the
        ranking; :meth:`start_heat_summary` does not."""
        return self.start_heat_summary(coldest, hottest).take()

    def start_heat_summary(self, coldest: int = HeatOptions.coldest,
                           hottest: int = HeatOptions.hottest) -> HeatSummaryInFlight:
        """Starts a heat summary (and the decay): on CPU it is done at once; on a device the ranking is queued
        on the current stream and copied back to pinned memory, ready once its event has passed."""
        for name, value in (("coldest", coldest), ("hottest", hottest)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**24:
                raise InvalidArgumentError(f"{name} must be an integer in 0..2**24, not {value!r}")
        lay = self.layout
        if self._cpu:
            tables = {name: self.state[name] for name in HEAT_FIELDS}
            bufs = [_buf(t, name, _DTYPES.get(name, torch.int32)) for name, t in tables.items()]
            _check_disjoint({"heat": tables["heat"]}, {k: v for k, v in tables.items() if k != "heat"})
            return HeatSummaryInFlight(_core._ref_heat_summary(bufs, lay.max_pages, lay.block_size, coldest, hottest))
        return self._rank_heat_torch(coldest, hottest)

    def _heat_summary_torch(self, coldest: int = HeatOptions.coldest, hottest: int = HeatOptions.hottest) -> bytes:
        """The device path of ``heat_summary``, waiting for it (tests run it on CPU tensors)."""
        return self._rank_heat_torch(coldest, hottest).take()

    def _rank_heat_torch(self, coldest: int, hottest: int) -> HeatSummaryInFlight:
        """Ranks on the device; one copy of [S, coldest + hottest] keys (and the rows' requests) back."""
        lay, st = self.layout, self.state
        pages = torch.arange(lay.max_pages, device=self.device)
        used = (st["seq_lens"].to(torch.int64) + lay.block_size - 1) // lay.block_size
        running = st["seq_lens"] > 0
        eligible = (st["releasable"] != 0) & (pages[None, :] < used[:, None]) & running[:, None]
        ranked = rank_heat(st["heat"], eligible, coldest, hottest)
        st["heat"].copy_(torch.where(running[:, None], st["heat"].clamp(min=0) >> 1, st["heat"]))
        return HeatSummaryInFlight.copy_back((*ranked, st["row_request"], st["seq_lens"]),
                                             (lay.max_pages, *heat_ranks(lay.max_pages, coldest, hottest)))

    # ------------------------------------------------------------------ the kernels

    def resolve(self, topk: torch.Tensor, row_state: torch.Tensor, group: int = 0) -> torch.Tensor:
        """Row ids into every layer of ``group`` for ``topk`` [rows, top_k] positions (see SPEC.md)."""
        group = _index(group, "group", self.layout.num_groups)  # first: an unknown group has no layers to name
        if not isinstance(topk, torch.Tensor) or topk.dim() != 2:
            raise InvalidArgumentError(f"topk must be a [rows, top_k] tensor, not {_describe(topk)}")
        out = torch.empty(topk.shape, dtype=torch.int32, device=self.device)
        layers = self.layout.layers_of(group)
        kwargs = dict(
            topk=topk,
            row_state=row_state,
            **{name: self.state[name] for name in RESOLVE_FIELDS},
            resident=self.state["resident"],
            gpu_layers=[self.gpu[layer] for layer in layers],
            host_layers=[self.host[layer] for layer in layers],
            group=group,
            block_size=self.layout.block_size,
            out=out,
        )
        if self.device.type == "cuda":
            from .kernels import ops

            ops.resolve(**kwargs, rows_per_request=self.layout.rows_per_request)
        else:
            resolve_reference(**kwargs)
        return out

    def gather(self, row_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """Dense rows [rows, top_k, row_bytes] of one layer; zeros for -1."""
        layer = _index(layer, "layer", self.layout.num_layers)  # a negative index would read another layer
        if not isinstance(row_ids, torch.Tensor):
            raise InvalidArgumentError(f"row_ids must be a tensor, not {_describe(row_ids)}")
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

    def _copy(self, pairs: torch.Tensor, unit: int, to_host: bool) -> None:
        """Copies ``pairs`` [n, 2] int64 (GPU unit, host unit; units of ``unit`` rows), every layer."""
        if not pairs.numel():
            return
        if self.device.type != "cpu":
            self._copy_device(_to_device(pairs, self.device), unit, to_host)
            return
        gpu, host, gpu_bufs, host_bufs = self._layer_bufs()
        pairs_buf = _buf(pairs, "pairs", torch.int64)
        # Rust takes both sides of every layer as mutable slices, whichever way the copy goes.
        _check_disjoint({**gpu, **host}, {"pairs": pairs})
        _core._ref_copy(pairs_buf, unit, self.layout.row_bytes, to_host, gpu_bufs, host_bufs)

    def _copy_device(self, pairs: torch.Tensor, unit: int, to_host: bool) -> None:
        from .kernels import ops

        layers = dict(gpu_layers=list(self.gpu), host_layers=list(self.host), to_host=to_host)
        if unit == 1:
            ops.copy_rows(pairs=pairs.contiguous(), **layers)
        else:
            ops.copy_blocks(pairs=pairs.to(torch.int32).contiguous(), block_size=self.layout.block_size, **layers)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]], to_host: bool) -> None:
        """Whole pages, every layer: materialize (``to_host``) or restore. ``pairs``: (GPU block, host block),
        destinations distinct; a restore never writes the null block 0."""
        if not isinstance(to_host, bool):
            raise InvalidArgumentError(f"to_host must be True or False, not {to_host!r}")
        lay = self.layout
        t = _pairs(pairs, "pairs", (lay.num_gpu_blocks, lay.num_host_blocks), distinct=1 if to_host else 0)
        if not to_host and bool((t[:, 0] == 0).any()):
            raise InvalidArgumentError("a restore into the null block 0: nothing may write it")
        self._copy(t, lay.block_size, to_host)

    def mirror(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies written rows (GPU row, host row) to the host pool, every layer; host rows distinct."""
        lay = self.layout
        limits = (lay.num_gpu_blocks * lay.block_size, lay.num_host_blocks * lay.block_size)
        self._copy(_pairs(pairs, "pairs", limits, distinct=1), 1, True)

    def invalidate(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Empties the hot slots holding (state row, position), whose host rows were rewritten."""
        lay = self.layout
        t = _pairs(pairs, "pairs", (lay.max_running, lay.max_model_len)).to(torch.int32)
        if not t.numel():
            return
        if self.device.type == "cuda":
            from .kernels import ops

            ops.invalidate(pairs=_to_device(t, self.device), hot_pos=self.state["hot_pos"],
                           hot_stamp=self.state["hot_stamp"])
            return
        hot = {name: self.state[name] for name in ("hot_pos", "hot_stamp")}
        bufs = [_buf(v, name, _DTYPES.get(name, torch.int32)) for name, v in {**hot, "pairs": t}.items()]
        _check_disjoint(hot, {"pairs": t})
        _core._ref_invalidate(_geometry(self.state, lay.block_size, lay.row_bytes), *bufs)

    # ------------------------------------------------------------------ helpers for engines and tests

    def token_rows(self, row: int, positions: torch.Tensor, *, start: int = 0, end: int | None = None) -> torch.Tensor:
        """GPU rows where the KV of ``positions`` (integers in ``start .. end - 1``, by default the whole
        ``max_model_len``) of state row ``row`` is written: the slot mapping. Give positions on the host to keep
        the device from waiting. On CPU a position on a page without a resident block is refused; on a device
        that check would wait, and such a position maps into the null block, which nothing reads (the pages a
        step writes are always resident: they are the newest)."""
        lay = self.layout
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < lay.max_running:
            raise InvalidArgumentError(f"row must be a state row in 0..{lay.max_running - 1}, not {row!r}")
        positions = _positions(positions, start, lay.max_model_len if end is None else end, self.device)
        blocks = self.state["block_table"][row, positions // lay.block_size]
        if self.device.type == "cpu" and bool((blocks == 0).any()):
            raise InvalidArgumentError(f"row {row}: some positions have no resident block to write")
        return blocks.to(torch.int64) * lay.block_size + positions % lay.block_size

    @property
    def counters(self) -> dict[str, int]:
        hits, misses, h2d = self.state["counters"].tolist()
        return {"hits": hits, "misses": misses, "h2d_bytes": h2d}
