"""Choosing GPUs by criteria: free memory, utilisation, processes, claims by other gpukit users.

>>> import gpukit as gk
>>> [g.index for g in gk.pick(2)]                          # doctest: +SKIP
[2, 4]
>>> gk.pick(1, min_free="60GiB", max_util=10)              # doctest: +SKIP
Traceback (most recent call last):
NoGpuAvailableError: Asked for 1 GPU(s) with at least 60 GiB free, at most 10% busy: ...
  GPU 3: 41.5 GiB free < 60 GiB; 1 process (bob, jupyter-kernel)

Without criteria a GPU qualifies only when it is idle: no process holds memory on it. A GPU at
0 % utilisation whose memory a process holds is *busy* (an open notebook, a paused run), the
case that pickers reading only utilisation get wrong. Give ``min_free`` to share GPUs by memory
(processes then do not count unless ``max_processes`` is also given). GPUs claimed by another
gpukit process (:func:`gpukit.gpus.claims.claim`) are taken, even before their job allocates memory.

Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from gpukit.errors import InvalidArgumentError, NoGpuAvailableError, UserLimitError
from gpukit.gpus.claims import Claim, Holder, claim, current_claims
from gpukit.gpus.inventory import GPU, Inventory
from gpukit.gpus.policy import Policy, holdings, load_policy
from gpukit.gpus.visible import Grant, granted_gpus
from gpukit.sizes import MOST_SIZE, format_size, parse_size
from gpukit.untrusted import InvalidInput, as_dict, as_int, as_list, as_str

__all__ = [
    "CRITERIA_SCHEMA",
    "Claim",
    "Criteria",
    "Verdict",
    "assess",
    "best_first",
    "check_user_limit",
    "choose",
    "claim",
    "current_claims",
    "pick",
    "within_grant",
]

Order = Literal["free", "index", "util"]
ORDERS: tuple[str, ...] = ("free", "index", "util")

CRITERIA_SCHEMA = "gpukit.criteria/1"
"""The ``schema`` field of :meth:`Criteria.to_json`."""
_CRITERIA_FIELDS = frozenset(
    {"schema", "min_free", "max_util", "max_processes", "exclude", "grant"}
)
_GRANT_FIELDS = frozenset({"indices", "variable", "value"})
_MOST_EXCLUDED = 1024  # entries of ``exclude`` read back: more than any machine has GPUs
_MOST_NUMBER = 2**32 - 1  # process counts and GPU indices


def _processes(gpu: GPU) -> str:
    count = len(gpu.processes)
    who = "; ".join(f"{p.user or '?'}, {(p.command or '?')[:30]}" for p in gpu.processes[:3])
    more = "; ..." if count > 3 else ""
    return f"{count} process{'es' if count != 1 else ''} ({who}{more})"


@dataclass(frozen=True)
class Criteria:
    """What a GPU must satisfy to be picked (see :func:`pick` for the meaning of each)."""

    min_free: int | None = None
    max_util: int | None = None
    max_processes: int | None = None
    exclude: tuple[int | str, ...] = ()
    grant: Grant | None = None
    """The GPUs a scheduler or the user granted this process (see :func:`within_grant`);
    None when every GPU of the machine may be chosen."""

    @classmethod
    def make(
        cls,
        *,
        min_free: int | float | str | None = None,
        max_util: float | None = None,
        max_processes: int | None = None,
        exclude: Iterable[int | str] = (),
    ) -> Criteria:
        """Criteria from user values, checked: sizes parsed, bounds in range."""
        if max_util is not None and (
            isinstance(max_util, bool)
            or not isinstance(max_util, (int, float))
            or not 0 <= max_util <= 100  # also refuses nan
        ):
            raise InvalidArgumentError(
                f"max_util={max_util} is not a percentage.", hint="Use a value from 0 to 100."
            )
        if max_processes is not None and max_processes < 0:
            raise InvalidArgumentError(
                f"max_processes={max_processes} is negative.", hint="Use 0 or more."
            )
        # One GPU on its own (3, "GPU-8d11"), or "2,4" as on the command line: iterating the
        # string would exclude "G", "P", "U", ... and with them every GPU.
        if isinstance(exclude, int):
            exclude = [exclude]
        elif isinstance(exclude, str):
            exclude = [e.strip() for e in exclude.split(",") if e.strip()]
        excluded = tuple(exclude)
        for item in excluded:
            if not isinstance(item, (int, str)) or isinstance(item, bool):
                raise InvalidArgumentError(
                    f"Cannot exclude {item!r}: not an NVML index or a UUID.",
                    hint="Exclude GPUs by their `gpukit list` index or GPU- UUID.",
                )
        return cls(
            min_free=None if min_free is None else parse_size(min_free, warn_unitless_below=2**20),
            max_util=None if max_util is None else int(max_util),
            max_processes=max_processes,
            exclude=excluded,
        )

    @property
    def process_limit(self) -> int | None:
        """The process limit in force: 0 (idle GPUs only) unless memory or a limit was given."""
        if self.max_processes is None and self.min_free is None:
            return 0
        return self.max_processes

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values, with a ``schema`` field: what a waiter's ticket records.

        :meth:`from_json` reads them back exactly (sizes in bytes, ``exclude`` entries as the
        indices and UUIDs they were).

        >>> Criteria.make(min_free="20GB", exclude=[3]).to_json()["min_free"]
        20000000000
        """
        return {
            "schema": CRITERIA_SCHEMA,
            "min_free": self.min_free,
            "max_util": self.max_util,
            "max_processes": self.max_processes,
            "exclude": list(self.exclude),
            "grant": None
            if self.grant is None
            else {
                "indices": list(self.grant.indices),
                "variable": self.grant.variable,
                "value": self.grant.value,
            },
        }

    @classmethod
    def from_json(cls, raw: object) -> Criteria:
        """The criteria that :meth:`to_json` wrote, as another user's file holds them.

        Every field is checked by exact type and range; anything else (a missing or unknown
        field, another schema, a float, a size past 2**100 bytes) raises
        :class:`~gpukit.untrusted.InvalidInput`, never another exception.
        """
        fields = as_dict(raw, what="the criteria")
        if fields.get("schema") != CRITERIA_SCHEMA:
            raise InvalidInput(f"the criteria are not a {CRITERIA_SCHEMA} record")
        if set(fields) != _CRITERIA_FIELDS:
            raise InvalidInput(f"the criteria hold other fields than {sorted(_CRITERIA_FIELDS)}")

        def number(name: str, high: int) -> int | None:
            value = fields[name]
            return None if value is None else as_int(value, high=high, what=name)

        exclude = as_list(fields["exclude"], limit=_MOST_EXCLUDED, what="exclude")
        grant = None
        if fields["grant"] is not None:
            granted = as_dict(fields["grant"], what="grant")
            if set(granted) != _GRANT_FIELDS:
                raise InvalidInput(f"the grant holds other fields than {sorted(_GRANT_FIELDS)}")
            indices = as_list(granted["indices"], limit=_MOST_EXCLUDED, what="granted GPUs")
            grant = Grant(
                indices=tuple(as_int(i, high=_MOST_NUMBER, what="a granted GPU") for i in indices),
                variable=as_str(granted["variable"], limit=256, what="the grant's variable"),
                value=as_str(granted["value"], what="the grant's value"),
            )
        return cls(
            min_free=number("min_free", MOST_SIZE),
            max_util=number("max_util", 100),
            max_processes=number("max_processes", _MOST_NUMBER),
            exclude=tuple(
                as_str(e, limit=256, what="an excluded GPU")
                if isinstance(e, str)
                else as_int(e, high=_MOST_NUMBER, what="an excluded GPU")
                for e in exclude
            ),
            grant=grant,
        )

    def describe(self) -> str:
        """``'at least 60 GiB free, at most 10% busy'``, for messages."""
        parts = []
        if self.min_free is not None:
            parts.append(f"at least {format_size(self.min_free)} free")
        if self.max_util is not None:
            parts.append(f"at most {self.max_util}% busy")
        limit = self.process_limit
        if limit == 0:
            parts.append("no process on it")
        elif limit is not None:
            parts.append(f"at most {limit} process(es)")
        if self.exclude:
            parts.append(f"not {', '.join(map(str, self.exclude))}")
        if self.grant is not None:
            parts.append(_granted(self.grant))
        return ", ".join(parts)

    def grants(self, gpu: GPU) -> bool:
        """True when ``gpu`` is one this process may choose: granted, or nothing restricts it."""
        return self.grant is None or gpu.index in self.grant.indices

    def excludes(self, gpu: GPU) -> bool:
        """True when ``gpu`` is excluded by index, UUID, or a prefix of its UUID."""
        return any(_names(e, gpu) for e in self.exclude)

    def check_exclude(self, inv: Inventory) -> None:
        """Raise InvalidArgumentError for an excluded GPU that ``inv`` does not have.

        A typo in ``exclude`` must not hand out the very GPU the user meant to keep free, so
        every entry must name exactly one GPU of the machine: an index, a UUID, or a prefix
        of one UUID.
        """
        for entry in self.exclude:
            matches = [g.index for g in inv.gpus if _names(entry, g)]
            if len(matches) == 1:
                continue
            have = ", ".join(f"{g.index} ({g.uuid})" for g in inv.gpus) or "none"
            what = (
                f"is a prefix of the UUIDs of GPUs {', '.join(map(str, matches))}"
                if matches
                else "names no GPU of this machine"
            )
            raise InvalidArgumentError(
                f"Cannot exclude {entry!r}: it {what}. The machine has GPUs {have}.",
                hint="Exclude GPUs by their `gpukit list` index or their UUID (a prefix is "
                "enough when it names one GPU).",
            )

    def could_ever_qualify(self, gpu: GPU) -> bool:
        """True unless ``gpu`` fails for a reason that waiting cannot change.

        A GPU NVML cannot read (fallen off the bus, "GPU is lost") needs a reset or a reboot:
        waiting for it would be forever.
        """
        if not self.grants(gpu) or self.excludes(gpu) or gpu.mig_mode or gpu.error is not None:
            return False
        total = gpu.memory_total
        return self.min_free is None or total is None or total >= self.min_free


def _gpu_list(indices: Iterable[int]) -> str:
    listed = list(indices)
    return f"GPU{'s' if len(listed) != 1 else ''} {','.join(map(str, listed))}"


def _granted(grant: Grant) -> str:
    """``'granted GPUs 4,5'``: the grant as the criteria's description says it, by index.

    Short on purpose: a scheduler's CUDA_VISIBLE_DEVICES may be full UUIDs, and this part of
    the description is in every line a waiter prints.
    """
    return f"granted {_gpu_list(grant.indices)}"


def _names(entry: int | str, gpu: GPU) -> bool:
    """True when the ``exclude`` entry ``entry`` names ``gpu``."""
    if isinstance(entry, int):
        return entry == gpu.index
    return entry == str(gpu.index) or (
        bool(entry) and bool(gpu.uuid) and gpu.uuid.startswith(entry)
    )


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


def pick(
    n: int = 1,
    *,
    min_free: int | float | str | None = None,
    max_util: float | None = None,
    max_processes: int | None = None,
    exclude: Iterable[int | str] = (),
    order: Order = "free",
    inventory: Inventory | None = None,
    claims: Mapping[str, Holder] | None = None,
    all_gpus: bool = False,
) -> list[GPU]:
    """Choose ``n`` GPUs that meet the criteria, best first (most free memory, by default).

    Reading the machine itself, it chooses only among the GPUs granted to this process by
    ``CUDA_VISIBLE_DEVICES`` (or Slurm's ``SLURM_JOB_GPUS``), unless ``all_gpus=True``.

    ``min_free``: bytes or a size (``"8GiB"``); ``max_util``: percent; ``max_processes``: how
    many processes may already hold memory on it (default 0, or no limit when ``min_free`` is
    given); ``exclude``: NVML indices or UUIDs; ``order``: ``"free"``, ``"util"`` or ``"index"``.
    GPUs claimed by other gpukit processes never qualify. ``inventory`` and ``claims`` default to
    the machine's readings now; when ``claims`` is read here, the lock folder's policy
    (:mod:`gpukit.gpus.policy`) applies too. Raises NoGpuAvailableError explaining each
    rejection (UserLimitError when the user already holds their share), and
    InvalidArgumentError when ``exclude`` names a GPU the machine does not have.

    >>> gpus = pick(2, min_free="20GiB")                  # doctest: +SKIP
    >>> with claim(gpus): ...                             # doctest: +SKIP
    """
    criteria = Criteria.make(
        min_free=min_free, max_util=max_util, max_processes=max_processes, exclude=exclude
    )
    if inventory is None:
        from gpukit.gpus.inventory import inventory as read_inventory

        inventory = read_inventory()
        if not all_gpus:
            inventory, criteria = within_grant(inventory, n, criteria)
    if claims is not None:
        return choose(inventory, n, criteria, order=order, claims=claims)
    gpus = choose(inventory, n, criteria, order=order, claims=current_claims())
    check_user_limit(n)
    return gpus


def check_user_limit(n: int, policy: Policy | None = None) -> None:
    """Raise UserLimitError when this user may not take ``n`` more GPUs under ``policy``.

    ``policy`` defaults to the lock folder's (:func:`~gpukit.gpus.policy.load_policy`).
    """
    policy = load_policy() if policy is None else policy
    if policy.limits.max_gpus_per_user is None:
        return
    held = holdings()
    if policy.refusal(os.getuid(), n, held) is not None:
        raise UserLimitError(
            policy.explain(os.getuid(), n, held),
            hint="Release a claim, ask for fewer GPUs, or wait for your own claims to end "
            "with `gpukit run --wait`."
            if policy.could_ever_allow(n)
            else "Waiting cannot help: ask for fewer GPUs, or ask the administrator.",
        )


def within_grant(
    inv: Inventory, n: int, criteria: Criteria, env: Mapping[str, str] | None = None
) -> tuple[Inventory, Criteria]:
    """``inv`` narrowed to the GPUs this process was granted, and ``criteria`` that say so.

    The grant is ``CUDA_VISIBLE_DEVICES``, or Slurm's ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS``
    (:func:`gpukit.gpus.visible.granted_gpus`); without one both come back unchanged. The
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
    from gpukit.gpus.visible import granted_inventory

    criteria.check_exclude(inv)
    grant = granted_gpus(inv, env)
    if grant is None:
        return inv, criteria
    granted = granted_inventory(inv, n, env)
    kept = tuple(e for e in criteria.exclude if any(_names(e, g) for g in granted.gpus))
    return granted, replace(criteria, exclude=kept, grant=grant)
