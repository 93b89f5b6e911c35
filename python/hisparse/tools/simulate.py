"""``hisparse simulate``: a step-level serving simulation of one node, driving the real residency core.

Every residency decision -- admission, block allocation, the pressure policy, hot-region leases, proactive
copies to the host, prefix reuse, preemption, restores -- is made by :class:`hisparse.ResidencyManager`.
This module is only the scheduler around it (vLLM-like), a clock, and a traffic model. No KV bytes move.

Modes
-----
``offload``   the baseline: plain GPU residency (core policy ``resident``: pages are never released, no hot
              regions) plus a 512 GiB CPU tier that holds every completed page (the core's proactive copies);
              a request that comes back -- the next turn of a conversation, or a preempted request -- adopts
              its blocks still on the GPU and has every other host page restored whole before it runs.
              When a step cannot be backed the newest running request is preempted (vLLM's order).
``hisparse``  Hybrid HiSparse: core policy ``fifo`` (what vLLM 0.33 does) or ``coldest``, 384 GiB HiSparse
              host pool for the sparse-MLA KV. The 128 GiB indexer OffloadingConnector pool is modeled as
              never binding (32 conversations of <= 86K tokens hold at most 7.6 GB of indexer keys).
              No selection heat is reported (the miss model below is aggregate, not per page), so
              ``coldest`` releases the oldest clean pages first -- its tie-break -- and ``fifo`` the newest.

Memory model (GLM-5.3 FP8 on 8xH200, TP8; every rank holds the same replicated MLA KV, so one GPU is
simulated)
  * KV HBM per GPU from :func:`hisparse.tools.calc.calculate` (17.8 GiB), one pool of 64-token blocks.
  * A core block is one page of every layer *with its indexer keys*: 64 x (78 x 656 + 21 x 132) =
    3,452,160 B (``calc.block_bytes(...)["baseline"]``, vLLM's 53,940 B/token). A resident page therefore
    pays for its own indexer keys exactly.
  * The indexer keys stay on the GPU for every token, also when the page's MLA rows go to the host. The core
    knows one hot-region size per manager, so a hisparse request's hot region is charged with its hot rows
    (78 x 656 B each) *plus* the indexer keys of its history at the workload's mean decode context
    (~80K tokens, 222 MB): ceil((hot_rows x 51,168 + L x 2,772) / 3,452,160) blocks = 217 for 10,240 hot
    rows. A request in full residency pays nothing extra; one in mixed residency pays its tail, its hot rows
    and its indexer keys, as in vLLM. Exact accounting (the real history length of each request) would need
    the core to count blocks held for it outside its pages, e.g. a per-request external block count.
  * Hot rows default to the blog's MTP sizing (q + 2) x top_k = 10,240 (vLLM's code default is (q + 1) x
    top_k); ``--adaptive-hot-rows`` picks the largest buffer that lets all ``concurrency`` requests fit.
  * Host page: MLA only (3,274,752 B) in hisparse mode, MLA + indexer (3,452,160 B) in offload mode.

Workload (vLLM blog, OpenHands-style): ``concurrency`` users, each runs 13-turn conversations back to back;
turn 1 is 74,160 tokens, each later turn is the whole conversation so far plus 753 new tokens; 220 output
tokens per turn (EOS ignored); the next turn is sent the moment the answer ends. Page hashes are a chain per
conversation (prefix caching), including the pages the answer fills, so a next turn finds every full page
that reached the host (or is still on the GPU).

Scheduler (vLLM V1 order): running requests first, in admission order -- a decode schedules 1 + q
verification tokens of the 32,768-token budget, a prefill the largest chunk that fits; then waiting
requests (preempted ones first, then arrivals, FCFS) while the budget lasts, the core admits them, and no
request was preempted since the last turn ended. A short plan preempts the newest running request (a
request admitted in the same step and never run is simply put back, not counted as a preemption) until the
plan fits. MTP: each decode step emits 1 + accepted drafts tokens, drafts accepted in a chain with the
probability that gives the measured mean accept length 3.48; the KV grows by the tokens emitted. A GPU pool
that cannot hold one prefill chunk (offload: one whole request) is refused before the run; a point in which no
request computes a new token for 50 scheduler passes (each step lost to a preemption) ends in an error.

Traffic and time (constants and sources in :mod:`hisparse.tools.sim_constants`)
  * Step = one decode step (26.2 ms: TPOT x accept length of GLM-5-FP8 MTP on 8xH200) + prefill FLOPs /
    (8 x 1,979 TFLOPS x 24.4% MFU) + host->GPU bytes the forward waits for / 55 GB/s.
  * Top-K locality: the LRU stack-distance profile of the selection stream is the published one (miss rate
    30% / 13.4% / 6.7% with a buffer of 1 / 2 / 4 times the rows one step selects; log-log interpolation,
    the last slope beyond 4x, linear to 100% below 1x). A hot buffer of ``h`` rows over a stream whose steps
    select ``s`` rows misses ``S(h / s)`` of them (LRU inclusion). One MTP step resolves the union of its
    q + 1 verification tokens' top-K: ``top_k x (1 + q x 0.30)`` rows (each next token brings the 30% a
    one-step buffer misses). Only the fraction ``f`` of the history that is host-only feeds the buffer
    (selections spread uniformly over the history; the tail is resident), so ``s = f x union`` and the step
    misses ``Binomial(s, S(hot_rows / s))`` rows of 51,168 B (all 78 layers). A prefill chunk of T tokens
    over host-only history reads the union of its tokens' selections, ``top_k x (1 + (T - 1) x 0.30) x f``
    rows capped at the host-only history, all of them copied (they cannot stay in a 10K-row buffer).
  * Restores at admission/resumption (tail pages, or every page for the offload baseline) and the indexer
    keys of host-only history run on the host link asynchronously: the request runs when they have landed.
    Restores planned inside a step (relief back to full residency) delay that step.
  * Proactive copies to the host go over a 55 GB/s link in order and are reported to the core
    (``complete``) at the first step boundary after they end.

Metrics: ``mean_running`` is the blog's metric, the mean of the non-zero samples of running requests
(sampled per unit of simulated time; a request waiting for its restores is not yet running), over the
simulated duration. Output tokens/s, TTFT and ITL medians (ITL: time between consecutive output chunks of a
request, one chunk per step), preemptions (not counting un-admissions), H2D GB (misses + restores +
indexer-key loads), and the hot-buffer hit rate of decode steps (hits / (hits + misses) of the rows selected
on host-only pages; ``null`` for offload).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from .._core import ResidencyManager
from ..errors import CapacityError, ConfigError
from . import calc, console
from . import sim_constants as K
from .argtypes import U32_MAX, int_range, plot_path, positive_float, positive_gib, positive_int, positive_int_list, seed

GIB = 2**30
#: Scheduler passes in a row in which no request computes a token it never had, after which a point is given up.
#: The default points and the tests' have none; a node too small for the workload has them forever.
NO_PROGRESS_PASSES = 50
MODES = ("offload", "hisparse")
TIER_POLICIES = ("coldest", "fifo")


# --------------------------------------------------------------------------- configuration


@dataclasses.dataclass
class SimConfig:
    """One simulated (mode, policy, concurrency) point. Defaults are the published benchmark."""

    mode: str = "hisparse"
    policy: str = "fifo"  # offload mode always runs the core's "resident" policy
    concurrency: int = 32
    duration_s: float = 1800.0
    max_steps: int | None = None
    seed: int = 0
    drain: bool = False  # after duration_s: no new turns, run until every request has finished
    check_every: int = 0  # > 0: audit the core's invariants every this many steps (tests)
    # workload
    turns: int = K.TURNS
    first_turn_tokens: int = K.FIRST_TURN_TOKENS
    later_turn_tokens: int = K.LATER_TURN_TOKENS
    output_tokens: int = K.OUTPUT_TOKENS
    max_model_len: int = K.MAX_MODEL_LEN
    max_batched_tokens: int = K.MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = K.MAX_NUM_SEQS
    # deployment
    gpu: str = K.GPU
    tp: int = K.TP
    kv_hbm_gib: float | None = None  # None: hisparse calc's KV HBM per GPU
    num_gpu_blocks: int | None = None  # overrides kv_hbm_gib
    host_gib: float | None = None  # None: 512 (offload) / 384 (hisparse)
    num_host_blocks: int | None = None  # overrides host_gib
    speculative_tokens: int = K.SPECULATIVE_TOKENS
    accept_length: float = K.MTP_ACCEPT_LENGTH
    top_k: int = K.TOP_K
    hot_rows: int | None = None  # None: (q + 2) * top_k
    adaptive_hot_rows: bool = False
    block_tokens: int = K.BLOCK_TOKENS
    tail_pages: int = K.TAIL_PAGES
    materialize_budget: int = K.MATERIALIZE_BUDGET
    # model rows
    mla_layers: int = K.MLA_LAYERS
    indexer_layers: int = K.INDEXER_LAYERS
    mla_row_bytes: int = K.MLA_ROW_BYTES
    indexer_row_bytes: int = K.INDEXER_ROW_BYTES
    index_groups: int = K.INDEX_GROUPS
    # time
    decode_step_s: float = K.DECODE_STEP_S
    h2d_bytes_per_s: float = K.H2D_BYTES_PER_S
    d2h_bytes_per_s: float = K.D2H_BYTES_PER_S

    @property
    def core_policy(self) -> str:
        return "resident" if self.mode == "offload" else self.policy

    def validate(self) -> None:
        """Raises :class:`hisparse.ConfigError` (a ``ValueError``) for a configuration that cannot run."""
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "hisparse" and self.policy not in TIER_POLICIES:
            raise ConfigError(f"hisparse mode needs policy coldest or fifo, got {self.policy!r}")
        for name in ("concurrency", "turns", "first_turn_tokens", "output_tokens", "max_batched_tokens",
                     "max_num_seqs", "top_k", "block_tokens", "tail_pages"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if not self.duration_s > 0:  # also NaN
            raise ConfigError("duration_s must be positive")
        if self.max_prompt() + self.output_tokens > self.max_model_len:
            raise ConfigError(f"the last turn ({self.max_prompt() + self.output_tokens} tokens) exceeds "
                              f"max_model_len {self.max_model_len}")
        if self.speculative_tokens < 0 or not 1.0 <= self.accept_length <= self.speculative_tokens + 1:
            raise ConfigError(f"accept_length must lie in [1, speculative_tokens + 1 = {self.speculative_tokens + 1}], "
                              f"got {self.accept_length}")

    def prompt(self, turn: int) -> int:
        """Prompt of turn ``turn`` (0-based): the conversation so far plus the new user tokens."""
        return self.first_turn_tokens + turn * (self.output_tokens + self.later_turn_tokens)

    def max_prompt(self) -> int:
        return self.prompt(self.turns - 1)

    def mean_decode_context(self) -> float:
        """The mean context a decode step sees over a conversation (turn-averaged)."""
        return sum(self.prompt(t) + self.output_tokens / 2 for t in range(self.turns)) / self.turns


@dataclasses.dataclass(frozen=True)
class Derived:
    """Sizes that follow from a :class:`SimConfig`."""

    kv_hbm_gib: float | None
    gpu_block_bytes: int  # one page of every layer with its indexer keys
    mla_page_bytes: int
    indexer_page_bytes: int
    host_page_bytes: int
    mla_row_all_layers: int
    indexer_row_all_layers: int
    num_gpu_blocks: int
    host_gib: float | None
    num_host_blocks: int
    hot_rows: int  # real hot rows per request (the miss model's buffer)
    core_hot_rows: int  # what the core is told: hot rows plus the history's indexer keys, in block rows
    indexer_charge_tokens: int
    watermark: int
    step_rows: float  # rows one decode step selects (union of the verification tokens' top-K)


def _miss_anchor_1() -> float:
    return K.MISS_ANCHORS[0][1]


def miss_rate(ratio: float) -> float:
    """Fraction of selected rows an LRU hot buffer misses, ``ratio`` = buffer rows / rows selected per step.

    Piecewise power law through the published points (1, 0.30), (2, 0.134), (4, 0.067), the last slope
    beyond 4, and linear to 1.0 at ratio 0 below 1 (a buffer smaller than one step cannot hold its rows).
    """
    anchors = K.MISS_ANCHORS
    if ratio <= 0:
        return 1.0
    x0, y0 = anchors[0]
    if ratio <= x0:
        return 1.0 - (1.0 - y0) * ratio / x0
    for (xa, ya), (xb, yb) in zip(anchors, anchors[1:], strict=False):
        if ratio <= xb:
            slope = math.log(yb / ya) / math.log(xb / xa)
            return ya * (ratio / xa) ** slope
    (xa, ya), (xb, yb) = anchors[-2], anchors[-1]
    slope = math.log(yb / ya) / math.log(xb / xa)
    return yb * (ratio / xb) ** slope


def _core_hot_blocks(cfg: SimConfig, hot_rows: int, gpu_block_bytes: int, charge_tokens: int) -> int:
    mla_all = cfg.mla_layers * cfg.mla_row_bytes
    idx_all = cfg.indexer_layers * cfg.indexer_row_bytes
    return -(-(hot_rows * mla_all + charge_tokens * idx_all) // gpu_block_bytes)


def derive(cfg: SimConfig) -> Derived:
    cfg.validate()
    bt = cfg.block_tokens
    sizes = calc.block_bytes(layers=cfg.mla_layers, indexers=cfg.indexer_layers, groups=1,
                             row_bytes=cfg.mla_row_bytes, indexer_row_bytes=cfg.indexer_row_bytes,
                             block_tokens=bt)
    gpu_block = sizes["baseline"]
    mla_page = sizes["host"]
    idx_page = gpu_block - mla_page
    if cfg.num_gpu_blocks is not None:
        kv_gib, gpu_blocks = None, cfg.num_gpu_blocks
    else:
        kv_gib = cfg.kv_hbm_gib
        if kv_gib is None:
            kv_gib = calc.calculate(model=K.MODEL, gpu=cfg.gpu, tp=cfg.tp, kv_dtype=K.KV_DTYPE).kv_hbm_gib
        gpu_blocks = int(kv_gib * GIB // gpu_block)
        if gpu_blocks > U32_MAX:
            raise ConfigError(f"{kv_gib:g} GiB of KV HBM is {gpu_blocks:,} blocks; the core counts at most {U32_MAX:,}")
    _check_pool(cfg, gpu_blocks, gpu_block, kv_gib)
    host_page = gpu_block if cfg.mode == "offload" else mla_page
    if cfg.num_host_blocks is not None:
        host_gib, host_blocks = None, cfg.num_host_blocks
    else:
        host_gib = cfg.host_gib
        if host_gib is None:
            host_gib = K.OFFLOAD_HOST_GIB if cfg.mode == "offload" else K.HISPARSE_HOST_GIB
        host_blocks = int(host_gib * GIB // host_page)
    q = cfg.speculative_tokens
    step_rows = cfg.top_k * (1 + q * _miss_anchor_1())
    charge = round(cfg.mean_decode_context())
    limit = max(cfg.top_k, K.HOT_ROWS_LIMIT)
    if cfg.mode == "offload":
        hot_rows, core_hot_rows = 0, cfg.top_k  # never leased under "resident"
        hot_blocks = -(-core_hot_rows // bt)
    else:
        if cfg.adaptive_hot_rows:
            hot_rows = adaptive_hot_rows(cfg, gpu_blocks, gpu_block, charge)
        else:
            hot_rows = cfg.hot_rows if cfg.hot_rows is not None else (q + K.HOT_ROWS_MTP_EXTRA) * cfg.top_k
        if not cfg.top_k <= hot_rows <= limit:
            raise ConfigError(f"hot rows must lie in [top_k = {cfg.top_k}, {limit}], got {hot_rows}")
        hot_blocks = _core_hot_blocks(cfg, hot_rows, gpu_block, charge)
        core_hot_rows = hot_blocks * bt
    watermark = max(hot_blocks, gpu_blocks // 10)
    return Derived(
        kv_hbm_gib=kv_gib, gpu_block_bytes=gpu_block, mla_page_bytes=mla_page, indexer_page_bytes=idx_page,
        host_page_bytes=host_page, mla_row_all_layers=cfg.mla_layers * cfg.mla_row_bytes,
        indexer_row_all_layers=cfg.indexer_layers * cfg.indexer_row_bytes, num_gpu_blocks=gpu_blocks,
        host_gib=host_gib, num_host_blocks=host_blocks, hot_rows=hot_rows, core_hot_rows=core_hot_rows,
        indexer_charge_tokens=charge, watermark=watermark, step_rows=step_rows,
    )


def _blocks(cfg: SimConfig, tokens: int) -> int:
    """GPU blocks that hold ``tokens`` at once: their pages and the null block the core keeps aside."""
    return -(-tokens // cfg.block_tokens) + 1


def _pool_advice(cfg: SimConfig, blocks: int, gpu_block_bytes: int) -> str:
    """The flag value that gives a GPU pool of at least ``blocks`` blocks."""
    if cfg.num_gpu_blocks is not None:
        return f"num_gpu_blocks {blocks:,} or more"
    return f"--kv-hbm-gib {math.ceil(100 * blocks * gpu_block_bytes / GIB) / 100:g} or more"


def _check_pool(cfg: SimConfig, gpu_blocks: int, gpu_block_bytes: int, kv_gib: float | None) -> None:
    """Refuses a GPU pool that can never run a step: the scheduler does not shrink a prefill chunk, and offload
    keeps a request whole on the GPU (core policy ``resident``). With less, a point would loop without progress."""
    tokens = min(cfg.max_batched_tokens, cfg.max_prompt())
    what = f"a prefill chunk of {tokens:,} tokens"
    if cfg.mode == "offload":
        tokens = cfg.max_prompt() + cfg.output_tokens
        what = f"offload keeps a request whole on the GPU: the last turn of {tokens:,} tokens"
    need = _blocks(cfg, tokens)
    if gpu_blocks < need:
        pool = f"the pool has {gpu_blocks:,}" if kv_gib is None else f"{kv_gib:g} GiB of KV HBM holds {gpu_blocks:,}"
        raise ConfigError(f"{what} needs {need - 1:,} GPU blocks of {gpu_block_bytes:,} B besides the null block, "
                          f"and {pool}: use {_pool_advice(cfg, need, gpu_block_bytes)}")


def adaptive_hot_rows(cfg: SimConfig, gpu_blocks: int, gpu_block_bytes: int, charge_tokens: int) -> int:
    """Hot rows chosen from admission pressure: the largest hot buffer (a multiple of the block size, within
    [top_k, 32,768]) that still lets every one of ``concurrency`` requests run at its steady-state footprint
    (tail + hot region with its indexer keys) beside the watermark; top_k when even that does not fit."""
    bt = cfg.block_tokens
    best = cfg.top_k
    rows = max(cfg.top_k, K.HOT_ROWS_LIMIT) // bt * bt
    while rows >= cfg.top_k:
        hot_blocks = _core_hot_blocks(cfg, rows, gpu_block_bytes, charge_tokens)
        watermark = max(hot_blocks, gpu_blocks // 10)
        if cfg.concurrency * (cfg.tail_pages + hot_blocks) <= gpu_blocks - 1 - watermark:
            return rows
        rows -= bt
    return best


# --------------------------------------------------------------------------- simulation


class _Req:
    """A request as the scheduler sees it. Its page hashes are made when it is admitted, not here: every waiting
    request would otherwise hold a list of ~1,200 of them (44 KB), 17 GB at a million conversations."""

    __slots__ = ("rid", "conv", "turn", "user", "prompt", "out", "arrival", "computed", "generated", "target",
                 "in_prefill", "ready_t", "first_t", "last_t", "ran", "preempted", "reached")

    def __init__(self, rid: int, conv: int, turn: int, user: int, prompt: int, out: int, arrival: float):
        self.rid = rid
        self.conv = conv
        self.turn = turn
        self.user = user
        self.prompt = prompt
        self.out = out
        self.arrival = arrival
        self.computed = 0
        self.generated = 0
        self.target = prompt
        self.in_prefill = True
        self.ready_t = 0.0
        self.first_t: float | None = None
        self.last_t = 0.0
        self.ran = False
        self.preempted = False
        self.reached = 0  # the most tokens it ever had computed: computing beyond is progress, redoing is not


class Simulation:
    """One point. ``run()`` returns the metrics; ``manager`` is the live core for inspection."""

    def __init__(self, cfg: SimConfig, progress: Callable[[float], None] | None = None):
        self.cfg = cfg
        self.d = derive(cfg)
        d = self.d
        self.manager = ResidencyManager(
            num_gpu_blocks=d.num_gpu_blocks, block_size=cfg.block_tokens, max_model_len=cfg.max_model_len,
            num_host_blocks=d.num_host_blocks, page_bytes=d.host_page_bytes, max_running=cfg.max_num_seqs,
            top_k=cfg.top_k, hot_rows=d.core_hot_rows, speculative_tokens=cfg.speculative_tokens,
            num_index_groups=cfg.index_groups, tail_pages=cfg.tail_pages, watermark=d.watermark,
            policy=cfg.core_policy, materialize_budget=cfg.materialize_budget,
        )
        key = f"{cfg.seed}/{cfg.mode}/{cfg.core_policy}/{cfg.concurrency}"
        self.rng = random.Random(key)
        self.progress = progress
        # Per-step (time, running, waiting, prefilling, gpu_free, mixed + none, preempted) when a list is set.
        self.trace: list[tuple[float, int, int, int, int, int, int]] | None = None
        # MTP: per-draft acceptance p with 1 + p + ... + p^q = accept_length
        self.accept_p = _chain_probability(cfg.accept_length, cfg.speculative_tokens)
        self.m1 = _miss_anchor_1()

    # ------------------------------------------------------------------ helpers

    def _hashes(self, conv: int, max_len: int) -> list[int]:
        pages = max_len // self.cfg.block_tokens
        base = conv << 20
        return list(range(base + 1, base + 1 + pages))

    def _new_request(self, user: int, conv: int, turn: int, now: float) -> _Req:
        prompt = self.cfg.prompt(turn)
        rid = self.next_rid
        self.next_rid += 1
        self.arrived += 1
        return _Req(rid, conv, turn, user, prompt, self.cfg.output_tokens, now)

    def _accepted(self) -> int:
        q = self.cfg.speculative_tokens
        rnd = self.rng.random
        p = self.accept_p
        n = 1
        while n <= q and rnd() < p:
            n += 1
        return n

    def _binomial(self, n: float, p: float) -> int:
        n = int(round(n))
        if n <= 0 or p <= 0:
            return 0
        if p >= 1:
            return n
        if n <= 48:
            rnd = self.rng.random
            return sum(1 for _ in range(n) if rnd() < p)
        mean = n * p
        x = int(round(self.rng.gauss(mean, math.sqrt(mean * (1 - p)))))
        return min(n, max(0, x))

    def _no_progress(self, now: float, running: int, waiting: int, short: int, refused: CapacityError | None) -> str:
        """Why a point stopped making progress, and what would let it."""
        cfg, d = self.cfg, self.d
        where = (f"no request computed a new token in {NO_PROGRESS_PASSES} scheduler passes up to t={now:.2f} s "
                 f"({running} running, {waiting} waiting)")
        if refused is not None and not short:
            return f"{where}: the core admits nothing: {refused}"
        if not short:
            return f"{where}: {self.manager.capacity_log()}"
        # Short plans end in preemptions that throw the step's work away, again and again. A pool that holds the
        # longest request whole never needs a release to run it, whatever the copies to the host are doing.
        whole = _blocks(cfg, cfg.max_prompt() + cfg.output_tokens)
        return (f"{where}: the GPU KV pool of {d.num_gpu_blocks:,} blocks is too small for this workload (the last "
                f"step lacked {short:,}); one that holds the longest request whole ({whole - 1:,} blocks besides the "
                f"null block) needs no release to run it: use {_pool_advice(cfg, whole, d.gpu_block_bytes)}")

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        cfg, d, m = self.cfg, self.d, self.manager
        q = cfg.speculative_tokens
        bt = cfg.block_tokens
        self.next_rid = 1
        self.arrived = 0
        next_conv = 1
        waiting: deque[_Req] = deque()
        running: list[_Req] = []
        now = 0.0
        for user in range(cfg.concurrency):
            waiting.append(self._new_request(user, next_conv, 0, now))
            next_conv += 1
        copies: deque[tuple[float, list[int]]] = deque()
        d2h_free = 0.0
        h2d_free = 0.0
        # metrics
        steps = 0
        busy_time = 0.0
        running_area = 0.0
        series_t: list[float] = []
        series_n: list[int] = []
        ttfts: list[float] = []
        itls: list[float] = []
        out_tokens = 0
        preemptions = 0
        unadmissions = 0
        finished = 0
        conversations = 0
        h2d = {"decode_miss": 0.0, "prefill_miss": 0.0, "restore": 0.0, "indexer": 0.0, "relief": 0.0}
        d2h_bytes = 0.0
        hits = misses = 0
        max_running = 0
        mixed_area = 0.0
        gated = False
        # Scheduler passes since a request last computed a token it never had: passes without a step and steps
        # that only redo what a preemption threw away are not progress.
        idle = 0
        short = 0  # GPU blocks the last refused step plan lacked
        refused: CapacityError | None = None  # the last admission the core refused
        arrivals_open = True
        last_progress = -1.0
        stats = m.stats()
        restored_before = stats["total_restored"]
        tiers = cfg.mode == "hisparse"

        while True:
            if arrivals_open and (now >= cfg.duration_s or (cfg.max_steps is not None and steps >= cfg.max_steps)):
                if not cfg.drain:
                    break
                arrivals_open = False
            if not arrivals_open and not running and not waiting:
                break
            if self.progress is not None and now - last_progress >= 5.0:
                last_progress = now
                part = max(now / cfg.duration_s, steps / cfg.max_steps if cfg.max_steps else 0.0)
                self.progress(min(1.0, part))
            # Copies to the host that have ended by now.
            if copies and copies[0][0] <= now:
                done: list[int] = []
                while copies and copies[0][0] <= now:
                    done += copies.popleft()[1]
                m.complete(done, ok=True)
            # Passes without progress are few (a wait for restores or copies, a preemption that empties the step,
            # recomputing what it lost) unless the node is too small for the workload: then they repeat forever,
            # with the clock stopped (no step fits) or running (each step is lost to the next preemption).
            idle += 1
            if idle > NO_PROGRESS_PASSES:
                raise CapacityError(self._no_progress(now, len(running), len(waiting), short, refused))
            # Schedule: running requests first (vLLM V1), in admission order.
            budget = cfg.max_batched_tokens
            sched: list[tuple[_Req, int]] = []
            for r in running:
                if r.ready_t > now:
                    continue
                if r.in_prefill:
                    chunk = min(r.target - r.computed, budget)
                    if chunk > 0:
                        sched.append((r, chunk))
                        budget -= chunk
                elif budget >= q + 1:
                    sched.append((r, min(self._accepted(), r.out - r.generated)))
                    budget -= q + 1
            # Then waiting requests, while the budget lasts and the core admits them.
            while waiting and budget > 0 and not gated and len(running) < cfg.max_num_seqs:
                r = waiting[0]
                before = m.stats()["total_restored"]
                try:
                    if r.preempted:
                        a = m.resume(r.rid)
                    else:
                        a = m.admit(r.rid, r.prompt, self._hashes(r.conv, r.prompt + r.out), r.prompt + r.out)
                except CapacityError as exc:
                    refused = exc
                    break
                waiting.popleft()
                running.append(r)
                r.computed = a.cached_tokens
                r.target = r.prompt + r.generated
                r.in_prefill = True
                r.ran = False
                # Restores (tail, or everything for the baseline) and the indexer keys of host-only history
                # travel on the host link before the request can run.
                restored = m.stats()["total_restored"] - before
                restored_before += restored
                nbytes = restored * d.host_page_bytes
                h2d["restore"] += nbytes
                if tiers:
                    host_only = m.request_info(r.rid)["host_only_pages"]
                    ibytes = host_only * d.indexer_page_bytes
                    h2d["indexer"] += ibytes
                    nbytes += ibytes
                if nbytes > 0:
                    start = max(now, h2d_free)
                    h2d_free = start + nbytes / cfg.h2d_bytes_per_s
                    r.ready_t = h2d_free
                else:
                    r.ready_t = now
                if r.ready_t <= now:
                    chunk = min(r.target - r.computed, budget)
                    if chunk > 0:
                        sched.append((r, chunk))
                        budget -= chunk
            if not sched:
                # Nothing can run now: jump to the next event.
                pending = [r.ready_t for r in running if r.ready_t > now]
                if copies:
                    pending.append(copies[0][0])
                if pending:
                    now = min(pending)
                gated = False
                continue
            if cfg.check_every and steps % cfg.check_every == 0:
                m.check_invariants()
            plan = m.plan_step([(r.rid, n) for r, n in sched])
            while not plan.ok:
                short = plan.missing_blocks
                # vLLM: preempt the newest running request until the step fits; one admitted this step that
                # never ran is just put back.
                victim = running.pop()
                kept = m.preempt(victim.rid)
                victim.computed = kept
                victim.target = victim.prompt + victim.generated
                victim.in_prefill = True
                victim.preempted = True
                waiting.appendleft(victim)
                if victim.ran:
                    preemptions += 1
                else:
                    unadmissions += 1
                gated = True
                sched = [(r, n) for r, n in sched if r is not victim]
                if not sched:
                    break
                plan = m.plan_step([(r.rid, n) for r, n in sched])
            if not plan.ok:
                continue
            steps += 1
            start = now
            stats = m.stats()
            # Copies to the host planned by this step start with it and overlap the forward.
            ids = plan.transfer_ids
            if ids:
                nbytes = len(ids) * d.host_page_bytes
                d2h_bytes += nbytes
                d2h_free = max(start, d2h_free) + nbytes / cfg.d2h_bytes_per_s
                copies.append((d2h_free, ids))
            # Restores planned inside the step (relief to full residency) land before the forward.
            relief = stats["total_restored"] - restored_before
            restored_before = stats["total_restored"]
            wait_bytes = relief * d.host_page_bytes
            h2d["relief"] += wait_bytes
            # Top-K misses of requests that read host-only history.
            prefill_tokens = 0
            flops = 0.0
            tiered = tiers and (stats["mixed"] + stats["none"]) > 0
            for r, n in sched:
                if r.in_prefill:
                    flops += K.prefill_flops(n, r.computed)
                    prefill_tokens += n
                if not tiered:
                    continue
                info = m.request_info(r.rid)
                host_only = info["host_only_pages"]
                if host_only == 0:
                    continue
                host_tokens = host_only * bt
                f = min(1.0, host_tokens / max(1, info["seq_len"]))
                if r.in_prefill:
                    rows = min(float(host_tokens), cfg.top_k * (1 + (n - 1) * self.m1) * f)
                    missed = int(rows)
                else:
                    rows = d.step_rows * f
                    missed = self._binomial(rows, miss_rate(d.hot_rows / rows))
                    hits += int(round(rows)) - missed
                    misses += missed
                wait_bytes += missed * d.mla_row_all_layers
                h2d["prefill_miss" if r.in_prefill else "decode_miss"] += missed * d.mla_row_all_layers
            compute = cfg.decode_step_s
            if prefill_tokens:
                compute += flops / K.PREFILL_FLOPS_PER_S
            dt = compute + wait_bytes / cfg.h2d_bytes_per_s
            now = start + dt
            # Sample the running requests over the step (those whose restores have landed).
            n_running = sum(1 for r in running if r.ready_t <= start)
            if start < cfg.duration_s:
                span = min(now, cfg.duration_s) - start
                if n_running > 0:
                    busy_time += span
                    running_area += n_running * span
                    mixed_area += (stats["mixed"] + stats["none"]) * span
                max_running = max(max_running, n_running)
                series_t.append(start)
                series_n.append(n_running)
                if self.trace is not None:
                    self.trace.append((start, n_running, len(waiting), sum(1 for r in running if r.in_prefill),
                                       stats["gpu_free"], stats["mixed"] + stats["none"], stats["preempted"]))
            # Apply the step.
            for r, n in sched:
                r.computed += n
                r.ran = True
                if r.computed > r.reached:
                    r.reached = r.computed
                    idle = short = 0
                    refused = None
                if r.in_prefill:
                    if r.computed < r.target:
                        continue
                    r.in_prefill = False
                    emitted = 1
                else:
                    emitted = n
                r.generated += emitted
                if now <= cfg.duration_s:
                    out_tokens += emitted
                if r.first_t is None:
                    r.first_t = now
                    if r.arrival < cfg.duration_s:
                        ttfts.append(now - r.arrival)
                elif now <= cfg.duration_s:
                    itls.append(now - r.last_t)
                r.last_t = now
            # Finished turns: the next turn (or a fresh conversation) is sent at once.
            done_reqs = [r for r, _ in sched if not r.in_prefill and r.generated >= r.out]
            for r in done_reqs:
                m.finish(r.rid)
                running.remove(r)
                finished += 1
                gated = False
                if not arrivals_open:
                    continue
                if r.turn + 1 < cfg.turns:
                    waiting.append(self._new_request(r.user, r.conv, r.turn + 1, now))
                else:
                    conversations += 1
                    waiting.append(self._new_request(r.user, next_conv, 0, now))
                    next_conv += 1

        # End: let the copies in flight finish, so a drained run holds no block at all.
        if copies:
            m.complete([t for _, ids in copies for t in ids], ok=True)
            copies.clear()
        m.check_invariants()
        if self.progress is not None:
            self.progress(1.0)
        horizon = min(now, cfg.duration_s)
        total_h2d = sum(h2d.values())
        final = m.stats()
        return {
            "mode": cfg.mode,
            "policy": cfg.core_policy,
            "concurrency": cfg.concurrency,
            "mean_running": running_area / busy_time if busy_time > 0 else 0.0,
            "output_tok_s": out_tokens / horizon if horizon > 0 else 0.0,
            "ttft_s_p50": statistics.median(ttfts) if ttfts else None,
            "itl_ms_p50": statistics.median(itls) * 1e3 if itls else None,
            "preemptions": preemptions,
            "h2d_gb": total_h2d / 1e9,
            "hit_rate": (hits / (hits + misses) if hits + misses > 0 else None) if tiers else None,
            "max_running": max_running,
            "mean_mixed": mixed_area / busy_time if busy_time > 0 else 0.0,
            "unadmissions": unadmissions,
            "requests_arrived": self.arrived,
            "requests_finished": finished,
            "conversations_finished": conversations,
            "steps": steps,
            "sim_s": now,
            "h2d_gb_by_kind": {k: v / 1e9 for k, v in h2d.items()},
            "d2h_gb": d2h_bytes / 1e9,
            "hot_rows": d.hot_rows,
            "gpu_blocks": d.num_gpu_blocks,
            "steady_state_concurrency": final["steady_state_concurrency"],
            "final": {k: final[k] for k in ("gpu_used", "host_referenced", "host_cached", "running",
                                            "preempted", "pending_transfers")},
            "series": (series_t, series_n),
        }


def _chain_probability(mean_len: float, q: int) -> float:
    """p such that 1 + p + p^2 + ... + p^q = mean_len (drafts accepted in a chain)."""
    if q == 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(q + 1)) < mean_len:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# --------------------------------------------------------------------------- runs


def run_points(configs: Sequence[SimConfig], progress: bool = False) -> list[dict[str, Any]]:
    points = []
    bar = console.Progress(progress)
    bar.start("simulate")
    n = len(configs)
    for i, cfg in enumerate(configs):
        label = f"{i + 1}/{n} {cfg.mode}/{cfg.core_policy} c={cfg.concurrency}"

        def tick(fraction: float, i: int = i, label: str = label) -> None:
            bar.update((i + fraction) / n, f"{label:<28} {fraction:4.0%}")

        points.append(Simulation(cfg, progress=tick if progress else None).run())
    bar.close()
    return points


def build_configs(args: argparse.Namespace) -> list[SimConfig]:
    modes = MODES if args.mode == "both" else (args.mode,)
    policies = TIER_POLICIES if args.policy == "both" else (args.policy,)
    configs = []
    for mode in modes:
        for policy in (("resident",) if mode == "offload" else policies):
            for c in args.concurrency:
                configs.append(SimConfig(
                    mode=mode, policy=policy, concurrency=c, duration_s=args.duration, max_steps=args.steps,
                    seed=args.seed, kv_hbm_gib=args.kv_hbm_gib, hot_rows=args.hot_rows,
                    adaptive_hot_rows=args.adaptive_hot_rows, speculative_tokens=args.mtp,
                    accept_length=min(args.accept_length, args.mtp + 1.0) if args.mtp else 1.0,
                ))
    return configs


def describe(cfg: SimConfig) -> dict[str, Any]:
    d = derive(cfg)
    return {
        "model": K.MODEL, "gpu": cfg.gpu, "tp": cfg.tp, "kv_hbm_gib": d.kv_hbm_gib,
        "gpu_block_bytes": d.gpu_block_bytes, "gpu_blocks": d.num_gpu_blocks, "watermark": d.watermark,
        "speculative_tokens": cfg.speculative_tokens, "accept_length": cfg.accept_length,
        "top_k": cfg.top_k, "decode_step_ms": cfg.decode_step_s * 1e3,
        "prefill_tflops": K.PREFILL_FLOPS_PER_S / 1e12, "h2d_gb_s": cfg.h2d_bytes_per_s / 1e9,
        "workload": {"turns": cfg.turns, "first_turn_tokens": cfg.first_turn_tokens,
                     "later_turn_tokens": cfg.later_turn_tokens, "output_tokens": cfg.output_tokens,
                     "max_model_len": cfg.max_model_len, "max_batched_tokens": cfg.max_batched_tokens,
                     "max_num_seqs": cfg.max_num_seqs},
        "duration_s": cfg.duration_s, "seed": cfg.seed,
    }


def mode_details(cfg: SimConfig) -> dict[str, Any]:
    d = derive(cfg)
    return {"host_gib": d.host_gib, "host_blocks": d.num_host_blocks, "host_page_bytes": d.host_page_bytes,
            "hot_rows": d.hot_rows, "core_hot_blocks": d.core_hot_rows // cfg.block_tokens,
            "indexer_charge_tokens": d.indexer_charge_tokens}


# --------------------------------------------------------------------------- output


def format_table(result: dict[str, Any], wall_s: float | None = None) -> str:
    c = result["config"]
    lines = [
        f"hisparse simulate: {c['model']} on {c['tp']}x{c['gpu'].upper()}, KV HBM "
        f"{c['kv_hbm_gib'] if c['kv_hbm_gib'] is not None else '-'} GiB/GPU = {c['gpu_blocks']:,} blocks of "
        f"{c['gpu_block_bytes']:,} B, MTP{c['speculative_tokens']} (accept {c['accept_length']}), "
        f"{c['duration_s']:g} s simulated per point",
    ]
    for mode, det in result["modes"].items():
        hot = (f", hot rows {det['hot_rows']:,} (core region {det['core_hot_blocks']} blocks incl. indexer "
               f"keys of {det['indexer_charge_tokens']:,} tokens)") if mode.startswith("hisparse") else ""
        gib = f"{det['host_gib']:g} GiB" if det["host_gib"] is not None else "host pool"
        lines.append(f"  {mode}: {gib} = {det['host_blocks']:,} host blocks{hot}")
    head = ("mode", "policy", "c", "running", "max", "mixed", "out tok/s", "TTFT p50 s", "ITL p50 ms",
            "preempt", "H2D GB", "hit rate", "turns")
    rows = []
    for p in result["points"]:
        rows.append((
            p["mode"], p["policy"], str(p["concurrency"]), f"{p['mean_running']:.1f}", str(p["max_running"]),
            f"{p['mean_mixed']:.1f}", f"{p['output_tok_s']:.0f}",
            "-" if p["ttft_s_p50"] is None else f"{p['ttft_s_p50']:.2f}",
            "-" if p["itl_ms_p50"] is None else f"{p['itl_ms_p50']:.1f}",
            str(p["preemptions"]), f"{p['h2d_gb']:.0f}",
            "-" if p["hit_rate"] is None else f"{p['hit_rate']:.1%}", str(p["requests_finished"]),
        ))
    lines.append(console.format_table(rows, head=head, align="ll" + "r" * (len(head) - 2), rule=True))
    lines.append("running = mean of non-zero samples of running requests (the blog's metric); mixed = of them "
                 "in mixed/none residency; published at c=32: offload 5-6, hisparse 19-25")
    if wall_s is not None:
        lines.append(f"wall time {wall_s:.1f} s")
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = sorted({p["concurrency"] for p in points})
    fig, axes = plt.subplots(len(conc), 1, figsize=(9, 2.4 * len(conc)), sharex=True, squeeze=False)
    for ax, c in zip(axes[:, 0], conc, strict=True):
        for p in points:
            if p["concurrency"] != c:
                continue
            ts, ns = p["series"]
            stride = max(1, len(ts) // 3000)
            ax.step(ts[::stride], ns[::stride], where="post", lw=0.8,
                    label=f"{p['mode']}/{p['policy']} (mean {p['mean_running']:.1f})")
        ax.set_ylabel(f"running, c={c}")
        ax.legend(loc="upper right", fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle("Running requests over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> None:
    """Register ``simulate`` on an ``argparse`` subparsers object (``set_defaults(func=main)``)."""
    p = subparsers.add_parser("simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=(*MODES, "both"), default="both")
    p.add_argument("--policy", choices=(*TIER_POLICIES, "both"), default="both",
                   help="hisparse pressure policy (offload always runs the core's 'resident')")
    p.add_argument("--concurrency", type=positive_int_list, default=list(K.CONCURRENCY),
                   help="comma-separated conversations in flight (default 1,8,16,24,32)")
    p.add_argument("--duration", type=positive_float, default=1800.0,
                   help="simulated seconds per point (default 1800)")
    p.add_argument("--steps", type=positive_int, default=None, help="stop a point after this many steps")
    p.add_argument("--seed", type=seed, default=0)
    hot = p.add_mutually_exclusive_group()
    hot.add_argument("--hot-rows", type=positive_int, default=None,
                     help="hot rows per request (default (MTP + 2) x top_k = 10,240)")
    hot.add_argument("--adaptive-hot-rows", action="store_true",
                     help="the largest hot buffer that lets every request of the concurrency run at steady state")
    p.add_argument("--kv-hbm-gib", type=positive_gib, default=None,
                   help="KV HBM per GPU (default: hisparse calc's, 17.8 GiB; FACTS.md quotes ~26 GiB measured)")
    p.add_argument("--mtp", type=int_range(0, 7), default=K.SPECULATIVE_TOKENS, metavar="Q",
                   help="speculative (MTP) tokens per step (default 3; the step time stays the MTP3 measurement)")
    p.add_argument("--accept-length", type=positive_float, default=K.MTP_ACCEPT_LENGTH,
                   help="mean tokens per decode step with MTP (default 3.48, measured)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="PNG", type=plot_path, default=None,
                   help="draw running requests over time per mode (.png, .pdf or .svg; the folder must exist)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress on stderr (a bar on a terminal; elsewhere a line every few seconds once a run "
                        "has lasted two)")
    p.set_defaults(func=main)


def simulate(configs: Sequence[SimConfig], progress: bool = False) -> dict[str, Any]:
    """Runs the points; returns the JSON-ready result (series left out) and the raw points."""
    points = run_points(configs, progress=progress)
    modes: dict[str, Any] = {}
    for cfg in configs:
        modes.setdefault(f"{cfg.mode}/{cfg.core_policy}", mode_details(cfg))
    return {
        "config": describe(configs[0]),
        "modes": modes,
        "points": points,
    }


def to_json(result: dict[str, Any]) -> dict[str, Any]:
    out = dict(result)
    out["points"] = [{k: v for k, v in p.items() if k != "series"} for p in result["points"]]
    return out


# Bytes per item of what a run keeps in Python and in the core, for the memory check before a run (CPython
# 3.11, 64-bit; rounded up from sys.getsizeof and from the core's resident size per block, 57 B).
REQUEST_BYTES = 400  # a request object waiting in the queue, its floats and its queue slot
SAMPLE_BYTES = 48  # one step of the running-requests series (a float, an int, two list slots), kept per point
LATENCY_BYTES = 32  # one TTFT or inter-token-latency sample (a float and a list slot)
CORE_BLOCK_BYTES = 64  # the core's bookkeeping of one GPU or host block
CORE_PAGE_BYTES = 16  # one page-table entry of one running request in the core


def estimate_memory(configs: Sequence[SimConfig]) -> tuple[float, str]:
    """Bytes a run of ``configs`` needs at its peak, an upper bound on the parts that grow with the flags, and
    what they are. Points run one after another; each keeps its series of running requests for the plot.

    A point takes at most ``duration / decode_step`` steps (every step lasts at least one decode step); each
    step records at most one latency sample per running request, and at most ``max_num_seqs`` run."""
    kept = peak = 0.0
    worst = ""
    for cfg in configs:
        d = derive(cfg)
        steps = cfg.duration_s / cfg.decode_step_s + 1  # a float: inf for a duration near the largest float
        if cfg.max_steps is not None:
            steps = min(steps, cfg.max_steps)
        running = min(cfg.concurrency, cfg.max_num_seqs)
        max_pages = -(-cfg.max_model_len // cfg.block_tokens)
        transient = (cfg.concurrency * REQUEST_BYTES + steps * running * LATENCY_BYTES
                     + (d.num_gpu_blocks + d.num_host_blocks) * CORE_BLOCK_BYTES
                     + running * max_pages * CORE_PAGE_BYTES)
        kept += steps * SAMPLE_BYTES
        if transient > peak:
            peak = transient
            worst = (f"concurrency {cfg.concurrency:,}, up to {steps:,.0f} steps of {running} running requests, "
                     f"{d.num_gpu_blocks + d.num_host_blocks:,} blocks")
    return kept + peak, f"{worst}; {len(configs)} points"


def main(args: argparse.Namespace) -> int:
    """``hisparse simulate``. The memory check and every point's configuration (sizes and the core's own checks)
    come before the first point runs, so a bad flag fails at once; errors reach the command line as one line."""
    configs = build_configs(args)
    need, what = estimate_memory(configs)
    console.require_memory(need, what, "lower --concurrency, --duration or --steps")
    for cfg in configs:
        Simulation(cfg)
    t0 = time.monotonic()
    result = simulate(configs, progress=args.progress)
    wall = time.monotonic() - t0
    if args.plot:
        plot(result["points"], args.plot)
    if args.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(format_table(result, wall_s=wall))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0

