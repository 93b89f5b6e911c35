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

STATE_KEYS = ("hot_pos", "hot_lru", "heat", "status", "counters")
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
) -> dict:
    """Random CPU state and inputs for resolve.

    Every hot region and resident page gets its own GPU block, so no two requests write one row; the slab and the
    pool have exactly the blocks the tables may name. ``from_hot`` draws topk from what group 0 already caches
    (all hits when nothing is resident); ``full_seq`` makes every request P * bs tokens long;
    ``hits_without_host = g`` takes the host copy from every page that group g caches and selects from cached
    positions and pages with a host copy only: the request succeeds only if no hit is mistaken for a miss.
    Padding rows get any negative state row.
    """
    rng = random.Random(seed)
    HB = math.ceil(H / bs)
    gpu_blocks = 1 + S * (P + HB)
    blocks = list(range(1, gpu_blocks))
    rng.shuffle(blocks)
    free = iter(blocks)
    host_blocks = min(2 * S * P, 1024)
    seq_lens = [P * bs if full_seq else rng.randint(bs, P * bs) for _ in range(S)]
    block_table = torch.zeros(S, P, dtype=torch.int32)
    host_table = torch.full((S, P), -1, dtype=torch.int32)
    hot_blocks = torch.zeros(S, HB, dtype=torch.int32)
    hot_pos = torch.full((S, G, H), -1, dtype=torch.int32)
    hot_lru = torch.zeros(S, G, H, dtype=torch.int32)
    for r in range(S):
        if rng.random() >= no_hot_region:
            hot_blocks[r] = torch.tensor([next(free) for _ in range(HB)], dtype=torch.int32)
        for page in range(P):
            if rng.random() < resident:
                block_table[r, page] = next(free)
            if rng.random() >= no_host:
                host_table[r, page] = rng.randrange(host_blocks)
        for g in range(G):
            cached = rng.sample(range(seq_lens[r] + 8), min(int(hot_fill * H), seq_lens[r] + 8))
            for slot, pos in zip(rng.sample(range(H), len(cached)), cached, strict=True):
                hot_pos[r, g, slot] = pos
            hot_lru[r, g] = torch.randperm(H, generator=torch.Generator().manual_seed(seed * 131 + r * 7 + g))
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
    return {
        "topk": topk,
        "row_state": row_state,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_table": block_table,
        "host_table": host_table,
        "hot_blocks": hot_blocks,
        "hot_pos": hot_pos,
        "hot_lru": hot_lru,
        "heat": torch.randint(0, 5, (S, P), dtype=torch.int32, generator=gen),
        "status": torch.zeros(S, dtype=torch.int32),
        "counters": torch.tensor([3, 4, 5], dtype=torch.int64),
        "gpu_layers": [torch.randint(0, 256, (gpu_blocks * bs, rb), dtype=torch.uint8, generator=gen)
                       for _ in range(L)],
        "host_layers": [torch.randint(0, 256, (host_blocks * bs, rb), dtype=torch.uint8, generator=gen)
                        for _ in range(L)],
        "block_size": bs,
    }


def cpu_copy(case: dict) -> dict:
    return {
        k: [t.clone() for t in v] if isinstance(v, list) else v.clone() if torch.is_tensor(v) else v
        for k, v in case.items()
    }


# ---------------------------------------------------------------------------------------------- corruptions


def _selected(case: dict, group: int) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """Per state row the batch selects: its selected (resident, hit, miss) positions in group ``group``."""
    bs = case["block_size"]
    out: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for i, r in enumerate(case["row_state"].tolist()):
        if r < 0:
            continue
        n = int(case["seq_lens"][r])
        cached = set(case["hot_pos"][r, group].tolist())
        resident, hits, misses = out.setdefault(r, ([], [], []))
        for p in case["topk"][i].tolist():
            if 0 <= p < n:
                (resident if case["block_table"][r, p // bs] != 0 else hits if p in cached else misses).append(p)
    return out


def corrupt(case: dict, what: str, rng: random.Random, group: int) -> None:
    """Breaks the state the way ``what`` names (SPEC.md's status bits 4 and 8), where resolving ``group`` reads
    it: a selected page, the hot region of a request that uses it, a miss's host copy."""
    S, P = case["block_table"].shape
    _, G, H = case["hot_pos"].shape
    bs = case["block_size"]
    gpu_blocks = case["gpu_layers"][0].shape[0] // bs
    host_blocks = case["host_layers"][0].shape[0] // bs
    selected = _selected(case, group)
    if not selected:
        return
    r = rng.choice(sorted(selected))
    resident, hits, misses = selected[r]
    if what == "seq_len":
        case["seq_lens"][r] = rng.choice([P * bs + rng.randint(1, 3 * bs), -rng.randint(1, 5)])
    elif what == "block" and resident + misses:
        pos = rng.choice(resident + misses)
        case["block_table"][r, pos // bs] = rng.choice([gpu_blocks, gpu_blocks + 7, -1, -(2**31)])
    elif what == "hot_block":
        case["hot_blocks"][r, rng.randrange(case["hot_blocks"].shape[1])] = rng.choice([gpu_blocks, -3, 0])
    elif what == "lru_range":
        case["hot_lru"][r, group, rng.randrange(H)] = rng.choice([H, H + 5, -2, 2**30])
    elif what == "lru_twice" and H > 1:
        a, b = rng.sample(range(H), 2)
        case["hot_lru"][r, group, a] = case["hot_lru"][r, group, b]
    elif what == "hot_pos_twice" and hits + misses and H > 1:
        pos = rng.choice(hits + misses)
        held = (case["hot_pos"][r, group] == pos).nonzero().flatten().tolist()
        for slot in rng.sample([s for s in range(H) if s not in held], 2 - min(len(held), 1)):
            case["hot_pos"][r, group, slot] = pos
    elif what == "host_block" and misses:
        pos = rng.choice(misses)
        case["host_table"][r, pos // bs] = host_blocks + rng.randint(0, 3)


CORRUPTIONS = ("seq_len", "block", "hot_block", "lru_range", "lru_twice", "hot_pos_twice", "host_block")


# ---------------------------------------------------------------------------------------------- comparisons


class CudaBackend:
    """The same launches on a CUDA device: tensors on the device (host pools pinned), launches through ops."""

    def __init__(self, index: int = 0) -> None:
        self.device = torch.device("cuda", index)
        dev = ops._device(index)
        self.sm_count, self.max_smem = dev.sm_count, dev.max_smem

    def tensor(self, like: torch.Tensor, host: bool = False) -> torch.Tensor:
        return like.clone().pin_memory() if host else like.to(self.device)

    def run(self, launches, seed: int, preempt: float) -> None:
        ops._run(self.device.index, launches)
        torch.cuda.synchronize(self.device)

    def damaged(self) -> int:
        return 0  # no guard zones on the device; every byte of every tensor is compared instead

    def free(self) -> None:
        pass


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
                max_smem: int = SMEM_SM90, resolve_layers: int | None = None) -> None:
    """resolve on the harness (the call's layers first, replay for the rest) against one reference resolve over
    every layer."""
    R, K = case["topk"].shape
    S = case["block_table"].shape[0]
    ref = cpu_copy(case)
    ref["out"] = torch.zeros(R, K, dtype=torch.int32)
    # A state row past S is a bad argument: the kernel pads the row, the reference refuses the call.
    ref["row_state"] = torch.where(ref["row_state"] >= S, -1, ref["row_state"])
    resolve_reference(group=group, **ref)

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
                                    sm_count=h.sm_count)
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
    for k in ("topk", "row_state", "seq_lens", "block_table", "host_table", "hot_blocks"):
        if not torch.equal(t[k].cpu(), case[k]):
            raise AssertionError(f"resolve wrote its input {k}")


def _buf(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


def run_invalidate(h: Harness, case: dict, pairs: torch.Tensor, *, seed: int, preempt: float) -> None:
    S, G, H = case["hot_pos"].shape
    want_pos, want_lru = case["hot_pos"].clone(), case["hot_lru"].clone()
    valid = pairs.clone()
    valid[valid[:, 0] >= S, 0] = -1  # past S: refused by the reference, skipped by the kernel
    geometry = (case["block_size"], case["block_table"].shape[1], H, G, 16)
    _core._ref_invalidate(geometry, _buf(want_pos), _buf(want_lru), _buf(valid))
    got_pos, got_lru, dev_pairs = h.tensor(case["hot_pos"]), h.tensor(case["hot_lru"]), h.tensor(pairs)
    h.run(ops.invalidate_launches(pairs=dev_pairs, hot_pos=got_pos, hot_lru=got_lru), seed, preempt)
    _assert_intact(h)
    assert_same({"hot_pos": got_pos, "hot_lru": got_lru}, {"hot_pos": want_pos, "hot_lru": want_lru},
                ("hot_pos", "hot_lru"))


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
    "decode_shape": {"S": 3, "R": 3, "P": 256, "bs": 64, "H": 4096, "K": 2048, "rb": 16, "L": 1, "G": 1},
    # more distinct positions than the hash table takes (3/4 of 4096): windowed first occurrences
    "wide_union": {"S": 1, "R": 4, "P": 1024, "H": 256, "K": 1024, "resident": 0.95, "dup": 0.0,
                   "full_seq": True, "L": 1, "rb": 16},
    "wide_union_overflow": {"S": 1, "R": 4, "P": 1024, "H": 256, "K": 1024, "dup": 0.0, "full_seq": True,
                            "L": 1, "rb": 16},
    # more selected elements than the hash table takes, but few enough distinct positions: counted inserts
    "wide_selection_overlapping": {"S": 1, "R": 4, "P": 1024, "H": 4096, "K": 1024, "resident": 0.3, "dup": 0.6,
                                   "full_seq": True, "hot_fill": 0.3, "L": 1, "rb": 16, "G": 1},
    # ... and a U too large for the hash table that fits the hot region: windowed lookups of U as well
    "wide_u": {"S": 1, "R": 4, "P": 1024, "H": 4096, "K": 1024, "resident": 0.0, "dup": 0.0, "full_seq": True,
               "hot_fill": 0.3, "L": 1, "rb": 16, "G": 1},
}
# Kinds resolved with a table sized for several rows per request (and, last, one clamped by a 99 KB GPU).
ROWS_PER_REQUEST = {"speculative": 2, "speculative_overflow": 3}
SIZED = {
    "hashed_4_rows": ({"S": 1, "R": 4, "P": 1024, "H": 4096, "K": 1024, "resident": 0.0, "dup": 0.0,
                       "full_seq": True, "hot_fill": 0.3, "L": 1, "rb": 16, "G": 1}, 4, SMEM_SM90),
    "clamped_5_rows": ({"S": 1, "R": 5, "P": 1024, "H": 10240, "K": 2048, "resident": 0.2, "dup": 0.2,
                        "full_seq": True, "hot_fill": 0.3, "L": 1, "rb": 16, "G": 1}, 5, SMEM_SM120),
}


def _resolve_kind(params: dict, rows_per_request: int = 1, max_smem: int = SMEM_SM90, corruptions: int = 0):
    def run(h: Harness, seed: int, preempt: float) -> None:
        rng = random.Random(seed)
        case = make_case(seed, **params)
        group = 0 if params.get("from_hot") or "hits_without_host" in params else seed % case["hot_pos"].shape[1]
        for _ in range(corruptions):
            corrupt(case, rng.choice(CORRUPTIONS), rng, group)
        run_resolve(h, case, group=group, seed=seed, preempt=preempt, rows_per_request=rows_per_request,
                    max_smem=max_smem)

    return run


def _corrupt_kind(what: str):
    def run(h: Harness, seed: int, preempt: float) -> None:
        rng = random.Random(seed)
        case = make_case(seed, S=3, R=4, H=256, K=96, P=24, bs=4, G=2, hot_fill=0.3, resident=0.3,
                         rows_per_state=rng.choice([1, 2]))
        group = rng.randrange(2)
        corrupt(case, what, rng, group)
        run_resolve(h, case, group=group, seed=seed, preempt=preempt)

    return run


def _lru_13_of_8(h: Harness, seed: int, preempt: float) -> None:
    """The issue's demonstration: one LRU entry of 13 in an 8-slot region must not let request 0 write request
    1's hot_pos or hot block."""
    case = make_case(seed, S=2, R=2, H=8, K=8, P=8, bs=4, G=1, hot_fill=0.0, resident=0.0, dup=0.0)
    case["row_state"] = torch.tensor([0, 1], dtype=torch.int32)
    case["hot_lru"][0, 0, 3] = 13
    run_resolve(h, case, group=0, seed=seed, preempt=preempt)


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
        _core._ref_invalidate(geometry, _buf(case["hot_pos"]), _buf(case["hot_lru"]), _buf(pairs))


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
    for _ in range(4):
        plan[rng.randrange(R * K), rng.randrange(2)] = rng.choice([-1, gpu_rows + 3, host_rows, 2**40])
    count = torch.tensor([rng.choice([-3, 0, 5, K, K + 9]) for _ in range(R)], dtype=torch.int32)
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
            case["hot_lru"][1, 1, 0] = case["hot_lru"][1, 1, H - 1]  # not a permutation: left alone
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
        dtype = torch.int32 if unit_blocks else torch.int64
        run_copy(h, case, torch.tensor(pairs, dtype=dtype), unit=unit, to_host=to_host, seed=seed, preempt=preempt)

    return run


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
    "lru_13_of_8": _lru_13_of_8,
    "bad_state_rows": _bad_state_rows,
    "sequence": _sequence,
    "replay_layers": _replay_layers,
    "replay_any_plan": _replay_any_plan,
    "invalidate": _invalidate(False),
    "invalidate_corrupt": _invalidate(True),
    "copy_rows": _copy(False),
    "copy_blocks": _copy(True),
    "gather": _gather,
}
# The suite's order: first one kind for each part of the kernels (a mutant usually fails in these), then the rest.
FIRST = ("mixed", "sequence", "wide_u", "wide_union", "hits_without_host", "invalidate", "replay_layers",
         "speculative", "no_host_copy", "copy_rows", "copy_blocks", "gather")
KINDS = {k: _ALL_KINDS[k] for k in (*FIRST, *(k for k in _ALL_KINDS if k not in FIRST))}
# Kinds that take seconds on the harness; the suite runs them in its first round only.
SLOW = {"decode_shape", "clamped_5_rows"}
