"""``gpukit pick``: print the indices of GPUs that meet the criteria, or fail loudly.

``CUDA_VISIBLE_DEVICES=$(gpukit pick -n 2) python train.py`` never runs on an empty value:
when too few GPUs qualify, nothing is printed on stdout, stderr says why GPU by GPU, and the
exit status is 4. Never imports torch.
"""

from __future__ import annotations

import argparse
import sys

from gpukit.cli._output import print_json, say_if_fake
from gpukit.errors import GpukitError, InvalidArgumentError
from gpukit.select import ORDERS, Criteria, choose

SCHEMA = "gpukit.pick/1"


def add_criteria(parser: argparse.ArgumentParser) -> None:
    """The options shared by ``gpukit pick`` and ``gpukit run``: how many GPUs, and which."""
    group = parser.add_argument_group("which GPUs")
    group.add_argument("-n", "--gpus", type=int, default=1, metavar="N", help="how many (1)")
    group.add_argument(
        "--min-free", metavar="SIZE", help='at least this much free memory, e.g. "20GiB", "500MB"'
    )
    group.add_argument("--max-util", type=float, metavar="PCT", help="at most this utilisation")
    group.add_argument(
        "--max-processes",
        type=int,
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


def criteria_from(args: argparse.Namespace) -> Criteria:
    """The Criteria the options ask for."""
    if args.gpus < 1:
        raise InvalidArgumentError(f"-n {args.gpus} asks for no GPU.", hint="Use -n 1 or more.")
    exclude: list[int | str] = []
    for item in ",".join(args.exclude).split(","):
        item = item.strip()
        if item:
            exclude.append(int(item) if item.isdigit() else item)
    return Criteria.make(
        min_free=args.min_free,
        max_util=args.max_util,
        max_processes=args.max_processes,
        exclude=exclude,
    )


def print_error(command: str, exc: GpukitError) -> int:
    """Print ``exc`` on stderr as its message, one line per GPU, then the next step."""
    print(f"gpukit {command}: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(exc.hint, file=sys.stderr)
    return int(exc.exit_code)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit pick``."""
    add_criteria(parser)
    parser.add_argument("--json", action="store_true", help="print JSON (with a schema field)")


def run(args: argparse.Namespace) -> int:
    """Print the chosen NVML indices, comma separated (or JSON); exit 4 when too few qualify."""
    from gpukit.claims import current_claims
    from gpukit.inventory import inventory

    criteria = criteria_from(args)
    say_if_fake("pick")
    inv = inventory()
    claims = current_claims()
    try:
        gpus = choose(inv, args.gpus, criteria, order=args.order, claims=claims)
    except GpukitError as exc:
        return print_error("pick", exc)
    if args.json:
        print_json(
            {
                "schema": SCHEMA,
                "indices": [g.index for g in gpus],
                "uuids": [g.uuid for g in gpus],
                "cuda_visible_devices": ",".join(str(g.index) for g in gpus),
                "criteria": criteria.describe(),
                "source": inv.source,
            }
        )
    else:
        print(",".join(str(g.index) for g in gpus))
    return 0
