"""prepare(..., shard=...) on two and four processes: FSDP2 on gloo, the weights one process ends
with.

The test process is rank 0 of a real two-process group (``tests/helpers/two_processes.py``); the
one-process reference runs first, before the group exists. Four processes are launched by a
process of their own (``tests/train/shard_four.py``), which trains its own reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.two_processes import OtherRank, two_processes
from tests.train import shard_workloads as work

# Its workers train on the CPU with gloo, on a GPU machine too.
pytestmark = [pytest.mark.slow, pytest.mark.cpu_workers]


@pytest.fixture(scope="module")
def single() -> dict[str, list[float]]:
    """One unsharded process: the weights every sharded run must end with."""
    return work.train()


@pytest.fixture(scope="module")
def other_rank(
    single: dict[str, list[float]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


def _furthest(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for key in a for x, y in zip(a[key], b[key], strict=True))


def test_two_sharded_processes_end_with_one_process_weights_when_the_data_does_not_divide(
    single: dict[str, list[float]], other_rank: OtherRank
) -> None:
    # 97 samples in batches of 8: the last step has 1 sample, rank 1 none. Averaging the two
    # reduce-scattered gradients (FSDP's own reduction) ends ~5e-3 away with AdamW.
    other_rank.run(work.train)
    mine = work.train()
    assert _furthest(mine, single) <= 1e-12
    assert _furthest(other_rank.result(), single) <= 1e-12


def test_four_sharded_processes_end_with_one_process_weights_when_the_data_does_not_divide() -> (
    None
):
    # 97 samples in batches of 8 over four processes: the last step has 1 sample, three ranks
    # none; 7 rows split 2 + 2 + 2 + 1.
    found = work.in_four_processes("train")
    assert len(found["ranks"]) == 4
    for weights in found["ranks"]:
        assert _furthest(weights, found["single"]) <= 1e-12


def test_two_sharded_processes_accumulating_micro_batches_end_with_one_process_weights(
    single: dict[str, list[float]], other_rank: OtherRank
) -> None:
    # Global batches of 8 as 2 micro-batches of 2 per process: FSDP reduce-scatters once per
    # step (set_requires_gradient_sync), weighed by the step's samples. 97 samples: the last
    # step is one micro-batch of one sample.
    other_rank.run(work.train_accumulating)
    mine = work.train_accumulating()
    assert _furthest(mine, single) <= 1e-12
    assert _furthest(other_rank.result(), single) <= 1e-12


def test_a_policy_of_classes_trains_as_exactly_as_the_default(
    single: dict[str, list[float]], other_rank: OtherRank
) -> None:
    other_rank.run(work.train, [work.Block])
    mine = work.train(0, [work.Block])
    assert _furthest(mine, single) <= 1e-12
    assert _furthest(other_rank.result(), single) <= 1e-12


def test_a_sharded_run_resumed_through_the_training_state_ends_with_one_process_weights(
    single: dict[str, list[float]], other_rank: OtherRank, tmp_path: Path
) -> None:
    folder = str(tmp_path / "runs")
    other_rank.run(work.train_with_training_state, folder)
    mine = work.train_with_training_state(0, folder)
    assert _furthest(mine, single) <= 1e-12
    assert _furthest(other_rank.result(), single) <= 1e-12


def test_each_process_holds_about_half_of_every_parameter(other_rank: OtherRank) -> None:
    other_rank.run(work.local_sizes)
    mine, theirs = work.local_sizes(), other_rank.result()
    full = {name: p.numel() for name, p in work.model().named_parameters()}
    # Rows are split as torch.chunk does: 7 rows give 4 + 3.
    assert mine["blocks.0.linear.weight"] == 4 * 7
    assert theirs["blocks.0.linear.weight"] == 3 * 7
    assert {k: mine[k] + theirs[k] for k in full} == full


def test_an_optimizer_that_holds_state_already_is_refused_on_every_process(
    other_rank: OtherRank,
) -> None:
    other_rank.run(work.refusal_of_a_resumed_optimizer)
    mine = work.refusal_of_a_resumed_optimizer()
    assert mine.startswith("InvalidArgumentError: prepare(..., shard=...) got an optimizer")
    assert other_rank.result() == mine
