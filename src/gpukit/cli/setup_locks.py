"""``gpukit setup-locks``: give the machine a lock folder that only root controls.

Run once by an administrator (``sudo gpukit setup-locks``). Never imports torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpukit.cli._output import say_if_fake
from gpukit.errors import NoDriverError, NvmlError
from gpukit.sharing.lock_folder import ADMIN_LOCK_FOLDER
from gpukit.sharing.lock_setup import setup_lock_dir


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``gpukit setup-locks``."""
    parser.add_argument(
        "folder",
        nargs="?",
        type=Path,
        default=ADMIN_LOCK_FOLDER,
        help=f"the lock folder to set up (default {ADMIN_LOCK_FOLDER})",
    )
    parser.add_argument(
        "--no-config",
        action="store_true",
        help="do not write lock_dir into /etc/gpukit/config.toml (GPUKIT_CONFIG)",
    )


def _uuids() -> tuple[list[str], str | None]:
    """Every GPU and MIG UUID NVML reports, or why there are none."""
    from gpukit.gpus.inventory import inventory

    try:
        inv = inventory()
    except (NoDriverError, NvmlError) as exc:
        return [], exc.message
    return [u for g in inv.gpus for u in (g.uuid, *(m.uuid for m in g.mig_instances))], None


def run(args: argparse.Namespace) -> int:
    """Set up the folder, then say what every user of the machine gets."""
    say_if_fake("setup-locks")
    uuids, why_none = _uuids()
    report = setup_lock_dir(args.folder, uuids=uuids, write_config=not args.no_config)
    print(f"lock folder {report.folder}: owned by root, mode 1777 (queue/ likewise).")
    if report.lock_files:
        print(f"{len(report.lock_files)} lock file(s) owned by root, one per GPU and MIG instance.")
    else:
        print(f"no lock files made in advance ({why_none or 'NVML reports no GPU'}).")
    if report.config is None:
        print(f"config not written: every user must set GPUKIT_LOCK_DIR={report.folder}.")
    elif report.config_written:
        print(f"{report.config}: lock_dir set; every gpukit user of this machine now uses it.")
    else:
        print(f"{report.config}: already names this folder.")
    return 0
