"""``hisparse scenario``: a small serving run through the residency core and the CPU data path.

Requests with shared prefixes are admitted, prefilled and decoded under a GPU pool too small to keep all
of them resident; an indexer stand-in picks top-K positions with temporal locality. Every KV row written
is derived from (content, position, layer), so at the end every position of every request is read back
through ``resolve`` and compared byte for byte.

:class:`Driver` is the serving loop (through the engine hooks) of the scenario and of the tests.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field, replace

import torch

from ._core import ResidencyManager, StepPlan
from .datapath import DataPath, Layout
from .errors import CapacityError
from .heat import HeatOptions
from .hooks import SchedulerHooks, WorkerHooks, WorkerStep
from .tools import console
from .tools.argtypes import int_range, seed


def expected_rows(keys: torch.Tensor, positions: torch.Tensor, layer: int, row_bytes: int) -> torch.Tensor:
    """The bytes of the KV rows of (content key, position) in ``layer``: [n, row_bytes] uint8."""
    seed = keys.to(torch.int64) * 1_000_003 + positions.to(torch.int64) * 7_919 + layer * 104_729
    cols = torch.arange(row_bytes, dtype=torch.int64) * 31
    return ((seed[:, None] + cols[None, :]) % 251).to(torch.uint8)


@dataclass
class RequestSpec:
    """What the driver knows of a request: whose content its first ``shared_tokens`` are."""

    family: int
    shared_tokens: int
    prompt_len: int
    max_len: int
    written: int = 0
    positions: list[int] = field(default_factory=list)


class Driver:
    """A serving loop through the engine hooks (:class:`~hisparse.hooks.SchedulerHooks` and
    :class:`~hisparse.hooks.WorkerHooks`, exactly the calls an engine makes), with content checks.

    Requests are named by ints. A step stays open on the worker after :meth:`step`, so that the caller can
    resolve in it; the next :meth:`step` or :meth:`close` ends it and hands its results to the scheduler.
    Copies the worker finished are delivered late on purpose: each close reports a random ``deliver`` part of
    all finished copies so far (some of them as failed), and withholds the rest for a later step's results.
    """

    def __init__(self, manager: ResidencyManager, datapath: DataPath, top_k: int, seed: int = 0,
                 heat_interval: int = 1):
        self.sched = SchedulerHooks(manager)
        self.worker = WorkerHooks(datapath, heat=HeatOptions(interval=heat_interval))
        self.m = manager
        self.dp = datapath
        self.top_k = top_k
        self.rng = random.Random(seed)
        self._torch_rng = torch.Generator().manual_seed(seed)
        self.specs: dict[int, RequestSpec] = {}
        self.open: WorkerStep | None = None
        self.withheld: list[int] = []  # copies the worker finished that the scheduler has not been told of
        self.transitions: list[tuple[int, str, str]] = []

    @property
    def layout(self) -> Layout:
        return self.dp.layout

    @staticmethod
    def name(request_id: int) -> str:
        return f"r{request_id}"

    def core(self, request_id: int) -> int:
        """The manager's id of a request (for the manager's own views)."""
        return self.sched.core_id(self.name(request_id))

    def info(self, request_id: int) -> dict:
        return self.sched.request_info(self.name(request_id))

    def content_keys(self, request_id: int, positions: torch.Tensor) -> torch.Tensor:
        spec = self.specs[request_id]
        own = torch.full_like(positions, 1_000_000 + request_id)
        return torch.where(positions < spec.shared_tokens, torch.full_like(positions, spec.family), own)

    def prefix_hashes(self, family: int, shared_tokens: int) -> list[int]:
        """Page hashes of a family's shared prefix (each covers the family and everything before it); some
        negative, as Python's ``hash()`` gives."""
        pages = shared_tokens // self.layout.block_size
        return [(family * 1_000_003 + page + 1) * (-1) ** page for page in range(pages)]

    # ------------------------------------------------------------------ the scheduler's side

    def admit(self, request_id: int, prompt_len: int, family: int = -1, shared_tokens: int = 0,
              max_len: int | None = None):
        spec = RequestSpec(family, shared_tokens if family >= 0 else 0, prompt_len,
                           max_len or self.layout.max_model_len)
        hashes = self.prefix_hashes(family, spec.shared_tokens) if family >= 0 else []
        admission = self.sched.admit(self.name(request_id), prompt_len, hashes, max_len)
        self.specs[request_id] = spec
        spec.written = admission.cached_tokens
        return admission

    def finish(self, request_id: int) -> None:
        self.sched.finish(self.name(request_id))

    def preempt(self, request_id: int) -> int:
        kept = self.sched.preempt(self.name(request_id))
        self.specs[request_id].written = kept
        return kept

    def resume(self, request_id: int):
        return self.sched.resume(self.name(request_id))

    # ------------------------------------------------------------------ steps

    def step(self, scheduled: list[tuple[int, int]], deliver: float = 0.0, fail: float = 0.0) -> StepPlan:
        """Closes the open step (see :meth:`close`), then plans, applies, and writes the scheduled tokens'
        rows. A short plan changes nothing and leaves no step open."""
        self.close(deliver, fail)
        step = self.sched.plan_step([(self.name(rid), n) for rid, n in scheduled])
        self.transitions += step.plan.transitions
        if not step.ok:
            return step.plan
        self.worker.apply(step)
        self.open = step
        for request_id, tokens in scheduled:
            self.write(request_id, tokens)
        return step.plan

    def close(self, deliver: float = 1.0, fail: float = 0.0) -> None:
        """Ends the open step (if any) and hands its results to the scheduler with a random ``deliver`` part of
        every copy finished so far, in random order, a ``fail`` part of those reported as failed."""
        if self.open is None:
            return
        results = self.worker.end_step()
        self.open = None
        self.withheld += results.completed
        chosen = [t for t in self.withheld if self.rng.random() < deliver]
        self.rng.shuffle(chosen)
        failed = [t for t in chosen if self.rng.random() < fail]
        done = set(chosen)
        self.withheld = [t for t in self.withheld if t not in done]
        failed_set = set(failed)
        ok = tuple(t for t in chosen if t not in failed_set)
        self.sched.apply_results(replace(results, completed=ok, failed=tuple(failed)))

    def rebuild_worker(self, mid_step: bool = True) -> WorkerStep:
        """The worker process dies and a new one registers the same slab and host pool (their bytes survive;
        every other worker state is gone). ``mid_step``: it dies in the open step's forward, before its
        results: the rows that step wrote and the blocks it restored hold garbage then. Otherwise the open
        step ends first. The new worker applies the scheduler's resync step, and the tokens of a step redone
        are written again; returns that step, left open."""
        lost = self.open if mid_step else None
        if not mid_step:
            self.close()
        elif lost is not None:
            garbage = torch.randint(0, 256, (self.layout.row_bytes,), dtype=torch.uint8, generator=self._torch_rng)
            slots = self.worker.slot_mapping()
            bs = self.layout.block_size
            restored = [torch.arange(g * bs, (g + 1) * bs) for g, _ in lost.plan.restores]
            for layer in range(self.layout.num_layers):
                for rows in (slots, *restored):
                    self.dp.gpu[layer][rows] = garbage
        self.open = None
        self.withheld = []  # what the dead worker finished is never reported: the scheduler redoes it
        self.dp = DataPath(self.layout, gpu=self.dp.gpu, host=self.dp.host)
        self.worker = WorkerHooks(self.dp, heat=self.worker.heat)
        step = self.sched.resync_worker()
        self.worker.apply(step)
        self.open = step
        for req in step.requests:  # the lost step's tokens, written again
            request_id = int(req.request_id.removeprefix("r"))
            self.specs[request_id].written = req.start
            self.write(request_id, req.num_tokens)
        return step

    def in_step(self) -> WorkerStep:
        """The open step, opening an empty one if there is none (the worker reads only inside a step)."""
        if self.open is None:
            self.step([])
        assert self.open is not None
        return self.open

    def write(self, request_id: int, tokens: int) -> None:
        spec = self.specs[request_id]
        positions = torch.arange(spec.written, spec.written + tokens, dtype=torch.int64)
        spec.written += tokens
        if tokens == 0:
            return
        keys = self.content_keys(request_id, positions)
        for layer in range(self.layout.num_layers):
            self.worker.write(self.name(request_id), positions, layer,
                              expected_rows(keys, positions, layer, self.layout.row_bytes))

    # ------------------------------------------------------------------ reads

    def select(self, request_id: int) -> list[int]:
        """An indexer stand-in: most of the last selection again, some recent tokens, some anywhere."""
        spec = self.specs[request_id]
        n = spec.written
        keep = [p for p in spec.positions if p < n and self.rng.random() < 0.8]
        recent = list(range(max(0, n - self.top_k // 4), n))
        chosen = dict.fromkeys(keep + recent)
        while len(chosen) < min(self.top_k, n):
            chosen[self.rng.randrange(n)] = None
        spec.positions = list(chosen)[: self.top_k]
        return spec.positions

    def decode_resolve(self, request_ids: list[int]) -> torch.Tensor:
        """Resolves one top-K row per request (every group) in the open step and checks what it reads."""
        self.in_step()
        rows = [self.info(r)["row"] for r in request_ids]
        topk = torch.full((len(request_ids), self.top_k), -1, dtype=torch.int32)
        for i, r in enumerate(request_ids):
            sel = self.select(r)
            topk[i, : len(sel)] = torch.tensor(sel, dtype=torch.int32)
        row_state = torch.tensor(rows, dtype=torch.int32)
        for group in range(self.layout.num_groups):
            row_ids = self.worker.resolve(topk, row_state, group)
            self.check(request_ids, topk, row_ids, group)
        return topk

    def check(self, request_ids: list[int], topk: torch.Tensor, row_ids: torch.Tensor, group: int) -> None:
        for i, r in enumerate(request_ids):
            valid = topk[i] >= 0
            positions = topk[i][valid].to(torch.int64)
            ids = row_ids[i][valid]
            if bool((ids < 0).any()):
                status = int(self.dp.state["status"][self.info(r)["row"]])
                raise AssertionError(f"request {r}: unresolved rows (status {status})")
            keys = self.content_keys(r, positions)
            for layer in self.layout.layers_of(group):
                got = self.worker.gather(row_ids[i : i + 1], layer)[0][valid]
                want = expected_rows(keys, positions, layer, self.layout.row_bytes)
                if not torch.equal(got, want):
                    bad = int((got != want).any(dim=1).nonzero()[0])
                    raise AssertionError(
                        f"request {r} position {int(positions[bad])} layer {layer}: read the wrong bytes "
                        f"(row {int(ids[bad])})"
                    )

    def verify_all(self, request_id: int) -> int:
        """Reads every written position of a running request through ``resolve``; returns rows checked."""
        self.in_step()
        spec = self.specs[request_id]
        row = torch.tensor([self.info(request_id)["row"]], dtype=torch.int32)
        checked = 0
        for start in range(0, spec.written, self.top_k):
            positions = torch.arange(start, min(spec.written, start + self.top_k), dtype=torch.int32)
            topk = torch.full((1, self.top_k), -1, dtype=torch.int32)
            topk[0, : len(positions)] = positions
            for group in range(self.layout.num_groups):
                self.check([request_id], topk, self.worker.resolve(topk, row, group), group)
            checked += len(positions)
        return checked


def count_step(scheduled: list[tuple[int, int]], prefill_left: dict[int, int], decode_left: dict[int, int]
               ) -> list[int]:
    """Counts a step's tokens off what each request has left: a chunk off its prefill, or one decode; returns the
    decoding requests, in order."""
    decoders = []
    for rid, chunk in scheduled:
        if prefill_left[rid]:
            prefill_left[rid] -= chunk
        else:
            decode_left[rid] -= 1
            decoders.append(rid)
    return decoders


def default_scenario(seed: int = 0, quiet: bool = False, rebuild_every: int = 0, progress: bool = False) -> dict:
    """24 requests in 3 prefix families under a pool that fits about 4 of them fully resident.

    ``rebuild_every``: every that many steps the worker process dies and is rebuilt (alternately in a step's
    forward and between steps, copies in flight either way); what it read before and after is checked.
    ``progress``: a progress line on stderr (:class:`hisparse.tools.console.Progress`), for a run without a log."""
    layout = Layout(num_gpu_blocks=180, num_host_blocks=2400, block_size=16, max_model_len=1024, max_running=8,
                    hot_rows=128, row_bytes=64, layer_groups=(0, 0, 1))
    manager = ResidencyManager(
        num_gpu_blocks=layout.num_gpu_blocks, num_host_blocks=layout.num_host_blocks,
        block_size=layout.block_size, max_model_len=layout.max_model_len, max_running=layout.max_running,
        top_k=64, hot_rows=layout.hot_rows, num_index_groups=layout.num_groups, page_bytes=layout.page_bytes,
    )
    driver = Driver(manager, DataPath(layout), top_k=64, seed=seed)
    rng = random.Random(seed)
    say = (lambda *a: None) if quiet else print
    waiting = list(range(24))
    running: list[int] = []
    preempted: list[int] = []
    prefill_left: dict[int, int] = {}
    decode_left: dict[int, int] = {}
    steps = preemptions = checked = 0
    rebuilt = {"rebuilds": 0, "copies_redone": 0, "restores_redone": 0, "tokens_redone": 0}
    retired = {"hits": 0, "misses": 0, "h2d_bytes": 0}  # the counters of workers that died
    running_samples = []
    t0 = time.perf_counter()
    calm = True  # the last step needed no preemption: room to bring someone in
    bar = console.Progress(progress)
    bar.start("scenario")
    while waiting or running or preempted:
        bar.update(1 - (len(waiting) + len(running) + len(preempted)) / 24, f"step {steps:4d}  running {len(running)}")
        free = manager.stats()["gpu_free"]
        if calm and preempted and free > 4 * layout.hot_blocks:
            # Preempted requests come back first, from the host, without recomputing their kept prefix.
            rid = preempted[0]
            try:
                a = driver.resume(rid)
                preempted.pop(0)
                running.append(rid)
                say(f"step {steps:4d}  resume  request {rid:2d}: {a.cached_tokens} tokens on the host, "
                    f"residency {a.residency}")
            except CapacityError:
                pass
        elif calm and waiting and free > 4 * layout.hot_blocks:
            rid = waiting[0]
            prompt = 640 + 64 * rng.randrange(3)
            try:
                a = driver.admit(rid, prompt, family=rid % 3, shared_tokens=512, max_len=prompt + 64)
                waiting.pop(0)
                running.append(rid)
                prefill_left[rid], decode_left[rid] = prompt - a.cached_tokens, 48
                say(f"step {steps:4d}  admit   request {rid:2d}: {a.cached_tokens:4d} of {prompt} tokens "
                    f"from the prefix cache, residency {a.residency}")
            except CapacityError:
                pass
        # Decodes first, then prefill chunks, within a token budget (like max_num_batched_tokens).
        budget = 256
        scheduled = []
        for rid in running:
            chunk = min(prefill_left[rid], budget) if prefill_left[rid] else 1
            if chunk:
                scheduled.append((rid, chunk))
                budget -= chunk if prefill_left[rid] else 0
        plan = driver.step(scheduled, deliver=0.7)
        if not plan.ok:
            decode_only = [(rid, n) for rid, n in scheduled if not prefill_left[rid]]
            plan = driver.step(decode_only, deliver=0.7) if decode_only else plan
            scheduled = decode_only
        calm = plan.ok
        if not plan.ok:
            # Preempt the newest request to the host; it resumes later from its durable pages.
            victim = running.pop()
            written = driver.specs[victim].written
            kept = driver.preempt(victim)
            prefill_left[victim] += written - kept
            preempted.append(victim)
            preemptions += 1
            say(f"step {steps:4d}  preempt request {victim:2d}: {plan.missing_blocks} blocks short, "
                f"{kept} tokens kept on the host")
            continue
        steps += 1
        for rid, frm, to in plan.transitions:
            say(f"step {steps:4d}  residency request {rid:2d}: {frm} -> {to}")
        decoders = count_step(scheduled, prefill_left, decode_left)
        if decoders:
            driver.decode_resolve(decoders)
        if rebuild_every and steps % rebuild_every == 0:
            retired = {k: v + driver.dp.counters[k] for k, v in retired.items()}
            step = driver.rebuild_worker(mid_step=steps // rebuild_every % 2 == 1)
            say(f"step {steps:4d}  rebuild worker: {len(step.plan.materialize)} copies and "
                f"{len(step.plan.restores)} restores started again, {step.plan.num_tokens} tokens written again")
            for key, n in (("rebuilds", 1), ("copies_redone", len(step.plan.materialize)),
                           ("restores_redone", len(step.plan.restores)), ("tokens_redone", step.plan.num_tokens)):
                rebuilt[key] += n
            if decoders:
                driver.decode_resolve(decoders)
        running_samples.append(len(running))
        for rid in [r for r in running if decode_left[r] == 0]:
            checked += driver.verify_all(rid)
            driver.finish(rid)
            running.remove(rid)
        manager.check_invariants()
    bar.update(1.0, f"step {steps:4d}  running 0")
    bar.close()
    driver.close()
    counters = {k: v + driver.dp.counters[k] for k, v in retired.items()}
    return {
        "steps": steps,
        "requests": 24,
        "preemptions": preemptions,
        "mean_running": sum(running_samples) / max(1, len(running_samples)),
        "transitions": len(driver.transitions),
        "hits": counters["hits"],
        "misses": counters["misses"],
        "h2d_bytes": counters["h2d_bytes"],
        "rows_verified": checked,
        **(rebuilt if rebuild_every else {}),
        "no_data_lost": True,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("scenario", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=seed, default=0, help="seeds the prompts and the indexer stand-in (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the log")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="with --json: no progress on stderr (without --json the log shows it)")
    p.add_argument("--rebuild-every", type=int_range(0, 10_000), default=0, metavar="STEPS",
                   help="kill and rebuild the worker every STEPS steps (in a forward or between steps, copies in "
                        "flight) and read everything back (default 0: never)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # small tensors: more threads only synchronize (see ``hisparse demo``)
    result = default_scenario(seed=args.seed, quiet=args.json, rebuild_every=args.rebuild_every,
                              progress=args.json and args.progress)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\n{result['steps']} steps, {result['requests']} requests, mean running {result['mean_running']:.1f}, "
          f"{result['preemptions']} preemptions, {result['transitions']} residency transitions")
    total = result["hits"] + result["misses"]
    print(f"hot-buffer hits {result['hits']}, misses {result['misses']} "
          f"(hit rate {result['hits'] / max(1, total):.1%}), {result['h2d_bytes']} bytes host -> GPU")
    if args.rebuild_every:
        print(f"{result['rebuilds']} worker rebuilds: {result['copies_redone']} copies and {result['restores_redone']} "
              f"restores started again, {result['tokens_redone']} tokens written again")
    print(f"no data lost: yes ({result['rows_verified']} rows read back byte for byte)")
    return 0
