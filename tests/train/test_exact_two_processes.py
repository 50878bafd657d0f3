"""Exact mode's sum over the ranks, in a group of two where rank 0 is this process.

Rank 0 running here lets mutation runs see the all-to-all, the tree over the ranks and the
reduce-scatter FSDP2 calls; the bitwise runs of whole trainings are in ``test_same_bits.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gpukit.train.context import StepContext
from gpukit.train.exact import ExactPlan, ExactReduceScatter, FixedOrderSum
from tests.helpers.two_processes import OtherRank, two_processes


@pytest.fixture(scope="module")
def other_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


def _leaves(rank: int) -> list[list[torch.Tensor]]:
    """Each rank's two micro-batch gradients: a float32 matrix of 7 (not a multiple of 2)
    elements and a float64 vector, with a -0.0 that an added zero would turn into +0.0."""
    gen = torch.Generator().manual_seed(rank)
    leaves = []
    for k in range(2):
        matrix = torch.randn(7, generator=gen).reshape(7, 1) * 10.0 ** (3 * k)
        vector = torch.tensor([-0.0, float(rank + k + 1)], dtype=torch.float64)
        leaves.append([matrix, vector])
    return leaves


def summed(rank: int, step_samples: int) -> list[torch.Tensor]:
    """This rank's sum of a step of ``step_samples`` samples (micro-batches of 2, 4 a step)."""
    plan = ExactPlan(8, 2, 2)
    total = FixedOrderSum(plan)
    total.start()
    mine = _leaves(rank)
    for k, leaf in enumerate(mine):
        present = plan.samples_of(step_samples, rank * plan.per_process + k) > 0
        total.add([t.clone() for t in leaf] if present else None)
    return total.total(step_samples, like=mine[0])


def _by_tree(step_samples: int) -> list[torch.Tensor]:
    """What the tree over micro-batches 0-3 gives: ((0 + 1) + (2 + 3)), absent ones passed."""
    plan = ExactPlan(8, 2, 2)
    leaves = [leaf for rank in range(2) for leaf in _leaves(rank)]
    present = [plan.samples_of(step_samples, j) > 0 for j in range(4)]
    nodes = []
    for pair in (0, 2):
        kept = [leaves[j] for j in (pair, pair + 1) if present[j]]
        if len(kept) == 2:
            nodes.append([a + b for a, b in zip(*kept, strict=True)])
        elif kept:
            nodes.append(kept[0])
    if len(nodes) == 2:
        return [a + b for a, b in zip(*nodes, strict=True)]
    return nodes[0]


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a, b)
        and torch.equal(torch.signbit(a), torch.signbit(b))
        for a, b in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("step_samples", [8, 6, 3], ids=["whole", "last-absent", "rank-1-absent"])
def test_both_ranks_receive_the_trees_sum_with_absent_micro_batches_never_added(
    other_rank: OtherRank, step_samples: int
) -> None:
    other_rank.run(summed, step_samples)
    here = summed(0, step_samples)
    want = _by_tree(step_samples)
    assert _same(here, want)
    assert _same(other_rank.result(), want)


def scattered(rank: int, step_samples: int) -> list[torch.Tensor]:
    """FSDP2's calls of the exact reduce-scatter on this rank for one step: the outputs."""
    import torch.distributed as dist

    plan = ExactPlan(8, 2, 2)
    context = StepContext(plan.per_process)
    comm = ExactReduceScatter(plan, context)
    outputs = []
    for k, leaf in enumerate(_leaves(rank)):
        index = rank * plan.per_process + k
        context.place(k, 2, plan.samples_of(step_samples, index), step_samples)
        flat = leaf[0].reshape(-1).clone()
        buffer = comm.allocate((8,), dtype=flat.dtype, device=flat.device)
        buffer[:7], buffer[7] = flat, -0.0  # padding: -0.0 stays -0.0 unless 0.0 is added
        output = comm.allocate((4,), dtype=flat.dtype, device=flat.device)
        comm(output, buffer, dist.group.WORLD, None)
        outputs.append(output)
    return outputs


@pytest.mark.parametrize(
    "step_samples", [8, 6, 3], ids=["whole", "rank-1-half-empty", "rank-1-absent"]
)
def test_fsdp_reduce_scatter_gives_zeros_until_the_last_micro_batch_then_the_shard_sum(
    other_rank: OtherRank, step_samples: int
) -> None:
    other_rank.run(scattered, step_samples)
    here = scattered(0, step_samples)
    theirs = other_rank.result()
    whole = torch.cat([_by_tree(step_samples)[0].reshape(-1), torch.tensor([-0.0])])
    for outputs in (here, theirs):
        assert torch.equal(outputs[0], torch.zeros(4))
    assert _same([here[1]], [whole[:4]])
    assert _same([theirs[1]], [whole[4:]])
