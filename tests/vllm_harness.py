"""A CPU harness that runs vLLM 0.33.0's own scheduler stack and checks every KV row a sparse-MLA step reads.

What is vLLM's, unchanged: ``VllmConfig`` (from a local ``config.json``: DeepSeek-V3.2's shapes, 61 sparse-MLA
layers, 61 indexer caches; or GLM-5.3's, ``model="glm5.3"``: 78 sparse-MLA layers, 21 indexer caches by
IndexShare; block 64, top-K 2048, ``fp8_ds_mla`` 656-byte rows), the KV cache planner
(``get_global_kv_cache_groups`` / ``get_kv_cache_configs`` with HiSparse's group layout), ``Scheduler`` and
``AsyncScheduler``, the KV cache manager and its HiSparse spec managers, the connector factory (which loads
our connector through ``kv_connector_module_path``), ``SchedulerOutput`` / ``ModelRunnerOutput`` /
``KVConnectorOutput`` and vLLM's own row-mirror selection (``_select_written_row_mirrors``). With
``offload_gib``: vLLM's ``MultiConnector`` (HiSparse's connector and vLLM's ``OffloadingConnector`` with
``TieringOffloadingSpec``, as the published GLM-5.3 deployment runs them), both children's scheduler sides,
and the offloading connector's worker side (``OffloadingConnector`` / ``OffloadingConnectorWorker``: job
bookkeeping, deferred stores, sync loads waited for, flushes on block reuse, ``get_finished``, its worker
metadata), called in vLLM's worker order (``v1/worker/gpu/kv_connector.py``), and ``MultiConnector``'s worker
metadata around both children's.

What is faked, because it needs CUDA (each is the smallest stand-in, and none of it is in the shipped plugin):

- Platform: no GPU resolves ``UnspecifiedPlatform``, which says no to the hybrid KV cache manager and makes
  ``VllmConfig`` refuse HiSparse. :func:`build` patches ``support_hybrid_kv_cache`` to True and attaches the
  ``KVTransferConfig`` and ``HiSparseConfig`` after ``VllmConfig.__post_init__`` exactly as it would have
  (``config/vllm.py:1876-1881``). The KV cache layout is resolved by vLLM from the real sparse-MLA and
  indexer backends' supported layouts (block-major BLHNC with the connector, as on a GPU).
- The worker (:class:`FakeWorker`): vLLM's ``HiSparseConnectorWorker`` drives CUDA streams and the
  ``_C_cache_ops`` resolver. The fake applies the same ``HiSparseConnectorMetadata`` in vLLM's order
  (``worker.py:start_step``): host copy-on-write copies, restores, post-forward transfers completed at the
  next step, residency updates, written-row mirrors, and returns vLLM's ``HiSparseConnectorWorkerMetadata``.
- The forward writes a 16-byte tag per (token, layer) at vLLM's slot mapping (the block ids vLLM handed
  out), and every layer reads its top-K rows through the resolver the CUDA kernel implements, here
  hisparse's CPU reference (``hisparse.datapath.resolve_reference``, ``cuda/SPEC.md``): resident pages in
  place from vLLM's residency table, the rest through the request's hot region (vLLM's hot-group blocks)
  filled from the host pool at vLLM's host block ids. Rows are 16 bytes instead of 656 to keep memory small;
  block ids, slots and row indices are vLLM's, unchanged. A slab part stands for a layer's share of a block:
  all device groups share one slab, so two groups holding one block would overwrite each other's rows.
- A worker that dies and is replaced (:meth:`FakeWorker.rebuild`, as vLLM starts a new worker process):
  the new one starts from nothing (zeroed slab and host pool, empty tables, nothing in flight), and the dead
  one's late report can be delivered with a later step's output (:meth:`FakeWorker.late_report`).
- The offloading connector's copy engine (:class:`TierCopyWorker`): vLLM's ``CPUOffloadingWorker`` needs
  CUDA (device tensors, a stream and events per transfer, the ``swap_blocks`` kernels). The stand-in keeps
  the tier's rows per CPU chunk and copies when a job completes (late, out of order; at once when vLLM waits
  for it), so a tier that hands back other bytes than it stored is caught by the reads. The scheduler-side
  tier (``TieringOffloadingManager`` and its ``/dev/shm`` region) is vLLM's.
- MTP under async scheduling: the scheduler sends placeholder drafts; the fake worker proposes its own and
  keeps its own count of computed tokens, as vLLM's worker (Model Runner V2) does, so drafts are accepted and
  rejected under either scheduling.
- Selection heat: the fake counts and ranks it with the plugin's own worker code (``SelectionHeat``, built
  by ``connector.build_selection_heat`` from the same config), called where the GPU worker calls it: before
  the forward, after each counted index group's resolve, and after the forward.

A tag is a function of the token prefix (not of the request), so a prefix-cache hit must read what another
request wrote, and a recycled block must never be read as the page it used to hold.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYERS = 61
BLOCK = 64
TOP_K = 2048
ROW = 16  # bytes of a tag row (vLLM's rows are 656; see the module docstring)
VOCAB = 129280

DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "vocab_size": VOCAB,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": LAYERS,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "index_topk": TOP_K, "index_n_heads": 64, "index_head_dim": 128, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
}


# GLM-5.3 (its config): 78 sparse-MLA layers, IndexShare (IndexCache, arXiv 2603.12201): ``index_topk_freq`` 4 with
# vLLM's and transformers' default ``index_skip_topk_offset`` 2 puts an indexer in layers 0, 1, 5, 9, ..., 77
# (21 in all); the others reuse the previous indexer layer's top-K. vLLM's planner makes 21 resident and 21 hot
# groups of it (1, 4 x 19, 1 layers). 32 x 128 indexer heads, 1M positions; the rest as transformers'
# ``GlmMoeDsaConfig`` defaults.
GLM53 = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880,
    "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
    "num_nextn_predict_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048,
    "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "index_topk": TOP_K,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk_freq": 4,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
}
MODELS = {"dsv32": DSV32, "glm5.3": GLM53}


def model_dir(model: str = "dsv32") -> str:
    """A directory holding the model's ``config.json`` (no weights: the scheduler needs none)."""
    path = Path(tempfile.gettempdir()) / f"hisparse-{model}-config"
    path.mkdir(exist_ok=True)
    cfg = path / "config.json"
    text = json.dumps(MODELS[model])
    if not cfg.exists() or cfg.read_text() != text:
        cfg.write_text(text)
    return str(path)


def indexer_layers(model: str = "dsv32") -> list[int]:
    """The layers that run an indexer (lead an index group), by vLLM's rule (``deepseek_v2.py:1145-1153``:
    a layer skips top-K when ``max(layer - offset + 1, 0) % index_topk_freq != 0``)."""
    cfg = MODELS[model]
    freq, offset = cfg.get("index_topk_freq", 1), cfg.get("index_skip_topk_offset", 2)
    return [i for i in range(cfg["num_hidden_layers"]) if max(i - offset + 1, 0) % freq == 0]


def kv_specs(model: str = "dsv32"):
    """The layer specs the model's attention modules report (``mla_attention.py:1371``,
    ``deepseek_v2.py:659``): one sparse-MLA cache (656-byte ``fp8_ds_mla`` rows) per layer, and one indexer
    key cache (132-byte rows) per indexer layer, which leads an index group (DeepSeek-V3.2: every layer;
    GLM-5.3: :func:`indexer_layers`); the other layers read their leader's top-K."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    leaders = set(indexer_layers(model))
    specs = {}
    for i in range(MODELS[model]["num_hidden_layers"]):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla", state_content_bytes=656, topk_buffer_width=TOP_K,
            is_index_group_leader=i in leaders)
        if i in leaders:
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER)
    return specs


def offload_connector_config(offload_gib: float, extra: dict | None = None) -> dict:
    """vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` and a CPU primary tier of ``offload_gib``
    (the published deployment's 128 GiB beside a 384 GiB HiSparse pool), no secondary tier: one MultiConnector
    child, placed after HiSparse's (vLLM loads from the first child that reports a hit; HiSparse never
    does, and its "wait" must be answered before the offloading child books a load). ``extra``: more of the
    offloading connector's ``kv_connector_extra_config`` (``sync_load_budget_bytes``...). Beside HiSparse
    vLLM offloads only the indexer group (``offloading/config.py:get_offloading_group_ids``); alone, every
    prefix-cacheable group."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                          "cpu_bytes_to_use": int(offload_gib * 2**30), **(extra or {})}}


@dataclass
class Setup:
    vllm_config: object
    kv_cache_config: object
    scheduler: object
    block_hasher: object
    mode: str
    # An OffloadingConnector beside HiSparse (MultiConnector) or alone (mode "plain").
    offload: bool = False
    model: str = "dsv32"

    @property
    def num_layers(self) -> int:
        return MODELS[self.model]["num_hidden_layers"]


def build(*, mode: str, gpu_gib: float, max_model_len: int = 16384, max_num_seqs: int = 32,
          max_num_batched_tokens: int = 8192, async_scheduling: bool = False, prefix_caching: bool = True,
          host_pool_gib: float = 8.0, num_spec_tokens: int = 0, extra: dict | None = None,
          num_gpu_blocks: int | None = None, device_buffer_size: int | None = None,
          offload_gib: float | None = None, offload_extra: dict | None = None, offload_first: bool = False,
          model: str = "dsv32") -> Setup:
    """vLLM's engine-core setup (``v1/engine/core.py:_initialize_kv_caches`` and ``EngineCore.__init__``)
    for ``mode``: ``"plain"`` (vLLM without HiSparse), ``"native"`` (vLLM's HiSparseConnector) or
    ``"hisparse"`` (ours, by ``kv_connector_module_path``). ``gpu_gib`` of KV memory in every mode.
    ``offload_gib``: vLLM's ``OffloadingConnector`` (:func:`offload_connector_config`) with a CPU tier that
    size, inside vLLM's ``MultiConnector`` after the HiSparse connector, or alone in ``"plain"`` mode (the
    published deployment's baseline); :class:`FakeWorker` then runs its worker side too. ``offload_first``:
    the offloading child before HiSparse's."""
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.config.attention import HiSparseConfig
    from vllm.platforms import current_platform
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
        update_kv_cache_capacity,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.hisparse.layout import get_hisparse_kv_cache_groups
    from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec
    from vllm.v1.structured_output import StructuredOutputManager

    # CPU patch 1: the hybrid KV cache manager, which HiSparse needs and every CUDA platform has.
    current_platform.support_hybrid_kv_cache = lambda: True
    model_name, model = model, ModelConfig(model=model_dir(model), skip_tokenizer_init=True,
                                           max_model_len=max_model_len, dtype="bfloat16")
    spec_config = None
    if num_spec_tokens:
        from vllm.config import ParallelConfig, SpeculativeConfig

        spec_config = SpeculativeConfig(method="mtp", num_speculative_tokens=num_spec_tokens,
                                        target_model_config=model, target_parallel_config=ParallelConfig())
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, is_encoder_decoder=False,
                            async_scheduling=async_scheduling, enable_chunked_prefill=True)
    cache = CacheConfig(block_size=BLOCK, cache_dtype="fp8_ds_mla", enable_prefix_caching=prefix_caching)
    vc = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched,
                    device_config=DeviceConfig(device="cpu"), speculative_config=spec_config)
    connectors = []
    if mode != "plain":
        # CPU patch 2: what __post_init__ does on CUDA once it sees a connector named HiSparseConnector.
        extra_config = {"host_pool_gib": host_pool_gib, **(extra or {})}
        kv = {"kv_connector": "HiSparseConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra_config}
        if mode == "hisparse":
            kv["kv_connector_module_path"] = "hisparse.integrations.vllm"
        connectors.append(kv)
        # vLLM's --attention-config '{"hisparse_config": {"device_buffer_size": N}}': hot-region rows per request.
        vc.attention_config.hisparse_config = HiSparseConfig(device_buffer_size=device_buffer_size)
    if offload_gib:
        connectors.insert(0 if offload_first else len(connectors), offload_connector_config(offload_gib, offload_extra))
    if len(connectors) == 1:
        vc.kv_transfer_config = KVTransferConfig(**connectors[0])
    elif connectors:
        vc.kv_transfer_config = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                                                 kv_connector_extra_config={"connectors": connectors})
    if num_gpu_blocks is not None:
        vc.cache_config.num_gpu_blocks_override = num_gpu_blocks
    specs = kv_specs(model_name)
    register_all_kvcache_specs(vc)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([FlashMLASparseBackend,
                                                                          DeepseekV32IndexerBackend])]
    if connectors:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        connector_cls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
        vc.kv_transfer_config.kv_connector_extra_config  # noqa: B018 - touched like vLLM does
        layouts = [name for name in layouts if name == connector_cls.get_required_kvcache_layout(vc)] or layouts
    resolve_kv_cache_layout(vc, [layouts], specs.values())
    if mode != "plain":
        # What the worker's resolve_hisparse_specs adds (binding.py:42-77), less the backend block-size
        # probe, which needs CUDA: 64 is what FlashMLA sparse uses.
        groups = get_hisparse_kv_cache_groups(vc, specs)
        specs = specs | {name: group.kv_cache_spec for group in groups
                         if isinstance(group.kv_cache_spec, (HiSparseResidentSpec, HiSparseHotSpec))
                         for name in group.layer_names}
    global_groups = get_global_kv_cache_groups(vc, [specs])
    configs = get_kv_cache_configs(vc, [specs], [int(gpu_gib * 2**30)], global_groups)
    kc = generate_scheduler_kv_cache_config(configs)
    vc.cache_config.num_gpu_blocks = kc.num_blocks
    vc.cache_config.block_size = min(g.kv_cache_spec.block_size for g in kc.kv_cache_groups
                                     if g.kv_cache_spec.prefix_cacheable)
    update_kv_cache_capacity(vc, kc)
    vc.validate_block_size()
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kc, vc)
    alignment = resolve_cache_hit_alignment_tokens(kc, vc, block_size, hash_block_size)
    kc.hash_block_size = hash_block_size
    kc.cache_hit_alignment_tokens = alignment
    scheduler_cls = vc.scheduler_config.get_scheduler_cls()
    scheduler = scheduler_cls(vllm_config=vc, kv_cache_config=kc,
                              structured_output_manager=StructuredOutputManager(vc),
                              block_size=block_size, hash_block_size=hash_block_size, log_stats=True)
    init_none_hash(get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo))
    hasher = get_request_block_hasher(hash_block_size, get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo),
                                      vc.num_hash_lookahead_tokens)
    setup = Setup(vc, kc, scheduler, hasher, mode, offload=bool(offload_gib), model=model_name)
    if offload_gib:
        # The offloading scheduler maps its CPU tier in /dev/shm: give it back when the setup goes.
        weakref.finalize(setup, scheduler.connector.shutdown)
    return setup


# ---------------------------------------------------------------------------------------------- content

_MIX = np.uint64(0x9E3779B97F4A7C15)
_ZERO = np.uint64(0)


def prefix_hashes(tokens: np.ndarray, start: np.uint64 = _ZERO) -> np.ndarray:
    """h[i] identifies tokens[: i + 1]: the content a row at position i was computed from."""
    out = np.empty(len(tokens), dtype=np.uint64)
    h = start
    with np.errstate(over="ignore"):
        for i, t in enumerate(tokens.tolist()):
            h = (h ^ np.uint64(t + 1)) * _MIX
            h ^= h >> np.uint64(29)
            out[i] = h
    return out


def next_token(h: np.uint64) -> int:
    """The fake model's greedy token after a prefix: a function of the prefix only."""
    return int(h % np.uint64(VOCAB - 2)) + 2


def tags(hashes: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
    """16-byte rows: the prefix hash, the position and the layer."""
    out = np.empty((len(positions), 2), dtype=np.uint64)
    out[:, 0] = hashes
    out[:, 1] = positions.astype(np.uint64) | (np.uint64(layer) << np.uint64(32))
    return out.view(np.uint8).reshape(len(positions), ROW)


# ---------------------------------------------------------------------------------------------- worker


class CheckFailed(AssertionError):
    pass


class NotDone(CheckFailed):
    """A run still serving after its ``max_steps``: a request admitted and preempted over and over, say.
    ``recording``: what ``run_recording`` had recorded by then, for comparing two runs that never finish."""

    recording: list | None = None


@dataclass
class _Req:
    row: int
    tokens: list[int]
    hashes: np.ndarray
    block_ids: list[list[int]]
    seed: int
    hot_blocks: tuple[int, ...] = ()
    num_computed: int = 0
    step_hashes: np.ndarray | None = None


@dataclass
class Stats:
    steps: int = 0
    rows_checked: int = 0
    indexer_rows_checked: int = 0
    rows_from_host: int = 0
    max_running: int = 0
    # vLLM's running-requests gauge (len(scheduler.running)) after each schedule(), and how many of those
    # the step scheduled (fewer when a prefill takes the token budget).
    running_samples: list[int] = field(default_factory=list)
    scheduled_samples: list[int] = field(default_factory=list)
    # The gauge while some request waits: how many requests the pool keeps running under pressure.
    pressure_samples: list[int] = field(default_factory=list)
    preemptions: int = 0
    # Steps that scheduled no token and whose workers had nothing to report: vLLM's empty output.
    outputs_without_connector: int = 0
    # FakeWorker.rebuild: how many times the worker was rebuilt, and the transfers the dead ones had in flight.
    rebuilds: int = 0
    transfers_lost: int = 0
    prefix_hit_tokens: int = 0
    host_only_prefix_admissions: int = 0
    aborted: int = 0
    # The offloading tier (TierCopyWorker): blocks stored and loaded back, jobs completed out of order.
    tier_blocks_stored: int = 0
    tier_blocks_loaded: int = 0
    tier_jobs_reordered: int = 0
    tier_sync_loads: int = 0
    tier_flushes: int = 0
    # MTP: draft tokens the fake model accepted and rejected.
    drafts_accepted: int = 0
    drafts_rejected: int = 0
    tier_async_loads: int = 0
    trace: list = field(default_factory=list)


#: How the fake forward's indexer selects (``FakeWorker(selection=...)``).
SELECTIONS = ("favourites", "locality")


class FakeWorker:
    """Applies each ``SchedulerOutput`` the way vLLM's GPU worker and HiSparse connector worker do, with a
    fake forward that writes tags at vLLM's slots and reads every selected top-K row back (module
    docstring). ``tp`` > 1 runs the connector metadata through vLLM's ``aggregate`` as that many ranks (the
    HiSparse connector's only). With an offloading connector in the setup, its worker side runs too
    (:class:`TierCopyWorker`, seeded by ``offload_seed``, every job complete within ``offload_lag`` calls)."""

    def __init__(self, setup: Setup, *, reads: bool = True, layers: list[int] | None = None, tp: int = 1,
                 record: bool = False, data: bool = True, completion_lag: int = 0, offload_seed: int = 0,
                 offload_lag: int = 3, selection: str = "favourites"):
        # What rebuild() starts the new worker process with: only its arguments (vLLM's config).
        self._args = {"reads": reads, "layers": layers, "tp": tp, "record": record, "data": data,
                      "completion_lag": completion_lag, "offload_seed": offload_seed, "offload_lag": offload_lag,
                      "selection": selection}
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, not {selection!r}")
        self.selection = selection
        # selection="locality": each request's index groups' selection streams and their recent answers.
        self._streams: dict[tuple[int, int], tuple[object, dict[int, np.ndarray]]] = {}
        # A late message from a worker that died (rebuild): merged into the next step's output.
        self._late = None
        kc = setup.kv_cache_config
        self.setup = setup
        self.mode = setup.mode
        self.reads = reads
        num_layers = setup.num_layers
        self.layers = list(range(num_layers)) if layers is None else layers
        # The indexer layer whose top-K each layer reads (itself for an indexer layer), and its index group.
        leaders = indexer_layers(setup.model)
        self.leader_of = {i: max(j for j in leaders if j <= i) for i in range(num_layers)}
        self.index_group_of = {layer: k for k, layer in enumerate(leaders)}
        self.tp = tp
        self.num_blocks = kc.num_blocks
        self.max_pages = setup.vllm_config.model_config.max_model_len // BLOCK + 1
        self.max_rows = setup.vllm_config.scheduler_config.max_num_seqs
        self.reqs: dict[str, _Req] = {}
        self.free_rows = list(range(self.max_rows))[::-1]
        self.stats = Stats()
        self.record = record
        # data=False: bookkeeping only (no slab, no host pool, no reads): for timing the scheduler.
        self.data = data
        self._fresh: set[str] = set()
        self._post_forward: list = []
        groups = kc.kv_cache_groups
        self.layer_of: dict[int, tuple[int, int]] = {}  # layer -> (group index in its kind, part)
        if self.mode == "plain":
            (self.plain_group,) = range(len(groups))
            names = [n for n in groups[0].layer_names if n.endswith(".attn")]
            self.parts = num_layers
            for n in names:
                layer = _layer(n)
                self.layer_of[layer] = (0, layer)
            self.indexer_group = 0
        else:
            from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec

            self.source_group = next(i for i, g in enumerate(groups) if g.host_resident)
            self.indexer_group = next(i for i, g in enumerate(groups) if "INDEXER" in str(g.role))
            self.resident_groups = [i for i, g in enumerate(groups)
                                    if isinstance(g.kv_cache_spec, HiSparseResidentSpec)]
            self.hot_groups = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiSparseHotSpec)]
            self.parts = max(len(groups[i].layer_names) for i in self.resident_groups)
            for k, gid in enumerate(self.resident_groups):
                for j, n in enumerate(groups[gid].layer_names):
                    self.layer_of[_layer(n)] = (k, j)
            for k, gid in enumerate(self.hot_groups):  # hot group k serves the layers of resident group k
                assert [_layer(n) for n in groups[gid].layer_names] == \
                    [_layer(n) for n in groups[self.resident_groups[k]].layer_names]
            self.hot_rows = groups[self.hot_groups[0]].kv_cache_spec.blocks_per_request * BLOCK
            host_blocks = kc.hisparse_host_num_blocks if data else 0
            # Host rows of the checked layers only (the others are never written or read here).
            self.host = torch.zeros(len(self.layers), host_blocks * BLOCK, ROW, dtype=torch.uint8)
            self.host_index = {layer: i for i, layer in enumerate(self.layers)}
            self.residency = torch.zeros(len(self.resident_groups), self.max_rows, self.max_pages, dtype=torch.int32)
            self.hot_pos = torch.full((self.max_rows, num_layers, self.hot_rows), -1, dtype=torch.int32)
            self.hot_stamp = torch.zeros(self.max_rows, num_layers, self.hot_rows, dtype=torch.int64)
            self.hot_clock = torch.zeros(self.max_rows, num_layers, dtype=torch.int64)
            # The reference resolver counts heat as SPEC.md says; what the scheduler gets is counted apart, by
            # the plugin's worker code (SelectionHeat, as on a GPU), so this table is never read.
            self.resolver_heat = torch.zeros(self.max_rows, self.max_pages, dtype=torch.int32)
            self.status = torch.zeros(self.max_rows, dtype=torch.int32)
            self.counters = torch.zeros(3, dtype=torch.int64)
            self._written: dict[str, np.ndarray] = {}
        # The plugin's worker-side heat, built from the config as HiSparseConnector.register_kv_caches does.
        self.selection_heat = None
        if self.mode == "hisparse":
            from hisparse.integrations.vllm.connector import build_selection_heat, policy_option

            if policy_option(setup.vllm_config) == "coldest":
                self.selection_heat = build_selection_heat(self.residency[0], BLOCK, setup.vllm_config)
        # One slab for every device group: a block's memory, whichever group holds it (docstring).
        self.slab = torch.zeros(self.parts + 1, self.num_blocks * BLOCK if data else 0, ROW, dtype=torch.uint8)
        self._completed_host_copies: list[int] = []
        self._enqueued: list[int] = []
        # completion_lag > 0: transfers are reported complete that many steps after they were enqueued, as
        # the DMA of a GPU worker lags its forward (the copies themselves are done at once here).
        self._completing: deque[list[int]] = deque([] for _ in range(completion_lag))
        # vLLM's OffloadingConnector, worker role, when the setup has one (alone or as a MultiConnector child):
        # its real OffloadingConnectorWorker with the copy engine replaced by TierCopyWorker (module docstring).
        self.offload = None
        self.tier = None
        if setup.offload:
            self.offload, self.tier = _offload_worker(setup, self, seed=offload_seed, max_lag=offload_lag)

    # ------------------------------------------------------------------ request state

    def _admit(self, req_id: str, tokens: list[int], block_ids, num_computed: int) -> None:
        if not self.free_rows:
            raise CheckFailed("more running requests than max_num_seqs state rows")
        row = self.free_rows.pop()
        arr = np.asarray(tokens, dtype=np.int64)
        req = _Req(row, list(tokens), prefix_hashes(arr), [list(b) for b in block_ids], seed=_seed(req_id),
                   num_computed=num_computed)
        self.reqs[req_id] = req
        if self.mode != "plain":
            self.residency[:, row] = 0
            self.resolver_heat[row] = 0
            self.status[row] = 0
            self._reset_hot(req)

    def _reset_hot(self, req: _Req) -> None:
        self.hot_pos[req.row] = -1
        self.hot_stamp[req.row] = 0
        self.hot_clock[req.row] = 0
        req.hot_blocks = ()

    def _drop(self, req_id: str) -> None:
        req = self.reqs.pop(req_id, None)
        if req is not None:
            self.free_rows.append(req.row)

    # ------------------------------------------------------------------ a worker that dies and comes back

    def rebuild(self) -> FakeWorker:
        """The worker process dies and vLLM starts a new one: ``self`` becomes that new worker, built from
        the same arguments (a zeroed slab and host pool, empty residency tables, hot regions, state rows and
        heat, no transfers or host copies in flight: nothing carried over but the test's ``Stats``). Returns
        the dead worker (its last state) for :meth:`late_report`. The scheduler must be told (vLLM's
        ``Scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)``): what it
        believes the worker holds is gone."""
        dead = object.__new__(FakeWorker)
        dead.__dict__ = dict(self.__dict__)
        stats = self.stats
        self.__init__(self.setup, **self._args)
        self.stats = stats
        stats.rebuilds += 1
        stats.transfers_lost += dead.in_flight()
        return dead

    def in_flight(self) -> int:
        """Transfers this worker enqueued or was asked for whose completion it has not reported."""
        return len(self._enqueued) + len(self._post_forward) + sum(map(len, self._completing))

    def late_report(self):
        """What a late message from this (dead) worker would say: every transfer it had in flight enqueued
        and completed, and the host copies it ran and had not reported; vLLM's worker metadata."""
        ids = [*self._enqueued, *(t.transfer_id for t in self._post_forward), *(t for c in self._completing
                                                                              for t in c)]
        args = ({t: 1 for t in ids}, {t: 1 for t in ids}, tuple(self._completed_host_copies))
        if self.mode == "hisparse":
            from hisparse.integrations.vllm.connector import HisparseWorkerMetadata

            return HisparseWorkerMetadata(*args)
        from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnectorWorkerMetadata

        return HiSparseConnectorWorkerMetadata(*args)

    def deliver_late(self, meta) -> None:
        """Send ``meta`` (a dead worker's :meth:`late_report`) with this worker's next output, as a message
        that arrives late rides a later step's aggregated output."""
        self._late = meta

    # ------------------------------------------------------------------ one step

    def execute(self, so) -> object:
        """One step: returns vLLM's ``ModelRunnerOutput``. ``so`` crosses a pickle first, as to a worker
        process of the multi-process executor."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = pickle.loads(pickle.dumps(so))
        self.stats.steps += 1
        # Sets: dropped in a fixed order, so that which state row each request gets next does not hang on the
        # process's string hashing.
        for rid in sorted(so.finished_req_ids):
            self._drop(rid)
        for rid in sorted(so.preempted_req_ids or ()):
            self._drop(rid)
        for new in so.scheduled_new_reqs:
            self._drop(new.req_id)
            # A preempted request comes back as a new one; Model Runner V2 gets its outputs so far too.
            tokens = new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
            self._admit(new.req_id, tokens, new.block_ids, new.num_computed_tokens)
            self.stats.prefix_hit_tokens += new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:
                self._drop(rid)
                self._admit(rid, cached.all_token_ids[rid], cached.new_block_ids[i], cached.num_computed_tokens[i])
                continue
            req = self.reqs[rid]
            req.num_computed = cached.num_computed_tokens[i]
            if cached.new_block_ids[i] is not None:
                for g, ids in enumerate(cached.new_block_ids[i]):
                    req.block_ids[g].extend(ids)
        for ids in so.new_block_ids_to_zero or ():
            self._zero_block(ids)
        for copy in so.kv_cache_block_copies or ():
            self._copy_block(copy.src_block_id, copy.dst_block_id)
        meta, off_meta = _split_metadata(self, so.kv_connector_metadata)
        if self.record:
            self.stats.trace.append(_digest(so, meta))
        self._fresh = {new.req_id for new in so.scheduled_new_reqs if new.num_computed_tokens}
        if self.offload is not None and off_meta is not None:
            # ActiveKVConnector.pre_forward: every child's handle_preemptions, then bind (MultiConnector order).
            # A flush: stores still in flight from blocks the scheduler has just handed out again.
            self.stats.tier_flushes += len(off_meta.jobs_to_flush or ())
            self.offload.handle_preemptions(off_meta)
            self.offload.bind_connector_metadata(off_meta)
        if self.mode != "plain" and meta is not None:
            self._start_step(meta, list(so.num_scheduled_tokens), so)
        if self.offload is not None and off_meta is not None:
            # HiSparse sets has_sync_kv_loads: start_load_kv runs before the forward, HiSparse's then this one's
            # (vLLM's order without HiSparse is after the forward; a load's rows land before its request runs
            # either way: sync loads are waited for, async ones only finish before the request is scheduled).
            self.offload.start_load_kv(None)
        sampled = self._forward(so, meta)
        self.stats.scheduled_samples.append(len(so.num_scheduled_tokens))
        out = ModelRunnerOutput(req_ids=list(sampled), req_id_to_index={r: i for i, r in enumerate(sampled)},
                                sampled_token_ids=list(sampled.values()))
        if self.mode != "plain":
            worker_meta = self._worker_meta()
            if self._late is not None:
                worker_meta = self._late if worker_meta is None else worker_meta.aggregate(self._late)
                self._late = None
            out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=worker_meta)
        if self.offload is not None:
            out.kv_connector_output = self._offload_post_forward(so, out.kv_connector_output)
        if not so.total_num_scheduled_tokens:
            # vLLM's model runner runs no forward (``ActiveKVConnector.no_forward``): the output carries the
            # connector's alone, and is vLLM's empty output when that is empty (no update_connector_output then).
            out = ModelRunnerOutput.with_kv_conn_output_only(out.kv_connector_output)
            self.stats.outputs_without_connector += out.kv_connector_output is None
        return pickle.loads(pickle.dumps(out))

    def _offload_post_forward(self, so, hisparse_output):
        """``ActiveKVConnector.post_forward`` for the offloading child: ``wait_for_save`` (stores deferred to
        the next step), ``get_finished`` (loads done: ``finished_recving``), its worker metadata, and vLLM's
        ``MultiConnector.build_connector_worker_meta`` around both children's."""
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        off = self.offload
        if off.has_connector_metadata():
            off.wait_for_save()
        _, recving = off.get_finished(set(so.finished_req_ids)) if off.has_connector_metadata() else \
            off.connector_worker.get_finished(set(so.finished_req_ids))
        off_worker_meta = off.build_connector_worker_meta()
        off.clear_connector_metadata()
        output = hisparse_output or KVConnectorOutput()
        output.finished_recving = set(recving) or None
        if self.mode == "plain":
            output.kv_connector_worker_meta = off_worker_meta
        else:
            parts = (output.kv_connector_worker_meta, off_worker_meta)
            if self.setup.vllm_config.kv_transfer_config.kv_connector_extra_config["connectors"][0][
                    "kv_connector"] == "OffloadingConnector":
                parts = parts[::-1]
            output.kv_connector_worker_meta = None if parts == (None, None) else \
                MultiKVConnectorWorkerMetadata(metadata=parts)
        return output

    def _start_step(self, meta, batch: list[str], so) -> None:
        """``HiSparseConnectorWorker.start_step`` (worker.py:408), in its order, then what our connector's
        ``start_load_kv`` adds (``batch``: the step's request ids in batch order; ``so``: the step's scheduler
        output)."""
        # _finish_previous_step: last step's post-forward spills are submitted now. With eager host
        # mirroring (vLLM's default) a spill moves no data: the rows are on the host already.
        self._enqueued.extend(t.transfer_id for t in self._post_forward)
        self._post_forward = []
        self._mirrors = meta.row_mirrors
        for copy in meta.host_block_copies:
            src, dst = copy.src_block_id * BLOCK, copy.dst_block_id * BLOCK
            if self.data:
                self.host[:, dst:dst + BLOCK] = self.host[:, src:src + BLOCK]
            self._completed_host_copies.append(copy.dst_block_id)
        transfers = meta.command.page_transfers if meta.command is not None else []
        for t in transfers:
            if t.restore:
                for k, block in enumerate(t.resident_block_ids if self.data else ()):
                    for layer in self._layers_of_group(k):
                        part = self.layer_of[layer][1]
                        self.slab[part, block * BLOCK:(block + 1) * BLOCK] = \
                            self.host[self.host_index[layer], t.host_block_id * BLOCK:(t.host_block_id + 1) * BLOCK]
                self._enqueued.append(t.transfer_id)
        self._post_forward = [t for t in transfers if not t.restore and t.after_forward]
        self._enqueued.extend(t.transfer_id for t in transfers if not t.restore and not t.after_forward)
        for rid, update in meta.residency_updates.items():
            req = self.reqs[rid]
            row = req.row
            if rid in self._fresh and 0 in update.block_ids[0][:req.num_computed // BLOCK]:
                # Admitted on a prefix hit whose pages are (partly) on the host only.
                self.stats.host_only_prefix_admissions += 1
            pages = torch.as_tensor(update.pages, dtype=torch.long)
            for k, ids in enumerate(update.block_ids):
                self.residency[k, row, pages] = torch.as_tensor(ids, dtype=torch.int32)

        if self.selection_heat is not None and batch:
            rows = torch.as_tensor([self.reqs[rid].row for rid in batch], dtype=torch.int32)
            from hisparse.integrations.vllm.heat import joins_batch

            self.selection_heat.begin_step(batch, rows, meta.residency_updates, joins_batch(so))

    def _layers_of_group(self, k: int) -> list[int]:
        """The checked layers of resident group ``k``."""
        return [layer for layer in self.layers if self.layer_of[layer][0] == k]

    def _worker_meta(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnectorWorkerMetadata

        enqueued, self._enqueued = self._enqueued, []
        copies, self._completed_host_copies = self._completed_host_copies, []
        heat = self.selection_heat.end_step() if self.selection_heat is not None else None
        # Transfers complete in the step that enqueues them (CPU copies are synchronous), or completion_lag
        # steps later.
        self._completing.append(enqueued)
        completed = self._completing.popleft()
        if not enqueued and not completed and not copies and heat is None:
            return None
        args = ({t: 1 for t in enqueued}, {t: 1 for t in completed}, tuple(copies))
        if self.mode == "hisparse":
            from hisparse.integrations.vllm.connector import HisparseWorkerMetadata

            meta = HisparseWorkerMetadata(*args, heat=heat)
        else:
            meta = HiSparseConnectorWorkerMetadata(*args)
        for _ in range(self.tp - 1):  # the other ranks ran the same copies (KVOutputAggregator)
            meta = meta.aggregate(pickle.loads(pickle.dumps(meta)))
        return meta

    def _zero_block(self, block: int) -> None:
        if not self.data:
            return
        self.slab[:, block * BLOCK:(block + 1) * BLOCK] = 0

    def _copy_block(self, src: int, dst: int) -> None:
        if not self.data:
            return
        self.slab[:, dst * BLOCK:(dst + 1) * BLOCK] = self.slab[:, src * BLOCK:(src + 1) * BLOCK]

    # ------------------------------------------------------------------ forward

    def _forward(self, so, meta) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        reads: list[tuple[_Req, int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.reqs[rid]
            start = req.num_computed
            drafts = list(so.scheduled_spec_decode_tokens.get(rid, ()))
            if drafts and drafts[0] == -1:
                # Async scheduling: the scheduler sends placeholders and counted last step's drafts as
                # computed before knowing how many were accepted; vLLM's worker keeps the drafts its MTP
                # proposed and its own count of the tokens it holds (Model Runner V2), and so does this one.
                drafts = self.drafts(rid, len(drafts))
                start = min(start, len(req.tokens) - 1)
            real_end = start + n - len(drafts)
            if real_end > len(req.tokens):
                raise CheckFailed(f"{rid}: scheduled up to position {real_end} but only {len(req.tokens)} tokens exist")
            # Draft tokens are written where they stand; a rejected one is rewritten when its position is
            # scheduled again.
            hashes = req.hashes[:real_end]
            if drafts:
                hashes = np.concatenate([hashes, prefix_hashes(np.asarray(drafts), hashes[-1])])
            req.step_hashes = hashes
            if self.data:
                self._write(rid, req, np.arange(start, start + n), hashes[start:start + n])
            if real_end < len(req.tokens):
                sampled[rid] = []  # a prefill chunk: nothing sampled yet
                continue
            accepted: list[int] = []
            for i, d in enumerate(drafts):
                if d != next_token(hashes[real_end - 1 + i]):
                    break
                accepted.append(d)
            new = accepted + [next_token(hashes[real_end - 1 + len(accepted)])]
            self.stats.drafts_accepted += len(accepted)
            self.stats.drafts_rejected += len(drafts) - len(accepted)
            for t in new:
                req.tokens.append(t)
                req.hashes = np.append(req.hashes, prefix_hashes(np.asarray([t]), req.hashes[-1]))
            sampled[rid] = new
            # One query row for the last real token and one per draft, each reading its causal prefix.
            for q in range(len(drafts) + 1):
                reads.append((req, real_end + q))
        if self.mode != "plain" and meta is not None and self.data:
            self._mirror(so)
        if self.reads and self.data and reads:
            self._read(reads)
        return sampled

    def drafts(self, req_id: str, k: int) -> list[int]:
        """MTP-like drafts: the model's own continuation for a while, then a wrong token."""
        req = self.reqs.get(req_id)
        if req is None or not k:
            return []
        rng = np.random.default_rng((req.seed, len(req.tokens)))
        good = int(rng.integers(0, k + 1))
        h = req.hashes[-1]
        out = []
        for i in range(k):
            t = next_token(h) if i < good else 1
            out.append(t)
            h = prefix_hashes(np.asarray([t]), h)[0]
        return out

    def _write(self, rid: str, req: _Req, positions: np.ndarray, hashes: np.ndarray) -> None:
        pages, offs = positions // BLOCK, positions % BLOCK
        if self.mode == "plain":
            blocks = np.asarray(req.block_ids[0], dtype=np.int64)[pages]
            slots = torch.as_tensor(blocks * BLOCK + offs)
            for layer in self.layers:
                self.slab[layer, slots] = torch.from_numpy(tags(hashes, positions, layer))
            self.slab[self.parts, slots] = torch.from_numpy(tags(hashes, positions, 1000))
            return
        idx = np.asarray(req.block_ids[self.indexer_group], dtype=np.int64)[pages]
        self.slab[self.parts, torch.as_tensor(idx * BLOCK + offs)] = torch.from_numpy(tags(hashes, positions, 1000))
        slots_by_group = []
        for k, gid in enumerate(self.resident_groups):
            blocks = np.asarray(req.block_ids[gid], dtype=np.int64)[pages]
            slots = blocks * BLOCK + offs
            slots_by_group.append(slots)
            for layer in self._layers_of_group(k):
                if layer in self.layers:
                    self.slab[self.layer_of[layer][1], torch.as_tensor(slots)] = \
                        torch.from_numpy(tags(hashes, positions, layer))
        self._written[rid] = np.stack(slots_by_group)

    def _mirror(self, so) -> None:
        """Mirror exactly the written rows inside the scheduler's envelopes (worker.py:104, 513)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.worker import _select_written_row_mirrors

        written, self._written = self._written, {}
        for rid, slots in written.items():
            candidates = tuple(self._mirrors.get(rid, ()))
            for k in range(len(self.resident_groups)):
                chosen = _select_written_row_mirrors(candidates, slots[k], k)
                for m in chosen:
                    src = torch.arange(m.source_starts[k], m.source_starts[k] + m.num_rows)
                    dst = slice(m.destination_start, m.destination_start + m.num_rows)
                    for layer in self._layers_of_group(k):
                        self.host[self.host_index[layer], dst] = self.slab[self.layer_of[layer][1], src]

    # ------------------------------------------------------------------ reads

    def _topk(self, req: _Req, layer: int, seq_len: int) -> np.ndarray:
        """An indexer-like selection: a sink, a local window, and the rest drawn from the request's
        favourite pages (40% of them, the same in every layer), so that some pages are never selected;
        all positions when the sequence is shorter than top-K. ``selection="locality"``: the per-page model
        of :mod:`hisparse.tools.locality` instead (:meth:`_topk_locality`)."""
        if seq_len <= TOP_K:
            return np.arange(seq_len, dtype=np.int32)
        layer = self.leader_of[layer]  # a layer without an indexer reads its leader's selection
        if self.selection == "locality":
            return self._topk_locality(req, layer, seq_len)
        rng = np.random.default_rng((req.seed, layer, seq_len))
        local = np.arange(max(0, seq_len - 512), seq_len)
        sink = np.arange(min(64, seq_len))
        num_pages = -(-seq_len // BLOCK)
        favourite = np.flatnonzero(np.random.default_rng(req.seed).random(num_pages) < 0.4)
        pool = (favourite[:, None] * BLOCK + np.arange(BLOCK)[None, :]).ravel()
        pool = pool[pool < seq_len]
        chosen = np.unique(np.concatenate([sink, local]))
        pool = np.setdiff1d(pool, chosen, assume_unique=False)
        rest = TOP_K - len(chosen)
        if rest > 0 and len(pool):
            chosen = np.concatenate([chosen, rng.choice(pool, size=min(rest, len(pool)), replace=False)])
        return np.sort(chosen[:TOP_K]).astype(np.int32)

    def _topk_locality(self, req: _Req, leader: int, seq_len: int) -> np.ndarray:
        """The selection of :class:`hisparse.tools.locality.SelectionStream` (sinks, a recent window, drifting
        topic spans with reuse, fitted to the published miss rates), one stream per request and index group,
        advanced to each position read. A position read again (another rank, a draft verified, a step
        replayed) gets the same answer while it is among the last 64 read; an older one is drawn anew."""
        from hisparse.tools import locality

        key = (req.seed, leader)
        if key not in self._streams:
            params = locality.Params(top_k=TOP_K, context=seq_len)
            self._streams[key] = (locality.SelectionStream(params, seed=list(key)), {})
        stream, answers = self._streams[key]
        if seq_len not in answers:
            stream.length = seq_len
            answers[seq_len] = stream.select().astype(np.int32)
            if len(answers) > 64:
                del answers[min(answers)]
        return answers[seq_len]

    def _read(self, reads: list[tuple[_Req, int]]) -> None:
        for layer in self.layers:
            topk = np.full((len(reads), TOP_K), -1, dtype=np.int32)
            for i, (req, seq_len) in enumerate(reads):
                sel = self._topk(req, layer, seq_len)
                topk[i, :len(sel)] = sel
            if self.mode == "plain":
                rows = self._plain_rows(reads, topk)
                slab = self.slab[layer]
            else:
                rows = self._resolve(reads, topk, layer)
                slab = self.slab[self.layer_of[layer][1]]
            self._check(reads, topk, rows, slab, layer)
        self._check_indexer(reads)

    def _plain_rows(self, reads, topk: np.ndarray) -> np.ndarray:
        rows = np.full(topk.shape, -1, dtype=np.int64)
        for i, (req, _) in enumerate(reads):
            valid = topk[i] >= 0
            pos = topk[i][valid].astype(np.int64)
            blocks = np.asarray(req.block_ids[0], dtype=np.int64)[pos // BLOCK]
            rows[i, valid] = blocks * BLOCK + pos % BLOCK
        return rows

    def _resolve(self, reads, topk: np.ndarray, layer: int) -> np.ndarray:
        from hisparse.datapath import resolve_reference

        k, part = self.layer_of[layer]
        hot_gid = self.hot_groups[k]
        n = len(reads)
        seq_lens = torch.zeros(self.max_rows, dtype=torch.int32)
        host_table = torch.full((self.max_rows, self.max_pages), -1, dtype=torch.int32)
        hb = self.hot_rows // BLOCK
        hot_blocks = torch.zeros(self.max_rows, hb, dtype=torch.int32)
        for req, seq_len in reads:
            seq_lens[req.row] = seq_len
            src = torch.as_tensor(req.block_ids[self.source_group][:self.max_pages], dtype=torch.int32)
            host_table[req.row, :len(src)] = torch.where(src > 0, src, torch.tensor(-1, dtype=torch.int32))
            hot = tuple(req.block_ids[hot_gid][:hb])
            if hot and k == 0 and hot != req.hot_blocks:
                self._reset_hot(req)  # a new hot region starts empty
                req.hot_blocks = hot
            if hot:
                hot_blocks[req.row, :len(hot)] = torch.as_tensor(hot, dtype=torch.int32)
        row_state = torch.as_tensor([req.row for req, _ in reads], dtype=torch.int32)
        out = torch.empty(n, TOP_K, dtype=torch.int32)
        before = int(self.counters[1])
        resolve_reference(topk=torch.from_numpy(topk), row_state=row_state, seq_lens=seq_lens,
                          block_table=self.residency[k].contiguous(), host_table=host_table, hot_blocks=hot_blocks,
                          hot_pos=self.hot_pos, hot_stamp=self.hot_stamp, hot_clock=self.hot_clock,
                          heat=self.resolver_heat, status=self.status,
                          counters=self.counters, gpu_layers=[self.slab[part]],
                          host_layers=[self.host[self.host_index[layer]]],
                          group=layer, block_size=BLOCK, out=out)
        group = self.index_group_of.get(layer)  # counted once per index group, at its leader, as vLLM does
        if self.selection_heat is not None and group is not None and self.selection_heat.counted(group):
            # What _CountingRuntime does after vLLM's resolve: each query row is its own batch row here.
            self.selection_heat.count(torch.from_numpy(topk), torch.arange(n, dtype=torch.int32), row_state)
        self.stats.rows_from_host += int(self.counters[1]) - before
        return out.numpy().astype(np.int64)

    def _check(self, reads, topk: np.ndarray, rows: np.ndarray, slab: torch.Tensor, layer: int) -> None:
        for i, (req, seq_len) in enumerate(reads):
            valid = topk[i] >= 0
            pos = topk[i][valid].astype(np.int64)
            r = rows[i][valid]
            if (r < 0).any():
                bad = pos[r < 0][:5]
                status = int(self.status[req.row]) if self.mode != "plain" else 0
                raise CheckFailed(f"layer {layer}: positions {bad.tolist()} of a request could not be read "
                                  f"(seq_len {seq_len}, resolver status {status})")
            got = slab[torch.as_tensor(r)].numpy()
            want = tags(req.step_hashes[pos], pos, layer)
            if not np.array_equal(got, want):
                wrong = np.flatnonzero((got != want).any(axis=1))
                raise CheckFailed(f"layer {layer}: {len(wrong)} of {len(pos)} rows read differ from what was "
                                  f"written, e.g. position {int(pos[wrong[0]])} (row {int(r[wrong[0]])})")
            self.stats.rows_checked += len(pos)

    def _check_indexer(self, reads) -> None:
        """The indexer scans every key of the request each step; they stay resident."""
        gid = 0 if self.mode == "plain" else self.indexer_group
        for req, seq_len in reads:
            pos = np.arange(seq_len)
            blocks = np.asarray(req.block_ids[gid], dtype=np.int64)[pos // BLOCK]
            got = self.slab[self.parts, torch.as_tensor(blocks * BLOCK + pos % BLOCK)].numpy()
            if not np.array_equal(got, tags(req.step_hashes[:seq_len], pos, 1000)):
                raise CheckFailed("an indexer key row differs from what was written")
            self.stats.indexer_rows_checked += seq_len


def _digest(so, meta) -> tuple:
    """What the scheduler decided in a step and every field of the (HiSparse) connector metadata it sent,
    for step-by-step comparisons."""
    cached = so.scheduled_cached_reqs
    return (
        tuple(sorted(so.num_scheduled_tokens.items())),
        tuple((n.req_id, n.block_ids) for n in so.scheduled_new_reqs),
        tuple(zip(cached.req_ids, map(tuple, (b or () for b in cached.new_block_ids)), strict=True)),
        tuple(sorted(so.preempted_req_ids or ())),
        None if meta is None else (
            meta.command.page_transfers if meta.command is not None else None,
            meta.host_block_copies,
            meta.source_block_ids,
            meta.row_mirrors,
            meta.all_context_pages_resident,
            tuple(sorted((r, tuple(u.pages), u.block_ids) for r, u in meta.residency_updates.items())),
        ),
    )


def _split_metadata(worker, meta) -> tuple:
    """(HiSparse's metadata, the offloading connector's) out of what the scheduler sent: vLLM's
    ``MultiKVConnectorMetadata`` holds its children's in configuration order (HiSparse first)."""
    if meta is None:
        return None, None
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorMetadata

    if isinstance(meta, MultiKVConnectorMetadata):
        hisparse, offload = meta.metadata
        if not hasattr(hisparse, "row_mirrors"):  # the offloading child configured first
            hisparse, offload = offload, hisparse
        return hisparse, offload
    return (None, meta) if worker.offload is not None else (meta, None)


class TierCopyWorker:
    """CPU stand-in for vLLM's ``CPUOffloadingWorker`` (``v1/kv_offload/cpu/gpu_worker.py``), the offloading
    connector's copy engine, which needs CUDA (device tensors, a stream and events per transfer, the
    ``swap_blocks`` kernels). vLLM's ``OffloadingConnectorWorker`` drives it unchanged, through the same
    ``OffloadingWorker`` calls: ``submit_store`` / ``submit_load`` / ``get_finished`` / ``wait``.

    The tier holds, per CPU chunk, the rows of the offloaded groups' blocks (the indexer keys beside HiSparse,
    every layer without it) as the harness writes them. A copy is made when its job *completes*, not when it
    is submitted, as a DMA reads the GPU block when it runs: a block vLLM reuses before a store has passed
    (without flushing it) is caught as wrong rows when they are loaded back. Jobs complete late and out of
    order: each ``get_finished`` completes a random half of those pending, any older than ``max_lag`` calls,
    in a shuffled order; ``wait`` (vLLM's sync loads and flushes) completes the named jobs at once."""

    def __init__(self, worker: FakeWorker, parts: list[int], blocks_per_chunk: int, seed: int, max_lag: int):
        self.worker = worker
        self.parts = parts
        self.bpc = blocks_per_chunk
        self.rng = np.random.default_rng(seed)
        self.max_lag = max_lag
        self.chunks: dict[int, torch.Tensor] = {}
        self.pending: dict[int, list] = {}  # job id -> [store?, gpu spec, cpu chunk ids, age]
        self._latest = -1
        self.waited: list[int] = []  # completed by wait(), reported by the next get_finished()

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        self.pending[job_id] = [True, src_spec, np.asarray(dst_spec.block_ids), 0]
        return True

    def submit_load(self, job_id, src_spec, dst_spec, expedited: bool = False) -> bool:
        self.pending[job_id] = [False, dst_spec, np.asarray(src_spec.block_ids), 0]
        if expedited:
            self.worker.stats.tier_sync_loads += 1
        else:
            self.worker.stats.tier_async_loads += 1
        return True

    def get_finished(self):
        from vllm.v1.kv_offload.base import TransferResult

        done = []
        for job_id, entry in list(self.pending.items()):
            entry[3] += 1
            if entry[3] > self.max_lag or self.rng.random() < 0.5:
                done.append(job_id)
        order = self.rng.permutation(len(done)) if done else []
        done = [done[i] for i in order]
        for job_id in done:
            self._complete(job_id)
        done, self.waited = self.waited + done, []
        return [TransferResult(job_id=j, success=True) for j in done]

    def wait(self, job_ids) -> None:
        """Completes the jobs now; they are still reported by the next ``get_finished``, as vLLM's handlers
        report a transfer whose event was synchronized."""
        for job_id in sorted(job_ids):
            if job_id in self.pending:
                self._complete(job_id)
                self.waited.append(job_id)

    def _complete(self, job_id: int) -> None:
        store, gpu_spec, chunk_ids, _ = self.pending.pop(job_id)
        # Out of order: a job completing after a later-submitted one did (vLLM's job ids grow).
        self.worker.stats.tier_jobs_reordered += int(job_id < self._latest)
        self._latest = max(self._latest, job_id)
        for block, chunk, slot in self._pairs(gpu_spec, chunk_ids):
            if store:
                self.worker.stats.tier_blocks_stored += 1
            else:
                self.worker.stats.tier_blocks_loaded += 1
            if not self.worker.data:
                continue
            rows = slice(block * BLOCK, (block + 1) * BLOCK)
            tier_rows = slice(slot * BLOCK, (slot + 1) * BLOCK)
            if store:
                held = self.chunks.setdefault(chunk, torch.zeros(len(self.parts), self.bpc * BLOCK, ROW,
                                                                 dtype=torch.uint8))
                held[:, tier_rows] = self.worker.slab[self.parts, rows]
            else:
                if chunk not in self.chunks:
                    raise CheckFailed(f"the offloading tier was asked to load chunk {chunk}, never stored")
                self.worker.slab[self.parts, rows] = self.chunks[chunk][:, tier_rows]

    def _pairs(self, gpu_spec, chunk_ids):
        """(GPU block, CPU chunk, block slot in the chunk), as ``SingleDirectionOffloadingHandler`` pairs them:
        per group, ``block_indices`` gives the first block's index in the request, so a group may start or
        end mid-chunk."""
        g = c = 0
        block_ids = np.asarray(gpu_spec.block_ids)
        for size, index in zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True):
            if not size:
                continue
            skip = index % self.bpc
            n_chunks = -(-(size + skip) // self.bpc)
            chunks = chunk_ids[c:c + n_chunks]
            for i in range(size):
                yield int(block_ids[g + i]), int(chunks[(skip + i) // self.bpc]), (skip + i) % self.bpc
            g += size
            c += n_chunks

    def shutdown(self) -> None:
        self.pending.clear()
        self.waited.clear()



def _offload_worker(setup: Setup, worker: FakeWorker, *, seed: int, max_lag: int):
    """vLLM's ``OffloadingConnector`` in the worker role (the MultiConnector child's config, as vLLM builds
    it), its ``OffloadingConnectorWorker`` given a :class:`TierCopyWorker` in place of the CUDA copy engine
    that ``register_kv_caches`` would build from the GPU tensors."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    vc = setup.vllm_config
    child = vc
    if vc.kv_transfer_config.kv_connector == "MultiConnector":
        (child,) = [c for cls, c in MultiConnector._get_connector_classes_and_configs(vc) if cls is OffloadingConnector]
    connector = OffloadingConnector(child, KVConnectorRole.WORKER, setup.kv_cache_config)
    parts = list(range(worker.parts + 1)) if worker.mode == "plain" else [worker.parts]
    tier = TierCopyWorker(worker, parts, connector.connector_worker.spec.blocks_per_chunk, seed, max_lag)
    connector.connector_worker.worker = tier
    return connector, tier


def _layer(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


def _seed(req_id: str) -> int:
    return int.from_bytes(req_id.encode()[-8:].rjust(8, b"\0"), "little")


# ---------------------------------------------------------------------------------------------- engine loop


@dataclass
class Job:
    req_id: str
    prompt: list[int]
    max_tokens: int
    arrival: int = 0


def prompt(seed: int, length: int, shared: list[int] | None = None) -> list[int]:
    """A prompt of ``length`` tokens, starting with ``shared`` when given (a common prefix)."""
    head = list(shared or [])
    rng = np.random.default_rng(seed)
    return head + [int(t) for t in rng.integers(2, VOCAB, size=length - len(head))]


def greedy(tokens: list[int], n: int) -> list[int]:
    """The ``n`` tokens the fake model generates after ``tokens`` (greedy, a function of the prefix; MTP
    drafts change only how many come per step): what a conversation's next turn carries forward."""
    h = prefix_hashes(np.asarray(tokens))[-1]
    out = []
    for _ in range(n):
        t = next_token(h)
        out.append(t)
        h = prefix_hashes(np.asarray([t]), h)[0]
    return out


def conversation(name: str, seed: int, *, first: int, later: int, output: int, turns: int,
                 arrival: int = 0) -> tuple[Job, dict[str, Job]]:
    """A multi-turn agent conversation (OpenHands-style): a ``first``-token first turn, then turns whose
    prompt is the previous turn's prompt, its answer (``output`` tokens, :func:`greedy`) and ``later`` new
    tokens, so each turn's prompt starts with everything before it. Returns the first turn and the
    follow-ups for :func:`run`'s ``then``."""
    head = Job(f"{name}-t0", prompt(seed, first), output, arrival=arrival)
    follow, last = {}, head
    for t in range(1, turns):
        tokens = last.prompt + greedy(last.prompt, output) + prompt(seed * 1000 + t, later)
        job = Job(f"{name}-t{t}", tokens, output)
        follow[last.req_id] = job
        last = job
    return head, follow


def conversations(count: int, seed: int, *, spacing: int = 0, **shape) -> tuple[list[Job], dict[str, Job]]:
    """``count`` conversations (:func:`conversation` of ``shape``) named ``c0``, ``c1``..., seeded from
    ``seed``, the first turn of each ``spacing`` steps after the last's: the jobs and :func:`run`'s ``then``."""
    jobs, then = [], {}
    for c in range(count):
        head, follow = conversation(f"c{c}", seed + c, arrival=spacing * c, **shape)
        jobs.append(head)
        then.update(follow)
    return jobs, then


def run(setup: Setup, worker: FakeWorker, jobs: list[Job], *, max_steps: int = 10_000,
        num_spec_tokens: int = 0, on_step=None, then: dict[str, Job] | None = None,
        aborts: dict[str, int] | None = None) -> Stats:
    """vLLM's engine-core loop: ``EngineCore.step`` when scheduling is synchronous, and
    ``step_with_batch_queue`` with two batches in flight when it is asynchronous (the next ``schedule()``
    runs before the last step's ``update_from_output``). Every ``schedule()`` and ``update_from_output()``
    is checked not to raise. ``then``: a request's follow-up (a conversation's next turn), sent at the step
    after the request has finished (its ``arrival`` ignored); ``aborts``: requests aborted once they have
    generated that many tokens (the API server's ``finish_requests(..., FINISHED_ABORTED)``: a client gone
    mid-turn, possibly with the step that computes it still in flight); an aborted request's follow-up is
    never sent."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request, RequestStatus

    sched = setup.scheduler
    pending = sorted(jobs, key=lambda j: j.arrival)
    then = dict(then or {})
    aborts = dict(aborts or {})
    live: set[str] = set()
    depth = 2 if setup.vllm_config.scheduler_config.async_scheduling else 1
    queue: deque = deque()
    coordinators = hisparse_coordinators(sched)
    step = 0
    while pending or sched.has_requests() or queue or live:
        if step >= max_steps:
            raise NotDone(f"not done after {max_steps} steps")
        arriving = []
        for rid in sorted(live - set(sched.requests)):  # finished since the last step: send the next turn
            live.discard(rid)
            if rid in then:
                arriving.append(then.pop(rid))
        for rid, after in list(aborts.items()):
            request = sched.requests.get(rid)
            if request is not None and request.num_output_tokens >= after:
                del aborts[rid]
                if sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED):
                    worker.stats.aborted += 1
                    then.pop(rid, None)
        while pending and pending[0].arrival <= step:
            arriving.append(pending.pop(0))
        for job in arriving:
            params = SamplingParams(max_tokens=job.max_tokens, ignore_eos=True, temperature=0.0)
            sched.add_request(Request(job.req_id, job.prompt, params, None, block_hasher=setup.block_hasher))
            live.add(job.req_id)
        scheduled = False
        if sched.has_requests() and len(queue) < depth:
            so = schedule(sched)
            worker.stats.running_samples.append(len(sched.running))
            if sched.waiting:
                worker.stats.pressure_samples.append(len(sched.running))
            worker.stats.max_running = max(worker.stats.max_running, len(sched.running))
            # Even an empty step reaches the workers (vLLM's no-forward connector path): that is where last
            # step's transfers complete and pinned blocks come back.
            queue.append((so, worker.execute(so)))
            scheduled = so.total_num_scheduled_tokens > 0
            worker.stats.preemptions += len(so.preempted_req_ids or ())
        if queue and (len(queue) == depth or not scheduled):
            so, out = queue.popleft()
            try:
                sched.update_from_output(so, out)
            except Exception as e:  # noqa: BLE001 - as for schedule(): it would kill vLLM's engine core
                raise CheckFailed(f"an exception escaped update_from_output(): {type(e).__name__}: {e}") from e
            if num_spec_tokens and depth == 1:
                ids = [r.request_id for r in sched.running]
                sched.update_draft_token_ids(DraftTokenIds(ids, [worker.drafts(r, num_spec_tokens) for r in ids]))
        for coordinator in coordinators:
            coordinator.check_rows()  # the core's record of vLLM's rows is vLLM's, after every step
            if coordinator.counters["rows_reread"]:
                raise CheckFailed("a row changed where the core's record of it was not told (re-read from vLLM)")
        if on_step is not None:
            on_step(step)
        step += 1
    return worker.stats


def hisparse_coordinators(sched) -> list:
    """hisparse's coordinator behind the scheduler's connector (alone or a ``MultiConnector`` child), if any."""
    connectors = getattr(sched.connector, "sub_connectors", None) or [sched.connector]
    found = [getattr(c.connector_scheduler, "coordinator", None) for c in connectors
             if getattr(c, "connector_scheduler", None) is not None]
    return [c for c in found if hasattr(c, "check_rows")]


def run_recording(setup: Setup, jobs: list[Job], *, completion_lag: int = 2, **run_options) -> tuple[Stats, list]:
    """Runs a trace (``run``'s options) and returns, per step, what the scheduler sent (``_digest``: its
    decisions and every connector metadata field) and what it keeps that the metadata does not show (host
    prefix publication, the GPU copies it records): equal step by step for two coordinators that make the same
    decisions. Copies complete ``completion_lag`` steps late, as a GPU's DMA would, so pages stay pending
    across steps. A run not done after ``max_steps`` raises ``NotDone`` with the recording so far."""
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator

    worker = FakeWorker(setup, layers=[0, 60], record=True, completion_lag=completion_lag)
    coord = setup.scheduler.connector.connector_scheduler.coordinator
    host_cache = coord.host_manager.block_pool.cached_block_hash_to_block._cache
    kept = []

    def on_step(step):
        # Our cache of requests that hold their hot regions holds nothing else (checked against vLLM's test).
        stale = [rid for rid in getattr(coord, "_reads_host", ())
                 if not HiSparseCoordinator._can_read_from_host(coord, rid)]
        assert not stale, f"step {step}: {stale} no longer read from the host"
        book = lifecycle(coord)
        kept.append((len(host_cache), len(book["copies"]), sorted(
            (rid, st["publication"] is not None, st["copies_recorded"], st["ready_prefix"])
            for rid, st in book["requests"].items())))

    try:
        stats = run(setup, worker, jobs, on_step=on_step, **run_options)
    except NotDone as e:
        e.recording = [worker.stats.trace, kept]
        raise
    return stats, [stats.trace, kept]


def lifecycle(coord) -> dict:
    """The page lifecycle of a HiSparse coordinator, ours (``Bookkeeping.lifecycle``: the core's book) or
    vLLM's (read from its Python state into the same shape): ``requests`` (request -> ``valid``,
    ``ready_prefix``, ``copying`` {page: transfer}, ``pinned_clean``, ``released``, ``stale``, ``synced``,
    ``to_adopt``, ``copies_recorded``, ``publication`` (computed tokens, pages) or None), ``transfers``
    (``(id, request, page, host block, resident blocks, pins released, live, detached)``, by id: live, of
    the request's live state; detached, a finished request's prefix waiting on it), ``owners`` (released
    block -> ``(request, page)`` pairs), ``copies`` (host block key -> GPU blocks) and ``copy_keys`` (GPU
    block -> the key of the copy it holds)."""
    if hasattr(coord, "lifecycle"):
        return coord.lifecycle()
    requests = {
        rid: {"valid": sorted(st.valid_pages), "ready_prefix": st.ready_prefix_pages,
              "copying": dict(st.pending_pages), "pinned_clean": sorted(st.pinned_clean),
              "released": sorted(st.unpinned_pages), "stale": sorted(st.stale_pages), "synced": st.synced_pages,
              "to_adopt": st.pages_to_adopt, "copies_recorded": st.copies_recorded_blocks,
              "publication": None if st.publication is None else (st.publication.num_computed_tokens,
                                                                    st.publication.num_pages)}
        for rid, st in coord.request_states.items()}
    transfers = [(tid, p.page[0], p.page[1], p.host_block.block_id, tuple(b.block_id for b in p.resident_blocks),
                  p.enqueue_applied, coord.request_states.get(p.page[0]) is p.request_state,
                  p.request_state.publication is not None and p.request_state.publication.detached_blocks is not None)
                 for tid, p in sorted(coord.pending_spills.items())]
    owners = {block: sorted(o) for block, o in coord._owners.items() if o}
    copies = {h: tuple(b.block_id for b in blocks) for h, blocks in coord.copies.items()}
    return {"requests": requests, "transfers": transfers, "owners": owners, "copies": copies,
            "copy_keys": dict(coord._copy_by_block)}


def schedule(sched):
    """``Scheduler.schedule()``: anything it raises would kill vLLM's engine core, so it fails the test."""
    try:
        return sched.schedule()
    except Exception as e:  # noqa: BLE001 - the point is that nothing escapes
        raise CheckFailed(f"an exception escaped schedule(): {type(e).__name__}: {e}") from e


