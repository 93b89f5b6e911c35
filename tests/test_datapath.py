"""The guards of ``hisparse.datapath``: it is all that stands between a bad argument and the Rust CPU
reference, which turns raw buffers into (mutable) slices with the GIL released."""

import inspect
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from plans import plan as make_plan

from hisparse import DataPath, InvalidArgumentError, Layout, ResidencyManager, _core
from hisparse.datapath import RESOLVE_FIELDS, _check_disjoint, resolve_reference

LAYOUT = Layout(num_gpu_blocks=40, num_host_blocks=160, block_size=4, max_model_len=96, max_running=6,
                hot_rows=16, row_bytes=16, layer_groups=(0, 1, 1))
# As many host as GPU blocks, so that one tensor can pose as both the slab and the host pool.
SQUARE = Layout(**{**LAYOUT.__dict__, "num_host_blocks": LAYOUT.num_gpu_blocks})
ROWS = LAYOUT.num_gpu_blocks * LAYOUT.block_size
TOP_K = 8


def filled(layout: Layout = LAYOUT, **adopted) -> DataPath:
    """A data path with random slab and host contents and a state that is not all defaults."""
    dp = DataPath(layout, **adopted)
    gen = torch.Generator().manual_seed(0)
    for t in [*dp.gpu, *dp.host]:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
    dp.apply(make_plan(**VALID))
    return dp


def snapshot(dp: DataPath) -> dict[str, torch.Tensor]:
    return {
        **{k: v.clone() for k, v in dp.state.items()},
        **{f"gpu {i}": t.clone() for i, t in enumerate(dp.gpu)},
        **{f"host {i}": t.clone() for i, t in enumerate(dp.host)},
    }


def assert_unchanged(dp: DataPath, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(dp)
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed"


def overlap_error(a: str, b: str):
    """pytest.raises for an overlap of ``a`` and ``b``, named in either order."""
    return pytest.raises(InvalidArgumentError, match=rf"^({a} and {b}|{b} and {a}) overlap in memory")


def reference_kwargs(dp: DataPath, group: int = 0) -> dict:
    """resolve_reference's keywords for a valid call on ``dp``'s state."""
    layers = dp.layout.layers_of(group)
    return dict(
        topk=torch.zeros(2, TOP_K, dtype=torch.int32),
        row_state=torch.tensor([0, 1], dtype=torch.int32),
        **{name: dp.state[name] for name in RESOLVE_FIELDS},
        gpu_layers=[dp.gpu[layer] for layer in layers],
        host_layers=[dp.host[layer] for layer in layers],
        group=group,
        block_size=dp.layout.block_size,
        out=torch.zeros(2, TOP_K, dtype=torch.int32),
    )


# ------------------------------------------------------------------ 1. aliasing


def test_the_layers_of_one_slab_are_disjoint_not_aliased():
    """Views of one storage are fine as long as their byte ranges do not meet."""
    storage = torch.zeros(6, ROWS, LAYOUT.row_bytes, dtype=torch.uint8)
    dp = filled(SQUARE, gpu=list(storage[:3]), host=storage[3:])
    dp.mirror([(4, 5)])
    dp.copy_blocks([(2, 3)], to_host=False)
    assert torch.equal(dp.host[1][5], dp.gpu[1][4]) and torch.equal(dp.gpu[2][8:12], dp.host[2][12:16])
    dp.resolve(torch.zeros(1, TOP_K, dtype=torch.int32), torch.tensor([0], dtype=torch.int32), group=1)
    assert dp.gather(torch.tensor([[4, -1]], dtype=torch.int32), 1)[0, 0].equal(dp.gpu[1][4])
    dp.invalidate([(0, 0)])


def test_adopted_layers_that_share_memory_are_refused():
    t = torch.zeros(ROWS, LAYOUT.row_bytes, dtype=torch.uint8)
    other = torch.zeros_like(t)
    host = torch.zeros(3, LAYOUT.num_host_blocks * LAYOUT.block_size, LAYOUT.row_bytes, dtype=torch.uint8)
    with overlap_error("gpu layer 0", "gpu layer 1"):
        DataPath(LAYOUT, gpu=[t, t, other], host=host)
    # A partial overlap counts as much as a full one.
    big = torch.zeros(3 * ROWS, LAYOUT.row_bytes, dtype=torch.uint8)
    with overlap_error("gpu layer 1", "gpu layer 2"):
        DataPath(LAYOUT, gpu=[big[:ROWS], big[ROWS : 2 * ROWS], big[2 * ROWS - 1 : 3 * ROWS - 1]], host=host)


def test_a_slab_that_is_the_host_pool_is_refused():
    t = torch.zeros(3, ROWS, LAYOUT.row_bytes, dtype=torch.uint8)
    with overlap_error("gpu", "host"):
        DataPath(SQUARE, gpu=t, host=t)
    with overlap_error("gpu layer 2", "host"):
        DataPath(SQUARE, gpu=[torch.zeros_like(t[0]), torch.zeros_like(t[0]), t[1]], host=t)


def test_copies_refuse_aliased_layers_and_write_nothing():
    """Attributes swapped after construction are caught at the call."""
    dp = filled(SQUARE)
    before = snapshot(dp)
    gpu, host = dp.gpu, dp.host
    dp.gpu = [gpu[0], gpu[0], gpu[2]]
    with overlap_error("gpu layer 0", "gpu layer 1"):
        dp.mirror([(1, 1)])
    with overlap_error("gpu layer 0", "gpu layer 1"):
        dp.copy_blocks([(1, 1)], to_host=False)
    dp.gpu, dp.host = gpu, gpu  # the slab as the host pool
    with overlap_error("gpu layer 0", "host layer 0"):
        dp.copy_blocks([(1, 1)], to_host=True)
    dp.gpu, dp.host = gpu, host
    assert_unchanged(dp, before)


def test_resolve_and_invalidate_refuse_aliased_state():
    dp = filled()
    before = snapshot(dp)
    topk, row_state = torch.zeros(1, TOP_K, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    hot_stamp, gpu = dp.state["hot_stamp"], dp.gpu
    dp.state["hot_stamp"] = dp.state["hot_pos"].view(torch.int64)  # the int64 type the stamps have, over hot_pos
    with overlap_error("hot_pos", "hot_stamp"):
        dp.invalidate([(0, 1)])
    with overlap_error("hot_pos", "hot_stamp"):
        dp.resolve(topk, row_state)
    dp.state["hot_stamp"] = hot_stamp
    dp.gpu = [gpu[0], gpu[1], gpu[1]]  # group 1 reads layers 1 and 2
    with overlap_error("gpu layer 0", "gpu layer 1"):
        dp.resolve(topk, row_state, group=1)
    dp.gpu = gpu
    assert_unchanged(dp, before)


def test_resolve_reference_refuses_every_overlap_with_a_written_buffer():
    dp = filled()
    before = snapshot(dp)
    kw = reference_kwargs(dp)
    cases = [
        (dict(hot_stamp=kw["hot_pos"].view(torch.int64)), ("hot_pos", "hot_stamp")),
        (dict(hot_clock=kw["hot_stamp"].view(-1)[: kw["hot_clock"].numel()]), ("hot_stamp", "hot_clock")),
        (dict(out=kw["topk"]), ("topk", "out")),
        (dict(out=dp.state["heat"].view(-1)[: 2 * TOP_K].view(2, TOP_K)), ("heat", "out")),
        (dict(out=dp.state["block_table"].view(-1)[3 : 3 + 2 * TOP_K].view(2, TOP_K)), ("block_table", "out")),
        (dict(gpu_layers=kw["host_layers"]), ("gpu layer 0", "host layer 0")),
        (dict(gpu_layers=[dp.host[0][: ROWS]]), ("gpu layer 0", "host layer 0")),
    ]
    for change, names in cases:
        with overlap_error(*names):
            resolve_reference(**{**kw, **change})
    assert_unchanged(dp, before)


def test_buffers_that_are_only_read_may_overlap():
    dp = filled()
    kw = reference_kwargs(dp)
    topk = torch.zeros(2, TOP_K, dtype=torch.int32)
    resolve_reference(**{**kw, "topk": topk, "row_state": topk.view(-1)[3:5]})  # row_state [0, 0] inside topk
    assert kw["out"].min() >= 0  # position 0 of request row 0 is resident or fetched


def test_gather_and_invalidate_shapes_of_aliasing():
    """Overlaps that DataPath's own calls cannot produce (it allocates out and pairs itself)."""
    slab = torch.zeros(64, 16, dtype=torch.uint8)
    with overlap_error("out", "slab"):
        _check_disjoint({"out": slab[8:24]}, {"row_ids": torch.zeros(16, dtype=torch.int32), "slab": slab})
    hot_pos, hot_stamp = torch.zeros(2, 3, 4, dtype=torch.int32), torch.zeros(2, 3, 4, dtype=torch.int64)
    with overlap_error("hot_pos", "pairs"):
        _check_disjoint({"hot_pos": hot_pos, "hot_stamp": hot_stamp}, {"pairs": hot_pos.view(-1)[10:14].view(2, 2)})


def test_a_write_inside_a_long_read_is_seen_past_a_short_read():
    """Address order read [0, 100), read [10, 20), written [50, 60): the write meets the first read."""
    buf = torch.zeros(100, dtype=torch.uint8)
    with overlap_error("long", "w"):
        _check_disjoint({"w": buf[50:60]}, {"long": buf, "short": buf[10:20]})
    _check_disjoint({"w": buf[:0], "v": buf[:0]}, {"all": buf})  # empty buffers alias nothing


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12), st.booleans()), max_size=8))
def test_check_disjoint_agrees_with_every_pair(spans):
    buf = torch.zeros(64, dtype=torch.int16)  # 2-byte elements: ranges are compared in bytes
    tensors = {f"t{i}": (buf[start : start + n], writes) for i, (start, n, writes) in enumerate(spans)}
    clash = any(
        (wa or wb) and a.numel() and b.numel()
        and a.data_ptr() < b.data_ptr() + 2 * b.numel() and b.data_ptr() < a.data_ptr() + 2 * a.numel()
        for (a, wa), (b, wb) in itertools.combinations(tensors.values(), 2)
    )
    written = {k: t for k, (t, w) in tensors.items() if w}
    read = {k: t for k, (t, w) in tensors.items() if not w}
    if clash:
        with pytest.raises(InvalidArgumentError, match="overlap in memory"):
            _check_disjoint(written, read)
    else:
        _check_disjoint(written, read)


# ------------------------------------------------------------------ 2. layout


@pytest.mark.parametrize("field", ["num_gpu_blocks", "num_host_blocks", "block_size", "max_model_len",
                                   "max_running", "hot_rows", "row_bytes"])
@pytest.mark.parametrize("value", [0, -16, 16.0, True])
def test_layout_sizes_must_be_positive_integers(field, value):
    with pytest.raises(InvalidArgumentError, match=f"{field} must be a positive integer"):
        Layout(**{**LAYOUT.__dict__, field: value})


@pytest.mark.parametrize("row_bytes", [8, 24, 17])
def test_row_bytes_must_be_a_multiple_of_16(row_bytes):
    with pytest.raises(InvalidArgumentError, match="multiple of 16"):
        Layout(**{**LAYOUT.__dict__, "row_bytes": row_bytes})


@pytest.mark.parametrize("groups", [(), (1,), (0, 2), (-1, 0)])
def test_layer_groups_must_name_every_group_from_0(groups):
    with pytest.raises(InvalidArgumentError, match="layer_groups"):
        Layout(**{**LAYOUT.__dict__, "layer_groups": groups})


# ------------------------------------------------------------------ 3. group and layer indices


@pytest.mark.parametrize("group", [2, -1, 7])
def test_resolve_names_a_group_out_of_range(group):
    dp = filled()
    before = snapshot(dp)
    topk, row_state = torch.zeros(1, TOP_K, dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match=rf"group must be an integer in 0..1, not int {group}"):
        dp.resolve(topk, row_state, group=group)
    with pytest.raises(InvalidArgumentError, match=rf"group {group} is out of range"):
        resolve_reference(**{**reference_kwargs(dp), "group": group})
    assert_unchanged(dp, before)


@pytest.mark.parametrize("layer", [3, -1])
def test_gather_names_a_layer_out_of_range(layer):
    with pytest.raises(InvalidArgumentError, match=rf"layer must be an integer in 0..2, not int {layer}"):
        filled().gather(torch.zeros(1, 2, dtype=torch.int32), layer)


def test_invalidate_wants_pairs():
    dp = filled()
    before = snapshot(dp)
    for bad in ([(0, 1, 2), (0, 3, 4)], [(0, 1), (2,)], [(0, 1.5)], [(True, 1)], [(2**40, 0)], "ab", 7):
        with pytest.raises(InvalidArgumentError, match="pairs"):
            dp.invalidate(bad)
    assert_unchanged(dp, before)


# ------------------------------------------------------------------ 4. plans are checked before they are applied


# Touches every part of the state and both copy directions; each bad plan below comes after these entries,
# so that an apply writing as it goes would have changed something before it failed.
VALID = dict(
    cleared_rows=[5],
    scheduled=[(7, 0, 0, 9), (2**64 - 1, 1, 95, 1)],
    seq_lens=[(0, 9, 7), (1, 96, 2**64 - 1)],
    table_updates=[(0, 0, 1, -1, False), (0, 1, 2, 7, True), (1, 23, 39, 39, False), (1, 2, 8, 9, True)],
    hot_updates=[(0, [3, 4, 5, 6]), (1, [])],
    restores=[(8, 9)],
    materialize=[(1, 10, 11)],
)
# The wire carries u32: a negative row or length arrives as a huge value (host blocks are signed).
BAD = {
    "cleared row 6": dict(cleared_rows=[6]),
    "cleared row 4294967295": dict(cleared_rows=[-1]),
    "state row 6": dict(seq_lens=[(6, 1, 3)]),
    "seq_len 97": dict(seq_lens=[(2, 97, 3)]),
    "page 24": dict(table_updates=[(2, 24, 1, -1, False)]),
    "GPU block 40": dict(table_updates=[(2, 0, 40, -1, False)]),
    "host block 160": dict(table_updates=[(2, 0, 1, 160, False)]),
    "host block -2": dict(table_updates=[(2, 0, 1, -2, False)]),
    "hot GPU block 40": dict(hot_updates=[(2, [1, 2, 3, 40])]),
    "hot GPU block 0": dict(hot_updates=[(2, [1, 2, 3, 0])]),
    "scheduled row 6": dict(scheduled=[(1, 6, 0, 1)]),
    "restored GPU block 40": dict(restores=[(40, 1)]),
    "copied host block 160": dict(materialize=[(2, 1, 160)]),
    "restored host block 4294967295": dict(restores=[(1, -1)]),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_a_plan_outside_the_layout_changes_nothing(what):
    dp = filled()
    before = snapshot(dp)
    plan = make_plan(**{k: v + BAD[what].get(k, []) for k, v in VALID.items()})
    with pytest.raises(InvalidArgumentError, match=f"the plan's {what} is outside"):
        dp.apply(plan)
    assert_unchanged(dp, before)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(hot_updates=[(2, [1, 2, 3, 4, 5])]), "hot update of 4 blocks in a plan of 5-block hot regions"),
        (dict(restores=[(12, 1), (12, 2)]), "restores two pages into GPU block 12"),
        (dict(materialize=[(2, 1, 20), (3, 2, 20)]), "copies two pages into host block 20"),
    ],
)
def test_a_plan_with_a_bad_hot_region_or_a_destination_twice_changes_nothing(bad, message):
    dp = filled()
    before = snapshot(dp)
    with pytest.raises(InvalidArgumentError, match=message):
        dp.apply(make_plan(**{k: v + bad.get(k, []) for k, v in VALID.items()}))
    assert_unchanged(dp, before)


# Plans whose scheduled positions or restores the plan does not own (SPEC.md, "apply"): each would make a
# slot mapping write another row's positions, or a restore overwrite a block no table entry names.
NOT_OWNED = {
    "a start wrapped below 0": (dict(scheduled=[(3, 2, 2**32 - 2, 10)], seq_lens=[(2, 8, 3)]), "row's length"),
    "2**32 - 1 tokens": (dict(scheduled=[(3, 2, 0, 2**32 - 1)], seq_lens=[(2, 96, 3)]), "row's length"),
    "a start one page past the table": (dict(scheduled=[(3, 2, 96, 4)], seq_lens=[(2, 96, 3)]), "row's length"),
    "no length for the row": (dict(scheduled=[(3, 2, 0, 4)]), "row's length"),
    "another request's row": (dict(scheduled=[(3, 2, 0, 4)], seq_lens=[(2, 4, 99)]), "row's length"),
    "a restore no table names": (dict(restores=[(13, 1)]), "none of its table entries names"),
}


@pytest.mark.parametrize("path", ["apply", "_apply_torch"])
@pytest.mark.parametrize("what", sorted(NOT_OWNED))
def test_both_worker_paths_refuse_positions_the_plan_does_not_own(what, path):
    """The CPU path (Rust) and the device path (torch, here on CPU tensors) share one check."""
    dp = filled()
    before = snapshot(dp)
    bad, message = NOT_OWNED[what]
    plan = make_plan(**{k: v + bad.get(k, []) for k, v in VALID.items()})
    with pytest.raises(InvalidArgumentError, match=message):
        getattr(dp, path)(plan)
    with pytest.raises(InvalidArgumentError, match="applied last"):
        dp.slot_mapping(plan)
    assert_unchanged(dp, before)


def test_apply_wants_a_step_plan_and_never_a_short_one():
    dp = filled()
    before = snapshot(dp)
    for bad in (None, b"HSPL", dict(VALID)):
        with pytest.raises(InvalidArgumentError, match="StepPlan"):
            dp.apply(bad)
    with pytest.raises(InvalidArgumentError, match="short plan"):
        dp.apply(make_plan(missing_blocks=3))
    assert_unchanged(dp, before)


def test_the_device_path_of_apply_equals_the_reference():
    """``_apply_torch`` is what a CUDA worker runs; on CPU tensors it must leave exactly what Rust leaves."""
    ref, torch_path = filled(), filled()
    hot = [(0, [3, 4, 5, 6]), (1, []), (4, [7, 8, 9, 10])]
    lens = [(0, 9, 7, True), (1, 96, 2**64 - 1)]  # row 0's request resident, row 1's not
    plan = make_plan(**{**VALID, "cleared_rows": [5, 4], "hot_updates": hot, "seq_lens": lens})
    assert plan.resident_rows == [(0, True), (1, False)]
    ref.apply(plan)
    torch_path._apply_torch(plan)
    assert_unchanged(torch_path, snapshot(ref))
    assert ref.state["row_request"][1] == -1  # u64::MAX as its int64 bits
    assert ref.state["releasable"][0, 1] == 1 and ref.state["host_table"][0, 1] == 7
    assert ref.state["resident"][:2].tolist() == [1, 0]
    ref.apply(make_plan(cleared_rows=[0]))
    assert ref.state["resident"][0] == 0


def test_resolve_reads_the_resident_flag_apply_set():
    """A request the plan flags resident takes resolve's resident path: a selected page without a block is then
    corrupt state (-1, BAD_TABLE) instead of a miss through the hot region."""
    outs = []
    for resident in (False, True):
        dp = DataPath(LAYOUT)
        dp.apply(make_plan(seq_lens=[(0, 9, 7, resident)], table_updates=[(0, 0, 1, 2, False)],
                           hot_updates=[(0, [3, 4, 5, 6])]))
        dp.state["block_table"][0, 0] = 0  # the page loses its block, as no plan of the core's would leave it
        outs.append((dp.resolve(torch.tensor([[3, -1]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)),
                     int(dp.state["status"][0])))
    (miss, ok), (bad, status) = outs
    assert miss[0, 0] >= 0 and ok == 0
    assert bad[0].tolist() == [-1, -1] and status == 4


def manager(**larger) -> ResidencyManager:
    sizes = dict(num_gpu_blocks=LAYOUT.num_gpu_blocks, num_host_blocks=LAYOUT.num_host_blocks,
                 max_model_len=LAYOUT.max_model_len, max_running=LAYOUT.max_running, hot_rows=LAYOUT.hot_rows)
    return ResidencyManager(block_size=LAYOUT.block_size, top_k=TOP_K, num_index_groups=LAYOUT.num_groups,
                            watermark=4, page_bytes=LAYOUT.page_bytes, **{**sizes, **larger})


@pytest.mark.parametrize(
    "larger, requests, refused",
    [
        (dict(max_running=12, num_gpu_blocks=80, num_host_blocks=800), [10] * 8, "state row 6"),
        (dict(max_model_len=400, num_gpu_blocks=400, num_host_blocks=800), [10, 200], "seq_len 200"),
        (dict(num_gpu_blocks=400, num_host_blocks=800), [90] * 4, r"GPU block \d+"),
    ],
)
def test_a_plan_from_a_larger_manager_changes_nothing(larger, requests, refused):
    m, dp = manager(**larger), filled()
    m.admit(0, 8)
    dp.apply(m.plan_step([(0, 8)]))  # a valid step first, so that there is state to damage
    before = snapshot(dp)
    for rid, n in enumerate(requests, start=1):
        m.admit(rid, n)
    plan = m.plan_step([(rid, n) for rid, n in enumerate(requests, start=1)])
    assert plan.ok
    with pytest.raises(InvalidArgumentError, match=f"the plan's {refused} is outside .* of this worker's layout"):
        dp.apply(plan)
    assert_unchanged(dp, before)


# ------------------------------------------------------------------ 5. no dead parameters


def test_resolve_reference_takes_no_miss_plan():
    """The CPU reference records no miss plan; the keyword is gone rather than accepted only to fail."""
    assert "miss_plan" not in inspect.signature(resolve_reference).parameters
    dp = filled()
    with pytest.raises(TypeError):
        resolve_reference(**reference_kwargs(dp), miss_plan=torch.zeros(2 * TOP_K, 2, dtype=torch.int64))


def test_the_device_path_of_heat_summary_equals_the_reference():
    """``_heat_summary_torch`` (ranked on the device, encoded on the host) reports and decays exactly what the
    Rust reference does, ties included (equal heat ranks the older page first)."""
    gen = torch.Generator().manual_seed(3)
    ref = filled()
    ref.apply(make_plan(seq_lens=[(2, 50, 11), (3, 1, 12)], scheduled=[(11, 2, 0, 50), (12, 3, 0, 1)],
                        table_updates=[(2, p, 1 + p, p, p % 3 != 0) for p in range(13)]))
    ref.state["heat"].copy_(torch.randint(0, 4, ref.state["heat"].shape, generator=gen, dtype=torch.int32))
    other = filled()
    for name, t in ref.state.items():
        other.state[name].copy_(t)
    for coldest, hottest in ((3, 2), (100, 0), (0, 5), (4, 100)):
        want, got = ref.heat_summary(coldest, hottest), other._heat_summary_torch(coldest, hottest)
        assert _core.decode_heat_summary(got) == _core.decode_heat_summary(want)
        assert torch.equal(ref.state["heat"], other.state["heat"])
    ranked = {rid: (cold, hot) for rid, cold, hot in _core.decode_heat_summary(ref.heat_summary(100, 4))}
    assert set(ranked) == {7, 11, 12, 2**64 - 1}  # the rows of VALID and the two above
    assert [page for _, page in ranked[11][0]] == sorted(p for p in range(13) if p % 3)  # heat decayed to 0
    assert ranked[11][1] == []  # all 8 releasable pages are among the coldest: none is left to be hottest


def test_apply_checks_again_after_a_tensor_is_replaced():
    """apply caches its checks across steps; replacing a state tensor, the slab or the pool is noticed."""
    dp = filled()
    dp.apply(make_plan())  # checked and cached
    before = snapshot(dp)
    heat = dp.state["heat"]
    dp.state["heat"] = dp.state["block_table"]  # aliases another tensor apply writes
    with overlap_error("block_table", "heat"):
        dp.apply(make_plan())
    dp.state["heat"] = heat
    gpu = dp.gpu
    dp.gpu = [gpu[0], gpu[0], gpu[2]]
    with overlap_error("gpu layer 0", "gpu layer 1"):
        dp.apply(make_plan())
    dp.gpu = gpu
    dp.apply(make_plan())
    assert_unchanged(dp, before)


def test_an_adopted_slabs_layers_cannot_be_swapped_one_at_a_time():
    """Checks made once hold until the slab is replaced whole: its layers are a tuple, so a layer swapped in
    place (which apply's restores would miss, writing the old tensor) is refused at the assignment."""
    dp = filled(gpu=[torch.zeros(ROWS, LAYOUT.row_bytes, dtype=torch.uint8) for _ in range(LAYOUT.num_layers)],
                host=torch.zeros(LAYOUT.num_layers, LAYOUT.num_host_blocks * LAYOUT.block_size, LAYOUT.row_bytes,
                                 dtype=torch.uint8))
    assert isinstance(dp.gpu, tuple)
    with pytest.raises(TypeError):
        dp.gpu[1] = torch.zeros(ROWS, LAYOUT.row_bytes, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="gpu must be a tensor or a list"):
        dp.gpu = 3


def test_uint64_values_beyond_int64_are_refused_not_wrapped_to_padding():
    """A uint64 pair past int64 would wrap to a negative entry, which copies skip as padding; positions would
    fail their range check with a value never given. Both are refused; values within range work."""
    dp = filled()
    before = snapshot(dp)
    for pairs in ([[8, 2**63 + 3]], [[2**64 - 1, 5]]):
        with pytest.raises(InvalidArgumentError, match="pairs holds a value beyond the int64 range"):
            dp.mirror(torch.tensor(pairs, dtype=torch.uint64))
    assert_unchanged(dp, before)
    dp.mirror(torch.tensor([[8, 5]], dtype=torch.uint64))
    assert torch.equal(dp.host[:, 5], dp.gpu[:, 8])
