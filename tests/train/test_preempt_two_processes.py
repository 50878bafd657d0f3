"""Preemption in a gloo group of two where rank 0 is this process (fast; the training loops of
``test_preempt_across_ranks.py`` are slow).

Rank 0 running here lets coverage and mutation runs see the agreement, the save's meeting and
the requeue that rank 0 asks for and every rank is told of.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from gpukit.train.preempt import Preempted, Preemption, Requeue
from tests.helpers.two_processes import OtherRank, two_processes

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import preempt_accumulate as work

CHECKS = 8


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as rank1:
        yield rank1


def _loop(signal_at: int | None, mid_step_at: int | None, **kwargs: Any) -> dict[str, Any]:
    """Check CHECKS times, signalling this process (SIGUSR1) before check ``signal_at`` and
    saying this rank is between micro-batches at check ``mid_step_at`` (both from 1); stop when
    told. What this rank saw: the check that stopped it and what became of the requeue."""
    window = work.Window()
    with Preemption(state=window, **kwargs) as preemption:
        for check in range(1, CHECKS + 1):
            if check == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            window.mid = check == mid_step_at
            if preemption.should_stop():
                try:
                    preemption.stop(None)
                except Preempted as stopped:
                    return {"checks": stopped.checks, "requeue": stopped.requeue}
    return {"checks": None, "requeue": None}


def _job(rank: int, bin_dir: str, signal_at: int | None, mid_step_at: int | None) -> Any:
    """Rank ``rank`` of Slurm job 77, whose ``scontrol`` is in ``bin_dir``."""
    return _loop(signal_at, mid_step_at, env={"SLURM_JOB_ID": "77", "PATH": bin_dir})


def _own_group(rank: int, bin_dir: str, signal_at: int) -> Any:
    """Rank ``rank`` as the one process of its own group, in Slurm job ``70 + rank``."""
    groups = [dist.new_group([0]), dist.new_group([1])]  # every rank makes every group
    env = {"SLURM_JOB_ID": str(70 + rank), "PATH": bin_dir}
    return _loop(signal_at, None, env=env, group=groups[rank])


def _signal_rank_1_alone(other: OtherRank, tmp_path: Path, mid_step_at: int | None) -> Any:
    """Rank 1 is signalled before check 3; rank 0 alone is between micro-batches at check
    ``mid_step_at``. What rank 0 saw (rank 1's is ``other.result()``)."""
    bin_dir = str(work.fake_scontrol(tmp_path / "bin"))
    other.run(_job, bin_dir, 3, None)
    return _job(0, bin_dir, None, mid_step_at)


def test_a_requeue_signal_to_rank_1_alone_has_rank_0_requeue_once_and_tell_every_rank(
    other: OtherRank, tmp_path: Path
) -> None:
    told = Requeue(True, "scontrol requeue 77")
    assert _signal_rank_1_alone(other, tmp_path, None) == {"checks": 3, "requeue": told}
    assert other.result() == {"checks": 3, "requeue": told}
    assert (tmp_path / "bin" / "calls").read_text().splitlines() == ["requeue 77"]


def test_a_rank_between_micro_batches_holds_every_rank_to_the_next_step_boundary(
    other: OtherRank, tmp_path: Path
) -> None:
    # Rank 1 is signalled before check 3, at which rank 0 alone is mid-step: both stop at 4.
    assert _signal_rank_1_alone(other, tmp_path, 3)["checks"] == 4
    assert other.result()["checks"] == 4


def test_each_group_stops_on_its_own_signal_and_its_own_rank_0_requeues_its_job(
    other: OtherRank, tmp_path: Path
) -> None:
    # Two jobs of one process each, sharing a launch: neither waits for, nor hears, the other.
    bin_dir = str(work.fake_scontrol(tmp_path / "bin"))
    other.run(_own_group, bin_dir, 2)
    mine = _own_group(0, bin_dir, 5)
    assert mine == {"checks": 5, "requeue": Requeue(True, "scontrol requeue 70")}
    assert other.result() == {"checks": 2, "requeue": Requeue(True, "scontrol requeue 71")}
    calls = (tmp_path / "bin" / "calls").read_text().splitlines()
    assert sorted(calls) == ["requeue 70", "requeue 71"]
