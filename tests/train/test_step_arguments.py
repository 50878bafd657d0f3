"""The step's arguments: a clipping norm and a count are checked before the step does anything.

A refused call leaves everything as it was (no backward, no gradient, no micro-batch counted,
no optimizer step), so the loop can call again with a right value.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.errors import InvalidArgumentError
from gpukit.train import TrainStep


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


BAD_NORMS = [
    -1.0,
    0,
    0.0,
    math.nan,
    math.inf,
    -math.inf,
    "x",
    "1.0",
    True,
    [1.0],
    torch.tensor(1.0),
    10**400,  # too large for a float: no finite norm
]


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 1).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(4, 3, generator=gen, dtype=torch.float64),
        torch.randn(4, 1, generator=gen, dtype=torch.float64),
    )


def _snapshot(model: nn.Module, step: TrainStep) -> tuple[Any, ...]:
    return (
        [p.detach().clone() for p in model.parameters()],
        [p.grad for p in model.parameters()],
        step.accumulation.state_dict(),
        step.mid_step,
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    weights = all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    grads = all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a[1], b[1], strict=True)
    )
    return weights and grads and a[2:] == b[2:]


@pytest.mark.parametrize("norm", BAD_NORMS, ids=repr)
def test_a_clipping_norm_that_is_not_a_finite_positive_number_is_refused_before_any_work(
    norm: object,
) -> None:
    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    x, y = _batch()
    before = _snapshot(model, step)
    with pytest.raises(InvalidArgumentError, match=r"^clip_grad_norm=") as raised:
        step(nn.functional.mse_loss(model(x), y), clip_grad_norm=norm)  # type: ignore[arg-type]
    assert raised.value.hint is not None
    assert "clip_grad_norm=1.0" in raised.value.hint
    assert _same(before, _snapshot(model, step))


def test_a_refused_call_is_not_counted_as_a_micro_batch() -> None:
    model, reference = _model(), _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    ref_step = TrainStep(reference, torch.optim.SGD(reference.parameters(), lr=0.1), accumulate=2)
    x, y = _batch()
    with pytest.raises(InvalidArgumentError):
        step(nn.functional.mse_loss(model(x), y), clip_grad_norm=-1.0)
    stepped = [step(nn.functional.mse_loss(model(x), y), clip_grad_norm=0.5) for _ in range(2)]
    expected = [
        ref_step(nn.functional.mse_loss(reference(x), y), clip_grad_norm=0.5) for _ in range(2)
    ]
    assert stepped == expected == [False, True]
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("count", [-1, 2.5, "3", True], ids=repr)
def test_a_refused_count_is_not_counted_as_a_micro_batch_either(count: object) -> None:
    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    x, y = _batch()
    before = _snapshot(model, step)
    with pytest.raises(InvalidArgumentError, match="is not a number of items"):
        step(nn.functional.mse_loss(model(x), y), count=count)
    assert _same(before, _snapshot(model, step))
    assert not step(nn.functional.mse_loss(model(x), y), count=4)  # the window's first


@pytest.mark.parametrize("norm", [1, 0.5, np.float64(0.5), np.float32(2.0), 1e-30])
def test_a_clipping_norm_may_be_any_finite_positive_real_number(norm: object) -> None:
    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=1.0))
    x, y = _batch()
    start = [p.detach().clone() for p in model.parameters()]
    assert step(nn.functional.mse_loss(model(x), y), clip_grad_norm=norm)  # type: ignore[arg-type]
    moved = torch.cat(
        [(a.detach() - b).flatten() for a, b in zip(model.parameters(), start, strict=True)]
    )
    assert float(moved.norm()) <= float(norm) * (1 + 1e-6)  # type: ignore[arg-type]


def test_a_loop_given_a_negative_clipping_norm_is_refused_with_its_weights_untouched() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 3, dtype=torch.float64)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    model, opt, prepared = dist.prepare(model, opt, loader, per_device_batch_size=4)
    before = [p.detach().clone() for p in model.parameters()]
    batches = iter(prepared)  # kept: the pass, and its step, last as long as it does
    xb, yb = next(batches)
    loss = nn.functional.mse_loss(model(xb), yb)
    with pytest.raises(InvalidArgumentError, match=r"clip_grad_norm=-1\.0"):
        dist.step(loss, clip_grad_norm=-1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
