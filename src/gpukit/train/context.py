"""The context of one optimizer step: where each micro-batch sits in it, and what it counts.

``prepare()`` makes one :class:`StepContext` per prepared loader and hands that same object to
the three parts that share the step, so they never look each other up:

- the loader fills it before it hands out each micro-batch (:meth:`StepContext.place`: the
  micro-batch's index and the window's length, this rank's share of samples and the global
  batch's);
- the :class:`~gpukit.train.step.TrainStep` reads the place and settles the step's count (the
  samples or tokens of the step on every rank) and this rank's gradient weight on the last
  micro-batch;
- the sample-weighted gradient all-reduce (DDP's communication hook, FSDP's reduce-scatter)
  reads the share, or the settled gradient weight, when the gradients are reduced.

It also carries the resolved precision, so ``loader.precision`` says what ``"auto"`` chose.

One lookup is kept, for the user's free functions only: :func:`current_context` names the
context of the prepared loader being iterated now, so that ``gk.distributed.step(loss)`` and
``gather_for_metrics`` need no object passed. The loader's pass sets it in a
:class:`contextvars.ContextVar` when it starts and removes it when it ends, so two threads (or
two asyncio tasks) each see their own loop; the step, the gradient hook and the training state
never use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from gpukit.errors import InvalidArgumentError
from gpukit.train.precision import Precision

__all__ = ["StepContext", "checked_accumulate", "current_context", "loader_pass"]


def checked_accumulate(steps: object) -> int:
    """A number of micro-batches per optimizer step, checked: a whole number from 1.

    Raises:
        InvalidArgumentError: ``steps`` is not an int (a bool, a float, a string), or is below 1.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(
            f"accumulate={steps!r} is not a number of micro-batches per optimizer step.",
            hint="Pass a whole number, 1 or more (1: no accumulation).",
        )
    return steps


class StepContext:
    """One optimizer step's place and counts, shared by the loader, the step and the hook.

    Per micro-batch (written by :meth:`place`): ``index`` of ``length`` in its window,
    ``samples`` (this rank's share), ``global_samples`` (the micro-batch over every rank) and
    ``window_samples`` (the step's samples over every rank, known in advance). Per step
    (written by :class:`~gpukit.train.accumulate.Accumulation`): ``local_count`` (this rank's
    items so far), ``reference`` (the count the loss weights divide by), ``user_counts``
    (counts came from ``dist.step(count=...)``), then on the last micro-batch ``count`` (the
    step's items over every rank) and ``gradient_weight`` (this rank's factor on its
    accumulated gradient). ``in_pass`` says whether its loader is being iterated.

    Args:
        accumulate: micro-batches per optimizer step, 1 or more.
        precision: the resolved precision the step trains with, or None.

    Raises:
        InvalidArgumentError: ``accumulate`` is not a whole number from 1.
    """

    def __init__(self, accumulate: int = 1, *, precision: Precision | None = None) -> None:
        self.accumulate = checked_accumulate(accumulate)
        self.precision = precision
        self.index = -1
        self.length = self.accumulate
        self.samples: int | None = None
        self.global_samples: int | None = None
        self.window_samples: int | None = None
        self.placed = False
        self.in_pass = False
        self.train_step: Any = None
        """The :class:`~gpukit.train.step.TrainStep` that reads this context, if any."""
        self.on_place: Callable[[bool], None] | None = None
        """Called by :meth:`place` with whether the micro-batch closes the step: the model's
        gradient sync (DDP's ``no_sync``) follows it."""
        self.new_step()

    def new_step(self) -> None:
        """Forget the counts of the previous optimizer step: a new one opens."""
        self.local_count = 0
        self.reference: int | None = None
        self.user_counts = False
        self.count: int | None = None
        self.gradient_weight: float | None = None

    def place(
        self,
        index: int,
        length: int,
        samples: int,
        window_samples: int,
        global_samples: int | None = None,
    ) -> None:
        """The next micro-batch is ``index`` of ``length`` in its step, ``samples`` here.

        ``window_samples`` counts the step's samples over every rank, ``global_samples`` the
        micro-batch's (``samples`` when not given: one process).

        Args:
            index: the micro-batch's place in its step, from 0.
            length: the micro-batches in the step.
            samples: this rank's samples in the micro-batch.
            window_samples: the step's samples over every rank.
            global_samples: the micro-batch's samples over every rank; None: ``samples``.
        """
        self.placed = True
        self.index, self.length = index, length
        self.samples, self.window_samples = samples, window_samples
        self.global_samples = samples if global_samples is None else global_samples
        if index == 0:
            self.new_step()
        if self.on_place is not None:
            self.on_place(self.last)

    def advance(self) -> None:
        """Count one more micro-batch where no loader places them: ``accumulate`` per step."""
        self.index = (self.index + 1) % self.accumulate
        self.length = self.accumulate
        if self.index == 0:
            self.new_step()

    @property
    def first(self) -> bool:
        """Whether the current micro-batch opens its optimizer step."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """Whether the current micro-batch closes its optimizer step (synchronise, step)."""
        return self.index == self.length - 1


_PASSES: ContextVar[tuple[StepContext, ...]] = ContextVar("gpukit_loader_passes", default=())
"""The contexts of the prepared loaders being iterated in this thread or task, innermost last."""


@contextmanager
def loader_pass(context: StepContext) -> Iterator[None]:
    """Mark ``context``'s loader as being iterated for the block (the loader's pass uses it).

    Passes nest (an evaluation loop inside a training loop): the innermost is current, and the
    one around it is current again once it ends.
    """
    context.in_pass = True
    _PASSES.set((*_PASSES.get(), context))
    try:
        yield
    finally:
        context.in_pass = False
        # Removed by identity, not reset to what was there before: passes left in another
        # order than they began (zip over two loaders) leave the others in place.
        _PASSES.set(tuple(c for c in _PASSES.get() if c is not context))


def current_context(*, with_step: bool = False) -> StepContext | None:
    """The step context of the prepared loader being iterated now, innermost first; None
    outside any. With ``with_step``, the innermost whose loader has a training step.

    The lookup behind ``gk.distributed.step(loss)`` and ``gather_for_metrics``, for user code
    that holds no loader; gpukit's own parts are handed their context instead.
    """
    for context in reversed(_PASSES.get()):
        # A pass ended from another thread (its generator closed there) left its context in
        # this thread's tuple; it is no longer in a pass.
        if context.in_pass and (not with_step or context.train_step is not None):
            return context
    return None
