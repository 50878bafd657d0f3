"""torch.distributed.checkpoint (DCP) folders, read on one process without a process group.

A DCP folder (written by ``torch.distributed.checkpoint.save``, FSDP, torchtitan) holds a
``.metadata`` pickle that lists every entry, its shape and which ``*.distcp`` file holds each
chunk. torch reads that pickle with plain :mod:`pickle`, which runs whatever code a hostile file
names; here it is read with an unpickler that knows only DCP's metadata classes, torch's sizes,
dtypes and layouts, paths and plain containers, so a DCP folder loads without ``trust=True`` and a
hostile one runs no code. The tensors themselves are then read by torch's own planner, straight
into the given tensors, one file at a time.
"""

from __future__ import annotations

import io
import itertools
import pickle
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpukit.checkpoint.paths import check_input, fs_error
from gpukit.errors import CheckpointError

__all__ = ["METADATA_NAME", "DcpFolder", "is_dcp_folder", "open_dcp", "set_path"]

METADATA_NAME = ".metadata"

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


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses every other global (so no code can run)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(
                value, (torch.dtype, torch.layout, torch.memory_format)
            ):
                return value
        raise pickle.UnpicklingError(f"refused global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id")


def is_dcp_folder(folder: Path) -> bool:
    """A folder with DCP's ``.metadata`` file."""
    return (folder / METADATA_NAME).is_file()


def _read_metadata(path: Path) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise fs_error(path, exc, "read") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} is not plain DCP metadata: {exc}. It was not run.",
            hint="A DCP .metadata file holds only DCP's own classes; this one names other code. "
            "If you made it, re-save the checkpoint with torch.distributed.checkpoint.save.",
        ) from None
    except Exception as exc:  # a damaged pickle raises nearly anything
        raise CheckpointError(
            f"{path} cannot be read as DCP metadata ({type(exc).__name__}: {exc}).",
            hint="The file is probably truncated or corrupted; copy the folder again.",
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not DCP metadata.",
            hint="Pass a folder written by torch.distributed.checkpoint.save.",
        )
    return metadata


@dataclass
class DcpFolder:
    """A checked DCP folder: its entries, files and the nested structure that was saved."""

    folder: Path
    metadata: Any
    files: dict[str, int] = field(default_factory=dict)  # data file name -> size

    @property
    def tensors(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """Every tensor entry (flattened key) with its full shape and dtype."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return {
            key: (list(item.size), item.properties.dtype)
            for key, item in self.metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }

    def path_of(self, key: str) -> tuple[Any, ...]:
        """Where ``key`` sat in the saved nested dict: ``("model", "0.weight")``."""
        found = (self.metadata.planner_data or {}).get(key)
        return tuple(found) if isinstance(found, (tuple, list)) and found else (key,)

    def _reader(self) -> Any:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        checked = self.metadata

        class _CheckedReader(FileSystemReader):
            # torch's reader unpickles .metadata with plain pickle; it gets the checked copy.
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                return checked

        return _CheckedReader(str(self.folder))

    def read_into(self, targets: Mapping[str, list[torch.Tensor]], *, trust: bool) -> None:
        """Copy each tensor entry into its targets, through torch's DCP planner, in place."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        first = {key: tensors[0].detach() for key, tensors in targets.items() if tensors}
        with torch.no_grad(), warnings.catch_warnings():
            # One process without a process group is exactly what is meant here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp_load(first, storage_reader=self._reader(), no_dist=True)
            except CheckpointError:
                raise
            except Exception as exc:  # torch wraps reader errors in CheckpointException
                raise CheckpointError(
                    f"{self.folder} cannot be read as a DCP checkpoint "
                    f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}).",
                    hint="A data file is probably truncated or corrupted; copy the folder again.",
                ) from None
            for tensors in targets.values():
                for extra in tensors[1:]:
                    extra.copy_(tensors[0])

    def read_all(
        self, *, trust: bool, skip: str | None = None, only: Collection[str] | None = None
    ) -> dict[str, Any]:
        """The saved nested dict, tensors on the CPU (the whole checkpoint in memory).

        ``skip`` leaves out one top-level entry (the weights, already in a model); ``only``
        reads just the entries under those top-level keys, so that what is not wanted (an
        optimizer's pickled state) is never unpickled. Non-tensor entries are pickles inside
        the data files: read with ``weights_only`` unless ``trust``.
        """
        wanted = [
            k
            for k in self.metadata.state_dict_metadata
            if self.path_of(k)[0] != skip and (only is None or self.path_of(k)[0] in only)
        ]
        shapes = self.tensors
        tensors = {
            key: torch.empty(shapes[key][0], dtype=shapes[key][1])
            for key in wanted
            if key in shapes
        }
        if tensors:
            self.read_into({key: [value] for key, value in tensors.items()}, trust=trust)
        flat: dict[str, Any] = dict(tensors)
        flat.update(self._read_objects(set(wanted), trust))
        nested: dict[str, Any] = {}
        for key in wanted:
            if key in flat:
                set_path(nested, self.path_of(key), flat[key])
        return nested

    def _read_objects(self, wanted: set[str], trust: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        objects: dict[str, Any] = {}
        for index, info in self.metadata.storage_data.items():
            item = self.metadata.state_dict_metadata.get(index.fqn)
            if index.fqn not in wanted or not isinstance(item, BytesStorageMetadata):
                continue
            path = self.folder / str(info.relative_path)
            with path.open("rb") as handle:
                handle.seek(info.offset)
                data = handle.read(info.length)
            try:
                objects[index.fqn] = torch.load(io.BytesIO(data), weights_only=not trust)
            except pickle.UnpicklingError as exc:
                from gpukit.checkpoint.io import untrusted_error

                raise untrusted_error(path, exc) from None
        return objects


def set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` in a nested dict, making dicts (lists for int steps) on the way."""
    node: Any = root
    for step, following in itertools.pairwise(path):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            while len(node) <= step:
                node.append(None)
            if node[step] is None:
                node[step] = empty
            node = node[step]
        else:
            node = node.setdefault(step, empty)
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
        node[last] = value
    else:
        node[last] = value


def open_dcp(folder: Path) -> DcpFolder:
    """Read and check a DCP folder's metadata and data files (names, presence, lengths)."""
    metadata = _read_metadata(folder / METADATA_NAME)
    found = DcpFolder(folder, metadata)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        # Data files are plain names in the folder: a metadata file cannot point elsewhere.
        if not name or "/" in name or "\\" in name or name in {".", ".."}:
            raise CheckpointError(
                f"{folder / METADATA_NAME} points at {name!r}, not a data file in {folder}.",
                hint="Refused: a DCP checkpoint's data files sit next to its .metadata.",
            )
        end = int(info.offset) + int(info.length)
        needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        path = folder / name
        if not path.exists():
            raise CheckpointError(
                f"{path} is missing: {folder / METADATA_NAME} lists it as a data file of this "
                "checkpoint.",
                hint="Copy the whole folder again; every .distcp file is needed.",
            )
        size = check_input(path).st_size
        if size < end:
            raise CheckpointError(
                f"{path} ({size} bytes) is cut short: {folder / METADATA_NAME} places data up to "
                f"byte {end}.",
                hint="The file is truncated (an interrupted copy); copy the folder again.",
            )
        found.files[name] = size
    return found
