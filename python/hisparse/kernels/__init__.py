"""CUDA kernels of the hisparse data path (cuda/SPEC.md).

``hisparse.kernels.compiler`` builds them with NVRTC (no GPU needed); ``hisparse.kernels.ops`` launches
them on torch tensors; ``hisparse.kernels.launch`` is the arithmetic both use to size a launch, which
configurations call to refuse at construction what a launch would refuse (it needs no CUDA library).
"""

from .launch import (
    COMPILED_ARCHS,
    SHARED_MEMORY_PER_BLOCK,
    ResolveShared,
    check_datapath,
    resolve_shared,
    shared_memory_table,
)

__all__ = [
    "COMPILED_ARCHS",
    "SHARED_MEMORY_PER_BLOCK",
    "ResolveShared",
    "check_datapath",
    "resolve_shared",
    "shared_memory_table",
]
