"""``hisparse demo``: the reference engine serving one workload in every mode, checked against unlimited memory.

A tiny DSA-style model (seeded random weights, sparse MLA with an indexer that picks top-K rows per token)
serves 24 requests of 4,096-token prompts (three families sharing their first 2,048 tokens) and 128 new
tokens each, under a KV budget that holds about 4 of them fully resident:

* ``resident``: plain paged KV; a step that does not fit preempts a request, computed again later;
* ``offload``:  a preempted request's KV waits on the host and comes back whole; prefixes come from the host;
* ``hisparse``: cold pages go to the host and are read through per-request hot regions.

The same workload first runs with unlimited memory (``resident``, every request fits); each mode's generated
tokens and every attention output it computed (a digest of each row's float64 bits) must equal that run's.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from ..errors import ConfigError
from ..tools import console
from ..tools.argtypes import U32_MAX, float_range, name_list, plot_path, positive_int, seed, torch_device
from .engine import MODES, Engine, EngineConfig, RunResult
from .model import ModelConfig, TinyDSA
from .workload import make_workload

#: The most query-key scores (:func:`indexer_scores`) a demo computes: 1e10 take about 8 minutes on one core of
#: the machine the README's numbers come from (46 ns a score at 16K tokens), six times the default run's 1.7e9.
MAX_INDEXER_SCORES = 1e10


@dataclass(frozen=True)
class DemoConfig:
    requests: int = 24
    prompt_len: int = 4096
    new_tokens: int = 128
    families: int = 3
    shared_tokens: int = 2048
    arrival_gap: int = 2  # steps between arrivals: later requests can find their family's prefix on the host
    fit: float = 4.0  # requests the GPU pool holds fully resident
    block_size: int = 16
    max_batched_tokens: int = 1024
    max_running: int = 32
    layers: int = 2
    index_share: int = 1
    hidden: int = 64
    latent: int = 128
    rope: int = 32
    top_k: int = 64
    seed: int = 0
    device: str = "cpu"

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def pages_per_request(self) -> int:
        return math.ceil(self.max_len / self.block_size)

    @property
    def gpu_blocks(self) -> int:
        return 1 + round(self.fit * self.pages_per_request)

    @property
    def unlimited_blocks(self) -> int:
        """The reference run's pool: room for every request, and one more."""
        return 1 + (self.requests + 1) * self.pages_per_request

    @property
    def hot_rows(self) -> int:
        """The engine's 4 x top_k, but no more than a whole request: a hot region larger than the request it
        serves would only shrink the pool (and, for short requests, not leave room for one of them)."""
        whole = self.pages_per_request * self.block_size
        return min(4 * self.top_k, max(self.top_k, whole))

    def model_config(self) -> ModelConfig:
        return ModelConfig(hidden=self.hidden, layers=self.layers, latent=self.latent, rope=self.rope,
                           top_k=self.top_k, index_share=self.index_share, max_model_len=self.max_len, seed=self.seed)


def engine_config(cfg: DemoConfig, mode: str, gpu_blocks: int, host_blocks: int | None = None) -> EngineConfig:
    """The engine of one run; ``host_blocks`` defaults to a page of the host pool for every page of every request
    and of every running slot."""
    if host_blocks is None:
        host_blocks = (cfg.requests + cfg.max_running) * cfg.pages_per_request
    return EngineConfig(mode=mode, num_gpu_blocks=gpu_blocks, block_size=cfg.block_size, max_running=cfg.max_running,
                        max_batched_tokens=cfg.max_batched_tokens, num_host_blocks=host_blocks,
                        hot_rows=cfg.hot_rows, device=cfg.device)


# --------------------------------------------------------------------------- checks before any run


def check_device(device: str) -> None:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA device is available here; use --device cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def estimate_memory(cfg: DemoConfig) -> tuple[int, int]:
    """(host bytes, device bytes) a demo run needs at its peak, from its largest parts: the pools (the reference
    run's GPU pool holds every request), each request's indexer keys and output digests (of one mode's run and
    of the reference, which is kept), the cache of prefix keys, the prompts, the weights, and the indexer's
    scores of a prefill chunk. An estimate: it leaves out what does not grow with the flags (torch itself, the
    rest of a step's activations)."""
    m = cfg.model_config()
    groups = -(-m.layers // m.index_share)  # not m.num_groups: it lists every layer, 2**31 of them for a typo
    page = cfg.block_size * m.row_bytes * m.layers
    ppr = cfg.pages_per_request
    host_pool = (cfg.requests + cfg.max_running) * ppr * page
    gpu_pool = max(cfg.unlimited_blocks, cfg.gpu_blocks) * page
    per_request = cfg.max_len * (8 * groups * m.index_dim + 8 * m.layers + 1)
    prefix_keys = cfg.requests * ppr * cfg.block_size * 8 * groups * m.index_dim
    weights = 8 * m.layers * m.hidden * ((m.latent + m.rope) * (2 * m.heads + 1) + 2 * m.mlp)
    tokens = 24 * cfg.requests * cfg.max_len  # a tuple and a list slot per token, and the generated lists
    # The indexer scores a prefill chunk against the whole history at once: float64 [chunk x heads, history] and
    # their weighted sum [chunk, history], 2.4 GB for a 1,024-token chunk over 100,000 tokens of history.
    scores = 8 * min(cfg.max_batched_tokens, cfg.max_len) * (m.index_heads + 1) * cfg.max_len
    device = gpu_pool + 2 * cfg.requests * per_request + prefix_keys + weights + scores
    return host_pool + tokens, device


def indexer_scores(cfg: DemoConfig, runs: int) -> float:
    """About how many query-key scores ``runs`` runs of the workload compute: the indexer is exact, so every
    position scores every earlier one, in every index group (a prefix hit saves some, a recomputation after a
    preemption adds some). The work that grows with the square of the length: what bounds a long run."""
    groups = -(-cfg.layers // cfg.index_share)
    return float(runs) * cfg.requests * groups * cfg.max_len * (cfg.max_len + 1) / 2


def check_work(cfg: DemoConfig, runs: int) -> None:
    """Refuses a run of more than :data:`MAX_INDEXER_SCORES`, naming the longest prompt that fits."""
    scores = indexer_scores(cfg, runs)
    if scores <= MAX_INDEXER_SCORES:
        return
    per_length = scores / (cfg.max_len * (cfg.max_len + 1) / 2)
    longest = math.isqrt(int(2 * MAX_INDEXER_SCORES / per_length))  # max_len * (max_len + 1) / 2 <= limit
    while longest * (longest + 1) / 2 * per_length > MAX_INDEXER_SCORES:
        longest -= 1
    prompt = longest - cfg.new_tokens
    fits = (f"--prompt-len {prompt:,} or less, or fewer --requests or --modes" if prompt > 0
            else "fewer --requests, --modes, --new-tokens or --layers")
    raise ConfigError(f"{cfg.requests:,} requests of {cfg.max_len:,} tokens, run {runs} times (the reference and "
                      f"each mode), are about {_e(scores)} indexer scores, more than the demo's limit of "
                      f"{_e(MAX_INDEXER_SCORES)} (minutes of one core; the exact indexer's work grows with the square "
                      f"of the length): use {fits}")


def _e(x: float) -> str:
    return f"{x:.1e}".replace("e+", "e")


def _probe(model: TinyDSA, cfg: DemoConfig, mode: str, blocks: int) -> str | None:
    """Why a pool of ``blocks`` GPU blocks cannot serve ``mode``, or ``None`` when it can: the core must accept
    it (null block, tail, hot region, watermark), and a mode that keeps requests whole must hold one at its full
    length beside the watermark. A small host pool keeps the probe cheap; it changes nothing on the GPU side."""
    try:
        engine = Engine(model, engine_config(cfg, mode, blocks, host_blocks=cfg.pages_per_request))
    except ConfigError as exc:
        return str(exc)
    if mode != "hisparse" and blocks - 1 - engine.watermark < cfg.pages_per_request:
        return (f"a {mode} request is kept whole: its {cfg.pages_per_request} pages and the watermark of "
                f"{engine.watermark} blocks do not fit in {blocks - 1}")
    return None


def _fewest_blocks(model: TinyDSA, cfg: DemoConfig, mode: str, blocks: int) -> int:
    """The smallest pool ``mode`` runs with, found by asking the engine (the core owns the rule)."""
    lo, hi = blocks, max(2 * blocks, 8)
    while _probe(model, cfg, mode, hi) is not None:
        if hi > 1 << 28:
            raise ConfigError(f"{mode}: no GPU pool serves one request of {cfg.max_len} tokens")
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _probe(model, cfg, mode, mid) is None else (mid, hi)
    return hi


def check_pools(model: TinyDSA, cfg: DemoConfig, modes: Sequence[str]) -> int:
    """Checks every mode's GPU pool against one request before anything runs; returns the reference run's pool
    (room for every request, or the smallest pool it runs with when that is larger). The error names the
    smallest ``--fit`` that serves every mode asked for."""
    short = {mode: why for mode in modes if (why := _probe(model, cfg, mode, cfg.gpu_blocks)) is not None}
    if short:
        need = {mode: _fewest_blocks(model, cfg, mode, cfg.gpu_blocks) for mode in short}
        mode = max(need, key=need.__getitem__)
        # The least --fit, in hundredths, whose pool (rounded, as gpu_blocks does) holds the blocks needed.
        fit = math.ceil(100 * (need[mode] - 1) / cfg.pages_per_request) / 100
        while fit > 0.01 and replace(cfg, fit=round(fit - 0.01, 2)).gpu_blocks >= need[mode]:
            fit = round(fit - 0.01, 2)
        raise ConfigError(f"--fit {cfg.fit:g} gives a GPU pool of {cfg.gpu_blocks - 1} blocks, too small for one "
                          f"request of {cfg.max_len} tokens in {', '.join(short)} ({mode}: {short[mode]}); raise "
                          f"--fit to at least {fit:g}")
    if _probe(model, cfg, "resident", cfg.unlimited_blocks) is None:
        return cfg.unlimited_blocks
    return _fewest_blocks(model, cfg, "resident", cfg.unlimited_blocks)


def _longest_request(cfg: DemoConfig) -> int:
    """The longest request the model accepts (its exact indexer scores bound positions to a power of two)."""
    bits = 0
    while bits < 62:
        try:
            replace(cfg, prompt_len=2 ** (bits + 1), new_tokens=0).model_config()
        except ConfigError:
            break
        bits += 1
    return 2**bits if bits else 0


def check(cfg: DemoConfig, modes: Sequence[str] = MODES) -> ModelConfig:
    """What can be checked before the model is built: the flags together, the device, memory, and the work of
    the reference run and one run per mode of ``modes``."""
    if not 0 < cfg.fit < float(U32_MAX):
        raise ConfigError(f"--fit must be a positive number of requests below 2**32, got {cfg.fit}")
    if not 0 <= cfg.shared_tokens <= cfg.prompt_len:
        raise ConfigError(f"a prefix of {cfg.shared_tokens} shared tokens does not fit a {cfg.prompt_len}-token prompt")
    if cfg.index_share > cfg.layers:
        raise ConfigError(f"--index-share {cfg.index_share} is more than --layers {cfg.layers}: at most one indexer "
                          "per layer group")
    try:
        model = cfg.model_config()
    except ConfigError as exc:
        limit = _longest_request(cfg)
        most = f"the demo model takes at most {limit:,}" if limit else "the demo model takes none"
        raise ConfigError(f"--prompt-len + --new-tokens = {cfg.max_len:,} tokens, and {most} ({exc})") from None
    check_device(cfg.device)
    host, device = estimate_memory(cfg)
    advice = "lower --requests, --prompt-len, --new-tokens, --layers or --fit"
    what = f"{cfg.requests:,} requests of {cfg.max_len:,} tokens, {cfg.layers:,} layers"
    if cfg.device == "cpu":
        console.require_memory(host + device, what, advice)
    else:
        console.require_memory(host, what, advice)
        free = torch.cuda.mem_get_info(torch.device(cfg.device))[0]
        if device > free:
            raise ConfigError(f"this run needs about {console.format_bytes(device)} of {cfg.device} memory ({what}), "
                              f"more than the {console.format_bytes(free)} free: {advice}")
    check_work(cfg, 1 + len(modes))
    return model


# --------------------------------------------------------------------------- the runs


def run_mode(model: TinyDSA, cfg: DemoConfig, mode: str, gpu_blocks: int, specs, progress: console.Progress,
             label: str) -> RunResult:
    engine = Engine(model, engine_config(cfg, mode, gpu_blocks))

    def note(e: Engine) -> str:
        tokens = sum(r.computed for r in e.requests.values())
        return f"{e.done:3d}/{cfg.requests} requests  step {e.step:5d}  running {len(e.running):3d}  tokens {tokens:,}"

    def tick(e: Engine) -> None:
        progress.update(e.done / cfg.requests, note(e))

    progress.start(label, note(engine))

    result = engine.run(specs, progress=tick)
    progress.close()
    return result


def summarize(result: RunResult, reference: RunResult, page_bytes: int) -> dict:
    m = result.metrics
    diffs = result.compare(reference) if result is not reference else []
    return {
        "peak_running": result.peak_running,
        # 4 places: the table's 1-place figure of a 2-place value was rounded twice (6.4477 -> 6.45 -> 6.5).
        "mean_running": round(result.mean_running, 4),
        "preemptions": result.preemptions,
        "steps": result.steps,
        "seconds": round(result.seconds, 2),
        "tokens_per_s": round(result.generated_tokens / result.seconds, 1) if result.seconds else None,
        "prefill_tokens": result.prefill_tokens,
        "decode_tokens": result.decode_tokens,
        "prefix_hit_tokens": m["prefix_hit_tokens"],
        "hits": m["hits"],
        "misses": m["misses"],
        "hit_rate": None if m["hit_rate"] is None else round(m["hit_rate"], 4),
        "h2d_bytes": m["h2d_bytes_total"],
        "h2d_bytes_rows": m["h2d_bytes"],
        "h2d_bytes_pages": m["restored_bytes"],
        "transitions": m["transitions"],
        "admitted_host_only_prefix": sum(e.kind == "admit" and e.residency != "full" for e in result.events),
        "preempted_in_mixed_residency": sum(e.kind == "preempt" and e.residency == "mixed" for e in result.events),
        "identical": not diffs,
        "differences": diffs[:5],
    }


def run_demo(cfg: DemoConfig, modes: Sequence[str] = MODES, progress: bool = True) -> dict:
    """Runs the reference, then each of ``modes``; everything that can fail on the configuration (flags, device,
    memory, each pool against one request) is checked before the first run. Raises :class:`ConfigError`."""
    t0 = time.perf_counter()
    bar = console.Progress(progress)  # from the start: the checks below build engines too
    if not modes:
        raise ConfigError(f"no mode to run: give some of {', '.join(MODES)}")
    model = TinyDSA(check(cfg, modes), cfg.device)
    unlimited = check_pools(model, cfg, modes)
    specs = make_workload(cfg.requests, cfg.prompt_len, cfg.new_tokens, cfg.families, cfg.shared_tokens,
                          cfg.arrival_gap, model.cfg.vocab, cfg.seed)
    reference = run_mode(model, cfg, "resident", unlimited, specs, bar, "unlimited")
    page_bytes = cfg.block_size * model.cfg.row_bytes * model.cfg.layers
    rows = {"unlimited": summarize(reference, reference, page_bytes)}
    series = {"unlimited": reference.running}
    for mode in modes:
        result = run_mode(model, cfg, mode, cfg.gpu_blocks, specs, bar, mode)
        rows[mode] = summarize(result, reference, page_bytes)
        series[mode] = result.running
    return {
        "config": {**asdict(cfg), "gpu_blocks": cfg.gpu_blocks, "pages_per_request": cfg.pages_per_request,
                   "row_bytes": model.cfg.row_bytes, "page_bytes": page_bytes},
        "modes": rows,
        "running": series,
        "all_identical": all(r["identical"] for r in rows.values()),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{c['requests']} requests x ({c['prompt_len']} prompt + {c['new_tokens']} new tokens), "
        f"{c['families']} prefix families of {c['shared_tokens']} tokens; GPU pool {c['gpu_blocks'] - 1} blocks "
        f"of {c['block_size']} tokens = {c['fit']:g} requests fully resident; top-K {c['top_k']}, "
        f"{c['layers']} layers, {c['row_bytes']}-byte KV rows",
        "",
    ]
    head = ("mode", "peak run", "mean run", "preempt", "steps", "tok/s", "hit rate", "H2D bytes",
            "outputs identical to unlimited memory")
    rows = []
    for mode, r in result["modes"].items():
        rows.append((mode, str(r["peak_running"]), f"{r['mean_running']:.1f}", str(r["preemptions"]), str(r["steps"]),
                     "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}",
                     "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}", console.format_bytes(r["h2d_bytes"]),
                     "(reference)" if mode == "unlimited" else ("yes" if r["identical"] else "NO")))
    lines.append(console.format_table(rows, head=head, align="lrrrrrrrl"))
    for mode, r in result["modes"].items():
        for d in r["differences"]:
            lines.append(f"  {mode}: {d}")
    lines += [
        "",
        "unlimited: resident serving with room for every request and no prefix cache (it computes every position);",
        "each mode's generated tokens and the float64 bits of every attention output it computed must equal it.",
        "tok/s: generated tokens per second of this run; hit rate: hot-buffer hits among reads of non-resident",
        "rows; H2D bytes: rows read from the host plus pages restored whole.",
    ]
    lines.append("")
    lines.append(f"done in {result['seconds']:.1f} s")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, series in result["running"].items():
        ax.plot(range(len(series)), series, label=mode, linestyle=":" if mode == "unlimited" else "-")
    ax.set_xlabel("engine step")
    ax.set_ylabel("running requests")
    c = result["config"]
    ax.set_title(f"{c['requests']} requests, GPU pool for {c['fit']:g} fully resident")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DemoConfig()
    p.add_argument("--requests", type=positive_int, default=d.requests, help=f"requests (default {d.requests})")
    p.add_argument("--prompt-len", type=positive_int, default=d.prompt_len, help="prompt tokens of each request")
    p.add_argument("--new-tokens", type=positive_int, default=d.new_tokens, help="tokens each request generates")
    p.add_argument("--fit", type=float_range(0, U32_MAX, lo_open=True), default=d.fit,
                   help=f"requests the GPU pool holds fully resident (default {d.fit:g})")
    p.add_argument("--layers", type=positive_int, default=d.layers, help="sparse-attention layers")
    p.add_argument("--index-share", type=positive_int, default=d.index_share,
                   help="layers per indexer (IndexShare), at most --layers")
    p.add_argument("--seed", type=seed, default=d.seed)
    p.add_argument("--device", type=torch_device, default=d.device, help="cpu (default), cuda or cuda:N")
    p.add_argument("--modes", type=name_list(MODES), default=MODES, help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--plot", metavar="PNG", type=plot_path,
                   help="write running requests over time to this file (.png, .pdf or .svg; the folder must exist)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """``hisparse demo``; a :class:`ConfigError` reaches the command line, which prints it on one line. Exit
    status 1 when a mode's outputs differ from the reference."""
    modes = args.modes
    # The demo's tensors are small: a second intra-op thread only adds synchronization, and on a busy machine
    # its spinning made the whole run twenty times slower (bit-identical results either way).
    torch.set_num_threads(1)
    cfg = DemoConfig(requests=args.requests, prompt_len=args.prompt_len, new_tokens=args.new_tokens, fit=args.fit,
                     layers=args.layers, index_share=args.index_share, seed=args.seed, device=args.device,
                     shared_tokens=min(DemoConfig.shared_tokens, args.prompt_len // 2))
    result = run_demo(cfg, modes, progress=not args.no_progress)
    console.print_then_plot(json.dumps(result) if args.json else format_table(result), args.plot,
                            lambda path: plot(result, path), say_where=not args.json)
    return 0 if result["all_identical"] else 1
