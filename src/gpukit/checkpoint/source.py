"""What every kind of checkpoint offers the loader: the one interface behind files and folders.

A :class:`Source` is a checkpoint opened: one file (``single_file``), a Hugging Face sharded
folder (``sharded``), a torch.distributed.checkpoint folder (``dcp``) or an accelerate
``save_state`` folder (``accelerate_state``). It describes itself (``format``, ``layout``, its
files and what gk.save recorded) and holds ``content``: the saved structure, whose tensors are
real where the source read them whole (a single file) and shape-only (``meta``) where it did
not (a folder), and whose other entries not yet read are :class:`StoredObject`. That structure
is what the weights are found in and what the load plan is made from, by names and shapes.

A tensor is then named by its *location* (the keys from the top of ``content`` down to it),
and the source gives the key it stores that tensor under (:meth:`Source.stored_key`, as DCP's
``ReadItem`` carries its storage index); :meth:`Source.read_into` copies each stored key's
tensor into the model tensors the plan gave it. :func:`gpukit.checkpoint.layout.open_source`
recognises which source a path is, by content.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["Location", "Source", "StoredObject", "shape_only"]

Location = tuple[str, ...]
"""Where an entry sits in a checkpoint's ``content``: the keys from the top down to it."""


class StoredObject:
    """A non-tensor entry of a checkpoint folder (an epoch, optimizer settings), not read yet."""

    def __repr__(self) -> str:
        return "object (not read)"


def shape_only(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor that stands for a stored one in ``content``: its shape and dtype, no data."""
    return torch.empty(shape, dtype=dtype, device="meta")


class Source(Protocol):
    """A checkpoint opened for reading: what it is, what it holds, and how to read it.

    ``path`` is the checkpoint as named (the file, or the folder); ``format`` is
    ``"safetensors"``, ``"torch"``, ``"sharded safetensors"``, ``"sharded torch"``, ``"dcp"`` or
    ``"accelerate state"``; ``layout`` is ``"file"``, ``"sharded"``, ``"dcp"`` or
    ``"accelerate"``. ``files`` maps each file of a folder to its size, the index (``index``,
    when there is one) last; a single file has none. ``metadata`` is what gk.save recorded and
    ``source_devices`` the devices the tensors were saved from, where known.
    """

    @property
    def path(self) -> Path:
        """The file, or the folder, the checkpoint is."""
        ...

    @property
    def format(self) -> str:
        """What the bytes are: ``"safetensors"``, ``"torch"``, ``"sharded safetensors"``..."""
        ...

    @property
    def layout(self) -> str:
        """How it is laid out on disk: ``"file"``, ``"sharded"``, ``"dcp"``, ``"accelerate"``."""
        ...

    @property
    def content(self) -> Any:
        """The saved structure: each tensor's name, shape and dtype; objects not read yet."""
        ...

    @property
    def files(self) -> Mapping[str, int]:
        """A folder's files with their sizes, the index last (empty for a single file)."""
        ...

    @property
    def index(self) -> str | None:
        """The name of the file that lists the others (an index JSON, DCP's ``.metadata``)."""
        ...

    @property
    def size(self) -> int:
        """Bytes of all the files that make up the checkpoint."""
        ...

    @property
    def metadata(self) -> dict[str, Any]:
        """What gk.save recorded with the checkpoint (empty when something else wrote it)."""
        ...

    @property
    def source_devices(self) -> list[str]:
        """The devices the tensors were saved from, where the checkpoint says so."""
        ...

    def saved_device(self, tensor: torch.Tensor) -> str | None:
        """The device one of ``content``'s tensors was saved from (None: unknown)."""
        ...

    def stored_key(self, location: Location) -> str:
        """The key this source stores the tensor at ``location`` of ``content`` under."""
        ...

    def read_into(self, targets: Mapping[str, list[torch.Tensor]], *, trust: bool) -> None:
        """Copy each stored key's tensor into its target tensors, in place."""
        ...

    def read_extras(
        self, names: Collection[str], *, trust: bool
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The top-level entries ``names`` (beside the weights), read on the CPU, and the
        entries left unread, each with the reason (a pickle that only ``trust`` reads)."""
        ...

    def read_content(self, *, trust: bool, only: Collection[str] | None = None) -> Any:
        """``content`` with every entry read, tensors on the CPU (a single file's where it was
        read onto); ``only``: just those top-level entries, so that what is not wanted (a
        pickled optimizer) is never read."""
        ...
