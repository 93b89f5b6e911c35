"""A CPU harness that runs vLLM 0.33.0's own scheduler stack and checks every KV row a sparse-MLA step reads.

What is vLLM's, unchanged: ``VllmConfig`` (DeepSeek-V3.2 shapes from a local ``config.json``: 61 sparse-MLA
layers, 61 indexer caches, block 64, top-K 2048, ``fp8_ds_mla`` 656-byte rows), the KV cache planner
(``get_global_kv_cache_groups`` / ``get_kv_cache_configs`` with HiSparse's group layout), ``Scheduler`` and
``AsyncScheduler``, the KV cache manager and its HiSparse spec managers, the connector factory (which loads
our connector through ``kv_connector_module_path``), ``SchedulerOutput`` / ``ModelRunnerOutput`` /
``KVConnectorOutput`` and vLLM's own row-mirror selection (``_select_written_row_mirrors``).

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


def model_dir() -> str:
    """A directory holding DeepSeek-V3.2's ``config.json`` (no weights: the scheduler needs none)."""
    path = Path(tempfile.gettempdir()) / "hisparse-dsv32-config"
    path.mkdir(exist_ok=True)
    cfg = path / "config.json"
    text = json.dumps(DSV32)
    if not cfg.exists() or cfg.read_text() != text:
        cfg.write_text(text)
    return str(path)


def kv_specs():
    """The layer specs DeepSeek-V3.2's attention modules report (``mla_attention.py:1371``,
    ``deepseek_v2.py:659``): one sparse-MLA cache (656-byte ``fp8_ds_mla`` rows) and one indexer key cache
    (132-byte rows) per layer; every layer leads its own index group."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    specs = {}
    for i in range(LAYERS):
        specs[f"model.layers.{i}.self_attn.attn"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla", state_content_bytes=656, topk_buffer_width=TOP_K,
            is_index_group_leader=True)
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER)
    return specs


@dataclass
class Setup:
    vllm_config: object
    kv_cache_config: object
    scheduler: object
    block_hasher: object
    mode: str


def build(*, mode: str, gpu_gib: float, max_model_len: int = 16384, max_num_seqs: int = 32,
          max_num_batched_tokens: int = 8192, async_scheduling: bool = False, prefix_caching: bool = True,
          host_pool_gib: float = 8.0, num_spec_tokens: int = 0, extra: dict | None = None,
          num_gpu_blocks: int | None = None, device_buffer_size: int | None = None) -> Setup:
    """vLLM's engine-core setup (``v1/engine/core.py:_initialize_kv_caches`` and ``EngineCore.__init__``)
    for ``mode``: ``"plain"`` (vLLM without HiSparse), ``"native"`` (vLLM's HiSparseConnector) or
    ``"hisparse"`` (ours, by ``kv_connector_module_path``). ``gpu_gib`` of KV memory in every mode."""
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
    model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, max_model_len=max_model_len,
                        dtype="bfloat16")
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
    if mode != "plain":
        # CPU patch 2: what __post_init__ does on CUDA once it sees a connector named HiSparseConnector.
        extra_config = {"host_pool_gib": host_pool_gib, **(extra or {})}
        kv = {"kv_connector": "HiSparseConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra_config}
        if mode == "hisparse":
            kv["kv_connector_module_path"] = "hisparse.integrations.vllm"
        vc.kv_transfer_config = KVTransferConfig(**kv)
        # vLLM's --attention-config '{"hisparse_config": {"device_buffer_size": N}}': hot-region rows per request.
        vc.attention_config.hisparse_config = HiSparseConfig(device_buffer_size=device_buffer_size)
    if num_gpu_blocks is not None:
        vc.cache_config.num_gpu_blocks_override = num_gpu_blocks
    specs = kv_specs()
    register_all_kvcache_specs(vc)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([FlashMLASparseBackend,
                                                                          DeepseekV32IndexerBackend])]
    if mode != "plain":
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
    return Setup(vc, kc, scheduler, hasher, mode)


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
    # FakeWorker.rebuild: how many times the worker was rebuilt, and the transfers the dead ones had in flight.
    rebuilds: int = 0
    transfers_lost: int = 0
    prefix_hit_tokens: int = 0
    host_only_prefix_admissions: int = 0
    trace: list = field(default_factory=list)


class FakeWorker:
    """Applies each ``SchedulerOutput`` the way vLLM's GPU worker and HiSparse connector worker do, with a
    fake forward that writes tags at vLLM's slots and reads every selected top-K row back (module
    docstring). ``tp`` > 1 runs the connector metadata through vLLM's ``aggregate`` as that many ranks."""

    def __init__(self, setup: Setup, *, reads: bool = True, layers: list[int] | None = None, tp: int = 1,
                 record: bool = False, data: bool = True, completion_lag: int = 0):
        # What rebuild() starts the new worker process with: only its arguments (vLLM's config).
        self._args = {"reads": reads, "layers": layers, "tp": tp, "record": record, "data": data,
                      "completion_lag": completion_lag}
        # A late message from a worker that died (rebuild): merged into the next step's output.
        self._late = None
        kc = setup.kv_cache_config
        self.setup = setup
        self.mode = setup.mode
        self.reads = reads
        self.layers = list(range(LAYERS)) if layers is None else layers
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
            self.parts = LAYERS
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
            self.hot_pos = torch.full((self.max_rows, LAYERS, self.hot_rows), -1, dtype=torch.int32)
            self.hot_lru = torch.arange(self.hot_rows, dtype=torch.int32).repeat(self.max_rows, LAYERS, 1).contiguous()
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
        self.hot_lru[req.row] = torch.arange(self.hot_rows, dtype=torch.int32)
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
        for rid in so.finished_req_ids:
            self._drop(rid)
        for rid in so.preempted_req_ids or ():
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
        meta = so.kv_connector_metadata
        if self.record:
            self.stats.trace.append(_digest(so))
        self._fresh = {new.req_id for new in so.scheduled_new_reqs if new.num_computed_tokens}
        if self.mode != "plain" and meta is not None:
            self._start_step(meta, list(so.num_scheduled_tokens))
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
        return pickle.loads(pickle.dumps(out))

    def _start_step(self, meta, batch: list[str]) -> None:
        """``HiSparseConnectorWorker.start_step`` (worker.py:408), in its order, then what our connector's
        ``start_load_kv`` adds (``batch``: the step's request ids in batch order)."""
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
            self.selection_heat.begin_step(batch, rows, meta.residency_updates)

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
        all positions when the sequence is shorter than top-K."""
        if seq_len <= TOP_K:
            return np.arange(seq_len, dtype=np.int32)
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
                          hot_pos=self.hot_pos, hot_lru=self.hot_lru, heat=self.resolver_heat, status=self.status,
                          counters=self.counters, gpu_layers=[self.slab[part]],
                          host_layers=[self.host[self.host_index[layer]]],
                          group=layer, block_size=BLOCK, out=out)
        if self.selection_heat is not None and self.selection_heat.counted(layer):  # every layer leads a group
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


def _digest(so) -> tuple:
    """What the scheduler decided in a step and every field of the connector metadata it sent, for
    step-by-step comparisons."""
    meta = so.kv_connector_metadata
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


def run(setup: Setup, worker: FakeWorker, jobs: list[Job], *, max_steps: int = 10_000,
        num_spec_tokens: int = 0, on_step=None) -> Stats:
    """vLLM's engine-core loop: ``EngineCore.step`` when scheduling is synchronous, and
    ``step_with_batch_queue`` with two batches in flight when it is asynchronous (the next ``schedule()``
    runs before the last step's ``update_from_output``). Every ``schedule()`` is checked not to raise."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request

    sched = setup.scheduler
    pending = sorted(jobs, key=lambda j: j.arrival)
    depth = 2 if setup.vllm_config.scheduler_config.async_scheduling else 1
    queue: deque = deque()
    step = 0
    while pending or sched.has_requests() or queue:
        if step >= max_steps:
            raise CheckFailed(f"not done after {max_steps} steps")
        while pending and pending[0].arrival <= step:
            job = pending.pop(0)
            params = SamplingParams(max_tokens=job.max_tokens, ignore_eos=True, temperature=0.0)
            sched.add_request(Request(job.req_id, job.prompt, params, None, block_hasher=setup.block_hasher))
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
            sched.update_from_output(so, out)
            if num_spec_tokens and depth == 1:
                ids = [r.request_id for r in sched.running]
                sched.update_draft_token_ids(DraftTokenIds(ids, [worker.drafts(r, num_spec_tokens) for r in ids]))
        if on_step is not None:
            on_step(step)
        step += 1
    return worker.stats


def schedule(sched):
    """``Scheduler.schedule()``: anything it raises would kill vLLM's engine core, so it fails the test."""
    try:
        return sched.schedule()
    except Exception as e:  # noqa: BLE001 - the point is that nothing escapes
        raise CheckFailed(f"an exception escaped schedule(): {type(e).__name__}: {e}") from e


