"""The selection model: its calibration predicts the held-out published miss rate, and its streams behave."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from hisparse.tools import locality

STEP_COST = Path(__file__).resolve().parent.parent / "benches" / "step_cost.py"


def test_fit_on_1x_and_4x_predicts_2x_within_20_percent():
    r = locality.check(held_out=1, quick=True)
    by_role = {p["role"]: p for p in r["points"] if p["role"] == "held out"}
    held = by_role["held out"]
    assert held["ratio"] == 2.0 and held["published"] == 0.134
    assert abs(held["rel_error"]) <= 0.20, r
    fitted = [p for p in r["points"] if p["role"] == "fitted"]
    assert all(abs(p["rel_error"]) <= 0.10 for p in fitted), r
    # consecutive positions share most of their top-K, not all of it
    assert 0.5 < r["overlap"] < 0.9


def test_a_stream_selects_top_k_rows_with_sinks_and_window():
    p = locality.Params(context=20_000)
    s = locality.SelectionStream(p, seed=1)
    rows = s.select()
    assert len(np.unique(rows)) == len(rows) <= p.top_k
    assert len(rows) > 0.9 * p.top_k
    assert set(range(p.sink_tokens)) <= set(rows.tolist())
    assert set(range(20_000 - p.window_tokens, 20_000)) <= set(rows.tolist())
    assert rows.max() < 20_000
    nxt = s.select()  # one position later: the window moved by one
    assert 20_000 in set(nxt.tolist())


def test_lru_counter_at_one_step_of_rows_is_one_minus_overlap():
    lru = locality.LruCounter([4], rows=16, steps=3)
    lru.step(np.array([0, 1, 2, 3]), record=False)
    lru.step(np.array([2, 3, 4, 5]), record=True)  # 2 of 4 were used by the last step
    assert lru.miss_rates() == [0.5]


def test_a_buffer_that_holds_much_of_a_short_history_misses_less():
    """The miss curve depends on the history's length: 4 x top_k rows over 10K tokens (5 x top_k) miss less than
    half of what they miss over 80K; at a measured length the curve is that length's profile; more rows never miss
    more; a buffer that serves no rows misses none."""
    short = [locality.context_miss_rate(0, h, 1.0, 5.0) for h in (1.0, 2.0, 4.0, 8.0)]
    long = [locality.context_miss_rate(0, h, 1.0, 40.0) for h in (1.0, 2.0, 4.0, 8.0)]
    assert short[2] < 0.5 * long[2], (short, long)
    assert all(a >= b for a, b in zip(short, short[1:], strict=False))
    assert all(a >= b for a, b in zip(long, long[1:], strict=False))
    prof = locality.step_profile(0, context=32.0)
    assert locality.context_miss_rate(0, 4.0, 1.0, 32.0) == prof.miss_rate(4.0 / prof.union)
    assert locality.context_miss_rate(0, 4.0, 0.0, 32.0) == 0.0


def test_step_cost_selects_from_the_model_and_its_quick_run_hits():
    """benches/step_cost.py's indexer stand-in: per request one stream of the model (sinks, the recent window,
    top_k positions at most, -1 after them), whose consecutive steps share most of their rows; its --quick run
    reports the resolver's hits and heat summaries."""
    spec = importlib.util.spec_from_file_location("step_cost", STEP_COST)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    select = bench.Selections(seed=0)
    first = select([7, 9], [20_000, 30_000]).numpy()
    again = select([7, 9], [20_001, 30_001]).numpy()
    assert first.shape == (2, bench.TOP_K) and first.dtype == np.int32
    for rows, length in zip(first, (20_000, 30_000), strict=True):
        valid = rows[rows >= 0]
        assert (rows[len(valid):] == -1).all() and valid.max() < length
        p = locality.Params()
        assert set(range(p.sink_tokens)) | set(range(length - p.window_tokens, length)) <= set(valid.tolist())
    shared = len(np.intersect1d(first[0][first[0] >= 0], again[0][again[0] >= 0])) / (first[0] >= 0).sum()
    assert shared > 0.5, shared
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, str(STEP_COST), "--quick"], capture_output=True, text=True, env=env,
                          timeout=300, check=True)
    detail = json.loads(proc.stdout)["detail_8x16k"]
    assert 0 < detail["hit_rate"] <= 1 and detail["heat_steps"] >= 1
