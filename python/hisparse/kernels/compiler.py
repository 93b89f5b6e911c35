"""Run-time compilation of the hisparse CUDA kernels with NVRTC, cached on disk.

The kernels live in ``.cu`` files in ``cuda/`` at the repository root; the extension module embeds the
same files, so an installed wheel compiles exactly what the repository holds. NVRTC needs no GPU, so
everything here runs on any machine that has the NVRTC library; only :func:`select_arch` needs the
device's compute capability and driver version.

``python -m hisparse.kernels.compiler`` prints the register and spill report as JSON (for the architectures CI
compiles for, ``launch.COMPILED_ARCHS``).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from cuda.bindings import nvrtc

from .launch import COMPILED_ARCHS

# Source file stem -> the extern "C" kernels it defines.
KERNELS: dict[str, tuple[str, ...]] = {
    "resolve": ("hisparse_resolve", "hisparse_invalidate"),
    "copy": ("hisparse_gather", "hisparse_copy_rows", "hisparse_copy_blocks", "hisparse_replay"),
}
HEADERS = ("common.cuh",)
# -default-device: NVRTC takes the kernels' generic lambdas (auto parameters) for host code without it.
OPTIONS = ("-std=c++17", "-default-device")


logger = logging.getLogger(__name__)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source, or no code can be built for a device."""


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel (``shared_bytes``: its static shared memory)."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int = 0


@dataclass(frozen=True)
class CompiledModule:
    """One source file compiled for one target.

    ``kind`` is ``"cubin"`` (target ``sm_XX``) or ``"ptx"`` (target ``compute_XX``); ``resources`` is
    empty for PTX, which ptxas has not seen yet.
    """

    name: str
    arch: str
    kind: str
    image: bytes
    resources: dict[str, KernelResources]
    log: str


def kernel_sources() -> dict[str, bytes]:
    """The ``.cu`` and ``.cuh`` files by name: the repository's ``cuda/`` when present (edits apply without
    a rebuild), else the copies embedded in ``hisparse._core``."""
    repo = Path(__file__).resolve().parents[3] / "cuda"
    if (repo / "common.cuh").is_file():
        return {f.name: f.read_bytes() for f in sorted(repo.glob("*.cu*"))}
    from .. import _core

    return {name: text.encode() for name, text in _core.kernel_sources()}


def cache_dir() -> Path:
    return Path(os.environ.get("HISPARSE_CACHE_DIR") or "~/.cache/hisparse").expanduser() / "kernels"


def _check(result: tuple, what: str, prog=None) -> tuple:
    err, *values = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = f"\n{_program_log(prog)}" if prog is not None else ""
        raise CompileError(f"{what} failed: {err.name}{log}")
    return tuple(values)


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    return _check(nvrtc.nvrtcVersion(), "nvrtcVersion")


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """Real architectures NVRTC can build cubins for, as integers (90 for sm_90)."""
    (archs,) = _check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    return tuple(archs)


def select_arch(capability: tuple[int, int], driver_version: int) -> str:
    """The NVRTC target for a device of ``capability`` under a driver of ``driver_version``.

    ``driver_version`` is cuDriverGetVersion's number (13000 for 13.0). A cubin is preferred: it holds
    machine code, which a driver older than NVRTC still loads, whereas PTX from a newer NVRTC may carry a
    PTX ISA version the driver cannot compile. A cubin built for sm_XY also runs on sm_XZ with Z > Y.
    PTX is the last resort, for a device newer than this NVRTC. Devices before 8.0 are refused: the kernels
    and their launch limits (``launch.SHARED_MEMORY_PER_BLOCK``) are written for sm_80 and newer.
    """
    major, minor = capability
    cc = major * 10 + minor
    if cc < 80:
        raise CompileError(f"compute capability {major}.{minor}: hisparse's kernels need 8.0 or newer")
    archs = supported_archs()
    if cc in archs:
        return f"sm_{cc}"
    same_major = [a for a in archs if a // 10 == major and a < cc]
    if same_major:
        return f"sm_{max(same_major)}"
    older = [a for a in archs if a < cc]
    if not older:
        raise CompileError(f"NVRTC {nvrtc_version()} cannot build for compute capability {major}.{minor}")
    nv_major, nv_minor = nvrtc_version()
    if driver_version < nv_major * 1000 + nv_minor * 10:
        raise CompileError(
            f"compute capability {major}.{minor} needs PTX, and PTX from NVRTC {nv_major}.{nv_minor} "
            f"needs a driver at least as new (driver: {driver_version // 1000}.{driver_version % 1000 // 10})"
        )
    return f"compute_{max(older)}"


def _program_log(prog) -> str:
    (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    buf = bytearray(size)  # NVRTC writes into it: never an immutable bytes (b" " * 1 is CPython's shared b" ")
    _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"Function properties for (\w+)\s*\n[^\n]*?"
                    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")


def parse_resources(log: str) -> dict[str, KernelResources]:
    """Per-kernel figures from a ptxas ``-v`` log. ptxas reports a ``__noinline__`` device function's frame
    apart, naming no caller: its stack and spills count against every kernel of the module (what the spill
    guard must see, and no kernel spills more than that)."""
    frames = {name: tuple(int(x) for x in rest) for name, *rest in _FRAME.findall(log)}
    sections = _ENTRY.split(log)  # [preamble, name1, body1, name2, body2, ...]
    entries = sections[1::2]
    callees = [frame for name, frame in frames.items() if name not in entries]
    out = {}
    for name, body in zip(entries, sections[2::2], strict=True):
        registers = _REGISTERS.search(body)
        if name not in frames or registers is None:
            raise CompileError(f"no ptxas resource line for {name} in the log:\n{log}")
        stack, stores, loads = (sum(values) for values in zip(frames[name], *callees, strict=True))
        shared = _SHARED.search(body)  # absent when the kernel has no static shared memory
        smem = int(shared.group(1)) if shared else 0
        out[name] = KernelResources(int(registers.group(1)), stores, loads, stack, smem)
    return out


def _compile(name: str, source: bytes, headers: dict[str, bytes], options: list[str]) -> tuple[bytes, str]:
    (prog,) = _check(
        nvrtc.nvrtcCreateProgram(
            source, f"{name}.cu".encode(), len(headers), list(headers.values()), [h.encode() for h in headers]
        ),
        "nvrtcCreateProgram",
    )
    try:
        opts = [o.encode() for o in options]
        _check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), f"compiling {name}.cu", prog)
        log = _program_log(prog)
        if any(o.startswith("--gpu-architecture=sm_") for o in options):
            get_size, get = nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN
        else:
            get_size, get = nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX
        (size,) = _check(get_size(prog), "reading the image size")
        image = bytearray(size)  # written by NVRTC (see _program_log)
        _check(get(prog, image), "reading the image")
        return bytes(image), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # on disk before it has the entry's name: a crash leaves no torn entry
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


#: A cache entry: this line, the SHA-256 of the entry's file name and the rest, the log's length (8 bytes),
#: the log, the image. The name (the key) is in the checksum, so an entry is only ever read as the one it was
#: written as: a file copied or renamed over another key's is built again.
_ENTRY_MAGIC = b"hisparse kernel cache entry 2\n"


def _entry_checksum(name: str, body: bytes) -> bytes:
    return hashlib.sha256(len(name).to_bytes(8, "little") + name.encode() + body).digest()


def _pack_entry(name: str, image: bytes, log: str) -> bytes:
    text = log.encode()
    body = len(text).to_bytes(8, "little") + text + image
    return _ENTRY_MAGIC + _entry_checksum(name, body) + body


def _read_entry(path: Path) -> tuple[bytes, str] | None:
    """The image and log the entry at ``path`` holds, or None when there is none whole: absent, not a regular
    file (a FIFO would block the read), truncated, corrupted, written under another name, or by an earlier
    version (then it is built again)."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    head = len(_ENTRY_MAGIC) + 32
    body = data[head:]
    if not data.startswith(_ENTRY_MAGIC) or len(body) < 8 or _entry_checksum(path.name, body) != data[head - 32:head]:
        return None
    n = int.from_bytes(body[:8], "little")
    return body[8 + n:], body[8:8 + n].decode(errors="replace")


def _cached(folder: Path, name: str, build) -> tuple[bytes, str]:
    """``build()``'s (image, log), kept in ``folder`` under ``name``. A lock file keeps concurrent processes
    from building one entry twice; an entry that is not whole is built again, and the temporary files of its
    writers that died are removed (a writer holds the lock until its file is renamed). A folder that cannot
    be used (read-only, not a folder) costs a compile per process, not the kernels: they are built in memory."""
    built = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        entry = _read_entry(path)
        if entry is None:
            with open(folder / f"{name}.lock", "wb") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                entry = _read_entry(path)  # another process may have built it while we waited
                if entry is None:
                    for torn in folder.glob(f".{name}.*"):  # left by a writer killed before its rename
                        torn.unlink(missing_ok=True)
                    entry = built = build()
                    _atomic_write(path, _pack_entry(name, *built))
        return entry
    except OSError as e:
        logger.warning("hisparse: the kernel cache %s cannot be used (%s): compiling in memory", folder, e)
        return built if built is not None else build()


@functools.cache
def compile_kernel_source(name: str, arch: str) -> CompiledModule:
    """Compile ``<name>.cu`` for ``arch`` (``sm_XX`` gives a cubin, ``compute_XX`` PTX).

    Results are cached under ``$HISPARSE_CACHE_DIR/kernels`` (default ``~/.cache/hisparse``), keyed by
    the sources, options, target and NVRTC version, one file an entry with its checksum (``_cached``).
    """
    if name not in KERNELS:
        raise ValueError(f"unknown kernel source {name!r}; expected one of {sorted(KERNELS)}")
    if not re.fullmatch(r"(sm|compute)_\d+[af]?", arch):
        raise ValueError(f"arch must look like 'sm_90' or 'compute_90', got {arch!r}")
    kind = "cubin" if arch.startswith("sm_") else "ptx"
    files = kernel_sources()
    source = files[f"{name}.cu"]
    headers = {h: files[h] for h in HEADERS}
    options = [*OPTIONS, f"--gpu-architecture={arch}"]
    if kind == "cubin":
        options.append("--ptxas-options=-v")  # the resource report lands in the program log

    digest = hashlib.sha256()
    for part in (
        name.encode(),
        source,
        *(k.encode() + v for k, v in headers.items()),
        *map(str.encode, options),
    ):
        digest.update(len(part).to_bytes(8, "little") + part)
    digest.update(repr(nvrtc_version()).encode())
    stem = f"{name}-{arch}-{digest.hexdigest()[:32]}"

    image, log = _cached(cache_dir(), f"{stem}.{kind}", lambda: _compile(name, source, headers, options))
    resources = parse_resources(log) if kind == "cubin" else {}
    missing = set(KERNELS[name]) - set(resources) if kind == "cubin" else set()
    if missing:
        raise CompileError(f"{name}.cu for {arch}: no ptxas report for {sorted(missing)}")
    return CompiledModule(name, arch, kind, image, resources, log)


def compile_report(archs: tuple[str, ...] = COMPILED_ARCHS) -> list[dict]:
    """Registers per thread, spills, stack and static shared memory of every kernel for every arch (cubins)."""
    rows = []
    for arch in archs:
        for name in KERNELS:
            for kernel, res in sorted(compile_kernel_source(name, arch).resources.items()):
                rows.append({"kernel": kernel, "arch": arch, **asdict(res)})
    return rows


if __name__ == "__main__":
    print(json.dumps(compile_report(), indent=1))
