"""A real two-process gloo group whose rank 0 is the test process itself.

A test runs its own side as rank 0, here, and asks rank 1, a spawned process, to run a
module-level function at the same time; collectives then meet as in a launched job. Keeping
rank 0 in the test process lets a failure point at the test's own line, and lets tools that
trace what a test runs (coverage, mutation testing) see the code under test.

    with two_processes(tmp_path / "store") as other:
        other.run(fn, *args)  # rank 1 calls fn(1, *args)
        mine = fn(0, *args)
        theirs = other.result()
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

# A bound on every wait, so that a rank that never reaches a collective fails the test instead
# of hanging it; it includes the other rank's start (import torch), slow on a busy machine.
WAIT = timedelta(seconds=120)


def _next_job(jobs: Any, parent: int) -> Any:
    """The next job, or None once the test process is gone (killed: a mutation run's timeout)
    so that this rank never waits on as an orphan."""
    while True:
        try:
            return jobs.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


def _serve(store: str, jobs: Any, results: Any, parent: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=1, world_size=2, timeout=WAIT
    )
    try:
        while (job := _next_job(jobs, parent)) is not None:
            fn, args = job
            try:
                results.put((True, fn(1, *args)))
            except Exception as exc:
                results.put((False, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


class OtherRank:
    """Rank 1, seen from rank 0: give it a function to run, then read what it returned."""

    def __init__(self, jobs: Any, results: Any) -> None:
        self._jobs = jobs
        self._results = results
        self._unread = 0

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start ``fn(1, *args)`` on rank 1 (``fn`` must be importable: module level)."""
        # A test that failed before reading its result leaves it behind: drop it here, so
        # that the next test reads its own.
        while self._unread:
            self._results.get(timeout=WAIT.total_seconds())
            self._unread -= 1
        self._jobs.put((fn, args))
        self._unread += 1

    def result(self) -> Any:
        """What the last ``run`` returned; an AssertionError naming what it raised instead."""
        returned, value = self._results.get(timeout=WAIT.total_seconds())
        self._unread -= 1
        if not returned:
            raise AssertionError(f"rank 1 raised {value}")
        return value


@contextmanager
def two_processes(store: Path) -> Iterator[OtherRank]:
    """Make this process rank 0 of a gloo group of two; the other rank serves ``run`` calls."""
    # A file store, not a TCP port: a port chosen here could be taken by another process
    # before the group binds it.
    context = multiprocessing.get_context("spawn")
    jobs, results = context.Queue(), context.Queue()
    process = context.Process(
        target=_serve, args=(str(store), jobs, results, os.getpid()), daemon=True
    )
    process.start()
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=2, timeout=WAIT
        )
        try:
            yield OtherRank(jobs, results)
        finally:
            jobs.put(None)
            dist.destroy_process_group()
    finally:
        process.join(timeout=WAIT.total_seconds())
        if process.is_alive():
            process.kill()
            process.join()
