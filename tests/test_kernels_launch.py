"""The launch arithmetic (hisparse.kernels.launch): what a kernel launch needs and refuses, checked with no GPU,
and the shared-memory table of resolve per architecture and configuration. Run with -s to see the table."""

import math

import pytest

from hisparse import ConfigError, Layout
from hisparse.kernels import COMPILED_ARCHS, check_datapath, launch, resolve_shared, shared_memory_table

TOP_K = 2048


@pytest.mark.parametrize("arch", COMPILED_ARCHS)
@pytest.mark.parametrize("hot_rows", [2048, 4096, 8192, 10240, 16384, 32768])
@pytest.mark.parametrize("batch", [1, 8, 32, 128])
@pytest.mark.parametrize("rows_per_request", [1, 2, 4, 5])
def test_resolve_launches_for_every_hot_region_up_to_32768_rows(arch, hot_rows, batch, rows_per_request):
    """The issue's bound: H up to 32,768 at top_k 2048 launches everywhere, within 99 KB where that is all."""
    limit = launch.smem_limit(arch)
    shared = resolve_shared(top_k=TOP_K, hot_rows=hot_rows, batch_rows=batch * rows_per_request,
                            rows_per_request=rows_per_request, limit=limit)
    assert shared.total_bytes <= limit
    assert shared.capacity >= launch.MIN_TABLE
    # The table holds the selection (or the most the architecture allows): it grows with top_k x rows, not H.
    assert shared.fast_positions >= min(TOP_K * rows_per_request, 3 * shared.capacity // 4)
    if not shared.clamped:
        assert shared.fast_positions >= TOP_K * rows_per_request


def test_shared_memory_does_not_grow_with_the_hot_region_but_with_the_selection():
    one = resolve_shared(top_k=TOP_K, hot_rows=4096, batch_rows=128, limit=227 * 1024)
    wide = resolve_shared(top_k=TOP_K, hot_rows=32768, batch_rows=128, limit=227 * 1024)
    assert wide.capacity == one.capacity == launch.SPARSE_TABLE * TOP_K  # a sparse table, where memory allows
    assert wide.dynamic_bytes - one.dynamic_bytes == (32768 - 4096) // 8  # one bit per hot slot
    four = resolve_shared(top_k=TOP_K, hot_rows=4096, batch_rows=128, rows_per_request=4, limit=227 * 1024)
    assert four.total_bytes <= 227 * 1024 and four.capacity >= math.ceil(4 * 4 * TOP_K / 3) and not four.clamped
    small = resolve_shared(top_k=TOP_K, hot_rows=4096, batch_rows=128, limit=99 * 1024)
    assert small.total_bytes <= 99 * 1024 and not small.clamped  # less sparse, all of the selection still fits


def test_a_small_gpu_clamps_the_table_instead_of_refusing():
    big = resolve_shared(top_k=TOP_K, hot_rows=10240, batch_rows=640, rows_per_request=5, limit=227 * 1024)
    small = resolve_shared(top_k=TOP_K, hot_rows=10240, batch_rows=640, rows_per_request=5, limit=99 * 1024)
    assert not big.clamped and small.clamped
    assert small.total_bytes <= 99 * 1024 < big.total_bytes
    assert small.fast_positions < big.fast_positions


def test_what_no_gpu_can_launch_is_refused_with_what_to_change():
    with pytest.raises(ConfigError, match="fewer batch rows or hot rows"):
        resolve_shared(top_k=TOP_K, hot_rows=4096, batch_rows=20000, limit=99 * 1024)
    with pytest.raises(ConfigError, match="positive integer"):
        resolve_shared(top_k=0, hot_rows=4096, batch_rows=1, limit=99 * 1024)
    sizes = dict(hot_rows=4096, block_size=64, gpu_blocks=1000, host_blocks=1000, max_model_len=2**20,
                 row_bytes=656, batch_rows=128)
    check_datapath(**sizes, top_k=TOP_K)
    for change, message in [
        (dict(gpu_blocks=2**25), "GPU slab rows"),
        (dict(host_blocks=2**25), "host pool rows"),
        (dict(max_model_len=2**31), "positions"),
        (dict(top_k=2**24), "replay jobs"),
        (dict(hot_rows=2**22), "invalidate needs"),
        (dict(batch_rows=30000), "replay needs"),
        (dict(groups=70000), "index groups"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_datapath(**{**sizes, "top_k": TOP_K, **change})


def test_layout_refuses_at_construction_what_a_launch_would_refuse():
    sizes = dict(num_gpu_blocks=100, num_host_blocks=100, block_size=64, max_model_len=8192, max_running=8,
                 hot_rows=4096, row_bytes=656)
    Layout(**sizes)
    with pytest.raises(ConfigError, match="GPU slab rows"):
        Layout(**{**sizes, "num_gpu_blocks": 2**26})
    with pytest.raises(ConfigError, match="invalidate needs"):
        Layout(**{**sizes, "hot_rows": 2**22})


def test_the_table_covers_every_architecture_and_configuration(capsys):
    rows = shared_memory_table()
    assert len(rows) == len(launch.TABLE_HOT_ROWS) * len(launch.TABLE_ROWS_PER_REQUEST) * len(
        launch.TABLE_BATCH) * len(COMPILED_ARCHS)
    assert all(r["total_bytes"] <= r["limit"] for r in rows)
    with capsys.disabled():
        print("\nresolve shared memory (KiB), top_k 2048, 128 requests (batch rows: 128 x rows/req); clamped: *")
        print(f"{'H':>6} {'rows/req':>8} " + " ".join(f"{a:>9}" for a in COMPILED_ARCHS))
        for h in launch.TABLE_HOT_ROWS:
            for n in launch.TABLE_ROWS_PER_REQUEST:
                cells = {r["arch"]: r for r in rows if r["hot_rows"] == h and r["rows_per_request"] == n
                         and r["batch"] == 128}
                print(f"{h:>6} {n:>8} " + " ".join(
                    f"{cells[a]['total_bytes'] / 1024:>8.1f}{'*' if cells[a]['clamped'] else ' '}"
                    for a in COMPILED_ARCHS))
