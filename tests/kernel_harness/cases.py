"""Cases for the kernels: random state and inputs (``make_case``), and the case kinds, each of which runs the
kernels' launches (the ``*_launches`` records of ``hisparse.kernels.ops``) on a backend and the Rust reference on
a copy, and compares every byte: outputs, state, status, counters, slabs and pools, and, on the CPU harness, the
guard zones of every buffer. A backend is the CPU harness (:class:`~kernel_harness.Harness`) or a CUDA device
(:class:`CudaBackend`, which tests/test_kernels_gpu.py runs every kind on): ``tensor(like, host=False)`` copies a
CPU tensor into its memory (``host``: a host pool, pinned on CUDA), ``run(launches, seed, preempt)``,
``damaged()``, ``free()``, ``sm_count`` and ``max_smem``.

Corrupt state (SPEC.md "Bad state and bad arguments") must give the same bytes and flags in both. A bad argument
(a state row past S, a row past its slab) is refused by the reference and skipped by the kernel; there the
reference runs on the input with the bad entries replaced by padding, which is what the kernel must have done.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from hisparse import _core
from hisparse.datapath import resolve_reference
from hisparse.kernels import launch, ops

from . import Harness

STATE_KEYS = ("hot_pos", "hot_stamp", "hot_clock", "heat", "status", "counters")
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
SMEM_SM90 = launch.SHARED_MEMORY_PER_BLOCK["sm_90"]
SMEM_SM120 = launch.SHARED_MEMORY_PER_BLOCK["sm_120"]


def make_case(
    seed: int,
    *,
    S: int = 4,
    P: int = 64,
    bs: int = 16,
    G: int = 2,
    H: int = 128,
    K: int = 256,
    R: int = 6,
    L: int = 2,
    rb: int = 48,
    hot_fill: float = 0.5,
    resident: float = 0.3,
    no_host: float = 0.0,
    rows_per_state: int = 1,
    padding: float = 0.0,
    no_hot_region: float = 0.0,
    dup: float = 0.3,
    from_hot: bool = False,
    full_seq: bool = False,
    hits_without_host: int | None = None,
    gpu_blocks_at_least: int = 0,
    flagged: float = 0.0,
) -> dict:
    """Random CPU state and inputs for resolve.

    Every hot region and resident page gets its own GPU block, so no two requests write one row; the slab and the
    pool have exactly the blocks the tables may name. ``from_hot`` draws topk from what group 0 already caches
    (all hits when nothing is resident); ``full_seq`` makes every request P * bs tokens long;
    ``hits_without_host = g`` takes the host copy from every page that group g caches and selects from cached
    positions and pages with a host copy only: the request succeeds only if no hit is mistaken for a miss.
    ``gpu_blocks_at_least`` makes the slab that many blocks at least (the tables still name only some of them).
    ``flagged``: the probability that a state row is flagged resident (SPEC.md's ``resident``; the case then has
    that tensor, else none), every page of it given a block. Padding rows get any negative state row.
    """
    rng = random.Random(seed)
    HB = math.ceil(H / bs)
    gpu_blocks = max(1 + S * (P + HB), gpu_blocks_at_least)
    blocks = list(range(1, gpu_blocks))
    rng.shuffle(blocks)
    free = iter(blocks)
    host_blocks = min(2 * S * P, 1024)
    seq_lens = [P * bs if full_seq else rng.randint(bs, P * bs) for _ in range(S)]
    block_table = torch.zeros(S, P, dtype=torch.int32)
    host_table = torch.full((S, P), -1, dtype=torch.int32)
    hot_blocks = torch.zeros(S, HB, dtype=torch.int32)
    hot_pos = torch.full((S, G, H), -1, dtype=torch.int32)
    hot_stamp = torch.zeros(S, G, H, dtype=torch.int64)
    hot_clock = torch.zeros(S, G, dtype=torch.int64)
    resident_rows: list[int] = []
    for r in range(S):
        if rng.random() >= no_hot_region:
            hot_blocks[r] = torch.tensor([next(free) for _ in range(HB)], dtype=torch.int32)
        for page in range(P):
            if rng.random() < resident:
                block_table[r, page] = next(free)
            if rng.random() >= no_host:
                host_table[r, page] = rng.randrange(host_blocks)
        if flagged and rng.random() < flagged:
            resident_rows.append(r)
            for page in range(P):
                if block_table[r, page] == 0:
                    block_table[r, page] = next(free)
        for g in range(G):
            cached = rng.sample(range(seq_lens[r] + 8), min(int(hot_fill * H), seq_lens[r] + 8))
            for slot, pos in zip(rng.sample(range(H), len(cached)), cached, strict=True):
                hot_pos[r, g, slot] = pos
            hot_stamp[r, g], hot_clock[r, g] = random_stamps(rng, H)
        if hits_without_host is not None:
            for pos in hot_pos[r, hits_without_host].tolist():
                if 0 <= pos < P * bs:
                    host_table[r, pos // bs] = -1

    states = rng.sample(range(S), S)[: max(1, S // rows_per_state)]
    row_state = torch.tensor(
        [-rng.randint(1, 3) if rng.random() < padding else rng.choice(states) for _ in range(R)], dtype=torch.int32
    )
    topk = torch.full((R, K), -1, dtype=torch.int32)
    for i in range(R):
        r = int(row_state[i])
        n = seq_lens[r] if r >= 0 else 16
        if r >= 0 and hits_without_host is not None:
            cached = [p for p in hot_pos[r, hits_without_host].tolist() if 0 <= p < n]
            backed = [p for p in range(n) if host_table[r, p // bs] >= 0 or block_table[r, p // bs] != 0]
            pool = [rng.choice(cached if cached and rng.random() < 0.6 else backed or [0]) for _ in range(K)]
        elif from_hot and r >= 0:
            cached = [int(p) for p in hot_pos[r, 0] if 0 <= p < n] or [0]
            pool = [rng.choice(cached) for _ in range(K)]
        else:
            pool = [rng.randint(-2, n + 2) for _ in range(K)]
        for j in range(1, K):
            if rng.random() < dup:
                pool[j] = pool[rng.randrange(j)]
        topk[i] = torch.tensor(pool, dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    flags = {}
    if flagged:
        flags["resident"] = torch.zeros(S, dtype=torch.uint8)
        flags["resident"][resident_rows] = 1
    return {
        **flags,
        "topk": topk,
        "row_state": row_state,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_table": block_table,
        "host_table": host_table,
        "hot_blocks": hot_blocks,
        "hot_pos": hot_pos,
        "hot_stamp": hot_stamp,
        "hot_clock": hot_clock,
        "heat": torch.randint(0, 5, (S, P), dtype=torch.int32, generator=gen),
        "status": torch.zeros(S, dtype=torch.int32),
        "counters": torch.tensor([3, 4, 5], dtype=torch.int64),
        "gpu_layers": [torch.randint(0, 256, (gpu_blocks * bs, rb), dtype=torch.uint8, generator=gen)
                       for _ in range(L)],
        "host_layers": [torch.randint(0, 256, (host_blocks * bs, rb), dtype=torch.uint8, generator=gen)
                        for _ in range(L)],
        "block_size": bs,
    }


def stamp(clock: int, q_first: int) -> int:
    """SPEC.md's stamp of a slot of U: the region's clock after the step, then the first request index."""
    return (((clock << 32) | q_first) + 2**63) % 2**64 - 2**63  # as the i64 the kernel's u64 arithmetic gives


def random_stamps(rng: random.Random, H: int) -> tuple[torch.Tensor, int]:
    """An LRU of H slots as stamps and its clock. Every i64 is a legal stamp; four kinds of region: the stamps
    steps and invalidations leave (clock << 32 | q, several slots of one step, emptied slots below them), distinct
    stamps in random order (what a permutation gave), few values (ties everywhere, broken by slot), and the
    extremes of i64 among them."""
    kind = rng.randrange(4)
    clock = rng.randint(1, 40)
    if kind == 0:
        values = [stamp(rng.randint(0, clock), rng.randrange(4 * H)) if rng.random() < 0.8 else -rng.randint(0, 3)
                  for _ in range(H)]
    elif kind == 1:
        values = rng.sample(range(-H, 4 * H), H)
    elif kind == 2:
        values = [rng.randint(-1, 2) for _ in range(H)]
    else:
        values = [rng.choice([I64_MIN, I64_MAX, 0, -1, I64_MIN + 1, rng.randint(-5, 5)]) for _ in range(H)]
    return torch.tensor(values, dtype=torch.int64), clock


def cpu_copy(case: dict) -> dict:
    return {
        k: [t.clone() for t in v] if isinstance(v, list) else v.clone() if torch.is_tensor(v) else v
        for k, v in case.items()
    }


# ---------------------------------------------------------------------------------------------- corruptions


def _selected(case: dict, group: int) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """Per state row the batch selects: its selected (resident, hit, miss) positions in group ``group``."""
    bs = case["block_size"]
    P = case["block_table"].shape[1]
    out: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for i, r in enumerate(case["row_state"].tolist()):
        if r < 0:
            continue
        n = min(max(int(case["seq_lens"][r]), 0), P * bs)  # clamped as resolve clamps it (it may be corrupt)
        cached = set(case["hot_pos"][r, group].tolist())
        resident, hits, misses = out.setdefault(r, ([], [], []))
        for p in case["topk"][i].tolist():
            if 0 <= p < n:
                (resident if case["block_table"][r, p // bs] != 0 else hits if p in cached else misses).append(p)
    return out


def corrupt(case: dict, what: str, rng: random.Random, group: int) -> tuple[int, int] | None:
    """Breaks the state the way ``what`` names (SPEC.md's status bits 1, 4 and 8), where resolving ``group`` reads
    it: a selected page, the hot region of a request that uses it, a miss's host copy. The request is one that
    reaches the check: it selects what is broken and, for the hot state and host copies, uses a hot region it does
    not overflow. Returns (state row, the status bit the corruption must raise), or None when no request of the
    case qualifies (nothing changed). Bounds are drawn exactly half the time: an off-by-one check passes the rest.
    """
    S, P = case["block_table"].shape
    _, G, H = case["hot_pos"].shape
    bs = case["block_size"]
    HB = case["hot_blocks"].shape[1]
    gpu_blocks = case["gpu_layers"][0].shape[0] // bs
    host_blocks = case["host_layers"][0].shape[0] // bs

    def uses_hot_region(r: int, sel: tuple[list[int], list[int], list[int]]) -> bool:
        return 0 < len(set(sel[1] + sel[2])) <= H and int(case["hot_blocks"][r, 0]) != 0

    def qualifies(r: int, sel: tuple[list[int], list[int], list[int]]) -> bool:
        resident, hits, misses = sel
        if what == "seq_len":
            return True
        if what == "block":
            return bool(resident + misses)
        if what == "host_block":
            return bool(misses) and uses_hot_region(r, sel)
        if what in ("hot_block_twice", "hot_block_neighbours") and HB < 2:
            return False
        if what == "resident_flag":
            return bool(hits + misses)
        return uses_hot_region(r, sel) and H > 1

    candidates = sorted(r for r, sel in _selected(case, group).items() if qualifies(r, sel))
    if not candidates:
        return None
    r = rng.choice(candidates)
    resident, hits, misses = _selected(case, group)[r]
    exact = rng.random() < 0.5
    if what == "seq_len":
        case["seq_lens"][r] = rng.choice([P * bs + 1 if exact else P * bs + rng.randint(2, 3 * bs),
                                          -1 if exact else -rng.randint(2, 5)])
        return r, HS_BAD_TABLE
    if what == "block":
        pos = rng.choice(resident + misses)
        case["block_table"][r, pos // bs] = gpu_blocks if exact else rng.choice([gpu_blocks + 7, -1, -(2**31)])
        return r, HS_BAD_TABLE
    if what == "hot_block":
        b = rng.randrange(HB)
        value = gpu_blocks if exact else rng.choice([-3, 0])
        case["hot_blocks"][r, b] = value
        return r, HS_OVERFLOW if b == 0 and value == 0 else HS_BAD_HOT  # no hot region at all
    if what == "hot_block_twice":
        a, b = rng.sample(range(HB), 2)
        case["hot_blocks"][r, a] = case["hot_blocks"][r, b]
        return r, HS_BAD_HOT
    if what == "hot_block_neighbours":  # at the list's ends, or anywhere
        a, d = rng.choice([0, HB - 2, rng.randrange(HB - 1)]), rng.randrange(2)
        case["hot_blocks"][r, a + d] = case["hot_blocks"][r, a + 1 - d]
        return r, HS_BAD_HOT
    if what == "hot_pos_twice":
        pos = rng.choice(hits + misses)
        held = (case["hot_pos"][r, group] == pos).nonzero().flatten().tolist()
        for slot in rng.sample([s for s in range(H) if s not in held], 2 - min(len(held), 1)):
            case["hot_pos"][r, group, slot] = pos
        return r, HS_BAD_HOT
    if what == "resident_flag":  # flagged resident, yet selecting pages without a block (all of them, or one)
        flags = case.setdefault("resident", torch.zeros(S, dtype=torch.uint8))
        flags[r] = 1
        if exact:  # one page: the null block, or the bound of the resident path's check
            for page in range(P):
                if case["block_table"][r, page] == 0:
                    case["block_table"][r, page] = gpu_blocks - 1  # in the slab (read only: no write lands there)
            case["block_table"][r, rng.choice(hits + misses) // bs] = rng.choice([0, gpu_blocks])
        return r, HS_BAD_TABLE
    if what == "host_block":
        pos = rng.choice(misses)
        case["host_table"][r, pos // bs] = host_blocks if exact else host_blocks + rng.randint(1, 3)
        return r, HS_BAD_TABLE
    raise ValueError(f"unknown corruption {what!r}")


CORRUPTIONS = ("seq_len", "block", "hot_block", "hot_block_twice", "hot_block_neighbours",
               "hot_pos_twice", "host_block", "resident_flag")
HS_OVERFLOW, HS_NO_HOST_COPY, HS_BAD_TABLE, HS_BAD_HOT = 1, 2, 4, 8  # SPEC.md's status bits


# ---------------------------------------------------------------------------------------------- comparisons


class CudaBackend:
    """The same launches on a CUDA device: tensors on the device (host pools pinned), launches through ops."""

    def __init__(self, index: int = 0) -> None:
        self.device = torch.device("cuda", index)
        dev = ops._device(index)
        self.sm_count, self.max_smem = dev.sm_count, dev.max_smem
        # Launch records hold raw addresses (a layer table's, say): the tensors behind them must outlive the
        # launch, or torch's caching allocator hands their memory to the next tensor, as the CPU harness's
        # guarded buffers are kept until free().
        self._held: list[torch.Tensor] = []

    def tensor(self, like: torch.Tensor, host: bool = False) -> torch.Tensor:
        t = like.clone().pin_memory() if host else like.to(self.device)
        self._held.append(t)
        return t

    def run(self, launches, seed: int, preempt: float) -> None:
        ops._run(self.device.index, launches)
        torch.cuda.synchronize(self.device)

    def damaged(self) -> int:
        return 0  # no guard zones on the device; every byte of every tensor is compared instead

    def free(self) -> None:
        self._held.clear()


def _differ(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    got = got.cpu()
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero()
    first = tuple(bad[0].tolist())
    return (f"{name} differs at {len(bad)} places, first {first}: kernel {got[first].item()}, "
            f"reference {want[first].item()}")


def assert_same(got: dict, want: dict, keys) -> None:
    problems = []
    for k in keys:
        a, b = got[k], want[k]
        pairs = zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]
        for n, (x, y) in enumerate(pairs):
            msg = _differ(f"{k}[{n}]" if isinstance(a, list) else k, x, y)
            if msg:
                problems.append(msg)
    if problems:
        raise AssertionError("; ".join(problems))


def _assert_intact(h: Harness) -> None:
    damaged = h.damaged()
    if damaged:
        raise AssertionError(f"{damaged} buffers were written outside their bounds")


class Device:
    """A case's tensors in guarded harness buffers, with the layer table the kernels read."""

    def __init__(self, h: Harness, case: dict) -> None:
        self.h = h
        self.t = {k: [h.tensor(x, host=k == "host_layers") for x in v] if isinstance(v, list)
                  else h.tensor(v) if torch.is_tensor(v) else v for k, v in case.items()}

    def layers(self, which: slice) -> tuple[int, int, int, int]:
        """(table address, count, gpu rows, host rows) of the layers in ``which``."""
        gpu, host = self.t["gpu_layers"][which], self.t["host_layers"][which]
        table = self.h.tensor(torch.tensor([t.data_ptr() for t in [*gpu, *host]], dtype=torch.int64))
        return table.data_ptr(), len(gpu), gpu[0].shape[0], host[0].shape[0]


def run_resolve(h: Harness, case: dict, *, group: int, seed: int, preempt: float, rows_per_request: int = 1,
                max_smem: int = SMEM_SM90, resolve_layers: int | None = None,
                expect: list[tuple[int, int]] = ()) -> None:
    """resolve on the harness (the call's layers first, replay for the rest) against one reference resolve over
    every layer. ``expect``: (state row, status bit) pairs the reference must raise, so that a corruption that
    broke nothing the call reads cannot pass for a test of the kernels' checks."""
    R, K = case["topk"].shape
    S = case["block_table"].shape[0]
    ref = cpu_copy(case)
    ref["out"] = torch.zeros(R, K, dtype=torch.int32)
    # A state row past S is a bad argument: the kernel pads the row, the reference refuses the call.
    ref["row_state"] = torch.where(ref["row_state"] >= S, -1, ref["row_state"])
    resolve_reference(group=group, **ref)
    for row, bit in expect:
        if not int(ref["status"][row]) & bit:
            raise AssertionError(f"the case is vacuous: the reference did not raise status {bit} on state row {row} "
                                 f"(it has {int(ref['status'][row])})")

    dev = Device(h, case)
    t = dev.t
    gen = torch.Generator().manual_seed(seed)
    t["out"] = h.tensor(torch.full((R, K), 77, dtype=torch.int32))
    t["miss_plan"] = h.tensor(torch.randint(-5, 2**40, (R * K, 2), dtype=torch.int64, generator=gen))
    t["miss_count"] = h.tensor(torch.randint(-5, 5 * K, (R,), dtype=torch.int32, generator=gen))
    L = len(case["gpu_layers"])
    first = L if resolve_layers is None else resolve_layers
    max_smem = min(max_smem, h.max_smem)
    table, count, gpu_rows, host_rows = dev.layers(slice(0, first))
    state = {k: t[k] for k in ("topk", "row_state", "seq_lens", "block_table", "host_table", "hot_blocks",
                               *STATE_KEYS, "out", "miss_plan", "miss_count")}
    launches = ops.resolve_launches(**state, group=group, block_size=case["block_size"], layers=table,
                                    num_layers=count, row_bytes=case["gpu_layers"][0].shape[1], gpu_rows=gpu_rows,
                                    host_rows=host_rows, rows_per_request=rows_per_request, max_smem=max_smem,
                                    resident=t.get("resident"))
    if first < L:
        table, count, gpu_rows, host_rows = dev.layers(slice(first, L))
        launches += ops.replay_launches(miss_plan=t["miss_plan"], miss_count=t["miss_count"], layers=table,
                                        num_layers=count, row_bytes=case["gpu_layers"][0].shape[1],
                                        gpu_rows=gpu_rows, host_rows=host_rows, sm_count=h.sm_count)
    h.run(launches, seed, preempt)
    _assert_intact(h)
    misses = int(ref["counters"][1] - case["counters"][1])
    if int(t["miss_count"].clamp(0, K).sum()) != misses:
        raise AssertionError(f"miss_count sums to {int(t['miss_count'].sum())}, the reference missed {misses}")
    # The reference counted the bytes of every layer, the kernel those of the call's layers.
    ref["counters"][2] -= misses * case["gpu_layers"][0].shape[1] * (L - first)
    assert_same(t, ref, ("out", *STATE_KEYS, "gpu_layers", "host_layers"))
    for k in ("topk", "row_state", "seq_lens", "block_table", "host_table", "hot_blocks", "resident"):
        if k in case and not torch.equal(t[k].cpu(), case[k]):
            raise AssertionError(f"resolve wrote its input {k}")


def _buf(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


def run_invalidate(h: Harness, case: dict, pairs: torch.Tensor, *, seed: int, preempt: float) -> None:
    S, G, H = case["hot_pos"].shape
    want_pos, want_stamp = case["hot_pos"].clone(), case["hot_stamp"].clone()
    valid = pairs.clone()
    valid[valid[:, 0] >= S, 0] = -1  # past S: refused by the reference, skipped by the kernel
    geometry = (case["block_size"], case["block_table"].shape[1], H, G, 16)
    _core._ref_invalidate(geometry, _buf(want_pos), _buf(want_stamp), _buf(valid))
    got_pos, got_stamp, dev_pairs = h.tensor(case["hot_pos"]), h.tensor(case["hot_stamp"]), h.tensor(pairs)
    h.run(ops.invalidate_launches(pairs=dev_pairs, hot_pos=got_pos, hot_stamp=got_stamp), seed, preempt)
    _assert_intact(h)
    assert_same({"hot_pos": got_pos, "hot_stamp": got_stamp}, {"hot_pos": want_pos, "hot_stamp": want_stamp},
                ("hot_pos", "hot_stamp"))


def _unique_destinations(pairs: list[list[int]], column: int) -> list[list[int]]:
    seen, out = set(), []
    for p in pairs:
        if p[0] >= 0 and p[1] >= 0 and p[column] in seen:
            continue
        seen.add(p[column])
        out.append(p)
    return out


def run_copy(h: Harness, case: dict, pairs: torch.Tensor, *, unit: int, to_host: bool, seed: int,
             preempt: float) -> None:
    """copy_rows (unit 1) or copy_blocks; entries past the slab or pool are skipped by the kernel."""
    bs = case["block_size"]
    gpu_units = case["gpu_layers"][0].shape[0] // unit
    host_units = case["host_layers"][0].shape[0] // unit
    valid = pairs.clone().to(torch.int64)
    valid[(valid[:, 0] >= gpu_units) | (valid[:, 1] >= host_units)] = -1
    ref = cpu_copy(case)
    rb = case["gpu_layers"][0].shape[1]
    _core._ref_copy(_buf(valid), unit, rb, to_host, [_buf(t) for t in ref["gpu_layers"]],
                    [_buf(t) for t in ref["host_layers"]])
    dev = Device(h, case)
    table, count, gpu_rows, host_rows = dev.layers(slice(None))
    dev_pairs = h.tensor(pairs)
    common = dict(pairs=dev_pairs, layers=table, num_layers=count, row_bytes=rb, gpu_rows=gpu_rows,
                  host_rows=host_rows, to_host=to_host, sm_count=h.sm_count)
    if unit == 1:
        launches = ops.copy_rows_launches(**common)
    else:
        launches = ops.copy_blocks_launches(**common, block_size=bs)
    h.run(launches, seed, preempt)
    _assert_intact(h)
    assert_same(dev.t, ref, ("gpu_layers", "host_layers"))


def run_gather(h: Harness, case: dict, row_ids: torch.Tensor, *, seed: int, preempt: float) -> None:
    slab = case["gpu_layers"][0]
    rows, rb = slab.shape
    valid = torch.where(row_ids >= rows, -1, row_ids)  # past the slab: zeros from the kernel
    want = torch.empty(*row_ids.shape, rb, dtype=torch.uint8)
    _core._ref_gather(_buf(valid), _buf(slab), rb, _buf(want))
    dev_ids, dev_slab = h.tensor(row_ids), h.tensor(slab)
    got = h.tensor(torch.full((*row_ids.shape, rb), 0xEE, dtype=torch.uint8))
    h.run(ops.gather_launches(row_ids=dev_ids, slab=dev_slab, out=got, sm_count=h.sm_count), seed, preempt)
    _assert_intact(h)
    assert_same({"dense": got}, {"dense": want}, ("dense",))


def run_replay_plan(h: Harness, case: dict, plan: torch.Tensor, count: torch.Tensor, *, seed: int,
                    preempt: float) -> None:
    """replay of an arbitrary plan: counts clamped into 0..=K, pairs past the slab or pool skipped."""
    R = count.shape[0]
    K = plan.shape[0] // R
    gpu_rows, host_rows = case["gpu_layers"][0].shape[0], case["host_layers"][0].shape[0]
    pairs = []
    for i, c in enumerate(count.clamp(0, K).tolist()):
        for g, hst in plan[i * K: i * K + c].tolist():
            ok = 0 <= g < gpu_rows and 0 <= hst < host_rows
            pairs.append([g, hst] if ok else [-1, -1])
    valid = torch.tensor(_unique_destinations(pairs, 0) or [[-1, -1]], dtype=torch.int64)
    ref = cpu_copy(case)
    rb = case["gpu_layers"][0].shape[1]
    _core._ref_copy(_buf(valid), 1, rb, False, [_buf(t) for t in ref["gpu_layers"]],
                    [_buf(t) for t in ref["host_layers"]])
    dev = Device(h, case)
    table, n, gpu_rows, host_rows = dev.layers(slice(None))
    launches = ops.replay_launches(miss_plan=h.tensor(plan), miss_count=h.tensor(count), layers=table,
                                   num_layers=n, row_bytes=rb, gpu_rows=gpu_rows, host_rows=host_rows,
                                   sm_count=h.sm_count)
    h.run(launches, seed, preempt)
    _assert_intact(h)
    assert_same(dev.t, ref, ("gpu_layers", "host_layers"))


# ---------------------------------------------------------------------------------------------- case kinds

# One request of 4 rows selecting about 4,500 distinct positions, every one cached (and selected more than once,
# within and across rows): past MIN_TABLE's table, so the bucketed path's short path (everything hits).
WIDE_HIT = {"S": 1, "R": 4, "P": 1024, "H": 8192, "K": 2048, "from_hot": True, "hot_fill": 1.0, "resident": 0.0,
            "full_seq": True, "L": 1, "rb": 16, "G": 1}
RESOLVE_KINDS: dict[str, dict] = {
    "mixed": {},
    "duplicates": {"dup": 0.8},
    "padding_rows": {"padding": 0.4},
    "all_hit": {"from_hot": True, "hot_fill": 1.0, "resident": 0.0},
    "all_miss": {"hot_fill": 0.0, "resident": 0.0, "H": 512},
    "all_resident": {"resident": 1.0},
    "speculative": {"rows_per_state": 2, "R": 8, "H": 1024},
    "speculative_overflow": {"rows_per_state": 3, "R": 6, "H": 300, "K": 200, "hot_fill": 0.3, "resident": 0.1},
    "overflow": {"H": 16, "K": 200},
    "no_hot_region": {"no_hot_region": 1.0},
    "some_without_hot_region": {"no_hot_region": 0.5},
    "no_host_copy": {"no_host": 0.05, "H": 512},
    "hits_without_host": {"hits_without_host": 0, "H": 256, "hot_fill": 0.6, "resident": 0.2, "G": 1},
    "block_size_1": {"bs": 1, "P": 600, "H": 100},
    # rows of many 16-byte chunks: resolve's copies take several rounds (65 chunks), or a round per row (4,097)
    "wide_rows": {"rb": 1040, "H": 512, "hot_fill": 0.2, "resident": 0.1, "L": 2},
    "huge_rows": {"S": 1, "R": 2, "P": 8, "bs": 4, "H": 8, "K": 8, "rb": 65552, "L": 2, "hot_fill": 0.0,
                  "resident": 0.0},
    "decode_shape": {"S": 3, "R": 3, "P": 256, "bs": 64, "H": 4096, "K": 2048, "rb": 16, "L": 1, "G": 1},
    # hot regions of 32,768 rows (LRU passes of several rounds): all hits, and hits with misses
    "hit_only_h32768": {"S": 2, "R": 2, "P": 1024, "bs": 64, "H": 32768, "K": 2048, "rb": 16, "L": 1, "G": 1,
                        "from_hot": True, "hot_fill": 1.0, "resident": 0.0, "full_seq": True},
    "mixed_h32768": {"S": 1, "R": 2, "P": 1024, "bs": 64, "H": 32768, "K": 2048, "rb": 16, "L": 1, "G": 1,
                     "hot_fill": 0.6, "resident": 0.2, "full_seq": True},
    # more distinct positions than the hash table takes (3/4 of its smallest size, 4096 entries, which a GPU
    # short of shared memory leaves): bucketed first occurrences
    "wide_union": {"S": 1, "R": 4, "P": 1024, "H": 256, "K": 1024, "resident": 0.95, "dup": 0.0,
                   "full_seq": True, "L": 1, "rb": 16, "table": launch.MIN_TABLE},
    "wide_union_overflow": {"S": 1, "R": 4, "P": 1024, "H": 256, "K": 1024, "dup": 0.0, "full_seq": True,
                            "L": 1, "rb": 16, "table": launch.MIN_TABLE},
    # more selected elements than the hash table takes, but few enough distinct positions: counted inserts
    "wide_selection_overlapping": {"S": 1, "R": 4, "P": 1024, "H": 4096, "K": 1024, "resident": 0.3, "dup": 0.6,
                                   "full_seq": True, "hot_fill": 0.3, "L": 1, "rb": 16, "G": 1,
                                   "table": launch.MIN_TABLE},
    # ... and a U too large for the hash table that fits the hot region: bucketed lookups of U as well
    "wide_u": {"S": 1, "R": 4, "P": 1024, "H": 4096, "K": 1024, "resident": 0.0, "dup": 0.0, "full_seq": True,
               "hot_fill": 0.3, "L": 1, "rb": 16, "G": 1, "table": launch.MIN_TABLE},
    # requests flagged resident (SPEC.md) in one batch with requests that are not: the resident path, with
    # several rows per request, and past the table (the bucketed path keeps the flag's meaning)
    "resident_flag": {"flagged": 0.5},
    "resident_flag_speculative": {"flagged": 0.5, "rows_per_state": 2, "R": 8, "H": 1024, "dup": 0.5},
    "resident_flag_wide": {"S": 2, "R": 8, "P": 1024, "H": 256, "K": 1024, "resident": 0.9, "dup": 0.0,
                           "full_seq": True, "L": 1, "rb": 16, "table": launch.MIN_TABLE, "flagged": 0.5},
}
# Kinds resolved with a table sized for several rows per request (and, last, one clamped by a 99 KB GPU).
ROWS_PER_REQUEST = {"speculative": 2, "speculative_overflow": 3, "resident_flag_speculative": 2}
SIZED = {
    "hashed_4_rows": ({"S": 1, "R": 4, "P": 1024, "H": 4096, "K": 1024, "resident": 0.0, "dup": 0.0,
                       "full_seq": True, "hot_fill": 0.3, "L": 1, "rb": 16, "G": 1}, 4, SMEM_SM90),
    "clamped_5_rows": ({"S": 1, "R": 5, "P": 1024, "H": 10240, "K": 2048, "resident": 0.2, "dup": 0.2,
                        "full_seq": True, "hot_fill": 0.3, "L": 1, "rb": 16, "G": 1}, 5, SMEM_SM120),
}


def flag_resident(case: dict, r: int) -> None:
    """Flags state row ``r`` resident, giving each of its pages without a block a block no table names."""
    bs = case["block_size"]
    used = set(case["block_table"].flatten().tolist()) | set(case["hot_blocks"].flatten().tolist())
    free = (b for b in range(1, case["gpu_layers"][0].shape[0] // bs) if b not in used)
    row = case["block_table"][r]
    for page in (row == 0).nonzero().flatten().tolist():
        row[page] = next(free)
    case["resident"][r] = 1


def mix_flags(case: dict, rng: random.Random) -> None:
    """Makes a case's batch hold a request flagged resident and, when it has two requests, one that is not."""
    states = sorted({r for r in case["row_state"].tolist() if r >= 0})
    if not states:
        return
    flagged = rng.choice(states)
    flag_resident(case, flagged)
    others = [r for r in states if r != flagged]
    if others:
        case["resident"][rng.choice(others)] = 0


def table_smem(entries: int, case: dict) -> int:
    """The shared memory (bytes per CTA) that leaves resolve's table exactly ``entries`` entries for ``case``."""
    fixed = launch.resolve_fixed_bytes(hot_rows=case["hot_pos"].shape[2], batch_rows=case["topk"].shape[0])
    return launch.STATIC_SHARED["hisparse_resolve"] + 8 * entries + fixed


def _resolve_kind(params: dict, rows_per_request: int = 1, max_smem: int = SMEM_SM90, corruptions: int = 0):
    params = dict(params)
    table = params.pop("table", None)  # entries of resolve's table; else what max_smem leaves it

    def run(h: Harness, seed: int, preempt: float) -> None:
        rng = random.Random(seed)
        case = make_case(seed, **params)
        if "resident" in case:
            mix_flags(case, rng)
        smem = max_smem if table is None else table_smem(table, case)
        group = 0 if params.get("from_hot") or "hits_without_host" in params else seed % case["hot_pos"].shape[1]
        for _ in range(corruptions):
            corrupt(case, rng.choice(CORRUPTIONS), rng, group)
        run_resolve(h, case, group=group, seed=seed, preempt=preempt, rows_per_request=rows_per_request,
                    max_smem=smem)

    return run


def _corrupt_kind(what: str):
    def run(h: Harness, seed: int, preempt: float) -> None:
        rng = random.Random(seed)
        for attempt in range(100):  # a case with a request that reaches the check (most first cases have one)
            case = make_case(seed * 100 + attempt, S=3, R=4, H=256, K=96, P=24, bs=4, G=2, hot_fill=0.3,
                             resident=0.3, rows_per_state=rng.choice([1, 2]))
            group = rng.randrange(2)
            hit = corrupt(case, what, rng, group)
            if hit is not None:
                break
        else:
            raise AssertionError(f"no case to corrupt with {what} in 100 attempts")
        run_resolve(h, case, group=group, seed=seed, preempt=preempt, expect=[hit])

    return run


def _stamp_ties(kind: str):
    """The LRU's ties, which go by slot, where misses choose among them: ``fresh`` regions (every stamp 0, so the
    misses take slots 0, 1, ...), ``same_step`` regions (the stamps one step leaves: each slot of U stamped with
    the step's clock and its first request index, the rest older; a few values repeated, so that the |M| oldest
    end inside a run of equal stamps and the slots below it hold equal stamps too) and ``invalidated`` ones
    (resolve, invalidate some held positions, then resolve again: the emptied slots, all one stamp below the
    smallest, go first, by slot). Every request misses more positions than its region has slots at the oldest
    stamp, on every seed."""

    def run(h: Harness, seed: int, preempt: float) -> None:
        rng = random.Random(seed)
        H = rng.choice([24, 64, 200])
        case = make_case(seed, S=3, R=3, P=64, bs=4, G=1, H=H, K=H // 2 + 4, L=1, rb=16, resident=0.1, dup=0.2,
                         hot_fill=0.0 if kind == "fresh" else 0.4, full_seq=True)
        case["row_state"] = torch.tensor([0, 1, 2], dtype=torch.int32)
        if kind == "fresh":
            case["hot_stamp"].zero_()
            case["hot_clock"].zero_()
        elif kind == "same_step":
            for r in range(3):
                clock = rng.randint(1, 9)
                old = [stamp(clock - 1, rng.choice([0, 3, 7])) for _ in range(H)]
                step = sorted(rng.sample(range(2 * H), H // 3))
                for slot, q in zip(rng.sample(range(H), H // 3), step, strict=True):
                    old[slot] = stamp(clock, q)
                case["hot_stamp"][r, 0] = torch.tensor(old, dtype=torch.int64)
                case["hot_clock"][r, 0] = clock
        run_resolve(h, case, group=0, seed=seed, preempt=preempt)
        if kind != "invalidated":
            return
        # The state the first step left (checked equal just now), some held positions invalidated, a second step.
        ref = cpu_copy(case)
        ref["out"] = torch.zeros(case["topk"].shape, dtype=torch.int32)
        resolve_reference(group=0, **ref)
        case = {k: v for k, v in ref.items() if k != "out"}
        held = [(r, int(p)) for r in range(3) for p in case["hot_pos"][r, 0].tolist() if p >= 0]
        pairs = torch.tensor(rng.sample(held, max(1, len(held) // 3)), dtype=torch.int32)
        run_invalidate(h, case, pairs, seed=seed, preempt=preempt)
        geometry = (case["block_size"], case["block_table"].shape[1], H, 1, 16)
        _core._ref_invalidate(geometry, _buf(case["hot_pos"]), _buf(case["hot_stamp"]), _buf(pairs))
        n = case["block_table"].shape[1] * case["block_size"]
        case["topk"] = torch.tensor([[rng.randrange(n) for _ in range(case["topk"].shape[1])] for _ in range(3)],
                                    dtype=torch.int32)
        run_resolve(h, case, group=0, seed=seed + 1, preempt=preempt)

    return run


def _bad_state_rows(h: Harness, seed: int, preempt: float) -> None:
    """State rows past S and below -1 in row_state: padding rows to the kernel."""
    rng = random.Random(seed)
    case = make_case(seed, S=3, R=5, H=64, K=64)
    case["row_state"][rng.randrange(5)] = 3 + rng.randrange(5)
    case["row_state"][rng.randrange(5)] = -(2**31)
    run_resolve(h, case, group=0, seed=seed, preempt=preempt)


def _sequence(h: Harness, seed: int, preempt: float) -> None:
    """Steps that carry the hot state over, alternating groups, with invalidations between."""
    rng = random.Random(seed)
    case = make_case(seed, S=3, R=4, H=48, K=24, P=32, bs=4, hot_fill=0.3, full_seq=True)
    for step in range(4):
        R, K = case["topk"].shape
        lens = [int(case["seq_lens"][r]) if r >= 0 else 8 for r in case["row_state"].tolist()]
        case["topk"] = torch.tensor([[rng.randint(-1, n) for _ in range(K)] for n in lens], dtype=torch.int32)
        n = max(lens)
        ref = cpu_copy(case)
        ref["out"] = torch.zeros(R, K, dtype=torch.int32)
        run_resolve(h, case, group=step % 2, seed=seed * 10 + step, preempt=preempt)
        resolve_reference(group=step % 2, **ref)  # advance the state as the kernel did (just checked equal)
        case = {k: v for k, v in ref.items() if k != "out"}
        pairs = torch.tensor([[rng.randrange(-1, 3), rng.randint(-1, n)] for _ in range(rng.randint(1, 12))],
                             dtype=torch.int32)
        run_invalidate(h, case, pairs, seed=seed * 10 + step, preempt=preempt)
        geometry = (case["block_size"], case["block_table"].shape[1], 48, 2, 16)
        _core._ref_invalidate(geometry, _buf(case["hot_pos"]), _buf(case["hot_stamp"]), _buf(pairs))


def _replay_layers(h: Harness, seed: int, preempt: float) -> None:
    """resolve for layer 0, replay of its plan for layers 1 and 2 = one resolve over all three."""
    case = make_case(seed, L=3, H=64, K=100, rows_per_state=2, padding=0.2)
    run_resolve(h, case, group=seed % 2, seed=seed, preempt=preempt, resolve_layers=1)


def _replay_any_plan(h: Harness, seed: int, preempt: float) -> None:
    rng = random.Random(seed)
    case = make_case(seed, S=2, L=2, H=16, K=16, P=8, bs=4, R=3)
    R, K = 3, 16
    gpu_rows, host_rows = case["gpu_layers"][0].shape[0], case["host_layers"][0].shape[0]
    gpu = rng.sample(range(gpu_rows), R * K)  # destinations distinct, as a plan's are
    plan = torch.tensor([[g, rng.randrange(host_rows)] for g in gpu], dtype=torch.int64)
    for _ in range(4):  # never entry K: see below
        e = rng.choice([e for e in range(R * K) if e != K])
        plan[e, rng.randrange(2)] = rng.choice([-1, gpu_rows + 3, host_rows + 1, 2**40])
    plan[1, 0], plan[2, 1] = gpu_rows, host_rows  # the exact bounds, in entries that row 0 counts
    # Row 0 counts K + 1 (clamped to K) and row 1 none: a clamp to K + 1 would copy row 1's first pair (a valid
    # one). The last row's K + 9 would read past the plan.
    count = torch.tensor([K + 1, 0, rng.choice([-3, 0, 5, K, K + 9])], dtype=torch.int32)
    run_replay_plan(h, case, plan, count, seed=seed, preempt=preempt)


def _invalidate(corrupt_state: bool):
    def run(h: Harness, seed: int, preempt: float) -> None:
        rng = random.Random(seed)
        H = rng.choice([5, 33, 300, 2000])
        case = make_case(seed, S=3, G=2, H=H, hot_fill=0.8)
        known = [int(p) for p in case["hot_pos"][1, 0] if p >= 0]
        n = rng.choice([1, 7, 40, 2100])  # 2100: two passes of INVALIDATE_BATCH
        pairs = torch.tensor(
            [[rng.choice([-1, 0, 1, 2]), rng.choice([*known[:20], -1, 7, 7, 99999])] for _ in range(n)],
            dtype=torch.int32,
        )
        if corrupt_state:
            case["hot_pos"][1, 0, : min(3, H)] = known[0] if known else 5  # one position in several slots
            case["hot_stamp"][1, 1, 0] = I64_MIN  # the emptied slots' stamp saturates
            pairs[rng.randrange(n), 0] = 3 + rng.randrange(4)  # state rows past S: skipped
        run_invalidate(h, case, pairs, seed=seed, preempt=preempt)

    return run


def _copy(unit_blocks: bool):
    def run(h: Harness, seed: int, preempt: float) -> None:
        rng = random.Random(seed)
        case = make_case(seed, S=2, P=8, bs=4, H=8, L=3, rb=32)
        bs = case["block_size"]
        unit = bs if unit_blocks else 1
        gpu_units = case["gpu_layers"][0].shape[0] // unit
        host_units = case["host_layers"][0].shape[0] // unit
        to_host = rng.random() < 0.5
        n = rng.randint(1, min(gpu_units, host_units))
        dst = rng.sample(range(host_units if to_host else gpu_units), n)
        src = [rng.randrange(gpu_units if to_host else host_units) for _ in range(n)]
        pairs = [[s, d] if to_host else [d, s] for s, d in zip(src, dst, strict=True)]
        for p in rng.sample(range(n), min(n, 3)):
            pairs[p][rng.randrange(2)] = rng.choice([-1, -7, gpu_units + host_units])
        # Each side's exact bound (skipped, as every entry outside the slab or pool is), in a random place.
        for bound in ([gpu_units, rng.randrange(host_units)], [rng.randrange(gpu_units), host_units]):
            pairs.insert(rng.randint(0, len(pairs)), bound)
        dtype = torch.int32 if unit_blocks else torch.int64
        run_copy(h, case, torch.tensor(pairs, dtype=dtype), unit=unit, to_host=to_host, seed=seed, preempt=preempt)

    return run


def _small(seed: int, **changes) -> dict:
    """A tiny case: 4 requests of 8 full-length pages of 4 tokens, 8 hot rows (2 hot blocks), nothing cached or
    resident, one group and layer."""
    return make_case(seed, **{**dict(S=4, R=4, P=8, bs=4, G=1, H=8, K=8, L=1, rb=16, hot_fill=0.0, resident=0.0,
                                      dup=0.0, full_seq=True), **changes})


def _bounds_resolve(h: Harness, seed: int, preempt: float) -> None:
    """Every bound resolve checks, at its exact value, one per request (accepting it would change that request's
    outputs, status or bytes): a block_table entry == gpu_blocks, a hot block == gpu_blocks, a host block ==
    host_blocks, seq_len == P * bs + 1 and -1; every row selects position P * bs (== seq_len of the others); and a
    batch row names state row S (with S = 8 the index lands on the guard page after the 32-byte state vectors).
    Request 3 resolves as it is: the LRU has no bound to check (every stamp is legal)."""
    rng = random.Random(seed)
    case = _small(seed, S=8)
    gpu_blocks = case["gpu_layers"][0].shape[0] // 4
    host_blocks = case["host_layers"][0].shape[0] // 4
    case["row_state"] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8], dtype=torch.int32)
    case["topk"] = torch.tensor([[*rng.sample(range(8), 8), 32] for _ in range(8)], dtype=torch.int32)
    case["block_table"][0, 1] = gpu_blocks
    case["hot_blocks"][1, 1] = gpu_blocks
    case["host_table"][2, 0] = host_blocks
    case["seq_lens"][4] = 33
    case["seq_lens"][5] = -1
    run_resolve(h, case, group=0, seed=seed, preempt=preempt,
                expect=[(0, HS_BAD_TABLE), (1, HS_BAD_HOT), (2, HS_BAD_TABLE), (4, HS_BAD_TABLE), (5, HS_BAD_TABLE)])


def _bounds_invalidate(h: Harness, seed: int, preempt: float) -> None:
    """The smallest stamp there is (i64 min) in a region whose slot a pair empties: the emptied slot's stamp
    saturates there instead of wrapping round to the newest; and one above it, where the stamp is min - 1 = i64 min
    exactly."""
    rng = random.Random(seed)
    case = _small(seed, hot_fill=1.0)
    case["hot_stamp"][0, 0, rng.randrange(8)] = I64_MIN
    case["hot_stamp"][1, 0] = torch.full((8,), I64_MIN + 1, dtype=torch.int64)
    held = [int(p) for p in case["hot_pos"][0, 0] if p >= 0]
    held1 = [int(p) for p in case["hot_pos"][1, 0] if p >= 0]
    pairs = torch.tensor([[0, rng.choice(held)], [4, held[0]], [1, rng.choice(held1)]], dtype=torch.int32)
    run_invalidate(h, case, pairs, seed=seed, preempt=preempt)


def _hot_blocks_past_one_window(h: Harness, seed: int, preempt: float) -> None:
    """A slab of more GPU blocks than one window of resolve's hot-block bitmap (64 ids per table entry), and hot
    regions of more blocks than resolve checks pair by pair (HB_PAIRWISE = 256): every request's hot blocks come
    in pairs one window apart (one bit of the bitmap), and request 1 names a block of the second window twice,
    which must be flagged, as the pairs must not be."""
    rng = random.Random(seed)
    H = 320  # blocks of one row
    shape = dict(S=3, R=4, P=16, bs=1, G=1, H=H, K=16, L=1, rb=16, hot_fill=0.3, resident=0.0, dup=0.0,
                 full_seq=True)
    window = 64 * launch.resolve_shared(top_k=16, hot_rows=H, batch_rows=4, limit=SMEM_SM90).capacity
    case = make_case(seed, **shape, gpu_blocks_at_least=window + 3000)
    half = H // 2
    low = rng.sample(range(1, 3000), 3 * half)
    for r in range(3):
        case["hot_blocks"][r] = torch.tensor([b + w for b in low[half * r: half * r + half] for w in (0, window)],
                                             dtype=torch.int32)
    case["hot_blocks"][1, 5] = case["hot_blocks"][1, 3]  # odd entries lie in the second window
    case["row_state"][rng.randrange(4)] = 1  # request 1 resolves on every seed
    run_resolve(h, case, group=0, seed=seed, preempt=preempt, expect=[(1, HS_BAD_HOT)])


def _bucket_edges(variant: str):
    """The bucketed path (more distinct positions than resolve's table takes: MIN_TABLE entries, so buckets of at
    most 3/4 of that many positions, cut at the bins of the selection's 256-bin histogram) with a selected position
    on every bucket edge: each bin's first position and the one before it, so that a bucket that takes the position
    at its end, or skips the one at its start, changes the request's heat on every seed.

    ``small_u``: U small (every page resident but those of eight bin edges): bucketed first occurrences.
    ``large_u``: U past the table too (4,096 distinct misses and hits, H = 4,096), every edge cached in some slot:
    bucketed claims and lookups of U. ``heavy``: as ``large_u`` at 1M tokens, where a bin (4,096 positions) may
    hold more distinct positions than a bucket takes: one bin holds 3,300 selected positions and goes in ranges of
    3/4 of MIN_TABLE positions, the edge between them selected too."""

    def run(h: Harness, seed: int, preempt: float) -> None:
        rng = random.Random(seed)
        K = 1024
        bs, P = (256, 4096) if variant == "heavy" else (16, 4096)
        H = 256 if variant == "small_u" else 4096
        case = make_case(seed, S=1, R=4, P=P, bs=bs, G=1, H=H, K=K, L=1, rb=16, dup=0.0, full_seq=True,
                         hot_fill=0.3, resident=1.0 if variant == "small_u" else 0.0)
        length = P * bs
        width = 1 << max(0, (length - 1).bit_length() - 8)  # resolve's bins
        starts = list(range(width, length, width))
        edges = {*starts, *(b - 1 for b in starts)}
        if variant == "heavy":
            b, limit = rng.choice(starts[:-1]), launch.MIN_TABLE - launch.MIN_TABLE // 4
            edges |= {b + limit - 1, b + limit}
            inside = [x for x in range(b, b + width) if x not in edges]
            edges |= set(rng.sample(inside, 3300 - (width - len(inside))))
        picked = set(edges)
        while len(picked) < 4 * K:
            picked.add(rng.randrange(length))
        if variant == "small_u":
            for b in rng.sample(starts, 8):
                case["block_table"][0, b // bs] = 0
                case["block_table"][0, (b - 1) // bs] = 0
        else:
            cached = set(case["hot_pos"][0, 0].tolist())
            free = [s for s in range(H) if int(case["hot_pos"][0, 0, s]) not in edges]
            uncached = [x for x in sorted(edges) if x not in cached]
            for x, slot in zip(uncached, rng.sample(free, len(uncached)), strict=True):
                case["hot_pos"][0, 0, slot] = x
        case["row_state"] = torch.zeros(4, dtype=torch.int32)
        case["topk"] = torch.tensor(rng.sample(sorted(picked), 4 * K), dtype=torch.int32).view(4, K)
        run_resolve(h, case, group=0, seed=seed, preempt=preempt, max_smem=table_smem(launch.MIN_TABLE, case))

    return run


def _wide_hit(h: Harness, seed: int, preempt: float) -> None:
    """``WIDE_HIT``: the bucketed path's short path, everything hit; the request's rows after one or two padding
    rows, so that its request indices (the stamps' low halves) differ from its batch rows' element indices."""
    rng = random.Random(seed)
    pad = rng.randint(1, 2)
    case = make_case(seed, **{**WIDE_HIT, "R": 4 + pad})
    case["row_state"][:pad] = -1
    run_resolve(h, case, group=0, seed=seed, preempt=preempt, max_smem=table_smem(launch.MIN_TABLE, case))


def _wide_corrupt(what: str):
    """A corruption (``corrupt``) of a request on the bucketed path, whose phase A flags bad blocks and finds a
    position held by two slots itself."""

    def run(h: Harness, seed: int, preempt: float) -> None:
        rng = random.Random(seed)
        case = make_case(seed, **{**WIDE_HIT, "hot_fill": 0.5, "resident": 0.1, "from_hot": False})
        hit = corrupt(case, what, rng, 0)
        run_resolve(h, case, group=0, seed=seed, preempt=preempt, max_smem=table_smem(launch.MIN_TABLE, case),
                    expect=[hit])

    return run


def _resident_flag_barriers(h: Harness, seed: int, preempt: float) -> None:
    """The resident path is taken: in a batch of one-row requests, some flagged resident and some not (their
    selections reaching the hot region), each flagged request's CTA passes phase A's two barriers and no more, and
    every other CTA more (the hit path's three at least). Outputs alone cannot tell the resident path from the
    others, which give the same bytes. On a device, which counts nothing, only the bytes are compared."""
    rng = random.Random(seed)
    case = make_case(seed, S=6, R=6, flagged=0.5, H=256, K=200, hot_fill=0.6, resident=0.3)
    case["row_state"] = torch.tensor(rng.sample(range(6), 6), dtype=torch.int32)
    flags = case["resident"]
    flags[int(case["row_state"][0])] = 1  # both kinds of request, on every seed
    flags[int(case["row_state"][1])] = 0
    for r in (int(case["row_state"][0]),):
        case["block_table"][r][case["block_table"][r] == 0] = case["gpu_layers"][0].shape[0] // case["block_size"] - 1
    run_resolve(h, case, group=seed % 2, seed=seed, preempt=preempt)
    counts = dict(getattr(h, "counts", ()))
    if "hisparse_resolve" not in counts:
        return
    for cta in counts["hisparse_resolve"]:
        r = int(case["row_state"][cta.x])
        want = "== 2" if flags[r] else ">= 3"
        if (cta.barriers == 2) != bool(flags[r]) or cta.barriers < 2:
            raise AssertionError(f"the CTA of state row {r} (flagged {int(flags[r])}) passed {cta.barriers} barriers, "
                                 f"not {want}")


def _resident_flag_one_bad(h: Harness, seed: int, preempt: float) -> None:
    """Requests flagged resident whose selection holds one bad block (the null block, or one == gpu_blocks), on a
    page no other element selects, at an element that is never lane 0's: its warp alone must raise BAD_TABLE."""
    rng = random.Random(seed)
    case = _small(seed, flagged=1.0)  # every request flagged, every page with a block
    bs, P = case["block_size"], case["block_table"].shape[1]
    gpu_blocks = case["gpu_layers"][0].shape[0] // bs
    case["row_state"] = torch.tensor(rng.sample(range(4), 4), dtype=torch.int32)
    case["topk"] = torch.tensor([[page * bs + rng.randrange(bs) for page in rng.sample(range(P), P)]
                                 for _ in range(4)], dtype=torch.int32)
    for i, r in enumerate(case["row_state"].tolist()):
        page = int(case["topk"][i, rng.randrange(1, P)]) // bs
        case["block_table"][r, page] = rng.choice([0, gpu_blocks])
    run_resolve(h, case, group=0, seed=seed, preempt=preempt, expect=[(r, HS_BAD_TABLE) for r in range(4)])


def _gather(h: Harness, seed: int, preempt: float) -> None:
    rng = random.Random(seed)
    case = make_case(seed, S=1, P=8, bs=4, H=8, L=1, rb=rng.choice([16, 48, 656]))
    rows = case["gpu_layers"][0].shape[0]
    K = rng.randint(1, 70)
    row_ids = torch.tensor([[rng.randint(-3, rows + 2) for _ in range(K)] for _ in range(3)], dtype=torch.int32)
    run_gather(h, case, row_ids, seed=seed, preempt=preempt)


_ALL_KINDS: dict[str, Callable[[Harness, int, float], None]] = {
    **{k: _resolve_kind(p, ROWS_PER_REQUEST.get(k, 1)) for k, p in RESOLVE_KINDS.items()},
    **{k: _resolve_kind(p, n, smem) for k, (p, n, smem) in SIZED.items()},
    **{f"corrupt_{what}": _corrupt_kind(what) for what in CORRUPTIONS},
    "corrupt_many": _resolve_kind({"S": 4, "R": 6, "H": 256, "K": 80, "P": 20, "bs": 4, "rows_per_state": 2,
                                   "hot_fill": 0.3}, 2, corruptions=4),
    "stamp_ties_fresh": _stamp_ties("fresh"),
    "stamp_ties_same_step": _stamp_ties("same_step"),
    "stamp_ties_invalidated": _stamp_ties("invalidated"),
    "bounds_resolve": _bounds_resolve,
    "bounds_invalidate": _bounds_invalidate,
    "hot_blocks_past_one_window": _hot_blocks_past_one_window,
    "bucket_edges": _bucket_edges("small_u"),
    "bucket_edges_u": _bucket_edges("large_u"),
    "bucket_edges_heavy": _bucket_edges("heavy"),
    "wide_hit": _wide_hit,
    "wide_hot_pos_twice": _wide_corrupt("hot_pos_twice"),
    "wide_bad_block": _wide_corrupt("block"),
    "bad_state_rows": _bad_state_rows,
    "sequence": _sequence,
    "replay_layers": _replay_layers,
    "replay_any_plan": _replay_any_plan,
    "invalidate": _invalidate(False),
    "invalidate_corrupt": _invalidate(True),
    "copy_rows": _copy(False),
    "copy_blocks": _copy(True),
    "resident_flag_barriers": _resident_flag_barriers,
    "gather": _gather,
    "resident_flag_one_bad": _resident_flag_one_bad,
    # no_host_copy on the long path (hot regions past HB_PAIRWISE blocks), whose check 4 is a pass of its own (the
    # short paths' phase A2 checks as it goes)
    "no_host_copy_long": _resolve_kind({"no_host": 0.05, "H": 1100, "bs": 4, "P": 512, "hot_fill": 0.1}),
}
# The suite's order: first one kind for each part of the kernels (a mutant usually fails in these), then the rest.
FIRST = ("mixed", "sequence", "wide_u", "wide_union", "hits_without_host", "invalidate", "replay_layers",
         "speculative", "no_host_copy", "copy_rows", "copy_blocks", "gather")
KINDS = {k: _ALL_KINDS[k] for k in (*FIRST, *(k for k in _ALL_KINDS if k not in FIRST))}
# Kinds that take seconds on the harness; the suite runs them in its first round only.
SLOW = {"decode_shape", "clamped_5_rows", "hit_only_h32768", "mixed_h32768"}
