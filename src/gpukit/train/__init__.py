"""The training step and the run around it: precision, accumulation, state, preemption, sharding.

``distributed.prepare()`` composes these parts with the process group and the sharded loader; a
one-process script uses them the same way. This package never imports ``gpukit.distributed``
(see docs/architecture.md, "The training room").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The step, and the light modules it needs, at once: ``gpukit.train.step`` is then the function,
# never the module of the same name that a later import would otherwise leave in its place.
from gpukit.train.accumulate import Accumulation, AccumulationPlan, plan_accumulation
from gpukit.train.context import StepContext
from gpukit.train.precision import PRECISIONS, Precision, resolve_precision
from gpukit.train.scaler import LossScaler
from gpukit.train.step import StepResult, TrainStep, step

# The run around the step (its saves, its preemption), loaded on first use: a script that only
# prepares a model and steps never imports the checkpoint package they need.
_EXPORTS = {
    "PREEMPTED_EXIT_CODE": "gpukit.train.preempt",
    "Preempted": "gpukit.train.preempt",
    "Preemption": "gpukit.train.preempt",
    "Requeue": "gpukit.train.preempt",
    "Resumed": "gpukit.train.state",
    "TrainingState": "gpukit.train.state",
}

if TYPE_CHECKING:
    from gpukit.train.preempt import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
    from gpukit.train.preempt import Preempted as Preempted
    from gpukit.train.preempt import Preemption as Preemption
    from gpukit.train.preempt import Requeue as Requeue
    from gpukit.train.state import Resumed as Resumed
    from gpukit.train.state import TrainingState as TrainingState

__all__ = [
    "PRECISIONS",
    "PREEMPTED_EXIT_CODE",
    "Accumulation",
    "AccumulationPlan",
    "LossScaler",
    "Precision",
    "Preempted",
    "Preemption",
    "Requeue",
    "Resumed",
    "StepContext",
    "StepResult",
    "TrainStep",
    "TrainingState",
    "plan_accumulation",
    "resolve_precision",
    "step",
]


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'gpukit.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(target), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
