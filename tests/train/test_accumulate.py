"""Gradient accumulation in one process: sizes, weights, the one call, and its refusals."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.errors import InvalidArgumentError
from gpukit.train import AccumulationPlan, TrainStep, plan_accumulation
from gpukit.train.accumulate import Accumulation, check_count

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import accumulate_workloads as work


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _loader(n: int, **options: Any) -> DataLoader[Any]:
    x = torch.arange(n, dtype=torch.float64)[:, None]
    return DataLoader(TensorDataset(x, 2 * x), batch_size=4, **options)


@pytest.mark.parametrize("tokens", [False, True], ids=["samples", "tokens"])
def test_three_micro_batches_per_step_end_with_the_weights_of_the_whole_global_batch(
    tokens: bool,
) -> None:
    # 97 samples, global batch 36, K=3: the last window holds micro-batches of 12, 12 and 1.
    expected = work.reference(97, "sgd-momentum", tokens)
    got = work.accumulated(97, 3, "sgd-momentum", tokens)
    assert got == pytest.approx(expected, rel=0, abs=1e-12)


@pytest.mark.parametrize("tokens", [False, True], ids=["samples", "tokens"])
def test_the_steps_result_carries_the_norm_clip_grad_norm_gives_on_the_whole_global_batch(
    tokens: bool,
) -> None:
    # 97 samples, K=3: the last window's micro-batches of 12, 12 and 1 weigh by what they hold.
    expected = work.reference_norms(97, "sgd-momentum", tokens)
    got = work.clipped_norms(97, 3, "sgd-momentum", tokens)
    assert len(got["norms"]) == len(expected["norms"]) == 6
    assert got["norms"] == pytest.approx(expected["norms"], rel=0, abs=1e-12)
    assert min(expected["norms"]) < work.clip(tokens) < max(expected["norms"])  # some clipped


def test_gradients_seen_before_the_optimizer_step_are_the_whole_batchs_weighed_and_clipped() -> (
    None
):
    expected = work.reference_norms(97, "adamw", False)["gradients"]
    got = work.clipped_norms(97, 3, "adamw", False)["gradients"]
    assert len(got) == len(expected)
    for seen, want in zip(got, expected, strict=True):
        assert seen == pytest.approx(want, rel=0, abs=1e-12)


def test_a_micro_batch_that_only_accumulates_reports_no_norm_and_runs_no_callback() -> None:
    model = nn.Linear(1, 1).double()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    called: list[int] = []
    x = torch.ones(2, 1, dtype=torch.float64)
    first = step(
        model(x).mean(), clip_grad_norm=1.0, before_optimizer_step=lambda: called.append(1)
    )
    assert (bool(first), first.grad_norm, called) == (False, None, [])
    second = step(
        model(x).mean(), clip_grad_norm=1.0, before_optimizer_step=lambda: called.append(2)
    )
    assert second
    assert second.grad_norm is not None
    assert called == [2]


def test_without_clipping_the_result_carries_no_norm() -> None:
    model = nn.Linear(1, 1).double()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result = step(model(torch.ones(2, 1, dtype=torch.float64)).mean())
    assert result == True  # noqa: E712 - the answer a bool gave, as before
    assert result.grad_norm is None


@pytest.mark.parametrize("callback", [1, "log", object()], ids=["int", "str", "object"])
def test_a_before_optimizer_step_that_cannot_be_called_is_refused_before_any_work(
    callback: object,
) -> None:
    model = nn.Linear(1, 1).double()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(InvalidArgumentError, match="is not callable") as raised:
        step(model(torch.ones(1, 1, dtype=torch.float64)).mean(), before_optimizer_step=callback)  # type: ignore[arg-type]
    assert raised.value.hint is not None
    assert all(p.grad is None for p in model.parameters())


def test_a_micro_batch_size_and_a_larger_global_batch_give_the_micro_batches_per_step() -> None:
    model = nn.Linear(1, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, loader = dist.prepare(
        model, opt, _loader(50), per_device_batch_size=4, global_batch_size=12
    )
    assert (loader.batch_size, loader.accumulate, loader.global_batch_size) == (4, 3, 12)
    # 50 = 4 windows of 12 (3 micro-batches of 4), then 2 samples: one more micro-batch.
    assert [len(x) for x, _ in loader] == [4] * 12 + [2]


def test_drop_last_drops_the_whole_incomplete_optimizer_step_not_only_its_last_micro_batch() -> (
    None
):
    model = nn.Linear(1, 1)
    _, loader = dist.prepare(
        model, loader=_loader(50, drop_last=True), global_batch_size=12, accumulate=3
    )
    assert len(loader) == 12
    assert [len(x) for x, _ in loader] == [4] * 12


def test_the_plain_optimizer_step_in_an_accumulating_loop_is_refused_before_it_steps() -> None:
    model = nn.Linear(1, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = dist.prepare(model, opt, _loader(24), global_batch_size=8, accumulate=2)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(InvalidArgumentError, match="accumulate=2") as caught:
        _plain_step_in_the_loop(opt, loader)
    assert "dist" in (caught.value.hint or "")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _plain_step_in_the_loop(opt: torch.optim.Optimizer, loader: Any) -> None:
    for _ in loader:
        opt.step()


def test_the_step_answers_true_only_when_the_optimizer_stepped() -> None:
    model = nn.Linear(1, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = dist.prepare(model, opt, _loader(20), global_batch_size=8, accumulate=2)
    stepped = [dist.step(nn.functional.mse_loss(model(x), y)) for x, y in loader]
    # 20 samples: windows of 4 + 4, 4 + 4, then a last window of one micro-batch of 4.
    assert stepped == [False, True, False, True, True]


def test_step_outside_a_prepared_loop_is_refused_with_a_hint() -> None:
    with pytest.raises(InvalidArgumentError, match="outside a loop") as caught:
        dist.step(torch.zeros((), requires_grad=True))
    assert "TrainStep" in (caught.value.hint or "")


@pytest.mark.parametrize(
    "sizes",
    [
        {"global_batch_size": 10, "accumulate": 3},
        {"per_device_batch_size": 4, "global_batch_size": 12, "accumulate": 2},
        {"per_device_batch_size": 4, "accumulate": 0},
    ],
    ids=["global-not-divisible", "three-sizes-disagree", "zero-micro-batches"],
)
def test_batch_sizes_that_do_not_fit_together_are_refused(sizes: dict[str, int]) -> None:
    with pytest.raises(InvalidArgumentError):
        dist.prepare(nn.Linear(1, 1), loader=_loader(8), **sizes)


def test_accumulate_without_a_loader_is_refused() -> None:
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InvalidArgumentError, match="without a loader"):
        dist.prepare(model, opt, accumulate=2)


def test_a_train_step_without_a_loader_accumulates_k_calls_into_one_step() -> None:
    torch.manual_seed(0)
    whole = nn.Linear(3, 1).double()
    parts = nn.Linear(3, 1).double()
    parts.load_state_dict(whole.state_dict())
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    opt = torch.optim.SGD(whole.parameters(), lr=0.1)
    nn.functional.mse_loss(whole(x), y).backward()
    opt.step()
    train_step = TrainStep(parts, torch.optim.SGD(parts.parameters(), lr=0.1), accumulate=2)
    assert not train_step(nn.functional.mse_loss(parts(x[:4]), y[:4]))
    assert train_step(nn.functional.mse_loss(parts(x[4:]), y[4:]))
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_save_between_micro_batches_is_refused_since_their_gradients_would_be_lost() -> None:
    model = nn.Linear(1, 1).double()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    step(model(torch.ones(2, 1, dtype=torch.float64)).mean(), count=5)
    assert step.mid_step
    with pytest.raises(InvalidArgumentError, match="1 of 3 done"):
        step.state_dict()


def test_the_training_step_state_round_trips_between_optimizer_steps() -> None:
    model = nn.Linear(1, 1).double()
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    for _ in range(3):
        stepped = step(model(torch.ones(2, 1, dtype=torch.float64)).mean(), count=5)
    assert stepped
    assert not step.mid_step
    other = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    other.load_state_dict(step.state_dict())
    assert other.state_dict() == step.state_dict()


def test_a_state_saved_with_another_number_of_micro_batches_is_refused() -> None:
    model = nn.Linear(1, 1)
    saved = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    other = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    with pytest.raises(InvalidArgumentError, match="accumulate=2"):
        other.load_state_dict(saved.state_dict())


def test_a_count_that_is_not_a_number_of_items_is_refused() -> None:
    model = nn.Linear(1, 1)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(InvalidArgumentError, match="count=-1"):
        step(model(torch.ones(1, 1)).mean(), count=-1)


@pytest.mark.parametrize(
    ("global_batch", "largest", "world", "plan"),
    [(256, 40, 2, (32, 4)), (64, 64, 1, (64, 1)), (96, 7, 2, (6, 8)), (12, 100, 3, (4, 1))],
)
def test_a_plan_uses_the_largest_micro_batch_that_fits_and_divides_the_share(
    global_batch: int, largest: int, world: int, plan: tuple[int, int]
) -> None:
    found = plan_accumulation(global_batch, largest, world)
    assert found == AccumulationPlan(*plan)
    assert type(found.micro_batch_size) is int
    assert type(found.steps) is int


def test_a_share_with_no_divisor_that_fits_is_cut_into_single_samples() -> None:
    assert plan_accumulation(7, 3) == AccumulationPlan(1, 7)


def test_a_plan_for_a_global_batch_that_does_not_split_over_the_processes_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="cannot be split evenly over 4") as raised:
        plan_accumulation(10, 2, 4)
    assert raised.value.hint == "Use a multiple of 4."


def _weights(acc: Accumulation, samples: list[int], counts: list[int] | None = None) -> list[float]:
    """The loss weights of one window of micro-batches, then the gradient weight."""
    out = []
    for k, n in enumerate(samples):
        acc.begin(k, len(samples), n, sum(samples))
        out.append(acc.loss_weight(None if counts is None else counts[k]))
    acc.settle()
    return [*out, acc.gradient_weight()]


def test_without_loss_scaling_the_loss_carries_the_whole_weight_and_gradients_are_left_alone() -> (
    None
):
    # As loss / K in a hand-written loop: the last window's 12, 12 and 1 samples of 25.
    assert _weights(Accumulation(3), [12, 12, 1]) == [12 / 25, 12 / 25, 1 / 25, 1.0]


def test_under_fp16_loss_scaling_a_loss_keeps_its_size_and_the_gradients_take_the_share() -> None:
    # A loss divided by the whole global batch would underflow in fp16 before the scaler saw it.
    assert _weights(Accumulation(3, scaled=True), [12, 12, 1]) == [1.0, 1.0, 1 / 12, 12 / 25]


def test_counts_a_user_gives_are_weighed_against_the_first_and_summed_at_the_end() -> None:
    # Tokens are known only as the micro-batches come: N is learnt on the last one.
    got = _weights(Accumulation(3), [12, 12, 1], counts=[40, 20, 0])
    assert got == [1.0, 0.5, 0.0, 40 / 60]


def test_a_rank_whose_micro_batches_were_all_empty_adds_nothing_to_the_step() -> None:
    # Its losses read nan (the mean of nothing): its gradient must weigh 0, not 1, while the
    # other ranks' 5 samples make the step.
    acc = Accumulation(2, distributed=True)
    weights = []
    for k in range(2):
        acc.begin(k, 2, 0, 5)
        weights.append(acc.loss_weight(None))
    acc.settle()
    assert [*weights, acc.gradient_weight()] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "2"])
def test_a_number_of_micro_batches_that_is_not_a_whole_number_from_1_is_refused(
    steps: object,
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"accumulate={steps!r} is not") as raised:
        Accumulation(steps)  # type: ignore[arg-type]
    assert raised.value.hint == "Pass a whole number, 1 or more (1: no accumulation)."


@pytest.mark.parametrize("count", [True, 2.0, -1, torch.tensor(2.0), torch.tensor([1, 2])])
def test_a_count_is_a_whole_number_of_items_and_the_refusal_shows_how_to_count_tokens(
    count: object,
) -> None:
    with pytest.raises(InvalidArgumentError, match="is not a number of items") as raised:
        check_count(count)
    assert raised.value.hint is not None
    assert "count=(labels != -100).sum()" in raised.value.hint


def test_a_count_may_be_a_whole_number_tensor_of_one_value() -> None:
    assert check_count(torch.tensor(7)) == 7


def test_an_accumulation_state_of_another_k_is_refused_with_what_to_resume_with() -> None:
    with pytest.raises(InvalidArgumentError, match="saved with accumulate=2") as raised:
        Accumulation(3).load_state_dict(Accumulation(2).state_dict())
    assert raised.value.hint == "Resume with the accumulate= the state was saved with."


@pytest.mark.parametrize(
    ("sizes", "named"),
    [
        ((0, 8, 1), "global_batch_size"),
        ((8, 1.5, 1), "largest_micro_batch"),
        ((8, 8, 0), "world_size"),
    ],
)
def test_a_plan_names_the_size_that_is_not_a_positive_whole_number(
    sizes: tuple[object, object, object], named: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^{named}=") as raised:
        plan_accumulation(*sizes)  # type: ignore[arg-type]
    assert raised.value.hint == "Pass sizes as ints, 1 or more."


def test_a_plan_is_for_one_process_unless_told() -> None:
    assert plan_accumulation(12, 5) == AccumulationPlan(4, 3)
