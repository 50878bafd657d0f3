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
    """Where this rank is in its optimizer step, and the two weights that make the step exact.

    The loader tells it each micro-batch's place with :meth:`begin`; without a loader it counts
    calls itself, K per window, every micro-batch weighing one item unless a count is given.
    """

    def __init__(self, steps: int, *, distributed: bool = False, scaled: bool = False) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidArgumentError(
                f"accumulate={steps!r} is not a number of micro-batches per optimizer step.",
                hint="Pass a whole number, 1 or more (1: no accumulation).",
            )
        self.steps = steps
        self.distributed = distributed
        self.scaled = scaled
        self.index = -1
        self.length = steps
        self.samples: int | None = None
        self.window_samples: int | None = None
        self._fed = False
        self._reset()

    def _reset(self) -> None:
        self.reference: int | None = None
        self.local_total = 0
        self.user_counts = False
        self.global_total: int | None = None

    def begin(self, index: int, length: int, samples: int, window_samples: int) -> None:
        """The next micro-batch is ``index`` of ``length`` in its window, with ``samples`` here."""
        self._fed = True
        self.index, self.length = index, length
        self.samples, self.window_samples = samples, window_samples
        if index == 0:
            self._reset()

    def _advance_alone(self) -> None:
        self.index = (self.index + 1) % self.steps
        self.length = self.steps
        if self.index == 0:
            self._reset()

    @property
    def first(self) -> bool:
        """Whether the current micro-batch opens its optimizer step."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """Whether the current micro-batch closes its optimizer step (synchronise, step)."""
        return self.index == self.length - 1

    def loss_weight(self, count: object | None) -> float:
        """Record this micro-batch's count and return the factor for its (mean) loss.

        Raises:
            InvalidArgumentError: ``count`` is not a whole number of items; nothing is counted.
        """
        n = None if count is None else check_count(count)  # before the micro-batch is counted
        if not self._fed:
            self._advance_alone()
        if n is None:
            n = self.samples if self.samples is not None else 1
        else:
            self.user_counts = True
        self.local_total += n
        if n == 0:
            return 0.0
        if self.reference is None:
            known = self.window_samples if count is None and not self.scaled else None
            self.reference = known or n
        return n / self.reference

    def settle(self) -> None:
        """Learn N, the step's count over every rank; call on the last micro-batch, every rank."""
        if not self.user_counts and self.window_samples is not None:
            self.global_total = self.window_samples
            return
        total = self.local_total
        if self.distributed and dist.is_available() and dist.is_initialized():
            summed = torch.tensor([total], dtype=torch.int64)
            dist.all_reduce(summed)
            total = int(summed.item())
        self.global_total = total

    def gradient_weight(self) -> float:
        """The factor for this rank's accumulated gradient before the sum over ranks: m / N."""
        if self.reference is None or not self.global_total:
            return 0.0
        return self.reference / self.global_total

    def state_dict(self) -> dict[str, Any]:
        """Where the current window stands (counts so far), to resume mid-step."""
        return {
            "steps": self.steps,
            "index": self.index,
            "length": self.length,
            "reference": self.reference,
            "local_total": self.local_total,
            "user_counts": self.user_counts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            InvalidArgumentError: the state was saved with another number of micro-batches.
        """
        if state.get("steps") != self.steps:
            raise InvalidArgumentError(
                f"the accumulation state was saved with accumulate={state.get('steps')!r}, "
                f"and this run uses accumulate={self.steps}.",
                hint="Resume with the accumulate= the state was saved with.",
            )
        self.index, self.length = int(state["index"]), int(state["length"])
        self.reference = state["reference"]
        self.local_total = int(state["local_total"])
        self.user_counts = bool(state["user_counts"])


@dataclass(frozen=True)
class AccumulationPlan:
    """A global batch as micro-batches: ``micro_batch_size`` per process, ``steps`` of them."""

    micro_batch_size: int
    steps: int


def plan_accumulation(
    global_batch_size: int, largest_micro_batch: int, world_size: int = 1
) -> AccumulationPlan:
    """The fewest micro-batches per step for ``global_batch_size`` when at most ``largest`` fit.

    The micro-batch is the largest size that fits and divides each process's share of the
    global batch, so every step is K equal micro-batches. Pair it with ``gk.find_batch_size``:

    >>> plan_accumulation(256, largest_micro_batch=40, world_size=2)
    AccumulationPlan(micro_batch_size=32, steps=4)

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
