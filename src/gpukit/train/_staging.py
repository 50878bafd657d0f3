"""Copying a state to host memory, so that training may go on while it is written.

A state dict holds the live tensors of the model and the optimizer; an asynchronous save must
copy them before the next step changes them. :func:`stage` copies every tensor to CPU memory
(pinned, and copied without waiting per tensor, when it lives on a GPU) and rebuilds every
container, so nothing the training loop changes afterwards reaches the save.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from gpukit.errors import InvalidArgumentError

__all__ = ["check_plain", "is_stateful", "stage"]

_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor)


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()`` (torch's convention)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def check_plain(value: object, where: str, depth: int = 0) -> None:
    """Refuse what a save could not read back as data (``torch.load(weights_only=True)``).

    Raises:
        InvalidArgumentError: ``value`` holds something other than None, bool, int, float,
            str, bytes, tensors, and lists, tuples and str-keyed dicts of them.
    """
    if depth > 32:
        raise InvalidArgumentError(
            f"{where} is nested more than 32 deep.", hint="Save flatter data."
        )
    if isinstance(value, _PLAIN) and type(value) in _PLAIN:
        return
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]", depth + 1)
        return
    if isinstance(value, dict) and type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise InvalidArgumentError(
                    f"{where} has the key {key!r}, not a string.", hint="Use str keys."
                )
            check_plain(item, f"{where}[{key!r}]", depth + 1)
        return
    raise InvalidArgumentError(
        f"{where} is a {type(value).__name__}, which a training state cannot save as data.",
        hint="Pass an object with state_dict()/load_state_dict(), or plain data (numbers, "
        "strings, tensors, and lists and dicts of them).",
    )


def stage(state: Any) -> Any:
    """A copy of ``state`` in host memory: every tensor copied to CPU, every container rebuilt."""
    on_gpu = False

    def copy_of(value: Any) -> Any:
        nonlocal on_gpu
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.device.type == "cpu":
                return value.clone()
            on_gpu = True
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            return host.copy_(value, non_blocking=True)
        if isinstance(value, dict):
            out = copy.copy(value)  # keeps the type, a defaultdict's factory, _metadata
            for key in out:
                out[key] = copy_of(value[key])
            return out
        if type(value) in (list, tuple):
            return type(value)(copy_of(item) for item in value)
        return copy.deepcopy(value)

    staged = copy_of(state)
    if on_gpu:
        torch.cuda.synchronize()  # the copies above were queued, not waited for, one by one
    return staged
