"""The training step's edges: "auto" off CUDA and the CPU, the fp16 scaler past its first step,
an empty rank's NaN gradient in the sharded reduce-scatter, and a save that leaves CUDA alone.

Each test here holds a behaviour that a one-line slip in the code would break while the rest of
the suite still passed (issue 39).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from gpukit.train import TrainingState, TrainStep, resolve_precision
from gpukit.train.precision import Precision
from gpukit.train.shard import WeightedReduceScatter

FP16_ON_CPU = Precision("fp16-mixed", "cpu", torch.float16)  # a scaler on the CPU, for tests


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


# -- "auto" on a device that is neither CUDA nor the CPU -----------------------------------------


@pytest.mark.parametrize("kind", ["mps", "xpu"])
def test_auto_gives_fp32_on_a_device_neither_cuda_nor_the_cpu_even_where_the_cpu_has_bf16(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # The host CPU's bf16 instructions say nothing of an mps or xpu device, where gpukit runs
    # no mixed precision: "auto" must not pick what resolve_precision then refuses.
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    chosen = resolve_precision("auto", torch.device(kind))
    assert (chosen.name, chosen.device_type, chosen.dtype, chosen.scaled) == (
        "fp32",
        kind,
        None,
        False,
    )


# -- the fp16 scaler, step after step ------------------------------------------------------------


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def test_clipping_under_the_scaler_sees_the_true_gradients_on_every_step_not_only_the_first() -> (
    None
):
    # Gradients are unscaled once per step: a step that took the previous step's unscale for
    # its own would clip gradients still scaled (x 65536), and shrink them 65536 times too much.
    scaled, plain = _linear(), _linear()
    step_scaled = TrainStep(
        scaled, torch.optim.SGD(scaled.parameters(), lr=0.1), precision=FP16_ON_CPU
    )
    step_plain = TrainStep(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    torch.manual_seed(1)
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    for number, (x, y) in enumerate(batches, start=1):
        got = step_scaled(nn.functional.mse_loss(scaled(x), y), clip_grad_norm=0.05)
        want = step_plain(nn.functional.mse_loss(plain(x), y), clip_grad_norm=0.05)
        assert got, f"step {number} was skipped under the scaler"
        assert want, f"step {number} was skipped"
        assert got.grad_norm is not None
        assert want.grad_norm is not None
        torch.testing.assert_close(
            got.grad_norm, want.grad_norm, msg=lambda m, n=number: f"step {n}: {m}"
        )
        for a, b in zip(scaled.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(
                a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=number: f"step {n}: {m}"
            )
    assert step_scaled.skipped_steps == 0


# -- the sharded reduce-scatter and a rank with no sample ----------------------------------------


@pytest.mark.usefixtures("group_of_one")
def test_the_sharded_reduce_scatter_counts_an_empty_share_as_no_gradient_even_a_nan_one() -> None:
    # A rank's loss over no sample reads nan, and so does its gradient: weighed by 0 it must add
    # zeros to the sum (nan * 0 is nan, which would reach every rank's weights).
    gradient = torch.tensor([math.nan, 1.0, -math.inf, 2.0])
    reduced = torch.full((4,), 7.0)
    group = tdist.group.WORLD
    assert group is not None
    work = WeightedReduceScatter(lambda: 0.0)(reduced, gradient, group, tdist.ReduceOp.SUM)
    if work is not None:
        work.wait()
    assert torch.equal(reduced, torch.zeros(4)), reduced


@pytest.mark.usefixtures("group_of_one")
def test_the_sharded_reduce_scatter_weighs_a_ranks_gradient_by_its_share() -> None:
    gradient = torch.tensor([1.0, -2.0, 4.0, 0.5])
    reduced = torch.empty(4)
    group = tdist.group.WORLD
    assert group is not None
    work = WeightedReduceScatter(lambda: 0.25)(reduced, gradient, group, tdist.ReduceOp.SUM)
    if work is not None:
        work.wait()
    assert torch.equal(reduced, torch.tensor([0.25, -0.5, 1.0, 0.125]))


# -- a save in a process that never used CUDA -----------------------------------------------------


def _cuda_never_started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make this process one on a machine with a GPU that it never used; list CUDA's uses.

    Every torch.cuda function that reads or sets the random streams, or starts CUDA, fails
    (as it would where CUDA cannot start) and is named in the list it returns.
    """
    touched: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            touched.append(name)
            raise RuntimeError(f"torch.cuda.{name} was called: it starts CUDA in this process")

        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in (
        "init",
        "_lazy_init",
        "get_rng_state",
        "get_rng_state_all",
        "set_rng_state",
        "set_rng_state_all",
    ):
        monkeypatch.setattr(torch.cuda, name, refuse(name))
    return touched


def test_a_save_and_its_resume_leave_cuda_alone_in_a_process_that_never_used_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A CPU data-loading or evaluation process on a GPU machine: starting CUDA there to read
    # streams nothing drew from would take a GPU's memory (and fails in a forked worker).
    touched = _cuda_never_started(monkeypatch)
    model = _linear()
    with TrainingState(tmp_path, model=model, asynchronous=False) as state:
        state.step = 1
        state.save()
    assert touched == []
    with TrainingState(tmp_path, model=_linear(), asynchronous=False) as state:
        resumed = state.resume()
    assert resumed is not None
    assert resumed.step == 1
    assert touched == []
