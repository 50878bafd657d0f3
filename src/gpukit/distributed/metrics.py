"""Numbers over every process: a mean weighed by samples, and gathering results for metrics."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpukit import _agree, _tree
from gpukit.distributed.process_group import DistributedContext, _ready
from gpukit.errors import DistributedError, InvalidArgumentError
from gpukit.train.context import current_context

T = TypeVar("T")

__all__ = ["all_reduce_mean", "gather_for_metrics"]


def all_reduce_mean(x: torch.Tensor | float, *, weight: float | None = None) -> Any:
    """The mean of ``x`` over all processes: a tensor for a tensor, a float for a number.

    With ``weight``, the weighted mean ``sum(w * x) / sum(w)``: pass ``weight=len(batch)`` to
    get the loss one process computes on the whole global batch, exact in the last, uneven step
    of an epoch. A process with weight 0 (an empty batch, whose mean loss reads nan) counts for
    nothing. Every process must call it, empty batch or not.

    >>> all_reduce_mean(2.0)        # one process: its own value
    2.0
    >>> # dist.all_reduce_mean(loss, weight=len(x))            # the global batch's mean loss

    Args:
        x: this process's value: a tensor or a number.
        weight: this process's weight, 0 or more (its batch's samples); None: equal weights.
    """
    if isinstance(x, bool) or not isinstance(x, (torch.Tensor, int, float)):
        raise InvalidArgumentError(
            f"all_reduce_mean takes a tensor or a number, not {type(x).__name__} ({x!r:.40}).",
            hint="Pass the value itself, e.g. all_reduce_mean(loss.item()) or all_reduce_mean(t).",
        )
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0
    ):
        raise InvalidArgumentError(
            f"all_reduce_mean(weight={weight!r}): a weight is a number of samples, 0 or more.",
            hint="Pass weight=len(batch), or leave it out for a plain mean over processes.",
        )
    ctx = _ready()
    is_number = not isinstance(x, torch.Tensor)
    tensor = torch.as_tensor(x, dtype=torch.float64 if is_number else None)
    if not tensor.is_floating_point():
        tensor = tensor.double()
    if ctx.distributed:
        origin = tensor.device
        work = tensor.detach().to(ctx.device, copy=True)
        if weight is None:
            dist.all_reduce(work, op=dist.ReduceOp.SUM)
            tensor = (work / ctx.world_size).to(origin)
        else:
            # One collective for the weighted values and the weights; a weight of 0 drops the
            # value itself, so the nan of a mean over no sample never reaches the sum.
            scaled = torch.zeros_like(work) if weight == 0 else work * weight
            packed = torch.cat([scaled.flatten(), work.new_tensor([float(weight)])])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM)
            tensor = (packed[:-1] / packed[-1]).reshape(work.shape).to(origin)
    return float(tensor) if is_number else tensor


def _gather_tensor(t: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """All-gather ``t`` from every rank, concatenated along dim 0 (stacked when 0-d)."""
    origin = t.device
    work = t.detach().to(ctx.device)
    if work.dim() == 0:
        parts = [torch.empty_like(work) for _ in range(ctx.world_size)]
        dist.all_gather(parts, work)
        return torch.stack(parts).to(origin)
    # Ranks may hold different lengths (the last batch of a metric computed by hand): share the
    # lengths, pad to the longest, gather, then cut each part back.
    size = torch.tensor([work.shape[0]], device=ctx.device)
    sizes = [torch.empty_like(size) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, size)
    lengths = [int(s) for s in sizes]
    longest = max(lengths)
    if work.shape[0] < longest:
        pad = work.new_zeros((longest - work.shape[0], *work.shape[1:]))
        work = torch.cat([work, pad])
    parts = [torch.empty_like(work) for _ in range(ctx.world_size)]
    dist.all_gather(parts, work)
    return torch.cat([p[:n] for p, n in zip(parts, lengths, strict=True)]).to(origin)


Signature = tuple[str, tuple[int, ...] | None]


def _signature(leaf: Any) -> Signature:
    """What every rank must agree on for one leaf: a tensor's dtype and shape after dim 0."""
    if not isinstance(leaf, torch.Tensor):
        return type(leaf).__name__, None
    return str(leaf.dtype), (-1, *leaf.shape[1:]) if leaf.dim() else ()


def _describe(signature: Signature) -> str:
    kind, shape = signature
    if shape is None:
        return f"a {kind}"
    if not shape:
        return f"a 0-dim {kind} tensor"
    dims = ", ".join(["N", *map(str, shape[1:])])  # any number of rows
    return f"a {kind} tensor of shape ({dims})"


def _disagreement(shapes: list[dict[_tree.KeyPath, Signature]]) -> str | None:
    """How the ranks' structures differ, naming ranks and paths; None when they agree."""
    paths = [set(s) for s in shapes]
    everywhere = set.intersection(*paths)
    for rank, own in enumerate(paths):
        extra = sorted(own - everywhere, key=repr)
        if extra:
            lacking = [r for r, other in enumerate(paths) if extra[0] not in other]
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            return (
                f"rank {rank} has {_tree.format_path(extra[0], 'x')}{more}, which rank "
                f"{lacking[0]} does not"
            )
    for path in shapes[0]:
        seen = [s[path] for s in shapes]
        odd = next((r for r, sig in enumerate(seen) if sig != seen[0]), None)
        if odd is not None:
            return (
                f"{_tree.format_path(path, 'x')} is {_describe(seen[0])} on rank 0 but "
                f"{_describe(seen[odd])} on rank {odd}"
            )
    return None


def _gather_leaf(t: torch.Tensor, ctx: DistributedContext, keep: list[bool] | None) -> Any:
    gathered = _gather_tensor(t, ctx)
    if keep is None or t.dim() == 0:
        return gathered
    if gathered.shape[0] != len(keep):
        context = current_context()
        samples = context.samples if context is not None else None
        raise DistributedError(
            f"gather_for_metrics() got a tensor of {t.shape[0]} rows during a batch of "
            f"{'?' if samples is None else samples} samples, so it cannot tell which "
            "rows the sampler repeated.",
            hint="Gather per-sample values (one row per sample of the batch), or use "
            "all_reduce_mean for per-batch numbers.",
        )
    return gathered[torch.tensor(keep, device=gathered.device)]


def _gather_nested(x: Any, ctx: DistributedContext, keep: list[bool] | None) -> Any:
    leaves = dict(_tree.leaves_with_paths(x, None))
    signature = {path: _signature(leaf) for path, leaf in leaves.items()}
    # Every rank learns every rank's structure first: tensors are then paired by key path,
    # never by position, and a mismatch is an error on every rank instead of a hang or a
    # silently wrong pairing.
    shapes = _agree.gathered(signature)
    problem = _disagreement(shapes)
    if problem is not None:
        raise DistributedError(
            f"gather_for_metrics() was given different structures by the processes: {problem}.",
            hint="Pass the same keys, lengths and tensor shapes (but the number of rows) on "
            "every rank.",
        )
    for path, (kind, shape) in shapes[0].items():
        if shape is None:  # the same on every rank, as checked above
            raise DistributedError(
                f"gather_for_metrics() cannot gather {_tree.format_path(path, 'x')}, a {kind}.",
                hint="Pass tensors, or dicts, lists, tuples, namedtuples or dataclasses of "
                "them; turn numbers into tensors first (torch.tensor(value)).",
            )
    gathered = {path: _gather_leaf(leaves[path], ctx, keep) for path in shapes[0]}
    return _tree.map_with_paths(x, lambda path, _: gathered[path], torch.Tensor)


def gather_for_metrics(x: T) -> T:
    """All-gather per-sample values from every process, dropping the sampler's repeats.

    ``x`` is a tensor, or any nesting of them that ``gk.tree_map`` walks (dicts are paired
    by key, so ranks may build them in any order), with one row per sample of the current
    batch of a loader from :func:`prepare`. Ranks that pass different keys, lengths or tensor
    shapes get a :class:`~gpukit.errors.DistributedError` naming the ranks and the path.

    DistributedSampler repeats a few samples so that every process gets as many; those rows
    are removed here, so a metric over the gathered values counts each sample of the dataset
    exactly once. Outside such a loop it gathers
    everything, concatenated in rank order. The batch is that of the prepared loader being
    iterated now (the innermost loop; :func:`gpukit.train.context.current_context`).

    Args:
        x: this process's per-sample values: a tensor with one row per sample, or a nesting of
            them (dicts, lists, tuples, dataclasses).
    """
    ctx = _ready()
    if not ctx.distributed or ctx.world_size == 1:
        return x
    context = current_context()
    # A prepared loader repeats no sample: every row of the gather is one of the batch.
    keep = None if context is None else [True] * (context.global_samples or 0)
    gathered: T = _gather_nested(x, ctx, keep)
    return gathered
