"""prepare(..., stand_in=True): an empty share of a micro-batch arrives as one real sample that
the step weighs 0, for models that cannot run on 0 rows.

Across processes, ``tests/hf/test_causal_lm_two_processes.py`` trains a transformers model
whose second rank gets a stand-in in the last step, against one process on whole batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.errors import InvalidArgumentError

SAMPLES = 70  # in steps of 16: the last step holds 6 samples


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


class NoEmptyBatches(nn.Linear):
    """A layer that, like a transformers model's attention, fails on a batch of 0 rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            raise RuntimeError("cannot reshape tensor of 0 elements")
        return super().forward(x)


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SAMPLES, 3, generator=gen, dtype=torch.float64)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.5)


def _train(stand_in: bool, exact: bool, counted: bool) -> tuple[list[torch.Tensor], list[Any]]:
    torch.manual_seed(0)
    model = (NoEmptyBatches if stand_in else nn.Linear)(3, 1).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sizes: dict[str, Any] = {"exact": True, "micro_batch_size": 4} if exact else {"accumulate": 4}
    model, opt, loader = dist.prepare(
        model, opt, DataLoader(_data(), shuffle=True), global_batch_size=16,
        stand_in=stand_in, **sizes,
    )  # fmt: skip
    seen = []
    for _ in range(2):
        for x, y in loader:
            seen.append((len(x), loader.current_len))
            loss = nn.functional.mse_loss(model(x), y)
            dist.step(loss, count=len(x) if counted else None)  # a stand-in's row is counted
    return [p.detach().clone() for p in model.parameters()], seen


@pytest.mark.parametrize("counted", [False, True], ids=["samples", "counts"])
def test_exact_mode_stand_ins_train_to_the_bits_of_empty_batches(counted: bool) -> None:
    # One process meets empty micro-batches in exact mode only (accumulating, the last step
    # has fewer micro-batches instead); several processes meet them in both modes.
    want, empty = _train(stand_in=False, exact=True, counted=counted)
    got, seen = _train(stand_in=True, exact=True, counted=counted)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # The last step of each epoch: 4 + 2 samples, then two micro-batches with none.
    assert empty[-4:] == [(4, 4), (2, 2), (0, 0), (0, 0)]
    assert seen[-4:] == [(4, 4), (2, 2), (1, 0), (1, 0)]  # one row, current_len 0


def test_stand_in_must_be_a_bool_and_needs_a_loader() -> None:
    model = nn.Linear(1, 1)
    loader = DataLoader(_data())
    with pytest.raises(InvalidArgumentError, match="stand_in"):
        dist.prepare(model, loader=loader, global_batch_size=4, stand_in="yes")  # type: ignore[call-overload]
    with pytest.raises(InvalidArgumentError, match="stand_in=True without a loader"):
        dist.prepare(model, stand_in=True)  # type: ignore[call-overload]
