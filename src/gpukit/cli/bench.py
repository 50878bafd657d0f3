"""``gpukit bench``: run the benchmark suites that apply here and print their ratios."""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from gpukit.cli._args import OutputFile
from gpukit.cli._output import console
from gpukit.errors import GpukitError, InvalidArgumentError
from gpukit.output import dumps, write_output

if TYPE_CHECKING:
    from gpukit.bench.core import BenchResult

# suite -> module under gpukit.bench; run in this order.
SUITES: dict[str, str] = {
    "transfer": "gpukit.bench.transfer",
    "data_parallel": "gpukit.bench.data_parallel",
    "ddp": "gpukit.bench.ddp",
    "exact": "gpukit.bench.exact",
    "shard": "gpukit.bench.shard",
    "train": "gpukit.bench.train",
    "preempt": "gpukit.bench.preempt",
    "checkpoint": "gpukit.bench.checkpoint",
    "train_state": "gpukit.bench.train_state",
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
        "--plot",
        type=OutputFile(),
        metavar="FILE.png",
        help="draw the ratios to FILE, written under exactly that name; its suffix names the "
        "format (.png, .svg, .pdf...) and a name without one is refused (needs matplotlib)",
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


def plot_format(path: str) -> str:
    """The picture format ``--plot path`` asks for, by its suffix; checked before any work.

    A usage error when matplotlib is missing or cannot write that suffix: found after the
    whole run, the results would be lost. The file is written under exactly the name given, so
    a name without a suffix is refused rather than quietly given one.
    """
    try:
        from gpukit.bench.plot import formats

        known = formats()
    except ImportError as exc:
        raise _no_matplotlib() from exc
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    usual = [name for name in ("png", "svg", "pdf") if name in known]
    others = ", ".join(f".{name}" for name in sorted(set(known) - set(usual)))
    choices = f"{', '.join(f'.{name}' for name in usual)} (matplotlib also writes {others})"
    if not suffix:
        raise InvalidArgumentError(
            f"--plot {path} has no suffix, and the suffix names the picture's format.",
            hint=f"Name the file with one, e.g. --plot {path}.png; suffixes: {choices}.",
        )
    if suffix not in known:
        raise InvalidArgumentError(
            f"--plot {path}: matplotlib cannot write .{suffix} pictures.",
            hint=f"Name a file ending in {choices}.",
        )
    return suffix


def _write(option: str, path: str, data: bytes) -> None:
    try:
        write_output(path, data)
    except OSError as exc:
        raise InvalidArgumentError(
            f"Cannot write {option} {path}: {exc.strerror or exc}.",
            hint="Name a file in a folder you can write; the results are in the table above.",
        ) from exc


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
    fmt = plot_format(args.plot) if args.plot else None
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
    machine = machine_description() if args.json or args.plot else {}
    wrote = []
    # Rendered in memory and written in one step by descriptor only now: whatever was planted
    # at the name during the run (a link, a FIFO) is replaced, never followed or opened.
    if args.json:
        payload: dict[str, Any] = {
            "schema": "gpukit.bench/1",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine,
            "quick": args.quick,
            "results": [r.to_json() for r in results],
            "skipped": skipped,
        }
        _write("--json", args.json, (dumps(payload, indent=2, default=str) + "\n").encode())
        wrote.append(f"the results to {args.json}")
    if args.plot:
        from gpukit.bench.plot import render

        try:
            picture = render(results, machine=machine, quick=args.quick, fmt=fmt or "png")
        except Exception as exc:  # a format's own needs (fonts, codecs) show only when drawing
            raise GpukitError(
                f"Cannot draw --plot {args.plot}: {type(exc).__name__}: {exc}",
                hint="Name a .png file; the figures are in the table above"
                + (f" and in {args.json}." if args.json else "."),
            ) from exc
        _write("--plot", args.plot, picture)
        wrote.append(f"the plot to {args.plot}")
    if wrote:
        console().print(f"wrote {' and '.join(wrote)}", soft_wrap=True)
    return 0
