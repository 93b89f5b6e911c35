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
``hisparse``  Hybrid HiSparse: core policy ``coldest`` (the default: as many running requests as ``fifo``, 4-8%
              fewer host-link bytes per token at concurrency 8-16) or ``fifo`` (what vLLM 0.33 does), 384 GiB HiSparse
              host pool for the sparse-MLA KV. The 128 GiB indexer OffloadingConnector pool is modeled as
              never binding (32 conversations of <= 86K tokens hold at most 7.6 GB of indexer keys).
              Selection heat comes from :mod:`hisparse.tools.locality`'s page model: every 32 steps each running
              request's selections are added to a worker-side heat table and the core's own summary of it
              (``_ref_heat_summary``, 128 coldest / 32 hottest pages) is reported through ``apply_results``, so
              ``coldest`` releases what the model selects least; ``fifo`` releases the newest pages first.

Memory model (GLM-5.3 FP8 on 8xH200, TP8; every rank holds the same replicated MLA KV, so one GPU is
simulated)
  * KV HBM per GPU from :func:`hisparse.tools.calc.calculate` (17.8 GiB), one pool of 64-token blocks. A
    conversation of the published workload holds ~1,250 blocks (~80K tokens): the calculator's 5,536 blocks hold
    4 whole, the 8,086 of the ~26 GiB vLLM's own profiling leaves hold 6, and vLLM admits a request only when its
    whole sequence is free (below), so offload runs fewer than that. vLLM also keeps KV for the MTP layer (one
    more sparse-MLA layer with its own indexer: 54,728 B per token, 1.5% more than modelled here); a pool of the
    same block count is ``--kv-hbm-gib`` x 53,940 / 54,728.
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
  * Hot rows default to the blog's MTP sizing (q + 2) x top_k = 10,240, which is vLLM 0.33's default too
    ((1 + q + 1) x top_k: a decode's query and one top-K of slack); ``--adaptive-hot-rows`` picks one size
    for every request, the largest buffer that lets all ``concurrency`` requests fit. ``--hot-buffers
    adaptive`` sizes each request's buffer instead: the core still leases regions of one size (it knows no
    other), and every heat interval the rows of all leased
    regions are shared among their holders in proportion to the rows each selected on its host-only pages per
    decode step (the equal-marginal-gain split of the model's miss curve), each within [one step's selected
    rows, 32,768]; the holders are read from the plans' hot-region updates. Same GPU blocks, same admission:
    it measures what moving rows between requests buys, not what giving blocks back would.
  * Host page: MLA only (3,274,752 B) in hisparse mode, MLA + indexer (3,452,160 B) in offload mode.

Workload (vLLM blog, OpenHands-style; every length a flag): ``concurrency`` users, whose first requests are
spread over the first 60 s (``arrival_spread_s``), each runs 13-turn conversations back to back;
turn 1 is 74,160 tokens, each later turn is the whole conversation so far plus 753 new tokens; 220 output
tokens per turn (EOS ignored); the next turn is sent the moment the answer ends. Page hashes are a chain per
conversation (prefix caching), including the pages the answer fills, so a next turn finds every full page
that reached the host (or is still on the GPU).

Scheduler (vLLM V1 order): running requests first, in admission order -- a decode schedules 1 + q
verification tokens of the 32,768-token budget, a prefill the largest chunk that fits; then waiting
requests (preempted ones first, then arrivals, FCFS) while the budget lasts, the core admits them, and no
request was preempted since the last turn ended. As vLLM 0.33 (``scheduler_reserve_full_isl``, its default), a
waiting request is admitted only when the GPU blocks of its whole sequence are free beside what the step already
takes; HiSparse caps that at one admission window of ``max_num_batched_tokens`` (``HiSparseResidentSpec``).
A short plan preempts the newest running request (a request admitted in the same step and never run is simply
put back, not counted as a preemption) until the plan fits, but for the step's only request when it is the
newest and a prefill: it halves its chunk instead, down to a page, as the reference engine's does. The core
copies the pages a step sealed to the host in the next plan, a step after vLLM's HiSparse, which copies them
after the forward that wrote them, so a prompt longer than the GPU pool can free room for its next chunk only
once the last one's copies are under way; preempted, it would lose that chunk each time and never get past it.
Running alone with not a page free, it waits instead for those copies, which a plan that schedules nothing
starts (the reference engine's ``_copy_written_pages``).
MTP: each decode step emits 1 + accepted drafts tokens, drafts accepted in a chain with the probability that
gives the measured mean accept length 3.48; the KV grows by the tokens emitted. A GPU pool that cannot hold one
prefill chunk (offload: one whole request) is refused before the run; a point in which no request computes a
new token for 50 scheduler passes (each step lost to a preemption) ends in an error.

Traffic and time (constants and sources in :mod:`hisparse.tools.sim_constants`)
  * Step = one decode step (26.2 ms: TPOT x accept length of GLM-5-FP8 MTP on 8xH200) + prefill FLOPs /
    (8 x 1,979 TFLOPS x 24.4% MFU) + host->GPU bytes the forward waits for / 55 GB/s.
  * Top-K locality (:mod:`hisparse.tools.locality`): a selection process (sinks, a recent window, drifting
    topics with reuse, one stream per indexer) fitted to the paper's miss rates (30% / 13.4% / 6.7% with 1x / 2x
    / 4x top_k hot rows: fitted on 1x and 4x, 2x predicted). From it: the rows one MTP step resolves (the union
    of its q + 1 consecutive positions' top-K, ~1.6 x top_k at q = 3), the LRU miss curve of a hot buffer over
    such steps, and per request the share ``f`` of a step's selection that lands on its host-only pages (from
    the request's page heat and its host-only pages as the plans' table updates leave them). A decode step
    misses ``Binomial(s, S(hot_rows / s))`` rows of 51,168 B (all 78 layers), ``s = f x union``, ``S`` the model's
    curve over the request's history length (measured at 4K, 8K, ... 1M tokens and interpolated: a buffer that
    holds most of a short history misses little; :func:`hisparse.tools.locality.context_miss_rate`). A prefill
    chunk of T tokens over host-only history reads ``top_k x (1 + (T - 1) x (1 - overlap)) x f`` rows capped
    at the host-only history, all of them copied (they cannot stay in a 10K-row buffer).
  * Restores at admission/resumption (tail pages; every page for the offload baseline, and for a hisparse request
    that never fills its admission window of ``max_num_batched_tokens`` (the core's ``admission_pages``), whose
    prefill would otherwise read its host-only history inside the steps: the count the core's
    ``Admission.restored_pages`` gives) and the indexer keys of the pages not on the GPU (host-only history and
    restored pages) run on the host link asynchronously: the request runs, and counts as running, when they
    have landed (vLLM: a request whose KV the connector loads waits in WAITING_FOR_REMOTE_KVS, holding its blocks).
    Restores planned inside a step (relief back to full residency) delay that step.
  * Proactive copies to the host go over a 55 GB/s link in order and are reported to the core
    (``complete``) at the first step boundary after they end.

Metrics: ``mean_running`` is the blog's metric, the mean of the non-zero samples of running requests
(sampled per unit of simulated time; a request waiting for its restores is not yet running), over the
simulated duration; ``null`` when no request finished (a request that never finishes is no success).
Also per point: host-link bytes per output token, the GPU blocks by use (``gpu_blocks_breakdown``) and what
held admission (``admission``), sampled every 8 steps; and ``policy_comparison``: coldest vs fifo, with fixed and
(``--hot-buffers both``) adaptive hot buffers, ``hot_rows_read`` (the rows of the buffers decode steps read) and
``host_share`` (quantiles of the share of a tiered request's selections on its host-only pages). Output
tokens/s, TTFT and ITL medians (ITL: time between consecutive output chunks of a request, one chunk per step),
preemptions (not counting un-admissions), H2D GB (misses + restores + indexer-key loads), and the hot-buffer hit
rate of decode steps (hits / (hits + misses) of the rows selected on host-only pages; ``null`` for offload).
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

from .. import _core
from .._core import ResidencyManager
from ..errors import CapacityError, ConfigError
from . import calc, console, locality
from . import sim_constants as K
from .argtypes import (
    U32_MAX,
    int_range,
    nonnegative_float,
    plot_path,
    positive_float,
    positive_gib,
    positive_int,
    positive_int_list,
    seed,
)

GIB = 2**30
#: Scheduler passes in a row in which no request computes a token it never had, after which a point is given up.
#: The default points and the tests' have none; a node too small for the workload has them forever.
NO_PROGRESS_PASSES = 50
MODES = ("offload", "hisparse")
TIER_POLICIES = ("coldest", "fifo")
#: fixed: every request's hot buffer holds ``hot_rows``; adaptive: the rows of the hot regions the core leased are
#: shared among their requests by what each one selects on its host-only pages (:meth:`Simulation._rebalance`).
HOT_BUFFERS = ("fixed", "adaptive")


# --------------------------------------------------------------------------- configuration


@dataclasses.dataclass
class SimConfig:
    """One simulated (mode, policy, concurrency) point. Defaults are the published benchmark."""

    mode: str = "hisparse"
    policy: str = "coldest"  # offload mode always runs the core's "resident" policy
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
    arrival_spread_s: float = K.ARRIVAL_SPREAD_S  # users' first requests spread evenly over [0, this) seconds
    # deployment
    model: str = K.MODEL
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
    adaptive_hot_rows: bool = False  # one size for every request: the largest that fits the concurrency
    hot_buffers: str = "fixed"  # HOT_BUFFERS: per request, fixed at hot_rows or adaptive within the leased rows
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
        if self.hot_buffers not in HOT_BUFFERS:
            raise ConfigError(f"hot_buffers must be one of {HOT_BUFFERS}, got {self.hot_buffers!r}")
        for name in ("concurrency", "turns", "first_turn_tokens", "output_tokens", "max_batched_tokens",
                     "max_num_seqs", "top_k", "block_tokens", "tail_pages"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if not self.duration_s > 0:  # also NaN
            raise ConfigError("duration_s must be positive")
        if self.later_turn_tokens < 0:
            raise ConfigError("later_turn_tokens must not be negative")
        if not 0 <= self.arrival_spread_s < math.inf:
            raise ConfigError("arrival_spread_s must be a finite number of seconds, at least 0")
        if self.model not in calc.MODELS:
            raise ConfigError(f"unknown model {self.model!r}; choose from {', '.join(calc.MODELS)}")
        if self.gpu not in calc.GPU_MEMORY_GB:
            raise ConfigError(f"unknown gpu {self.gpu!r}; choose from {', '.join(calc.GPU_MEMORY_GB)}")
        positions = calc.MODELS[self.model].max_positions
        if self.max_model_len > positions:
            raise ConfigError(f"max_model_len {self.max_model_len:,} exceeds {self.model}'s {positions:,} positions")
        if self.max_prompt() + self.output_tokens > self.max_model_len:
            raise ConfigError(f"the last turn ({self.max_prompt() + self.output_tokens:,} tokens) exceeds "
                              f"max_model_len {self.max_model_len:,}: raise --max-model-len (at most {positions:,} "
                              f"for {self.model}) or lower --turns, --first-turn-tokens, --later-turn-tokens or "
                              f"--output-tokens")
        if self.speculative_tokens < 0 or not 1.0 <= self.accept_length <= self.speculative_tokens + 1:
            raise ConfigError(f"accept_length (--accept-length) must lie in [1, speculative_tokens (--mtp) + 1 = "
                              f"{self.speculative_tokens + 1}], got {self.accept_length}")

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


def miss_rate(ratio: float, speculative_tokens: int = K.SPECULATIVE_TOKENS) -> float:
    """Fraction of selected rows an LRU hot buffer misses, ``ratio`` = buffer rows / rows one step resolves, from
    the selection model (:func:`hisparse.tools.locality.step_profile`) for ``speculative_tokens``."""
    return locality.step_profile(speculative_tokens).miss_rate(ratio)


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
            kv_gib = calc.calculate(model=cfg.model, gpu=cfg.gpu, tp=cfg.tp, kv_dtype=K.KV_DTYPE).kv_hbm_gib
        hbm_gib = calc.GPU_MEMORY_GB[cfg.gpu] * 1e9 / GIB
        if kv_gib > hbm_gib:
            raise ConfigError(f"{kv_gib:g} GiB of KV HBM per GPU exceeds the {hbm_gib:.1f} GiB of one "
                              f"{cfg.gpu.upper()}; use --kv-hbm-gib {hbm_gib:.1f} or less")
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
    step_rows = cfg.top_k * locality.step_profile(q).union
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


def _new_pages(block_tokens: int, computed: int, tokens: int) -> int:
    """Pages a step of ``tokens`` after ``computed`` adds to a request (its blocks vLLM allocates as it schedules)."""
    return -(-(computed + tokens) // block_tokens) - -(-computed // block_tokens)


def _pool_advice(cfg: SimConfig, blocks: int, gpu_block_bytes: int) -> str:
    """The flag value that gives a GPU pool of at least ``blocks`` blocks."""
    if cfg.num_gpu_blocks is not None:
        return f"num_gpu_blocks {blocks:,} or more"
    return f"--kv-hbm-gib {math.ceil(100 * blocks * gpu_block_bytes / GIB) / 100:g} or more"


class PoolTooSmall(ConfigError):
    """A GPU pool that can never run one step of the point's workload (a ``ConfigError``)."""


def _check_pool(cfg: SimConfig, gpu_blocks: int, gpu_block_bytes: int, kv_gib: float | None) -> None:
    """Refuses a GPU pool that can never run a step: a prefill chunk that fills the pool leaves no room to run
    until its pages' copies to the host start (in the next plan), and offload keeps a request whole on the GPU
    (core policy ``resident``). With less, a point would loop without progress."""
    tokens = min(cfg.max_batched_tokens, cfg.max_prompt())
    what = f"a prefill chunk of {tokens:,} tokens"
    if cfg.mode == "offload":
        tokens = cfg.max_prompt() + cfg.output_tokens
        what = f"offload keeps a request whole on the GPU: the last turn of {tokens:,} tokens"
    need = _blocks(cfg, tokens)
    if gpu_blocks < need:
        pool = f"the pool has {gpu_blocks:,}" if kv_gib is None else f"{kv_gib:g} GiB of KV HBM holds {gpu_blocks:,}"
        raise PoolTooSmall(f"{what} needs {need - 1:,} GPU blocks of {gpu_block_bytes:,} B besides the null block, "
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


class _NotWholeSequence(CapacityError):
    """vLLM's scheduler holds the next request back: the blocks of its whole sequence are not free."""


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


class _WorkerTables:
    """What a worker keeps that a heat summary reads (``seq_lens``, ``releasable``, ``row_request``, ``heat``,
    as ``hisparse.datapath`` lays them out) plus which pages are host-only, kept from the plans' table updates;
    the summary itself is the core's (``_ref_heat_summary``: rank, then halve every count)."""

    def __init__(self, rows: int, pages: int, block_size: int):
        import numpy as np

        self.np = np
        self.pages = pages
        self.block_size = block_size
        self.seq_lens = np.zeros(rows, dtype=np.int32)
        self.row_request = np.full(rows, -1, dtype=np.int64)
        self.releasable = np.zeros((rows, pages), dtype=np.uint8)
        self.heat = np.zeros((rows, pages), dtype=np.int32)
        self.host_only = np.zeros((rows, pages), dtype=bool)
        self.dirty: set[int] = set()  # rows whose host-only pages changed since the caller last looked
        self.hot_held = np.zeros(rows, dtype=bool)  # rows the core leased a hot region (the plans' hot updates)
        self.hot_changed = False  # a region was leased or returned since the caller last looked

    #: Words per entry of each section of an encoded plan (``StepPlan.to_bytes``; ``hisparse.datapath``'s
    #: ``_PlanSections`` reads the same layout): cleared rows, lengths, table updates, hot updates (2 + width),
    #: restores, copies, scheduled, transitions; after 14 header words, then the u64 sections.
    SECTIONS = ("cleared", "seq_lens", "table", "hot", "restores", "materialize", "scheduled", "transitions")

    def apply(self, plan: Any) -> None:
        np = self.np
        raw = plan.to_bytes()
        words = np.frombuffer(raw, dtype=np.int32, count=len(raw) // 4)
        hot_width = int(words[5])
        widths = (1, 3, 5, 2 + hot_width, 2, 2, 3, 2)
        at = 14
        spans = {}
        for name, n, w in zip(self.SECTIONS, words[6:14].tolist(), widths, strict=True):
            spans[name] = words[at:at + n * w].reshape(n, w)
            at += n * w
        at += at % 2
        n_copies = len(spans["materialize"])
        longs = np.frombuffer(raw, dtype=np.int64, offset=4 * at) if len(raw) > 4 * at else np.zeros(0, np.int64)
        cleared = spans["cleared"][:, 0]
        hot = spans["hot"]
        if len(hot):
            self.hot_held[hot[:, 0]] = hot[:, 1] > 0  # (row, blocks, block ids...): no blocks, no region
            self.hot_changed = True
        if len(cleared):
            self.seq_lens[cleared] = 0
            self.row_request[cleared] = -1
            self.releasable[cleared] = 0
            self.heat[cleared] = 0
            self.host_only[cleared] = False
            self.dirty.update(cleared.tolist())
        lens = spans["seq_lens"]
        if len(lens):
            self.seq_lens[lens[:, 0]] = lens[:, 1]
            self.row_request[lens[:, 0]] = longs[n_copies:n_copies + len(lens)]
        table = spans["table"]
        if len(table):
            rows, pages = table[:, 0], table[:, 1]
            self.releasable[rows, pages] = table[:, 4]
            host_only = (table[:, 2] == 0) & (table[:, 3] >= 0)
            changed = self.host_only[rows, pages] != host_only
            if changed.any():
                self.host_only[rows, pages] = host_only
                self.dirty.update(set(rows[changed].tolist()))

    def summary(self, coldest: int, hottest: int) -> bytes:
        bufs = [(a.ctypes.data, a.size) for a in (self.seq_lens, self.releasable, self.row_request, self.heat)]
        return _core._ref_heat_summary(bufs, self.pages, self.block_size, coldest, hottest)


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
            admission_pages=self._admission_pages(),
        )
        # Common random numbers: every mode and policy at one (seed, concurrency) draws from the same stream, so
        # a difference between them is theirs, not the dice's (MTP acceptances, misses, the page heat's seed).
        key = f"{cfg.seed}/{cfg.concurrency}"
        self.rng = random.Random(key)
        heat_seed = self.rng.randrange(2**32)  # drawn in every mode: the streams stay aligned
        self.progress = progress
        # Per-step (time, running, waiting, prefilling, gpu_free, mixed + none, preempted) when a list is set.
        self.trace: list[tuple[float, int, int, int, int, int, int]] | None = None
        # MTP: per-draft acceptance p with 1 + p + ... + p^q = accept_length
        self.accept_p = _chain_probability(cfg.accept_length, cfg.speculative_tokens)
        self.profile = locality.step_profile(cfg.speculative_tokens)
        self.m1 = 1.0 - self.profile.overlap  # new rows each further position brings
        # Per-page selection (hisparse mode): the worker's tables and the model's page heat, whose summaries
        # reach the core every HEAT_INTERVAL steps, so the coldest policy ranks pages by what the model selects.
        self.tables: _WorkerTables | None = None
        self.page_heat: locality.PageHeat | None = None
        if cfg.mode == "hisparse":
            self.tables = _WorkerTables(cfg.max_num_seqs, -(-cfg.max_model_len // cfg.block_tokens), cfg.block_tokens)
            lp = locality.Params(top_k=cfg.top_k, sink_tokens=max(1, K.TOP_K_SINKS * cfg.top_k // K.TOP_K),
                                 window_tokens=max(1, locality.WINDOW_TOKENS * cfg.top_k // K.TOP_K))
            self.page_heat = locality.PageHeat(lp, cfg.index_groups, cfg.block_tokens, seed=heat_seed)
        self.rows: dict[int, int] = {}  # running request -> its state row
        # request -> (pages, host share, hot rows, miss rate at them)
        self.shares: dict[int, tuple[int, float, float, float]] = {}
        # Adaptive hot buffers: each region holder's rows, and what it selected on host-only pages (rows, steps)
        # since the last heat interval; its measured rows per step of the interval before.
        self.adaptive = cfg.mode == "hisparse" and cfg.hot_buffers == "adaptive"
        self.hot_alloc: dict[int, float] = {}
        self.selected: dict[int, list[float]] = {}
        self.demand: dict[int, float] = {}

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
        if isinstance(refused, _NotWholeSequence) and not short:
            whole = _blocks(cfg, cfg.max_prompt() + cfg.output_tokens)
            return (f"{where}: {refused}; with nothing running nothing will free them: use "
                    f"{_pool_advice(cfg, whole, d.gpu_block_bytes)} (the longest request whole, {whole - 1:,} blocks "
                    f"besides the null block)")
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

    def _sample_breakdown(self, acc: dict[str, float], span: float, running: list[_Req], stats: dict[str, int],
                          waiting: int, refused: bool, gated: bool, now: float) -> None:
        """Adds one step's GPU blocks by use, and what held admission, weighted by the step's duration."""
        if span <= 0:
            return
        m, d = self.manager, self.d
        parts = dict.fromkeys(BREAKDOWN_KEYS, 0)
        restoring = 0
        for r in running:
            info = m.request_info(r.rid)
            if r.ready_t > now:
                restoring += 1
            on_gpu = int(info["num_pages"]) - int(info["host_only_pages"]) - int(info["released_pages"])
            if r.in_prefill:
                parts["prefill_pages"] += on_gpu
            elif info["residency"] == "full":
                parts["resident_full"] += on_gpu
            else:
                parts["resident_tails"] += on_gpu
            hot = int(info["hot_blocks"])
            if hot:
                rows_part = min(hot, -(-d.hot_rows * d.mla_row_all_layers // d.gpu_block_bytes))
                parts["hot_rows"] += rows_part
                parts["indexer_keys"] += hot - rows_part
        parts["released_readable"] = stats["gpu_released"]
        parts["free"] = stats["gpu_free"] - stats["gpu_released"]
        parts["other"] = stats["gpu_used"] - sum(parts[k] for k in ("prefill_pages", "resident_full", "resident_tails",
                                                                     "hot_rows", "indexer_keys"))
        acc["_time"] += span
        for k, v in parts.items():
            acc[k] += v * span
        acc["waiting"] += waiting * span
        acc["restoring"] += restoring * span
        acc["refused_by_core"] += (span if refused else 0.0)
        acc["held_after_preemption"] += (span if gated and waiting else 0.0)

    def _report_heat(self) -> None:
        """One heat interval: the model's selections of every running request added to the worker's heat table,
        then the core's summary of it (which halves the counts) reported through ``apply_results``."""
        tables, heat, cfg = self.tables, self.page_heat, self.cfg
        assert tables is not None and heat is not None
        positions = K.HEAT_INTERVAL * (cfg.speculative_tokens + 1)
        for rid, row in self.rows.items():
            pages = -(-int(tables.seq_lens[row]) // cfg.block_tokens)
            if pages <= 0:
                continue
            counts = heat.interval(rid, pages, positions)
            tables.heat[row, :pages] += counts.astype(tables.np.int32)
            self.shares.pop(rid, None)
        self.manager.apply_results(heat=tables.summary(K.HEAT_COLDEST, K.HEAT_HOTTEST))
        if self.adaptive:
            for rid, (rows, n) in self.selected.items():
                if n:
                    self.demand[rid] = rows / n
            self.selected.clear()
            self._rebalance()

    def _rebalance(self) -> None:
        """Adaptive hot buffers: the rows of every hot region the core has leased (``hot_rows`` each; the GPU
        blocks stay the core's) are shared among their requests in proportion to the rows each selected on its
        host-only pages per decode step over the last heat interval in which it decoded, each within [one step's
        selected rows, 32,768]. The model's miss rate is a function of hot rows / selected rows alone, so equal
        ratios equalize every request's marginal gain from a row: for a fixed total, the fewest misses. A request
        not measured yet counts as the holders' mean. Prefill steps are not counted: as steps that select nothing
        there, they would starve a request for the interval after its prefill, when it decodes."""
        tables, d = self.tables, self.d
        assert tables is not None
        tables.hot_changed = False
        holders = [rid for rid, row in self.rows.items() if tables.hot_held[row]]
        self.hot_alloc = {}
        if not holders:
            return
        measured = [self.demand[r] for r in holders if r in self.demand]
        mean = statistics.fmean(measured) if measured else d.step_rows
        demand = [self.demand.get(r, mean) for r in holders]
        hi = float(max(d.hot_rows, K.HOT_ROWS_LIMIT))
        lo = min(float(d.hot_rows), max(float(self.cfg.top_k), d.step_rows))
        for rid, rows in zip(holders, share_rows(len(holders) * d.hot_rows, demand, lo, hi), strict=True):
            self.hot_alloc[rid] = rows

    def _admission_pages(self) -> int:
        """The resident pages admission reserves for a request: vLLM's HiSparse caps them at one admission
        window of ``max_num_batched_tokens`` (``HiSparseResidentSpec.max_admission_blocks_per_request``); plain
        residency has no window. A hisparse request that never fills it comes back from the host restored whole
        (the core's ``Config::returns_resident``)."""
        cfg = self.cfg
        return -(-cfg.max_batched_tokens // cfg.block_tokens) if cfg.mode == "hisparse" else 0

    def _isl_blocks(self, r: _Req) -> int:
        """GPU blocks vLLM 0.33's scheduler wants free before it admits ``r``: its whole sequence so far
        (``SchedulerConfig.scheduler_reserve_full_isl``, default True: ``KVCacheManager.allocate_slots`` with
        ``full_sequence_must_fit``; prefix-cache hits still in the free queue count as blocks to take), which vLLM's
        HiSparse caps at one admission window of ``max_num_batched_tokens`` (``HiSparseResidentSpec.
        max_admission_blocks_per_request``)."""
        cfg = self.cfg
        tokens = r.prompt + r.generated
        if cfg.mode == "hisparse":
            tokens = min(tokens, cfg.max_batched_tokens)
        return -(-tokens // cfg.block_tokens)

    def _host_share(self, rid: int, info: dict[str, Any]) -> tuple[float, float]:
        """Share of a request's selected rows on its host-only pages, from the model's page heat, and the miss
        rate of its hot buffer over the rows a decode step then selects there (cached until its pages, its
        host-only set or its heat change)."""
        tables, heat = self.tables, self.page_heat
        row = info["row"]
        pages = info["num_pages"]
        if tables is not None and row in tables.dirty:
            tables.dirty.discard(row)
            self.shares.pop(rid, None)
        cached = self.shares.get(rid)
        hot = self.hot_alloc.get(rid, self.d.hot_rows) if self.adaptive else self.d.hot_rows
        # A few new pages (one every ~18 decode steps) move the share little: recompute every SHARE_PAGES.
        if cached is not None and 0 <= pages - cached[0] < SHARE_PAGES:
            if cached[2] == hot:
                return cached[1], cached[3]
            share = cached[1]
        elif tables is None or heat is None or row is None:
            share = min(1.0, info["host_only_pages"] * self.cfg.block_tokens / max(1, info["seq_len"]))
        else:
            share = heat.host_share(rid, tables.host_only[row, :pages])
        top_k = self.cfg.top_k
        miss = locality.context_miss_rate(self.cfg.speculative_tokens, hot / top_k, share, info["seq_len"] / top_k)
        self.shares[rid] = (pages, share, hot, miss)
        return share, miss

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
        # Users' first requests: all at t = 0, or spread evenly over arrival_spread_s.
        arrivals: deque[tuple[float, int]] = deque(
            (user * cfg.arrival_spread_s / cfg.concurrency, user) for user in range(cfg.concurrency))
        copies: deque[tuple[float, list[int]]] = deque()
        d2h_free = 0.0
        d2h_bytes = 0.0

        def start_copies(ids: list[int], start: float) -> None:
            """Copies to the host a plan started, in order on the link from ``start``."""
            nonlocal d2h_free, d2h_bytes
            if ids:
                nbytes = len(ids) * d.host_page_bytes
                d2h_bytes += nbytes
                d2h_free = max(start, d2h_free) + nbytes / cfg.d2h_bytes_per_s
                copies.append((d2h_free, ids))

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
        hits = misses = 0
        hot_area = hot_weight = 0.0  # hot rows of the buffers decode steps read, weighted by their selected rows
        share_bins = [0] * (SHARE_BINS + 1)  # decode steps over host-only history by the share f they select there
        max_running = 0
        mixed_area = 0.0
        breakdown: dict[str, float] = dict.fromkeys(("_time", *BREAKDOWN_KEYS, *LIMIT_KEYS), 0.0)
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
        # Admissions since the last plan: request -> (restored pages, restore bytes, indexer bytes, link start, link
        # end). The core queues an admission's restores for the next plan; one preempted before that plan drops
        # them (and is refunded), the rest are the admissions' part of the plan's restores, not relief.
        admitted: dict[int, tuple[int, float, float, float, float]] = {}

        while True:
            if arrivals_open and (now >= cfg.duration_s or (cfg.max_steps is not None and steps >= cfg.max_steps)):
                if not cfg.drain:
                    break
                arrivals_open = False
            while arrivals and arrivals[0][0] <= now and arrivals_open:
                t_arrive, user = arrivals.popleft()
                waiting.append(self._new_request(user, next_conv, 0, t_arrive))
                next_conv += 1
                idle = 0
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
            # Then waiting requests, while the budget lasts and the core admits them. vLLM allocates each
            # scheduled request's new blocks as it goes: what the step takes is not free for the next admission.
            refused_now = False
            claimed = sum(_new_pages(bt, r.computed, n) for r, n in sched)
            while waiting and budget > 0 and not gated and len(running) < cfg.max_num_seqs:
                r = waiting[0]
                isl_need, isl_free = self._isl_blocks(r), m.stats()["gpu_free"] - claimed
                if isl_need > isl_free:
                    refused_now = True
                    if not running:
                        refused = _NotWholeSequence(
                            f"vLLM admits a request only when the GPU blocks of its whole sequence are free "
                            f"(scheduler_reserve_full_isl): the next one needs {isl_need:,} and {isl_free:,} are free")
                    break
                try:
                    if r.preempted:
                        a = m.resume(r.rid)
                    else:
                        a = m.admit(r.rid, r.prompt, self._hashes(r.conv, r.prompt + r.out), r.prompt + r.out)
                except CapacityError as exc:
                    refused = exc
                    refused_now = True
                    break
                waiting.popleft()
                running.append(r)
                self.rows[r.rid] = a.row
                self.shares.pop(r.rid, None)
                r.computed = a.cached_tokens
                r.target = r.prompt + r.generated
                r.in_prefill = True
                r.ran = False
                # Restores (the tail, or every page: the baseline, a request that never fills its admission
                # window) and the indexer keys of every page not on the GPU (hisparse's host pages hold the MLA
                # rows: those of its host-only history and of its restored pages) travel on the host link before
                # the request can run (vLLM: WAITING_FOR_REMOTE_KVS, not running).
                rbytes = a.restored_pages * d.host_page_bytes
                pages_in = m.request_info(r.rid)["host_only_pages"] + a.restored_pages
                ibytes = pages_in * d.indexer_page_bytes if tiers else 0
                h2d["restore"] += rbytes
                h2d["indexer"] += ibytes
                nbytes = rbytes + ibytes
                link_start = h2d_free
                if nbytes > 0:
                    h2d_free = max(now, h2d_free) + nbytes / cfg.h2d_bytes_per_s
                    r.ready_t = h2d_free
                else:
                    r.ready_t = now
                admitted[r.rid] = (a.restored_pages, rbytes, ibytes, link_start, h2d_free)
                if r.ready_t <= now:
                    chunk = min(r.target - r.computed, budget)
                    if chunk > 0:
                        sched.append((r, chunk))
                        budget -= chunk
                        claimed += _new_pages(bt, r.computed, chunk)
            if not sched:
                # Nothing can run now: jump to the next event.
                pending = [r.ready_t for r in running if r.ready_t > now]
                if copies:
                    pending.append(copies[0][0])
                if arrivals and arrivals_open:
                    pending.append(arrivals[0][0])
                if pending:
                    now = min(pending)
                gated = False
                continue
            if cfg.check_every and steps % cfg.check_every == 0:
                m.check_invariants()
            plan = m.plan_step([(r.rid, n) for r, n in sched])
            while not plan.ok:
                short = plan.missing_blocks
                lone, chunk = sched[0]
                if len(sched) == 1 and running[-1] is lone and lone.in_prefill and chunk > bt:
                    # Preempting the step's only request would leave nothing to run (module docstring).
                    sched = [(lone, max(bt, chunk // 2))]
                    plan = m.plan_step([(lone.rid, sched[0][1])])
                    continue
                if len(running) == 1 and lone.in_prefill:
                    # Alone, its last chunk filled the pool: a plan that schedules nothing starts that chunk's
                    # copies to the host, and the request waits for them rather than throwing the chunk away.
                    empty = m.plan_step([])
                    if self.tables is not None:
                        self.tables.apply(empty)
                    start_copies(empty.transfer_ids, now)
                    if copies:
                        now = max(now, copies[0][0])
                        break
                # vLLM: preempt the newest running request until the step fits; one admitted this step that
                # never ran is just put back.
                victim = running.pop()
                kept = m.preempt(victim.rid)
                self.rows.pop(victim.rid, None)
                victim.computed = kept
                victim.target = victim.prompt + victim.generated
                victim.in_prefill = True
                victim.preempted = True
                waiting.appendleft(victim)
                undone = admitted.pop(victim.rid, None)
                if undone is not None:
                    # Admitted since the last plan: its restores never happen, nor its loads.
                    _, rbytes, ibytes, link_start, link_end = undone
                    h2d["restore"] -= rbytes
                    h2d["indexer"] -= ibytes
                    if h2d_free == link_end:
                        h2d_free = link_start
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
            if self.tables is not None:
                self.tables.apply(plan)
                if steps % K.HEAT_INTERVAL == 0:
                    self._report_heat()
                elif self.adaptive and self.tables.hot_changed:
                    self._rebalance()
            stats = m.stats()
            start_copies(plan.transfer_ids, start)  # they overlap the forward
            # Restores planned inside the step (relief to full residency) land before the forward.
            relief = stats["total_restored"] - restored_before - sum(x[0] for x in admitted.values())
            restored_before = stats["total_restored"]
            admitted.clear()
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
                if self.adaptive and not r.in_prefill:
                    sel = self.selected.setdefault(r.rid, [0.0, 0])
                    sel[1] += 1
                if not tiered:
                    continue
                info = m.request_info(r.rid)
                host_only = info["host_only_pages"]
                if host_only == 0:
                    continue
                host_tokens = host_only * bt
                f, miss = self._host_share(r.rid, info)
                if r.in_prefill:
                    rows = min(float(host_tokens), cfg.top_k * (1 + (n - 1) * self.m1) * f)
                    missed = int(rows)
                else:
                    rows = d.step_rows * f
                    missed = self._binomial(rows, miss)
                    hits += int(round(rows)) - missed
                    misses += missed
                    hot_area += rows * (self.hot_alloc.get(r.rid, d.hot_rows) if self.adaptive else d.hot_rows)
                    share_bins[int(f * SHARE_BINS)] += 1
                    hot_weight += rows
                    if self.adaptive:
                        self.selected[r.rid][0] += rows
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
                if steps % BREAKDOWN_EVERY == 0:
                    self._sample_breakdown(breakdown, span, running, stats, len(waiting), refused_now, gated, start)
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
                self.rows.pop(r.rid, None)
                self.shares.pop(r.rid, None)
                self.selected.pop(r.rid, None)
                self.demand.pop(r.rid, None)
                if self.page_heat is not None:
                    self.page_heat.forget(r.rid)
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
            "hot_buffers": cfg.hot_buffers if tiers else None,
            "concurrency": cfg.concurrency,
            # A request that never finished may have "run" for the whole point (restoring, or prefilling a
            # prompt the node cannot serve): with nothing finished no running count reads as success.
            "mean_running": (running_area / busy_time if busy_time > 0 else 0.0) if finished else None,
            "output_tok_s": out_tokens / horizon if horizon > 0 else 0.0,
            "ttft_s_p50": statistics.median(ttfts) if ttfts else None,
            "itl_ms_p50": statistics.median(itls) * 1e3 if itls else None,
            "preemptions": preemptions,
            "h2d_gb": total_h2d / 1e9,
            "hit_rate": (hits / (hits + misses) if hits + misses > 0 else None) if tiers else None,
            "max_running": max_running,
            "mean_mixed": mixed_area / busy_time if busy_time > 0 else 0.0,
            "h2d_bytes_per_token": total_h2d / out_tokens if out_tokens else None,
            "gpu_blocks_breakdown": _breakdown(breakdown, BREAKDOWN_KEYS),
            "admission": _breakdown(breakdown, LIMIT_KEYS),
            "unadmissions": unadmissions,
            "requests_arrived": self.arrived,
            "requests_finished": finished,
            "conversations_finished": conversations,
            "steps": steps,
            "sim_s": now,
            "h2d_gb_by_kind": {k: v / 1e9 for k, v in h2d.items()},
            "d2h_gb": d2h_bytes / 1e9,
            "hot_rows": d.hot_rows,
            # the rows of the hot buffers decode steps read (weighted by their rows on host-only pages)
            "hot_rows_read": hot_area / hot_weight if hot_weight > 0 else None,
            # the share of a decode step's selected rows on the request's host-only pages, over the decode steps
            # of requests with host-only pages: how alike the tiered requests' needs are (quantiles, +-0.01)
            "host_share": _quantiles(share_bins, (0.05, 0.5, 0.95)),
            "gpu_blocks": d.num_gpu_blocks,
            "steady_state_concurrency": final["steady_state_concurrency"],
            "final": {k: final[k] for k in ("gpu_used", "host_referenced", "host_cached", "running",
                                            "preempted", "pending_transfers")},
            "series": (series_t, series_n),
        }


#: A request's share of selections on host-only pages is recomputed when it has grown by this many pages (and
#: whenever its host-only pages or its heat change).
SHARE_PAGES = 4
#: Every this many steps the simulation samples what the GPU blocks hold and what holds admission back.
BREAKDOWN_EVERY = 8
#: GPU blocks by use (time-weighted means): pages of requests still prefilling; pages of decoding requests in full
#: residency; pages on the GPU of decoding requests in mixed/none residency (their tails and what is left);
#: hot regions, split into the hot rows and the indexer keys of host-only history charged with them; released
#: pages still readable (counted free); free; the rest (blocks pinned by copies in flight, shared prefixes).
BREAKDOWN_KEYS = ("prefill_pages", "resident_full", "resident_tails", "hot_rows", "indexer_keys",
                  "released_readable", "free", "other")
#: Admission (time-weighted): requests waiting; admitted requests waiting for their restores; the share of time
#: the core refused the next waiting request; the share of time admission was held after a preemption.
LIMIT_KEYS = ("waiting", "restoring", "refused_by_core", "held_after_preemption")


def share_rows(total: float, demand: Sequence[float], lo: float, hi: float) -> list[float]:
    """``total`` rows shared in proportion to ``demand``, each share within [lo, hi]: ``clamp(x * demand, lo,
    hi)`` with the scale ``x`` that spends the total (bisection; a share held at a bound leaves the rest to the
    others). ``len(demand) x lo <= total`` keeps every share >= lo; no demand at all shares evenly; rows that no
    share can take (every one at hi) stay unspent."""
    n = len(demand)
    if n == 0:
        return []
    if not any(x > 0 for x in demand):
        return [min(hi, max(lo, total / n))] * n

    def spend(x: float) -> list[float]:
        return [min(hi, max(lo, x * d)) for d in demand]

    low, high = 0.0, 1.0
    while sum(spend(high)) < total and high < 1e300:
        if all(s >= hi for s, d in zip(spend(high), demand, strict=True) if d > 0):
            return spend(high)
        high *= 2.0
    for _ in range(100):
        mid = (low + high) / 2
        if sum(spend(mid)) <= total:
            low = mid
        else:
            high = mid
    return spend(low)


#: Bins of the host share histogram (``host_share`` in a point).
SHARE_BINS = 100


def _quantiles(bins: Sequence[int], qs: Sequence[float]) -> dict[str, float] | None:
    """Quantiles of a histogram of ``len(bins) - 1`` equal bins over [0, 1] (the last holds 1.0), each the
    middle of its bin."""
    total = sum(bins)
    if total == 0:
        return None
    out = {}
    width = 1.0 / (len(bins) - 1)
    for q in qs:
        seen = 0
        for i, n in enumerate(bins):
            seen += n
            if seen >= q * total:
                out[f"p{round(q * 100)}"] = round(min(1.0, (i + 0.5) * width), 3)
                break
    return out


def _breakdown(acc: dict[str, float], keys: Sequence[str]) -> dict[str, float] | None:
    t = acc["_time"]
    if t <= 0:
        return None
    return {k: round(acc[k] / t, 3) for k in keys}


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


def failed_point(cfg: SimConfig, why: str) -> dict[str, Any]:
    """A point that could not run (its pool holds no step, or it stopped making progress): no metric, the cause."""
    return {"mode": cfg.mode, "policy": cfg.core_policy, "concurrency": cfg.concurrency, "error": why,
            "hot_buffers": cfg.hot_buffers if cfg.mode == "hisparse" else None,
            "mean_running": None, "output_tok_s": None, "ttft_s_p50": None, "itl_ms_p50": None, "preemptions": None,
            "h2d_gb": None, "hit_rate": None, "requests_finished": 0, "series": ([], [])}


def run_points(configs: Sequence[SimConfig], progress: bool = False,
               refused: dict[int, str] | None = None, keep_going: bool = False) -> list[dict[str, Any]]:
    """Runs the points in order. ``refused``: points known not to run (index -> why), reported as such;
    ``keep_going``: a point that stops making progress is reported as failed and the others still run."""
    points = []
    bar = console.Progress(progress)
    bar.start("simulate")
    n = len(configs)
    refused = refused or {}
    for i, cfg in enumerate(configs):
        if i in refused:
            points.append(failed_point(cfg, refused[i]))
            continue
        label = f"{i + 1}/{n} {point_label(cfg.mode, cfg.core_policy, cfg.hot_buffers)} c={cfg.concurrency}"

        def tick(fraction: float, i: int = i, label: str = label) -> None:
            bar.update((i + fraction) / n, f"{label:<28} {fraction:4.0%}")

        try:
            points.append(Simulation(cfg, progress=tick if progress else None).run())
        except CapacityError as exc:
            if not keep_going:
                raise
            points.append(failed_point(cfg, str(exc)))
    bar.close()
    return points


def model_fields(model: str) -> dict[str, int]:
    """The :class:`SimConfig` fields a model preset of ``hisparse calc`` sets: sparse-MLA and indexer layers, one
    top-K per indexer (IndexShare followers reuse their leader's), top_k. The row sizes stay vLLM's fp8_ds_mla
    (656 B) and indexer (132 B) rows; step time and prefill FLOPs stay GLM-5 measurements."""
    preset = calc.MODELS[model]
    return {"mla_layers": preset.layers, "indexer_layers": preset.indexers, "index_groups": preset.indexers,
            "top_k": preset.top_k}


def accept_length(given: float | None, mtp: int) -> float:
    """The tokens a decode step emits: ``given`` as it is (``SimConfig.validate`` refuses one outside [1, mtp + 1]),
    or by default the measured MTP3 figure, within what ``mtp`` drafts can emit."""
    return given if given is not None else min(K.MTP_ACCEPT_LENGTH, mtp + 1.0)


def build_configs(args: argparse.Namespace) -> list[SimConfig]:
    if args.mode == "offload" and (args.hot_rows is not None or args.adaptive_hot_rows or args.hot_buffers != "fixed"):
        raise ConfigError("--hot-rows, --adaptive-hot-rows and --hot-buffers size hisparse's hot buffers, and "
                          "--mode offload has none: use --mode hisparse or both")
    modes = MODES if args.mode == "both" else (args.mode,)
    policies = TIER_POLICIES if args.policy == "both" else (args.policy,)
    buffers = HOT_BUFFERS if args.hot_buffers == "both" else (args.hot_buffers,)
    configs = []
    for mode in modes:
        variants = [("resident", "fixed")] if mode == "offload" else [(p, b) for b in buffers for p in policies]
        for policy, hot_buffers in variants:
            for c in args.concurrency:
                configs.append(SimConfig(
                    mode=mode, policy=policy, hot_buffers=hot_buffers, concurrency=c, duration_s=args.duration,
                    max_steps=args.steps,
                    seed=args.seed, kv_hbm_gib=args.kv_hbm_gib, hot_rows=args.hot_rows,
                    adaptive_hot_rows=args.adaptive_hot_rows, speculative_tokens=args.mtp,
                    accept_length=accept_length(args.accept_length, args.mtp),
                    turns=args.turns, first_turn_tokens=args.first_turn_tokens,
                    later_turn_tokens=args.later_turn_tokens, output_tokens=args.output_tokens,
                    max_model_len=args.max_model_len, model=args.model, gpu=args.gpu,
                    arrival_spread_s=args.arrival_spread, **model_fields(args.model),
                ))
    return configs


def describe(cfg: SimConfig) -> dict[str, Any]:
    d = derive(cfg)
    return {
        "model": cfg.model, "gpu": cfg.gpu, "tp": cfg.tp, "kv_hbm_gib": d.kv_hbm_gib,
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
    """What a mode's points share. The hot rows do not when ``--adaptive-hot-rows`` sizes them per concurrency:
    None then (each point's ``hot_rows`` says)."""
    d = derive(cfg)
    shared = not cfg.adaptive_hot_rows
    return {"host_gib": d.host_gib, "host_blocks": d.num_host_blocks, "host_page_bytes": d.host_page_bytes,
            "hot_rows": d.hot_rows if shared else None,
            "core_hot_blocks": d.core_hot_rows // cfg.block_tokens if shared else None,
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
        hot = ""
        if mode.startswith("hisparse"):
            hot = (", hot rows sized per concurrency (--adaptive-hot-rows: each point's hot_rows in --json)"
                   if det["hot_rows"] is None else
                   f", hot rows {det['hot_rows']:,} (core region {det['core_hot_blocks']} blocks incl. indexer "
                   f"keys of {det['indexer_charge_tokens']:,} tokens)")
        gib = f"{det['host_gib']:g} GiB" if det["host_gib"] is not None else "host pool"
        lines.append(f"  {mode}: {gib} = {det['host_blocks']:,} host blocks{hot}")
    head = ("mode", "policy", "c", "running", "max", "mixed", "out tok/s", "TTFT p50 s", "ITL p50 ms",
            "preempt", "H2D GB", "hit rate", "turns")
    rows = []
    notes = []
    for p in result["points"]:
        if p.get("error") or p["mean_running"] is None:
            notes.append(f"  {p['mode']}/{_variant(p)} c={p['concurrency']}: "
                         + (p.get("error") or "no request finished: no metric is shown"))
            rows.append((p["mode"], _variant(p), str(p["concurrency"]), *(["-"] * (len(head) - 4)),
                         str(p["requests_finished"])))
            continue
        rows.append((
            p["mode"], _variant(p), str(p["concurrency"]), f"{p['mean_running']:.1f}", str(p["max_running"]),
            f"{p['mean_mixed']:.1f}", f"{p['output_tok_s']:.0f}",
            "-" if p["ttft_s_p50"] is None else f"{p['ttft_s_p50']:.2f}",
            "-" if p["itl_ms_p50"] is None else f"{p['itl_ms_p50']:.1f}",
            str(p["preemptions"]), f"{p['h2d_gb']:.0f}",
            "-" if p["hit_rate"] is None else f"{p['hit_rate']:.1%}", str(p["requests_finished"]),
        ))
    lines.append(console.format_table(rows, head=head, align="ll" + "r" * (len(head) - 2), rule=True))
    lines.append("running = mean of non-zero samples of running requests (the blog's metric); mixed = of them "
                 "in mixed/none residency; published at c=32: offload 5-6, hisparse 19-25")
    if notes:
        lines.append("points without a result:")
        lines.extend(notes)
    comparison = result.get("policy_comparison")
    if comparison:
        lines.append("hisparse side by side: c, running / hit rate / host-link bytes per output token")
        for row in comparison:
            cells = []
            for pol in (k for k in row if k != "concurrency"):
                x = row[pol]
                hit = "-" if x["hit_rate"] is None else f"{x['hit_rate']:.1%}"
                bpt = "-" if x["h2d_mb_per_token"] is None else f"{x['h2d_mb_per_token']:.1f} MB"
                run = "-" if x["mean_running"] is None else f"{x['mean_running']:.1f}"
                cells.append(f"{pol} {run} / {hit} / {bpt}")
            lines.append(f"  c={row['concurrency']}: " + ";  ".join(cells))
    if wall_s is not None:
        lines.append(f"wall time {wall_s:.1f} s")
    return "\n".join(lines)


#: The published running requests at concurrency 32 (vLLM blog, GLM-5.3 on 8xH200), drawn on the plot.
PUBLISHED_BANDS = {32: (("offload", 5, 6), ("hisparse", 19, 25))}


def plot(points: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conc = sorted({p["concurrency"] for p in points})
    fig, axes = plt.subplots(len(conc), 1, figsize=(11, 2.4 * len(conc)), sharex=True, squeeze=False)
    colors = {"offload/resident": "tab:gray", "hisparse/fifo": "tab:blue", "hisparse/coldest": "tab:orange",
              "hisparse/fifo/adaptive": "tab:cyan", "hisparse/coldest/adaptive": "tab:red"}
    for ax, c in zip(axes[:, 0], conc, strict=True):
        for mode, lo, hi in PUBLISHED_BANDS.get(c, ()):
            ax.axhspan(lo, hi, color="tab:green" if mode == "hisparse" else "tab:red", alpha=0.12, lw=0,
                       label=f"published {mode} {lo}-{hi}")
        for p in points:
            if p["concurrency"] != c:
                continue
            ts, ns = p["series"]
            stride = max(1, len(ts) // 3000)
            key = point_label(p["mode"], p["policy"], p.get("hot_buffers"))
            mean = "no request finished" if p["mean_running"] is None else f"mean {p['mean_running']:.1f}"
            ax.step(ts[::stride], ns[::stride], where="post", lw=0.8, color=colors.get(key),
                    label=f"{key} ({mean})")
        ax.set_ylabel(f"running, c={c}")
        # Outside the axes, so that it never hides a curve.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle("Running requests over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


HELP = """Simulates one serving node step by step -- a vLLM-like scheduler around the real residency core -- for
a multi-turn workload, and reports running requests, tokens/s, latencies, host-link traffic and hot-buffer hit
rates for plain residency with CPU offload ("offload") and Hybrid HiSparse ("hisparse", policies coldest and fifo).
Defaults: the vLLM blog's GLM-5.3 benchmark on 8xH200 (13 turns, 74,160-token first turn, 753-token later turns,
220 output tokens, concurrency 1-32). python/hisparse/tools/simulate.py's docstring gives the model and its
sources (README: "Tools")."""


def add_parser(subparsers: Any) -> None:
    """Register ``simulate`` on an ``argparse`` subparsers object (``set_defaults(func=main)``)."""
    p = subparsers.add_parser("simulate", description=HELP, help="step-level serving simulation of one node")
    p.add_argument("--mode", choices=(*MODES, "both"), default="both")
    p.add_argument("--policy", choices=(*TIER_POLICIES, "both"), default="both",
                   help="hisparse pressure policy (offload always runs the core's 'resident')")
    p.add_argument("--concurrency", metavar="C[,C...]", type=positive_int_list, default=list(K.CONCURRENCY),
                   help="comma-separated conversations in flight (default 1,8,16,24,32)")
    p.add_argument("--duration", metavar="S", type=positive_float, default=1800.0,
                   help="simulated seconds per point (default 1800)")
    p.add_argument("--steps", metavar="N", type=positive_int, default=None, help="stop a point after this many steps")
    p.add_argument("--seed", metavar="N", type=seed, default=0)
    w = p.add_argument_group("workload")
    w.add_argument("--turns", metavar="N", type=int_range(1, 10_000), default=K.TURNS,
                   help="turns per conversation (default 13)")
    w.add_argument("--first-turn-tokens", metavar="N", type=int_range(1, U32_MAX), default=K.FIRST_TURN_TOKENS,
                   help="prompt of the first turn (default 74,160)")
    w.add_argument("--later-turn-tokens", metavar="N", type=int_range(0, U32_MAX), default=K.LATER_TURN_TOKENS,
                   help="new user tokens of each later turn, after the whole conversation (default 753)")
    w.add_argument("--output-tokens", metavar="N", type=int_range(1, U32_MAX), default=K.OUTPUT_TOKENS,
                   help="output tokens per turn (default 220)")
    w.add_argument("--max-model-len", metavar="N", type=int_range(1, U32_MAX), default=K.MAX_MODEL_LEN,
                   help="admission limit in tokens (default 142,000; at most the model's positions)")
    w.add_argument("--arrival-spread", type=nonnegative_float, default=K.ARRIVAL_SPREAD_S, metavar="S",
                   help=f"users' first requests spread evenly over S seconds (default {K.ARRIVAL_SPREAD_S:g}; 0: all "
                        "at t = 0)")
    dep = p.add_argument_group("deployment")
    dep.add_argument("--model", type=str.lower, choices=sorted(calc.MODELS), default=K.MODEL, metavar="NAME",
                     help=f"{', '.join(sorted(calc.MODELS))} (hisparse calc's presets; default {K.MODEL})")
    dep.add_argument("--gpu", type=str.lower, choices=sorted(calc.GPU_MEMORY_GB), default=K.GPU, metavar="NAME",
                     help=f"{', '.join(sorted(calc.GPU_MEMORY_GB))} (default {K.GPU}; the step time stays the H200 "
                          "measurement)")
    dep.add_argument("--kv-hbm-gib", metavar="GIB", type=positive_gib, default=None,
                     help="KV HBM per GPU, at most the GPU's memory (default: hisparse calc's, 17.8 GiB for GLM-5.3 "
                          "on 8xH200; vLLM's own profiling leaves ~26 GiB)")
    hot = dep.add_mutually_exclusive_group()
    hot.add_argument("--hot-rows", metavar="N", type=positive_int, default=None,
                     help="hot rows per request (default (MTP + 2) x top_k = 10,240)")
    hot.add_argument("--adaptive-hot-rows", action="store_true",
                     help="one hot-buffer size for every request: the largest that lets every request of the "
                          "concurrency run at steady state")
    dep.add_argument("--hot-buffers", choices=(*HOT_BUFFERS, "both"), default="fixed",
                     help="fixed (default): each request's hot buffer holds the hot rows; adaptive: the rows of the "
                          "hot regions the core leased are shared by what each request selects on its host-only "
                          "pages, every 32 steps; both: run each")
    dep.add_argument("--mtp", type=int_range(0, 7), default=K.SPECULATIVE_TOKENS, metavar="Q",
                     help="speculative (MTP) tokens per step (default 3; the step time stays the MTP3 measurement)")
    dep.add_argument("--accept-length", metavar="X", type=positive_float, default=None,
                     help="mean tokens per decode step, in [1, MTP + 1] (default 3.48, measured with MTP 3; "
                          "at most MTP + 1 with fewer drafts)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object: every point with its GPU block breakdown, and coldest vs fifo")
    p.add_argument("--plot", metavar="PNG", type=plot_path, default=None,
                   help="draw running requests over time per mode (.png, .pdf or .svg; the folder must exist)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress on stderr")
    p.set_defaults(func=main)


def _variant(p: dict[str, Any]) -> str:
    """A point's policy, with ``/adaptive`` for adaptive hot buffers."""
    return point_label(p["mode"], p["policy"], p.get("hot_buffers")).split("/", 1)[1]


def point_label(mode: str, policy: str, hot_buffers: str | None) -> str:
    """``mode/policy``, with ``/adaptive`` for adaptive hot buffers."""
    label = f"{mode}/{policy}"
    return f"{label}/adaptive" if mode == "hisparse" and hot_buffers == "adaptive" else label


def policy_comparison(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hisparse variants side by side at each concurrency at least two of them ran: ``coldest`` and ``fifo``
    with fixed hot buffers, ``coldest/adaptive`` and ``fifo/adaptive`` with adaptive ones; running, hit rate,
    host-link bytes per token, tokens/s and the hot rows decode steps read."""
    by: dict[int, dict[str, dict[str, Any]]] = {}
    for p in points:
        if p["mode"] == "hisparse" and p["policy"] in TIER_POLICIES:
            label = point_label("hisparse", p["policy"], p.get("hot_buffers")).split("/", 1)[1]
            by.setdefault(p["concurrency"], {})[label] = p
    rows = []
    for c, pols in sorted(by.items()):
        if len(pols) < 2:
            continue
        row: dict[str, Any] = {"concurrency": c}
        for pol, p in pols.items():
            bpt = p.get("h2d_bytes_per_token")
            row[pol] = {"mean_running": p["mean_running"], "hit_rate": p["hit_rate"],
                        "h2d_mb_per_token": None if bpt is None else bpt / 1e6, "output_tok_s": p["output_tok_s"],
                        "hot_rows_read": p.get("hot_rows_read")}
        rows.append(row)
    return rows


def simulate(configs: Sequence[SimConfig], progress: bool = False, refused: dict[int, str] | None = None,
             keep_going: bool = False) -> dict[str, Any]:
    """Runs the points; returns the JSON-ready result (series left out) and the raw points. ``refused`` and
    ``keep_going``: see :func:`run_points`."""
    refused = refused or {}
    points = run_points(configs, progress=progress, refused=refused, keep_going=keep_going)
    modes: dict[str, Any] = {}
    for i, cfg in enumerate(configs):
        if i not in refused:
            modes.setdefault(point_label(cfg.mode, cfg.core_policy, cfg.hot_buffers), mode_details(cfg))
    first = next(cfg for i, cfg in enumerate(configs) if i not in refused)
    return {
        "config": describe(first),
        "modes": modes,
        "points": points,
        "policy_comparison": policy_comparison(points),
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
TABLE_PAGE_BYTES = 6  # hisparse mode: one page of the worker tables the heat model keeps (heat, releasable, host)


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
                     + running * max_pages * CORE_PAGE_BYTES
                     + (cfg.max_num_seqs * max_pages * TABLE_PAGE_BYTES if cfg.mode == "hisparse" else 0))
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
    for cfg in configs:
        cfg.validate()
    # A point whose GPU pool can never hold one step is refused before anything runs; under --mode both it is
    # reported as such (offload keeps a request whole, so a 1M-token context never fits it) and the rest runs.
    refused: dict[int, str] = {}
    for i, cfg in enumerate(configs):
        try:
            derive(cfg)
        except PoolTooSmall as exc:
            if args.mode != "both" or all(c.mode == cfg.mode for c in configs):
                raise
            refused[i] = str(exc)
    if len(refused) == len(configs):
        raise PoolTooSmall(next(iter(refused.values())))
    need, what = estimate_memory([c for i, c in enumerate(configs) if i not in refused])
    console.require_memory(need, what, "lower --concurrency, --duration or --steps")
    for i, cfg in enumerate(configs):
        if i not in refused:
            try:
                Simulation(cfg)
            except ConfigError as exc:  # the core's check names its own fields: say which flags set them
                raise ConfigError(f"{exc} (the GPU pool is --kv-hbm-gib's; the hot rows --hot-rows', or (--mtp + 2) "
                                  f"x top_k by default)") from None
    t0 = time.monotonic()
    result = simulate(configs, progress=args.progress, refused=refused, keep_going=args.mode == "both")
    wall = time.monotonic() - t0
    console.print_then_plot(json.dumps(to_json(result), indent=2) if args.json else format_table(result, wall_s=wall),
                            args.plot, lambda path: plot(result["points"], path), say_where=not args.json)
    return 0

