"""The vLLM worker's selection heat on a CUDA device (skipped without one). Needs torch, not vLLM: it runs in
``benches/gpu_check.sh`` on a device without vLLM. What a GPU adds to ``test_vllm_plugin.py``: the count runs
inside a captured CUDA graph, on a copy stream, as it does inside vLLM's, and a whole step (begin, count, end)
never waits for the device, while its reports equal the CPU's.

    python -m pytest -q -m gpu tests/test_vllm_heat_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from hisparse import _core
from hisparse.heat import HeatOptions
from hisparse.integrations.vllm.heat import SelectionHeat

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROWS, PAGES, BLOCK, TOP_K = 8, 96, 64, 256


def _pair(**options):
    """The same SelectionHeat on the CPU and on the device."""
    gen = torch.Generator().manual_seed(1)
    residency = (torch.rand(ROWS, PAGES, generator=gen) < 0.8).to(torch.int32)
    heat = HeatOptions(**{"interval": 4, "coldest": 16, "hottest": 8, **options})
    return (SelectionHeat(residency, BLOCK, tail_pages=2, options=heat),
            SelectionHeat(residency.cuda(), BLOCK, tail_pages=2, options=heat))


def _inputs(step: int, tokens: int = 12):
    gen = torch.Generator().manual_seed(100 + step)
    topk = torch.randint(-1, PAGES * BLOCK, (tokens, TOP_K), generator=gen, dtype=torch.int32)
    batch_rows = torch.arange(tokens, dtype=torch.int32) % 5
    batch_rows[-2:] = -1  # CUDA-graph padding rows
    return topk, batch_rows


def test_count_is_captured_in_a_cuda_graph_and_replays_what_the_cpu_counts():
    cpu, gpu = _pair()
    state_rows = torch.tensor([6, 1, 3, -1, 0, -1, -1, -1], dtype=torch.int32)
    topk, batch_rows = _inputs(0)
    static = (topk.cuda(), batch_rows.cuda(), state_rows.cuda())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as torch asks before a capture
        gpu.count(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.count(*static)
    gpu.heat.zero_()
    for step in range(3):
        topk, batch_rows = _inputs(step)
        static[0].copy_(topk)
        static[1].copy_(batch_rows)
        graph.replay()
        cpu.count(topk, batch_rows, state_rows)
    torch.cuda.synchronize()
    assert torch.equal(gpu.heat.cpu(), cpu.heat)
    assert int(cpu.heat.sum()) > 0


def test_count_on_a_copy_stream_is_captured_as_vllms_leader_resolves():
    """Where vLLM counts: its leader runtime resolves on the index group's copy stream, which waits on the compute
    stream, after masking CUDA-graph padding rows (mapped to request 0) to -1 by a device-side row count, and the
    compute stream waits on the copy stream before attention (``runtime.py``, ``_resolve_and_stage_group``);
    ``_CountingRuntime`` counts right after the resolve, on that stream. The same pattern captured in a CUDA graph
    (vLLM's own resolve needs its compiled ops, and this file runs without vLLM) counts what the CPU counts."""
    cpu, gpu = _pair()
    state_rows = torch.tensor([2, 5, 0, 7, 4, -1, -1, -1], dtype=torch.int32)
    tokens = 12
    static = {"topk": torch.full((tokens, TOP_K), -1, dtype=torch.int32, device="cuda"),
              "rows": torch.zeros(tokens, dtype=torch.int32, device="cuda"),
              "valid": torch.zeros((), dtype=torch.int32, device="cuda")}
    request_ids = torch.empty(tokens, dtype=torch.int32, device="cuda")
    row_index = torch.arange(tokens, device="cuda")
    state_dev = state_rows.cuda()
    copy_stream = torch.cuda.Stream()

    def forward():
        compute = torch.cuda.current_stream()
        copy_stream.wait_stream(compute)
        with torch.cuda.stream(copy_stream):
            request_ids.copy_(static["rows"])
            request_ids.masked_fill_(row_index >= static["valid"], -1)
            gpu.count(static["topk"], request_ids, state_dev)
        compute.wait_stream(copy_stream)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # warm-up, then captured
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    torch.cuda.synchronize()
    gpu.heat.zero_()
    for step, valid in enumerate((tokens - 2, 7, tokens)):
        topk, batch_rows = _inputs(10 + step, tokens)
        batch_rows[batch_rows < 0] = 0  # vLLM's padding rows point at request 0 until masked
        static["topk"].copy_(topk)
        static["rows"].copy_(batch_rows)
        static["valid"].fill_(valid)
        graph.replay()
        masked = torch.where(torch.arange(tokens) >= valid, -1, batch_rows)
        cpu.count(topk, masked, state_rows)
    torch.cuda.synchronize()
    assert torch.equal(gpu.heat.cpu(), cpu.heat)
    assert int(cpu.heat.sum()) > 0


def _update(pages: int):
    """A stand-in for vLLM's ``SparseKVResidencyUpdate`` (only ``pages`` is read)."""
    from types import SimpleNamespace

    return SimpleNamespace(pages=list(range(pages)))


def test_a_step_never_waits_for_the_device_and_reports_what_the_cpu_reports():
    cpu, gpu = _pair()
    ids = [f"r{i}" for i in range(5)]
    state_rows = torch.tensor([6, 1, 3, 2, 0], dtype=torch.int32)
    updates = {rid: _update(40 + 10 * i) for i, rid in enumerate(ids)}
    reports: dict[str, list] = {"cpu": [], "gpu": []}
    for step in range(1, 9):
        topk, batch_rows = _inputs(step)
        cpu.begin_step(ids, state_rows, updates if step == 1 else {})
        cpu.count(topk, batch_rows, state_rows)
        reports["cpu"].append(cpu.end_step())
        dev = (topk.cuda(), batch_rows.cuda(), state_rows.cuda())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host-device synchronization below raises
        try:
            gpu.begin_step(ids, dev[2], updates if step == 1 else {})
            gpu.count(*dev)
            reports["gpu"].append(gpu.end_step())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Summaries start at steps 1, 2, 4 and 8; the device's arrive at a later end_step (or the same one).
    sent = {k: [r for r in v if r is not None] for k, v in reports.items()}
    assert len(sent["cpu"]) == 4 and 1 <= len(sent["gpu"]) <= 4
    # Each device report is one of the CPU's, in order (a newer one that arrived with it replaces it).
    decoded = [_core.decode_heat_summary(r.summary) for r in sent["cpu"]]
    at = 0
    for report in sent["gpu"]:
        assert report.request_ids == tuple(ids)
        at = decoded.index(_core.decode_heat_summary(report.summary), at) + 1
    torch.cuda.synchronize()
    assert torch.equal(gpu.heat.cpu(), cpu.heat)
