"""A vLLM worker that dies and is rebuilt mid-serving (issue 15), through vLLM 0.33.0's real scheduler on CPU.

vLLM restarts a worker as a new process: its GPU KV cache, its pinned host pool (vLLM's HiSparse worker
allocates it), its residency tables, hot buffers and the transfers it had in flight are gone, and the hisparse
state that matters is the scheduler's. vLLM's recovery for "the KV the workers hold is gone" is
``Scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)``: every running request is
preempted (it recomputes), both pools' prefix caches are reset, and the connector's ``reset_cache()`` runs.

The scenario (``_serve_and_rebuild``): requests under pressure, some with a shared prefix, read from the host
pool while transfers complete two steps late (``completion_lag``); at the first step with transfers in flight
on the worker and pending in the scheduler, the worker is rebuilt (``FakeWorker.rebuild``: zeroed slab and
host pool, empty tables), the engine calls the recovery, the dead worker's late report (every transfer it had
in flight, enqueued and completed) rides the next step's output, and new requests sharing the prefix arrive
after. The harness checks every row read against what was written, so a page the dead worker held, read as
valid, fails the run.
"""

from __future__ import annotations

import numpy as np
import pytest

H = pytest.importorskip("vllm_harness")
pytest.importorskip("vllm")

from test_vllm_defaults import check_everything_returned, check_no_block_held_twice  # noqa: E402

pytestmark = pytest.mark.vllm

LAYERS = [0, 60]


def _jobs() -> list:
    shared = H.prompt(500, 2048)
    # Most end a token or two past a page boundary: they finish with the last page's copy in flight, and
    # their prefix waits on it (vLLM's detached publication).
    first = [H.Job(f"w{i}", H.prompt(i, 5000 + 64 * i, shared if i % 2 else None), 56 + i % 3, arrival=2 * i)
             for i in range(5)]
    # After the rebuild (which comes at about step 60): the shared prefix again, whose host copy is gone.
    late = [H.Job(f"n{i}", H.prompt(50 + i, 4500, shared), 16, arrival=80 + 5 * i) for i in range(2)]
    return first + late


def _expected_output(job) -> list[int]:
    """The fake model's greedy continuation (``vllm_harness.next_token``), whatever was recomputed."""
    h = H.prefix_hashes(np.asarray(job.prompt))[-1]
    out = []
    for _ in range(job.max_tokens):
        t = H.next_token(h)
        out.append(t)
        h = H.prefix_hashes(np.asarray([t]), h)[0]
    return out


def _detached(coord) -> bool:
    """Whether a finished request's prefix waits on its copies (vLLM's detached publication)."""
    return any(detached for *_, detached in H.lifecycle(coord)["transfers"])


def _serve_and_rebuild(mode: str, policy: str = "coldest", *, detached: bool = False) -> dict:
    """Runs the scenario (module docstring); returns its figures. ``detached``: rebuild only once a finished
    request's prefix also waits on copies in flight. An exception out of the recovery call is
    recorded in ``figures["reset_error"]`` and serving goes on, as vLLM's engine core does after a failed
    utility call (it logs it and returns the failure to the caller)."""
    setup = H.build(mode=mode, gpu_gib=0.9, max_model_len=8192, host_pool_gib=24,
                    extra={"policy": policy} if mode == "hisparse" else None)
    sched = setup.scheduler
    connector = sched.connector
    coord = connector.coordinator if mode == "hisparse" else connector.connector_scheduler.coordinator
    worker = H.FakeWorker(setup, layers=LAYERS, completion_lag=3)
    jobs = _jobs()
    figures: dict = {"reset_error": None}
    outputs: dict[str, list[int]] = {job.req_id: [] for job in jobs}
    finished: dict[str, object] = {}
    first_after: dict[str, int] = {}  # preempted request -> tokens computed when it was next scheduled

    update = sched.update_from_output

    def update_from_output(so, out):
        result = update(so, out)
        for engine_outputs in result.values():
            for o in engine_outputs.outputs:
                outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.request_id] = o.finish_reason
        return result

    schedule = sched.schedule

    def schedule_and_note_resumptions():
        so = schedule()
        if "preempted" in figures:
            computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
            cached = so.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for rid in figures["preempted"]:
                if rid in computed and rid not in first_after:
                    first_after[rid] = computed[rid]
        return so

    sched.update_from_output = update_from_output
    sched.schedule = schedule_and_note_resumptions

    def on_step(step):
        if mode == "hisparse":
            check_no_block_held_twice(setup)
        # Under pressure (requests reading from the host, two running, one waiting), copies in flight.
        if "step" in figures or not worker.stats.rows_from_host or len(sched.running) < 2 or not sched.waiting \
                or not H.lifecycle(coord)["transfers"] or not worker.in_flight() or detached and not _detached(coord):
            return
        figures.update(step=step, running=len(sched.running), waiting=len(sched.waiting),
                       pending=len(H.lifecycle(coord)["transfers"]), detached=_detached(coord),
                       rows_before=worker.stats.rows_checked, host_rows_before=worker.stats.rows_from_host,
                       preempted=[r.request_id for r in sched.running])
        dead = worker.rebuild()
        try:
            figures["reset"] = sched.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        except Exception as e:  # noqa: BLE001 - vLLM's engine core catches it too (docstring)
            figures["reset_error"] = e
        worker.deliver_late(dead.late_report())

    try:
        stats = H.run(setup, worker, jobs, on_step=on_step)
    except H.CheckFailed as e:
        figures["check_failed"] = e
        stats = worker.stats
    figures.update(setup=setup, coord=coord, stats=stats, jobs=jobs, outputs=outputs, finished=finished,
                   first_after=first_after)
    return figures


@pytest.mark.parametrize("policy,detached", [("coldest", True), ("fifo", False), ("fifo", True)],
                         ids=["coldest-detached-prefix", "fifo", "fifo-detached-prefix"])
def test_rebuilt_worker_resumes_under_pressure_with_copies_in_flight(policy, detached):
    """hisparse's connector (either policy; ``fifo`` makes vLLM's own decisions, and rebuilds at the same step
    as the test below): vLLM's recovery call succeeds with transfers in flight, the dead worker's late report
    is ignored, every request finishes with its full output (those preempted by the reset recomputed from
    token 0: no prefix, host or GPU, of the dead worker is hit), every row read is what was written, and
    every block and every piece of state comes back. ``detached``: also with a finished request's prefix
    waiting on copies the dead worker will never report (it is dropped unpublished)."""
    f = _serve_and_rebuild("hisparse", policy, detached=detached)
    assert "step" in f, "no step was under pressure with copies in flight"
    assert "check_failed" not in f, f["check_failed"]
    assert f["reset_error"] is None and f["reset"] is True
    stats, coord = f["stats"], f["coord"]
    assert stats.rebuilds == 1 and stats.transfers_lost > 0
    assert coord.counters["transfers_dropped"] == f["pending"] and f["detached"] >= detached
    assert coord.counters["late_transfer_reports"] > 0, "the dead worker's late report never arrived"
    for job in f["jobs"]:
        assert f["finished"].get(job.req_id) is not None, f"{job.req_id} never finished"
        assert f["outputs"][job.req_id] == _expected_output(job), f"{job.req_id}: wrong or missing tokens"
    assert set(f["first_after"]) == set(f["preempted"]), "a preempted request was never scheduled again"
    assert not any(f["first_after"].values()), f"resumed from a stale prefix: {f['first_after']}"
    assert stats.rows_checked > f["rows_before"] and stats.rows_from_host > f["host_rows_before"], \
        "the new worker read nothing from its host pool"
    check_everything_returned(f["setup"])
    print(f"\n{policy}: rebuild at step {f['step']} of {stats.steps} ({f['waiting']} requests waiting): "
          f"{len(f['preempted'])} requests preempted by the "
          f"reset, {coord.counters['transfers_dropped']} transfers dropped ({stats.transfers_lost} in flight on "
          f"the worker; a finished request's prefix waiting on them: {f['detached']}), "
          f"{coord.counters['late_transfer_reports']} late transfer reports ignored; "
          f"{stats.rows_checked:,} rows checked ({stats.rows_checked - f['rows_before']:,} after the rebuild, "
          f"{stats.rows_from_host - f['host_rows_before']:,} of them from the new host pool)")


def test_vllms_own_connector_cannot_recover_a_rebuilt_worker():
    """vLLM's own HiSparseConnector in the same scenario (a reproducer). Its coordinator keeps the pins of the
    transfers in flight until a worker reports them, which a dead one never does, and it has no
    ``reset_cache``: vLLM's pool reset finds blocks in use and ``reset_prefix_cache`` raises RuntimeError,
    after the running requests were preempted and with both prefix caches left as they were. An engine that
    goes on serving (vLLM's engine core returns the error to the caller and keeps stepping) then hits the
    prefixes the dead worker held and reads rows the new worker never wrote."""
    f = _serve_and_rebuild("native")
    assert f["pending"] > 0
    assert isinstance(f["reset_error"], RuntimeError) and "Failed to reset KV cache" in str(f["reset_error"])
    assert isinstance(f.get("check_failed"), H.CheckFailed), "expected a stale row to be read"
    assert "differ from what was written" in str(f["check_failed"])
    print(f"\nvLLM's connector: rebuild at step {f['step']}, {f['pending']} transfers pending; reset raised "
          f"{f['reset_error']!r}; then {f['check_failed']}")


def test_a_reset_that_cannot_succeed_changes_nothing():
    """With requests running (no preemption asked for), vLLM's reset fails, its pools being in use, and so
    does the connector's: the transfers in flight keep their pins and every request its state; serving goes
    on and everything comes back."""
    setup = H.build(mode="hisparse", gpu_gib=0.9, max_model_len=8192, host_pool_gib=24)
    sched = setup.scheduler
    coord = sched.connector.coordinator
    worker = H.FakeWorker(setup, layers=LAYERS, completion_lag=3)
    tried = []

    def snapshot():
        book = H.lifecycle(coord)
        return (book["transfers"], sorted(book["requests"]), sched.kv_cache_manager.block_pool
                .get_num_free_blocks(), coord.host_manager.block_pool.get_num_free_blocks(), len(sched.running))

    def on_step(step):
        if tried or not H.lifecycle(coord)["transfers"] or not sched.running:
            return
        before = snapshot()
        tried.append((sched.reset_prefix_cache(reset_connector=True), sched.connector.reset_cache()))
        assert snapshot() == before
        assert coord.counters["transfers_dropped"] == 0

    stats = H.run(setup, worker, [H.Job(f"r{i}", H.prompt(i, 5000), 16, arrival=2 * i) for i in range(3)],
                  on_step=on_step)
    assert tried == [(False, False)]
    assert stats.rows_checked > 0
    check_everything_returned(setup)


def test_heat_of_a_row_that_changes_hands_in_a_reset_is_not_carried_over():
    """``reset_prefix_cache(reset_running_requests=True, reset_connector=True)`` on a live worker (vLLM's recovery
    after a weight update) preempts every running request; they come back together, in the same order, and the
    worker gives them state rows again, some another's. The worker's selection heat (``policy: coldest``, a
    summary every step) then starts each such row cold: the batch's ids alone would not show the change."""
    setup = H.build(mode="hisparse", gpu_gib=0.8, max_model_len=8192, host_pool_gib=20,
                    extra={"policy": "coldest", "heat_interval": 1})
    sched = setup.scheduler
    worker = H.FakeWorker(setup, layers=[0], completion_lag=1)
    heat = worker.selection_heat
    owners: dict[int, str] = {}  # state row -> the request it served in the last forward
    last = {"ids": None}
    moved = []  # forwards whose batch is the last one's ids on other rows: (heat in the moved rows)
    begin = heat.begin_step

    def begin_step(ids, rows, updates, joined=True):
        begin(ids, rows, updates, joined)
        served = dict(zip(rows.tolist(), ids, strict=False))
        changed = [row for row, rid in served.items() if owners.get(row, rid) != rid]
        if tuple(ids) == last["ids"] and changed:
            moved.append(sum(int(heat.heat[row].sum()) for row in changed))
        owners.update(served)
        last["ids"] = tuple(ids)

    heat.begin_step = begin_step

    def on_step(step):
        if step in (12, 25):
            assert sched.reset_prefix_cache(reset_running_requests=True, reset_connector=True)

    jobs = [H.Job(f"r{i}", H.prompt(i, 300 + 100 * i), 60, arrival=0) for i in range(3)]
    stats = H.run(setup, worker, jobs, on_step=on_step)
    assert stats.rows_checked and moved, "no forward re-ran the same batch on other rows"
    assert moved == [0] * len(moved)
    check_everything_returned(setup)
