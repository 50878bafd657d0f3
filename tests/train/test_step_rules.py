"""The training step's rules, one at a time: what it answers, what it refuses and in which
words, which gradients it keeps, and how it tells a wrapped model when to synchronise.

The whole-run tests (`test_accumulate.py`, `test_precision.py`, `test_exact_mode.py`) show the
step trains right; these pin each rule on its own, so that a change to one is seen here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from gpukit import distributed as dist
from gpukit.errors import InvalidArgumentError
from gpukit.train import Precision, StepContext, StepResult, TrainStep
from gpukit.train.exact import ExactPlan
from gpukit.train.shard import shard

FP16_ON_CPU = Precision("fp16-mixed", "cpu", torch.float16)  # a scaler on the CPU, for tests
CPU = torch.device("cpu")
CLIP_HINT = "Pass a number above 0, such as clip_grad_norm=1.0, or leave it out to not clip."


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def _model(inputs: int = 3) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(inputs, 1).double()


def _sgd(model: nn.Module, **options: Any) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, **options)


def _loss(model: nn.Module, rows: int = 4, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, generator=gen, dtype=torch.float64)
    return model(x).square().mean()


@contextmanager
def _at_first_batch(loader: Any) -> Iterator[Any]:
    """Inside a loop over ``loader``, at its first batch; the loop is closed after, so that no
    other test finds it still running."""
    batches = iter(loader)
    try:
        yield next(batches)
    finally:
        batches.close()


def _said(error: InvalidArgumentError, message: str, hint: str) -> None:
    """``error`` says ``message`` and, as its next step, ``hint``: each whole."""
    assert (error.message, error.hint) == (message, hint)


def _loader(n: int) -> DataLoader[Any]:
    x = torch.arange(n, dtype=torch.float64)[:, None]
    return DataLoader(TensorDataset(x, 2 * x), batch_size=4)


# -- the result ------------------------------------------------------------------------------------


def test_a_result_equals_another_only_with_the_same_answer_and_the_same_norm() -> None:
    norm = torch.tensor(2.0)
    assert StepResult(True, norm) == StepResult(True, torch.tensor(2.0))
    assert StepResult(True) == StepResult(True)
    assert StepResult(True) != StepResult(False)  # no norm on either: the answers decide
    assert StepResult(True, norm) != StepResult(False, norm)
    assert StepResult(True, norm) != StepResult(True, torch.tensor(3.0))
    assert StepResult(True, norm) != StepResult(True)  # a norm against none, either way round
    assert StepResult(True) != StepResult(True, norm)


def test_a_result_hashes_as_its_answer_so_that_it_is_found_among_bools() -> None:
    assert hash(StepResult(True, torch.tensor(1.0))) == hash(True)
    assert hash(StepResult(False)) == hash(False)
    assert StepResult(True) in {True}
    assert StepResult(False) in {False: "skipped"}


# -- a step made by hand ---------------------------------------------------------------------------


def test_a_context_of_another_training_step_is_refused_saying_what_to_do() -> None:
    context = StepContext(2)
    model = _model()
    TrainStep(model, _sgd(model), context=context)
    with pytest.raises(InvalidArgumentError) as refused:
        TrainStep(model, _sgd(model), context=context)
    _said(
        refused.value,
        "this step context already belongs to another training step.",
        "Give each TrainStep its own StepContext (prepare() makes one per loader).",
    )


def test_an_accumulate_other_than_the_contexts_is_refused_not_overridden() -> None:
    model = _model()
    with pytest.raises(InvalidArgumentError, match="accumulate"):
        TrainStep(model, _sgd(model), accumulate=3, context=StepContext(2))
    step = TrainStep(model, _sgd(model), context=StepContext(2))  # the context's, unsaid
    assert step.accumulation.steps == 2


def test_a_precision_neither_a_name_nor_resolved_is_refused_naming_its_type() -> None:
    model = _model()
    with pytest.raises(InvalidArgumentError) as refused:
        TrainStep(model, _sgd(model), precision=16)  # type: ignore[arg-type]
    _said(
        refused.value,
        "TrainStep got precision=16 (a int), neither a precision's name nor a resolved Precision.",
        "Pass one of 'auto', 'bf16-mixed', 'fp16-mixed', 'fp32' (as prepare() takes them), "
        "or gk.train.resolve_precision(name, device).",
    )


def test_a_model_without_weights_resolves_its_precision_on_the_cpu() -> None:
    weight = torch.zeros(1, requires_grad=True)
    step = TrainStep(nn.Sequential(), torch.optim.SGD([weight], lr=0.1), precision="auto")
    assert step.precision.device_type == "cpu"


def test_a_fresh_step_is_not_mid_step() -> None:
    model = _model()
    assert TrainStep(model, _sgd(model), accumulate=2).mid_step is False


def test_begin_places_the_micro_batch_in_its_step() -> None:
    model = _model()
    step = TrainStep(model, _sgd(model), accumulate=3)
    step.begin(1, 3, 4, 10)
    context = step.context
    assert (context.index, context.length, context.samples, context.window_samples) == (1, 3, 4, 10)
    assert not step(_loss(model))  # the second of three: it only accumulates
    assert step.mid_step


def test_the_step_zeroes_gradients_to_none_so_an_unreached_weight_is_not_decayed() -> None:
    # SGD passes over a parameter whose gradient is None: weight decay must not reach a weight
    # the step's loss did not reach, as after a plain loop's opt.zero_grad().
    def pair() -> nn.ModuleList:
        torch.manual_seed(0)
        return nn.ModuleList([nn.Linear(3, 1), nn.Linear(3, 1)]).double()

    plain, stepped = pair(), pair()
    plain_opt = _sgd(plain, weight_decay=0.5)
    train_step = TrainStep(stepped, _sgd(stepped, weight_decay=0.5))
    for number, reach in enumerate([2, 1]):  # both layers, then the first alone
        plain_opt.zero_grad()
        sum(_loss(layer, seed=number) for layer in plain[:reach]).backward()
        plain_opt.step()
        assert train_step(sum(_loss(layer, seed=number) for layer in stepped[:reach]))
    for a, b in zip(plain.parameters(), stepped.parameters(), strict=True):
        assert torch.equal(a, b)
    assert stepped[1].weight.grad is None


def test_a_hooked_step_leaves_the_weighing_of_the_gradients_to_the_hook() -> None:
    def gradients(hooked: bool) -> list[torch.Tensor]:
        model = _model()
        step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=2)
        step.hooked = hooked
        seen: list[torch.Tensor] = []
        step(_loss(model, seed=1), count=1)
        step(
            _loss(model, seed=2),
            count=3,
            before_optimizer_step=lambda: seen.extend(p.grad.clone() for p in model.parameters()),
        )
        return seen

    weighed, raw = gradients(False), gradients(True)
    # counts 1 and 3: the losses are weighed 1 and 3 (by the first count), the sum by 1/4
    for w, r in zip(weighed, raw, strict=True):
        assert torch.equal(w, r * 0.25)
    made = TrainStep(_model(), _sgd(_model()), hooked=True)
    assert made.hooked is True


def test_a_scaled_step_weighs_its_first_micro_batch_one_an_unscaled_one_by_the_steps_samples() -> (
    None
):
    # fp16's losses are never made smaller than the first micro-batch's before scaling (small
    # gradients underflow); fp32 weighs each micro-batch by its share of the step at once.
    for precision, reference in [(FP16_ON_CPU, 4), ("fp32", 8)]:
        model = _model()
        step = TrainStep(model, _sgd(model), precision=precision, accumulate=2)
        step.begin(0, 2, 4, 8)
        step(_loss(model))
        assert step.accumulation.state_dict()["reference"] == reference, precision


def test_an_exact_steps_state_names_its_cut() -> None:
    model = _model()
    step = TrainStep(model, _sgd(model), accumulate=2, exact=ExactPlan(8, 4, 1))
    assert step.state_dict()["accumulation"]["exact"] == [8, 4]
    assert step.exact == ExactPlan(8, 4, 1)


# -- exact mode's sum in one process -----------------------------------------------------------


class _WithAnIdleWeight(nn.Module):
    """A float32 model with a weight no loss reaches (its gradient stays None)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(16, 8)
        self.idle = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _micro_batch(index: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + index))


def _exact_gradients(counts: list[int] | None) -> list[torch.Tensor]:
    """Exact mode's gradients of a step of four micro-batches of 4 samples, as the optimizer
    is handed them (with ``counts``, each micro-batch's items; the second's loss then NaN)."""
    model = _WithAnIdleWeight()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(model, opt, accumulate=4, exact=ExactPlan(16, 4, 1))
    seen: list[torch.Tensor] = []
    for index in range(4):
        step.begin(index, 4, 4, 16)
        loss = model(_micro_batch(index)).square().mean()
        if counts is not None and counts[index] == 0:
            loss = loss * math.nan  # a micro-batch that counts no item: its loss is no one's
        result = step(
            loss,
            count=None if counts is None else counts[index],
            before_optimizer_step=lambda: seen.extend(
                torch.zeros(3) if p.grad is None else p.grad.clone() for p in model.parameters()
            ),
        )
    assert result
    assert not any(torch.equal(a, b) for a, b in zip(seen, model.parameters(), strict=True))
    return seen


def _by_the_tree(weights: list[float]) -> list[torch.Tensor]:
    """The gradients of each micro-batch's weighed loss, computed apart, added as exact mode's
    tree adds four leaves: (g0 + g1) + (g2 + g3); a weight of 0 is a zero leaf."""
    leaves = []
    for index, weight in enumerate(weights):
        model = _WithAnIdleWeight()
        if weight:
            (model(_micro_batch(index)).square().mean() * weight).backward()
        leaves.append(
            [torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()]
        )
    return [(a + b) + (c + d) for a, b, c, d in zip(*leaves, strict=True)]


def test_exact_mode_adds_each_micro_batchs_weighed_gradients_by_the_fixed_tree() -> None:
    expected = _by_the_tree([0.25] * 4)  # 4 of the step's 16 samples each
    assert all(torch.equal(a, b) for a, b in zip(_exact_gradients(None), expected, strict=True))
    # autograd's running sum, ((g0 + g1) + g2) + g3, gives other bits for these batches
    model = _WithAnIdleWeight()
    for index in range(4):
        (model(_micro_batch(index)).square().mean() * 0.25).backward()
    assert not torch.equal(model.layer.weight.grad, expected[0])


def test_exact_mode_weighs_counts_and_adds_a_micro_batch_of_no_item_as_zeros_even_its_nan() -> None:
    # With counts, each loss weighs its count, and the step's sum is weighed by 1 / the total.
    found = _exact_gradients([1, 0, 3, 2])
    expected = [g * (1 / 6) for g in _by_the_tree([1.0, 0.0, 3.0, 2.0])]
    assert all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))
    assert all(bool(torch.isfinite(g).all()) for g in found)


# -- the plain optimizer step in a prepared loop -----------------------------------------------


def test_the_plain_optimizer_step_is_refused_in_full_words_while_accumulating() -> None:
    model = _model(1)
    opt = _sgd(model)
    model, opt, loader = dist.prepare(model, opt, _loader(16), global_batch_size=8, accumulate=2)
    with _at_first_batch(loader), pytest.raises(InvalidArgumentError) as refused:
        opt.step()
    _said(
        refused.value,
        "opt.step() was called in a loop over a loader prepared with accumulate=2: it would "
        "step on every micro-batch, with unweighted or unscaled gradients.",
        "End each batch with gk.distributed.step(loss) in place of "
        "opt.zero_grad(); loss.backward(); opt.step().",
    )


def test_the_plain_optimizer_step_is_refused_under_fp16_naming_fp16() -> None:
    model = _model(1)
    opt = _sgd(model)
    step = TrainStep(model, opt, precision=FP16_ON_CPU)
    loader = dist.DistributedLoader(
        _loader(8), batch_size=4, rank=0, world_size=1, seed=0, train_step=step, device=CPU
    )
    with _at_first_batch(loader), pytest.raises(InvalidArgumentError) as refused:
        opt.step()
    assert refused.value.message.startswith(
        "opt.step() was called in a loop over a loader prepared with fp16 precision: "
    )


def test_the_plain_optimizer_step_stays_refused_after_a_step_and_is_free_outside_the_loop() -> None:
    model = _model(1)
    opt = _sgd(model)
    model, opt, loader = dist.prepare(model, opt, _loader(16), global_batch_size=4, accumulate=2)
    batches = iter(loader)
    for _ in range(2):
        x, y = next(batches)
        stepped = dist.step(nn.functional.mse_loss(model(x), y))
    assert stepped  # the step's own optimizer step, allowed
    next(batches)
    with pytest.raises(InvalidArgumentError, match="accumulate=2"):
        opt.step()  # and a plain one after it, refused as before
    for _ in batches:
        pass
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 1, dtype=torch.float64)).sum().backward()
    opt.step()  # outside the loop: the user's own step
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_step_in_a_loop_over_a_loader_prepared_without_an_optimizer_is_refused_saying_why() -> None:
    # evaluation: no optimizer, no step
    model, loader = dist.prepare(_model(1), loader=_loader(8), per_device_batch_size=4)
    with _at_first_batch(loader) as (x, _), pytest.raises(InvalidArgumentError) as refused:
        dist.step(model(x).sum())
    _said(
        refused.value,
        "step(loss) was called outside a loop over a loader prepared with an optimizer.",
        "Call it inside `for batch in loader:` for the loader from prepare(model, opt, "
        "loader, ...), or use gk.train.TrainStep(model, opt) directly.",
    )


# -- saving between micro-batches, and resuming with another scaler -----------------------------


def test_a_save_between_micro_batches_is_refused_counting_the_micro_batches_done() -> None:
    model = _model()
    step = TrainStep(model, _sgd(model), accumulate=3)
    step(_loss(model))
    step(_loss(model))
    with pytest.raises(InvalidArgumentError) as refused:
        step.state_dict()
    _said(
        refused.value,
        "the training step is between micro-batches (2 of 3 done): a save now would lose their "
        "accumulated gradients, and the resumed run would differ.",
        "Save after an optimizer step: when the result of dist.step(...) is true.",
    )


@pytest.mark.parametrize("saved_scaled", [True, False])
def test_a_state_of_the_other_precision_is_refused_saying_which_has_the_scaler(
    saved_scaled: bool,
) -> None:
    model = _model()
    saver = TrainStep(model, _sgd(model), precision=FP16_ON_CPU if saved_scaled else "fp32")
    loader = TrainStep(_model(), _sgd(_model()), precision="fp32" if saved_scaled else FP16_ON_CPU)
    with pytest.raises(InvalidArgumentError) as refused:
        loader.load_state_dict(saver.state_dict())
    _said(
        refused.value,
        "the training-step state was saved with an fp16 gradient scaler, and this run does not."
        if saved_scaled
        else "the training-step state was saved without an fp16 gradient scaler, and this run "
        "uses one.",
        "Resume with the precision= the state was saved with.",
    )


# -- the clipping norm's refusals ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("norm", "message"),
    [
        (
            math.nan,
            "clip_grad_norm=nan is not a finite norm above 0: it would write NaN into every "
            "weight.",
        ),
        (
            -1.0,
            "clip_grad_norm=-1.0 is not a finite norm above 0: it would flip every gradient, "
            "turning descent into ascent.",
        ),
        (
            -0.5,
            "clip_grad_norm=-0.5 is not a finite norm above 0: it would flip every gradient, "
            "turning descent into ascent.",
        ),
        (
            0,
            "clip_grad_norm=0 is not a finite norm above 0: it would zero every gradient, so the "
            "steps would learn nothing.",
        ),
        (
            math.inf,
            "clip_grad_norm=inf is not a finite norm above 0: it would never clip, which is what "
            "leaving it out does.",
        ),
        (
            "1.0",
            "clip_grad_norm='1.0' (a str) is not a number, so it cannot bound the gradients' norm.",
        ),
    ],
    ids=["nan", "minus-one", "minus-a-half", "zero", "inf", "a-string"],
)
def test_a_refused_clipping_norm_says_what_it_would_do(norm: object, message: str) -> None:
    model = _model()
    step = TrainStep(model, _sgd(model))
    with pytest.raises(InvalidArgumentError) as refused:
        step(_loss(model), clip_grad_norm=norm)  # type: ignore[arg-type]
    assert (refused.value.message, refused.value.hint) == (message, CLIP_HINT)


def test_a_check_before_the_optimizer_step_that_is_not_callable_is_refused_saying_what_to_do() -> (
    None
):
    model = _model()
    step = TrainStep(model, _sgd(model))
    with pytest.raises(InvalidArgumentError) as refused:
        step(_loss(model), before_optimizer_step="check")  # type: ignore[arg-type]
    _said(
        refused.value,
        "before_optimizer_step='check' is not callable.",
        "Pass a function of no argument, such as before_optimizer_step=check, or leave it out.",
    )


# -- telling a wrapped model when to synchronise ----------------------------------------------


class _Syncing(nn.Linear):
    """A model with FSDP2's ``set_requires_gradient_sync``: it records what it is told."""

    def __init__(self) -> None:
        super().__init__(3, 1, dtype=torch.float64)
        self.told: list[bool] = []

    def set_requires_gradient_sync(self, flag: bool) -> None:
        self.told.append(flag)


@pytest.mark.parametrize(
    ("exact", "told"),
    [(None, [False, False, True]), (ExactPlan(12, 4, 1), [True, True, True])],
    ids=["accumulating", "exact"],
)
def test_a_sharded_model_reduces_only_on_the_steps_last_micro_batch_but_in_exact_mode(
    exact: ExactPlan | None, told: list[bool]
) -> None:
    model = _Syncing()
    step = TrainStep(model, _sgd(model), accumulate=3, exact=exact)
    for index in range(3):
        step.begin(index, 3, 4, 12)
    assert model.told == told


@pytest.mark.usefixtures("group_of_one")
def test_a_ddp_model_prepares_its_all_reduce_only_on_the_steps_last_micro_batch() -> None:
    model = DistributedDataParallel(_model())
    step = TrainStep(model, _sgd(model), accumulate=3)
    told = []
    for index in range(3):
        step.begin(index, 3, 4, 12)
        told.append(model.require_backward_grad_sync)
    assert told == [False, False, True]


@pytest.mark.usefixtures("group_of_one")
def test_a_precision_name_puts_a_ddp_models_own_module_under_autocast() -> None:
    model = DistributedDataParallel(_model().float())  # autocast casts float32, not float64
    TrainStep(model, _sgd(model), precision="bf16-mixed")
    x = torch.ones(2, 3)
    inner = model.module
    in_fp32 = nn.functional.linear(x, inner.weight, inner.bias)
    in_bf16 = nn.functional.linear(x.bfloat16(), inner.weight.bfloat16(), inner.bias.bfloat16())
    assert not torch.equal(in_fp32, in_bf16.float())
    assert torch.equal(model(x), in_bf16.float())
    assert torch.equal(inner(x), in_bf16.float())  # evaluating through .module: the same


@pytest.mark.usefixtures("group_of_one")
def test_a_sharded_models_clipped_norm_is_a_plain_tensor_of_every_shard() -> None:
    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).double()

    plain = layers()
    _loss(plain).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e6)
    sharded = shard(layers(), device=torch.device("cpu"), weight=lambda: 1.0)
    step = TrainStep(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1))
    result = step(_loss(sharded), clip_grad_norm=1e6)
    assert type(result.grad_norm) is torch.Tensor  # not a DTensor of this rank's shards
    assert torch.equal(result.grad_norm, expected)


@pytest.mark.usefixtures("group_of_one")
def test_clipping_in_exact_mode_with_a_sharded_model_is_refused_saying_why() -> None:
    torch.manual_seed(0)
    sharded = shard(
        nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).double(),
        device=torch.device("cpu"),
        weight=lambda: 1.0,
    )
    step = TrainStep(
        sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), exact=ExactPlan(4, 4, 1)
    )
    with pytest.raises(InvalidArgumentError) as refused:
        step(_loss(sharded), clip_grad_norm=1.0)
    _said(
        refused.value,
        "clip_grad_norm= in exact mode with a sharded model: the norm adds every rank's shards "
        "in the backend's order, which changes with the number of processes.",
        "Clip in exact mode without shard=, or shard without exact=True.",
    )
