"""Split a batch across devices: ``gk.parallel.scatter``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

import gpukit.parallel._cuda as _cuda
from gpukit import _tree
from gpukit._tree import KeyPath, format_path
from gpukit.devices import DeviceLike, device_list
from gpukit.errors import InvalidArgumentError, ScatterError
from gpukit.transfer import _Mover

T = TypeVar("T")

__all__ = ["chunk_sizes", "scatter"]


def chunk_sizes(total: int, replicas: int, *, min_chunk: int = 1) -> list[int]:
    """How ``scatter`` splits ``total`` samples over at most ``replicas`` devices.

    As even as possible (sizes differ by at most one, larger first), never an empty chunk, and
    no chunk under ``min_chunk`` unless the whole batch is smaller than that.

    >>> chunk_sizes(9, 4)
    [3, 2, 2, 2]
    >>> chunk_sizes(3, 4)
    [1, 1, 1]
    >>> chunk_sizes(9, 4, min_chunk=4)
    [5, 4]

    Args:
        total: the samples to split, 0 or more (an empty batch: one chunk of 0).
        replicas: the devices at most.
        min_chunk: the fewest samples a chunk holds, 1 or more.
    """
    if replicas < 1:
        raise InvalidArgumentError(
            f"chunk_sizes was asked for {replicas} replicas.", hint="Pass at least one device."
        )
    if total < 0:
        raise InvalidArgumentError(
            f"chunk_sizes was asked to split {total} samples.",
            hint="Pass a number of samples, 0 or more (an empty batch is one chunk of 0).",
        )
    if min_chunk < 1:
        raise InvalidArgumentError(
            f"min_chunk={min_chunk} is below 1.", hint="Use min_chunk=1 (the default) or more."
        )
    count = max(1, min(replicas, total // min_chunk))
    base, extra = divmod(total, count)
    return [base + 1 if i < extra else base for i in range(count)]


def _batch_size(inputs: Any, dim: int) -> int | None:
    """The one size every tensor in ``inputs`` has along ``dim``, or None without tensors."""
    found = list(_tree.leaves_with_paths(inputs, torch.Tensor))
    if not found:
        return None
    sizes: dict[int, list[KeyPath]] = {}
    for path, tensor in found:
        if not -tensor.dim() <= dim < tensor.dim():
            raise ScatterError(
                f"scatter was asked to split along dim {dim}, but {format_path(path)} has "
                f"shape {tuple(tensor.shape)} and so no dim {dim}.",
                hint="Give every tensor in the batch that dimension, or pass values that are "
                "the same for every replica as Python numbers.",
            )
        sizes.setdefault(tensor.size(dim), []).append(path)
    if len(sizes) > 1:
        parts = []
        for size, paths in sizes.items():
            shown = ", ".join(format_path(p) for p in paths[:3])
            more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
            parts.append(f"{size} ({shown}{more})")
        raise ScatterError(
            f"scatter was asked to split a batch along dim {dim}, but its tensors disagree in "
            f"size there: {'; '.join(parts)}.",
            hint="Every tensor in a batch must hold the same number of samples along the "
            "split dim; pass per-batch constants as Python values instead.",
        )
    return next(iter(sizes))


def scatter(
    inputs: T, devices: Sequence[DeviceLike], dim: int = 0, *, min_chunk: int = 1
) -> list[T]:
    """Split every tensor in ``inputs`` along ``dim`` into one chunk per device, and move it there.

    ``inputs`` is any nesting that ``gk.to_device`` accepts (for a call, pass ``(args, kwargs)``).
    Each element of the result has the structure of ``inputs``, with that device's chunks in
    place of the tensors; every other value (numbers, strings, modules...) is passed to every
    replica unchanged. Chunks are as even as possible and never empty: with fewer samples than
    devices, the result is shorter than ``devices`` and fewer replicas run. ``min_chunk`` keeps
    chunks at least that large (BatchNorm cannot train on one sample). Without any tensor there
    is nothing to split and one copy, for the first device, is returned.

    Raises :class:`~gpukit.errors.ScatterError` naming the paths and sizes when the tensors
    disagree in size along ``dim``.

    >>> import torch
    >>> parts = scatter(({"x": torch.zeros(9, 2)}, 0.5), ["cpu"] * 4)
    >>> [p[0]["x"].shape[0] for p in parts], parts[1][1]
    ([3, 2, 2, 2], 0.5)

    Args:
        inputs: a tensor or any nesting of them; other leaves go to every chunk unchanged.
        devices: one device per chunk, repeats allowed.
        dim: the dimension to split along.
        min_chunk: the fewest samples a chunk holds, 1 or more.
    """
    if len(devices) == 0:
        raise InvalidArgumentError(
            "scatter was given no devices.", hint='Pass at least one, for example ["cpu"].'
        )
    targets = device_list(devices)
    total = _batch_size(inputs, dim)
    if total is None:
        return [inputs]
    sizes = chunk_sizes(total, len(targets), min_chunk=min_chunk)
    used = targets[: len(sizes)]
    moves = [_Mover(t, "auto", False).leaf() for t in used]
    if len(sizes) == 1:
        # The walk above found no cycle, so the mappers below need no guard.
        return [_tree.mapper(moves[0], torch.Tensor)(inputs)]
    # On distinct GPUs each tensor is split and copied to all of them in one call.
    indices = _cuda.cuda_indices(used)
    # Split each tensor once, on first use, rather than once per device. ``inputs`` keeps every
    # tensor alive for the whole call, so ids are stable keys here.
    splits: dict[int, tuple[torch.Tensor, ...]] = {}

    def split(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        parts = splits.get(id(t))
        if parts is None:
            if indices is not None and t.device.type in ("cpu", "cuda"):
                parts = _cuda.scatter(t, indices, sizes, dim % t.dim())
            else:
                parts = torch.split(t, sizes, dim)
            splits[id(t)] = parts
        return parts

    def chunk_for(index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        move = moves[index]
        return lambda t: move(split(t)[index])

    return [_tree.mapper(chunk_for(index), torch.Tensor)(inputs) for index in range(len(sizes))]
