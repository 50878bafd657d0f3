"""The GPUs a scheduler or the user granted this process, as NVML indices.

A job runs on the GPUs ``CUDA_VISIBLE_DEVICES`` names when it is set, else on those Slurm's
``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS`` list; choosing GPUs (``gk.pick``, ``gpukit run``)
chooses among those alone, and says so in its messages (``granted by CUDA_VISIBLE_DEVICES``).
How CUDA numbers what the variable names is :mod:`gpukit.gpus.visible`'s business; this module
turns the grant into the machine's GPUs.

Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpukit.errors import NoGpuAvailableError, VisibleDevicesError
from gpukit.gpus.visible import ORDER_VAR, VAR, gpus_differ, parse_visible_devices, resolve

if TYPE_CHECKING:
    from gpukit.gpus.inventory import Inventory

__all__ = ["SLURM_GPU_VARS", "Grant", "granted_gpus", "granted_inventory"]

SLURM_GPU_VARS = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
"""Slurm's lists of the GPUs (NVML indices) given to the step and to the job, in that order."""


@dataclass(frozen=True)
class Grant:
    """The GPUs this process may choose among, and the variable that granted them."""

    indices: tuple[int, ...]
    """NVML (nvidia-smi) indices of the granted GPUs, in the variable's order."""
    variable: str
    """``CUDA_VISIBLE_DEVICES``, ``SLURM_STEP_GPUS`` or ``SLURM_JOB_GPUS``."""
    value: str

    def describe(self) -> str:
        """``'CUDA_VISIBLE_DEVICES=4,5'``, for messages."""
        return f"{self.variable}={self.value}"


def _slurm_indices(name: str, raw: str, inv: Inventory) -> tuple[int, ...]:
    indices: list[int] = []
    for part in raw.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if match is None:
            raise VisibleDevicesError(
                f"{name}={raw} is not a list of GPU indices.",
                hint=f"Unset {name}, or pass --all-gpus to choose among all GPUs.",
            )
        lo = int(match.group(1))
        indices += range(lo, int(match.group(2) or lo) + 1)
    known = {g.index for g in inv.gpus}
    unknown = [i for i in indices if i not in known]
    if unknown:
        raise VisibleDevicesError(
            f"{name}={raw} names GPU {', '.join(map(str, unknown))}, which NVML does not show "
            f"on this machine (it shows {', '.join(map(str, sorted(known))) or 'none'}).",
            hint="Slurm numbers GPUs as this node's gres.conf does; when it differs from "
            "nvidia-smi, set CUDA_VISIBLE_DEVICES to the job's GPU UUIDs, or pass --all-gpus.",
        )
    return tuple(dict.fromkeys(indices))


def granted_gpus(inv: Inventory, env: Mapping[str, str] | None = None) -> Grant | None:
    """The GPUs this process was granted, as NVML indices; None when nothing restricts it.

    ``CUDA_VISIBLE_DEVICES`` (set by a scheduler or by the user) decides when it is set; else
    Slurm's ``SLURM_STEP_GPUS``, then ``SLURM_JOB_GPUS``. Its entries map to NVML GPUs
    exactly: UUIDs (and unique UUID prefixes) by UUID, MIG UUIDs to their GPU, indices by PCI
    order when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or when every GPU is the same model (CUDA's
    order is then PCI order). Indices on a machine of mixed GPUs in CUDA's default order are
    refused with a VisibleDevicesError: CUDA's fastest-first order cannot be known for sure.

    >>> granted_gpus(inv, {"CUDA_VISIBLE_DEVICES": "4"}).indices     # doctest: +SKIP
    (4,)
    """
    env = os.environ if env is None else env
    value = env.get(VAR)
    if value is None:
        for name in SLURM_GPU_VARS:
            raw = env.get(name)
            if raw and raw.strip().upper() not in ("N/A", "NONE"):
                return Grant(_slurm_indices(name, raw, inv), name, raw)
        return None
    entries = parse_visible_devices(value) or ()
    order = env.get(ORDER_VAR, "FASTEST_FIRST")
    if order != "PCI_BUS_ID" and gpus_differ(inv.gpus) and any(isinstance(e, int) for e in entries):
        raise VisibleDevicesError(
            f"{VAR}={value} counts GPUs in CUDA's fastest-first order, and this machine's GPUs "
            f"differ ({', '.join(sorted({g.name for g in inv.gpus}))}), so which GPU each "
            "number names cannot be known for sure.",
            hint=f"Set {ORDER_VAR}=PCI_BUS_ID (then the numbers are nvidia-smi's), or list the "
            "GPUs by UUID (`gpukit list`), or pass --all-gpus to choose among all of them.",
        )
    view = resolve(value, "PCI_BUS_ID", inv)
    return Grant(tuple(dict.fromkeys(d.nvml_index for d in view.devices or ())), VAR, value)


def granted_inventory(inv: Inventory, n: int, env: Mapping[str, str] | None = None) -> Inventory:
    """``inv`` with only the granted GPUs (all of them when nothing restricts this process).

    Raises NoGpuAvailableError when fewer than ``n`` GPUs are granted, saying which variable
    granted which GPUs, and VisibleDevicesError when the grant cannot be mapped exactly.
    """
    grant = granted_gpus(inv, env)
    if grant is None:
        return inv
    gpus = tuple(g for g in inv.gpus if g.index in grant.indices)
    if isinstance(n, int) and len(gpus) < n:  # a bad n is refused by the chooser, by name
        which = ", ".join(f"GPU {g.index}" for g in gpus) or "none of this machine's GPUs"
        raise NoGpuAvailableError(
            f"Asked for {n} GPU{'s' if n != 1 else ''}: {grant.describe()} grants this process "
            f"{len(gpus)} ({which}).",
            hint=f"Ask for at most {len(gpus)}, ask the scheduler for more, or pass --all-gpus "
            "(all_gpus=True) to choose among all of the machine's GPUs.",
        )
    return replace(inv, gpus=gpus)
