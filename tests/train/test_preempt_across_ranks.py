"""Preemption in a real two-process gloo group: a signal to one rank stops both at one step.

The test process is rank 0 (see ``tests/helpers/two_processes.py``); rank 1 runs the same loop in a
spawned process. Lightning broadcasts rank 0's flag only, so a signal to any other rank is lost
there; here every rank's counts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpukit.train.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption
from tests.helpers.two_processes import OtherRank, two_processes

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import preempt_accumulate as work

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


def _requeued_loop(rank: int, folder: str) -> tuple[bool, str] | None:
    """Rank 1 is signalled at step 2; each rank saves a file of its own, slowly on rank 1.
    Returns what this rank was told of the requeue."""
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
                    requeue = stopped.requeue
                    return None if requeue is None else (requeue.done, requeue.reason)
    return None


def _scontrol(folder: Path, code: int) -> None:
    """A fake scontrol that notes its arguments and which ranks' saves existed when it was
    called, then exits with ``code`` (saying why on stderr when not 0)."""
    scontrol = folder / "scontrol"
    scontrol.write_text(
        f'#!/bin/sh\ncd {folder} && echo "$* $(ls saved-* | tr "\\n" " ")" >> calls\n'
        + (f"echo 'Job is not requeueable' >&2\nexit {code}\n" if code else "")
    )
    scontrol.chmod(0o755)


def test_the_job_is_requeued_once_by_rank_0_after_every_rank_has_saved(
    other: OtherRank, tmp_path: Path
) -> None:
    _scontrol(tmp_path, 0)
    other.run(_requeued_loop, str(tmp_path))
    assert _requeued_loop(0, str(tmp_path)) == (True, "scontrol requeue 77")
    assert other.result() == (True, "scontrol requeue 77")  # rank 1 is told what rank 0 did
    assert (tmp_path / "calls").read_text().split() == ["requeue", "77", "saved-0", "saved-1"]


def test_a_requeue_that_slurm_refused_reads_the_same_on_every_rank(
    other: OtherRank, tmp_path: Path
) -> None:
    _scontrol(tmp_path, 1)
    other.run(_requeued_loop, str(tmp_path))
    mine = _requeued_loop(0, str(tmp_path))
    assert mine == (False, "scontrol requeue 77: Job is not requeueable")
    assert other.result() == mine
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


def _signalled_twice(
    rank: int, folder: str, signals: list[tuple[int, int, int]], during_save: int | None
) -> dict[str, Any]:
    """Run STEPS steps, checking after each; ``signals`` are (rank, step, signal) to send
    before that step's check, ``during_save`` a signal rank 1 sends itself while it saves."""
    saved: list[int] = []
    env = {"SLURM_JOB_ID": "77", "PATH": folder}
    with Preemption(env=env) as preemption:
        for step in range(STEPS):
            for to, at, signum in signals:
                if (to, at) == (rank, step):
                    os.kill(os.getpid(), signum)
            if preemption.should_stop():

                def save(step: int = step) -> None:
                    if rank == 1 and during_save is not None:
                        os.kill(os.getpid(), during_save)
                    saved.append(step)

                try:
                    preemption.stop(save)
                except Preempted as stopped:
                    requeue = stopped.requeue
                    return {
                        "step": step,
                        "code": stopped.code,
                        "saved": saved,
                        "requeue": None if requeue is None else requeue.done,
                    }
    return {"step": None, "saved": saved}


@pytest.mark.parametrize(
    ("signals", "during_save", "requeued"),
    [
        ([(1, 4, signal.SIGUSR1), (1, 4, signal.SIGTERM)], None, True),
        ([(1, 4, signal.SIGUSR1), (1, 4, signal.SIGUSR1)], None, True),
        ([(1, 4, signal.SIGTERM), (0, 4, signal.SIGUSR1)], None, True),
        ([(0, 4, signal.SIGTERM), (1, 4, signal.SIGTERM)], None, False),
        ([(1, 4, signal.SIGUSR1)], signal.SIGTERM, True),
        ([(1, 4, signal.SIGTERM)], signal.SIGUSR1, False),
    ],
    ids=[
        "USR1-then-TERM",
        "USR1-twice",
        "TERM-on-1-USR1-on-0",
        "TERM-on-each",
        "TERM-during-the-save",
        "USR1-during-a-TERM-save",
    ],
)
def test_a_second_signal_stops_every_rank_once_at_the_same_step(
    other: OtherRank,
    tmp_path: Path,
    signals: list[tuple[int, int, int]],
    during_save: int | None,
    requeued: bool,
) -> None:
    _scontrol(tmp_path, 0)
    other.run(_signalled_twice, str(tmp_path), signals, during_save)
    mine = _signalled_twice(0, str(tmp_path), signals, during_save)
    theirs = other.result()
    assert mine["step"] == theirs["step"] == 4
    assert mine["saved"] == theirs["saved"] == [4]  # one save each, at the agreed step
    assert mine["code"] == theirs["code"] == PREEMPTED_EXIT_CODE
    assert mine["requeue"] == theirs["requeue"] == (requeued or None)
    calls = tmp_path / "calls"
    assert (len(calls.read_text().splitlines()) if calls.exists() else 0) == int(requeued)


def _one_rank_mid_step(rank: int) -> int | None:
    """Rank 1 is signalled at step 2; rank 0 alone says it is mid-step from step 2 to 4."""
    window = work.Window()
    with Preemption(env={}, state=window) as preemption:
        for step in range(STEPS):
            window.mid = rank == 0 and 2 <= step <= 4
            if rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
            if preemption.should_stop():
                return step
    return None


def test_no_rank_stops_while_any_rank_is_between_micro_batches(other: OtherRank) -> None:
    other.run(_one_rank_mid_step)
    assert _one_rank_mid_step(0) == 5
    assert other.result() == 5


def test_a_signal_between_micro_batches_stops_every_rank_where_the_step_closes(
    other: OtherRank, tmp_path: Path
) -> None:
    # The documented loop with prepare(..., accumulate=2) on two processes: rank 1 alone is
    # signalled after the first micro-batch of the second optimizer step.
    bin_dir = str(work.fake_scontrol(tmp_path / "bin"))
    run = str(tmp_path / "run")
    other.run(work.segment, run, bin_dir, 3)
    mine = work.segment(0, run, bin_dir, 3)
    theirs = other.result()
    assert theirs["stepped_at_signal"] == [False]  # the signal came between micro-batches
    for stopped in (mine, theirs):
        # Both stopped after the micro-batch that closed the step, saved, and asked Slurm
        # once for a requeue, which both say was done.
        assert (stopped["micro"], stopped["stepped"], stopped["step"]) == (4, True, 2)
        assert stopped["code"] == PREEMPTED_EXIT_CODE
        assert stopped["requeue"] == (True, f"scontrol requeue {work.JOB_ID}")
    assert Path(bin_dir, "calls").read_text().splitlines() == [f"requeue {work.JOB_ID}"]
    # Started again, the run resumes from that save and ends bitwise as the run never stopped.
    other.run(work.segment, run)
    resumed = work.segment(0, run), other.result()
    other.run(work.segment, str(tmp_path / "whole"))
    whole = work.segment(0, str(tmp_path / "whole")), other.result()
    assert resumed[0]["resumed"] == resumed[1]["resumed"] == 2
    assert resumed[0]["weights"] == resumed[1]["weights"] == whole[0]["weights"]
    assert whole[1]["weights"] == whole[0]["weights"]
