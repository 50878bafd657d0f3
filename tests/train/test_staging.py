"""Staging a state to host memory: an independent copy, the same values, buffers reused."""

from __future__ import annotations

import copy
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpukit.train._staging import Stager

_leaves = st.one_of(
    st.integers(-5, 5),
    st.text(max_size=3),
    st.none(),
    st.lists(st.floats(-1, 1), min_size=1, max_size=4).map(
        lambda v: torch.tensor(v, dtype=torch.float64)
    ),
)
_states = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
    ),
    max_leaves=12,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


@settings(max_examples=80)
@given(_states)
def test_a_staged_state_holds_the_same_values_and_no_memory_of_the_original(state: Any) -> None:
    before = copy.deepcopy(state)
    staged = Stager().stage(state)
    assert _same(staged, state)
    for original in _tensors(state):
        original.add_(1.0)  # the loop goes on at once
    assert _same(staged, before)


def test_the_next_staging_copies_into_the_buffers_of_the_one_before() -> None:
    stager = Stager()
    weights = {"w": torch.ones(1000)}
    first = stager.stage(weights)
    weights["w"].fill_(2.0)
    second = stager.stage(weights)
    assert second["w"].data_ptr() == first["w"].data_ptr()
    assert torch.all(second["w"] == 2.0)


def test_a_tensor_whose_shape_changed_gets_a_new_buffer() -> None:
    stager = Stager()
    first = stager.stage({"w": torch.ones(3)})
    second = stager.stage({"w": torch.ones(4)})
    assert second["w"].shape == (4,)
    assert torch.all(first["w"] == 1.0)
