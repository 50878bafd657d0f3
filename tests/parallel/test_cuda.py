"""The CUDA fast path of data parallel: comm collectives on distinct GPUs, the plain path elsewhere.

The tests marked ``gpu`` run where CUDA devices exist; the others check, on any machine, that
the fast path is only taken where it applies.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.parallel import _cuda, replicate, scatter
from tests.helpers import needs_gpus


def _cuda_devices(*indices: int) -> list[torch.device]:
    return [torch.device("cuda", i) for i in indices]


def test_the_fast_path_applies_to_distinct_cuda_devices_only() -> None:
    assert _cuda.cuda_indices(_cuda_devices(0, 1, 3)) == [0, 1, 3]
    assert _cuda.cuda_indices(_cuda_devices(0, 0)) is None  # a repeated GPU
    assert _cuda.cuda_indices([torch.device("cpu")] * 2) is None
    assert _cuda.cuda_indices([torch.device("cuda", 0), torch.device("cpu")]) is None
    assert _cuda.cuda_indices([]) is None


def _refuse(*_: Any, **__: Any) -> Any:
    raise AssertionError("the CUDA fast path was taken")


def test_cpu_replicas_never_take_the_cuda_path(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("broadcast", "scatter", "gather"):
        monkeypatch.setattr(_cuda, name, _refuse)
    net = gk.DataParallel(nn.Linear(3, 2), device_ids=["cpu"] * 3)
    net(torch.randn(7, 3)).sum().backward()
    assert net.module.weight.grad is not None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
        self.head = nn.Linear(3, 3)
        self.register_buffer("offset", torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        y = (self.head(self.body(x)) + self.offset) * scale[:, None]
        return {"y": y, "loss": y.pow(2).mean()}


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    real: Callable[..., Any] = getattr(_cuda, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_cuda, name, counted)
    return calls


@needs_gpus(2)
def test_data_parallel_on_two_gpus_moves_with_comm_and_matches_the_plain_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broadcasts = _spy(monkeypatch, "broadcast")
    scatters = _spy(monkeypatch, "scatter")
    gathers = _spy(monkeypatch, "gather")
    torch.manual_seed(0)
    plain = _Net().cuda(0)
    wrapped = gk.DataParallel(copy.deepcopy(plain), device_ids=[0, 1])
    x, scale = torch.randn(10, 5), torch.rand(10)  # on the host: scattered from there
    got = wrapped(x, scale=scale)
    want = plain(x.cuda(0), scale=scale.cuda(0))
    torch.testing.assert_close(got["y"], want["y"])
    assert got["y"].device == torch.device("cuda", 0)
    got["y"].pow(2).mean().backward()
    want["y"].pow(2).mean().backward()
    for a, b in zip(wrapped.module.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(a.grad, b.grad)
    assert broadcasts == [1]  # all parameters and buffers in one coalesced call
    assert len(scatters) == 2  # one per input tensor, not one per tensor per device
    assert gathers  # the output was gathered by comm


@needs_gpus(2)
def test_broadcast_copies_are_differentiable_only_where_gradients_are_needed() -> None:
    weight = torch.ones(3, device="cuda:0", requires_grad=True)
    stats = torch.zeros(3, device="cuda:0")
    copies = _cuda.broadcast([weight, stats], 0, [1])
    assert copies is not None
    w1, s1 = copies[0]
    assert w1.device == torch.device("cuda", 1)
    assert w1.requires_grad
    assert not s1.requires_grad
    w1.sum().backward()
    assert weight.grad is not None
    torch.testing.assert_close(weight.grad, torch.ones(3, device="cuda:0"))


@needs_gpus(2)
def test_replicas_on_two_gpus_keep_tied_weights_tied() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).cuda(0)
    net[1].weight = net[0].weight
    (replica,) = replicate(net, ["cuda:1"])
    assert replica[0].weight is replica[1].weight
    assert replica[0].weight.device == torch.device("cuda", 1)


@needs_gpus(1)
def test_scatter_from_the_host_to_one_gpu_gives_the_tensor_there() -> None:
    t = torch.arange(6.0).reshape(3, 2)
    (part,) = _cuda.scatter(t, [0], [3], 0)
    assert part.device == torch.device("cuda", 0)
    torch.testing.assert_close(part.cpu(), t)


@needs_gpus(1)
def test_a_repeated_gpu_keeps_the_plain_path_and_the_same_answers() -> None:
    x = torch.randn(6, 4)
    parts = scatter(x, ["cuda:0", "cuda:0"])
    assert [p.device for p in parts] == [torch.device("cuda", 0)] * 2
    torch.testing.assert_close(torch.cat(parts).cpu(), x)


@needs_gpus(2)
def test_gather_on_two_gpus_joins_outputs_and_names_shapes_that_do_not_fit() -> None:
    from gpukit.errors import GatherError
    from gpukit.parallel import gather

    a, b = torch.ones(2, 3, device="cuda:0"), torch.zeros(1, 3, device="cuda:1")
    joined = gather([{"y": a}, {"y": b}], "cuda:0")["y"]
    assert joined.device == torch.device("cuda", 0)
    torch.testing.assert_close(joined.cpu(), torch.cat([a.cpu(), b.cpu()]))
    with pytest.raises(GatherError, match=r"shapes \[\(2, 3\), \(1, 4\)\]"):
        gather([a, torch.zeros(1, 4, device="cuda:1")], "cuda:0")
