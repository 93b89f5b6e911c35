"""A reference engine: a tiny DSA-style sparse-MLA decoder served with continuous batching over the hooks, in
three modes (``resident``, ``offload``, ``hisparse``), exact in every one of them."""

from .engine import MODES, Engine, EngineConfig, Event, RequestSpec, RunResult, prefix_hashes
from .model import ModelConfig, TinyDSA
from .workload import make_workload

__all__ = [
    "MODES",
    "Engine",
    "EngineConfig",
    "Event",
    "ModelConfig",
    "RequestSpec",
    "RunResult",
    "TinyDSA",
    "make_workload",
    "prefix_hashes",
]
