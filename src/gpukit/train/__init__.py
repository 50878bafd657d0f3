"""The training step and the run around it: precision, accumulation, state, preemption, sharding.

``distributed.prepare()`` composes these parts with the process group and the sharded loader; a
one-process script uses them the same way. This package never imports ``gpukit.distributed``
(see docs/architecture.md, "The training room").
"""

from __future__ import annotations

from gpukit.train.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption, Requeue

__all__: list[str] = ["PREEMPTED_EXIT_CODE", "Preempted", "Preemption", "Requeue"]
