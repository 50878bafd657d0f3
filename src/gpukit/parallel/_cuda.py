"""The CUDA fast path of data parallel: ``torch.nn.parallel.comm``, as ``nn.DataParallel`` uses it.

On distinct CUDA devices one collective call replaces one ``.to()`` per tensor per device:
parameters and buffers are broadcast in coalesced buckets, each input tensor is split and
copied to every device at once (from the host on side streams), and outputs are gathered
straight into their destination. Where gradients must flow, the same calls go through the
autograd functions that ``nn.DataParallel`` itself uses (``Broadcast``, ``Scatter``,
``Gather``), so backward is theirs too.

Everything here runs only on a machine with several GPUs; CPU replicas, repeated devices and
complex tensors keep the plain path. Tests marked ``gpu`` cover it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.parallel import comm
from torch.nn.parallel._functions import Broadcast, Gather, Scatter

__all__ = ["broadcast", "cuda_indices", "gather", "scatter"]


def cuda_indices(devices: Sequence[torch.device]) -> list[int] | None:
    """The CUDA indices of ``devices`` when they are distinct CUDA devices; else None."""
    if not devices or any(d.type != "cuda" or d.index is None for d in devices):
        return None
    indices = [d.index for d in devices if d.index is not None]
    return indices if len(set(indices)) == len(indices) else None


def broadcast(
    tensors: Sequence[torch.Tensor], source: int, targets: Sequence[int]
) -> list[list[torch.Tensor]] | None:
    """Copies of ``tensors`` (all on CUDA device ``source``) for each target, in target order.

    Tensors that require grad get differentiable copies when grad is on, as in
    ``nn.parallel.replicate``; the rest are copied detached. None when some tensor is not on
    ``source`` or is complex: the caller then copies tensor by tensor.
    """
    home = torch.device("cuda", source)
    if any(t.device != home or t.is_complex() for t in tensors):
        return None
    devices = [source, *targets]
    out: list[list[torch.Tensor]] = [[] for _ in targets]
    grad = torch.is_grad_enabled()
    tracked = [i for i, t in enumerate(tensors) if grad and t.requires_grad]
    plain = [i for i, t in enumerate(tensors) if not (grad and t.requires_grad)]
    copies: dict[int, list[torch.Tensor]] = {}
    if tracked:
        flat = Broadcast.apply(devices, *(tensors[i] for i in tracked))  # type: ignore[no-untyped-call]
        for k, i in enumerate(tracked):
            copies[i] = [flat[(d + 1) * len(tracked) + k] for d in range(len(targets))]
    if plain:
        detached = [tensors[i].detach() for i in plain]
        per_device = comm.broadcast_coalesced(detached, devices)  # type: ignore[no-untyped-call]
        for k, i in enumerate(plain):
            copies[i] = [per_device[d + 1][k] for d in range(len(targets))]
    for i in range(len(tensors)):
        for d in range(len(targets)):
            out[d].append(copies[i][d])
    return out


def scatter(
    tensor: torch.Tensor, indices: Sequence[int], sizes: Sequence[int], dim: int
) -> tuple[torch.Tensor, ...]:
    """``tensor`` split into chunks of ``sizes`` along ``dim``, chunk i on CUDA device i."""
    parts = Scatter.apply(list(indices), list(sizes), dim, tensor)  # type: ignore[no-untyped-call]
    return tuple(parts)


def gather(tensors: Sequence[torch.Tensor], dim: int, target: torch.device) -> torch.Tensor | None:
    """``tensors`` (one per distinct CUDA device) concatenated along ``dim`` on ``target``.

    None when the plain path must do it: 0-dim tensors (stacked by the caller, without
    ``Gather``'s warning), complex ones, tensors not on distinct CUDA devices, and tensors that
    cannot be joined (dtypes or other dimensions differ: the plain path says how).
    """
    if target.type != "cuda" or target.index is None:
        return None
    first = tensors[0]
    if any(t.dim() == 0 or t.is_complex() or t.dtype != first.dtype for t in tensors):
        return None
    if not -first.dim() <= dim < first.dim():
        return None
    dim %= first.dim()
    for t in tensors:
        if t.dim() != first.dim() or any(
            a != b for i, (a, b) in enumerate(zip(t.shape, first.shape, strict=True)) if i != dim
        ):
            return None
    if cuda_indices([t.device for t in tensors]) is None:
        return None
    gathered: torch.Tensor = Gather.apply(target.index, dim, *tensors)  # type: ignore[no-untyped-call]
    return gathered
