"""The picture of ``gpukit bench --plot``: every ratio against its alternative, on one log axis.

A ratio of 35x and one of 0.4x differ by the same factor from 1 as 1/35 and 2.5 do, so the axis
is logarithmic and centred on 1 (the same as the alternative): a bar grows from 1 towards the
ratio, green where gpukit did better than the alternative and orange where it did worse, with
the ratio written at its end. Each row says which way is better (from the result's own
``higher_is_better``) and carries its goal as a black mark. The title names the machine and
whether ``--quick`` sizes were used. Rendered to bytes, so that the caller writes the file in
one step (:func:`gpukit.output.write_output`).

>>> picture = render(results, machine=machine_description(), quick=True)   # doctest: +SKIP
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from gpukit.bench.core import BenchResult

BETTER = "#2e7d32"
WORSE = "#e07b22"
_LABEL_WIDTH = 48  # characters a row label is wrapped at


def formats() -> dict[str, str]:
    """The file suffixes (without the dot) matplotlib can write, each with its description.

    Without ``pgf``, which needs a TeX installation to draw any text. Raises ``ImportError``
    when matplotlib is not installed.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    known = dict(FigureCanvasBase.get_supported_filetypes())
    known.pop("pgf", None)
    return known


def describe_machine(machine: dict[str, Any]) -> str:
    """``machine_description()`` in one line: processor, cores, GPUs, torch and Python."""
    gpus = machine.get("gpus") or []
    shown = ", ".join(str(g) for g in gpus) if gpus else "no GPU"
    return (
        f"{machine.get('processor') or '?'}, {machine.get('cpu_count') or '?'} CPUs, {shown}; "
        f"torch {machine.get('torch') or '?'}, Python {machine.get('python') or '?'}"
    )


def _plotted(results: Sequence[BenchResult]) -> list[BenchResult]:
    return [r for r in results if r.ratio is not None and math.isfinite(r.ratio) and r.ratio > 0]


def _label(r: BenchResult) -> str:
    head = textwrap.shorten(f"{r.suite}: {r.name}", _LABEL_WIDTH + 12, placeholder="...")
    against = textwrap.shorten(f"vs {r.baseline_name}", _LABEL_WIDTH, placeholder="...")
    way = "higher is better" if r.higher_is_better else "lower is better"
    return f"{head}\n{against} · {way}"


def _better(r: BenchResult, ratio: float) -> bool:
    return ratio > 1 if r.higher_is_better else ratio < 1


def _distance(ratio: float) -> float:
    return abs(math.log10(ratio))


def _ratio_text(value: float) -> str:
    return f"{value:.3g}x"


def figure(results: Sequence[BenchResult], *, machine: dict[str, Any], quick: bool) -> Figure:
    """The plot as a matplotlib figure (not attached to pyplot: nothing to close)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows = _plotted(results)
    fig = Figure(figsize=(11, 0.55 * len(rows) + 2.2), layout="constrained")
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ratios = [r.ratio or 1.0 for r in rows]
    ys = list(range(len(rows)))
    colours = [BETTER if _better(r, x) else WORSE for r, x in zip(rows, ratios, strict=True)]
    ax.barh(ys, [x - 1 for x in ratios], left=1.0, color=colours, height=0.6)
    targets = [(y, r.target_as_ratio) for y, r in zip(ys, rows, strict=True)]
    marked = [(y, t) for y, t in targets if t is not None and math.isfinite(t) and t > 0]
    if marked:
        ax.scatter(
            [t for _, t in marked],
            [y for y, _ in marked],
            marker="|",
            s=400,
            color="black",
            linewidths=2,
            zorder=3,
        )
    # Symmetric around 1 on the log scale, wide enough for every bar, mark and its value.
    reach = max([_distance(x) for x in ratios] + [_distance(t) for _, t in marked], default=0.0)
    half = max(reach * 1.35, math.log10(2.5))
    ax.set_xlim(10**-half, 10**half)
    goals = dict(marked)
    for y, x in zip(ys, ratios, strict=True):
        # Past the bar's end, and past its target mark when that lies further on the same side.
        goal = goals.get(y)
        end = x if goal is None or (goal >= 1) != (x >= 1) else max(x, goal, key=_distance)
        ax.annotate(
            _ratio_text(x),
            (end, y),
            xytext=(6 if x >= 1 else -6, 0),
            textcoords="offset points",
            ha="left" if x >= 1 else "right",
            va="center",
            fontsize=9,
        )
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(ys, [_label(r) for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -0.6)  # first result on top
    # 1, 2, 5 per decade while they fit; decades alone on a wide axis.
    subs = (1.0, 2.0, 5.0) if half <= math.log10(30) else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(axis="x", which="major", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_xlabel("ratio: gpukit / alternative (log scale; 1x = the same)")
    sizes = "--quick sizes" if quick else "full sizes"
    ax.set_title(f"gpukit bench, {sizes}\n{describe_machine(machine)}", fontsize=10)
    fig.legend(
        handles=[
            Patch(color=BETTER, label="better than the alternative"),
            Patch(color=WORSE, label="worse than the alternative"),
            Line2D([], [], color="black", marker="|", linestyle="", markersize=12, label="target"),
        ],
        loc="outside lower center",
        ncols=3,
        fontsize=8,
        frameon=False,
    )
    return fig


def render(
    results: Sequence[BenchResult], *, machine: dict[str, Any], quick: bool, fmt: str = "png"
) -> bytes:
    """The plot as the bytes of a file of format ``fmt`` (a suffix :func:`formats` lists)."""
    buffer = io.BytesIO()
    figure(results, machine=machine, quick=quick).savefig(
        buffer, format=fmt, dpi=120, bbox_inches="tight"
    )
    return buffer.getvalue()
