from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch import nn

from gpukit.errors import InvalidArgumentError
from gpukit.parallel import replicate


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2))


def test_gradients_through_replicas_land_on_the_original_parameters() -> None:
    net = _mlp().eval()
    x = torch.randn(6, 4)
    replicas = replicate(net, ["cpu"] * 3)
    sum(r(chunk).sum() for r, chunk in zip(replicas, x.split(2), strict=True)).backward()
    expected = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    net.zero_grad()
    net(x).sum().backward()
    for got, want in zip(expected, (p.grad for p in net.parameters()), strict=True):
        torch.testing.assert_close(got, want)


def test_replicas_are_copies_not_the_original_module() -> None:
    net = _mlp()
    replicas = replicate(net, ["cpu"] * 2)
    assert len(replicas) == 2
    assert all(r is not net and type(r) is type(net) for r in replicas)


def test_replicas_are_reused_across_calls() -> None:
    net = _mlp()
    first = replicate(net, ["cpu"] * 2)
    assert all(a is b for a, b in zip(first, replicate(net, ["cpu"] * 2), strict=True))


def test_replicas_are_rebuilt_when_a_submodule_is_replaced() -> None:
    net = _mlp()
    first = replicate(net, ["cpu"] * 2)
    net[3] = nn.Linear(8, 5)
    second = replicate(net, ["cpu"] * 2)
    assert second[0] is not first[0]
    assert second[0](torch.zeros(1, 4)).shape == (1, 5)


def test_replicas_are_rebuilt_when_the_devices_change() -> None:
    net = _mlp()
    assert len(replicate(net, ["cpu"] * 2)) == 2
    assert len(replicate(net, ["cpu"] * 3)) == 3


def test_replicas_follow_train_and_eval_of_the_original() -> None:
    net = _mlp()
    replicate(net, ["cpu"])
    net.eval()
    (replica,) = replicate(net, ["cpu"])
    assert not any(m.training for m in replica.modules())
    x = torch.randn(3, 4)
    torch.testing.assert_close(replica(x), net(x))


def test_replicas_see_parameter_updates_made_between_calls() -> None:
    net = _mlp().eval()
    replicate(net, ["cpu"])
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    net[0].bias = nn.Parameter(torch.full((8,), 3.0))  # replaced, not just updated
    (replica,) = replicate(net, ["cpu"])
    x = torch.randn(3, 4)
    torch.testing.assert_close(replica(x), net(x))


def test_replicas_use_the_original_buffers() -> None:
    net = nn.BatchNorm1d(3).eval()
    net.running_mean.fill_(2.0)
    (replica,) = replicate(net, ["cpu"])
    x = torch.randn(4, 3)
    torch.testing.assert_close(replica(x), net(x))


def test_tied_weights_stay_tied_in_replicas() -> None:
    net = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    net[1].weight = net[0].weight
    (replica,) = replicate(net, ["cpu"])
    assert replica[0].weight is replica[1].weight


def test_replicated_lstm_matches_the_original() -> None:
    torch.manual_seed(0)
    net = nn.LSTM(3, 5, batch_first=True)
    (replica,) = replicate(net, ["cpu"])
    x = torch.randn(2, 4, 3)
    torch.testing.assert_close(replica(x)[0], net(x)[0])


def test_each_thread_gets_its_own_replicas() -> None:
    net = _mlp()
    mine = replicate(net, ["cpu"])[0]
    theirs: list[nn.Module] = []
    thread = threading.Thread(target=lambda: theirs.extend(replicate(net, ["cpu"])))
    thread.start()
    thread.join()
    assert theirs[0] is not mine
    assert replicate(net, ["cpu"])[0] is mine


class _Remembers(nn.Module):
    """Stores its last activation on itself, as some debugging code does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = self.linear(x)
        return self.last


def test_replicas_drop_what_forward_stored_at_the_next_call() -> None:
    net = _Remembers()
    (replica,) = replicate(net, ["cpu"])
    activation = weakref.ref(replica(torch.randn(2, 4)))
    replicate(net, ["cpu"])
    gc.collect()
    assert activation() is None


def test_cached_replicas_do_not_keep_the_module_alive() -> None:
    net = _mlp()
    replicate(net, ["cpu"] * 2)
    alive = weakref.ref(net)
    del net
    gc.collect()
    assert alive() is None


def test_replicate_rejects_an_empty_device_list() -> None:
    with pytest.raises(InvalidArgumentError, match="no devices"):
        replicate(_mlp(), [])


def test_buffer_updates_in_a_replica_leave_the_original_alone() -> None:
    net = nn.BatchNorm1d(2)
    (replica,) = replicate(net, ["cpu"])
    replica(torch.full((4, 2), 5.0))
    assert torch.equal(net.running_mean, torch.zeros(2))
