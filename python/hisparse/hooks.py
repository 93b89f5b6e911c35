"""Engine hooks: the small surface an inference engine calls, in two halves.

:class:`SchedulerHooks` lives next to the engine's scheduler and owns the residency core
(:class:`~hisparse.ResidencyManager`); :class:`WorkerHooks` lives in each worker and owns its
:class:`~hisparse.DataPath` (the KV slab, the host pool and the resolver's state). The only things that
cross between them are a :class:`WorkerStep` (scheduler -> worker, once per step) and a
:class:`StepResults` (worker -> scheduler, once per step); both pickle, so the two halves can live in
different processes. Engines name requests with strings; the hooks map them onto the core's integer ids.

One step::

    scheduler (SchedulerHooks)                          worker (WorkerHooks)
    --------------------------                          --------------------
    between steps, any of:
      admit(rid, prompt_len, prefix_hashes)
      resume(rid) / preempt(rid) / finish(rid)
    step = plan_step([(rid, new_tokens), ...])
      step.ok False: nothing changed; shrink the
      batch or preempt someone, plan again
                               ────── step ──────▶  apply(step)          before the forward: one call applies
                                                                         tables, hot regions, restores
                                                                         (host -> GPU), page copies (GPU -> host)
                                                    forward, per layer l:
                                                      write(rid, positions, l, kv) the new KV rows
                                                        (or token_rows(): the slot mapping)
                                                      resolve(topk, rows, group)   first layer of a group
                                                      gather(row_ids, l)           dense top-K rows
                                                    results = end_step()  after the forward: the copies that
                                                                          ended, every heat interval a
                                                                          heat summary, resolver counters
                               ◀──── results ─────
    apply_results(results)     one atomic core call: copies ended or failed, the heat summary
    capacity() / metrics() / capacity_log()

Per step each half makes one call into the core and does no per-request or per-page work in Python (the
engine's own loops aside). Selection heat stays on the worker (the resolver counts it on the device); every
``HeatOptions.interval`` steps the worker sends the coldest releasable pages of each request and halves the
counts (``rust/core/src/heat.rs`` gives the decay rule).

The order is enforced; a call out of order raises :class:`CallOrderError` and changes nothing:

* scheduler: ``plan_step`` -> ``apply_results`` -> ``plan_step`` ...: a second ``plan_step`` while the
  worker's results of the last good plan are outstanding is refused (the core relies on the tokens of a
  plan being written before the next one is made). A short plan (``step.ok`` False) needs no results.
* worker: ``apply(step N)`` -> (``write`` | ``token_rows`` | ``resolve`` | ``gather``)* -> ``end_step()`` ->
  ``apply(step N + 1)``: resolving outside a step, applying a plan twice, skipping one, applying a short
  plan, or starting the next step before ``end_step`` are refused. A worker handed a step past its next one
  (it was rebuilt, or missed steps) raises :class:`StepGapError`: the scheduler's ``resync_worker()`` then
  gives the step that brings it to the current state, which every worker applies.
* one scheduler, one worker state: each step carries its scheduler's identity, and its results carry it back.
  A scheduler refuses the results of another's step, and a worker another scheduler's step but a resync. A
  resync is refused too once it is stale: its scheduler's steps have gone past it on this worker, or the
  worker has left its scheduler for another's resync (a resync delivered again would take the worker back and
  redo old page copies over host blocks that now hold other pages).

With tensor parallelism every worker applies the same steps; any one worker's results (they are the same
copies and the same selections) go to ``apply_results``.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import torch

from ._core import Admission, ResidencyManager, StepPlan
from .datapath import DataPath, Layout, _bounded_list, _int64, _to_device
from .errors import InvalidArgumentError, UnknownRequestError
from .heat import HeatOptions, HeatSummaryInFlight

__all__ = [
    "CallOrderError",
    "ScheduledRequest",
    "SchedulerHooks",
    "StepGapError",
    "StepResults",
    "WorkerHooks",
    "WorkerStep",
]


#: Integer dtypes whose every value fits in int32.
_NARROW_INTS = (torch.int8, torch.int16, torch.int32, torch.uint8)


class CallOrderError(InvalidArgumentError):
    """A hook was called out of the documented per-step order; nothing changed."""


class StepGapError(CallOrderError):
    """A worker was handed a step past the next one: it was rebuilt (a new process starts at step 0) or
    missed steps. Its state cannot be trusted; apply the step of :meth:`SchedulerHooks.resync_worker`."""


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
    """What the scheduler hands the worker for one step: the plan, and the engine's name of each request
    the plan schedules (``request_ids[i]`` is ``plan.scheduled[i]``).

    ``step`` counts good plans and resyncs from 1; a short plan (``ok`` False) has step 0 and must not be applied.
    ``resync``: the plan of :meth:`SchedulerHooks.resync_worker`, which a worker applies whatever it applied
    before. ``plan`` may also be given as its bytes (``StepPlan.to_bytes``); it is decoded and checked.
    ``scheduler``: the identity of the :class:`SchedulerHooks` that planned it (0: not said, not checked),
    which the worker's results carry back: transfer ids and step numbers are per scheduler, so results of
    another scheduler's step would name its copies as this one's.
    """

    step: int
    plan: StepPlan
    request_ids: tuple[str, ...] = ()
    resync: bool = False
    scheduler: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        if type(self.step) is not int or self.step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, not {self.step!r}")
        if type(self.resync) is not bool:
            raise InvalidArgumentError(f"resync must be True or False, not {self.resync!r}")
        if type(self.scheduler) is not int or not 0 <= self.scheduler < 1 << 64:
            raise InvalidArgumentError(f"scheduler must be an int in 0..2**64, not {self.scheduler!r}")
        plan = self.plan
        if isinstance(plan, bytes | bytearray):
            object.__setattr__(self, "plan", plan := StepPlan.from_bytes(plan))
        if not isinstance(plan, StepPlan):
            raise InvalidArgumentError(f"plan must be a StepPlan (or its bytes), not {type(plan).__name__}")
        ids = self.request_ids
        if isinstance(ids, list):
            object.__setattr__(self, "request_ids", ids := tuple(ids))
        if not isinstance(ids, tuple) or len(ids) != plan.num_scheduled or not all(type(rid) is str for rid in ids):
            raise InvalidArgumentError(
                f"request_ids must name the plan's {plan.num_scheduled} scheduled requests with strings"
            )

    @classmethod
    def _of_plan(cls, step: int, plan: StepPlan, request_ids: tuple[str, ...], resync: bool = False,
                 scheduler: int = 0) -> WorkerStep:
        """What ``plan_step`` builds: its values are right by construction, so the per-step cost of checking
        them (a pass over every request id) is skipped."""
        obj = object.__new__(cls)
        for name, value in (("step", step), ("plan", plan), ("request_ids", request_ids), ("resync", resync),
                            ("scheduler", scheduler)):
            object.__setattr__(obj, name, value)
        return obj

    def __getstate__(self) -> dict:
        """What crosses processes: the fields, not the views built from them on demand."""
        return {name: getattr(self, name) for name in _STEP_DEFAULTS}

    def __setstate__(self, state: object) -> None:
        """An unpickled step is checked as a constructed one: it may come from anywhere."""
        if not isinstance(state, dict) or not set(state) <= set(_STEP_DEFAULTS) or not {"step", "plan"} <= set(state):
            raise InvalidArgumentError(f"a pickled WorkerStep holds {list(_STEP_DEFAULTS)}, not {state!r:.200}")
        for name, default in _STEP_DEFAULTS.items():
            object.__setattr__(self, name, state.get(name, default))
        self._check()

    @property
    def ok(self) -> bool:
        return self.plan.ok

    @property
    def missing_blocks(self) -> int:
        return self.plan.missing_blocks

    @cached_property
    def requests(self) -> tuple[ScheduledRequest, ...]:
        """The scheduled requests, built on first use (the worker's step path does not need them)."""
        return tuple(ScheduledRequest(rid, row, start, n)
                     for rid, (_, row, start, n) in zip(self.request_ids, self.plan.scheduled, strict=True))

    @cached_property
    def _by_id(self) -> dict[str, ScheduledRequest]:
        return {r.request_id: r for r in self.requests}

    def request(self, request_id: str) -> ScheduledRequest:
        try:
            return self._by_id[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"request {request_id!r} is not scheduled in step {self.step}") from None


@dataclass(slots=True)
class StepResults:
    """What the worker reports after the forward of one step. Edit it (or :func:`dataclasses.replace` it) to
    hold back or fail completions; a refused report changes nothing and can be sent again, corrected. (Not
    frozen: a frozen dataclass costs microseconds to build, and one is built every step.)"""

    step: int
    #: Host copies (transfer ids of ``plan.materialize``) that finished, and those that failed. A copy still
    #: in flight is reported by a later step's results.
    completed: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    #: A heat summary (``DataPath.heat_summary``), every ``HeatOptions.interval`` steps; None in between.
    heat: bytes | None = None
    #: Resolver counters since the last results that carried them (with each heat summary:
    #: metrics need no more, and reading them every step would cost more than the rest of ``end_step``).
    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    #: The ``WorkerStep.scheduler`` of the step these results end (0: not said, not checked).
    scheduler: int = field(default=0, compare=False)

    def __getstate__(self) -> dict:
        # Said, so that every pickle protocol takes it (0 and 1 need it for a class with slots).
        return {name: getattr(self, name) for name in _RESULT_DEFAULTS}

    def __setstate__(self, state: object) -> None:
        # Also what earlier versions pickled, (None, {slot: value}), without the fields added since.
        if isinstance(state, tuple) and len(state) == 2 and state[0] is None:
            state = state[1]
        if not isinstance(state, dict) or not set(state) <= set(_RESULT_DEFAULTS) or "step" not in state:
            raise InvalidArgumentError(f"a pickled StepResults holds {list(_RESULT_DEFAULTS)}, not {state!r:.200}")
        for name, default in _RESULT_DEFAULTS.items():
            object.__setattr__(self, name, state.get(name, default))


def _field_defaults(cls: type) -> dict[str, Any]:
    """Each field of a dataclass and its default: what a field missing from a pickle holds (required fields
    are checked present first)."""
    return {f.name: f.default for f in fields(cls)}


_STEP_DEFAULTS = _field_defaults(WorkerStep)
_RESULT_DEFAULTS = _field_defaults(StepResults)


def _check_request_id(request_id: Any) -> str:
    """The id as the hooks keep it and hand it to the worker: a plain ``str``. A subclass's value (e.g.
    ``numpy.str_``) is taken as that string, as a step that crosses processes must carry it."""
    if type(request_id) is str:
        return request_id
    if not isinstance(request_id, str):
        raise InvalidArgumentError(f"request ids are strings, not {type(request_id).__name__} ({request_id!r})")
    return str.__str__(request_id)


class SchedulerHooks:
    """The scheduler half: admission, step plans, the worker's feedback, leaving, capacity and metrics.

    Give a :class:`~hisparse.ResidencyManager`, or its keyword arguments.
    """

    def __init__(self, manager: ResidencyManager | None = None, **config: Any):
        if manager is not None and config:
            raise InvalidArgumentError("give a ResidencyManager or its configuration, not both")
        if manager is not None and not isinstance(manager, ResidencyManager):
            raise InvalidArgumentError(f"manager must be a ResidencyManager, not {type(manager).__name__}")
        self.manager = manager if manager is not None else ResidencyManager(**config)
        self._config = self.manager.config()
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._next_id = 1
        self._steps = 0
        self._outstanding: int | None = None  # step whose results have not come back yet
        # Which scheduler planned a step (``WorkerStep.scheduler``): random, so that another's differs; 63
        # bits, so that an engine may carry it as an int64.
        self._identity = int.from_bytes(os.urandom(8), "little") >> 1 | 1
        self._metrics = dict(hits=0, misses=0, h2d_bytes=0, admissions=0, prefix_hit_tokens=0, preemptions=0,
                             resumptions=0, finished=0, short_plans=0, transitions=0, resyncs=0)

    # ------------------------------------------------------------------ ids

    def core_id(self, request_id: str) -> int:
        """The core's integer id of an admitted request."""
        try:
            return self._ids[_check_request_id(request_id)]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} is not admitted (or finished already)") from None

    def request_id(self, core_id: int) -> str:
        try:
            return self._names[core_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"no admitted request has core id {core_id!r}") from None

    def __contains__(self, request_id: object) -> bool:
        return isinstance(request_id, str) and _check_request_id(request_id) in self._ids

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
        """Admits a request; ``prefix_hashes`` hash its full prompt pages (a chain: each covers all before it;
        any int, Python's negative ``hash()`` values included).

        Returns its :class:`~hisparse.Admission`: ``cached_tokens`` are not computed again (their pages are on
        the host, or still on the GPU). Raises :class:`~hisparse.CapacityError` (``.resource`` says which)
        when it cannot be backed now; nothing changed then. Takes effect with the next plan.
        """
        request_id = _check_request_id(request_id)
        if request_id in self._ids:
            raise InvalidArgumentError(f"request {request_id!r} is already admitted")
        core = self._next_id
        admission = self.manager.admit(core, prompt_len, prefix_hashes, max_len)
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
        request_id = _check_request_id(request_id)
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
        # One comprehension per step (it runs for every request every step); the core checks the counts.
        pairs = scheduled if isinstance(scheduled, list) else _bounded_list(scheduled, "scheduled")
        ids = self._ids
        try:
            core = [(ids[rid], n) for rid, n in pairs]
        except (KeyError, TypeError, ValueError):
            pairs = [self._checked_pair(pair) for pair in pairs]  # ids given as str subclasses, or a precise error
            core = [(self.core_id(rid), n) for rid, n in pairs]
        # Named from the caller's pairs, not from ``_names``, which an engine's abort thread may finish() a
        # request out of at any point of this call.
        request_ids = tuple([rid if type(rid) is str else _check_request_id(rid) for rid, _ in pairs])
        plan = self.manager.plan_step(core)
        self._metrics["transitions"] += plan.num_transitions
        if not plan.ok:
            self._metrics["short_plans"] += 1
            return WorkerStep._of_plan(0, plan, (), scheduler=self._identity)
        self._steps += 1
        self._outstanding = self._steps
        return WorkerStep._of_plan(self._steps, plan, request_ids, scheduler=self._identity)

    @staticmethod
    def _checked_pair(pair: Any) -> tuple[str, Any]:
        """A scheduled pair with its request id as the hooks keep it (else the precise error)."""
        try:
            request_id, tokens = pair
        except (TypeError, ValueError):
            raise InvalidArgumentError("scheduled must be a sequence of (request_id, new_tokens) pairs") from None
        return _check_request_id(request_id), tokens

    def resync_worker(self) -> WorkerStep:
        """The step that brings a rebuilt worker (a new process, a crashed rank, one whose ``apply`` raised
        :class:`StepGapError`) to the current state; with several workers, every one applies it.

        Its plan clears every row and sets each running request's length, table and (empty) hot region
        again; copies to the host still in flight count as failed and start again under new ids (reports of
        the old ids are refused from now on). Nothing is lost: blocks, pages and host copies stay as they are.
        If the worker's results of the last step never came back, this step replaces that step with its
        restores and scheduled requests again: run their forward again. Otherwise it schedules nothing. Either
        way it is a new step, numbered after the last, whose results the worker ends it with and hands to
        :meth:`apply_results`: the lost step's results, should the dead worker's still arrive, are refused (they
        report its copies under the ids this step has replaced, and would take the place of this step's).
        """
        plan = self.manager.resync(self._outstanding is not None)
        self._steps += 1
        self._outstanding = self._steps
        self._metrics["resyncs"] += 1
        names = self._names
        return WorkerStep._of_plan(self._outstanding, plan, tuple([names[s[0]] for s in plan.scheduled]),
                                   resync=True, scheduler=self._identity)

    def apply_results(self, results: StepResults) -> None:
        """Takes the worker's feedback of the outstanding step in one atomic core call: finished and failed
        copies, and the heat summary. A refused report changed nothing; the step still waits for its results."""
        if not isinstance(results, StepResults):
            raise InvalidArgumentError(f"apply_results() takes StepResults, not {type(results).__name__}")
        if type(results.step) is not int:
            raise InvalidArgumentError(f"results.step must be an int, not {type(results.step).__name__}")
        if results.scheduler not in (0, self._identity):
            raise InvalidArgumentError(f"these are the results of step {results.step} of another scheduler: a "
                                       f"worker's results go to the SchedulerHooks that planned its steps")
        if self._outstanding is None:
            raise CallOrderError(f"apply_results() for step {results.step}, but no step is waiting for results")
        if results.step != self._outstanding:
            raise CallOrderError(
                f"apply_results() got the results of step {results.step}; step {self._outstanding} is waiting"
            )
        hits, misses, h2d = results.hits, results.misses, results.h2d_bytes
        if not (type(hits) is int and type(misses) is int and type(h2d) is int and min(hits, misses, h2d) >= 0):
            raise InvalidArgumentError(f"hits, misses and h2d_bytes must be non-negative integers, not {hits!r}, "
                                       f"{misses!r}, {h2d!r}")
        self.manager.apply_results(results.completed, results.failed, results.heat)
        m = self._metrics
        m["hits"] += hits
        m["misses"] += misses
        m["h2d_bytes"] += h2d
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


@dataclass
class _InFlight:
    """Host copies started by one step; on CUDA they are done once ``event`` is."""

    transfers: tuple[int, ...]
    event: Any = None

    def done(self) -> bool:
        return self.event is None or self.event.query()


@dataclass
class _LaggedCounters:
    """The resolver's counters, read without waiting for the device: each step copies them into pinned
    memory behind an event, and the next step reads the copy once the event is done. On CPU they are read in
    place through a view of their memory (a torch call after the forward costs tens of microseconds: the
    forward has evicted torch's dispatcher from the caches)."""

    device: torch.device
    last: tuple[int, int, int] = (0, 0, 0)
    pending: list = field(default_factory=list)
    view: tuple = (None, None)

    def _read_cpu(self, counters: torch.Tensor) -> tuple[int, int, int]:
        tensor, array = self.view
        if tensor is not counters:
            if counters.dtype != torch.int64 or counters.shape != (3,) or not counters.is_contiguous():
                raise InvalidArgumentError("the counters tensor must be 3 contiguous int64")
            array = (ctypes.c_int64 * 3).from_address(counters.data_ptr())
            self.view = (counters, array)
        return tuple(array)

    def take(self, counters: torch.Tensor) -> tuple[int, int, int]:
        """The counters' growth since the last call that could read them (on CPU: now)."""
        if self.device.type != "cuda":
            now = self._read_cpu(counters)
        else:
            host = torch.empty(3, dtype=torch.int64, pin_memory=True)
            with torch.cuda.device(self.device):  # the data path's device, whichever is current
                host.copy_(counters, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
            self.pending.append((host, event))
            now = self.last
            while self.pending and self.pending[0][1].query():
                now = tuple(self.pending.pop(0)[0].tolist())
        grown = tuple(a - b for a, b in zip(now, self.last, strict=True))
        self.last = now
        return grown


class WorkerHooks:
    """The worker half: the KV slab and host pool, the step plan before the forward, ``resolve`` and
    ``gather`` during attention, and the step's results after it.

    ``heat``: when heat summaries go out and what they rank (:class:`~hisparse.heat.HeatOptions`; its
    ``layer_stride`` is vLLM's: here the resolver counts every group).
    """

    def __init__(self, datapath: DataPath, *, heat: HeatOptions | None = None):
        if not isinstance(datapath, DataPath):
            raise InvalidArgumentError(f"datapath must be a DataPath, not {type(datapath).__name__}")
        if heat is not None and not isinstance(heat, HeatOptions):
            raise InvalidArgumentError(f"heat must be HeatOptions, not {type(heat).__name__}")
        self.dp = datapath
        self._cuda = datapath.device.type == "cuda"
        self.heat = heat if heat is not None else HeatOptions()
        self._step: WorkerStep | None = None  # the step in its forward
        self._last = 0
        self._scheduler = 0  # the WorkerStep.scheduler of the steps applied (0: none said yet)
        self._left: set[int] = set()  # the schedulers this worker left for another's resync
        self._named = 0  # the last scheduler a step applied named (kept through a resync that names none)
        self._in_flight: list[_InFlight] = []
        self._summaries: list[HeatSummaryInFlight] = []
        # From the counts the data path holds now: a worker rebuilt over a used one reports only its own steps.
        self._counters = _LaggedCounters(datapath.device, last=tuple(datapath.state["counters"].tolist()))

    @classmethod
    def build(cls, layout: Layout, device: str | torch.device = "cpu", *,
              heat: HeatOptions | None = None) -> WorkerHooks:
        """A worker with a fresh data path (slab on ``device``, host pool pinned when that is CUDA)."""
        return cls(DataPath(layout, device), heat=heat)

    @classmethod
    def register(cls, layout: Layout, gpu: torch.Tensor | Sequence[torch.Tensor], host: torch.Tensor, *,
                 heat: HeatOptions | None = None) -> WorkerHooks:
        """A worker over an engine's own tensors. ``gpu``: the KV slab, one uint8 tensor [layers, num_gpu_blocks
        * bs, row_bytes], or one contiguous [num_gpu_blocks * bs, row_bytes] uint8 tensor per layer (engines
        that allocate each layer's cache apart); a block id addresses the same rows in every layer. ``host``:
        the host pool [layers, num_host_blocks * bs, row_bytes] uint8 in CPU memory (pinned when the slab is on
        CUDA)."""
        return cls(DataPath(layout, gpu=gpu, host=host), heat=heat)

    @property
    def layout(self) -> Layout:
        return self.dp.layout

    @property
    def device(self) -> torch.device:
        return self.dp.device

    @property
    def last_step(self) -> int:
        """The last step applied (0: none yet, e.g. a worker just rebuilt)."""
        return self._last

    @property
    def in_step(self) -> int | None:
        """The step in its forward (applied, not ended), or None."""
        return self._step.step if self._step is not None else None

    def _need_step(self, what: str) -> WorkerStep:
        if self._step is None:
            raise CallOrderError(f"{what} outside a step: apply() the plan of step {self._last + 1} first")
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
        other = bool(step.scheduler and self._scheduler and step.scheduler != self._scheduler)
        if step.resync:
            # Applied whatever this worker applied before, unless it is an old one delivered again (step numbers
            # are per scheduler: compared only when the step names this worker's).
            same = step.scheduler and step.scheduler == self._scheduler
            if step.scheduler in self._left or (same and step.step <= self._last):
                raise CallOrderError(
                    f"apply() of a stale resync step ({step.step}): this worker has applied later steps of its "
                    f"scheduler (last: {self._last}) or left it for another scheduler's resync"
                )
        elif other:
            raise StepGapError(
                f"apply() of step {step.step} of another scheduler than the steps this worker applied: its state "
                f"is that scheduler's; apply the new scheduler's SchedulerHooks.resync_worker() step instead"
            )
        elif step.step <= self._last:
            raise CallOrderError(f"the plan of step {step.step} was applied already (last applied: {self._last})")
        elif step.step != self._last + 1:
            raise StepGapError(
                f"apply() of step {step.step} skips step {self._last + 1}: this worker was rebuilt or missed steps; "
                f"apply the step of SchedulerHooks.resync_worker() instead"
            )
        copied = self.dp.apply(step.plan)  # on CUDA, the event of the page copies to the host
        if step.resync:  # the scheduler counts every copy in flight here as failed, and starts it again
            self._in_flight, self._summaries = [], []
        started = step.plan.transfer_ids
        if started:
            self._in_flight.append(_InFlight(tuple(started), copied))
        self._step = step
        self._last = step.step
        # A resync makes the worker its scheduler's, whatever it held before. The scheduler it served before is
        # known left once a step names another (at once, or after a resync that names none).
        if step.scheduler:
            if self._named and step.scheduler != self._named:
                self._left.add(self._named)
            self._named = step.scheduler
        self._scheduler = step.scheduler if step.resync else step.scheduler or self._scheduler
        return started

    # ------------------------------------------------------------------ during the forward

    def row(self, request_id: str) -> int:
        """The state row of a request scheduled in the step in its forward."""
        return self._need_step("row()").request(request_id).row

    def rows(self, request_ids: Sequence[str | None]) -> torch.Tensor:
        """``row_state`` for :meth:`resolve`: int32 state rows, -1 for ``None`` (padding rows)."""
        step = self._need_step("rows()")
        rows = [-1 if r is None else step.request(r).row for r in request_ids]
        return _to_device(torch.tensor(rows, dtype=torch.int32), self.device)  # pinned: the host does not wait

    def slot_mapping(self) -> torch.Tensor:
        """The GPU rows where the step writes its new KV, every token of every scheduled request in the step's
        order (``WorkerStep.requests``): an engine's slot mapping in one call, no per-request work."""
        return self.dp.slot_mapping(self._need_step("slot_mapping()").plan)

    def token_rows(self, request_id: str, positions: torch.Tensor) -> torch.Tensor:
        """GPU rows (the slot mapping) where the new KV of ``positions`` (an integer tensor, on the host to keep
        the device from waiting) of a scheduled request is written."""
        step = self._need_step("token_rows()")
        req = step.request(request_id)
        if not isinstance(positions, torch.Tensor):
            raise InvalidArgumentError(f"positions must be an integer tensor, not {type(positions).__name__}")
        try:
            return self.dp.token_rows(req.row, positions, start=req.start, end=req.seq_len)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                f"request {request_id!r} writes positions {req.start}..{req.seq_len - 1} in step {step.step}: {e}"
            ) from None

    def write(self, request_id: str, positions: torch.Tensor, layer: int, rows: torch.Tensor) -> None:
        """Writes the new KV ``rows`` [n, row_bytes] uint8 of ``positions`` [n] of a scheduled request into
        ``layer`` of the slab."""
        lay = self.layout
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < lay.num_layers:
            raise InvalidArgumentError(f"layer must be an integer in 0..{lay.num_layers - 1}, not {layer!r}")
        dest = self.token_rows(request_id, positions)
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or tuple(rows.shape) != (
                dest.numel(), lay.row_bytes):
            got = f"{rows.dtype} {list(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise InvalidArgumentError(f"rows must be [{dest.numel()}, {lay.row_bytes}] uint8, not {got}")
        self.dp.gpu[layer][dest] = rows.to(self.device)

    def _row_state(self, rows: torch.Tensor | Sequence[str | None]) -> torch.Tensor:
        """int32 state rows for the kernels, a negative row a padding row (-1: it reads nothing and touches no
        state), as ``cuda/SPEC.md`` and ``DataPath.resolve`` have it. A row past the last (S or more) is refused
        on CPU; on CUDA, where checking would wait for the device, it becomes a padding row too."""
        if not isinstance(rows, torch.Tensor):
            return self.rows(list(rows))
        if rows.dtype.is_floating_point or rows.dtype in (torch.bool, torch.complex64, torch.complex128) or \
                rows.dim() != 1:
            raise InvalidArgumentError(f"rows must be a 1-D integer tensor, not {rows.dtype} {list(rows.shape)}")
        s = self.layout.max_running
        rows = _to_device(_int64(rows, "rows") if rows.device.type == "cpu" else rows.to(torch.int64), self.device)
        if self.device.type == "cpu" and rows.numel() and int(rows.max()) >= s:
            raise InvalidArgumentError(f"rows must be state rows below {s} (negative: padding), got {int(rows.max())}")
        return torch.where((rows < 0) | (rows >= s), -1, rows).to(torch.int32).contiguous()

    @staticmethod
    def _positions(topk: torch.Tensor) -> torch.Tensor:
        """int32 positions without wrapping: a value beyond int32 is clamped to a position no request reaches
        (read as -1, like any position at or past its length), a negative one to the pad -1."""
        if not isinstance(topk, torch.Tensor) or topk.dtype.is_floating_point or topk.dtype in (
                torch.bool, torch.complex64, torch.complex128):
            raise InvalidArgumentError(f"topk must be an integer tensor, not {topk!r}")
        if topk.dtype in _NARROW_INTS:  # every value fits: nothing to clamp
            return topk.to(torch.int32).contiguous()
        # uint64 beyond 2**63 turns negative in int64: a pad, never another position.
        return topk.to(torch.int64).clamp(-1, 2**31 - 1).to(torch.int32).contiguous()

    def resident(self, rows: torch.Tensor | Sequence[str | None], topk: torch.Tensor) -> torch.Tensor:
        """Which positions of ``topk`` [batch rows, top_k] (of state ``rows`` [batch rows]) are on the GPU as of
        the applied plan (a resolve reads them in place); False for -1 pads and padding rows. Lets an engine
        split a large selection (a prefill chunk) into resolves that each fit the hot region."""
        self._need_step("resident()")
        bs, st = self.layout.block_size, self.dp.state
        row_state = self._row_state(rows).to(torch.int64)
        pos = self._positions(topk).to(device=self.device, dtype=torch.int64)
        if pos.dim() != 2 or pos.shape[0] != row_state.shape[0]:
            raise InvalidArgumentError(f"topk must be [{row_state.shape[0]}, top_k], not {list(pos.shape)}")
        live = row_state >= 0
        safe_rows = row_state.clamp(min=0)
        seq = st["seq_lens"][safe_rows].to(torch.int64)
        inside = (pos >= 0) & (pos < seq[:, None]) & live[:, None]
        blocks = st["block_table"][safe_rows[:, None], (pos.clamp(min=0) // bs).clamp(max=self.layout.max_pages - 1)]
        return inside & (blocks != 0)

    def resolve(self, topk: torch.Tensor, rows: torch.Tensor | Sequence[str | None], group: int = 0) -> torch.Tensor:
        """Row ids into every layer of ``group`` for ``topk`` [batch rows, top_k] positions (-1 pads).

        ``rows``: the state row of each batch row (an integer tensor, -1 for padding), or the request id of
        each (None: a padding row). Resident positions read in place; the others come through the request's
        hot region (SPEC.md). Read the rows of a layer with :meth:`gather` before the next ``resolve`` of the
        same group.
        """
        self._need_step("resolve()")
        return self.dp.resolve(_to_device(self._positions(topk), self.device), self._row_state(rows), group)

    def gather(self, row_ids: torch.Tensor, layer: int) -> torch.Tensor:
        """Dense rows [batch rows, top_k, row_bytes] uint8 of one layer, in top-K order; zeros for -1."""
        self._need_step("gather()")
        if not isinstance(row_ids, torch.Tensor) or row_ids.dtype != torch.int32:
            raise InvalidArgumentError("row_ids must be the int32 tensor resolve() returned")
        return self.dp.gather(row_ids.contiguous(), layer)

    # ------------------------------------------------------------------ after the forward

    def end_step(self, *, flush: bool = False) -> StepResults:
        """Ends the step after the forward and returns the results for :meth:`SchedulerHooks.apply_results`:
        the host copies that are done (on CUDA, those whose event has passed; the others come with a later
        step); when ``heat`` says one is due, a heat summary and the resolver's counters (``flush``: the counters
        now, e.g. at the end of a run). Never waits for the device."""
        step = self._need_step("end_step()")
        due = self.heat.due(step.step)
        if due:  # first: if it refuses, nothing below has been taken yet
            self._summaries.append(self.dp.start_heat_summary(self.heat.coldest, self.heat.hottest))
        if not self._cuda:  # copies on CPU are done when apply() returns
            completed = tuple(t for f in self._in_flight for t in f.transfers)
            self._in_flight = []
        else:
            finished = [f.done() for f in self._in_flight]  # one query each: an event may pass meanwhile
            completed = tuple(t for f, ok in zip(self._in_flight, finished, strict=True) if ok for t in f.transfers)
            self._in_flight = [f for f, ok in zip(self._in_flight, finished, strict=True) if not ok]
        # A summary goes out once it reached the host (on CPU: now); a later one replaces an earlier one.
        heat = None
        while self._summaries and self._summaries[0].ready():
            heat = self._summaries.pop(0).take()
        self._step = None
        if not due and not flush:
            return StepResults(step.step, completed, (), heat, scheduler=step.scheduler)
        hits, misses, h2d = self._counters.take(self.dp.state["counters"])
        return StepResults(step.step, completed, (), heat, hits, misses, h2d, step.scheduler)
