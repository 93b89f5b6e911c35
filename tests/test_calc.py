"""Tests for ``hisparse calc`` (pure Python; the core-accounting test skips without the extension).

Expected values are worked out by hand in the comments.  Common facts for GLM-5.3 on H200, TP8:
  budget  = 141e9 / 2**30 * 0.92                 = 120.8112 GiB
  weights = 19.556 / 8 + 684.167 / 8              =  87.9654 GiB  (DP1: EP or not, the same)
  KV      = 120.8112 - 87.9654 - 15 = 17.8458    -> 17.8 GiB = 19,112,604,467.2 bytes
  fp8 blocks: baseline 3,052,800, HiSparse 184,320, host 2,875,392; 81,920 tokens = 1,280 blocks
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import sys

import pytest

from hisparse.tools import calc

GIB = 2**30
KV_178 = 17.8 * GIB


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="hisparse")
    calc.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["calc", *argv])
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- the page's defaults


def test_glm53_defaults_match_the_page() -> None:
    r = calc.calculate()
    assert r.budget_gib == pytest.approx(141e9 / GIB * 0.92)
    assert r.weights_gib == pytest.approx(19.556 / 8 + 684.167 / 8)
    assert r.kv_hbm_gib == 17.8
    assert (r.baseline_block_bytes, r.hisparse_block_bytes, r.host_block_bytes) == (3_052_800, 184_320, 2_875_392)
    assert r.seq_blocks == 1280
    # baseline: floor(19,112,604,467.2 / 3,052,800) = 6,260 blocks; 6,260 // 1,280 = 4
    assert r.baseline_gpu_blocks == 6260
    assert r.baseline_total == 4
    # HiSparse per request: 1,280 + 20 * ceil(4096/64) + 20 * 2 = 1,280 + 1,280 + 40 = 2,600
    assert r.per_request_gpu_blocks == 2600
    # floor(19,112,604,467.2 / 184,320) = 103,692 blocks; 103,692 // 2,600 = 39 (39.88)
    assert r.hisparse_gpu_blocks == 103_692
    assert r.gpu_limit_per_replica == 39
    # min host: ceil(39 * 1,280 * 2,875,392 / 2**30) = ceil(133.68) = 134 GiB
    assert r.min_host_gib == 134
    # host pool = 134 GiB: floor(134 * 2**30 / 2,875,392) = 50,038 blocks; // 1,280 = 39
    assert r.host_pool_gib == 134
    assert r.host_pool_blocks == 50_038
    assert r.host_limit_per_replica == 39
    assert r.hisparse_total == 39
    assert r.multiplier == pytest.approx(39 / 4)
    assert r.limiter == "gpu"  # GPU and host tie at 39; the host pool was sized from the GPU limit
    assert r.notes == ()


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_block_bytes_derivation_reproduces_page_constants(kv_dtype: str) -> None:
    preset = calc.MODELS["glm-5.3"]
    derived = calc.block_bytes(
        layers=preset.layers, indexers=preset.indexers, groups=preset.groups, row_bytes=preset.row_bytes(kv_dtype)
    )
    assert derived == calc.PAGE_BLOCK_BYTES[kv_dtype]


def test_block_bytes_decomposition_by_hand() -> None:
    # fp8, row 576: baseline 64 * (78*576 + 21*132) = 64 * 47,700; host 64 * 44,928;
    # HiSparse: max(ceil(78/20) = 4, ceil(2,772/576) = 5) = 5 pages -> 64 * 2,880
    assert calc.block_bytes(layers=78, indexers=21, groups=20, row_bytes=576) == {
        "baseline": 64 * 47_700,
        "hisparse": 64 * 2_880,
        "host": 64 * 44_928,
    }
    # bf16, row 1152: HiSparse max(4, ceil(2,772/1,152) = 3) = 4 pages -> 64 * 4,608
    assert calc.block_bytes(layers=78, indexers=21, groups=20, row_bytes=1152)["hisparse"] == 64 * 4_608
    with pytest.raises(calc.CalcError):
        calc.block_bytes(layers=78, indexers=21, groups=0, row_bytes=576)


def test_expert_weights_derive_the_page_figure() -> None:
    # 76 MoE layers (75 + MTP) * 256 experts * 3 fp8 6144x2048 matrices + fp32 128x128 scales
    assert calc.compute_expert_weight_gib(calc.MODELS["glm-5.3"]) == pytest.approx(684.167, abs=5e-4)
    # the dense estimate lands within 0.5% of the page's 19.556
    assert calc.estimate_dense_weight_gib(calc.MODELS["glm-5.3"]) == pytest.approx(19.556, rel=5e-3)


# --------------------------------------------------------------------------- edge cases


def test_model_that_does_not_fit_gives_zeros() -> None:
    # TP1: weights 19.556 + 684.167 = 703.7 GiB > 120.8 GiB budget -> KV 0
    r = calc.calculate(tp=1)
    assert r.kv_hbm_gib == 0
    assert r.kv_hbm_gib_raw == pytest.approx(120.8112 - 703.723 - 15, abs=1e-3)
    assert (r.baseline_total, r.hisparse_total, r.min_host_gib) == (0, 0, 0)
    assert r.multiplier is None
    assert r.limiter == "no_kv_memory"
    assert any("does not fit" in n for n in r.notes)


def test_kv_override_zero_also_means_no_kv() -> None:
    r = calc.calculate(kv_hbm_gib=0)
    assert (r.baseline_total, r.hisparse_total, r.limiter) == (0, 0, "no_kv_memory")
    # Too little for one block is none either: not the GPU "binding" at 0 requests.
    r = calc.calculate(kv_hbm_gib=1e-300)
    assert (r.baseline_total, r.hisparse_total, r.limiter) == (0, 0, "no_kv_memory")


def test_a_host_pool_past_the_range_is_named_as_given() -> None:
    with pytest.raises(calc.CalcError, match="a host pool of 4096.0001 GiB per replica is beyond"):
        calc.calculate(host_gib=4096.0001)


def test_one_million_tokens() -> None:
    # 1,048,576 tokens = 16,384 blocks; baseline 6,260 // 16,384 = 0
    # per request 16,384 + 1,280 + 40 = 17,704; 103,692 // 17,704 = 5
    # min host ceil(5 * 16,384 * 2,875,392 / 2**30) = ceil(219.375) = 220;
    # host pool 220 GiB = 82,153 blocks // 16,384 = 5
    r = calc.calculate(seq_len=1_048_576)
    assert r.seq_blocks == 16_384
    assert r.baseline_total == 0
    assert r.per_request_gpu_blocks == 17_704
    assert r.hisparse_total == 5
    assert r.min_host_gib == 220
    assert r.host_limit_per_replica == 5
    assert r.multiplier is None
    assert r.limiter == "gpu"


def test_dp2_with_ep_shards_experts_and_multiplies() -> None:
    # weights 19.556/8 + 684.167/16 = 45.2049; KV 120.8112 - 45.2049 - 15 = 60.606 -> 60.6 GiB
    # baseline floor(60.6 * 2**30 / 3,052,800) = 21,314 // 1,280 = 16 per replica
    # HiSparse floor(60.6 * 2**30 / 184,320) = 353,020 // 2,600 = 135 per replica
    # min host ceil(135 * 1,280 * 2,875,392 / 2**30) = ceil(462.74) = 463 per replica
    r = calc.calculate(dp=2)
    assert r.weights_gib == pytest.approx(19.556 / 8 + 684.167 / 16)
    assert r.kv_hbm_gib == 60.6
    assert (r.baseline_per_replica, r.hisparse_per_replica) == (16, 135)
    assert (r.baseline_total, r.hisparse_total) == (32, 270)
    assert (r.min_host_gib, r.min_host_gib_total) == (463, 926)
    assert r.multiplier == pytest.approx(270 / 32)


def test_no_ep_keeps_experts_on_tp_only() -> None:
    # DP2 without EP: weights as DP1 (87.97 GiB), so each replica is the default one, totals double
    r = calc.calculate(dp=2, ep=False)
    assert r.weights_gib == pytest.approx(19.556 / 8 + 684.167 / 8)
    assert r.kv_hbm_gib == 17.8
    assert (r.baseline_total, r.hisparse_total, r.min_host_gib_total) == (8, 78, 268)
    # with DP1, EP makes no difference
    assert calc.calculate(ep=False).to_dict() | {"ep": True} == calc.calculate().to_dict()


def test_bf16() -> None:
    # baseline floor(19,112,604,467.2 / 5,928,192) = 3,224 // 1,280 = 2
    # HiSparse floor(19,112,604,467.2 / 294,912) = 64,807 // 2,600 = 24
    # min host ceil(24 * 1,280 * 5,750,784 / 2**30) = ceil(164.53) = 165
    r = calc.calculate(kv_dtype="bf16")
    assert (r.baseline_block_bytes, r.hisparse_block_bytes, r.host_block_bytes) == (5_928_192, 294_912, 5_750_784)
    assert (r.baseline_gpu_blocks, r.hisparse_gpu_blocks) == (3_224, 64_807)
    assert (r.baseline_total, r.hisparse_total, r.min_host_gib) == (2, 24, 165)
    assert r.multiplier == pytest.approx(12.0)


def test_mtp3_sizes_hot_rows() -> None:
    # hot rows (3 + 2) * 2048 = 10,240 = 160 blocks; per request 1,280 + 20*160 + 40 = 4,520
    # 103,692 // 4,520 = 22; min host ceil(22 * 1,280 * 2,875,392 / 2**30) = ceil(75.41) = 76
    r = calc.calculate(mtp=3)
    assert r.hot_rows == 10_240
    assert r.per_request_gpu_blocks == 4_520
    assert (r.baseline_total, r.hisparse_total, r.min_host_gib) == (4, 22, 76)
    # MTP 0 is the page's default of 2 * top_k
    assert calc.calculate(mtp=0).hot_rows == 4096
    with pytest.raises(calc.CalcError, match="not both"):
        calc.calculate(mtp=3, hot_rows=4096)


def test_kv_hbm_override() -> None:
    # 40 GiB: baseline floor(40 * 2**30 / 3,052,800) = 14,068 // 1,280 = 10
    # HiSparse floor(40 * 2**30 / 184,320) = 233,016 // 2,600 = 89
    # min host ceil(89 * 1,280 * 2,875,392 / 2**30) = ceil(305.07) = 306
    r = calc.calculate(kv_hbm_gib=40)
    assert r.kv_hbm_gib == 40
    assert r.kv_hbm_gib_raw == pytest.approx(17.8458, abs=1e-3)  # still reported
    assert (r.baseline_gpu_blocks, r.hisparse_gpu_blocks) == (14_068, 233_016)
    assert (r.baseline_total, r.hisparse_total, r.min_host_gib) == (10, 89, 306)


def test_host_pool_binds() -> None:
    # 50 GiB: floor(50 * 2**30 / 2,875,392) = 18,671 blocks // 1,280 = 14
    r = calc.calculate(host_gib=50)
    assert r.host_limit_per_replica == 14
    assert r.hisparse_total == 14
    assert r.min_host_gib == 134  # still what the GPU limit would need
    assert r.limiter == "host"


def test_max_seqs_binds() -> None:
    # min(10, 39) = 10 > 4: min host ceil(10 * 1,280 * 2,875,392 / 2**30) = ceil(34.28) = 35;
    # 35 GiB = 13,069 blocks // 1,280 = 10
    r = calc.calculate(max_seqs=10)
    assert (r.baseline_total, r.hisparse_total, r.min_host_gib) == (4, 10, 35)
    assert r.limiter == "max_seqs"


def test_the_cap_is_the_limiter_when_it_holds_all_kv_on_the_gpu_already() -> None:
    # max_seqs 3 caps both: min(3, 39) = 3 is not above baseline 3 -> min host 0, pool 16 GiB. The cap binds,
    # not the baseline (which would hold 4): "HiSparse does not beat keeping all KV on the GPU" would mislead.
    r = calc.calculate(max_seqs=3)
    assert (r.baseline_total, r.hisparse_total, r.min_host_gib) == (3, 3, 0)
    assert r.host_pool_gib == 16
    assert r.multiplier == 1.0
    assert r.limiter == "max_seqs"
    assert calc.calculate(max_seqs=4).limiter == "max_seqs"  # the baseline's own 4


def test_host_pool_cap_at_4096() -> None:
    r = calc.calculate(kv_hbm_gib=131.3, seq_len=1_048_576, max_seqs=1024)
    # per request 17,704 blocks; floor(131.3 * 2**30 / 184,320) = 764,877 // 17,704 = 43
    # min host ceil(43 * 16,384 * 2,875,392 / 2**30) = ceil(1,886.6) = 1,887 GiB: below the cap
    assert r.gpu_limit_per_replica == 43
    assert r.min_host_gib == math.ceil(43 * 16_384 * 2_875_392 / GIB) == 1887
    r = calc.calculate(kv_hbm_gib=1000, seq_len=1_048_576)
    # floor(1000 * 2**30 / 184,320) = 5,825,422 // 17,704 = 329; min host ceil(329 * 16,384 * 2,875,392 / 2**30)
    # = 14,435 GiB > 4,096 -> pool 4,096 GiB = 1,529,533 blocks // 16,384 = 93 requests
    assert r.gpu_limit_per_replica == 329
    assert r.min_host_gib == 14_435
    assert r.host_pool_gib == 4096
    assert r.host_limit_per_replica == 93
    assert r.hisparse_total == 93
    assert r.limiter == "host"
    assert any("cap" in n for n in r.notes)


def test_kv_clamp_and_rounding_on_b300() -> None:
    # B300: 288e9 / 2**30 * 0.92 = 246.76; - 87.97 - 15 = 143.80 -> clamped to 131.32 -> shown 131.3
    r = calc.calculate(gpu="B300")
    assert r.kv_hbm_gib_raw == pytest.approx(143.80, abs=0.01)
    assert r.kv_hbm_gib == 131.3
    # floor(131.3 * 2**30 / 3,052,800) = 46,181 // 1,280 = 36; floor(.. / 184,320) = 764,877 // 2,600 = 294
    assert (r.baseline_total, r.hisparse_total) == (36, 294)


def test_round_tenth_ties_go_up_like_javascript() -> None:
    assert calc._round_tenth(17.25) == 17.3
    assert calc._round_tenth(17.24) == 17.2
    assert calc._round_tenth(0.05) == 0.1


def test_groups_override_changes_count_not_block_size() -> None:
    # 21 groups: 1,280 + 21*64 + 21*2 = 2,666 blocks; 103,692 // 2,666 = 38
    r = calc.calculate(groups=21)
    assert r.hisparse_block_bytes == 184_320
    assert r.per_request_gpu_blocks == 2_666
    assert r.hisparse_total == 38


def test_presets_without_the_pages_groups_group_layers_as_vllms_planner() -> None:
    # vLLM 0.33's layout: DeepSeek-V3.2 under vLLM holds 6 hot groups x 64 blocks (4,096 rows) a request. 32,000 tokens:
    # 500 pages + 6 * 64 + 6 * 2 retained = 896 blocks of 545,792 B (about 0.49 GB), not one group per layer.
    r = calc.calculate(model="deepseek-v3.2", seq_len=32_000)
    assert (r.groups, r.per_request_gpu_blocks) == (6, 896)
    # bf16 rows (1,152 B) halve the layers a block holds of their pages: 8,052 // 1,152 = 6 a group, 11 groups.
    assert calc.calculate(model="deepseek-v3.2", kv_dtype="bf16").groups == 11
    assert calc.calculate().groups == 20  # the page's


def test_fewer_groups_than_a_block_holds_the_layers_of_are_refused() -> None:
    # GLM-5.3's fp8 block holds 5 layer pages: 78 layers need 16 groups at least.
    assert calc.calculate(groups=16).groups == 16
    with pytest.raises(calc.CalcError, match="groups must be at least 16 for glm-5.3"):
        calc.calculate(groups=15)
    with pytest.raises(calc.CalcError, match="at least 5 for deepseek-v3.2"):  # 13 layer pages a block
        calc.calculate(model="deepseek-v3.2", groups=4)
    # 5 groups of 13 layers fit those blocks, but vLLM's planner closes a group at 12 (8,052 // 656): said.
    five = calc.calculate(model="deepseek-v3.2", groups=5)
    assert any("vLLM's planner builds 6 hot groups" in note for note in five.notes)
    assert not any("planner" in note for note in calc.calculate(model="deepseek-v3.2").notes)


def test_the_host_pool_holds_what_vllm_wants_and_says_when_it_binds() -> None:
    # 406,208 tokens on 1.4 GiB of KV: one request a replica; the minimum pool held ceil(seq / 64) blocks and
    # vLLM wants 2 more, which rounding to whole GiB missed by one block.
    r = calc.calculate(seq_len=406_208, kv_hbm_gib=1.4)
    assert r.host_pool_gib * GIB // r.host_block_bytes >= r.seq_blocks + 2
    assert not any("vLLM wants a host pool" in note for note in r.notes)
    small = calc.calculate(host_gib=10)  # the GPU would hold 39, the pool 3: the pool binds, not "baseline"
    assert small.limiter == "host" and small.hisparse_per_replica == small.baseline_per_replica
    empty = calc.calculate(host_gib=0)
    assert any("vLLM wants a host pool of at least" in note for note in empty.notes)


def test_other_presets_use_the_same_formula() -> None:
    # GLM-5.1: 78 layers, 78 indexers (10,296 B/token), row 656:
    #   baseline 64 * (78*656 + 10,296) = 3,933,696; host 64 * 51,168 = 3,274,752;
    #   HiSparse max(ceil(78/78) = 1, ceil(10,296/656) = 16) = 16 pages -> 64 * 10,496 = 671,744
    r = calc.calculate(model="glm-5.1")
    assert (r.baseline_block_bytes, r.hisparse_block_bytes, r.host_block_bytes) == (3_933_696, 671_744, 3_274_752)
    assert r.groups == 6  # vLLM's planner: 10,296 // 656 = 15 layers a group
    # DeepSeek-V3.2: 61 layers and indexers (8,052 B/token): baseline 64 * 48,068 = 3,076,352;
    #   host 64 * 40,016 = 2,561,024; HiSparse ceil(8,052/656) = 13 pages -> 64 * 8,528 = 545,792
    r = calc.calculate(model="deepseek-v3.2")
    assert (r.baseline_block_bytes, r.hisparse_block_bytes, r.host_block_bytes) == (3_076_352, 545_792, 2_561_024)
    # experts: 59 MoE layers * 256 * 3 fp8 7168x2048 + scales = 619.65 GiB
    assert calc.expert_weight_gib(calc.MODELS["deepseek-v3.2"]) == pytest.approx(619.651, abs=1e-3)
    assert any("page covers GLM-5.3 only" in n for n in r.notes)


def test_mla_row_override_gives_vllm_bytes_per_token() -> None:
    # GLM-5.3 with vLLM's 656-byte fp8_ds_mla row: 78*656 + 21*132 = 53,940 bytes per token
    r = calc.calculate(mla_row_bytes=656)
    assert r.baseline_block_bytes == 64 * 53_940


def test_totals_are_replica_values_times_dp() -> None:
    for dp in (1, 2, 3, 8):
        r = calc.calculate(dp=dp, ep=False)
        assert r.baseline_total == 4 * dp
        assert r.hisparse_total == 39 * dp


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 0}, "tp must be positive"),
        ({"dp": -1}, "dp must be positive"),
        ({"seq_len": 0}, "seq must be positive"),
        ({"max_seqs": 0}, "max_seqs"),
        ({"hot_rows": 0}, "hot_rows"),
        ({"groups": 0}, "groups"),
        ({"retained_pages": -1}, "retained_pages"),
        ({"host_gib": -1.0}, "host_gib"),
        ({"host_gib": 4096.5}, "use --host-gib 4096 or less"),
        ({"kv_hbm_gib": float("nan")}, "kv_hbm_gib"),
        ({"gpu": "a100"}, "unknown gpu"),
        ({"model": "llama"}, "unknown model"),
        ({"kv_dtype": "int4"}, "unknown kv dtype"),
        ({"accounting": "magic"}, "unknown accounting"),
        ({"tp": 2.5}, "integer"),
    ],
)
def test_bad_inputs_raise_calc_error(kwargs: dict, match: str) -> None:
    with pytest.raises(calc.CalcError, match=match):
        calc.calculate(**kwargs)
    assert issubclass(calc.CalcError, ValueError)


def test_the_largest_host_pool_accepted_is_the_bound() -> None:
    """A host pool of 4,096 GiB, the top of the calculator's range, is accepted (just beyond: refused above)."""
    assert calc.calculate(host_gib=4096).host_pool_gib == 4096


@pytest.mark.parametrize(
    "argv",
    [["--tp", "0"], ["--dp", "-2"], ["--seq", "abc"], ["--gpu", "a100"], ["--model", "llama"],
     ["--kv-dtype", "int4"], ["--host-gib", "-5"], ["--mtp", "3", "--hot-rows", "4096"], ["--accounting", "x"]],
)
def test_cli_rejects_bad_input(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _run_cli(argv, capsys)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


# --------------------------------------------------------------------------- CLI and JSON


def test_cli_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run_cli(["--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    for key in ("baseline_total", "hisparse_total", "multiplier", "min_host_gib", "kv_hbm_gib", "limiter",
                "baseline_per_replica", "hisparse_per_replica", "gpu_limit_per_replica", "host_limit_per_replica",
                "model", "gpu", "tp", "dp", "ep", "kv_dtype", "seq_len", "hot_rows", "groups", "retained_pages",
                "max_seqs", "accounting", "weights_gib", "budget_gib"):
        assert key in d, key
    assert (d["baseline_total"], d["hisparse_total"], d["min_host_gib"], d["kv_hbm_gib"]) == (4, 39, 134, 17.8)
    assert d["limiter"] == "gpu"
    assert d["multiplier"] == 9.75


def test_cli_flags_reach_calculate(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run_cli(["--json", "--gpu", "H200", "--tp", "8", "--dp", "2", "--no-ep", "--kv-dtype", "bf16",
                           "--seq", "81,920", "--mtp", "3", "--groups", "20", "--retained-pages", "2",
                           "--host-gib", "500", "--max-seqs", "64", "--kv-hbm-gib", "17.8", "--model", "glm-5.3",
                           "--accounting", "exact"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert (d["dp"], d["ep"], d["kv_dtype"], d["hot_rows"], d["mtp"], d["host_gib_input"]) == (2, False, "bf16",
                                                                                                10_240, 3, 500.0)
    # bf16, 10,240 hot rows: per request 1,280 + 3,200 + 40 = 4,520; 64,807 // 4,520 = 14 per replica
    assert d["per_request_gpu_blocks"] == 4_520
    assert d["hisparse_total"] == 28
    assert d["baseline_total"] == 4


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run_cli([], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("hisparse calc: glm-5.3 on H200, TP8 x DP1 (EP), fp8 KV, 81,920-token")
    table = {line.split("  ")[1].strip(): line for line in lines[1:] if line.startswith("  ")}
    assert "4 total" in table["Baseline"]
    assert "39 total" in table["HiSparse"]
    assert "9.75x" in table["Multiplier"]
    assert "134 GiB per replica" in table["Minimum host pool"]
    # the value column is aligned
    value_starts = {re.match(r"  \S+(?: \S+)* +", line).end() for line in lines[1:] if not line.startswith("  note")}
    assert len(value_starts) == 1


def test_add_parser_sets_func() -> None:
    parser = argparse.ArgumentParser(prog="hisparse")
    calc.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calc"])
    assert args.func is calc.main
    assert (args.gpu, args.tp, args.dp, args.ep, args.kv_dtype, args.seq) == ("h200", 8, 1, True, "fp8", 81_920)
    assert (args.hot_rows, args.mtp, args.groups, args.max_seqs, args.accounting) == (None, None, None, 1024, "exact")


def test_to_dict_is_json_serialisable() -> None:
    d = calc.calculate(tp=1).to_dict()
    assert json.loads(json.dumps(d))["notes"] == d["notes"]
    assert isinstance(d["notes"], list)


# --------------------------------------------------------------------------- core accounting


def test_core_accounting_without_extension_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hisparse._core", None)  # makes the import fail
    with pytest.raises(calc.CalcError, match=r"hisparse\._core"):
        calc.calculate(accounting="core")


def _core_available() -> bool:
    try:
        core = importlib.import_module("hisparse._core")
    except ImportError:
        return False
    return hasattr(core, "steady_state_blocks")


@pytest.mark.skipif(not _core_available(), reason="hisparse._core (with steady_state_blocks) is not built")
def test_core_accounting_matches_exact_on_defaults() -> None:
    for kwargs in ({}, {"mtp": 3}, {"seq_len": 1_048_576}, {"seq_len": 1000, "groups": 21, "retained_pages": 0}):
        exact = calc.calculate(**kwargs)
        core = calc.calculate(accounting="core", **kwargs)
        assert core.per_request_gpu_blocks == exact.per_request_gpu_blocks, kwargs
        assert (core.baseline_total, core.hisparse_total, core.min_host_gib) == (
            exact.baseline_total, exact.hisparse_total, exact.min_host_gib)


# --------------------------------------------------------------------------- invariants

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

if given is not None:

    @settings(max_examples=300, deadline=None)
    @given(
        model=st.sampled_from(sorted(calc.MODELS)),
        gpu=st.sampled_from(sorted(calc.GPU_MEMORY_GB)),
        tp=st.sampled_from([1, 2, 4, 8, 16]),
        dp=st.integers(1, 8),
        ep=st.booleans(),
        kv_dtype=st.sampled_from(calc.KV_DTYPES),
        seq_len=st.integers(1, 2_000_000),
        mtp=st.none() | st.integers(0, 6),
        max_seqs=st.integers(1, 2048),
        host_gib=st.none() | st.floats(0, calc.HOST_POOL_MAX_GIB),  # above: refused
    )
    def test_invariants(model, gpu, tp, dp, ep, kv_dtype, seq_len, mtp, max_seqs, host_gib) -> None:
        r = calc.calculate(model=model, gpu=gpu, tp=tp, dp=dp, ep=ep, kv_dtype=kv_dtype, seq_len=seq_len,
                           mtp=mtp, max_seqs=max_seqs, host_gib=host_gib)
        assert 0 <= r.baseline_per_replica <= r.hisparse_per_replica <= max_seqs
        assert r.baseline_total == r.baseline_per_replica * dp
        assert r.hisparse_total == r.hisparse_per_replica * dp
        assert r.limiter in calc.LIMITERS
        assert 0 <= r.kv_hbm_gib <= calc.KV_HBM_CAP_GIB
        # the KV memory really holds what the counts claim
        kv_bytes = r.kv_hbm_gib * GIB
        assert r.baseline_per_replica * r.seq_blocks * r.baseline_block_bytes <= kv_bytes
        if r.hisparse_per_replica > r.baseline_per_replica:
            assert r.hisparse_per_replica * r.per_request_gpu_blocks * r.hisparse_block_bytes <= kv_bytes
            assert r.hisparse_per_replica * r.seq_blocks * r.host_block_bytes <= r.host_pool_gib * GIB
            assert r.limiter in ("max_seqs", "gpu", "host")
            if host_gib is None and r.min_host_gib <= calc.HOST_POOL_MAX_GIB:
                # the default pool is the minimum, which serves the GPU limit
                assert r.hisparse_per_replica == min(max_seqs, r.gpu_limit_per_replica)
        elif r.kv_hbm_gib > 0 and r.baseline_per_replica > 0:
            # the GPU would hold more through HiSparse, but for the host pool: then that is the limiter
            gpu_more = min(max_seqs, r.gpu_limit_per_replica) > r.baseline_per_replica
            capped = r.baseline_per_replica >= max_seqs
            assert r.limiter == ("max_seqs" if capped else "host" if gpu_more else "baseline")
        if r.multiplier is not None:
            assert r.multiplier >= 1.0
