"""The one call of a training loop: backward a micro-batch, step the optimizer when it is time.

A plain loop ends each batch with ``opt.zero_grad(); loss.backward(); opt.step()``. With mixed
precision and gradient accumulation that line grows a scaler, an unscale before clipping, a
``no_sync`` on all but the last micro-batch and a weight per micro-batch. :class:`TrainStep`
does all of it; ``gk.distributed.prepare(..., precision=..., accumulate=...)`` builds one, and
:func:`step` (``gk.distributed.step``) calls the one that belongs to the loader being iterated::

    for x, y in loader:
        loss = loss_fn(model(x), y)
        if result := dist.step(loss, clip_grad_norm=1.0):  # false while accumulating, or on
            scheduler.step()                              # a skipped fp16 step
            log(result.grad_norm)                         # the step's total gradient norm

One process without a group uses the same object: ``TrainStep(model, opt, accumulate=4)``,
then ``train_step(loss)`` per micro-batch (each weighing one item unless ``count=`` is given).
The step's place and counts live in its :class:`~gpukit.train.context.StepContext`, which the
prepared loader fills and the gradient all-reduce reads: the three are handed one object.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from gpukit.checkpoint.dtensor import is_sharded
from gpukit.errors import InvalidArgumentError
from gpukit.train.accumulate import Accumulation
from gpukit.train.context import StepContext, current_context
from gpukit.train.exact import ExactPlan, FixedOrderSum
from gpukit.train.precision import Precision, autocast_forward, resolve_precision
from gpukit.train.scaler import LossScaler

__all__ = ["StepResult", "TrainStep", "step"]


@dataclass(frozen=True, eq=False)
class StepResult:
    """What one call of the step did: true when the optimizer stepped.

    ``if dist.step(loss):`` reads as before, and the result equals ``True`` or ``False`` as the
    step's answer (``results.count(True)`` counts the steps taken).

    ``grad_norm`` is the total 2-norm of the step's gradients (unscaled and weighed: the
    gradients of the whole global batch, as ``torch.nn.utils.clip_grad_norm_`` returns it in
    one process) when the step clipped them (``clip_grad_norm=``), a 0-dim tensor on the
    gradients' device (read it with ``.item()`` when you log it: reading it waits for the
    GPU); ``None`` on a micro-batch that only accumulated, and when the step did not clip.

    Args:
        stepped: whether the optimizer stepped.
        grad_norm: the gradients' total 2-norm when the step clipped them; None otherwise.
    """

    stepped: bool
    grad_norm: torch.Tensor | None = None

    def __bool__(self) -> bool:
        return self.stepped

    def __eq__(self, other: object) -> bool:
        if isinstance(other, bool):
            return self.stepped is other
        if isinstance(other, StepResult):
            mine, theirs = self.grad_norm, other.grad_norm
            same_norm = mine is theirs or (
                mine is not None and theirs is not None and torch.equal(mine, theirs)
            )
            return self.stepped == other.stepped and same_norm
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.stepped)


class TrainStep:
    """Backward, weights, scaling and the optimizer step of one model, micro-batch by micro-batch.

    ``precision`` is a name, as ``prepare()`` takes it (``"fp32"``, ``"bf16-mixed"``,
    ``"fp16-mixed"``, ``"auto"``: resolved against the device of the model's parameters, and
    the model's forward put under its autocast, as ``prepare()`` does), or a resolved
    :class:`~gpukit.train.precision.Precision` (the forward is then left as it is: ``prepare()``
    and :func:`~gpukit.train.precision.autocast_forward` wrap it). :attr:`precision` is the
    resolved one: ``train_step.precision.name`` says what ``"auto"`` chose.

    ``context`` is the step's :class:`~gpukit.train.context.StepContext`, shared with the
    loader that places the micro-batches and the gradient hook that reads the weights
    (``prepare()`` hands the three one context); without one the step makes its own and counts
    its calls, ``accumulate`` per optimizer step. ``hooked`` says that the model's gradient
    all-reduce applies the gradient weight itself (the communication hook ``prepare()``
    installs); otherwise the gradients are weighted here before the step. ``distributed`` makes
    user-given counts summed over the group.

    Args:
        model: the model whose gradients are stepped.
        optimizer: its optimizer.
        precision: a precision name or a resolved ``Precision``; None: the context's, else fp32.
        accumulate: micro-batches per optimizer step, 1 or more; None: the context's, else 1.
        hooked: whether the model's gradient all-reduce applies the weights itself.
        distributed: whether counts given by the caller are summed over the process group.
        context: the step context shared with a loader and a hook; None: a new one.
        exact: exact mode's cut (``prepare(..., exact=True)`` gives it): each micro-batch's
            gradients are kept apart and added in the one order of
            :mod:`gpukit.train.exact`, over the processes too (by the step, or for a sharded
            model by its reduce-scatters); None: autograd accumulates.

    Raises:
        InvalidArgumentError: ``precision`` is neither a known name nor a ``Precision``,
            ``accumulate`` is not a whole number from 1 (or differs from the context's), or the
            context already belongs to another training step.
        DeviceError: a precision name the model's device cannot run natively.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        *,
        precision: Precision | str | None = None,
        accumulate: int | None = None,
        hooked: bool = False,
        distributed: bool = False,
        context: StepContext | None = None,
        exact: ExactPlan | None = None,
    ) -> None:
        if context is None:
            context = StepContext(1 if accumulate is None else accumulate)
        elif context.train_step is not None:
            raise InvalidArgumentError(
                "this step context already belongs to another training step.",
                hint="Give each TrainStep its own StepContext (prepare() makes one per loader).",
            )
        steps = context.accumulate if accumulate is None else accumulate
        requested = precision if precision is not None else context.precision
        resolved = _resolved(requested, model)
        self.scaler = LossScaler(resolved.device_type) if resolved.scaled else None
        self.accumulation = Accumulation(
            steps,
            distributed=distributed,
            scaled=self.scaler is not None,
            context=context,
            exact=None if exact is None else (exact.global_batch_size, exact.micro_batch_size),
        )  # the last check: nothing was changed before it
        if isinstance(requested, str):  # a name: its forward under autocast, as prepare() does
            inner = model.module if isinstance(model, DistributedDataParallel) else model
            autocast_forward(inner, resolved)  # fp32 gives back the plain forward
        self.model = model
        self.optimizer = optimizer
        self.context = context
        context.precision = resolved
        context.train_step = self
        context.on_place = self._set_gradient_sync
        self.hooked = hooked
        self.exact = exact
        # Exact mode adds the micro-batches' gradients here, unless the model is sharded: its
        # reduce-scatters add them (gpukit.train.exact.ExactReduceScatter).
        self._sum = FixedOrderSum(exact) if exact is not None and not is_sharded(model) else None
        self._stepping = False
        self._open = False
        optimizer.register_step_pre_hook(self._refuse_a_direct_step)

    @property
    def precision(self) -> Precision:
        """The resolved precision (``.name``: what ``"auto"`` chose)."""
        precision = self.context.precision
        assert precision is not None  # set when the step was made
        return precision

    def _refuse_a_direct_step(self, *_: object) -> None:
        if self._stepping or not self.required or not self.context.in_pass:
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
        """Place the next micro-batch: ``index`` of ``length`` in its optimizer step, with
        ``samples`` of the step's ``window_samples``. A prepared loader does it itself (through
        the context); call it in a loop of your own that cuts its batches into micro-batches.

        Args:
            index: the micro-batch's place in its step, from 0.
            length: the micro-batches in the step.
            samples: this rank's samples in the micro-batch.
            window_samples: the step's samples over every rank.
        """
        self.context.place(index, length, samples, window_samples)

    def _set_gradient_sync(self, last: bool) -> None:
        """Before each micro-batch's forward: reduce the gradients only on the step's last."""
        if isinstance(self.model, DistributedDataParallel):
            # What DDP's no_sync() sets: the forward that follows prepares the all-reduce only
            # when this micro-batch closes the step.
            self.model.require_backward_grad_sync = last
        elif callable(sync := getattr(self.model, "set_requires_gradient_sync", None)):
            # A sharded model (FSDP2): its no_sync. Gradients stay whole and local until the
            # micro-batch that closes the step, which reduce-scatters them once. In exact mode
            # every micro-batch reaches the reduce-scatter, which keeps it for the fixed sum.
            sync(last or self.exact is not None)

    def __call__(
        self,
        loss: torch.Tensor,
        *,
        count: object | None = None,
        clip_grad_norm: float | None = None,
        before_optimizer_step: Callable[[], object] | None = None,
    ) -> StepResult:
        """Backward ``loss`` (a mean over the micro-batch); step when the global batch is done.

        ``count``: the number of items ``loss`` averages over (non-padding tokens, say), to weigh
        micro-batches by items instead of samples; pass it on every call or on none.
        ``clip_grad_norm``: clip the gradients' total norm to this, on true (unscaled) gradients;
        the norm before clipping is the result's ``grad_norm``.
        ``before_optimizer_step``: called with no argument on the micro-batch that closes the
        step, after the gradients are final (reduced over the processes, weighed, unscaled and
        clipped: what the optimizer is about to use) and before the optimizer steps; for
        logging or checking gradients. Not called on micro-batches that only accumulate.

        Returns a :class:`StepResult`, true when the optimizer stepped: false on a micro-batch
        that only accumulated, and on a step skipped for inf/NaN fp16 gradients (do not advance
        an LR scheduler then).

        Raises:
            InvalidArgumentError: ``count`` is not a whole number of items,
                ``clip_grad_norm`` is not a finite number above 0, or ``before_optimizer_step``
                is not callable; checked on every call, before anything runs, so a refused call
                changes nothing.
        """
        max_norm = _checked_clip_norm(clip_grad_norm)
        if max_norm is not None and self.exact is not None and self._sum is None:
            raise InvalidArgumentError(
                "clip_grad_norm= in exact mode with a sharded model: the norm adds every "
                "rank's shards in the backend's order, which changes with the number of "
                "processes.",
                hint="Clip in exact mode without shard=, or shard without exact=True.",
            )
        if before_optimizer_step is not None and not callable(before_optimizer_step):
            raise InvalidArgumentError(
                f"before_optimizer_step={before_optimizer_step!r} is not callable.",
                hint="Pass a function of no argument, such as before_optimizer_step=check, "
                "or leave it out.",
            )
        acc = self.accumulation
        weight = acc.loss_weight(count)  # checks the count before counting the micro-batch
        if acc.last:
            acc.settle()
        if acc.first:
            self.optimizer.zero_grad(set_to_none=True)
            if self._sum is not None:
                self._sum.start()
        if self._sum is not None:
            self._exact_backward(loss, weight)
        else:
            if weight != 1.0:
                loss = loss * weight
            scaled = self.scaler.scale(loss) if self.scaler is not None else loss
            torch.autograd.backward(scaled)
        self._open = not acc.last
        if not acc.last:
            return StepResult(False)
        if self._sum is not None:
            self._exact_total()
        if not self.hooked:
            self._weigh_gradients(acc.gradient_weight())
        if self.scaler is not None and (max_norm is not None or before_optimizer_step is not None):
            self.scaler.unscale(self.optimizer)
        norm = None
        if max_norm is not None:
            norm = _whole(torch.nn.utils.clip_grad_norm_(self._parameters(), max_norm))
        if before_optimizer_step is not None:
            before_optimizer_step()
        self._stepping = True
        try:
            if self.scaler is not None:
                stepped = self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
                stepped = True
        finally:
            self._stepping = False
        return StepResult(stepped, norm)

    def _parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _trained(self) -> list[torch.Tensor]:
        return [p for p in self._parameters() if p.requires_grad]

    def _exact_backward(self, loss: torch.Tensor, weight: float) -> None:
        """Exact mode: this micro-batch's weighed gradients, kept apart for the fixed sum.

        An empty micro-batch (past the end of a short last step) is absent from the sum: its
        loss over no sample may read nan, and it is never backpropagated.
        """
        assert self._sum is not None
        params = self._trained()
        if not self.context.samples:
            self._sum.add(None)
            return
        if weight == 0.0:  # no item counted (a count of 0): a zero gradient, not nan * 0
            self._sum.add([torch.zeros_like(p) for p in params])
            return
        torch.autograd.backward(loss * weight if weight != 1.0 else loss)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for p in params:
            p.grad = None
        self._sum.add(grads)

    def _exact_total(self) -> None:
        """Exact mode, on the step's last micro-batch: the gradients become the fixed sum."""
        assert self._sum is not None
        params = self._trained()
        summed = self._sum.total(self.context.window_samples or 0, like=params)
        for p, grad in zip(params, summed, strict=True):
            p.grad = grad

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
        """The scaler's state and the accumulation's place (the optimizer's steps are
        ``TrainingState.step``'s to count).

        Raises:
            InvalidArgumentError: called between the micro-batches of one optimizer step, whose
                accumulated gradients no state holds.
        """
        if self._open:
            raise InvalidArgumentError(
                f"the training step is between micro-batches ({self.context.index + 1} of "
                f"{self.context.length} done): a save now would lose their accumulated "
                "gradients, and the resumed run would differ.",
                hint="Save after an optimizer step: when the result of dist.step(...) is true.",
            )
        return {
            "accumulation": self.accumulation.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: what :meth:`state_dict` returned.

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
        self.accumulation.load_state_dict(state["accumulation"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def _resolved(precision: object, model: nn.Module) -> Precision:
    """``precision`` as a :class:`Precision`: a name resolved against the model's device, an
    object as it is; None is fp32.

    Raises:
        InvalidArgumentError: ``precision`` is neither a known name nor a ``Precision``.
        DeviceError: the model's device cannot run the named precision natively.
    """
    if isinstance(precision, Precision):
        return precision
    device = _device_of(model)
    if precision is None:
        return resolve_precision("fp32", device)
    if not isinstance(precision, str):
        raise InvalidArgumentError(
            f"TrainStep got precision={precision!r} (a {type(precision).__name__}), neither a "
            "precision's name nor a resolved Precision.",
            hint="Pass one of 'auto', 'bf16-mixed', 'fp16-mixed', 'fp32' (as prepare() takes "
            "them), or gk.train.resolve_precision(name, device).",
        )
    return resolve_precision(precision, device)  # an unknown name: InvalidArgumentError


def _device_of(model: nn.Module) -> torch.device:
    """Where the model's weights are: its first parameter's (or buffer's) device; the CPU for
    a model with neither."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """The total norm of a sharded model's gradients (a DTensor over the ranks) as a plain
    tensor, every rank's shards included; a plain tensor as it is."""
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


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


def step(
    loss: torch.Tensor,
    *,
    count: object | None = None,
    clip_grad_norm: float | None = None,
    before_optimizer_step: Callable[[], object] | None = None,
) -> StepResult:
    """End a batch of a prepared loader: backward, and the optimizer step when it is time.

    The one call that replaces ``opt.zero_grad(); loss.backward(); opt.step()`` in a loop over
    a loader from ``prepare(..., precision=..., accumulate=...)``; see :meth:`TrainStep.__call__`
    for ``count``, ``clip_grad_norm`` and ``before_optimizer_step``. Returns a
    :class:`StepResult`: true when the optimizer stepped, with the gradients' norm when it
    clipped them.

    It reaches the training step of the prepared loader being iterated now (the innermost
    such loop; :func:`~gpukit.train.context.current_context`): ``loader.train_step(loss)`` is
    the same call, without the lookup.

    Args:
        loss: this micro-batch's loss, a scalar tensor (its mean over the micro-batch).
        count: the items the loss averages over (tokens, say); None: the micro-batch's samples.
        clip_grad_norm: the largest total 2-norm of the step's gradients, above 0; None: no
            clipping.
        before_optimizer_step: called once the step's gradients are weighed, unscaled and
            clipped, just before the optimizer steps; None: nothing.

    Raises:
        InvalidArgumentError: no loader prepared with an optimizer is being iterated, or
            an argument is refused (see :meth:`TrainStep.__call__`).
    """
    context = current_context(with_step=True)
    if context is None:
        raise InvalidArgumentError(
            "step(loss) was called outside a loop over a loader prepared with an optimizer.",
            hint="Call it inside `for batch in loader:` for the loader from "
            "prepare(model, opt, loader, ...), or use gk.train.TrainStep(model, opt) directly.",
        )
    train_step: TrainStep = context.train_step
    return train_step(
        loss,
        count=count,
        clip_grad_norm=clip_grad_norm,
        before_optimizer_step=before_optimizer_step,
    )
