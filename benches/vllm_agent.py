"""The published GLM-5.3 agent workload (the vLLM blog's GLM-5.3 post, part 1), scaled down to a CPU run, on vLLM
0.33.0's real scheduler stack (``tests/vllm_harness.py``: vLLM's config, planner, ``AsyncScheduler``, KV cache
manager, ``MultiConnector`` and ``OffloadingConnector`` with ``TieringOffloadingSpec``; the forward and the
copy engines are the harness's CPU stand-ins, and every top-K row and indexer key read is checked against what
was written).

What runs, per concurrency ``c`` (default 1, 8, 16, 32) and mode:

- ``offload``: vLLM + OffloadingConnector alone (the published baseline: every layer's blocks offloaded);
- ``native``: vLLM's own HiSparseConnector + OffloadingConnector in a ``MultiConnector``;
- ``hisparse-coldest`` / ``hisparse-fifo``: hisparse's HiSparseConnector (``policy`` coldest / fifo) +
  OffloadingConnector in a ``MultiConnector`` (the published Hybrid HiSparse shape).

``c`` OpenHands-style conversations start at once; each has 13 turns (the first turn's prompt, then the previous
prompt + its answer + new tokens), the next turn sent when the answer ends (``H.conversation``, ``H.run(then=)``).
GLM-5.3's layout as vLLM's planner builds it (78 sparse-MLA layers, 21 indexer layers, 21 resident + 21 hot
groups), MTP 3 (the fake worker's drafts are accepted and rejected), async scheduling, prefix caching, ignore
EOS, ``max_num_seqs`` 256.

Scaling (``--scale S``, default 16): every length and every memory is the published one divided by ``S``:

    published                  at S = 16
    first turn      74,160     4,635 tokens
    later turns        753        47
    outputs            220        14
    turns               13        13 (``--turns``)
    max_model_len  142,000     8,875
    batched tokens  32,768     2,048 per step
    GPU KV          26 GiB     1.625 GiB (vLLM's real 656 / 132-byte rows: 53,940 B per token)
    HiSparse pool  384 GiB     24 GiB    (scheduler bookkeeping only on CPU: costs no RAM here)
    offload tier   128 GiB     8 GiB     beside HiSparse
    offload tier   512 GiB     32 GiB    baseline alone, capped at ``--tier-cap-gib`` (default 8; see below)
    index top-K      2,048     128       (``--topk``; the hot region is vLLM's default (1 + MTP + 1) x top-K)

Top-K is scaled with the lengths because a hot region is a multiple of top-K, not of the context: at the
published top-K a GLM-5.3 MTP-3 hot region is 160 blocks per group (~13K tokens' worth of KV), more than a
whole 1/16-scale conversation, so an unscaled top-K would measure a short-context workload, not this one (the
issue's "short end", where HiSparse loses). Scaled, the ratios that set capacity stay the published ones:
hot region / context (10,240 / ~86K rows then, 640 / ~5.4K now), top-K / context, indexer keys / context. The
fake selection (sink, local window, favourite pages) is scaled with top-K too (:class:`Worker`). Block size
stays 64 (vLLM's), so a later turn is under a block at S = 16 (a 1,024-token block at full scale).

The offloading tier is a real ``/dev/shm`` region that vLLM's scheduler side writes in full (RAM), so the
baseline's 32 GiB cannot be had on a small machine: ``--tier-cap-gib`` caps every tier (the line reports the
size used and the tier's peak use, which says whether the cap bound). The GPU KV binds the baseline; at c = 32
its conversations' whole KV is ~8.6 GiB at S = 16.

Reading the line (one JSON object on stdout): ``config`` (the scaled sizes), then ``results[c][mode]``:

- ``running``: mean of the non-zero samples of vLLM's running-requests gauge (``len(scheduler.running)`` after
  each ``schedule()``), the blog's metric; ``max_running``; ``running_while_waiting`` (mean while some request
  waits: what the pool keeps under pressure); ``gpu_free_while_waiting``: the mean fraction of vLLM's GPU
  blocks free (unpinned cached pages count as free, as vLLM counts them) while some request waits: near 0,
  memory binds; well above, an admission decision does;
- ``first_turns_started_step``: the step by which every client's first turn has started (the first turns'
  prefills take the token budget one after another, first come first served, and every second turn queues
  behind them: running counts stay low until then, whatever the memory), and ``running_after_first_turns``:
  ``running`` from then on;
- ``preemptions``, ``steps`` (engine steps to serve every turn), ``prefix_hit_tokens`` (tokens a turn did not
  recompute: GPU cache, HiSparse host pool, or tier);
- ``rows_checked`` (top-K rows, on layers 0, 21, 42 (a follower of 41), 77), ``indexer_rows_checked``,
  ``rows_from_host`` (rows read through a hot region from the host pool), ``rows_wrong`` (0: the harness
  stops at the first wrong row and the mode reports ``error`` instead);
- ``host_pool_peak_gib`` / ``host_pool_end_gib``: HiSparse host-pool blocks in use x host block bytes (none in
  ``offload``); ``tier_gib`` / ``tier_peak_gib``: the offloading tier's size and its peak chunks in use;
- ``kv_layout``: what vLLM's planner made of the GPU memory (:func:`kv_layout`): blocks, blocks per page,
  tokens it holds fully resident, a hot region's blocks;
- ``drafts_accepted`` / ``drafts_rejected``, ``wall_s`` (this mode's run, build included; the top level's
  ``wall_s`` is the whole sweep's);
- hisparse modes: ``counters``, the coordinator's admission and transition decisions;
- ``vllm_lock_left_held``: how many times vLLM logged "Offloading manager lock was left held by a previous
  schedule()" (a vLLM 0.33 wart, :class:`_LockLeftHeld`; counted, not printed).

The published targets, read at c = 32: ``hisparse-coldest`` running >= 3 x ``offload`` and >=
``native``, with fewer preemptions than ``native``. The blog's numbers: baseline 5-6, Hybrid HiSparse 19-25.
What does not scale: a decode step makes 1 + accepted drafts tokens (~2.5 with MTP 3) at any scale, while a
prefill chunk is scaled with the batched-token budget. So a turn's answer is ~6 decode steps at S = 16 against
~90 published, while a first turn's prefill stays ~2.3 steps: the first turns' prefill (c x 2.3 steps, the
token budget shared) is ~25% of a c = 32 run instead of ~6%, and the steps between a turn's end and the next
turn's first weigh ~15x more: ``H.run`` sends the next turn once vLLM has let go of the last one, which with
an offloading connector is when its stores have completed (``delay_free_blocks``; the stand-in copy engine
completes jobs 1-3 steps late), where a real client sends it as soon as the answer ends. ``running``
therefore reads lower than the published run would at the same memory, in every mode; ``--output-tokens``
keeps answers longer (at the cost of their ratio to the context) to see how much.

``--workload short``: the short end instead (issue 19's outside run, unscaled): 10 conversations of 3 turns
of 2-4K tokens (a 2,000-token first turn, 900 new tokens and a 100-token answer a turn), GLM-5.3's layout with
the published top-K (2,048: a 160-block hot region per group, 3,360 blocks in all), MTP 3, async, 1 GiB of
KV, 1 GiB offloading tiers; rows checked on layers 0 and 42 (a leader and a follower: the prefills are most of
the reads here). The same line, ``config["workload"]`` saying which.

``--workload mixed``: the published shape at the same scale with every other client a chat user instead of
an agent (issue 19's "mixed" workloads): the short end's conversations (2,000 tokens, 900 more and a
100-token answer a turn, 3 turns), scaled like the rest, one after another, a new conversation with no
prefix in common once the last one ends, as many turns in all as an agent's conversation has (13: five short
conversations, the last cut to one turn). ``config["short"]`` gives their scaled shape. Default c = 32.

    .venv/bin/python benches/vllm_agent.py [--workload published|short|mixed] [--concurrency 1 8 16 32]
        [--modes offload native hisparse-coldest hisparse-fifo] [--scale 16] [--turns 13] [--topk N]
        [--tier-cap-gib 8] [--output-tokens N] [--sync-loads] [--quick]

``--quick``: a smoke run, well under a minute (c = 2, 3 turns, S = 32, tiers capped at 1 GiB).
``--sync-loads``: the offloading connector loads synchronously (``sync_load_budget_bytes`` 1 GiB: a load runs
in the step whose forward reads it) where it loads asynchronously by default; ``config["offload_extra"]``.
Progress goes to stderr, one line per mode.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import numpy as np  # noqa: E402
import vllm_harness as H  # noqa: E402

# The published run (the vLLM blog's GLM-5.3 post, part 1; GLM-5.3 FP8 on 8xH200 TP8: ~26 GiB of KV per GPU).
PUBLISHED = {"first": 74_160, "later": 753, "output": 220, "turns": 13, "max_model_len": 142_000,
             "max_num_batched_tokens": 32_768, "max_num_seqs": 256, "gpu_gib": 26.0, "hisparse_pool_gib": 384.0,
             "offload_gib": 128.0, "baseline_offload_gib": 512.0, "top_k": 2048, "num_spec_tokens": 3}
MODES = ("offload", "native", "hisparse-coldest", "hisparse-fifo")
CONCURRENCY = (1, 8, 16, 32)
# One layer of the first (1-layer) and last resident groups, a leader in the middle, and a follower (42 reads
# layer 41's top-K).
LAYERS = [0, 21, 42, 77]


class _LockLeftHeld(logging.Filter):
    """Counts (and keeps off stderr) vLLM's "Offloading manager lock was left held by a previous schedule()"
    error: vLLM 0.33's ``update_from_output`` starts a deferred async load (``_drain_deferred_loads``) through
    the offloading connector's ``update_state_after_alloc``, which opens its step-scoped lock region outside
    ``schedule()``; the next hook outside ``schedule()`` finds it open, logs this and releases it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "left held by a previous" in record.getMessage():
            self.count += 1
            return False
        return True

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


LOCK_LEFT_HELD = _LockLeftHeld()
logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler").addFilter(LOCK_LEFT_HELD)


class Worker(H.FakeWorker):
    """The harness's fake worker with its selection scaled to the bench's top-K: the same shape (a sink, a
    local window, the rest drawn from the request's favourite 40% of pages, the same in every layer of an index
    group) at top-K / 32 sink rows and top-K / 4 local rows (64 and 512 at 2,048, the harness's own)."""

    def _topk(self, req, layer: int, seq_len: int) -> np.ndarray:
        top_k = H.TOP_K
        if seq_len <= top_k:
            return np.arange(seq_len, dtype=np.int32)
        layer = self.leader_of[layer]
        rng = np.random.default_rng((req.seed, layer, seq_len))
        local = np.arange(max(0, seq_len - top_k // 4), seq_len)
        sink = np.arange(min(max(1, top_k // 32), seq_len))
        num_pages = -(-seq_len // H.BLOCK)
        favourite = np.flatnonzero(np.random.default_rng(req.seed).random(num_pages) < 0.4)
        pool = (favourite[:, None] * H.BLOCK + np.arange(H.BLOCK)[None, :]).ravel()
        pool = pool[pool < seq_len]
        chosen = np.unique(np.concatenate([sink, local]))
        pool = np.setdiff1d(pool, chosen)
        rest = top_k - len(chosen)
        if rest > 0 and len(pool):
            chosen = np.concatenate([chosen, rng.choice(pool, size=min(rest, len(pool)), replace=False)])
        return np.sort(chosen[:top_k]).astype(np.int32)


def scaled(scale: float, turns: int, top_k: int | None, tier_cap_gib: float, output: int | None = None) -> dict:
    p = PUBLISHED
    top_k = top_k or max(H.BLOCK, round(p["top_k"] / scale))
    return {
        "scale": scale, "first": round(p["first"] / scale), "later": max(1, round(p["later"] / scale)),
        "output": output or max(1, round(p["output"] / scale)), "turns": turns,
        "max_model_len": math.ceil(p["max_model_len"] / scale),
        "max_num_batched_tokens": max(H.BLOCK, round(p["max_num_batched_tokens"] / scale)),
        "max_num_seqs": p["max_num_seqs"], "gpu_gib": p["gpu_gib"] / scale,
        "hisparse_pool_gib": p["hisparse_pool_gib"] / scale,
        "offload_gib": min(tier_cap_gib, p["offload_gib"] / scale),
        "baseline_offload_gib": min(tier_cap_gib, p["baseline_offload_gib"] / scale),
        "top_k": top_k, "num_spec_tokens": p["num_spec_tokens"], "model": "glm5.3", "async_scheduling": True,
        "checked_layers": LAYERS,
    }


#: The short end (``--workload short``): issue 19's outside run, at full scale.
SHORT = {"scale": 1.0, "first": 2_000, "later": 900, "output": 100, "turns": 3, "max_model_len": 4_608,
         "max_num_batched_tokens": 8_192, "max_num_seqs": 256, "gpu_gib": 1.0, "hisparse_pool_gib": 8.0,
         "offload_gib": 1.0, "baseline_offload_gib": 1.0, "top_k": PUBLISHED["top_k"],
         "num_spec_tokens": PUBLISHED["num_spec_tokens"], "model": "glm5.3", "async_scheduling": True,
         "checked_layers": [0, 42]}


def short(turns: int | None, output: int | None) -> dict:
    return {**SHORT, "turns": turns or SHORT["turns"], "output": output or SHORT["output"]}


def mixed(cfg: dict) -> dict:
    """The published shape ``cfg`` with the short end's conversations scaled alike beside it (``--workload
    mixed``)."""
    scale = cfg["scale"]
    return {**cfg, "short": {"first": round(SHORT["first"] / scale), "later": max(1, round(SHORT["later"] / scale)),
                             "output": max(1, round(SHORT["output"] / scale)), "turns": SHORT["turns"]}}


def conversations(cfg: dict, c: int) -> tuple[list, dict]:
    shape = {k: cfg[k] for k in ("first", "later", "output", "turns")}
    if "short" not in cfg:
        return H.conversations(c, 100, **shape)
    # Agents and chat users in turn: an agent's turns are one conversation; a chat user's, short conversations
    # one after another, the next sent when the last one's last turn ends.
    jobs, then = [], {}
    for client in range(c):
        agent = client % 2 == 0
        each = shape if agent else cfg["short"]
        last, left, part = None, cfg["turns"], 0
        while left > 0:
            turns = min(left, each["turns"])
            name = f"c{client}" if agent else f"c{client}-{part}"
            head, follow = H.conversation(name, 100 + client + 1000 * part, **{**each, "turns": turns})
            if last is None:
                jobs.append(head)
            else:
                then[last] = head
            then.update(follow)
            last, left, part = f"{name}-t{turns - 1}", left - turns, part + 1
    return jobs, then


def _copy(jobs: list, then: dict) -> tuple[list, dict]:
    """Fresh jobs for a run (vLLM's ``Request`` is given the prompt list)."""
    def dup(j):
        return H.Job(j.req_id, list(j.prompt), j.max_tokens, j.arrival)
    return [dup(j) for j in jobs], {k: dup(j) for k, j in then.items()}


def _children(setup) -> dict:
    connector = setup.scheduler.connector
    subs = getattr(connector, "sub_connectors", [connector])
    return {type(s).__module__.split(".")[0] + "." + type(s).__name__: s for s in subs}


def kv_layout(setup) -> dict:
    """What vLLM's planner made of the GPU KV memory: ``gpu_blocks`` in its shared pool, ``blocks_per_page``
    (every group on the GPU but the hot ones holds a block per 64-token page), ``tokens_fully_resident`` (the
    tokens the pool holds with every page on the GPU) and ``hot_region_blocks`` (a hot region, every hot
    group's; vLLM gives one to any request that starts from a prefix hit)."""
    from vllm.v1.kv_cache_interface import HiSparseHotSpec

    kc = setup.kv_cache_config
    groups = kc.kv_cache_groups
    hot = [g for g in groups if isinstance(g.kv_cache_spec, HiSparseHotSpec)]
    per_page = sum(1 for g in groups if not getattr(g, "host_resident", False) and g not in hot)
    return {"gpu_blocks": kc.num_blocks, "blocks_per_page": per_page,
            "tokens_fully_resident": kc.num_blocks // per_page * H.BLOCK,
            "hot_region_blocks": sum(g.kv_cache_spec.blocks_per_request for g in hot)}


def run_mode(cfg: dict, mode: str, c: int, jobs: list, then: dict) -> dict:
    start = time.perf_counter()
    engine, _, policy = mode.partition("-")
    engine = "plain" if engine == "offload" else engine
    setup = H.build(mode=engine, model="glm5.3", gpu_gib=cfg["gpu_gib"], max_model_len=cfg["max_model_len"],
                    max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
                    async_scheduling=True, num_spec_tokens=cfg["num_spec_tokens"],
                    host_pool_gib=cfg["hisparse_pool_gib"], extra={"policy": policy} if policy else None,
                    offload_gib=cfg["baseline_offload_gib" if engine == "plain" else "offload_gib"],
                    offload_extra=cfg.get("offload_extra"))
    children = _children(setup)
    layout = kv_layout(setup)
    jobs, then = _copy(jobs, then)
    host_pool = block_bytes = None
    if engine != "plain":
        hs = children.get("hisparse.HiSparseConnector") or children["vllm.HiSparseConnector"]
        coordinator = getattr(hs, "coordinator", None) or hs.connector_scheduler.coordinator
        host_pool = coordinator.host_manager.block_pool
        block_bytes = int(cfg["hisparse_pool_gib"] * 2**30) // setup.kv_cache_config.hisparse_host_num_blocks
    tier = children["vllm.OffloadingConnector"].connector_scheduler.manager.primary_tier
    tier_bytes = cfg["baseline_offload_gib" if engine == "plain" else "offload_gib"] * 2**30
    chunk_bytes = tier_bytes / tier._num_chunks
    worker = Worker(setup, layers=cfg["checked_layers"], completion_lag=1, offload_seed=c)
    samples = {"host": [], "tier": [], "free": []}
    gpu_pool = setup.scheduler.kv_cache_manager.block_pool

    first_turns = {job.req_id for job in jobs}
    ramp = {"started": set(), "samples": None}  # samples: running samples taken once every first turn ran

    def on_step(_step):
        if ramp["samples"] is None:
            ramp["started"].update(r.request_id for r in setup.scheduler.running if r.request_id in first_turns)
            if len(ramp["started"]) == len(first_turns):
                ramp["samples"] = len(worker.stats.running_samples)
        if setup.scheduler.waiting:
            samples["free"].append(gpu_pool.get_num_free_blocks() / (gpu_pool.num_gpu_blocks - 1))
        if host_pool is not None:
            samples["host"].append(host_pool.num_gpu_blocks - 1 - host_pool.get_num_free_blocks())
        samples["tier"].append(tier._num_chunks - tier._get_num_free_chunks())

    out: dict = {}
    try:
        stats = H.run(setup, worker, jobs, then=then, on_step=on_step,
                      num_spec_tokens=cfg["num_spec_tokens"], max_steps=100_000)
        out["rows_wrong"] = 0
    except H.CheckFailed as e:  # a wrong row or an exception out of schedule()/update_from_output()
        stats = worker.stats
        out["rows_wrong"] = None
        out["error"] = str(e)[:300]
    nonzero = [n for n in stats.running_samples if n > 0]
    after_ramp = [] if ramp["samples"] is None else [n for n in stats.running_samples[ramp["samples"]:] if n > 0]
    gib = 2**30
    out = {
        "running": round(statistics.mean(nonzero), 2) if nonzero else 0.0,
        "max_running": stats.max_running,
        "first_turns_started_step": ramp["samples"],
        "running_after_first_turns": round(statistics.mean(after_ramp), 2) if after_ramp else None,
        "running_while_waiting": round(statistics.mean(stats.pressure_samples), 2) if stats.pressure_samples else 0.0,
        "gpu_free_while_waiting": round(statistics.mean(samples["free"]), 3) if samples["free"] else None,
        "preemptions": stats.preemptions, "steps": stats.steps, "prefix_hit_tokens": stats.prefix_hit_tokens,
        "rows_checked": stats.rows_checked, "indexer_rows_checked": stats.indexer_rows_checked,
        "rows_from_host": stats.rows_from_host, **out,
        "host_pool_peak_gib": round(max(samples["host"]) * block_bytes / gib, 3) if block_bytes else None,
        "host_pool_end_gib": round(samples["host"][-1] * block_bytes / gib, 3) if block_bytes else None,
        "tier_gib": round(tier_bytes / gib, 3),
        "tier_peak_gib": round(max(samples["tier"], default=0) * chunk_bytes / gib, 3),
        "drafts_accepted": stats.drafts_accepted, "drafts_rejected": stats.drafts_rejected,
        "kv_layout": layout, "wall_s": round(time.perf_counter() - start, 1),
    }
    if engine == "hisparse":
        out["counters"] = {k: v for k, v in sorted(coordinator.counters.items())
                           if k in ("admissions_deferred", "admissions_forced", "transitions",
                                    "transitions_declined", "transitions_postponed", "restored_whole",
                                    "pages_restored")}
    out["vllm_lock_left_held"] = LOCK_LEFT_HELD.take()
    # The tier's /dev/shm region (written in full: RAM) goes now, not when the setup is collected.
    setup.scheduler.connector.shutdown()
    # on_step holds these too: drop what it sees before collecting.
    setup = worker = children = tier = host_pool = gpu_pool = None
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("published", "short", "mixed"), default="published")
    ap.add_argument("--concurrency", nargs="+", type=int, default=None)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--scale", type=float, default=None, help="divide published lengths and memory by this")
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--topk", type=int, default=None, help="index top-K (default: 2,048 / scale)")
    ap.add_argument("--tier-cap-gib", type=float, default=None,
                    help="cap on each offloading tier, a /dev/shm region vLLM writes in full (default 8; 1 --quick)")
    ap.add_argument("--output-tokens", type=int, default=None,
                    help="tokens per answer (default: 220 / scale; see the docstring on decode steps)")
    ap.add_argument("--sync-loads", action="store_true",
                    help="the offloading connector loads synchronously (sync_load_budget_bytes = 1 GiB)")
    ap.add_argument("--quick", action="store_true", help="smoke run: c = 2, 3 turns, scale 32")
    args = ap.parse_args()
    quick = args.quick
    if args.workload == "short":
        concurrency = args.concurrency or [10]
        cfg = short(args.turns, args.output_tokens)
    else:
        concurrency = args.concurrency or ([2] if quick else list(CONCURRENCY))
        cfg = scaled(args.scale or (32.0 if quick else 16.0), args.turns or (3 if quick else PUBLISHED["turns"]),
                     args.topk, args.tier_cap_gib or (1.0 if quick else 8.0), args.output_tokens)
        if args.workload == "mixed":
            cfg = mixed(cfg)
            concurrency = args.concurrency or ([2] if quick else [32])
    cfg["workload"] = args.workload
    cfg["offload_extra"] = {"sync_load_budget_bytes": 1 << 30} if args.sync_loads else None
    # The harness reads its top-K from this module global (the specs' topk_buffer_width, the fake worker's
    # selections); vLLM's planner takes the specs' width over the model config's index_topk.
    H.TOP_K = cfg["top_k"]
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    results: dict = {}
    for c in concurrency:
        jobs, then = conversations(cfg, c)
        results[str(c)] = {}
        for mode in args.modes:
            r = run_mode(cfg, mode, c, jobs, then)
            results[str(c)][mode] = r
            print(f"c={c} {mode}: running {r['running']} preemptions {r['preemptions']} steps {r['steps']} "
                  f"rows {r['rows_checked']} wrong {r['rows_wrong']} ({r['wall_s']} s)", file=sys.stderr, flush=True)
    print(json.dumps({"bench": "vllm_agent", "config": cfg, "results": results,
                      "wall_s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
