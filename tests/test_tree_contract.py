"""The walk's promises at its edges: slotted dataclasses, tensor subclasses, key paths, errors."""

from __future__ import annotations

import dataclasses
import functools
from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit import _tree
from gpukit.errors import InvalidArgumentError

Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass(slots=True)
class Slotted:
    inputs: Any
    name: str = "s"


def test_a_dataclass_with_slots_is_rebuilt_with_its_mapped_fields() -> None:
    sample = Slotted(torch.ones(2))
    out = gk.tree_map(lambda t: t + 1, sample)
    assert type(out) is Slotted
    assert out is not sample
    assert out.inputs.tolist() == [2.0, 2.0]
    assert out.name == "s"
    assert sample.inputs.tolist() == [1.0, 1.0]


def test_a_cached_property_never_computed_before_the_map_is_computed_from_the_new_fields() -> None:
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

        @functools.cached_property
        def total(self) -> float:
            return float(self.x.sum())

    doubled = gk.tree_map(lambda t: t * 2, Batch(torch.ones(3)))
    assert doubled.total == 6.0


def test_tree_map_hands_tensor_subclasses_such_as_parameters_to_fn() -> None:
    weight = nn.Parameter(torch.ones(2))
    seen: list[Any] = []

    def triple(t: torch.Tensor) -> torch.Tensor:
        seen.append(t)
        return t.detach() * 3

    out: dict[str, Any] = gk.tree_map(triple, {"w": [weight], "top": weight})
    assert len(seen) == 2
    assert seen[0] is weight
    assert seen[1] is weight
    assert out["w"][0].tolist() == [3.0, 3.0]
    assert out["top"].tolist() == [3.0, 3.0]


def test_tree_map_and_leaves_with_paths_agree_that_a_bool_is_an_int() -> None:
    data = {"flag": True, "n": 2, "name": "x", "ratio": 0.5}
    assert gk.tree_map(lambda n: n * 10, data, types=int) == {
        "flag": 10,
        "n": 20,
        "name": "x",
        "ratio": 0.5,
    }
    assert list(_tree.leaves_with_paths(data, int)) == [(("flag",), True), (("n",), 2)]


def test_map_with_paths_hands_each_leaf_its_key_path_from_the_top() -> None:
    data = {"a": [torch.zeros(1), {"b": torch.zeros(1)}], "p": Point(torch.zeros(1), 3)}
    out = _tree.map_with_paths(data, lambda path, t: path, torch.Tensor)
    assert out == {"a": [("a", 0), {"b": ("a", 1, "b")}], "p": Point(("p", "x"), 3)}


def test_map_with_paths_keeps_what_keep_names_and_everything_under_it() -> None:
    inner = {"b": torch.zeros(1)}
    data = {"a": [torch.zeros(1), inner]}
    out = _tree.map_with_paths(
        data, lambda path, t: t + 1, torch.Tensor, keep=lambda path: path == ("a", 1)
    )
    assert out["a"][0].tolist() == [1.0]
    assert out["a"][1] is inner


def test_map_with_paths_keeps_other_leaves_or_hands_them_to_opaque() -> None:
    thing = object()
    data = {"t": torch.zeros(1), "n": 3, "thing": thing}
    plain = _tree.map_with_paths(data, lambda path, t: t + 1, torch.Tensor)
    assert plain["n"] == 3
    assert plain["thing"] is thing
    seen: list[Any] = []

    def opaque(obj: Any) -> str:
        seen.append(obj)
        return "moved"

    out = _tree.map_with_paths(data, lambda path, t: t + 1, torch.Tensor, opaque=opaque)
    assert out["t"].tolist() == [1.0]
    assert out["n"] == "moved"
    assert out["thing"] == "moved"
    assert seen == [3, thing]


@pytest.mark.parametrize("types", [(), [int, float], (int, "float")], ids=["empty", "list", "str"])
def test_types_must_be_a_type_or_a_non_empty_tuple_of_types(types: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="is neither a type nor a tuple of types"):
        gk.tree_map(lambda n: n, [1, 2.5], types=types)


def test_a_types_that_is_not_a_type_says_what_to_pass() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        gk.tree_map(lambda n: n, [1], types=[int])  # type: ignore[arg-type]
    assert str(caught.value) == (
        "types=[<class 'int'>] is neither a type nor a tuple of types. Pass the leaf type to "
        "map, e.g. types=torch.Tensor or types=(torch.Tensor, int)."
    )


def test_a_fn_that_is_not_callable_says_what_to_pass() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        gk.tree_map([1], lambda t: t)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "tree_map got fn=[1], which is not callable. Pass the function first: "
        "gk.tree_map(fn, data)."
    )


def test_a_structure_that_contains_itself_is_refused_naming_both_places() -> None:
    data: dict[str, Any] = {"x": torch.ones(1), "inner": [1]}
    data["inner"].append(data)
    with pytest.raises(InvalidArgumentError) as caught:
        gk.tree_map(lambda t: t + 1, data)
    assert str(caught.value) == (
        "the structure contains itself: data['inner'][1] is the same container as data, so "
        "walking it would never end. Pass a tree of containers (each dict, list or dataclass "
        "in one place), for example a copy without the back-reference."
    )


def test_a_loop_below_the_top_names_the_container_it_loops_back_to() -> None:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    data = {"batch": {"ids": loop}}
    with pytest.raises(
        InvalidArgumentError,
        match=r"data\['batch'\]\['ids'\]\[1\] is the same container as data\['batch'\]\['ids'\], ",
    ):
        list(_tree.leaves_with_paths(data))
