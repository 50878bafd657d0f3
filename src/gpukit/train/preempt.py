"""Preemption: stop every rank at the same step when a signal asks the job to stop, save, leave.

A cluster that wants its GPUs back first sends a signal (Slurm's ``--signal=USR1@90``: SIGUSR1
ninety seconds before the end; ``scancel`` and a time limit: SIGTERM), then kills. The signal
handler here only notes that a signal came; nothing is saved inside it, where the training
step may be half done. At each check :meth:`Preemption.should_stop` asks every rank (one
all-reduce, MAX), so a signal to any rank stops all of them at the same step, and
:meth:`Preemption.stop` saves, asks Slurm to requeue the job, and ends the process with
:data:`PREEMPTED_EXIT_CODE`::

    from gpukit.train import Preemption

    with Preemption() as preemption:          # SIGUSR1 and SIGTERM; the previous handlers after
        for step in range(start, steps):
            train_step()
            if preemption.should_stop():      # the same answer on every rank, at the same step
                preemption.stop(state)        # state.save() (or a callable), requeue, exit 75

Under Slurm (``SLURM_JOB_ID`` set), a stop caused by a requeue signal (SIGUSR1 by default) runs
``scontrol requeue $SLURM_JOB_ID`` once, from rank 0, after every rank has saved; the job goes
back to the queue and, started again, resumes from the save. A stop caused by another signal
(SIGTERM: ``scancel``, or the time limit reached) saves and exits without a requeue: a
cancelled job stays cancelled. Without ``scontrol`` the exit code (75, ``EX_TEMPFAIL``: "try
again") is the batch script's to act on, or Slurm's own (``RequeueExit=75`` in slurm.conf).

With gradient accumulation (``prepare(..., accumulate=K)``, ``dist.step(loss)`` per
micro-batch) a check between the micro-batches of one optimizer step answers False: their
accumulated gradients are in no save. The stop comes at the check after the micro-batch that
closes the step, on every rank alike.

What is promised: a signal that arrives at any moment, to any rank, between or during checks,
is acted on at the next check at an optimizer step's end, by every rank at that same check;
the save runs in the training loop's thread, never in a signal handler; every rank reports
what became of the requeue that rank 0 asked for; a process with no group (one process) is
its own whole job. Not promised: anything about a signal that arrives after
:meth:`~Preemption.close`, or about a rank that never reaches the next check (a hang, or a kill
before it): what is saved then is the previous save.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import torch.distributed as dist

from gpukit._agree import from_rank_0, largest
from gpukit.errors import InvalidArgumentError, check_bool
from gpukit.train.context import current_context

if TYPE_CHECKING:
    from gpukit.train.state import TrainingState

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "Preemption", "Requeue"]

PREEMPTED_EXIT_CODE = 75
"""The exit code of a process that :meth:`Preemption.stop` ended: sysexits' ``EX_TEMPFAIL``
("a temporary failure; try again"), apart from 0, gpukit's own codes and 128+N (a signal)."""

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGUSR1, signal.SIGTERM)
DEFAULT_REQUEUE_ON: tuple[signal.Signals, ...] = (signal.SIGUSR1,)

# What a rank says at a check, agreed by MAX: any rank's requeue signal outranks a plain stop.
_NONE, _STOP, _REQUEUE = 0, 1, 2


class _Saves(Protocol):
    def save(self) -> object: ...


class _Stepping(Protocol):
    """A training step (``gk.train.TrainStep``): whether it is between micro-batches."""

    @property
    def mid_step(self) -> bool: ...


@dataclass(frozen=True)
class Requeue:
    """What became of the request to requeue the job: ``done``, and what was run or why not.

    Rank 0 asks; every rank of the group reads what happened to rank 0's request.

    Args:
        done: whether the job was requeued.
        reason: what was run (``"scontrol requeue 1234"``), or why it was not.
    """

    done: bool
    reason: str


class Preempted(SystemExit):
    """Raised by :meth:`Preemption.stop` once the state is saved: the process ends with
    :data:`PREEMPTED_EXIT_CODE` and no traceback unless caught. ``checks`` counts the
    :meth:`~Preemption.should_stop` calls up to the one that said stop (the same on every
    rank); ``requeue`` says what became of rank 0's request to requeue, the same on every
    rank, ``None`` when none was asked for.

    Args:
        checks: the :meth:`~Preemption.should_stop` calls up to the one that said stop.
        requeue: what became of rank 0's request to requeue; None: none was asked for.
    """

    def __init__(self, checks: int, requeue: Requeue | None) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.checks = checks
        self.requeue = requeue


class Preemption:
    """Note the stop signals as they come; agree on them across ranks at step boundaries.

    ``signals`` are the signals that ask the job to stop (SIGUSR1 and SIGTERM by default);
    ``requeue_on`` those of them after which the job is requeued under Slurm (SIGUSR1).
    ``group`` is the process group that stops together: torch.distributed's default group
    when one is initialised, else none (this process alone). ``requeue=False`` never asks
    Slurm to requeue.

    ``state`` is the training state (``gk.TrainingState``, whose training step is among its
    parts) or the training step (``gk.train.TrainStep``) whose optimizer steps bound the
    stops: :meth:`should_stop` answers False between the micro-batches of one step. Without
    it, or when the state holds no training step, the step of the prepared loader that the
    calling thread is iterating is used (``prepare(..., accumulate=K)``), and outside any such
    loop every check is a step boundary.

    The handlers are installed by :meth:`install` (or ``with``) and the previous ones restored
    by :meth:`close`. Python runs signal handlers in the main thread only, so both must be
    called there. While they are installed, a stop signal no longer ends the process by
    itself: the loop must reach its next check (Slurm kills the job ``KillWait`` seconds,
    30 by default, after its SIGTERM).

    Args:
        signals: the signals that ask the job to stop (SIGUSR1 and SIGTERM).
        requeue_on: those of them after which the job is requeued under Slurm (SIGUSR1).
        requeue: False: never ask Slurm to requeue.
        group: the process group that stops together; None: the default group, if any.
        env: the variables to read the Slurm job from; None: ``os.environ``.
        state: the training state or training step whose optimizer steps bound the stops;
            None: the prepared loader's step being iterated.

    Raises:
        InvalidArgumentError: ``signals`` is empty or not signals, ``requeue_on`` names a
            signal not in ``signals``, ``requeue`` is not a bool, ``state`` is neither a
            training state nor a training step, or (from :meth:`install`) not in the main
            thread.
    """

    def __init__(
        self,
        signals: Iterable[int] = DEFAULT_SIGNALS,
        *,
        requeue_on: Iterable[int] = DEFAULT_REQUEUE_ON,
        requeue: bool = True,
        group: dist.ProcessGroup | None = None,
        env: Mapping[str, str] | None = None,
        state: TrainingState | _Stepping | None = None,
    ) -> None:
        self.signals = _signals(signals, "signals")
        if not self.signals:
            raise InvalidArgumentError(
                "Preemption(signals=()) was given no signal to stop on.",
                hint="Leave the default (SIGUSR1, SIGTERM) or name the signals your "
                "scheduler sends, e.g. signals=[signal.SIGUSR1].",
            )
        self.requeue_on = _signals(requeue_on, "requeue_on")
        stray = [s.name for s in self.requeue_on if s not in self.signals]
        if stray:
            raise InvalidArgumentError(
                f"Preemption(requeue_on=...) names {', '.join(stray)}, which is not among "
                f"the signals it stops on ({', '.join(s.name for s in self.signals)}).",
                hint="Add it to signals=..., or leave it out of requeue_on.",
            )
        check_bool("requeue", requeue)
        self.requeue = requeue
        self.group = group
        self._env = env
        if state is not None and not hasattr(state, "mid_step") and not _has_parts(state):
            raise InvalidArgumentError(
                f"Preemption(state=...) got a {type(state).__name__}, which is neither a "
                "training state nor a training step, so the stops cannot wait for the end of "
                "an optimizer step.",
                hint="Pass the gk.TrainingState the loop saves, or its gk.train.TrainStep; "
                "or leave state out in a loop over a prepared loader.",
            )
        self.state = state
        self.received: signal.Signals | None = None
        """The stop signal this process received: the first, or a requeue signal that came
        after it (``None``: none yet)."""
        self.checks = 0
        """How many times :meth:`should_stop` was called."""
        self._agreed = _NONE
        self._previous: dict[signal.Signals, Any] = {}

    # --- the handler: it notes, nothing more --------------------------------------------------

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None or (
            signum in self.requeue_on and self.received not in self.requeue_on
        ):
            self.received = signal.Signals(signum)

    def install(self) -> Preemption:
        """Install the handlers (in the main thread); returns ``self``.

        Raises:
            InvalidArgumentError: called from another thread than the main one, or twice.
        """
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError(
                f"Preemption.install() was called in thread "
                f"{threading.current_thread().name!r}: Python runs signal handlers only in "
                "the main thread, so the signals would never be noted.",
                hint="Create and enter the Preemption in the main thread, around the training "
                "loop; should_stop() and stop() may then run in any thread.",
            )
        if self._previous:
            raise InvalidArgumentError(
                "Preemption.install() was called twice: its handlers are installed already.",
                hint="Install it once (or use `with Preemption() as p:`), close() it after.",
            )
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._note)
        return self

    def close(self) -> None:
        """Restore the handlers that were installed before :meth:`install` (idempotent)."""
        while self._previous:
            signum, previous = self._previous.popitem()
            signal.signal(signum, previous)

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- the step boundary --------------------------------------------------------------------

    def should_stop(self) -> bool:
        """True, on every rank alike, when any rank has received a stop signal and no rank is
        between the micro-batches of an optimizer step.

        Call it on every rank, the same number of times, after each step or micro-batch: it is
        one all-reduce (MAX) of two numbers over the group (this rank's wish, and whether it is
        mid-step), so the answer is the same on every rank. A signal that arrives during the
        call, or between micro-batches, is answered at the next call that ends a step.
        """
        self.checks += 1
        self._agreed, anyone_mid_step = self._agree(self._wish(), self._mid_step())
        return self._agreed != _NONE and not anyone_mid_step

    def stop(self, save: Callable[[], object] | _Saves | None) -> NoReturn:
        """Save, requeue the job if a requeue signal stopped it, and raise :class:`Preempted`.

        ``save`` is a callable or an object with a ``save()`` method (the training state, whose
        asynchronous save is waited for), run on every rank in this (the loop's) thread; ``None``
        saves nothing. Every rank must call this after :meth:`should_stop` said True, so that
        the save and the requeue happen once for the whole job: once every rank has saved, rank
        0 asks Slurm to requeue and tells every rank what came of it (:attr:`Preempted.requeue`).

        Args:
            save: what saves the state: a callable, an object with ``save()`` (a
                ``gk.TrainingState``, waited for), or None (nothing saved).

        Raises:
            InvalidArgumentError: called between the micro-batches of an optimizer step (which
                :meth:`should_stop` never answers True in), before anything is saved.
            Preempted: otherwise, after saving: ``SystemExit(75)``.
        """
        if save is not None and _mid_step(self._train_step() or _train_step_of(save)):
            # Refused here, on every rank alike (all are at the same micro-batch), rather than
            # by rank 0's save alone while the others wait for it at the save's meeting.
            raise InvalidArgumentError(
                "Preemption.stop() was called between the micro-batches of an optimizer step: "
                "a save now would lose their accumulated gradients.",
                hint="Call stop() when should_stop() said True, which it says only once the "
                "step's last micro-batch is done (the result of dist.step(...) is true).",
            )
        if callable(save):
            save()
        elif save is not None:
            save.save()
            # An asynchronous save (gk.TrainingState) must be on disk before the requeue.
            wait = getattr(save, "wait", None)
            if callable(wait):
                wait()
        group = self._group()
        if group is not None:
            dist.barrier(group=group)  # every rank's part is written before the job is requeued
        requeue = None
        if self._agreed == _REQUEUE:
            rank = 0 if group is None else dist.get_rank(group)
            if rank == 0 and self.requeue:
                requeue = _requeue(self._env)
            if group is not None:
                requeue = _told_by_rank_0(requeue, group)
        raise Preempted(self.checks, requeue)

    def _wish(self) -> int:
        received = self.received
        if received is None:
            return _NONE
        return _REQUEUE if received in self.requeue_on else _STOP

    def _group(self) -> dist.ProcessGroup | None:
        if self.group is not None:
            return self.group
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    def _train_step(self) -> _Stepping | None:
        """The training step whose window bounds the stops (see the class's ``state``)."""
        given = _train_step_of(self.state)
        if given is not None:
            return given
        context = current_context(with_step=True)
        return None if context is None else _train_step_of(context.train_step)

    def _mid_step(self) -> bool:
        return _mid_step(self._train_step())

    def _agree(self, wish: int, mid_step: bool) -> tuple[int, bool]:
        """The group's strongest wish, and whether any rank is between micro-batches."""
        group = self._group()
        if group is None:
            return wish, mid_step
        agreed, anyone_mid_step = largest([wish, int(mid_step)], group)
        return agreed, bool(anyone_mid_step)


def _has_parts(source: object) -> bool:
    return isinstance(getattr(source, "parts", None), Mapping)


def _train_step_of(source: object) -> _Stepping | None:
    """``source`` itself when it is a training step, else the training step among its
    ``parts`` (a ``gk.TrainingState``'s), else None."""
    if hasattr(source, "mid_step"):
        return source
    parts = getattr(source, "parts", None)
    if isinstance(parts, Mapping):
        found: _Stepping | None = next((p for p in parts.values() if hasattr(p, "mid_step")), None)
        return found
    return None


def _mid_step(train_step: _Stepping | None) -> bool:
    return train_step is not None and bool(train_step.mid_step)


def _told_by_rank_0(requeue: Requeue | None, group: dist.ProcessGroup) -> Requeue | None:
    """What became of rank 0's requeue, on every rank of ``group`` (rank 0 passes its own)."""
    said = from_rank_0(None if requeue is None else (requeue.done, requeue.reason), group)
    if said is None:
        return None
    done, reason = said
    return Requeue(bool(done), str(reason))


def _signals(values: Iterable[int], name: str) -> tuple[signal.Signals, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise InvalidArgumentError(
            f"Preemption({name}={values!r}) is not a collection of signals.",
            hint=f"Pass signals, e.g. {name}=[signal.SIGUSR1, signal.SIGTERM].",
        )
    found: list[signal.Signals] = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(
                f"Preemption({name}=...) holds {value!r}, which is not a signal.",
                hint="Use the signal module's names: signal.SIGUSR1, signal.SIGTERM.",
            )
        try:
            sig = signal.Signals(value)
        except ValueError as exc:
            raise InvalidArgumentError(
                f"Preemption({name}=...) holds {value}, which is no signal of this system.",
                hint="Use the signal module's names: signal.SIGUSR1, signal.SIGTERM.",
            ) from exc
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise InvalidArgumentError(
                f"Preemption({name}=...) holds {sig.name}, which no process can handle.",
                hint="Ask the scheduler for a signal before the kill: sbatch --signal=USR1@90.",
            )
        if sig not in found:
            found.append(sig)
    return tuple(found)


def _requeue(env: Mapping[str, str] | None) -> Requeue:
    """Ask Slurm to requeue this job: ``scontrol requeue $SLURM_JOB_ID``."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "")  # an array task's own id: it alone is requeued
    if not job_id:
        return Requeue(False, "not a Slurm job (no SLURM_JOB_ID)")
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        return Requeue(
            False, f"no scontrol on PATH: exit code {PREEMPTED_EXIT_CODE} is the script's"
        )
    try:
        done = subprocess.run(
            [scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Requeue(False, f"scontrol requeue {job_id} failed: {exc}")
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
        return Requeue(False, f"scontrol requeue {job_id}: {said}")
    return Requeue(True, f"scontrol requeue {job_id}")
