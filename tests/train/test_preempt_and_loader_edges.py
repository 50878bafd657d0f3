"""Edges of preemption and of the distributed loader that the main tests pass by.

- Preemption: a requeue signal (SIGUSR1) that comes after a SIGTERM a check has already seen
  still has the job requeued at the next check (``test_preempt.py`` sends both signals before
  one check).
- The loader's epoch: ``set_epoch`` to another epoch while the loader sits in the middle of one
  (a pass left early, a state loaded mid-epoch, an epoch chosen during a pass) starts that epoch
  at its beginning (``test_loader_position.py`` sets another epoch only at an epoch's end).
- The loader's workers: each rank's workers get seeds of their own, so random augmentations do
  not repeat from rank to rank.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from gpukit.distributed.data import DistributedLoader
from gpukit.train.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import preempt_accumulate as work

JOB_ID = "4242"


@pytest.mark.parametrize("seen", ["at a check that stopped", "at a check between micro-batches"])
def test_a_requeue_signal_after_a_sigterm_already_seen_at_a_check_still_requeues_the_job(
    tmp_path: Path, seen: str
) -> None:
    # Slurm's --signal=USR1@90 can come after a SIGTERM (a copy from torchrun, a co-worker's
    # kill): the requeue signal outranks the plain stop at every check until stop().
    bin_dir = work.fake_scontrol(tmp_path / "bin")
    window = work.Window()
    env = {"SLURM_JOB_ID": JOB_ID, "PATH": str(bin_dir)}
    with Preemption(env=env, state=window) as preemption:
        window.mid = seen == "at a check between micro-batches"
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.should_stop() is not window.mid  # the SIGTERM is seen here
        os.kill(os.getpid(), signal.SIGUSR1)
        window.mid = False  # the optimizer step closes
        assert preemption.should_stop()
        assert preemption.received is signal.SIGUSR1
        with pytest.raises(Preempted) as stopped:
            preemption.stop(None)
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    assert stopped.value.requeue is not None
    assert stopped.value.requeue.done
    assert (bin_dir / "calls").read_text().splitlines() == [f"requeue {JOB_ID}"]


class _Ids(Dataset[int]):
    """Sample i is i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _loader(n: int = 43, global_batch: int = 6) -> DistributedLoader:
    inner = DataLoader(_Ids(n), batch_size=global_batch, shuffle=True)
    return DistributedLoader(
        inner, batch_size=global_batch, rank=0, world_size=1, device=torch.device("cpu"), seed=3
    )


def _batches(loader: DistributedLoader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def _epoch(epoch: int) -> list[list[int]]:
    """The batches of a whole ``epoch``, from a loader that never ran before."""
    loader = _loader()
    loader.set_epoch(epoch)
    return _batches(loader)


def _left_early(loader: DistributedLoader) -> None:
    for step, _ in enumerate(loader):
        if step == 2:
            break


def _resumed_mid_epoch(loader: DistributedLoader) -> None:
    stopped = _loader()
    _left_early(stopped)
    loader.load_state_dict(stopped.state_dict())


@pytest.mark.parametrize("mid_epoch", ["a pass left early", "a state loaded mid-epoch"])
def test_set_epoch_to_another_epoch_in_the_middle_of_one_hands_out_that_whole_epoch(
    mid_epoch: str,
) -> None:
    loader = _loader()
    (_left_early if mid_epoch == "a pass left early" else _resumed_mid_epoch)(loader)
    assert loader.state_dict()["consumed"] == 18  # three batches of epoch 0 are out
    loader.set_epoch(5)
    assert _batches(loader) == _epoch(5)  # from its first batch, none skipped
    assert _batches(loader) == _epoch(6)  # and the passes after it count on from there


def test_an_epoch_chosen_during_a_pass_left_early_starts_at_its_beginning() -> None:
    loader = _loader()
    for step, _ in enumerate(loader):
        if step == 2:
            loader.set_epoch(5)  # for the next pass; this one keeps its place
            break
    assert loader.state_dict()["epoch"] == 5
    assert loader.state_dict()["consumed"] == 0
    assert _batches(loader) == _epoch(5)


class _Augmented(Dataset[tuple[int, float]]):
    """Sample i is the seed of the worker that loads it and a random draw in that worker, as a
    random augmentation draws."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[int, float]:
        return torch.initial_seed() % (1 << 62), torch.rand(()).item()


def _seeds_and_draws(rank: int) -> tuple[set[int], set[float]]:
    """What rank ``rank`` of two sees in one pass with one worker: its seeds, its draws."""
    inner = DataLoader(_Augmented(), batch_size=4, shuffle=True, num_workers=1)
    loader = DistributedLoader(
        inner, batch_size=2, rank=rank, world_size=2, device=torch.device("cpu"), seed=3
    )
    seeds: set[int] = set()
    draws: set[float] = set()
    for worker_seeds, worker_draws in loader:
        seeds.update(worker_seeds.tolist())
        draws.update(worker_draws.tolist())
    return seeds, draws


def test_each_ranks_loader_workers_draw_other_random_numbers_than_the_other_ranks() -> None:
    seeds_0, draws_0 = _seeds_and_draws(rank=0)
    seeds_1, draws_1 = _seeds_and_draws(rank=1)
    assert len(seeds_0) == len(seeds_1) == 1  # one worker each
    assert seeds_0 != seeds_1
    assert len(draws_0) == len(draws_1) == 4  # four samples each
    assert not draws_0 & draws_1  # no augmentation repeated on the other rank
