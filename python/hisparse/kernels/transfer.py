"""Page copies as DMA on side streams, ordered by events, and index tensors through pinned memory: the pieces a
worker needs so that restores and materializations neither take SMs from the forward nor make the host wait.

A GPU block and a host block hold one page for every layer (cuda/SPEC.md). :func:`page_copies` turns
(GPU block, host block) pairs into 2D memory copies: runs of consecutive blocks on both sides merge into one copy,
and when both sides' layers are evenly spaced (one tensor ``[L, rows, rb]``, as ``DataPath`` allocates) a copy
spans every layer (height L, the layer strides as pitches). :class:`PageMover` issues them with
``cuMemcpy2DAsync``, one stream per direction, in the data path's device's context:

- ``restore(pairs)`` (host to GPU): starts after the work the current stream has enqueued (the blocks' last
  readers), and the current stream waits, on the device, for an event recorded right after these copies: the next
  forward reads the restored pages, and never waits for a copy to the host. The host does not wait.
- ``materialize(pairs)`` (GPU to host): starts after the work the current stream has enqueued (the pages' last
  writes, and so the restores before it) and overlaps what follows, restores included; it returns an event, done
  when the host copies are durable; poll it with ``event.query()`` (each step), never ``synchronize()``.

The two directions need no order between them beyond that: a page whose copy to the host is in flight keeps its
GPU block pinned (the core frees neither side until the copy is reported done), so no restore writes a block a
materialization still reads, nor reads a host block one still writes.

:func:`to_device_async` moves an index tensor to the GPU through pinned memory without a host synchronization.

How ``DataPath`` uses them: one ``PageMover`` per data path (built on its first CUDA ``apply``, again if its slab or
pool is replaced); ``apply(plan)`` calls ``restore(plan.restores)`` and ``materialize`` with the plan's
materializations, and returns that event; the worker reports the transfers whose event has passed. None of these
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
    # In destination order (destinations are distinct; sources may repeat), runs are contiguous; none wider
    # than the largest pitch, which a single row's copy takes as its pitch.
    live = sorted(((g, h) for g, h in pairs if g >= 0 and h >= 0), key=lambda p: (p[1], p[0]) if to_host else p)
    longest = max(1, max_pitch // block_bytes)
    runs: list[tuple[int, int, int]] = []  # (first GPU block, first host block, blocks)
    for g, h in live:
        if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == h and runs[-1][2] < longest:
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
    """Whole-page copies between a data path's GPU slab and its pinned host pool, as DMA on two side streams (see
    the module docstring). ``gpu_layers[l]`` / ``host_layers[l]``: layer l's slab (CUDA) and pool (pinned CPU),
    rows of the same bytes."""

    def __init__(self, gpu_layers: Sequence[torch.Tensor], host_layers: Sequence[torch.Tensor], block_size: int):
        from cuda.bindings import driver

        from . import cuda_context

        self._driver, self._context = driver, cuda_context
        if not gpu_layers or len(gpu_layers) != len(host_layers):
            raise ValueError("give the same positive number of GPU and host layers")
        device = gpu_layers[0].device
        if device.type != "cuda" or any(t.device != device for t in gpu_layers):
            raise ValueError("the GPU layers must be on one CUDA device")
        if not all(t.is_pinned() for t in host_layers):
            raise ValueError("the host layers must be pinned")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        # One stream per direction: restores never queue behind materializations, and the two overlap.
        self.h2d = torch.cuda.Stream(self.device)
        self.d2h = torch.cuda.Stream(self.device)
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_PITCH
        self._max_pitch = cuda_context.call(
            driver.cuDeviceGetAttribute(attr, cuda_context.device(self.device.index)), "cuDeviceGetAttribute")
        self._gpu = [t.data_ptr() for t in gpu_layers]
        self._host = [t.data_ptr() for t in host_layers]
        self._block_bytes = block_size * gpu_layers[0].shape[-1] * gpu_layers[0].element_size()
        self._keep = (list(gpu_layers), list(host_layers))  # the memory the copies address stays alive

    def copies(self, pairs: Sequence[tuple[int, int]], to_host: bool) -> list[Copy2D]:
        """The 2D copies that move ``pairs`` (what :meth:`restore` and :meth:`materialize` issue)."""
        return page_copies(pairs, gpu_layers=self._gpu, host_layers=self._host, block_bytes=self._block_bytes,
                           to_host=to_host, max_pitch=self._max_pitch)

    def _issue(self, pairs: Sequence[tuple[int, int]], to_host: bool, stream: torch.cuda.Stream) -> None:
        drv = self._driver
        handle = drv.CUstream(stream.cuda_stream)
        # The stream belongs to this device's context: the calling thread may have another one current, or none.
        with self._context.current(self.device.index):
            for c in self.copies(pairs, to_host):
                p = drv.CUDA_MEMCPY2D()
                p.srcMemoryType = p.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_UNIFIED
                p.srcDevice, p.srcPitch = drv.CUdeviceptr(c.src), c.src_pitch
                p.dstDevice, p.dstPitch = drv.CUdeviceptr(c.dst), c.dst_pitch
                p.WidthInBytes, p.Height = c.width, c.height
                self._context.call(drv.cuMemcpy2DAsync(p, handle), "cuMemcpy2DAsync")

    def restore(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host to GPU; what the current stream enqueues next waits for these copies (and only these) on the
        device."""
        if not pairs:
            return
        current = torch.cuda.current_stream(self.device)
        self.h2d.wait_stream(current)  # the blocks' previous readers are done with them
        self._issue(pairs, to_host=False, stream=self.h2d)
        restored = torch.cuda.Event()
        restored.record(self.h2d)  # right after the restores: nothing else runs on this stream
        current.wait_event(restored)

    def materialize(self, pairs: Sequence[tuple[int, int]]) -> torch.cuda.Event:
        """GPU to host, after the current stream's work so far; the event is done when the host copies are."""
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        self._issue(pairs, to_host=True, stream=self.d2h)
        done = torch.cuda.Event()
        done.record(self.d2h)
        return done
