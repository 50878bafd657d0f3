"""A map over the tensors of a nested structure, on the container rules of ``gk.to_device``.

``scatter`` must accept exactly the structures ``to_device`` accepts, so rather than a second
walker this reuses the one in :mod:`gpukit.transfer` and changes only what happens at the
leaves: tensors go through a caller-given function, and every other leaf (modules and objects
with a ``.to`` method included) is kept as it is, because a replica receives it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpukit.transfer import KeyPath, _Walker

TensorFn = Callable[[torch.Tensor, KeyPath | None], Any]


class _TensorMap(_Walker):
    """``to_device``'s walk, applying ``leaf(tensor, path)`` to every tensor instead of a move.

    Every other leaf, modules and objects with a ``.to`` method included, is kept as it is.
    """

    __slots__ = ("_leaf",)

    def __init__(self, leaf: TensorFn) -> None:
        super().__init__()
        self._leaf = leaf

    def tensor(self, t: torch.Tensor, path: KeyPath | None) -> Any:
        return self._leaf(t, path)


def map_tensors(obj: Any, leaf: TensorFn, *, with_paths: bool = False) -> Any:
    """Rebuild ``obj`` with ``leaf(tensor, path)`` in place of each tensor.

    Paths (tuples of keys, list positions and field names from the top) are computed only when
    ``with_paths`` is true; otherwise ``leaf`` receives ``None``.
    """
    return _TensorMap(leaf).walk(obj, () if with_paths else None)


def tensors_with_paths(obj: Any) -> list[tuple[KeyPath, torch.Tensor]]:
    """Every tensor in ``obj`` with its key path, in walk order."""
    found: list[tuple[KeyPath, torch.Tensor]] = []

    def record(t: torch.Tensor, path: KeyPath | None) -> torch.Tensor:
        found.append((path or (), t))
        return t

    map_tensors(obj, record, with_paths=True)
    return found


def format_path(path: KeyPath, root: str = "inputs") -> str:
    """``("x", 0, "ids")`` as ``inputs['x'][0]['ids']``, for error messages."""
    return root + "".join(f"[{key!r}]" for key in path)
