"""Page copies as DMA on a side stream, ordered by events, and index tensors through pinned memory: the pieces a
worker needs so that restores and materializations neither take SMs from the forward nor make the host wait.

A GPU block and a host block hold one page for every layer (cuda/SPEC.md). :func:`page_copies` turns
(GPU block, host block) pairs into 2D memory copies: runs of consecutive blocks on both sides merge into one copy,
and when both sides' layers are evenly spaced (one tensor ``[L, rows, rb]``, as ``DataPath`` allocates) a copy
spans every layer (height L, the layer strides as pitches). :class:`PageMover` issues them with
``cuMemcpy2DAsync`` on its own stream:

- ``restore(pairs)`` (host to GPU): starts after the work the current stream has enqueued, and the current stream
  waits for it on the device, so the next forward reads the restored pages; the host does not wait.
- ``materialize(pairs)`` (GPU to host): starts after the work the current stream has enqueued (the pages' last
  writes) and overlaps what follows; it returns an event, done when the host copies are durable; poll it with
  ``event.query()`` (each step), never ``synchronize()``.

:func:`to_device_async` moves an index tensor to the GPU through pinned memory without a host synchronization.

How ``DataPath`` uses them (not wired yet): one ``PageMover`` per data path, built with its slab and host pool;
``apply(plan)`` calls ``restore(plan.restores)`` and, for ``plan.materialize``, ``materialize(pairs)`` keeping
``(transfer ids, event)``; ``end_step`` reports the ids whose event ``query()`` is true and keeps the others; the
pairs of mirror, invalidate and the kernels' other index inputs go through ``to_device_async``. None of these
calls belongs inside a captured CUDA graph: the decode path's graph holds resolve and gather only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Copy2D:
    """``height`` rows of ``width`` bytes from ``src`` to ``dst``; row i starts at ``src + i * src_pitch`` and
    ``dst + i * dst_pitch``."""

    dst: int
    dst_pitch: int
    src: int
    src_pitch: int
    width: int
    height: int


def _even_stride(addresses: Sequence[int]) -> int | None:
    """The stride of evenly spaced addresses (0 for one address), or None."""
    if len(addresses) < 2:
        return 0
    stride = addresses[1] - addresses[0]
    ok = stride > 0 and all(b - a == stride for a, b in itertools.pairwise(addresses))
    return stride if ok else None


MAX_PITCH = 2**31 - 1  # CU_DEVICE_ATTRIBUTE_MAX_PITCH of current GPUs: a larger layer stride gets a copy per layer


def page_copies(
    pairs: Sequence[tuple[int, int]],
    *,
    gpu_layers: Sequence[int],
    host_layers: Sequence[int],
    block_bytes: int,
    to_host: bool,
    max_pitch: int = MAX_PITCH,
) -> list[Copy2D]:
    """The copies that move the blocks of ``pairs`` (GPU block, host block; a pair with a negative entry is
    skipped) for every layer; ``gpu_layers`` / ``host_layers`` are the layers' base addresses, ``block_bytes``
    one block of one layer. Destinations must be distinct (SPEC.md)."""
    if len(gpu_layers) != len(host_layers) or not gpu_layers:
        raise ValueError("give the same positive number of GPU and host layers")
    # In destination order (destinations are distinct; sources may repeat), runs are contiguous.
    live = sorted(((g, h) for g, h in pairs if g >= 0 and h >= 0), key=lambda p: (p[1], p[0]) if to_host else p)
    runs: list[tuple[int, int, int]] = []  # (first GPU block, first host block, blocks)
    for g, h in live:
        if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == h:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((g, h, 1))
    gpu_stride, host_stride = _even_stride(gpu_layers), _even_stride(host_layers)
    one_copy = gpu_stride is not None and host_stride is not None and max(gpu_stride, host_stride) <= max_pitch
    spans = [(0, len(gpu_layers))] if one_copy else [(layer, 1) for layer in range(len(gpu_layers))]
    copies = []
    for first, height in spans:
        for g, h, n in runs:
            gpu = gpu_layers[first] + g * block_bytes
            host = host_layers[first] + h * block_bytes
            # A single row's pitch is its width, which every driver takes.
            pitch_gpu, pitch_host = (gpu_stride, host_stride) if height > 1 else (n * block_bytes, n * block_bytes)
            if to_host:
                copies.append(Copy2D(host, pitch_host, gpu, pitch_gpu, n * block_bytes, height))
            else:
                copies.append(Copy2D(gpu, pitch_gpu, host, pitch_host, n * block_bytes, height))
    return copies


def to_device_async(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a sequence or a CPU tensor) on ``device`` without waiting for the host: through pinned memory,
    which torch's caching host allocator keeps from reuse until the copy has run."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return t.to(dtype).pin_memory().to(device, non_blocking=True)


class PageMover:
    """Whole-page copies between a data path's GPU slab and its pinned host pool, as DMA on a side stream (see the
    module docstring). ``gpu_layers[l]`` / ``host_layers[l]``: layer l's slab (CUDA) and pool (pinned CPU), rows
    of the same bytes."""

    def __init__(self, gpu_layers: Sequence[torch.Tensor], host_layers: Sequence[torch.Tensor], block_size: int):
        from cuda.bindings import driver

        self._driver = driver
        if not gpu_layers or len(gpu_layers) != len(host_layers):
            raise ValueError("give the same positive number of GPU and host layers")
        device = gpu_layers[0].device
        if device.type != "cuda" or any(t.device != device for t in gpu_layers):
            raise ValueError("the GPU layers must be on one CUDA device")
        if not all(t.is_pinned() for t in host_layers):
            raise ValueError("the host layers must be pinned")
        self.device = device
        self.stream = torch.cuda.Stream(device)
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH
        err, self._max_pitch = driver.cuDeviceGetAttribute(attr, device.index)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuDeviceGetAttribute failed: {err.name}")
        self._gpu = [t.data_ptr() for t in gpu_layers]
        self._host = [t.data_ptr() for t in host_layers]
        self._block_bytes = block_size * gpu_layers[0].shape[-1] * gpu_layers[0].element_size()
        self._keep = (list(gpu_layers), list(host_layers))  # the memory the copies address stays alive

    def _issue(self, pairs: Sequence[tuple[int, int]], to_host: bool) -> None:
        drv = self._driver
        stream = drv.CUstream(self.stream.cuda_stream)
        for c in page_copies(pairs, gpu_layers=self._gpu, host_layers=self._host, block_bytes=self._block_bytes,
                             to_host=to_host, max_pitch=self._max_pitch):
            p = drv.CUDA_MEMCPY2D()
            p.srcMemoryType = p.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_UNIFIED
            p.srcDevice, p.srcPitch = drv.CUdeviceptr(c.src), c.src_pitch
            p.dstDevice, p.dstPitch = drv.CUdeviceptr(c.dst), c.dst_pitch
            p.WidthInBytes, p.Height = c.width, c.height
            (err,) = drv.cuMemcpy2DAsync(p, stream)
            if err != drv.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemcpy2DAsync failed: {err.name}")

    def restore(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host to GPU; what the current stream enqueues next waits for these copies on the device."""
        if not pairs:
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the blocks' previous users are done with them
        self._issue(pairs, to_host=False)
        current.wait_stream(self.stream)

    def materialize(self, pairs: Sequence[tuple[int, int]]) -> torch.cuda.Event:
        """GPU to host, after the current stream's work so far; the event is done when the host copies are."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._issue(pairs, to_host=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        return done
