"""What each kernel launch needs, as plain arithmetic: shared memory per architecture, grid sizes, and the
limits of the kernels' 32-bit indices. Nothing here needs a GPU or a CUDA library, so ``Layout`` (and any
configuration) can refuse at construction what a launch would refuse, with the same numbers the launchers in
``hisparse.kernels.ops`` use.

``benches/kernel_report.py`` prints resolve's shared memory per architecture and configuration (the table of
:func:`shared_memory_table`) next to every kernel's registers and spills.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..errors import ConfigError

# Most shared memory (static + dynamic) one CTA may use after opting in, by architecture, in bytes: the CUDA
# C++ Programming Guide's technical specifications per compute capability (163 KB on 8.0 / 8.7, 99 KB on
# 8.6 / 8.9 / 12.x, 227 KB on 9.0 / 10.x). A device of another architecture is held to the smallest.
SHARED_MEMORY_PER_BLOCK = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_87": 163 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
    "sm_100": 227 * 1024,
    "sm_103": 227 * 1024,
    "sm_120": 99 * 1024,
    "sm_121": 99 * 1024,
}
# The architectures CI compiles every kernel for (spill-free) and checks every launch against.
COMPILED_ARCHS = ("sm_80", "sm_90", "sm_100", "sm_120")

# Threads per CTA, as the kernels' #defines (RESOLVE_THREADS, INVALIDATE_THREADS, COPY_THREADS) say.
RESOLVE_THREADS = 1024
INVALIDATE_THREADS = 256
COPY_THREADS = 256
INVALIDATE_BATCH = 2048  # INVALIDATE_BATCH in cuda/resolve.cu: pairs per pass of its position set
# Static shared memory of the kernels that have any, at most (the compile test checks this bound on every
# architecture CI compiles for): resolve's scalars and warp sums, and the 1 KiB histogram of its LRU select.
STATIC_SHARED = {"hisparse_resolve": 1280, "hisparse_invalidate": 256, "hisparse_replay": 256}
# resolve's hash table: at least 4 entries per thread (table_insert_min claims at most limit + blockDim - 1
# entries, with limit = 3/4 of the capacity), and 4/3 entries per selected position, so that a request that
# selects no more distinct positions than its batch rows hold stays on the hash path.
MIN_TABLE = 4 * RESOLVE_THREADS
# Beyond that the table takes up to SPARSE_TABLE entries per selected position, as far as shared memory allows:
# resolve runs one CTA per SM (its registers fill the SM), so the memory is otherwise idle, and in a sparser
# table probes end sooner. Hit-only resolve at top-K 2048 and batch 128 took 12-14% fewer cycles on an H200 with
# 8 entries per position than with 2 (hot regions of 4,096 and 10,240 rows). The sparse table stops at what was
# measured, 16,384 entries (128 KiB): shared memory and the L1 cache share an SM's memory, and resolve's
# scattered loads (page table, heat, plan) use the L1 cache.
SPARSE_TABLE = 8
SPARSE_TABLE_MAX = 16384
INT32_LIMIT = 2**31


@dataclass(frozen=True)
class ResolveShared:
    """resolve's shared memory for one launch configuration on one architecture."""

    capacity: int  # entries of the hash table (8 bytes each)
    dynamic_bytes: int  # table + the request's batch rows + one bit per hot slot
    static_bytes: int
    fast_positions: int  # distinct positions one request may select and stay on the hash path
    selection: int  # top_k x rows per request: the positions one request selects at most
    clamped: bool  # the architecture's limit made the table smaller than the selection asks

    @property
    def total_bytes(self) -> int:
        return self.dynamic_bytes + self.static_bytes


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, not {value!r}")


def smem_limit(arch: str) -> int:
    return SHARED_MEMORY_PER_BLOCK.get(arch, min(SHARED_MEMORY_PER_BLOCK.values()))


def resolve_fixed_bytes(*, hot_rows: int, batch_rows: int) -> int:
    """resolve's dynamic shared memory beside its table: a request's batch rows, one bit per hot slot."""
    return 4 * batch_rows + 4 * math.ceil(hot_rows / 32)


def resolve_shared(*, top_k: int, hot_rows: int, batch_rows: int, rows_per_request: int = 1,
                   limit: int) -> ResolveShared:
    """resolve's shared memory: a hash table sized by the selection (``top_k x rows_per_request``, the rows
    one request resolves together), the batch rows of a request, and one bit per hot slot. A request that
    selects more distinct positions than the table takes is still resolved exactly, bucket by bucket of
    positions; so the table shrinks to what ``limit`` (bytes per CTA) leaves, down to ``MIN_TABLE`` entries.
    Raises ConfigError when not even that fits.
    """
    _positive(top_k=top_k, hot_rows=hot_rows, batch_rows=batch_rows, rows_per_request=rows_per_request)
    static = STATIC_SHARED["hisparse_resolve"]
    fixed = resolve_fixed_bytes(hot_rows=hot_rows, batch_rows=batch_rows)
    selection = top_k * rows_per_request
    needed = max(MIN_TABLE, math.ceil(4 * selection / 3))  # the whole selection on the hash path
    room = (limit - static - fixed) // 8
    if room < MIN_TABLE:
        raise ConfigError(
            f"resolve needs {8 * MIN_TABLE + fixed + static} bytes of shared memory for {batch_rows} batch rows "
            f"and {hot_rows} hot rows; this GPU allows {limit}: use fewer batch rows or hot rows"
        )
    capacity = min(max(needed, min(SPARSE_TABLE * selection, SPARSE_TABLE_MAX)), room)
    return ResolveShared(
        capacity=capacity,
        dynamic_bytes=8 * capacity + fixed,
        static_bytes=static,
        fast_positions=capacity - capacity // 4,
        selection=selection,
        clamped=capacity < needed,
    )


def invalidate_shared(hot_rows: int) -> int:
    """Dynamic shared memory of invalidate: its position set, then one bit per hot slot."""
    return 4 * 2 * INVALIDATE_BATCH + 4 * math.ceil(hot_rows / 32)


def replay_shared(batch_rows: int) -> int:
    """Dynamic shared memory of replay: where each batch row's pairs start."""
    return 4 * batch_rows


def copy_grid(jobs: int, jobs_per_cta: int, sm_count: int) -> int:
    """CTAs for a copy kernel: one job per warp (or CTA), at most 8 CTAs of COPY_THREADS per SM (a full SM);
    the kernels stride over the rest."""
    return max(1, min(math.ceil(jobs / jobs_per_cta), 8 * sm_count))


def check_datapath(
    *,
    hot_rows: int,
    block_size: int,
    gpu_blocks: int,
    host_blocks: int,
    max_model_len: int,
    row_bytes: int,
    batch_rows: int,
    top_k: int | None = None,
    rows_per_request: int = 1,
    layers: int = 1,
    groups: int = 1,
    archs: tuple[str, ...] = COMPILED_ARCHS,
) -> dict[str, ResolveShared]:
    """Refuses (ConfigError, saying what to change) a data path some kernel launch would refuse on one of
    ``archs``: 32-bit row ids, positions and job counts, shared memory, grid sizes. ``batch_rows`` is the
    most batch rows one resolve call takes; without ``top_k``, resolve's table is checked at its smallest,
    which every top_k needs at least. Returns resolve's shared memory per architecture.
    """
    _positive(hot_rows=hot_rows, block_size=block_size, gpu_blocks=gpu_blocks, host_blocks=host_blocks,
              max_model_len=max_model_len, row_bytes=row_bytes, batch_rows=batch_rows, layers=layers,
              groups=groups, rows_per_request=rows_per_request)
    pages = math.ceil(max_model_len / block_size)
    limits = [
        ("GPU slab rows (num_gpu_blocks x block_size), which row ids index", gpu_blocks * block_size),
        ("host pool rows (num_host_blocks x block_size)", host_blocks * block_size),
        ("positions (pages x block_size)", pages * block_size),
        ("bytes of one block (block_size x row_bytes)", block_size * row_bytes),
    ]
    if top_k is not None:
        _positive(top_k=top_k)
        limits.append(("replay jobs (batch rows x top_k x layers)", batch_rows * top_k * layers))
    for what, value in limits:
        if value >= INT32_LIMIT:
            raise ConfigError(f"{what} is {value}: the kernels index it with 32 bits, so it must stay below 2^31")
    if groups > 65535:
        raise ConfigError(f"{groups} index groups: invalidate's grid takes at most 65535")
    out = {}
    for arch in archs:
        limit = smem_limit(arch)
        for kernel, dynamic in (
            ("invalidate", invalidate_shared(hot_rows)),
            ("replay", replay_shared(batch_rows)),
        ):
            total = dynamic + STATIC_SHARED[f"hisparse_{kernel}"]
            if total > limit:
                raise ConfigError(
                    f"{kernel} needs {total} bytes of shared memory on {arch}, which allows {limit}: "
                    f"use fewer {'hot rows' if kernel == 'invalidate' else 'batch rows'}"
                )
        out[arch] = resolve_shared(top_k=top_k or 1, hot_rows=hot_rows, batch_rows=batch_rows,
                                   rows_per_request=rows_per_request, limit=limit)
    return out


# The configurations of the shared-memory table: H = 2x .. 16x top_k (H = 32,768 at the top), the batch sizes of
# kernel_bench.py and 1 to 5 batch rows per request (speculative decoding with up to 4 draft tokens).
TABLE_TOP_K = 2048
TABLE_HOT_ROWS = (4096, 8192, 10240, 16384, 32768)
TABLE_BATCH = (1, 8, 32, 128)
TABLE_ROWS_PER_REQUEST = (1, 2, 4, 5)


def shared_memory_table(archs: tuple[str, ...] = COMPILED_ARCHS) -> list[dict]:
    """resolve's shared memory for every configuration of the table above on every architecture."""
    rows = []
    for hot_rows in TABLE_HOT_ROWS:
        for rows_per_request in TABLE_ROWS_PER_REQUEST:
            for batch in TABLE_BATCH:
                for arch in archs:
                    shared = resolve_shared(top_k=TABLE_TOP_K, hot_rows=hot_rows, batch_rows=batch * rows_per_request,
                                            rows_per_request=rows_per_request, limit=smem_limit(arch))
                    rows.append({"arch": arch, "limit": smem_limit(arch), "top_k": TABLE_TOP_K, "hot_rows": hot_rows,
                                 "batch": batch, "rows_per_request": rows_per_request, **asdict(shared),
                                 "total_bytes": shared.total_bytes})
    return rows
