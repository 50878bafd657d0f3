"""What a request for GPUs asks of each one: the criteria, their sentence and their JSON form.

:class:`Criteria` is checked once when it is made (:meth:`Criteria.make`), says itself as the
sentence every message and waiting line shows (:meth:`Criteria.describe`), and travels as data
in a waiter's ticket (:meth:`Criteria.to_json`, read back by :meth:`Criteria.from_json` through
the untrusted-input layer: a ticket is another user's file). Judging GPUs against criteria is
:mod:`gpukit.gpus.select`'s.

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpukit.errors import InvalidArgumentError
from gpukit.gpus.grants import Grant
from gpukit.gpus.inventory import GPU, Inventory
from gpukit.sizes import MOST_SIZE, format_size, parse_size
from gpukit.untrusted import InvalidInput, as_dict, as_int, as_list, as_str

__all__ = ["CRITERIA_SCHEMA", "Criteria", "names_gpu"]

CRITERIA_SCHEMA = "gpukit.criteria/1"
"""The ``schema`` field of :meth:`Criteria.to_json`."""
_CRITERIA_FIELDS = frozenset(
    {"schema", "min_free", "max_util", "max_processes", "exclude", "grant"}
)
_GRANT_FIELDS = frozenset({"indices", "variable", "value"})
_MOST_EXCLUDED = 1024  # entries of ``exclude`` read back: more than any machine has GPUs
_MOST_NUMBER = 2**32 - 1  # process counts and GPU indices


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
        return any(names_gpu(e, gpu) for e in self.exclude)

    def check_exclude(self, inv: Inventory) -> None:
        """Raise InvalidArgumentError for an excluded GPU that ``inv`` does not have.

        A typo in ``exclude`` must not hand out the very GPU the user meant to keep free, so
        every entry must name exactly one GPU of the machine: an index, a UUID, or a prefix
        of one UUID.
        """
        for entry in self.exclude:
            matches = [g.index for g in inv.gpus if names_gpu(entry, g)]
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


def names_gpu(entry: int | str, gpu: GPU) -> bool:
    """True when the ``exclude`` entry ``entry`` names ``gpu``."""
    if isinstance(entry, int):
        return entry == gpu.index
    return entry == str(gpu.index) or (
        bool(entry) and bool(gpu.uuid) and gpu.uuid.startswith(entry)
    )
