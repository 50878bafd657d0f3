"""``gpukit pick``: print the indices of GPUs that meet the criteria, or fail loudly.

``CUDA_VISIBLE_DEVICES=$(gpukit pick -n 2) python train.py`` never runs on an empty value:
when too few GPUs qualify, nothing is printed on stdout, stderr says why GPU by GPU, and the
exit status is 4. Never imports torch.
"""

from __future__ import annotations

import argparse

from gpukit.cli._criteria import add_criteria, criteria_from
from gpukit.cli._output import print_error, print_json, say_if_fake
from gpukit.errors import GpukitError
from gpukit.gpus.select import choose, within_grant

SCHEMA = "gpukit.pick/1"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit pick``."""
    add_criteria(parser)
    parser.add_argument(
        "--all-gpus",
        action="store_true",
        help="choose among all of the machine's GPUs, not only those CUDA_VISIBLE_DEVICES "
        "(or Slurm's SLURM_JOB_GPUS) grants",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (with a schema field)")


def run(args: argparse.Namespace) -> int:
    """Print the chosen NVML indices, comma separated (or JSON); exit 4 when too few qualify."""
    from gpukit.gpus.inventory import inventory
    from gpukit.gpus.visible import visible_devices
    from gpukit.sharing.claims import current_claims

    criteria = criteria_from(args)
    say_if_fake("pick")
    machine = inventory()
    claims = current_claims()
    try:
        inv = machine
        if not args.all_gpus:
            inv, criteria = within_grant(machine, args.gpus, criteria)
        gpus = choose(inv, args.gpus, criteria, order=args.order, claims=claims)
    except GpukitError as exc:
        return print_error("pick", exc)
    if args.json:
        cuda = visible_devices(machine).cuda_indices()
        print_json(
            {
                "schema": SCHEMA,
                "indices": [g.index for g in gpus],
                "uuids": [g.uuid for g in gpus],
                "cuda_visible_devices": ",".join(str(g.index) for g in gpus),
                # What this process's CUDA calls each GPU now (under its CUDA_VISIBLE_DEVICES).
                "cuda_indices": [cuda[g.index][0] if g.index in cuda else None for g in gpus],
                "criteria": criteria.describe(),
                "source": inv.source,
            }
        )
    else:
        print(",".join(str(g.index) for g in gpus))
    return 0
