"""benches/kernel_bench.py's cases are what its report says they are, checked with no GPU: each target case's
arguments, built on the CPU for one request, go through the CPU reference of resolve (``resolve_reference``),
which the kernels match bit for bit, and give the hits, misses and reads the case names. A GPU session then
times cases known to be right."""

import sys
from pathlib import Path

import pytest
import torch

from hisparse.datapath import resolve_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import kernel_bench as K  # noqa: E402

CASES = [K.MISSES_CASE, *K.HIT_ONLY.values(), *K.RESIDENT_CASES]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_target_case_resolves_as_its_name_says(case):
    hot_rows, _batch, miss_rate, resident = case
    pages = K.SEQ_LEN // K.BLOCK_SIZE
    host_pool = torch.zeros(pages * K.BLOCK_SIZE, K.ROW_BYTES, dtype=torch.uint8)  # one request's host pages
    args = K.build(hot_rows, 1, miss_rate, host_pool, seed=3, resident=resident, device="cpu")
    del args["miss_plan"], args["miss_count"]  # only the CUDA resolver records a plan
    hot_before = args["hot_pos"].clone()
    resolve_reference(**args)
    hits, misses, _ = args["counters"].tolist()
    assert args["status"].tolist() == [0]
    assert args["resident"].tolist() == [int(resident)]  # the flag that sends resolve down its short path
    out, topk = args["out"][0], args["topk"][0].long()
    assert len(set(topk.tolist())) == K.TOP_K  # distinct positions: each is one hit, miss or in-place read
    if resident:
        # The short path: every row read in place from its own page, the hot region neither read nor changed.
        blocks = args["block_table"][0].long()[topk // K.BLOCK_SIZE]
        assert torch.equal(out.long(), blocks * K.BLOCK_SIZE + topk % K.BLOCK_SIZE)
        assert (hits, misses) == (0, 0)
        assert torch.equal(args["hot_pos"], hot_before)
    else:
        assert misses == round(miss_rate * K.TOP_K) and hits == K.TOP_K - misses
        assert bool((out >= 0).all())
