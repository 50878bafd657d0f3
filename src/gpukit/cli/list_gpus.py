"""``gpukit list``: one line per GPU with its memory, load and users, like a better nvidia-smi.

Never imports torch, and imports rich only for human output, so that it starts fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from gpukit.cli._args import Seconds, add_watch
from gpukit.cli._gpu_table import build_table
from gpukit.cli._lock_folder import LockFolderState, read_lock_folder
from gpukit.cli._output import na, print_json, say_if_fake
from gpukit.errors import ExitCode
from gpukit.gpus.grants import Grant, granted_gpus
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.gpus.visible import VisibleDevices, visible_devices
from gpukit.output import dumps

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

FORMATS = ("gpukit", "gpustat")
"""What ``--json`` prints: gpukit's inventory, or gpustat's document (gpus/gpustat_format.py)."""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit list``."""
    parser.add_argument(
        "--json", action="store_true", help="print JSON (with a schema field, or see --format)"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="with --json: gpukit's inventory (default), or the document `gpustat --json` "
        "prints, for scripts written for gpustat",
    )
    add_watch(parser)
    remote = parser.add_argument_group("other machines (over ssh, nothing to install there)")
    remote.add_argument(
        "--hosts",
        metavar="A,B,C",
        help="list the GPUs of these hosts instead: gpukit list --json there, else nvidia-smi",
    )
    remote.add_argument(
        "--timeout",
        type=Seconds(positive=True),
        default=None,
        metavar="SECONDS",
        help="give up on a host after SECONDS (default 10)",
    )
    remote.add_argument(
        "--ssh-command",
        metavar="CMD",
        help="how to reach a host (default: $GPUKIT_SSH, else ssh -o BatchMode=yes "
        "-o ConnectTimeout=TIMEOUT); the host and the command are appended",
    )


def _payload(inv: Inventory, view: VisibleDevices, locks: LockFolderState) -> dict[str, Any]:
    claims = None
    if locks.claims is not None:
        claims = {uuid: holder.to_json() for uuid, holder in locks.claims.items()}
    grant, _ = _grant(inv)
    granted = None if grant is None else {**asdict(grant), "indices": list(grant.indices)}
    return {
        **inv.to_json(),
        "visible": view.to_json(),
        "claims": claims,
        "granted": granted,
        "lock_dir": locks.to_json(),
    }


def _grant(inv: Inventory) -> tuple[Grant | None, str | None]:
    """The GPUs granted to this process or job, or why they cannot be told."""
    from gpukit.errors import GpukitError

    try:
        return granted_gpus(inv), None
    except GpukitError as exc:
        return None, exc.message


def _render(inv: Inventory, view: VisibleDevices, locks: LockFolderState) -> RenderableType:
    from rich.console import Group
    from rich.text import Text

    head = Text(
        f"driver {na(inv.driver_version)} · CUDA {na(inv.cuda_driver_version)} · "
        f"{len(inv.gpus)} GPU{'s' * (len(inv.gpus) != 1)} · "
        f"{time.strftime('%H:%M:%S', time.localtime(inv.taken_at))}",
        style="dim",
    )
    if view.restricted:
        head.append(f" · CUDA_VISIBLE_DEVICES={view.env}")
    grant, why = _grant(inv)
    if grant is not None:
        # Inside a Slurm job (or with CUDA_VISIBLE_DEVICES), say which GPUs are this job's:
        # pick and run choose only among them.
        mine = ",".join(map(str, grant.indices)) or "none"
        head.append(f" · this job's GPUs: {mine} ({grant.describe()})", style="bold")
    parts: list[RenderableType] = [head, build_table(inv, view, claims=locks.claims or None)]
    parts.extend(Text(f"note: {w}", style="yellow") for w in view.warnings)
    if why is not None:
        parts.append(Text(f"note: {why}", style="yellow"))
    parts.extend(Text(text, style=style) for text, style in locks.notes())
    return Group(*parts)


def _print(out: Console, renderable: RenderableType) -> None:
    if not out.is_terminal:
        # A log or a pipe has no edge: give every line its full width instead of cutting it.
        wide = out.options.update_width(10_000)
        out.width = max(out.width, out.measure(renderable, options=wide).maximum)
    out.print(renderable)


def _read() -> tuple[Inventory, VisibleDevices, LockFolderState]:
    inv = inventory()
    return inv, visible_devices(inv), read_lock_folder()


def _json(args: argparse.Namespace) -> dict[str, Any]:
    """The document ``--json`` prints: the inventory with views and claims, or gpustat's."""
    if args.format == "gpustat":
        from gpukit.gpus.gpustat_format import gpustat_json

        return gpustat_json(inventory())
    return _payload(*_read())


def _check_format(args: argparse.Namespace) -> None:
    """Refuse a ``--format`` without ``--json`` to shape, or gpustat's for several hosts."""
    from gpukit.errors import InvalidArgumentError

    if args.format is not None and not args.json:
        raise InvalidArgumentError(
            f"--format {args.format} chooses what --json prints, and --json was not given.",
            hint=f"Add --json: gpukit list --json --format {args.format}.",
        )
    if args.format == "gpustat" and args.hosts is not None:
        raise InvalidArgumentError(
            "--format gpustat describes one machine, as gpustat does; --hosts lists several.",
            hint="Run `gpukit list --json --format gpustat` on each host (over ssh), or leave "
            "--format out for gpukit's JSON of every host.",
        )


def _watch(args: argparse.Namespace) -> int:
    from rich.live import Live

    from gpukit.cli._output import console

    out = console()
    interval = max(float(args.watch), 0.05)
    try:
        if args.json or not out.is_terminal:
            # A log or a program: a full reading per interval, never cursor movement.
            while True:
                if args.json:
                    sys.stdout.write(dumps(_json(args), default=str) + "\n")
                    sys.stdout.flush()
                else:
                    _print(out, _render(*_read()))
                time.sleep(interval)
        # auto_refresh off: the screen changes only when a new reading arrives, so an idle
        # watch costs one NVML reading per interval and no redraws in between.
        with Live(_render(*_read()), console=out, auto_refresh=False, transient=False) as live:
            while True:
                time.sleep(interval)
                live.update(_render(*_read()), refresh=True)
    except KeyboardInterrupt:
        return 0


def _hosts(args: argparse.Namespace) -> int:
    """``--hosts``: every host's GPUs in one table (or gpukit.hosts/1 JSON)."""
    from gpukit.errors import ExitCode, InvalidArgumentError
    from gpukit.gpus.hosts import hosts_json, parse_hosts, read_hosts

    if args.watch is not None:
        raise InvalidArgumentError(
            "--watch does not combine with --hosts.",
            hint="Run gpukit list --watch on each host, or gpukit serve there.",
        )
    timeout = 10.0 if args.timeout is None else args.timeout
    readings = read_hosts(
        parse_hosts(args.hosts), timeout=timeout, ssh_command_text=args.ssh_command
    )
    if args.json:
        print_json(hosts_json(readings))
    else:
        from gpukit.cli._gpu_table import build_hosts_table
        from gpukit.cli._output import console

        _print(console(), build_hosts_table(readings))
    # Some machines answering is a useful answer; none at all is "no GPU could be read".
    return ExitCode.OK if any(r.inventory is not None for r in readings) else ExitCode.NO_DRIVER


def run(args: argparse.Namespace) -> int:
    """Print the GPUs once, or keep a live view with ``--watch``."""
    _check_format(args)
    if args.hosts is not None:
        return _hosts(args)
    if args.timeout is not None or args.ssh_command is not None:
        from gpukit.errors import InvalidArgumentError

        raise InvalidArgumentError(
            "--timeout and --ssh-command apply to other machines, and no --hosts was given.",
            hint="Add --hosts A,B,C, or leave them out to list this machine's GPUs.",
        )
    say_if_fake("list")
    if args.watch is not None:
        return _watch(args)
    if args.json and args.format == "gpustat":
        # gpustat's own layout (json.dump with indent=4), so that even a diff against it is empty.
        sys.stdout.write(dumps(_json(args), indent=4, separators=(",", ": ")) + "\n")
        return ExitCode.OK
    inv, view, locks = _read()
    if args.json:
        print_json(_payload(inv, view, locks))
    else:
        from gpukit.cli._output import console

        _print(console(), _render(inv, view, locks))
    # The GPUs are shown either way; a script learns that their claims could not be read.
    return ExitCode.LOCK_FOLDER if locks.error else ExitCode.OK
