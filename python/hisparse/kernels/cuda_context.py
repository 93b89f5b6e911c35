"""Driver calls in the right CUDA context: a device's primary context (the one torch uses), made current around
the calls that need it. A thread may have another device's context current, or none (a thread that never made a
CUDA runtime call), and a driver call with a stream of one device under another device's context fails; so every
driver call of ``hisparse.kernels`` that names a device's stream or memory runs inside :func:`current`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from cuda.bindings import driver

_lock = threading.Lock()
_contexts: dict[int, driver.CUcontext] = {}


def call(result: tuple, what: str):
    """The values of a driver call's result tuple, or RuntimeError naming ``what`` and the error."""
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err.name}")
    return values[0] if len(values) == 1 else tuple(values)


def device(index: int) -> driver.CUdevice:
    call(driver.cuInit(0), "cuInit")
    return call(driver.cuDeviceGet(index), "cuDeviceGet")


def primary(index: int) -> driver.CUcontext:
    """The primary context of device ``index``, retained once for the life of the process."""
    with _lock:
        ctx = _contexts.get(index)
        if ctx is None:
            ctx = _contexts[index] = call(driver.cuDevicePrimaryCtxRetain(device(index)), "cuDevicePrimaryCtxRetain")
    return ctx


@contextlib.contextmanager
def current(index: int) -> Iterator[None]:
    """Makes device ``index``'s primary context current for the driver calls inside (and restores the caller's)."""
    ctx = primary(index)
    if int(call(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")) == int(ctx):
        yield
        return
    call(driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        call(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")
