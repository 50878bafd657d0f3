"""The fp16 gradient scaler, run by gpukit: scale, unscale before clipping, skip and count.

fp16 gradients underflow without loss scaling, so the loss is multiplied by a large factor
before the backward and the gradients divided by it before the optimizer uses them (torch's
``GradScaler`` does both). What a user of ``GradScaler`` must remember, this does in one
place: gradients are unscaled before clipping, so ``clip_grad_norm_`` sees true gradients; a
step whose gradients hold inf or NaN is skipped (the weights stay) and counted; the caller
learns whether the optimizer stepped, so an LR scheduler is not advanced on a skipped step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["LossScaler"]

_LOG = logging.getLogger("gpukit.train")


class LossScaler:
    """A ``torch.amp.GradScaler`` with its skipped steps counted and reported.

    Args:
        device_type: "cuda" or "cpu", as ``torch.amp.GradScaler`` takes it.
        **grad_scaler_kwargs: ``GradScaler``'s options (``init_scale``, ``growth_interval``...).
    """

    def __init__(self, device_type: str, **grad_scaler_kwargs: Any) -> None:
        self.scaler = torch.amp.GradScaler(device_type, **grad_scaler_kwargs)
        self.steps = 0
        self.skipped_steps = 0
        self._unscaled = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale, to call ``backward()`` on.

        Args:
            loss: the loss to call ``backward()`` on, a scalar tensor.
        """
        return self.scaler.scale(loss)

    def unscale(self, optimizer: Optimizer) -> None:
        """Divide the optimizer's gradients by the scale (once per step), before clipping.

        Args:
            optimizer: the optimizer whose gradients to unscale.
        """
        if not self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def step(self, optimizer: Optimizer) -> bool:
        """Step unless the gradients hold inf or NaN; update the scale. True when it stepped.

        Args:
            optimizer: the optimizer to step.
        """
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled = False
        self.steps += 1
        # The scale only ever shrinks after inf/NaN was found (backoff), and then the step
        # was skipped: torch offers no public flag for it.
        skipped = self.scaler.get_scale() < before
        if skipped:
            self.skipped_steps += 1
            _LOG.info(
                "skipped an optimizer step: inf or NaN in the fp16 gradients; loss scale "
                "%g -> %g (%d of %d steps skipped)",
                before,
                self.scaler.get_scale(),
                self.skipped_steps,
                self.steps,
            )
        return not skipped

    @property
    def scale_value(self) -> float:
        """The current loss scale."""
        return float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        """The scale, its growth tracker and the step counts."""
        return {
            "scaler": self.scaler.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Args:
            state: what :meth:`state_dict` returned.
        """
        self.scaler.load_state_dict(state["scaler"])
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
