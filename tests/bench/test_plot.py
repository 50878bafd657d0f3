"""The bench's picture: a log axis centred on 1, a mark per goal, values, the way that is better."""

from __future__ import annotations

import math

import pytest

from gpukit.bench.core import BenchResult

pytest.importorskip(
    "matplotlib", reason="matplotlib is not installed (pip install 'gpukit[bench]')"
)

from gpukit.bench.plot import BETTER, WORSE, figure, render

MACHINE = {"processor": "x86_64", "cpu_count": 2, "gpus": [], "torch": "2.13.0", "python": "3.11"}
RESULTS = [
    BenchResult("data_parallel", "step, 4 CPU replicas", 55.0, "ms", "plain module", 1.0),
    BenchResult("transfer", "to_device", 40.0, "us/call", "accelerate", 100.0, target_ratio=0.5),
    BenchResult(
        "ddp", "2 processes", 180.0, "samples/s", "1 process", 100.0, higher_is_better=True
    ),
    BenchResult("serve", "GET /metrics", 2.0, "ms", "on demand", 10.0, target_value=50.0),
]


def test_the_axis_is_logarithmic_and_centred_on_1_so_small_ratios_stay_visible() -> None:
    ax = figure(RESULTS, machine=MACHINE, quick=True).axes[0]
    low, high = ax.get_xlim()
    assert ax.get_xscale() == "log"
    assert low * high == pytest.approx(1.0)
    assert high > 55  # the largest ratio fits
    assert math.log10(high) / math.log10(100 / 40) < 10  # and 0.4x is no sliver


def test_each_row_says_which_way_is_better_from_its_own_result() -> None:
    ax = figure(RESULTS, machine=MACHINE, quick=False).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert [label.endswith("higher is better") for label in labels] == [False, False, True, False]


def test_bars_are_coloured_by_whether_gpukit_did_better_in_that_rows_direction() -> None:
    from matplotlib.colors import to_hex

    ax = figure(RESULTS, machine=MACHINE, quick=False).axes[0]
    colours = [to_hex(bar.get_facecolor()) for bar in ax.patches]
    assert colours == [WORSE, BETTER, BETTER, BETTER]


def test_every_bar_carries_its_value_and_every_goal_a_mark() -> None:
    ax = figure(RESULTS, machine=MACHINE, quick=False).axes[0]
    assert [t.get_text() for t in ax.texts] == ["55x", "0.4x", "1.8x", "0.2x"]
    [marks] = ax.collections
    assert sorted(map(tuple, marks.get_offsets().tolist())) == [(0.5, 1.0), (5.0, 3.0)]


def test_the_title_names_the_machine_and_the_quick_sizes() -> None:
    ax = figure(RESULTS, machine=MACHINE, quick=True).axes[0]
    title = ax.get_title()
    assert "--quick" in title
    assert "x86_64, 2 CPUs, no GPU; torch 2.13.0" in title


def test_nothing_of_the_axes_is_cut_off_the_picture() -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure(RESULTS, machine=MACHINE, quick=True)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ax, renderer, page = fig.axes[0], canvas.get_renderer(), fig.bbox
    for part in [ax.xaxis.label, ax.title, *ax.get_yticklabels(), *fig.legends]:
        box = part.get_window_extent(renderer)
        assert page.x0 <= box.x0, part
        assert page.y0 <= box.y0, part
        assert box.x1 <= page.x1, part
        assert box.y1 <= page.y1, part


def test_render_gives_the_bytes_of_the_format_asked_for() -> None:
    assert render(RESULTS, machine=MACHINE, quick=True).startswith(b"\x89PNG")
    assert render(RESULTS, machine=MACHINE, quick=True, fmt="pdf").startswith(b"%PDF")


def test_a_ratio_that_is_zero_or_missing_is_left_out_instead_of_breaking_the_log_axis() -> None:
    rows = [*RESULTS, BenchResult("x", "none", 0.0, "s", "y", 1.0), BenchResult("x", "n", 1, "s")]
    ax = figure(rows, machine=MACHINE, quick=True).axes[0]
    assert len(ax.get_yticklabels()) == len(RESULTS)
