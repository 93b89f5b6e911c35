"""The command line refuses bad input in one line on stderr with exit status 2, never a traceback.

The battery runs ``hisparse.cli.main`` in-process; nothing in it may start a run (each tool's run function is
replaced by one that fails the test), and the memory available is fixed at 16 GiB so that the refusals do not
depend on the machine. A few cases go through a subprocess to show that no traceback reaches stderr.
"""

from __future__ import annotations

import argparse
import ast
import io
import itertools
import json
import os
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from hisparse import CapacityError, ConfigError, InvariantError
from hisparse.cli import COMMANDS, main
from hisparse.engine import demo
from hisparse.tools import console, simulate

BIG_INTS = ("4294967296", "9223372036854775808", "18446744073709551616")  # 2**32, 2**63, 2**64
BAD_NUMBERS = ("abc", "", "1.5", "1e3", "0x10", "nan", "inf", "-inf", "9" * 5000)
BAD_FLOATS = ("abc", "", "nan", "inf", "-inf", "NaN", "1e400", "-1", "0")


def ints(*extra: str) -> tuple[str, ...]:
    """What a count flag refuses: not an integer, not positive, beyond u32."""
    return (*BAD_NUMBERS, "-1", "0", *BIG_INTS, *extra)


# (subcommand, flag, bad values): each value is tried alone after the flag.
DEMO = [
    ("--requests", ints("2147483648")),  # 2**31 requests: the memory check
    ("--prompt-len", ints("2147483648", "1048576", "100000")),  # 2**20: the indexer's exact scores; 1e5: its work
    ("--new-tokens", ints("2147483648", "1048576")),
    ("--layers", ints("2147483648", "100000")),  # the memory check
    ("--index-share", ints("2147483648", "3")),  # more than --layers 2
    ("--fit", (*BAD_FLOATS, "1e308", "2147483648", "1e-300", "0.5", "1")),  # memory; one request does not fit
    ("--seed", ("abc", "1.5", "nan", "-1", "18446744073709551616", "1e308")),
    ("--device", ("bogus", "gpu", "cuda:x", "cuda:", "", "cuda", "cuda:1")),  # no CUDA device in the battery
    ("--modes", (",", "", " , ", "bogus", "hisparse,bogus", "HISPARSE,swap")),
]
SCENARIO = [
    ("--seed", ("abc", "", "1.5", "nan", "inf", "-1", "18446744073709551616", "1e308")),
    ("--rebuild-every", ("abc", "", "1.5", "nan", "-1", "10001", "18446744073709551616")),
]
CALC = [
    ("--tp", ints()), ("--dp", ints()), ("--seq", ints()), ("--hot-rows", ints()),
    ("--mtp", (*BAD_NUMBERS, "-1", *BIG_INTS, "2147483648")),  # (2**31 + 2) * top_k hot rows overflow u32
    ("--groups", ints("15")), ("--retained-pages", (*BAD_NUMBERS, "-1", *BIG_INTS)),
    ("--max-seqs", ints()), ("--mla-row-bytes", ints()),
    ("--host-gib", ("abc", "", "nan", "inf", "-inf", "-1", "1e308", "2e9", "18446744073709551616")),
    ("--kv-hbm-gib", ("abc", "", "nan", "inf", "-inf", "-1", "1e308", "2e9", "18446744073709551616")),
    ("--model", ("llama", "", "glm")), ("--gpu", ("a100", "")), ("--kv-dtype", ("int4", "")),
    ("--accounting", ("magic", "")),
    ("--host-gib", ("100000", "4096.5")),  # beyond the calculator's 4,096 GiB host pools
]
SIMULATE = [
    ("--concurrency", (*ints("2147483648"), ",", "1,,0", "1,-1", "8,4294967296")),  # 2**31: the memory check
    ("--duration", (*BAD_FLOATS, "1e308", "2147483648")),  # the memory check (series of every step)
    ("--steps", ints()),
    ("--seed", ("abc", "1.5", "nan", "-1", "18446744073709551616")),
    ("--hot-rows", ints("2147483648", "100", "40000")),  # hot rows lie in [top_k, 32,768]
    ("--kv-hbm-gib", (*BAD_FLOATS, "1e308", "2147483648", "1e8")),  # 1e8 GiB: 31e9 blocks, the memory check
    ("--mtp", (*BAD_NUMBERS, "-1", "8", *BIG_INTS)),
    ("--accept-length", (*BAD_FLOATS, "0.5", "4.5")),  # in [1, --mtp + 1 = 4]
    ("--mode", ("bogus", "", "HISPARSE")), ("--policy", ("lru", "")), ("--hot-buffers", ("grow", "", "ADAPTIVE")),
    ("--kv-hbm-gib", ("100000", "131.4")),  # more than one H200's memory (131.3 GiB)
    ("--turns", ints()), ("--first-turn-tokens", ints("200000")),  # 200,000 > the default --max-model-len
    ("--later-turn-tokens", (*BAD_NUMBERS, "-1", *BIG_INTS)), ("--output-tokens", ints()),
    ("--max-model-len", (*ints(), "2000000")),  # beyond GLM-5.3's 1,048,576 positions
    ("--model", ("llama", "")), ("--gpu", ("a100", "")), ("--arrival-spread", (*BAD_FLOATS[:3], "-1")),
]
BATTERY = {"demo": DEMO, "scenario": SCENARIO, "calc": CALC, "simulate": SIMULATE}

# Whole command lines that must be refused: flags together, missing values, unknown flags, plot paths.
LINES = [
    ["demo", "--requests"], ["demo", "--bogus"], ["demo", "extra"], ["demo", "--requests", "2", "--requests"],
    ["demo", "--layers", "1", "--index-share", "2"],
    ["calc", "--mtp", "3", "--hot-rows", "4096"], ["calc", "--seq"], ["calc", "--bogus", "1"],
    ["simulate", "--hot-rows", "4096", "--adaptive-hot-rows"], ["simulate", "--concurrency"],
    ["simulate", "--hot-buffers"], ["simulate", "--mtp", "0", "--accept-length", "2"],
    ["simulate", "--mode", "offload", "--hot-rows", "4096"], ["simulate", "--mode", "offload", "--adaptive-hot-rows"],
    ["simulate", "--mode", "offload", "--hot-buffers", "adaptive"],
    ["scenario", "--seed"], ["scenario", "--json", "x"],
    [], ["bogus"], ["--bogus"], ["-x", "calc"],
]
PLOT_COMMANDS = ("demo", "simulate")


def plot_paths(tmp: str) -> list[str]:
    """Plot targets refused before any run: a missing folder, a folder, unknown or no extension."""
    return [os.path.join(tmp, "missing", "x.png"), "/nonexistent/x.png", tmp, os.path.join(tmp, "x.gif"),
            os.path.join(tmp, "x"), os.path.join(tmp, "x.png", "y.png")]


def cases() -> list[tuple[str, list[str]]]:
    return [(cmd, [cmd, flag, value]) for cmd, flags in BATTERY.items() for flag, values in flags for value in values]


@pytest.fixture(autouse=True)
def no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in the battery may start a run; memory is 16 GiB; no CUDA device, whatever the machine has."""

    def refuse(*args, **kwargs):
        raise AssertionError("the battery started a run")

    monkeypatch.setattr(demo, "run_mode", refuse)
    monkeypatch.setattr(simulate, "run_points", refuse)
    monkeypatch.setattr("hisparse.scenario.default_scenario", refuse)
    monkeypatch.setattr(console, "available_memory", lambda: 16 << 30)
    monkeypatch.setattr(demo.torch.cuda, "is_available", lambda: False)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    status, out, err = run(argv, capsys)
    assert status == 2, (argv, status, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, (argv, err)
    assert "Traceback" not in err
    assert re.match(r"hisparse( [a-z]+)?: error: \S", lines[0]), lines[0]
    return lines[0]


@pytest.mark.parametrize(("command", "argv"), cases(), ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else v)
def test_bad_flag_values_are_one_line_and_exit_2(command: str, argv: list[str], capsys) -> None:
    assert_refused(argv, capsys)


@pytest.mark.parametrize("argv", LINES, ids=lambda v: " ".join(v) or "(nothing)")
def test_bad_command_lines_are_one_line_and_exit_2(argv: list[str], capsys) -> None:
    assert_refused(argv, capsys)


@pytest.mark.parametrize("command", PLOT_COMMANDS)
def test_plot_into_a_missing_folder_is_refused_before_the_run(command: str, tmp_path, capsys) -> None:
    for path in plot_paths(str(tmp_path)):
        line = assert_refused([command, "--plot", path], capsys)
        assert "--plot" in line


def test_battery_size() -> None:
    """The report quotes these counts; every subcommand is covered."""
    per_command = {cmd: sum(1 for c, _ in cases() if c == cmd) for cmd in COMMANDS}
    per_command = {cmd: n + sum(1 for argv in LINES if argv[:1] == [cmd]) for cmd, n in per_command.items()}
    assert all(n >= 8 for n in per_command.values()), per_command


def test_the_issue_cases(capsys) -> None:
    """hisparse issue 11's command lines, each refused with a message that says what to change."""
    expect = {
        ("demo", "--requests", "-1"): "--requests: must lie in [1,",
        ("demo", "--fit", "nan"): "--fit: must be a finite number",
        ("demo", "--device", "bogus"): "--device: expected cpu, cuda or cuda:N",
        ("demo", "--layers", "0"): "--layers: must lie in [1,",
        ("demo", "--requests", "0"): "--requests: must lie in [1,",
        ("demo", "--modes", ","): "an empty run",
        ("calc", "--host-gib", "1e308"): "--host-gib: must lie in [0, 1.07374e+09]",
        ("simulate", "--concurrency", "2147483648"): "lower --concurrency",
        ("simulate", "--kv-hbm-gib", "100000"): "use --kv-hbm-gib 131.3 or less",
        ("calc", "--host-gib", "100000"): "use --host-gib 4096 or less",
        ("simulate", "--first-turn-tokens", "1000000"): "raise --max-model-len (at most 1,048,576",
        ("demo", "--fit", "0.5"): "raise --fit to at least",
    }
    for argv, text in expect.items():
        assert text in assert_refused(list(argv), capsys), argv


@pytest.mark.parametrize("requests, prompt_len, new_tokens, shared", [(2, 256, 8, 128), (1, 1, 1, 0)])
def test_suggested_fit_is_enough_and_a_little_less_is_not(requests, prompt_len, new_tokens, shared) -> None:
    """The pool check asks the engine for the fewest blocks; the --fit it suggests passes, a hundredth less fails
    (the pool rounds fit x pages: a suggestion rounded up from blocks / pages was up to half a page too high)."""
    def config(fit: float) -> demo.DemoConfig:
        return demo.DemoConfig(requests=requests, prompt_len=prompt_len, new_tokens=new_tokens,
                               shared_tokens=shared, fit=fit)

    model = demo.TinyDSA(demo.check(config(0.5)))
    with pytest.raises(ConfigError, match="raise --fit to at least") as exc:
        demo.check_pools(model, config(0.5), demo.MODES)
    fit = float(str(exc.value).rsplit(" ", 1)[1])
    assert fit > 1  # resident and offload keep a request whole; hisparse needs a hot region and a watermark
    assert demo.check_pools(model, config(fit), demo.MODES) >= config(fit).unlimited_blocks
    with pytest.raises(ConfigError, match="raise --fit"):
        demo.check_pools(model, config(round(fit - 0.01, 2)), demo.MODES)


def test_a_hisparse_error_from_a_run_is_one_line(monkeypatch, capsys) -> None:
    """Errors a run raises because of its configuration end in one line and exit 2; a bug (InvariantError) in one
    line and exit 1."""
    argv = ["simulate", "--mode", "hisparse", "--policy", "fifo", "--concurrency", "1", "--duration", "1"]
    for error, status in ((CapacityError("simulation stalled: nothing fits"), 2), (InvariantError("page 3 lost"), 1)):
        def fail(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(simulate, "run_points", fail)
        got, out, err = run(argv, capsys)
        assert got == status and out == "" and len(err.splitlines()) == 1 and str(error) in err


def test_simulate_memory_estimate_bounds_what_a_run_allocates() -> None:
    """20,000 conversations waiting: the estimate bounds the Python allocations of a few steps, and those stay
    small (every waiting request used to hold its page hashes, ~44 KB each: 880 MB here, 17 GB at a million)."""
    cfg = simulate.SimConfig(concurrency=20_000, duration_s=30.0, max_steps=3)
    need, what = simulate.estimate_memory([cfg])
    assert "20,000" in what
    sim = simulate.Simulation(cfg)
    tracemalloc.start()
    try:
        sim.run()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= need and peak < 50e6, (peak, need)


def test_plausible_small_demo_runs(monkeypatch, capsys) -> None:
    """``--requests 2 --prompt-len 64 --new-tokens 4`` used to end in a traceback (a hot region larger than the
    pool); its hot region is now capped at a whole request, and the run matches unlimited memory."""
    monkeypatch.undo()
    status, out, err = run(["demo", "--requests", "2", "--prompt-len", "64", "--new-tokens", "4", "--json",
                            "--no-progress"], capsys)
    assert status == 0, err
    result = json.loads(out)
    assert result["all_identical"] and set(result["modes"]) == {"unlimited", "resident", "offload", "hisparse"}
    assert result["config"]["gpu_blocks"] == 21


def test_calc_takes_huge_legal_counts(capsys) -> None:
    """2**31 is a legal count for calc's flags: it computes (with notes), no error and no traceback. Groups are
    at most one a layer."""
    for flag in ("--tp", "--dp", "--seq", "--hot-rows", "--retained-pages", "--max-seqs", "--mla-row-bytes"):
        status, out, err = run(["calc", flag, "2147483648", "--json"], capsys)
        assert status == 0 and err == "", (flag, err)
        assert json.loads(out)["hisparse_total"] >= 0
    assert run(["calc", "--groups", "78", "--json"], capsys)[0] == 0
    status, _, err = run(["calc", "--groups", "79"], capsys)
    assert status == 2 and "groups must be at most 78 for glm-5.3, one a layer" in err


def _subprocess(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hisparse", *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [  # demo imports torch (3 s here): one is enough
    ["demo", "--requests", "-1"], ["calc", "--host-gib", "1e308"],
    ["simulate", "--concurrency", "4294967296"], ["simulate", "--duration", "1e308"],
    ["simulate", "--plot", "/nonexistent/x.png"],
], ids=" ".join)
def test_no_traceback_reaches_stderr(argv: list[str]) -> None:
    done = _subprocess(*argv)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_calc_loads_neither_torch_nor_the_core() -> None:
    code = ("import sys; from hisparse.cli import main; assert main(['calc', '--json']) == 0; "
            "bad = [m for m in ('torch', 'hisparse._core', 'hisparse.datapath') if m in sys.modules]; "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["hisparse_total"] == 39


def test_nothing_imports_the_cli_back() -> None:
    """No import circle: the CLI imports the tools (lazily); no module of the package imports the CLI."""
    package = Path(main.__code__.co_filename).parent
    for path in package.rglob("*.py"):
        if path.name in ("cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" if node.module else a.name for a in node.names]
                names.append(node.module or "")
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n.split(".")[-1] == "cli" or ".cli." in f".{n}." for n in names), (path, names)


def test_runs_beyond_their_bounds_are_refused_with_what_fits(capsys) -> None:
    """A demo whose exact indexer would score 8e10 pairs (an hour here) and a simulation whose GPU pool cannot hold
    one step are refused in one line that names the value that fits."""
    expect = {
        ("demo", "--prompt-len", "100000", "--requests", "2"): "use --prompt-len 35,226 or less",
        ("simulate", "--mode", "offload", "--kv-hbm-gib", "0.5", "--concurrency", "1", "--steps", "50"):
            "use --kv-hbm-gib 4.33 or more",
    }
    for argv, text in expect.items():
        assert text in assert_refused(list(argv), capsys), argv


def test_the_demo_prompt_it_suggests_fits_and_one_more_does_not() -> None:
    def config(prompt_len: int) -> demo.DemoConfig:
        return demo.DemoConfig(requests=2, prompt_len=prompt_len)

    demo.check(config(35_226))
    with pytest.raises(ConfigError, match="use --prompt-len 35,226 or less"):
        demo.check(config(35_227))
    assert demo.indexer_scores(demo.DemoConfig(), 4) < demo.MAX_INDEXER_SCORES / 5  # the default run is far inside


def test_a_simulation_that_cannot_progress_ends_at_once_with_the_cause() -> None:
    """The issue's command looped forever without output (no step ever fit, so neither the clock nor --steps
    moved); it now ends within the timeout, in one line naming the resource and the size that works."""
    done = subprocess.run([sys.executable, "-m", "hisparse", "simulate", "--mode", "offload", "--kv-hbm-gib", "0.5",
                           "--concurrency", "1", "--steps", "50"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert "keeps a request whole on the GPU" in done.stderr and "use --kv-hbm-gib 4.33 or more" in done.stderr


SLOW_RUNS = {  # each takes a second or two, and prints one JSON object on stdout
    "simulate": ["simulate", "--mode", "hisparse", "--policy", "fifo", "--concurrency", "1", "--duration", "60",
                 "--json"],
    "demo": ["demo", "--requests", "2", "--prompt-len", "64", "--new-tokens", "4", "--json"],
    "scenario": ["scenario", "--json"],
}
LABELS = {"simulate": {"simulate"}, "demo": {"unlimited", *demo.MODES}, "scenario": {"scenario"}}


@pytest.mark.parametrize("command", SLOW_RUNS)
def test_a_slow_run_shows_progress_on_stderr_and_a_quick_one_does_not(command: str, monkeypatch, capsys) -> None:
    """Off a terminal, a run that lasts (here its clock moves a second at each look) prints progress lines on
    stderr from its start, every label of it, and leaves stdout to the result; a run that does not last prints
    nothing there."""
    monkeypatch.undo()
    monkeypatch.setattr(console.Progress, "clock", staticmethod(itertools.count().__next__))
    status, out, err = run(SLOW_RUNS[command], capsys)
    assert status == 0, err
    json.loads(out)
    lines = err.splitlines()
    assert len(lines) >= 2, err
    assert all(re.fullmatch(r"[a-z]+ +\[[#.]{30}\] .*\d s", line) for line in lines), err
    assert {line.split()[0] for line in lines} == LABELS[command]
    assert lines[-1].count("#") == 30  # the end is shown too
    monkeypatch.setattr(console.Progress, "clock", staticmethod(lambda: 0.0))
    status, out, err = run(SLOW_RUNS[command], capsys)
    assert status == 0 and err == "", err
    json.loads(out)


def test_progress_off_a_terminal_is_a_line_every_few_seconds_and_at_each_quarter(monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr(console.Progress, "clock", staticmethod(lambda: now[0]))
    stream = io.StringIO()
    bar = console.Progress(stream=stream)
    bar.start("run")
    for t, fraction in ((1.0, 0.1), (1.9, 0.3), (2.0, 0.3), (3.0, 0.3), (6.9, 0.3), (7.0, 0.3), (7.1, 0.5),
                        (7.2, 0.6), (7.3, 1.0), (7.4, 1.0)):
        now[0] = t
        bar.update(fraction, f"at {t}")
    bar.close()
    # Quiet for 2 s (a quick run prints nothing); then a line at once, 5 s later, and at each new quarter.
    assert [line.split("] ")[1].split()[1] for line in stream.getvalue().splitlines()] == ["2.0", "7.0", "7.1", "7.3"]


def test_a_plot_that_cannot_be_written_keeps_the_printed_results(monkeypatch, tmp_path, capsys) -> None:
    """The plot's folder checked before the run can be gone by its end: the results are printed first, then one
    line says why the plot is missing (it used to be a traceback and no results)."""
    monkeypatch.undo()
    target = tmp_path / "gone" / "x.png"
    target.parent.mkdir()

    def folder_removed(result, path):
        target.parent.rmdir()
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(demo, "plot", folder_removed)
    status, out, err = run(["demo", "--requests", "2", "--prompt-len", "64", "--new-tokens", "4", "--json",
                            "--no-progress", "--plot", str(target)], capsys)
    assert status == 2 and json.loads(out)["all_identical"]
    assert err.count("\n") == 1 and f"--plot {target}: the plot could not be written" in err


def test_a_plot_is_written_when_stdouts_reader_has_left() -> None:
    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    drawn = []
    stdout, sys.stdout = sys.stdout, Gone()
    try:
        with pytest.raises(BrokenPipeError):
            console.print_then_plot("results", "x.png", drawn.append, say_where=True)
    finally:
        sys.stdout = stdout
    assert drawn == ["x.png"]


def test_a_plot_link_is_checked_where_it_points_and_named_as_given(tmp_path) -> None:
    """A link's folder is its target's (a dangling one is refused before the run); its extension is the link's
    own, which is the format matplotlib writes through it."""
    from hisparse.tools import argtypes

    dangling = tmp_path / "dangling.png"
    dangling.symlink_to(tmp_path / "missing" / "x.png")
    with pytest.raises(argparse.ArgumentTypeError, match="no such folder"):
        argtypes.plot_path(str(dangling))
    link = tmp_path / "link.png"
    link.symlink_to(tmp_path / "target.out")
    assert argtypes.plot_path(str(link)) == str(link)


def test_an_interrupt_while_the_tool_loads_is_one_line(monkeypatch, capsys) -> None:
    def interrupted(command):
        raise KeyboardInterrupt

    monkeypatch.setattr("hisparse.cli.build_parser", interrupted)
    status, out, err = run(["demo"], capsys)
    assert (status, out) == (130, "") and err == "hisparse demo: error: interrupted\n"
