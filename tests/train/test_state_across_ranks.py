"""The training state in a real two-process gloo group (the test process is rank 0, see
``tests/helpers/two_processes.py``): what every rank must meet alike."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import InvalidArgumentError
from gpukit.train import TrainStep
from tests.helpers.two_processes import OtherRank, two_processes

pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]


@pytest.fixture
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as rank_1:
        yield rank_1


def _save_between_micro_batches(rank: int, folder: str, asynchronous: bool) -> tuple[str, float]:
    """One micro-batch of two, then a save: what this rank met, and how long it took."""
    model = nn.Linear(2, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step = TrainStep(model, opt, accumulate=2)
    train_step(model(torch.ones(4, 2, dtype=torch.float64)).mean(), count=8)
    state = gk.TrainingState(folder, model=model, optimizer=opt, train_step=train_step)
    start = time.monotonic()
    try:
        state.save(asynchronous=asynchronous)
        state.wait()
    except InvalidArgumentError as exc:
        return f"refused: {exc.message}", time.monotonic() - start
    finally:
        state.close()
    return "saved", time.monotonic() - start


@pytest.mark.parametrize("asynchronous", [True, False], ids=["asynchronous", "blocking"])
def test_a_save_between_micro_batches_is_refused_on_every_rank_at_once(
    other: OtherRank, tmp_path: Path, asynchronous: bool
) -> None:
    other.run(_save_between_micro_batches, str(tmp_path), asynchronous)
    mine, mine_took = _save_between_micro_batches(0, str(tmp_path), asynchronous)
    theirs, theirs_took = other.result()
    assert mine == theirs
    assert mine.startswith("refused: the training step is between micro-batches (1 of 2 done)")
    assert max(mine_took, theirs_took) < 30  # not a collective's timeout
    assert list(tmp_path.iterdir()) == []  # nothing half-written
