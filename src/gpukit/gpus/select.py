"""Judging GPUs against criteria and choosing the best: pure, given the readings.

Without criteria a GPU qualifies only when it is idle: no process holds memory on it. A GPU at
0 % utilisation whose memory a process holds is *busy* (an open notebook, a paused run), the
case that pickers reading only utilisation get wrong. Give ``min_free`` to share GPUs by memory
(processes then do not count unless ``max_processes`` is also given). A GPU another gpukit
process holds (the ``claims`` given, as :func:`gpukit.sharing.claims.current_claims` reads them)
never qualifies, even before its job allocates memory.

Nothing here reads a lock file or imports torch: :func:`gpukit.sharing.pick.pick` reads the
claims and the policy, then asks this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from gpukit.errors import InvalidArgumentError, NoGpuAvailableError
from gpukit.gpus.criteria import Criteria, names_gpu
from gpukit.gpus.grants import granted_gpus, granted_inventory
from gpukit.gpus.inventory import GPU, Inventory
from gpukit.holders import Holder
from gpukit.sizes import format_size

__all__ = [
    "ORDERS",
    "Order",
    "Verdict",
    "assess",
    "best_first",
    "choose",
    "no_gpu_error",
    "within_grant",
]

Order = Literal["free", "index", "util"]
ORDERS: tuple[str, ...] = ("free", "index", "util")


def _processes(gpu: GPU) -> str:
    count = len(gpu.processes)
    who = "; ".join(f"{p.user or '?'}, {(p.command or '?')[:30]}" for p in gpu.processes[:3])
    more = "; ..." if count > 3 else ""
    return f"{count} process{'es' if count != 1 else ''} ({who}{more})"


@dataclass(frozen=True)
class Verdict:
    """Whether one GPU qualifies, and if not, why."""

    gpu: GPU
    reasons: tuple[str, ...]
    claimed_by: Holder | None = None

    @property
    def ok(self) -> bool:
        """True when the GPU qualifies."""
        return not self.reasons

    def explain(self) -> str:
        """``'GPU 3: 41.5 GiB free < 60 GiB; 1 process (bob, jupyter-kernel)'``."""
        text = "; ".join(self.reasons) if self.reasons else "qualifies"
        if self.gpu.processes and not any("process" in r for r in self.reasons):
            text += f"; {_processes(self.gpu)}"
        return f"GPU {self.gpu.index}: {text}"


def _reasons(gpu: GPU, criteria: Criteria, holder: Holder | None) -> list[str]:
    if not criteria.grants(gpu):
        return ["not granted to this process"]
    if criteria.excludes(gpu):
        return ["excluded"]
    if gpu.error is not None:
        return [f"unreadable by NVML ({gpu.error})"]
    if gpu.mig_mode:
        return ["in MIG mode (use one of its MIG instances by UUID in CUDA_VISIBLE_DEVICES)"]
    reasons = []
    if holder is not None:
        reasons.append(f"claimed by {holder.describe()}")
    if criteria.min_free is not None:
        free = gpu.memory_free
        if free is None:
            reasons.append("free memory unknown")
        elif free < criteria.min_free:
            reasons.append(f"{format_size(max(free, 0))} free < {format_size(criteria.min_free)}")
    if criteria.max_util is not None:
        util = gpu.utilization_gpu
        if util is not None and util > criteria.max_util:
            reasons.append(f"{util}% busy > {criteria.max_util}%")
    limit = criteria.process_limit
    if limit is not None and len(gpu.processes) > limit:
        reasons.append(_processes(gpu) + ("" if limit == 0 else f" > {limit}"))
    return reasons


def assess(
    inv: Inventory, criteria: Criteria, claims: Mapping[str, Holder] | None = None
) -> list[Verdict]:
    """A verdict for every GPU of ``inv``, in NVML order. Pure: reads nothing."""
    claims = claims or {}
    return [
        Verdict(g, tuple(_reasons(g, criteria, claims.get(g.uuid))), claims.get(g.uuid))
        for g in inv.gpus
    ]


def _sort_key(order: str, gpu: GPU) -> tuple[int, ...]:
    if order == "free":
        return (-(gpu.memory_free or 0), gpu.index)
    if order == "util":
        return (gpu.utilization_gpu or 0, len(gpu.processes), -(gpu.memory_free or 0), gpu.index)
    return (gpu.index,)


def best_first(gpus: Iterable[GPU], order: str = "free") -> list[GPU]:
    """``gpus`` sorted best first: most free memory (``"free"``), least busy, or by index."""
    return sorted(gpus, key=lambda g: _sort_key(order, g))


def choose(
    inv: Inventory,
    n: int,
    criteria: Criteria,
    *,
    order: str = "free",
    claims: Mapping[str, Holder] | None = None,
) -> list[GPU]:
    """The ``n`` best qualifying GPUs of ``inv``, or NoGpuAvailableError. Pure: reads nothing."""
    if order not in ORDERS:
        raise InvalidArgumentError(
            f"order={order!r} is not an order gpukit knows.", hint=f"Use one of {ORDERS}."
        )
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgumentError(f"Cannot pick {n!r} GPUs.", hint="Ask for 1 or more, as an int.")
    criteria.check_exclude(inv)
    verdicts = assess(inv, criteria, claims)
    good = best_first((v.gpu for v in verdicts if v.ok), order)
    if len(good) >= n:
        return good[:n]
    raise no_gpu_error(inv, n, criteria, verdicts)


def no_gpu_error(
    inv: Inventory, n: int, criteria: Criteria, verdicts: list[Verdict]
) -> NoGpuAvailableError:
    """The error for too few qualifying GPUs, explaining each GPU's rejection.

    Under a grant, only the granted GPUs are counted and explained, as the job sees them.
    """
    grant = criteria.grant
    if grant is not None:
        inv = replace(inv, gpus=tuple(g for g in inv.gpus if criteria.grants(g)))
        verdicts = [v for v in verdicts if criteria.grants(v.gpu)]
        criteria = replace(criteria, grant=None)
    wanted = f"{n} GPU{'s' if n != 1 else ''}" + (
        f" with {criteria.describe()}" if criteria.describe() else ""
    )
    if grant is not None:
        count = len(inv.gpus)
        wanted += (
            f", of the {count} GPU{'s' if count != 1 else ''} "
            f"({', '.join(str(g.index) for g in inv.gpus) or 'none'}) granted by {grant.variable}"
        )
    found = sum(v.ok for v in verdicts)
    rejected = "".join(f"\n  {v.explain()}" for v in verdicts if not v.ok)
    if not inv.gpus:
        return NoGpuAvailableError(
            f"Asked for {wanted}: the driver reports no GPU on this machine.",
            hint="Check `nvidia-smi`.",
        )
    if len(inv.gpus) < n:
        return NoGpuAvailableError(
            f"Asked for {wanted}: this machine has {len(inv.gpus)}.{rejected}",
            hint=f"Ask for at most {len(inv.gpus)}.",
        )
    possible = sum(criteria.could_ever_qualify(g) for g in inv.gpus)
    hint = "Wait for them with `gpukit run --wait`, or relax the criteria"
    if possible < n:
        hint = f"Waiting cannot help: only {possible} could ever qualify; relax the criteria"
    if criteria.process_limit == 0 and any(v.gpu.processes for v in verdicts):
        hint += " (--min-free SIZE or --max-processes N shares a GPU with its processes)"
    return NoGpuAvailableError(
        f"Asked for {wanted}: {found} of {len(inv.gpus)} qualif{'y' if found != 1 else 'ies'}."
        f"{rejected}",
        hint=hint + ".",
    )


def within_grant(
    inv: Inventory, n: int, criteria: Criteria, env: Mapping[str, str] | None = None
) -> tuple[Inventory, Criteria]:
    """``inv`` narrowed to the GPUs this process was granted, and ``criteria`` that say so.

    The grant is ``CUDA_VISIBLE_DEVICES``, or Slurm's ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS``
    (:func:`gpukit.gpus.grants.granted_gpus`); without one both come back unchanged. The
    criteria carry the grant as what it is, so messages speak of "the 2 GPUs granted by
    CUDA_VISIBLE_DEVICES" rather than of every other GPU as excluded. ``exclude`` entries are
    checked against the whole machine first (a typo is still refused); those naming a GPU
    outside the grant are dropped, as there is nothing left to exclude.

    Raises NoGpuAvailableError when fewer than ``n`` GPUs are granted and VisibleDevicesError
    when the grant cannot be mapped to the machine's GPUs exactly.

    >>> inv, criteria = within_grant(inventory(), 1, Criteria())     # doctest: +SKIP
    >>> criteria.describe()                                          # doctest: +SKIP
    'no process on it, granted GPUs 4,5'
    """
    criteria.check_exclude(inv)
    grant = granted_gpus(inv, env)
    if grant is None:
        return inv, criteria
    granted = granted_inventory(inv, n, env)
    kept = tuple(e for e in criteria.exclude if any(names_gpu(e, g) for g in granted.gpus))
    return granted, replace(criteria, exclude=kept, grant=grant)
