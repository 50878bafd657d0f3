"""The one call of a training loop: backward a micro-batch, step the optimizer when it is time.

A plain loop ends each batch with ``opt.zero_grad(); loss.backward(); opt.step()``. With mixed
precision and gradient accumulation that line grows a scaler, an unscale before clipping, a
``no_sync`` on all but the last micro-batch and a weight per micro-batch. :class:`TrainStep`
does all of it; ``gk.distributed.prepare(..., precision=..., accumulate=...)`` builds one, and
:func:`step` (``gk.distributed.step``) calls the one that belongs to the loader being iterated::

    for x, y in loader:
        loss = loss_fn(model(x), y)
        if dist.step(loss):          # False while accumulating, or on a skipped fp16 step
            scheduler.step()

One process without a group uses the same object: ``TrainStep(model, opt, accumulate=4)``,
then ``train_step(loss)`` per micro-batch (each weighing one item unless ``count=`` is given).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from gpukit.errors import InvalidArgumentError
from gpukit.train.accumulate import Accumulation
from gpukit.train.precision import Precision
from gpukit.train.scaler import LossScaler

__all__ = ["TrainStep", "current_step", "step"]

_FEEDING: list[TrainStep] = []


class TrainStep:
    """Backward, weights, scaling and the optimizer step of one model, micro-batch by micro-batch.

    ``hooked`` says that the model's gradient all-reduce applies the accumulation's gradient
    weight itself (the communication hook ``prepare()`` installs); otherwise the gradients are
    weighted here before the step. ``distributed`` makes user-given counts summed over the group.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        *,
        precision: Precision | None = None,
        accumulate: int = 1,
        hooked: bool = False,
        distributed: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.precision = precision
        self.scaler = (
            LossScaler(precision.device_type)
            if precision is not None and precision.scaled
            else None
        )
        self.accumulation = Accumulation(
            accumulate, distributed=distributed, scaled=self.scaler is not None
        )
        self.hooked = hooked
        self.optimizer_steps = 0
        self._stepping = False
        self._open = False
        optimizer.register_step_pre_hook(self._refuse_a_direct_step)

    def _refuse_a_direct_step(self, *_: object) -> None:
        if self._stepping or not self.required or current_step() is not self:
            return
        raise InvalidArgumentError(
            "opt.step() was called in a loop over a loader prepared with "
            + (
                f"accumulate={self.accumulation.steps}"
                if self.accumulation.steps > 1
                else "fp16 precision"
            )
            + ": it would step on every micro-batch, with unweighted or unscaled gradients.",
            hint="End each batch with gk.distributed.step(loss) in place of "
            "opt.zero_grad(); loss.backward(); opt.step().",
        )

    @property
    def required(self) -> bool:
        """Whether a loop that skips this call would train wrongly (accumulation, fp16)."""
        return self.accumulation.steps > 1 or self.scaler is not None

    def begin(self, index: int, length: int, samples: int, window_samples: int) -> None:
        """Called by the loader before it hands out each micro-batch: place it, set the sync."""
        self.accumulation.begin(index, length, samples, window_samples)
        if isinstance(self.model, DistributedDataParallel):
            # What DDP's no_sync() sets: the forward that follows prepares the all-reduce only
            # when this micro-batch closes the step.
            self.model.require_backward_grad_sync = self.accumulation.last
        elif callable(sync := getattr(self.model, "set_requires_gradient_sync", None)):
            # A sharded model (FSDP2): its no_sync. Gradients stay whole and local until the
            # micro-batch that closes the step, which reduce-scatters them once.
            sync(self.accumulation.last)

    def __call__(
        self,
        loss: torch.Tensor,
        *,
        count: object | None = None,
        clip_grad_norm: float | None = None,
    ) -> bool:
        """Backward ``loss`` (a mean over the micro-batch); step when the global batch is done.

        ``count``: the number of items ``loss`` averages over (non-padding tokens, say), to weigh
        micro-batches by items instead of samples; pass it on every call or on none.
        ``clip_grad_norm``: clip the gradients' total norm to this, on true (unscaled) gradients.
        Returns True when the optimizer stepped: False on a micro-batch that only accumulated,
        and on a step skipped for inf/NaN fp16 gradients (do not advance an LR scheduler then).

        Raises:
            InvalidArgumentError: ``count`` is not a whole number of items, or
                ``clip_grad_norm`` is not a finite number above 0; checked on every call, before
                anything runs, so a refused call changes nothing.
        """
        max_norm = _checked_clip_norm(clip_grad_norm)
        acc = self.accumulation
        weight = acc.loss_weight(count)  # checks the count before counting the micro-batch
        if acc.last:
            acc.settle()
        if acc.first:
            self.optimizer.zero_grad(set_to_none=True)
        if weight != 1.0:
            loss = loss * weight
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        torch.autograd.backward(scaled)
        self._open = not acc.last
        if not acc.last:
            return False
        if not self.hooked:
            self._weigh_gradients(acc.gradient_weight())
        if max_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self._parameters(), max_norm)
        self._stepping = True
        try:
            if self.scaler is not None:
                stepped = self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
                stepped = True
        finally:
            self._stepping = False
        self.optimizer_steps += stepped
        return stepped

    def _parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _weigh_gradients(self, weight: float) -> None:
        if weight == 1.0:
            return
        grads = [p.grad for p in self._parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, weight)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN fp16 gradients (0 without a scaler)."""
        return 0 if self.scaler is None else self.scaler.skipped_steps

    @property
    def mid_step(self) -> bool:
        """Whether gradients of an unfinished optimizer step are accumulated (between its first
        micro-batch's backward and its optimizer step)."""
        return self._open

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, the accumulation's place and the step counts.

        Raises:
            InvalidArgumentError: called between the micro-batches of one optimizer step, whose
                accumulated gradients no state holds.
        """
        if self._open:
            raise InvalidArgumentError(
                f"the training step is between micro-batches ({self.accumulation.index + 1} of "
                f"{self.accumulation.length} done): a save now would lose their accumulated "
                "gradients, and the resumed run would differ.",
                hint="Save after an optimizer step: when dist.step(...) returned True.",
            )
        return {
            "optimizer_steps": self.optimizer_steps,
            "accumulation": self.accumulation.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            InvalidArgumentError: the state holds a scaler and this step has none, or the other
                way round.
        """
        if (state.get("scaler") is None) != (self.scaler is None):
            raise InvalidArgumentError(
                "the training-step state was saved "
                + ("without" if state.get("scaler") is None else "with")
                + " an fp16 gradient scaler, and this run "
                + ("uses one." if self.scaler is not None else "does not."),
                hint="Resume with the precision= the state was saved with.",
            )
        self.optimizer_steps = int(state["optimizer_steps"])
        self.accumulation.load_state_dict(state["accumulation"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def _checked_clip_norm(clip_grad_norm: object) -> float | None:
    """The gradient norm to clip to, as a float; ``None`` (no clipping) stays ``None``.

    A norm of 0 or below would turn each step around (a negative norm flips the gradients'
    sign: descent becomes ascent), and NaN would write NaN into every weight, so only a finite
    number above 0 is a norm.

    >>> _checked_clip_norm(1), _checked_clip_norm(None)
    (1.0, None)

    Raises:
        InvalidArgumentError: ``clip_grad_norm`` is not a real number (a bool, a string, a
            tensor), is not finite, or is not above 0.
    """
    if clip_grad_norm is None:
        return None
    if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, Real):
        raise InvalidArgumentError(
            f"clip_grad_norm={clip_grad_norm!r} (a {type(clip_grad_norm).__name__}) is not a "
            "number, so it cannot bound the gradients' norm.",
            hint="Pass a number above 0, such as clip_grad_norm=1.0, or leave it out to not clip.",
        )
    try:
        norm = float(clip_grad_norm)
    except OverflowError:  # an int too large for a float: no finite norm either
        norm = math.inf
    if not math.isfinite(norm) or norm <= 0:
        raise InvalidArgumentError(
            f"clip_grad_norm={clip_grad_norm!r} is not a finite norm above 0: "
            + _what_it_does(norm),
            hint="Pass a number above 0, such as clip_grad_norm=1.0, or leave it out to not clip.",
        )
    return norm


def _what_it_does(norm: float) -> str:
    """What clipping to ``norm`` (not a finite number above 0) would do to the training."""
    if math.isnan(norm):
        return "it would write NaN into every weight."
    if norm < 0:
        return "it would flip every gradient, turning descent into ascent."
    if norm == 0:
        return "it would zero every gradient, so the steps would learn nothing."
    return "it would never clip, which is what leaving it out does."


def feeding(train_step: TrainStep) -> None:
    """Mark ``train_step`` as the one whose loader is being iterated (the loader calls this)."""
    _FEEDING.append(train_step)


def done_feeding(train_step: TrainStep) -> None:
    """Undo :func:`feeding` when the loader's pass ends."""
    _FEEDING.remove(train_step)


def current_step() -> TrainStep | None:
    """The training step of the prepared loader being iterated now, if any."""
    return _FEEDING[-1] if _FEEDING else None


def step(
    loss: torch.Tensor, *, count: object | None = None, clip_grad_norm: float | None = None
) -> bool:
    """End a batch of a prepared loader: backward, and the optimizer step when it is time.

    The one call that replaces ``opt.zero_grad(); loss.backward(); opt.step()`` in a loop over
    a loader from ``prepare(..., precision=..., accumulate=...)``; see :meth:`TrainStep.__call__`
    for ``count`` and ``clip_grad_norm``. Returns True when the optimizer stepped.

    Raises:
        InvalidArgumentError: no loader prepared with an optimizer is being iterated, or
            ``count`` or ``clip_grad_norm`` is refused (see :meth:`TrainStep.__call__`).
    """
    current = current_step()
    if current is None:
        raise InvalidArgumentError(
            "step(loss) was called outside a loop over a loader prepared with an optimizer.",
            hint="Call it inside `for batch in loader:` for the loader from "
            "prepare(model, opt, loader, ...), or use gk.train.TrainStep(model, opt) directly.",
        )
    return current(loss, count=count, clip_grad_norm=clip_grad_norm)
