"""The CPU kernel harness: the real ``cuda/*.cu`` kernels compiled as C++ and run on the CPU with randomized
thread schedules, then compared byte for byte with the Rust reference (``hisparse._core``) on random and corrupt
cases. It runs in ``make test`` and needs only g++.

- ``shim.h``: CUDA device code on the CPU (g++ ``-include``): thread and block indices, barriers, warp
  collectives, atomics, shared memory. ``runtime.cpp``: fibers for threads, the randomized scheduler, checks of
  barrier and collective use, guarded buffers, the global-memory watch (every load and store of the kernel
  sources, through g++'s ``-fsanitize=thread`` hooks: bytes and barriers per CTA, :class:`CtaCount`, and data
  races on global memory), a C API.
- this module: builds the library (one translation unit per source of ``hisparse.kernels.compiler.KERNELS``,
  which includes the ``.cu`` file and registers its kernels) and runs the :class:`~hisparse.kernels.ops.KernelLaunch`
  records that ``hisparse.kernels.ops`` builds for the GPU: the same arguments, grids and shared memory.
- ``cases.py``: the case kinds, each run through the kernels and the reference and compared.
- ``run.py``: a suite of cases as a command, so that a kernel that faults takes down a subprocess, not pytest.
- ``mutate.py``: the mutation check: each barrier removed in turn (``__syncthreads()``, and ``__syncthreads_or(x)``
  made the thread's own ``x``), and each bound the kernels check moved by one, must make the suite fail.

What it cannot see: the GPU's weak memory ordering (fibers share one coherent CPU memory, so a missing
``volatile`` or fence goes unnoticed), races between launches (two streams), races on shared memory that the
schedule does not expose, and speed. What it sees and CUDA does not report: a missing or misplaced barrier
(garbage shared memory, randomized schedules), divergent barriers and collectives, a write outside any buffer
(guard pages and canaries around every buffer, shared memory included), and a data race on global memory, within
a CTA between two barriers or between CTAs of a launch (a plain ``+=`` where an atomic belongs is one, however
the fibers are scheduled). What it counts: per CTA, the barriers executed and the global bytes read and written
(``Harness.counts``; ``benches/resolve_budget.py`` reports them per request).

Adding a kernel file (say ``cuda/plan.cu``): list it with its kernels in ``compiler.KERNELS`` (NVRTC needs that
anyway) and in ``rust/python/src/lib.rs``'s embedded sources, give ``ops.py`` a ``*_launches`` function, and add a
case kind to ``cases.py`` that runs those launches and compares the result with the reference. The build, the
GPU tests (which run every kind on the device) and the mutation check pick the rest up by themselves; the
mutation check fails until some kind catches the removal of each of the new file's barriers. List the new
kernels' bounds checks in ``mutate.SEMANTIC`` and give each a case that draws its exact bound.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from hisparse.kernels.compiler import KERNELS, cache_dir

HERE = Path(__file__).resolve().parent
CUDA_DIR = HERE.parents[1] / "cuda"
CXX = os.environ.get("CXX", "g++")
FLAGS = ("-std=c++17", "-fPIC", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas")
# The kernel sources only: every load and store calls a hook of runtime.cpp, which counts global memory and looks
# for data races on it (g++'s ThreadSanitizer instrumentation; runtime.cpp stands in for its library).
INSTRUMENT = ("-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0")


class HarnessError(RuntimeError):
    """The runtime refused a launch or saw a kernel misuse barriers, collectives or shared memory."""


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:24]


def _compile_objects(jobs: list[tuple[list[str], Path]]) -> None:
    """Runs the compilations (command, output) two at a time; raises with the compiler's message."""
    running: list[tuple[subprocess.Popen, Path]] = []
    pending = list(jobs)
    while pending or running:
        while pending and len(running) < 2:
            cmd, out = pending.pop(0)
            running.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out))
        proc, out = running.pop(0)
        log = proc.communicate()[0].decode(errors="replace")
        if proc.returncode != 0:
            raise HarnessError(f"building {out.name} failed:\n{log}")


SELFTEST = {HERE / "selftest.cu": ("selftest_intrinsics", "selftest_out_of_bounds", "selftest_divergent_barrier",
                                    "selftest_exit_before_barrier", "selftest_missing_lane", "selftest_neighbour",
                                    "selftest_scan_twice", "selftest_global_add")}


def build(cuda_dir: Path = CUDA_DIR, opt: str = "-O2", folder: Path | None = None,
          extra: dict[Path, tuple[str, ...]] | None = None) -> Path:
    """The harness library for the kernel sources in ``cuda_dir`` (the repository's, or a mutant's), cached by
    content under ``folder`` (default: the kernel cache's ``harness/``). ``extra`` adds more sources (path:
    kernels), such as the harness's own self-test."""
    folder = folder or cache_dir().parent / "harness"
    folder.mkdir(parents=True, exist_ok=True)
    shim, runtime = (HERE / "shim.h").read_bytes(), (HERE / "runtime.cpp").read_bytes()
    flags = [*FLAGS, opt]
    headers = b"".join(f.read_bytes() for f in sorted(cuda_dir.glob("*.cuh")))
    base = [CXX, *flags, "-include", str(HERE / "shim.h"), "-I", str(HERE), "-I", str(cuda_dir)]
    jobs, objects = [], []
    runtime_o = folder / f"runtime-{_digest(shim, runtime, ' '.join(flags).encode())}.o"
    objects.append(runtime_o)
    if not runtime_o.exists():
        jobs.append(([*base, "-c", str(HERE / "runtime.cpp"), "-o", str(runtime_o)], runtime_o))
    sources = {cuda_dir / f"{stem}.cu": kernels for stem, kernels in KERNELS.items()} | (extra or {})
    for cu, kernels in sources.items():
        # -I: a source outside cuda/ (the self-test) finds common.cuh too.
        unit = f'#include "{cu}"\n' + "".join(f"HS_REGISTER({k})\n" for k in kernels)
        key = _digest(shim, unit.encode(), cu.read_bytes(), headers, " ".join([*flags, *INSTRUMENT]).encode())
        obj = folder / f"{cu.stem}-{key}.o"
        objects.append(obj)
        if not obj.exists():
            src = folder / f"{obj.stem}.cpp"
            src.write_text(unit)
            jobs.append(([*base, *INSTRUMENT, "-c", str(src), "-o", str(obj)], obj))
    # Objects appear under their final name only when complete, so a concurrent build never links half of one.
    tag = f"{os.getpid()}-{threading.get_ident()}"
    _compile_objects([(cmd[:-1] + [f"{out}.{tag}.tmp"], out) for cmd, out in jobs])
    for _, out in jobs:
        os.replace(f"{out}.{tag}.tmp", out)
    library = folder / f"harness-{_digest(*(o.name.encode() for o in objects))}.so"
    if not library.exists():
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
        os.close(fd)
        _compile_objects([([CXX, "-shared", *map(str, objects), "-o", tmp], Path(tmp))])
        os.replace(tmp, library)
    return library


@dataclass(frozen=True)
class CtaCount:
    """What one CTA of a launch did on the harness: barriers it executed (each once, however many threads wait
    at it) and global memory it moved (every load and store of a guarded buffer, as the C++ compiler emits them
    from the kernel source; an atomic counts its bytes as read and as written). Shared memory is not counted."""

    x: int
    y: int
    barriers: int
    read_bytes: int
    written_bytes: int
    atomics: int
    read_footprint: int  # bytes of the distinct 4-byte words read (0 unless footprints are tracked)
    written_footprint: int


class Harness:
    """The loaded library: guarded buffers and launches (a backend of ``cases.py``)."""

    sm_count = 3  # few SMs: the copy kernels stride over their jobs
    max_smem = 1 << 30  # launches are sized by each case's architecture

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library))
        lib.hs_alloc.restype = ctypes.c_void_p
        lib.hs_alloc.argtypes = [ctypes.c_size_t]
        lib.hs_free.argtypes = [ctypes.c_void_p]
        lib.hs_error.restype = ctypes.c_char_p
        lib.hs_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_size_t,
                                  ctypes.c_void_p, ctypes.c_uint64, ctypes.c_double]
        lib.hs_has_kernel.argtypes = [ctypes.c_char_p]
        lib.hs_stats.argtypes = [ctypes.c_void_p]
        lib.hs_cta_counts.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.hs_check_races.argtypes = [ctypes.c_int]
        lib.hs_track_footprint.argtypes = [ctypes.c_int]
        self.lib = lib
        self._buffers: list[int] = []
        # Per launch since the last free(): (kernel, one CtaCount per CTA in the order the CTAs ran).
        self.counts: list[tuple[str, list[CtaCount]]] = []

    def has_kernel(self, name: str) -> bool:
        return bool(self.lib.hs_has_kernel(name.encode()))

    def tensor(self, like: torch.Tensor, host: bool = False) -> torch.Tensor:
        """A copy of the CPU tensor ``like`` in a guarded buffer (its neighbourhood detects stray writes); device
        and host memory are alike here."""
        nbytes = like.numel() * like.element_size()
        size = max(nbytes, 16)
        address = self.lib.hs_alloc(size)
        if not address:
            raise MemoryError("hs_alloc failed")
        self._buffers.append(address)
        raw = torch.frombuffer((ctypes.c_uint8 * size).from_address(address), dtype=torch.uint8)
        t = raw[:nbytes].view(like.dtype).view(like.shape)
        t.copy_(like)
        return t

    def run(self, launches, seed: int, preempt: float) -> None:
        """Runs :class:`~hisparse.kernels.ops.KernelLaunch` records in order, like the device would."""
        for i, k in enumerate(launches):
            params = (ctypes.c_void_p * len(k.args))(*(ctypes.addressof(a) for a in k.args))
            rc = self.lib.hs_launch(k.kernel.encode(), k.grid[0], k.grid[1], k.threads, k.smem, params,
                                    seed * 7919 + i, preempt)
            if rc != 0:
                raise HarnessError(f"{k.kernel}: {self.lib.hs_error().decode()}")
            ctas = k.grid[0] * k.grid[1]
            words = (ctypes.c_uint64 * (8 * ctas))()
            ran = self.lib.hs_cta_counts(words, ctas)
            self.counts.append((k.kernel, [CtaCount(*words[8 * c: 8 * c + 6], 4 * words[8 * c + 6],
                                                    4 * words[8 * c + 7]) for c in range(min(ran, ctas))]))

    def damaged(self) -> int:
        """Buffers written outside their bounds so far."""
        return self.lib.hs_damaged()

    def free(self) -> None:
        """Frees every buffer; tensors made by :meth:`tensor` must not be used afterwards."""
        for address in self._buffers:
            self.lib.hs_free(address)
        self._buffers.clear()
        self.counts.clear()

    def check_races(self, on: bool) -> None:
        """Whether launches fail on a data race on global memory (on by default; see runtime.cpp)."""
        self.lib.hs_check_races(int(on))

    def track_footprint(self, on: bool) -> None:
        """Whether launches count the distinct global words each CTA reads and writes (``CtaCount``'s
        footprints; off by default, as it costs a set insert per access)."""
        self.lib.hs_track_footprint(int(on))

    def stats(self) -> dict[str, int]:
        out = (ctypes.c_uint64 * 4)()
        self.lib.hs_stats(out)
        return dict(zip(("switches", "barriers", "collectives", "preemptions"), out, strict=True))
