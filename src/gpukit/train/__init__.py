"""The training step and the run around it: precision, accumulation, state, preemption, sharding.

``distributed.prepare()`` composes these parts with the process group and the sharded loader; a
one-process script uses them the same way. This package never imports ``gpukit.distributed``
(see docs/architecture.md, "The training room").
"""

from __future__ import annotations

from gpukit.train.accumulate import Accumulation, AccumulationPlan, plan_accumulation
from gpukit.train.context import StepContext
from gpukit.train.precision import PRECISIONS, Precision, resolve_precision
from gpukit.train.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption, Requeue
from gpukit.train.scaler import LossScaler
from gpukit.train.state import Resumed, TrainingState
from gpukit.train.step import StepResult, TrainStep, step

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
