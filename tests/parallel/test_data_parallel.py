from __future__ import annotations

import copy
import gc
import weakref
from collections import OrderedDict

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import DeviceError, GatherError, InvalidArgumentError
from tests.helpers import cuda_devices, needs_gpus
from tests.helpers.refcycles import cyclic_garbage


class _Net(nn.Module):
    """A small MLP whose forward takes a keyword argument that scales its output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, *, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.body(x) * weight.unsqueeze(1) * scale


class _RecordsBatch(nn.Module):
    """Records the batch size each forward call sees."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        return self.linear(x)


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [16, 9, 3])
def test_gradients_equal_those_of_the_plain_module_on_the_whole_batch(
    replicas: int, batch: int
) -> None:
    torch.manual_seed(replicas * 100 + batch)
    plain = _Net()
    wrapped = gk.DataParallel(copy.deepcopy(plain), device_ids=["cpu"] * replicas)
    x, weight = torch.randn(batch, 5), torch.rand(batch)
    plain(x, weight=weight, scale=0.5).pow(2).mean().backward()
    wrapped(x, weight=weight, scale=0.5).pow(2).mean().backward()
    assert len(_grads(wrapped.module)) == 4
    for got, want in zip(_grads(wrapped.module), _grads(plain), strict=True):
        torch.testing.assert_close(got, want)


def test_training_steps_follow_the_plain_module_step_for_step() -> None:
    torch.manual_seed(0)
    plain = _Net()
    wrapped = gk.DataParallel(copy.deepcopy(plain), device_ids=["cpu"] * 3)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, wrapped.module)]
    for _ in range(4):
        x, weight = torch.randn(10, 5), torch.ones(10)
        for model, opt in zip((plain, wrapped), optimizers, strict=True):
            opt.zero_grad()
            model(x, weight=weight).pow(2).mean().backward()
            opt.step()
    for got, want in zip(wrapped.module.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got, want)


def test_each_replica_sees_an_equal_share_of_an_even_batch() -> None:
    net = gk.DataParallel(_RecordsBatch(), device_ids=["cpu"] * 4)
    out = net(torch.randn(16, 2))
    assert sorted(net.module.seen) == [4, 4, 4, 4]
    assert out.shape == (16, 2)


def test_an_uneven_batch_is_split_as_evenly_as_possible() -> None:
    net = gk.DataParallel(_RecordsBatch(), device_ids=["cpu"] * 4)
    out = net(torch.randn(9, 2))
    assert sorted(net.module.seen) == [2, 2, 2, 3]
    assert out.shape == (9, 2)


def test_fewer_samples_than_devices_runs_fewer_replicas() -> None:
    net = gk.DataParallel(_RecordsBatch(), device_ids=["cpu"] * 4)
    assert net(torch.randn(2, 2)).shape == (2, 2)
    assert net.module.seen == [1, 1]


def test_min_chunk_avoids_single_sample_chunks() -> None:
    net = gk.DataParallel(_RecordsBatch(), device_ids=["cpu"] * 4, min_chunk=2)
    net(torch.randn(5, 2))
    assert sorted(net.module.seen) == [2, 3]


def test_outputs_keep_their_order_after_gathering() -> None:
    net = gk.DataParallel(nn.Identity(), device_ids=["cpu"] * 3)
    x = torch.arange(7.0).unsqueeze(1)
    assert torch.equal(net(x), x)


def test_dict_outputs_and_scalar_losses_are_gathered() -> None:
    class Scored(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"y": x * 2, "loss": x.sum()}

    out = gk.DataParallel(Scored(), device_ids=["cpu"] * 2)(torch.ones(4, 1))
    assert out["y"].shape == (4, 1)
    assert torch.equal(out["loss"], torch.tensor([2.0, 2.0]))


def test_replicas_returning_a_dict_and_an_ordered_dict_is_a_gather_error() -> None:
    class Mixed(nn.Module):
        """Returns an OrderedDict for the chunk of one sample and a dict for the others."""

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return OrderedDict(y=x) if len(x) == 1 else {"y": x}

    with pytest.raises(GatherError, match="different types at outputs: OrderedDict, dict"):
        gk.DataParallel(Mixed(), device_ids=["cpu"] * 2)(torch.ones(3, 1))


@pytest.mark.parametrize("batch", [1, 6], ids=["one chunk", "three chunks"])
def test_building_and_a_training_step_leave_no_reference_cycles(batch: int) -> None:
    # PyTorch's own DataParallel test: wrap, run forward, and find nothing for the collector.
    def step() -> None:
        net = gk.DataParallel(
            nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4)), ["cpu"] * 3, min_chunk=2
        )
        net(torch.randn(batch * 2, 1)).sum().backward()
        net(torch.randn(batch * 2, 1)).sum().backward()

    assert cyclic_garbage(step) == 0


def test_module_gives_the_wrapped_module_and_state_dict_keys_carry_its_prefix() -> None:
    inner = _Net()
    net = gk.DataParallel(inner, device_ids=["cpu"] * 2)
    assert net.module is inner
    assert set(net.state_dict()) == {f"module.{k}" for k in inner.state_dict()}


def test_buffer_updates_survive_only_from_the_first_replica() -> None:
    bn = nn.BatchNorm1d(1, momentum=1.0)
    net = gk.DataParallel(bn, device_ids=["cpu"] * 2)
    net(torch.tensor([[0.0], [2.0], [10.0], [20.0]]))
    assert float(bn.running_mean) == pytest.approx(1.0)


def test_eval_mode_under_no_grad_gives_the_plain_modules_output() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    net = gk.DataParallel(inner, device_ids=["cpu"] * 3).eval()
    x = torch.randn(7, 4)
    with torch.no_grad():
        torch.testing.assert_close(net(x), inner(x))


def test_no_autograd_graph_outlives_the_step() -> None:
    activations: list[weakref.ref[torch.Tensor]] = []

    class Remembers(nn.Module):
        """Keeps its last activation on itself, as debugging code sometimes does."""

        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = self.linear(x)
            activations.append(weakref.ref(self.last))
            return self.last

    net = gk.DataParallel(Remembers(), device_ids=["cpu"] * 3)
    net(torch.randn(6, 2)).sum().backward()
    del net.module.last  # the first replica is the module itself, whose state persists
    gc.collect()
    assert len(activations) == 3
    assert all(ref() is None for ref in activations)


def test_module_not_on_the_first_device_is_a_clear_error() -> None:
    with pytest.raises(DeviceError, match=r"device_ids\[0\] \(cpu\).*on meta"):
        gk.DataParallel(nn.Linear(2, 2).to("meta"), device_ids=["cpu"])


def test_module_moved_away_after_wrapping_is_a_clear_error() -> None:
    net = gk.DataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 2)
    net.module.to("meta")
    with pytest.raises(DeviceError, match="found one on meta"):
        net(torch.randn(2, 2))


def test_empty_device_ids_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="empty device_ids"):
        gk.DataParallel(nn.Linear(2, 2), device_ids=[])


def test_default_device_ids_is_the_cpu_without_cuda() -> None:
    if cuda_devices():  # asked as the test runs, like needs_gpus, not while collecting
        pytest.skip("checks the CPU-only default; this machine has CUDA devices")
    assert gk.DataParallel(nn.Linear(2, 2)).device_ids == [torch.device("cpu")]


@needs_gpus(1)
def test_gradients_on_cuda_equal_those_of_the_plain_module() -> None:
    torch.manual_seed(0)
    plain = _Net().cuda()
    count = torch.cuda.device_count()
    ids = list(range(count)) * (2 if count == 1 else 1)
    wrapped = gk.DataParallel(copy.deepcopy(plain), device_ids=ids)
    x, weight = torch.randn(9, 5, device="cuda"), torch.rand(9, device="cuda")
    plain(x, weight=weight).pow(2).mean().backward()
    wrapped(x, weight=weight).pow(2).mean().backward()
    for got, want in zip(_grads(wrapped.module), _grads(plain), strict=True):
        torch.testing.assert_close(got, want)


def test_a_bare_string_for_device_ids_is_refused_with_a_list_hint() -> None:
    from gpukit.errors import DeviceError

    with pytest.raises(DeviceError, match=r"device_ids must be a list"):
        gk.DataParallel(torch.nn.Linear(2, 2), device_ids="cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("module", ["not a module", None, lambda x: x, nn.Linear])
def test_wrapping_something_that_is_not_a_module_is_a_typed_error(module: object) -> None:
    with pytest.raises(InvalidArgumentError, match="DataParallel wraps a module"):
        gk.DataParallel(module, device_ids=["cpu"] * 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "value"), [("dim", "0"), ("dim", 0.5), ("min_chunk", True)])
def test_dim_and_min_chunk_must_be_whole_numbers(name: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{name}={value!r}"):
        gk.DataParallel(nn.Linear(2, 2), device_ids=["cpu"] * 2, **{name: value})  # type: ignore[arg-type]
