"""Preemption in a real two-process gloo group: a signal to one rank stops both at one step.

The test process is rank 0 (see ``tests/helpers/two_processes.py``); rank 1 runs the same loop in a
spawned process. Lightning broadcasts rank 0's flag only, so a signal to any other rank is lost
there; here every rank's counts.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpukit.train.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption
from tests.helpers.two_processes import OtherRank, two_processes

pytestmark = pytest.mark.slow

STEPS = 50


def _loop(rank: int, signalled_rank: int, signal_at: int, signum: int) -> dict[str, Any]:
    """Train STEPS steps, checking after each; signal this process at ``signal_at`` when it is
    ``signalled_rank``. Returns the step each rank stopped at and what it saw."""
    saved: list[int] = []
    with Preemption(env={}) as preemption:
        for step in range(STEPS):
            if rank == signalled_rank and step == signal_at:
                os.kill(os.getpid(), signum)
            if preemption.should_stop():
                try:
                    preemption.stop(lambda step=step: saved.append(step))
                except Preempted as stopped:
                    return {
                        "step": step,
                        "checks": stopped.checks,
                        "code": stopped.code,
                        "saved": saved,
                        "received": preemption.received and preemption.received.name,
                    }
    return {"step": None, "saved": saved}


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as rank1:
        yield rank1


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=lambda s: s.name)
def test_a_signal_to_rank_1_alone_stops_both_ranks_at_the_same_step(
    other: OtherRank, signum: int
) -> None:
    other.run(_loop, 1, 7, signum)
    mine = _loop(0, 1, 7, signum)
    theirs = other.result()
    assert mine["step"] is not None, "rank 0 never stopped: rank 1's signal was not agreed"
    assert mine["step"] == theirs["step"] >= 7
    assert mine["checks"] == theirs["checks"] == mine["step"] + 1
    # Each rank saved once, at the step that stopped it, and ends with the documented code.
    assert mine["saved"] == theirs["saved"] == [mine["step"]]
    assert mine["code"] == theirs["code"] == PREEMPTED_EXIT_CODE
    assert (mine["received"], theirs["received"]) == (None, signal.Signals(signum).name)


def test_a_signal_to_rank_0_alone_stops_rank_1_too(other: OtherRank) -> None:
    other.run(_loop, 0, 3, signal.SIGUSR1)
    mine = _loop(0, 0, 3, signal.SIGUSR1)
    theirs = other.result()
    assert mine["step"] == theirs["step"] >= 3


def test_without_a_signal_both_ranks_run_every_step(other: OtherRank) -> None:
    other.run(_loop, 1, STEPS, signal.SIGUSR1)  # never signalled: signal_at is past the end
    mine = _loop(0, 1, STEPS, signal.SIGUSR1)
    assert mine == other.result() == {"step": None, "saved": []}


def _signal_before_the_first_check(rank: int) -> int | None:
    """Rank 1 is signalled before the loop starts, long before any check."""
    with Preemption(env={}) as preemption:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        for step in range(STEPS):
            if preemption.should_stop():
                return step
    return None


def test_a_signal_that_came_between_checks_is_acted_on_at_the_next(other: OtherRank) -> None:
    other.run(_signal_before_the_first_check)
    assert _signal_before_the_first_check(0) == 0
    assert other.result() == 0


def _requeued_loop(rank: int, folder: str) -> bool:
    """Rank 1 is signalled at step 2; each rank saves a file of its own, slowly on rank 1."""
    env = {"SLURM_JOB_ID": "77", "PATH": folder}
    with Preemption(env=env) as preemption:
        for step in range(STEPS):
            if rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
            if preemption.should_stop():

                def save() -> None:
                    if rank == 1:
                        time.sleep(0.5)  # a slow rank's part: the requeue must wait for it
                    Path(folder, f"saved-{rank}").touch()

                try:
                    preemption.stop(save)
                except Preempted as stopped:
                    return stopped.requeue is not None and stopped.requeue.done
    return False


def test_the_job_is_requeued_once_by_rank_0_after_every_rank_has_saved(
    other: OtherRank, tmp_path: Path
) -> None:
    # A fake scontrol notes its arguments and which ranks' saves existed when it was called.
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        f'#!/bin/sh\ncd {tmp_path} && echo "$* $(ls saved-* | tr "\\n" " ")" >> calls\n'
    )
    scontrol.chmod(0o755)
    other.run(_requeued_loop, str(tmp_path))
    assert _requeued_loop(0, str(tmp_path))
    assert not other.result()  # rank 1 asked no one: rank 0 did
    assert (tmp_path / "calls").read_text().split() == ["requeue", "77", "saved-0", "saved-1"]
