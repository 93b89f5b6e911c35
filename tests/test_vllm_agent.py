"""hisparse beside vLLM's OffloadingConnector, GLM-5.3's layout under MTP 3 and async scheduling, and multi-turn
agent traces, on vLLM 0.33.0's own scheduler stack (CPU).

Every run goes through ``tests/vllm_harness.py``: vLLM's config, planner, ``Scheduler`` / ``AsyncScheduler``,
KV cache manager, ``MultiConnector`` and ``OffloadingConnector`` (scheduler side, and its worker side but for
the CUDA copy engine, which ``TierCopyWorker`` stands in for: copies made when a job completes, jobs completed
late and out of order). The fake forward writes a tag per (token, layer) and reads every selected top-K row
and every indexer key back; a row that differs from what was written, or an exception out of ``schedule()`` /
``update_from_output()``, fails the run. The published deployment (the vLLM blog's GLM-5.3 post, part 1) is the
shape: a HiSparse host pool and an OffloadingConnector (``TieringOffloadingSpec``) CPU tier in a
``MultiConnector``, HiSparse's child first.
"""

from __future__ import annotations

import numpy as np
import pytest

H = pytest.importorskip("vllm_harness")
pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

# One layer of each of vLLM's six DeepSeek-V3.2 resident groups.
GROUP_LAYERS = [0, 12, 24, 36, 48, 60]


def _children(setup):
    connector = setup.scheduler.connector
    return {type(c).__module__.split(".")[0] + "." + type(c).__name__: c for c in connector.sub_connectors}


def _waves():
    """Prefix traffic: a shared 4,096-token prefix hit while its first users still run (GPU), then other
    traffic recycles those blocks, and a last wave hits the prefix again when the MLA pages are on
    HiSparse's host pool only and the indexer keys are in the offloading tier."""
    shared = H.prompt(1000, 4096)
    jobs = [H.Job(f"a{i}", H.prompt(i, 6000, shared), 24) for i in range(2)]
    jobs += [H.Job(f"b{i}", H.prompt(10 + i, 6000, shared), 24, arrival=8) for i in range(2)]
    jobs += [H.Job(f"c{i}", H.prompt(20 + i, 7000), 8, arrival=60) for i in range(3)]
    jobs += [H.Job(f"d{i}", H.prompt(30 + i, 5000, shared), 24, arrival=140) for i in range(2)]
    return jobs


def _imports_left_open(coordinator) -> list[str]:
    """Watches vLLM's host-import bookkeeping in the HiSparse coordinator: a load by another connector is
    recorded as an import into the request's host pages (``record_pending_host_import``) and makes those
    pages valid and publishable only once finished (``finish_host_import``). Returns the list, filled as the
    run goes, of requests freed with their import never finished."""
    opened, left = set(), []
    record, finish, free = coordinator.record_pending_host_import, coordinator.finish_host_import, coordinator.free

    def recorded(request_id, num_tokens):
        opened.add(request_id)
        record(request_id, num_tokens)

    def finished(request_id, *, failed):
        opened.discard(request_id)
        finish(request_id, failed=failed)

    def freed(request_id):
        if request_id in opened:
            left.append(request_id)
            opened.discard(request_id)
        free(request_id)

    coordinator.record_pending_host_import = recorded
    coordinator.finish_host_import = finished
    coordinator.free = freed
    return left


def _assert_all_freed(setup, worker):
    """Every finished request's blocks are back in vLLM's pool, and neither connector holds anything of it."""
    pool = setup.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == setup.kv_cache_config.num_blocks - 1
    offloading = _children(setup)["vllm.OffloadingConnector"].connector_scheduler
    assert not offloading._req_status and not offloading._jobs
    assert not worker.tier.pending and not worker.tier.waited
    assert not worker.reqs


@pytest.mark.parametrize("async_scheduling,loads,offload_first",
                         [(False, "async", False), (True, "sync", False), (True, "async", True)],
                         ids=["sync-scheduling-async-loads", "async-scheduling-sync-loads", "offloading-child-first"])
def test_hisparse_beside_vllms_offloading_connector(async_scheduling, loads, offload_first):
    """vLLM's ``MultiConnector`` of hisparse's ``HiSparseConnector`` and vLLM's ``OffloadingConnector``
    (``TieringOffloadingSpec``): hisparse's "wait" from ``get_num_new_matched_tokens`` holds inside the
    MultiConnector (it answers before the offloading child books a load), the offloading tier serves the
    indexer keys of a prefix whose MLA pages are on HiSparse's host pool only (loaded asynchronously, or
    synchronously within vLLM's ``sync_load_budget_bytes``), stores and loads complete late and out of
    order, and every row read is the one written. In either order of the two children: with the offloading
    child first, it has looked the request up (and may have reserved a sync load) when hisparse says wait."""
    extra = {"sync_load_budget_bytes": 1 << 30} if loads == "sync" else None
    setup = H.build(mode="hisparse", gpu_gib=0.9, max_model_len=8192, host_pool_gib=20, offload_gib=0.25,
                    offload_extra=extra, async_scheduling=async_scheduling, offload_first=offload_first)
    from hisparse.integrations.vllm.coordinator import HisparseCoordinator

    children = _children(setup)
    assert type(setup.scheduler.connector).__name__ == "MultiConnector"
    names = ["hisparse.HiSparseConnector", "vllm.OffloadingConnector"]
    assert list(children) == (names[::-1] if offload_first else names)
    hisparse = children["hisparse.HiSparseConnector"]
    assert isinstance(hisparse.coordinator, HisparseCoordinator)
    worker = H.FakeWorker(setup, layers=GROUP_LAYERS)
    left_open = _imports_left_open(hisparse.coordinator)
    stats = H.run(setup, worker, _waves())
    assert hisparse.coordinator.counters["admissions_deferred"] > 0, "hisparse answered 'wait' in MultiConnector"
    # A synchronous load never reports finished_recving; its host pages must still become valid, or the
    # request publishes nothing of its own past the loaded prefix (a later turn would miss it).
    assert left_open == []
    assert stats.rows_from_host > 0 and stats.host_only_prefix_admissions > 0
    assert stats.tier_blocks_stored > 0 and stats.tier_blocks_loaded > 0, "the tier served a prefix"
    assert (stats.tier_sync_loads if loads == "sync" else stats.tier_async_loads) > 0
    assert stats.tier_jobs_reordered > 0
    assert stats.rows_checked >= 9 * 8 * len(GROUP_LAYERS) * H.TOP_K
    _assert_all_freed(setup, worker)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steps_that_return_vllms_empty_output_keep_the_imports_in_step(async_scheduling):
    """Agents whose later turns wait for the offloading tier's asynchronous loads: some steps schedule no
    token, and with nothing to report their output is vLLM's empty one, which never reaches
    ``update_connector_output``. Each step's imports to finish after it are still taken with its own output:
    none is left over once the engine is idle (one was per such step, for the engine's life)."""
    setup = H.build(mode="hisparse", gpu_gib=0.8, max_model_len=16384, host_pool_gib=20, offload_gib=0.25,
                    max_num_seqs=8, max_num_batched_tokens=2048, async_scheduling=async_scheduling)
    hisparse = _children(setup)["hisparse.HiSparseConnector"]
    worker = H.FakeWorker(setup, layers=GROUP_LAYERS)
    jobs, then = H.conversations(5, 100, first=2500, later=300, output=24, turns=4, spacing=3)
    stats = H.run(setup, worker, jobs, then=then)
    assert stats.outputs_without_connector > 0 and stats.tier_async_loads > 0
    assert not hisparse._sync_imports
    _assert_all_freed(setup, worker)


def test_a_tier_that_hands_back_other_bytes_is_caught(monkeypatch):
    """The conformance check has teeth: a tier that loads a prefix from the wrong chunks fails the run."""
    complete = H.TierCopyWorker._complete

    def wrong_chunks(self, job_id):
        store, _, chunks, _ = self.pending[job_id]
        if not store:
            others = [c for c in self.chunks if c not in set(chunks.tolist())]
            self.pending[job_id][2] = np.roll(chunks, 1) if len(chunks) > 1 else np.asarray(others[:1])
        complete(self, job_id)

    monkeypatch.setattr(H.TierCopyWorker, "_complete", wrong_chunks)
    setup = H.build(mode="hisparse", gpu_gib=0.9, max_model_len=8192, host_pool_gib=20, offload_gib=0.25)
    with pytest.raises(H.CheckFailed, match="indexer key row differs"):
        H.run(setup, H.FakeWorker(setup, layers=[0]), _waves())


def test_vllms_own_hisparse_leaves_a_synchronous_loads_host_import_open():
    """vLLM 0.33's own HiSparseConnector beside its OffloadingConnector, loads within
    ``sync_load_budget_bytes``: the load is recorded as an import into the request's host pages
    (``HiSparseTieredKVCacheManager.allocate_external_computed_blocks``), finished only by a
    ``finished_recving`` that a synchronous load never sends, so the pages stay invalid until the request is
    freed and it publishes nothing of its own past the loaded prefix. hisparse's connector finishes such an
    import once the step has run (``HiSparseConnector.update_connector_output``); this documents vLLM's."""
    setup = H.build(mode="native", gpu_gib=0.9, max_model_len=8192, host_pool_gib=20, offload_gib=0.25,
                    offload_extra={"sync_load_budget_bytes": 1 << 30})
    left_open = _imports_left_open(_children(setup)["vllm.HiSparseConnector"].connector_scheduler.coordinator)
    stats = H.run(setup, H.FakeWorker(setup, layers=[0]), _waves())
    assert stats.tier_sync_loads > 0
    assert left_open == ["d0"]


@pytest.mark.parametrize("mode,offload_gib", [("native", 0.25), ("plain", 1.25)],
                         ids=["vllms-hisparse-beside-offloading", "offloading-alone"])
def test_the_references_run_the_same_traffic(mode, offload_gib):
    """The published comparison's other two engines on the same traffic: vLLM's own HiSparseConnector
    beside the offloading connector, and the offloading connector alone (the baseline, which offloads every
    layer's blocks, not only the indexer's, and so needs a larger tier to keep the prefix); both load the
    prefix back from the tier, every layer's rows of it checked in the baseline."""
    setup = H.build(mode=mode, gpu_gib=0.9, max_model_len=8192, host_pool_gib=20, offload_gib=offload_gib)
    worker = H.FakeWorker(setup, layers=GROUP_LAYERS)
    stats = H.run(setup, worker, _waves())
    assert stats.tier_blocks_stored > 0 and stats.tier_blocks_loaded > 0 and stats.prefix_hit_tokens > 0
    assert (stats.rows_from_host > 0) == (mode == "native")
    pool = setup.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == setup.kv_cache_config.num_blocks - 1


def test_glm53_layout_mtp3_async_reads_from_the_host():
    """GLM-5.3's layout as vLLM's own planner builds it (78 sparse-MLA layers, IndexShare: 21 indexer layers,
    21 resident and 21 hot groups, a 160-block hot region per group with MTP 3), async scheduling, beside
    the offloading connector; the pool is sized so that requests must read from the host, and drafts are
    both accepted and rejected (the worker proposes them, as vLLM's does under async scheduling). The prompts
    are long enough for a region to pay for itself (past 10,368 tokens on this layout): shorter ones keep
    every page resident."""
    from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec

    setup = H.build(mode="hisparse", model="glm5.3", gpu_gib=2.0, max_model_len=16384, num_spec_tokens=3,
                    host_pool_gib=40, async_scheduling=True, max_num_seqs=8, max_num_batched_tokens=1024,
                    offload_gib=0.25)
    assert type(setup.scheduler).__name__ == "AsyncScheduler"
    groups = setup.kv_cache_config.kv_cache_groups
    resident = [g for g in groups if isinstance(g.kv_cache_spec, HiSparseResidentSpec)]
    hot = [g for g in groups if isinstance(g.kv_cache_spec, HiSparseHotSpec)]
    assert len(H.indexer_layers("glm5.3")) == 21 and len(resident) == 21 and len(hot) == 21
    assert sum(len(g.layer_names) for g in resident) == 78
    assert {g.kv_cache_spec.blocks_per_request for g in hot} == {160}
    leaders = [H._layer(g.layer_names[0]) for g in resident]
    worker = H.FakeWorker(setup, layers=leaders[::5] + [leaders[5] + 2])  # some leaders, and one follower
    jobs = [H.Job(f"r{i}", H.prompt(i, 10_400 + 37 * i), 24, arrival=2 * i) for i in range(6)]
    stats = H.run(setup, worker, jobs, num_spec_tokens=3)
    assert stats.rows_from_host > 0, "the pool was meant to push requests onto their hot regions"
    assert stats.drafts_accepted > 0 and stats.drafts_rejected > 0
    assert stats.tier_blocks_stored > 0
    _assert_all_freed(setup, worker)


def test_multi_turn_agent_conversations():
    """Agent conversations (each turn's prompt is the last turn's prompt, its answer and a few hundred new
    tokens, long enough for a hot region to pay for itself), five at once in a pool that holds about three:
    later turns hit their own earlier turns' prefix
    on the GPU and on HiSparse's host pool only with the indexer keys loaded back from the offloading tier;
    two turns are aborted mid-answer (their conversations end there)."""
    setup = H.build(mode="hisparse", gpu_gib=0.8, max_model_len=16384, host_pool_gib=20, offload_gib=0.25,
                    max_num_seqs=8, max_num_batched_tokens=2048)
    worker = H.FakeWorker(setup, layers=[0, 30, 60])
    jobs, then = H.conversations(5, 100, first=4500, later=300, output=24, turns=3, spacing=3)
    stats = H.run(setup, worker, jobs, then=then, aborts={"c1-t2": 5, "c3-t1": 10})
    assert stats.aborted == 2
    assert stats.prefix_hit_tokens >= 5 * 4500, "later turns read their earlier turns' prefix"
    assert stats.host_only_prefix_admissions > 0 and stats.tier_blocks_loaded > 0
    assert stats.rows_from_host > 0
    _assert_all_freed(setup, worker)


def test_multi_turn_agents_in_the_published_shape_with_preemptions():
    """The published deployment's shape, scaled down: GLM-5.3's layout, MTP 3, async scheduling, hisparse
    beside the offloading connector, six agent conversations in a pool that holds about three, under
    ``policy: fifo`` (vLLM's own decisions, which preempt), HiSparse's transfers completing two steps late:
    requests are preempted with copies of both connectors in flight (blocks with offloading stores in flight
    are handed out again, which vLLM's scheduler flushes first), later turns hit their earlier turns'
    prefix on the GPU, on HiSparse's host pool only and (their indexer keys) in the offloading tier, drafts
    are accepted and rejected, two turns are aborted mid-answer, and every row read is the one written."""
    setup = H.build(mode="hisparse", model="glm5.3", gpu_gib=1.8, max_model_len=16384, num_spec_tokens=3,
                    host_pool_gib=40, async_scheduling=True, max_num_seqs=8, max_num_batched_tokens=1024,
                    offload_gib=0.25, extra={"policy": "fifo"})
    worker = H.FakeWorker(setup, layers=[0, 21, 41, 77], completion_lag=2)
    jobs, then = H.conversations(6, 100, first=2500, later=300, output=24, turns=3, spacing=2)
    stats = H.run(setup, worker, jobs, then=then, aborts={"c1-t2": 5, "c3-t1": 10}, num_spec_tokens=3)
    assert stats.aborted == 2 and stats.preemptions > 0
    assert stats.tier_flushes > 0, "blocks were handed out again with their stores in flight (vLLM flushes them)"
    assert stats.prefix_hit_tokens >= 6 * 2500
    assert stats.host_only_prefix_admissions > 0 and stats.tier_blocks_loaded > 0
    assert stats.rows_from_host > 0 and stats.drafts_accepted > 0 and stats.drafts_rejected > 0
    _assert_all_freed(setup, worker)


def test_later_turns_loaded_back_beside_hisparse_are_admitted_as_the_prefix_hits_they_are(monkeypatch):
    """The published shape scaled down (GLM-5.3, MTP 3, async, top-K 128, the offloading connector beside
    hisparse), 20 conversations of 6 turns in a pool that holds about a third of them. ``MultiConnector``
    asks hisparse first, so a later turn whose indexer keys left the GPU has no local hit yet; the offloading
    connector then loads them back up to the prefix HiSparse's host pool holds. Counted as that hit
    (``HisparseCoordinator.loadable_prefix``) rather than as a whole new prefill, fewer admissions wait and
    the run takes no more steps, with no preemption and every row read right."""
    from hisparse.integrations.vllm.coordinator import HisparseCoordinator

    top_k = H.TOP_K
    H.TOP_K = 128
    try:
        def run():
            setup = H.build(mode="hisparse", model="glm5.3", gpu_gib=1.2, max_model_len=8875, num_spec_tokens=3,
                            host_pool_gib=24, async_scheduling=True, max_num_seqs=256, max_num_batched_tokens=2048,
                            offload_gib=1.0)
            worker = H.FakeWorker(setup, layers=[0, 42], completion_lag=1)
            jobs, then = H.conversations(20, 100, first=4635, later=47, output=56, turns=6)
            stats = H.run(setup, worker, jobs, then=then, num_spec_tokens=3)
            assert stats.preemptions == 0 and stats.tier_blocks_loaded > 0
            _assert_all_freed(setup, worker)
            return stats, _children(setup)["hisparse.HiSparseConnector"].coordinator.counters

        counting, counters = run()
        monkeypatch.setattr(HisparseCoordinator, "loadable_prefix", lambda self, request: 0)
        local_only, local_counters = run()
        assert counters["admissions_counting_loads"] > 0 and not local_counters["admissions_counting_loads"]
        assert counters["admissions_deferred"] < local_counters["admissions_deferred"], (counters, local_counters)
        assert len(counting.running_samples) <= len(local_only.running_samples)
    finally:
        H.TOP_K = top_k


def test_the_short_end_on_glm53s_layout_later_turns_are_restored_whole():
    """The short end of the published shape (``benches/vllm_agent.py --workload short``, smaller): GLM-5.3's
    layout at the published top-K (a 160-block hot region per group, 3,360 blocks in all), MTP 3, async, 1 GiB
    of KV, conversations of 2-3K-token turns. vLLM's planner holds fewer tokens fully resident than plain vLLM
    on the same memory (its layout, in vLLM's HiSparse and in hisparse alike), and vLLM gives any request that
    starts from a prefix hit a hot region (``HiSparseHotManager.get_num_blocks_to_allocate``), here two thirds
    of the pool. hisparse restores such a request's prefix whole to resident pages instead when it is too short
    ever to take a region (``restore.py``): no later turn holds a region, and more than twice vLLM's HiSparse's
    requests run, with no preemption where vLLM's preempts."""
    from vllm.v1.kv_cache_interface import HiSparseHotSpec

    top_k = H.TOP_K
    H.TOP_K = 2048
    try:
        def setup(mode):
            return H.build(mode=mode, model="glm5.3", gpu_gib=1.0, max_model_len=4096, num_spec_tokens=3,
                           async_scheduling=True, max_num_batched_tokens=8192, host_pool_gib=8, offload_gib=0.25)

        plain = setup("plain").kv_cache_config.num_blocks * H.BLOCK  # one block per page holds every layer
        results = {}
        for mode in ("native", "hisparse"):
            s = setup(mode)
            groups = s.kv_cache_config.kv_cache_groups
            hot = sum(g.kv_cache_spec.blocks_per_request for g in groups
                      if isinstance(g.kv_cache_spec, HiSparseHotSpec))
            per_page = sum(not g.host_resident and not isinstance(g.kv_cache_spec, HiSparseHotSpec) for g in groups)
            assert hot > s.kv_cache_config.num_blocks / 2
            assert s.kv_cache_config.num_blocks // per_page * H.BLOCK < 0.8 * plain
            hot_managers = [m for m in s.scheduler.kv_cache_manager.coordinator.single_type_managers
                            if isinstance(m.kv_cache_spec, HiSparseHotSpec)]
            with_region: set[str] = set()

            def on_step(_, s=s, hot_managers=hot_managers, with_region=with_region):
                with_region.update(r.request_id for r in s.scheduler.running if hot_managers[0].has_hot(r.request_id))

            jobs, then = H.conversations(4, 300, first=2000, later=900, output=48, turns=2)
            stats = H.run(s, H.FakeWorker(s, reads=False, data=False), jobs, then=then, on_step=on_step,
                          num_spec_tokens=3)
            assert stats.prefix_hit_tokens > 0
            hits = {f"c{c}-t1" for c in range(4)}
            if mode == "native":
                assert hits <= with_region, f"later turns without a hot region: {hits - with_region}"
            else:
                assert not with_region, f"short requests given a hot region: {with_region}"
                assert _children(s)["hisparse.HiSparseConnector"].coordinator.counters["restored_whole"] >= 4
            nonzero = [n for n in stats.running_samples if n]
            results[mode] = (sum(nonzero) / len(nonzero), stats.preemptions)
        assert results["hisparse"][1] == 0 and results["native"][1] > 0, results
        assert results["hisparse"][0] >= 2 * results["native"][0], results
    finally:
        H.TOP_K = top_k


def _short_turns(monkeypatch, gpu_gib: float, n: int, output: int, aborts: dict[str, int] | None = None,
                 offload_extra: dict | None = None):
    """``n`` conversations of two short turns (2,000 tokens, then 900 more) on GLM-5.3's layout at the
    published top-K, MTP 3, async, beside the offloading connector (``offload_extra``: its options), every row
    read checked: the setup, the worker, the run's stats and hisparse's coordinator. Between steps, vLLM's
    allocation and block count reach vLLM's own methods but for the requests restored whole: the restores'
    wraps are in place only while they can matter (``restore.WholeRestores``)."""
    monkeypatch.setattr(H, "TOP_K", 2048)
    setup = H.build(mode="hisparse", model="glm5.3", gpu_gib=gpu_gib, max_model_len=4096, num_spec_tokens=3,
                    async_scheduling=True, max_num_batched_tokens=8192, host_pool_gib=8, offload_gib=0.25,
                    offload_extra=offload_extra)
    worker = H.FakeWorker(setup, layers=[0, 42])
    coordinator = _children(setup)["hisparse.HiSparseConnector"].coordinator
    manager = setup.scheduler.kv_cache_manager
    vllms_allocation = type(manager).allocate_slots.__get__(manager)
    vllms_count = type(manager.coordinator).get_num_blocks_to_allocate.__get__(manager.coordinator)
    counted_alone = []  # steps where no request was restored whole

    def between_steps(_step):
        assert manager.allocate_slots == vllms_allocation, "the allocation is wrapped past a schedule pass"
        if not coordinator.restores.requests:
            assert manager.coordinator.get_num_blocks_to_allocate == vllms_count
            counted_alone.append(_step)

    jobs, then = H.conversations(n, 300, first=2000, later=900, output=output, turns=2)
    stats = H.run(setup, worker, jobs, then=then, num_spec_tokens=3, aborts=aborts, on_step=between_steps)
    assert counted_alone, "every step had a request restored whole: the count's unwrapping went unchecked"
    return setup, worker, stats, coordinator


def test_short_later_turns_restored_whole_read_every_byte_right(monkeypatch):
    """Short later turns restored whole from both sources, every row read checked: prefixes HiSparse's host
    pool holds (restored in the step that admits them) and prefixes whose indexer keys the offloading tier
    loads back asynchronously (restored once the load completes, before the request runs). Nothing is read
    from the host afterwards, and no request is preempted."""
    setup, worker, stats, coordinator = _short_turns(monkeypatch, gpu_gib=1.0, n=6, output=48)
    counters = coordinator.counters
    # Each turn's prefix is at least its first turn's 2,000 tokens: its pages but the tail (which vLLM's
    # import restores itself) and a page the hit may stop short of, each restored from the host or, where
    # vLLM still holds its GPU copy, adopted (read in place, no block of its own).
    assert counters["restored_whole"] == 6
    assert counters["pages_restored"] + counters["pages_adopted"] >= 6 * (2000 // H.BLOCK - 2)
    assert counters["pages_adopted"] > 0 and counters["pages_restored"] > 0
    assert stats.tier_blocks_loaded > 0, "some prefixes came back from the offloading tier"
    assert stats.rows_from_host == 0 and stats.host_only_prefix_admissions == 0 and stats.preemptions == 0
    _assert_all_freed(setup, worker)


def test_short_later_turns_loaded_synchronously_are_restored_whole_too(monkeypatch):
    """The offloading tier loading the later turns' indexer keys synchronously (within vLLM's
    ``sync_load_budget_bytes``): their MLA pages are published on HiSparse's host pool already, so each import
    is finished, and its pages restored, before the forward that first reads them (``restore.py``): every later
    turn is restored whole rather than given a hot region (3,360 blocks, two thirds of the pool), every row
    read is right, nothing is read from the host, and no request is preempted."""
    setup, worker, stats, coordinator = _short_turns(monkeypatch, gpu_gib=1.0, n=6, output=48,
                                                     offload_extra={"sync_load_budget_bytes": 1 << 30})
    assert stats.tier_sync_loads > 0 and stats.tier_async_loads == 0
    assert coordinator.counters["restored_whole"] == 6 and coordinator.counters["pages_restored"] > 0
    assert stats.rows_from_host == 0 and stats.preemptions == 0
    _assert_all_freed(setup, worker)


def test_short_turns_restored_whole_through_preemptions_and_aborts(monkeypatch):
    """Whole restores (GPU copies adopted, the rest restored from the host) in a pool small enough that vLLM
    preempts, with half the later turns aborted three tokens in: every row read is right, nothing is read
    from the host, and every block, restore and transfer is given back."""
    aborts = {f"c{c}-t1": 3 for c in range(0, 16, 2)}
    setup, worker, stats, coordinator = _short_turns(monkeypatch, gpu_gib=0.95, n=16, output=400, aborts=aborts)
    assert stats.preemptions > 0 and stats.aborted == len(aborts), (stats.preemptions, stats.aborted)
    assert coordinator.counters["restored_whole"] > len(aborts) and coordinator.counters["pages_restored"] > 0
    assert stats.rows_from_host == 0
    book = H.lifecycle(coordinator)
    assert not book["requests"] and not book["transfers"]
    assert not coordinator.restores.requests and not coordinator.restores._unrestored
    _assert_all_freed(setup, worker)


@pytest.mark.parametrize("longest, short, rid", [(10358, True, "c0-t1"), (10359, False, "c0-t1"),
                                                 (10359, False, "c0-t11")])
def test_a_request_counted_short_never_takes_a_hot_region(monkeypatch, longest, short, rid):
    """A later turn of prompt + max_tokens just under the length past which its pages could pay for a hot
    region (GLM-5.3's layout: 21 resident blocks a page, a region of 3,360 blocks, so 160 releasable pages
    and the 2 of the tail, 10,368 tokens), under MTP 3 with async scheduling: vLLM allocates slots past the
    last token (drafts and lookahead, and the drafts of the step in flight: 1 + 3 + 3 + 3), which count.
    Past its admission window (64 pages) it keeps every page: vLLM would move it there, to peak at its window
    and the region, more than all its pages. It is short only when its rows, those slots included, stay
    within that length: then it is restored whole and never holds a region; else it reads through one from
    the start, as vLLM gives a host prefix hit, and restores nothing."""
    monkeypatch.setattr(H, "TOP_K", 2048)
    setup = H.build(mode="hisparse", model="glm5.3", gpu_gib=2.0, max_model_len=12288, num_spec_tokens=3,
                    async_scheduling=True, max_num_batched_tokens=8192, host_pool_gib=8)
    worker = H.FakeWorker(setup, layers=[0, 42])
    coordinator = H.hisparse_coordinators(setup.scheduler)[0]
    first = H.Job("c0-t0", H.prompt(300, 2000), 48)
    prompt = first.prompt + H.greedy(first.prompt, 48)
    later = H.Job(rid, prompt + H.prompt(999, 10_000 - len(prompt)), longest - 10_000)
    held = []

    def on_step(_):
        request = setup.scheduler.requests.get(rid)
        if request is not None and coordinator.hot_managers[0].has_hot(rid):
            held.append(request.num_tokens)

    H.run(setup, worker, [first], then={"c0-t0": later}, num_spec_tokens=3, on_step=on_step)
    assert coordinator.counters["restored_whole"] == int(short)
    assert coordinator.counters["transitions"] == 0
    assert (held == []) == short, held[:3]
    assert setup.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == setup.kv_cache_config.num_blocks - 1
    assert not worker.reqs and not H.lifecycle(coordinator)["requests"]


@pytest.mark.parametrize("mode", ["native", "fifo"])
def test_a_synchronous_load_restores_the_import_tail_before_the_forward_reads_it(mode):
    """A later turn whose indexer keys the offloading tier loads synchronously (within vLLM's
    ``sync_load_budget_bytes``) starts in the step that loads them, its import pending. Its MLA pages are on
    HiSparse's host pool already (the offloading connector loads only the groups it offloads), and vLLM keeps
    the import's tail page resident, restored from the host when the import finishes. vLLM 0.33's HiSparse never
    finishes a synchronous import, so that page is read without its prompt rows (reproduced here: the check
    fails); hisparse finishes it before the step's transfers are planned (``_finish_loaded_imports``), so the
    restore runs before the forward. ``fifo`` is vLLM's decisions in every other respect."""
    setup = H.build(mode="native" if mode == "native" else "hisparse", gpu_gib=0.8, max_model_len=16384,
                    host_pool_gib=20, offload_gib=0.25, max_num_seqs=8, max_num_batched_tokens=2048,
                    offload_extra={"sync_load_budget_bytes": 1 << 30},
                    extra=None if mode == "native" else {"policy": mode})
    worker = H.FakeWorker(setup, layers=[0, 30, 60])
    jobs, then = H.conversations(5, 100, first=4500, later=300, output=24, turns=3, spacing=3)
    if mode == "native":
        with pytest.raises(H.CheckFailed, match="rows read differ"):
            H.run(setup, worker, jobs, then=then)
        return
    stats = H.run(setup, worker, jobs, then=then)
    assert stats.tier_sync_loads > 0 and stats.tier_async_loads == 0
    assert stats.host_only_prefix_admissions > 0 and stats.rows_from_host > 0
    _assert_all_freed(setup, worker)


def test_agents_and_chat_users_mixed_run_no_fewer_requests_than_the_offloading_baseline(monkeypatch):
    """``benches/vllm_agent.py --workload mixed``, smaller (scale 32, 6 clients, 4 turns each): agents in the
    published shape beside chat users, each a chain of short conversations with nothing in common (a new one
    once the last ends), as many turns as an agent's. hisparse beside the offloading connector keeps at least
    as many requests running as vLLM with the offloading connector alone, with every row read right."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benches"))
    import vllm_agent as bench

    cfg = bench.mixed(bench.scaled(32.0, 4, None, 1.0))
    monkeypatch.setattr(H, "TOP_K", cfg["top_k"])
    jobs, then = bench.conversations(cfg, 6)
    # Every client sends four turns: an agent's grow one prompt; a chat user's are a 3-turn conversation, then
    # a new one whose first turn shares no prefix with what came before.
    for head in jobs:
        chain = [head]
        while chain[-1].req_id in then:
            chain.append(then[chain[-1].req_id])
        assert len(chain) == 4
        grows = [b.prompt[:len(a.prompt)] == a.prompt for a, b in zip(chain, chain[1:], strict=False)]
        agent = head.req_id.count("-") == 1  # c2-t0; a chat user's is c3-0-t0
        assert grows == ([True] * 3 if agent else [True, True, False]), (head.req_id, grows)
    results = {mode: bench.run_mode(cfg, mode, 6, jobs, then) for mode in ("offload", "hisparse-coldest")}
    for mode, r in results.items():
        assert r["rows_wrong"] == 0 and r["rows_checked"] > 0, (mode, r.get("error"))
        # Every client's first turn started before the end, and requests ran after that.
        assert 0 < r["first_turns_started_step"] < r["steps"] and r["running_after_first_turns"] > 0, (mode, r)
    assert results["hisparse-coldest"]["running"] >= results["offload"]["running"], results
    assert results["hisparse-coldest"]["preemptions"] == 0
