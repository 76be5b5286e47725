"""The benchmarks' pictures: ``--plot FILE.png`` on every script draws its result rows with
matplotlib (Agg, no display) beside the table it prints.

matplotlib is imported inside the drawing functions only, so a script run without ``--plot``
never imports it (it is a test extra, not a kvserve dependency). A figure is one or more
panels side by side (``Bars``, ``GroupedBars``, ``Lines``) under one title; ``bar_chart``,
``grouped_bars`` and ``line_chart`` draw a figure of one panel. ``annotate`` puts a text above
each bar or point (``None`` or ``""``: nothing there): where a script prints a ratio, the
ratio goes there.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

Annotations = Sequence[str | None] | None


@dataclass
class Bars:
    """One bar per label."""

    labels: Sequence[str]
    values: Sequence[float]
    ylabel: str
    annotate: Annotations = None
    title: str | None = None
    xlabel: str | None = None
    log: bool = False
    refs: Sequence[tuple[float, str]] = ()  # horizontal reference lines: (y, label)


@dataclass
class GroupedBars:
    """For each group, one bar per series (series name -> one value per group)."""

    groups: Sequence[str]
    series: Mapping[str, Sequence[float]]
    ylabel: str
    annotate: Mapping[str, Annotations] = field(default_factory=dict)  # series -> per group
    title: str | None = None
    xlabel: str | None = None
    log: bool = False
    refs: Sequence[tuple[float, str]] = ()
    colors: Sequence[str] | None = None  # one per series (default: matplotlib's cycle)


@dataclass
class Lines:
    """One line per series over the shared x values (series name -> one y per x)."""

    x: Sequence[float]
    series: Mapping[str, Sequence[float]]
    xlabel: str
    ylabel: str
    annotate: Mapping[str, Annotations] = field(default_factory=dict)  # series -> per point
    title: str | None = None
    logx: bool = False
    logy: bool = False


Panel = Bars | GroupedBars | Lines

# dark / light pairs (matplotlib's tab20): a series and its tail percentile share a hue
PAIRED = ("#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78", "#2ca02c", "#98df8a", "#d62728", "#ff9896")


def add_plot_arg(parser: argparse.ArgumentParser) -> None:
    """The one spelling of the flag, for every benchmark script."""
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        type=Path,
        default=None,
        help="also draw the comparison into this PNG (matplotlib, no display needed)",
    )


def bar_chart(
    path: str | Path,
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    ylabel: str,
    annotate: Annotations = None,
    subtitle: str | None = None,
    **kw,
) -> Path:
    """A figure of one ``Bars`` panel (``subtitle``: the panel's title under the figure's);
    ``kw``: its other fields (xlabel, log, refs)."""
    return figure(path, title, [Bars(labels, values, ylabel, annotate, subtitle, **kw)])


def grouped_bars(
    path: str | Path,
    title: str,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
    annotate: Mapping[str, Annotations] | None = None,
    subtitle: str | None = None,
    **kw,
) -> Path:
    """A figure of one ``GroupedBars`` panel; ``kw``: xlabel, log, refs."""
    panel = GroupedBars(groups, series, ylabel, annotate or {}, subtitle, **kw)
    return figure(path, title, [panel])


def line_chart(
    path: str | Path,
    title: str,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    annotate: Mapping[str, Annotations] | None = None,
    subtitle: str | None = None,
    **kw,
) -> Path:
    """A figure of one ``Lines`` panel; ``kw``: logx, logy."""
    panel = Lines(x, series, xlabel, ylabel, annotate or {}, subtitle, **kw)
    return figure(path, title, [panel])


def figure(
    path: str | Path, title: str, panels: Sequence[Panel | None], ncols: int | None = None
) -> Path:
    """Draw ``panels`` (row by row, ``ncols`` per row: default all in one row, at most 3;
    ``None`` leaves its slot empty, to keep a grid's columns aligned) under ``title`` into the
    PNG at ``path``; returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # no display; idempotent once pyplot is imported with it
    import matplotlib.pyplot as plt

    if not any(p is not None for p in panels):
        raise ValueError("a figure needs at least one panel")
    path = Path(path)
    ncols = ncols or min(len(panels), 3)
    nrows = math.ceil(len(panels) / ncols)
    widths = [_width(p) if p is not None else 0.0 for p in panels]
    # each column as wide as its widest panel
    width = sum(max(widths[c::ncols]) for c in range(ncols))
    wrapped = _wrap(title, max(50, int(width * 10.5)))
    height = 4.2 * nrows + 0.22 * (wrapped.count("\n") + 1)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(width, height),
        squeeze=False,
        layout="constrained",
        gridspec_kw={"width_ratios": [max(0.1, max(widths[c::ncols])) for c in range(ncols)]},
    )
    try:
        for i, ax in enumerate(axes.flat):
            p = panels[i] if i < len(panels) else None
            if p is None:
                ax.set_visible(False)
                continue
            if isinstance(p, Bars):
                _bars(ax, p)
            elif isinstance(p, GroupedBars):
                _grouped(ax, p)
            else:
                _lines(ax, p)
            if p.title:
                ax.set_title(_wrap(p.title, int(widths[i] * 11)), fontsize=10)
        fig.suptitle(wrapped, fontsize=10)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    print(f"plot: wrote {path}", file=sys.stderr)
    return path


def _wrap(text: str, chars: int) -> str:
    return textwrap.fill(text, width=chars, break_on_hyphens=False, break_long_words=False)


def _width(p: Panel) -> float:
    if isinstance(p, Bars):
        return max(4.5, 0.8 * len(p.labels) + 1.5)
    if isinstance(p, GroupedBars):
        return max(5.0, len(p.groups) * (0.32 * len(p.series) + 0.35) + 1.8)
    return 5.0


def _finite(v: float) -> bool:
    return isinstance(v, int | float) and math.isfinite(v)


def _label_bars(ax, container, texts: Annotations, log: bool) -> None:
    if not texts:
        return
    labels = [
        (t or "") if _finite(b.get_height()) and (b.get_height() > 0 or not log) else ""
        for t, b in zip(texts, container, strict=True)
    ]
    ax.bar_label(container, labels=labels, padding=2, fontsize=7)


def _style(ax, ylabel: str, xlabel: str | None, log: bool, refs) -> None:
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    if log:
        ax.set_yscale("log")
    for y, label in refs:
        if _finite(y):
            ax.axhline(y, color="0.35", linestyle="--", linewidth=1, label=label)
    ax.margins(y=0.18)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _clean(values: Sequence[float], log: bool) -> list[float]:
    """NaN for values a bar cannot show (missing, or <= 0 on a log axis)."""
    return [float(v) if _finite(v) and (v > 0 or not log) else math.nan for v in values]


def _bars(ax, p: Bars) -> None:
    if p.annotate is not None and len(p.annotate) != len(p.labels):
        raise ValueError("annotate needs one entry per bar")
    xs = range(len(p.labels))
    container = ax.bar(xs, _clean(p.values, p.log), color=[f"C{i % 10}" for i in xs])
    _ticks(ax, p.labels, (_width(p) - 1.5) / max(1, len(p.labels)))
    _style(ax, p.ylabel, p.xlabel, p.log, p.refs)
    _label_bars(ax, container, p.annotate, p.log)
    if p.refs:
        _legend(ax, len(p.refs), p.log)


def _grouped(ax, p: GroupedBars) -> None:
    n = len(p.series)
    width = 0.8 / max(1, n)
    for i, (name, values) in enumerate(p.series.items()):
        if len(values) != len(p.groups):
            raise ValueError(f"series {name!r} needs one value per group")
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(p.groups))]
        color = p.colors[i % len(p.colors)] if p.colors else f"C{i % 10}"
        container = ax.bar(xs, _clean(values, p.log), width, label=name, color=color)
        _label_bars(ax, container, p.annotate.get(name), p.log)
    _ticks(ax, p.groups, (_width(p) - 1.8) / max(1, len(p.groups)))
    _style(ax, p.ylabel, p.xlabel, p.log, p.refs)
    _legend(ax, n + len(p.refs), p.log)


def _lines(ax, p: Lines) -> None:
    for name, ys in p.series.items():
        if len(ys) != len(p.x):
            raise ValueError(f"series {name!r} needs one value per x")
        ax.plot(list(p.x), _clean(ys, p.logy), marker="o", label=name)
        for x, y, text in zip(p.x, ys, p.annotate.get(name) or [None] * len(ys), strict=True):
            if text and _finite(y):
                ax.annotate(
                    text, (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7
                )
    ax.set_xlabel(p.xlabel)
    ax.set_ylabel(p.ylabel)
    if p.logx:
        from matplotlib.ticker import NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
    if p.logy:
        ax.set_yscale("log")
    ax.set_xticks(list(p.x), [f"{x:g}" for x in p.x])
    ax.margins(y=0.15)
    ax.grid(alpha=0.3)
    _legend(ax, len(p.series), p.logy)


def _rotation(labels: Sequence[str], slot: float) -> int:
    """30 degrees when the longest line of a tick label is wider than its slot (inches)."""
    longest = max((max(map(len, s.split("\n"))) for s in labels), default=0)
    return 30 if longest * 0.075 > slot else 0


def _ticks(ax, labels: Sequence[str], slot: float) -> None:
    rotation = _rotation(labels, slot)
    ax.set_xticks(
        list(range(len(labels))),
        list(labels),
        rotation=rotation,
        ha="right" if rotation else "center",
        rotation_mode="anchor",
    )


def _legend(ax, entries: int, log: bool) -> None:
    """A legend in headroom made above the tallest bar or point."""
    bottom, top = ax.get_ylim()
    if log:
        ax.set_ylim(bottom, top * (top / bottom) ** 0.2 if bottom > 0 else top * 3)
    else:
        ax.set_ylim(bottom, top + (top - bottom) * 0.3)
    ax.legend(fontsize=8, ncols=min(entries, 3), loc="upper left")
