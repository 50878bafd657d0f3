"""The fp16 loss scaler on its own: its options, its counts, its report of a skipped step."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from gpukit.train.scaler import LossScaler


def _model_and_optimizer() -> tuple[nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(scaler: LossScaler, model: nn.Linear, poison: bool = False) -> None:
    loss = model(torch.ones(2, 3)).sum()
    if poison:
        loss = loss * torch.tensor(float("inf"))
    scaler.scale(loss).backward()


def test_the_scalers_options_reach_torchs_scaler_on_the_device_asked() -> None:
    scaler = LossScaler("cpu", init_scale=8.0, growth_interval=3)
    assert scaler.scaler.is_enabled()
    assert scaler.scale_value == 8.0
    assert scaler.scaler.get_growth_interval() == 3


def test_steps_and_skipped_steps_are_counted_and_a_skip_is_reported_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, opt = _model_and_optimizer()
    scaler = LossScaler("cpu", init_scale=2.0**16)
    results = []
    with caplog.at_level(logging.INFO, logger="gpukit.train"):
        for poison in (False, True, False, True):
            opt.zero_grad()
            _backward(scaler, model, poison)
            results.append(scaler.step(opt))
    assert results == [True, False, True, False]
    assert (scaler.steps, scaler.skipped_steps) == (4, 2)
    assert [r.getMessage() for r in caplog.records if r.name == "gpukit.train"] == [
        "skipped an optimizer step: inf or NaN in the fp16 gradients; loss scale "
        "65536 -> 32768 (1 of 2 steps skipped)",
        "skipped an optimizer step: inf or NaN in the fp16 gradients; loss scale "
        "32768 -> 16384 (2 of 4 steps skipped)",
    ]


def test_unscaling_twice_in_a_step_divides_once_and_the_next_step_unscales_again() -> None:
    model, opt = _model_and_optimizer()
    scaler = LossScaler("cpu", init_scale=4.0)
    for _ in range(2):  # the second step must unscale afresh
        opt.zero_grad()
        _backward(scaler, model)
        scaler.unscale(opt)
        once = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        scaler.unscale(opt)  # torch's scaler would raise on a second unscale_
        twice = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(torch.equal(a, b) for a, b in zip(once, twice, strict=True))
        assert torch.equal(once[0], torch.full((1, 3), 2.0))  # d(sum)/dw, not 4x it
        assert scaler.step(opt)


def test_the_counts_and_the_scale_come_back_from_a_state() -> None:
    model, opt = _model_and_optimizer()
    scaler = LossScaler("cpu", init_scale=2.0**10)
    for poison in (True, False, False):
        opt.zero_grad()
        _backward(scaler, model, poison)
        scaler.step(opt)
    fresh = LossScaler("cpu")
    fresh.load_state_dict(scaler.state_dict())
    assert (fresh.steps, fresh.skipped_steps) == (3, 1)
    assert fresh.scale_value == scaler.scale_value == 2.0**9
