"""A DCP folder's ``.metadata``, read as a stranger's file: unpickled with an allow-list, then
every field checked and rebuilt.

torch reads that pickle with plain :mod:`pickle`, which runs whatever code a hostile file names;
here it is read with an unpickler that knows only DCP's metadata classes, torch's sizes, dtypes
and layouts, paths and plain containers, so a DCP folder loads without ``trust=True`` and a
hostile one runs no code.

An unpickler that builds only allowed classes still lets a file choose their contents (pickle's
BUILD sets any attribute, even a ``PosixPath``'s slots), so nothing of the unpickled object is
used as it is: :func:`_checked` reads every field by exact type and range, checks the sizes
against the bytes that hold them, and builds new metadata objects from those plain values.
:func:`read_metadata` returns only that rebuilt copy.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import sys
from collections import OrderedDict
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from gpukit import untrusted
from gpukit.checkpoint.paths import fs_error, open_content
from gpukit.errors import CheckpointError
from gpukit.untrusted import InvalidInput

__all__ = ["read_metadata", "set_path"]

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Where releases before 2.2 kept TensorProperties.
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties", "MEM_FORMAT_ENCODING"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


def _enum_member(cls: object, name: object) -> Enum:
    """``getattr(cls, name)`` for the one use pickle makes of it: an allowed enum's member.

    Early Python 3.11 releases (3.11.2, Debian 12's python3, among them) pickle an enum member as
    ``builtins.getattr(<enum class>, "<name>")``; any other attribute of any other object is
    refused, since getattr of an allowed class could hand pickle one of its methods to call.
    """
    if not (isinstance(cls, type) and issubclass(cls, Enum) and cls in _allowed_enums()):
        raise pickle.UnpicklingError("refused getattr of something other than an allowed enum")
    if type(name) is not str or name not in cls.__members__:
        raise pickle.UnpicklingError("refused getattr of a name that is not an enum member")
    member: Enum = cls.__members__[name]
    return member


def _allowed_enums() -> set[type]:
    """The enums of the allow-list among the modules imported so far (find_class imports the
    module of every class it allows, so an enum that reached getattr is among them)."""
    found: set[type] = set()
    for module, names in _DCP_CLASSES.items():
        for name in names:
            value = getattr(sys.modules.get(module), name, None)
            if isinstance(value, type) and issubclass(value, Enum):
                found.add(value)
    return found


# Globals that pickle calls with a container and that copy it: counted, so that a small file
# calling list(big_list) a million times is refused before it fills the memory.
_COPYING = {"set", "frozenset", "tuple", "list", "dict", "OrderedDict", "Size"} | set(
    _DCP_CLASSES["pathlib"]
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses every other global (so no code can run).

    What the allowed constructors copy is bounded by the size of the file, so a few kilobytes
    cannot build gigabytes.
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._budget = len(data) + 1024

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            found = super().find_class(module, name)
            return self._counted(found) if name in _COPYING else found
        if module == "builtins" and name == "getattr":
            return _enum_member
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size":
                return self._counted(torch.Size)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"refused global {module}.{name}")

    def _counted(self, make: Any) -> Any:
        def build(*args: Any) -> Any:
            self._budget -= len(args)
            for arg in args:
                if isinstance(arg, list | tuple | set | frozenset | dict):
                    self._budget -= len(arg)
            if self._budget < 0:
                raise pickle.UnpicklingError("refused: it builds far more than its own size")
            return make(*args)

        return build

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id")


_METADATA_LIMIT = 1 << 30
"""The largest ``.metadata`` read (a 400B-parameter run's is tens of megabytes)."""
_MAX_ENTRIES = 1 << 22
_MAX_CHUNKS = 1 << 16
_MAX_DIMS = 64
_MAX_ELEMENTS = 1 << 62
_NAME_LIMIT = 4096
_DTYPE_NAMES = (
    "float64 float32 float16 bfloat16 complex128 complex64 complex32 "
    "int64 int32 int16 int8 uint64 uint32 uint16 uint8 bool "
    "float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu"
)
_DTYPES = {
    dtype
    for name in _DTYPE_NAMES.split()
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.preserve_format)


def read_metadata(path: Path) -> Any:
    fd = open_content(path, folder=path.parent)
    try:
        data = untrusted.read_bounded(fd, _METADATA_LIMIT)
    except OSError as exc:
        raise fs_error(path, exc, "read") from None
    except InvalidInput as exc:
        raise CheckpointError(
            f"{path} is not DCP metadata gpukit reads: {exc}.",
            hint="A DCP .metadata file is far smaller; copy the folder again.",
        ) from None
    finally:
        os.close(fd)
    try:
        metadata = _MetadataUnpickler(data).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} is not plain DCP metadata: {untrusted.printable(str(exc))}. It was not run.",
            hint="A DCP .metadata file holds only DCP's own classes; this one names other code. "
            "If you made it, re-save the checkpoint with torch.distributed.checkpoint.save.",
        ) from None
    except Exception as exc:  # a damaged pickle raises nearly anything
        raise CheckpointError(
            f"{path} cannot be read as DCP metadata ({type(exc).__name__}).",
            hint="The file is probably truncated or corrupted; copy the folder again.",
        ) from None
    try:
        return _checked(metadata)
    except InvalidInput as exc:
        raise CheckpointError(
            f"{path} is not valid DCP metadata: {exc}.",
            hint="The file is corrupted or was not written by torch.distributed.checkpoint; "
            "copy the folder again.",
        ) from None


# --- checking the unpickled metadata ------------------------------------------------------------


def _fields(obj: object, cls: type, what: str) -> dict[str, Any]:
    """The attributes pickle gave ``obj``, which must be exactly a ``cls``."""
    if type(obj) is not cls:
        raise InvalidInput(f"{what} is not a {cls.__name__}")
    state = getattr(obj, "__dict__", None)
    return dict(state) if type(state) is dict else {}


def _mapping(value: object, what: str) -> dict[Any, Any]:
    if type(value) not in (dict, OrderedDict):
        raise InvalidInput(f"{what} is not a mapping")
    assert isinstance(value, dict)
    if len(value) > _MAX_ENTRIES:
        raise InvalidInput(f"{what} has more than {_MAX_ENTRIES} entries")
    return dict(value)


def _sizes(value: object, what: str) -> tuple[int, ...]:
    if type(value) not in (torch.Size, tuple, list):
        raise InvalidInput(f"{what} is not a size")
    assert isinstance(value, tuple | list)
    if len(value) > _MAX_DIMS:
        raise InvalidInput(f"{what} has more than {_MAX_DIMS} dimensions")
    return tuple(untrusted.as_int(n, high=_MAX_ELEMENTS, what=what) for n in value)


def _numel(sizes: tuple[int, ...], what: str) -> int:
    total = 1
    for n in sizes:
        total *= n
        if total > _MAX_ELEMENTS:
            raise InvalidInput(f"{what} has more elements than any tensor can")
    return total


def _bool(value: object, what: str) -> bool:
    if type(value) is not bool:
        raise InvalidInput(f"{what} is not true or false")
    return value


def _properties(value: object, what: str) -> Any:
    from torch.distributed.checkpoint.metadata import TensorProperties

    got = _fields(value, TensorProperties, what)
    dtype, layout, memory_format = (got.get(n) for n in ("dtype", "layout", "memory_format"))
    if type(dtype) is not torch.dtype or dtype not in _DTYPES:
        raise InvalidInput(f"{what} has a dtype gpukit does not read")
    if layout is not torch.strided:
        raise InvalidInput(f"{what} has a layout other than strided")
    if memory_format not in _MEMORY_FORMATS:
        raise InvalidInput(f"{what} has an unknown memory format")
    return TensorProperties(
        dtype=dtype,
        layout=torch.strided,
        requires_grad=_bool(got.get("requires_grad", False), what),
        memory_format=memory_format,
        pin_memory=_bool(got.get("pin_memory", False), what),
    )


def _tensor_entry(value: object, what: str) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    got = _fields(value, TensorStorageMetadata, what)
    properties = _properties(got.get("properties"), what)
    size = _sizes(got.get("size"), f"{what}'s size")
    if _numel(size, what) * properties.dtype.itemsize > _MAX_ELEMENTS:
        raise InvalidInput(f"{what} has more bytes than any tensor can")
    chunks = []
    for chunk in untrusted.as_list(got.get("chunks"), limit=_MAX_CHUNKS, what=f"{what}'s chunks"):
        parts = _fields(chunk, ChunkStorageMetadata, f"a chunk of {what}")
        offsets = _sizes(parts.get("offsets"), f"a chunk offset of {what}")
        sizes = _sizes(parts.get("sizes"), f"a chunk size of {what}")
        if not len(offsets) == len(sizes) == len(size) or any(
            o + n > full for o, n, full in zip(offsets, sizes, size, strict=True)
        ):
            raise InvalidInput(f"a chunk of {what} lies outside the tensor")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)


def _storage_key(value: object) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    got = _fields(value, MetadataIndex, "a storage key")
    fqn = untrusted.as_str(got.get("fqn"), limit=_NAME_LIMIT, what="a storage key's name")
    offset = got.get("offset")
    index = got.get("index")
    return MetadataIndex(
        fqn,
        None if offset is None else _sizes(offset, f"the storage offset of {fqn!r}"),
        None if index is None else untrusted.as_int(index, high=_MAX_CHUNKS, what="a chunk index"),
    )


def _storage_info(value: object, what: str) -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    got = _fields(value, _StorageInfo, what)
    name = untrusted.as_str(got.get("relative_path"), limit=255, what=f"{what}'s file")
    # Data files are plain names in the folder: a metadata file cannot point elsewhere.
    if not name.isprintable() or "/" in name or "\\" in name or name in {"", ".", ".."}:
        shown = untrusted.printable(name)
        raise InvalidInput(f"{what} points at {shown!r}, not a data file in its folder")
    transforms = got.get("transform_descriptors")
    if transforms is not None:
        if type(transforms) not in (list, tuple):
            raise InvalidInput(f"{what}'s transforms are not a list")
        assert isinstance(transforms, list | tuple)
        transforms = [
            untrusted.as_str(t, limit=256, what=f"{what}'s transform") for t in transforms
        ]
        if len(transforms) > 16:
            raise InvalidInput(f"{what} has more than 16 transforms")
    return _StorageInfo(
        name,
        untrusted.as_int(got.get("offset"), high=_MAX_ELEMENTS, what=f"{what}'s offset"),
        untrusted.as_int(got.get("length"), high=_MAX_ELEMENTS, what=f"{what}'s length"),
        transform_descriptors=transforms or None,
    )


def _planner_paths(value: object, keys: list[str]) -> dict[str, tuple[str | int, ...]]:
    """Where each entry sat in the saved nested dict, each step checked; bounded list indices."""
    if value is None:
        return {}
    paths: dict[str, tuple[str | int, ...]] = {}
    for key, path in _mapping(value, "planner_data").items():
        name = untrusted.as_str(key, limit=_NAME_LIMIT, what="a planner_data key")
        if type(path) not in (tuple, list) or not 1 <= len(path) <= untrusted.DEPTH:
            raise InvalidInput(f"the path of {name!r} is not 1 to {untrusted.DEPTH} steps")
        steps: list[str | int] = []
        for step in path:
            if type(step) is int:
                steps.append(untrusted.as_int(step, high=len(keys), what=f"a step of {name!r}"))
            else:
                steps.append(untrusted.as_str(step, limit=_NAME_LIMIT, what=f"a step of {name!r}"))
        paths[name] = tuple(steps)
    # Every list the paths make is as long as its highest index: bound them all together.
    longest: dict[tuple[str | int, ...], int] = {}
    for key in keys:
        path = paths.get(key, (key,))
        for i, step in enumerate(path):
            if type(step) is int:
                longest[path[:i]] = max(longest.get(path[:i], 0), step + 1)
    if sum(longest.values()) > 2 * len(keys) + 1024:
        raise InvalidInput("planner_data makes lists far longer than the entries they hold")
    shape: dict[str, Any] = {}
    for key in keys:
        set_path(shape, paths.get(key, (key,)), _PLACED)
    return paths


_PLACED = object()


def _checked(metadata: object) -> Any:
    """A new ``Metadata`` made only of checked plain values; InvalidInput for anything else."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        StorageMeta,
        TensorStorageMetadata,
    )

    got = _fields(metadata, Metadata, "the file")
    entries: dict[str, Any] = {}
    for key, item in _mapping(got.get("state_dict_metadata"), "state_dict_metadata").items():
        name = untrusted.as_str(key, limit=_NAME_LIMIT, what="an entry's name")
        if type(item) is BytesStorageMetadata:
            entries[name] = BytesStorageMetadata()
        else:
            entries[name] = _tensor_entry(item, f"entry {name!r}")
    storage: dict[Any, Any] = {}
    for key, info in _mapping(got.get("storage_data"), "storage_data").items():
        index = _storage_key(key)
        storage[index] = _storage_info(info, f"the storage of {index.fqn!r}")
    for name, item in entries.items():
        if isinstance(item, TensorStorageMetadata):
            _check_chunks_stored(name, item, storage)
        elif storage.get(_index(name)) is None:
            raise InvalidInput(f"entry {name!r} has no storage")
    planner = _planner_paths(got.get("planner_data"), list(entries))
    version = got.get("version")
    return Metadata(
        state_dict_metadata=entries,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=None if version is None else untrusted.as_str(version, limit=64, what="version"),
    )


def _index(name: str, offset: tuple[int, ...] | None = None) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(name, offset)


def _check_chunks_stored(name: str, item: Any, storage: dict[Any, Any]) -> None:
    """Each chunk has its storage, and stored plainly it cannot be larger than its bytes: a
    tensor's size is bounded by the data that holds it, never by what the metadata claims."""
    itemsize = item.properties.dtype.itemsize
    covered = 0
    for chunk in item.chunks:
        info = storage.get(_index(name, tuple(chunk.offsets)))
        if info is None:
            raise InvalidInput(f"a chunk of entry {name!r} has no storage")
        elements = _numel(tuple(chunk.sizes), f"entry {name!r}")
        if info.transform_descriptors is None and elements * itemsize > info.length:
            raise InvalidInput(f"entry {name!r} claims more data than its storage holds")
        covered += elements
    if covered < _numel(tuple(item.size), f"entry {name!r}"):
        raise InvalidInput(f"entry {name!r} is larger than its chunks")


def set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in a nested dict, making dicts (lists for int steps) on the way.

    A path that goes through a value another path put, or uses an index on a dict (a name on
    a list), is an :class:`~gpukit.untrusted.InvalidInput`: DCP's paths never do.
    """
    node: Any = root
    for step, following in itertools.pairwise(path):
        empty: Any = [] if type(following) is int else {}
        slot = _slot(node, step)
        if slot is None:
            _put(node, step, empty)
            node = empty
        elif type(slot) is type(empty) and slot is not value:
            node = slot
        else:
            raise InvalidInput(f"two entries claim the place {step!r}")
    if _slot(node, path[-1]) is not None:
        raise InvalidInput(f"two entries claim the place {path[-1]!r}")
    _put(node, path[-1], value)


def _slot(node: Any, step: Any) -> Any:
    if type(node) is list and type(step) is int:
        return node[step] if step < len(node) else None
    if type(node) is dict and type(step) is str:
        return node.get(step)
    raise InvalidInput(f"the step {step!r} does not fit the {type(node).__name__} it reaches")


def _put(node: Any, step: Any, value: Any) -> None:
    if type(node) is list:
        node.extend([None] * (step + 1 - len(node)))
        node[step] = value
    else:
        node[step] = value
