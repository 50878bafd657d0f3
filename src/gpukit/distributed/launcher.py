"""Run a function in several processes from Python, through torch.distributed.elastic.

This is torchrun's own machinery (``elastic_launch``: an agent, a c10d rendezvous, worker
processes it watches), called in-process so that notebooks and tests can use it. When one
worker fails the agent stops the others, and the failure comes back as a
:class:`~gpukit.errors.WorkerFailedError` naming the rank and what went wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from gpukit.errors import InvalidArgumentError, WorkerFailedError

R = TypeVar("R")

__all__ = ["free_port", "launch"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (the OS picks it).

    Args:
        host: the address to bind to look for a free port (127.0.0.1 by default).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# Error messages that mean "a peer went away", not "this rank went wrong": when one rank dies,
# the others fail in their next collective, and those failures must not hide the first one.
_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "communicator was aborted",
    "remote process exited",
)


def _worker(fn: Callable[..., R], backend: str | None, args: tuple[Any, ...], reports: str) -> R:
    """What each launched process runs: join the group, call ``fn``, leave the group.

    It notes in ``reports`` that it started, and when and how it failed, with a precise time:
    the agent reports only the first process it saw exit, which is not always the one that
    failed first.
    """
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    from gpukit.distributed.process_group import init

    folder = Path(reports)
    rank = os.environ.get("RANK", "0")
    (folder / f"{rank}.start").touch()

    @record  # also writes the exception to the agent's error file, as torchrun does
    def run() -> R:
        try:
            init(backend=backend)
            try:
                result = fn(*args)
                _check_result_travels(fn, result)
                return result
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        except BaseException as exc:
            note = {
                "time": time.time(),
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            (folder / f"{rank}.error").write_text(json.dumps(note))
            raise

    result = cast(R, run())  # record re-raises, so a value always comes back here
    (folder / f"{rank}.done").touch()
    return result


class _Discard:
    """A file that forgets what is written: pickling into it costs no memory."""

    def write(self, data: bytes) -> int:
        return len(data)


def _check_result_travels(fn: Callable[..., Any], result: object) -> None:
    # The result goes back to the parent by pickle, after fn has returned; a value that cannot
    # be pickled would end the worker with a bare exit code 1 and no word of why.
    try:
        pickle.Pickler(_Discard()).dump(result)
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError...
        raise InvalidArgumentError(
            f"{getattr(fn, '__qualname__', fn)!r} returned a {type(result).__name__}, which "
            f"cannot be sent back to the launching process by pickle ({exc}).",
            hint="Return plain data (numbers, strings, lists, dicts, tensors, state dicts), not "
            "open files, locks, generators, lambdas or models holding them.",
        ) from exc


_NOT_LOADED = "before running the function: the worker could not load it or its arguments"
_LOAD_HINT = (
    'With the default start_method="spawn", workers import the function by name: define it in '
    "a module file they can import, not in `python -c`, a notebook cell or the REPL (the "
    'worker\'s own error is on stderr above). start_method="fork" works in notebooks on Linux, '
    "before CUDA starts."
)


def _agent_view(failure: Any, started: bool = True) -> str:
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()} (pid {failure.pid})"
    if not started:
        return f"exited with code {failure.exitcode} (pid {failure.pid}) {_NOT_LOADED}"
    return f"exited with code {failure.exitcode} (pid {failure.pid}) without a Python error"


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _failures(failed: dict[int, Any], reports: Path) -> list[tuple[int, str, str | None]]:
    """Every failed rank, what happened to it and its traceback; the likely first cause first."""
    found: dict[int, tuple[float, float, str, str | None]] = {}
    for path in reports.glob("*.error"):
        note = json.loads(path.read_text())
        lost = any(s in note["error"].lower() for s in _PEER_LOST)
        found[int(path.stem)] = (
            1.0 if lost else 0.0,
            note["time"],
            f"raised {note['error']}",
            note["traceback"],
        )
    for rank, failure in failed.items():
        if rank not in found:  # no Python error: a signal or a hard exit, seen first by the agent
            started = (reports / f"{rank}.start").exists()
            found[rank] = (0.0, 0.0, _agent_view(failure, started), None)
    if any(entry[0] == 1.0 for entry in found.values()):
        # Another rank lost its peer: a rank that vanished without a word is the likely cause.
        for path in reports.glob("*.start"):
            rank = int(path.stem)
            if rank not in found and not (reports / f"{rank}.done").exists():
                found[rank] = (0.5, 0.0, "died without a Python error (a signal?)", None)
    ordered = sorted(found.items(), key=lambda item: (item[1][0], item[1][1], item[0]))
    return [(rank, _short(text), trace) for rank, (_, _, text, trace) in ordered]


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...], start_method: str) -> None:
    # Spawned workers receive fn and args by pickle; a lambda or a nested function would
    # otherwise fail deep inside multiprocessing with "Can't pickle local object".
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        # Pickled as "__main__.f": a spawned worker has no such __main__ to find f in.
        raise InvalidArgumentError(
            f"launch() cannot start {getattr(fn, '__qualname__', fn)!r} in {start_method}ed "
            "processes: it is defined in `python -c`, a notebook cell or the REPL, where "
            "the workers cannot import it.",
            hint="Define fn in a module file and import it from there, or pass "
            'start_method="fork" (Linux; works in notebooks, before CUDA starts).',
        )
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"launch() cannot send {getattr(fn, '__qualname__', fn)!r} or its arguments to "
            f"{start_method}ed processes: {exc}.",
            hint="Define fn at the top level of an importable module and pass picklable "
            'arguments, or use start_method="fork" (Linux, before CUDA starts).',
        ) from None


# The signals torch's elastic agent takes over (TORCHELASTIC_SIGNALS_TO_HANDLE's default).
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """Give the caller back its signal handlers once the launch is over.

    The elastic agent installs handlers that raise ``SignalException`` for SIGTERM, SIGINT,
    SIGHUP and SIGQUIT and leaves them in place: after ``launch`` returned, Ctrl-C would raise
    that instead of KeyboardInterrupt, and a script run under ``nohup`` would die on a hang-up.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # the agent installs nothing outside the main thread
        return
    kept = {
        signum: signal.getsignal(signum)
        for name in _AGENT_SIGNALS
        if (signum := getattr(signal, name, None)) is not None
    }
    try:
        yield
    finally:
        for signum, handler in kept.items():
            if handler is not None:  # None: set outside Python, nothing to give back
                signal.signal(signum, handler)


def launch(
    fn: Callable[..., R],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    start_method: str = "spawn",
    host: str = "127.0.0.1",
) -> list[R]:
    """Run ``fn(*args)`` in ``nprocs`` processes with the process group set up; results by rank.

    Each process starts with ``gk.distributed.init()`` already done, so ``fn`` may call
    ``rank()``, ``barrier()`` or ``prepare()`` at once. ``fn`` and ``args`` travel to the workers
    by pickle: with the default ``start_method="spawn"`` define ``fn`` in an importable module
    (not a notebook cell; ``start_method="fork"`` works there on Linux, before CUDA starts).

    Raises :class:`~gpukit.errors.WorkerFailedError` naming each failed rank and its error.

    >>> # results = gk.distributed.launch(train, 2, config)   # [rank 0's result, rank 1's]

    Args:
        fn: the function each process runs; picklable (module level) unless ``start_method``
            is "fork".
        nprocs: how many processes, 1 or more.
        *args: the arguments ``fn`` is called with, picklable.
        backend: the process group's backend; None: as :func:`init` picks it.
        start_method: how the processes start: "spawn" (the default), "fork" or
            "forkserver".
        host: the address of the rendezvous (127.0.0.1: this machine).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidArgumentError(
            f"launch() was asked for nprocs={nprocs!r} processes.",
            hint="Pass a positive number of processes, e.g. launch(fn, 2).",
        )
    if start_method != "fork":
        _check_picklable(fn, args, start_method)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"gpukit-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{host}:{free_port(host)}",
        max_restarts=0,  # a failure is reported, never silently retried
        monitor_interval=0.1,
        start_method=start_method,
    )
    with tempfile.TemporaryDirectory(prefix="gpukit-launch-") as reports, _signals_kept():
        try:
            results = elastic_launch(config, _worker)(fn, backend, args, reports)
        except ChildFailedError as exc:
            failures = _failures(exc.failures, Path(reports))
            first_rank, first_text, trace = failures[0]
            then = "; then ".join(f"rank {r} {text}" for r, text, _ in failures[1:])
            hint = f"Fix rank {first_rank} first: when one rank fails the launcher stops the "
            hint += "others, and their errors follow from it"
            hint += " (its traceback is this error's __cause__)." if trace else "."
            if _NOT_LOADED in first_text:
                hint = _LOAD_HINT
            raise WorkerFailedError(
                f"launch() of {getattr(fn, '__name__', fn)!r} on {nprocs} processes failed: "
                f"rank {first_rank} {first_text}" + (f"; then {then}" if then else "") + ".",
                hint=hint,
            ) from (RuntimeError(f"rank {first_rank}'s traceback:\n{trace}") if trace else None)
    return [results[rank] for rank in sorted(results)]
