"""What a checkpoint holds, described without loading it into anything: gk.checkpoint.describe.

The description is what ``gpukit ckpt show`` prints: the format and layout, the files and their
sizes, what gk.save recorded, where the weights are and what sits beside them, the wrapper
prefixes the keys carry, and every tensor's shape, dtype and saved device. A folder's tensors
are described from its headers without being read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gpukit.checkpoint.keys import clean_keys, find_weights
from gpukit.checkpoint.layout import open_source
from gpukit.checkpoint.single_file import SAFETENSORS, TORCH, TORCH_SUFFIXES
from gpukit.checkpoint.source import Source, StoredObject
from gpukit.errors import check_bool

__all__ = ["SCHEMA", "WRAPPER_OF", "Description", "TensorRow", "describe"]

SCHEMA = "gpukit.ckpt.show/1"
WRAPPER_OF = {
    "module.": "nn.DataParallel or DistributedDataParallel",
    "_orig_mod.": "torch.compile",
    "_fsdp_wrapped_module.": "FullyShardedDataParallel",
    "_checkpoint_wrapped_module.": "activation checkpointing",
    "_forward_module.": "Lightning Fabric",
}
"""The wrapper that puts each prefix into state-dict keys."""


@dataclass(frozen=True)
class TensorRow:
    """One tensor of the weights: its key, shape, dtype, saved device (None: unknown), size."""

    key: str
    shape: list[int]
    dtype: str
    device: str | None
    numel: int


@dataclass(frozen=True)
class Description:
    """What :func:`describe` found: the checkpoint as stored, its weights and what is beside them.

    ``layout`` is ``"file"``, ``"sharded"``, ``"dcp"`` or ``"accelerate"``; ``files`` lists a
    folder's files with their sizes (``index`` names the one listing the others); ``holds`` is
    the type of the checkpoint's top-level object. ``weights_found`` says whether model weights
    were found; ``other_entries`` describes, in a few words each, the entries beside them (every
    entry when no weights were found). ``prefixes`` are the wrapper prefixes the keys carry, and
    ``suffix_mismatch`` says when a file's suffix names another format than its bytes.

    Args:
        path: the checkpoint, as named (a file or a folder).
        format: what the bytes are: ``"safetensors"``, ``"torch"``, ``"sharded safetensors"``,
            ``"sharded torch"``, ``"dcp"`` or ``"accelerate state"``.
        layout: ``"file"``, ``"sharded"``, ``"dcp"`` or ``"accelerate"``.
        size: bytes of all its files.
        metadata: what gk.save recorded (empty when something else wrote it).
        source_devices: the devices the tensors were saved from, where it says so.
        holds: the type name of its top-level object (``"dict"``).
        weights_found: whether model weights were found.
        container_key: the entry the weights are under (``"model"``); None: none.
        weights_at_top_level: whether the weights are top-level tensors beside other entries.
        other_entries: each entry beside the weights (all, without weights), in a few words.
        prefixes: the wrapper prefixes the weights' keys carry (``"module."``).
        suffix_mismatch: a note when the suffix names another format than the bytes; else None.
        tensors: one row per tensor of the weights.
        files: a folder's files and their sizes in bytes (empty for a single file).
        index: the name of the file listing the others; None: there is none.
    """

    path: Path
    format: str
    layout: str
    size: int
    metadata: dict[str, Any]
    source_devices: list[str]
    holds: str
    weights_found: bool
    container_key: str | None
    weights_at_top_level: bool
    other_entries: dict[str, str]
    prefixes: list[str]
    suffix_mismatch: str | None
    tensors: list[TensorRow]
    files: dict[str, int] = field(default_factory=dict)
    index: str | None = None

    @property
    def wrappers(self) -> list[str]:
        """The wrappers whose prefixes the keys carry (``"torch.compile"``...)."""
        return [WRAPPER_OF[p] for p in self.prefixes if p in WRAPPER_OF]

    @property
    def parameter_count(self) -> int:
        """The number of values in the weights' tensors."""
        return sum(row.numel for row in self.tensors)

    @property
    def shard_count(self) -> int | None:
        """How many data files an indexed folder has (None for other layouts)."""
        return len(self.files) - 1 if self.index is not None else None

    def to_json(self) -> dict[str, Any]:
        """The description as JSON-ready data, with its ``schema`` (``gpukit ckpt show --json``)."""
        return {
            "schema": SCHEMA,
            "path": str(self.path),
            "format": self.format,
            "size_bytes": self.size,
            "metadata": self.metadata,
            "container_key": self.container_key,
            "weights_at_top_level": self.weights_at_top_level,
            "other_entries": self.other_entries,
            "prefixes": self.prefixes,
            "wrappers": self.wrappers,
            "wrappers_removed_at_save": self.metadata.get("wrappers_removed", []),
            "source_devices": self.source_devices,
            "layout": self.layout,
            "files": [{"name": name, "size_bytes": size} for name, size in self.files.items()],
            "shard_count": self.shard_count,
            "index_file": self.index,
            "suffix_mismatch": self.suffix_mismatch,
            "weights_found": self.weights_found,
            "tensor_count": len(self.tensors),
            "parameter_count": self.parameter_count,
            "tensors": [row.__dict__ for row in self.tensors],
        }


def _entry(value: object) -> str:
    """A few words on one entry beside the weights: ``"dict of 3"``, ``"5"``..."""
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)}"
    if isinstance(value, (int, float, str, bool)) or value is None:
        return repr(value)[:60]
    if isinstance(value, Mapping):
        return f"dict of {len(value)}"
    if isinstance(value, StoredObject):
        return repr(value)
    return type(value).__name__


def _suffix_note(source: Source) -> str | None:
    if source.layout != "file":
        return None
    suffix = source.path.suffix.lower()
    named = SAFETENSORS if suffix == ".safetensors" else TORCH if suffix in TORCH_SUFFIXES else None
    if named is None or named == source.format:
        return None
    what = "a torch.save file" if source.format == TORCH else "a safetensors file"
    return f"named {suffix} but holds {what}"


def _rows(source: Source, state: Mapping[str, Any]) -> list[TensorRow]:
    return [
        TensorRow(
            key=key,
            shape=list(value.shape),
            dtype=str(value.dtype).removeprefix("torch."),
            device=source.saved_device(value),
            numel=value.numel(),
        )
        for key, value in state.items()
        if isinstance(value, torch.Tensor)
    ]


def describe(path: str | Path, *, trust: bool = False) -> Description:
    """Describe the checkpoint at ``path`` (a file, a sharded folder or its index, a DCP folder,
    an accelerate ``save_state`` folder) without loading it into a model.

    A folder's tensors are described from its headers and metadata, unread; a file is read on
    the CPU. A checkpoint without model weights is described too (``weights_found`` False).

    >>> info = describe("run/last.pt")  # doctest: +SKIP
    >>> info.format, info.container_key, info.parameter_count  # doctest: +SKIP
    ('torch', 'model', 1034)

    Args:
        path: the checkpoint: a file, a sharded folder or its index, a DCP folder, an
            accelerate ``save_state`` folder.
        trust: allow a pickle that runs code to be read (only for files you made).

    Raises:
        CheckpointError: ``path`` is missing, unreadable, damaged or not a checkpoint.
        UntrustedCheckpointError: the file is a pickle that runs code, and ``trust`` is False.
        InvalidArgumentError: ``trust`` is not a bool.
    """
    check_bool("trust", trust)
    source = open_source(Path(path), target=torch.device("cpu"), trust=trust)
    content = source.content
    try:
        weights = find_weights(content)
    except LookupError:
        weights = None
    state = weights.state if weights is not None else {}
    others: dict[str, str] = {}
    if isinstance(content, Mapping):
        # Without weights, every top-level entry is "other": show what the file does hold.
        shown = set(weights.others) if weights is not None else {str(k) for k in content}
        others = {str(k): _entry(v) for k, v in content.items() if str(k) in shown}
    return Description(
        path=source.path,
        format=source.format,
        layout=source.layout,
        size=source.size,
        metadata=source.metadata,
        source_devices=source.source_devices,
        holds=type(content).__name__,
        weights_found=weights is not None,
        container_key=weights.container if weights is not None else None,
        weights_at_top_level=weights is not None and weights.top_level,
        other_entries=others,
        prefixes=clean_keys(state)[1],
        suffix_mismatch=_suffix_note(source),
        tensors=_rows(source, state),
        files=dict(source.files),
        index=source.index,
    )
