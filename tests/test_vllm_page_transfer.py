"""``Bookkeeping._plan_page_transfer`` and ``_record_copy`` against vLLM 0.33's own, where they plan or record
nothing as much as where they do.

Both read a page's GPU blocks from the core's rows (``BlockRows``) instead of vLLM's managers, and return early
where vLLM's do (``vllm/v1/hisparse/coordinator.py:567-615``, ``:300-313``): a page already in flight, no host
block for the page (past the host row, or a null one), or a resident group that reads the page from the host.
Two kinds of test:

- vLLM's scheduler (``tests/vllm_harness.py``) runs traffic that reaches these methods in every way it can:
  imports from vLLM's offloading tier, short later turns restored whole (``restore.py``), pages released under
  pressure and reused. Every call is classified by vLLM's own view of the request's rows and must return what
  vLLM's conditions say, and the run is repeated with vLLM's two methods put back on the coordinator: the calls
  and what they change, step by step, are the same.
- Of the early returns, these traces reach only ``_record_copy``'s "a group has no GPU block" (an imported
  page is on the host only). vLLM's scheduler does not reach the others (why: the second test's docstring):
  they are called directly on a state vLLM's scheduler built, mutated as little as each needs, in two engines
  run identically, one with vLLM's methods, and must give the same result and change the same.
"""

from __future__ import annotations

import types

import pytest

H = pytest.importorskip("vllm_harness")
pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

PLANNED, RECORDED = "planned", "recorded"


def _use_vllms(coord) -> None:
    """vLLM's ``_plan_page_transfer`` and ``_record_copy`` on this coordinator instance (as the parity tests of
    ``test_vllm_integration.py`` put vLLM's scans back): the reference ours must equal."""
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator

    for name in ("_plan_page_transfer", "_record_copy"):
        setattr(coord, name, types.MethodType(getattr(HiSparseCoordinator, name), coord))


def _ours_and_vllms(scenario):
    """``scenario()`` built twice, the second with vLLM's methods (``_use_vllms``): ``(*scenario(), coordinator)``
    for each."""
    for vllms in (False, True):
        built = scenario()
        (coord,) = H.hisparse_coordinators(built[0].scheduler)
        if vllms:
            _use_vllms(coord)
        yield *built, coord


def _plan_branch(coord, request_id: str, page: int) -> str:
    """Which of vLLM's conditions decides ``_plan_page_transfer`` (``coordinator.py:576-591``), read from vLLM's
    managers, not from the core's rows."""
    state = coord.request_states.get(request_id)
    if state is not None and page in state.pending_pages:
        return "pending"
    host = coord.host_manager.req_to_blocks.get(request_id)
    if host is None or page >= len(host):
        return "past the host row"
    if host[page].is_null:
        return "null host block"
    if any(m.get_resident_page(request_id, page) is None for m in coord.resident_managers):
        return "no GPU block"
    return PLANNED


def _record_branch(coord, request_id: str, page: int, host_block) -> str:
    if host_block.is_null:
        return "null host block"
    if host_block.block_hash is None:
        return "unhashed host block"
    if any(m.get_resident_page(request_id, page) is None for m in coord.resident_managers):
        return "no GPU block"
    return RECORDED


def _trace(coord, calls: list) -> None:
    """Wraps both methods on the instance (whichever implementation it has): every call, the branch vLLM's
    conditions take, and the result."""
    plan, record = coord._plan_page_transfer, coord._record_copy

    def traced_plan(request_id, page, *, after_forward, restore=False):
        branch = _plan_branch(coord, request_id, page)
        result = plan(request_id, page, after_forward=after_forward, restore=restore)
        calls.append(("plan", request_id, page, restore, branch, result))
        return result

    def traced_record(request_id, page, host_block):
        branch = _record_branch(coord, request_id, page, host_block)
        record(request_id, page, host_block)
        calls.append(("record", request_id, page, host_block.block_id, branch))

    coord._plan_page_transfer, coord._record_copy = traced_plan, traced_record


def _state(coord) -> tuple:
    """Everything the two methods may change: the transfers planned (sent and in flight), each request's pages
    in flight, the GPU copies indexed for prefix hits, and both pools' reference counts and free queue order
    (``touch`` takes a block with no reference out of the queue)."""

    def pool(p):
        return [b.ref_cnt for b in p.blocks], [b.block_id for b in p.free_block_queue.get_all_free_blocks()]

    return (
        coord.next_spill_id, list(coord.spills_to_send),
        {t: (s.page, s.host_block.block_id, tuple(b.block_id for b in s.resident_blocks), s.restore)
         for t, s in coord.pending_spills.items()},
        {r: dict(s.pending_pages) for r, s in coord.request_states.items()},
        {h: tuple(b.block_id for b in blocks) for h, blocks in coord.copies.items()}, dict(coord._copy_by_block),
        pool(coord.gpu_pool), pool(coord.host_manager.block_pool),
    )


def _imports():
    """Agents' later turns whose indexer keys come back from vLLM's offloading tier (asynchronous loads): the
    imported pages' MLA rows are on HiSparse's host pool only, null in the resident rows (turns long enough
    to read through hot regions, not restored whole)."""
    setup = H.build(mode="hisparse", gpu_gib=0.8, max_model_len=16384, host_pool_gib=20, offload_gib=0.25,
                    max_num_seqs=8, max_num_batched_tokens=2048)
    return setup, *H.conversations(5, 100, first=4500, later=300, output=24, turns=4, spacing=3), 0


def _whole_restores():
    """Short later turns on GLM-5.3's layout (MTP 3, async) restored whole to resident pages (``restore.py``),
    in a pool small enough that vLLM preempts: restore transfers from local hits and completed imports."""
    setup = H.build(mode="hisparse", model="glm5.3", gpu_gib=0.95, max_model_len=4096, num_spec_tokens=3,
                    async_scheduling=True, max_num_batched_tokens=8192, host_pool_gib=8, offload_gib=0.25)
    return setup, *H.conversations(16, 300, first=2000, later=900, output=400, turns=2), 3


def _pressure():
    """A stream of requests in a tight pool (``coldest``): requests read through hot regions, release their
    clean pages, and the pool reuses them (pages lost: null in the resident rows)."""
    setup = H.build(mode="hisparse", gpu_gib=0.8, max_model_len=8192, host_pool_gib=40)
    return setup, [H.Job(f"r{i}", H.prompt(i, 5000 + 97 * i), 24, arrival=3 * i) for i in range(16)], None, 0


@pytest.mark.parametrize("scenario", [_imports, _whole_restores, _pressure], ids=lambda f: f.__name__[1:])
def test_every_call_in_vllms_traffic_decides_and_changes_what_vllms_does(scenario):
    runs = []
    for setup, jobs, then, mtp, coord in _ours_and_vllms(scenario):
        calls, steps = [], []
        _trace(coord, calls)
        # Transfers complete two steps late, as a GPU's DMA would: pages stay in flight across steps.
        worker = H.FakeWorker(setup, layers=[0], reads=False, data=False, completion_lag=2)
        H.run(setup, worker, jobs, then=then, num_spec_tokens=mtp,
              on_step=lambda _, coord=coord, calls=calls, steps=steps: steps.append((len(calls), _state(coord))))
        runs.append((calls, steps))
    (ours, ours_steps), (theirs, theirs_steps) = runs
    # Each call returns what vLLM's conditions, on vLLM's rows, say.
    for call in ours:
        if call[0] == "plan":
            assert call[5] == (call[4] == PLANNED), call
    assert ours == theirs
    assert len(ours_steps) == len(theirs_steps)
    for step, (a, b) in enumerate(zip(ours_steps, theirs_steps, strict=True)):
        assert a == b, f"step {step}: the calls or what they changed differ"
    reached = {(c[0], c[4]) for c in ours}
    assert ("plan", PLANNED) in reached and ("record", RECORDED) in reached
    if scenario is _imports:
        assert ("record", "no GPU block") in reached, "an imported page's GPU copy was looked for"
    if scenario is _whole_restores:
        assert any(c[0] == "plan" and c[3] and c[5] for c in ours), "restores were planned"


class _Probed(Exception):
    """Stops the run once the probes have run."""


# The probes (case -> the branch of vLLM's conditions each must take).
EXPECTED = {"in flight": "pending", "past the host row": "past the host row", "no host row": "past the host row",
            "null host block": "null host block", "lost page": "no GPU block",
            "one group reads it from the host": "no GPU block", "unhashed host block": "unhashed host block",
            "released page planned": PLANNED, "copy recorded": RECORDED}


def _probe(coord, jobs) -> list | None:
    """The direct calls, on the state vLLM's scheduler has built at this step, if a running request has all a
    probe needs: a page in flight, a page lost (valid, its blocks reused: null in every resident group), a page
    released but still on the GPU (its blocks in the free queue), a page whose host block has no hash yet (the
    tail) and one whose has. Returns (case, method, branch, result, state after) for each call; a call expected
    to change nothing is checked to have changed nothing, one expected to change something to have."""
    managers, host_rows = coord.resident_managers, coord.host_manager.req_to_blocks

    def on_gpu(rid, page):
        return all(m.get_resident_page(rid, page) is not None for m in managers)

    for rid, st in sorted(coord.request_states.items()):
        row = host_rows.get(rid, [])
        idle = [p for p in range(len(row)) if p not in st.pending_pages]
        lost = [p for p in idle if p in st.valid_pages
                and all(m.get_resident_page(rid, p) is None for m in managers)]
        released = [p for p in idle if p in st.unpinned_pages and on_gpu(rid, p)
                    and managers[0].get_resident_page(rid, p).ref_cnt == 0]
        unhashed = [p for p in idle if row[p].block_hash is None and on_gpu(rid, p)]
        hashed = [p for p in idle if row[p].block_hash is not None and on_gpu(rid, p)]
        if st.pending_pages and lost and released and unhashed and hashed:
            break
    else:
        return None
    gone = next(j.req_id for j in jobs if j.req_id not in host_rows)  # finished, or not yet arrived: no host row
    page, null = released[0], coord.host_manager.block_pool.null_block
    out = []

    def call(case, method, branch, *args, changes=False, **kwargs):
        before = _state(coord)
        result = getattr(coord, method)(*args, **kwargs)
        after = _state(coord)
        assert (after != before) == changes, f"{case}: {'no change' if changes else 'a change'}"
        out.append((case, method, branch, result, after))

    def plan(case, rid, p, changes=False):
        call(case, "_plan_page_transfer", _plan_branch(coord, rid, p), rid, p, after_forward=True, changes=changes)

    def record(case, rid, p, host_block, changes=False):
        call(case, "_record_copy", _record_branch(coord, rid, p, host_block), rid, p, host_block, changes=changes)

    plan("in flight", rid, next(iter(st.pending_pages)))
    # (b) Past the end of the host row, and no host row at all: vLLM's _get_request_state comes first and makes
    # an empty state for the request in both (a change, compared between the two engines).
    plan("past the host row", rid, len(row))
    plan("no host row", gone, 0, changes=True)
    # (a) A null host block: the page's host block swapped for the pool's null block, then put back.
    row[page], real = null, row[page]
    plan("null host block", rid, page)
    row[page] = real
    record("null host block", rid, page, null)
    # (c) A page read from the host: lost in every group (vLLM's state, unmutated), then in the last group only
    # (dropped as _lose_page drops it, through vLLM's manager, and recorded in the core as _lose_page records
    # a loss; then adopted back, through vLLM's manager, whose adoptions the core records).
    plan("lost page", rid, lost[0])
    record("lost page", rid, lost[0], row[lost[0]])
    block = managers[-1].drop_resident_page(rid, page)
    coord.rows.set_page(rid, len(managers) - 1, page, None)
    plan("one group reads it from the host", rid, page)
    record("one group reads it from the host", rid, page, row[page])
    assert managers[-1].adopt_resident_page(rid, page, block)
    record("unhashed host block", rid, unhashed[0], row[unhashed[0]])
    # What they change when they plan and record: a released page's blocks are touched out of the free queue;
    # a page whose hash indexes another GPU copy (as when another request's copy of it was indexed: here the
    # tail's blocks, which nothing indexes) is indexed under its own blocks, the other copy's entries dropped.
    plan("released page planned", rid, page, changes=True)
    digest, other = row[hashed[0]].block_hash, [m.get_resident_page(rid, unhashed[0]) for m in managers]
    assert not any(b.block_id in coord._copy_by_block for b in other)
    coord._drop_copy(digest)
    coord.copies[digest] = tuple(other)
    coord._copy_by_block.update(dict.fromkeys((b.block_id for b in other), digest))
    record("copy recorded", rid, hashed[0], row[hashed[0]], changes=True)
    return out


def test_early_returns_vllms_scheduler_never_reaches_match_vllms_on_its_state():
    """The early returns the traffic above never takes, on a real state: two engines run the same pressure trace
    (copies completing two steps late) to the first step where a running request has a page in flight, a page
    lost, a page released but still on the GPU and a tail page not yet hashed; one has vLLM's two methods. Each
    probe takes the branch named, and both give the same result and leave the same state.

    Why vLLM's scheduler does not take these branches (vLLM 0.33.0, files under ``vllm/v1/``; ``coordinator``
    is ``hisparse/coordinator.py``, ``managers`` ``core/single_type_kv_cache_manager.py``):

    - A null host block (``coordinator:583``; ``:303`` in ``_record_copy``): never in a host row. The host
      group's ``HiSparseSourceManager`` (``managers:2223``) is a ``FullAttentionManager``, which skips no token
      (``get_num_skipped_tokens`` is 0, ``managers:722-733``, not overridden): no null padding at admission
      (``:311-312``) and none freed behind a window (``:706-712``); a prefix hit is cached blocks
      (``:792-800``), new and imported pages and copy-on-write targets come from ``get_new_blocks``
      (``:361-366``, ``:396-409``, ``:469-474``), which never hands out the null block (taken out of the free
      queue at start, ``core/block_pool.py:191-192``). ``_record_copy`` is passed a host row's block
      (``coordinator:295``) or a planned transfer's (``:815``).
    - Past the host row (``coordinator:580``): pages are planned for tokens computed after the step
      (``kv_connector/v1/hisparse/connector.py:151-157``), which ``allocate_slots`` gave host blocks in that
      ``schedule()``; the last page of an import (``coordinator:561``), whose host blocks the import allocated
      (``managers:2297-2317``), an import being dropped when its request is freed (``coordinator:855``); and
      ``restore.py``'s pages of a host prefix hit or an import.
    - In flight, or read from the host by a resident group (``coordinator:577``, ``:587-591``): vLLM's
      ``plan_prefix_materialization`` tests both first (``:477-485``). Ours skips pages in flight and valid
      pages; a resident page is null only when valid (a host prefix hit, ``commit_computed_blocks`` ``:198-212``;
      a page lost, released only when valid ``:361``) or below a pending import's end, where planning starts
      (``:468-473``); an import's last page keeps its block (``managers:2523-2525``), as do the pages
      ``restore.py`` fills, until the request is freed.
    - An unhashed host block (``coordinator:303``): ``_record_copies`` records the pages just published
      (``:529-535``); a completed restore (``:815``) is of a host prefix hit's page (``restore.py``) or an
      import's, and vLLM's ``OffloadingConnector`` imports only within the prefix HiSparse's host pool holds
      (``distributed/kv_transfer/kv_connector/v1/offloading_connector.py:164-181``): published blocks.
    """
    results = []
    for setup, jobs, _, _, coord in _ours_and_vllms(_pressure):
        found = []

        def on_step(_, coord=coord, jobs=jobs, found=found):
            probed = _probe(coord, jobs)
            if probed is not None:
                found.append(probed)
                raise _Probed

        with pytest.raises(_Probed):
            H.run(setup, H.FakeWorker(setup, layers=[0], reads=False, data=False, completion_lag=2), jobs,
                  on_step=on_step)
        results.append(found[0])
    ours, theirs = results
    for case, method, branch, result, _ in ours:
        assert branch == EXPECTED[case], (case, branch)
        assert result is (branch == PLANNED if method == "_plan_page_transfer" else None), (case, result)
    assert [c[:4] for c in ours] == [c[:4] for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a[4] == b[4], f"{a[0]} ({a[1]}): ours and vLLM's left different states"
