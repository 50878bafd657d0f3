"""What a save holds, checked by structure before torch's or the user's loaders see it.

A save's files passed their digests (:func:`gpukit.train.saves.verify`), so they are what was
written; but what was written may come from another version of the script, another optimizer,
or a save someone handed over. torch's own loaders trust their input: ``Optimizer.load_state_dict``
calls ``.items()`` on whatever ``"state"`` is, ``LRScheduler.load_state_dict`` writes every key
into the scheduler's attributes, and ``torch.load`` inflates a compressed zip record to the size
the record claims before anything is checked. So each part is checked here first, against the
live object it is meant for, and refused with the reason (:class:`gpukit.untrusted.InvalidInput`,
which the training state turns into a ``CheckpointError`` naming the file):

- :func:`check_records`: a ``torch.save`` file's zip records are stored (torch never compresses
  them), each inside the file;
- :func:`check_optimizer_state`: a mapping with ``state`` and ``param_groups``, as many groups
  as the live optimizer, each with as many parameters and a learning rate, each setting of the
  kind the live group has, the state keyed by those parameters;
- :func:`check_scheduler_state`: only the keys the live scheduler's own state has, each of the
  kind it has there.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gpukit.untrusted import InvalidInput

__all__ = ["check_optimizer_state", "check_records", "check_scheduler_state"]

_MAX_RECORDS = 1 << 20


def check_records(path: Path) -> None:
    """Check that the ``torch.save`` zip archive at ``path`` holds stored records only.

    Read from the archive's central directory (bounded by the file's own size), before
    ``torch.load`` opens it: a compressed record would be inflated to whatever size it claims.
    A file that is not a zip archive is left to the reader, which refuses it.

    Raises:
        InvalidInput: a record is compressed, claims more bytes than it holds, or lies
            outside the file; or the archive has more records than any save writes.
    """
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # not an archive (or unreadable): torch's reader says so, typed
    with archive:
        size = path.stat().st_size
        records = archive.infolist()
        if len(records) > _MAX_RECORDS:
            raise InvalidInput(f"it has more than {_MAX_RECORDS} records")
        for record in records:
            if record.compress_type != zipfile.ZIP_STORED:
                raise InvalidInput(
                    "it holds a compressed record (torch.save writes them stored): it was "
                    "rewritten by another program"
                )
            if record.file_size != record.compress_size or (
                record.header_offset + record.compress_size > size
            ):
                raise InvalidInput("a record claims more bytes than the file holds")


def check_optimizer_state(saved: object, optimizer: torch.optim.Optimizer) -> None:
    """Check that ``saved`` is a state ``optimizer.load_state_dict`` can take as it is.

    Args:
        saved: the optimizer state read from a save.
        optimizer: the live optimizer it is for.

    Raises:
        InvalidInput: ``saved`` is not a mapping with ``state`` and ``param_groups``; it has
            another number of groups or of parameters in a group; its per-parameter state is
            keyed by anything but those parameters' indices, or is not a mapping.
    """
    if type(saved) is not dict:
        raise InvalidInput("it is not a mapping")
    state, groups = saved.get("state"), saved.get("param_groups")
    if type(state) is not dict:
        raise InvalidInput("its 'state' is not a mapping")
    if type(groups) is not list:
        raise InvalidInput("its 'param_groups' is not a list")
    live = optimizer.param_groups
    if len(groups) != len(live):
        raise InvalidInput(f"it has {len(groups)} parameter groups, this optimizer has {len(live)}")
    indices: set[int] = set()
    for number, (group, mine) in enumerate(zip(groups, live, strict=True)):
        if type(group) is not dict or type(group.get("params")) is not list:
            raise InvalidInput(f"its parameter group {number} is not a mapping with 'params'")
        params = group["params"]
        if len(params) != len(mine["params"]):
            raise InvalidInput(
                f"its parameter group {number} has {len(params)} parameters, this "
                f"optimizer's has {len(mine['params'])}"
            )
        for index in params:
            if type(index) is not int:
                raise InvalidInput(
                    f"its parameter group {number} names a parameter by {type(index).__name__}, "
                    "not by its index"
                )
            if index in indices:
                raise InvalidInput(f"its parameter group {number} names a parameter twice")
            indices.add(index)
        if "lr" in mine and "lr" not in group:  # torch takes the saved group as it is
            raise InvalidInput(f"its parameter group {number} has no learning rate")
        for key, value in group.items():
            if type(key) is not str:
                raise InvalidInput(f"its parameter group {number} has a key that is not text")
            _check_like(value, mine.get(key), f"its parameter group {number}'s {key!r}")
    for key, value in state.items():
        if key not in indices:
            raise InvalidInput("its 'state' holds a parameter that no group names")
        if type(value) is not dict or not all(type(k) is str for k in value):
            raise InvalidInput("a parameter's state is not a mapping")


def check_scheduler_state(saved: object, scheduler: Any) -> None:
    """Check that ``saved`` holds only the keys ``scheduler``'s own state has, each alike.

    ``LRScheduler.load_state_dict`` writes every key it is given into the scheduler's
    attributes: an extra ``"optimizer"`` or ``"state_dict"`` key would replace a method or the
    optimizer it drives.

    Args:
        saved: the scheduler state read from a save.
        scheduler: the live scheduler it is for.

    Raises:
        InvalidInput: ``saved`` is not a mapping, has a key the scheduler's state lacks, or a
            value of another kind (a list for a number, a list of another length).
    """
    if type(saved) is not dict:
        raise InvalidInput("it is not a mapping")
    own = scheduler.state_dict()
    for key, value in saved.items():
        if type(key) is not str or key not in own:
            raise InvalidInput(f"it has a key {_shown(key)} that this scheduler's state lacks")
        _check_like(value, own[key], f"its {key!r}")


def _shown(key: object) -> str:
    return repr(key)[:60] if type(key) in (str, int) else f"of type {type(key).__name__}"


def _check_like(value: object, live: object, what: str) -> None:
    """``value`` must be of the kind ``live`` is: a number (or a one-element tensor) for a
    number, finite where ``live`` is an integer; a bool for a bool; a list as long for a list
    (item by item); a mapping for a mapping; anything for None (a value not yet set) and for
    kinds not listed."""
    if live is None:
        return
    if type(live) is bool:
        if type(value) is not bool:
            raise InvalidInput(f"{what} is not a bool")
    elif type(live) in (int, float):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return  # a learning rate may be given as a tensor
        if type(value) not in (int, float):
            raise InvalidInput(f"{what} is not a number")
        if type(live) is int and type(value) is float and not math.isfinite(value):
            raise InvalidInput(f"{what} is not finite")
    elif type(live) in (list, tuple):
        if type(value) not in (list, tuple):
            raise InvalidInput(f"{what} is not a list")
        assert isinstance(value, list | tuple)
        assert isinstance(live, list | tuple)
        if len(value) != len(live):
            raise InvalidInput(f"{what} has {len(value)} items, this one has {len(live)}")
        for item, mine in zip(value, live, strict=True):
            _check_like(item, mine, what)
    elif isinstance(live, Mapping) and not isinstance(value, Mapping):
        raise InvalidInput(f"{what} is not a mapping")
