"""The coldest policy through the real hooks loop, the heat produced by the reference resolver (not injected)."""

import torch

from hisparse import Layout, _core
from hisparse.heat import HeatOptions
from hisparse.hooks import SchedulerHooks, WorkerHooks

BS, TOP_K = 16, 16


def build(num_gpu_blocks, heat_interval, heat_coldest):
    lay = Layout(num_gpu_blocks=num_gpu_blocks, num_host_blocks=400, block_size=BS, max_model_len=1024, max_running=4,
                 hot_rows=32, row_bytes=16)
    sched = SchedulerHooks(num_gpu_blocks=num_gpu_blocks, num_host_blocks=400, block_size=BS, max_model_len=1024,
                           max_running=4, top_k=TOP_K, hot_rows=32, page_bytes=lay.page_bytes, watermark=2,
                           policy="coldest")
    worker = WorkerHooks.build(lay, heat=HeatOptions(interval=heat_interval, coldest=heat_coldest))
    return sched, worker


def step(sched, worker, scheduled, select=None):
    s = sched.plan_step(scheduled)
    assert s.ok, s.missing_blocks
    worker.apply(s)
    if select is not None:
        rid, positions = select
        worker.resolve(torch.tensor([positions], dtype=torch.int32), [rid])
    sched.apply_results(worker.end_step())
    return s


def released(sched, rid):
    """Pages that left the GPU (released, or released and their block reused: host_only)."""
    return [i for i, st in enumerate(sched.manager.page_states(sched.core_id(rid))) if st in ("released", "host_only")]


# "a": 40 pages. The indexer selects page 0 (sinks) and pages 20..23 every step; every other page never.
HOT = [0, 20, 21, 22, 23]
POSITIONS = [p * BS + o for p in (0, 20, 21, 22, 23) for o in range(3)][:TOP_K]


def warm(sched, worker, interval):
    sched.admit("a", 40 * BS)
    step(sched, worker, [("a", 40 * BS)])
    for _ in range(2 * interval):  # copies complete, then heat summaries arrive
        step(sched, worker, [("a", 0)], ("a", POSITIONS))


def test_never_selected_pages_go_before_the_hot_ones_within_the_candidates():
    sched, worker = build(num_gpu_blocks=60, heat_interval=4, heat_coldest=64)
    warm(sched, worker, 4)
    sched.admit("b", 24 * BS)  # needs pages: 'a' must release some
    step(sched, worker, [("a", 0), ("b", 24 * BS)])
    rel = released(sched, "a")
    assert rel, "no pressure"
    assert not set(rel) & set(HOT), f"hot pages released: {rel}"


def test_more_releases_than_candidates_keep_the_hot_pages():
    """Fewer coldest pages (8) in the summary than pressure needs: the rest goes before the hottest, so page 0 (the
    sinks, selected every step, among the hottest) stays while never-selected pages go."""
    sched, worker = build(num_gpu_blocks=60, heat_interval=4, heat_coldest=8)
    warm(sched, worker, 4)
    sched.admit("b", 24 * BS)
    step(sched, worker, [("a", 0), ("b", 24 * BS)])
    rel = released(sched, "a")
    states = sched.manager.page_states(sched.core_id("a"))
    cold_resident = [p for p in range(36) if p not in HOT and states[p] == "clean"]
    assert len(rel) > 8  # more than the candidates
    assert not set(rel) & set(HOT), (f"hot pages {sorted(set(rel) & set(HOT))} released while never-selected "
                                     f"pages {cold_resident} stay on the GPU")


def test_the_first_summaries_come_early():
    """Summaries come at steps 1, 2, 4... before the first interval: the sinks are known hot by step 8."""
    sched, worker = build(num_gpu_blocks=60, heat_interval=32, heat_coldest=128)
    sched.admit("a", 40 * BS)
    step(sched, worker, [("a", 40 * BS)])
    for _ in range(8):
        step(sched, worker, [("a", 0)], ("a", POSITIONS))
    sched.admit("b", 24 * BS)
    step(sched, worker, [("a", 0), ("b", 24 * BS)])
    rel = released(sched, "a")
    assert rel
    assert 0 not in rel, f"the sink page, selected in every one of 8 steps, was released first: {rel}"


def test_decay_makes_long_ago_hot_pages_go_first_again():
    """Pages 20..23 are hot for a while, then never selected again while every other page is: after enough
    summaries (each halves the counts) they are the coldest and go first."""
    sched, worker = build(num_gpu_blocks=60, heat_interval=4, heat_coldest=64)
    sched.admit("a", 40 * BS)
    step(sched, worker, [("a", 40 * BS)])
    old_hot = [p * BS + o for p in (20, 21, 22, 23) for o in range(BS)]
    for _ in range(12):
        step(sched, worker, [("a", 0)], ("a", old_hot))
    others = [p * BS for p in range(40) if p not in (20, 21, 22, 23)]
    for _ in range(40):  # 10 summaries: 20..23 decay from ~128 to 0
        step(sched, worker, [("a", 0)], ("a", others))


    (_, ranking, _), = _core.decode_heat_summary(worker.dp.heat_summary(64))
    assert [page for _, page in ranking[:4]] == [20, 21, 22, 23], ranking[:8]
    sched.admit("b", 24 * BS)
    step(sched, worker, [("a", 0), ("b", 24 * BS)])
    assert {20, 21, 22, 23} <= set(released(sched, "a"))
