"""The invariants of a HiSparse page's life in vLLM 0.33's coordinator, checked after every step of vLLM's own
HiSparse and of ours (``fifo`` and ``coldest``), under pressure, preemptions, prefix hits, host imports beside
vLLM's offloading connector, aborted turns and short requests restored whole.

vLLM's coordinator keeps each request's pages in sets (``_HiSparseRequestState``); ours keeps them in the Rust
core (``PageBook``, ``rust/core/src/page_book.rs``), read here through ``vllm_harness.lifecycle`` in one shape
for both. A page is *dirty* (on the GPU only), *copying* (a transfer in flight), *clean* (its host copy
complete), and then either *pinned* (the request still holds its blocks) or *released* (the pool may hand its
blocks out, and until it does the request still reads them, each block naming it among its owners). Beside
them: the transfers in flight, the GPU copies of published host pages (and the index back from their blocks),
and what the worker was sent (``synced``, ``stale``). The invariants, checked on vLLM's own runs and on ours:

- a pinned or released page is clean; no page is both; a released page has no transfer in flight;
- the durable prefix (``ready_prefix_pages``) is clean;
- a released page's block in each resident group names the page among its owners, and every owner so named
  is a released page of a live request whose row holds that block there;
- the copy index and its inverse agree;
- each page in flight names its transfer, and each transfer of a live request names that page; a transfer not
  yet applied holds its GPU blocks beside the request (a reference count above one);
- stale pages were sent to the worker (below ``synced_pages``), which was sent no more pages than the row has;
- a request that holds its hot regions is in every hot manager's ``hot_required`` (so asking again is a no-op).
"""

from __future__ import annotations

from collections import Counter

import pytest

H = pytest.importorskip("vllm_harness")
pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


def lifecycle_violations(coord) -> list[str]:
    """Every invariant of the module docstring that ``coord`` (vLLM's ``HiSparseCoordinator`` or ours) breaks
    now, named with the request and page; empty when it holds them all."""
    bad: list[str] = []
    managers, hot = coord.resident_managers, coord.hot_managers
    book = H.lifecycle(coord)
    live, owners, transfers = book["requests"], book["owners"], {t[0]: t for t in book["transfers"]}
    copies, copy_keys, gpu_blocks = book["copies"], book["copy_keys"], coord.gpu_pool.blocks
    rows_of = {rid: [manager.get_residency_row(rid) for manager in managers] for rid in live}
    for rid, st in live.items():
        valid, pinned, released = set(st["valid"]), set(st["pinned_clean"]), set(st["released"])
        pending, stale, synced = st["copying"], st["stale"], st["synced"]
        rows = rows_of[rid]
        if not pinned | released <= valid:
            bad.append(f"{rid}: pinned or released pages not clean: {sorted((pinned | released) - valid)}")
        if pinned & released or released & pending.keys():
            bad.append(f"{rid}: pages pinned and released, or released in flight: "
                       f"{sorted(pinned & released)} {sorted(released & pending.keys())}")
        if not set(range(st["ready_prefix"])) <= valid:
            bad.append(f"{rid}: durable prefix of {st['ready_prefix']} pages not clean")
        if any(page >= synced for page in stale) or (rows and synced > len(rows[0])):
            bad.append(f"{rid}: stale {stale} or synced {synced} past what was sent")
        for page in released:
            for group, row in enumerate(rows):
                block = row[page] if page < len(row) else None
                if block is None or block.is_null or (rid, page) not in owners.get(block.block_id, ()):
                    bad.append(f"{rid}: released page {page} is not among group {group}'s block's owners")
        for page, transfer_id in pending.items():
            transfer = transfers.get(transfer_id)
            if transfer is None or transfer[1:3] != (rid, page) or not transfer[6]:
                bad.append(f"{rid}: page {page} in flight names transfer {transfer_id}, which is not its")
        if hot and all(manager.has_hot(rid) for manager in hot) and any(
                rid not in manager.hot_required for manager in hot):
            bad.append(f"{rid}: holds its hot regions outside hot_required")
    for block_id, pairs in owners.items():
        for rid, page in pairs:
            st = live.get(rid)
            if st is None or page not in st["released"]:
                bad.append(f"block {block_id}: owner {rid} page {page} is not a released page of a live request")
            elif all(page >= len(row) or row[page].block_id != block_id for row in rows_of[rid]):
                bad.append(f"block {block_id}: owner {rid} page {page} does not hold it")
    for host_hash, blocks in copies.items():
        if any(copy_keys.get(block) != host_hash for block in blocks):
            bad.append(f"copy {host_hash!r}: its blocks do not name it")
    for block_id, host_hash in copy_keys.items():
        if block_id not in copies.get(host_hash, ()):
            bad.append(f"block {block_id} names a copy that does not hold it")
    for transfer_id, rid, page, _, resident, pins_released, of_live, _ in transfers.values():
        if not of_live:
            continue  # a freed request's: it only gives back its pins when it completes
        if live[rid]["copying"].get(page) != transfer_id:
            bad.append(f"transfer {transfer_id} of {rid} page {page}: the page does not name it")
        if not pins_released and any(gpu_blocks[block].ref_cnt < 2 for block in resident):
            bad.append(f"transfer {transfer_id} of {rid} page {page}: its GPU blocks are not held beside the page")
    return bad


def _coordinator(setup):
    """The HiSparse coordinator behind the scheduler's connector, alone or a ``MultiConnector`` child."""
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator

    connectors = getattr(setup.scheduler.connector, "sub_connectors", None) or [setup.scheduler.connector]
    found = [getattr(getattr(c, "connector_scheduler", None), "coordinator", None) for c in connectors]
    (coord,) = [c for c in found if isinstance(c, HiSparseCoordinator)]
    return coord


def _run_checked(setup, worker, jobs, *, between_steps=None, **run) -> tuple:
    """``jobs`` through vLLM's scheduler, the lifecycle checked after every step: the run's stats, and in how
    many steps each state the invariants speak of was held by some request. ``between_steps(step)``, run after
    each step's check, returns whether it changed the scheduler's state (the lifecycle is then checked again)."""
    coord = _coordinator(setup)
    seen: Counter[str] = Counter()

    def check(step: int) -> None:
        bad = lifecycle_violations(coord)
        assert not bad, f"step {step}: " + "; ".join(bad[:5])

    def on_step(step: int) -> None:
        check(step)
        book = H.lifecycle(coord)
        states = book["requests"].values()
        seen["released"] += any(st["released"] for st in states)
        seen["pinned"] += any(st["pinned_clean"] for st in states)
        seen["in flight"] += bool(book["transfers"])
        seen["lost"] += any(block.is_null for rid in book["requests"]
                            for block in coord.resident_managers[0].get_residency_row(rid))
        seen["owned"] += any(book["owners"].values())
        seen["copies"] += bool(book["copies"])
        if between_steps is not None and between_steps(step):
            check(step)

    return H.run(setup, worker, jobs, on_step=on_step, **run), seen


#: The states the invariants speak of, each of which a run must reach for its check to mean anything.
STATES = ("released", "pinned", "in flight", "lost", "owned", "copies")


@pytest.mark.parametrize("mode,policy,async_scheduling,mtp", [
    ("native", None, False, 0), ("native", None, True, 3),
    ("hisparse", "fifo", True, 0), ("hisparse", "coldest", False, 0), ("hisparse", "coldest", True, 3)],
    ids=["native", "native-async-mtp", "fifo-async", "coldest", "coldest-async-mtp"])
def test_every_step_keeps_the_page_lifecycle_invariants(monkeypatch, mode, policy, async_scheduling, mtp):
    """``test_vllm_integration.py``'s parity trace (shared prefixes, pressure, preemptions, recycled blocks,
    copies that complete late), each step checked; and the trace reaches every state the invariants speak of,
    so none holds only because it was never tested."""
    if mtp:
        monkeypatch.setattr(H, "TOP_K", 512)  # hot regions small enough for MTP's requests to take them
    shared = H.prompt(1000, 2048)
    jobs = [H.Job(f"r{i}", H.prompt(i, 4000 + 97 * i, shared if i % 2 else None), 16 + 60 * (i % 3 == 0),
                  arrival=3 * i) for i in range(12)]
    setup = H.build(mode=mode, gpu_gib=1.3 if mtp else 0.8, max_model_len=8192, host_pool_gib=40,
                    async_scheduling=async_scheduling, num_spec_tokens=mtp,
                    max_num_batched_tokens=2048 if mtp else 8192,
                    extra=None if policy is None else {"policy": policy, "heat_interval": 4})
    worker = H.FakeWorker(setup, layers=[0, 60], completion_lag=2)
    stats, seen = _run_checked(setup, worker, jobs, num_spec_tokens=mtp)
    assert stats.rows_from_host > 0 and stats.preemptions + stats.prefix_hit_tokens > 0
    assert all(seen[state] for state in STATES), seen


@pytest.mark.parametrize("mode,policy", [("native", None), ("hisparse", "fifo")])
def test_agents_beside_the_offloading_connector_keep_the_page_lifecycle_invariants(mode, policy):
    """The published deployment's shape, scaled down (``test_vllm_agent.py``): GLM-5.3's layout, MTP 3, async,
    HiSparse beside vLLM's offloading connector, agent conversations in a pool that holds about half of them,
    turns aborted mid-answer, copies completing two steps late; later turns hit their prefixes on the GPU, on
    HiSparse's host pool only (host imports) and in the offloading tier. vLLM's decisions (native and
    ``fifo``): under ``coldest`` these turns are too short ever to pay for a hot region, so they keep their
    pages and never reach the released states (its lifecycle is checked above, and restores below)."""
    setup = H.build(mode=mode, model="glm5.3", gpu_gib=1.8, max_model_len=16384, num_spec_tokens=3,
                    host_pool_gib=40, async_scheduling=True, max_num_seqs=8, max_num_batched_tokens=1024,
                    offload_gib=0.25, extra=None if policy is None else {"policy": policy})
    worker = H.FakeWorker(setup, layers=[0, 77], completion_lag=2)
    jobs, then = H.conversations(6, 100, first=2500, later=300, output=24, turns=3, spacing=2)
    stats, seen = _run_checked(setup, worker, jobs, then=then, aborts={"c1-t2": 5, "c3-t1": 10}, num_spec_tokens=3)
    assert stats.aborted == 2 and stats.host_only_prefix_admissions > 0 and stats.rows_from_host > 0
    assert all(seen[state] for state in STATES), seen


@pytest.mark.parametrize("mode", ["native", "hisparse"])
def test_short_turns_restored_whole_keep_the_page_lifecycle_invariants(monkeypatch, mode):
    """Short later turns on GLM-5.3's layout at the published top-K, MTP 3, async, beside the offloading
    connector: vLLM gives each prefix hit a hot region, hisparse restores it whole to resident pages
    (``restore.py``: its pages are planned as restores, host to GPU, and adopted)."""
    monkeypatch.setattr(H, "TOP_K", 2048)
    setup = H.build(mode=mode, model="glm5.3", gpu_gib=1.0, max_model_len=4096, num_spec_tokens=3,
                    async_scheduling=True, max_num_batched_tokens=8192, host_pool_gib=8, offload_gib=0.25)
    jobs, then = H.conversations(4, 300, first=2000, later=900, output=48, turns=2)
    stats, seen = _run_checked(setup, H.FakeWorker(setup, layers=[0, 42]), jobs, then=then, num_spec_tokens=3)
    assert stats.prefix_hit_tokens > 0 and seen["pinned"] and seen["copies"], seen
    if mode == "hisparse":
        assert _coordinator(setup).counters["restored_whole"] >= 4
