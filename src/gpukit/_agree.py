"""What every rank agrees on: gpukit's one way for the ranks of a group to reach one answer.

Which save to resume, whether to stop, whether a save failed anywhere, the largest batch that
fits everywhere: each is one of these few questions, asked of every rank of ``group`` at the
same moment (each call is a collective), answered the same on every rank. Without a process
group, or with ``group`` None and none started, each answers for this process alone, so that a
one-process run calls them unchanged.

Tensors travel on the device the group's backend takes (CUDA for NCCL, the CPU otherwise);
Python objects travel pickled, as torch's object collectives send them, and are trusted as
torch trusts them: they come from this job's own ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["all_true", "any_true", "first_error", "from_rank_0", "gathered", "largest", "smallest"]

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)


def _alone(group: Any) -> bool:
    """Whether this process answers alone: no process group runs."""
    return not (dist.is_available() and dist.is_initialized())


def _device(group: Any) -> torch.device | None:
    """Where the group's backend takes tensors: the current CUDA device for NCCL, else the CPU."""
    backend = str(dist.get_backend(group))
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else None


def _reduced(values: Sequence[int], op: Any, group: Any) -> list[int]:
    if _alone(group):
        return [int(v) for v in values]
    tensor = torch.tensor([int(v) for v in values], dtype=torch.int64, device=_device(group))
    dist.all_reduce(tensor, op=op, group=group)
    return [int(v) for v in tensor.tolist()]


def all_true(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is true on every rank of ``group``.

    Args:
        flag: this rank's answer.
        group: the process group (None: the default one).

    >>> all_true(True)               # one process: its own answer
    True
    """
    return _reduced([1 if flag else 0], dist.ReduceOp.MIN, group)[0] == 1


def any_true(flag: bool, group: Any = None) -> bool:
    """Whether ``flag`` is true on at least one rank of ``group``.

    Args:
        flag: this rank's answer.
        group: the process group (None: the default one).
    """
    return _reduced([1 if flag else 0], dist.ReduceOp.MAX, group)[0] == 1


def smallest(value: int, group: Any = None) -> int:
    """The smallest of every rank's ``value``.

    Args:
        value: this rank's integer.
        group: the process group (None: the default one).
    """
    return _reduced([value], dist.ReduceOp.MIN, group)[0]


def largest(values: Sequence[int], group: Any = None) -> list[int]:
    """The largest of every rank's ``values``, element by element (one collective for all).

    Args:
        values: this rank's integers; the same count on every rank.
        group: the process group (None: the default one).

    >>> largest([2, 0])
    [2, 0]
    """
    return _reduced(values, dist.ReduceOp.MAX, group)


def from_rank_0(value: T, group: Any = None) -> T:
    """Rank 0's ``value`` (the group's first rank), on every rank; the others' are not read.

    Args:
        value: on rank 0, what to tell every rank; on the others, anything (None).
        group: the process group (None: the default one).
    """
    if _alone(group):
        return value
    box: list[Any] = [value]
    source = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=source, group=group)
    return box[0]  # type: ignore[no-any-return]


def gathered(value: T, group: Any = None) -> list[T]:
    """Every rank's ``value``, in rank order, on every rank.

    Args:
        value: this rank's value (picklable).
        group: the process group (None: the default one).
    """
    if _alone(group):
        return [value]
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, value, group=group)
    return every


def first_error(mine: E | None, group: Any = None) -> E | None:
    """The error of the first rank (in rank order) that met one, on every rank; None when no
    rank did. So every rank can raise the same error, and none waits for a rank that failed.

    Args:
        mine: the error this rank met, or None.
        group: the process group (None: the default one).
    """
    return next((error for error in gathered(mine, group) if error is not None), None)
