"""Which checkpoint a path holds, recognised by content, opened as its :class:`Source`.

A path may be a checkpoint file (torch.save or safetensors, whatever its suffix), an index file
(JSON with a ``weight_map``), a DCP ``.metadata`` file, or a folder holding any of these, or the
files of an ``Accelerator.save_state`` (the model's file beside the training state). A folder
is opened without reading its tensors: its source's ``content`` has shape-only (``meta``)
tensors, and the source reads the real ones on demand, one shard at a time.

The kinds of folder are tried in one order, each a function that opens the folder when it is
of its kind and says None otherwise (:data:`_FOLDER_KINDS`): a new layout is one more source
class and one more entry there.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpukit import untrusted
from gpukit.checkpoint.accelerate_state import is_accelerate_state, open_accelerate_state
from gpukit.checkpoint.dcp import METADATA_NAME, is_dcp_folder, open_dcp
from gpukit.checkpoint.digests import SHARED, is_save_folder, verified_save
from gpukit.checkpoint.paths import check_input, check_inside, open_content
from gpukit.checkpoint.sharded import INDEX_LIMIT, INDEX_NAMES, open_index
from gpukit.checkpoint.single_file import SAFETENSORS, TORCH, file_format
from gpukit.checkpoint.single_file import read as read_file
from gpukit.checkpoint.source import Source
from gpukit.errors import CheckpointError

__all__ = ["open_source"]


def _index_data(path: Path, folder: Path | None = None) -> dict[str, Any] | None:
    """The parsed index if ``path`` is one (JSON with a ``weight_map``), else None.

    Opened as all checkpoint content is (a FIFO named config.json is refused, not waited on);
    a JSON file that is too large or malformed is just not an index. What is parsed here is
    handed to the sharded folder, so that the index is read once. An index is the folder of
    its shards' own file: a named one that links out of its folder is refused, as a link in
    the folder is.
    """
    fd = open_content(path, folder=folder)
    try:
        if os.read(fd, 1) != b"{":
            return None
        os.lseek(fd, 0, os.SEEK_SET)
        data = untrusted.parse_json(untrusted.read_bounded(fd, INDEX_LIMIT), limit=INDEX_LIMIT)
        if type(data) is not dict or type(data.get("weight_map")) is not dict:
            return None
        if folder is None:
            check_inside(fd, path, path.parent)
    except (OSError, untrusted.InvalidInput):
        return None
    finally:
        os.close(fd)
    return data


_Opener = Callable[[Path, list[str], torch.device | None, bool], Source | None]
"""Opens a folder of one kind (given its visible file names), or says None: not this kind."""


def _dcp(folder: Path, names: list[str], target: torch.device | None, trust: bool) -> Source | None:
    return open_dcp(folder) if is_dcp_folder(folder) else None


def _sharded(
    folder: Path, names: list[str], target: torch.device | None, trust: bool
) -> Source | None:
    indexes: dict[str, dict[str, Any]] = {}
    for name in names:
        if name.endswith(".json") and (data := _index_data(folder / name, folder)) is not None:
            indexes[name] = data
    # Hugging Face's loaders prefer safetensors when a folder has both layouts.
    chosen = next((name for name in INDEX_NAMES if name in indexes), None)
    if chosen is None and len(indexes) > 1:
        raise CheckpointError(
            f"{folder} holds several checkpoint indexes ({', '.join(indexes)}).",
            hint="Pass the index file of the checkpoint you mean.",
        )
    if chosen is None and indexes:
        chosen = next(iter(indexes))
    if chosen is None:
        return None
    return open_index(folder / chosen, trust=trust, data=indexes[chosen])


def _accelerate(
    folder: Path, names: list[str], target: torch.device | None, trust: bool
) -> Source | None:
    return open_accelerate_state(folder, names, trust=trust) if is_accelerate_state(names) else None


def _single_file(
    folder: Path, names: list[str], target: torch.device | None, trust: bool
) -> Source | None:
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
    if len(singles) > 1:
        raise CheckpointError(
            f"{folder} holds several checkpoint files ({', '.join(singles[:6])}) and no index "
            "that joins them.",
            hint="Pass the file you mean.",
        )
    if not singles:
        return None
    return read_file(folder / singles[0], target=target, trust=trust, folder=folder)


def _training_save(
    folder: Path, names: list[str], target: torch.device | None, trust: bool
) -> Source | None:
    """A save of gk.TrainingState: its digests verified, then the sharded part (a DCP folder)
    or the shared part, whose ``"model"`` entry holds the weights."""
    if not is_save_folder(names):
        return None
    sums = verified_save(folder)
    if any(name.startswith("sharded/") for name in sums):
        return open_dcp(folder / "sharded")
    return read_file(folder / SHARED, target=target, trust=trust, folder=folder)


# Tried in this order: the first kind that recognises the folder opens it.
_FOLDER_KINDS: tuple[_Opener, ...] = (_training_save, _dcp, _sharded, _accelerate, _single_file)


def _folder(folder: Path, target: torch.device | None, trust: bool) -> Source:
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    for kind in _FOLDER_KINDS:
        found = kind(folder, names, target, trust)
        if found is not None:
            return found
    raise CheckpointError(
        f"{folder} holds no checkpoint: no index (*.index.json), no DCP .metadata, no "
        "checkpoint file.",
        hint="Pass the folder that holds the checkpoint, or the checkpoint file itself.",
    )


def open_source(path: Path, *, target: torch.device | None, trust: bool) -> Source:
    """Open whatever checkpoint ``path`` is; a single file is read whole, onto ``target``."""
    info = check_input(path)
    if stat.S_ISDIR(info.st_mode):
        return _folder(path, target, trust)
    if path.name == METADATA_NAME and is_dcp_folder(path.parent):
        return open_dcp(path.parent)
    data = _index_data(path)
    if data is not None:
        return open_index(path, trust=trust, data=data)
    return read_file(path, target=target, trust=trust)
