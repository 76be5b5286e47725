"""benchmarks/plot.py and the scripts' ``--plot FILE.png``: every helper writes a real PNG,
the capacity benchmark (a pure-Python simulation, seconds) draws its rows end to end, and
every benchmark script takes the flag (``--help`` only: nothing is loaded or started)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib  # noqa: F401  a test extra (pyproject's [test]): CI has it, so no skip
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is a package at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks import plot  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SCRIPTS = [
    "decode",
    "offline",
    "latency",
    "shared_prefix",
    "capacity",
    "prefix_overhead",
    "paged_attention",
    "quant_matmul",
    "serve",
    "noisy_neighbour",
    "cluster",
    "cluster_failover",
    "kv_dtype_attention",
    "kv_dtype_offline",
    "invariant_cost",
]


def assert_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.stat().st_size > 1024, path.stat().st_size
    assert path.read_bytes()[:8] == PNG_MAGIC


def subprocess_env() -> dict[str, str]:
    """This checkout's kvserve and benchmarks first on the path."""
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def test_bar_chart(tmp_path):
    out = plot.bar_chart(
        tmp_path / "bars.png",
        "synthetic: tokens/s per engine, model=tiny threads=2",
        ["kvserve", "vllm", "hf-static"],
        [310.5, 250.0, 80.2],
        "output tokens/s",
        annotate=["310.5", "kvserve / vllm: 1.24x", None],
        subtitle="ratio: kvserve / peer",
        xlabel="engine",
        refs=[(200.0, "target")],
    )
    assert out == tmp_path / "bars.png"
    assert_png(out)


def test_grouped_bars_log_and_missing_values(tmp_path):
    out = plot.grouped_bars(
        tmp_path / "sub" / "grouped.png",  # parent folders are made
        "synthetic: kernel vs reference per shape",
        ["B 1\nctx 128", "B 8\nctx 512", "B 64\nctx 2048"],
        {"gather + SDPA": [12.0, 310.0, 77000.0], "kernel": [3.0, 0.0, math.nan]},
        "time per call (us)",
        annotate={"kernel": ["4.0x", "", "nan"]},
        log=True,  # a 0 and a NaN cannot be drawn on a log axis: left out, not an error
        colors=plot.PAIRED,
    )
    assert_png(out)


def test_line_chart(tmp_path):
    out = plot.line_chart(
        tmp_path / "lines.png",
        "synthetic: TTFT / TPOT by prompt length",
        [8, 128, 512, 1024],
        {"TTFT": [10.0, 50.0, 200.0, 450.0], "TPOT": [12.0, 13.0, 16.0, float("nan")]},
        "prompt length (tokens)",
        "ms",
        annotate={"TTFT": ["10", "50", "200", "450"]},
        logx=True,
        logy=True,
    )
    assert_png(out)


def test_figure_grid_with_empty_slots(tmp_path):
    panels = [
        plot.Bars(["a", "b"], [1.0, 2.0], "count", ["1", "2"], title="bars"),
        None,  # an empty slot keeps the grid's columns aligned
        plot.GroupedBars(["x", "y"], {"s1": [1, 2], "s2": [3, 4]}, "requests", title="grouped"),
        plot.Lines([1, 2, 3], {"l": [3.0, 1.0, 2.0]}, "M", "us", title="lines"),
    ]
    assert_png(plot.figure(tmp_path / "grid.png", "a grid " * 40, panels, ncols=2))


def test_figure_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="at least one panel"):
        plot.figure(tmp_path / "none.png", "t", [None])
    with pytest.raises(ValueError, match="one entry per bar"):
        plot.bar_chart(tmp_path / "b.png", "t", ["a", "b"], [1, 2], "y", annotate=["1"])
    with pytest.raises(ValueError, match="one value per group"):
        plot.grouped_bars(tmp_path / "g.png", "t", ["a", "b"], {"s": [1]}, "y")
    assert not list(tmp_path.iterdir())


def test_add_plot_arg():
    import argparse

    ap = argparse.ArgumentParser()
    plot.add_plot_arg(ap)
    assert ap.parse_args([]).plot is None
    assert ap.parse_args(["--plot", "out/x.png"]).plot == Path("out/x.png")


def test_scripts_do_not_import_matplotlib_without_plot():
    code = (
        "import sys; import benchmarks.plot, benchmarks.capacity, benchmarks.cluster; "
        "assert 'matplotlib' not in sys.modules, 'imported at module level'"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=subprocess_env(),
    )
    assert run.returncode == 0, run.stderr


def test_capacity_plot(tmp_path, monkeypatch, capsys):
    from benchmarks import capacity

    out = tmp_path / "capacity.png"
    capacity.main(["--num-requests", "32", "--kv-cache-dtype", "auto", "int8", "--plot", str(out)])
    printed = capsys.readouterr()
    tables = printed.out.split("one request growing")
    rows = [line for line in tables[0].splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 2 and rows[-1].startswith("| int8 |")  # header + one per dtype
    # the growth table: 3 models x 6 lengths; the windowed one flat past its window
    grow = [line.split(" | ") for line in tables[1].splitlines() if line.startswith("| M")]
    windowed = [int(r[3].replace(",", "")) for r in grow if "every layer windowed" in r[0]]
    assert windowed == [64, 128, 256, 256, 256, 256]
    assert f"plot: wrote {out}" in printed.err
    assert_png(out)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_takes_plot_flag(name):
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=subprocess_env(),
    )
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr
    assert "--plot FILE.png" in run.stdout
    assert took < 60, f"--help took {took:.0f} s: something is loaded before the arguments"
