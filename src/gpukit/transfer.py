"""Move any nesting of tensors to a device: ``gk.to_device``.

The walk is :mod:`gpukit._tree`'s, so ``to_device`` accepts exactly the containers that
``tree_map``, scatter and gather do; this module adds only what a move means for each leaf.
Containers are rebuilt only when something inside them moved; otherwise the very same object
comes back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from gpukit import _tree
from gpukit.devices import DeviceLike
from gpukit.devices import device as _parse_device
from gpukit.errors import InvalidArgumentError, check_bool

T = TypeVar("T")
KeyPath = _tree.KeyPath

__all__ = ["to_device"]


class _Mover:
    """One ``to_device`` call: its settings, and how it moves a tensor or another leaf."""

    __slots__ = ("_nb", "_pin", "_target", "_target_is_cuda")

    def __init__(
        self, target: torch.device, non_blocking: bool | Literal["auto"], pin: bool
    ) -> None:
        self._target = target
        self._target_is_cuda = target.type == "cuda"
        self._nb = non_blocking
        self._pin = pin and self._target_is_cuda

    def leaf(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The function applied to each tensor: a quick "already there?" test, then a move."""
        target, move = self._target, self.move
        if target.type == "cpu":
            # is_cpu is a flag read; t.device builds a torch.device object on every call.
            return lambda t: t if t.is_cpu else move(t)
        return lambda t: t if t.device == target else move(t)

    def move(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self._target:
            return t
        if self._pin and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        if self._nb == "auto":
            # Non-blocking is only safe and useful from pinned host memory to a GPU: the host
            # buffer stays alive and CUDA orders the copy before later kernels on the stream.
            # Device-to-host non-blocking copies can be read before they finish.
            nb = self._target_is_cuda and t.device.type == "cpu" and t.is_pinned()
        else:
            nb = self._nb
        return t.to(self._target, non_blocking=nb)

    def opaque(self, obj: Any) -> Any:
        """A leaf that is not a tensor: a module moves in place; an object with ``.to`` moves."""
        if isinstance(obj, nn.Module):
            return obj.to(self._target)
        to = getattr(obj, "to", None)
        if not callable(to) or isinstance(obj, type):
            return obj
        try:
            moved = to(self._target, non_blocking=self._nb is True)
        except TypeError:  # a .to() that takes only the device
            moved = to(self._target)
        # A .to() that moves in place and returns None (as nn.Module.to once could) must not
        # turn the object into None: the object itself is what it moved.
        return obj if moved is None else moved


def _parse_skip(skip: object) -> tuple[frozenset[Any], frozenset[KeyPath]]:
    if isinstance(skip, (str, bytes, int)) and not isinstance(skip, bool):
        skip = (skip,)
    if not isinstance(skip, Iterable):
        raise InvalidArgumentError(
            f"skip={skip!r} is not a key, a key path, or a collection of them.",
            hint='Pass e.g. skip="labels", skip=["labels", "meta.ids"] or skip=[("batch", 0)].',
        )
    names: set[Any] = set()
    paths: set[KeyPath] = set()
    for entry in skip:
        if isinstance(entry, tuple):
            paths.add(entry)
        elif isinstance(entry, str) and "." in entry:
            paths.add(tuple(int(p) if p.isdigit() else p for p in entry.split(".")))
        elif isinstance(entry, (str, int)) and not isinstance(entry, bool):
            names.add(entry)
        else:
            raise InvalidArgumentError(
                f"skip entry {entry!r} is neither a key, a dotted key path, nor a tuple path.",
                hint='Use "labels" (a key at any depth), "batch.meta.ids" or ("batch", 0).',
            )
    return frozenset(names), frozenset(paths)


def mover(
    device: torch.device, *, non_blocking: bool | Literal["auto"] = "auto"
) -> Callable[[Any], Any]:
    """A function that moves any nesting to ``device`` (parsed already), for per-step callers.

    Calling it raises ``RecursionError`` on a cyclic structure; ``to_device`` turns that into a
    typed error.
    """
    moving = _Mover(device, non_blocking, False)
    return _tree.mapper(moving.leaf(), torch.Tensor, moving.opaque)


def to_device(
    obj: T,
    device: DeviceLike,
    *,
    non_blocking: bool | Literal["auto"] = "auto",
    pin: bool = False,
    skip: Iterable[Any] = (),
) -> T:
    """Move every tensor in ``obj`` to ``device`` and return the result.

    ``obj`` may be a tensor, a module, or any nesting of dict (OrderedDict and defaultdict keep
    their type and factory), list, tuple, namedtuple, dataclass (frozen too) and objects with a
    ``.to`` method. Other leaves (str, numbers, None...) are kept as they are. Tensors already on
    ``device``, and containers in which nothing moved, come back as the very same objects.
    Modules are moved in place and returned; so is an object whose ``.to()`` returns None.
    A dataclass that is copied loses the values its ``functools.cached_property`` attributes
    had computed, so they are computed again from the moved fields.

    ``non_blocking="auto"`` copies asynchronously only from pinned host memory to a GPU, where
    that is both safe and useful; ``pin=True`` pins host tensors first when the target is a GPU.
    ``skip`` leaves alone every value under a key named like an entry (``"labels"``), or at a
    key path from the top (``"meta.ids"`` or ``("meta", "ids")``; list positions are ints).
    A structure that contains itself raises :class:`~gpukit.errors.InvalidArgumentError`.

    >>> import torch
    >>> batch = {"x": torch.ones(2), "ids": [1, 2], "name": "a"}
    >>> to_device(batch, "cpu") is batch
    True

    Args:
        obj: a tensor, a module, or any nesting of containers of them.
        device: where to move the tensors.
        non_blocking: whether copies are asynchronous; ``"auto"``: only from pinned memory to a
            GPU.
        pin: whether host tensors are pinned first, when the target is a GPU.
        skip: key names or key paths whose values are left where they are.
    """
    check_bool("pin", pin)
    if non_blocking != "auto" and non_blocking is not True and non_blocking is not False:
        raise InvalidArgumentError(
            f"non_blocking={non_blocking!r} is not understood.", hint='Use True, False or "auto".'
        )
    target = _parse_device(device)
    names, paths = _parse_skip(skip)
    moving = _Mover(target, non_blocking, pin)
    if not (names or paths):
        walked: T = _tree.guarded(_tree.mapper(moving.leaf(), torch.Tensor, moving.opaque), obj)
        return walked

    def kept(path: KeyPath) -> bool:
        return path[-1] in names or path in paths

    tensor_leaf = moving.leaf()
    return _tree.map_with_paths(  # type: ignore[no-any-return]
        obj, lambda _, t: tensor_leaf(t), torch.Tensor, keep=kept, opaque=moving.opaque
    )
