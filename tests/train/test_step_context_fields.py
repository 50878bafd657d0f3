"""A step context's fields as the loader, the step and the hooks read them: fresh, placed, and
the lookup of the loader being iterated."""

from __future__ import annotations

import torch

from gpukit.train.context import StepContext, current_context, loader_pass
from gpukit.train.precision import Precision


def test_a_fresh_context_counts_one_micro_batch_a_step_and_nothing_yet() -> None:
    ctx = StepContext()
    assert (ctx.accumulate, ctx.length, ctx.index) == (1, 1, -1)
    assert (ctx.samples, ctx.global_samples, ctx.window_samples) == (None, None, None)
    assert ctx.placed is False
    assert ctx.in_pass is False
    assert ctx.user_counts is False
    assert (ctx.count, ctx.gradient_weight, ctx.reference) == (None, None, None)
    assert StepContext(3).length == 3


def test_the_precision_given_is_the_one_kept() -> None:
    bf16 = Precision("bf16-mixed", "cpu", torch.bfloat16)
    assert StepContext(2, precision=bf16).precision is bf16


def test_a_placed_micro_batch_counts_its_own_samples_over_every_rank_unless_told() -> None:
    ctx = StepContext(2)
    ctx.place(0, 2, 3, 10)
    assert (ctx.samples, ctx.global_samples, ctx.window_samples) == (3, 3, 10)
    ctx.place(1, 2, 3, 10, global_samples=7)
    assert ctx.global_samples == 7


def test_a_new_step_forgets_the_last_ones_counts() -> None:
    ctx = StepContext(2)
    ctx.place(0, 2, 3, 10)
    ctx.user_counts, ctx.count, ctx.gradient_weight, ctx.local_count = True, 9, 0.5, 4
    ctx.place(0, 2, 3, 10)
    assert ctx.user_counts is False
    assert (ctx.count, ctx.gradient_weight, ctx.local_count) == (None, None, 0)


def test_the_gradient_sync_is_told_whether_each_micro_batch_closes_its_step() -> None:
    ctx = StepContext(3)
    told: list[bool] = []
    ctx.on_place = told.append
    for index in range(3):
        ctx.place(index, 3, 1, 3)
    assert told == [False, False, True]


def test_the_lookup_finds_the_loader_being_iterated_and_with_step_only_one_with_a_step() -> None:
    plain, stepped = StepContext(), StepContext()
    stepped.train_step = object()
    assert current_context() is None
    with loader_pass(stepped), loader_pass(plain):
        assert current_context() is plain  # the innermost
        assert current_context(with_step=True) is stepped
        plain.in_pass = False  # a pass ended from another thread: no longer current
        assert current_context() is stepped
    assert current_context() is None
