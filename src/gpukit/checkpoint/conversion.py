"""A checkpoint rewritten clean, on the CPU, in another layout: gk.checkpoint.convert.

The output path picks the layout as gk.save's does. Safetensors and sharded folders hold only
tensors, so from a training checkpoint they get the model's weights; a ``.pt`` file keeps
everything unless ``weights_only`` asks for the weights alone. Only what the output keeps is
read: a pickle beside the weights is never unpickled for an output that leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpukit.checkpoint.api import SHARDED, SaveTarget, check_save_target, save
from gpukit.checkpoint.keys import FoundWeights, clean_keys, find_state_dict, find_weights
from gpukit.checkpoint.layout import open_source
from gpukit.checkpoint.paths import check_input
from gpukit.checkpoint.single_file import TORCH
from gpukit.checkpoint.source import Source
from gpukit.errors import CheckpointError, InvalidArgumentError, check_bool

__all__ = ["Conversion", "convert"]


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert` wrote: where, in which layout, and what it left out.

    ``format`` is ``"torch"``, ``"safetensors"`` or ``"sharded safetensors"``;
    ``prefixes_removed`` the wrapper prefixes taken off the keys. ``left_out`` names the
    top-level entries beside the weights that were not kept, ``kept`` says which part was
    (``"the weights under 'model'"``), and ``weights_only_asked`` says whether that was asked
    for (``weights_only``) rather than needed by a format that holds only tensors.

    Args:
        source: the checkpoint read, as named (a file or a folder).
        output: what was written: a file, or a folder of shards.
        format: ``"torch"``, ``"safetensors"`` or ``"sharded safetensors"``.
        source_devices: the devices the tensors were saved from, where the source says so.
        prefixes_removed: the wrapper prefixes taken off the keys (``"module."``).
        left_out: the top-level entries beside the weights that were not kept.
        kept: which part was kept (``"everything"``, the default, or ``"the weights"``...).
        weights_only_asked: whether ``weights_only`` asked for the weights alone (False).
    """

    source: Path
    output: Path
    format: str
    source_devices: list[str]
    prefixes_removed: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    kept: str = "everything"
    weights_only_asked: bool = False

    @property
    def sharded(self) -> bool:
        """The output is a folder of shards."""
        return self.format == SHARDED


def _kept(found: FoundWeights) -> str:
    if found.top_level:
        return "the top-level tensors"
    if found.container is not None:
        return f"the weights under {found.container!r}"
    return "the weights"


def _weights(source: Source, to_torch: bool, trust: bool) -> tuple[object, FoundWeights]:
    """The model's weights alone, read (nothing else is), and where they were found."""
    try:
        found = find_weights(source.content)
    except LookupError as exc:
        keep_all = (
            "Drop weights_only (gpukit ckpt convert: --weights-only)"
            if to_torch
            else "Convert to a .pt file"
        )
        raise CheckpointError(
            f"{source.path} holds no model weights to convert: {exc}.",
            hint=f"{keep_all} to keep what it holds: a .pt file keeps anything torch.save wrote.",
        ) from None
    read = source.read_content(trust=trust, only=found.entries)
    return find_weights(read).state, found


def _prefixes(obj: object) -> list[str]:
    try:
        state, _ = find_state_dict(obj)
    except LookupError:
        return []
    return clean_keys(state)[1]


def convert(
    source: str | Path,
    output: str | Path | SaveTarget,
    *,
    weights_only: bool = False,
    max_shard_size: int | str | None = None,
    trust: bool = False,
) -> Conversion:
    """Rewrite the checkpoint ``source`` clean at ``output``: no wrapper prefixes, every tensor
    on the CPU, in the layout the output path names; returns what was written and left out.

    ``source`` is anything :func:`gpukit.load` reads (a file, a sharded folder or its index, a
    DCP folder, an accelerate ``save_state`` folder). ``output`` is a ``.pt`` / ``.pth`` file
    (anything torch.save holds), a ``.safetensors`` file or a folder name without a suffix (a
    sharded safetensors folder, shards of at most ``max_shard_size``; see :func:`gpukit.save`),
    or a :class:`~gpukit.checkpoint.api.SaveTarget` already checked. Safetensors outputs get
    the model's weights only, as does a ``.pt`` output with ``weights_only``; what that leaves
    out is never read. Both paths are checked before anything is read; the output is written
    atomically, with the source's name and saved devices in its metadata.

    >>> done = convert("run/last.pt", "run/weights.safetensors")  # doctest: +SKIP
    >>> done.left_out, done.kept  # doctest: +SKIP
    (['optimizer', 'epoch'], "the weights under 'model'")

    Args:
        source: the checkpoint to read: a file, a sharded folder or its index, a DCP folder,
            an accelerate ``save_state`` folder.
        output: the path to write (its suffix picks the layout), or a checked ``SaveTarget``.
        weights_only: with a ``.pt`` output, keep the model's weights alone.
        max_shard_size: the largest shard of a folder output, bytes or a size (``"2GB"``).
        trust: allow a pickle that runs code to be read (only for files you made).

    Raises:
        CheckpointError: ``source`` is missing, damaged or not a checkpoint, holds no model
            weights where only they are kept, or ``output`` cannot be written.
        UntrustedCheckpointError: what must be read is a pickle that runs code, and ``trust``
            is False.
        InvalidArgumentError: ``output`` has a suffix gpukit does not know, ``max_shard_size``
            is not a size, comes with a file's suffix or with a SaveTarget, or a switch is not
            a bool.
    """
    check_bool("weights_only", weights_only)
    check_bool("trust", trust)
    check_input(Path(source))
    if isinstance(output, SaveTarget):
        if max_shard_size is not None:
            raise InvalidArgumentError(
                f"convert was given a checked SaveTarget for {output.path} and a max_shard_size; "
                "the target already says how the output is sharded.",
                hint="Pass max_shard_size to check_save_target, or pass the output path.",
            )
        planned = output
    else:
        planned = check_save_target(Path(output), max_shard_size)
    opened = open_source(Path(source), target=torch.device("cpu"), trust=trust)
    to_torch = planned.format == TORCH
    obj: object
    if weights_only or not to_torch:
        obj, found = _weights(opened, to_torch, trust)
        left_out, kept = list(found.others), _kept(found)
    else:
        obj, left_out, kept = opened.read_content(trust=trust), [], "everything"
    prefixes = _prefixes(obj)
    metadata = {"converted_from": Path(source).name, "source_devices": opened.source_devices}
    save(obj, planned.path, metadata=metadata, max_shard_size=planned.shard_limit)
    return Conversion(
        source=opened.path,
        output=planned.path,
        format=planned.format,
        source_devices=opened.source_devices,
        prefixes_removed=prefixes,
        left_out=left_out,
        kept=kept,
        weights_only_asked=weights_only,
    )
