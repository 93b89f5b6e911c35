"""hisparse: keep decoding long-context requests on sparse-attention models when their KV cache no longer fits.

The residency core (``ResidencyManager``) is Rust; ``DataPath`` is the worker side (GPU kernels, or the CPU
reference that specifies them).

The core and the data path load on first use, so that a pure-Python tool (``hisparse calc``) and code that
only needs the error classes pay for neither the extension nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CapacityError,
    ConfigError,
    HiSparseError,
    InvalidArgumentError,
    InvariantError,
    UnknownRequestError,
)

if TYPE_CHECKING:
    from ._core import Admission, ResidencyManager, StepPlan, __version__, steady_state_blocks
    from .datapath import DataPath, Layout

_LAZY = {
    "Admission": "._core",
    "ResidencyManager": "._core",
    "StepPlan": "._core",
    "__version__": "._core",
    "steady_state_blocks": "._core",
    "DataPath": ".datapath",
    "Layout": ".datapath",
}

__all__ = [
    "Admission",
    "CapacityError",
    "ConfigError",
    "DataPath",
    "HiSparseError",
    "InvalidArgumentError",
    "InvariantError",
    "Layout",
    "ResidencyManager",
    "StepPlan",
    "UnknownRequestError",
    "__version__",
    "steady_state_blocks",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hisparse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
