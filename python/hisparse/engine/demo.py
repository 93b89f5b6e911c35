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
import sys
import time
from dataclasses import asdict, dataclass

from ..errors import ConfigError
from .engine import MODES, Engine, EngineConfig, RunResult
from .model import ModelConfig, TinyDSA
from .workload import make_workload


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


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.label = ""
        self.last = 0.0
        self.quarter = 0
        self.t0 = time.perf_counter()

    def start(self, label: str) -> None:
        self.label, self.t0, self.last, self.quarter = label, time.perf_counter(), 0.0, 0
        self.draw(0, 0, 0, force=True)

    def __call__(self, engine: Engine) -> None:
        self.draw(engine.done, engine.step, len(engine.running))

    def draw(self, done: int, step: int, running: int, force: bool = False) -> None:
        """Redraws in place on a terminal (at most 10 times a second); elsewhere writes one line per quarter."""
        now = time.perf_counter()
        if not self.enabled:
            return
        tty = getattr(self.stream, "isatty", lambda: False)()
        quarter = 4 * done // max(1, self.total)
        if tty and not force and now - self.last < 0.1 and done < self.total:
            return
        if not tty and not force and quarter == self.quarter:
            return
        self.last, self.quarter = now, quarter
        width = 30
        fill = width * done // max(1, self.total)
        bar = "#" * fill + "." * (width - fill)
        line = (f"{self.label:<10} [{bar}] {done:3d}/{self.total} requests  step {step:5d}  "
                f"running {running:3d}  {now - self.t0:6.1f} s")
        if tty:
            self.stream.write("\r" + line + ("\n" if done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def run_mode(model: TinyDSA, cfg: DemoConfig, mode: str, gpu_blocks: int, specs, progress: Progress | None
             ) -> RunResult:
    engine = Engine(model, EngineConfig(
        mode=mode, num_gpu_blocks=gpu_blocks, block_size=cfg.block_size, max_running=cfg.max_running,
        max_batched_tokens=cfg.max_batched_tokens,
        num_host_blocks=(cfg.requests + cfg.max_running) * cfg.pages_per_request, device=cfg.device,
    ))
    if progress is not None:
        progress.start(mode if gpu_blocks == cfg.gpu_blocks else "unlimited")
    return engine.run(specs, progress=progress)


def summarize(result: RunResult, reference: RunResult, page_bytes: int) -> dict:
    m = result.metrics
    diffs = result.compare(reference) if result is not reference else []
    return {
        "peak_running": result.peak_running,
        "mean_running": round(result.mean_running, 2),
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


def run_demo(cfg: DemoConfig, modes=MODES, progress: bool = True) -> dict:
    t0 = time.perf_counter()
    model = TinyDSA(ModelConfig(hidden=cfg.hidden, layers=cfg.layers, latent=cfg.latent, rope=cfg.rope,
                                top_k=cfg.top_k, index_share=cfg.index_share, max_model_len=cfg.max_len,
                                seed=cfg.seed), cfg.device)
    specs = make_workload(cfg.requests, cfg.prompt_len, cfg.new_tokens, cfg.families, cfg.shared_tokens,
                          cfg.arrival_gap, model.cfg.vocab, cfg.seed)
    bar = Progress(cfg.requests, progress)
    unlimited = 1 + (cfg.requests + 1) * cfg.pages_per_request
    reference = run_mode(model, cfg, "resident", unlimited, specs, bar)
    page_bytes = cfg.block_size * model.cfg.row_bytes * model.cfg.layers
    rows = {"unlimited": summarize(reference, reference, page_bytes)}
    series = {"unlimited": reference.running}
    for mode in modes:
        result = run_mode(model, cfg, mode, cfg.gpu_blocks, specs, bar)
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


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"{c['requests']} requests x ({c['prompt_len']} prompt + {c['new_tokens']} new tokens), "
        f"{c['families']} prefix families of {c['shared_tokens']} tokens; GPU pool {c['gpu_blocks'] - 1} blocks "
        f"of {c['block_size']} tokens = {c['fit']:g} requests fully resident; top-K {c['top_k']}, "
        f"{c['layers']} layers, {c['row_bytes']}-byte KV rows",
        "",
        f"{'mode':<10} {'peak run':>8} {'mean run':>8} {'preempt':>7} {'steps':>6} {'tok/s':>7} {'hit rate':>8} "
        f"{'H2D bytes':>10}  outputs identical to unlimited memory",
    ]
    for mode, r in result["modes"].items():
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        same = "(reference)" if mode == "unlimited" else ("yes" if r["identical"] else "NO")
        lines.append(f"{mode:<10} {r['peak_running']:>8} {r['mean_running']:>8.1f} {r['preemptions']:>7} "
                     f"{r['steps']:>6} {r['tokens_per_s']:>7.1f} {hit:>8} {_bytes(r['h2d_bytes']):>10}  {same}")
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
    p = subparsers.add_parser("demo", help="the reference engine in every mode, checked against unlimited memory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DemoConfig()
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--new-tokens", type=int, default=d.new_tokens)
    p.add_argument("--fit", type=float, default=d.fit, help="requests the GPU pool holds fully resident")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--index-share", type=int, default=d.index_share, help="layers per indexer (IndexShare)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="cpu (default) or cuda")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--plot", metavar="PNG", help="write running requests over time to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ConfigError(f"unknown mode(s) {unknown}: expected some of {', '.join(MODES)}")
    cfg = DemoConfig(requests=args.requests, prompt_len=args.prompt_len, new_tokens=args.new_tokens, fit=args.fit,
                     layers=args.layers, index_share=args.index_share, seed=args.seed, device=args.device,
                     shared_tokens=min(DemoConfig.shared_tokens, args.prompt_len // 2))
    result = run_demo(cfg, modes, progress=not args.no_progress)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if result["all_identical"] else 1
