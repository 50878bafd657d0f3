"""The training step made by hand in a gloo group of two whose rank 0 is this process: the
counts of its micro-batches are its own unless it is told ``distributed=True``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from gpukit.train import TrainStep
from gpukit.train.exact import ExactPlan
from tests.helpers.two_processes import OtherRank, two_processes


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 1).double()


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    return model(x).square().mean()


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("pair") / "store") as rank1:
        yield rank1


def _counted(rank: int, options: dict[str, bool]) -> list[list[float]]:
    """Two micro-batches of counts 1 and 3 on rank 0, 2 and 2 on rank 1, stepped by a
    TrainStep of this rank's own: its gradients just before the optimizer step."""
    model = _model()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=2, **options)
    seen: list[list[float]] = []
    counts = [(1, 3), (2, 2)][rank]
    step(_loss(model, seed=1), count=counts[0])
    step(
        _loss(model, seed=2),
        count=counts[1],
        before_optimizer_step=lambda: seen.extend(
            p.grad.flatten().tolist() for p in model.parameters()
        ),
    )
    return seen


@pytest.mark.parametrize(
    "options",
    [{}, {"distributed": False}, {"distributed": True}],
    ids=["unsaid", "not-distributed", "distributed"],
)
def test_a_hand_made_step_in_a_group_sums_its_counts_over_the_group_only_when_told(
    other: OtherRank, options: dict[str, bool]
) -> None:
    other.run(_counted, options)
    mine = _counted(0, options)
    other.result()
    # Rank 0's losses are weighed 1 and 3; their sum by 1/4 (its own count) or 1/8 (the group's).
    model = _model()
    (_loss(model, seed=1) + 3 * _loss(model, seed=2)).backward()
    total = 8 if options.get("distributed") else 4
    expected = [(p.grad / total).flatten().tolist() for p in model.parameters()]
    assert mine == expected


def _micro_batch(index: int) -> torch.Tensor:
    return torch.randn(
        2, 3, generator=torch.Generator().manual_seed(20 + index), dtype=torch.float64
    )


def _exact_step(rank: int, window: int) -> list[list[float]]:
    """One exact step of ``window`` samples cut into micro-batches of 2, two per rank: this
    rank's gradients as its optimizer is handed them. Rank r holds micro-batches 2r and 2r+1;
    one past the window is empty (its loss over no sample, NaN)."""
    model = _model()
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        accumulate=2,
        exact=ExactPlan(8, 2, 2),
    )
    seen: list[list[float]] = []
    for local in range(2):
        index = 2 * rank + local
        samples = 2 if 2 * index < window else 0
        step.begin(local, 2, samples, window)
        loss = model(_micro_batch(index)[:samples]).square().mean()
        step(
            loss,
            before_optimizer_step=lambda: seen.extend(
                p.grad.flatten().tolist() for p in model.parameters()
            ),
        )
    return seen


@pytest.mark.parametrize("window", [8, 4], ids=["every-rank-holds-samples", "rank-1-holds-none"])
def test_an_exact_step_gives_both_ranks_the_trees_sum_of_the_real_micro_batches(
    other: OtherRank, window: int
) -> None:
    other.run(_exact_step, window)
    mine = _exact_step(0, window)
    theirs = other.result()
    leaves = []
    for index in range(window // 2):  # each micro-batch weighs its 2 of the window's samples
        model = _model()
        (model(_micro_batch(index)).square().mean() * (2 / window)).backward()
        leaves.append([p.grad for p in model.parameters()])
    if window == 8:
        summed = [(a + b) + (c + d) for a, b, c, d in zip(*leaves, strict=True)]
    else:
        summed = [a + b for a, b in zip(*leaves, strict=True)]
    expected = [g.flatten().tolist() for g in summed]
    assert mine == expected
    assert theirs == expected
