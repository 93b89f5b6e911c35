"""The page book's host copies (``PageBook::plan``, ``rust/core/src/page_book.rs``) against vLLM 0.33's own
coordinator, where they plan nothing as much as where they do.

The book reads a page's blocks from the core's rows (``BlockRows``) instead of vLLM's managers, and plans
nothing where vLLM's ``_plan_page_transfer`` returns early (``vllm/v1/hisparse/coordinator.py:567-615``): a
page already in flight, no host block for the page (past the host row, or a null one), or a resident group
that reads the page from the host. Two kinds of test, each running vLLM's own HiSparse and ours under
``policy: fifo`` (vLLM's decisions) side by side:

- vLLM's scheduler (``tests/vllm_harness.py``) runs traffic that plans and completes copies in every way it
  can: imports from vLLM's offloading tier, pages released under pressure and reused. After every step the
  transfers in flight, each request's pages in flight, the GPU copies indexed for prefix hits and both
  pools' reference counts and free queues are the same in both.
- vLLM's scheduler does not reach most of the early returns (why: the second test's docstring): they are
  called directly, on the state both engines' schedulers built, mutated as little as each needs, and must
  give the same result and change the same.
"""

from __future__ import annotations

import pytest

H = pytest.importorskip("vllm_harness")
pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

PLANNED = "planned"


def _vllms_and_ours(scenario):
    """``scenario(mode, extra)`` built for vLLM's own HiSparse and for ours under ``policy: fifo``: ``(*built,
    coordinator)`` for each."""
    for mode, extra in (("native", None), ("hisparse", {"policy": "fifo"})):
        built = scenario(mode, extra)
        coord = built[0].scheduler.connector
        coord = getattr(coord, "sub_connectors", [coord])
        (coord,) = [c.connector_scheduler.coordinator for c in coord
                    if getattr(getattr(c, "connector_scheduler", None), "coordinator", None) is not None]
        yield *built, coord


def _plan_branch(coord, request_id: str, page: int) -> str:
    """Which of vLLM's conditions decides ``_plan_page_transfer`` (``coordinator.py:576-591``), read from vLLM's
    managers, not from the core's rows."""
    state = H.lifecycle(coord)["requests"].get(request_id)
    if state is not None and page in state["copying"]:
        return "pending"
    host = coord.host_manager.req_to_blocks.get(request_id)
    if host is None or page >= len(host):
        return "past the host row"
    if host[page].is_null:
        return "null host block"
    if any(m.get_resident_page(request_id, page) is None for m in coord.resident_managers):
        return "no GPU block"
    return PLANNED


def _state(coord) -> tuple:
    """Everything a page's host copy changes: the transfers in flight, each request's pages in flight, the GPU
    copies indexed for prefix hits, and both pools' reference counts and free queue order (``touch`` takes a
    block with no reference out of the queue)."""

    def pool(p):
        return [b.ref_cnt for b in p.blocks], [b.block_id for b in p.free_block_queue.get_all_free_blocks()]

    book = H.lifecycle(coord)
    return (coord.next_spill_id, book["transfers"], {r: st["copying"] for r, st in book["requests"].items()},
            book["copies"], book["copy_keys"], pool(coord.gpu_pool), pool(coord.host_manager.block_pool))


def _imports(mode, extra):
    """Agents' later turns whose indexer keys come back from vLLM's offloading tier (asynchronous loads): the
    imported pages' MLA rows are on HiSparse's host pool only, null in the resident rows (turns long enough
    to read through hot regions)."""
    setup = H.build(mode=mode, gpu_gib=0.8, max_model_len=16384, host_pool_gib=20, offload_gib=0.25,
                    max_num_seqs=8, max_num_batched_tokens=2048, extra=extra)
    return setup, *H.conversations(5, 100, first=4500, later=300, output=24, turns=4, spacing=3)


def _pressure(mode, extra):
    """A stream of requests in a tight pool: requests read through hot regions, release their clean pages, and
    the pool reuses them (pages lost: null in the resident rows)."""
    setup = H.build(mode=mode, gpu_gib=0.8, max_model_len=8192, host_pool_gib=40, extra=extra)
    return setup, [H.Job(f"r{i}", H.prompt(i, 5000 + 97 * i), 24, arrival=3 * i) for i in range(16)], None


@pytest.mark.parametrize("scenario", [_imports, _pressure], ids=lambda f: f.__name__[1:])
def test_every_copy_in_vllms_traffic_changes_what_vllms_does(scenario):
    runs = []
    for setup, jobs, then, coord in _vllms_and_ours(scenario):
        steps = []
        # Transfers complete two steps late, as a GPU's DMA would: pages stay in flight across steps.
        worker = H.FakeWorker(setup, layers=[0], reads=False, data=False, completion_lag=2)
        H.run(setup, worker, jobs, then=then, on_step=lambda _, coord=coord, steps=steps: steps.append(_state(coord)))
        runs.append(steps)
    theirs, ours = runs
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"step {step}: the copies or what they changed differ"
    assert any(s[1] for s in ours) and any(s[3] for s in ours), "copies were in flight and indexed"


class _Probed(Exception):
    """Stops the run once the probes have run."""


# The probes (case -> the branch of vLLM's conditions each must take).
EXPECTED = {"in flight": "pending", "past the host row": "past the host row", "no host row": "past the host row",
            "null host block": "null host block", "lost page": "no GPU block",
            "one group reads it from the host": "no GPU block", "released page planned": PLANNED}


def _probe(coord, jobs) -> list | None:
    """The direct calls, on the state vLLM's scheduler has built at this step, if a running request has all a
    probe needs: a page lost (valid, its blocks reused: null in every resident group) and a page released but
    still on the GPU (its blocks in the free queue), while some request has a page in flight. Returns (case,
    branch, result, state after) for each call; a call expected to change nothing is checked to have changed
    nothing, one expected to change something to have."""
    managers, host_rows = coord.resident_managers, coord.host_manager.req_to_blocks
    rows = getattr(coord, "rows", None)  # ours: the core's record of vLLM's rows, changed with them

    def on_gpu(rid, page):
        return all(m.get_resident_page(rid, page) is not None for m in managers)

    requests = H.lifecycle(coord)["requests"]
    in_flight = next(((rid, page) for rid, st in sorted(requests.items()) for page in st["copying"]), None)
    for rid, st in sorted(requests.items()):
        row = host_rows.get(rid, [])
        idle = [p for p in range(len(row)) if p not in st["copying"]]
        lost = [p for p in idle if p in st["valid"] and all(m.get_resident_page(rid, p) is None for m in managers)]
        released = [p for p in idle if p in st["released"] and on_gpu(rid, p)
                    and managers[0].get_resident_page(rid, p).ref_cnt == 0]
        if in_flight and lost and released:
            break
    else:
        return None
    gone = next(j.req_id for j in jobs if j.req_id not in host_rows)  # finished, or not yet arrived: no host row
    page, null = released[0], coord.host_manager.block_pool.null_block
    out = []

    def plan(case, rid, p, changes=False):
        branch = _plan_branch(coord, rid, p)
        before = _state(coord)
        result = coord._plan_page_transfer(rid, p, after_forward=True)
        after = _state(coord)
        assert (after != before) == changes, f"{case}: {'no change' if changes else 'a change'}"
        out.append((case, branch, result, after))

    plan("in flight", *in_flight)
    # Past the end of the host row, and no host row at all: vLLM's _get_request_state comes first and makes an
    # empty state for the request in both (a change, compared between the two engines).
    plan("past the host row", rid, len(row))
    plan("no host row", gone, 0, changes=True)
    # A null host block: the page's host block swapped for the pool's null block, then put back.
    row[page], real = null, row[page]
    if rows is not None:
        rows.set_page(rid, None, page, None)
    plan("null host block", rid, page)
    row[page] = real
    if rows is not None:
        rows.set_page(rid, None, page, real.block_id)
    # A page read from the host: lost in every group (vLLM's state, unmutated), then in the last group only
    # (dropped through vLLM's manager, as a loss drops it, and in the core's rows; then adopted back).
    plan("lost page", rid, lost[0])
    block = managers[-1].drop_resident_page(rid, page)
    if rows is not None:
        rows.set_page(rid, len(managers) - 1, page, None)
    plan("one group reads it from the host", rid, page)
    assert managers[-1].adopt_resident_page(rid, page, block)
    if rows is not None:
        rows.set_page(rid, len(managers) - 1, page, block.block_id)
    # What it changes when it plans: a released page's blocks are touched out of the free queue.
    plan("released page planned", rid, page, changes=True)
    return out


def test_early_returns_vllms_scheduler_never_reaches_match_vllms_on_its_state():
    """The early returns the traffic above never takes, on a real state: two engines run the same pressure trace
    (copies completing two steps late), one on vLLM's own HiSparse and one on ours under ``policy: fifo``, to
    the first step where a running request has a page lost and a page released but still on the GPU while a
    page is in flight. Each probe takes the branch named, and both give the same result and leave the same
    state.

    Why vLLM's scheduler does not take these branches (vLLM 0.33.0, files under ``vllm/v1/``; ``coordinator``
    is ``hisparse/coordinator.py``, ``managers`` ``core/single_type_kv_cache_manager.py``):

    - A null host block (``coordinator:583``): never in a host row. The host
      group's ``HiSparseSourceManager`` (``managers:2223``) is a ``FullAttentionManager``, which skips no token
      (``get_num_skipped_tokens`` is 0, ``managers:722-733``, not overridden): no null padding at admission
      (``:311-312``) and none freed behind a window (``:706-712``); a prefix hit is cached blocks
      (``:792-800``), new and imported pages and copy-on-write targets come from ``get_new_blocks``
      (``:361-366``, ``:396-409``, ``:469-474``), which never hands out the null block (taken out of the free
      queue at start, ``core/block_pool.py:191-192``).
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
    """
    results = []
    for setup, jobs, _, coord in _vllms_and_ours(_pressure):
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
    theirs, ours = results
    for case, branch, result, _ in ours:
        assert branch == EXPECTED[case], (case, branch)
        assert result is (branch == PLANNED), (case, result)
    assert [c[:3] for c in ours] == [c[:3] for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a[3] == b[3], f"{a[0]}: ours and vLLM's left different states"
