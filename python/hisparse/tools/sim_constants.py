"""Every constant ``hisparse simulate`` uses, with where it comes from.

Nothing here is fitted to the result the simulator is compared with (the vLLM blog's 5-6 running requests
for the offload baseline and 19-25 for Hybrid HiSparse at concurrency 32). Numbers are either the published
workload and deployment of that benchmark, public model/hardware specifications, or public measurements;
derived values are computed below from those, never typed in.

Sources (short names used in the comments):

* [blog]     vLLM blog, "Hybrid HiSparse", GLM-5.3 part 1 (workload, deployment, host pools, MTP hot buffers
             ``(k + 2) * top_k``, 5-6 vs 19-25 running requests at concurrency 32).
* [calc]     the public vLLM HiSparse concurrency calculator, reproduced by :mod:`hisparse.tools.calc` (KV HBM per
             GPU: 0.92 * 141 GB - weights - 15 GiB = 17.8 GiB for GLM-5.3 FP8 on 8xH200 TP8).
* [flashmla] deepseek-ai/FlashMLA README: the fp8 sparse-MLA KV row is 656 B (512 fp8 latent values, four fp32
             scales, 64 bf16 rope values), vLLM's ``fp8_ds_mla``; the DSA indexer key row is 128 fp8 values and one
             fp32 scale (132 B), DeepSeek-V3.2-Exp ``inference/model.py``.
* [hf]       Hugging Face ``transformers`` ``configuration_glm_moe_dsa.py`` and the IndexCache paper (arXiv
             2603.12201): GLM-5.3 has 78 sparse-MLA layers and 21 indexers (IndexShare: one per 4 layers),
             index_topk 2048.
* [vllm]     vLLM 0.33 ``vllm/v1/hisparse/``: ``ACTIVE_TAIL_PAGES = 2``, the hot LRU kept in int16 (at most
             32,768 rows).
* [nvbw]     NVIDIA nvbandwidth, pinned host <-> device copies over PCIe Gen5 x16: ~55 GB/s per direction
             (H100; the H200 SXM has the same host link).
* [paper]    HiSparse paper (arXiv 2608.07009), GLM-5.1, top_k 2048: hot-buffer miss rate ~30% with a buffer of
             top_k rows, 13.4% with 2 x top_k, 6.7% with 4 x top_k.
* [cookbook] SGLang GLM-5 cookbook, GLM-5-FP8 on 8xH200 TP8 with EAGLE/MTP (3 steps, 4 draft tokens), batch 1:
             TPOT 7.54 ms (mean), accept length 3.48; quoted in
             https://gist.github.com/BenHamm/dcd09f595fef141567a39582f502cef4 (8xB200 vs 8xH200 report).
* [lambda]   https://lambda.ai/inference-models/zai-org/glm-5: GLM-5 is 744B parameters, 40B active per token
             (GLM-5.3 keeps the GLM-5 shapes; hisparse calc's glm-5.3 preset uses the same architecture).
* [lmsys]    LMSYS blog 2025-05-05 "Deploying DeepSeek with PD Disaggregation and Large-scale Expert
             Parallelism on 96 H100 GPUs": 52.3k input tokens/s per 8-GPU node, 2000-token inputs,
             DeepSeek-V3 (37B active).
* [streamingllm] Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.
* [h200]     NVIDIA H200 SXM datasheet: FP8 Tensor Core 3,958 TFLOPS with sparsity = 1,979 TFLOPS dense (the
             same tensor cores as H100 SXM, so [lmsys]'s H100 efficiency carries over).
"""

from __future__ import annotations

# --------------------------------------------------------------------------- workload [blog]
TURNS = 13  # turns per OpenHands-style conversation
FIRST_TURN_TOKENS = 74_160  # prompt of turn 1
LATER_TURN_TOKENS = 753  # new user tokens of every later turn (the whole conversation so far comes before them)
OUTPUT_TOKENS = 220  # output tokens of every turn, EOS ignored
CONCURRENCY = (1, 8, 16, 24, 32)  # conversations in flight; the next turn is sent when the answer ends
# Users' first requests spread over this many seconds (not published; a benchmark client starts its users within
# a short while, and a spread keeps the conversations' turns from moving in lockstep).
ARRIVAL_SPREAD_S = 60.0
MAX_MODEL_LEN = 142_000
MAX_NUM_BATCHED_TOKENS = 32_768
MAX_NUM_SEQS = 256

# --------------------------------------------------------------------------- deployment [blog] [calc]
GPU = "h200"
TP = 8
KV_DTYPE = "fp8"
SPECULATIVE_TOKENS = 3  # MTP3
OFFLOAD_HOST_GIB = 512.0  # the offload baseline's CPU pool
HISPARSE_HOST_GIB = 384.0  # Hybrid HiSparse pool (sparse-MLA KV)
INDEXER_OFFLOAD_GIB = 128.0  # Hybrid HiSparse: OffloadingConnector pool for the indexer keys (never binds here)
BLOCK_TOKENS = 64

# --------------------------------------------------------------------------- model [hf] [flashmla]
MODEL = "glm-5.3"
MLA_LAYERS = 78
INDEXER_LAYERS = 21
MLA_ROW_BYTES = 656  # vLLM fp8_ds_mla: 512 fp8 latent + 16 B scales + 64 bf16 rope values
INDEXER_ROW_BYTES = 132  # 128 fp8 + one fp32 scale
TOP_K = 2048
INDEX_GROUPS = 21  # one top-K per indexer (IndexShare); the core keeps one hot region for all of them
MLA_HEADS = 64  # GLM-5 attention heads (hisparse calc's architecture)
MLA_QK_DIM = 576  # absorbed sparse MLA: 512 latent + 64 rope per key
MLA_V_DIM = 512
INDEXER_HEADS = 32
INDEXER_HEAD_DIM = 128
ACTIVE_PARAMS = 40e9  # [lambda]

# Hot buffer: the blog sizes MTP hot buffers as (k + 2) * top_k rows ("must accommodate all verification
# tokens at once"); vLLM's code default is (q + 1) * top_k. The simulator defaults to the blog's sizing
# (the published run is the blog's); --hot-rows overrides it.
HOT_ROWS_MTP_EXTRA = 2  # hot rows = (SPECULATIVE_TOKENS + HOT_ROWS_MTP_EXTRA) * TOP_K
HOT_ROWS_LIMIT = 32_768  # vLLM keeps the hot LRU in int16 [vllm]
TAIL_PAGES = 2  # vLLM ACTIVE_TAIL_PAGES [vllm]
MATERIALIZE_BUDGET = 256  # page copies per step and direction (the core's default)

# --------------------------------------------------------------------------- Top-K locality [paper]
# The selection stream is hisparse.tools.locality's model, fitted to two of the paper's miss rates (30% / 13.4% /
# 6.7% with 1x / 2x / 4x top_k hot rows) and checked on the third (benches/locality_check.py).
TOP_K_SINKS = 4  # sink tokens at top_k 2048 (scaled with top_k for other top_k), [streamingllm]
# Heat summaries: hisparse.WorkerHooks' defaults (every 32 steps, 128 coldest and 32 hottest pages per request).
HEAT_INTERVAL = 32
HEAT_COLDEST = 128
HEAT_HOTTEST = 32

# --------------------------------------------------------------------------- time
COOKBOOK_TPOT_S = 7.54e-3  # [cookbook]
MTP_ACCEPT_LENGTH = 3.48  # [cookbook]: tokens emitted per decode step with 3 drafts
DECODE_STEP_S = COOKBOOK_TPOT_S * MTP_ACCEPT_LENGTH  # 26.2 ms: one MTP3 decode step

H200_FP8_DENSE_FLOPS = 1.979e15  # [h200]
LMSYS_PREFILL_TOKENS_PER_S = 52.3e3  # [lmsys], per 8-GPU node
LMSYS_ACTIVE_PARAMS = 37e9  # DeepSeek-V3
# The MFU [lmsys] implies, counting only the 2 * active-params linear FLOPs (attention over 2000 tokens is
# left out, so this errs low): 52.3e3 * 74e9 / (8 * 1.979e15) = 24.4%. A TP8 vLLM node is unlikely to do
# better than that expert-parallel SGLang deployment, so this is an upper bound on prefill speed.
PREFILL_MFU = LMSYS_PREFILL_TOKENS_PER_S * 2 * LMSYS_ACTIVE_PARAMS / (8 * H200_FP8_DENSE_FLOPS)
PREFILL_FLOPS_PER_S = TP * H200_FP8_DENSE_FLOPS * PREFILL_MFU

H2D_BYTES_PER_S = 55e9  # [nvbw] pinned host -> GPU, per GPU (each TP rank copies its own replica)
D2H_BYTES_PER_S = 55e9  # [nvbw] same link, other direction (rank 0 writes the shared host pool)


def prefill_flops(tokens: int, start: int) -> float:
    """FLOPs of prefilling positions ``start .. start + tokens - 1`` of one request on the whole node:
    linear layers (2 x active params per token), sparse MLA over min(position, top_k) keys in every layer,
    and the indexer scoring every earlier key in each indexer layer."""
    if tokens <= 0:
        return 0.0
    linear = 2.0 * ACTIVE_PARAMS * tokens
    per_key_mla = 2.0 * MLA_HEADS * (MLA_QK_DIM + MLA_V_DIM) * MLA_LAYERS
    end = start + tokens
    # sum over positions p in [start, end) of min(p, TOP_K)
    below = max(0, min(end, TOP_K) - start)
    lo = start
    hi = start + below
    keys = (hi * (hi - 1) - lo * (lo - 1)) // 2 + (tokens - below) * TOP_K
    per_key_indexer = 2.0 * INDEXER_HEADS * INDEXER_HEAD_DIM * INDEXER_LAYERS
    positions = (end * (end - 1) - start * (start - 1)) // 2
    return linear + per_key_mla * keys + per_key_indexer * positions
