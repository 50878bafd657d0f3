"""gpukit._agree: every rank reaches the same answer, one process answers alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from gpukit import _agree as agree
from gpukit.errors import CheckpointError
from tests.helpers.two_processes import OtherRank, two_processes

pytestmark = pytest.mark.cpu_workers


@pytest.fixture
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as rank_1:
        yield rank_1


def ask(rank: int) -> dict[str, Any]:
    """Every question, with answers that differ by rank (rank 1 is the one with news)."""
    error = CheckpointError(f"rank {rank} failed") if rank == 1 else None
    return {
        "all_true": agree.all_true(rank == 0),
        "all_true_when_all": agree.all_true(True),
        "any_true": agree.any_true(rank == 1),
        "any_true_when_none": agree.any_true(False),
        "smallest": agree.smallest(10 + rank * 5),
        "largest": agree.largest([rank, 1 - rank, 7]),
        "from_rank_0": agree.from_rank_0(["chosen", 3] if rank == 0 else None),
        "gathered": agree.gathered({"rank": rank}),
        "first_error": str(agree.first_error(error)),
        "no_error": agree.first_error(None),
        "in_a_subgroup": agree.from_rank_0(f"from {rank}", dist.new_group([0, 1])),
    }


def test_every_rank_reaches_the_same_answers(other: OtherRank) -> None:
    other.run(ask)
    mine = ask(0)
    assert other.result() == mine
    assert mine == {
        "all_true": False,
        "all_true_when_all": True,
        "any_true": True,
        "any_true_when_none": False,
        "smallest": 10,
        "largest": [1, 1, 7],
        "from_rank_0": ["chosen", 3],
        "gathered": [{"rank": 0}, {"rank": 1}],
        "first_error": "rank 1 failed",
        "no_error": None,
        "in_a_subgroup": "from 0",
    }


def test_one_process_answers_alone() -> None:
    assert not dist.is_initialized()
    error = CheckpointError("mine")
    assert agree.all_true(False) is False
    assert agree.any_true(True) is True
    assert agree.smallest(4) == 4
    assert agree.largest([3, 1]) == [3, 1]
    assert agree.from_rank_0("x") == "x"
    assert agree.gathered(5) == [5]
    assert agree.first_error(error) is error
