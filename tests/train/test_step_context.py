"""The step's context: one object handed to the loader, its training step and the gradient hook.

No part finds another through a module-level registry; the one lookup kept, for
``dist.step(loss)`` and the metrics, follows the loop of this thread only.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.errors import InvalidArgumentError
from gpukit.train import StepContext, TrainStep

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _data(n: int) -> DataLoader[Any]:
    x = torch.arange(n, dtype=torch.float64)[:, None]
    return DataLoader(TensorDataset(x, 2 * x), batch_size=4)


def _step(accumulate: int = 1, **options: Any) -> TrainStep:
    model = nn.Linear(1, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainStep(model, opt, accumulate=accumulate, **options)


def test_prepare_hands_the_loader_and_its_training_step_one_context_the_loader_fills() -> None:
    model = nn.Linear(1, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, loader = dist.prepare(model, opt, _data(10), global_batch_size=4, accumulate=2)
    assert loader.train_step is not None
    assert loader.context is loader.train_step.context
    context = loader.context
    placed = [(context.index, context.length, context.samples) for _ in loader]
    # 10 samples: a step of 2 + 2, one of 2 + 2, then a last step of one micro-batch of 2.
    assert placed == [(0, 2, 2), (1, 2, 2), (0, 2, 2), (1, 2, 2), (0, 1, 2)]
    assert not context.in_pass


def test_a_loop_in_another_thread_does_not_reach_this_threads_training_step() -> None:
    model = nn.Linear(1, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = dist.prepare(model, opt, _data(8), global_batch_size=4)
    batches = iter(loader)
    x, y = next(batches)  # this thread is inside the loader's pass
    refused: list[InvalidArgumentError] = []

    def elsewhere() -> None:
        try:
            dist.step(torch.zeros((), dtype=torch.float64, requires_grad=True))
        except InvalidArgumentError as exc:
            refused.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert [e.message for e in refused] == [
        "step(loss) was called outside a loop over a loader prepared with an optimizer."
    ]
    assert dist.step(nn.functional.mse_loss(model(x), y))  # this thread's loop: its step


def test_a_loader_given_a_training_step_fills_that_steps_context() -> None:
    step = _step(accumulate=3)
    loader = dist.DistributedLoader(
        _data(12), batch_size=4, rank=0, world_size=1, device=CPU, seed=0, accumulate=3,
        train_step=step,
    )  # fmt: skip
    assert loader.context is step.context
    assert loader.train_step is step
    assert [step.context.index for _ in loader] == [0, 1, 2]


def test_a_loader_refuses_a_training_step_of_another_context_or_another_accumulate() -> None:
    options: dict[str, Any] = {"batch_size": 4, "rank": 0, "world_size": 1, "device": CPU}
    with pytest.raises(InvalidArgumentError, match="another step context") as raised:
        dist.DistributedLoader(
            _data(8), seed=0, train_step=_step(), context=StepContext(), **options
        )
    assert "context=train_step.context" in (raised.value.hint or "")
    with pytest.raises(InvalidArgumentError, match="accumulate=2 micro-batches") as raised:
        dist.DistributedLoader(_data(8), seed=0, accumulate=2, train_step=_step(3), **options)
    assert "one accumulate=" in (raised.value.hint or "")


def test_a_context_serves_one_training_step() -> None:
    context = StepContext(2)
    first = _step(context=context, accumulate=None)
    assert context.train_step is first
    with pytest.raises(InvalidArgumentError, match="another training step") as raised:
        _step(context=context, accumulate=None)
    assert "its own StepContext" in (raised.value.hint or "")
    assert context.train_step is first
