"""The one walk over nested data: containers, key paths, and rebuilding with identity kept.

Every part of gpukit that looks inside a batch (``to_device``, scatter and gather, the device
doctor, ``gather_for_metrics``, the distributed loader) walks it with this module, so they all
agree on what a container is:

- mappings: ``dict`` and its subclasses (``OrderedDict``, ``defaultdict`` keep their type and
  factory), other ``Mapping`` types rebuilt from a dict;
- ``list`` and ``tuple`` (and subclasses built from an iterable);
- namedtuples, rebuilt by field;
- dataclass instances (frozen too), copied with their changed fields set; values that a
  ``functools.cached_property`` computed from the old fields are dropped from the copy.

Everything else is a leaf. A key path is the tuple of keys, list positions and field names from
the top. A container in which nothing changed comes back as the very same object; a structure
that contains itself is refused with a typed error naming where it loops.

:func:`tree_map` is the public face (``gk.tree_map``); the rest is for gpukit's own walkers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from operator import is_
from typing import Any, TypeVar

import torch

from gpukit.errors import InvalidArgumentError

T = TypeVar("T")
KeyPath = tuple[Any, ...]

__all__ = [
    "DATACLASS",
    "LEAF",
    "MAPPING",
    "NAMEDTUPLE",
    "SEQUENCE",
    "KeyPath",
    "child",
    "children",
    "format_path",
    "guarded",
    "is_namedtuple",
    "leaves_with_paths",
    "map_with_paths",
    "mapper",
    "rebuild",
    "tree_map",
    "walk_kind",
]

# What a type is to the walk. Plain ints: they are compared on the hot path.
LEAF, MAPPING, SEQUENCE, NAMEDTUPLE, DATACLASS = range(5)

_KINDS: dict[type, int] = {}
_KINDS_LIMIT = 4096  # types made on the fly (namedtuples in a loop) must not grow it forever
# Leaves met in every batch, decided without a lookup.
_ATOMS: frozenset[type] = frozenset(
    {str, bytes, int, float, bool, complex, type(None), torch.device, torch.dtype, range, slice}
)


def _classify(kind: type) -> int:
    if issubclass(kind, torch.Tensor):
        return LEAF
    if issubclass(kind, Mapping):
        return MAPPING
    if issubclass(kind, tuple):
        # The one namedtuple test: a tuple type with the _fields that namedtuple() gives it.
        return NAMEDTUPLE if hasattr(kind, "_fields") else SEQUENCE
    if issubclass(kind, list):
        return SEQUENCE
    if dataclasses.is_dataclass(kind):
        return DATACLASS
    return LEAF


def walk_kind(obj: object) -> int:
    """What ``obj`` is to the walk: ``LEAF``, ``MAPPING``, ``SEQUENCE``, ``NAMEDTUPLE``..."""
    kind = type(obj)
    found = _KINDS.get(kind)
    if found is None:
        if len(_KINDS) >= _KINDS_LIMIT:
            _KINDS.clear()
        found = _KINDS[kind] = _classify(kind)
    return found


def is_namedtuple(obj: object) -> bool:
    """Whether ``obj`` is an instance of a ``collections.namedtuple`` or ``typing.NamedTuple``."""
    return walk_kind(obj) == NAMEDTUPLE


@functools.cache
def _field_names(kind: type) -> tuple[str, ...]:
    # dataclasses.fields() rebuilds its tuple on every call; a batch holds many of one type.
    return tuple(field.name for field in dataclasses.fields(kind))


@functools.cache
def _cached_properties(kind: type) -> tuple[str, ...]:
    """Names of ``functools.cached_property`` attributes of ``kind`` (they cache in __dict__)."""
    names = {
        name
        for klass in kind.__mro__
        for name, value in vars(klass).items()
        if isinstance(value, functools.cached_property)
    }
    return tuple(sorted(names))


def children(obj: Any, kind: int) -> list[tuple[Any, Any]]:
    """The ``(key, value)`` pairs of a container, in walk order."""
    if kind == MAPPING:
        return list(obj.items())
    if kind == SEQUENCE:
        return list(enumerate(obj))
    if kind == NAMEDTUPLE:
        return list(zip(obj._fields, obj, strict=True))
    if kind == DATACLASS:
        return [(name, getattr(obj, name)) for name in _field_names(_type(obj))]
    return []


def _type(obj: object) -> type:
    return type(obj)


def _values(obj: Any, kind: int) -> Any:
    """The values of a container in :func:`children` order (a tuple is its own values)."""
    if kind == MAPPING:
        return list(obj.values())
    if kind == DATACLASS:
        return [getattr(obj, name) for name in _field_names(_type(obj))]
    return obj


def child(obj: Any, kind: int, key: Any) -> Any:
    """The value under ``key`` in a container of this kind."""
    if kind in (MAPPING, SEQUENCE):
        return obj[key]
    return getattr(obj, key)


def rebuild(obj: Any, kind: int, values: list[Any]) -> Any:
    """A container like ``obj`` holding ``values`` (in :func:`children` order) instead.

    Mappings keep their type (a shallow copy keeps a dict subclass's own state, such as
    defaultdict's factory); a dataclass is copied, its fields set even when frozen, and values
    its cached properties computed from the old fields are dropped, so they are recomputed.
    """
    cls: type = type(obj)
    if kind == MAPPING:
        if cls is dict:
            return dict(zip(obj, values, strict=True))
        if isinstance(obj, dict):
            new = copy.copy(obj)
            # Key by key, through the subclass's own __setitem__: transformers' ModelOutput
            # refuses update() and keeps its attributes in step with its keys there.
            for key, value in zip(obj, values, strict=True):
                new[key] = value
            return new
        return cls(dict(zip(obj, values, strict=True)))
    if kind == SEQUENCE:
        return cls(values)
    if kind == NAMEDTUPLE:
        return cls(*values)
    if kind == DATACLASS:
        new = copy.copy(obj)
        for name, value in zip(_field_names(cls), values, strict=True):
            # object.__setattr__ works for frozen dataclasses and init=False fields alike.
            object.__setattr__(new, name, value)
        state = getattr(new, "__dict__", None)
        if state is not None:
            for name in _cached_properties(cls):
                state.pop(name, None)
        return new
    raise AssertionError(f"rebuild of a leaf ({cls.__name__})")


def format_path(path: KeyPath, root: str = "inputs", data: Any = None) -> str:
    """``("x", 0, "ids")`` as ``inputs['x'][0]['ids']``, for error messages.

    Given the ``data`` the path is in, fields of namedtuples and dataclasses read as
    attributes: ``inputs['pair'].left``.
    """
    parts = [root]
    node = data
    for key in path:
        kind = walk_kind(node) if data is not None else MAPPING
        parts.append(f".{key}" if kind in (NAMEDTUPLE, DATACLASS) else f"[{key!r}]")
        if data is not None:
            node = child(node, kind, key)
    return "".join(parts)


# -- mapping --------------------------------------------------------------------------------
LeafFn = Callable[[Any], Any]


def _check_types(types: object) -> tuple[type, ...]:
    if isinstance(types, type):
        return (types,)
    if isinstance(types, tuple) and types and all(isinstance(t, type) for t in types):
        return types
    raise InvalidArgumentError(
        f"types={types!r} is neither a type nor a tuple of types.",
        hint="Pass the leaf type to map, e.g. types=torch.Tensor or types=(torch.Tensor, int).",
    )


def mapper(leaf: LeafFn, types: type | tuple[type, ...], opaque: LeafFn | None = None) -> LeafFn:
    """A function that rebuilds a structure with ``leaf(x)`` for every ``x`` of ``types``.

    Other leaves go through ``opaque`` (kept as they are when it is None). This is the hot path
    of every training step, so it dispatches on the exact type first and decides what any other
    type is once (:func:`walk_kind`); a container in which nothing changed is returned itself.
    The returned function raises ``RecursionError`` on a cyclic structure: call it through
    :func:`guarded` for a typed error.
    """
    wanted = _check_types(types)
    exact = wanted[0] if len(wanted) == 1 else None
    # Leaves of ``types`` win over containers: with types=Mapping, a dict goes to ``leaf``.
    first = exact is None or any(issubclass(c, wanted) for c in (list, dict, tuple))
    atoms = frozenset(c for c in _ATOMS if not issubclass(c, wanted))

    # The walk is handed itself as its first argument instead of calling itself through its
    # closure: a function whose closure holds the function is a reference cycle, and one such
    # cycle per call would be garbage for the collector on every training step.
    def walk(again: Any, obj: Any) -> Any:
        cls = type(obj)
        if cls is exact:
            return leaf(obj)
        if first and isinstance(obj, wanted):
            return leaf(obj)
        if cls is list:
            out = [leaf(v) if type(v) is exact else again(again, v) for v in obj]
            return obj if all(map(is_, out, obj)) else out
        if cls is dict:
            new = {k: leaf(v) if type(v) is exact else again(again, v) for k, v in obj.items()}
            return obj if all(map(is_, new.values(), obj.values())) else new
        if cls is tuple:
            out = [leaf(v) if type(v) is exact else again(again, v) for v in obj]
            return obj if all(map(is_, out, obj)) else tuple(out)
        if cls in atoms:
            return obj
        if isinstance(obj, wanted):
            return leaf(obj)
        kind = walk_kind(obj)
        if kind == LEAF:
            return obj if opaque is None else opaque(obj)
        old = _values(obj, kind)
        values = [leaf(v) if type(v) is exact else again(again, v) for v in old]
        if all(map(is_, values, old)):
            return obj
        return rebuild(obj, kind, values)

    return functools.partial(walk, walk)


def map_with_paths(
    data: Any,
    leaf: Callable[[KeyPath, Any], Any],
    types: type | tuple[type, ...],
    *,
    keep: Callable[[KeyPath], bool] | None = None,
    opaque: LeafFn | None = None,
) -> Any:
    """Like :func:`mapper`, handing ``leaf`` each value's key path as well; slower.

    ``keep(path)`` true leaves the value at that path (and all under it) as it is.
    """

    wanted = _check_types(types)

    def walk(again: Any, obj: Any, path: KeyPath) -> Any:  # handed itself: see mapper
        if isinstance(obj, wanted):
            return leaf(path, obj)
        kind = walk_kind(obj)
        if kind == LEAF:
            return obj if opaque is None else opaque(obj)
        pairs = children(obj, kind)
        values = [
            value if keep is not None and keep((*path, key)) else again(again, value, (*path, key))
            for key, value in pairs
        ]
        if all(new is old for new, (_, old) in zip(values, pairs, strict=True)):
            return obj
        return rebuild(obj, kind, values)

    return guarded(lambda d: walk(walk, d, ()), data)


def leaves_with_paths(
    data: Any, types: type | tuple[type, ...] | None = torch.Tensor
) -> Iterator[tuple[KeyPath, Any]]:
    """Every leaf of ``types`` (``None``: every leaf) in ``data`` with its key path, in order.

    Walked with an explicit stack, so any depth is fine; a container met again inside itself is
    a typed error naming where.
    """
    stack: list[tuple[KeyPath, Any, int]] = [((), data, 0)]
    on_path: list[int] = []  # ids of the containers from the top down to the current one
    while stack:
        path, obj, depth = stack.pop()
        del on_path[depth:]
        if types is not None and isinstance(obj, types):
            yield path, obj
            continue
        kind = walk_kind(obj)
        if kind == LEAF:
            if types is None:
                yield path, obj
            continue
        if id(obj) in on_path:
            raise _cycle_error(path, on_path.index(id(obj)))
        on_path.append(id(obj))
        pairs = children(obj, kind)
        for key, value in reversed(pairs):
            stack.append(((*path, key), value, depth + 1))


def _cycle_error(path: KeyPath, depth: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"the structure contains itself: {format_path(path, 'data')} is the same container "
        f"as {format_path(path[:depth], 'data')}, so walking it would never end.",
        hint="Pass a tree of containers (each dict, list or dataclass in one place), for "
        "example a copy without the back-reference.",
    )


def _find_cycle(data: Any) -> InvalidArgumentError | None:
    try:
        for _ in leaves_with_paths(data, ()):  # no leaf wanted: only the walk
            pass
    except InvalidArgumentError as exc:
        return exc
    return None


def guarded(walk: Callable[[Any], T], data: Any) -> T:
    """``walk(data)``, with a cyclic ``data`` turned from RecursionError into a typed error.

    Costs nothing on the way in: the structure is searched for a loop only once the recursion
    has failed.
    """
    try:
        return walk(data)
    except RecursionError as exc:
        error = _find_cycle(data)
        if error is None:
            raise
        raise error from exc


def tree_map(
    fn: Callable[[Any], Any], data: T, *, types: type | tuple[type, ...] = torch.Tensor
) -> T:
    """Apply ``fn`` to every leaf of ``types`` in ``data`` and rebuild the structure around it.

    The containers are those of ``gk.to_device``: dict (OrderedDict, defaultdict and other
    subclasses keep their type), other mappings, list, tuple, namedtuple and dataclass (frozen
    too). A leaf of ``types`` is handed to ``fn`` even when it is itself a container; every
    other leaf is kept as it is. Containers in which ``fn`` changed nothing come back as the
    very same objects, so a no-op map copies nothing. A structure that contains itself raises
    :class:`~gpukit.errors.InvalidArgumentError` instead of recursing forever.

    This is what accelerate calls ``recursively_apply`` and Lightning ``apply_to_collection``.

    >>> import torch
    >>> batch = {"x": torch.ones(2), "pair": (torch.zeros(1), "id-7"), "n": 3}
    >>> half = tree_map(lambda t: t.half(), batch)
    >>> half["x"].dtype, half["pair"][1], half["n"]
    (torch.float16, 'id-7', 3)
    >>> tree_map(lambda n: n * 10, [1, (2, "a")], types=int)
    [10, (20, 'a')]

    Args:
        fn: called on each leaf, returns its replacement.
        data: the nested structure.
        types: the leaf types ``fn`` applies to (tensors by default); other leaves are kept.
    """
    if not callable(fn):
        raise InvalidArgumentError(
            f"tree_map got fn={fn!r}, which is not callable.",
            hint="Pass the function first: gk.tree_map(fn, data).",
        )
    mapped: T = guarded(mapper(fn, types), data)
    return mapped
