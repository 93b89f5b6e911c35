"""``hisparse scenario``: a small serving run through the residency core and the CPU data path.

Requests with shared prefixes are admitted, prefilled and decoded under a GPU pool too small to keep all
of them resident; an indexer stand-in picks top-K positions with temporal locality. Every KV row written
is derived from (content, position, layer), so at the end every position of every request is read back
through ``resolve`` and compared byte for byte.

:class:`Driver` is the worker + scheduler loop used by the scenario and by the tests.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field

import torch

from ._core import ResidencyManager, StepPlan
from .datapath import DataPath, Layout
from .errors import CapacityError
from .tools.argtypes import seed


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
    """Scheduler and worker in one loop, with content checks. Transfers complete on request, so a test can
    deliver them late, out of order, or failed."""

    def __init__(self, manager: ResidencyManager, datapath: DataPath, top_k: int, seed: int = 0):
        self.m = manager
        self.dp = datapath
        self.top_k = top_k
        self.rng = random.Random(seed)
        self.specs: dict[int, RequestSpec] = {}
        self.in_flight: list[int] = []
        self.transitions: list[tuple[int, str, str]] = []

    @property
    def layout(self) -> Layout:
        return self.dp.layout

    def content_keys(self, request_id: int, positions: torch.Tensor) -> torch.Tensor:
        spec = self.specs[request_id]
        own = torch.full_like(positions, 1_000_000 + request_id)
        return torch.where(positions < spec.shared_tokens, torch.full_like(positions, spec.family), own)

    def prefix_hashes(self, family: int, shared_tokens: int) -> list[int]:
        """Page hashes of a family's shared prefix (each covers the family and everything before it)."""
        return [family * 1_000_003 + page + 1 for page in range(shared_tokens // self.layout.block_size)]

    def admit(self, request_id: int, prompt_len: int, family: int = -1, shared_tokens: int = 0,
              max_len: int | None = None):
        spec = RequestSpec(family, shared_tokens if family >= 0 else 0, prompt_len,
                           max_len or self.layout.max_model_len)
        hashes = self.prefix_hashes(family, spec.shared_tokens) if family >= 0 else []
        self.specs[request_id] = spec
        try:
            admission = self.m.admit(request_id, prompt_len, hashes, max_len)
        except Exception:
            del self.specs[request_id]
            raise
        spec.written = admission.cached_tokens
        return admission

    def step(self, scheduled: list[tuple[int, int]]) -> StepPlan:
        """Plans, applies, and writes the scheduled tokens' rows. A short plan changes nothing."""
        plan = self.m.plan_step(scheduled)
        self.transitions += plan.transitions
        if not plan.ok:
            return plan
        self.in_flight += self.dp.apply(plan)
        for request_id, tokens in scheduled:
            self.write(request_id, tokens)
        return plan

    def write(self, request_id: int, tokens: int) -> None:
        spec = self.specs[request_id]
        row = self.m.request_info(request_id)["row"]
        positions = torch.arange(spec.written, spec.written + tokens, dtype=torch.int64)
        spec.written += tokens
        if tokens == 0:
            return
        rows = self.dp.token_rows(row, positions)
        keys = self.content_keys(request_id, positions)
        for layer in range(self.layout.num_layers):
            self.dp.gpu[layer, rows] = expected_rows(keys, positions, layer, self.layout.row_bytes)

    def complete(self, fraction: float = 1.0, fail: float = 0.0) -> None:
        """Reports a random part of the in-flight copies, in random order, some of them failed."""
        chosen = [t for t in self.in_flight if self.rng.random() < fraction]
        self.rng.shuffle(chosen)
        chosen_set = set(chosen)
        self.in_flight = [t for t in self.in_flight if t not in chosen_set]
        failed = [t for t in chosen if self.rng.random() < fail]
        failed_set = set(failed)
        if failed:
            self.m.complete(failed, ok=False)
        ok = [t for t in chosen if t not in failed_set]
        if ok:
            self.m.complete(ok, ok=True)

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
        """Resolves one top-K row per request (group 0 and every other group) and checks what it reads."""
        rows = [self.m.request_info(r)["row"] for r in request_ids]
        topk = torch.full((len(request_ids), self.top_k), -1, dtype=torch.int32)
        for i, r in enumerate(request_ids):
            sel = self.select(r)
            topk[i, : len(sel)] = torch.tensor(sel, dtype=torch.int32)
        row_state = torch.tensor(rows, dtype=torch.int32)
        for group in range(self.layout.num_groups):
            row_ids = self.dp.resolve(topk, row_state, group)
            self.check(request_ids, topk, row_ids, group)
        heat = self.dp.take_heat(rows)
        for r, row in zip(request_ids, rows, strict=True):
            self.m.report_heat(r, *heat[row])
        return topk

    def check(self, request_ids: list[int], topk: torch.Tensor, row_ids: torch.Tensor, group: int) -> None:
        for i, r in enumerate(request_ids):
            valid = topk[i] >= 0
            positions = topk[i][valid].to(torch.int64)
            ids = row_ids[i][valid]
            if bool((ids < 0).any()):
                status = int(self.dp.state["status"][self.m.request_info(r)["row"]])
                raise AssertionError(f"request {r}: unresolved rows (status {status})")
            keys = self.content_keys(r, positions)
            for layer in self.layout.layers_of(group):
                got = self.dp.gpu[layer, ids.to(torch.int64)]
                want = expected_rows(keys, positions, layer, self.layout.row_bytes)
                if not torch.equal(got, want):
                    bad = int((got != want).any(dim=1).nonzero()[0])
                    raise AssertionError(
                        f"request {r} position {int(positions[bad])} layer {layer}: read the wrong bytes "
                        f"(row {int(ids[bad])})"
                    )

    def verify_all(self, request_id: int) -> int:
        """Reads every written position of a running request through ``resolve``; returns rows checked."""
        spec = self.specs[request_id]
        row = self.m.request_info(request_id)["row"]
        checked = 0
        for start in range(0, spec.written, self.top_k):
            positions = torch.arange(start, min(spec.written, start + self.top_k), dtype=torch.int32)
            topk = torch.full((1, self.top_k), -1, dtype=torch.int32)
            topk[0, : len(positions)] = positions
            for group in range(self.layout.num_groups):
                row_ids = self.dp.resolve(topk, torch.tensor([row], dtype=torch.int32), group)
                self.check([request_id], topk, row_ids, group)
            checked += len(positions)
        return checked


def default_scenario(seed: int = 0, quiet: bool = False) -> dict:
    """24 requests in 3 prefix families under a pool that fits about 4 of them fully resident."""
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
    running_samples = []
    t0 = time.perf_counter()
    calm = True  # the last step needed no preemption: room to bring someone in
    while waiting or running or preempted:
        free = manager.stats()["gpu_free"]
        if calm and preempted and free > 4 * layout.hot_blocks:
            # Preempted requests come back first, from the host, without recomputing their kept prefix.
            rid = preempted[0]
            try:
                a = manager.resume(rid)
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
        plan = driver.step(scheduled)
        if not plan.ok:
            decode_only = [(rid, n) for rid, n in scheduled if not prefill_left[rid]]
            plan = driver.step(decode_only) if decode_only else plan
            scheduled = decode_only
        calm = plan.ok
        if not plan.ok:
            # Preempt the newest request to the host; it resumes later from its durable pages.
            victim = running.pop()
            kept = manager.preempt(victim)
            spec = driver.specs[victim]
            prefill_left[victim] += spec.written - kept
            spec.written = kept
            preempted.append(victim)
            preemptions += 1
            say(f"step {steps:4d}  preempt request {victim:2d}: {plan.missing_blocks} blocks short, "
                f"{kept} tokens kept on the host")
            driver.complete()
            continue
        steps += 1
        for rid, frm, to in plan.transitions:
            say(f"step {steps:4d}  residency request {rid:2d}: {frm} -> {to}")
        driver.complete(fraction=0.7)
        decoders = []
        for rid, chunk in scheduled:
            if prefill_left[rid]:
                prefill_left[rid] -= chunk
            else:
                decode_left[rid] -= 1
                decoders.append(rid)
        if decoders:
            driver.decode_resolve(decoders)
        running_samples.append(len(running))
        for rid in [r for r in running if decode_left[r] == 0]:
            checked += driver.verify_all(rid)
            manager.finish(rid)
            running.remove(rid)
        manager.check_invariants()
    counters = driver.dp.counters
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
        "no_data_lost": True,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("scenario", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=seed, default=0, help="seeds the prompts and the indexer stand-in (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the log")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    result = default_scenario(seed=args.seed, quiet=args.json)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\n{result['steps']} steps, {result['requests']} requests, mean running {result['mean_running']:.1f}, "
          f"{result['preemptions']} preemptions, {result['transitions']} residency transitions")
    total = result["hits"] + result["misses"]
    print(f"hot-buffer hits {result['hits']}, misses {result['misses']} "
          f"(hit rate {result['hits'] / max(1, total):.1%}), {result['h2d_bytes']} bytes host -> GPU")
    print(f"no data lost: yes ({result['rows_verified']} rows read back byte for byte)")
    return 0
