"""Collect replica outputs on one device: ``gk.parallel.gather``."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpukit.devices import DeviceLike
from gpukit.devices import device as _parse_device
from gpukit.errors import GatherError, InvalidArgumentError
from gpukit.parallel._nested import format_path
from gpukit.transfer import KeyPath

__all__ = ["gather"]


def gather(outputs: Sequence[Any], target_device: DeviceLike, dim: int = 0) -> Any:
    """Combine one output per replica into a single output on ``target_device``.

    The outputs must share a structure (dict, OrderedDict, list, tuple, namedtuple, dataclass,
    as ``scatter`` accepts). Tensors are moved and concatenated along ``dim``; 0-dim tensors,
    such as a per-replica loss, are stacked into a vector with one value per replica. ``None``
    everywhere stays ``None``; any other leaf (numbers, strings, objects) becomes the list of
    the replicas' values. Gradients flow back through the moves and the concatenation.

    Raises :class:`~gpukit.errors.GatherError` naming the path when the structures disagree.

    >>> import torch
    >>> out = gather([{"y": torch.ones(2, 3), "n": 2}, {"y": torch.ones(1, 3), "n": 1}], "cpu")
    >>> out["y"].shape, out["n"]
    (torch.Size([3, 3]), [2, 1])
    """
    if len(outputs) == 0:
        raise InvalidArgumentError(
            "gather was given no outputs.", hint="Pass one output per replica that ran."
        )
    return gather_on(outputs, _parse_device(target_device), dim)


def gather_on(outputs: Sequence[Any], target: torch.device, dim: int = 0) -> Any:
    """``gather`` to an already parsed device, for callers that gather every step."""
    return _Gatherer(target, dim).gather(list(outputs), ())


class _Gatherer:
    __slots__ = ("_dim", "_target")

    def __init__(self, target: torch.device, dim: int) -> None:
        self._target = target
        self._dim = dim

    def gather(self, items: list[Any], path: KeyPath) -> Any:
        first = items[0]
        if isinstance(first, torch.Tensor):
            return self._tensors(items, path)
        kind = type(first)
        if any(type(item) is not kind for item in items[1:]):
            names = ", ".join(sorted({type(item).__name__ for item in items}))
            raise GatherError(
                f"gather found different types at {format_path(path, 'outputs')}: {names}.",
                hint="Make the module return the same structure for every chunk of the batch.",
            )
        if first is None:
            return None
        if isinstance(first, Mapping):
            return self._mapping(items, path)
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            fields = first._fields
            return kind(*(self.gather([getattr(i, f) for i in items], (*path, f)) for f in fields))
        if isinstance(first, (list, tuple)):
            return self._sequence(items, path)
        if dataclasses.is_dataclass(first) and not isinstance(first, type):
            return self._dataclass(items, path)
        return list(items)

    def _tensors(self, items: list[Any], path: KeyPath) -> torch.Tensor:
        if not all(isinstance(item, torch.Tensor) for item in items):
            raise GatherError(
                f"gather found a tensor at {format_path(path, 'outputs')} in some replica "
                "outputs but not in others.",
                hint="Make the module return a tensor there for every chunk of the batch.",
            )
        moved: list[torch.Tensor] = [item.to(self._target) for item in items]
        if all(t.dim() == 0 for t in moved):
            return torch.stack(moved)
        if len(moved) == 1:
            return moved[0]
        shapes = [tuple(t.shape) for t in moved]
        try:
            return torch.cat(moved, self._dim)
        except (RuntimeError, IndexError) as exc:
            raise GatherError(
                f"gather cannot concatenate {format_path(path, 'outputs')} along dim "
                f"{self._dim}: the replicas returned shapes {shapes}.",
                hint="Outputs must agree in every dimension but the gather dim; return "
                "0-dim tensors for per-replica scalars.",
            ) from exc

    def _mapping(self, items: list[Any], path: KeyPath) -> Any:
        first = items[0]
        keys = list(first)
        for item in items[1:]:
            if set(item) != set(keys):
                raise GatherError(
                    f"gather found dicts with different keys at "
                    f"{format_path(path, 'outputs')}: {sorted(map(str, keys))} and "
                    f"{sorted(map(str, item))}.",
                    hint="Make the module return the same keys for every chunk of the batch.",
                )
        values = {key: self.gather([item[key] for item in items], (*path, key)) for key in keys}
        if type(first) is dict:
            return values
        if isinstance(first, dict):
            # A shallow copy keeps the subclass and defaultdict's factory, as to_device does.
            new = copy.copy(first)
            new.update(values)
            return new
        return type(first)(values)

    def _sequence(self, items: list[Any], path: KeyPath) -> Any:
        first = items[0]
        lengths = {len(item) for item in items}
        if len(lengths) > 1:
            raise GatherError(
                f"gather found {type(first).__name__}s of lengths {sorted(lengths)} at "
                f"{format_path(path, 'outputs')}.",
                hint="Make the module return sequences of one length for every chunk.",
            )
        values = [self.gather([item[i] for item in items], (*path, i)) for i in range(len(first))]
        return type(first)(values)

    def _dataclass(self, items: list[Any], path: KeyPath) -> Any:
        new = copy.copy(items[0])
        for field in dataclasses.fields(new):
            value = self.gather([getattr(item, field.name) for item in items], (*path, field.name))
            # object.__setattr__ also works on frozen dataclasses.
            object.__setattr__(new, field.name, value)
        return new
