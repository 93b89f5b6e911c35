"""Engine hooks: the small surface an inference engine calls, in two halves.

:class:`SchedulerHooks` lives next to the engine's scheduler and owns the residency core
(:class:`~hisparse.ResidencyManager`); :class:`WorkerHooks` lives in each worker and owns its
:class:`~hisparse.DataPath` (the KV slab, the host pool and the resolver's state). The only things that
cross between them are a :class:`WorkerStep` (scheduler -> worker, once per step) and a
:class:`StepResults` (worker -> scheduler, once per step), so the two halves can live in different
processes. Engines name requests with strings; the hooks map them onto the core's integer ids.

One step::

    scheduler (SchedulerHooks)                          worker (WorkerHooks)
    --------------------------                          --------------------
    between steps, any of:
      admit(rid, prompt_len, prefix_hashes)
      resume(rid) / preempt(rid) / finish(rid)
    step = plan_step([(rid, new_tokens), ...])
      step.ok False: nothing changed; shrink the
      batch or preempt someone, plan again
                               ────── step ──────▶  apply(step)          before the forward: tables, hot
                                                                         regions, restores (host -> GPU),
                                                                         page copies (GPU -> host) start
                                                    forward, per layer l:
                                                      write(rid, positions, l, kv) the new KV rows
                                                        (or token_rows(): the slot mapping)
                                                      resolve(topk, rids, group)   first layer of a group
                                                      gather(row_ids, l)           dense top-K rows
                                                    results = end_step()  after the forward: mirrors the
                                                                          written rows that have a host
                                                                          copy, collects selection heat
                               ◀──── results ─────                        and the finished copies
    apply_results(results)     complete(transfers), report_heat(...)
    capacity() / metrics() / capacity_log()

The order is enforced; a call out of order raises :class:`CallOrderError` and changes nothing:

* scheduler: ``plan_step`` -> ``apply_results`` -> ``plan_step`` ...: a second ``plan_step`` while the
  worker's results of the last good plan are outstanding is refused (the core relies on the tokens of a
  plan being written before the next one is made). A short plan (``step.ok`` False) needs no results.
* worker: ``apply(step N)`` -> (``write`` | ``token_rows`` | ``resolve`` | ``gather``)* -> ``end_step()`` ->
  ``apply(step N + 1)``: resolving outside a step, applying a plan twice, skipping one, applying a short
  plan, or starting the next step before ``end_step`` are refused.

With tensor parallelism every worker applies the same steps; any one worker's results (they are the same
copies and the same selections) go to ``apply_results``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._core import Admission, ResidencyManager, StepPlan
from .datapath import DataPath, Layout
from .errors import InvalidArgumentError, UnknownRequestError

__all__ = [
    "CallOrderError",
    "ScheduledRequest",
    "SchedulerHooks",
    "StepResults",
    "WorkerHooks",
    "WorkerStep",
]


class CallOrderError(InvalidArgumentError):
    """A hook was called out of the documented per-step order; nothing changed."""


@dataclass(frozen=True)
class ScheduledRequest:
    """One request of a step: its state row and the positions ``start .. start + num_tokens`` it writes."""

    request_id: str
    row: int
    start: int
    num_tokens: int

    @property
    def seq_len(self) -> int:
        """Tokens visible to this step (history and the new ones)."""
        return self.start + self.num_tokens


@dataclass(frozen=True)
class WorkerStep:
    """What the scheduler hands the worker for one step.

    ``step`` counts good plans from 1; a short plan (``ok`` False) has step 0 and must not be applied.
    """

    step: int
    plan: StepPlan
    requests: tuple[ScheduledRequest, ...]

    @property
    def ok(self) -> bool:
        return self.plan.ok

    @property
    def missing_blocks(self) -> int:
        return self.plan.missing_blocks

    def request(self, request_id: str) -> ScheduledRequest:
        for r in self.requests:
            if r.request_id == request_id:
                return r
        raise UnknownRequestError(f"request {request_id!r} is not scheduled in step {self.step}")


@dataclass
class StepResults:
    """What the worker reports after the forward of one step."""

    step: int
    #: Host copies (transfer ids of ``plan.materialize``) that finished, and those that failed.
    completed: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    #: Selection heat since the last step, per request that was scheduled: (pages, counts) of the pages
    #: that were selected.
    heat: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    #: Resolver counters of this step.
    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0


def _check_request_id(request_id: Any) -> str:
    if not isinstance(request_id, str):
        raise InvalidArgumentError(f"request ids are strings, not {type(request_id).__name__} ({request_id!r})")
    return request_id


class SchedulerHooks:
    """The scheduler half: admission, step plans, the worker's feedback, leaving, capacity and metrics.

    Give a :class:`~hisparse.ResidencyManager`, or its keyword arguments.
    """

    def __init__(self, manager: ResidencyManager | None = None, **config: Any):
        if manager is not None and config:
            raise InvalidArgumentError("give a ResidencyManager or its configuration, not both")
        self.manager = manager if manager is not None else ResidencyManager(**config)
        self._config = self.manager.config()
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next_id = 1
        self._steps = 0
        self._outstanding: int | None = None  # step whose results have not come back yet
        self._metrics = dict(hits=0, misses=0, h2d_bytes=0, admissions=0, prefix_hit_tokens=0, preemptions=0,
                             resumptions=0, finished=0, short_plans=0, transitions=0)

    # ------------------------------------------------------------------ ids

    def core_id(self, request_id: str) -> int:
        """The core's integer id of an admitted request."""
        try:
            return self._ids[_check_request_id(request_id)]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} is not admitted (or finished already)") from None

    def request_id(self, core_id: int) -> str:
        return self._names[core_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    @property
    def config(self) -> dict:
        """The manager's validated configuration."""
        return dict(self._config)

    @property
    def awaiting_results(self) -> int | None:
        """The step whose worker results are outstanding, or None."""
        return self._outstanding

    # ------------------------------------------------------------------ requests

    def admit(self, request_id: str, prompt_len: int, prefix_hashes: Sequence[int] = (),
              max_len: int | None = None) -> Admission:
        """Admits a request; ``prefix_hashes`` hash its full prompt pages (a chain: each covers all before it).

        Returns its :class:`~hisparse.Admission`: ``cached_tokens`` are not computed again (their pages are on
        the host, or still on the GPU). Raises :class:`~hisparse.CapacityError` (``.resource`` says which)
        when it cannot be backed now; nothing changed then. Takes effect with the next plan.
        """
        request_id = _check_request_id(request_id)
        if request_id in self._ids:
            raise InvalidArgumentError(f"request {request_id!r} is already admitted")
        core = self._next_id
        admission = self.manager.admit(core, prompt_len, list(prefix_hashes), max_len)
        self._next_id += 1
        self._ids[request_id] = core
        self._names[core] = request_id
        self._metrics["admissions"] += 1
        self._metrics["prefix_hit_tokens"] += admission.cached_tokens
        return admission

    def resume(self, request_id: str) -> Admission:
        """Brings a preempted request back from its kept host pages; ``cached_tokens`` is where it continues."""
        admission = self.manager.resume(self.core_id(request_id))
        self._metrics["resumptions"] += 1
        return admission

    def preempt(self, request_id: str) -> int:
        """Stops a running request; returns the tokens kept on the host (the rest is computed again)."""
        kept = self.manager.preempt(self.core_id(request_id))
        self._metrics["preemptions"] += 1
        return kept

    def finish(self, request_id: str) -> None:
        """Ends a request (finished or aborted); every block it holds goes back."""
        core = self.core_id(request_id)
        self.manager.finish(core)
        del self._ids[request_id]
        del self._names[core]
        self._metrics["finished"] += 1

    def request_info(self, request_id: str) -> dict:
        """``row`` (None when preempted), ``seq_len``, ``residency``, ``num_pages`` and more."""
        return self.manager.request_info(self.core_id(request_id))

    # ------------------------------------------------------------------ steps

    def plan_step(self, scheduled: Iterable[tuple[str, int]]) -> WorkerStep:
        """Plans one step: ``scheduled`` lists (request, tokens it adds). Hand the result to the worker.

        A short plan (``ok`` False, ``missing_blocks`` > 0) changed nothing and needs no results: shrink the
        batch or preempt someone, and plan again.
        """
        if self._outstanding is not None:
            raise CallOrderError(
                f"plan_step() called again before the worker's results of step {self._outstanding} were applied: "
                f"the worker must apply() that step, run its forward and end_step(), then pass the StepResults "
                f"to apply_results()"
            )
        scheduled = [(_check_request_id(rid), int(n)) for rid, n in scheduled]
        core_ids = [(self.core_id(rid), n) for rid, n in scheduled]
        starts = []
        for core, _ in core_ids:
            info = self.manager.request_info(core)
            starts.append(info["seq_len"])
        plan = self.manager.plan_step(core_ids)
        self._metrics["transitions"] += len(plan.transitions)
        if not plan.ok:
            self._metrics["short_plans"] += 1
            return WorkerStep(0, plan, ())
        self._steps += 1
        self._outstanding = self._steps
        requests = []
        for (rid, n), (core, _), start in zip(scheduled, core_ids, starts, strict=True):
            row = self.manager.request_info(core)["row"]
            requests.append(ScheduledRequest(rid, row, start, n))
        return WorkerStep(self._steps, plan, tuple(requests))

    def apply_results(self, results: StepResults) -> None:
        """Takes the worker's feedback of the outstanding step: finished (or failed) copies, selection heat."""
        if self._outstanding is None:
            raise CallOrderError(f"apply_results() for step {results.step}, but no step is waiting for results")
        if results.step != self._outstanding:
            raise CallOrderError(
                f"apply_results() got the results of step {results.step}; step {self._outstanding} is waiting"
            )
        m = self.manager
        if results.failed:
            m.complete(list(results.failed), ok=False)
        if results.completed:
            m.complete(list(results.completed), ok=True)
        for rid, (pages, counts) in results.heat.items():
            core = self._ids.get(rid)
            if core is None or core not in m:
                continue  # finished meanwhile
            info = m.request_info(core)
            if info["row"] is None or not pages:
                continue  # preempted meanwhile, or nothing selected
            kept = [(p, c) for p, c in zip(pages, counts, strict=True) if p < info["num_pages"]]
            m.report_heat(core, [p for p, _ in kept], [c for _, c in kept])
        self._metrics["hits"] += results.hits
        self._metrics["misses"] += results.misses
        self._metrics["h2d_bytes"] += results.h2d_bytes
        self._outstanding = None

    # ------------------------------------------------------------------ capacity and metrics

    def capacity(self) -> dict:
        """The pools now: GPU blocks (free, used, hot, released), host blocks, running requests by residency,
        and the steady-state concurrency."""
        return dict(self.manager.stats())

    def capacity_log(self) -> str:
        return self.manager.capacity_log()

    def metrics(self) -> dict:
        """Counters since construction: resolver hits, misses and host-to-device bytes (from the worker's
        results), page restores and copies, releases, admissions, preemptions, residency transitions."""
        s = self.manager.stats()
        page_bytes = self._config["page_bytes"]
        out = dict(self._metrics)
        out.update(
            steps=self._steps,
            restored_pages=s["total_restored"],
            restored_bytes=s["total_restored"] * page_bytes,
            materialized_pages=s["total_materialized"],
            released_pages=s["total_released"],
            lost_pages=s["total_lost"],
        )
        out["h2d_bytes_total"] = out["h2d_bytes"] + out["restored_bytes"]
        reads = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / reads if reads else None
        return out


class WorkerHooks:
    """The worker half: the KV slab and host pool, the step plan before the forward, ``resolve`` and
    ``gather`` during attention, and the step's results after it."""

    def __init__(self, datapath: DataPath):
        self.dp = datapath
        self._step: WorkerStep | None = None  # the step in its forward
        self._last = 0
        self._started: list[int] = []
        self._rows: dict[str, int] = {}
        self._mirrored = False
        self._counters = self._read_counters()

    @classmethod
    def build(cls, layout: Layout, device: str | torch.device = "cpu") -> WorkerHooks:
        """A worker with a fresh data path (slab on ``device``, host pool pinned when that is CUDA)."""
        return cls(DataPath(layout, device))

    @classmethod
    def register(cls, layout: Layout, gpu: torch.Tensor | Sequence[torch.Tensor], host: torch.Tensor) -> WorkerHooks:
        """A worker over an engine's own tensors. ``gpu``: the KV slab, one uint8 tensor [layers, num_gpu_blocks
        * bs, row_bytes], or one contiguous [num_gpu_blocks * bs, row_bytes] uint8 tensor per layer (engines
        that allocate each layer's cache apart); a block id addresses the same rows in every layer. ``host``:
        the host pool [layers, num_host_blocks * bs, row_bytes] uint8 in CPU memory (pinned when the slab is on
        CUDA)."""
        return cls(DataPath(layout, gpu=gpu, host=host))

    @property
    def layout(self) -> Layout:
        return self.dp.layout

    @property
    def device(self) -> torch.device:
        return self.dp.device

    @property
    def in_step(self) -> int | None:
        """The step in its forward (applied, not ended), or None."""
        return self._step.step if self._step is not None else None

    def _read_counters(self) -> tuple[int, int, int]:
        c = self.dp.counters
        return c["hits"], c["misses"], c["h2d_bytes"]

    def _need_step(self, what: str) -> WorkerStep:
        if self._step is None:
            nxt = self._last + 1
            raise CallOrderError(f"{what} outside a step: apply() the plan of step {nxt} first")
        return self._step

    # ------------------------------------------------------------------ before the forward

    def apply(self, step: WorkerStep) -> list[int]:
        """Applies a step's plan before its forward; returns the host copies it started (their transfer ids)."""
        if not isinstance(step, WorkerStep):
            raise InvalidArgumentError(f"apply() takes the WorkerStep from plan_step(), not {type(step).__name__}")
        if self._step is not None:
            raise CallOrderError(
                f"apply() of step {step.step} while step {self._step.step} is in its forward: call end_step() first"
            )
        if not step.ok:
            raise CallOrderError(
                f"apply() of a short plan ({step.missing_blocks} blocks missing): it changed nothing and must not "
                f"be applied; plan again"
            )
        if step.step <= self._last:
            raise CallOrderError(f"the plan of step {step.step} was applied already (last applied: {self._last})")
        if step.step != self._last + 1:
            raise CallOrderError(f"apply() of step {step.step} skips step {self._last + 1}: apply plans in order")
        self._started = self.dp.apply(step.plan)
        cleared = set(step.plan.cleared_rows)
        self._rows = {rid: row for rid, row in self._rows.items() if row not in cleared}
        for r in step.requests:
            self._rows[r.request_id] = r.row
        self._step = step
        self._last = step.step
        self._mirrored = False
        return list(self._started)

    # ------------------------------------------------------------------ during the forward

    def row(self, request_id: str) -> int:
        """The state row of a request (as of the last applied step)."""
        try:
            return self._rows[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} has no state row on this worker") from None

    def rows(self, request_ids: Sequence[str | None]) -> torch.Tensor:
        """``row_state`` for :meth:`resolve`: int32 state rows, -1 for ``None`` (padding rows)."""
        rows = [-1 if r is None else self.row(r) for r in request_ids]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def token_rows(self, request_id: str, positions: torch.Tensor) -> torch.Tensor:
        """GPU rows (the slot mapping) where the new KV of ``positions`` of a scheduled request is written."""
        step = self._need_step("token_rows()")
        req = step.request(request_id)
        positions = positions.to(device=self.device, dtype=torch.int64)
        if positions.numel() and (int(positions.min()) < req.start or int(positions.max()) >= req.seq_len):
            raise InvalidArgumentError(
                f"request {request_id!r} writes positions {req.start}..{req.seq_len - 1} in step {step.step}"
            )
        return self.dp.token_rows(req.row, positions)

    def write(self, request_id: str, positions: torch.Tensor, layer: int, rows: torch.Tensor) -> None:
        """Writes the new KV ``rows`` [n, row_bytes] uint8 of ``positions`` [n] of a scheduled request into
        ``layer`` of the slab."""
        dest = self.token_rows(request_id, positions)
        if rows.dtype != torch.uint8 or tuple(rows.shape) != (dest.numel(), self.layout.row_bytes):
            raise InvalidArgumentError(
                f"rows must be [{dest.numel()}, {self.layout.row_bytes}] uint8, not {rows.dtype} {list(rows.shape)}"
            )
        self.dp.gpu[layer][dest] = rows.to(self.device)

    def resident(self, rows: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        """Which positions of ``topk`` [batch rows, top_k] (of state ``rows`` [batch rows]) are on the GPU as of
        the applied plan (a resolve reads them in place); False for -1 pads. Lets an engine split a large
        selection (a prefill chunk) into resolves that each fit the hot region."""
        self._need_step("resident()")
        bs = self.layout.block_size
        pos = topk.to(device=self.device, dtype=torch.int64)
        rows = rows.to(device=self.device, dtype=torch.int64)
        blocks = self.dp.state["block_table"][rows[:, None], pos.clamp(min=0) // bs]
        return (pos >= 0) & (blocks != 0)

    def resolve(self, topk: torch.Tensor, rows: torch.Tensor | Sequence[str | None], group: int = 0) -> torch.Tensor:
        """Row ids into every layer of ``group`` for ``topk`` [batch rows, top_k] positions (-1 pads).

        ``rows``: the int32 state row of each batch row, or the request id of each (None: a padding row).
        Resident positions read in place; the others come through the request's hot region (SPEC.md). Read the
        rows of a layer with :meth:`gather` before the next ``resolve`` of the same group.
        """
        self._need_step("resolve()")
        if not isinstance(rows, torch.Tensor):
            rows = self.rows(list(rows))
        if not 0 <= group < self.layout.num_groups:
            raise InvalidArgumentError(f"group {group} out of range (the layout has {self.layout.num_groups})")
        return self.dp.resolve(topk.to(device=self.device, dtype=torch.int32).contiguous(),
                               rows.to(device=self.device, dtype=torch.int32).contiguous(), group)

    def gather(self, row_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """Dense rows [batch rows, top_k, row_bytes] uint8 of one layer, in top-K order; zeros for -1."""
        self._need_step("gather()")
        return self.dp.gather(row_ids.contiguous(), layer)

    # ------------------------------------------------------------------ after the forward

    def mirror_written(self) -> int:
        """Copies this step's written rows whose page already has a durable host copy to the host pool (every
        layer) and empties hot slots holding them; returns the rows mirrored. The core copies whole pages once
        they are complete, so appended tokens normally need none; an engine that rewrites rows (e.g. after
        rejected speculative tokens) relies on it. :meth:`end_step` calls it."""
        step = self._need_step("mirror_written()")
        if self._mirrored:
            return 0
        self._mirrored = True
        bs = self.layout.block_size
        st = self.dp.state
        pairs: list[tuple[int, int]] = []
        invalid: list[tuple[int, int]] = []
        for r in step.requests:
            if r.num_tokens == 0:
                continue
            first, last = r.start // bs, (r.seq_len - 1) // bs
            host = st["host_table"][r.row, first: last + 1]
            if not bool((host >= 0).any()):
                continue
            positions = torch.arange(r.start, r.seq_len, dtype=torch.int64, device=self.device)
            hb = st["host_table"][r.row, positions // bs].to(torch.int64)
            gb = st["block_table"][r.row, positions // bs].to(torch.int64)
            keep = (hb >= 0) & (gb > 0)
            gpu_rows = (gb * bs + positions % bs)[keep].tolist()
            host_rows = (hb * bs + positions % bs)[keep].tolist()
            pairs += list(zip(gpu_rows, host_rows, strict=True))
            invalid += [(r.row, int(p)) for p in positions[keep].tolist()]
        if pairs:
            self.dp.mirror(pairs)
            self.dp.invalidate(invalid)
        return len(pairs)

    def end_step(self) -> StepResults:
        """Ends the step after the forward: mirrors written rows, waits for this step's copies, and returns the
        results for :meth:`SchedulerHooks.apply_results`."""
        step = self._need_step("end_step()")
        self.mirror_written()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        taken = self.dp.take_heat([r.row for r in step.requests])
        heat = {r.request_id: taken[r.row] for r in step.requests}
        now = self._read_counters()
        hits, misses, h2d = (a - b for a, b in zip(now, self._counters, strict=True))
        self._counters = now
        results = StepResults(step.step, tuple(self._started), (), heat, hits, misses, h2d)
        self._step = None
        self._started = []
        return results
