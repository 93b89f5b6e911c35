"""vLLM 0.33.0's scheduler step with hisparse's coordinator vs vLLM's native HiSparse vs vLLM alone: same
trace, same run.

For N = 32 and 128 requests of 64K-token prompts, each mode (``hisparse``, ``native``: vLLM's HiSparseConnector,
``plain``: vLLM without HiSparse) runs vLLM's real ``Scheduler`` (the CPU harness of ``tests/vllm_harness.py``,
bookkeeping only: no KV data) in the same KV memory, a pool that holds a third of the requests fully resident,
until the batch stops growing, then times ``schedule()`` + ``update_from_output()`` over decode steps, in thread
CPU time. vLLM alone runs only the requests that fit, so compare its step with the others' per running request
too. Prints one JSON line: per N and mode, the median, mean and longest step in microseconds, the mean number of
running requests while timed, the median step per running request, and for the HiSparse modes the median of the
part of the step spent in the HiSparse connector's own bookkeeping (``connector_median_us``, and per running
request). That part is every call vLLM's scheduler and KV cache manager make into the HiSparse connector and
coordinator: the connector's scheduler side (``get_num_new_matched_tokens``, where hisparse decides admissions,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``, ``get_kv_connector_stats``,
``request_finished_all_groups``); the HiSparse host group's ``cache_blocks``, which vLLM's KV cache manager calls
for every request every step and which hands it to the coordinator's ``publish_when_ready``; the coordinator's
``_on_block_reused`` (when the pool hands out a released page's block), ``free``, ``commit_computed_blocks`` and
``record_pending_host_import``; and for hisparse the record of each allocation's new blocks in the core
(``_RowRecorder.allocated``). hisparse replaces vLLM's scans there. The rest of the step is vLLM's scheduler and
KV cache manager, the same code in both, but for hisparse's wraps of vLLM's objects, which only the step counts:
the call each scheduled request makes through the wrap of the allocation (under ``coldest``, while a short request
restored whole runs or one is being admitted, through those of ``allocate_slots`` and of the block count too), and
those around vLLM's rare row changes (admissions, copy-on-write, adoptions and frees). At the defaults both modes
make the same calls (as many frees, as many released blocks handed out); where ``coldest`` decides otherwise than
vLLM (other contexts, waiting requests), the figure holds those decisions' work too, and ``policy: fifo`` would
compare bookkeeping alone. Then hisparse's over native's per running request (``hisparse_over_native``), and the
mean per running request beside the median (``connector_mean_...``: a step in which a request seals a page, its
host copy planned and completed, its GPU copy indexed, an older page released, costs several times one in which
none does; at N = 32 about half the steps are such steps, so there the median falls anywhere between the two
kinds, where the mean is the CPU the connector takes; ``connector_by_step`` gives each kind's mean apart), and the
median bytes and time of pickling the connector metadata as vLLM's multi-process executor sends it to its workers
(``metadata_bytes``, ``metadata_pickle_us``: scheduler CPU this harness's in-process worker does not pay).
Nothing is read here, so every heat summary (every 32 steps; 64 timed steps hold two) lists every request's
pages as never selected: the longest list a summary can bring. The longest step over the median is printed for
every mode (``longest_over_median``, and which of the timed steps, counted from 0 in every mode alike, were the
three longest: ``longest_steps``), for the connector part alone (``connector_longest_over_median``), and for
hisparse the longest a heat summary took to apply (``heat_summary_max_us``, thread CPU, within the connector
part). The trace's requests start together and seal their pages in nearby steps, so its longest steps hold
vLLM's own work for many requests at once: read hisparse's beside native's.

With ``--breakdown``, each HiSparse mode also prints where its connector part goes (``breakdown``: per label,
the median and mean microseconds a step and the calls a step, each call timed whole, callees included, and only
when made from within the connector part): by which of vLLM's calls into the connector it was spent in
(``entry.*``, the timed calls above: their sums are the connector part), the coordinator's phases
(``coordinator.*``: hisparse's scan in the core, and the phases vLLM's connector calls in both modes), and vLLM's
own calls that either coordinator must make for the same decisions (``vllm.*``: the GPU and host pools' touch,
free and release, the host prefix cache's publication, the resident rows' page drops and adoptions, the hot
regions asked for), with their sum per running request (``vllm_calls_mean_us_per_running``): what no rewrite of
the bookkeeping can take off. Those timers cost time too: compare modes within a --breakdown run, and take the
headline figures from a run without it.

With ``--repeat R``, the trace runs R times (fresh engines each time, every mode stepped in turn as above), and
every figure is taken from each timed step's least time over the runs (``fastest``): the runs schedule the same
requests step by step (checked), so what a busy machine adds to a step, the least run of it has least of. Its
longest step is then the step that does the most work, not the one a burst of other work on the machine hit.

    .venv/bin/python benches/vllm_step.py [--steps 64] [--n 32 128] [--modes hisparse native plain]
                                          [--context 16384 131072] [--breakdown] [--repeat 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import vllm_harness as H  # noqa: E402

CONTEXT = 65536


class Engine:
    """One vLLM scheduler (``mode``) with N requests of ``context`` tokens and a bookkeeping-only fake worker."""

    def __init__(self, mode: str, n: int, context: int = CONTEXT, breakdown: bool = False):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        # A GPU pool that holds a third of the requests fully resident (the rest must read through hot
        # regions), and a host pool that holds them all (2.6 GiB of 656-byte rows per 64K request).
        page_bytes = 7 * 515328  # one block per resident group (6) and the indexer, DeepSeek-V3.2
        gpu_gib = n / 3 * (context // H.BLOCK + 2) * page_bytes / 2**30
        self.setup = H.build(mode=mode, gpu_gib=gpu_gib, max_model_len=context + 1024, max_num_seqs=n,
                             max_num_batched_tokens=65536, host_pool_gib=n * 2.7 * context / CONTEXT + 4)
        self.worker = H.FakeWorker(self.setup, data=False)
        self.sched = self.setup.scheduler
        for i in range(n):
            params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
            self.sched.add_request(Request(f"r{i}", H.prompt(i, context), params, None,
                                           block_hasher=self.setup.block_hasher))
        self.times: list[float] = []
        self.running: list[int] = []
        # What each kept timed step scheduled (its number among the timed steps, running, tokens, new and
        # resumed requests): runs of one trace must agree on it before their times are compared step by step
        # (``fastest``). Only decode steps are kept, so the numbers say which steps the kept ones were.
        self.trace: list[tuple[int, int, int, int, int]] = []
        self.timed_steps = 0
        self.most = self.settled = 0
        self.in_connector = 0.0  # seconds spent in the connector's bookkeeping during the current step
        self.depth = 0  # timed calls under way: one made from another is counted in the outer one
        self.connector_times: list[float] = []
        self.breakdown = breakdown
        self.metadata: list[tuple[int, float]] = []  # (pickled bytes, seconds to pickle) per timed step
        self.transfers: list[int] = []  # host copies planned in each kept timed step
        connector = self.sched.connector
        self.has_connector = connector is not None
        self.coordinator = connector.connector_scheduler.coordinator if connector is not None else None
        if connector is not None:
            # Once per step: thread CPU time, which a machine shared with other jobs does not inflate. Once
            # per request: the wall clock, whose read costs a quarter of the thread clock's (a system call of
            # about 0.5 us here, as much as hisparse's whole call), and which a call this short rarely loses
            # to another thread.
            coordinator = self.coordinator
            per_request = time.perf_counter
            for owner, clock, names in (
                    (connector, time.thread_time,
                     ("build_connector_meta", "update_connector_output", "get_kv_connector_stats")),
                    (connector, per_request,
                     ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished_all_groups")),
                    (coordinator, per_request,
                     ("_on_block_reused", "free", "commit_computed_blocks", "record_pending_host_import")),
                    (coordinator.host_manager, per_request, ("cache_blocks",)),
                    (getattr(coordinator, "_recorder", None), per_request, ("allocated",))):  # hisparse's only
                for name in names if owner is not None else ():
                    setattr(owner, name, self._timed(getattr(owner, name), clock, f"entry.{name}"))
            if callable(getattr(coordinator, "report_heat", None)):
                coordinator.report_heat = self._heat_timed(coordinator.report_heat)
            if breakdown:
                for label, owner, name in breakdown_calls(coordinator):
                    setattr(owner, name, self._part(label, getattr(owner, name)))
        self.timing = False  # whether the current step is a timed one
        self.heat_times: list[float] = []  # thread CPU of each heat summary the coordinator applied in timed steps
        self.step_parts: dict[str, list] = {}  # label -> [seconds, calls] in the current step (--breakdown)
        self.parts: list[dict[str, list]] = []  # step_parts of each timed step

    def _timed(self, method, clock, label: str):
        """``method`` counted in the connector part (under ``label`` too with ``--breakdown``), unless called
        from within a call counted already."""
        def timed(*args, **kwargs):
            if self.depth:
                return method(*args, **kwargs)
            self.depth += 1
            t0 = clock()
            try:
                return method(*args, **kwargs)
            finally:
                spent = clock() - t0
                self.in_connector += spent
                self.depth -= 1
                if self.breakdown:
                    self._add_part(label, spent)

        return timed

    def _heat_timed(self, method):
        def timed(report):
            t0 = time.thread_time()
            try:
                return method(report)
            finally:
                if self.timing:
                    self.heat_times.append(time.thread_time() - t0)

        return timed

    def _part(self, label: str, method):
        """``method`` timed under ``label`` when called from within the connector part (``--breakdown``)."""

        def timed(*args, **kwargs):
            if not self.depth:
                return method(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._add_part(label, time.perf_counter() - t0)

        return timed

    def _add_part(self, label: str, seconds: float) -> None:
        """One call of ``seconds`` under ``label`` in the current step's breakdown."""
        part = self.step_parts.setdefault(label, [0.0, 0])
        part[0] += seconds
        part[1] += 1

    def step(self, timed: bool) -> None:
        self.timing = timed
        t0 = time.thread_time()
        self.in_connector = 0.0
        self.step_parts = {}
        planned = self.coordinator.next_spill_id if self.coordinator is not None else 0
        so = self.sched.schedule()
        t1 = time.thread_time()
        in_schedule = self.in_connector
        out = self.worker.execute(so)
        t2 = time.thread_time()
        self.in_connector = in_schedule  # the worker's calls are not the scheduler's
        self.sched.update_from_output(so, out)
        t3 = time.thread_time()
        now = len(so.num_scheduled_tokens)
        self.timed_steps += timed
        self.settled = self.settled + 1 if now <= self.most else 0
        self.most = max(self.most, now)
        if timed and now and all(v == 1 for v in so.num_scheduled_tokens.values()):
            self.times.append((t1 - t0) + (t3 - t2))
            self.running.append(now)
            self.trace.append((self.timed_steps - 1, now, so.total_num_scheduled_tokens, len(so.scheduled_new_reqs),
                               len(so.scheduled_cached_reqs.resumed_req_ids)))
            self.connector_times.append(self.in_connector)
            self.parts.append(self.step_parts)
            if self.coordinator is not None:
                self.transfers.append(self.coordinator.next_spill_id - planned)
            if so.kv_connector_metadata is not None:
                t = time.thread_time()
                size = len(pickle.dumps(so.kv_connector_metadata, protocol=pickle.HIGHEST_PROTOCOL))
                self.metadata.append((size, time.thread_time() - t))

    @property
    def ready(self) -> bool:
        """Admissions have stopped growing the batch for 20 steps."""
        return self.settled > 20


MODES = ("hisparse", "native", "plain")


def breakdown_calls(coordinator) -> list[tuple[str, object, str]]:
    """``(label, owner, method)`` of the calls ``--breakdown`` times within the connector part (module
    docstring): the coordinator's phases, then vLLM's own calls (labels ``vllm.*``), in every manager."""
    out = [(f"coordinator.{name}", coordinator, name)
           for name in ("scan", "advance_scheduled", "take_residency_updates", "update_spills", "_lose_page",
                        "publish_when_ready", "build_row_mirrors", "all_context_pages_resident")
           if hasattr(coordinator, name)]
    host = coordinator.host_manager
    out += [(f"vllm.gpu_pool.{name}", coordinator.gpu_pool, name) for name in ("touch", "free_blocks", "unpin_blocks")]
    out += [(f"vllm.host_pool.{name}", host.block_pool, name) for name in ("touch", "free_blocks")]
    out.append(("vllm.host.publish_blocks", host, "publish_blocks"))
    out += [(f"vllm.resident.{name}", manager, name) for manager in coordinator.resident_managers
            for name in ("drop_resident_page", "adopt_resident_page")]
    out += [("vllm.hot.require_hot", manager, "require_hot") for manager in coordinator.hot_managers]
    return out


def breakdown_of(engine: Engine) -> dict:
    """Per label: median and mean microseconds a timed step, and calls a step (``--breakdown``)."""
    out = {}
    for label in sorted({label for parts in engine.parts for label in parts}):
        times = [parts.get(label, (0.0, 0))[0] * 1e6 for parts in engine.parts]
        calls = [parts.get(label, (0.0, 0))[1] for parts in engine.parts]
        out[label] = [round(statistics.median(times), 1), round(statistics.mean(times), 1),
                      round(statistics.mean(calls), 2)]
    return out


def run(n: int, steps: int, modes=MODES, context: int = CONTEXT, breakdown: bool = False) -> dict[str, Engine]:
    """Every engine in one process, stepped in turn on the same trace, so that noise hits them alike; each
    returned without its scheduler (what it measured stays)."""
    from vllm.utils.gc_utils import freeze_gc_heap

    engines = {mode: Engine(mode, n, context, breakdown) for mode in modes}
    freeze_gc_heap()  # what vLLM's engine core does once it has built its KV cache manager
    for _ in range(40 * n):
        if all(e.ready for e in engines.values()):
            break
        for e in engines.values():
            e.step(timed=False)
    for _ in range(steps):
        for e in engines.values():
            e.step(timed=True)
    for e in engines.values():
        e.setup = e.worker = e.sched = e.coordinator = None
    gc.unfreeze()  # the next run's engines are built in a heap without these
    gc.collect()
    return engines


def fastest(runs: list[Engine]) -> Engine:
    """One mode's runs of the same trace as one: each timed step's figures (the step, the connector part,
    each heat summary, the pickling, each breakdown label) the least any run took. Each run does the same work
    step by step (checked: the same steps kept and requests scheduled, as many heat summaries, the same metadata
    sizes and breakdown calls), and a machine shared with other jobs only adds time to it: what stays is the
    step's own cost, its longest steps those that do the most work."""
    first = runs[0]

    def work(e: Engine) -> tuple:
        return (e.trace, e.transfers, len(e.heat_times), [size for size, _ in e.metadata],
                [{label: calls for label, (_, calls) in step.items()} for step in e.parts])

    for other in runs[1:]:
        if work(other) != work(first):
            raise RuntimeError("two runs of the same trace scheduled differently: their steps cannot be compared")

    def least(lists) -> list[float]:
        return [min(values) for values in zip(*lists, strict=True)]

    first.times = least(e.times for e in runs)
    first.connector_times = least(e.connector_times for e in runs)
    first.heat_times = least(e.heat_times for e in runs)
    pickling = least([seconds for _, seconds in e.metadata] for e in runs)
    first.metadata = [(size, seconds) for (size, _), seconds in zip(first.metadata, pickling, strict=True)]
    first.parts = [{label: [min(step.get(label, (0.0, 0))[0] for step in steps), calls]
                    for label, (_, calls) in steps[0].items()} for steps in zip(*(e.parts for e in runs), strict=True)]
    return first


def by_transfers(e: Engine) -> dict:
    """The connector part per running request (mean microseconds) in the timed steps that planned no host copy
    (``quiet``: a decode within its last page for every request) and in those that planned some (``sealing``:
    a page sealed, its copy planned, completed and published, an older page released, blocks handed out),
    with how many steps each and copies a sealing step: a step's work is mostly the one or the other."""
    kinds = {"quiet": [i for i, n in enumerate(e.transfers) if not n],
             "sealing": [i for i, n in enumerate(e.transfers) if n]}
    out = {kind: {"steps": len(steps), "mean_us_per_running": round(
               statistics.mean(e.connector_times[i] / e.running[i] for i in steps) * 1e6, 2)}
           for kind, steps in kinds.items() if steps}
    if "sealing" in out:
        out["sealing"]["copies_per_step"] = round(statistics.mean(e.transfers[i] for i in kinds["sealing"]), 2)
    return out


def measure(n: int, steps: int, modes=MODES, context: int = CONTEXT, breakdown: bool = False,
            repeat: int = 1) -> dict:
    """The figures of each mode, from ``repeat`` runs of the trace (``fastest``)."""
    runs = [run(n, steps, modes, context, breakdown) for _ in range(repeat)]
    engines = {mode: fastest([r[mode] for r in runs]) for mode in modes}
    out = {}
    for mode, e in engines.items():
        out[mode] = {"median_us": round(statistics.median(e.times) * 1e6, 1),
                     "mean_us": round(statistics.mean(e.times) * 1e6, 1), "max_us": round(max(e.times) * 1e6, 1),
                     "mean_running": round(statistics.mean(e.running), 1),
                     "median_us_per_running": round(statistics.median(t / r for t, r in zip(e.times, e.running,
                                                                                           strict=True)) * 1e6, 2),
                     "steps": len(e.times),
                     "longest_over_median": round(max(e.times) / statistics.median(e.times), 2),
                     "longest_steps": [e.trace[i][0] for i in sorted(range(len(e.times)), key=e.times.__getitem__,
                                                                       reverse=True)[:3]]}
        if e.has_connector:
            out[mode]["connector_median_us"] = round(statistics.median(e.connector_times) * 1e6, 1)
            out[mode]["connector_longest_over_median"] = round(max(e.connector_times)
                                                               / statistics.median(e.connector_times), 2)
            if e.heat_times:
                out[mode]["heat_summaries"] = len(e.heat_times)
                out[mode]["heat_summary_max_us"] = round(max(e.heat_times) * 1e6, 1)
            per_running = [t / r for t, r in zip(e.connector_times, e.running, strict=True)]
            out[mode]["connector_us_per_running"] = round(statistics.median(per_running) * 1e6, 2)
            out[mode]["connector_mean_us_per_running"] = round(statistics.mean(per_running) * 1e6, 2)
            out[mode]["connector_by_step"] = by_transfers(e)
            out[mode]["metadata_bytes"] = statistics.median(size for size, _ in e.metadata)
            out[mode]["metadata_pickle_us"] = round(statistics.median(t for _, t in e.metadata) * 1e6, 1)
            if breakdown:
                parts_us = out[mode]["breakdown"] = breakdown_of(e)
                out[mode]["vllm_calls_mean_us_per_running"] = round(
                    sum(mean for label, (_, mean, _) in parts_us.items() if label.startswith("vllm."))
                    / statistics.mean(e.running), 2)
    if "hisparse" in out and "native" in out:
        ours, theirs = out["hisparse"], out["native"]
        out["hisparse_over_native"] = {
            "connector": round(ours["connector_us_per_running"] / theirs["connector_us_per_running"], 3),
            "connector_mean": round(ours["connector_mean_us_per_running"] / theirs["connector_mean_us_per_running"], 3),
            "step": round(ours["median_us_per_running"] / theirs["median_us_per_running"], 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--n", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--context", type=int, nargs="+", default=[CONTEXT],
                    help="prompt tokens per request; several: a measurement per context (flat in context?)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the connector part's phases and vLLM's own calls within it (module docstring)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of the trace, each step's figures the least any run took (module docstring)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    result = {"context": args.context[0]} if len(args.context) == 1 else {}
    result["repeat"] = args.repeat
    for context in args.context:
        for n in args.n:
            key = f"n{n}" if len(args.context) == 1 else f"n{n}_ctx{context}"
            result[key] = measure(n, args.steps, args.modes, context, args.breakdown, args.repeat)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
