"""Launchers of the hisparse CUDA kernels on torch tensors; cuda/SPEC.md is their contract.

Every launcher takes keyword arguments only, validates dtypes, shapes, devices and contiguity (raising
ValueError), and enqueues one kernel on ``torch.cuda.current_stream()``. None of them waits for the GPU,
so they can be captured in CUDA graphs once each call has run eagerly with the same shapes and layers: the
first launch on a device compiles (or loads from the disk cache) and loads the kernels, and the first
launch with a set of layers builds the device table of their addresses, which capture cannot do. Those
tables are kept for the life of the process, since a captured graph keeps reading them.

Layers come as two lists of equal length: ``gpu_layers[l]`` a CUDA uint8 tensor ``[rows, rb]`` (the GPU
slab of layer l) and ``host_layers[l]`` a pinned CPU uint8 tensor ``[host rows, rb]`` (its host pool),
which the kernels read and write in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
from collections.abc import Iterator

import torch
from cuda.bindings import driver

from hisparse.kernels.compiler import KERNELS, compile_kernel_source, select_arch

RESOLVE_THREADS = 1024  # RESOLVE_THREADS in cuda/resolve.cu; its shared-memory layout assumes it
COPY_THREADS = 256
INVALIDATE_THREADS = 256
_CHUNK = 16  # bytes per vector load: row bytes must be a multiple of it

_lock = threading.Lock()
_devices: dict[int, _Device] = {}
_layer_tables: dict[tuple, torch.Tensor] = {}


def _drv(result: tuple, what: str):
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err.name}")
    return values[0] if len(values) == 1 else tuple(values)


class _Device:
    """Modules, functions and limits of one GPU, in its primary context (the one torch uses)."""

    def __init__(self, index: int) -> None:
        _drv(driver.cuInit(0), "cuInit")
        device = _drv(driver.cuDeviceGet(index), "cuDeviceGet")
        self.context = _drv(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
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

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Makes this device's context current for the driver calls inside: the calling thread may have
        another device's context current, or none if it never made a CUDA runtime call."""
        if int(_drv(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")) == int(self.context):
            yield
            return
        _drv(driver.cuCtxPushCurrent(self.context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            _drv(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def function(self, kernel: str, smem: int) -> driver.CUfunction:
        """The kernel, allowed ``smem`` bytes of dynamic shared memory (call with this context current)."""
        fn = self._functions[kernel]
        if smem > self.max_smem:
            raise ValueError(f"{kernel} needs {smem} bytes of shared memory; this GPU allows {self.max_smem}")
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


def _ptr(t: torch.Tensor | None) -> ctypes.c_uint64:
    return ctypes.c_uint64(0 if t is None else t.data_ptr())


def _launch(
    index: int, kernel: str, grid: tuple[int, int], threads: int, smem: int, args: list[ctypes._SimpleCData]
) -> None:
    dev = _device(index)
    params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
    stream = driver.CUstream(torch.cuda.current_stream(index).cuda_stream)
    with dev.current():
        fn = dev.function(kernel, smem)
        _drv(
            driver.cuLaunchKernel(fn, grid[0], grid[1], 1, threads, 1, 1, smem, stream, ctypes.addressof(params), 0),
            f"launching {kernel}",
        )


def _check(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device | None) -> torch.Tensor:
    """``shape`` entries of None match any size; device None means a CPU tensor."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if len(t.shape) != len(shape) or any(
        want is not None and want != got for want, got in zip(shape, t.shape, strict=True)
    ):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    where = device if device is not None else torch.device("cpu")
    if t.device != where:
        raise ValueError(f"{name} must be on {where}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def _cuda_device(name: str, t) -> torch.device:
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor")
    return t.device


def _layer_table(
    device: torch.device, gpu_layers: list[torch.Tensor], host_layers: list[torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """The device array [GPU slab addresses..., host pool addresses...] of the layers, and the row bytes."""
    if not isinstance(gpu_layers, (list, tuple)) or not isinstance(host_layers, (list, tuple)):
        raise ValueError("gpu_layers and host_layers must be lists of tensors")
    if len(gpu_layers) == 0 or len(gpu_layers) != len(host_layers):
        raise ValueError(
            f"gpu_layers and host_layers must be non-empty and of equal length, got {len(gpu_layers)} and "
            f"{len(host_layers)}"
        )
    rb = _check("gpu_layers[0]", gpu_layers[0], torch.uint8, (None, None), device).shape[1]
    if rb == 0 or rb % _CHUNK:
        raise ValueError(f"row bytes must be a positive multiple of {_CHUNK}, got {rb}")
    for layers, where in ((gpu_layers, device), (host_layers, None)):
        for i, t in enumerate(layers):
            name = f"{'gpu' if where is not None else 'host'}_layers[{i}]"
            if _check(name, t, torch.uint8, (None, rb), where).data_ptr() % _CHUNK:
                raise ValueError(f"{name} must be {_CHUNK}-byte aligned")
    key = (device.index, *(t.data_ptr() for t in gpu_layers), *(t.data_ptr() for t in host_layers))
    table = _layer_tables.get(key)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a new set of layers during CUDA graph capture: run the call once eagerly before capturing"
            )
        attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        addresses = [t.data_ptr() for t in gpu_layers]
        for i, t in enumerate(host_layers):
            if not t.is_pinned():
                raise ValueError(f"host_layers[{i}] must be pinned (pin_memory())")
            # The address kernels use for this pinned memory (the host address itself under unified
            # addressing, which every 64-bit CUDA platform has).
            with _device(device.index).current():
                ptr = _drv(driver.cuPointerGetAttribute(attr, t.data_ptr()), "cuPointerGetAttribute")
            addresses.append(int(ptr))
        table = torch.tensor(addresses, dtype=torch.int64).to(device)
        _layer_tables[key] = table
    return table, rb


def _copy_grid(index: int, chunks: int, threads: int) -> int:
    # Enough CTAs to fill the GPU a few times over; the kernels stride over the rest.
    return max(1, min(math.ceil(chunks / (threads * 4)), _device(index).sm_count * 8))


def resolve_shared_bytes(batch_rows: int, top_k: int, hot_rows: int) -> tuple[int, int]:
    """(log2 of the hash capacity C, dynamic shared memory bytes) of hisparse_resolve.

    C >= 2 * hot_rows (the table of U and the fallback's first-occurrence list fit in it),
    C >= 2 * top_k (a single-row request never takes the fallback path), C >= 4 * RESOLVE_THREADS (the
    insertion bound of table_insert_min needs 2 *, and a second row of a request often fits too).
    The layout is in the comment of hisparse_resolve.
    """
    capacity = max(2 * hot_rows, 2 * top_k, 4 * RESOLVE_THREADS)
    log2c = (capacity - 1).bit_length()
    return log2c, 8 * (1 << log2c) + 8 * hot_rows + 4 * math.ceil(hot_rows / 32) + 4 * batch_rows


def resolve(
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
    gpu_layers: list[torch.Tensor],
    host_layers: list[torch.Tensor],
    group: int,
    block_size: int,
    out: torch.Tensor,
    miss_plan: torch.Tensor | None = None,
    miss_count: torch.Tensor | None = None,
) -> None:
    """resolve(topk, row_state, group, layers) of SPEC.md into ``out`` (int32 [R, K]).

    ``gpu_layers`` / ``host_layers`` are the layers of ``group`` that this call fills. With
    ``miss_plan`` (int64 [R * K, 2]) and ``miss_count`` (int32 [R]), the misses' (GPU row, host row)
    pairs are recorded for :func:`replay`: miss_count[i] pairs at the start of batch row i's K entries.
    """
    device = _cuda_device("topk", topk)
    i32 = torch.int32
    R, K = _check("topk", topk, i32, (None, None), device).shape
    S, P = _check("block_table", block_table, i32, (None, None), device).shape
    _, G, H = _check("hot_pos", hot_pos, i32, (S, None, None), device).shape
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    HB = math.ceil(H / block_size)
    _check("row_state", row_state, i32, (R,), device)
    _check("seq_lens", seq_lens, i32, (S,), device)
    _check("host_table", host_table, i32, (S, P), device)
    _check("hot_blocks", hot_blocks, i32, (S, HB), device)
    _check("hot_lru", hot_lru, i32, (S, G, H), device)
    _check("heat", heat, i32, (S, P), device)
    _check("status", status, i32, (S,), device)
    _check("counters", counters, torch.int64, (3,), device)
    _check("out", out, i32, (R, K), device)
    if (miss_plan is None) != (miss_count is None):
        raise ValueError("miss_plan and miss_count go together")
    if miss_plan is not None:
        _check("miss_plan", miss_plan, torch.int64, (R * K, 2), device)
        _check("miss_count", miss_count, i32, (R,), device)
    if not 0 <= group < G:
        raise ValueError(f"group must be in [0, {G}), got {group}")
    if R * K >= 2**31:
        raise ValueError(f"R * K must be below 2**31, got {R * K}")
    layers, rb = _layer_table(device, gpu_layers, host_layers)
    if R == 0:
        return
    log2c, smem = resolve_shared_bytes(R, K, H)
    ints = (R, K, P, G, H, HB, group, len(gpu_layers), block_size, rb, log2c)
    args = [
        _ptr(t)
        for t in (
            topk,
            row_state,
            seq_lens,
            block_table,
            host_table,
            hot_blocks,
            hot_pos,
            hot_lru,
            heat,
            status,
            counters,
            layers,
            out,
            miss_plan,
            miss_count,
        )
    ] + [ctypes.c_int32(v) for v in ints]
    _launch(device.index, "hisparse_resolve", (R, 1), RESOLVE_THREADS, smem, args)


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
    if R == 0 or rows % R:
        raise ValueError(f"miss_plan must have R * K rows for R = {R} batch rows, got {rows}")
    layers, rb = _layer_table(device, gpu_layers, host_layers)
    args = [
        _ptr(miss_plan),
        _ptr(miss_count),
        ctypes.c_int32(rows // R),
        _ptr(layers),
        ctypes.c_int32(len(gpu_layers)),
        ctypes.c_int32(rb),
    ]
    _launch(device.index, "hisparse_replay", (R, len(gpu_layers)), COPY_THREADS, 0, args)


def gather(*, row_ids: torch.Tensor, slab: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gather(row_ids, layer) of SPEC.md from ``slab`` (one layer's GPU slab): uint8 [R, K, rb], zeros where
    row_ids < 0."""
    device = _cuda_device("row_ids", row_ids)
    R, K = _check("row_ids", row_ids, torch.int32, (None, None), device).shape
    rb = _check("slab", slab, torch.uint8, (None, None), device).shape[1]
    if rb == 0 or rb % _CHUNK or slab.data_ptr() % _CHUNK:
        raise ValueError(f"slab rows must be a positive multiple of {_CHUNK} bytes, {_CHUNK}-byte aligned")
    if out is None:
        out = torch.empty((R, K, rb), dtype=torch.uint8, device=device)
    _check("out", out, torch.uint8, (R, K, rb), device)
    n = R * K
    if n:
        args = [_ptr(row_ids), _ptr(slab), _ptr(out), ctypes.c_int64(n), ctypes.c_int32(rb)]
        grid = _copy_grid(device.index, n * rb // _CHUNK, COPY_THREADS)
        _launch(device.index, "hisparse_gather", (grid, 1), COPY_THREADS, 0, args)
    return out


def copy_rows(
    *, pairs: torch.Tensor, gpu_layers: list[torch.Tensor], host_layers: list[torch.Tensor], to_host: bool
) -> None:
    """copy_rows(pairs, direction) of SPEC.md: pairs int64 [n, 2] of (GPU row, host row), every layer;
    ``to_host`` is direction d2h."""
    device = _cuda_device("pairs", pairs)
    (n, _) = _check("pairs", pairs, torch.int64, (None, 2), device).shape
    layers, rb = _layer_table(device, gpu_layers, host_layers)
    if n:
        L = len(gpu_layers)
        args = [
            _ptr(pairs),
            ctypes.c_int64(n),
            _ptr(layers),
            ctypes.c_int32(L),
            ctypes.c_int32(rb),
            ctypes.c_int32(int(to_host)),
        ]
        grid = _copy_grid(device.index, L * n * rb // _CHUNK, COPY_THREADS)
        _launch(device.index, "hisparse_copy_rows", (grid, 1), COPY_THREADS, 0, args)


def copy_blocks(
    *,
    pairs: torch.Tensor,
    gpu_layers: list[torch.Tensor],
    host_layers: list[torch.Tensor],
    block_size: int,
    to_host: bool,
) -> None:
    """copy_blocks(pairs, direction) of SPEC.md: pairs int32 [n, 2] of (GPU block, host block), all layers;
    ``to_host`` is direction d2h."""
    device = _cuda_device("pairs", pairs)
    (n, _) = _check("pairs", pairs, torch.int32, (None, 2), device).shape
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    layers, rb = _layer_table(device, gpu_layers, host_layers)
    if n:
        L = len(gpu_layers)
        args = [
            _ptr(pairs),
            ctypes.c_int64(n),
            _ptr(layers),
            ctypes.c_int32(L),
            ctypes.c_int32(block_size),
            ctypes.c_int32(rb),
            ctypes.c_int32(int(to_host)),
        ]
        grid = _copy_grid(device.index, L * n * block_size * rb // _CHUNK, COPY_THREADS)
        _launch(device.index, "hisparse_copy_blocks", (grid, 1), COPY_THREADS, 0, args)


def invalidate(*, pairs: torch.Tensor, hot_pos: torch.Tensor, hot_lru: torch.Tensor) -> None:
    """invalidate(pairs) of SPEC.md: pairs int32 [n, 2] of (state row, position), for every group."""
    device = _cuda_device("pairs", pairs)
    (n, _) = _check("pairs", pairs, torch.int32, (None, 2), device).shape
    S, G, H = _check("hot_pos", hot_pos, torch.int32, (None, None, None), device).shape
    _check("hot_lru", hot_lru, torch.int32, (S, G, H), device)
    if n and G and H:
        smem = 4 * min(H, n) + 4 * math.ceil(H / 32)
        args = [
            _ptr(pairs),
            ctypes.c_int32(n),
            _ptr(hot_pos),
            _ptr(hot_lru),
            ctypes.c_int32(G),
            ctypes.c_int32(H),
        ]
        _launch(device.index, "hisparse_invalidate", (n, G), INVALIDATE_THREADS, smem, args)
