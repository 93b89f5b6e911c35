"""Random traces through vLLM 0.33.0's own scheduler stack (``tests/vllm_harness.py``), each drawn from a seed:
staggered arrivals, a shared prefix, follow-up turns, aborts mid-turn, pressure and preemptions, MTP's drafts,
async scheduling, copies that complete late, with and without prefix caching, vLLM's OffloadingConnector
beside us, and a worker that dies mid-serving. The fixed scenarios of ``test_vllm_integration.py``,
``test_vllm_lifecycle.py`` and ``test_vllm_rebuild.py`` each pick one combination; these mix them.

- ``policy: fifo`` makes vLLM's native HiSparse decisions: every step's scheduler output, connector metadata
  and kept state (``vllm_harness.run_recording``) equal vLLM's own coordinator's on the same trace;
- every policy, alone or beside the offloading connector, keeps the page lifecycle's invariants
  (``test_vllm_lifecycle.lifecycle_violations``) after every step; the harness checks, as in every run, that
  the recorded rows are vLLM's (``check_rows``) and that every row the fake forward reads is the one written.
  Where the trace draws it, vLLM's recovery (``reset_prefix_cache``) runs with transfers in flight: in a
  synchronous engine the worker has died and is rebuilt, the reset must succeed, and every row read after it
  is checked against what the new worker wrote; under async scheduling vLLM refuses it while a step is in
  flight, and serving goes on.

The seeds here were chosen out of a sweep that passed, to cover those features between them
(``test_the_seeds_cover_what_they_are_for``). ``HISPARSE_TRACE_SEEDS=0-400`` runs every test over those seeds
instead (a wider sweep: about 10 s a seed here).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest

H = pytest.importorskip("vllm_harness")
pytest.importorskip("vllm")
import test_vllm_lifecycle as L  # noqa: E402  (after the skips: it needs vLLM too)

pytestmark = pytest.mark.vllm


@dataclass
class Trace:
    """What one seed draws: ``vllm_harness.build``'s options, the jobs and ``run``'s follow-ups and aborts."""

    build: dict
    jobs: list
    then: dict = field(default_factory=dict)
    aborts: dict = field(default_factory=dict)
    completion_lag: int = 0
    top_k: int = 2048
    reset_from: int | None = None  # vLLM's reset at the first step from this one with transfers in flight


def draw(seed: int, *, checked: bool = False) -> Trace:
    """The trace of ``seed``: under ``policy: fifo`` alone, or (``checked``) with a policy and the offloading
    connector drawn too."""
    rng = random.Random(seed)
    policy, offload = "fifo", False
    if checked:
        policy, offload = rng.choice(["coldest", "coldest", "fifo"]), rng.random() < 0.3
    mtp = rng.choice([0, 0, 3])
    build = dict(gpu_gib=rng.choice([0.7, 0.9, 1.3]), max_model_len=8192, host_pool_gib=rng.choice([6, 20, 40]),
                 async_scheduling=rng.random() < 0.5, num_spec_tokens=mtp,
                 prefix_caching=offload or rng.random() < 0.7, max_num_batched_tokens=rng.choice([2048, 8192]),
                 max_num_seqs=rng.choice([8, 32]), extra={"policy": policy, "heat_interval": rng.choice([2, 4, 32])})
    if offload:
        build.update(offload_gib=rng.choice([0.25, 1.0]), offload_first=rng.random() < 0.5)
    trace = Trace(build, [], completion_lag=rng.choice([0, 1, 2, 3]), top_k=512 if mtp else 2048)
    shared = H.prompt(1000 + seed, rng.choice([1024, 2048, 3000]))
    for i in range(rng.randint(3, 10)):
        head = shared if rng.random() < 0.4 else None
        length = rng.randint(300, 6500) if head is None else len(head) + rng.randint(1, 2000)
        prompt = H.prompt(100 * seed + i, min(length, 7000), head)
        new_tokens = rng.choice([rng.randint(2, 30), rng.randint(60, 200)])
        trace.jobs.append(H.Job(f"r{i}", prompt, new_tokens, arrival=rng.randint(0, 25)))
        if rng.random() < 0.3:
            follow = prompt + H.prompt(1000 * seed + i, rng.randint(10, 400))
            trace.then[f"r{i}"] = H.Job(f"r{i}t", follow[:7600], rng.randint(2, 40))
        if rng.random() < 0.15:
            trace.aborts[f"r{i}"] = rng.randint(0, 30)
    # Drawn last, so that adding it changed no seed's other draws. Not beside the offloading connector, whose
    # own jobs in flight a dead worker would take with it.
    if checked and not offload and rng.random() < 0.5:
        trace.reset_from = rng.randint(5, 60)
    return trace


def _build(trace: Trace, monkeypatch, **overrides):
    # MTP's hot regions at top-K 2,048 cost more than these short requests hold: none would take one.
    monkeypatch.setattr(H, "TOP_K", trace.top_k)
    return H.build(**{**trace.build, "mode": "hisparse", **overrides})


def _seeds(chosen: list[int]) -> list[int]:
    sweep = os.environ.get("HISPARSE_TRACE_SEEDS")
    if not sweep:
        return chosen
    first, _, last = sweep.partition("-")
    return list(range(int(first), int(last or first) + 1))


FIFO_SEEDS = [52, 74, 76, 84, 117, 121]
CHECKED_SEEDS = [5, 6, 7, 13, 30, 43]


#: Steps after which a run is taken never to finish: several times the longest a trace here takes to finish.
MAX_STEPS = 3000


def _recordings(seed: int, monkeypatch) -> list[tuple[bool, list]]:
    """The fifo trace of ``seed`` through vLLM's coordinator, then ours: whether each run finished within
    ``MAX_STEPS``, and its recording (``vllm_harness.run_recording``) of every step it ran."""
    trace = draw(seed)
    runs = []
    for mode in ("native", "hisparse"):
        setup = _build(trace, monkeypatch, mode=mode, extra=None if mode == "native" else trace.build["extra"])
        try:
            _, recording = H.run_recording(setup, trace.jobs, completion_lag=trace.completion_lag,
                                           num_spec_tokens=trace.build["num_spec_tokens"], then=trace.then,
                                           aborts=trace.aborts, max_steps=MAX_STEPS)
            runs.append((True, recording))
        except H.NotDone as e:
            runs.append((False, e.recording))
    return runs


@pytest.mark.parametrize("seed", _seeds(FIFO_SEEDS))
def test_fifo_makes_vllms_decisions_on_random_traces(monkeypatch, seed):
    """Step by step, until both finish or neither has (vLLM's HiSparse can admit and preempt a request forever:
    ``test_coldest_finishes_a_trace_vllms_hisparse_never_does``)."""
    (done, theirs), (we_done, ours) = _recordings(seed, monkeypatch)
    for kind, a, b in zip(("sent", "kept"), theirs, ours, strict=True):
        assert len(a) == len(b), f"{kind}: {len(a)} steps against {len(b)}"
        for step, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x == y, f"step {step} differs ({kind})"
    assert we_done == done


def _resets(setup, worker, first: int):
    """``_run_checked``'s ``between_steps``: at the first step from ``first`` whose transfers are in flight, the
    scheduler is told that the KV its workers hold is gone, as vLLM's engine tells it
    (``reset_prefix_cache(reset_running_requests=True, reset_connector=True)``, ``test_vllm_rebuild.py``).
    Synchronous: the worker has died and is rebuilt, the reset must succeed, and the dead worker's late report
    rides the next step's output. Asynchronous: the worker lives (a reset after a weight update); with a step
    in flight vLLM defers the preempted requests' frees and refuses the reset (``RuntimeError``,
    ``Bookkeeping.forget_worker_state``), and serving goes on."""
    sched = setup.scheduler
    live = bool(setup.vllm_config.scheduler_config.async_scheduling)
    done = []

    def between_steps(step: int) -> bool:
        if step < first or done or not worker.in_flight():
            return False
        done.append(step)
        try:
            reset = sched.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        except RuntimeError:
            if not live:
                raise
            return True  # refused (docstring): serving goes on, checked from here as before
        if not live:
            assert reset, f"step {step}: vLLM's reset failed with nothing but transfers in flight"
            dead = worker.rebuild()
            worker.deliver_late(dead.late_report())
        return True

    return between_steps


def _run_checked(seed: int, monkeypatch) -> tuple[Trace, object]:
    """The checked trace of ``seed``, the lifecycle checked after every step (``test_vllm_lifecycle``; the
    harness checks the recorded rows and every row read), reset where the trace says: the trace, and the run's
    stats or None when it had not finished after ``MAX_STEPS``."""
    trace = draw(seed, checked=True)
    setup = _build(trace, monkeypatch)
    worker = H.FakeWorker(setup, layers=[0, 60], completion_lag=trace.completion_lag)
    reset = None if trace.reset_from is None else _resets(setup, worker, trace.reset_from)
    try:
        stats, _ = L._run_checked(setup, worker, trace.jobs, between_steps=reset, max_steps=MAX_STEPS,
                                  num_spec_tokens=trace.build["num_spec_tokens"], then=trace.then,
                                  aborts=trace.aborts)
    except H.NotDone:
        return trace, None
    return trace, stats


@pytest.mark.parametrize("seed", _seeds(CHECKED_SEEDS))
def test_every_policy_keeps_the_lifecycle_on_random_traces(monkeypatch, seed):
    """And coldest finishes every trace (fifo, making vLLM's decisions, may not:
    ``test_coldest_finishes_a_trace_vllms_hisparse_never_does``)."""
    trace, stats = _run_checked(seed, monkeypatch)
    if stats is None:
        assert trace.build["extra"]["policy"] == "fifo", "coldest never finished the trace"
        return
    assert stats.rows_checked > 0


def test_the_seeds_cover_what_they_are_for():
    """Between them, the chosen seeds draw every feature the module docstring lists (what each run then hit,
    preemptions, host reads, prefix hits and its reset, was read from the sweep they were chosen from: seed 30
    rebuilds its worker, seed 6 has its reset refused)."""
    fifo = [draw(seed) for seed in FIFO_SEEDS]
    checked = [draw(seed, checked=True) for seed in CHECKED_SEEDS]
    for traces in (fifo, checked):
        builds = [t.build for t in traces]
        assert {b["num_spec_tokens"] for b in builds} == {0, 3}
        assert {b["async_scheduling"] for b in builds} == {False, True}
        assert any(t.aborts for t in traces) and any(t.then for t in traces)
        assert any(t.completion_lag >= 2 for t in traces)
    assert not all(t.build["prefix_caching"] for t in fifo)
    assert {t.build["extra"]["policy"] for t in checked} == {"coldest", "fifo"}
    assert {t.build.get("offload_first") for t in checked} >= {True, False}
    assert {t.build["async_scheduling"] for t in checked if t.reset_from is not None} == {False, True}


#: A sweep's trace on which vLLM's HiSparse never finishes (fifo neither, making its decisions).
NEVER_FINISHES = 533


@pytest.mark.parametrize("policy", ["native", "fifo", "coldest"])
def test_coldest_finishes_a_trace_vllms_hisparse_never_does(monkeypatch, policy):
    """Seed 533 (async, 0.7 GiB, no prefix caching, 2,048-token chunks): two running requests each wait for a
    hot region the pool cannot grant beside their next chunk, holding their pages. vLLM's HiSparse admits the
    waiting follow-up turn ``r5t`` into the blocks left (it counts released pages as free), cannot then grow the
    others, preempts ``r5t``, and admits it again, every three steps, forever. coldest defers that admission
    while the pool lacks the regions owed to running requests (``PoolPolicy.admit``), moves a request to a region
    only once it pays (``PoolPolicy.transition``), and finishes the trace without a preemption, every row read
    right."""
    trace = draw(NEVER_FINISHES)
    extra = None if policy == "native" else {**trace.build["extra"], "policy": policy}
    setup = _build(trace, monkeypatch, mode="native" if policy == "native" else "hisparse", extra=extra)
    worker = H.FakeWorker(setup, layers=[0, 60], completion_lag=trace.completion_lag)
    run = dict(num_spec_tokens=trace.build["num_spec_tokens"], then=trace.then, aborts=trace.aborts, max_steps=700)
    if policy != "coldest":
        with pytest.raises(H.NotDone):
            H.run(setup, worker, trace.jobs, **run)
        assert setup.scheduler.requests["r5t"].num_preemptions > 50
        return
    stats = H.run(setup, worker, trace.jobs, **run)
    assert stats.preemptions == 0 and stats.rows_checked > 0 and stats.rows_from_host > 0
    assert setup.scheduler.connector.coordinator.counters["admissions_deferred"] > 0
