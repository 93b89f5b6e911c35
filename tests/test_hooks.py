"""The engine hooks: string ids, the per-step call order (refused clearly when wrong), and a byte-checked loop."""

import dataclasses
import itertools
import pickle

import pytest
import torch

from hisparse import CapacityError, DataPath, HiSparseError, InvalidArgumentError, Layout, UnknownRequestError, _core
from hisparse.heat import HeatOptions
from hisparse.hooks import CallOrderError, SchedulerHooks, StepGapError, StepResults, WorkerHooks, WorkerStep

LAYOUT = Layout(num_gpu_blocks=40, num_host_blocks=200, block_size=8, max_model_len=256, max_running=4,
                hot_rows=32, row_bytes=32, layer_groups=(0, 0, 1))


def pair(layout=LAYOUT, heat_interval=32, **kw):
    sched = SchedulerHooks(num_gpu_blocks=layout.num_gpu_blocks, num_host_blocks=layout.num_host_blocks,
                           block_size=layout.block_size, max_model_len=layout.max_model_len,
                           max_running=layout.max_running, top_k=16, hot_rows=layout.hot_rows,
                           num_index_groups=layout.num_groups, page_bytes=layout.page_bytes, **kw)
    return sched, WorkerHooks.build(layout, heat=HeatOptions(interval=heat_interval))


def content(rid: str, positions: torch.Tensor, layer: int) -> torch.Tensor:
    seed = sum(map(ord, rid)) * 1009 + positions.to(torch.int64) * 31 + layer * 7
    return ((seed[:, None] + torch.arange(LAYOUT.row_bytes)[None, :] * 13) % 251).to(torch.uint8)


def run_step(sched, worker, scheduled):
    step = sched.plan_step(scheduled)
    assert step.ok
    worker.apply(step)
    for r in step.requests:
        pos = torch.arange(r.start, r.seq_len)
        for layer in range(LAYOUT.num_layers):
            worker.write(r.request_id, pos, layer, content(r.request_id, pos, layer))
    sched.apply_results(worker.end_step())
    return step


def test_call_order_errors_are_clear_and_change_nothing():
    sched, worker = pair()
    assert issubclass(CallOrderError, HiSparseError) and issubclass(CallOrderError, InvalidArgumentError)
    sched.admit("a", 20)
    topk = torch.zeros(1, 16, dtype=torch.int32)
    with pytest.raises(CallOrderError, match=r"resolve\(\) outside a step: apply\(\) the plan of step 1 first"):
        worker.resolve(topk, ["a"])
    with pytest.raises(CallOrderError, match="end_step"):
        worker.end_step()
    step = sched.plan_step([("a", 20)])
    assert step.step == 1 and step.ok
    with pytest.raises(CallOrderError, match=r"plan_step\(\) called again before the worker's results of step 1"):
        sched.plan_step([("a", 1)])
    with pytest.raises(CallOrderError, match="no step is waiting|step 1 is waiting"):
        sched.apply_results(StepResults(step=2))
    worker.apply(step)
    with pytest.raises(CallOrderError, match="while step 1 is in its forward"):
        worker.apply(step)
    row_ids = worker.resolve(torch.arange(16, dtype=torch.int32)[None], ["a"])
    assert bool((row_ids >= 0).all())
    results = worker.end_step()
    with pytest.raises(CallOrderError, match="the plan of step 1 was applied already"):
        worker.apply(step)
    with pytest.raises(CallOrderError, match=r"resolve\(\) outside a step"):
        worker.resolve(topk, ["a"])
    sched.apply_results(results)
    with pytest.raises(CallOrderError, match="no step is waiting"):
        sched.apply_results(results)
    # The right order still works after all those refusals.
    step2 = sched.plan_step([("a", 1)])
    step3_never = WorkerStep(step2.step + 1, step2.plan, step2.request_ids)
    with pytest.raises(CallOrderError, match="skips step 2"):
        worker.apply(step3_never)
    worker.apply(step2)
    sched.apply_results(worker.end_step())
    assert sched.metrics()["steps"] == 2


def test_a_short_plan_needs_no_results_and_cannot_be_applied():
    layout = Layout(num_gpu_blocks=24, num_host_blocks=200, block_size=8, max_model_len=256, max_running=4,
                    hot_rows=16, row_bytes=32, layer_groups=(0,))
    sched, worker = pair(layout)
    sched.admit("big", 200)
    short = sched.plan_step([("big", 200)])
    assert not short.ok and short.missing_blocks > 0 and short.step == 0
    with pytest.raises(CallOrderError, match="short plan"):
        worker.apply(short)
    assert sched.awaiting_results is None
    step = sched.plan_step([("big", 64)])  # a smaller chunk fits; no results were owed for the short plan
    assert step.ok and step.step == 1
    worker.apply(step)
    sched.apply_results(worker.end_step())
    assert sched.metrics()["short_plans"] == 1


def test_string_ids_map_to_core_ids():
    sched, _ = pair()
    a = sched.admit("req-a", 10)
    assert a.row >= 0 and "req-a" in sched
    with pytest.raises(InvalidArgumentError, match="strings"):
        sched.admit(7, 10)
    with pytest.raises(InvalidArgumentError, match="already admitted"):
        sched.admit("req-a", 10)
    with pytest.raises(UnknownRequestError, match="req-b"):
        sched.preempt("req-b")
    first = sched.core_id("req-a")
    assert sched.request_id(first) == "req-a"
    sched.finish("req-a")
    assert "req-a" not in sched
    sched.admit("req-a", 10)
    assert sched.core_id("req-a") != first  # ids are never reused
    for i in range(3):
        sched.admit(f"fill-{i}", 10)
    with pytest.raises(CapacityError) as err:
        sched.admit("one-too-many", 10)
    assert err.value.resource == "slots" and "one-too-many" not in sched


def test_a_loop_reads_back_every_byte_through_the_hooks():
    sched, worker = pair(heat_interval=1)
    ids = ["a", "b", "c"]
    for rid in ids:
        sched.admit(rid, 60, max_len=120)
    for _ in range(3):
        run_step(sched, worker, [(rid, 20) for rid in ids])
    for _ in range(30):
        run_step(sched, worker, [(rid, 1) for rid in ids])
        cap = sched.capacity()
        assert cap["running"] == 3
    # Pressure moved someone to mixed residency: its cold pages are read through the hot region.
    assert any(sched.request_info(r)["residency"] != "full" for r in ids)
    step = run_step(sched, worker, [(rid, 1) for rid in ids])
    worker.apply(sched.plan_step([(rid, 1) for rid in ids]))
    for rid in ids:
        seq_len = sched.request_info(rid)["seq_len"]
        for start in range(0, seq_len - 1, 16):
            pos = torch.arange(start, min(start + 16, seq_len - 1), dtype=torch.int32)
            topk = torch.full((1, 16), -1, dtype=torch.int32)
            topk[0, : len(pos)] = pos
            for group in range(LAYOUT.num_groups):
                row_ids = worker.resolve(topk, [rid], group)
                for layer in LAYOUT.layers_of(group):
                    dense = worker.gather(row_ids, layer)[0, : len(pos)]
                    assert torch.equal(dense, content(rid, pos, layer)), (rid, start, layer)
    results = worker.end_step()
    assert results.step == step.step + 1
    summary = {rid: cold for rid, cold, _ in _core.decode_heat_summary(results.heat)}
    assert set(summary) == {sched.core_id(rid) for rid in ids}  # every running request is ranked
    sched.apply_results(results)
    m = sched.metrics()
    assert m["misses"] > 0 and m["hits"] >= 0 and m["h2d_bytes"] > 0 and m["transitions"] > 0
    assert 0.0 <= m["hit_rate"] <= 1.0
    assert "running 3" in sched.capacity_log()
    kept = sched.preempt("b")
    assert kept > 0 and sched.request_info("b")["row"] is None
    a = sched.resume("b")
    assert a.cached_tokens == kept
    for rid in ids:
        sched.finish(rid)
    assert sched.capacity()["running"] == 0


def test_worker_refuses_wrong_writes_and_unknown_requests():
    sched, worker = pair()
    sched.admit("a", 20)
    step = sched.plan_step([("a", 20)])
    worker.apply(step)
    with pytest.raises(InvalidArgumentError, match="writes positions 0..19"):
        worker.token_rows("a", torch.tensor([20]))
    with pytest.raises(UnknownRequestError):
        worker.token_rows("zzz", torch.tensor([0]))
    with pytest.raises(InvalidArgumentError, match="uint8"):
        worker.write("a", torch.arange(2), 0, torch.zeros(2, LAYOUT.row_bytes))
    with pytest.raises(InvalidArgumentError, match="group"):
        worker.resolve(torch.zeros(1, 16, dtype=torch.int32), ["a"], group=5)
    sched.apply_results(worker.end_step())


def test_register_uses_the_engines_tensors():
    gpu = torch.zeros(LAYOUT.num_layers, LAYOUT.num_gpu_blocks * LAYOUT.block_size, LAYOUT.row_bytes,
                      dtype=torch.uint8)
    host = torch.zeros(LAYOUT.num_layers, LAYOUT.num_host_blocks * LAYOUT.block_size, LAYOUT.row_bytes,
                       dtype=torch.uint8)
    worker = WorkerHooks.register(LAYOUT, gpu, host)
    assert worker.dp.gpu is gpu and worker.dp.host is host and worker.layout == LAYOUT
    with pytest.raises(InvalidArgumentError, match="shape"):
        WorkerHooks.register(LAYOUT, gpu[:, :8], host)
    with pytest.raises(InvalidArgumentError, match="uint8"):
        WorkerHooks.register(LAYOUT, gpu.float(), host)
    sched, _ = pair()
    sched.admit("a", 24)
    worker.apply(sched.plan_step([("a", 24)]))
    pos = torch.arange(24)
    worker.write("a", pos, 2, content("a", pos, 2))
    rows = worker.token_rows("a", pos)
    assert torch.equal(gpu[2, rows], content("a", pos, 2))
    sched.apply_results(worker.end_step())


def test_what_crosses_between_the_halves_pickles():
    sched, worker = pair(heat_interval=1)
    sched.admit("a", 40)
    step = pickle.loads(pickle.dumps(sched.plan_step([("a", 40)])))
    assert step.request("a").row == sched.request_info("a")["row"] and step.requests[0].seq_len == 40
    worker.apply(step)
    results = pickle.loads(pickle.dumps(worker.end_step()))
    sched.apply_results(results)
    step = sched.plan_step([("a", 1)])  # copies the five complete pages (40 tokens of 8) to the host
    assert len(step.plan.transfer_ids) == 5
    same = pickle.loads(pickle.dumps(step))
    assert same.plan == step.plan and same.plan.to_bytes() == step.plan.to_bytes()
    worker.apply(same)
    sched.apply_results(pickle.loads(pickle.dumps(worker.end_step())))
    assert sched.capacity()["pending_transfers"] == 0


def test_results_and_steps_stay_with_the_scheduler_that_planned_them():
    # Two schedulers alike plan alike steps: same numbers, same transfer ids. Results of one's step handed to
    # the other would mark pages it never had copied as saved on the host.
    (a, worker_a), (b, worker_b) = pair(), pair()
    for sched in (a, b):
        sched.admit("r", 40)
    run_step(a, worker_a, [("r", 40)])
    run_step(b, worker_b, [("r", 40)])
    step_a, step_b = a.plan_step([("r", 1)]), b.plan_step([("r", 1)])
    assert step_a.plan.transfer_ids == step_b.plan.transfer_ids != [] and step_a == step_b
    worker_a.apply(step_a)
    results = worker_a.end_step()
    with pytest.raises(InvalidArgumentError, match="another scheduler"):
        b.apply_results(results)
    assert b.awaiting_results == 2 and b.capacity()["pending_transfers"] == 5  # nothing taken
    a.apply_results(results)
    # A worker holds one scheduler's state: another's next step is a gap, which that scheduler's resync closes.
    with pytest.raises(StepGapError, match="another scheduler"):
        worker_a.apply(step_b)
    b.apply_results(StepResults(step=2))  # none of its copies is done: they are reported later
    resync = b.resync_worker()
    worker_a.apply(resync)
    b.apply_results(worker_a.end_step())
    run_step(b, worker_a, [("r", 1)])
    assert b.capacity()["pending_transfers"] == 0


def test_the_lost_steps_results_arriving_after_a_resync_are_refused():
    # The worker dies with a step's copies in flight; its results of that step come late, after the resync that
    # redoes the step with the copies started again under new ids. Taken, they would stand for the resync's:
    # the new copies never reported, their pages copying for good.
    sched, worker = pair()
    sched.admit("r", 40)
    run_step(sched, worker, [("r", 40)])
    lost = sched.plan_step([("r", 1)])
    worker.apply(lost)
    late = dataclasses.replace(worker.end_step(), completed=())  # its copies not done when it ended the step
    resync = sched.resync_worker()
    assert resync.step == lost.step + 1 and set(resync.plan.transfer_ids).isdisjoint(lost.plan.transfer_ids)
    rebuilt = WorkerHooks(DataPath(worker.dp.layout, gpu=worker.dp.gpu, host=worker.dp.host))
    rebuilt.apply(resync)
    with pytest.raises(CallOrderError, match=f"results of step {lost.step}; step {resync.step} is waiting"):
        sched.apply_results(late)
    sched.apply_results(rebuilt.end_step())
    run_step(sched, rebuilt, [("r", 1)])
    assert sched.capacity()["pending_transfers"] == 0


def test_positions_of_any_integer_type_and_negative_rows_as_the_spec_has_them():
    """uint64 positions are positions (torch has no min/max of uint64 on CPU: they were a raw error), and a
    negative state row is a padding row, as cuda/SPEC.md and DataPath.resolve have it; a row past the last is
    refused."""
    sched, worker = pair()
    sched.admit("a", 20)
    run_step(sched, worker, [("a", 20)])
    step = sched.plan_step([("a", 1)])
    worker.apply(step)
    pos = torch.tensor([20], dtype=torch.uint64)
    assert worker.token_rows("a", pos).tolist() == worker.token_rows("a", torch.tensor([20])).tolist()
    for layer in range(LAYOUT.num_layers):
        worker.write("a", pos, layer, content("a", pos.to(torch.int64), layer))
    topk = torch.tensor([[3, 20], [3, 20]], dtype=torch.int32)
    row = sched.request_info("a")["row"]
    got = worker.resolve(topk, torch.tensor([row, -2], dtype=torch.int32))
    assert got[1].tolist() == [-1, -1] and (got[0] >= 0).all()
    assert worker.resident(torch.tensor([-5, row]), topk).tolist() == [[False, False], [True, True]]
    with pytest.raises(InvalidArgumentError, match=f"rows must be state rows below {LAYOUT.max_running}"):
        worker.resolve(topk, torch.tensor([row, LAYOUT.max_running]))
    sched.apply_results(worker.end_step())


def test_ids_of_a_string_subclass_reach_the_worker_as_strings():
    class Name(str):
        pass

    sched, worker = pair()
    sched.admit(Name("a"), 20)
    step = sched.plan_step([(Name("a"), 20)])
    assert [type(rid) for rid in step.request_ids] == [str]
    worker.apply(pickle.loads(pickle.dumps(step)))
    sched.apply_results(worker.end_step())
    assert "a" in sched and Name("a") in sched


def test_results_pickled_before_they_named_their_scheduler_still_load():
    # What the slots dataclass pickled as before the field was added: (None, {slot: value}).
    old = {"step": 3, "completed": (1,), "failed": (), "heat": None, "hits": 2, "misses": 0, "h2d_bytes": 0}
    results = object.__new__(StepResults)
    results.__setstate__((None, old))
    assert results == StepResults(step=3, completed=(1,), hits=2) and results.scheduler == 0
    with pytest.raises(InvalidArgumentError, match="a pickled StepResults holds"):
        object.__new__(StepResults).__setstate__({"completed": ()})


def test_a_resync_makes_the_worker_its_schedulers_whatever_it_names():
    (a, worker), (b, _) = pair(), pair()
    for sched in (a, b):
        sched.admit("r", 16)
    run_step(a, worker, [("r", 16)])
    resync = b.resync_worker()
    # A resync rebuilt from its bytes, naming no scheduler: the worker's state is b's after it all the same.
    worker.apply(WorkerStep(resync.step, resync.plan.to_bytes(), resync.request_ids, resync=True))
    b.apply_results(worker.end_step())
    run_step(b, worker, [("r", 1)])  # not refused as another's: the worker no longer holds a's state
    with pytest.raises(StepGapError, match="another scheduler"):  # and now it knows b's
        run_step(a, worker, [("r", 1)])


def test_a_stale_resync_is_refused_and_changes_nothing():
    """A resync delivered again after later steps (a retransmit, a replayed queue) would take the worker back
    and redo its page copies over host blocks that hold other pages by then; so would one of a scheduler the
    worker has left for another's resync."""
    (a, worker), (b, _) = pair(), pair()
    for sched in (a, b):
        sched.admit("r", 16)
    run_step(a, worker, [("r", 16)])
    old = a.resync_worker()
    worker.apply(old)
    a.apply_results(worker.end_step())
    run_step(a, worker, [("r", 1)])
    host, last = worker.dp.host.clone(), worker.last_step
    with pytest.raises(CallOrderError, match="stale resync"):
        worker.apply(old)
    assert worker.last_step == last and worker.in_step is None and torch.equal(worker.dp.host, host)
    run_step(a, worker, [("r", 1)])  # a goes on
    worker.apply(b.resync_worker())
    b.apply_results(worker.end_step())
    with pytest.raises(CallOrderError, match="stale resync"):
        worker.apply(a.resync_worker())
    run_step(b, worker, [("r", 1)])
    # Left through a resync that names no scheduler (rebuilt from its bytes): known left at b's next named step.
    (c, _) = pair()
    c.admit("r", 16)
    from_c = c.resync_worker()
    worker.apply(WorkerStep(from_c.step, from_c.plan.to_bytes(), from_c.request_ids, resync=True))
    c.apply_results(worker.end_step())
    run_step(c, worker, [("r", 1)])
    with pytest.raises(CallOrderError, match="stale resync"):
        worker.apply(b.resync_worker())


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_results_pickle_under_every_protocol(protocol):
    results = StepResults(step=3, completed=(1, 2), failed=(4,), heat=b"x", hits=5, misses=6, h2d_bytes=7,
                          scheduler=9)
    again = pickle.loads(pickle.dumps(results, protocol=protocol))
    assert again == results and again.scheduler == 9


def test_heat_summaries_come_every_interval_and_the_counts_halve():
    sched, worker = pair(heat_interval=3)
    worker.heat = HeatOptions(interval=3, coldest=3, hottest=2)
    sched.admit("a", 64)
    heats = []
    for n in (64, 1, 1, 1, 1, 1):
        step = sched.plan_step([("a", n)])
        worker.apply(step)
        worker.resolve(torch.arange(16, dtype=torch.int32)[None], ["a"])  # pages 0 and 1, 8 positions each
        results = worker.end_step()
        heats.append(results.heat)
        sched.apply_results(results)
    # Summaries come early (steps 1 and 2: powers of two below the interval), then every 3 steps.
    assert [h is not None for h in heats] == [True, True, True, False, False, True]
    row = sched.request_info("a")["row"]
    # Pages 0 and 1 gain 8 per step and halve at each summary: 8 -> 4, 12 -> 6, 14 -> 7, 15, 23, 31 -> 15.
    assert worker.dp.state["heat"][row, :3].tolist() == [15, 15, 0]
    (rid, coldest, hottest), = _core.decode_heat_summary(heats[-1])
    assert rid == sched.core_id("a")
    # Six releasable pages (eight, less the tail of two): the three coldest never selected, pages 0 and 1 hottest.
    assert coldest == [(0, 2), (0, 3), (0, 4)] and hottest == [(31, 0), (31, 1)]


def test_rows_admitted_from_the_host_serve_their_own_request_before_they_are_scheduled():
    """A request admitted from a host prefix has a length before its first step: the worker must know its
    request from the plan that sets that length, or its heat would be reported for another (regression)."""
    from hisparse import DataPath, ResidencyManager
    from hisparse.scenario import Driver

    m = ResidencyManager(num_gpu_blocks=LAYOUT.num_gpu_blocks, num_host_blocks=LAYOUT.num_host_blocks,
                         block_size=LAYOUT.block_size, max_model_len=LAYOUT.max_model_len,
                         max_running=LAYOUT.max_running, top_k=16, hot_rows=LAYOUT.hot_rows,
                         num_index_groups=LAYOUT.num_groups, page_bytes=LAYOUT.page_bytes)
    d = Driver(m, DataPath(LAYOUT), top_k=16)
    d.admit(0, 41, family=1, shared_tokens=40)
    d.step([(0, 41)])
    d.step([(0, 0)])
    d.close()
    d.finish(0)  # five prefix pages are durable on the host
    for rid in (1, 2):
        assert d.admit(rid, 41, family=1, shared_tokens=40).cached_tokens == 40
    d.step([(1, 1)])  # request 2 is not scheduled, yet its row has a length
    summary = {rid: cold for rid, cold, _ in _core.decode_heat_summary(d.dp.heat_summary(8))}
    assert set(summary) == {d.core(1), d.core(2)}
    d.close()


def test_the_slot_mapping_of_a_step_is_every_token_rows_in_order():
    sched, worker = pair()
    for rid, n in (("a", 20), ("b", 3), ("c", 41)):
        sched.admit(rid, n)
    step = sched.plan_step([("a", 20), ("b", 3), ("c", 41)])
    worker.apply(step)
    want = torch.cat([worker.token_rows(r.request_id, torch.arange(r.start, r.seq_len)) for r in step.requests])
    assert torch.equal(worker.slot_mapping(), want) and want.numel() == 64
    assert torch.equal(worker.dp._slot_mapping_torch(step.plan), want)  # the device path, on CPU tensors
    sched.apply_results(worker.end_step())
    step = sched.plan_step([("c", 1), ("a", 1)])
    worker.apply(step)
    assert worker.slot_mapping().tolist() == [worker.token_rows("c", torch.tensor([41])).item(),
                                              worker.token_rows("a", torch.tensor([20])).item()]
    sched.apply_results(worker.end_step())
    with pytest.raises(CallOrderError):
        worker.slot_mapping()


def test_an_endless_schedule_is_refused_while_read():
    """``plan_step`` reads what it is given with a bound: an endless iterable is refused, never collected."""
    sched = SchedulerHooks(num_gpu_blocks=64, num_host_blocks=64, block_size=16, max_model_len=512, top_k=32)
    sched.admit("a", 8)
    with pytest.raises(InvalidArgumentError, match="more than"):
        sched.plan_step(itertools.repeat(("a", 1)))
    assert sched.plan_step([("a", 8)]).ok


def test_a_step_pickles_with_its_checks():
    """A step crosses processes as its fields; the receiving side checks them as the constructor does, and
    takes a plan given as its bytes."""
    sched = SchedulerHooks(num_gpu_blocks=64, num_host_blocks=64, block_size=16, max_model_len=512, top_k=32)
    sched.admit("a", 8)
    step = sched.plan_step([("a", 8)])
    again = pickle.loads(pickle.dumps(step))
    assert (again.step, again.plan, again.request_ids, again.resync) == (step.step, step.plan, ("a",), False)
    assert WorkerStep(step.step, step.plan.to_bytes(), ["a"]).plan == step.plan
    resync = pickle.loads(pickle.dumps(sched.resync_worker()))
    assert resync.resync and resync.step == step.step + 1 and resync.request_ids == ("a",)  # redoes step 1


def test_a_request_finished_while_its_step_is_planned_leaves_the_hooks_usable():
    """An engine's abort thread may finish() a request while plan_step is in the core (the GIL released): the
    step still names every request it planned, and the scheduler goes on (it used to raise KeyError with its
    step counted outstanding, refusing every plan after)."""
    sched, worker = pair()
    for rid in ("a", "b"):
        sched.admit(rid, 16)
    real = sched.manager

    class AbortDuringPlan:
        def __getattr__(self, name):
            return getattr(real, name)

        def plan_step(self, core):
            plan = real.plan_step(core)
            sched.finish("b")
            return plan

    sched.manager = AbortDuringPlan()
    step = sched.plan_step([("a", 16), ("b", 16)])
    sched.manager = real
    assert step.request_ids == ("a", "b") and "b" not in sched
    worker.apply(step)
    sched.apply_results(worker.end_step())
    run_step(sched, worker, [("a", 1)])


def test_request_ids_of_a_str_subclass_are_kept_as_their_string():
    class Rid(str):  # its own __eq__, so no __hash__: unusable as a dict key itself
        def __eq__(self, other):
            return str.__eq__(self, other)

    sched, worker = pair()
    sched.admit(Rid("a"), 16)
    assert Rid("a") in sched and "a" in sched
    assert run_step(sched, worker, [(Rid("a"), 16)]).request_ids == ("a",)
    sched.finish(Rid("a"))
    assert "a" not in sched and sched.manager.stats()["running"] == 0
    sched.admit("a", 16)  # the name is free again


def test_a_slab_or_pool_replaced_with_another_number_of_layers_is_refused():
    """A copy runs over the layers both sides have: a missing layer would be reported copied, never being."""
    _, worker = pair()
    dp = worker.dp
    with pytest.raises(InvalidArgumentError, match="gpu must hold 3 layers, not 2"):
        dp.gpu = list(dp.gpu[:2])
    with pytest.raises(InvalidArgumentError, match="host must hold 3 layers, not 2"):
        dp.host = dp.host[:2]
    dp.gpu, dp.host = list(dp.gpu), dp.host.clone()  # whole ones are taken


def test_a_worker_rebuilt_over_a_used_data_path_reports_only_its_own_counts():
    sched, worker = pair()
    sched.admit("a", 16)
    run_step(sched, worker, [("a", 16)])
    worker.dp.state["counters"].copy_(torch.tensor([5, 6, 7]))  # what the resolver counted for the old hooks
    again = WorkerHooks(worker.dp)
    again.apply(sched.resync_worker())
    results = again.end_step()
    assert (results.hits, results.misses, results.h2d_bytes) == (0, 0, 0)
    sched.apply_results(results)
