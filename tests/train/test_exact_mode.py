"""Exact mode's parts in one process: the fixed order, the cut, the refusals, the streams.

The bitwise comparisons across numbers of processes are in ``test_same_bits.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from gpukit import distributed as dist
from gpukit.distributed.data import DistributedLoader
from gpukit.errors import InvalidArgumentError
from gpukit.train.exact import ExactPlan, FixedOrderSum, exact_plan, tree_sum
from gpukit.train.precision import Precision


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _concat(left: str, right: str) -> str:
    return f"({left}+{right})"


def test_the_tree_pairs_neighbours_and_passes_absent_subtrees_over() -> None:
    assert tree_sum(list("abcdefg"), _concat) == "(((a+b)+(c+d))+((e+f)+g))"
    assert tree_sum(["a", "b", None, None], _concat) == "(a+b)"
    assert tree_sum([None, "b"], _concat) == "b"
    assert tree_sum(["a", None, "c"], _concat) == "(a+c)"
    assert tree_sum([None, None, "c", "d", "e"], _concat) == "((c+d)+e)"
    assert tree_sum(["a"], _concat) == "a"
    assert tree_sum([None], _concat) is None
    assert tree_sum([], _concat) is None


@pytest.mark.parametrize(
    ("world", "sizes", "per_process"),
    [(1, (1, 1), 1), (4, (4, 1), 1), (2, (4, 1), 2), (1, (6, 1), 6), (3, (6, 2), 1)],
)
def test_the_smallest_cuts_are_exact(world: int, sizes: tuple[int, int], per_process: int) -> None:
    assert exact_plan(world, *sizes).per_process == per_process


@pytest.mark.parametrize(("world", "sizes"), [(2, (6, 1)), (3, (18, 1)), (4, (4, 2))])
def test_a_process_with_other_than_a_power_of_two_of_micro_batches_is_refused(
    world: int, sizes: tuple[int, int]
) -> None:
    with pytest.raises(InvalidArgumentError, match="each process must take a power of two"):
        exact_plan(world, *sizes)


def test_each_refusal_of_a_cut_says_what_is_wrong_and_what_to_pass() -> None:
    # The whole message: what a user reads is the interface.
    cases = {
        (64, None): (
            "exact mode needs global_batch_size= and micro_batch_size=: the cut of a step "
            "into micro-batches is what stays the same on every number of processes. Pass "
            "both, e.g. prepare(..., exact=True, global_batch_size=64, micro_batch_size=8)."
        ),
        (64, 0): (
            "exact mode got micro_batch_size=0, which is not a number of samples. Pass "
            "micro_batch_size as a whole number, 1 or more."
        ),
        (True, 8): (
            "exact mode got global_batch_size=True, which is not a number of samples. Pass "
            "global_batch_size as a whole number, 1 or more."
        ),
        (64, 7): (
            "exact mode got global_batch_size=64, which is not a whole number of micro-batches "
            "of micro_batch_size=7. Use a global batch that is a multiple of 7, or a "
            "micro-batch size that divides 64."
        ),
    }
    for (size, micro), text in cases.items():
        with pytest.raises(InvalidArgumentError) as refused:
            exact_plan(2, size, micro)
        assert str(refused.value) == text
    nearest = {
        (3, 200, 8): "run on 1, 25 processes; on 3, use global_batch_size=192 or 384 with 8.",
        (2, 7, 1): "run on 1, 7 processes; on 2, use global_batch_size=4 or 8 with 1.",
    }
    for (world, size, micro), text in nearest.items():
        with pytest.raises(InvalidArgumentError) as refused:
            exact_plan(world, size, micro)
        assert str(refused.value).endswith(text)
    with pytest.raises(InvalidArgumentError) as refused:
        exact_plan(2, 48, 8)
    assert str(refused.value) == (
        "exact mode cannot sum 6 micro-batches of 8 in one order on 2 processes: each process "
        "must take a power of two of them. With these sizes, run on 1, 3, 6 processes; on 2, "
        "use micro_batch_size=6, 12, 24 with 48, or global_batch_size=32 or 64 with 8."
    )


@settings(max_examples=60, deadline=None)
@given(
    leaves=st.integers(1, 19),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_streaming_sum_of_one_process_is_the_tree_bit_for_bit(leaves: int, seed: int) -> None:
    # Values over many magnitudes, so that another order of additions rounds otherwise.
    gen = torch.Generator().manual_seed(seed)
    values = [
        torch.randn(64, generator=gen) * 10.0 ** torch.randint(-6, 7, (64,), generator=gen)
        for _ in range(leaves)
    ]
    summed = FixedOrderSum(ExactPlan(leaves, 1, 1))
    summed.start()
    for value in values:
        summed.add([value.clone()])
    summed.add(None)  # an empty micro-batch after the last one: absent
    want = tree_sum([v.clone() for v in values], torch.add)
    assert want is not None
    (got,) = summed.total(leaves, like=[values[0]])
    assert torch.equal(got, want)


def test_the_streaming_sum_is_not_left_to_right() -> None:
    # 1e8 + 1 + 1 + ... in float32 (spacing 8 there): left to right loses every 1, the tree
    # adds them up first.
    values = [torch.tensor([1e8])] + [torch.tensor([1.0])] * 15
    summed = FixedOrderSum(ExactPlan(16, 1, 1))
    for value in values:
        summed.add([value.clone()])
    (got,) = summed.total(16, like=values)
    left_to_right = torch.tensor([1e8])
    for value in values[1:]:
        left_to_right = left_to_right + value
    assert torch.equal(got, tree_sum(values, torch.add))
    assert not torch.equal(got, left_to_right)


def test_a_process_without_a_micro_batch_sums_to_zeros() -> None:
    summed = FixedOrderSum(ExactPlan(4, 2, 1))
    summed.add(None)
    (got,) = summed.total(0, like=[torch.ones(3)])
    assert torch.equal(got, torch.zeros(3))


@pytest.mark.parametrize(
    ("world", "sizes", "exact"),
    [
        (1, (64, 8), [1, 2, 4, 8]),
        (4, (64, 8), [1, 2, 4, 8]),
        (3, (48, 8), [1, 3, 6]),
        (1, (12, 4), [1, 3]),
    ],
)
def test_a_plan_is_exact_where_each_process_takes_a_power_of_two(
    world: int, sizes: tuple[int, int], exact: list[int]
) -> None:
    plan = exact_plan(world, *sizes)
    assert plan.exact_world_sizes() == exact
    assert plan.per_process * world == plan.micro_batches


def test_a_short_step_is_cut_into_the_same_micro_batches_for_every_n() -> None:
    plan = exact_plan(2, 16, 4)
    assert [plan.samples_of(6, i) for i in range(4)] == [4, 2, 0, 0]
    assert plan.real_micro_batches(6) == 2


def test_a_number_of_processes_the_order_cannot_hold_is_refused_with_the_exact_ones() -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        exact_plan(3, 64, 8)
    text = str(refused.value)
    assert "power of two" in text
    assert "run on 1, 2, 4, 8 processes" in text
    assert "on 3, use global_batch_size=48 or 96 with 8" in text
    # Every configuration the hint names is exact on 3 processes.
    assert exact_plan(3, 48, 8).per_process == 2
    assert exact_plan(3, 96, 8).per_process == 4


def test_the_hint_names_micro_batch_sizes_that_keep_the_global_batch() -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        exact_plan(2, 48, 8)  # 6 micro-batches: 3 a process
    assert "use micro_batch_size=4, 8, 12 with 48" not in str(refused.value)
    assert "use micro_batch_size=6, 12, 24 with 48" in str(refused.value)
    for micro in (6, 12, 24):
        exact_plan(2, 48, micro)


def test_a_huge_global_batch_is_judged_by_arithmetic_not_by_counting() -> None:
    # The refusal's hint lists sizes: found from the powers of two, not by trying every size.
    with pytest.raises(InvalidArgumentError, match="on 3, use global_batch_size="):
        exact_plan(3, 2**62, 8)
    assert exact_plan(1, 2**62, 2**60).exact_world_sizes() == [1, 2, 4]


@pytest.mark.parametrize(
    ("global_size", "micro"),
    [(None, 8), (64, None), (64, 0), (64, -8), (64, True), (64, 2.5), ("64", 8), (64, 7)],
)
def test_sizes_that_are_not_a_cut_are_refused(global_size: object, micro: object) -> None:
    with pytest.raises(InvalidArgumentError):
        exact_plan(1, global_size, micro)


def _parts(
    model: nn.Module | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader[Any]]:
    model = model if model is not None else nn.Linear(3, 1)
    data = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"micro_batch_size": 4}, "without exact=True"),
        ({"exact": "yes", "global_batch_size": 8, "micro_batch_size": 4}, "True or False"),
        ({"exact": True, "global_batch_size": 8}, "needs global_batch_size= and micro"),
        (
            {"exact": True, "global_batch_size": 8, "micro_batch_size": 4, "accumulate": 2},
            "takes global_batch_size= and micro_batch_size= only",
        ),
        (
            {
                "exact": True,
                "global_batch_size": 8,
                "micro_batch_size": 4,
                "per_device_batch_size": 4,
            },
            "takes global_batch_size= and micro_batch_size= only",
        ),
        (
            {
                "exact": True,
                "global_batch_size": 8,
                "micro_batch_size": 4,
                "ddp_kwargs": {"bucket_cap_mb": 1},
            },
            "runs no DDP",
        ),
    ],
)
def test_what_exact_mode_cannot_make_exact_is_refused_before_any_work(
    kwargs: dict[str, Any], words: str
) -> None:
    model, opt, loader = _parts()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidArgumentError, match=words):
        dist.prepare(model, opt, loader, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_exact_mode_needs_the_optimizer_and_the_loader() -> None:
    model, opt, _ = _parts()
    with pytest.raises(InvalidArgumentError, match="needs the optimizer and the loader"):
        dist.prepare(model, opt, exact=True, global_batch_size=8, micro_batch_size=4)


def test_batch_norm_running_statistics_are_refused_and_named() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model, opt, loader = _parts(model)
    with pytest.raises(InvalidArgumentError, match=r"running statistics exact \(1\)") as refused:
        dist.prepare(model, opt, loader, exact=True, global_batch_size=8, micro_batch_size=4)
    assert "LayerNorm" in (refused.value.hint or "")
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False))
    model, opt, loader = _parts(plain)
    dist.prepare(model, opt, loader, exact=True, global_batch_size=8, micro_batch_size=4)


def test_fp16_is_refused_in_exact_mode() -> None:
    from gpukit.distributed.ddp import _exact_checks

    model, opt, loader = _parts()
    fp16 = Precision("fp16-mixed", "cuda", torch.float16)
    with pytest.raises(InvalidArgumentError, match="does not run fp16"):
        _exact_checks(
            model,
            opt,
            loader,
            world_size=1,
            exact=True,
            sizes=(None, 8, 4, None),
            precision=fp16,
            shard=False,
            ddp_kwargs=None,
        )


def test_a_resume_in_exact_mode_refuses_a_state_of_another_cut() -> None:
    model, opt, loader = _parts()
    _, _, prepared = dist.prepare(
        model, opt, loader, exact=True, global_batch_size=8, micro_batch_size=4
    )
    step = prepared.train_step
    assert step is not None
    state = step.state_dict()
    assert state["accumulation"]["exact"] == [8, 4]
    state["accumulation"]["exact"] = [8, 2]
    with pytest.raises(InvalidArgumentError, match="micro_batch_size=2"):
        step.load_state_dict(state)
    state["accumulation"].pop("exact")
    with pytest.raises(InvalidArgumentError, match="outside exact mode"):
        step.load_state_dict(state)
    state["accumulation"]["exact"] = "x" * 10_000
    with pytest.raises(InvalidArgumentError, match="not \\[global, micro\\] sizes"):
        step.load_state_dict(state)


def test_exact_mode_computes_on_one_intra_op_thread_on_the_cpu() -> None:
    torch.set_num_threads(2)
    model, opt, loader = _parts()
    dist.prepare(model, opt, loader, exact=True, global_batch_size=8, micro_batch_size=4)
    assert torch.get_num_threads() == 1
    assert torch.are_deterministic_algorithms_enabled()


def test_sample_generators_are_keyed_by_index_epoch_and_seed() -> None:
    def draw(index: int, epoch: int, seed: int = 0) -> float:
        return torch.rand((), generator=dist.sample_generator(index, epoch=epoch, seed=seed)).item()

    assert draw(5, 0) == draw(5, 0)
    assert len({draw(5, 0), draw(6, 0), draw(5, 1), draw(5, 0, seed=1)}) == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"index": -1, "epoch": 0},
        {"index": True, "epoch": 0},
        {"index": 1.0, "epoch": 0},
        {"index": 0, "epoch": -1},
        {"index": 0, "epoch": 0, "seed": 2**63},
    ],
)
def test_sample_generator_refuses_what_is_not_an_index_epoch_or_seed(
    kwargs: dict[str, Any],
) -> None:
    with pytest.raises(InvalidArgumentError):
        dist.sample_generator(**kwargs)


class EpochAware(Dataset[int]):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index


def test_a_dataset_that_follows_the_epoch_is_told_it_before_each_pass() -> None:
    data = EpochAware()
    loader = DistributedLoader(
        DataLoader(data, batch_size=4),
        batch_size=4,
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        seed=0,
    )
    for _ in range(3):
        list(loader)
    assert data.epochs == [0, 1, 2]


def test_persistent_workers_are_refused_for_a_dataset_that_follows_the_epoch() -> None:
    inner = DataLoader(EpochAware(), batch_size=4, num_workers=1, persistent_workers=True)
    with pytest.raises(InvalidArgumentError, match="persistent_workers=False"):
        DistributedLoader(
            inner, batch_size=4, rank=0, world_size=1, device=torch.device("cpu"), seed=0
        )


def test_the_streams_seeds_stay_what_they_were_so_a_run_resumed_by_a_later_gpukit_draws_alike() -> (
    None
):
    # Written down once: a change of the key's text, hash, size or shift would give a resumed
    # run other dropout masks and augmentations than the run it continues.
    from gpukit.distributed.streams import micro_batch_seed

    assert micro_batch_seed(0, 0, 0) == 8368483151293633224
    assert micro_batch_seed(11, 1, 64) == 4625489652494818856
    expected = torch.Generator().manual_seed(8831464122974515740)
    assert torch.equal(
        torch.rand(4, generator=dist.sample_generator(0, epoch=0)),
        torch.rand(4, generator=expected),
    )
    other = torch.Generator().manual_seed(5002336175728054378)
    assert torch.equal(
        torch.rand(4, generator=dist.sample_generator(5, epoch=2, seed=7)),
        torch.rand(4, generator=other),
    )


def test_a_micro_batchs_seed_is_what_the_torch_stream_draws_from() -> None:
    from gpukit.distributed.streams import micro_batch_seed, seed_micro_batch

    seed_micro_batch(torch.device("cpu"), 3, 1, 40)
    drawn = torch.rand(5)
    alone = torch.Generator().manual_seed(micro_batch_seed(3, 1, 40))
    assert torch.equal(drawn, torch.rand(5, generator=alone))


def test_sample_generator_refusals_say_what_to_pass() -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        dist.sample_generator(-1, epoch=0)
    assert str(refused.value) == (
        "sample_generator got index=-1, which is not a sample's index. Pass the index "
        "__getitem__ received, a whole number from 0."
    )


def test_on_a_gpu_the_devices_own_generator_is_seeded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA's generators stood in for by CPU ones: the micro-batch's device gets the seed, the
    # other devices keep their streams.
    from gpukit.distributed.streams import micro_batch_seed, seed_micro_batch

    generators = (torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    seed_micro_batch(torch.device("cuda", 1), 3, 1, 40)
    assert generators[1].initial_seed() == micro_batch_seed(3, 1, 40)
    assert generators[0].initial_seed() == 1
    seed_micro_batch(torch.device("cuda"), 3, 1, 48)
    assert generators[0].initial_seed() == micro_batch_seed(3, 1, 48)
    assert torch.default_generator.initial_seed() == micro_batch_seed(3, 1, 48)
