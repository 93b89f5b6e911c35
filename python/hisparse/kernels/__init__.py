"""CUDA kernels of the hisparse data path (cuda/SPEC.md).

``hisparse.kernels.compiler`` builds them with NVRTC (no GPU needed); ``hisparse.kernels.ops`` launches
them on torch tensors.
"""
