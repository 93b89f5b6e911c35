"""``hisparse calc``: how many long requests fit, with and without HiSparse.

A pure-Python planning calculator (it does not need the compiled core unless
``accounting="core"`` is asked for).  The default, *exact* mode reproduces the
public vLLM Hybrid HiSparse concurrency calculator (GLM-5.3 defaults) number for
number:

* GPU memory (decimal GB): H200 141, B200 180, B300 288.
  Budget per GPU = GB * 1e9 / 2**30 * 0.92 GiB.
* Weights per GPU = dense / TP + experts / (DP * TP with expert parallelism,
  TP without); GLM-5.3: 19.556 + 684.167 GiB.
* KV HBM per GPU = budget - weights - 15 GiB, at least 0, at most 131.32 GiB,
  rounded to 0.1 GiB as the page shows it (``kv_hbm_gib`` overrides it).
* baseline = min(max_seqs, floor(floor(KV / baseline_block) / ceil(seq / 64)))
* HiSparse GPU blocks per request = ceil(seq/64) + groups * ceil(hot_rows/64)
  + groups * retained_pages + other; GPU limit =
  floor(floor(KV / hisparse_block) / per_request).
* host limit = floor(floor(host_gib * 2**30 / host_block) / ceil(seq/64));
  offloaded = min(max_seqs, GPU limit, host limit); HiSparse = max(baseline,
  offloaded).
* Minimum host pool = ceil(min(max_seqs, GPU limit) * ceil(seq/64) * host_block
  / 2**30) GiB when min(max_seqs, GPU limit) > baseline, else 0.  Without an
  explicit host pool the pool is that minimum, kept within [16, 4096] GiB; a
  given pool above 4096 GiB is refused.
* Totals multiply by DP.  Every per-replica number is also the per-GPU number:
  the sparse-MLA KV is replicated on every TP rank, so each GPU of a replica
  holds the KV of every request that replica runs.

With the defaults (GLM-5.3, H200, TP8, DP1, EP, fp8, 81,920 tokens, 4,096 hot
rows, 20 groups, 2 retained pages) it gives baseline 4, HiSparse 39 and a
minimum host pool of 134 GiB.

Block bytes
-----------
The page's block sizes decompose exactly (see :func:`block_bytes`), per token
of a 64-token block, ``row`` being the sparse-MLA row of one layer and
``idx = indexers * 132`` the indexer keys of all indexer layers:

* baseline GPU block = 64 * (layers * row + idx)
* host block         = 64 * layers * row            (only MLA KV is tiered)
* HiSparse GPU block = 64 * row * max(ceil(layers / groups),
  ceil(idx / row)): one block size for everything the GPU keeps (the
  indexer keys of 64 tokens, or 64 hot rows of one group's layers), a whole
  number of layer pages.

GLM-5.3 (78 layers, 21 indexers, 20 groups): the page's ``row`` is 576 bytes
for fp8 (one byte per latent + rope value) and 1,152 for bf16, giving
3,052,800 / 184,320 / 2,875,392 (fp8) and 5,928,192 / 294,912 / 5,750,784
(bf16) -- the page's constants exactly (fp8 HiSparse block: max(4, ceil(2772 /
576) = 5) = 5 pages; bf16: max(4, 3) = 4 pages).  The other presets use the
same formula with vLLM's real ``fp8_ds_mla`` row of 656 bytes (``--mla-row-
bytes`` overrides the row for any preset; 656 for GLM-5.3 gives vLLM's 53,940
bytes per token).  With an indexer on every layer the indexer keys set the
HiSparse block size, and a hot group holds as many layers as one block holds
of their pages, as vLLM's planner groups them (DeepSeek-V3.2: 12 layers, 6
groups; GLM-5.1: 15 layers, 6 groups; :meth:`ModelPreset.hot_groups`), in
blocks of whole layer pages (13 for DeepSeek-V3.2), as vLLM's are.

Weights
-------
The page's GLM-5.3 expert weights are exact: 76 MoE layers (75 + the MTP layer)
x 256 experts x 3 fp8 matrices of 6144 x 2048 with fp32 128x128 block scales =
684.16699 GiB.  The glm-5.3 preset keeps the page's literal 684.167 and 19.556
GiB (dense part).  The other presets compute the experts the same way and
estimate the dense part from the architecture (fp8 linears with block scales,
bf16 embeddings, router and norms, one MTP layer); that estimate gives 19.486
GiB for GLM-5.3, 0.4% under the page.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from ..errors import ConfigError
from . import console
from .argtypes import MAX_GIB, U32_MAX, gib, nonnegative_int, positive_int

GIB = 2**30
BLOCK_TOKENS = 64
INDEXER_ROW_BYTES = 132  # 128 fp8 values + one fp32 scale
MEMORY_UTILIZATION = 0.92
OVERHEAD_GIB = 15.0
KV_HBM_CAP_GIB = 131.32
HOST_POOL_MIN_GIB = 16
HOST_POOL_MAX_GIB = 4096
DEFAULT_MAX_SEQS = 1024
DEFAULT_SEQ_LEN = 81_920
DEFAULT_RETAINED_PAGES = 2  # vLLM's ACTIVE_TAIL_PAGES
DEFAULT_OTHER_BLOCKS = 0
HOT_ROWS_LIMIT = 32_768  # vLLM keeps the hot LRU in int16

GPU_MEMORY_GB = {"h200": 141, "b200": 180, "b300": 288}
KV_DTYPES = ("fp8", "bf16")
ACCOUNTING_MODES = ("exact", "core")
LIMITERS = ("max_seqs", "gpu", "host", "baseline", "no_kv_memory")

# The page's constants (bytes per 64-token block), which the glm-5.3 preset
# reproduces through block_bytes(); kept for the tests and as documentation.
PAGE_BLOCK_BYTES = {
    "fp8": {"baseline": 3_052_800, "hisparse": 184_320, "host": 2_875_392},
    "bf16": {"baseline": 5_928_192, "hisparse": 294_912, "host": 5_750_784},
}


class CalcError(ConfigError):
    """Invalid calculator input (the message says what and why); a ``ValueError`` too."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The shapes the weight estimate needs (Hugging Face config names)."""

    hidden: int
    vocab: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    dense_intermediate: int
    moe_intermediate: int
    shared_experts: int
    routed_experts: int
    first_dense_layers: int
    index_heads: int
    index_head_dim: int
    mtp_layers: int = 1


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    name: str
    layers: int  # sparse-MLA layers
    indexers: int  # indexer layers (their keys stay on the GPU)
    groups: int | None  # hot groups (the block size, the default count); None: as vLLM's planner (hot_groups)
    fp8_row_bytes: int  # sparse-MLA row of one layer and token, fp8 KV
    bf16_row_bytes: int  # the same in bf16 (576 values)
    top_k: int
    max_positions: int
    arch: Architecture
    dense_weight_gib: float | None = None  # None: estimated from arch
    expert_weight_gib: float | None = None  # None: computed from arch
    source: str = ""

    def row_bytes(self, kv_dtype: str) -> int:
        return self.fp8_row_bytes if kv_dtype == "fp8" else self.bf16_row_bytes

    def hot_groups(self, row_bytes: int) -> int:
        """The hot groups a request holds: the page's count where it gives one (GLM-5.3), else vLLM's planner's,
        which puts in one group as many layers as one block holds of their pages, the block being as large as
        64 tokens of every indexer layer's keys (DeepSeek-V3.2 with vLLM's 656-byte rows: 8,052 // 656 = 12
        layers a group, 6 groups)."""
        if self.groups is not None:
            return self.groups
        return -(-self.layers // max(1, self.indexers * INDEXER_ROW_BYTES // row_bytes))


_GLM5_ARCH = Architecture(
    hidden=6144, vocab=154_880, heads=64, q_lora_rank=2048, kv_lora_rank=512,
    qk_nope_dim=192, qk_rope_dim=64, v_head_dim=256, dense_intermediate=12_288,
    moe_intermediate=2048, shared_experts=1, routed_experts=256, first_dense_layers=3,
    index_heads=32, index_head_dim=128,
)
_DSV32_ARCH = Architecture(
    hidden=7168, vocab=129_280, heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, dense_intermediate=18_432,
    moe_intermediate=2048, shared_experts=1, routed_experts=256, first_dense_layers=3,
    index_heads=64, index_head_dim=128,
)

MODELS: dict[str, ModelPreset] = {
    "glm-5.3": ModelPreset(
        name="glm-5.3", layers=78, indexers=21, groups=20, fp8_row_bytes=576,
        bf16_row_bytes=1152, top_k=2048, max_positions=1_048_576, arch=_GLM5_ARCH,
        dense_weight_gib=19.556, expert_weight_gib=684.167,
        source="the vLLM HiSparse calculator page (fp8 row counted as 576 bytes)",
    ),
    "glm-5.1": ModelPreset(
        name="glm-5.1", layers=78, indexers=78, groups=None, fp8_row_bytes=656,
        bf16_row_bytes=1152, top_k=2048, max_positions=202_752, arch=_GLM5_ARCH,
        source="derived: indexer on every layer, vLLM fp8_ds_mla row 656 bytes",
    ),
    "deepseek-v3.2": ModelPreset(
        name="deepseek-v3.2", layers=61, indexers=61, groups=None, fp8_row_bytes=656,
        bf16_row_bytes=1152, top_k=2048, max_positions=163_840, arch=_DSV32_ARCH,
        source="derived: indexer on every layer, vLLM fp8_ds_mla row 656 bytes",
    ),
}
DEFAULT_MODEL = "glm-5.3"


# --------------------------------------------------------------------------- model constants


def block_bytes(
    *,
    layers: int,
    indexers: int,
    groups: int,
    row_bytes: int,
    indexer_row_bytes: int = INDEXER_ROW_BYTES,
    block_tokens: int = BLOCK_TOKENS,
) -> dict[str, int]:
    """Bytes of one block: ``baseline`` GPU, ``hisparse`` GPU and ``host``.

    baseline = tokens * (layers * row + indexers * indexer_row)
    host     = tokens * layers * row
    hisparse = tokens * row * max(ceil(layers / groups), ceil(indexers * indexer_row / row))

    The HiSparse GPU pool has one block size for everything it holds: 64 tokens of
    indexer keys of every indexer layer, or 64 hot rows of one group's layers, in
    whole layer pages.  For GLM-5.3 with the page's rows (576 fp8, 1152 bf16) this
    gives the page's constants exactly.
    """
    for name, value in (("layers", layers), ("groups", groups), ("row_bytes", row_bytes),
                        ("indexer_row_bytes", indexer_row_bytes), ("block_tokens", block_tokens)):
        if value <= 0:
            raise CalcError(f"{name} must be positive, got {value}")
    if indexers < 0:
        raise CalcError(f"indexers must be >= 0, got {indexers}")
    indexer_bytes = indexers * indexer_row_bytes
    pages = max(-(-layers // groups), -(-indexer_bytes // row_bytes))
    return {
        "baseline": block_tokens * (layers * row_bytes + indexer_bytes),
        "hisparse": block_tokens * row_bytes * pages,
        "host": block_tokens * layers * row_bytes,
    }


def _fp8_linear_bytes(n_in: int, n_out: int) -> int:
    """An fp8 weight with fp32 scales per 128 x 128 block."""
    return n_in * n_out + math.ceil(n_in / 128) * math.ceil(n_out / 128) * 4


def compute_expert_weight_gib(preset: ModelPreset) -> float:
    """Routed experts of every MoE layer, the MTP layer's included (684.16699 GiB for GLM-5.3)."""
    a = preset.arch
    moe_layers = preset.layers - a.first_dense_layers + a.mtp_layers
    per_expert = 3 * _fp8_linear_bytes(a.hidden, a.moe_intermediate)
    return moe_layers * a.routed_experts * per_expert / GIB


def estimate_dense_weight_gib(preset: ModelPreset) -> float:
    """Everything but the routed experts, estimated from the architecture."""
    a = preset.arch
    heads = a.heads
    attention = (
        _fp8_linear_bytes(a.hidden, a.q_lora_rank)
        + _fp8_linear_bytes(a.q_lora_rank, heads * (a.qk_nope_dim + a.qk_rope_dim))
        + _fp8_linear_bytes(a.hidden, a.kv_lora_rank + a.qk_rope_dim)
        + _fp8_linear_bytes(a.kv_lora_rank, heads * (a.qk_nope_dim + a.v_head_dim))
        + _fp8_linear_bytes(heads * a.v_head_dim, a.hidden)
        + 2 * (a.q_lora_rank + a.kv_lora_rank + 2 * a.hidden)  # bf16 norms
    )
    indexer = (
        _fp8_linear_bytes(a.q_lora_rank, a.index_heads * a.index_head_dim)
        + _fp8_linear_bytes(a.hidden, a.index_head_dim)
        + 2 * a.hidden * a.index_heads  # bf16 head weights
        + 2 * 2 * a.index_head_dim  # bf16 key norm
    )
    dense_mlp = 3 * _fp8_linear_bytes(a.hidden, a.dense_intermediate)
    moe_rest = (
        a.shared_experts * 3 * _fp8_linear_bytes(a.hidden, a.moe_intermediate)
        + 2 * a.routed_experts * a.hidden  # bf16 router
        + 4 * a.routed_experts  # fp32 router bias
    )
    mtp = a.mtp_layers
    total = (
        (preset.layers + mtp) * attention
        + (preset.indexers + mtp) * indexer
        + a.first_dense_layers * dense_mlp
        + (preset.layers - a.first_dense_layers + mtp) * moe_rest
        + 2 * 2 * a.vocab * a.hidden  # bf16 embedding and LM head
        + mtp * (_fp8_linear_bytes(2 * a.hidden, a.hidden) + 2 * 2 * a.hidden)
        + 2 * a.hidden  # final norm
    )
    return total / GIB


def dense_weight_gib(preset: ModelPreset) -> float:
    if preset.dense_weight_gib is not None:
        return preset.dense_weight_gib
    return estimate_dense_weight_gib(preset)


def expert_weight_gib(preset: ModelPreset) -> float:
    if preset.expert_weight_gib is not None:
        return preset.expert_weight_gib
    return compute_expert_weight_gib(preset)


# --------------------------------------------------------------------------- accounting


def per_request_gpu_blocks(
    accounting: str,
    *,
    seq_len: int,
    block_tokens: int,
    hot_rows: int,
    groups: int,
    retained_pages: int,
    other_blocks: int = 0,
) -> int:
    """GPU blocks one HiSparse request holds in steady state.

    ``exact``: the page's formula, ceil(seq/bt) + groups*ceil(hot/bt) + groups*retained + other.
    ``core``: the Rust core's own steady-state accounting
    (``hisparse._core.steady_state_blocks``), plus ``other_blocks``.  Its count is
    priced at the same HiSparse block bytes as the exact mode, so the core has to
    count in that unit (a block of every group's layers for 64 tokens).
    """
    if accounting == "exact":
        return (
            -(-seq_len // block_tokens)
            + groups * -(-hot_rows // block_tokens)
            + groups * retained_pages
            + other_blocks
        )
    if accounting == "core":
        try:
            core = importlib.import_module("hisparse._core")
        except ImportError as exc:
            raise CalcError(
                "accounting 'core' needs the compiled extension hisparse._core "
                f"(build it first, e.g. `maturin develop`): {exc}"
            ) from exc
        steady_state_blocks = getattr(core, "steady_state_blocks", None)
        if steady_state_blocks is None:
            raise CalcError("this build of hisparse._core has no steady_state_blocks(); rebuild it")
        blocks = steady_state_blocks(
            seq_len=seq_len,
            block_size=block_tokens,
            hot_rows=hot_rows,
            tail_pages=retained_pages,
            groups=groups,
        )
        return int(blocks) + other_blocks
    raise CalcError(f"unknown accounting {accounting!r}; choose from {', '.join(ACCOUNTING_MODES)}")


# --------------------------------------------------------------------------- the calculation


@dataclasses.dataclass(frozen=True)
class CalcResult:
    # inputs
    model: str
    gpu: str
    tp: int
    dp: int
    ep: bool
    kv_dtype: str
    seq_len: int
    hot_rows: int
    mtp: int | None
    top_k: int
    groups: int
    retained_pages: int
    other_blocks: int
    max_seqs: int
    host_gib_input: float | None
    kv_hbm_gib_input: float | None
    accounting: str
    mla_row_bytes: int
    # memory per GPU (GiB)
    gpu_memory_gb: int
    budget_gib: float
    weights_gib: float
    kv_hbm_gib_raw: float
    kv_hbm_gib: float
    # blocks
    block_tokens: int
    baseline_block_bytes: int
    hisparse_block_bytes: int
    host_block_bytes: int
    seq_blocks: int
    per_request_gpu_blocks: int
    baseline_gpu_blocks: int
    hisparse_gpu_blocks: int
    host_pool_gib: float
    host_pool_blocks: int
    # concurrency per DP replica (= per GPU: MLA KV is replicated across TP)
    baseline_per_replica: int
    gpu_limit_per_replica: int
    host_limit_per_replica: int
    hisparse_per_replica: int
    min_host_gib: int
    # totals over DP
    baseline_total: int
    hisparse_total: int
    min_host_gib_total: int
    host_pool_gib_total: float
    multiplier: float | None
    limiter: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        return d


def _require_int(name: str, value: Any, minimum: int) -> int:
    """An integer from ``minimum`` to 2**32 - 1: the core counts tokens, rows and blocks in 32 bits."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise CalcError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        raise CalcError(f"{name} must be {what}, got {value}")
    if value > U32_MAX:
        raise CalcError(f"{name} must be at most {U32_MAX:,}, got {value:,}")
    return value


def _require_gib(name: str, value: Any) -> float:
    """GiB from 0 to 2**30 (1 EiB): beyond it bytes no longer fit a float exactly enough to count blocks."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalcError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not 0 <= value <= MAX_GIB:
        raise CalcError(f"{name} must be a number in [0, {MAX_GIB:g}] GiB, got {value}")
    return float(value)


def _round_tenth(x: float) -> float:
    """Round to 0.1 as JavaScript's toFixed(1) shows it (ties away from zero)."""
    return float(Decimal(x).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def calculate(
    *,
    model: str = DEFAULT_MODEL,
    gpu: str = "h200",
    tp: int = 8,
    dp: int = 1,
    ep: bool = True,
    kv_dtype: str = "fp8",
    seq_len: int = DEFAULT_SEQ_LEN,
    hot_rows: int | None = None,
    mtp: int | None = None,
    groups: int | None = None,
    retained_pages: int = DEFAULT_RETAINED_PAGES,
    other_blocks: int = DEFAULT_OTHER_BLOCKS,
    max_seqs: int = DEFAULT_MAX_SEQS,
    host_gib: float | None = None,
    kv_hbm_gib: float | None = None,
    accounting: str = "exact",
    mla_row_bytes: int | None = None,
) -> CalcResult:
    """Concurrency with and without HiSparse (see the module docstring for the rules).

    ``hot_rows`` defaults to 2 * top_k (4,096); ``mtp=K`` sizes it as (K + 2) * top_k
    instead (the two are exclusive).  ``groups`` defaults to the preset's (20 for
    GLM-5.3, :meth:`ModelPreset.hot_groups`); it changes the per-request count,
    not the block size, so it must leave each group's layer pages within a block.  ``host_gib``
    and ``kv_hbm_gib`` are per DP replica / per GPU.  Raises :class:`CalcError`.
    """
    key = model.lower() if isinstance(model, str) else model
    if key not in MODELS:
        raise CalcError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    preset = MODELS[key]
    gkey = gpu.lower() if isinstance(gpu, str) else gpu
    if gkey not in GPU_MEMORY_GB:
        raise CalcError(f"unknown gpu {gpu!r}; choose from {', '.join(g.upper() for g in GPU_MEMORY_GB)}")
    if kv_dtype not in KV_DTYPES:
        raise CalcError(f"unknown kv dtype {kv_dtype!r}; choose from {', '.join(KV_DTYPES)}")
    if accounting not in ACCOUNTING_MODES:
        raise CalcError(f"unknown accounting {accounting!r}; choose from {', '.join(ACCOUNTING_MODES)}")
    tp = _require_int("tp", tp, 1)
    dp = _require_int("dp", dp, 1)
    seq_len = _require_int("seq", seq_len, 1)
    max_seqs = _require_int("max_seqs", max_seqs, 1)
    retained_pages = _require_int("retained_pages", retained_pages, 0)
    other_blocks = _require_int("other_blocks", other_blocks, 0)
    given_groups = None if groups is None else _require_int("groups", groups, 1)
    if given_groups is not None and given_groups > preset.layers:
        raise CalcError(f"groups must be at most {preset.layers} for {preset.name}, one a layer")
    if hot_rows is not None and mtp is not None:
        raise CalcError("give hot_rows or mtp, not both (mtp K sizes hot rows as (K + 2) * top_k)")
    if mtp is not None:
        mtp = _require_int("mtp", mtp, 0)
        hot_rows = _require_int("the hot rows --mtp asks for, (mtp + 2) x top_k,", (mtp + 2) * preset.top_k, 1)
    elif hot_rows is None:
        hot_rows = 2 * preset.top_k
    else:
        hot_rows = _require_int("hot_rows", hot_rows, 1)
    if host_gib is not None:
        host_gib = _require_gib("host_gib", host_gib)
        if host_gib > HOST_POOL_MAX_GIB:
            raise CalcError(f"a host pool of {host_gib} GiB per replica is beyond the calculator's range; use "
                            f"--host-gib {HOST_POOL_MAX_GIB} or less")
    if kv_hbm_gib is not None:
        kv_hbm_gib = _require_gib("kv_hbm_gib", kv_hbm_gib)
    row = preset.row_bytes(kv_dtype) if mla_row_bytes is None else _require_int(
        "mla_row_bytes", mla_row_bytes, 1)

    notes: list[str] = []

    # Memory per GPU.
    gpu_gb = GPU_MEMORY_GB[gkey]
    budget = gpu_gb * 1e9 / GIB * MEMORY_UTILIZATION
    expert_shards = dp * tp if ep else tp
    weights = dense_weight_gib(preset) / tp + expert_weight_gib(preset) / expert_shards
    kv_raw = budget - weights - OVERHEAD_GIB
    if kv_hbm_gib is not None:
        kv = kv_hbm_gib
    else:
        kv = _round_tenth(min(KV_HBM_CAP_GIB, max(0.0, kv_raw)))
        if kv_raw <= 0:
            notes.append(
                f"the model does not fit: weights {weights:.2f} GiB + {OVERHEAD_GIB:g} GiB overhead "
                f"exceed the {budget:.2f} GiB budget per GPU, leaving no KV memory"
            )
    kv_bytes = kv * GIB

    # Blocks: their size is the model's, set by its own hot groups; --groups changes only how many a request holds,
    # each of whose layers' pages must fit in one block.
    model_groups = preset.hot_groups(row)
    sizes = block_bytes(layers=preset.layers, indexers=preset.indexers, groups=model_groups, row_bytes=row)
    groups = model_groups if given_groups is None else given_groups
    layer_pages = sizes["hisparse"] // (BLOCK_TOKENS * row)
    group_layers = -(-preset.layers // groups)
    if group_layers > layer_pages:
        raise CalcError(f"groups must be at least {-(-preset.layers // layer_pages)} for {preset.name}: a group's "
                        f"hot rows hold pages of {group_layers} layers, and one HiSparse block holds {layer_pages}")
    if groups < model_groups:
        notes.append(f"vLLM's planner builds {model_groups} hot groups for {preset.name} (as many layers a group as "
                     f"the indexer keys' bytes hold of their pages); {groups} groups of up to {group_layers} layers "
                     "fit its blocks, but it does not build them")
    bt = BLOCK_TOKENS
    seq_blocks = -(-seq_len // bt)
    per_request = per_request_gpu_blocks(
        accounting, seq_len=seq_len, block_tokens=bt, hot_rows=hot_rows, groups=groups,
        retained_pages=retained_pages, other_blocks=other_blocks,
    )
    baseline_gpu_blocks = math.floor(kv_bytes / sizes["baseline"])
    hisparse_gpu_blocks = math.floor(kv_bytes / sizes["hisparse"])

    # Per replica.
    baseline = min(max_seqs, baseline_gpu_blocks // seq_blocks)
    gpu_limit = hisparse_gpu_blocks // per_request if per_request > 0 else max_seqs
    gpu_bound = min(max_seqs, gpu_limit)
    # Every request the GPU holds, and never fewer blocks than vLLM wants: ceil(max_model_len / bt) + 2.
    min_host_blocks = max(gpu_bound * seq_blocks, seq_blocks + 2)
    min_host = math.ceil(min_host_blocks * sizes["host"] / GIB) if gpu_bound > baseline else 0
    if host_gib is None:
        host_pool = float(min(HOST_POOL_MAX_GIB, max(HOST_POOL_MIN_GIB, min_host)))
        if min_host > HOST_POOL_MAX_GIB:
            notes.append(f"the minimum host pool ({min_host} GiB) is above the {HOST_POOL_MAX_GIB} GiB "
                         "cap; the host pool limits HiSparse")
    else:
        host_pool = host_gib
    host_pool_blocks = math.floor(host_pool * GIB / sizes["host"])
    host_limit = host_pool_blocks // seq_blocks
    offloaded = min(max_seqs, gpu_limit, host_limit)
    hisparse = max(baseline, offloaded)

    if kv <= 0 or max(baseline_gpu_blocks, hisparse_gpu_blocks) == 0:
        limiter = "no_kv_memory"
    elif offloaded > baseline:
        limiter = min(("max_seqs", max_seqs), ("gpu", gpu_limit), ("host", host_limit),
                      key=lambda kv_: kv_[1])[0]
    elif baseline >= max_seqs:  # the cap binds with all KV on the GPU already
        limiter = "max_seqs"
    elif baseline > 0:  # the GPU would hold more through HiSparse: then the host pool is what holds it back
        limiter = "host" if gpu_bound > baseline else "baseline"
    else:
        limiter = "gpu" if gpu_limit <= host_limit else "host"
    if kv > 0 and hisparse == 0:
        notes.append("not even one request of this length fits, with or without HiSparse")
    if (host_gib is not None or min_host) and host_pool_blocks < seq_blocks + 2:
        notes.append(f"vLLM wants a host pool of at least ceil(max_model_len / {bt}) + 2 = "
                     f"{seq_blocks + 2} blocks; this one has {host_pool_blocks}")
    if hot_rows > HOT_ROWS_LIMIT:
        notes.append(f"vLLM caps hot rows at {HOT_ROWS_LIMIT} (int16 LRU); {hot_rows} asked")
    if seq_len > preset.max_positions:
        notes.append(f"{preset.name} supports {preset.max_positions:,} positions; {seq_len:,} asked")
    if key != DEFAULT_MODEL:
        notes.append(f"{preset.name}: block bytes and weights {preset.source}; the page covers GLM-5.3 only")

    baseline_total = baseline * dp
    hisparse_total = hisparse * dp
    return CalcResult(
        model=preset.name, gpu=gkey.upper(), tp=tp, dp=dp, ep=bool(ep), kv_dtype=kv_dtype,
        seq_len=seq_len, hot_rows=hot_rows, mtp=mtp, top_k=preset.top_k, groups=groups,
        retained_pages=retained_pages, other_blocks=other_blocks, max_seqs=max_seqs,
        host_gib_input=host_gib, kv_hbm_gib_input=kv_hbm_gib, accounting=accounting,
        mla_row_bytes=row,
        gpu_memory_gb=gpu_gb, budget_gib=budget, weights_gib=weights, kv_hbm_gib_raw=kv_raw,
        kv_hbm_gib=kv,
        block_tokens=bt, baseline_block_bytes=sizes["baseline"], hisparse_block_bytes=sizes["hisparse"],
        host_block_bytes=sizes["host"], seq_blocks=seq_blocks, per_request_gpu_blocks=per_request,
        baseline_gpu_blocks=baseline_gpu_blocks, hisparse_gpu_blocks=hisparse_gpu_blocks,
        host_pool_gib=host_pool, host_pool_blocks=host_pool_blocks,
        baseline_per_replica=baseline, gpu_limit_per_replica=gpu_limit,
        host_limit_per_replica=host_limit, hisparse_per_replica=hisparse, min_host_gib=min_host,
        baseline_total=baseline_total, hisparse_total=hisparse_total,
        min_host_gib_total=min_host * dp, host_pool_gib_total=host_pool * dp,
        multiplier=hisparse_total / baseline_total if baseline_total > 0 else None,
        limiter=limiter, notes=tuple(notes),
    )


# --------------------------------------------------------------------------- output

_LIMITER_TEXT = {
    "max_seqs": "max_seqs (the scheduler cap binds)",
    "gpu": "gpu (HBM for indexer keys, hot rows and tail pages binds)",
    "host": "host (the host pool binds)",
    "baseline": "baseline (HiSparse does not beat keeping all KV on the GPU)",
    "no_kv_memory": "no_kv_memory (no HBM left for one KV block: the weights, or --kv-hbm-gib)",
}


def format_table(r: CalcResult) -> str:
    ep = "EP" if r.ep else "no EP"
    mult = f"{r.multiplier:.2f}x" if r.multiplier is not None else "n/a (baseline is 0)"
    mtp = f" (MTP {r.mtp})" if r.mtp is not None else ""
    host_src = "given"
    if r.host_gib_input is None:
        host_src = f"minimum, within [{HOST_POOL_MIN_GIB}, {HOST_POOL_MAX_GIB}]"
    kv_src = "given" if r.kv_hbm_gib_input is not None else f"raw {r.kv_hbm_gib_raw:.2f}"
    head = (f"hisparse calc: {r.model} on {r.gpu}, TP{r.tp} x DP{r.dp} ({ep}), {r.kv_dtype} KV, "
            f"{r.seq_len:,}-token requests, accounting {r.accounting}")
    rows: list[tuple[str, str]] = [
        ("GPU budget", f"{r.budget_gib:.2f} GiB per GPU ({r.gpu_memory_gb} GB x {MEMORY_UTILIZATION})"),
        ("Weights", f"{r.weights_gib:.2f} GiB per GPU"),
        ("KV HBM", f"{r.kv_hbm_gib:.1f} GiB per GPU ({kv_src})"),
        ("Block bytes", (f"baseline {r.baseline_block_bytes:,} / HiSparse GPU {r.hisparse_block_bytes:,} "
                         f"/ host {r.host_block_bytes:,} ({r.block_tokens} tokens)")),
        ("Hot rows", f"{r.hot_rows:,}{mtp} x {r.groups} groups, {r.retained_pages} retained pages"),
        ("Blocks per request", f"baseline {r.seq_blocks:,} / HiSparse GPU {r.per_request_gpu_blocks:,}"),
        ("GPU blocks", f"baseline {r.baseline_gpu_blocks:,} / HiSparse {r.hisparse_gpu_blocks:,}"),
        ("Host pool", f"{r.host_pool_gib:g} GiB per replica ({host_src}), {r.host_pool_blocks:,} blocks"),
        ("Limits per replica", (f"max_seqs {r.max_seqs:,} / GPU {r.gpu_limit_per_replica:,} "
                                f"/ host {r.host_limit_per_replica:,}")),
        ("Baseline", f"{r.baseline_total:,} total ({r.baseline_per_replica:,} per replica)"),
        ("HiSparse", f"{r.hisparse_total:,} total ({r.hisparse_per_replica:,} per replica)"),
        ("Multiplier", mult),
        ("Minimum host pool", f"{r.min_host_gib:,} GiB per replica ({r.min_host_gib_total:,} GiB total)"),
        ("Limiter", _LIMITER_TEXT[r.limiter]),
    ]
    lines = [head, console.format_table(rows, indent="  ")]
    lines += [f"  note: {n}" for n in r.notes]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> None:
    """Register ``calc`` on an ``argparse`` subparsers object (``set_defaults(func=main)``)."""
    p = subparsers.add_parser(
        "calc",
        description="How many requests of a given length fit with all KV on the GPU (baseline) and with "
                    "HiSparse. The default 'exact' accounting reproduces the vLLM HiSparse calculator page.",
    )
    p.add_argument("--model", type=str.lower, choices=sorted(MODELS), default=DEFAULT_MODEL,
                   help=f"model preset (default {DEFAULT_MODEL}, the page's)")
    p.add_argument("--gpu", type=str.lower, choices=sorted(GPU_MEMORY_GB), default="h200",
                   help="GPU: H200 141 GB, B200 180 GB, B300 288 GB (default h200)")
    p.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel size; totals multiply (default 1)")
    p.add_argument("--no-ep", dest="ep", action="store_false",
                   help="no expert parallelism: experts are sharded over TP only")
    p.add_argument("--kv-dtype", type=str.lower, choices=KV_DTYPES, default="fp8", help="KV cache dtype (default fp8)")
    p.add_argument("--seq", type=positive_int, default=DEFAULT_SEQ_LEN,
                   help=f"tokens per request (default {DEFAULT_SEQ_LEN})")
    hot = p.add_mutually_exclusive_group()
    hot.add_argument("--hot-rows", type=positive_int, default=None,
                     help="hot rows per request and group (default 2 x top_k = 4096)")
    hot.add_argument("--mtp", type=nonnegative_int, default=None,
                     help="MTP draft tokens K: hot rows = (K + 2) x top_k")
    p.add_argument("--groups", type=positive_int, default=None,
                   help="hot groups per request (default: the model's, 20 for glm-5.3)")
    p.add_argument("--retained-pages", type=nonnegative_int, default=DEFAULT_RETAINED_PAGES,
                   help=f"tail pages each group keeps on the GPU (default {DEFAULT_RETAINED_PAGES})")
    p.add_argument("--host-gib", type=gib, default=None,
                   help="host pool per replica, at most 4096 GiB (default: the minimum, within [16, 4096])")
    p.add_argument("--max-seqs", type=positive_int, default=DEFAULT_MAX_SEQS,
                   help=f"scheduler cap on running requests per replica (default {DEFAULT_MAX_SEQS})")
    p.add_argument("--kv-hbm-gib", type=gib, default=None,
                   help="KV HBM per GPU, instead of budget - weights - 15 GiB")
    p.add_argument("--mla-row-bytes", type=positive_int, default=None,
                   help="sparse-MLA row bytes per layer and token (default: the model's; 656 is vLLM fp8_ds_mla)")
    p.add_argument("--accounting", choices=ACCOUNTING_MODES, default="exact",
                   help="'exact' (default): the page's formula; 'core': the Rust core's steady-state accounting")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """``hisparse calc``; a :class:`CalcError` reaches the command line, which prints it on one line."""
    result = calculate(
        model=args.model, gpu=args.gpu, tp=args.tp, dp=args.dp, ep=args.ep,
        kv_dtype=args.kv_dtype, seq_len=args.seq, hot_rows=args.hot_rows, mtp=args.mtp,
        groups=args.groups, retained_pages=args.retained_pages, max_seqs=args.max_seqs,
        host_gib=args.host_gib, kv_hbm_gib=args.kv_hbm_gib, accounting=args.accounting,
        mla_row_bytes=args.mla_row_bytes,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_table(result))
    return 0
