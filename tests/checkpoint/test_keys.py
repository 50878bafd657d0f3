"""Key cleaning: wrapper prefixes disappear, real module names stay."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gpukit as gk
from gpukit.checkpoint.keys import (
    clean_keys,
    find_state_dict,
    is_state_dict,
    match_keys,
    nearest,
    unwrap,
)
from gpukit.errors import InvalidArgumentError

_SEGMENT = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(
    lambda s: s not in {"module", "_orig_mod"}
)
_INNER_WRAPPERS = [
    "_orig_mod",
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
    "_forward_module",
]
_KEYS = st.lists(
    st.lists(_SEGMENT, min_size=1, max_size=4).map(".".join), min_size=1, max_size=12, unique=True
)
_WRAPPERS = st.lists(st.sampled_from(["module.", "_orig_mod."]), max_size=5).map("".join)


@settings(max_examples=40, deadline=None)
@given(keys=_KEYS, stack=_WRAPPERS)
def test_clean_state_dict_removes_any_stacking_of_wrapper_prefixes(keys: list[str], stack: str):
    state = {stack + key: torch.zeros(1) for key in keys}
    assert list(gk.clean_state_dict(state)) == keys


@settings(max_examples=40, deadline=None)
@given(keys=_KEYS, data=st.data())
def test_clean_state_dict_removes_compile_prefix_inside_keys(keys: list[str], data: st.DataObject):
    def compiled_inside(key: str) -> str:
        parts = key.split(".")
        cut = data.draw(st.integers(0, len(parts) - 1))
        return ".".join([*parts[:cut], "_orig_mod", *parts[cut:]])

    state = {compiled_inside(key): torch.zeros(1) for key in keys}
    assert list(gk.clean_state_dict(state)) == keys


@settings(max_examples=40, deadline=None)
@given(keys=_KEYS)
def test_clean_state_dict_keeps_a_real_submodule_named_module(keys: list[str]):
    state = {"module.weight": torch.zeros(1), **{k: torch.zeros(1) for k in keys}}
    assert list(gk.clean_state_dict(state)) == list(state)


def test_clean_state_dict_keeps_the_tensors_themselves():
    weight = torch.ones(3)
    cleaned = gk.clean_state_dict({"module.weight": weight})
    assert cleaned["weight"] is weight


def test_clean_state_dict_renames_torch_module_metadata_like_the_keys():
    model = nn.DataParallel(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    cleaned = gk.clean_state_dict(model.state_dict())
    metadata = cleaned._metadata  # type: ignore[attr-defined]
    assert metadata["1"]["version"] == 2  # BatchNorm's version, under its clean name
    assert not any(key.startswith("module") for key in metadata)


def test_clean_state_dict_refuses_something_that_is_not_a_mapping():
    with pytest.raises(InvalidArgumentError, match="state dict"):
        gk.clean_state_dict([torch.zeros(1)])  # type: ignore[arg-type]


def test_clean_state_dict_returns_an_ordered_dict_in_the_original_order():
    state = OrderedDict([("module.b", torch.zeros(1)), ("module.a", torch.zeros(1))])
    assert list(gk.clean_state_dict(state)) == ["b", "a"]


@settings(max_examples=40, deadline=None)
@given(keys=_KEYS, data=st.data())
def test_wrapper_segments_are_removed_anywhere_in_any_stacking(
    keys: list[str], data: st.DataObject
):
    """FSDP, activation checkpointing (around one block), Fabric and compile, with module."""
    lead = data.draw(st.lists(st.sampled_from([*_INNER_WRAPPERS, "module"]), max_size=4))

    def wrapped(key: str) -> str:
        parts = key.split(".")
        cut = data.draw(st.integers(0, len(parts) - 1))
        inner = data.draw(st.lists(st.sampled_from(_INNER_WRAPPERS), max_size=2))
        return ".".join([*lead, *parts[:cut], *inner, *parts[cut:]])

    state = {wrapped(key): torch.zeros(1) for key in keys}
    assert list(gk.clean_state_dict(state)) == keys


def test_load_report_names_every_wrapper_segment_it_removed(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    state = {
        "_forward_module.module._fsdp_wrapped_module.0._checkpoint_wrapped_module.weight": (
            model[0].weight.detach()
        ),
        "_forward_module.module._fsdp_wrapped_module.0._checkpoint_wrapped_module.bias": (
            model[0].bias.detach()
        ),
        "_forward_module.module._fsdp_wrapped_module.1.weight": model[1].weight.detach(),
        "_forward_module.module._fsdp_wrapped_module.1.bias": model[1].bias.detach(),
    }
    torch.save(state, tmp_path / "wrapped.pt")
    target = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    report = gk.load(target, tmp_path / "wrapped.pt")
    assert sorted(report.prefixes_removed) == sorted(
        ["_forward_module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module."]
    )
    assert torch.equal(target[0].weight, model[0].weight)


# -- exact answers for each rule of finding and matching keys -----------------------------------


def _sd(*keys: str) -> dict[str, torch.Tensor]:
    return {key: torch.zeros(1) for key in keys}


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({}, False),
        ({"w": torch.zeros(1)}, True),
        ({1: torch.zeros(1)}, False),
        ({"w": torch.zeros(1), "step": 3}, False),
        ({"w": torch.zeros(1), "head._extra_state": b"x"}, True),
        ({"head._extra_state": b"x"}, False),
        ([torch.zeros(1)], False),
    ],
    ids=repr,
)
def test_a_state_dict_is_a_mapping_of_names_to_tensors(obj: object, expected: bool) -> None:
    assert is_state_dict(obj) is expected


def test_the_state_dict_is_found_under_the_most_specific_container_key() -> None:
    weights, other = _sd("fc.weight"), _sd("other.weight")
    assert find_state_dict(weights) == (weights, None)
    assert find_state_dict({"model": other, "state_dict": weights}) == (weights, "state_dict")
    assert find_state_dict({"model": "resnet18", "weights": weights}) == (weights, "weights")
    assert find_state_dict({"ema": weights, "epoch": 3}) == (weights, "ema")
    state, key = find_state_dict({"model": nn.DataParallel(nn.Linear(1, 1))})
    assert (sorted(state), key) == (["bias", "weight"], "model")


def test_a_file_without_a_state_dict_is_described() -> None:
    with pytest.raises(LookupError, match=r"^the file holds a list, not a dict of tensors$"):
        find_state_dict([torch.zeros(1)])
    entries = {f"k{i}": i for i in range(13)}
    with pytest.raises(LookupError) as caught:
        find_state_dict(entries)
    shown = ", ".join(f"'k{i}'" for i in range(12))
    assert str(caught.value) == f"no state dict among its entries ({shown})"


def test_unwrap_names_every_wrapper_it_removed_outermost_first() -> None:
    inner = nn.Linear(1, 1)
    assert unwrap(nn.DataParallel(nn.DataParallel(inner))) == (inner, ["DataParallel"] * 2)
    assert unwrap(inner) == (inner, [])


def test_clean_keys_lists_the_prefixes_it_removed_wrappers_first() -> None:
    cleaned, removed = clean_keys(_sd("module._orig_mod.fc.weight", "module._orig_mod.fc.bias"))
    assert list(cleaned) == ["fc.weight", "fc.bias"]
    assert removed == ["_orig_mod.", "module."]
    assert clean_keys(_sd("module.module.w"))[1] == ["module.", "module."]
    assert clean_keys({}) == (OrderedDict(), [])


def test_module_metadata_of_a_wrapper_gives_way_to_the_real_roots() -> None:
    state = OrderedDict(_sd("module.fc.weight"))
    state._metadata = OrderedDict(  # type: ignore[attr-defined]
        [("", {"version": 1}), ("module", {"version": 2}), ("module.fc", {"version": 3})]
    )
    cleaned, _ = clean_keys(state)
    assert cleaned._metadata == {"": {"version": 2}, "fc": {"version": 3}}  # type: ignore[attr-defined]


def test_match_keys_drops_a_framework_attribute_only_when_it_matches_more_keys() -> None:
    found = match_keys(["model.fc.weight", "model.fc.bias"], ["fc.weight", "fc.bias"])
    assert found.mapping == {"model.fc.weight": "fc.weight", "model.fc.bias": "fc.bias"}
    assert (found.prefixes, found.missing, found.unexpected) == (["model."], [], [])
    kept = match_keys(["model.fc.weight"], ["model.fc.weight"])
    assert (kept.mapping, kept.prefixes) == ({"model.fc.weight": "model.fc.weight"}, [])
    # dropping "model." would match no more keys than keeping it: kept
    neither = match_keys(["model.a", "model.b"], ["c"])
    assert (neither.prefixes, neither.missing, neither.unexpected) == (
        [],
        ["c"],
        ["model.a", "model.b"],
    )
    wrapped = match_keys(["model.module.fc.weight"], ["fc.weight"])
    assert (wrapped.mapping, wrapped.prefixes) == (
        {"model.module.fc.weight": "fc.weight"},
        ["model.", "module."],
    )


def test_match_keys_drops_a_module_segment_inside_a_key_only_for_a_key_the_model_lacks() -> None:
    found = match_keys(
        ["enc.module.w", "enc.w", "dec.module.w", "head.w"], ["enc.w", "dec.w", "head.w", "x"]
    )
    assert found.mapping == {"enc.w": "enc.w", "dec.module.w": "dec.w", "head.w": "head.w"}
    assert found.prefixes == [".module."]
    assert found.unexpected == ["enc.module.w"]  # enc.w came from the checkpoint itself
    assert found.missing == ["x"]
    twice = match_keys(["a.module.w", "b.module.w"], ["a.w", "b.w"])
    assert twice.prefixes == [".module."]


def test_nearest_suggests_a_close_name_and_nothing_for_a_distant_one() -> None:
    assert nearest("fc.weigth", ["fc.weight", "conv.bias"]) == "fc.weight"
    assert nearest("embedding", ["fc.weight", "conv.bias"]) is None


def test_a_container_key_without_weights_gives_way_to_the_next_container_key() -> None:
    weights = _sd("fc.weight")
    found = find_state_dict({"state_dict": {"step": 1}, "model": {"net": weights}})
    assert found == (weights, "model")


def test_match_keys_never_strips_first_segments_that_differ_and_keeps_every_segment_dropped() -> (
    None
):
    differ = match_keys(["a.x", "b.y"], ["x", "y"])
    assert (differ.mapping, differ.unexpected) == ({}, ["a.x", "b.y"])
    # each segment dropped matches more keys, and the report names both
    nested = match_keys(["a.b.x", "a.b.y"], ["b.x", "x", "y"])
    assert nested.mapping == {"a.b.x": "x", "a.b.y": "y"}
    assert nested.prefixes == ["a.", "b."]


def test_two_checkpoint_keys_never_fill_the_same_model_key() -> None:
    found = match_keys(["a.module.w", "module.a.w"], ["a.w"])
    assert found.mapping == {"a.module.w": "a.w"}
    assert found.unexpected == ["module.a.w"]
