"""benches/vllm_step.py's ``--repeat``: runs of one trace through vLLM's scheduler do the same work step by
step, so each step's figures can be taken from the run that spent least on it, and runs that scheduled
differently are refused rather than compared."""

import copy
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))

import vllm_step as S  # noqa: E402


@pytest.fixture(scope="module")
def runs():
    return [S.run(8, 8, ("hisparse", "native"), context=4096, breakdown=True) for _ in range(2)]


def test_each_step_is_the_least_any_run_took(runs):
    for mode in ("hisparse", "native"):
        engines = [r[mode] for r in runs]
        assert engines[0].trace == engines[1].trace and engines[0].trace  # decode steps, each timed
        before = copy.deepcopy([(e.times, e.connector_times, e.metadata, e.parts) for e in engines])
        least = S.fastest(engines)
        for i in range(len(least.times)):
            assert least.times[i] == min(times[i] for times, *_ in before)
            assert least.connector_times[i] == min(connector[i] for _, connector, *_ in before)
            assert least.metadata[i] == (before[0][2][i][0], min(meta[i][1] for *_, meta, _ in before))
            for label, (seconds, calls) in least.parts[i].items():
                assert seconds == min(parts[i].get(label, (0.0, 0))[0] for *_, parts in before)
                assert calls == before[0][3][i][label][1]
        assert least.connector_times and any(least.parts)


def test_runs_that_scheduled_differently_are_refused(runs):
    first = runs[0]["native"]
    shifted = copy.copy(runs[1]["native"])  # the same steps, kept one timed step later
    shifted.trace = [(step + 1, *rest) for step, *rest in shifted.trace]
    other = copy.copy(runs[1]["hisparse"])  # other work: a step's metadata or calls differ
    other.trace = first.trace
    for run in (shifted, other):
        with pytest.raises(RuntimeError, match="scheduled differently"):
            S.fastest([first, run])


def test_the_breakdown_splits_the_connector_part_by_vllms_calls_into_it(runs):
    """``--breakdown``'s ``entry.*`` labels: the connector part of each step, split by which of vLLM's calls
    into the connector and coordinator it was spent in, adds up to the part."""
    for mode in ("hisparse", "native"):
        engine = runs[1][mode]
        for part, step in zip(engine.connector_times, engine.parts, strict=True):
            entries = {label: seconds for label, (seconds, _) in step.items() if label.startswith("entry.")}
            assert "entry.build_connector_meta" in entries and "entry.cache_blocks" in entries
            assert sum(entries.values()) == pytest.approx(part, rel=1e-9, abs=1e-12)


def test_the_connector_part_is_split_by_whether_a_step_planned_host_copies(runs):
    """``connector_by_step``: the timed steps that planned no host copy and those that planned some, each kind's
    mean connector part per running request over exactly its steps (on the runs' steps as recorded, and with
    copies planned in every other step, so that both kinds are there)."""
    for mode in ("hisparse", "native"):
        recorded = runs[0][mode]
        assert len(recorded.transfers) == len(recorded.connector_times) and recorded.transfers
        alternating = copy.copy(recorded)
        alternating.transfers = [i % 2 * (i + 1) for i in range(len(recorded.transfers))]
        for engine in (recorded, alternating):
            by = S.by_transfers(engine)
            assert sum(kind["steps"] for kind in by.values()) == len(engine.transfers)
            for kind, planned in (("quiet", lambda n: n == 0), ("sealing", lambda n: n > 0)):
                steps = [i for i, n in enumerate(engine.transfers) if planned(n)]
                if not steps:
                    assert kind not in by
                    continue
                mean = sum(engine.connector_times[i] / engine.running[i] for i in steps) / len(steps) * 1e6
                assert by[kind]["steps"] == len(steps)
                assert by[kind]["mean_us_per_running"] == pytest.approx(mean, abs=0.01)
            if "sealing" in by:
                copies = [n for n in engine.transfers if n]
                assert by["sealing"]["copies_per_step"] == pytest.approx(sum(copies) / len(copies), abs=0.01)
        assert set(S.by_transfers(alternating)) == {"quiet", "sealing"}
