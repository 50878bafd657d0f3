"""The options that choose GPUs, shared by ``gpukit pick`` and ``gpukit run``."""

from __future__ import annotations

import argparse

from gpukit.cli._args import Number, Percent, Size
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.select import ORDERS


def add_criteria(parser: argparse.ArgumentParser) -> None:
    """The options shared by ``gpukit pick`` and ``gpukit run``: how many GPUs, and which."""
    group = parser.add_argument_group("which GPUs")
    group.add_argument(
        "-n", "--gpus", type=Number(1, 100_000), default=1, metavar="N", help="how many (1)"
    )
    group.add_argument(
        "--min-free",
        type=Size(),
        metavar="SIZE",
        help='at least this much free memory, e.g. "20GiB", "500MB"',
    )
    group.add_argument(
        "--max-util", type=Percent(), metavar="PCT", help="at most this utilisation (0-100)"
    )
    group.add_argument(
        "--max-processes",
        type=Number(0, 1_000_000),
        metavar="N",
        help="at most N processes already on it (default 0, or any with --min-free)",
    )
    group.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="IDS",
        help="never these GPUs: indices or UUIDs, comma separated; repeatable",
    )
    group.add_argument(
        "--order",
        choices=ORDERS,
        default="free",
        help="best first by: free memory (default), utilisation, or index",
    )


def excluded(args: argparse.Namespace) -> list[int | str]:
    """The ``--exclude`` entries: ASCII digits as indices, anything else as a UUID (prefix).

    Nothing is dropped: an entry that names no GPU is refused later, against the machine.
    """
    entries: list[int | str] = []
    for item in ",".join(args.exclude).split(","):
        item = item.strip()
        if item:
            # str.isdigit() is also true of "²" and other digits int() cannot read.
            entries.append(int(item) if item.isascii() and item.isdigit() else item)
    return entries


def criteria_from(args: argparse.Namespace) -> Criteria:
    """The Criteria the options ask for (``-n`` is checked by its parser and by the request)."""
    return Criteria.make(
        min_free=args.min_free,
        max_util=args.max_util,
        max_processes=args.max_processes,
        exclude=excluded(args),
    )
