"""The loader's seed and epoch: one range for what prepare() and the loader take and what a saved
position may hold, so every run a loader can make resumes, and a bad value is refused up front.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.distributed.data import DistributedLoader
from gpukit.distributed.position import MAX_EPOCH, MAX_SEED
from gpukit.errors import InvalidArgumentError

BAD_SEEDS = [-1, 1.5, True, "3", None, MAX_SEED + 1, 2**64]
BAD_EPOCHS = [-1, 1.5, True, "1", None, MAX_EPOCH + 1, 2**64]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _data(n: int = 10) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=4, shuffle=True)


def _loader(seed: object = 3) -> DistributedLoader:
    return DistributedLoader(
        _data(),
        batch_size=4,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        seed=seed,  # type: ignore[arg-type]
    )


def _samples(loader: DistributedLoader) -> list[int]:
    return [int(i) for (x,) in loader for i in x]


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_prepare_refuses_a_seed_that_is_not_a_whole_number_in_range(seed: object) -> None:
    model = nn.Linear(1, 1)
    with pytest.raises(InvalidArgumentError, match=r"^seed=") as raised:
        dist.prepare(model, loader=_data(), per_device_batch_size=4, seed=seed)  # type: ignore[call-overload]
    assert raised.value.hint is not None
    assert "2**63" in raised.value.hint


@pytest.mark.parametrize("seed", BAD_SEEDS, ids=repr)
def test_a_loader_refuses_a_seed_that_is_not_a_whole_number_in_range(seed: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^seed="):
        _loader(seed)


@pytest.mark.parametrize("seed", [0, MAX_SEED])
def test_a_run_with_any_seed_the_loader_takes_resumes_from_its_own_save(seed: int) -> None:
    whole = _loader(seed)
    whole.set_epoch(MAX_EPOCH)
    expected = _samples(whole)
    stopped = _loader(seed)
    stopped.set_epoch(MAX_EPOCH)
    next(iter(stopped))
    resumed = _loader(seed)
    resumed.load_state_dict(stopped.state_dict())
    assert _samples(resumed) == expected[4:]
    assert sorted(expected) == list(range(10))


@pytest.mark.parametrize("epoch", BAD_EPOCHS, ids=repr)
def test_a_saved_epoch_outside_what_a_loader_reaches_is_refused_and_nothing_changes(
    epoch: object,
) -> None:
    loader = _loader()
    next(iter(loader))  # mid-epoch 0: 4 samples consumed
    before = loader.state_dict()
    with pytest.raises(InvalidArgumentError, match="'epoch'") as raised:
        loader.load_state_dict({**before, "epoch": epoch})
    assert raised.value.hint is not None
    assert loader.state_dict() == before


@pytest.mark.parametrize("epoch", BAD_EPOCHS, ids=repr)
def test_set_epoch_refuses_an_epoch_outside_what_a_loader_reaches(epoch: object) -> None:
    loader = _loader()
    next(iter(loader))
    before = loader.state_dict()
    with pytest.raises(InvalidArgumentError, match=r"^set_epoch\(") as raised:
        loader.set_epoch(epoch)  # type: ignore[arg-type]
    assert raised.value.hint is not None
    assert loader.state_dict() == before


def test_set_epoch_during_a_pass_refuses_a_bad_epoch_and_the_pass_goes_on() -> None:
    loader = _loader()
    seen = []
    for (x,) in loader:
        seen.extend(x.tolist())
        with pytest.raises(InvalidArgumentError):
            loader.set_epoch(-1)
    assert sorted(seen) == list(range(10))
    assert loader.epoch == 1
