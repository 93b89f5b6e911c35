"""The CUDA kernels against cuda/SPEC.md: resolve against the CPU reference, the others against small
models written here. Tests marked ``gpu`` need a CUDA device and are skipped without one."""

from __future__ import annotations

import math
import random

import pytest
import torch

pytest.importorskip("cuda.bindings")

from hisparse.kernels import ops  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STATE_KEYS = ("hot_pos", "hot_lru", "heat", "status", "counters")


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
) -> dict:
    """Random CPU state and inputs for resolve.

    Every hot region and resident page gets its own GPU block, so no two requests write one row.
    ``from_hot`` draws topk from what group 0 already caches (all hits when nothing is resident);
    ``full_seq`` makes every request P * bs tokens long.
    """
    rng = random.Random(seed)
    HB = math.ceil(H / bs)
    blocks = list(range(1, 1 + S * (P + HB)))
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

    states = rng.sample(range(S), S)[: max(1, S // rows_per_state)]
    row_state = torch.tensor(
        [-1 if rng.random() < padding else rng.choice(states) for _ in range(R)], dtype=torch.int32
    )
    topk = torch.full((R, K), -1, dtype=torch.int32)
    for i in range(R):
        r = int(row_state[i])
        n = seq_lens[r] if r >= 0 else 16
        if from_hot and r >= 0:
            cached = [int(p) for p in hot_pos[r, 0] if 0 <= p < n] or [0]
            pool = [rng.choice(cached) for _ in range(K)]
        else:
            pool = [rng.randint(-2, n + 2) for _ in range(K)]
        for j in range(1, K):
            if rng.random() < dup:
                pool[j] = pool[rng.randrange(j)]
        topk[i] = torch.tensor(pool, dtype=torch.int32)
    rows = 1 + S * (P + HB)
    return {
        "topk": topk,
        "row_state": row_state,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_table": block_table,
        "host_table": host_table,
        "hot_blocks": hot_blocks,
        "hot_pos": hot_pos,
        "hot_lru": hot_lru,
        "heat": torch.randint(0, 5, (S, P), dtype=torch.int32, generator=torch.Generator().manual_seed(seed)),
        "status": torch.zeros(S, dtype=torch.int32),
        "counters": torch.tensor([3, 4, 5], dtype=torch.int64),
        "gpu_layers": [torch.randint(0, 256, (rows * bs, rb), dtype=torch.uint8) for _ in range(L)],
        "host_layers": [torch.randint(0, 256, (host_blocks * bs, rb), dtype=torch.uint8) for _ in range(L)],
        "block_size": bs,
    }


def cpu_copy(case: dict) -> dict:
    return {
        k: [t.clone() for t in v] if isinstance(v, list) else v.clone() if torch.is_tensor(v) else v
        for k, v in case.items()
    }


def gpu_copy(case: dict) -> dict:
    out = {}
    for k, v in case.items():
        if k == "host_layers":
            out[k] = [t.clone().pin_memory() for t in v]
        elif isinstance(v, list):
            out[k] = [t.cuda() for t in v]
        else:
            out[k] = v.cuda() if torch.is_tensor(v) else v
    return out


def assert_same(got: dict, want: dict, keys=(*STATE_KEYS, "gpu_layers", "host_layers")) -> None:
    for k in keys:
        a, b = got[k], want[k]
        for n, (x, y) in enumerate(zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]):
            assert torch.equal(x.cpu(), y.cpu()), f"{k}{f'[{n}]' if isinstance(a, list) else ''} differs"


@pytest.fixture(scope="module")
def resolve_reference():
    from hisparse.datapath import resolve_reference

    return resolve_reference


def run_both(case: dict, group: int, resolve_reference) -> tuple[dict, dict]:
    """resolve on the GPU and in the reference from the same state; returns (gpu state, reference state)."""
    R, K = case["topk"].shape
    ref, dev = cpu_copy(case), gpu_copy(case)
    ref["out"] = torch.zeros(R, K, dtype=torch.int32)
    dev["out"] = torch.full((R, K), 77, dtype=torch.int32, device="cuda")
    resolve_reference(group=group, **ref)
    ops.resolve(group=group, **dev)
    torch.cuda.synchronize()
    return dev, ref


SCENARIOS = {
    "mixed": {},
    "duplicates": {"dup": 0.8},
    "padding_rows": {"padding": 0.4},
    "all_hit": {"from_hot": True, "hot_fill": 1.0, "resident": 0.0},
    "all_miss": {"hot_fill": 0.0, "resident": 0.0, "H": 512},
    "all_resident": {"resident": 1.0},
    "speculative": {"rows_per_state": 2, "R": 8, "H": 1024},
    "overflow": {"H": 16, "K": 200},
    "no_hot_region": {"no_hot_region": 1.0},
    "some_without_hot_region": {"no_hot_region": 0.5},
    "no_host_copy": {"no_host": 0.05, "H": 512},
    "block_size_1": {"bs": 1, "P": 600, "H": 100},
    "decode_shape": {"S": 8, "R": 8, "P": 512, "bs": 64, "H": 4096, "K": 2048, "rb": 656, "L": 1, "G": 1},
    # more distinct positions than resolve's hash table holds: the windowed path
    "wide_union": {
        "S": 1,
        "R": 3,
        "P": 1024,
        "H": 256,
        "K": 1024,
        "resident": 0.95,
        "dup": 0.0,
        "full_seq": True,
    },
    "wide_union_overflow": {"S": 1, "R": 3, "P": 1024, "H": 256, "K": 1024, "dup": 0.0, "full_seq": True},
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_resolve_matches_reference(scenario, seed, resolve_reference):
    params = SCENARIOS[scenario]
    case = make_case(seed, **params)
    group = 0 if params.get("from_hot") else seed % case["hot_pos"].shape[1]
    dev, ref = run_both(case, group, resolve_reference)
    assert torch.equal(dev["out"].cpu(), ref["out"])
    assert_same(dev, ref)


@pytest.mark.gpu
@needs_gpu
def test_resolve_sequence_of_steps(resolve_reference):
    case = make_case(11, H=64, K=96, rows_per_state=2)
    ref, dev = cpu_copy(case), gpu_copy(case)
    rng = random.Random(5)
    R, K = case["topk"].shape
    for step in range(6):
        topk = torch.tensor([[rng.randint(-1, 300) for _ in range(K)] for _ in range(R)], dtype=torch.int32)
        ref["topk"], dev["topk"] = topk, topk.cuda()
        ref["out"], dev["out"] = (
            torch.zeros(R, K, dtype=torch.int32),
            torch.zeros(R, K, dtype=torch.int32).cuda(),
        )
        resolve_reference(group=step % 2, **ref)
        ops.resolve(group=step % 2, **dev)
        torch.cuda.synchronize()
        assert torch.equal(dev["out"].cpu(), ref["out"]), f"step {step}"
        assert_same(dev, ref)


@pytest.mark.gpu
@needs_gpu
def test_graph_replay_equals_eager():
    case = make_case(21, H=96, K=128, rows_per_state=2, padding=0.2)
    R, K = case["topk"].shape
    graphed, eager = gpu_copy(case), gpu_copy(case)
    for state in (graphed, eager):
        state["out"] = torch.zeros(R, K, dtype=torch.int32, device="cuda")
        state["miss_plan"] = torch.zeros(R * K, 2, dtype=torch.int64, device="cuda")
        state["miss_count"] = torch.zeros(R, dtype=torch.int32, device="cuda")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the eager warm-up caches the layer table before capture
        ops.resolve(group=1, **graphed)
    torch.cuda.current_stream().wait_stream(side)
    ops.resolve(group=1, **eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.resolve(group=1, **graphed)

    rng = random.Random(3)
    for _ in range(4):
        topk = torch.tensor([[rng.randint(-1, 400) for _ in range(K)] for _ in range(R)], dtype=torch.int32)
        graphed["topk"].copy_(topk)
        graph.replay()
        eager["topk"].copy_(topk)
        ops.resolve(group=1, **eager)
        torch.cuda.synchronize()
        assert_same(graphed, eager, keys=(*STATE_KEYS, "out", "miss_count", "gpu_layers", "host_layers"))
        for i in range(R):  # miss_plan entries past miss_count[i] are unspecified
            n = int(eager["miss_count"][i])
            assert torch.equal(graphed["miss_plan"][i * K : i * K + n], eager["miss_plan"][i * K : i * K + n])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(3))
def test_replay_fills_a_second_layer(seed, resolve_reference):
    """Two layers sharing one indexer: resolve fills layer 0, replay layer 1; together they equal one
    resolve over both layers (whose counters also count layer 1's bytes)."""
    case = make_case(seed, L=2, H=64, K=100, rows_per_state=2, padding=0.2)
    R, K = case["topk"].shape
    ref = cpu_copy(case)
    ref["out"] = torch.zeros(R, K, dtype=torch.int32)
    resolve_reference(group=0, **ref)

    dev = gpu_copy(case)
    plan = torch.zeros(R * K, 2, dtype=torch.int64, device="cuda")
    count = torch.zeros(R, dtype=torch.int32, device="cuda")
    out = torch.zeros(R, K, dtype=torch.int32, device="cuda")
    leader = {k: v for k, v in dev.items() if k not in ("gpu_layers", "host_layers")}
    ops.resolve(
        group=0,
        out=out,
        miss_plan=plan,
        miss_count=count,
        gpu_layers=dev["gpu_layers"][:1],
        host_layers=dev["host_layers"][:1],
        **leader,
    )
    ops.replay(miss_plan=plan, miss_count=count, gpu_layers=dev["gpu_layers"][1:], host_layers=dev["host_layers"][1:])
    torch.cuda.synchronize()

    assert torch.equal(out.cpu(), ref["out"])
    assert_same(dev, ref, keys=("hot_pos", "hot_lru", "heat", "status", "gpu_layers", "host_layers"))
    misses = int(ref["counters"][1] - case["counters"][1])
    rb = case["gpu_layers"][0].shape[1]
    assert int(count.sum()) == misses
    assert dev["counters"][:2].cpu().tolist() == ref["counters"][:2].tolist()
    assert int(dev["counters"][2]) == int(case["counters"][2]) + misses * rb


def pinned_layers(L: int, rows: int, rb: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    gpu_layers = [torch.randint(0, 256, (rows, rb), dtype=torch.uint8, generator=g).cuda() for _ in range(L)]
    host_layers = [torch.randint(0, 256, (rows, rb), dtype=torch.uint8, generator=g).pin_memory() for _ in range(L)]
    return gpu_layers, host_layers


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("to_host", [True, False])
def test_copy_rows(to_host):
    gpu_layers, host_layers = pinned_layers(3, 64, 32, 1)
    pairs = torch.tensor([[5, 9], [7, 0], [-1, 3], [63, -1], [0, 63]], dtype=torch.int64)
    want_gpu = [t.cpu() for t in gpu_layers]
    want_host = [t.clone() for t in host_layers]
    for layer in range(3):
        for g, h in pairs.tolist():
            if g >= 0 and h >= 0:
                if to_host:
                    want_host[layer][h] = want_gpu[layer][g]
                else:
                    want_gpu[layer][g] = want_host[layer][h]
    ops.copy_rows(pairs=pairs.cuda(), gpu_layers=gpu_layers, host_layers=host_layers, to_host=to_host)
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu_layers, want_gpu, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(host_layers, want_host, strict=True))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("to_host", [True, False])
def test_copy_blocks(to_host):
    bs = 8
    gpu_layers, host_layers = pinned_layers(2, 16 * bs, 48, 2)
    pairs = torch.tensor([[1, 15], [3, 0], [-1, 4], [9, -2], [15, 7]], dtype=torch.int32)
    want_gpu = [t.cpu() for t in gpu_layers]
    want_host = [t.clone() for t in host_layers]
    for layer in range(2):
        for g, h in pairs.tolist():
            if g >= 0 and h >= 0:
                gs, hs = slice(g * bs, (g + 1) * bs), slice(h * bs, (h + 1) * bs)
                if to_host:
                    want_host[layer][hs] = want_gpu[layer][gs]
                else:
                    want_gpu[layer][gs] = want_host[layer][hs]
    ops.copy_blocks(pairs=pairs.cuda(), gpu_layers=gpu_layers, host_layers=host_layers, block_size=bs, to_host=to_host)
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu_layers, want_gpu, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(host_layers, want_host, strict=True))


@pytest.mark.gpu
@needs_gpu
def test_gather():
    slab = torch.randint(0, 256, (100, 64), dtype=torch.uint8).cuda()
    row_ids = torch.randint(-3, 100, (5, 37), dtype=torch.int32).cuda()
    dense = ops.gather(row_ids=row_ids, slab=slab)
    want = torch.where((row_ids >= 0)[..., None], slab[row_ids.clamp(min=0).long()], 0)
    assert torch.equal(dense, want)


def invalidate_model(pairs: torch.Tensor, hot_pos: torch.Tensor, hot_lru: torch.Tensor) -> None:
    for r in dict.fromkeys(int(s) for s in pairs[:, 0] if s >= 0):
        for g in range(hot_pos.shape[1]):
            emptied = []
            for s_row, pos in pairs.tolist():
                if s_row == r and pos >= 0:
                    found = (hot_pos[r, g] == pos).nonzero()
                    if len(found):
                        hot_pos[r, g, int(found[0])] = -1
                        emptied.append(int(found[0]))
            rest = [int(s) for s in hot_lru[r, g] if int(s) not in emptied]
            hot_lru[r, g] = torch.tensor(emptied + rest, dtype=torch.int32)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("H", [5, 300, 2000])
def test_invalidate(H):
    case = make_case(H, S=3, G=2, H=H, hot_fill=0.8)
    hot_pos, hot_lru = case["hot_pos"], case["hot_lru"]
    rng = random.Random(H)
    known = [int(p) for p in hot_pos[1, 0] if p >= 0]
    pairs = torch.tensor(
        [[rng.choice([-1, 0, 1, 2]), rng.choice([*known[:20], -1, 7, 7, 99999])] for _ in range(40)],
        dtype=torch.int32,
    )
    dev_pos, dev_lru = hot_pos.cuda(), hot_lru.cuda()
    invalidate_model(pairs, hot_pos, hot_lru)
    ops.invalidate(pairs=pairs.cuda(), hot_pos=dev_pos, hot_lru=dev_lru)
    assert torch.equal(dev_pos.cpu(), hot_pos)
    assert torch.equal(dev_lru.cpu(), hot_lru)


@pytest.mark.gpu
@needs_gpu
def test_resolve_rejects_bad_inputs():
    case = gpu_copy(make_case(0))
    R, K = case["topk"].shape
    case["out"] = torch.zeros(R, K, dtype=torch.int32, device="cuda")
    bad = [
        ("topk", case["topk"].long(), "dtype"),
        ("hot_lru", case["hot_lru"][:, :1], "shape"),
        ("heat", case["heat"].t().contiguous().t(), "contiguous"),
        ("host_layers", [t.clone() for t in case["host_layers"]], "pinned"),
        ("gpu_layers", [t[:, :40].contiguous() for t in case["gpu_layers"]], "multiple of 16"),
        ("group", 5, "group"),
        ("status", case["status"].cpu(), "cuda"),
    ]
    for key, value, message in bad:
        with pytest.raises(ValueError, match=message):
            ops.resolve(group=0, **{**case, key: value})


def test_launchers_reject_cpu_tensors():
    case = make_case(0, R=2, K=4)
    case["out"] = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA tensor"):
        ops.resolve(group=0, **case)
    with pytest.raises(ValueError, match="CUDA tensor"):
        ops.gather(row_ids=torch.zeros(2, 2, dtype=torch.int32), slab=torch.zeros(4, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="CUDA tensor"):
        ops.invalidate(pairs=torch.zeros(1, 2, dtype=torch.int32), hot_pos=case["hot_pos"], hot_lru=case["hot_lru"])


def test_resolve_shared_memory_budget():
    # decode shape: H = 4096 hot rows, top-K 2048, 128 batch rows fit the 99 KiB of sm_86 / sm_89
    log2c, smem = ops.resolve_shared_bytes(128, 2048, 4096)
    assert 1 << log2c == 8192
    assert smem <= 99 * 1024
