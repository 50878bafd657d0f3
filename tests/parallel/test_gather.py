from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukit.errors import GatherError, InvalidArgumentError
from gpukit.parallel import gather, scatter
from gpukit.parallel.gather import gather_on

from ._structures import Frozen, Pair, batches, map_tensors_and_leaves, same_structure


@dataclass
class Output:
    logits: torch.Tensor
    count: int


def test_gather_concatenates_tensors_along_dim() -> None:
    out = gather([torch.zeros(2, 3), torch.ones(1, 3)], "cpu")
    assert torch.equal(out, torch.tensor([[0.0] * 3, [0.0] * 3, [1.0] * 3]))


def test_gather_concatenates_along_another_dim() -> None:
    out = gather([torch.zeros(3, 2), torch.zeros(3, 1)], "cpu", dim=1)
    assert out.shape == (3, 3)


def test_gather_stacks_zero_dim_losses_into_a_vector() -> None:
    out = gather([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)], "cpu")
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0]))


def test_gather_returns_non_tensor_leaves_as_lists() -> None:
    out = gather([{"n": 2, "name": "a"}, {"n": 1, "name": "b"}], "cpu")
    assert out == {"n": [2, 1], "name": ["a", "b"]}


def test_gather_keeps_none_as_none() -> None:
    assert gather([(torch.zeros(1), None), (torch.zeros(1), None)], "cpu")[1] is None


def test_gather_rebuilds_namedtuples_and_dataclasses() -> None:
    out = gather(
        [
            Pair(torch.zeros(1), Output(torch.zeros(1, 4), 1)),
            Pair(torch.zeros(2), Output(torch.zeros(2, 4), 2)),
        ],
        "cpu",
    )
    assert isinstance(out, Pair)
    assert isinstance(out.right, Output)
    assert out.right.logits.shape == (3, 4)
    assert out.right.count == [1, 2]


def test_gather_keeps_ordered_dicts_in_order() -> None:
    outs = [OrderedDict(b=torch.zeros(1), a=torch.zeros(1)) for _ in range(2)]
    out = gather(outs, "cpu")
    assert type(out) is OrderedDict
    assert list(out) == ["b", "a"]


def test_gather_names_the_path_when_keys_disagree() -> None:
    with pytest.raises(GatherError, match=r"outputs\['aux'\]"):
        gather([{"aux": {"x": 1}}, {"aux": {"y": 1}}], "cpu")


def test_gather_names_the_shapes_when_tensors_cannot_be_concatenated() -> None:
    with pytest.raises(GatherError, match=r"\[\(2, 3\), \(2, 4\)\]"):
        gather([torch.zeros(2, 3), torch.zeros(2, 4)], "cpu")


def test_gather_rejects_a_tensor_missing_from_some_outputs() -> None:
    with pytest.raises(GatherError, match="tensor"):
        gather([[torch.zeros(1)], [None]], "cpu")


def test_gather_rejects_an_empty_list_of_outputs() -> None:
    with pytest.raises(InvalidArgumentError):
        gather([], "cpu")


def test_gather_lets_gradients_flow_back_to_every_replica_output() -> None:
    parts = [torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)]
    (gather(parts, "cpu") * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert parts[0].grad is not None
    assert parts[1].grad is not None
    assert torch.equal(parts[0].grad, torch.tensor([1.0, 2.0]))
    assert torch.equal(parts[1].grad, torch.tensor([3.0]))


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 11), devices=st.integers(1, 5), data=st.data())
def test_gather_undoes_scatter_for_any_batch_of_tensors(
    size: int, devices: int, data: st.DataObject
) -> None:
    batch = data.draw(batches(size, leaves=False))
    assert same_structure(gather(scatter(batch, ["cpu"] * devices), "cpu"), batch)


@settings(max_examples=25, deadline=None)
@given(size=st.integers(1, 11), devices=st.integers(1, 5), data=st.data())
def test_gather_accepts_every_structure_scatter_accepts(
    size: int, devices: int, data: st.DataObject
) -> None:
    batch = data.draw(batches(size))
    parts = scatter(batch, ["cpu"] * devices)
    expected = map_tensors_and_leaves(batch, replicas=len(parts))
    assert same_structure(gather(parts, "cpu"), expected)


def test_gather_of_a_frozen_dataclass_keeps_it_frozen() -> None:
    out = gather([Frozen(torch.zeros(1), "a"), Frozen(torch.zeros(1), "b")], "cpu")
    assert isinstance(out, Frozen)
    assert out.tag == ["a", "b"]


# -- what the user reads when outputs cannot be combined, and the exact edge cases ---------------


@pytest.mark.parametrize(
    ("outputs", "message", "hint"),
    [
        (
            [{"a": 1}, {"a": "x"}],
            "gather found different types at outputs['a']: int, str.",
            "Make the module return the same structure for every chunk of the batch.",
        ),
        (
            [None, 1],
            "gather found different types at outputs: NoneType, int.",
            "Make the module return the same structure for every chunk of the batch.",
        ),
        (
            [[torch.zeros(1)], [None]],
            "gather found a tensor at outputs[0] in some replica outputs but not in others.",
            "Make the module return a tensor there for every chunk of the batch.",
        ),
        (
            [{"aux": {"x": 1}}, {"aux": {"y": 1, "x": 2}}],
            "gather found dicts with different keys at outputs['aux']: ['x'] and ['x', 'y'].",
            "Make the module return the same keys for every chunk of the batch.",
        ),
        (
            [(1, 2), (1, 2), (1,)],
            "gather found tuples of lengths [1, 2] at outputs.",
            "Make the module return sequences of one length for every chunk.",
        ),
        (
            [torch.zeros(2, 3), torch.zeros(2, 4)],
            "gather cannot concatenate outputs along dim 0: the replicas returned shapes "
            "[(2, 3), (2, 4)].",
            "Outputs must agree in every dimension but the gather dim; return 0-dim tensors for "
            "per-replica scalars.",
        ),
        (
            [torch.tensor(1.0), torch.zeros(2)],
            "gather cannot concatenate outputs along dim 0: the replicas returned shapes "
            "[(), (2,)].",
            "Outputs must agree in every dimension but the gather dim; return 0-dim tensors for "
            "per-replica scalars.",
        ),
        ([], "gather was given no outputs.", "Pass one output per replica that ran."),
    ],
    ids=["types", "none", "tensor", "keys", "lengths", "shapes", "scalar", "empty"],
)
def test_outputs_that_cannot_be_combined_are_refused_naming_where_and_what_to_change(
    outputs: list[object], message: str, hint: str
) -> None:
    with pytest.raises((GatherError, InvalidArgumentError)) as caught:
        gather(outputs, "cpu")
    assert (caught.value.message, caught.value.hint) == (message, hint)  # type: ignore[union-attr]


def test_gather_along_a_dim_the_outputs_lack_names_it() -> None:
    with pytest.raises(GatherError) as caught:
        gather([torch.zeros(2), torch.zeros(2)], "cpu", dim=1)
    assert caught.value.message == (
        "gather cannot concatenate outputs along dim 1: the replicas returned shapes [(2,), (2,)]."
    )


def test_gather_of_one_replica_gives_its_output_and_its_loss_as_a_vector() -> None:
    out = gather([{"y": torch.tensor([[1.0, 2.0]]), "loss": torch.tensor(3.0), "n": 4}], "cpu")
    assert out["y"].tolist() == [[1.0, 2.0]]
    assert out["loss"].tolist() == [3.0]
    assert out["n"] == [4]
    assert gather([None, None, None], "cpu") is None


def test_gather_concatenates_along_a_dim_counted_from_the_end() -> None:
    out = gather([torch.tensor([[1], [2]]), torch.tensor([[3], [4]])], "cpu", dim=-1)
    assert out.tolist() == [[1, 3], [2, 4]]


def test_gather_on_a_parsed_device_concatenates_along_dim_0_by_default() -> None:
    out = gather_on([torch.tensor([[1, 2]]), torch.tensor([[3, 4]])], torch.device("cpu"))
    assert out.tolist() == [[1, 2], [3, 4]]
