"""The sample-weighted gradient all-reduce: each rank's gradient weighed by its share.

Shares of a global batch may differ (the last batch of an epoch, a rank with none), so DDP's
plain average would weigh a sample of a small share more than one of a large share.
:class:`SampleWeights`, a DDP communication hook that :func:`~gpukit.distributed.ddp.prepare`
installs, weighs each rank's gradient by its share of the global batch instead, so the update is
the one a single process computes on the whole global batch. FSDP2's reduce-scatter reads the
same weight (:mod:`gpukit.train.shard`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    GradBucket,  # public as torch.distributed.GradBucket; typed here
)

from gpukit.train.context import StepContext

__all__ = ["SampleWeights", "weighted_allreduce"]


class SampleWeights:
    """State of the DDP communication hook that weighs each rank's gradient by its samples.

    Each rank's gradient is the mean over its own share of ``n_r`` samples; the hook sums
    ``n_r / n * grad_r`` over the ranks, where ``n`` is the global batch's size, which is the
    mean over the whole global batch: exactly one process's gradient. The shares come from
    ``context``, the :class:`~gpukit.train.context.StepContext` its loader fills (``prepare()``
    hands the hook the loader's own); with accumulation, the step's settled gradient weight
    from the same context. Outside that loader's pass, without a context (or with equal
    shares) it is DDP's plain average. The loss must be a mean over the batch (PyTorch's
    default ``reduction="mean"``).
    """

    def __init__(self, world_size: int, context: StepContext | None = None) -> None:
        self.world_size = world_size
        self.context = context

    def weight(self) -> float:
        """This rank's share of the current global batch, or 1/N outside its loader's pass."""
        ctx = self.context
        if ctx is None or not ctx.in_pass:
            return 1.0 / self.world_size
        if ctx.gradient_weight is not None:
            return ctx.gradient_weight  # the step's micro-batches, weighed (settled)
        if not ctx.global_samples or ctx.samples is None:
            return 1.0 / self.world_size
        return ctx.samples / ctx.global_samples


def weighted_allreduce(
    state: SampleWeights, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The communication hook of :class:`SampleWeights`: register it with that state."""
    buffer = bucket.buffer()
    weight = state.weight()
    if weight == 0.0:
        buffer.zero_()  # an empty share: a loss over no sample may read nan, its gradient is 0
    elif weight != 1.0:  # 1: the loss carried the whole weight
        buffer.mul_(weight)
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True)
    assert work is not None
    summed: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return summed


# DDP checks the hook's annotations as objects; this module's are strings (future annotations).
weighted_allreduce.__annotations__ = {
    "state": SampleWeights,
    "bucket": GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
