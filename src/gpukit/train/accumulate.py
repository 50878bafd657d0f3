"""Exact gradient accumulation: each micro-batch weighted by its share of the optimizer step.

An optimizer step sees one global batch, cut into up to K micro-batches per process. The plain
recipe (divide each micro-batch's mean loss by K) is exact only when every micro-batch holds as
many samples (or tokens) as the others; the last window of an epoch, uneven shares over the
processes and padding make them differ, and then a sample of a small micro-batch weighs more than
one of a large one (the bug of transformers#34191, trl#2175). Here each micro-batch's loss, a
mean over its own ``n_k`` items, is weighted so that the step's gradient is the mean over all
``N`` items of the global batch, on every process together:

    gradient = sum over ranks r, micro-batches k of (n_rk / N) * grad(mean loss_rk)

which is what one process computes on the whole global batch. The weight is applied in two
factors, ``n_k / r`` on the loss of micro-batch k and ``r / N`` once on the accumulated
gradient, in the all-reduce of the last micro-batch (or on the gradients, for one process). The
reference ``r`` is ``N`` itself where it is known before the first backward (samples counted by
the loader, which knows the window's size in advance): the loss then carries the whole weight,
as ``loss / K`` does in a hand-written loop, and the gradients are not touched again. Under fp16
loss scaling, and for counts the user gives (tokens, whose ``N`` is the sum of every rank's
counts: one small all-reduce per optimizer step, made just before the last micro-batch's
backward), ``r`` is this rank's first non-zero count in the window instead, so that no rank needs
``N`` early and a loss keeps its usual size (a small loss underflows in fp16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpukit.errors import InvalidArgumentError
from gpukit.train.context import StepContext, checked_accumulate

__all__ = ["Accumulation", "AccumulationPlan", "check_count", "plan_accumulation"]


def check_count(count: object) -> int:
    """A micro-batch's count (samples, tokens) as an int; a 0-dim tensor is read once.

    Raises:
        InvalidArgumentError: ``count`` is not a whole number of items, or is negative.
    """
    if isinstance(count, torch.Tensor) and count.dim() == 0 and not count.is_floating_point():
        count = int(count.item())
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise InvalidArgumentError(
            f"count={count!r} is not a number of items in the micro-batch.",
            hint="Pass the number of items the loss averages over, e.g. the non-padding tokens: "
            "count=(labels != -100).sum().",
        )
    return count


class Accumulation:
    """The two weights that make an optimizer step exact, over the step's :class:`StepContext`.

    The context says where the current micro-batch sits (a loader places it there); without
    a loader the accumulation counts calls itself, K per window, every micro-batch weighing
    one item unless a count is given. What it counts is written into the same context, so the
    gradient all-reduce reads the settled weight from there.

    Args:
        steps: micro-batches per optimizer step, 1 or more.
        distributed: whether counts given by the caller are summed over the process group.
        scaled: whether the loss is scaled (fp16 mixed precision, a gradient scaler).
        context: the step context to read and write; None: a new one.
        exact: exact mode's cut (global and micro-batch size), or None. Its weights do not
            depend on the number of processes: ``n_k / N`` on the loss where the loader counts
            samples, else ``n_k`` on the loss and ``1 / N`` on the summed gradient.

    Raises:
        InvalidArgumentError: ``steps`` is not a whole number from 1, or ``context`` was made
            for another number of micro-batches per step.
    """

    def __init__(
        self,
        steps: int,
        *,
        distributed: bool = False,
        scaled: bool = False,
        context: StepContext | None = None,
        exact: tuple[int, int] | None = None,
    ) -> None:
        checked_accumulate(steps)
        if context is not None and context.accumulate != steps:
            raise InvalidArgumentError(
                f"accumulate={steps} was given with a step context of "
                f"accumulate={context.accumulate}.",
                hint="Give the training step and its loader one number of micro-batches.",
            )
        self.steps = steps
        self.distributed = distributed
        self.scaled = scaled
        self.context = context if context is not None else StepContext(steps)
        self.exact = exact

    def begin(self, index: int, length: int, samples: int, window_samples: int) -> None:
        """The next micro-batch is ``index`` of ``length`` in its window, with ``samples`` here
        (see :meth:`StepContext.place`).

        Args:
            index: the micro-batch's place in its window, from 0.
            length: the micro-batches in the window.
            samples: this rank's samples in the micro-batch.
            window_samples: the window's samples over every rank.
        """
        self.context.place(index, length, samples, window_samples)

    @property
    def first(self) -> bool:
        """Whether the current micro-batch opens its optimizer step."""
        return self.context.first

    @property
    def last(self) -> bool:
        """Whether the current micro-batch closes its optimizer step (synchronise, step)."""
        return self.context.last

    def loss_weight(self, count: object | None) -> float:
        """Record this micro-batch's count and return the factor for its (mean) loss.

        Args:
            count: the items this micro-batch's loss averages over; None: its samples.

        Raises:
            InvalidArgumentError: ``count`` is not a whole number of items; nothing is counted.
        """
        n = None if count is None else check_count(count)  # before the micro-batch is counted
        ctx = self.context
        if not ctx.placed:
            ctx.advance()
        if n is None:
            n = ctx.samples if ctx.samples is not None else 1
        else:
            ctx.user_counts = True
            if ctx.samples == 0:  # an empty share's stand-in: its tokens are no one's
                n = 0
        ctx.local_count += n
        if ctx.reference is None and self.exact is not None:
            # A reference every rank and every number of processes shares, a rank without a
            # sample included: the step's samples (known before the first backward), or 1 for
            # counts (the sum's 1/N comes after).
            ctx.reference = (ctx.window_samples if count is None else None) or 1
        if n == 0:
            return 0.0
        if ctx.reference is None:
            known = ctx.window_samples if count is None and not self.scaled else None
            ctx.reference = known or n
        return n / ctx.reference

    def settle(self) -> None:
        """Learn N, the step's count over every rank, and this rank's gradient weight m / N;
        call on the last micro-batch, on every rank."""
        ctx = self.context
        if not ctx.user_counts and ctx.window_samples is not None:
            total = ctx.window_samples
        else:
            total = ctx.local_count
            if self.distributed and dist.is_available() and dist.is_initialized():
                summed = torch.tensor([total], dtype=torch.int64)
                dist.all_reduce(summed)
                total = int(summed.item())
        ctx.count = total
        ctx.gradient_weight = ctx.reference / total if ctx.reference is not None and total else 0.0

    def gradient_weight(self) -> float:
        """The factor for this rank's accumulated gradient before the sum over ranks: m / N
        (0 before :meth:`settle`)."""
        weight = self.context.gradient_weight
        return 0.0 if weight is None else weight

    def state_dict(self) -> dict[str, Any]:
        """Where the current window stands (counts so far), to resume mid-step."""
        ctx = self.context
        return {
            "steps": self.steps,
            **({} if self.exact is None else {"exact": list(self.exact)}),
            "index": ctx.index,
            "length": ctx.length,
            "reference": ctx.reference,
            "local_total": ctx.local_count,
            "user_counts": ctx.user_counts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            InvalidArgumentError: the state was saved with another number of micro-batches
                (in exact mode: another global batch or micro-batch size, whatever the number
                of processes).
        """
        if self.exact is not None or "exact" in state:
            saved = state.get("exact")
            if saved != (None if self.exact is None else list(self.exact)):
                raise InvalidArgumentError(
                    "the accumulation state was saved "
                    + (
                        f"in exact mode with global_batch_size={saved[0]} and "
                        f"micro_batch_size={saved[1]}"
                        if isinstance(saved, list) and len(saved) == 2
                        else "outside exact mode"
                        if saved is None
                        else "with an exact cut that is not [global, micro] sizes"
                    )
                    + ", and this run "
                    + (
                        f"uses global_batch_size={self.exact[0]}, micro_batch_size={self.exact[1]}."
                        if self.exact is not None
                        else "is not in exact mode."
                    ),
                    hint="Resume with the exact= and batch sizes the run started with.",
                )
        elif state.get("steps") != self.steps:
            raise InvalidArgumentError(
                f"the accumulation state was saved with accumulate={state.get('steps')!r}, "
                f"and this run uses accumulate={self.steps}.",
                hint="Resume with the accumulate= the state was saved with.",
            )
        ctx = self.context
        ctx.index, ctx.length = int(state["index"]), int(state["length"])
        ctx.reference = state["reference"]
        ctx.local_count = int(state["local_total"])
        ctx.user_counts = bool(state["user_counts"])


@dataclass(frozen=True)
class AccumulationPlan:
    """A global batch as micro-batches: ``micro_batch_size`` per process, ``steps`` of them.

    Args:
        micro_batch_size: the samples of one micro-batch on one process.
        steps: the micro-batches per optimizer step (``accumulate=``), 1 or more.
    """

    micro_batch_size: int
    steps: int


def plan_accumulation(
    global_batch_size: int, largest_micro_batch: int, world_size: int = 1
) -> AccumulationPlan:
    """The fewest micro-batches per step for ``global_batch_size`` when at most
    ``largest_micro_batch`` samples fit.

    The micro-batch is the largest size that fits and divides each process's share of the
    global batch, so every step is K equal micro-batches. Pair it with ``gk.find_batch_size``:

    >>> plan_accumulation(256, largest_micro_batch=40, world_size=2)
    AccumulationPlan(micro_batch_size=32, steps=4)

    Args:
        global_batch_size: the samples one optimizer step sees over all processes.
        largest_micro_batch: the largest micro-batch that fits on one device.
        world_size: how many processes share each global batch (1).

    Raises:
        InvalidArgumentError: a size is not a positive whole number, or the global batch
            cannot be split evenly over ``world_size`` processes.
    """
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("largest_micro_batch", largest_micro_batch),
        ("world_size", world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(
                f"{name}={value!r} is not a positive whole number.",
                hint="Pass sizes as ints, 1 or more.",
            )
    if global_batch_size % world_size:
        raise InvalidArgumentError(
            f"global_batch_size={global_batch_size} cannot be split evenly over {world_size} "
            "processes.",
            hint=f"Use a multiple of {world_size}.",
        )
    share = global_batch_size // world_size
    micro = max(d for d in range(1, min(share, largest_micro_batch) + 1) if share % d == 0)
    return AccumulationPlan(micro, share // micro)
