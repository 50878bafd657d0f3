"""gather puts every output on the target device, whatever device each replica's output is on.

The ``meta`` device stands in for a second device: a tensor moved there changes ``.device``, and a
result left on the CPU would show.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from gpukit.parallel import gather

from ._structures import Frozen, Pair

META = torch.device("meta")


def test_gather_moves_concatenated_outputs_to_the_target_device() -> None:
    out = gather([torch.zeros(2, 3), torch.ones(1, 3)], META)
    assert out.device == META
    assert out.shape == (3, 3)


def test_gather_moves_stacked_per_replica_losses_to_the_target_device() -> None:
    out = gather([torch.tensor(1.0), torch.tensor(2.0)], META)
    assert out.device == META
    assert out.shape == (2,)


def test_gather_of_a_single_replica_still_moves_its_output() -> None:
    out = gather([torch.zeros(4, 2)], META)
    assert out.device == META
    assert out.shape == (4, 2)


def test_gather_combines_outputs_from_different_devices_on_the_target() -> None:
    on_target, elsewhere = torch.zeros(2, 3, device=META), torch.ones(1, 3)
    out = gather([on_target, elsewhere], META)
    assert out.device == META
    assert out.shape == (3, 3)
    assert elsewhere.device.type == "cpu"  # the input itself is left where it was


def test_gather_moves_every_tensor_of_a_nested_output() -> None:
    outputs = [
        OrderedDict(
            logits=torch.zeros(2, 5),
            aux=Pair(torch.tensor(0.5), [torch.zeros(2), None]),
            frozen=Frozen(torch.zeros(2, 1), "tag"),
        )
        for _ in range(3)
    ]
    out = gather(outputs, META)
    assert out["logits"].device == META
    assert out["logits"].shape == (6, 5)
    assert out["aux"].left.device == META
    assert out["aux"].left.shape == (3,)
    assert out["aux"].right[0].device == META
    assert out["aux"].right[1] is None
    assert out["frozen"].value.device == META
    assert out["frozen"].tag == ["tag", "tag", "tag"]


def test_gather_to_the_cpu_gives_a_new_tensor_not_a_view_of_a_replicas_output() -> None:
    first, second = torch.zeros(2), torch.zeros(2)
    out = gather([first, second], "cpu")
    out.add_(1.0)
    assert first.tolist() == [0.0, 0.0]
    assert second.tolist() == [0.0, 0.0]


def test_gradients_flow_back_to_each_replicas_output_through_the_gather() -> None:
    first = torch.zeros(2, requires_grad=True)
    second = torch.zeros(1, requires_grad=True)
    out = gather([first, second], "cpu")
    (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert first.grad is not None
    assert second.grad is not None
    assert first.grad.tolist() == [1.0, 2.0]
    assert second.grad.tolist() == [3.0]
