"""Launchers of the hisparse CUDA kernels on torch tensors; cuda/SPEC.md is their contract.

Every launcher takes keyword arguments only, validates dtypes, shapes, devices and contiguity (raising
InvalidArgumentError, as the CPU reference does; ConfigError for sizes no launch can take: both are ValueErrors),
and enqueues its kernels on
``torch.cuda.current_stream()``. None of them waits for the GPU, so they can be captured in CUDA graphs once
each call has run eagerly with the same shapes and layers: the first launch on a device compiles (or loads
from the disk cache) and loads the kernels, and the first launch with a set of layers builds the device table
of their addresses, which capture cannot do. A table used during a capture is kept for the life of the
process, since the graph keeps reading it; the others are kept for the most recent sets of layers only.

Layers come as two lists of equal length: ``gpu_layers[l]`` a CUDA uint8 tensor ``[rows, rb]`` (the GPU
slab of layer l) and ``host_layers[l]`` a pinned CPU uint8 tensor ``[host rows, rb]`` (its host pool),
which the kernels read and write in place.

Each launcher is split in two: the checks and the device work, and a ``*_launches`` function that turns
sizes and addresses into :class:`KernelLaunch` records (kernel, grid, threads, shared memory, arguments in
the kernel's parameter order). The CPU kernel harness (``tests/kernel_harness``) runs those same records on
the CPU, so the packing and sizing of every launch is tested where no GPU is.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from cuda.bindings import driver

from hisparse.errors import ConfigError, InvalidArgumentError
from hisparse.kernels import cuda_context
from hisparse.kernels import launch as sizes
from hisparse.kernels.compiler import KERNELS, compile_kernel_source, select_arch

_CHUNK = 16  # bytes per vector load: row bytes must be a multiple of it
_MAX_LAYER_TABLES = 64  # eager layer tables kept; a long-lived process with changing layers stays bounded

_lock = threading.Lock()
_devices: dict[int, _Device] = {}
_layer_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_captured_tables: dict[tuple, torch.Tensor] = {}


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch: ``args`` are ctypes values in the kernel's parameter order."""

    kernel: str
    grid: tuple[int, int]
    threads: int
    smem: int
    args: tuple


_drv = cuda_context.call


class _Device:
    """Modules, functions and limits of one GPU, in its primary context (the one torch uses)."""

    def __init__(self, index: int) -> None:
        self.index = index
        device = cuda_context.device(index)
        self.arch = select_arch(
            torch.cuda.get_device_capability(index), _drv(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        )
        attr = driver.CUdevice_attribute
        self.max_smem = _drv(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device),
            "cuDeviceGetAttribute",
        )
        self.sm_count = _drv(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device),
            "cuDeviceGetAttribute",
        )
        self._smem_opt_in: dict[str, int] = {}
        self._functions: dict[str, driver.CUfunction] = {}
        with self.current():
            for source, kernels in KERNELS.items():
                err, module = driver.cuModuleLoadData(compile_kernel_source(source, self.arch).image)
                if err == driver.CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION:
                    raise RuntimeError(f"the driver is too old for the PTX of {source}.cu ({self.arch})")
                _drv((err, module), f"loading {source}.cu ({self.arch})")
                for name in kernels:
                    self._functions[name] = _drv(driver.cuModuleGetFunction(module, name.encode()), name)

    def current(self):
        """This device's primary context, current for the driver calls inside (see ``cuda_context``)."""
        return cuda_context.current(self.index)

    def function(self, kernel: str, smem: int) -> driver.CUfunction:
        """The kernel, allowed ``smem`` bytes of dynamic shared memory (call with this context current)."""
        fn = self._functions[kernel]
        static = sizes.STATIC_SHARED.get(kernel, 0)
        if smem + static > self.max_smem:  # the launch arithmetic keeps this from happening
            raise ConfigError(f"{kernel} needs {smem + static} bytes of shared memory; this GPU allows {self.max_smem}")
        if smem > 48 * 1024 and smem > self._smem_opt_in.get(kernel, 0):
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _drv(driver.cuFuncSetAttribute(fn, attr, smem), "cuFuncSetAttribute")
            self._smem_opt_in[kernel] = smem
        return fn


def _device(index: int) -> _Device:
    with _lock:
        dev = _devices.get(index)
        if dev is None:
            dev = _devices[index] = _Device(index)
    return dev


def _ptr(t: torch.Tensor | int | None) -> ctypes.c_uint64:
    if isinstance(t, int):
        return ctypes.c_uint64(t)
    return ctypes.c_uint64(0 if t is None else t.data_ptr())


def _ints(*values: int) -> list[ctypes.c_int32]:
    return [ctypes.c_int32(v) for v in values]


def _run(index: int, launches: list[KernelLaunch]) -> None:
    dev = _device(index)
    stream = driver.CUstream(torch.cuda.current_stream(index).cuda_stream)
    with dev.current():
        for k in launches:
            params = (ctypes.c_void_p * len(k.args))(*(ctypes.addressof(a) for a in k.args))
            fn = dev.function(k.kernel, k.smem)
            _drv(
                driver.cuLaunchKernel(
                    fn, k.grid[0], k.grid[1], 1, k.threads, 1, 1, k.smem, stream, ctypes.addressof(params), 0
                ),
                f"launching {k.kernel}",
            )


def _check(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device | None) -> torch.Tensor:
    """``shape`` entries of None match any size; device None means a CPU tensor."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise InvalidArgumentError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if len(t.shape) != len(shape) or any(
        want is not None and want != got for want, got in zip(shape, t.shape, strict=True)
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise InvalidArgumentError(f"{name} must have shape {want}, got {list(t.shape)}")
    where = device if device is not None else torch.device("cpu")
    if t.device != where:
        raise InvalidArgumentError(f"{name} must be on {where}, got {t.device}")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{name} must be contiguous")
    return t


def _cuda_device(name: str, t) -> torch.device:
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        raise InvalidArgumentError(f"{name} must be a CUDA tensor")
    return t.device


def _disjoint(**tensors: torch.Tensor) -> None:
    """Refuses overlapping tensors: the kernel writes some of them while it still reads the others."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                   for name, t in tensors.items() if t.numel())
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise InvalidArgumentError(f"{a} and {b} overlap in memory")


def _below_int32(**values: int) -> None:
    """The kernels index these with 32 bits."""
    for name, value in values.items():
        if value >= sizes.INT32_LIMIT:
            raise ConfigError(f"{name} is {value}: the kernels index it with 32 bits, so it must stay below 2^31")


@dataclass(frozen=True)
class Layers:
    """The device table of a set of layers and their sizes."""

    table: torch.Tensor
    count: int
    row_bytes: int
    gpu_rows: int
    host_rows: int


def _layer_table(device: torch.device, gpu_layers: list[torch.Tensor], host_layers: list[torch.Tensor]) -> Layers:
    """The device array [GPU slab addresses..., host pool addresses...] of the layers, and their sizes."""
    if not isinstance(gpu_layers, (list, tuple)) or not isinstance(host_layers, (list, tuple)):
        raise InvalidArgumentError("gpu_layers and host_layers must be lists of tensors")
    if len(gpu_layers) == 0 or len(gpu_layers) != len(host_layers):
        raise InvalidArgumentError(
            f"gpu_layers and host_layers must be non-empty and of equal length, got {len(gpu_layers)} and "
            f"{len(host_layers)}"
        )
    gpu_rows, rb = _check("gpu_layers[0]", gpu_layers[0], torch.uint8, (None, None), device).shape
    if rb == 0 or rb % _CHUNK:
        raise InvalidArgumentError(f"row bytes must be a positive multiple of {_CHUNK}, got {rb}")
    host_rows = _check("host_layers[0]", host_layers[0], torch.uint8, (None, rb), None).shape[0]
    for layers, where, rows in ((gpu_layers, device, gpu_rows), (host_layers, None, host_rows)):
        for i, t in enumerate(layers):
            name = f"{'gpu' if where is not None else 'host'}_layers[{i}]"
            if _check(name, t, torch.uint8, (rows, rb), where).data_ptr() % _CHUNK:
                raise InvalidArgumentError(f"{name} must be {_CHUNK}-byte aligned")
    _below_int32(gpu_rows=gpu_rows, host_rows=host_rows)
    key = (device.index, *(t.data_ptr() for t in gpu_layers), *(t.data_ptr() for t in host_layers))
    capturing = torch.cuda.is_current_stream_capturing()
    with _lock:
        table = _captured_tables.get(key)
        if table is None:
            table = _layer_tables.get(key)
            if table is not None:
                _layer_tables.move_to_end(key)
                if capturing:  # the graph reads it at every replay: never evicted from now on
                    _captured_tables[key] = _layer_tables.pop(key)
    if table is None:
        if capturing:
            raise RuntimeError(
                "a new set of layers during CUDA graph capture: run the call once eagerly before capturing"
            )
        attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        addresses = [t.data_ptr() for t in gpu_layers]
        for i, t in enumerate(host_layers):
            if not t.is_pinned():
                raise InvalidArgumentError(f"host_layers[{i}] must be pinned (pin_memory())")
            # The address kernels use for this pinned memory (the host address itself under unified
            # addressing, which every 64-bit CUDA platform has).
            with _device(device.index).current():
                ptr = _drv(driver.cuPointerGetAttribute(attr, t.data_ptr()), "cuPointerGetAttribute")
            addresses.append(int(ptr))
        # From pinned memory, so that the copy does not wait for the device.
        table = torch.tensor(addresses, dtype=torch.int64).pin_memory().to(device, non_blocking=True)
        with _lock:
            _layer_tables[key] = table
            while len(_layer_tables) > _MAX_LAYER_TABLES:
                _layer_tables.popitem(last=False)
    elif not capturing:
        # An evicted table is freed when its last user is done on every stream that used it.
        table.record_stream(torch.cuda.current_stream(device))
    return Layers(table, len(gpu_layers), rb, gpu_rows, host_rows)


# ---------------------------------------------------------------------------------------------- launches


def resolve_launches(
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
    out: torch.Tensor,
    miss_plan: torch.Tensor,
    miss_count: torch.Tensor,
    group: int,
    block_size: int,
    layers: int,
    num_layers: int,
    row_bytes: int,
    gpu_rows: int,
    host_rows: int,
    rows_per_request: int,
    max_smem: int,
    resident: torch.Tensor | None = None,
) -> list[KernelLaunch]:
    """hisparse_resolve, which copies its misses into the call's layers itself (``layers`` is the address of
    their table): one launch, none after it on a step without misses. Shapes are taken as checked; ``resident``
    (uint8 [S], SPEC.md) may be None: no request flagged."""
    R, K = topk.shape
    S, G, H = hot_pos.shape
    P = block_table.shape[1]
    shared = sizes.resolve_shared(top_k=K, hot_rows=H, batch_rows=R, rows_per_request=rows_per_request,
                                  limit=max_smem)
    tensors = (topk, row_state, seq_lens, block_table, host_table, hot_blocks, resident, hot_pos, hot_stamp,
               hot_clock, heat, status, counters, out, miss_plan, miss_count, layers)
    args = (*map(_ptr, tensors), *_ints(R, K, S, P, G, H, hot_blocks.shape[1], group, num_layers, block_size,
                                         row_bytes, gpu_rows // block_size, host_rows // block_size,
                                         shared.capacity))
    return [KernelLaunch("hisparse_resolve", (R, 1), sizes.RESOLVE_THREADS, shared.dynamic_bytes, args)]


def replay_launches(*, miss_plan: torch.Tensor, miss_count: torch.Tensor, layers: int, num_layers: int,
                    row_bytes: int, gpu_rows: int, host_rows: int, sm_count: int) -> list[KernelLaunch]:
    R = miss_count.shape[0]
    K = miss_plan.shape[0] // R
    grid = sizes.copy_grid(R * K * num_layers, sizes.COPY_THREADS // 32, sm_count)
    args = (_ptr(miss_plan), _ptr(miss_count), *_ints(R, K), _ptr(layers),
            *_ints(num_layers, row_bytes, gpu_rows, host_rows))
    return [KernelLaunch("hisparse_replay", (grid, 1), sizes.COPY_THREADS, sizes.replay_shared(R), args)]


def gather_launches(*, row_ids: torch.Tensor, slab: torch.Tensor, out: torch.Tensor, sm_count: int
                    ) -> list[KernelLaunch]:
    n = row_ids.numel()
    rows, rb = slab.shape
    grid = sizes.copy_grid(n, sizes.COPY_THREADS // 32, sm_count)
    args = (_ptr(row_ids), _ptr(slab), _ptr(out), *_ints(n, rb, rows))
    return [KernelLaunch("hisparse_gather", (grid, 1), sizes.COPY_THREADS, 0, args)]


def copy_rows_launches(*, pairs: torch.Tensor, layers: int, num_layers: int, row_bytes: int, gpu_rows: int,
                       host_rows: int, to_host: bool, sm_count: int) -> list[KernelLaunch]:
    n = pairs.shape[0]
    grid = sizes.copy_grid(n * num_layers, sizes.COPY_THREADS // 32, sm_count)
    args = (_ptr(pairs), *_ints(n), _ptr(layers), *_ints(num_layers, row_bytes, gpu_rows, host_rows, int(to_host)))
    return [KernelLaunch("hisparse_copy_rows", (grid, 1), sizes.COPY_THREADS, 0, args)]


def copy_blocks_launches(*, pairs: torch.Tensor, layers: int, num_layers: int, block_size: int, row_bytes: int,
                         gpu_rows: int, host_rows: int, to_host: bool, sm_count: int) -> list[KernelLaunch]:
    n = pairs.shape[0]
    grid = sizes.copy_grid(n * num_layers, 1, sm_count)
    args = (_ptr(pairs), *_ints(n), _ptr(layers),
            *_ints(num_layers, block_size, row_bytes, gpu_rows // block_size, host_rows // block_size,
                   int(to_host)))
    return [KernelLaunch("hisparse_copy_blocks", (grid, 1), sizes.COPY_THREADS, 0, args)]


def invalidate_launches(*, pairs: torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor
                        ) -> list[KernelLaunch]:
    n = pairs.shape[0]
    S, G, H = hot_pos.shape
    args = (_ptr(pairs), *_ints(n), _ptr(hot_pos), _ptr(hot_stamp), *_ints(G, H))
    return [KernelLaunch("hisparse_invalidate", (S, G), sizes.INVALIDATE_THREADS, sizes.invalidate_shared(H), args)]


# ---------------------------------------------------------------------------------------------- launchers


def resolve(
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
    gpu_layers: list[torch.Tensor],
    host_layers: list[torch.Tensor],
    group: int,
    block_size: int,
    out: torch.Tensor,
    miss_plan: torch.Tensor | None = None,
    miss_count: torch.Tensor | None = None,
    rows_per_request: int = 1,
    resident: torch.Tensor | None = None,
) -> None:
    """resolve(topk, row_state, group, layers) of SPEC.md into ``out`` (int32 [R, K]).

    ``gpu_layers`` / ``host_layers`` are the layers of ``group`` that this call fills. The misses' (GPU row,
    host row) pairs are recorded in ``miss_plan`` (int64 [R * K, 2]) and ``miss_count`` (int32 [R]) for
    :func:`replay` when given (miss_count[i] pairs at the start of batch row i's K entries), else in scratch.
    ``rows_per_request`` (1 + speculative tokens) sizes the hash table of resolve: a request with more batch
    rows, or more distinct positions than they hold, is resolved exactly but more slowly. ``resident`` (uint8
    [S], SPEC.md) flags the requests whose every page is resident, which then take a short path; None flags none.
    """
    device = _cuda_device("topk", topk)
    i32 = torch.int32
    R, K = _check("topk", topk, i32, (None, None), device).shape
    S, P = _check("block_table", block_table, i32, (None, None), device).shape
    _, G, H = _check("hot_pos", hot_pos, i32, (S, None, None), device).shape
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive integer, got {block_size!r}")
    if isinstance(rows_per_request, bool) or not isinstance(rows_per_request, int) or rows_per_request <= 0:
        raise InvalidArgumentError(f"rows_per_request must be a positive integer, got {rows_per_request!r}")
    if H == 0:
        raise InvalidArgumentError("hot_pos must have at least one hot row")
    HB = math.ceil(H / block_size)
    _check("row_state", row_state, i32, (R,), device)
    _check("seq_lens", seq_lens, i32, (S,), device)
    _check("host_table", host_table, i32, (S, P), device)
    _check("hot_blocks", hot_blocks, i32, (S, HB), device)
    _check("hot_stamp", hot_stamp, torch.int64, (S, G, H), device)
    _check("hot_clock", hot_clock, torch.int64, (S, G), device)
    _check("heat", heat, i32, (S, P), device)
    _check("status", status, i32, (S,), device)
    _check("counters", counters, torch.int64, (3,), device)
    if resident is not None:
        _check("resident", resident, torch.uint8, (S,), device)
    _check("out", out, i32, (R, K), device)
    if (miss_plan is None) != (miss_count is None):
        raise InvalidArgumentError("miss_plan and miss_count go together")
    if miss_plan is not None:
        _check("miss_plan", miss_plan, torch.int64, (R * K, 2), device)
        _check("miss_count", miss_count, i32, (R,), device)
    if not 0 <= group < G:
        raise InvalidArgumentError(f"group must be in [0, {G}), got {group}")
    lay = _layer_table(device, gpu_layers, host_layers)
    _below_int32(**{"R * K * layers": R * K * lay.count, "P * block_size": P * block_size})
    if R == 0 or K == 0:  # nothing selected: no state changes (as in the CPU reference), no misses
        if miss_count is not None:
            miss_count.zero_()
        return
    if miss_plan is None:  # scratch from the caching allocator, stream-ordered (and graph-safe)
        miss_plan = torch.empty(R * K, 2, dtype=torch.int64, device=device)
        miss_count = torch.empty(R, dtype=i32, device=device)
    # resolve keeps its work in `out` and the plan while it still reads topk and row_state.
    _disjoint(topk=topk, row_state=row_state, out=out, miss_plan=miss_plan, miss_count=miss_count)
    dev = _device(device.index)
    launches = resolve_launches(
        topk=topk, row_state=row_state, seq_lens=seq_lens, block_table=block_table, host_table=host_table,
        hot_blocks=hot_blocks, hot_pos=hot_pos, hot_stamp=hot_stamp, hot_clock=hot_clock, heat=heat, status=status,
        counters=counters,
        out=out, miss_plan=miss_plan, miss_count=miss_count, group=group, block_size=block_size,
        layers=lay.table.data_ptr(), num_layers=lay.count, row_bytes=lay.row_bytes, gpu_rows=lay.gpu_rows,
        host_rows=lay.host_rows, rows_per_request=rows_per_request, max_smem=dev.max_smem, resident=resident,
    )
    _run(device.index, launches)


def replay(
    *,
    miss_plan: torch.Tensor,
    miss_count: torch.Tensor,
    gpu_layers: list[torch.Tensor],
    host_layers: list[torch.Tensor],
) -> None:
    """replay(miss_plan, layers) of SPEC.md: the miss copies a resolve call recorded, for these layers."""
    device = _cuda_device("miss_plan", miss_plan)
    (R,) = _check("miss_count", miss_count, torch.int32, (None,), device).shape
    rows = _check("miss_plan", miss_plan, torch.int64, (None, 2), device).shape[0]
    if rows % max(R, 1) or (R == 0 and rows):
        raise InvalidArgumentError(f"miss_plan must have R * K rows for R = {R} batch rows, got {rows}")
    lay = _layer_table(device, gpu_layers, host_layers)
    _below_int32(**{"R * K * layers": rows * lay.count})
    if rows == 0:  # no batch rows, or K == 0: no pair to copy
        return
    dev = _device(device.index)
    _run(device.index, replay_launches(miss_plan=miss_plan, miss_count=miss_count, layers=lay.table.data_ptr(),
                                       num_layers=lay.count, row_bytes=lay.row_bytes, gpu_rows=lay.gpu_rows,
                                       host_rows=lay.host_rows, sm_count=dev.sm_count))


def gather(*, row_ids: torch.Tensor, slab: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gather(row_ids, layer) of SPEC.md from ``slab`` (one layer's GPU slab): uint8 [R, K, rb], zeros where
    row_ids < 0."""
    device = _cuda_device("row_ids", row_ids)
    R, K = _check("row_ids", row_ids, torch.int32, (None, None), device).shape
    rows, rb = _check("slab", slab, torch.uint8, (None, None), device).shape
    if rb == 0 or rb % _CHUNK or slab.data_ptr() % _CHUNK:
        raise InvalidArgumentError(f"slab rows must be a positive multiple of {_CHUNK} bytes, {_CHUNK}-byte aligned")
    if out is None:
        out = torch.empty((R, K, rb), dtype=torch.uint8, device=device)
    _check("out", out, torch.uint8, (R, K, rb), device)
    if out.data_ptr() % _CHUNK:
        raise InvalidArgumentError(f"out must be {_CHUNK}-byte aligned")
    _below_int32(**{"R * K": R * K, "slab rows": rows})
    if R * K:
        launches = gather_launches(row_ids=row_ids, slab=slab, out=out, sm_count=_device(device.index).sm_count)
        _run(device.index, launches)
    return out


def copy_rows(
    *, pairs: torch.Tensor, gpu_layers: list[torch.Tensor], host_layers: list[torch.Tensor], to_host: bool
) -> None:
    """copy_rows(pairs, direction) of SPEC.md: pairs int64 [n, 2] of (GPU row, host row), every layer;
    ``to_host`` is direction d2h. Destinations must be distinct."""
    device = _cuda_device("pairs", pairs)
    (n, _) = _check("pairs", pairs, torch.int64, (None, 2), device).shape
    lay = _layer_table(device, gpu_layers, host_layers)
    _below_int32(**{"pairs * layers": n * lay.count})
    if n:
        _run(device.index, copy_rows_launches(pairs=pairs, layers=lay.table.data_ptr(), num_layers=lay.count,
                                              row_bytes=lay.row_bytes, gpu_rows=lay.gpu_rows,
                                              host_rows=lay.host_rows, to_host=to_host,
                                              sm_count=_device(device.index).sm_count))


def copy_blocks(
    *,
    pairs: torch.Tensor,
    gpu_layers: list[torch.Tensor],
    host_layers: list[torch.Tensor],
    block_size: int,
    to_host: bool,
) -> None:
    """copy_blocks(pairs, direction) of SPEC.md: pairs int32 [n, 2] of (GPU block, host block), all layers;
    ``to_host`` is direction d2h. Destinations must be distinct."""
    device = _cuda_device("pairs", pairs)
    (n, _) = _check("pairs", pairs, torch.int32, (None, 2), device).shape
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidArgumentError(f"block_size must be a positive integer, got {block_size!r}")
    lay = _layer_table(device, gpu_layers, host_layers)
    _below_int32(**{"pairs * layers": n * lay.count, "block bytes": block_size * lay.row_bytes})
    if n:
        _run(device.index, copy_blocks_launches(pairs=pairs, layers=lay.table.data_ptr(), num_layers=lay.count,
                                                block_size=block_size, row_bytes=lay.row_bytes,
                                                gpu_rows=lay.gpu_rows, host_rows=lay.host_rows, to_host=to_host,
                                                sm_count=_device(device.index).sm_count))


def invalidate(*, pairs: torch.Tensor, hot_pos: torch.Tensor, hot_stamp: torch.Tensor) -> None:
    """invalidate(pairs) of SPEC.md: pairs int32 [n, 2] of (state row, position), for every group."""
    device = _cuda_device("pairs", pairs)
    (n, _) = _check("pairs", pairs, torch.int32, (None, 2), device).shape
    S, G, H = _check("hot_pos", hot_pos, torch.int32, (None, None, None), device).shape
    _check("hot_stamp", hot_stamp, torch.int64, (S, G, H), device)
    _below_int32(**{"pairs": 2 * n})
    if G > 65535:
        raise ConfigError(f"{G} index groups: invalidate's grid takes at most 65535")
    if n and S and G and H:
        _run(device.index, invalidate_launches(pairs=pairs, hot_pos=hot_pos, hot_stamp=hot_stamp))
