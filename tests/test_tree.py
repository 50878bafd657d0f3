"""gk.tree_map and the one walk that every nested-data feature shares."""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukit as gk
from gpukit import _tree
from gpukit.errors import InvalidArgumentError
from tests.helpers.refcycles import cyclic_garbage

Point = namedtuple("Point", ["x", "y"])


class Typed(NamedTuple):
    image: Any
    label: Any


@dataclasses.dataclass
class Sample:
    inputs: Any
    extra: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    inputs: Any


# -- properties ------------------------------------------------------------------------------

_tensors = st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3))
_leaves = st.one_of(_tensors, st.integers(), st.text(max_size=2), st.none(), st.booleans())


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
        st.dictionaries(st.integers(0, 5), inner, max_size=3).map(OrderedDict),
        st.builds(Point, inner, inner),
        st.builds(Typed, inner, inner),
        st.builds(Sample, inner, inner),
        st.builds(FrozenSample, inner),
    )


trees = st.recursive(_leaves, _containers, max_leaves=15)


def _count_tensors(data: Any) -> int:
    """Tensors in ``data``, counted by a walk written here, independently of gpukit's."""
    if isinstance(data, torch.Tensor):
        return 1
    if isinstance(data, dict):
        return sum(_count_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return sum(_count_tensors(v) for v in data)
    if dataclasses.is_dataclass(data):
        return sum(_count_tensors(getattr(data, f.name)) for f in dataclasses.fields(data))
    return 0


def _assert_mapped(original: Any, mapped: Any) -> None:
    """``mapped`` is ``original`` with every tensor t replaced by t + 1, all else identical."""
    assert type(mapped) is type(original)
    if isinstance(original, torch.Tensor):
        assert torch.equal(mapped, original + 1)
    elif isinstance(original, dict):
        assert list(mapped) == list(original)
        for key in original:
            _assert_mapped(original[key], mapped[key])
    elif isinstance(original, (list, tuple)):
        assert len(mapped) == len(original)
        for a, b in zip(original, mapped, strict=True):
            _assert_mapped(a, b)
    elif dataclasses.is_dataclass(original):
        for field in dataclasses.fields(original):
            _assert_mapped(getattr(original, field.name), getattr(mapped, field.name))
    else:
        assert mapped is original


@settings(max_examples=200, deadline=None)
@given(trees)
def test_tree_map_replaces_every_tensor_and_keeps_every_container_type(data: Any) -> None:
    _assert_mapped(data, gk.tree_map(lambda t: t + 1, data))


@settings(max_examples=200, deadline=None)
@given(trees)
def test_tree_map_that_changes_nothing_returns_the_very_same_object(data: Any) -> None:
    assert gk.tree_map(lambda t: t, data) is data


@settings(max_examples=200, deadline=None)
@given(trees)
def test_every_leaf_path_leads_back_to_its_leaf(data: Any) -> None:
    found = list(_tree.leaves_with_paths(data))
    assert len(found) == _count_tensors(data)
    for path, leaf in found:
        node = data
        for key in path:
            node = _tree.child(node, _tree.walk_kind(node), key)
        assert node is leaf


@settings(max_examples=100, deadline=None)
@given(trees)
def test_leaves_are_visited_in_the_order_tree_map_visits_them(data: Any) -> None:
    seen: list[torch.Tensor] = []
    gk.tree_map(lambda t: seen.append(t) or t, data)
    assert [id(t) for t in seen] == [id(t) for _, t in _tree.leaves_with_paths(data)]


# -- examples --------------------------------------------------------------------------------


def test_tree_map_applies_to_the_types_asked_for_and_leaves_the_rest() -> None:
    data = {"n": 2, "flag": "x", "pair": (3, torch.ones(1))}
    out = gk.tree_map(lambda n: n * 10, data, types=int)
    assert out["n"] == 20
    assert out["pair"][0] == 30
    assert out["pair"][1] is data["pair"][1]
    assert out["flag"] == "x"


def test_tree_map_hands_a_container_type_to_fn_whole() -> None:
    data = [{"a": 1}, ({"b": 2},)]
    out = gk.tree_map(lambda d: sorted(d), data, types=Mapping)
    assert out == [["a"], (["b"],)]


def test_tree_map_with_a_tuple_of_types_maps_each() -> None:
    out = gk.tree_map(str, [1, 2.5, "s", None], types=(int, float))
    assert out == ["1", "2.5", "s", None]


def test_namedtuples_of_both_kinds_are_rebuilt_as_themselves() -> None:
    out = gk.tree_map(lambda t: t * 2, [Point(torch.ones(1), 1), Typed(torch.ones(1), "cat")])
    assert type(out[0]) is Point
    assert out[0].x.item() == 2
    assert out[0].y == 1
    assert type(out[1]) is Typed
    assert out[1].image.item() == 2
    assert out[1].label == "cat"


def test_is_namedtuple_tells_namedtuples_from_plain_and_sized_tuples() -> None:
    assert _tree.is_namedtuple(Point(1, 2))
    assert _tree.is_namedtuple(Typed(1, 2))
    assert not _tree.is_namedtuple((1, 2))
    assert not _tree.is_namedtuple(torch.Size([1, 2]))
    assert not _tree.is_namedtuple(Point)  # the class itself is not an instance


def test_defaultdict_keeps_its_factory_and_a_read_only_mapping_its_type() -> None:
    dd: defaultdict[str, Any] = defaultdict(list, {"x": torch.ones(1)})
    out = gk.tree_map(lambda t: t + 1, dd)
    assert type(out) is defaultdict
    assert out.default_factory is list
    proxy = MappingProxyType({"x": torch.ones(1)})
    moved = gk.tree_map(lambda t: t + 1, proxy)
    assert type(moved) is MappingProxyType
    assert moved["x"].item() == 2


class _ModelOutput(OrderedDict[str, Any]):
    """As transformers' ModelOutput behaves: update() refused, keys mirrored as attributes."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("You cannot use ``update`` on a ModelOutput instance.")

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


def test_a_model_output_that_refuses_update_is_rebuilt_key_by_key() -> None:
    # A Hugging Face model's output under prepare(precision="bf16-mixed"), whose float32
    # cast of the outputs rebuilds it.
    out = _ModelOutput()
    out["logits"] = torch.ones(2)
    out["loss"] = torch.zeros(())
    moved = gk.tree_map(lambda t: t + 1, out)
    assert type(moved) is _ModelOutput
    assert list(moved) == ["logits", "loss"]
    assert torch.equal(moved.logits, torch.full((2,), 2.0))  # the attribute follows its key
    assert torch.equal(moved["loss"], torch.ones(()))
    assert torch.equal(out.logits, torch.ones(2))  # the original is untouched


def test_a_dataclass_copy_recomputes_its_cached_properties() -> None:
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

        @functools.cached_property
        def total(self) -> float:
            return float(self.x.sum())

    batch = Batch(torch.ones(3))
    assert batch.total == 3.0  # computed and cached before the map
    doubled = gk.tree_map(lambda t: t * 2, batch)
    assert doubled.total == 6.0
    assert batch.total == 3.0


def test_a_dict_that_contains_itself_is_a_typed_error_naming_where() -> None:
    data: dict[str, Any] = {"x": torch.ones(1), "inner": [1]}
    data["inner"].append(data)
    with pytest.raises(
        InvalidArgumentError, match=r"data\['inner'\]\[1\] is the same container as data"
    ):
        gk.tree_map(lambda t: t + 1, data)


def test_a_list_that_contains_itself_is_found_by_the_path_walk_too() -> None:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    with pytest.raises(InvalidArgumentError, match="contains itself"):
        list(_tree.leaves_with_paths(loop))


def test_the_same_container_twice_side_by_side_is_not_a_cycle() -> None:
    shared = [torch.ones(1)]
    out = gk.tree_map(lambda t: t + 1, {"a": shared, "b": shared})
    assert out["a"][0].item() == 2
    assert out["b"][0].item() == 2
    assert len(list(_tree.leaves_with_paths({"a": shared, "b": shared}))) == 2


def test_a_recursion_error_from_fn_itself_is_not_mistaken_for_a_cycle() -> None:
    def recurse(t: torch.Tensor) -> torch.Tensor:
        return recurse(t)

    with pytest.raises(RecursionError):
        gk.tree_map(recurse, [torch.ones(1)])


@pytest.mark.parametrize("fn", [lambda t: t, lambda t: t + 1], ids=["no-op", "changing"])
def test_tree_map_leaves_no_reference_cycles_behind(fn: Any) -> None:
    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), "id"), "s": Sample(torch.ones(1), 0)}
    assert cyclic_garbage(lambda: gk.tree_map(fn, batch)) == 0
    assert (
        cyclic_garbage(lambda: _tree.map_with_paths(batch, lambda _, t: fn(t), torch.Tensor)) == 0
    )


def test_tree_map_refuses_a_non_callable_fn_and_a_non_type() -> None:
    with pytest.raises(InvalidArgumentError, match="not callable"):
        gk.tree_map({"x": 1}, lambda t: t)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="types="):
        gk.tree_map(lambda t: t, [1], types="int")  # type: ignore[arg-type]


def test_format_path_shows_keys_positions_and_fields() -> None:
    assert _tree.format_path(("x", 0, "ids")) == "inputs['x'][0]['ids']"
    assert _tree.format_path((), "out") == "out"
    data = {"pair": Point(Sample([1]), 2)}
    assert _tree.format_path(("pair", "x", "inputs", 0), "batch", data) == (
        "batch['pair'].x.inputs[0]"
    )
