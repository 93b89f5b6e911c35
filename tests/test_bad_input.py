"""Every public boundary refuses bad input with a ``HiSparseError`` and changes nothing.

One serving state (a few requests, some copies in flight, pressure, a hot region), then every entry point of
``ResidencyManager``, ``SchedulerHooks``, ``WorkerHooks``, ``DataPath`` and ``Layout`` is fed wrong types,
negatives, huge values (2**31, 2**32, 2**63, 2**64), floats, NaN, out-of-range rows, layers, positions and
pages, ragged and duplicate pairs. Each call must raise a ``HiSparseError`` subclass (never a raw
``TypeError``/``OverflowError``/``IndexError``...), the manager's and the worker's state must be
byte-identical afterwards, and at the end the audit passes and a valid step reads every byte back.
"""

from __future__ import annotations

import copyreg
import itertools
import math
import pickle
import random
import re
import struct
import types
from collections.abc import Callable
from dataclasses import replace

import plans
import pytest
import torch

from hisparse import DataPath, HiSparseError, Layout, ResidencyManager, StepPlan, _core
from hisparse.errors import InvalidArgumentError
from hisparse.heat import HeatOptions
from hisparse.hooks import StepGapError, StepResults, WorkerStep
from hisparse.scenario import Driver

LAYOUT = Layout(num_gpu_blocks=40, num_host_blocks=160, block_size=4, max_model_len=96, max_running=6,
                hot_rows=16, row_bytes=16, layer_groups=(0, 1, 1))
TOP_K = 8

#: Never a valid integer argument anywhere.
class _NoIndex:
    """An integer-like whose ``__index__`` raises (not a TypeError): it gives no integer."""

    def __index__(self):
        raise ValueError("no integer here")

    def __repr__(self):
        return "_NoIndex()"


NOT_INTS = [1.5, 2.0, math.nan, math.inf, -math.inf, True, False, "3", b"3", [3], (3,), None, object(), _NoIndex()]
#: Integers outside 0..2**32 (u32 arguments: sizes, lengths, token counts, rows, pages, layers).
NOT_U32 = [-1, -(2**31), 2**32, 2**63, 2**64, 2**100, -(2**64)]
#: Integers outside 0..2**64 (u64 arguments: request and transfer ids).
NOT_U64 = [-1, -(2**63), 2**64, 2**100]
#: Valid u64 ids that no request has.
UNKNOWN_IDS = [2**31, 2**32, 2**63, 2**64 - 1]


def serving() -> Driver:
    """A Driver mid-run: three requests, pressure (one in mixed residency), copies withheld in flight."""
    m = ResidencyManager(num_gpu_blocks=LAYOUT.num_gpu_blocks, num_host_blocks=LAYOUT.num_host_blocks,
                         block_size=LAYOUT.block_size, max_model_len=LAYOUT.max_model_len,
                         max_running=LAYOUT.max_running, top_k=TOP_K, hot_rows=LAYOUT.hot_rows,
                         num_index_groups=LAYOUT.num_groups, watermark=4, page_bytes=LAYOUT.page_bytes)
    d = Driver(m, DataPath(LAYOUT), top_k=TOP_K, seed=7)
    for rid in range(3):
        d.admit(rid, 40, family=rid % 2, shared_tokens=16, max_len=90)
    d.plans = [d.step([(rid, 40) for rid in range(3)])]  # the plans, for tests that corrupt real ones
    for _ in range(12):
        d.plans.append(d.step([(rid, 2) for rid in range(3)], deliver=0.8))
        d.decode_resolve([0, 1, 2])
    d.close(deliver=0.5)
    assert d.withheld, "the battery wants copies in flight"
    assert any(d.info(r)["residency"] != "full" for r in range(3)), "the battery wants pressure"
    d.step([(rid, 1) for rid in range(3)])  # a step open on the worker, its results outstanding
    return d


def snapshot(d: Driver) -> tuple:
    m = d.m
    ids = m.request_ids()
    core = (m.stats(), ids, [m.block_table(i) for i in ids], [m.page_states(i) for i in ids],
            [m.hot_blocks(i) for i in ids], d.sched.metrics(), d.sched.awaiting_results, d.worker.in_step)
    worker = {**{k: v.clone() for k, v in d.dp.state.items()}, "gpu": d.dp.gpu.clone(), "host": d.dp.host.clone()}
    return core, worker


def assert_same(before: tuple, after: tuple, what: str) -> None:
    assert before[0] == after[0], f"{what}: the scheduler's state changed"
    for k, v in before[1].items():
        assert torch.equal(v, after[1][k]), f"{what}: worker tensor {k} changed"


def crafted_heat(valid: bytes) -> list[tuple[str, bytes]]:
    """An encoded heat summary cut short, with trailing bytes, or with its request or page count inflated."""
    out = [(f"cut to {n} bytes", valid[:n]) for n in (0, 7, 12, 16, len(valid) - 8, len(valid) - 1)]
    out.append(("with 8 trailing bytes", valid + bytes(8)))
    for at, name in ((8, "requests"), (12, "pages")):
        for value in (2**31, 2**32 - 1, struct.unpack_from("<I", valid, at)[0] + 1):
            out.append((f"{name} count {value}", valid[:at] + struct.pack("<I", value) + valid[at + 4 :]))
    return out


def battery(d: Driver) -> dict[str, list[tuple[str, Callable[[], object]]]]:
    """entry point -> [(description, call)]; every call must raise a HiSparseError and change nothing."""
    m, sched, worker, dp = d.m, d.sched, d.worker, d.dp
    core = d.core(0)
    name = d.name(0)
    step = d.open
    assert step is not None
    cases: dict[str, list[tuple[str, Callable[[], object]]]] = {}

    def add(entry: str, what: str, call: Callable[[], object]) -> None:
        cases.setdefault(entry, []).append((what, call))

    # ------------------------------------------------------------ ResidencyManager
    sizes = dict(num_gpu_blocks=64, num_host_blocks=64, block_size=16, max_model_len=512, max_running=4, top_k=32)
    for arg in ("num_gpu_blocks", "num_host_blocks", "block_size", "max_model_len", "max_running", "top_k",
                "hot_rows", "speculative_tokens", "num_index_groups", "tail_pages", "watermark", "materialize_budget",
                "admission_pages", "page_bytes"):
        # page_bytes is a byte count (u64): large values are refused by the configuration, not the type.
        for bad in NOT_INTS + (NOT_U64 + [2**41, 2**63] if arg == "page_bytes" else NOT_U32):
            if bad is None and arg not in ("num_gpu_blocks", "max_model_len"):
                continue  # None means "the default" for optional sizes
            add("ResidencyManager()", f"{arg}={bad!r}",
                lambda arg=arg, bad=bad: ResidencyManager(**{**sizes, arg: bad}))
    no_host = {k: v for k, v in sizes.items() if k != "num_host_blocks"}
    for bad in [math.nan, math.inf, -1.0, 0.0, 1e308, 10**400, -(10**400), "1", True]:
        add("ResidencyManager()", f"host_pool_gib={bad!r:.20}",
            lambda bad=bad: ResidencyManager(**no_host, host_pool_gib=bad, page_bytes=4096))
    for bad in ["coldest ", "LRU", 1, b"fifo"]:
        add("ResidencyManager()", f"policy={bad!r}", lambda bad=bad: ResidencyManager(**sizes, policy=bad))
    add("ResidencyManager()", "both host sizes", lambda: ResidencyManager(**sizes, host_pool_gib=1.0, page_bytes=8))
    add("ResidencyManager()", "materialize_budget=0 (no page could ever be released)",
        lambda: ResidencyManager(**sizes, materialize_budget=0))

    for bad in NOT_INTS + NOT_U64:
        add("admit", f"request_id={bad!r}", lambda bad=bad: m.admit(bad, 8))
    for bad in NOT_INTS + NOT_U32 + [0, 97]:
        add("admit", f"prompt_len={bad!r}", lambda bad=bad: m.admit(99, bad))
    for bad in [*NOT_INTS[:6], -1, 2**32, 97]:
        add("admit", f"max_len={bad!r}", lambda bad=bad: m.admit(99, 8, None, bad))
    for bad in [[1.5], [True], ["h"], [2**64], [-(2**63) - 1], "abc", 7, [[1]], list(range(30))]:
        add("admit", f"prefix_hashes={bad!r:.40}", lambda bad=bad: m.admit(99, 8, bad))
    add("admit", "an admitted id", lambda: m.admit(core, 8))

    class Huge:
        """A sequence that claims to be enormous: nothing may allocate for its length."""

        def __len__(self):
            return 2**60

        def __iter__(self):
            return iter(range(2**40))

    for entry, call in [("complete", lambda: m.complete(range(2**40))), ("complete", lambda: m.complete(Huge())),
                        ("plan_step", lambda: m.plan_step((core, 1) for _ in range(2**40))),
                        ("admit", lambda: m.admit(99, 8, Huge())),
                        ("apply_results", lambda: m.apply_results(completed=Huge()))]:
        add(entry, "a sequence of 2**40 elements", call)
    for what, kwargs in [("block_size 0", dict(block_size=0)), ("groups 0", dict(groups=0)),
                         ("overflow", dict(seq_len=2**64 - 1, block_size=1, tail_pages=0, groups=1)),
                         ("groups overflow", dict(seq_len=0, block_size=1, tail_pages=2**32 - 1, groups=2**32 - 1))]:
        full = dict(seq_len=1, block_size=16, hot_rows=32, tail_pages=2, groups=1) | kwargs
        add("steady_state_blocks", what, lambda full=full: _core.steady_state_blocks(**full))
    for entry, call in [("resume", m.resume), ("finish", m.finish), ("preempt", m.preempt),
                        ("request_info", m.request_info), ("block_table", m.block_table),
                        ("page_states", m.page_states), ("hot_blocks", m.hot_blocks)]:
        for bad in NOT_INTS + NOT_U64 + UNKNOWN_IDS:
            add(entry, f"request_id={bad!r}", lambda call=call, bad=bad: call(bad))
    add("resume", "a running request", lambda: m.resume(core))

    for bad in [None, 5, "ab", b"ab", [5], [(core,)], [(core, 1, 2)], [(core, 1.0)], [(core, True)], [(core, -1)],
                [(core, 2**32)], [(core, 2**64)], [(-1, 1)], [(2**64, 1)], [(1.5, 1)], [(core, 1), (core, 1)],
                [(core, 10_000)], [(12345, 1)], [[core, 1, 2]], [(core, 1), 7]]:
        add("plan_step", f"{bad!r:.40}", lambda bad=bad: m.plan_step(bad))

    in_flight = list(d.withheld)
    for bad in [None, 7, "ab", [1.5], [True], [-1], [2**64], [10**9], in_flight[:1] * 2, [*in_flight, 10**9]]:
        add("complete", f"transfer_ids={bad!r:.40}", lambda bad=bad: m.complete(bad))
    for bad in [1, 0, "yes", None]:
        if bad is None:
            continue
        add("complete", f"ok={bad!r}", lambda bad=bad: m.complete(in_flight[:1], bad))
    first = in_flight[:1]
    for what, kwargs in [
        ("completed unknown", dict(completed=[10**9])),
        ("failed unknown", dict(completed=first, failed=[10**9])),
        ("completed and failed", dict(completed=first, failed=first)),
        ("completed twice", dict(completed=first * 2)),
        ("completed float", dict(completed=[1.0])),
        ("failed negative", dict(failed=[-1])),
        ("heat not bytes", dict(completed=first, heat="HSHT")),
        ("heat int list", dict(heat=[1, 2])),
        ("heat truncated", dict(completed=first, heat=plans.heat({core: [(0, 1)]})[:-1])),
        ("heat unordered", dict(completed=first, heat=plans.heat({core: [(5, 1), (0, 2)]}))),
        ("heat page twice", dict(heat=plans.heat({core: [(0, 1), (3, 1)]}))),
        ("heat request twice", dict(heat=plans.heat([(core, [(0, 1)]), (core, [(0, 2)])]))),
        ("heat garbage", dict(heat=b"\x00" * 40)),
        ("heat of a plan", dict(heat=step.plan.to_bytes())),
    ] + [(f"heat {what}", dict(heat=data)) for what, data in crafted_heat(plans.heat({core: [(0, 1), (2, 3)]}))]:
        add("apply_results", what, lambda kwargs=kwargs: m.apply_results(**kwargs))
    for bad in [[1.5], [-(2**63) - 1], [2**64], "ab", 5, [None], [True]]:
        add("add_page_hashes", f"hashes={bad!r}", lambda bad=bad: m.add_page_hashes(core, bad))
    add("add_page_hashes", "beyond max_len", lambda: m.add_page_hashes(core, list(range(40))))
    for bad in NOT_INTS[:6] + NOT_U64 + UNKNOWN_IDS:
        add("add_page_hashes", f"request_id={bad!r}", lambda bad=bad: m.add_page_hashes(bad, [1]))

    # ------------------------------------------------------------ SchedulerHooks
    for bad in [7, None, b"r0", 1.5, ("r",)]:
        add("SchedulerHooks.admit", f"request_id={bad!r}", lambda bad=bad: sched.admit(bad, 8))
    add("SchedulerHooks.admit", "an admitted name", lambda: sched.admit(name, 8))
    for bad in NOT_INTS + NOT_U32:
        add("SchedulerHooks.admit", f"prompt_len={bad!r}", lambda bad=bad: sched.admit("new", bad))
    for bad in [[1.5], ["x"], [2**64], 5]:
        add("SchedulerHooks.admit", f"prefix_hashes={bad!r}", lambda bad=bad: sched.admit("new", 8, bad))
    for entry, call in [("SchedulerHooks.resume", sched.resume), ("SchedulerHooks.finish", sched.finish),
                        ("SchedulerHooks.preempt", sched.preempt), ("SchedulerHooks.request_info", sched.request_info),
                        ("SchedulerHooks.core_id", sched.core_id)]:
        for bad in ["nobody", 0, None, 1.5, b"r0", [name]]:
            add(entry, f"{bad!r}", lambda call=call, bad=bad: call(bad))
    for bad in [-1, 10**9, None, "r0"]:
        add("SchedulerHooks.request_id", f"{bad!r}", lambda bad=bad: sched.request_id(bad))
    # A step's results are outstanding: a second plan is refused whatever it holds, and so is anything else.
    for bad in [[(name, 1)], [], None, 5, [(name,)], [(name, 1.5)]]:
        add("SchedulerHooks.plan_step", f"{bad!r:.40}", lambda bad=bad: sched.plan_step(bad))
    good = StepResults(step.step)
    for what, bad in [
        ("not results", None), ("a dict", {"step": step.step}), ("another step", replace(good, step=step.step + 1)),
        ("unknown copy", replace(good, completed=(10**9,))),
        ("both", replace(good, completed=tuple(first), failed=tuple(first))),
        ("twice", replace(good, completed=tuple(first) * 2)),
        ("bad heat", replace(good, heat=b"junk")), ("heat str", replace(good, heat="x")),
        ("negative hits", replace(good, hits=-1)), ("float misses", replace(good, misses=1.5)),
        ("bool bytes", replace(good, h2d_bytes=True)), ("completed floats", replace(good, completed=(1.0,))),
        ("step a tensor", replace(good, step=torch.tensor([step.step, step.step]))),
        ("step a float", replace(good, step=float(step.step))),
    ]:
        add("SchedulerHooks.apply_results", what, lambda bad=bad: sched.apply_results(bad))

    # ------------------------------------------------------------ WorkerHooks (a step is open)
    for what, bad in [("not a step", None), ("a plan", step.plan), ("again", step),
                      ("next while open", WorkerStep(step.step + 1, step.plan, step.request_ids))]:
        add("WorkerHooks.apply", what, lambda bad=bad: worker.apply(bad))
    for what, args in [("no request ids", (step.step, step.plan)), ("step as str", ("1", step.plan, step.request_ids)),
                       ("no plan", (1, None, ())), ("negative step", (-1, step.plan, step.request_ids)),
                       ("ids not str", (step.step, step.plan, tuple(range(len(step.request_ids))))),
                       ("one id too many", (step.step, step.plan, (*step.request_ids, "x")))]:
        add("WorkerStep()", what, lambda args=args: WorkerStep(*args))
    pos = torch.tensor([40 + 24])  # request 0 writes position 64 in the open step
    for what, call in [
        ("unknown request", lambda: worker.token_rows("nobody", pos)),
        ("request not in step", lambda: worker.token_rows(7, pos)),
        ("float positions", lambda: worker.token_rows(name, pos.float())),
        ("bool positions", lambda: worker.token_rows(name, pos > 0)),
        ("a list", lambda: worker.token_rows(name, [64])),
        ("history position", lambda: worker.token_rows(name, torch.tensor([3]))),
        ("future position", lambda: worker.token_rows(name, torch.tensor([65]))),
        ("negative position", lambda: worker.token_rows(name, torch.tensor([-1]))),
        ("2**32 + 64", lambda: worker.token_rows(name, torch.tensor([2**32 + 64]))),
    ]:
        add("WorkerHooks.token_rows", what, call)
    kv = torch.zeros(1, LAYOUT.row_bytes, dtype=torch.uint8)
    for bad in [-1, 3, 2**32, 1.0, True, None, "0"]:
        add("WorkerHooks.write", f"layer={bad!r}", lambda bad=bad: worker.write(name, pos, bad, kv))
    for what, rows in [("float rows", kv.float()), ("short rows", kv[:, :8]), ("two rows", kv.repeat(2, 1)),
                       ("a list", [[0] * 16])]:
        add("WorkerHooks.write", what, lambda rows=rows: worker.write(name, pos, 0, rows))
    topk = torch.arange(TOP_K, dtype=torch.int32)[None]
    row = torch.tensor([d.info(0)["row"]], dtype=torch.int32)
    for what, call in [
        ("group -1", lambda: worker.resolve(topk, row, -1)),
        ("group 2", lambda: worker.resolve(topk, row, 2)),
        ("group 1.0", lambda: worker.resolve(topk, row, 1.0)),
        ("float topk", lambda: worker.resolve(topk.float(), row)),
        ("bool topk", lambda: worker.resolve(topk > 0, row)),
        ("1-D topk", lambda: worker.resolve(topk[0], row)),
        ("row 6", lambda: worker.resolve(topk, torch.tensor([6]))),
        ("row 2**64 - 1", lambda: worker.resolve(topk, torch.tensor([2**64 - 1], dtype=torch.uint64))),
        ("row 2**32", lambda: worker.resolve(topk, torch.tensor([2**32]))),
        ("float rows", lambda: worker.resolve(topk, row.float())),
        ("rows of two", lambda: worker.resolve(topk, torch.tensor([0, 1], dtype=torch.int32))),
        ("unknown name", lambda: worker.resolve(topk, ["nobody"])),
        ("not a tensor", lambda: worker.resolve([[0] * TOP_K], row)),
        ("complex topk", lambda: worker.resolve(topk.to(torch.complex64), row)),
    ]:
        add("WorkerHooks.resolve", what, call)
    for what, call in [
        ("float topk", lambda: worker.resident(row, topk.float())),
        ("row 6", lambda: worker.resident(torch.tensor([6]), topk)),
        ("shape", lambda: worker.resident(torch.tensor([0, 1]), topk)),
    ]:
        add("WorkerHooks.resident", what, call)
    ids = torch.zeros(1, TOP_K, dtype=torch.int32)
    for what, call in [
        ("layer -1", lambda: worker.gather(ids, -1)),
        ("layer 3", lambda: worker.gather(ids, 3)),
        ("layer True", lambda: worker.gather(ids, True)),
        ("int64 ids", lambda: worker.gather(ids.long(), 0)),
        ("row beyond the slab", lambda: worker.gather(torch.full((1, 2), 40 * 4, dtype=torch.int32), 0)),
        ("a list", lambda: worker.gather([[0]], 0)),
    ]:
        add("WorkerHooks.gather", what, call)
    for what, kwargs in [("interval 0", dict(interval=0)), ("interval 1.5", dict(interval=1.5)),
                         ("coldest -1", dict(coldest=-1)), ("hottest True", dict(hottest=True)),
                         ("coldest 2**24", dict(coldest=2**24)), ("layer_stride 0", dict(layer_stride=0))]:
        add("HeatOptions()", what, lambda kwargs=kwargs: HeatOptions(**kwargs))
    for bad in [{"interval": 4}, 4, "heat"]:
        add("WorkerHooks()", f"heat={bad!r}", lambda bad=bad: type(worker)(dp, heat=bad))
    add("WorkerHooks()", "not a DataPath", lambda: type(worker)(None))

    # ------------------------------------------------------------ DataPath
    bad_pairs = [[(0, 1, 2)], [(0,)], [(1.5, 1)], [(True, 1)], [(2**40, 0)], [(2**64, 0)], [(0, 2**63)], "ab", 7,
                 [(1, 2), (3,)], [None]]
    endless = itertools.repeat((1, 1))
    for entry, call in [("DataPath.copy_blocks", lambda: dp.copy_blocks(endless, to_host=False)),
                        ("DataPath.mirror", lambda: dp.mirror(endless)),
                        ("DataPath.invalidate", lambda: dp.invalidate(endless))]:
        add(entry, "an endless iterable of pairs", call)
    for bad in [*bad_pairs, [(40, 0)], [(0, 160)], [(1, 5), (1, 6)]]:
        add("DataPath.copy_blocks", f"{bad!r:.30} to GPU", lambda bad=bad: dp.copy_blocks(bad, to_host=False))
    for bad in [*bad_pairs, [(1, 5), (2, 5)]]:
        add("DataPath.copy_blocks", f"{bad!r:.30} to host", lambda bad=bad: dp.copy_blocks(bad, to_host=True))
    for bad in [*bad_pairs, [(160, 0)], [(0, 640)], [(1, 5), (2, 5)]]:
        add("DataPath.mirror", f"{bad!r:.30}", lambda bad=bad: dp.mirror(bad))
    for bad in [*bad_pairs, [(6, 0)], [(0, 96)]]:
        add("DataPath.invalidate", f"{bad!r:.30}", lambda bad=bad: dp.invalidate(bad))
    for what, call in [
        ("row -1", lambda: dp.token_rows(-1, torch.tensor([0]))),
        ("row 6", lambda: dp.token_rows(6, torch.tensor([0]))),
        ("row 1.0", lambda: dp.token_rows(1.0, torch.tensor([0]))),
        ("position -1", lambda: dp.token_rows(0, torch.tensor([-1]))),
        ("position 96", lambda: dp.token_rows(0, torch.tensor([96]))),
        ("float positions", lambda: dp.token_rows(0, torch.tensor([1.0]))),
        ("2-D positions", lambda: dp.token_rows(0, torch.tensor([[1]]))),
        ("not resident", lambda: dp.token_rows(5, torch.tensor([0]))),
    ]:
        add("DataPath.token_rows", what, call)
    for bad in [-1, 1.5, True, 2**24, "8", None]:
        add("DataPath.heat_summary", f"coldest={bad!r}", lambda bad=bad: dp.heat_summary(bad))
        add("DataPath.heat_summary", f"hottest={bad!r}", lambda bad=bad: dp.heat_summary(8, bad))
    add("DataPath.copy_blocks", "to_host 'no'", lambda: dp.copy_blocks([(1, 1)], to_host="no"))
    add("DataPath.copy_blocks", "a restore into block 0", lambda: dp.copy_blocks([(0, 1)], to_host=False))
    for what, args in [("no layout", (None,)), ("bogus device", (LAYOUT, "bogus")), ("meta", (LAYOUT, "meta")),
                       ("cuda 99", (LAYOUT, "cuda:99")), ("device 5", (LAYOUT, 5.5))]:
        add("DataPath()", what, lambda args=args: DataPath(*args))
    for what, gpu, host in [("gpu 5", 5, dp.host), ("two layers of three", list(dp.gpu[:2]), dp.host),
                            ("host a list", dp.gpu, [dp.host]), ("host float", dp.gpu, dp.host.float()),
                            ("gpu the host", dp.host, dp.host)]:
        add("WorkerHooks.register", what, lambda gpu=gpu, host=host: type(worker).register(LAYOUT, gpu, host))
    for what, plan in [("not a plan", None), ("bytes", step.plan.to_bytes()),
                       ("short", plans.plan(missing_blocks=1)), ("row 6", plans.plan(cleared_rows=[6])),
                       ("block 40", plans.plan(restores=[(40, 1)]))]:
        add("DataPath.apply", what, lambda plan=plan: dp.apply(plan))
    for what, call in [("group 2", lambda: dp.resolve(topk, row, 2)),
                       ("layer 3", lambda: dp.gather(ids, 3)),
                       ("int64 topk", lambda: dp.resolve(topk.long(), row)),
                       ("row 9", lambda: dp.resolve(topk, row + 9))]:
        add("DataPath.resolve/gather", what, call)

    # ------------------------------------------------------------ what arrives as bytes
    valid = step.plan.to_bytes()
    for what, data in plans.crafted(valid):
        add("StepPlan.from_bytes", what, lambda data=data: StepPlan.from_bytes(data))
        add("WorkerStep(plan=bytes)", what, lambda data=data: WorkerStep(step.step, data, step.request_ids))
    for bad in [None, "HSPL", 5, [1, 2], bytearray(3)]:
        add("StepPlan.from_bytes", f"{bad!r:.20}", lambda bad=bad: StepPlan.from_bytes(bad))
    # Plans that decode but schedule positions, or restore into blocks, they do not own: both worker paths
    # (Rust on CPU, torch on a device: here on CPU tensors) refuse them whole.
    ok = plans.sections(step.plan)
    first = ok["scheduled"][0]
    rid, srow, start, n = first
    not_owned = {
        "start wrapped to -2": dict(ok, scheduled=[(rid, srow, 2**32 - 2, n + 2)] + ok["scheduled"][1:]),
        "2**32 - 1 tokens": dict(ok, scheduled=[(rid, srow, start, 2**32 - 1)] + ok["scheduled"][1:]),
        "a start one page past the table": dict(ok, scheduled=[(rid, srow, 96, n)] + ok["scheduled"][1:]),
        "no length for a scheduled row": dict(ok, seq_lens=[e for e in ok["seq_lens"] if e[0] != srow]),
        "another request's row": dict(ok, scheduled=[(rid + 1, srow, start, n)] + ok["scheduled"][1:]),
        "a restore no table names": dict(ok, restores=[*ok["restores"], (39, 0)]),
    }
    for what, fields in not_owned.items():
        bad_plan = plans.plan(**fields)
        add("DataPath.apply", what, lambda bad_plan=bad_plan: dp.apply(bad_plan))
        add("DataPath.apply (device path)", what, lambda bad_plan=bad_plan: dp._apply_torch(bad_plan))
        add("DataPath.slot_mapping", what, lambda bad_plan=bad_plan: dp.slot_mapping(bad_plan))

    class Forged:
        """Pickles as a WorkerStep with the given state: what an unpickler hands ``__setstate__``."""

        def __init__(self, state):
            self.state = state

        def __reduce__(self):
            return copyreg._reconstructor, (WorkerStep, object, None), self.state

    fields = {"step": step.step, "plan": step.plan, "request_ids": step.request_ids, "resync": False}
    for what, state in [
        ("one request id short", {**fields, "request_ids": step.request_ids[:-1]}),
        ("plan garbage bytes", {**fields, "plan": b"garbage"}), ("plan None", {**fields, "plan": None}),
        ("plan truncated", {**fields, "plan": valid[:-4]}), ("step -1", {**fields, "step": -1}),
        ("step a str", {**fields, "step": "3"}), ("resync 'yes'", {**fields, "resync": "yes"}),
        ("ids not str", {**fields, "request_ids": tuple(range(len(step.request_ids)))}),
        ("an unknown field", {**fields, "extra": 1}), ("no plan", {"step": 1}), ("not a dict", [1, 2]),
    ]:
        add("WorkerStep unpickled", what, lambda state=state: pickle.loads(pickle.dumps(Forged(state))))

    # ------------------------------------------------------------ sequences read with a bound, nested ones too
    for what, call in [("an inner pair of 2**40", lambda: m.plan_step([range(2**40)])),
                       ("an inner Huge", lambda: m.plan_step([Huge()])),
                       ("inner pairs of 2**40", lambda: m.plan_step(range(2**40) for _ in range(3)))]:
        add("plan_step", what, call)
    for bad in [None, 1, 0, "yes", 1.0]:
        add("resync", f"redo_last_step={bad!r}", lambda bad=bad: m.resync(bad))

    # ------------------------------------------------------------ Layout
    for field in ("num_gpu_blocks", "num_host_blocks", "block_size", "max_model_len", "max_running", "hot_rows",
                  "row_bytes"):
        for bad in [0, -16, 16.0, True, None, "16"]:
            add("Layout()", f"{field}={bad!r}", lambda field=field, bad=bad: Layout(**{**LAYOUT.__dict__, field: bad}))
    for bad in [(), (1,), (0, 2), (-1, 0), (0.0,), "0"]:
        add("Layout()", f"layer_groups={bad!r}", lambda bad=bad: Layout(**{**LAYOUT.__dict__, "layer_groups": bad}))
    return cases


def test_every_bad_input_is_refused_cleanly_and_changes_nothing():
    d = serving()
    cases = battery(d)
    before = snapshot(d)
    raw = []
    for entry, calls in cases.items():
        for what, call in calls:
            try:
                call()
            except HiSparseError:
                pass
            except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
                raw.append(f"{entry} {what}: {type(exc).__name__}: {exc}")
            else:
                raw.append(f"{entry} {what}: accepted")
            assert_same(before, snapshot(d), f"{entry} {what}")
    assert not raw, "\n".join(raw)
    # The state is intact and still serves: the audit passes, a valid step reads every byte back.
    d.m.check_invariants()
    d.step([(rid, 1) for rid in range(3)], deliver=1.0)
    for rid in range(3):
        assert d.verify_all(rid) == d.specs[rid].written
    d.close()
    assert sum(len(calls) for calls in cases.values()) > 500


def test_battery_sizes(capsys):
    """The number of bad inputs per entry point (for the record; each one is asserted above)."""
    cases = battery(serving())
    with capsys.disabled():
        print("\n" + ", ".join(f"{entry}: {len(calls)}" for entry, calls in cases.items()))
    assert all(len(calls) >= 3 for calls in cases.values())


@pytest.mark.parametrize("ids", [[-(2**63), -1, 2**63, 2**64 - 1], [hash("a"), hash("b")]])
def test_negative_and_huge_hashes_are_hashes(ids):
    """Python's hash() is negative half the time: every int in -2**63..2**64 is a valid page hash."""
    m = ResidencyManager(num_gpu_blocks=64, num_host_blocks=64, block_size=4, max_model_len=64, top_k=4)
    a = m.admit(1, 4 * len(ids) + 1, ids)
    assert a.cached_tokens == 0
    m.add_page_hashes(1, [0])
    m.check_invariants()


def clone(dp: DataPath, device: str = "cpu") -> DataPath:
    """A data path with the same state, slab and host pool, in tensors of its own on ``device``."""
    out = DataPath(LAYOUT, device)
    for name, t in dp.state.items():
        out.state[name].copy_(t)
    for mine, theirs in ((out.gpu, dp.gpu), (out.host, dp.host)):
        mine.copy_(theirs)
    return out


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random corruption: a bit flipped, a word set to an edge value, bytes cut, added or dropped."""
    words = len(data) // 4
    kind = rng.randrange(5)
    if kind == 0:
        at = rng.randrange(len(data))
        return data[:at] + bytes([data[at] ^ 1 << rng.randrange(8)]) + data[at + 1 :]
    if kind == 1:
        at = 4 * rng.randrange(words)
        old = struct.unpack_from("<I", data, at)[0]
        value = rng.choice([0, 1, 2**31, 2**32 - 1, 2**32 - 2, old + 1, old - 1, rng.randrange(2**32)])
        return data[:at] + struct.pack("<I", value & 0xFFFFFFFF) + data[at + 4 :]
    if kind == 2:
        return data[: rng.randrange(len(data))]
    at = 4 * rng.randrange(words)
    return data[:at] + bytes(4) + data[at:] if kind == 3 else data[:at] + data[at + 4 :]


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_mutated_plans_are_refused_or_applied_alike_by_both_worker_paths(device):
    """Random corruptions of real plans (bits, edge values, cuts, inserted or dropped words): each is refused
    by the decoder, or by both worker paths with the same message and nothing changed, or applied by both
    with the same state, slab and host pool and the same slot mapping, every slot inside the slab and in a
    block of its own row's table. The device path runs on CPU tensors here, on a GPU where there is one."""
    d = serving()
    real = [p.to_bytes() for p in d.plans if p.num_scheduled and (p.table_updates or p.materialize)]
    assert len(real) >= 3
    base = d.dp
    before = {k: v.clone() for k, v in base.state.items()}
    rng = random.Random(0)
    outcomes = {"decode": 0, "refused": 0, "applied": 0}
    for i in range(2000 if device == "cpu" else 400):
        data = mutate(real[i % len(real)], rng)
        try:
            plan = StepPlan.from_bytes(data)
        except HiSparseError:
            outcomes["decode"] += 1
            continue
        cpu_path, device_path = clone(base), clone(base, device)
        refusals = []
        for apply in (cpu_path.apply, device_path.apply if device == "cuda" else device_path._apply_torch):
            try:
                apply(plan)
                refusals.append(None)
            except HiSparseError as e:
                refusals.append(str(e))
        assert refusals[0] == refusals[1], f"mutation {i}: the paths disagree: {refusals}"
        if device == "cuda":
            torch.cuda.synchronize()
        state = {k: (cpu_path.state[k], device_path.state[k].cpu()) for k in before}
        if refusals[0] is not None:
            assert all(torch.equal(a, before[k]) and torch.equal(b, before[k]) for k, (a, b) in state.items()), \
                f"mutation {i} changed state"
            outcomes["refused"] += 1
            continue
        for k, (a, b) in state.items():
            assert torch.equal(a, b), f"mutation {i}: {k} differs"
        assert torch.equal(cpu_path.gpu, device_path.gpu.cpu()) and torch.equal(cpu_path.host, device_path.host)
        slots = device_path._slot_mapping_torch(plan).cpu()
        try:
            cpu = cpu_path.slot_mapping(plan)
        except HiSparseError as e:  # a scheduled page without a block: the device path maps it nowhere (-1)
            assert "no resident block" in str(e) and bool((slots < 0).any()), f"mutation {i}: {e}"
            outcomes["refused"] += 1
            continue
        assert torch.equal(cpu, slots), f"mutation {i}: the slot mappings differ"
        rows = torch.repeat_interleave(torch.tensor([r for _, r, _, _ in plan.scheduled], dtype=torch.int64),
                                       torch.tensor([n for *_, n in plan.scheduled], dtype=torch.int64))
        blocks = cpu // LAYOUT.block_size
        assert bool(((blocks > 0) & (blocks < LAYOUT.num_gpu_blocks)).all()), f"mutation {i}: a slot off the slab"
        table = cpu_path.state["block_table"]
        assert bool((table[rows] == blocks[:, None]).any(dim=1).all()), f"mutation {i}: a slot outside its row"
        outcomes["applied"] += 1
    assert min(outcomes.values()) > 0, outcomes


@pytest.mark.parametrize("mid_step", [True, False])
def test_a_rebuilt_worker_resumes_with_every_byte_right(mid_step):
    """The worker process dies under pressure with copies in flight (in a step's forward, or between steps)
    and a new one registers the same slab and host pool. Handed the next plan it refuses (a step gap, nothing
    changed); the scheduler's resync step brings it to the current state: the dead worker's copies count as
    failed and start again under new ids (its late reports are refused), a lost step's restores and tokens
    come again, and every byte of every request reads back, then and after more serving under pressure."""
    d = serving()
    lost = list(d.withheld)
    assert lost
    if not mid_step:  # its results came back: the next plan is made before anyone notices the worker died
        d.close(deliver=0.0)
        lost = list(d.withheld)
        nxt = d.sched.plan_step([(d.name(r), 1) for r in range(3)])
        fresh = type(d.worker)(DataPath(LAYOUT, gpu=d.dp.gpu, host=d.dp.host))
        before = snapshot(d)
        with pytest.raises(StepGapError, match="skips step 1"):
            fresh.apply(nxt)
        assert_same(before, snapshot(d), "a refused step")
        for r in range(3):  # the step is outstanding: the resync step redoes it, tokens included
            d.specs[r].written += 1
    step = d.rebuild_worker(mid_step=True)  # in the forward of a step, or (not mid_step) of none
    assert step.resync and d.worker.last_step == step.step
    redone = {t for t, _, _ in step.plan.materialize}
    assert redone and not redone & set(lost), "the copies in flight start again under new ids"
    assert step.plan.num_tokens == 3, "the lost step's tokens come again"
    with pytest.raises(HiSparseError, match="not in flight"):
        d.m.complete(lost[:1])
    for r in range(3):
        assert d.verify_all(r) == d.specs[r].written
    rows = 0
    for _ in range(12):
        d.step([(r, 2) for r in range(3)], deliver=0.6)
        d.decode_resolve([0, 1, 2])
    assert any(d.info(r)["residency"] != "full" for r in range(3)), "still under pressure"
    for r in range(3):
        rows += d.verify_all(r)
    d.close()
    d.m.check_invariants()
    assert rows == sum(d.specs[r].written for r in range(3))


def test_the_vllm_bookkeeping_refuses_counts_no_engine_has():
    """``BlockRows``, ``unpack_row_mirrors`` and ``PoolPolicy`` (the vLLM plugin's core objects) with counts near
    the integer limits: a refusal or the same answer as a sane count, never an abort, a panic, a hang or the
    opposite decision (a review's reproducers)."""
    for groups in (2**40, 2**64 - 1):
        with pytest.raises(InvalidArgumentError):
            _core.BlockRows(groups, 16)
    rows = _core.BlockRows(1, 16)
    rows.set("a", 0, [1])
    rows.set("a", None, [2])
    # A step or a lookahead reaching far past the rows mirrors the rows there are, at once.
    assert rows.scan({"a": 2**63}, {"a": 0})[0][1:] == rows.scan({"a": 16}, {"a": 0})[0][1:]
    assert rows.scan({"a": 1}, {"a": 0}, 2**64 - 1)[0][1:] == rows.scan({"a": 16}, {"a": 0})[0][1:]
    count, two = struct.pack("=I", 2), struct.pack("=qq", 0, 0)
    with pytest.raises(InvalidArgumentError):
        _core.unpack_row_mirrors(object, ["a"], count, b"", two, two, 2**63)
    policy = _core.PoolPolicy(block_size=16, blocks_per_page=2, hot_blocks=64, admission_pages=4, tail_pages=2,
                              low_watermark=10)
    assert policy.transition(True, 100, 0, 0, 0, 2**64 - 1, 0, None) == "postponed"
    assert policy.transition(True, 2**64 - 1, 2**64 - 1, 0, 2**64 - 1, 2**64 - 1, 2**64 - 1, None) == "take"
    pool = dict(free_blocks=1000, running=0, reading_host=0, owed_hot_blocks=0, may_take_hot=False)
    assert policy.admit(16, 0, 16, 16, **pool)
    assert policy.admit(16, 0, 16, 16, **{**pool, "free_blocks": 2**64 - 1})
    assert not policy.admit(16, 0, 16, 16, **{**pool, "owed_hot_blocks": 2**64 - 1})
    policy.end_pass()  # a refusal holds the rest of its pass
    assert not policy.admit(16, 0, 16, 16, **{**pool, "running": 2**63})


def test_the_vllm_bookkeeping_refuses_wrong_types_and_negatives_by_name():
    """The vLLM plugin's core objects (``PageBook`` too) check their arguments as ``ResidencyManager`` does
    (``args.rs``): a negative, a bool, a float, a value past the range, a string for a sequence, a missing key or a
    group that does not exist is an ``InvalidArgumentError`` naming the argument, never a raw
    ``OverflowError``/``TypeError``/``KeyError``, nor a silent answer (a review's reproducers)."""
    policy = _core.PoolPolicy(block_size=16, blocks_per_page=2, hot_blocks=64, admission_pages=4, tail_pages=2)
    rows = _core.BlockRows(2, 16)
    rows.set("a", 0, [1, None])
    fake_pool = types.SimpleNamespace(blocks=[])  # a pool's blocks by id (none: nothing is read here)
    book = _core.PageBook(rows, object(), set(), fake_pool, fake_pool, [0, 1], [], 16, 8)
    pool = dict(free_blocks=1000, running=0, reading_host=0, owed_hot_blocks=0, may_take_hot=False)
    count, two = struct.pack("=I", 2), struct.pack("=qq", 0, 0)
    calls = {
        "block_size": lambda: _core.PoolPolicy(block_size=-1),
        "hot_blocks": lambda: _core.PoolPolicy(hot_blocks=2.0),
        "tail_pages": lambda: _core.PoolPolicy(tail_pages=True),
        "releasable_pages": lambda: policy.worth_transition(-1),
        "free_blocks": lambda: policy.transition(False, -5, 0, 0, 0, 0, 0, None),
        "fills_window": lambda: policy.transition(1, 5, 0, 0, 0, 0, 0, None),
        "tokens_left": lambda: policy.transition(False, 5, 0, 0, 0, -1, 0, None),
        "tokens": lambda: policy.admit(-1, 0, 16, 16, **pool),
        "longest_tokens": lambda: policy.admit(16, 0, 16, True, **pool),
        "longest_tokens ": lambda: policy.transition(False, 5, 0, 0, 0, 0, 0, -1),
        "pages[0]": lambda: policy.release_order("a", [2**32]),
        "request_ids": lambda: policy.report(b"", "ab"),
        "groups": lambda: _core.BlockRows(True, 16),
        "block size of 1 to": lambda: _core.BlockRows(1, 2**31 + 1),  # its slots would not fit vLLM's i64 rows
        "group": lambda: rows.set("a", -1, [1]),
        "ids[0]": lambda: rows.set("a", 0, [1.0]),
        "ids[1]": lambda: rows.extend("a", 0, [1, -1]),
        "page": lambda: rows.drop_page("a", -1),
        "resident group 2": lambda: rows.row("a", 2),
        "resident group 5": lambda: rows.row_len("a", 5),
        "tokens ": lambda: rows.quiet("a", -1),
        "scheduled[a]": lambda: rows.scan({"a": -1}, {"a": 0}),
        "computed has no entry": lambda: rows.scan({"a": 1}, {}),
        "scheduled must be a dict": lambda: rows.scan(types.MappingProxyType({"a": 1}), {"a": 0}),
        "lookahead": lambda: rows.scan({"a": 1}, {"a": 0}, -1),
        "groups ": lambda: _core.unpack_row_mirrors(object, ["a"], count, b"", two, two, -1),
        "page_tokens": lambda: _core.PublishGate(-64, object()),
        "num_tokens": lambda: _core.PublishGate(64, object()).cache_blocks(object(), -1, replay_boundaries=()),
        "pages": lambda: _core.PublishGate(64, object()).mark("a", -1),
        "pages ": lambda: book.commit_computed("a", -1),
        "page ": lambda: book.plan("a", -1, True, False),
        "after_forward": lambda: book.plan("a", 0, 1, False),
        "tokens  ": lambda: book.advance([("a", 2.0)], 0),
        "a step must be (request, tokens)": lambda: book.with_work([("a",)], 0),
        "transfer id": lambda: book.update_transfers({-1: 1}, {}),
        "count": lambda: book.update_transfers({}, {0: -1}),
        "null": lambda: book.residency_updates(["a"], -1),
        "publication needs its tokens": lambda: book.set_publication("a", object()),
        "max_planned": lambda: _core.PageBook(rows, object(), set(), fake_pool, fake_pool, [0, 1], [], 16, -1),
        "2 resident managers": lambda: _core.PageBook(_core.BlockRows(1, 16), object(), set(), fake_pool, fake_pool,
                                                       [0, 1], [], 16, 8),
        "blocks must be a list": lambda: _core.PageBook(rows, object(), set(), types.SimpleNamespace(blocks=()),
                                                          fake_pool, [0, 1], [], 16, 8),
        "reads_host must be a set": lambda: _core.PageBook(rows, object(), [], fake_pool, fake_pool, [0, 1], [], 16, 8),
        "reprefill": lambda: book.advance([], -1),
    }
    before = rows.row("a", 0), rows.row_len("a", None), len(policy), book.pages("a")
    for name, call in calls.items():
        with pytest.raises(InvalidArgumentError, match=re.escape(name.strip())):
            call()
    assert (rows.row("a", 0), rows.row_len("a", None), len(policy), book.pages("a")) == before
