"""The training step made by hand in a gloo group of two whose rank 0 is this process: the
counts of its micro-batches are its own unless it is told ``distributed=True``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from gpukit.train import TrainStep
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
