"""The step an engine pays, measured the way an engine drives hisparse: ``SchedulerHooks`` + ``WorkerHooks`` +
``DataPath`` on CPU tensors, per running request per step, p50 and p90 over every step of a decode window
(allocating steps included), and the core alone (the two ``ResidencyManager`` calls inside the hooks).

The workload, for N requests of about C tokens (block 64, top-K 2048, 4096 hot rows, one 16-byte layer):

* staggered lengths: request i holds ``C * (0.75 + 0.25 * i / N)`` tokens, so pages fill on different steps;
* a GPU pool at 30% of what full residency needs, or what every request's tail and hot region need when that
  is more (at 16K a 64-block hot region is a quarter of a request), a host pool that holds everything: most
  requests decode in mixed residency, pages are released and reused every step;
* every step each request decodes one token and the indexer stand-in selects up to 2048 positions from the
  per-page selection model of :mod:`hisparse.tools.locality`, one stream per request with its fitted
  parameters: the first 4 tokens (sinks), the last 512 (recent window), and the rest from drifting topic spans
  of 256 tokens anywhere in the history, half of the new spans ones the request read before (the model that
  puts LRU hot buffers of 1x / 4x top-K rows on the published 30% / 6.7% misses). Selections therefore recur
  from step to step, heat summaries rank pages by what is selected again, and the real resolver (the Rust
  reference of ``resolve``) runs on them, so heat, hits and misses are real. Making the selections is not
  timed (it stands for the indexer's kernel);
* the worker's copies are reported one step late;
* heat summaries every 32 steps (``WorkerHooks`` defaults: 128 coldest and 32 hottest pages per request),
  which the core's ``coldest`` policy (the default; ``--policy fifo`` for vLLM's order) releases by.

The configurations of one N are set up first, then stepped in turn, one decode step each (``run_together``):
whatever the machine does to memory over the run falls on every context alike, so the figures of 16K and 1M
compare (run one after the other, this VM's 1M figure moved up to 2x between runs of the same code). Setup
(prefill under pressure) is not timed. Timed per step: ``plan_step`` and ``apply_results``
(scheduler); ``apply``, ``slot_mapping`` (where the step writes its KV: an engine needs it every step) and
``end_step`` (worker); not the resolver, which is the GPU kernel's work (it runs between them, as the forward
does, and leaves the caches as cold as a forward would). Wall time (``time.perf_counter``): a thread's CPU
clock costs ~5 us per reading on this VM, more than what it would measure. The garbage collector is frozen
after setup, as serving engines do after start-up (else a collection of torch's objects lands on a random
step). p50 and p90 are over every timed step; the mean includes the heat summary steps (one in 32), whose
cost on CPU is the reference's scan of the heat table (on a GPU, one kernel). Prints one JSON line:
``sched_us_per_req_<N>x<C>`` (p50), ``..._p90_...``, ``..._mean_...``, ``worker_us_per_req_...``,
``core_us_per_req_...``, ``plan_bytes_...`` (the pickled WorkerStep), and the workload's counters.

    python benches/step_cost.py                  # N in {32, 128, 256} x C in {16K, 128K, 1M}
    python benches/step_cost.py --quick          # one small configuration (a smoke test)
    python benches/step_cost.py --configs 32x16k,256x1m --steps 128
    python benches/step_cost.py --quick --policy fifo   # the same selections released in vLLM's order
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pickle
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

from hisparse import DataPath, Layout, ResidencyManager
from hisparse.hooks import SchedulerHooks, WorkerHooks
from hisparse.tools import locality

BLOCK, TOP_K, HOT_ROWS, ROW_BYTES = 64, 2048, 4096, 16
clock = time.perf_counter
CHUNK = 1 << 20  # prefill tokens per setup step, over all requests


class Timed:
    """The manager behind the hooks, with its two per-step calls timed (the core alone)."""

    def __init__(self, manager: ResidencyManager):
        self._m = manager
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def __contains__(self, item):
        return item in self._m

    def plan_step(self, scheduled):
        t = clock()
        try:
            return self._m.plan_step(scheduled)
        finally:
            self.seconds += clock() - t

    def apply_results(self, completed=None, failed=None, heat=None):
        t = clock()
        try:
            return self._m.apply_results(completed, failed, heat)
        finally:
            self.seconds += clock() - t


def parse_config(text: str) -> tuple[int, int]:
    n, ctx = text.lower().split("x")
    scale = {"k": 1 << 10, "m": 1 << 20}
    return int(n), int(ctx[:-1]) * scale[ctx[-1]] if ctx[-1] in scale else int(ctx)


class Selections:
    """The indexer stand-in: one :class:`hisparse.tools.locality.SelectionStream` per request (its fitted
    parameters at top-K 2048), started at the request's length on its first decode step."""

    def __init__(self, seed: int):
        self.seed = seed
        self.streams: dict[int, locality.SelectionStream] = {}

    def __call__(self, requests: list[int], lens: list[int]) -> torch.Tensor:
        """[N, TOP_K] int32 positions (-1 pads: topic spans can overlap) for requests of lengths ``lens``."""
        out = torch.full((len(requests), TOP_K), -1, dtype=torch.int32)
        for i, (request, length) in enumerate(zip(requests, lens, strict=True)):
            stream = self.streams.get(request)
            if stream is None:
                params = locality.Params(top_k=TOP_K, context=length)
                stream = self.streams[request] = locality.SelectionStream(params, seed=self.seed * 1_000_003 + request)
            stream.length = length  # one decoded token per step keeps it there; a bench change would not
            rows = stream.select()
            out[i, : len(rows)] = torch.from_numpy(rows.astype(np.int32))
        return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Workload:
    """N requests of about C tokens behind the hooks, set up (prefilled under pressure, not timed) and stepped
    one decode step at a time (:meth:`step`, timed)."""

    def __init__(self, n: int, ctx: int, steps: int, seed: int = 0, policy: str = "coldest"):
        self.n = n
        lens0 = [int(ctx * (0.75 + 0.25 * i / max(1, n - 1))) // 1 for i in range(n)]
        max_len = max(lens0) + steps + BLOCK
        max_pages = math.ceil(max_len / BLOCK)
        hot_blocks = HOT_ROWS // BLOCK
        self.full = sum(math.ceil(length / BLOCK) for length in lens0)
        self.gpu_blocks = max(int(0.3 * self.full), n * (hot_blocks + 4)) + 2 * hot_blocks
        host_blocks = n * max_pages + 64
        layout = Layout(num_gpu_blocks=self.gpu_blocks, num_host_blocks=host_blocks, block_size=BLOCK,
                        max_model_len=max_len, max_running=n, hot_rows=HOT_ROWS, row_bytes=ROW_BYTES,
                        layer_groups=(0,))
        self.manager = ResidencyManager(num_gpu_blocks=self.gpu_blocks, num_host_blocks=host_blocks,
                                        block_size=BLOCK, max_model_len=max_len, max_running=n, top_k=TOP_K,
                                        hot_rows=HOT_ROWS, page_bytes=layout.page_bytes, materialize_budget=1 << 20,
                                        policy=policy)
        self.timed = Timed(self.manager)
        self.sched = SchedulerHooks(self.manager)
        self.sched.manager = self.timed
        self.worker = WorkerHooks(DataPath(layout))
        self.names = [f"req-{i}" for i in range(n)]
        for name, length in zip(self.names, lens0, strict=True):
            self.sched.admit(name, length, max_len=max_len)
        self.late: tuple[int, ...] = ()
        self.select = Selections(seed)
        self.timing: dict[str, list] = {k: [] for k in ("sched", "worker", "core", "resolve", "plan_bytes",
                                                        "allocating", "heat")}
        t_setup = clock()
        self._prefill(dict(zip(self.names, lens0, strict=True)))
        self.setup_s = clock() - t_setup

    def _prefill(self, left: dict[str, int]) -> None:
        """Prefill in chunks under pressure, until every request holds its prompt. A chunk the pool cannot back
        is halved; a step without tokens lets the copies (and so the releases) catch up."""
        flush = [(name, 0) for name in self.names]
        chunk = CHUNK
        while any(left.values()):
            budget, scheduled = chunk, []
            for name in self.names:
                take = min(left[name], budget)
                if take:
                    scheduled.append((name, take))
                    budget -= take
            if self._one_step(scheduled, None):
                for name, take in scheduled:
                    left[name] -= take
            else:
                chunk = max(BLOCK, chunk // 2)
                self._one_step(flush, None)
        self._one_step(flush, None)  # the last chunk's pages are copied

    def step(self) -> None:
        """One timed decode step of every request."""
        self._one_step([(name, 1) for name in self.names], self.timing)

    def _one_step(self, scheduled, timing: dict | None) -> bool:
        """plan -> apply -> (resolve) -> end_step -> apply_results, copies reported a step late. False: the
        plan was short (only while setting up; a timed step must fit)."""
        sched, worker, timed = self.sched, self.worker, self.timed
        t0 = clock()
        core0 = timed.seconds
        step = sched.plan_step(scheduled)
        t1 = clock()
        if not step.ok:
            if timing is None:
                return False
            raise RuntimeError(f"the benchmark's pool is too small: {step.missing_blocks} blocks missing")
        worker.apply(step)
        worker.slot_mapping()
        t2 = clock()
        resolved = 0.0
        if timing is not None:
            scheduled = step.plan.scheduled
            topk = self.select([r for r, _, _, _ in scheduled], [s + 1 for _, _, s, _ in scheduled])
            rows = torch.tensor(step.plan.rows, dtype=torch.int32)
            r0 = clock()
            worker.resolve(topk, rows)
            resolved = clock() - r0
        t3 = clock()
        results = worker.end_step()
        t4 = clock()
        due, self.late = self.late, results.completed  # the engine hands the copies over a step late: not timed
        results = replace(results, completed=due)
        t5 = clock()
        sched.apply_results(results)
        t6 = clock()
        if timing is not None:
            timing["sched"].append((t1 - t0) + (t6 - t5))
            timing["worker"].append((t2 - t1) + (t4 - t3))
            timing["core"].append(timed.seconds - core0)
            timing["resolve"].append(resolved)
            timing["plan_bytes"].append(len(pickle.dumps(step)))
            timing["allocating"].append(any(u[2] != 0 for u in step.plan.table_updates))
            timing["heat"].append(results.heat is not None)
        return True

    def result(self) -> dict:
        timing, n, steps = self.timing, self.n, len(self.timing["sched"])
        metrics = self.sched.metrics()
        stats = self.manager.stats()
        us = {k: [v * 1e6 / n for v in timing[k]] for k in ("sched", "worker", "core")}
        return {
            **{f"{side}_{stat}": f(us[side]) for side in ("sched", "worker", "core") for stat, f in (
                ("p50", statistics.median), ("p90", lambda v: percentile(v, 0.9)), ("mean", statistics.fmean),
                ("max", max))},
            "pool_fraction": self.gpu_blocks / self.full,
            "plan_bytes": int(statistics.median(timing["plan_bytes"])),
            "allocating_steps": sum(timing["allocating"]) / steps,
            "heat_steps": sum(timing["heat"]),
            "resolve_ms_per_step": statistics.median(timing["resolve"]) * 1e3,
            "mixed": stats["mixed"] + stats["none"],
            "released_pages": metrics["released_pages"],
            "lost_pages": metrics["lost_pages"],
            "hit_rate": metrics["hit_rate"],
            "setup_s": self.setup_s,
        }


def run_together(configs: list[tuple[int, int]], steps: int, seed: int = 0, policy: str = "coldest") -> list[dict]:
    """The results of each ``(n, ctx)`` configuration, set up one after another and then stepped in turn, one
    decode step each: what the machine does to its caches and memory over the run (this VM's memory latency
    drifts, and its kernel scans memory: ``kdamond``) falls on every configuration alike, so their figures can
    be compared with each other. Each configuration's steps still leave its own caches as cold as a forward
    would: the resolver runs between its plan and its results."""
    workloads = [Workload(n, ctx, steps, seed, policy) for n, ctx in configs]
    gc.collect()
    gc.freeze()
    for _ in range(steps):
        for workload in workloads:
            workload.step()
    gc.unfreeze()
    return [workload.result() for workload in workloads]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="32x16k,32x128k,32x1m,128x16k,128x128k,128x1m,256x16k,256x128k,256x1m")
    p.add_argument("--steps", type=int, default=128, help="timed decode steps per configuration")
    p.add_argument("--quick", action="store_true", help="one small configuration, a few steps")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: no pool contention)")
    p.add_argument("--policy", choices=("coldest", "fifo"), default="coldest",
                   help="the core's pressure policy (coldest: release the pages the heat summaries rank coldest)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    configs = ["8x16k"] if args.quick else args.configs.split(",")
    steps = 40 if args.quick else args.steps
    out: dict = {"steps": steps, "block_size": BLOCK, "top_k": TOP_K, "hot_rows": HOT_ROWS, "policy": args.policy}
    parsed = [(text.lower(), parse_config(text)) for text in configs]
    results: dict[str, dict] = {}
    for n in dict.fromkeys(n for _, (n, _) in parsed):  # one N at a time: its contexts stepped in turn
        group = [(key, config) for key, config in parsed if config[0] == n]
        for (key, _), r in zip(group, run_together([config for _, config in group], steps, policy=args.policy),
                               strict=True):
            results[key] = r
    for key, _ in parsed:
        r = results[key]
        out[f"sched_us_per_req_{key}"] = round(r["sched_p50"], 3)
        out[f"sched_us_per_req_p90_{key}"] = round(r["sched_p90"], 3)
        out[f"worker_us_per_req_{key}"] = round(r["worker_p50"], 3)
        out[f"worker_us_per_req_p90_{key}"] = round(r["worker_p90"], 3)
        out[f"core_us_per_req_{key}"] = round(r["core_p50"], 3)
        out[f"core_us_per_req_p90_{key}"] = round(r["core_p90"], 3)
        for side in ("sched", "worker", "core"):
            out[f"{side}_us_per_req_mean_{key}"] = round(r[f"{side}_mean"], 3)
        out[f"plan_bytes_{key}"] = r["plan_bytes"]
        out[f"detail_{key}"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
