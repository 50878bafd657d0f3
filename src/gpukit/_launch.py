"""Run a function in several processes from Python, through torch.distributed.elastic.

This is torchrun's own machinery (``elastic_launch``: an agent, a c10d rendezvous, worker
processes it watches), called in-process so that notebooks and tests can use it. When one
worker fails the agent stops the others, and the failure comes back as a
:class:`~gpukit.errors.WorkerFailedError` naming the rank and what went wrong.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from typing import Any, TypeVar, cast

from gpukit.errors import InvalidArgumentError, WorkerFailedError

R = TypeVar("R")

__all__ = ["free_port", "launch"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _worker(fn: Callable[..., R], backend: str | None, args: tuple[Any, ...]) -> R:
    """What each launched process runs: join the group, call ``fn``, leave the group."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    from gpukit import distributed

    @record  # writes the exception to the agent's error file, so the parent can name it
    def run() -> R:
        distributed.init(backend=backend)
        try:
            return fn(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    result = cast(R, run())  # record re-raises, so a value always comes back here
    return result


def _describe(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):  # the error file's structured form
        message = message.get("message", "")
    if failure.exitcode < 0 and not isinstance(failure.error_file_data.get("message"), dict):
        return f"was killed by {failure.signal_name()} (pid {failure.pid})"
    if not message or message.startswith("To enable traceback"):
        return f"exited with code {failure.exitcode} (pid {failure.pid}) without a Python error"
    return f"raised {message}"


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
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidArgumentError(
            f"launch() was asked for nprocs={nprocs!r} processes.",
            hint="Pass a positive number of processes, e.g. launch(fn, 2).",
        )
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
    try:
        results = elastic_launch(config, _worker)(fn, backend, args)
    except ChildFailedError as exc:
        failures = sorted(exc.failures.items())
        lines = [f"rank {rank} {_describe(failure)}" for rank, failure in failures]
        first_rank, first = exc.get_first_failure()
        cause = _cause(first)
        where = (
            "its traceback is this error's __cause__"
            if cause is not None
            else "a signal usually means the system killed it (out of memory?) or a native crash"
        )
        raise WorkerFailedError(
            f"launch() of {getattr(fn, '__name__', fn)!r} on {nprocs} processes failed: "
            + "; ".join(lines)
            + ".",
            hint=f"Look at rank {first_rank} first ({where}); when one rank fails, the others "
            "are stopped.",
        ) from cause
    return [results[rank] for rank in sorted(results)]


def _cause(failure: Any) -> BaseException | None:
    data = failure.error_file_data.get("message")
    if isinstance(data, dict):
        trace = data.get("extraInfo", {}).get("py_callstack")
        if trace:
            return RuntimeError(f"traceback of the failed worker:\n{trace}")
    return None
