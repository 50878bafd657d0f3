"""The prepared loader's passes: a new shuffle every epoch, set_epoch honoured, drop_last kept.

The expected orders are torch's own DistributedSampler rule for one process, written out here:
the order of pass ``e`` with seed ``s`` is ``torch.randperm(n)`` drawn from a generator seeded
``s + e``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist

N = 16


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _order(epoch: int, seed: int = 0) -> list[int]:
    return torch.randperm(N, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def _shuffled_loader(seed: int = 0) -> dist.DistributedLoader:
    data = DataLoader(TensorDataset(torch.arange(N)), batch_size=4, shuffle=True)
    _, loader = dist.prepare(nn.Linear(1, 1), loader=data, per_device_batch_size=N, seed=seed)
    assert isinstance(loader, dist.DistributedLoader)
    return loader


def _one_pass(loader: dist.DistributedLoader) -> list[int]:
    return [i for batch in loader for i in batch[0].tolist()]


def test_passes_without_set_epoch_shuffle_as_epochs_0_1_2() -> None:
    loader = _shuffled_loader()
    assert [_one_pass(loader) for _ in range(3)] == [_order(0), _order(1), _order(2)]


def test_the_pass_after_set_epoch_gets_the_next_epochs_shuffle() -> None:
    loader = _shuffled_loader()
    loader.set_epoch(5)
    assert [_one_pass(loader) for _ in range(3)] == [_order(5), _order(6), _order(7)]


def test_set_epoch_before_every_pass_shuffles_as_that_epoch() -> None:
    loader = _shuffled_loader(seed=3)
    passes = []
    for epoch in (4, 4, 9):
        loader.set_epoch(epoch)
        passes.append(_one_pass(loader))
    assert passes == [_order(4, 3), _order(4, 3), _order(9, 3)]


def test_set_epoch_during_a_pass_chooses_the_next_pass() -> None:
    loader = _shuffled_loader()
    for _ in loader:
        loader.set_epoch(10)  # as an end-of-epoch hook would, inside the loop
    assert _one_pass(loader) == _order(10)
    assert _one_pass(loader) == _order(11)


def test_an_unshuffled_loader_stays_in_order_every_pass() -> None:
    data = DataLoader(TensorDataset(torch.arange(N)), batch_size=4, shuffle=False)
    _, loader = dist.prepare(nn.Linear(1, 1), loader=data, per_device_batch_size=5)
    loader.set_epoch(3)
    assert [_one_pass(loader) for _ in range(2)] == [list(range(N))] * 2


# -- drop_last ----------------------------------------------------------------------------------


def test_the_users_drop_last_drops_the_short_last_batch() -> None:
    data = DataLoader(TensorDataset(torch.arange(10)), batch_size=2, drop_last=True)
    _, loader = dist.prepare(nn.Linear(1, 1), loader=data, per_device_batch_size=4)
    assert [batch[0].tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(loader) == 2


def test_without_drop_last_the_short_last_batch_is_kept() -> None:
    data = DataLoader(TensorDataset(torch.arange(10)), batch_size=2, drop_last=False)
    _, loader = dist.prepare(nn.Linear(1, 1), loader=data, per_device_batch_size=4)
    assert [batch[0].tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(loader) == 3
