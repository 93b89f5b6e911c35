"""A continuous-batching engine over the hooks: admission, chunked prefill and decode, preemption.

Three modes share everything but what happens when the GPU pool is full:

* ``resident``: plain paged KV (the core's ``resident`` policy, no prefix cache). A step that does not fit
  preempts the newest request, which is dropped and computed again from its first token later (vLLM's
  recompute preemption).
* ``offload``: the same pool, plus the host: a preempted request keeps its durable pages on the host and
  brings every one of them back before it runs again (``resident`` policy + preempt / resume); prompt pages
  found on the host (shared prefixes) are brought back whole.
* ``hisparse``: the core's ``coldest`` policy and the data path: requests give up cold pages and read them
  through their hot regions; a request can start from a prefix that lives only on the host.

Every step is one :meth:`SchedulerHooks.plan_step` -> :meth:`WorkerHooks.apply` -> forward ->
:meth:`WorkerHooks.end_step` -> :meth:`SchedulerHooks.apply_results`. Attention reads KV only through
``resolve`` -> ``gather``, and the model (:mod:`.model`) computes exactly, so the generated tokens and every
attention output are the same bits in every mode, under any memory pressure.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..datapath import Layout
from ..errors import CapacityError, ConfigError, InvalidArgumentError, InvariantError
from ..hooks import ScheduledRequest, SchedulerHooks, WorkerHooks, WorkerStep
from ..kernels.launch import _positive
from .model import TinyDSA, digest

MODES = ("resident", "offload", "hisparse")
POLICY = {"resident": "resident", "offload": "resident", "hisparse": "coldest"}


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    #: The first step at which the request may be admitted.
    arrival: int = 0

    @property
    def max_len(self) -> int:
        return len(self.prompt) + self.max_new_tokens


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "hisparse"
    num_gpu_blocks: int = 1024
    #: Default: room for every running request at max_model_len, twice (prefix pages stay cached).
    num_host_blocks: int | None = None
    block_size: int = 16
    max_running: int = 32
    #: Tokens per step (decodes first, then prefill chunks), like vLLM's max_num_batched_tokens.
    max_batched_tokens: int = 1024
    #: Hot rows per request; default 4 x top_k (prefill chunks resolve in rounds that fit it).
    hot_rows: int | None = None
    watermark: int | None = None
    device: str = "cpu"
    #: Keep every attention output (float64), not only a digest of it: for tests on small runs.
    record_outputs: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}: expected one of {', '.join(MODES)}")
        _positive(num_gpu_blocks=self.num_gpu_blocks, block_size=self.block_size, max_running=self.max_running,
                  max_batched_tokens=self.max_batched_tokens)
        _positive(**{name: value for name in ("num_host_blocks", "hot_rows")
                     if (value := getattr(self, name)) is not None})


@dataclass(frozen=True)
class Event:
    step: int
    kind: str  # admit, resume, preempt, finish
    request_id: str
    residency: str = ""
    tokens: int = 0  # cached (admit, resume) or kept (preempt) tokens


@dataclass
class RunResult:
    mode: str
    tokens: dict[str, list[int]]
    digests: dict[str, torch.Tensor]
    computed: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor] | None
    running: list[int]
    steps: int
    seconds: float
    preemptions: int
    prefill_tokens: int
    decode_tokens: int
    recompute_mismatches: int
    events: list[Event]
    metrics: dict

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    @property
    def peak_running(self) -> int:
        return max(self.running, default=0)

    @property
    def mean_running(self) -> float:
        busy = [n for n in self.running if n]
        return sum(busy) / len(busy) if busy else 0.0

    def compare(self, reference: RunResult) -> list[str]:
        """Differences from ``reference`` (which computed every position): generated tokens, and the attention
        outputs (digests, and full outputs when both kept them) at every position this run computed. Empty:
        identical."""
        diffs = []
        if self.recompute_mismatches:
            diffs.append(f"{self.recompute_mismatches} recomputed attention outputs differ from the first time")
        for rid, toks in reference.tokens.items():
            if self.tokens.get(rid) != toks:
                diffs.append(f"request {rid}: generated tokens differ")
                continue
            mask = self.computed[rid]
            if not bool(reference.computed[rid][mask].all()):
                diffs.append(f"request {rid}: the reference did not compute every position")
            elif not torch.equal(self.digests[rid][:, mask].cpu(), reference.digests[rid][:, mask].cpu()):
                diffs.append(f"request {rid}: attention outputs differ")
            elif self.outputs is not None and reference.outputs is not None:
                if not torch.equal(self.outputs[rid][:, mask].cpu(), reference.outputs[rid][:, mask].cpu()):
                    diffs.append(f"request {rid}: attention outputs differ (full comparison)")
        return diffs


def prefix_hashes(prompt: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full pages of a prompt: page i's covers tokens 0 .. (i + 1) * block_size."""
    out, prev = [], b""
    for page in range(len(prompt) // block_size):
        chunk = prompt[page * block_size: (page + 1) * block_size]
        prev = hashlib.blake2b(prev + b"".join(t.to_bytes(4, "little") for t in chunk), digest_size=8).digest()
        out.append(int.from_bytes(prev, "little") >> 1)
    return out


class _Request:
    def __init__(self, spec: RequestSpec, model: TinyDSA, record: bool):
        c, dev = model.cfg, model.device
        self.spec = spec
        self.id = spec.request_id
        self.tokens = list(spec.prompt)
        self.computed = 0
        self.status = "future"  # future, waiting, running, preempted, done
        self.hashes: list[int] = []
        self.idx_keys = torch.zeros(c.num_groups, spec.max_len, c.index_dim, dtype=torch.float64, device=dev)
        self.digests = torch.zeros(c.layers, spec.max_len, dtype=torch.int64, device=dev)
        self.done_mask = torch.zeros(spec.max_len, dtype=torch.bool, device=dev)
        self.mismatches = 0
        self.outputs = (torch.zeros(c.layers, spec.max_len, c.heads * c.latent, dtype=torch.float64, device=dev)
                        if record else None)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.spec.prompt)


class _GroupReads:
    """The rows one index group reads this step: resolved once (or in rounds), gathered per layer."""

    def __init__(self, worker: WorkerHooks, topk: torch.Tensor, row_ids: torch.Tensor,
                 hist_mask: torch.Tensor | None, hist: dict[int, torch.Tensor] | None):
        self.worker, self.topk, self.row_ids, self.hist_mask, self.hist = worker, topk, row_ids, hist_mask, hist
        self.valid = topk >= 0

    def read(self, layer: int) -> torch.Tensor:
        if self.hist is None:
            return self.worker.gather(self.row_ids, layer)
        fresh = self.worker.gather(self.row_ids.masked_fill(self.hist_mask, -1), layer)
        return torch.where(self.hist_mask[..., None], self.hist[layer], fresh)


class Engine:
    """Runs request specs to completion in one mode; see the module docstring."""

    def __init__(self, model: TinyDSA, config: EngineConfig):
        c, m = config, model.cfg
        if torch.device(c.device).type != model.device.type:
            raise ConfigError(f"the model is on {model.device}, the engine on {c.device}: use one device")
        self.model, self.config = model, c
        self.hot_rows = 4 * m.top_k if c.hot_rows is None else c.hot_rows
        host = c.num_host_blocks
        if host is None:
            host = 2 * c.max_running * math.ceil(m.max_model_len / c.block_size)
        watermark = c.watermark
        if watermark is None and c.mode != "hisparse":
            watermark = max(1, c.num_gpu_blocks // 100)  # nothing to release: no hot-region-sized reserve
        self.layout = Layout(num_gpu_blocks=c.num_gpu_blocks, num_host_blocks=host, block_size=c.block_size,
                             max_model_len=m.max_model_len, max_running=c.max_running, hot_rows=self.hot_rows,
                             row_bytes=m.row_bytes, layer_groups=m.layer_groups)
        self.sched = SchedulerHooks(
            num_gpu_blocks=c.num_gpu_blocks, num_host_blocks=host, block_size=c.block_size,
            max_model_len=m.max_model_len, max_running=c.max_running, top_k=m.top_k, hot_rows=self.hot_rows,
            num_index_groups=m.num_groups, watermark=watermark, policy=POLICY[c.mode],
            page_bytes=self.layout.page_bytes,
        )
        self.worker = WorkerHooks.build(self.layout, c.device)
        cfg = self.sched.config
        self.watermark, self.tail_pages, self.hot_blocks = cfg["watermark"], cfg["tail_pages"], cfg["hot_blocks"]
        self.key_cache: dict[int, torch.Tensor] = {}
        self.requests: dict[str, _Request] = {}
        self.running: list[_Request] = []
        self.waiting: deque[_Request] = deque()
        self.preempted: deque[_Request] = deque()
        self.events: list[Event] = []
        self.step = 0
        self.calm = True
        self.resolves = {"calls": 0, "split_groups": 0}

    # ------------------------------------------------------------------ the loop

    def run(self, specs: Sequence[RequestSpec], progress: Callable[[Engine], None] | None = None,
            on_step: Callable[[Engine], None] | None = None) -> RunResult:
        """Serves ``specs`` to completion. ``on_step(engine)`` runs between steps (a test may preempt there);
        ``progress(engine)`` after each step. An engine serves one run."""
        if self.requests:
            raise ConfigError("an Engine serves one run: build a new one")
        for s in specs:
            self._check_spec(s)
            self.requests[s.request_id] = _Request(s, self.model, self.config.record_outputs)
        future = sorted(self.requests.values(), key=lambda r: r.spec.arrival)
        running_samples: list[int] = []
        prefill = decode = 0
        t0 = time.perf_counter()
        while any(r.status != "done" for r in self.requests.values()):
            while future and future[0].spec.arrival <= self.step:
                r = future.pop(0)
                r.status = "waiting"
                self.waiting.append(r)
            if on_step is not None:
                on_step(self)
            self._admit()
            step, batch = self._plan()
            if step is None:
                if not self.running and not future:
                    raise CapacityError(f"nothing can run: {self.sched.capacity_log()}")
                if future and not self.running:
                    self.step = max(self.step + 1, future[0].spec.arrival)
                else:
                    self.step += 1
                continue
            running_samples.append(len(self.running))
            self.worker.apply(step)
            new_tokens = self._forward(step)
            self.sched.apply_results(self.worker.end_step(flush=True))  # exact counters every step: a reference
            for r, n in batch:
                old = r.computed
                r.computed += n
                if n == 1 and old == len(r.tokens) - 1:
                    decode += 1
                else:
                    prefill += n
                self._cache_keys(r, old)
                if r.computed == len(r.tokens):
                    r.tokens.append(new_tokens[r.id])
                    if r.generated == r.spec.max_new_tokens:
                        self._finish(r)
            self.step += 1
            if progress is not None:
                progress(self)
        seconds = time.perf_counter() - t0
        reqs = self.requests.values()
        return RunResult(
            mode=self.config.mode,
            tokens={r.id: r.tokens[len(r.spec.prompt):] for r in reqs},
            digests={r.id: r.digests.cpu() for r in reqs},
            computed={r.id: r.done_mask.cpu() for r in reqs},
            outputs={r.id: r.outputs.cpu() for r in reqs} if self.config.record_outputs else None,
            running=running_samples,
            steps=len(running_samples),
            seconds=seconds,
            preemptions=sum(e.kind == "preempt" for e in self.events),
            prefill_tokens=prefill,
            decode_tokens=decode,
            recompute_mismatches=sum(r.mismatches for r in reqs),
            events=list(self.events),
            metrics={**self.sched.metrics(), "resolve_calls": self.resolves["calls"],
                     "split_resolves": self.resolves["split_groups"]},
        )

    def _check_spec(self, s: RequestSpec) -> None:
        m = self.model.cfg
        if not isinstance(s, RequestSpec):
            raise ConfigError(f"requests must be RequestSpecs, not {type(s).__name__}")
        if not isinstance(s.request_id, str) or s.request_id in self.requests:
            raise ConfigError(f"request ids must be distinct strings: {s.request_id!r} is not")
        if not all(type(t) is int and 0 <= t < m.vocab for t in s.prompt):
            raise ConfigError(f"request {s.request_id}: prompt tokens must be integers in 0..{m.vocab - 1}")
        if type(s.max_new_tokens) is not int or type(s.arrival) is not int or s.arrival < 0:
            raise ConfigError(f"request {s.request_id}: max_new_tokens and arrival must be integers, arrival >= 0")
        if s.max_len > m.max_model_len or not s.prompt or s.max_new_tokens < 1:
            raise ConfigError(f"request {s.request_id}: need a prompt, new tokens, and max_len <= max_model_len")

    @property
    def done(self) -> int:
        return sum(r.status == "done" for r in self.requests.values())

    # ------------------------------------------------------------------ scheduling

    def _pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _fits(self, r: _Request) -> bool:
        if self.config.mode == "hisparse":
            # Clean pages are released under pressure: what bounds concurrency is each request's footprint
            # (tail and hot region), which the core's admission checks. Once nothing runs, a step that had to
            # preempt holds nobody back: the pool is as free as it gets.
            return self.calm or not self.running
        free = self.sched.capacity()["gpu_free"]
        margin = max(1, self.config.num_gpu_blocks // 100)  # vLLM's watermark: 1% of the pool
        # The prefill of running requests will still take blocks; the new one needs its whole sequence.
        outstanding = 0
        for o in self.running:
            outstanding += max(0, self._pages(len(o.tokens)) - self.sched.request_info(o.id)["num_pages"])
        return free - outstanding - self._pages(len(r.tokens)) >= margin

    def _admit(self) -> None:
        """Resumes preempted requests first, then admits waiting ones, in order, while they fit."""
        while (self.preempted or self.waiting) and len(self.running) < self.config.max_running:
            queue = self.preempted if self.preempted else self.waiting
            r = queue[0]
            if not self._fits(r):
                return
            try:
                if r.status == "preempted":
                    a = self.sched.resume(r.id)
                    kind = "resume"
                else:
                    if self.config.mode != "resident" and r.computed == 0:
                        r.hashes = prefix_hashes(r.spec.prompt, self.config.block_size)
                    a = self.sched.admit(r.id, len(r.tokens), r.hashes, r.spec.max_len)
                    kind = "admit"
                    self._load_keys(r, a.cached_tokens)
            except CapacityError:
                return
            queue.popleft()
            r.computed = a.cached_tokens
            r.status = "running"
            self.running.append(r)
            self.events.append(Event(self.step, kind, r.id, a.residency, a.cached_tokens))

    def _load_keys(self, r: _Request, cached: int) -> None:
        """Indexer keys stay on the GPU, out of the tiered KV: a prefix hit takes them from the key cache."""
        bs = self.config.block_size
        for page in range(cached // bs):
            keys = self.key_cache.get(r.hashes[page])
            if keys is None:
                raise InvariantError(f"request {r.id}: page {page} is a prefix hit but its indexer keys are unknown")
            r.idx_keys[:, page * bs: (page + 1) * bs] = keys

    def _cache_keys(self, r: _Request, old: int) -> None:
        bs = self.config.block_size
        for page in range(old // bs, min(r.computed // bs, len(r.hashes))):
            self.key_cache.setdefault(r.hashes[page], r.idx_keys[:, page * bs: (page + 1) * bs].clone())

    def _batch(self, prefill: bool, max_chunk: int) -> list[tuple[_Request, int]]:
        budget = self.config.max_batched_tokens
        out = []
        for r in self.running:
            if len(r.tokens) - r.computed == 1 and budget > 0:
                out.append((r, 1))
                budget -= 1
        if prefill:
            for r in self.running:
                left = len(r.tokens) - r.computed
                n = min(left, budget, max_chunk)
                if left > 1 and n > 0:
                    out.append((r, n))
                    budget -= n
        return out

    def _plan(self) -> tuple[WorkerStep | None, list[tuple[_Request, int]]]:
        """Plans a step; when it does not fit: prefill chunks shrink (down to one page), then prefill waits for
        the decodes, then the newest request is preempted, or, running alone, starts its pages' host copies
        (``_copy_written_pages``). Shrinking first keeps a request admitted into a full pool prefilling a page
        at a time beside the decodes, where waiting would leave it stalled until they end."""
        prefill, max_chunk = True, self.config.max_batched_tokens
        shrunk = False
        while True:
            batch = self._batch(prefill, max_chunk)
            if not batch:
                self.calm = not shrunk
                return None, batch
            step = self.sched.plan_step([(r.id, n) for r, n in batch])
            if step.ok:
                self.calm = not shrunk
                return step, batch
            shrunk = True
            has_decode = any(len(r.tokens) - r.computed == 1 for r, _ in batch)
            has_prefill = any(len(r.tokens) - r.computed > 1 for r, _ in batch)
            if has_prefill and max_chunk > self.config.block_size:
                max_chunk = max(self.config.block_size, max_chunk // 2)
            elif prefill and has_decode and has_prefill:
                prefill = False
            elif len(self.running) > 1:
                self.preempt(self.running[-1].id)
                prefill, max_chunk = True, self.config.max_batched_tokens
            elif self._copy_written_pages():
                prefill, max_chunk = True, self.config.max_batched_tokens
            else:
                raise CapacityError(f"one request cannot run a single step ({step.missing_blocks} blocks missing): "
                                    f"{self.sched.capacity_log()}")

    def _copy_written_pages(self) -> bool:
        """Runs a step that schedules nothing: its plan starts the host copies of the pages the last step
        completed (the core plans a step's copies in the next plan, which a short plan is not). A lone request
        whose last chunk filled the pool can release those pages once they are on the host, where preempting
        it would only throw them away. False when no copy is started or still under way: nothing to wait for."""
        step = self.sched.plan_step([])
        self.worker.apply(step)
        self.sched.apply_results(self.worker.end_step(flush=True))
        return bool(step.plan.transfer_ids) or self.sched.capacity()["pending_transfers"] > 0

    def preempt(self, request_id: str) -> None:
        """Preempts a running request: dropped and recomputed later (``resident``), or kept on the host."""
        r = self.requests.get(request_id)
        if r is None or r.status != "running":
            raise InvalidArgumentError(f"request {request_id!r} is not running")
        residency = self.sched.request_info(r.id)["residency"]
        self.running.remove(r)
        if self.config.mode == "resident":
            self.sched.finish(r.id)
            kept = 0
            r.status = "waiting"
            self.waiting.appendleft(r)
        else:
            kept = self.sched.preempt(r.id)
            r.status = "preempted"
            self.preempted.appendleft(r)
        r.computed = kept
        self.events.append(Event(self.step, "preempt", r.id, residency, kept))

    def _finish(self, r: _Request) -> None:
        self.sched.finish(r.id)
        self.running.remove(r)
        r.status = "done"
        self.events.append(Event(self.step, "finish", r.id))

    # ------------------------------------------------------------------ the forward

    def _forward(self, step: WorkerStep) -> dict[str, int]:
        """One forward over the step's tokens; returns the next token of requests that reached their end."""
        model, w, c = self.model, self.worker, self.model.cfg
        dev = model.device
        sched = step.requests
        reqs = [self.requests[s.request_id] for s in sched]
        spans, at = [], 0
        for s in sched:
            spans.append((at, at + s.num_tokens))
            at += s.num_tokens
        tokens = torch.tensor([t for s, r in zip(sched, reqs, strict=True) for t in r.tokens[s.start: s.seq_len]],
                              dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(s.start, s.seq_len, device=dev) for s in sched])
        h = model.embed(tokens)
        reads: _GroupReads | None = None
        for layer in range(c.layers):
            group = c.layer_groups[layer]
            xn = model.norm(h)
            if layer == c.first_layer(group):
                q, k, wt = model.indexer(group, xn)
                parts = []
                for s, r, (a, b) in zip(sched, reqs, spans, strict=True):
                    r.idx_keys[group, s.start: s.seq_len] = k[a:b]
                    parts.append(model.select(q[a:b], wt[a:b], r.idx_keys[group, : s.seq_len], s.start))
                reads = self._resolve(group, torch.cat(parts), sched, spans)
            kv = model.kv_rows(layer, xn, positions)
            for s, (a, b) in zip(sched, spans, strict=True):
                w.write(s.request_id, positions[a:b], layer, kv[a:b])
            out = model.attend(model.query(layer, xn, positions), reads.read(layer), reads.valid)
            self._record(layer, out, sched, reqs, spans)
            h = model.finish_layer(layer, h, out)
        for s, r in zip(sched, reqs, strict=True):
            r.done_mask[s.start: s.seq_len] = True
        ends = [(r.id, b - 1) for s, r, (_, b) in zip(sched, reqs, spans, strict=True) if s.seq_len == len(r.tokens)]
        if not ends:
            return {}
        nxt = model.next_tokens(h[torch.tensor([i for _, i in ends], device=dev)]).tolist()
        return {rid: t for (rid, _), t in zip(ends, nxt, strict=True)}

    def _record(self, layer: int, out: torch.Tensor, sched: Sequence[ScheduledRequest], reqs: list[_Request],
                spans: list[tuple[int, int]]) -> None:
        d = digest(out)
        for s, r, (a, b) in zip(sched, reqs, spans, strict=True):
            again = r.done_mask[s.start: s.seq_len]
            if bool(again.any()):
                before = r.digests[layer, s.start: s.seq_len][again]
                r.mismatches += int((before != d[a:b][again]).sum())
            r.digests[layer, s.start: s.seq_len] = d[a:b]
            if r.outputs is not None:
                r.outputs[layer, s.start: s.seq_len] = out[a:b].reshape(b - a, -1)

    def _resolve(self, group: int, topk: torch.Tensor, sched: Sequence[ScheduledRequest],
                 spans: list[tuple[int, int]]) -> _GroupReads:
        """Resolves the group's selection: in one call when every request's non-resident positions fit its hot
        region, else in rounds (each request's rows split so that each round fits), gathering the history rows
        of every layer of the group right after each round."""
        w, dev = self.worker, self.model.device
        row_state = torch.cat([torch.full((b - a,), s.row, dtype=torch.int32, device=dev)
                               for s, (a, b) in zip(sched, spans, strict=True)])
        valid = topk >= 0
        away = valid & ~w.resident(row_state, topk)
        splits = [self._split(topk[a:b], away[a:b], a) for a, b in spans]
        rounds = max(len(p) for p in splits)
        self.resolves["calls"] += rounds
        if rounds == 1:
            row_ids = w.resolve(topk, row_state, group)
            self._check(topk, row_ids, row_state)
            return _GroupReads(w, topk, row_ids, None, None)
        self.resolves["split_groups"] += 1
        starts = torch.cat([torch.full((b - a,), s.start, device=dev) for s, (a, b) in zip(sched, spans, strict=True)])
        hist_mask = valid & (topk < starts[:, None])
        row_ids = torch.full_like(topk, -1)
        layers = self.layout.layers_of(group)
        hist = {layer: torch.zeros(*topk.shape, self.layout.row_bytes, dtype=torch.uint8, device=dev)
                for layer in layers}
        for j in range(rounds):
            idx = torch.tensor([i for p in splits if j < len(p) for i in p[j]], dtype=torch.int64, device=dev)
            ids = w.resolve(topk[idx], row_state[idx], group)
            self._check(topk[idx], ids, row_state[idx])
            row_ids[idx] = ids
            hist_ids = ids.masked_fill(~hist_mask[idx], -1)
            for layer in layers:
                hist[layer][idx] = w.gather(hist_ids, layer)
        return _GroupReads(w, topk, row_ids, hist_mask, hist)

    def _split(self, topk: torch.Tensor, away: torch.Tensor, offset: int) -> list[list[int]]:
        """Rows of one request in consecutive runs whose distinct non-resident positions fit the hot region."""
        n = topk.shape[0]
        if not bool(away.any()) or torch.unique(topk[away]).numel() <= self.hot_rows:
            return [list(range(offset, offset + n))]
        runs: list[list[int]] = [[]]
        seen: set[int] = set()
        for i, row in enumerate(torch.where(away, topk, -1).tolist()):
            new = {p for p in row if p >= 0}
            if len(seen | new) > self.hot_rows:
                runs.append([])
                seen = set()
            seen |= new
            runs[-1].append(offset + i)
        return runs

    def _check(self, topk: torch.Tensor, row_ids: torch.Tensor, row_state: torch.Tensor) -> None:
        bad = (topk >= 0) & (row_ids < 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            row = int(row_state[i])
            status = int(self.worker.dp.state["status"][row])
            raise InvariantError(f"state row {row}: resolve left selected positions unread (status {status})")
