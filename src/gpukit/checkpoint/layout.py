"""Which checkpoint a path holds, recognised by content: one file, a sharded folder, or DCP.

A path may be a checkpoint file (torch.save or safetensors, whatever its suffix), an index file
(JSON with a ``weight_map``), a DCP ``.metadata`` file, or a folder holding any of these, or the
files of an ``Accelerator.save_state`` (the model's file beside the training state). A folder
is opened without reading its tensors: what :func:`open_checkpoint` returns for it is a
:class:`FolderCheckpoint` whose ``content`` has the saved structure with shape-only (``meta``)
tensors, and which reads the real tensors on demand, one shard at a time.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpukit import untrusted
from gpukit.checkpoint.accelerate_state import (
    WEIGHTS_ENTRY,
    AccelerateState,
    is_accelerate_state,
    open_accelerate_state,
)
from gpukit.checkpoint.dcp import METADATA_NAME, DcpFolder, is_dcp_folder, open_dcp
from gpukit.checkpoint.dcp_metadata import set_path
from gpukit.checkpoint.single_file import SAFETENSORS, TORCH, RawCheckpoint, file_format, gpukit_metadata
from gpukit.checkpoint.single_file import read as read_file
from gpukit.checkpoint.keys import FoundWeights
from gpukit.checkpoint.paths import check_input, open_content
from gpukit.checkpoint.sharded import INDEX_LIMIT, INDEX_NAMES, ShardedFolder, open_index
from gpukit.errors import CheckpointError

__all__ = ["SHARDED_SAFETENSORS", "FolderCheckpoint", "StoredObject", "open_checkpoint"]

SHARDED_SAFETENSORS = "sharded safetensors"
SHARDED_TORCH = "sharded torch"
DCP = "dcp"
ACCELERATE = "accelerate state"


@dataclass
class FolderCheckpoint:
    """A checkpoint folder, opened: its structure (shape-only tensors) and a way to read it."""

    path: Path
    format: str
    content: Any
    source: ShardedFolder | DcpFolder | AccelerateState
    files: dict[str, int]  # every file of the checkpoint, the index last, with its size
    metadata: dict[str, Any] = field(default_factory=dict)
    source_devices: list[str] = field(default_factory=list)
    stored_key: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def index(self) -> str:
        """The name of the file that lists the others (an index JSON, DCP's ``.metadata``)."""
        return list(self.files)[-1]

    @property
    def size(self) -> int:
        """Bytes of all the files that make up the checkpoint."""
        return sum(self.files.values())

    def saved_device(self, tensor: torch.Tensor) -> str | None:
        """The device the tensors were saved from, when every one came from the same."""
        return self.source_devices[0] if len(self.source_devices) == 1 else None

    def key_of(self, tensor: torch.Tensor) -> str:
        """The stored key of one of ``content``'s shape-only tensors."""
        return self.stored_key[id(tensor)]

    def read_into(self, targets: Mapping[str, list[torch.Tensor]], *, trust: bool) -> None:
        """Copy each stored key's tensor into its targets, one shard in memory at a time."""
        self.source.read_into(targets, trust=trust)

    def read_all(self, *, trust: bool) -> Any:
        """The saved structure with real tensors on the CPU (the whole checkpoint in memory)."""
        return self.source.read_all(trust=trust)

    def read_weights(self, found: FoundWeights, *, trust: bool) -> Any:
        """Only the entries that hold the weights ``found`` in ``content``, read, on the CPU.

        Nothing else is read, so the pickled objects beside the weights (an optimizer's, a
        sampler's) are never unpickled for an output that keeps only the weights.
        """
        if isinstance(self.source, DcpFolder):
            keys = {found.container} if found.container is not None else set(found.state)
            return self.source.read_all(trust=trust, only=keys)
        if isinstance(self.source, AccelerateState):
            return self.source.read_all(trust=trust, only={WEIGHTS_ENTRY})
        return self.source.read_all(trust=trust)

    def read_extras(
        self, found: FoundWeights, *, trust: bool
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The entries beside the weights (``found.others``), read on the CPU, and the entries
        left unread with the reason (an accelerate pickle that needs ``trust``)."""
        if not found.others:
            return {}, {}
        if isinstance(self.source, DcpFolder):
            return self.source.read_all(trust=trust, only=set(found.others)), {}
        if isinstance(self.source, AccelerateState):
            return self.source.read_extras(found.others, trust=trust)
        return {}, {}


class StoredObject:
    """A non-tensor entry of a checkpoint folder (an epoch, optimizer settings), not read yet."""

    def __repr__(self) -> str:
        return "object (not read)"


def _shape_only(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _sharded(index: Path, trust: bool) -> FolderCheckpoint:
    folder = open_index(index, trust=trust)
    content: dict[str, torch.Tensor] = {}
    stored: dict[int, str] = {}
    for key, (shape, dtype) in folder.tensors.items():
        content[key] = _shape_only(shape, dtype)
        stored[id(content[key])] = key
    files = {shard.path.name: shard.size for shard in folder.shards}
    files[index.name] = index.stat().st_size
    meta = gpukit_metadata({}, folder.shards[0].metadata) if folder.shards else {}
    fmt = SHARDED_SAFETENSORS if folder.format == SAFETENSORS else SHARDED_TORCH
    devices = [str(d) for d in meta.get("devices", [])] if isinstance(meta, dict) else []
    return FolderCheckpoint(index.parent, fmt, content, folder, files, meta, devices, stored)


def _dcp(folder: Path) -> FolderCheckpoint:
    found = open_dcp(folder)
    content: dict[str, Any] = {}
    stored: dict[int, str] = {}
    tensors = found.tensors
    for key in found.metadata.state_dict_metadata:
        if key in tensors:
            value: Any = _shape_only(*tensors[key])
            stored[id(value)] = key
        else:
            value = StoredObject()
        set_path(content, found.path_of(key), value)
    files = dict(found.files)
    files[METADATA_NAME] = (folder / METADATA_NAME).stat().st_size
    return FolderCheckpoint(folder, DCP, content, found, files, {}, [], stored)


def _accelerate(folder: Path, names: list[str], trust: bool) -> FolderCheckpoint:
    found = open_accelerate_state(folder, names, trust=trust)
    weights = found.weights
    content: dict[str, Any] = {WEIGHTS_ENTRY: weights.content}
    stored: dict[int, str] = {}
    if isinstance(weights.content, Mapping):
        stored = {id(v): str(k) for k, v in weights.content.items() if isinstance(v, torch.Tensor)}
    for name in found.others:
        content[name] = StoredObject()
    devices = list(weights.source_devices)
    meta = dict(weights.metadata)
    return FolderCheckpoint(folder, ACCELERATE, content, found, found.files, meta, devices, stored)


def _is_index(path: Path, folder: Path | None = None) -> bool:
    # Opened as all checkpoint content is (a FIFO named config.json is refused, not waited
    # on); a JSON file that is too large or malformed is just not an index.
    fd = open_content(path, folder=folder)
    try:
        if os.read(fd, 1) != b"{":
            return False
        os.lseek(fd, 0, os.SEEK_SET)
        data = untrusted.parse_json(untrusted.read_bounded(fd, INDEX_LIMIT), limit=INDEX_LIMIT)
    except (OSError, untrusted.InvalidInput):
        return False
    finally:
        os.close(fd)
    return type(data) is dict and type(data.get("weight_map")) is dict


def _folder(folder: Path, trust: bool) -> FolderCheckpoint | RawCheckpoint:
    if is_dcp_folder(folder):
        return _dcp(folder)
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    indexes = [
        name for name in names if name.endswith(".json") and _is_index(folder / name, folder)
    ]
    # Hugging Face's loaders prefer safetensors when a folder has both layouts.
    for preferred in INDEX_NAMES:
        if preferred in indexes:
            return _sharded(folder / preferred, trust)
    if len(indexes) == 1:
        return _sharded(folder / indexes[0], trust)
    if len(indexes) > 1:
        raise CheckpointError(
            f"{folder} holds several checkpoint indexes ({', '.join(indexes)}).",
            hint="Pass the index file of the checkpoint you mean.",
        )
    if is_accelerate_state(names):
        return _accelerate(folder, names, trust)
    singles = []
    for name in names:
        path = folder / name
        info = path.lstat()
        if stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode):
            try:
                if file_format(path, folder=folder) in (SAFETENSORS, TORCH):
                    singles.append(name)
            except OSError:
                continue
    if len(singles) == 1:
        return read_file(
            folder / singles[0], target=torch.device("cpu"), trust=trust, folder=folder
        )
    if singles:
        raise CheckpointError(
            f"{folder} holds several checkpoint files ({', '.join(singles[:6])}) and no index "
            "that joins them.",
            hint="Pass the file you mean.",
        )
    raise CheckpointError(
        f"{folder} holds no checkpoint: no index (*.index.json), no DCP .metadata, no "
        "checkpoint file.",
        hint="Pass the folder that holds the checkpoint, or the checkpoint file itself.",
    )


def open_checkpoint(
    path: Path, *, target: torch.device | None, trust: bool
) -> RawCheckpoint | FolderCheckpoint:
    """Open whatever checkpoint ``path`` is; a single file is read whole, onto ``target``."""
    info = check_input(path)
    if stat.S_ISDIR(info.st_mode):
        found = _folder(path, trust)
        if isinstance(found, RawCheckpoint) and target is not None and target.type != "cpu":
            return read_file(found.path, target=target, trust=trust, folder=path)
        return found
    if path.name == METADATA_NAME and is_dcp_folder(path.parent):
        return _dcp(path.parent)
    if _is_index(path):
        return _sharded(path, trust)
    return read_file(path, target=target, trust=trust)
