"""The Python surface: errors are precise and leave state intact, threads drive independent managers."""

import threading

import plans
import pytest

import hisparse
from hisparse import (
    CapacityError,
    ConfigError,
    HiSparseError,
    InvalidArgumentError,
    ResidencyManager,
    UnknownRequestError,
)
from hisparse.scenario import default_scenario


def manager(**overrides):
    kw = dict(num_gpu_blocks=64, num_host_blocks=64, block_size=16, max_model_len=512, max_running=4, top_k=32)
    kw.update(overrides)
    return ResidencyManager(**kw)


def test_errors_form_one_hierarchy_and_are_also_builtin_kinds():
    for cls in (ConfigError, CapacityError, InvalidArgumentError, UnknownRequestError, hisparse.InvariantError):
        assert issubclass(cls, HiSparseError)
    assert issubclass(InvalidArgumentError, ValueError) and issubclass(UnknownRequestError, KeyError)


@pytest.mark.parametrize("gib", [float("nan"), float("inf"), -float("inf"), 0, -1.0, 1e300])
def test_a_host_pool_size_out_of_range_is_a_config_error(gib):
    """Any number is a valid argument type; whether it can size a pool is the configuration's to say."""
    with pytest.raises(ConfigError, match="host_pool_gib"):
        ResidencyManager(num_gpu_blocks=64, host_pool_gib=gib, page_bytes=1 << 20, block_size=16, max_model_len=512,
                         top_k=32)


def test_config_errors_say_what_to_raise():
    with pytest.raises(ConfigError, match=r"raise it \(num_host_blocks or host_pool_gib\) to at least 32 blocks"):
        manager(num_host_blocks=8)
    with pytest.raises(ConfigError, match="policy"):
        manager(policy="random")
    with pytest.raises(ConfigError, match="hot_rows"):
        manager(hot_rows=8)
    m = ResidencyManager(num_gpu_blocks=64, host_pool_gib=1.0, page_bytes=1 << 20, block_size=16,
                         max_model_len=512, top_k=32)
    assert m.config()["num_host_blocks"] == 1024


def test_bad_calls_raise_and_change_nothing():
    m = manager()
    m.admit(1, 40)
    m.plan_step([(1, 40)])
    before = (m.stats(), m.block_table(1))
    with pytest.raises(UnknownRequestError) as err:
        m.plan_step([(7, 1)])
    assert err.value.request_id == 7
    with pytest.raises(InvalidArgumentError, match="twice"):
        m.plan_step([(1, 1), (1, 1)])
    with pytest.raises(InvalidArgumentError, match=r"scheduled\[0\] new_tokens = -1 is outside 0..2\*\*32"):
        m.plan_step([(1, -1)])
    with pytest.raises(InvalidArgumentError, match=r"request_id = -3 is outside 0..2\*\*64"):
        m.finish(-3)
    with pytest.raises(InvalidArgumentError, match="beyond its max_len"):
        m.plan_step([(1, 10_000)])
    with pytest.raises(InvalidArgumentError, match="not in flight"):
        m.complete([12345])
    with pytest.raises(InvalidArgumentError, match="already admitted"):
        m.admit(1, 10)
    with pytest.raises(InvalidArgumentError):
        m.admit(2, 0)
    assert (m.stats(), m.block_table(1)) == before
    m.check_invariants()


def test_duplicate_completion_is_refused():
    m = manager()
    m.admit(1, 40)
    m.plan_step([(1, 40)])
    ids = m.plan_step([(1, 1)]).transfer_ids
    assert len(ids) == 2
    m.complete(ids)
    with pytest.raises(InvalidArgumentError):
        m.complete(ids[:1])
    assert m.page_states(1)[:2] == ["clean", "clean"]


def test_admission_names_the_resource():
    m = manager(num_host_blocks=64, max_running=8)
    m.admit(1, 10, max_len=512)
    m.admit(2, 10, max_len=512)
    with pytest.raises(CapacityError) as err:
        m.admit(3, 10, max_len=512)
    assert err.value.resource == "host" and err.value.needed == 32


def test_step_plan_reports_missing_blocks():
    m = manager(num_gpu_blocks=30, top_k=16)
    m.admit(1, 500)
    plan = m.plan_step([(1, 500)])
    assert not plan.ok and plan.missing_blocks == 32 - 29  # 32 pages, 29 usable blocks
    assert m.request_info(1)["seq_len"] == 0


def test_hot_rows_default_to_twice_top_k_or_the_speculative_union():
    assert manager().config()["hot_rows"] == 64
    assert manager(speculative_tokens=3, num_gpu_blocks=128).config()["hot_rows"] == 128


def test_every_policy_parses_by_name():
    for policy in ("coldest", "fifo", "resident"):
        assert manager(policy=policy).config()["policy"] == policy


def test_capacity_log_mentions_the_host_pool():
    m = manager()
    line = m.capacity_log()
    assert "host 0/64 blocks" in line and "steady-state concurrency" in line


def test_threads_drive_independent_managers():
    results, errors = [], []

    def work(seed):
        try:
            results.append(default_scenario(seed=seed, quiet=True))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 3 and all(r["no_data_lost"] and r["rows_verified"] > 0 for r in results)


def test_a_request_gone_before_the_next_plan_leaves_no_restore_behind():
    """admit (a tail restore is queued) then finish before any plan: the block goes to someone else, and the
    next plan must restore it once, from that someone's host page (regression: two copies raced)."""
    from hisparse import DataPath, Layout
    from hisparse.scenario import Driver

    lay = Layout(num_gpu_blocks=11, num_host_blocks=64, block_size=4, max_model_len=32, max_running=4,
                 hot_rows=4, row_bytes=16, layer_groups=(0,))
    m = ResidencyManager(num_gpu_blocks=11, num_host_blocks=64, block_size=4, max_model_len=32, max_running=4,
                         top_k=4, hot_rows=4, tail_pages=1, watermark=0, page_bytes=lay.page_bytes)
    d = Driver(m, DataPath(lay), top_k=4)
    for rid, family in [(100, 1), (101, 2)]:  # two prefixes made durable on the host
        d.admit(rid, 13, family=family, shared_tokens=12, max_len=16)
        d.step([(rid, 13)])
        d.step([(rid, 0)])
        d.close()  # the prefix pages' copies end: published on the host
        d.finish(rid)
    d.admit(7, 32, max_len=32)
    d.step([(7, 32)])
    d.step([])
    d.admit(1, 13, family=1, shared_tokens=12, max_len=16)
    d.finish(1)
    d.admit(2, 13, family=2, shared_tokens=12, max_len=16)
    restores = [r for _ in range(3) for r in d.step([]).restores]
    assert len({gpu for gpu, _ in restores}) == len(restores) == 1
    assert d.verify_all(2) == 12


def test_coldest_releases_the_pages_the_indexer_selects_least():
    m = manager(num_gpu_blocks=40, top_k=16)  # hot region: 32 rows = 2 blocks; watermark 4
    m.admit(1, 320)
    m.plan_step([(1, 320)])
    m.complete(m.plan_step([(1, 1)]).transfer_ids)  # 20 complete pages copied to the host
    # The first ten pages were selected, the rest never (a summary ranks coldest first).
    summary = {1: [(0, page) for page in range(10, 20)] + [(5, page) for page in range(10)]}
    with pytest.raises(InvalidArgumentError, match="ascending"):
        m.apply_results(heat=plans.heat({1: summary[1][::-1]}))
    m.apply_results(heat=plans.heat(summary))
    m.admit(2, 256)
    plan = m.plan_step([(2, 256)])  # 16 blocks of 18 free, watermark 4: four pages must go
    assert plan.ok and plan.released_pages == 4
    states = m.page_states(1)
    assert [i for i, s in enumerate(states) if s == "released"] == [10, 11, 12, 13]
    assert m.request_info(1)["hot_blocks"] == 2
    m.check_invariants()


def test_one_manager_shared_by_a_serving_loop_and_metrics_threads():
    """A serving loop mutates one manager while two threads read metrics from it: every read succeeds (calls
    are serialized, never refused), and the loop ends where it ends alone. A timeout would mean a deadlock
    (a thread holding the lock while waiting for the GIL)."""

    def serve(m: ResidencyManager, ids: range) -> int:
        released = 0
        for rid in ids:
            m.admit(rid, 100, max_len=200)
            for _ in range(4):
                plan = m.plan_step([(rid, 20)])
                assert plan.ok
                m.apply_results(plan.transfer_ids)
                released += plan.released_pages
            m.finish(rid)
        return released

    def fresh() -> ResidencyManager:
        return manager(num_gpu_blocks=96, num_host_blocks=512, max_running=8)

    shared = fresh()
    stop = threading.Event()
    reads, errors = [0, 0], []

    def metrics(slot: int) -> None:
        while not stop.is_set():
            try:
                s = shared.stats()
                assert s["gpu_free"] + s["gpu_used"] == s["gpu_blocks"] - 1
                assert "hisparse" in shared.capacity_log()
                for rid in shared.request_ids():
                    try:
                        shared.request_info(rid)
                    except UnknownRequestError:
                        pass  # finished between the two calls: a true answer, not a failure
                reads[slot] += 1
            except Exception as exc:  # surfaced below
                errors.append(exc)
                return

    readers = [threading.Thread(target=metrics, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    before, served, released = list(reads), 0, 0
    try:
        # Serve until each reader has read many times while the loop ran, however busy the machine is.
        while served < 10_000 and (served < 200 or min(r - b for r, b in zip(reads, before, strict=True)) < 20):
            released += serve(shared, range(served, served + 50))
            served += 50
    finally:
        stop.set()
        for t in readers:
            t.join(timeout=30)
    assert not any(t.is_alive() for t in readers), "a reader never came back: deadlock"
    assert not errors, errors
    assert min(r - b for r, b in zip(reads, before, strict=True)) >= 20
    shared.check_invariants()
    alone = fresh()
    assert serve(alone, range(served)) == released and alone.stats() == shared.stats()


@pytest.mark.parametrize("policy", ["coldest", "fifo"])
def test_requests_too_short_for_a_hot_region_are_admitted_as_plain_residency_admits_them(policy):
    """A request whose pages outside its tail could never free more blocks than a hot region costs never
    takes one: admission reserves only its tail, as plain residency does, and restores it whole."""
    def admitted(policy: str, max_len: int) -> int:
        m = manager(num_gpu_blocks=40, num_host_blocks=400, max_running=32, hot_rows=64, policy=policy)
        n = 0
        while True:
            try:
                m.admit(n, 16, None, max_len)
            except CapacityError:
                return n
            n += 1

    short, long = 5 * 16, 512  # 5 pages (3 outside the tail of 2; a region costs 4), 32 pages
    assert admitted(policy, short) == admitted("resident", short) > admitted(policy, long)
