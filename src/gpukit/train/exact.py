"""Exact mode: the same bits on any number of processes.

A step's global batch of ``B`` samples is cut into ``P = B / m`` micro-batches of the fixed size
``m`` (the last step of an epoch into fewer, its last one shorter), the same cut for every
number of processes ``N``. Process ``r`` takes the contiguous micro-batches ``r*K`` to
``r*K + K - 1`` (``K = P / N``), so each micro-batch's gradient is computed with the same
shapes, and so the same bits, whatever ``N`` is.

What is left is the sum. Floating-point addition is not associative, so the order is fixed: a
balanced binary tree over the micro-batch index, ``P`` padded to a power of two, where a
subtree with no micro-batch in it (the short last step) is simply absent. Each process adds its
own ``K`` leaves as they come (a stack of at most log2(K) + 1 partial sums: the pairwise
summation of Higham, evaluated streaming), which is one node of that tree when ``K`` is a
power of two or ``N`` is 1; the nodes of the processes are then added by the same tree, each
process adding the ranks' values of its own slice of the gradient (one all-to-all) and every
process receiving the whole sum (one all-gather): the bytes of a ring all-reduce, in the one
order. gloo's and NCCL's own all-reduce add in an order of their choosing that changes with N.

So exact mode is exact for ``N = 1`` and for every ``N`` that leaves each process a power of
two of micro-batches (``P = 8``: ``N`` in 1, 2, 4 and 8); :func:`exact_plan` refuses any other
with the nearest exact configurations in the hint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpukit.errors import InvalidArgumentError
from gpukit.train.context import StepContext
from gpukit.train.shard import PlainBuffers

__all__ = [
    "ExactPlan",
    "ExactReduceScatter",
    "FixedOrderSum",
    "exact_plan",
    "scatter_sum",
    "tree_sum",
]

T = TypeVar("T")


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _exact_for(world_size: int, micro_batches: int) -> bool:
    if world_size == 1:
        return True
    return micro_batches % world_size == 0 and _power_of_two(micro_batches // world_size)


@dataclass(frozen=True)
class ExactPlan:
    """How exact mode cuts a step: ``micro_batches`` of ``micro_batch_size``, ``per_process``
    of them on each of ``world_size`` processes.

    Args:
        global_batch_size: the samples of one optimizer step over every process.
        micro_batch_size: the samples of one micro-batch, the same for every number of
            processes.
        world_size: the number of processes.
    """

    global_batch_size: int
    micro_batch_size: int
    world_size: int

    @property
    def micro_batches(self) -> int:
        """The micro-batches of a whole step, over every process (P)."""
        return self.global_batch_size // self.micro_batch_size

    @property
    def per_process(self) -> int:
        """The micro-batches each process computes per step (K)."""
        return self.micro_batches // self.world_size

    def real_micro_batches(self, step_samples: int) -> int:
        """How many micro-batches a step of ``step_samples`` samples holds (the rest are
        empty): all of them but in an epoch's short last step.

        Args:
            step_samples: the samples of the step over every process.
        """
        return -(-step_samples // self.micro_batch_size)

    def ranks_holding(self, step_samples: int) -> list[bool]:
        """For each rank, whether it holds a micro-batch with samples in a step of
        ``step_samples`` (the others' partial sums are absent from the tree).

        Args:
            step_samples: the samples of the step over every process.
        """
        real = self.real_micro_batches(step_samples)
        return [rank * self.per_process < real for rank in range(self.world_size)]

    def samples_of(self, step_samples: int, index: int) -> int:
        """The samples of micro-batch ``index`` (0 to P - 1) in a step of ``step_samples``.

        Args:
            step_samples: the samples of the step over every process.
            index: the micro-batch's index in the step.
        """
        start = index * self.micro_batch_size
        return max(0, min(self.micro_batch_size, step_samples - start))

    def exact_world_sizes(self) -> list[int]:
        """Every number of processes this cut is exact on: 1, and P / 2**k where it divides."""
        count = self.micro_batches
        found = {count >> k for k in range(count.bit_length()) if count % (1 << k) == 0}
        return sorted(found | {1})


def _checked_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"exact mode got {name}={value!r}, which is not a number of samples.",
            hint=f"Pass {name} as a whole number, 1 or more.",
        )
    return value


def exact_plan(world_size: int, global_batch_size: object, micro_batch_size: object) -> ExactPlan:
    """Check an exact configuration and return its cut.

    Args:
        world_size: the number of processes.
        global_batch_size: the samples of one optimizer step over every process.
        micro_batch_size: the samples of one micro-batch.

    Raises:
        InvalidArgumentError: a size is missing or not a whole number from 1; the global batch
            is not a whole number of micro-batches; or this number of processes cannot sum them
            in the one order (each process must take a power of two of them). The hint names
            the process counts that are exact and the micro-batch sizes that make this one so.
    """
    if global_batch_size is None or micro_batch_size is None:
        raise InvalidArgumentError(
            "exact mode needs global_batch_size= and micro_batch_size=: the cut of a step into "
            "micro-batches is what stays the same on every number of processes.",
            hint="Pass both, e.g. prepare(..., exact=True, global_batch_size=64, "
            "micro_batch_size=8).",
        )
    size = _checked_size("global_batch_size", global_batch_size)
    micro = _checked_size("micro_batch_size", micro_batch_size)
    if size % micro:
        raise InvalidArgumentError(
            f"exact mode got global_batch_size={size}, which is not a whole number of "
            f"micro-batches of micro_batch_size={micro}.",
            hint=f"Use a global batch that is a multiple of {micro}, or a micro-batch size that "
            f"divides {size}.",
        )
    plan = ExactPlan(size, micro, world_size)
    if not _exact_for(world_size, plan.micro_batches):
        raise InvalidArgumentError(
            f"exact mode cannot sum {plan.micro_batches} micro-batches of {micro} in one order "
            f"on {world_size} processes: each process must take a power of two of them.",
            hint=f"With these sizes, run on {_listed(plan.exact_world_sizes())} processes; on "
            f"{world_size}, {_nearest(world_size, size, micro)}.",
        )
    return plan


def _listed(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _nearest(world_size: int, size: int, micro: int) -> str:
    """The exact configurations on ``world_size`` processes nearest to ``(size, micro)``."""
    # The micro-batch sizes that leave each process 2**k micro-batches: size / (N * 2**k).
    micros = sorted(
        size // (world_size << k) for k in range(size.bit_length()) if size % (world_size << k) == 0
    )
    steps = [world_size * micro << k for k in range(size.bit_length() + 1)]
    below = [g for g in steps if g <= size][-1:]
    above = [g for g in steps if g > size][:1]
    sizes = f"global_batch_size={' or '.join(str(g) for g in below + above)} with {micro}"
    if micros:
        return f"use micro_batch_size={_listed(micros[-3:])} with {size}, or {sizes}"
    return f"use {sizes}"


def tree_sum(nodes: Sequence[T | None], add: Callable[[T, T], T]) -> T | None:
    """The balanced binary tree's sum of ``nodes``, padded to a power of two; ``None`` is an
    absent node (a subtree without data), passed over, never added.

    >>> tree_sum(["a", "b", "c"], lambda x, y: f"({x}+{y})")
    '((a+b)+c)'

    Args:
        nodes: the values in order, ``None`` where there is none.
        add: the sum of two values (left, right).
    """
    level = list(nodes)
    while len(level) > 1:
        if len(level) % 2:
            level.append(None)
        paired: list[T | None] = []
        for left, right in zip(level[::2], level[1::2], strict=True):
            if left is None or right is None:
                paired.append(right if left is None else left)
            else:
                paired.append(add(left, right))
        level = paired
    return level[0] if level else None


Grads = list[torch.Tensor]


def _add(left: Grads, right: Grads) -> Grads:
    torch._foreach_add_(left, right)
    return left


class FixedOrderSum:
    """A step's micro-batch gradients summed by the tree of :mod:`gpukit.train.exact`.

    :meth:`add` takes each of this process's micro-batch gradients in order (``None`` for an
    empty micro-batch, past the end of a short last step); :meth:`total` adds what this
    process holds, then the processes' partial sums, and gives every process the step's sum.

    Args:
        plan: the step's cut.
        group: the process group to sum over; None: the default group (or none, alone).
    """

    def __init__(self, plan: ExactPlan, group: dist.ProcessGroup | None = None) -> None:
        self.plan = plan
        self.group = group
        self._stack: list[tuple[int, Grads]] = []

    def start(self) -> None:
        """Forget the previous step's partial sums."""
        self._stack = []

    def add(self, grads: Grads | None) -> None:
        """Add the next micro-batch's gradients (None: an empty micro-batch, absent).

        Args:
            grads: the micro-batch's gradient of every parameter, in a fixed order; None for
                an empty micro-batch.
        """
        if grads is None:
            return  # empty micro-batches come last: their subtrees are absent
        self._stack.append((1, grads))
        while len(self._stack) > 1 and self._stack[-1][0] == self._stack[-2][0]:
            size, right = self._stack.pop()
            _, left = self._stack.pop()
            self._stack.append((2 * size, _add(left, right)))

    def _local(self) -> Grads | None:
        """This process's subtree: the partial sums left on the stack, added right to left."""
        while len(self._stack) > 1:
            _, right = self._stack.pop()
            size, left = self._stack.pop()
            self._stack.append((size, _add(left, right)))
        node = self._stack[0][1] if self._stack else None
        self._stack = []
        return node

    def total(self, step_samples: int, like: Grads) -> Grads:
        """The step's summed gradients, the same bits on every process and for every N.

        Args:
            step_samples: the step's samples over every process (which ranks hold data).
            like: a tensor per gradient (its shape, dtype and device), for a process that
                holds no micro-batch of this step.
        """
        node = self._local()
        world = self.plan.world_size
        if world == 1:
            return node if node is not None else [torch.zeros_like(t) for t in like]
        present = self.plan.ranks_holding(step_samples)
        mine = node if node is not None else [torch.zeros_like(t) for t in like]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for index, grad in enumerate(mine):
            by_dtype.setdefault(grad.dtype, []).append(index)
        out: Grads = list(mine)
        for indices in by_dtype.values():
            summed = self._across([mine[i] for i in indices], present)
            for i, grad in zip(indices, summed, strict=True):
                out[i] = grad
        return out

    def _across(self, grads: Grads, present: list[bool]) -> Grads:
        """Add the processes' partial sums of ``grads`` (one dtype) by the tree over ranks."""
        world = self.plan.world_size
        flat = torch.cat([g.reshape(-1) for g in grads])
        chunk = -(-flat.numel() // world)
        send = torch.zeros(chunk * world, dtype=flat.dtype, device=flat.device)
        send[: flat.numel()] = flat
        mine = scatter_sum(send, present, self.group)
        gathered = torch.empty_like(send)
        dist.all_gather_single(gathered, mine, group=self.group)
        pieces = torch.split(gathered[: flat.numel()], [g.numel() for g in grads])
        return [p.view_as(g) for p, g in zip(pieces, grads, strict=True)]


def scatter_sum(
    send: torch.Tensor, present: Sequence[bool], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's slice of the ranks' ``send`` buffers, added by the tree over ranks.

    ``send`` holds one equal slice per rank, in rank order (a reduce-scatter's input); the
    result is the sum of every present rank's slice ``rank``: a reduce-scatter whose order of
    additions is the tree's, whatever the backend. One all-to-all, then local additions.

    Args:
        send: this rank's buffer, ``world_size`` slices of one size.
        present: for each rank, whether it holds a partial sum (False: absent, not added).
        group: the process group; None: the default group.
    """
    world = len(present)
    chunk = send.numel() // world
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    rows = [received[r * chunk : (r + 1) * chunk] if present[r] else None for r in range(world)]
    mine = tree_sum(rows, lambda a, b: a.add_(b))
    assert mine is not None  # rank 0 holds the step's first micro-batch
    return mine


class ExactReduceScatter(PlainBuffers):
    """FSDP's reduce-scatter of one sharded unit, in exact mode: the tree's sum.

    FSDP reduce-scatters each micro-batch's gradients as its backward ends (exact mode keeps the
    gradient sync on). On all but the step's last micro-batch this keeps the gradients (one
    flat buffer, the micro-batch's leaf) and gives FSDP zeros to accumulate; on the last it
    adds the leaves it kept by the tree, then the ranks' partial sums of this rank's shard
    (:func:`scatter_sum`): the same sum, element for element, as the unsharded exact mode.

    Args:
        plan: the step's cut.
        context: the step context its loader fills (which micro-batch, how many samples).
    """

    def __init__(self, plan: ExactPlan, context: StepContext) -> None:
        self.plan = plan
        self.context = context
        self.sum = FixedOrderSum(plan)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Keep this micro-batch's gradients; on the step's last, write the shard's sum."""
        ctx = self.context
        if ctx.first:
            self.sum.start()
        self.sum.add([input_tensor] if ctx.samples else None)
        if not ctx.last:
            output_tensor.zero_()
            return None
        node = self.sum._local()
        send = node[0] if node is not None else torch.zeros_like(input_tensor)
        present = self.plan.ranks_holding(ctx.window_samples or 0)
        output_tensor.copy_(scatter_sum(send, present, group))
        return None
