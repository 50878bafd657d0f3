"""``gpukit bench``: run the benchmark suites that apply here and print their ratios."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from gpukit.cli._args import OutputFile
from gpukit.cli._output import console
from gpukit.errors import InvalidArgumentError

if TYPE_CHECKING:
    from gpukit.bench.core import BenchResult

# suite -> module under gpukit.bench; run in this order.
SUITES: dict[str, str] = {
    "transfer": "gpukit.bench.transfer",
    "data_parallel": "gpukit.bench.data_parallel",
    "ddp": "gpukit.bench.ddp",
    "checkpoint": "gpukit.bench.checkpoint",
    "startup": "gpukit.bench.startup",
    "batch_size": "gpukit.bench.batch_size",
    "h2d": "gpukit.bench.h2d",
    "serve": "gpukit.bench.serve",
}


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit bench``."""
    parser.add_argument(
        "--only",
        action="append",
        metavar="SUITE",
        help=f"run only this suite (repeatable): {', '.join(SUITES)}",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds a suite")
    parser.add_argument(
        "--json", type=OutputFile(), metavar="FILE", help="also write the results as JSON to FILE"
    )
    parser.add_argument(
        "--plot", type=OutputFile(), metavar="FILE.png", help="draw the ratios (needs matplotlib)"
    )


def print_results(results: Sequence[BenchResult]) -> None:
    """Print results as a table (value, alternative, ratio, target), notes underneath."""
    from rich.table import Table

    table = Table(title="gpukit bench", title_justify="left")
    for column in ("suite", "measure", "gpukit", "against", "theirs", "ratio", "target"):
        justify = "right" if column in ("gpukit", "theirs", "ratio") else "left"
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    notes: list[str] = []
    for r in results:
        ratio = r.ratio
        mark = ""
        if r.note:
            if r.note not in notes:
                notes.append(r.note)
            mark = f" [{notes.index(r.note) + 1}]"
        table.add_row(
            r.suite,
            r.name + mark,
            f"{r.value:.4g} {r.unit}",
            r.baseline_name or "-",
            f"{r.baseline_value:.4g} {r.unit}" if r.baseline_value is not None else "-",
            f"{ratio:.2f}x" if ratio is not None else "-",
            r.target or "",
        )
    out = console()
    out.print(table)
    for i, note in enumerate(notes, 1):
        out.print(f"[{i}] {note}")


def _no_matplotlib() -> InvalidArgumentError:
    return InvalidArgumentError(
        "--plot needs matplotlib, which is not installed.",
        hint="pip install 'gpukit[bench]', or leave out --plot.",
    )


def _plot(results: Sequence[BenchResult], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise _no_matplotlib() from exc
    rows = [r for r in results if r.ratio is not None]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    labels = [f"{r.suite}: {r.name}\nvs {r.baseline_name}" for r in rows]
    ax.barh(labels, [r.ratio or 0.0 for r in rows], color="#4c72b0")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio (gpukit / alternative; below 1 is better for time and memory)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_new_or_own(path: str, text: str) -> None:
    # O_NOFOLLOW: a link planted at the path since the arguments were checked is not followed.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)


def run(args: argparse.Namespace) -> int:
    """Run the chosen suites with a progress bar, then print and optionally save the results."""
    from rich.progress import Progress

    from gpukit.bench.core import machine_description

    chosen = args.only or list(SUITES)
    unknown = [name for name in chosen if name not in SUITES]
    if unknown:
        raise InvalidArgumentError(
            f"unknown suite {', '.join(unknown)}.", hint=f"Choose from {', '.join(SUITES)}."
        )
    # Found now, not after the whole run: the results would be lost.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise _no_matplotlib()
    results: list[BenchResult] = []
    skipped: list[str] = []
    err = console(stderr=True)
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("benchmarks", total=len(chosen))
        for name in chosen:
            progress.update(task, description=f"bench {name}")
            try:
                module = importlib.import_module(SUITES[name])
            except ImportError:
                skipped.append(f"{name}: not available in this installation")
            else:
                applies = getattr(module, "applies", None)
                reason = applies() if applies is not None else None
                if reason:
                    skipped.append(f"{name}: {reason}")
                else:
                    try:
                        results.extend(module.run(quick=args.quick))
                    except ImportError as exc:  # an alternative to measure against is missing
                        missing = exc.name or str(exc)
                        skipped.append(
                            f"{name}: {missing} is not installed (pip install 'gpukit[bench]')"
                        )
            progress.advance(task)
    print_results(results)
    for line in skipped:
        err.print(f"skipped {line}")
    if args.json:
        payload: dict[str, Any] = {
            "schema": "gpukit.bench/1",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_description(),
            "quick": args.quick,
            "results": [r.to_json() for r in results],
            "skipped": skipped,
        }
        _write_new_or_own(args.json, json.dumps(payload, indent=2) + "\n")
    if args.plot:
        _plot(results, args.plot)
    return 0
