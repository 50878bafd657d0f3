"""The torchrun that ``gpukit run --ddp`` starts: torchrun, which acts on the first signal it
passes on and only passes on the ones after it.

torchrun's agent answers a signal it handles by passing it to every worker and waiting for them
to end (``--shutdown-timeout``). A second signal during that wait cuts it short: the agent sends
SIGTERM to its workers, and a third ends the agent with its workers still running, on GPUs
gpukit then no longer claims. Second copies are the rule, not the exception: Slurm signals every
process of a step (``scancel --signal``, ``--signal=USR1@90``), so torchrun gets Slurm's copy and
gpukit's; a user presses Ctrl-C twice; Slurm sends SIGTERM at the time limit after its SIGUSR1.
Here every signal after the first goes to the workers' process groups (each worker leads its
own), and the agent goes on waiting for them.

How torchrun exits says how its workers ended, so that a batch script can tell a preemption
from a failure, as it can with one process (instead of a traceback and 1 for both):

- workers that fail: the code of the first that failed, or 75 when the workers that failed
  stopped for preemption (:data:`gpukit.train.preempt.PREEMPTED_EXIT_CODE`); see
  :func:`workers_exit_code`;
- a torchrun ended by signal N: 128+N, as a process killed by it would, or 75 when the workers
  it passed the signal on to stopped for preemption (every one that did not exit 0, 75).

``python -m gpukit.distributed.torchrun_agent ARGS`` takes torchrun's arguments. On a torch whose
agent has no ``_terminate_process_handler`` this is torchrun unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from gpukit.supervise import children

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["WorkerFailure", "how_workers_ended", "main", "workers_exit_code"]


class WorkerFailure(Protocol):
    """What torchrun's ``ProcessFailure`` says of a failed worker, as read here."""

    @property
    def exitcode(self) -> int:
        """The worker's exit code, or -N when signal N ended it."""

    @property
    def timestamp(self) -> int:
        """When torchrun saw it fail, in whole seconds."""


# How torchrun's own stopping of the remaining workers shows in their exit codes.
_STOPPED_BY_TORCHRUN = (-signal.SIGTERM, -signal.SIGKILL)


def _status(exitcode: int) -> int:
    """The shell's ``$?`` for a worker's exit code: -N (signal N) becomes 128+N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def workers_exit_code(failures: Mapping[int, WorkerFailure]) -> int:
    """The exit code of a torchrun whose workers failed (``failures``: by global rank, in the
    order torchrun saw them fail).

    Once a worker has failed, torchrun stops the others (SIGTERM, then SIGKILL) and lists
    them too: those, after the first failure, followed it and are left out. Of the rest, 75
    when every one exited 75, the code of a worker stopped for preemption, so that the job may
    be requeued; otherwise the code of the first that failed for another reason (128+N for
    signal N): a failure beside a preemption is a failure, which a requeued job would meet
    again. The first failure is torchrun's "root cause": earliest, then first seen.

    >>> from types import SimpleNamespace as Failure
    >>> workers_exit_code({0: Failure(exitcode=75, timestamp=1), 1: Failure(exitcode=3,
    ...     timestamp=2)})
    3
    """
    from gpukit.train.preempt import PREEMPTED_EXIT_CODE  # torch: imported when needed

    ordered = sorted(failures.values(), key=lambda failure: failure.timestamp)  # stable
    if not ordered:
        return 1
    first, *later = ordered
    counted = [first, *(f for f in later if f.exitcode not in _STOPPED_BY_TORCHRUN)]
    others = [_status(f.exitcode) for f in counted if f.exitcode != PREEMPTED_EXIT_CODE]
    return others[0] if others else PREEMPTED_EXIT_CODE


def _pass_on(signum: int) -> None:
    for pid in children(os.getpid()):
        try:
            os.killpg(pid, signum)  # torchrun starts each worker in a session of its own
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)  # a child that leads no group (not one of torchrun's)
        except PermissionError:
            pass


def _record_workers() -> list[Any]:
    """Keep each group of workers torchrun's agent starts (its process context), to read how
    they ended once a signal has ended torchrun, which then reports nothing of them."""
    started: list[Any] = []
    try:
        from torch.distributed.elastic.agent.server import local_elastic_agent as agent
    except ImportError:
        return started
    start = getattr(agent, "start_processes", None)
    if start is None:  # another torch: the signal's 128+N stands
        return started

    def recording(*args: Any, **kwargs: Any) -> Any:
        context = start(*args, **kwargs)
        started.append(context)
        return context

    # The agent calls the name it imported into its module, so it is replaced there.
    agent.start_processes = recording  # type: ignore[attr-defined]
    return started


def _no_restart_after_preemption() -> None:
    """Have torchrun's agent end, not restart its workers, once they stopped for preemption.

    With ``--max-restarts`` the agent restarts a failed worker group while restarts remain:
    workers that stopped for preemption (every one that failed on its own, 75) would be
    started again on a node that is being taken away, and the job never requeued. Their
    failure then takes the agent's no-restarts-left way out, whose report ends as 75.
    """
    try:
        from torch.distributed.elastic.agent.server import local_elastic_agent as agent
    except ImportError:
        return
    cls = getattr(agent, "LocalElasticAgent", None)
    monitor = getattr(cls, "_monitor_workers", None)
    if cls is None or monitor is None:  # another torch: its restarts stand
        return
    from gpukit.train.preempt import PREEMPTED_EXIT_CODE

    def monitoring(self: Any, worker_group: Any) -> Any:
        result = monitor(self, worker_group)
        failures = getattr(result, "failures", None)
        if failures and workers_exit_code(failures) == PREEMPTED_EXIT_CODE:
            self._remaining_restarts = 0
        return result

    cls._monitor_workers = monitoring


def _signalled(signum: int, started: list[Any]) -> int:
    """128+N for the signal N that ended torchrun, as for a process it killed; but 75 when the
    workers it passed the signal on to stopped for preemption (every one that failed, 75)."""
    from gpukit.train.preempt import PREEMPTED_EXIT_CODE

    handlers = getattr(started[-1], "subprocess_handlers", None) if started else None
    codes = [handler.proc.returncode for handler in (handlers or {}).values()]
    failed = [code for code in codes if code != 0]  # None: a worker that never ended
    if failed and all(code == PREEMPTED_EXIT_CODE for code in failed):
        return _preempted(PREEMPTED_EXIT_CODE)
    return 128 + signum


def _preempted(code: int) -> int:
    print(
        f"gpukit run: the workers stopped for preemption (exit {code}): the job can be requeued.",
        file=sys.stderr,
    )
    return code


def _failed(exc: ChildFailedError) -> int:
    """Say how the workers ended, in place of the traceback torchrun ends with; their code."""
    from gpukit.train.preempt import PREEMPTED_EXIT_CODE

    code = workers_exit_code(exc.failures)
    if code == PREEMPTED_EXIT_CODE:
        return _preempted(code)
    preempted = any(f.exitcode == PREEMPTED_EXIT_CODE for f in exc.failures.values())
    aside = f" for a reason other than preemption (exit {PREEMPTED_EXIT_CODE})" if preempted else ""
    print(
        f"gpukit run: {how_workers_ended(exc.failures)}; exit {code}, the code of the first "
        f"worker that failed{aside}.",
        file=sys.stderr,
    )
    return code


def _not_a_failed_worker(record: logging.LogRecord) -> bool:
    """False for torchrun's log lines of a failed worker and of its stopping the others: the
    line of :func:`how_workers_ended` says both."""
    message = str(record.msg)
    return not message.startswith(("failed (exitcode", "Sending process"))


def how_workers_ended(failures: Mapping[int, WorkerFailure]) -> str:
    """One line for torchrun's report of its failed workers: what each worker said is in its
    own output, above.

    Args:
        failures: torchrun's failures, by global rank.

    >>> from types import SimpleNamespace as Failure
    >>> how_workers_ended({1: Failure(exitcode=-9, timestamp=1), 0: Failure(exitcode=3,
    ...     timestamp=2), 2: Failure(exitcode=-15, timestamp=2)})
    'rank 0 exited 3, rank 1 was killed by SIGKILL, rank 2 was stopped (SIGTERM)'
    """
    # When a worker has failed on its own, torchrun stops the rest with SIGTERM, then SIGKILL.
    own = [f.timestamp for f in failures.values() if f.exitcode not in _STOPPED_BY_TORCHRUN]
    first = min(own, default=None)
    said = []
    for rank, failure in sorted(failures.items()):
        code = failure.exitcode
        if code >= 0:
            said.append(f"rank {rank} exited {code}")
            continue
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if code in _STOPPED_BY_TORCHRUN and first is not None and failure.timestamp >= first:
            said.append(f"rank {rank} was stopped ({name})")
        else:
            said.append(f"rank {rank} was killed by {name}")
    return ", ".join(said)


def main() -> int:
    """Run torchrun on ``sys.argv[1:]``; return its exit status."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    first = getattr(api, "_terminate_process_handler", None)
    if first is not None:
        acting: list[int] = []

        def handler(signum: int, frame: FrameType | None) -> None:
            if not acting:
                acting.append(signum)
                first(signum, frame)  # raises: the agent passes the signal on and waits
            _pass_on(signum)

        # The agent installs its handler by this module-level name when it starts the workers.
        api._terminate_process_handler = handler
    started = _record_workers()
    _no_restart_after_preemption()
    # The agent logs each failed worker, then reports them all: said once here, in one line.
    logging.getLogger(api.__name__).addFilter(_not_a_failed_worker)
    try:
        torchrun()
    except api.SignalException as exc:
        return _signalled(int(exc.sigval), started)
    except ChildFailedError as exc:
        return _failed(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
