"""Collect replica outputs on one device: ``gk.parallel.gather``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import gpukit.parallel._cuda as _cuda
from gpukit import _tree
from gpukit._tree import KeyPath, format_path
from gpukit.devices import DeviceLike
from gpukit.devices import device as _parse_device
from gpukit.errors import GatherError, InvalidArgumentError

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

    Args:
        outputs: one output per replica, alike in structure.
        target_device: where the combined output goes.
        dim: the dimension tensors are concatenated along.
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
        cls = type(first)
        if any(type(item) is not cls for item in items[1:]):
            names = ", ".join(sorted({type(item).__name__ for item in items}))
            raise GatherError(
                f"gather found different types at {format_path(path, 'outputs')}: {names}.",
                hint="Make the module return the same structure for every chunk of the batch.",
            )
        if first is None:
            return None
        kind = _tree.walk_kind(first)
        if kind == _tree.LEAF:
            return list(items)
        keys = [key for key, _ in _tree.children(first, kind)]
        if kind == _tree.MAPPING:
            self._same_keys(items, keys, path)
        elif kind == _tree.SEQUENCE:
            self._same_length(items, path)
        values = [
            self.gather([_tree.child(item, kind, key) for item in items], (*path, key))
            for key in keys
        ]
        return _tree.rebuild(first, kind, values)

    def _tensors(self, items: list[Any], path: KeyPath) -> torch.Tensor:
        if not all(isinstance(item, torch.Tensor) for item in items):
            raise GatherError(
                f"gather found a tensor at {format_path(path, 'outputs')} in some replica "
                "outputs but not in others.",
                hint="Make the module return a tensor there for every chunk of the batch.",
            )
        if len(items) > 1 and self._target.type == "cuda":
            direct = _cuda.gather(items, self._dim, self._target)
            if direct is not None:
                return direct
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

    @staticmethod
    def _same_keys(items: list[Any], keys: list[Any], path: KeyPath) -> None:
        for item in items[1:]:
            if set(item) != set(keys):
                raise GatherError(
                    f"gather found dicts with different keys at "
                    f"{format_path(path, 'outputs')}: {sorted(map(str, keys))} and "
                    f"{sorted(map(str, item))}.",
                    hint="Make the module return the same keys for every chunk of the batch.",
                )

    @staticmethod
    def _same_length(items: list[Any], path: KeyPath) -> None:
        lengths = {len(item) for item in items}
        if len(lengths) > 1:
            raise GatherError(
                f"gather found {type(items[0]).__name__}s of lengths {sorted(lengths)} at "
                f"{format_path(path, 'outputs')}.",
                hint="Make the module return sequences of one length for every chunk.",
            )
