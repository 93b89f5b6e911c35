"""Seeded request workloads with shared prompt prefixes."""

from __future__ import annotations

import torch

from .engine import RequestSpec


def make_workload(num_requests: int = 24, prompt_len: int = 4096, new_tokens: int = 128, families: int = 3,
                  shared_tokens: int = 2048, arrival_gap: int = 0, vocab: int = 256, seed: int = 0,
                  ) -> list[RequestSpec]:
    """``num_requests`` prompts of ``prompt_len`` random tokens; request ``i`` belongs to family
    ``i % families`` and starts with that family's ``shared_tokens`` tokens. Request ``i`` arrives at step
    ``i * arrival_gap``."""
    gen = torch.Generator().manual_seed(seed)
    shared = [torch.randint(0, vocab, (shared_tokens,), generator=gen).tolist() for _ in range(max(1, families))]
    specs = []
    for i in range(num_requests):
        own = torch.randint(0, vocab, (prompt_len - shared_tokens,), generator=gen).tolist()
        prompt = (shared[i % families] if families else []) + own
        specs.append(RequestSpec(f"req-{i}", tuple(prompt), new_tokens, arrival=i * arrival_gap))
    return specs
