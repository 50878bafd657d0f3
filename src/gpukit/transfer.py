"""Move any nesting of tensors to a device: ``gk.to_device``.

The walk is the hot path of every training loop that feeds a GPU, so it dispatches on the exact
type first (dict, list, tuple, Tensor) and only falls back to ``isinstance`` checks for
subclasses, dataclasses and objects with a ``.to`` method. Containers are rebuilt only when
something inside them moved; otherwise the very same object comes back.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from gpukit.devices import DeviceLike
from gpukit.devices import device as _parse_device
from gpukit.errors import InvalidArgumentError, check_bool

T = TypeVar("T")
KeyPath = tuple[Any, ...]

__all__ = ["to_device"]


class _Walker:
    """Rebuild a nested structure, handing each tensor to :meth:`tensor`.

    Containers (dict and other mappings, list, tuple, namedtuple, dataclass) are walked and
    rebuilt only when something inside changed; every other object goes to :meth:`opaque`.
    ``to_device`` moves tensors with it; ``gk.parallel.scatter`` splits them.
    """

    __slots__ = ("_skip_names", "_skip_paths")

    def __init__(
        self, skip_names: frozenset[Any] = frozenset(), skip_paths: frozenset[KeyPath] = frozenset()
    ) -> None:
        self._skip_names = skip_names
        self._skip_paths = skip_paths

    # -- leaves: what subclasses change ---------------------------------------------------
    def tensor(self, t: torch.Tensor, path: KeyPath | None) -> Any:
        raise NotImplementedError

    def opaque(self, obj: Any) -> Any:
        """A leaf that is neither a tensor nor a container: kept as it is."""
        return obj

    def other(self, obj: Any, path: KeyPath | None) -> Any:
        if isinstance(obj, torch.Tensor):  # Parameter and other subclasses
            return self.tensor(obj, path)
        if isinstance(obj, Mapping):
            return self.mapping(obj, path)
        if isinstance(obj, tuple):
            return self.tuple_(obj, path)
        if isinstance(obj, list):
            return self.list_(obj, path)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return self.dataclass(obj, path)
        return self.opaque(obj)

    # -- walking --------------------------------------------------------------------------
    def _skipped(self, key: Any, path: KeyPath | None) -> bool:
        if key in self._skip_names:
            return True
        return path is not None and path in self._skip_paths

    def walk(self, obj: Any, path: KeyPath | None) -> Any:
        kind = type(obj)
        if kind is _Tensor:
            return self.tensor(obj, path)
        if kind is dict:
            return self.mapping(obj, path)
        if kind is list:
            return self.list_(obj, path)
        if kind is tuple:
            return self.tuple_(obj, path)
        if kind in _LEAVES:
            return obj
        return self.other(obj, path)

    def _child(self, value: Any, key: Any, path: KeyPath | None) -> Any:
        if path is None:  # no skip rules: the fast path
            return self.walk(value, None)
        sub = (*path, key)
        if self._skipped(key, sub):
            return value
        return self.walk(value, sub)

    def mapping(self, obj: Mapping[Any, Any], path: KeyPath | None) -> Any:
        changed: dict[Any, Any] = {}
        walk = self.walk
        for key, value in obj.items():
            moved = walk(value, None) if path is None else self._child(value, key, path)
            if moved is not value:
                changed[key] = moved
        if not changed:
            return obj
        if type(obj) is dict:
            return {key: changed.get(key, value) for key, value in obj.items()}
        if isinstance(obj, dict):
            # A shallow copy keeps the subclass, defaultdict's factory and OrderedDict's order.
            new = copy.copy(obj)
            new.update(changed)
            return new
        rebuilt = {key: changed.get(key, value) for key, value in obj.items()}
        return type(obj)(rebuilt)  # type: ignore[call-arg]

    def _items(self, obj: Iterable[Any], path: KeyPath | None) -> list[Any] | None:
        if path is None:
            walk = self.walk
            out = [walk(value, None) for value in obj]
        else:
            out = [self._child(value, i, path) for i, value in enumerate(obj)]
        if all(new is old for new, old in zip(out, obj, strict=True)):
            return None
        return out

    def list_(self, obj: list[Any], path: KeyPath | None) -> Any:
        out = self._items(obj, path)
        if out is None:
            return obj
        return out if type(obj) is list else type(obj)(out)

    def tuple_(self, obj: tuple[Any, ...], path: KeyPath | None) -> Any:
        if hasattr(obj, "_fields"):  # namedtuple: children are named by field
            values = [self._child(getattr(obj, field), field, path) for field in obj._fields]
            if all(new is old for new, old in zip(values, obj, strict=True)):
                return obj
            return type(obj)(*values)
        out = self._items(obj, path)
        if out is None:
            return obj
        return tuple(out) if type(obj) is tuple else type(obj)(out)

    def dataclass(self, obj: Any, path: KeyPath | None) -> Any:
        changed = {}
        for name in _field_names(type(obj)):  # type: ignore[arg-type]
            value = getattr(obj, name)
            moved = self._child(value, name, path)
            if moved is not value:
                changed[name] = moved
        if not changed:
            return obj
        # copy + object.__setattr__ works for frozen dataclasses and init=False fields alike.
        new = copy.copy(obj)
        for name, value in changed.items():
            object.__setattr__(new, name, value)
        return new


class _Mover(_Walker):
    """One ``to_device`` call: its settings, and how it moves a tensor or a module."""

    __slots__ = ("_nb", "_pin", "_target", "_target_is_cuda")

    def __init__(
        self,
        target: torch.device,
        non_blocking: bool | Literal["auto"],
        pin: bool,
        skip_names: frozenset[Any],
        skip_paths: frozenset[KeyPath],
    ) -> None:
        super().__init__(skip_names, skip_paths)
        self._target = target
        self._target_is_cuda = target.type == "cuda"
        self._nb = non_blocking
        self._pin = pin and self._target_is_cuda

    def tensor(self, t: torch.Tensor, path: KeyPath | None) -> torch.Tensor:
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
        if isinstance(obj, nn.Module):
            return obj.to(self._target)
        to = getattr(obj, "to", None)
        if callable(to) and not isinstance(obj, type):
            try:
                return to(self._target, non_blocking=self._nb is True)
            except TypeError:  # a .to() that takes only the device
                return to(self._target)
        return obj


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    # dataclasses.fields() rebuilds its tuple on every call; a batch holds many of one type.
    return tuple(field.name for field in dataclasses.fields(kind))


_Tensor = torch.Tensor  # a module-level name is found faster than torch.Tensor in the hot loop
_LEAVES: frozenset[type] = frozenset(
    {str, bytes, int, float, bool, complex, type(None), torch.device, torch.dtype, range, slice}
)


def _parse_skip(skip: Iterable[Any]) -> tuple[frozenset[Any], frozenset[KeyPath]]:
    if isinstance(skip, (str, bytes)):
        skip = (skip,)
    names: set[Any] = set()
    paths: set[KeyPath] = set()
    for entry in skip:
        if isinstance(entry, tuple):
            paths.add(entry)
        elif isinstance(entry, str) and "." in entry:
            paths.add(tuple(int(p) if p.isdigit() else p for p in entry.split(".")))
        elif isinstance(entry, (str, int)):
            names.add(entry)
        else:
            raise InvalidArgumentError(
                f"skip entry {entry!r} is neither a key, a dotted key path, nor a tuple path.",
                hint='Use "labels" (a key at any depth), "batch.meta.ids" or ("batch", 0).',
            )
    return frozenset(names), frozenset(paths)


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
    Modules are moved in place and returned.

    ``non_blocking="auto"`` copies asynchronously only from pinned host memory to a GPU, where
    that is both safe and useful; ``pin=True`` pins host tensors first when the target is a GPU.
    ``skip`` leaves alone every value under a key named like an entry (``"labels"``), or at a
    key path from the top (``"meta.ids"`` or ``("meta", "ids")``; list positions are ints).

    >>> import torch
    >>> batch = {"x": torch.ones(2), "ids": [1, 2], "name": "a"}
    >>> to_device(batch, "cpu") is batch
    True
    """
    check_bool("pin", pin)
    if non_blocking != "auto" and non_blocking is not True and non_blocking is not False:
        raise InvalidArgumentError(
            f"non_blocking={non_blocking!r} is not understood.", hint='Use True, False or "auto".'
        )
    target = _parse_device(device)
    names, paths = _parse_skip(skip)
    mover = _Mover(target, non_blocking, pin, names, paths)
    walked: T = mover.walk(obj, () if (names or paths) else None)
    return walked
