"""The vLLM plugin's own pieces, without running vLLM's scheduler: version pin, entry point, the worker's
selection heat (counting, ranking, the runtime it counts in) and the Rust pool policy that consumes it."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

from hisparse import _core
from hisparse import errors as hisparse_errors
from hisparse.errors import ConfigError
from hisparse.integrations import vllm as plugin


def test_only_the_pinned_vllm_is_accepted():
    assert plugin.check_vllm_version("0.33.0") == "0.33.0"
    assert plugin.check_vllm_version("0.33.0+cu130") == "0.33.0+cu130"
    with pytest.raises(ConfigError, match=r"supports vllm==0\.33\.0 only, found 0\.34\.0"):
        plugin.check_vllm_version("0.34.0")


def test_another_vllm_gets_a_warning_from_the_entry_point_and_a_refusal_from_the_connector(monkeypatch, caplog):
    vllm = pytest.importorskip("vllm")
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    plugin.register()  # vLLM runs this in every process: it must not raise
    assert "supports vllm==0.33.0 only, found 0.34.0" in caplog.text
    with pytest.raises(ConfigError, match="found 0.34.0"):
        plugin.HiSparseConnector  # noqa: B018 - what vLLM's connector factory does


def test_entry_point_is_declared():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."vllm.general_plugins"]', 1)[1]
    assert section.split("[", 1)[0].strip() == 'hisparse = "hisparse.integrations.vllm:register"'


def test_connector_class_is_found_by_vllms_factory():
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnector as Native

    plugin.register()
    cfg = KVTransferConfig(kv_connector="HiSparseConnector", kv_connector_module_path="hisparse.integrations.vllm",
                           kv_role="kv_both", kv_connector_extra_config={"host_pool_gib": 1})
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls is plugin.HiSparseConnector and issubclass(cls, Native) and cls.__name__ == "HiSparseConnector"


def _summary(heat: list[list[int]], eligible: list[list[int]], coldest: int, hottest: int) -> bytes:
    """The core's own heat summary (``heat::summarize``) of rows whose request i is row i."""
    h = torch.tensor(heat, dtype=torch.int32)
    rows, pages = h.shape
    tables = [torch.full((rows,), pages * 64, dtype=torch.int32), torch.tensor(eligible, dtype=torch.uint8),
              torch.arange(rows, dtype=torch.int64), h]
    return _core._ref_heat_summary([(t.data_ptr(), t.numel()) for t in tables], pages, 64, coldest, hottest)


def test_pool_policy_takes_the_cores_heat_summary():
    # Request "a": pages 1 and 4 never selected, 2 once, 0 (a sink) and 6 the hottest; 3 and 5 unlisted.
    summary = _summary([[0, 0, 0, 0, 0, 0, 0], [90, 0, 1, 7, 0, 5, 40]], [[0] * 7, [1] * 7], 3, 2)
    p = _core.PoolPolicy()
    assert p.release_order("a", [5, 1, 0]) == [0, 1, 5]  # nothing known yet: oldest first
    assert p.report(summary, ["other", "a"]) is None
    assert p.release_order("a", [0, 1, 2, 3, 4, 5, 6]) == [1, 4, 2, 3, 5, 6, 0]
    assert len(p) == 2
    p.forget("a")
    assert len(p) == 1
    with pytest.raises(hisparse_errors.InvalidArgumentError, match="names request 1 of a batch of 1"):
        p.report(summary, ["only"])
    with pytest.raises(hisparse_errors.InvalidArgumentError):
        p.report(b"not a summary", ["a"])
    shaped = _core.PoolPolicy(blocks_per_page=6, hot_blocks=384)
    assert not shaped.worth_transition(64) and shaped.worth_transition(65)


def test_block_rows_mirror_what_vllms_scan_mirrors():
    """``BlockRows`` (the core's record of vLLM's rows): mirrors as vLLM's ``build_row_mirrors`` makes them,
    packed and read back as vLLM's mapping (``RowMirrors``: equal to vLLM's dict, pickled as its bytes);
    pages read from the host counted; quiet requests left out of the busy ones until a row changes; a lost
    page dropped in every resident row; bad records refused whole."""
    import pickle

    from vllm.v1.hisparse.types import SparseKVRowMirror

    from hisparse.integrations.vllm.mirrors import RowMirrors

    rows = _core.BlockRows(2, 4)
    rows.set("a", 0, [10, 11, None])
    rows.set("a", 1, [20, 21, 22])
    rows.extend("a", None, [30, 31, 32])
    # rows 3 .. 9 of a (from 2 rows back, through 1 past the step), 0 .. 4 of b.
    packed, resident, busy = rows.scan({"a": 4, "b": 4}, {"a": 5, "b": 0}, 1, {"a": 2, "b": 0})
    got = RowMirrors(*packed, 2)
    # Page 2 is read from the host in group 0: skipped, its neighbours mirrored.
    expected = {"a": (SparseKVRowMirror((43, 83), 123, 1), SparseKVRowMirror((44, 84), 124, 4)), "b": ()}
    assert got == expected and expected == got and got.get("nobody", ()) == ()
    assert list(got) == ["a", "b"] and not resident and busy == ["a", "b"]
    again = pickle.loads(pickle.dumps(got))
    assert type(again) is RowMirrors and again == expected and list(again) == ["a", "b"]
    mirror = got["a"][0]
    assert pickle.loads(pickle.dumps(mirror)) == mirror and hash(mirror) == hash(SparseKVRowMirror((43, 83), 123, 1))
    assert type(mirror.source_starts[0]) is int and type(mirror.num_rows) is int
    # Packed bytes that do not add up (a corrupt or foreign payload) are refused where they are read.
    one = (1).to_bytes(4, sys.byteorder)  # one mirror for the request
    for bad in (RowMirrors(["a"], one, b"", b"", b"", 2), RowMirrors(["a"], b"\x01", b"", b"", b"", 2),
                RowMirrors(["a", "b"], one, bytes(16), bytes(8), bytes(8), 2)):
        with pytest.raises(hisparse_errors.InvalidArgumentError):
            bad["a"]
    changes = rows.changes
    rows.set_page("a", 0, 2, 12)
    assert rows.changes > changes and rows.scan({"a": 1}, {"a": 11})[1]
    assert not rows.scan({"a": 1, "b": 0}, {"a": 12, "b": 0})[1]

    def busy(scheduled, computed):
        return rows.scan(scheduled, computed)[2]

    rows.quiet("a", 12)
    assert busy({"a": 1, "b": 1}, {"a": 10, "b": 0}) == ["b"] and busy({"a": 2}, {"a": 10}) == ["a"]
    rows.extend("a", None, [33])
    assert busy({"a": 1}, {"a": 10}) == ["a"]
    with pytest.raises(hisparse_errors.InvalidArgumentError, match="computed has no entry for request a"):
        busy({"a": 1}, {})
    # A scan finds each request's rows where the last scan had the same id string: one whose rows are gone
    # since, their slot now another request's, is looked up by name (and has none).
    gone, new = "".join(["gone"]), "".join(["new"])  # strings of their own, as vLLM's ids are

    def mirrored(request, pages):
        got = RowMirrors(*rows.scan({request: 4}, {request: 0})[0], 2)[request]
        return [mirror.destination_start // 4 for mirror in got] == pages

    for group, ids in ((0, [1]), (1, [2]), (None, [3])):
        rows.set(gone, group, ids)
    assert mirrored(gone, [3]) and mirrored(gone, [3])
    for group in (0, 1, None):
        rows.clear(gone, group)
    for group, ids in ((0, [4]), (1, [5]), (None, [6])):
        rows.set(new, group, ids)
    assert mirrored(gone, []) and busy({gone: 1}, {gone: 0}) == [gone] and mirrored(new, [6])
    for group in (0, 1, None):
        rows.clear(new, group)
    assert rows.row("a", 0) == [10, 11, 12] and rows.row_len("a", 0) == 3 and rows.row_len("nobody", None) == 0
    for bad in (lambda: rows.set_page("a", 0, 3, 1), lambda: rows.set_page("nobody", None, 0, 1),
                lambda: rows.set("a", 2, []), lambda: rows.extend("a", 0, [2**32 - 1])):
        with pytest.raises(hisparse_errors.InvalidArgumentError):
            bad()
    assert rows.row("a", 0) == [10, 11, 12] and len(rows) == 1
    # A lost page: read from the host in every resident row, the host row as it was; no rows, nothing.
    rows.drop_page("a", 1)
    rows.drop_page("nobody", 0)
    assert [rows.row("a", group)[1] for group in (0, 1, None)] == [None, None, 31] and len(rows) == 1
    for group in (0, 1, None):
        rows.clear("a", group)
    assert len(rows) == 0


def test_block_rows_grow_as_vllm_appends_and_hand_back_rows_changed_elsewhere():
    """``BlockRows.grow``: one allocation's new blocks, every group in one call, read from each manager's
    ``req_to_blocks`` (a null block is a page read from the host); a row that also changed unreported, or a
    group whose allocation added nothing, is not extended, and the first comes back to be set whole."""
    from types import SimpleNamespace

    def block(block_id):
        return SimpleNamespace(block_id=block_id, is_null=block_id is None)

    rows = _core.BlockRows(2, 4)
    resident = [SimpleNamespace(req_to_blocks={"a": [block(10), block(11)]}),
                SimpleNamespace(req_to_blocks={"a": [block(20), block(None)]})]
    host = SimpleNamespace(req_to_blocks={"a": [block(30), block(31)]})
    groups = [(0, host, None), (1, resident[0], 0), (2, resident[1], 1)]
    assert rows.grow("a", ([1, 2], [1, 2], [1, 2]), groups) == []
    assert [rows.row("a", g) for g in (0, 1, None)] == [[10, 11], [20, None], [30, 31]]
    resident[0].req_to_blocks["a"].append(block(12))
    resident[1].req_to_blocks["a"][0] = block(25)  # changed where no record saw it, then grown
    resident[1].req_to_blocks["a"] += [block(22), block(23)]
    assert rows.grow("a", ([], [1], [1]), groups) == [(resident[1], 1)]
    assert [rows.row("a", g) for g in (0, 1, None)] == [[10, 11, 12], [20, None], [30, 31]]


def test_the_publication_gate_answers_a_known_page_count_and_hands_on_the_rest():
    """``PublishGate.cache_blocks`` (vLLM's host group's, called for every request every step): nothing for a
    request marked with the page count its coordinator found publishes nothing; otherwise (another count, no
    mark, a mark taken back) the coordinator's ``publish_when_ready``, looked up at each call, with vLLM's
    arguments as given. A call where the last pass had the same request reads its mark without the request's
    id; a mark changed since is read as it now stands."""
    from types import SimpleNamespace

    calls = []
    owner = SimpleNamespace(publish_when_ready=lambda *args, **kwargs: calls.append((args, kwargs)))
    gate = _core.PublishGate(64, owner)
    gate.mark("a", 2)
    a, b = SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")
    gate.cache_blocks(a, 128, replay_boundaries=(0,))
    gate.cache_blocks(a, 191, None, replay_boundaries=(0,))
    assert calls == []
    gate.cache_blocks(a, 192, 7, replay_boundaries=(64,))
    gate.cache_blocks(b, 0, replay_boundaries=())
    assert calls == [((a, 192, 7), {"replay_boundaries": (64,)}), ((b, 0, None), {"replay_boundaries": ()})]
    gate.end_pass()

    def one_pass(*steps):
        calls.clear()
        for request, tokens in steps:
            gate.cache_blocks(request, tokens, replay_boundaries=())
        gate.end_pass()
        return [args[0] for args, _ in calls]

    gate.mark("b", 0)
    assert one_pass((a, 128), (b, 63)) == [], "b marked since the last pass: read as it stands"
    assert one_pass((a, 128), (b, 63)) == [], "both found by position"
    gate.unmark("a")
    gate.mark("b", 1)
    assert one_pass((a, 128), (b, 63)) == [a, b], "a's mark taken back, b's changed"
    # Another request at a's position, then requests in another order: each read by its id.
    c = SimpleNamespace(request_id="c")
    gate.mark("a", 2)
    gate.mark("c", 3)
    assert one_pass((c, 192), (b, 64)) == [] and one_pass((b, 64), (a, 128), (c, 255)) == []
    assert (gate.marked("b"), gate.marked("nobody"), len(gate)) == (1, None, 3)
    gate.unmark_all()
    assert one_pass((b, 64), (a, 128)) == [b, a] and len(gate) == 0
    with pytest.raises(hisparse_errors.InvalidArgumentError, match="page_tokens"):
        _core.PublishGate(0, owner)


def test_the_publication_gate_lets_go_of_requests_unlocked():
    """A request the gate lets go of (another request at its place, or a pass that no longer calls for it) may
    run Python as it is freed, which may call the gate: that runs, where freeing it under the gate's lock would
    hang the process (in a child process here, so that a hang fails the test)."""
    script = """
from types import SimpleNamespace
from hisparse import _core
gate = _core.PublishGate(4, SimpleNamespace(publish_when_ready=lambda *a, **k: None))
freed = []
class Request:
    def __init__(self, request_id): self.request_id = request_id
    def __del__(self): freed.append(gate.marked(self.request_id))
for replaced in (True, False):
    gate.cache_blocks(Request("a"), 8, replay_boundaries=())
    gate.end_pass()
    if replaced:
        gate.cache_blocks(SimpleNamespace(request_id="b"), 8, replay_boundaries=())
    gate.end_pass()
assert freed == [None, None], freed
"""
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_publication_gate_is_collected_with_its_coordinator():
    """The coordinator holds its gate, and the gate the coordinator and the last pass's requests: the cycle is
    collected once nothing else holds either (the gate lets the collector see what it holds)."""
    import gc
    import weakref

    class Coordinator:
        def publish_when_ready(self, *args, **kwargs):
            pass

    class Request:
        request_id = "a"

    coordinator, request = Coordinator(), Request()
    coordinator.gate = _core.PublishGate(64, coordinator)
    request.coordinator = coordinator
    coordinator.gate.cache_blocks(request, 64, replay_boundaries=())
    collected = weakref.ref(coordinator), weakref.ref(request)
    del coordinator, request
    gc.collect()
    assert [ref() for ref in collected] == [None, None]


def _selection_heat(rows: int = 4, pages: int = 12, **options):
    from hisparse.heat import HeatOptions
    from hisparse.integrations.vllm.heat import SelectionHeat

    residency = torch.ones(rows, pages, dtype=torch.int32)
    heat = HeatOptions(**{"interval": 1, "coldest": 3, "hottest": 2, **options})
    return SelectionHeat(residency, 64, tail_pages=2, options=heat), residency


def _update(pages):
    from vllm.v1.hisparse.types import SparseKVResidencyUpdate

    return SparseKVResidencyUpdate(pages=list(pages), block_ids=([1] * len(pages),))


def test_selection_heat_counts_each_selected_position_and_skips_padding():
    pytest.importorskip("vllm")
    heat, _ = _selection_heat()
    # Query rows 0 and 1 are batch row 1 (state row 3: an MTP request's two rows), row 2 is padding.
    topk = torch.tensor([[0, 1, 64, -1], [130, 0, -1, -1], [5, 6, 7, 8]], dtype=torch.int32)
    heat.count(topk, torch.tensor([1, 1, -1], dtype=torch.int32), torch.tensor([2, 3, -1, -1], dtype=torch.int32))
    want = torch.zeros(4, 12, dtype=torch.int32)
    want[3, 0], want[3, 1], want[3, 2] = 3, 1, 1
    assert torch.equal(heat.heat, want)
    # A batch row whose state row is -1 counts nowhere either.
    heat.count(topk[:1], torch.tensor([2], dtype=torch.int32), torch.tensor([2, 3, -1, -1], dtype=torch.int32))
    assert torch.equal(heat.heat, want)


def test_selection_heat_summary_is_the_cores_ranking_then_halves():
    """What the worker sends equals the core's ``heat::summarize`` of the same heat over the same pages (resident,
    outside vLLM's two tail pages), and the counts are halved afterwards."""
    pytest.importorskip("vllm")
    gen = torch.Generator().manual_seed(5)
    heat, residency = _selection_heat(rows=5, pages=40, coldest=6, hottest=4)
    residency.copy_((torch.rand(5, 40, generator=gen) < 0.7).to(torch.int32))
    ids, rows = ["x", "y", "z"], torch.tensor([4, 0, 2], dtype=torch.int32)
    heat.begin_step(ids, rows, {"x": _update(range(30)), "y": _update(range(40)), "z": _update(range(2))})
    topk = torch.randint(-1, 40 * 64, (9, 50), generator=gen, dtype=torch.int32)
    heat.count(topk, torch.arange(9, dtype=torch.int32) % 3, rows)
    before = heat.heat.clone()
    report = heat.end_step()  # step 1 is due, and on CPU the copy is done at once
    assert report is not None and report.request_ids == tuple(ids)
    pages = torch.tensor([30, 40, 2])[:, None]
    eligible = (residency[rows.long()] != 0) & (torch.arange(40)[None, :] < pages - 2)
    want = _summary(before[rows.long()].tolist(), eligible.to(torch.uint8).tolist(), 6, 4)
    assert _core.decode_heat_summary(report.summary) == _core.decode_heat_summary(want)
    assert _core.decode_heat_summary(report.summary)[2] == (2, [], [])  # z: 2 pages, both in the tail
    halved = before.clone()
    halved[rows.long()] >>= 1
    assert torch.equal(heat.heat, halved)
    assert pickle.loads(pickle.dumps(report)) == report


def test_selection_heat_starts_a_row_cold_when_it_changes_hands_and_reports_on_schedule():
    pytest.importorskip("vllm")
    heat, _ = _selection_heat(rows=2, pages=8, interval=4)
    rows = torch.tensor([0, 1], dtype=torch.int32)
    reports = []
    for step in range(1, 10):
        ids = ["a", "b"] if step < 6 else ["c", "b"]  # "a" finished; "c" took its row 0
        heat.begin_step(ids, rows, {rid: _update(range(8)) for rid in ids})
        if step == 6:
            assert heat.heat[0].sum() == 0 and heat.heat[1].sum() > 0
        heat.count(torch.tensor([[0, 64, 128]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), rows)
        heat.count(torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), rows)
        reports.append(heat.end_step() is not None)
    # Steps 1, 2, 4 (first ones sooner), then every 4: 8.
    assert reports == [True, True, False, True, False, False, False, True, False]
    heat.begin_step([], None, {})  # a step without a forward is not counted
    assert heat.end_step() is None
    assert int(heat.heat.sum()) > 0
    heat.reset()  # as after vLLM's CUDA-graph capture
    assert int(heat.heat.abs().sum()) == 0 and heat.end_step() is None


def test_selection_heat_rows_that_change_hands_under_the_same_batch_start_cold():
    """Every running request preempted by ``reset_prefix_cache(reset_running_requests=True)`` comes back in the
    same order on other state rows: the batch's ids are the last forward's, and a request joined the batch."""
    pytest.importorskip("vllm")
    heat, _ = _selection_heat(rows=2, pages=8)
    ids = ["a", "b"]

    def forward(rows: list[int], joined: bool) -> None:
        state_rows = torch.tensor(rows, dtype=torch.int32)
        heat.begin_step(ids, state_rows, {}, joined)
        heat.count(torch.tensor([[64 * 3], [64 * 5]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                   state_rows)

    forward([0, 1], joined=True)
    forward([0, 1], joined=False)  # nobody joined: each row still serves its request, and keeps its heat
    assert heat.heat[0, 3] == 2 and heat.heat[1, 5] == 2 and int(heat.heat.sum()) == 4
    heat.begin_step(ids, torch.tensor([1, 0], dtype=torch.int32), {}, True)
    assert int(heat.heat.sum()) == 0


def test_a_request_joins_the_batch_when_it_is_new_or_resumed():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from hisparse.integrations.vllm.heat import joins_batch

    def output(new=(), resumed=()):
        return SimpleNamespace(scheduled_new_reqs=list(new),
                               scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)))

    assert not joins_batch(output())
    assert joins_batch(output(new=[object()])) and joins_batch(output(resumed=["a"]))
    assert joins_batch(None)


class _Rank:
    """A worker rank's connector with vLLM's worker state stubbed: what ``build_connector_worker_meta`` and
    ``reset_capture_state`` read from it."""

    def __init__(self, heat, transfers):
        from types import SimpleNamespace

        from hisparse.integrations.vllm.connector import HiSparseConnector

        self.resets = 0

        def reset_hot_state():
            self.resets += 1

        self.transfers = transfers
        self.connector = HiSparseConnector.__new__(HiSparseConnector)
        self.connector.connector_worker = SimpleNamespace(
            take_transfer_updates=lambda: (self.transfers.pop(0), []), take_completed_host_copies=lambda: [],
            reset_hot_state=reset_hot_state)
        self.connector.selection_heat = heat


def test_worker_metadata_keeps_a_report_that_only_one_rank_has_this_step(monkeypatch):
    """vLLM combines the ranks' metadata with the first rank's ``aggregate``: a report that reached the host on
    rank 1 but not yet on rank 0 (its copy still running) must survive it."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from hisparse.heat import HeatSummaryInFlight

    copying = {"rank": None}  # the rank whose summaries have not reached the host yet
    ready = HeatSummaryInFlight.ready
    monkeypatch.setattr(HeatSummaryInFlight, "ready", lambda self: copying["rank"] is None and ready(self))
    ranks = []
    for _ in range(2):
        heat, _ = _selection_heat(rows=2, pages=8)
        ranks.append(_Rank(heat, [[7], [8]]))
    aggregator = KVOutputAggregator(expected_finished_count=2)
    ids, rows = ["a", "b"], torch.tensor([0, 1], dtype=torch.int32)
    got = []
    for step in range(2):
        outputs = []
        for i, rank in enumerate(ranks):
            rank.connector.selection_heat.begin_step(ids, rows, {rid: _update(range(8)) for rid in ids})
            rank.connector.selection_heat.count(torch.tensor([[0, 64]], dtype=torch.int32),
                                                torch.tensor([0], dtype=torch.int32), rows)
            copying["rank"] = i if (step, i) == (0, 0) else None
            meta = rank.connector.build_connector_worker_meta()
            assert (getattr(meta, "heat", None) is None) == ((step, i) == (0, 0))
            out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
            out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=meta)
            outputs.append(pickle.loads(pickle.dumps(out)))
        meta = aggregator.aggregate(outputs).kv_connector_output.kv_connector_worker_meta
        assert meta.enqueued_transfer_counts == {7 + step: 2}
        got.append(meta.heat)
    assert all(h is not None and h.request_ids == tuple(ids) for h in got)
    ranks[0].connector.reset_capture_state()
    assert ranks[0].resets == 1 and int(ranks[0].connector.selection_heat.heat.sum()) == 0


def test_counting_runtime_counts_what_vllms_resolver_just_resolved(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.v1.hisparse.runtime import HiSparseRuntime

    from hisparse.integrations.vllm.connector import count_heat_in_resolver

    calls = []
    monkeypatch.setattr(HiSparseRuntime, "_resolve_residency", lambda self, **kw: calls.append(self))
    heat, _ = _selection_heat(layer_stride=2)
    runtimes = [HiSparseRuntime.__new__(HiSparseRuntime) for _ in range(5)]
    for rt in runtimes:
        rt.request_state_indices = torch.tensor([2, -1, -1, -1], dtype=torch.int32)
    assert count_heat_in_resolver(runtimes, heat) == 3  # index groups 0, 2, 4
    assert [type(rt).__name__ for rt in runtimes] == ["_CountingRuntime", "HiSparseRuntime"] * 2 + ["_CountingRuntime"]
    topk = torch.tensor([[0, 65, -1]], dtype=torch.int32)
    for rt in runtimes[:2]:
        rt._resolve_residency(resident=None, req_id_per_token=torch.tensor([0], dtype=torch.int32), block_table=None,
                              topk_indices=topk, block_size=64, return_valid_counts=True, shared_rows=slice(0, 1),
                              attention_indices_out=None, valid_counts_out=None)
    assert calls == runtimes[:2]  # vLLM's resolve ran in both; only the counted one counted
    assert heat.heat[2, :2].tolist() == [1, 1] and int(heat.heat.sum()) == 2
    with pytest.raises(ConfigError, match="cannot count heat in a str"):
        count_heat_in_resolver(["not a runtime"], heat)


def test_heat_options_are_checked_where_the_config_is_read():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from hisparse.heat import HeatOptions
    from hisparse.integrations.vllm.connector import heat_options

    def config(**extra):
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))

    assert heat_options(config()) == HeatOptions(interval=32, coldest=128, hottest=32, layer_stride=8)
    assert heat_options(config(heat_layer_stride=1)).layer_stride == 1
    with pytest.raises(ConfigError, match="heat_interval must be an integer from 1 to 2\\*\\*24 - 1"):
        heat_options(config(heat_interval=0))
    with pytest.raises(ConfigError, match="heat_coldest"):
        heat_options(config(heat_coldest="many"))


def test_a_method_wrapped_while_needed_gives_back_what_was_in_place():
    """``restore.WrappedWhileNeeded``: vLLM's per-request methods wrapped only while a restore can need them,
    then given back as they were (a class's method, or an attribute of the object), and a wrap put over ours in
    the meantime left in place."""
    from hisparse.integrations.vllm.restore import WrappedWhileNeeded

    class Pools:
        def count(self, n):
            return n

    pools = Pools()
    calls = []

    def doubling(count):
        def doubled(n):
            calls.append(n)
            return 2 * count(n)
        return doubled

    wrapped = WrappedWhileNeeded(pools, "count", doubling)
    wrapped.off()  # never on: nothing to give back
    assert "count" not in vars(pools)
    wrapped.on()
    wrapped.on()  # once
    assert pools.count(3) == 6 and calls == [3]
    wrapped.off()
    assert "count" not in vars(pools) and pools.count(3) == 3  # the class's method again, not a copy of it
    own = lambda n: n + 1  # noqa: E731 - an attribute of the object, put there before
    pools.count = own
    wrapped.on()
    assert pools.count(3) == 8
    wrapped.off()
    assert pools.count is own
    wrapped.on()
    ours = pools.count
    pools.count = lambda n: ours(n) - 1  # someone else's wrap, over ours
    wrapped.off()
    assert pools.count(3) == 7  # theirs stays, calling through ours
