"""The CUDA kernels on a GPU against cuda/SPEC.md: every case kind of the CPU kernel harness (random, corrupt,
speculative, windowed, replay, invalidate, copies, gather) run through the same launch records on the device and
compared byte for byte with the Rust reference; then the public launchers (``ops.resolve`` and friends): their
checks, multi-step state, CUDA graph capture and replay. Tests marked ``gpu`` need a CUDA device and are skipped
without one.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("cuda.bindings")

from kernel_harness.cases import KINDS, STATE_KEYS, CudaBackend, assert_same, cpu_copy, make_case  # noqa: E402

from hisparse.datapath import resolve_reference  # noqa: E402
from hisparse.errors import InvalidArgumentError  # noqa: E402
from hisparse.kernels import launch, ops  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_harness_kind_matches_the_reference_on_the_gpu(kind, seed):
    KINDS[kind](CudaBackend(), 100 + seed, 0.0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("miss_plan", [True, False])
def test_the_public_launcher_matches_the_reference(miss_plan):
    case = make_case(3, H=256, K=200, rows_per_state=2, padding=0.2, no_host=0.02)
    R, K = case["topk"].shape
    ref, dev = cpu_copy(case), gpu_copy(case)
    ref["out"] = torch.zeros(R, K, dtype=torch.int32)
    dev["out"] = torch.full((R, K), 77, dtype=torch.int32, device="cuda")
    if miss_plan:
        dev["miss_plan"] = torch.zeros(R * K, 2, dtype=torch.int64, device="cuda")
        dev["miss_count"] = torch.zeros(R, dtype=torch.int32, device="cuda")
    resolve_reference(group=1, **ref)
    ops.resolve(group=1, rows_per_request=2, **dev)
    torch.cuda.synchronize()
    assert_same(dev, ref, ("out", *STATE_KEYS, "gpu_layers", "host_layers"))


@pytest.mark.gpu
@needs_gpu
def test_resolve_sequence_of_steps():
    case = make_case(11, H=64, K=96, rows_per_state=2)
    ref, dev = cpu_copy(case), gpu_copy(case)
    rng = random.Random(5)
    R, K = case["topk"].shape
    for step in range(6):
        topk = torch.tensor([[rng.randint(-1, 300) for _ in range(K)] for _ in range(R)], dtype=torch.int32)
        ref["topk"], dev["topk"] = topk, topk.cuda()
        ref["out"], dev["out"] = torch.zeros(R, K, dtype=torch.int32), torch.zeros(R, K, dtype=torch.int32).cuda()
        resolve_reference(group=step % 2, **ref)
        ops.resolve(group=step % 2, **dev)
        torch.cuda.synchronize()
        assert_same(dev, ref, ("out", *STATE_KEYS, "gpu_layers", "host_layers"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("miss_plan", [True, False])
def test_graph_replay_equals_eager(miss_plan):
    """Captured once (with the plan's scratch allocated inside the capture when the caller gives none), replayed
    with new top-K: every replay equals an eager call."""
    case = make_case(21, H=96, K=128, rows_per_state=2, padding=0.2)
    R, K = case["topk"].shape
    graphed, eager = gpu_copy(case), gpu_copy(case)
    for state in (graphed, eager):
        state["out"] = torch.zeros(R, K, dtype=torch.int32, device="cuda")
        if miss_plan:
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
    keys = (*STATE_KEYS, "out", "gpu_layers", "host_layers", *(("miss_count",) if miss_plan else ()))
    for _ in range(4):
        topk = torch.tensor([[rng.randint(-1, 400) for _ in range(K)] for _ in range(R)], dtype=torch.int32)
        graphed["topk"].copy_(topk)
        graph.replay()
        eager["topk"].copy_(topk)
        ops.resolve(group=1, **eager)
        torch.cuda.synchronize()
        assert_same(graphed, {k: [t.cpu() for t in v] if isinstance(v, list) else v.cpu() for k, v in eager.items()
                              if k in keys}, keys)
        if miss_plan:
            for i in range(R):  # miss_plan entries past miss_count[i] are unspecified
                n = int(eager["miss_count"][i])
                assert torch.equal(graphed["miss_plan"][i * K: i * K + n], eager["miss_plan"][i * K: i * K + n])


@pytest.mark.gpu
@needs_gpu
def test_replay_through_the_public_launcher():
    """Two layers sharing one indexer: resolve fills layer 0, replay layer 1; together they equal one resolve over
    both layers (whose counters also count layer 1's bytes)."""
    case = make_case(4, L=2, H=64, K=100, rows_per_state=2, padding=0.2)
    R, K = case["topk"].shape
    ref = cpu_copy(case)
    ref["out"] = torch.zeros(R, K, dtype=torch.int32)
    resolve_reference(group=0, **ref)
    dev = gpu_copy(case)
    plan = torch.zeros(R * K, 2, dtype=torch.int64, device="cuda")
    count = torch.zeros(R, dtype=torch.int32, device="cuda")
    out = torch.zeros(R, K, dtype=torch.int32, device="cuda")
    leader = {k: v for k, v in dev.items() if k not in ("gpu_layers", "host_layers")}
    ops.resolve(group=0, out=out, miss_plan=plan, miss_count=count, gpu_layers=dev["gpu_layers"][:1],
                host_layers=dev["host_layers"][:1], **leader)
    ops.replay(miss_plan=plan, miss_count=count, gpu_layers=dev["gpu_layers"][1:], host_layers=dev["host_layers"][1:])
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), ref["out"])
    assert_same(dev, ref, ("hot_pos", "hot_stamp", "hot_clock", "heat", "status", "gpu_layers", "host_layers"))
    misses = int(ref["counters"][1] - case["counters"][1])
    assert int(count.sum()) == misses
    assert int(dev["counters"][2]) == int(case["counters"][2]) + misses * case["gpu_layers"][0].shape[1]


def pinned_layers(L: int, rows: int, rb: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    gpu_layers = [torch.randint(0, 256, (rows, rb), dtype=torch.uint8, generator=g).cuda() for _ in range(L)]
    host_layers = [torch.randint(0, 256, (rows, rb), dtype=torch.uint8, generator=g).pin_memory() for _ in range(L)]
    return gpu_layers, host_layers


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("to_host", [True, False])
def test_copy_rows_and_blocks_through_the_launchers(to_host):
    bs = 8
    gpu_layers, host_layers = pinned_layers(2, 16 * bs, 48, 2)
    want_gpu = [t.cpu() for t in gpu_layers]
    want_host = [t.clone() for t in host_layers]
    rows = torch.tensor([[5, 9], [7, 0], [-1, 3], [63, -1], [0, 63]], dtype=torch.int64)
    blocks = torch.tensor([[1, 15], [3, 0], [-1, 4], [9, -2], [15, 7]], dtype=torch.int32)
    for layer in range(2):
        for unit, pairs in ((1, rows), (bs, blocks)):
            for g, h in pairs.tolist():
                if g >= 0 and h >= 0:
                    gs, hs = slice(g * unit, (g + 1) * unit), slice(h * unit, (h + 1) * unit)
                    if to_host:
                        want_host[layer][hs] = want_gpu[layer][gs]
                    else:
                        want_gpu[layer][gs] = want_host[layer][hs]
    ops.copy_rows(pairs=rows.cuda(), gpu_layers=gpu_layers, host_layers=host_layers, to_host=to_host)
    ops.copy_blocks(pairs=blocks.cuda(), gpu_layers=gpu_layers, host_layers=host_layers, block_size=bs, to_host=to_host)
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu_layers, want_gpu, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(host_layers, want_host, strict=True))


@pytest.mark.gpu
@needs_gpu
def test_gather_through_the_launcher():
    slab = torch.randint(0, 256, (100, 64), dtype=torch.uint8).cuda()
    row_ids = torch.randint(-3, 100, (5, 37), dtype=torch.int32).cuda()
    dense = ops.gather(row_ids=row_ids, slab=slab)
    want = torch.where((row_ids >= 0)[..., None], slab[row_ids.clamp(min=0).long()], 0)
    assert torch.equal(dense, want)
    with pytest.raises(ValueError, match="aligned"):
        ops.gather(row_ids=row_ids, slab=slab, out=torch.empty(5 * 37 * 64 + 1, dtype=torch.uint8,
                                                                device="cuda")[1:].view(5, 37, 64))


@pytest.mark.gpu
@needs_gpu
def test_resolve_rejects_bad_inputs():
    case = gpu_copy(make_case(0))
    R, K = case["topk"].shape
    case["out"] = torch.zeros(R, K, dtype=torch.int32, device="cuda")
    bad = [
        ("topk", case["topk"].long(), "dtype"),
        ("hot_stamp", case["hot_stamp"][:, :1], "shape"),
        ("hot_clock", case["hot_clock"].int(), "dtype"),
        ("heat", case["heat"].t().contiguous().t(), "contiguous"),
        ("host_layers", [t.clone() for t in case["host_layers"]], "pinned"),
        ("gpu_layers", [t[:, :40].contiguous() for t in case["gpu_layers"]], "multiple of 16"),
        ("gpu_layers", [case["gpu_layers"][0], case["gpu_layers"][1][:-16]], "shape"),
        ("group", 5, "group"),
        ("status", case["status"].cpu(), "cuda"),
        ("rows_per_request", 0, "rows_per_request"),
        ("out", case["topk"], "overlap"),
    ]
    for key, value, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):  # what the CPU reference raises
            ops.resolve(**{"group": 0, **case, key: value})


@pytest.mark.gpu
@needs_gpu
def test_an_empty_selection_resolves_as_on_the_cpu():
    """topk [R, 0] (and [0, K]): no state changes, no misses, as the CPU reference does (no ConfigError)."""
    case = make_case(2, H=64, K=32)
    R = case["topk"].shape[0]
    for shape in ((R, 0), (0, 32)):
        ref, dev = cpu_copy(case), gpu_copy(case)
        ref["topk"], dev["topk"] = torch.zeros(shape, dtype=torch.int32), torch.zeros(shape, dtype=torch.int32).cuda()
        ref["row_state"] = ref["row_state"][: shape[0]].clone()
        dev["row_state"] = dev["row_state"][: shape[0]].clone()
        ref["out"] = torch.zeros(shape, dtype=torch.int32)
        dev["out"] = torch.zeros(shape, dtype=torch.int32, device="cuda")
        dev["miss_plan"] = torch.zeros(0, 2, dtype=torch.int64, device="cuda")
        dev["miss_count"] = torch.full((shape[0],), 7, dtype=torch.int32, device="cuda")
        resolve_reference(group=0, **ref)
        ops.resolve(group=0, **dev)
        ops.replay(miss_plan=dev["miss_plan"], miss_count=dev["miss_count"], gpu_layers=dev["gpu_layers"],
                   host_layers=dev["host_layers"])
        torch.cuda.synchronize()
        assert_same(dev, ref, (*STATE_KEYS, "gpu_layers", "host_layers"))
        assert int(dev["miss_count"].abs().sum()) == 0


@pytest.mark.gpu
@needs_gpu
def test_the_device_limit_agrees_with_the_launch_arithmetic():
    dev = ops._device(0)
    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{major}{minor}"
    if arch in launch.SHARED_MEMORY_PER_BLOCK:
        assert dev.max_smem == launch.smem_limit(arch)


def test_launchers_reject_cpu_tensors():
    case = make_case(0, R=2, K=4)
    case["out"] = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA tensor"):
        ops.resolve(group=0, **case)
    with pytest.raises(ValueError, match="CUDA tensor"):
        ops.gather(row_ids=torch.zeros(2, 2, dtype=torch.int32), slab=torch.zeros(4, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="CUDA tensor"):
        ops.invalidate(pairs=torch.zeros(1, 2, dtype=torch.int32), hot_pos=case["hot_pos"], hot_stamp=case["hot_stamp"])
