"""Every kernel compiles with NVRTC for every architecture CI checks (sm_80, sm_90, sm_100, sm_120), without
local-memory spills, within the static shared memory the launch arithmetic counts.

Runs on CPU: NVRTC needs no GPU. Run with -s to see the register report.
"""

import os

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from hisparse.kernels import compiler, launch  # noqa: E402

ARCHS = launch.COMPILED_ARCHS


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hisparse-cache"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", sorted(compiler.KERNELS))
def test_compiles_to_cubin_without_spills(source, arch):
    module = compiler.compile_kernel_source(source, arch)
    assert module.kind == "cubin"
    assert module.image[:4] == b"\x7fELF"
    assert set(module.resources) == set(compiler.KERNELS[source])
    for kernel, res in sorted(module.resources.items()):
        print(
            f"\n{kernel:22s} {arch:7s} {res.registers:3d} registers/thread, stack {res.stack_bytes} B, "
            f"spill stores {res.spill_stores} B, spill loads {res.spill_loads} B, static smem {res.shared_bytes} B",
            end="",
        )
        assert res.spill_stores == res.spill_loads == res.stack_bytes == 0, f"{kernel} spills on {arch}: {res}"
        assert res.shared_bytes <= launch.STATIC_SHARED.get(kernel, 0), f"{kernel} on {arch}: {res.shared_bytes} B"


def test_ptx_target():
    module = compiler.compile_kernel_source("copy", "compute_90")
    assert module.kind == "ptx"
    assert module.resources == {}
    text = module.image.decode()
    assert all(f".entry {k}(" in text for k in compiler.KERNELS["copy"])


def test_compiling_leaves_the_interpreters_shared_bytes_alone(tmp_path, monkeypatch):
    # A PTX build's log is empty: one byte, NVRTC's terminating NUL. Read into ``b" " * 1``, which is
    # CPython's one shared b" ", it turned every one-byte space in the process into b"\0".
    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))
    compiler.compile_kernel_source.cache_clear()
    try:
        for arch in ("compute_90", "sm_90"):
            compiler.compile_kernel_source("copy", arch)
    finally:
        compiler.compile_kernel_source.cache_clear()
    assert b" "[0] == bytes([32])[0] == 0x20 and b"a b".split(b" ") == [b"a", b"b"]


def test_disk_cache_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))
    compiler.compile_kernel_source.cache_clear()
    first = compiler.compile_kernel_source("copy", "sm_90")
    entries = sorted(p.suffix for p in (tmp_path / "kernels").iterdir())
    assert entries == [".cubin", ".lock"]

    def no_nvrtc(*args):
        raise AssertionError("compiled again despite a cache entry")

    monkeypatch.setattr(compiler, "_compile", no_nvrtc)
    compiler.compile_kernel_source.cache_clear()
    second = compiler.compile_kernel_source("copy", "sm_90")
    assert second.image == first.image
    assert second.resources == first.resources
    compiler.compile_kernel_source.cache_clear()


def test_an_entry_that_is_not_whole_is_built_again(tmp_path, monkeypatch):
    """Truncated, emptied, zeroed or foreign entries (a full disk, a crash, an earlier version) are built again,
    never loaded: a driver given a truncated image reads past its end."""
    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))
    compiler.compile_kernel_source.cache_clear()
    good = compiler.compile_kernel_source("copy", "sm_90")
    (entry,) = (tmp_path / "kernels").glob("*.cubin")
    whole = entry.read_bytes()
    for damaged in (b"", whole[: len(whole) // 2], bytes(len(whole)), good.image, whole[:-1] + b"x"):
        entry.write_bytes(damaged)
        compiler.compile_kernel_source.cache_clear()
        again = compiler.compile_kernel_source("copy", "sm_90")
        assert again.image == good.image and again.resources == good.resources
        assert compiler._read_entry(entry)[0] == good.image  # whole again (its log's compile times differ)
    compiler.compile_kernel_source.cache_clear()


def test_an_entry_is_read_only_under_the_name_it_was_written_as(tmp_path, monkeypatch):
    """Another key's whole entry copied into place (here the sm_80 cubin where sm_90's belongs) is built again,
    not loaded for the wrong target; so is a FIFO, which would block the read forever."""
    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))
    compiler.compile_kernel_source.cache_clear()
    sm80 = compiler.compile_kernel_source("copy", "sm_80")
    sm90 = compiler.compile_kernel_source("copy", "sm_90")
    assert sm80.image != sm90.image
    folder = tmp_path / "kernels"
    (entry80,) = folder.glob("copy-sm_80-*.cubin")
    (entry90,) = folder.glob("copy-sm_90-*.cubin")
    entry90.write_bytes(entry80.read_bytes())
    assert compiler._read_entry(entry90) is None
    compiler.compile_kernel_source.cache_clear()
    assert compiler.compile_kernel_source("copy", "sm_90").image == sm90.image
    entry90.unlink()
    os.mkfifo(entry90)
    compiler.compile_kernel_source.cache_clear()
    assert compiler.compile_kernel_source("copy", "sm_90").image == sm90.image
    assert entry90.is_file()
    compiler.compile_kernel_source.cache_clear()


def test_a_killed_writers_temporary_file_is_removed_when_the_entry_is_built(tmp_path, monkeypatch):
    """A process killed between writing an entry and renaming it leaves its temporary file; the next build of that
    entry (under its lock, which the dead writer held) removes it, and leaves other entries' files alone."""
    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))
    compiler.compile_kernel_source.cache_clear()
    compiler.compile_kernel_source("copy", "sm_90")
    folder = tmp_path / "kernels"
    (entry,) = folder.glob("*.cubin")
    entry.unlink()
    torn = folder / f".{entry.name}.k1ll3d"
    torn.write_bytes(b"half an entry")
    other = folder / ".another-entry.cubin.k1ll3d"
    other.write_bytes(b"")
    compiler.compile_kernel_source.cache_clear()
    assert compiler.compile_kernel_source("copy", "sm_90").image[:4] == b"\x7fELF"
    assert entry.exists() and not torn.exists() and other.exists()
    compiler.compile_kernel_source.cache_clear()


def test_a_cache_folder_that_cannot_be_used_costs_a_compile_not_the_kernels(tmp_path, monkeypatch, caplog):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_bytes(b"")
    for where in (not_a_folder, not_a_folder / "below"):
        monkeypatch.setenv("HISPARSE_CACHE_DIR", str(where))
        compiler.compile_kernel_source.cache_clear()
        assert compiler.compile_kernel_source("copy", "sm_90").image[:4] == b"\x7fELF"
        assert "cannot be used" in caplog.text
    monkeypatch.setenv("HISPARSE_CACHE_DIR", "")  # unset, not the current folder
    assert compiler.cache_dir() == compiler.Path("~/.cache/hisparse/kernels").expanduser()
    compiler.compile_kernel_source.cache_clear()


def test_compile_report():
    rows = compiler.compile_report(ARCHS)
    kernels = {k for ks in compiler.KERNELS.values() for k in ks}
    assert {(r["kernel"], r["arch"]) for r in rows} == {(k, a) for k in kernels for a in ARCHS}
    fields = {"kernel", "arch", "registers", "spill_stores", "spill_loads", "stack_bytes", "shared_bytes"}
    assert all(set(r) == fields for r in rows)


def test_select_arch():
    new_driver = 99990
    assert compiler.select_arch((9, 0), 13000) == "sm_90"
    assert compiler.select_arch((8, 6), 13000) == "sm_86"
    assert compiler.select_arch((9, 9), 13000) == "sm_90"  # same major: the sm_90 cubin runs there
    newest = max(compiler.supported_archs())
    assert compiler.select_arch((99, 0), new_driver) == f"compute_{newest}"
    nv_major, nv_minor = compiler.nvrtc_version()
    older_driver = nv_major * 1000 + nv_minor * 10 - 10  # one minor release behind this NVRTC
    with pytest.raises(compiler.CompileError, match="driver"):
        compiler.select_arch((99, 0), older_driver)
    for old in ((3, 0), (7, 5)):  # Turing holds 64 KB of shared memory a block, below every launch limit
        with pytest.raises(compiler.CompileError, match="need 8.0 or newer"):
            compiler.select_arch(old, new_driver)


def test_parse_resources():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Function properties for k1
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 144 bytes smem, 392 bytes cmem[0]
ptxas info    : Compiling entry function 'k2' for 'sm_90'
ptxas info    : Function properties for k2
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers
"""
    assert compiler.parse_resources(log) == {
        "k1": compiler.KernelResources(40, 4, 12, 8, 144),
        "k2": compiler.KernelResources(12, 0, 0, 0, 0),
    }
    # A __noinline__ device function's frame comes apart, after the entries: every kernel counts it.
    helper = """ptxas info    : Function properties for _Z6helperPKhii
ptxas         .     1184 bytes stack frame, 1476 bytes spill stores, 1484 bytes spill loads
"""
    assert compiler.parse_resources(log + helper) == {
        "k1": compiler.KernelResources(40, 1480, 1496, 1192, 144),
        "k2": compiler.KernelResources(12, 1476, 1484, 1184, 0),
    }


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown kernel source"):
        compiler.compile_kernel_source("nope", "sm_90")
    with pytest.raises(ValueError, match="arch"):
        compiler.compile_kernel_source("copy", "90")


def test_the_extension_embeds_exactly_the_repository_kernels():
    from pathlib import Path

    from hisparse import _core

    repo = Path(__file__).resolve().parents[1] / "cuda"
    embedded = dict(_core.kernel_sources())
    assert embedded == {f.name: f.read_text() for f in repo.glob("*.cu*")}
