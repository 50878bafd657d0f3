"""``gpukit usage``: GPU time per user from the ledger of claims.

    gpukit usage                     # the last 7 days
    gpukit usage --since 24h
    gpukit usage --since 2026-11-01 --json   # schema gpukit.usage/1

Never imports torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import re
import sys
import time

from gpukit.cli._output import print_json
from gpukit.errors import InvalidArgumentError
from gpukit.output import json_safe
from gpukit.sharing.usage import Usage, usage

_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SPAN = re.compile(r"(\d+(?:\.\d+)?)([mhdw])")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit usage``."""
    parser.add_argument(
        "--since",
        default="7d",
        metavar="WHEN",
        help="a span back from now (30m, 24h, 7d, 2w), a date (2026-11-01, local midnight), "
        "a local time (2026-11-01T09:30), or 'all' (7d)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (schema gpukit.usage/1)")


def parse_since(text: str, now: float) -> float | None:
    """``'7d'`` -> now minus 7 days; ``'2026-11-01'`` -> that local midnight; ``'all'`` -> None."""
    value = text.strip()
    if value == "all":
        return None
    span = _SPAN.fullmatch(value)
    try:
        if span:
            stamp = now - float(span.group(1)) * _UNITS[span.group(2)]
        else:
            when = dt.datetime.fromisoformat(value)
            try:
                stamp = when.timestamp()  # a time without a zone is local time
            except (ValueError, OverflowError, OSError):  # year 1: before the clock's start
                stamp = -math.inf
    except ValueError:
        stamp = math.nan
    if math.isnan(stamp):
        raise InvalidArgumentError(
            f"--since {text!r} is neither a span nor a date.",
            hint="Use e.g. --since 7d, --since 24h, --since 2026-11-01 or --since all.",
        )
    if stamp < 0:
        raise InvalidArgumentError(
            f"--since {text!r} reaches back before 1970, before any claim.",
            hint="Use --since all for every claim in the ledger.",
        )
    if stamp > now:
        raise InvalidArgumentError(
            f"--since {text!r} is in the future.", hint="Use a date in the past, e.g. 7d."
        )
    return stamp


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


def _render(report: Usage) -> None:
    from rich.table import Table

    from gpukit.cli._output import console

    since = (
        "all time"
        if report.since is None
        else time.strftime("%Y-%m-%d %H:%M", time.localtime(report.since))
    )
    out = console()
    if not report.users:
        out.print(f"No claims in the ledger since {since}.")
        return
    table = Table(title=f"GPU use since {since}", title_justify="left", box=None, pad_edge=False)
    for column in ("user", "GPU-hours", "runs", "longest (h)", "held now", "end unknown"):
        table.add_column(column, justify="left" if column == "user" else "right")
    for u in report.users:
        table.add_row(
            u.user,
            _hours(u.gpu_seconds),
            str(u.runs),
            _hours(u.longest_run_s),
            str(u.held_now),
            str(u.unknown_end),
        )
    out.print(table)


def run(args: argparse.Namespace) -> int:
    """Add up the ledger per user and print it."""
    now = time.time()
    report = usage(parse_since(args.since, now), until=now)
    for note in report.notes:  # also in --json; here for whoever reads the table
        print(f"gpukit usage: note: {note}.", file=sys.stderr)
    if args.json:
        data = json_safe(report.to_json())  # finite numbers only, whatever the ledger held
        assert isinstance(data, dict)
        print_json(data)
    else:
        _render(report)
    return 0
