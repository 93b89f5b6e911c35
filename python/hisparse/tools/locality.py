"""A per-page model of what a DSA indexer selects, step after step, and what an LRU hot buffer then misses.

The paper's miss rates (top-K hot-buffer hits measured on GLM-5.1) are three numbers; everything downstream
(how many rows a step copies from the host, which pages ``coldest`` should keep, how many rows an MTP step
resolves) needs a selection *stream*. This module makes one up from a few parts, each stated with its source,
fits the two parameters nobody has published to two of the three miss rates, and predicts the third.

The process (one index group; token rows, ``top_k`` of them per decoded position)
-------------------------------------------------------------------------------------
* **Sinks**: the first ``sink_tokens`` (4) are always selected. Attention sinks: Xiao et al., "Efficient
  Streaming Language Models with Attention Sinks", arXiv 2309.17453 (4 initial tokens keep the attention mass).
* **Recent window**: the last ``window_tokens`` (512) are always selected. The sliding-window branch of
  DeepSeek's Native Sparse Attention (arXiv 2502.11089) uses 512 tokens; DSA has no explicit window, but its
  indexer scores recent keys high (the vLLM blog keeps the newest pages resident for the same reason,
  ``ACTIVE_TAIL_PAGES``). An assumption, stated as such.
* **Topics**: the rest of the budget comes from ``topics`` active spans of ``topic_tokens`` (256, four pages)
  each, somewhere in the history. Every token of a span has a fixed relevance ``a ~ N(0, 1)`` drawn when the
  span becomes active; each position adds fresh noise ``sigma x N(0, 1)`` and the indexer keeps the best rows.
  Rows near the cut flicker in and out, which is what makes a buffer larger than one step's rows pay at all
  (the published curve keeps falling past 1x: 30% -> 13.4% -> 6.7%). Span count and width are assumptions:
  eight times the budget's rows are candidates (with two, a 2x buffer holds every candidate and the curve
  drops far below the published 13.4%).
* **Drift with temporal reuse**: after each position every active topic is replaced with probability ``drift``;
  the replacement is, with probability ``reuse`` (0.5, an assumption), one of the last ``reuse_memory`` (64)
  retired topics (the conversation comes back to something it read before), otherwise a fresh span anywhere in
  the history.
* **Index groups**: each indexer draws its own stream (statistically alike); IndexShare followers (GLM-5.2/5.3:
  one indexer per 4 layers; IndexCache paper, arXiv 2603.12201) reuse their leader's selection, so a model has
  ``index_groups`` streams, not one per layer.
* **MTP**: a decode step with ``q`` speculative tokens resolves the union of ``q + 1`` *consecutive positions'*
  selections (the rows of each next position come from the same process one position later). Their overlap is
  an output of the model, not an input.

The hot buffer is the resolver's LRU (vLLM 0.33 ``vllm/v1/hisparse/``): rows used by a step become the most recent (the
order inside one step does not matter for hits at the next; a tie at the cut is counted as a fraction).

Calibration
-----------
``sigma`` (flicker) and ``drift`` are fitted by least squares on the log miss rate to two of the published
points (by default 1x and 4x) with common random numbers; the third (2x) is then a prediction.
``benches/locality_check.py`` prints the fit, the prediction of each held-out point and the overlap of
consecutive positions' top-K with its spread over the three leave-one-out fits.

The published points (HiSparse paper, arXiv 2608.07009, GLM-5.1, top_k 2048): a buffer of 1x / 2x /
4x top_k rows misses ~30% / 13.4% / 6.7% of the rows a step selects. The paper does not say whether its steps
were speculative; this module reads them as one position per step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

#: (hot buffer rows / top_k, miss rate), HiSparse paper (arXiv 2608.07009), GLM-5.1, top_k 2048.
PUBLISHED_MISS = ((1.0, 0.30), (2.0, 0.134), (4.0, 0.067))

SINK_TOKENS = 4  # StreamingLLM, arXiv 2309.17453
WINDOW_TOKENS = 512  # NSA sliding window, arXiv 2502.11089 (an assumption for DSA)
TOPIC_TOKENS = 256  # assumption: four 64-token pages per topic
CANDIDATE_FACTOR = 8  # assumption: eight times the topic budget's rows are candidates
REUSE = 0.5  # assumption: half of the new topics are ones read before
REUSE_MEMORY = 64  # retired topics remembered for reuse

#: The fit of ``fit(PUBLISHED_MISS[0], PUBLISHED_MISS[2])`` (``benches/locality_check.py`` recomputes it).
FITTED_SIGMA = 0.452
FITTED_DRIFT = 0.0759


@dataclasses.dataclass(frozen=True)
class Params:
    top_k: int = 2048
    context: int = 80_000  # tokens of history (the published workload's mean decode context)
    sink_tokens: int = SINK_TOKENS
    window_tokens: int = WINDOW_TOKENS
    topic_tokens: int = TOPIC_TOKENS
    candidate_factor: float = CANDIDATE_FACTOR
    sigma: float = FITTED_SIGMA
    drift: float = FITTED_DRIFT
    reuse: float = REUSE
    reuse_memory: int = REUSE_MEMORY

    @property
    def budget(self) -> int:
        """Rows the topics fill per position."""
        return self.top_k - self.sink_tokens - self.window_tokens

    @property
    def topics(self) -> int:
        return max(1, math.ceil(self.candidate_factor * self.budget / self.topic_tokens))


class SelectionStream:
    """One index group's selections, position after position (numpy; seeded)."""

    def __init__(self, p: Params, seed: int = 0):
        import numpy as np

        self.np = np
        self.p = p
        self.rng = np.random.default_rng(seed)
        self.length = p.context
        lo, hi = p.sink_tokens, max(p.sink_tokens + 1, p.context - p.window_tokens - p.topic_tokens)
        self._lo, self._hi = lo, hi
        self.starts = self.rng.integers(lo, hi, size=p.topics)
        self.affinity = self.rng.standard_normal((p.topics, p.topic_tokens))
        self.retired: list[tuple[int, Any]] = []
        self._offs = np.arange(p.topic_tokens)
        self._sinks = np.arange(p.sink_tokens)

    def select(self):
        """The rows (token positions) the next position selects, then one position of drift."""
        np, p = self.np, self.p
        scores = self.affinity + p.sigma * self.rng.standard_normal(self.affinity.shape)
        rows = (self.starts[:, None] + self._offs[None, :]).ravel()
        window_lo = self.length - p.window_tokens
        scores = scores.ravel()
        scores[rows >= window_lo] = -np.inf  # the window takes those anyway
        pick = np.argpartition(-scores, p.budget)[: p.budget]
        chosen = np.unique(rows[pick])
        out = np.concatenate([self._sinks, chosen, np.arange(window_lo, self.length)])
        out = np.unique(out)
        self._drift()
        self.length += 1
        return out

    def _drift(self) -> None:
        np, p, rng = self.np, self.p, self.rng
        replace = np.nonzero(rng.random(p.topics) < p.drift)[0]
        for i in replace:
            self.retired.append((int(self.starts[i]), self.affinity[i].copy()))
            if len(self.retired) > p.reuse_memory:
                self.retired.pop(0)
            if len(self.retired) > 1 and rng.random() < p.reuse:
                s, a = self.retired[int(rng.integers(0, len(self.retired) - 1))]
                self.starts[i] = s
                self.affinity[i] = a
            else:
                self.starts[i] = rng.integers(self._lo, self._hi)
                self.affinity[i] = rng.standard_normal(p.topic_tokens)


class LruCounter:
    """Hits of LRU buffers of several sizes over a stream of steps (each step a set of rows used together)."""

    def __init__(self, sizes: Sequence[int], rows: int, steps: int):
        import numpy as np

        self.np = np
        self.sizes = [int(s) for s in sizes]
        self.last = np.full(rows, -1, dtype=np.int64)
        self.count = np.zeros(steps + 1, dtype=np.int64)  # rows whose last use is step u
        self.t = 0
        self.hits = [0.0] * len(self.sizes)
        self.used = 0

    def step(self, rows, record: bool) -> None:
        np = self.np
        t = self.t
        last = self.last[rows]
        seen = last >= 0
        if record:
            # rows used after step u: a suffix sum of the per-step counts
            above = np.concatenate([np.cumsum(self.count[:t][::-1])[::-1][1:], [0]]) if t else np.zeros(0)
            u = last[seen]
            a = above[u]
            c = self.count[u]
            for i, h in enumerate(self.sizes):
                self.hits[i] += float(np.clip((h - a) / np.maximum(c, 1), 0.0, 1.0).sum())
            self.used += len(rows)
        if seen.any():
            np.subtract.at(self.count, last[seen], 1)
        self.last[rows] = t
        self.count[t] = len(rows)
        self.t += 1

    def miss_rates(self) -> list[float]:
        return [1.0 - h / self.used for h in self.hits]


def measure(p: Params, ratios: Sequence[float] = (1.0, 2.0, 4.0), steps: int = 240, warmup: int = 60,
            groups: int = 2, seed: int = 0, positions_per_step: int = 1) -> dict[str, Any]:
    """Miss rates of LRU buffers of ``ratio x top_k`` rows, the overlap of consecutive positions' top-K, and
    the rows of one step (the union of ``positions_per_step`` consecutive positions), over ``groups``
    independent streams."""
    import numpy as np

    misses = np.zeros(len(ratios))
    overlaps: list[float] = []
    union_rows: list[int] = []
    for g in range(groups):
        stream = SelectionStream(p, seed=seed * 1000 + g)
        total = steps + warmup
        lru = LruCounter([r * p.top_k for r in ratios], p.context + total * positions_per_step + 1, total)
        prev = None
        for t in range(total):
            sel = [stream.select() for _ in range(positions_per_step)]
            for s in sel:
                if prev is not None and t >= warmup:
                    overlaps.append(len(np.intersect1d(prev, s, assume_unique=True)) / len(s))
                prev = s
            rows = sel[0] if positions_per_step == 1 else np.unique(np.concatenate(sel))
            if t >= warmup:
                union_rows.append(len(rows))
            lru.step(rows, record=t >= warmup)
        misses += np.array(lru.miss_rates())
    return {
        "ratios": list(ratios),
        "miss": list(misses / groups),
        "overlap": float(np.mean(overlaps)),
        "overlap_sd": float(np.std(overlaps)),
        "step_rows": float(np.mean(union_rows)),
    }


def fit(points: Sequence[tuple[float, float]], start: Params = Params(), steps: int = 160, warmup: int = 40,
        seed: int = 0, iterations: int = 4) -> Params:
    """``sigma`` and ``drift`` that put the model's miss rates on two ``points`` ((ratio, miss) pairs): Gauss-Newton
    on the log miss rates over log parameters, finite-difference Jacobian, common random numbers (one seed for
    every evaluation, so the residual is a fixed function of the parameters)."""
    import numpy as np

    if len(points) != 2:
        raise ValueError("fit takes two (ratio, miss) points for its two parameters")
    ratios = [r for r, _ in points]
    target = np.log([y for _, y in points])

    def resid(x) -> Any:
        p = dataclasses.replace(start, sigma=float(math.exp(x[0])), drift=float(math.exp(x[1])))
        m = measure(p, ratios, steps, warmup, 1, seed)
        return np.log(np.maximum(m["miss"], 1e-6)) - target

    x = np.log([start.sigma, start.drift])
    r = resid(x)
    for _ in range(iterations):
        if float(np.abs(r).max()) < 0.02:
            break
        jac = np.empty((2, 2))
        for j, h in enumerate((0.08, 0.25)):
            dx = x.copy()
            dx[j] += h
            jac[:, j] = (resid(dx) - r) / h
        step = np.linalg.lstsq(jac, -r, rcond=None)[0]
        step = np.clip(step, -1.0, 1.0)
        for scale in (1.0, 0.5, 0.25):  # damped: keep the step only if it lowers the error
            trial = x + scale * step
            rt = resid(trial)
            if float(rt @ rt) < float(r @ r):
                x, r = trial, rt
                break
        else:
            break
    return dataclasses.replace(start, sigma=float(math.exp(x[0])), drift=float(math.exp(x[1])))


def check(held_out: int = 1, quick: bool = False, seed: int = 0, start: Params | None = None) -> dict[str, Any]:
    """Fits on every published point but ``held_out`` (an index into :data:`PUBLISHED_MISS`) and predicts it,
    with another seed than the fit's. ``quick``: short streams and a start at the pinned fit (the tests)."""
    steps, warmup = (100, 30) if quick else (200, 50)
    if start is None:
        start = Params() if quick else Params(sigma=1.0, drift=0.01)
    fitted = [pt for i, pt in enumerate(PUBLISHED_MISS) if i != held_out]
    p = fit(fitted, start=start, steps=steps, warmup=warmup, seed=seed)
    m = measure(p, [r for r, _ in PUBLISHED_MISS], steps=steps, warmup=warmup, groups=1 if quick else 2,
                seed=seed + 1)
    rows = [{"ratio": r, "role": "held out" if i == held_out else "fitted", "published": y,
             "predicted": round(float(x), 4), "rel_error": round(float(x) / y - 1, 4)}
            for i, ((r, y), x) in enumerate(zip(PUBLISHED_MISS, m["miss"], strict=True))]
    return {"held_out": PUBLISHED_MISS[held_out][0], "sigma": round(p.sigma, 4), "drift": round(p.drift, 5),
            "points": rows, "overlap": round(m["overlap"], 4), "overlap_sd": round(m["overlap_sd"], 4)}


def mtp_rows(p: Params = Params(), speculative: int = 3, steps: int = 120, warmup: int = 30, seed: int = 0,
             ratios: Sequence[float] = (1.0, 2.0, 4.0, 5.0)) -> dict[str, Any]:
    """Rows one MTP step resolves (the union of ``speculative + 1`` consecutive positions' top-K) and the miss
    rates of hot buffers of ``ratio x top_k`` rows over such steps."""
    m = measure(p, ratios, steps=steps, warmup=warmup, groups=1, seed=seed, positions_per_step=speculative + 1)
    return {"speculative_tokens": speculative, "step_rows": round(m["step_rows"], 1),
            "union_over_top_k": round(m["step_rows"] / p.top_k, 4),
            "miss": {f"{r:g}x": round(float(x), 4) for r, x in zip(ratios, m["miss"], strict=True)}}


# --------------------------------------------------------------------------- what the simulator takes


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """The model's outputs the simulator needs for ``q`` speculative tokens (top_k-relative, so any top_k):
    ``union``: rows one step resolves / top_k; ``overlap``: consecutive positions' shared top-K fraction;
    ``curve``: (hot buffer rows / rows one step resolves, LRU miss rate) points, ascending."""

    speculative_tokens: int
    union: float
    overlap: float
    curve: tuple[tuple[float, float], ...]

    def miss_rate(self, ratio: float) -> float:
        """Miss rate of a buffer of ``ratio`` x the rows of one step: log-log between the model's points, the
        last slope beyond them, linear to 1.0 at 0 below the first."""
        pts = self.curve
        if ratio <= 0:
            return 1.0
        x0, y0 = pts[0]
        if ratio <= x0:
            return 1.0 - (1.0 - y0) * ratio / x0
        for (xa, ya), (xb, yb) in zip(pts, pts[1:], strict=False):
            if ratio <= xb:
                return ya * (ratio / xa) ** (math.log(yb / ya) / math.log(xb / xa))
        (xa, ya), (xb, yb) = pts[-2], pts[-1]
        return yb * (ratio / xb) ** (math.log(yb / ya) / math.log(xb / xa))


_PROFILES: dict[tuple[int, float | None], StepProfile] = {}
#: Buffer sizes (x top_k) at which :func:`step_profile` measures the miss rate.
PROFILE_RATIOS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
#: History lengths (x top_k; 4K .. 1M tokens at top_k 2048) at which :func:`context_miss_rate` measures profiles:
#: a buffer that holds most of a short history misses little (at 10K tokens, 5 x top_k rows miss 0.5%, at 80K 16%).
CONTEXT_BUCKETS = tuple(float(2**k) for k in range(1, 10))


def step_profile(speculative_tokens: int, steps: int = 100, warmup: int = 30,
                 context: float | None = None) -> StepProfile:
    """The fitted model's step profile for ``speculative_tokens`` over a history of ``context`` x top_k tokens
    (None: the published workload's 80,000 tokens), computed once per process, fixed seed."""
    q = speculative_tokens
    key = (q, context)
    if key not in _PROFILES:
        p = Params() if context is None else Params(context=int(context * Params().top_k))
        m = measure(p, PROFILE_RATIOS, steps=steps, warmup=warmup, groups=1, seed=7, positions_per_step=q + 1)
        union = m["step_rows"] / p.top_k
        curve: list[tuple[float, float]] = []
        for r, x in zip(PROFILE_RATIOS, m["miss"], strict=True):
            x = float(x)
            if r >= union * 0.999 and x > 0 and (not curve or x < curve[-1][1]):
                curve.append((r / union, x))
        if len(curve) < 2:
            curve = [(1.0, 0.3), (4.0, 0.067)]
        _PROFILES[key] = StepProfile(q, union, m["overlap"], tuple(curve))
    return _PROFILES[key]


def context_miss_rate(speculative_tokens: int, hot: float, share: float, context: float) -> float:
    """Miss rate of a hot buffer of ``hot`` x top_k rows that serves the share ``share`` of each step's selected
    rows (those on host-only pages), over a history of ``context`` x top_k tokens: the profiles measured at the
    two :data:`CONTEXT_BUCKETS` around it (clamped to their range), each at its own rows per step, interpolated
    linearly in log context."""
    if share <= 0:
        return 0.0
    buckets = CONTEXT_BUCKETS
    c = min(max(context, buckets[0]), buckets[-1])
    i = max(0, min(len(buckets) - 2, int(math.floor(math.log2(c / buckets[0])))))
    lo, hi = buckets[i], buckets[i + 1]
    rates = []
    for b in (lo, hi):
        prof = step_profile(speculative_tokens, context=b)
        rates.append(prof.miss_rate(hot / (prof.union * share)))
    w = min(1.0, max(0.0, math.log(c / lo) / math.log(hi / lo)))
    return rates[0] + w * (rates[1] - rates[0])


class PageHeat:
    """The process at page granularity, for a simulator that cannot afford token rows: per request and heat
    interval, the rows each page gets (all index groups together), and the share of a step's selection that
    falls on a given set of pages.

    Per index group: ``topics`` spans of ``topic_tokens / block`` pages; over an interval of ``n`` positions a
    group visits its active spans and about ``topics x drift x n`` replacements, each a reuse (probability
    ``reuse``) of a span the request read before or a fresh one anywhere in the history; the group's topic
    rows (``budget x n``) are spread evenly over its visits (at most ``max_visits`` sampled per request and
    interval, weighted up). Sinks go to page 0, the window to the last pages. A step's selection over the next
    interval is expected to come half from what was read (reuse) and half from anywhere (fresh topics)."""

    def __init__(self, p: Params, groups: int, block_tokens: int, seed: int, max_visits: int = 1024):
        import numpy as np

        self.np = np
        self.p = p
        self.groups = groups
        self.bt = block_tokens
        self.rng = np.random.default_rng(seed)
        self.span = max(1, p.topic_tokens // block_tokens)
        self.window_pages = max(1, -(-p.window_tokens // block_tokens))
        self.max_visits = max_visits
        tk = p.top_k
        self.sink_share = p.sink_tokens / tk
        self.window_share = p.window_tokens / tk
        self.topic_share = 1.0 - self.sink_share - self.window_share
        self.memory: dict[int, Any] = {}  # request -> start pages of spans it read (a ring)
        self.profile: dict[int, Any] = {}  # request -> topic rows per page of its last interval, normalized

    def forget(self, request: int) -> None:
        self.memory.pop(request, None)
        self.profile.pop(request, None)

    def interval(self, request: int, pages: int, positions: int):
        """Rows per page (float64 ``[pages]``) that ``positions`` positions of ``request`` select."""
        np, p, rng = self.np, self.p, self.rng
        heat = np.zeros(pages)
        if pages <= 0 or positions <= 0:
            return heat
        g = self.groups
        heat[0] += g * p.sink_tokens * positions
        w = min(self.window_pages, pages)
        heat[pages - w:] += g * self.bt * positions
        hist = pages - w  # pages outside the window
        if hist > 0:
            visits = g * p.topics + int(rng.poisson(g * p.topics * p.drift * positions))
            n = min(visits, self.max_visits)
            weight = g * p.budget * positions / n
            hi = max(1, hist - self.span + 1)
            fresh = rng.integers(0, hi, size=n)
            mem = self.memory.get(request)
            if mem is not None and len(mem):
                reuse = rng.random(n) < p.reuse
                picks = mem[rng.integers(0, len(mem), size=n)]
                starts = np.where(reuse & (picks < hi), picks, fresh)
            else:
                starts = fresh
            ring = fresh[: min(n, 64 * g)] if mem is None else np.concatenate([mem, fresh])[-64 * g:]
            self.memory[request] = ring
            cells = (starts[:, None] + np.arange(self.span)[None, :]).ravel()
            cells = cells[cells < hist]
            topic = np.bincount(cells, minlength=hist)[:hist] * (weight / self.span)
            heat[:hist] += topic
            total = topic.sum()
            self.profile[request] = topic / total if total > 0 else None
        return heat

    def host_share(self, request: int, host_only) -> float:
        """Share of one step's selected rows that fall on pages where ``host_only`` (bool ``[pages]``) is set."""
        np = self.np
        pages = len(host_only)
        if pages == 0:
            return 0.0
        w = min(self.window_pages, pages)
        hist = pages - w
        share = self.sink_share * float(host_only[0])
        share += self.window_share * np.count_nonzero(host_only[hist:]) / w
        if hist > 0:
            uniform = np.count_nonzero(host_only[:hist]) / hist
            prof = self.profile.get(request)
            if prof is None:
                seen = uniform
            else:
                m = min(len(prof), hist)
                seen = float(prof[:m][host_only[:m]].sum())
            share += self.topic_share * (self.p.reuse * seen + (1 - self.p.reuse) * uniform)
        else:
            share += self.topic_share * float(host_only[0])
        return min(1.0, float(share))
