"""Exact accumulation in a group of two where rank 0 is this process (fast; the table is slow).

Rank 0 running here lets a failure point at gpukit's line, and lets coverage and mutation runs
see the weighted hook and the step's count all-reduce.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpukit import distributed as dist
from tests.helpers.two_processes import OtherRank, two_processes

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import accumulate_workloads as work


@pytest.fixture(scope="module")
def other_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


@pytest.mark.parametrize(
    "case",
    [(97, 3, "adamw", True), (101, 2, "sgd-momentum", False)],
    ids=["tokens-97-samples-K3", "samples-101-K2"],
)
def test_two_processes_accumulating_end_with_one_process_weights(
    other_rank: OtherRank, case: tuple[int, int, str, bool]
) -> None:
    # Token case: padded sequences, the step's token count summed over both ranks before the
    # last micro-batch's backward; 97 samples leave a last window of 12 + 12 + 1.
    other_rank.run(work.on_rank, *case)
    assert dist.world_size() == 2
    here = work.accumulated(*case)
    expected = work.reference(case[0], case[2], case[3])
    assert here == pytest.approx(expected, rel=0, abs=1e-12)
    assert other_rank.result() == pytest.approx(expected, rel=0, abs=1e-12)


@pytest.mark.parametrize(
    "case",
    [(97, 3, "adamw", True), (101, 2, "sgd-momentum", False)],
    ids=["tokens-97-samples-K3", "samples-101-K2"],
)
def test_two_processes_report_the_gradient_norm_and_gradients_of_one_process(
    other_rank: OtherRank, case: tuple[int, int, str, bool]
) -> None:
    # The norm dist.step reports is clip_grad_norm_'s on the whole global batch in one process,
    # and a before_optimizer_step callback sees the gradients that process clipped and used.
    other_rank.run(work.clipped_on_rank, *case)
    here = work.clipped_norms(*case)
    expected = work.reference_norms(case[0], case[2], case[3])
    for seen in (here, other_rank.result()):
        assert seen["norms"] == pytest.approx(expected["norms"], rel=0, abs=1e-12)
        assert len(seen["gradients"]) == len(expected["gradients"])
        for got, want in zip(seen["gradients"], expected["gradients"], strict=True):
            assert got == pytest.approx(want, rel=0, abs=1e-12)
