"""The worker's step path on a GPU never waits for the device, and reads back what the CPU path reads.

``torch.cuda.set_sync_debug_mode("error")`` turns any host-device synchronization into an error: the
worker's apply, resolve, gather and end_step run under it, step after step, heat summaries and late copies
included. Skipped without a CUDA device (``benches/gpu_check.sh`` runs these on a lent GPU).
"""

import pytest
import torch

from hisparse import Layout
from hisparse.heat import HeatOptions
from hisparse.hooks import SchedulerHooks, WorkerHooks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYOUT = Layout(num_gpu_blocks=32, num_host_blocks=400, block_size=8, max_model_len=256, max_running=4,
                hot_rows=32, row_bytes=32, layer_groups=(0, 0, 1))


def content(rid: str, positions: torch.Tensor, layer: int) -> torch.Tensor:
    seed = sum(map(ord, rid)) * 1009 + positions.to(torch.int64) * 31 + layer * 7
    return ((seed[:, None] + torch.arange(LAYOUT.row_bytes)[None, :] * 13) % 251).to(torch.uint8)


def hooks(device: str) -> tuple[SchedulerHooks, WorkerHooks]:
    sched = SchedulerHooks(num_gpu_blocks=LAYOUT.num_gpu_blocks, num_host_blocks=LAYOUT.num_host_blocks,
                           block_size=LAYOUT.block_size, max_model_len=LAYOUT.max_model_len,
                           max_running=LAYOUT.max_running, top_k=16, hot_rows=LAYOUT.hot_rows,
                           num_index_groups=LAYOUT.num_groups, page_bytes=LAYOUT.page_bytes)
    return sched, WorkerHooks.build(LAYOUT, device, heat=HeatOptions(interval=4))


def run(device: str, sync_free: bool) -> list[torch.Tensor]:
    """Three requests under pressure; every step writes, resolves every group and gathers every layer. Returns
    what each step's gathers read (on the host)."""
    sched, worker = hooks(device)
    ids = ["a", "b", "c"]
    for rid in ids:
        sched.admit(rid, 60, max_len=140)
    reads = []
    gen = torch.Generator().manual_seed(0)
    for i in range(40):
        step = sched.plan_step([(rid, 20 if i < 3 else 1) for rid in ids])
        assert step.ok
        topk = []
        for r in step.requests:
            topk.append(torch.randperm(r.seq_len, generator=gen)[:16].to(torch.int32))
        topk = torch.stack(topk).to(device)
        rows = torch.tensor([r.row for r in step.requests], dtype=torch.int32).to(device)
        kv = {(r.request_id, layer): content(r.request_id, torch.arange(r.start, r.seq_len), layer).to(device)
              for r in step.requests for layer in range(LAYOUT.num_layers)}
        if sync_free:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            worker.apply(step)
            for r in step.requests:
                positions = torch.arange(r.start, r.seq_len)  # on the host: checking them costs no wait
                for layer in range(LAYOUT.num_layers):
                    worker.write(r.request_id, positions, layer, kv[r.request_id, layer])
            dense = []
            for group in range(LAYOUT.num_groups):
                row_ids = worker.resolve(topk, rows, group)
                dense += [worker.gather(row_ids, layer) for layer in LAYOUT.layers_of(group)]
            results = worker.end_step()
        finally:
            if sync_free:
                torch.cuda.set_sync_debug_mode("default")
        reads.append(torch.stack(dense).cpu())
        sched.apply_results(results)
    assert any(sched.request_info(r)["residency"] != "full" for r in ids), "no pressure: a weak test"
    return reads


def test_the_step_path_never_waits_for_the_device_and_reads_what_the_cpu_reads():
    on_gpu = run("cuda", sync_free=True)
    on_cpu = run("cpu", sync_free=False)
    for step, (g, c) in enumerate(zip(on_gpu, on_cpu, strict=True)):
        assert torch.equal(g, c), f"step {step}: the GPU read other bytes than the CPU reference"
