"""gk.to_device over nested structures."""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gpukit as gk
from gpukit.errors import DeviceError, InvalidArgumentError
from tests.helpers import needs_gpus
from tests.helpers.refcycles import cyclic_garbage

META = torch.device("meta")
Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    labels: list[torch.Tensor]
    name: str = "batch"


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor
    cached: int = dataclasses.field(default=0, init=False)


class Movable:
    """A user type that knows how to move itself."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: torch.device, non_blocking: bool = False) -> Movable:
        return Movable(self.t.to(device, non_blocking=non_blocking))


def test_tensor_is_moved() -> None:
    assert gk.to_device(torch.ones(2), META).device == META


def test_tensor_already_there_is_the_same_object() -> None:
    t = torch.ones(2)
    assert gk.to_device(t, "cpu") is t


def test_container_with_nothing_to_move_is_the_same_object() -> None:
    batch = {"x": torch.ones(1), "y": [torch.zeros(1), "label", 3]}
    assert gk.to_device(batch, "cpu") is batch


def test_dict_keeps_its_type_order_and_leaves() -> None:
    batch = OrderedDict([("b", torch.ones(1)), ("a", "text"), ("c", None)])
    moved = gk.to_device(batch, META)
    assert type(moved) is OrderedDict
    assert list(moved) == ["b", "a", "c"]
    assert moved["b"].device == META
    assert moved["a"] == "text"
    assert moved["c"] is None


def test_defaultdict_keeps_its_default_factory() -> None:
    batch: defaultdict[str, list[Any]] = defaultdict(list, {"x": torch.ones(1)})
    moved = gk.to_device(batch, META)
    assert type(moved) is defaultdict
    assert moved.default_factory is list
    assert moved["missing"] == []


def test_namedtuple_is_rebuilt_as_itself() -> None:
    moved = gk.to_device(Point(torch.ones(1), 2), META)
    assert type(moved) is Point
    assert moved.x.device == META
    assert moved.y == 2


def test_dataclass_is_rebuilt_with_moved_fields() -> None:
    batch = Batch(torch.ones(2), [torch.zeros(1)])
    moved = gk.to_device(batch, META)
    assert type(moved) is Batch
    assert moved is not batch
    assert moved.inputs.device == META
    assert moved.labels[0].device == META
    assert moved.name == "batch"
    assert batch.inputs.device.type == "cpu"  # the original is untouched


def test_frozen_dataclass_with_non_init_field_is_moved() -> None:
    moved = gk.to_device(Frozen(torch.ones(1)), META)
    assert moved.value.device == META
    assert moved.cached == 0


def test_object_with_a_to_method_is_moved_by_it() -> None:
    moved = gk.to_device([Movable(torch.ones(1))], META)
    assert moved[0].t.device == META


def test_module_is_moved_in_place_and_returned() -> None:
    model = nn.Linear(2, 2)
    moved = gk.to_device(model, META)
    assert moved is model
    assert model.weight.device == META


def test_skip_by_key_name_leaves_those_values_at_any_depth() -> None:
    labels = torch.ones(1)
    batch = {"x": torch.ones(1), "inner": {"labels": labels}}
    moved = gk.to_device(batch, META, skip=["labels"])
    assert moved["x"].device == META
    assert moved["inner"]["labels"] is labels


def test_skip_by_dotted_path_leaves_only_that_value() -> None:
    keep = torch.ones(1)
    batch = {"a": {"ids": keep}, "b": {"ids": torch.ones(1)}}
    moved = gk.to_device(batch, META, skip=["a.ids"])
    assert moved["a"]["ids"] is keep
    assert moved["b"]["ids"].device == META


def test_skip_by_tuple_path_reaches_into_lists() -> None:
    keep = torch.ones(1)
    moved = gk.to_device({"xs": [torch.ones(1), keep]}, META, skip=[("xs", 1)])
    assert moved["xs"][0].device == META
    assert moved["xs"][1] is keep


def test_bad_skip_entry_is_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="skip entry"):
        gk.to_device({}, "cpu", skip=[1.5])


@pytest.mark.parametrize("value", ["yes", 1, 0, None])
def test_non_blocking_that_is_not_a_bool_or_auto_is_rejected(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match="non_blocking"):
        gk.to_device({}, "cpu", non_blocking=value)  # type: ignore[arg-type]


def test_bad_device_is_a_device_error() -> None:
    with pytest.raises(DeviceError):
        gk.to_device(torch.ones(1), "gpu")


def test_pin_is_ignored_for_a_cpu_target() -> None:
    t = torch.ones(1)
    assert gk.to_device(t, "cpu", pin=True) is t


@needs_gpus(1)
def test_pin_pins_host_tensors_and_copies_without_blocking() -> None:
    moved = gk.to_device({"x": torch.ones(1024)}, "cuda", pin=True)
    torch.cuda.synchronize()
    assert moved["x"].device.type == "cuda"
    assert moved["x"].sum().item() == 1024


# -- properties --------------------------------------------------------------------------------

_leaves = st.one_of(
    st.integers(),
    st.text(max_size=3),
    st.none(),
    st.floats(allow_nan=False),
    st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 4)),
)


def _nested(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), children, max_size=3),
        st.dictionaries(st.text(max_size=2), children, max_size=3).map(OrderedDict),
        st.tuples(children, children).map(lambda xy: Point(*xy)),
        st.tuples(children, st.lists(children, max_size=2)).map(lambda p: Batch(*p)),
    )


structures = st.recursive(_leaves, _nested, max_leaves=12)


def _assert_same_shape(original: Any, moved: Any, device: torch.device) -> None:
    assert type(moved) is type(original)
    if isinstance(original, torch.Tensor):
        assert moved.device == device
        assert moved.shape == original.shape
        if device.type != "meta":
            assert torch.equal(moved, original)
    elif isinstance(original, dict):
        assert list(moved) == list(original)
        for key in original:
            _assert_same_shape(original[key], moved[key], device)
    elif isinstance(original, (list, tuple)):
        assert len(moved) == len(original)
        for a, b in zip(original, moved, strict=True):
            _assert_same_shape(a, b, device)
    elif dataclasses.is_dataclass(original):
        for field in dataclasses.fields(original):
            _assert_same_shape(getattr(original, field.name), getattr(moved, field.name), device)
    else:
        assert moved is original  # untouched leaves keep their identity


@settings(max_examples=150, deadline=None)
@given(structures)
def test_moving_preserves_structure_types_values_and_leaf_identity(data: Any) -> None:
    _assert_same_shape(data, gk.to_device(data, META), META)


@settings(max_examples=150, deadline=None)
@given(structures)
def test_moving_to_the_current_device_returns_the_same_object(data: Any) -> None:
    assert gk.to_device(data, "cpu") is data


# -- data never lost, bad input typed ------------------------------------------------------------


class MovesInPlace:
    """A user type whose .to() moves its tensor in place and, wrongly, returns None."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: torch.device, non_blocking: bool = False) -> None:
        self.t = self.t.to(device)


def test_object_whose_to_returns_none_is_kept_not_replaced_by_none() -> None:
    obj = MovesInPlace(torch.ones(1))
    moved = gk.to_device({"obj": obj}, META)
    assert moved["obj"] is obj
    assert obj.t.device == META


def test_copied_dataclass_drops_cached_values_computed_on_the_old_device() -> None:
    @dataclasses.dataclass
    class WithCache:
        x: torch.Tensor

        @functools.cached_property
        def doubled(self) -> torch.Tensor:
            return self.x * 2

    batch = WithCache(torch.ones(2))
    assert batch.doubled.device.type == "cpu"
    moved = gk.to_device(batch, META)
    assert moved.doubled.device == META


def test_a_batch_that_contains_itself_is_a_typed_error_not_a_recursion_error() -> None:
    batch: dict[str, Any] = {"x": torch.ones(1)}
    batch["self"] = batch
    with pytest.raises(InvalidArgumentError, match=r"data\['self'\] is the same container"):
        gk.to_device(batch, META)
    with pytest.raises(InvalidArgumentError, match="contains itself"):
        gk.to_device(batch, META, skip=["labels"])


@pytest.mark.parametrize("skip", [(), ("labels",)], ids=["plain", "with skip"])
def test_to_device_leaves_no_reference_cycles_behind(skip: tuple[str, ...]) -> None:
    batch = {"x": torch.ones(2), "labels": [torch.zeros(1)], "pair": Point(torch.ones(1), 2)}
    assert cyclic_garbage(lambda: gk.to_device(batch, "cpu", skip=skip)) == 0
    assert cyclic_garbage(lambda: gk.to_device(batch, META, skip=skip)) == 0


@pytest.mark.parametrize("skip", [5.5, None, object()])
def test_skip_that_is_no_key_or_collection_of_keys_is_a_typed_error(skip: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="skip="):
        gk.to_device({"x": torch.ones(1)}, META, skip=skip)


def test_skip_of_one_int_key_leaves_that_position() -> None:
    keep = torch.ones(1)
    moved = gk.to_device([torch.ones(1), keep], META, skip=1)  # type: ignore[arg-type]
    assert moved[0].device == META
    assert moved[1] is keep


def test_pin_that_is_not_a_bool_is_a_typed_error() -> None:
    with pytest.raises(InvalidArgumentError, match="pin="):
        gk.to_device(torch.ones(1), "cpu", pin="no")  # type: ignore[arg-type]
