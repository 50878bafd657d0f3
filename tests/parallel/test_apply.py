from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from gpukit.errors import InvalidArgumentError, ReplicaError
from gpukit.parallel import parallel_apply, replicate


class _Meets(nn.Module):
    """Waits for every other replica inside forward: only finishes if they run at once."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.barrier.wait()
        return x


class _FailsOnNegative(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x < 0).any():
            raise ValueError("negative input")
        return x


def test_parallel_apply_runs_the_replicas_at_the_same_time() -> None:
    barrier = threading.Barrier(3, timeout=10)
    modules = [_Meets(barrier) for _ in range(3)]
    out = parallel_apply(modules, [torch.full((1,), float(i)) for i in range(3)])
    assert [float(t) for t in out] == [0.0, 1.0, 2.0]


def test_parallel_apply_passes_each_replica_its_own_kwargs() -> None:
    def scale(x: torch.Tensor, *, by: float) -> torch.Tensor:
        return x * by

    out = parallel_apply([scale, scale], [torch.ones(1), torch.ones(1)], [{"by": 2.0}, {"by": 3.0}])
    assert [float(t) for t in out] == [2.0, 3.0]


def test_parallel_apply_treats_a_non_tuple_input_as_the_only_argument() -> None:
    out = parallel_apply([len, len], [[1, 2], ([1, 2, 3],)])
    assert out == [2, 3]


def test_parallel_apply_names_the_device_of_a_failing_replica() -> None:
    replicas = replicate(_FailsOnNegative(), ["cpu"] * 2)
    with pytest.raises(ReplicaError, match=r"replica 1 of 2 on cpu raised ValueError"):
        parallel_apply(replicas, [torch.ones(1), -torch.ones(1)])


def test_parallel_apply_keeps_the_original_exception_as_the_cause() -> None:
    with pytest.raises(ReplicaError) as info:
        parallel_apply(
            [_FailsOnNegative()] * 2, [-torch.ones(1), torch.ones(1)], devices=["cpu"] * 2
        )
    assert isinstance(info.value.__cause__, ValueError)


def test_parallel_apply_keeps_the_callers_no_grad_mode_in_every_thread() -> None:
    net = nn.Linear(2, 2)
    with torch.no_grad():
        out = parallel_apply([net] * 3, [torch.ones(1, 2)] * 3)
    assert not any(t.requires_grad for t in out)


def test_parallel_apply_keeps_the_callers_autocast_in_every_thread() -> None:
    net = nn.Linear(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = parallel_apply([net] * 2, [torch.ones(1, 2)] * 2)
    assert [t.dtype for t in out] == [torch.bfloat16, torch.bfloat16]


def test_parallel_apply_rejects_inputs_that_do_not_match_the_replicas() -> None:
    with pytest.raises(InvalidArgumentError, match="2 replicas, 1 inputs"):
        parallel_apply([len, len], [[1]])
