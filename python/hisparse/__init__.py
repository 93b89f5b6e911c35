"""hisparse: keep decoding long-context requests on sparse-attention models when their KV cache no longer fits.

The residency core (``ResidencyManager``) is Rust; ``DataPath`` is the worker side (GPU kernels, or the CPU
reference that specifies them).
"""

from ._core import Admission, ResidencyManager, StepPlan, __version__, steady_state_blocks
from .datapath import DataPath, Layout
from .errors import (
    CapacityError,
    ConfigError,
    HiSparseError,
    InvalidArgumentError,
    InvariantError,
    UnknownRequestError,
)

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
