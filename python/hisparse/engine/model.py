"""A tiny DSA-style decoder (sparse MLA + an indexer) whose numerics do not depend on batching.

Every value the model computes lives on a fixed dyadic grid (multiples of ``2**-8``, clamped to +-16) and
every matrix product runs in float64, where the products and sums of such values are exact: the result of a
dot product is the same whatever the order of its additions, so a token's KV row, its indexer key and its
attention output are the same bits whether it was computed in a prefill chunk of 1,000 tokens, a decode batch
of 20 requests, on a re-computation after preemption, or by another request that shared its prefix. The only
inexact operations (``sqrt`` and one division per output value) are elementwise and correctly rounded.
Softmax reads ``exp`` from a fixed table indexed by the exact grid distance to the row maximum.

An MLA KV row is ``latent`` values then ``rope`` values, stored as bfloat16 (the grid values survive the
conversion) and viewed as ``row_bytes`` uint8: the slab's byte layout. Attention reads dense rows in top-K
order (what ``resolve`` + ``gather`` return), so it sees the same bytes whatever their residency.

Layers that share one indexer (IndexShare) form an index group; ``index_share = 1`` gives every layer its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError

FRAC = 256.0  # grid: multiples of 1/256
LIMIT = 16.0  # clamp
EXP_FRAC = float(1 << 20)  # softmax weights: multiples of 2**-20
EXP_RANGE = 24  # exp(-24) ~ 4e-11: beyond, the weight is 0
ROPE_FRAC = float(1 << 14)
# The indexer works on a coarser grid (multiples of 1/64, clamped to +-8), so that its score plus a position
# tie-break (the later position wins) is one exact float64: score grid 2**-18, tie-break below it.
IDX_FRAC = 64.0
IDX_LIMIT = 8.0
IDX_GRID_BITS = 18


def fix(x: torch.Tensor, frac: float = FRAC, limit: float = LIMIT) -> torch.Tensor:
    """Rounds onto the grid (ties to even) and clamps: the only way values enter the model's state."""
    y = x * frac
    return y.round_().clamp_(-limit * frac, limit * frac).div_(frac)


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    latent: int = 128  # kv_lora_rank
    rope: int = 32  # rope dims of the MLA key
    index_heads: int = 2
    index_dim: int = 16
    top_k: int = 64
    index_share: int = 1  # layers per indexer (IndexShare)
    mlp: int = 128
    max_model_len: int = 8192
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.latent + self.rope) % 8:
            raise ConfigError(f"latent + rope ({self.latent + self.rope}) must be a multiple of 8 (16-byte rows)")
        if self.rope % 2:
            raise ConfigError("rope must be even")
        if self.index_share < 1 or self.layers < 1:
            raise ConfigError("layers and index_share must be positive")
        # |score| <= heads * dim * 8**3 on a 2**-18 grid, then max_model_len positions below the grid step.
        bits = math.log2(self.index_heads * self.index_dim * IDX_LIMIT**3) + IDX_GRID_BITS + self.position_bits
        if bits > 52:
            raise ConfigError("index_heads * index_dim * max_model_len is too large for exact indexer scores")

    @property
    def position_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.max_model_len)))

    @property
    def row_bytes(self) -> int:
        """Bytes of one MLA KV row: (latent + rope) bfloat16 values."""
        return 2 * (self.latent + self.rope)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """The index group of each layer."""
        return tuple(layer // self.index_share for layer in range(self.layers))

    @property
    def num_groups(self) -> int:
        return self.layer_groups[-1] + 1

    def first_layer(self, group: int) -> int:
        return group * self.index_share


class TinyDSA:
    """Seeded random weights; every method is a pure function of its inputs (see the module docstring)."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu"):
        self.cfg = c = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(c.seed)

        def weight(*shape: int, scale: float | None = None) -> torch.Tensor:
            scale = scale if scale is not None else 1.0 / math.sqrt(shape[0])
            w = (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale * math.sqrt(3)
            return fix(w).to(self.device)

        d = c.hidden
        self.embedding = weight(c.vocab, d, scale=0.5)
        self.w_dkv = [weight(d, c.latent) for _ in range(c.layers)]
        self.w_kr = [weight(d, c.rope) for _ in range(c.layers)]
        self.w_q = [weight(d, c.heads * c.latent) for _ in range(c.layers)]
        self.w_qr = [weight(d, c.heads * c.rope) for _ in range(c.layers)]
        self.w_o = [weight(c.heads * c.latent, d) for _ in range(c.layers)]
        self.w_up = [weight(d, c.mlp) for _ in range(c.layers)]
        self.w_down = [weight(c.mlp, d) for _ in range(c.layers)]
        self.w_iq = [weight(d, c.index_heads * c.index_dim) for _ in range(c.num_groups)]
        self.w_ik = [weight(d, c.index_dim) for _ in range(c.num_groups)]
        self.w_iw = [weight(d, c.index_heads, scale=0.5) for _ in range(c.num_groups)]
        self.w_out = weight(d, c.vocab)
        # Fixed tables, computed once on the CPU: rope angles and exp(-i / FRAC).
        half = c.rope // 2
        inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.arange(c.max_model_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = (torch.round(torch.cos(angles) * ROPE_FRAC) / ROPE_FRAC).to(self.device)
        self.sin = (torch.round(torch.sin(angles) * ROPE_FRAC) / ROPE_FRAC).to(self.device)
        steps = torch.arange(EXP_RANGE * int(FRAC) + 1, dtype=torch.float64)
        self.exp_table = (torch.round(torch.exp(-steps / FRAC) * EXP_FRAC) / EXP_FRAC).to(self.device)
        self.exp_table[-1] = 0.0
        self.score_scale = 2.0 ** -round(math.log2(math.sqrt(c.latent + c.rope)))
        positions = torch.arange(c.max_model_len, dtype=torch.float64)
        self.tie_break = (positions * 2.0 ** -(IDX_GRID_BITS + c.position_bits)).to(self.device)
        self._causal: torch.Tensor | None = None
        self.attend_rows = 64

    def _causal_mask(self, n: int) -> torch.Tensor:
        """[m, m] bool, m >= n: True above the diagonal (a query's later positions)."""
        if self._causal is None or self._causal.shape[0] < n:
            m = max(n, 1024, 0 if self._causal is None else 2 * self._causal.shape[0])
            self._causal = torch.ones(m, m, dtype=torch.bool, device=self.device).triu_(1)
        return self._causal

    # ------------------------------------------------------------------ pieces

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding[tokens.to(self.device)]

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        ms = (x * x).sum(-1, keepdim=True) * (1.0 / x.shape[-1])
        return fix(x / torch.sqrt(ms + 1.0 / FRAC))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotates the last dim of ``x`` [n, ..., rope] by ``positions`` [n]."""
        half = x.shape[-1] // 2
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
        c, s = self.cos[positions].view(shape), self.sin[positions].view(shape)
        x1, x2 = x[..., :half], x[..., half:]
        return fix(torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1))

    def indexer(self, group: int, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(queries [n, heads, dim], keys [n, dim], head weights [n, heads]) of the group's indexer."""
        c = self.cfg
        q = fix(xn @ self.w_iq[group], IDX_FRAC, IDX_LIMIT).view(-1, c.index_heads, c.index_dim)
        k = fix(xn @ self.w_ik[group], IDX_FRAC, IDX_LIMIT)
        return q, k, fix(xn @ self.w_iw[group], IDX_FRAC, IDX_LIMIT)

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, start: int) -> torch.Tensor:
        """Top-K positions [n, top_k] int32 (-1 pads) for queries at ``start .. start + n`` over ``keys``
        [start + n, dim] (the request's indexer keys): the largest ``sum_h w_h relu(q_h . k)``, causal; on
        ties the later position wins."""
        n, heads, dim = q.shape
        total = keys.shape[0]
        scores = (q.reshape(n * heads, dim) @ keys.t()).relu_()
        score = torch.bmm(w.view(n, 1, heads), scores.view(n, heads, total)).view(n, total)
        score.add_(self.tie_break[:total])
        if n > 1:  # the chunk's own future
            score[:, start:].masked_fill_(self._causal_mask(n)[:n, :n], -math.inf)
        k = min(self.cfg.top_k, total)
        values, idx = torch.topk(score, k, dim=1)
        idx = idx.masked_fill_(values == -math.inf, -1).to(torch.int32)
        if k < self.cfg.top_k:
            idx = torch.cat([idx, idx.new_full((n, self.cfg.top_k - k), -1)], dim=1)
        return idx

    def kv_rows(self, layer: int, xn: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The MLA KV rows of new tokens: [n, row_bytes] uint8 (bfloat16 latent then rope)."""
        latent = fix(xn @ self.w_dkv[layer])
        rope = self.rope(fix(xn @ self.w_kr[layer]), positions)
        return torch.cat([latent, rope], dim=-1).to(torch.bfloat16).contiguous().view(torch.uint8)

    def query(self, layer: int, xn: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Absorbed MLA queries [n, heads, latent + rope]."""
        c = self.cfg
        q = fix(xn @ self.w_q[layer]).view(-1, c.heads, c.latent)
        qr = self.rope(fix(xn @ self.w_qr[layer]).view(-1, c.heads, c.rope), positions)
        return torch.cat([q, qr], dim=-1)

    def attend(self, q: torch.Tensor, dense: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Sparse attention over the dense top-K rows ``dense`` [n, K, row_bytes] uint8 (``valid`` [n, K]):
        the latent output [n, heads, latent], float64."""
        rows = self.attend_rows
        if q.shape[0] > rows:  # in blocks of rows: the float64 copies of the rows stay in cache
            return torch.cat([self.attend(q[i: i + rows], dense[i: i + rows], valid[i: i + rows])
                              for i in range(0, q.shape[0], rows)])
        c = self.cfg
        kv = dense.view(torch.bfloat16).to(torch.float64)  # [n, K, latent + rope], exact
        scores = torch.bmm(q, kv.transpose(1, 2)) * self.score_scale  # [n, heads, K], exact
        scores = scores.masked_fill(~valid[:, None, :], -math.inf)
        top = scores.max(dim=-1, keepdim=True).values
        dist = torch.round((top - scores) * FRAC).clamp_(max=EXP_RANGE * FRAC).nan_to_num_(EXP_RANGE * FRAC)
        weights = self.exp_table[dist.to(torch.int64)]
        out = torch.bmm(weights, kv[:, :, : c.latent])
        return out / weights.sum(-1, keepdim=True)

    def finish_layer(self, layer: int, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP of one layer."""
        h = fix(h + fix(fix(out).reshape(out.shape[0], -1) @ self.w_o[layer]))
        up = torch.relu(fix(self.norm(h) @ self.w_up[layer]))
        return fix(h + fix(up @ self.w_down[layer]))

    def next_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of hidden states [n, hidden] (the first maximum on ties)."""
        return torch.argmax(self.norm(h) @ self.w_out, dim=-1)


_MULTIPLIERS: dict[tuple[int, str], torch.Tensor] = {}


def digest(x: torch.Tensor) -> torch.Tensor:
    """One int64 per row of float64 ``x`` [n, ...]: a weighted sum of its 32-bit halves with odd weights below
    2**20 (no overflow up to 2,048 values), so it changes whenever a single value of the row does."""
    bits = x.reshape(x.shape[0], -1).contiguous().view(torch.int64)
    key = (bits.shape[1], str(x.device))
    mult = _MULTIPLIERS.get(key)
    if mult is None:
        gen = torch.Generator().manual_seed(12345)
        mult = torch.randint(1, 1 << 20, (2, bits.shape[1]), generator=gen, dtype=torch.int64).to(x.device) | 1
        _MULTIPLIERS[key] = mult
    lo, hi = bits & 0xFFFFFFFF, (bits >> 32) & 0xFFFFFFFF
    return (lo * mult[0]).sum(-1) + (hi * mult[1]).sum(-1)
