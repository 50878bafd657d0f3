"""Key cleaning: wrapper prefixes disappear, real module names stay."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gpukit as gk
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
