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
