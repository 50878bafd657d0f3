"""A prepared loader's workers: the stop signals left to the process they serve.

Slurm signals every process of a job step, and torchrun each worker's whole process group, so a
DataLoader's workers get a job's stop signal too. :class:`WorkerStart` makes them ignore it; the
served process stops at a step's end, saves and exits (``gk.train.Preemption``).
"""

from __future__ import annotations

import signal
from collections.abc import Callable

__all__ = ["STOP_SIGNALS", "WorkerStart"]


# The signals a job is stopped with: Slurm's --signal and scancel, a time limit's SIGTERM,
# torchrun passing a signal on to each worker's process group, Ctrl-C, a hang-up.
STOP_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


class WorkerStart:
    """A DataLoader worker's start: the stop signals ignored, then the loader's own
    ``worker_init_fn`` (``user``), if any.

    Slurm signals every process of a job step, and torchrun each worker's whole process group:
    the DataLoader's workers get the stop signal too. Left to its default action a worker dies,
    and the process it serves fails with "DataLoader worker ... is killed by signal" in the
    middle of a step, where ``gk.train.Preemption`` would have stopped at the step's end, saved
    and exited 75. The served process handles the signal, and ends its workers when it ends;
    a worker whose process is gone ends by itself (torch's watchdog).

    Args:
        user: the loader's own ``worker_init_fn``, called after, with the worker's id.
    """

    def __init__(self, user: Callable[[int], object] | None) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if self.user is not None:
            self.user(worker_id)
