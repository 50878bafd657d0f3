"""Rule: the JSON gpukit writes never holds NaN or Infinity."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpukit.output import dumps, json_safe
from gpukit.untrusted import InvalidInput


def test_non_finite_numbers_are_written_as_null() -> None:
    value = {"free": math.nan, "power": [math.inf, -math.inf, 1.5], "n": (1, 2)}
    assert json.loads(dumps(value)) == {"free": None, "power": [None, None, 1.5], "n": [1, 2]}


def test_finite_values_are_unchanged() -> None:
    value = {"a": [1, 2.5, "x", None, True], "b": {"c": -0.0}}
    assert json_safe(value) == value


def test_options_reach_json_dumps() -> None:
    assert dumps({"b": 1, "a": 2}, sort_keys=True) == '{"a": 2, "b": 1}'


def test_a_value_nested_past_reason_is_refused() -> None:
    deep: list[object] = []
    for _ in range(1000):
        deep = [deep]
    with pytest.raises(InvalidInput, match="too deep"):
        dumps(deep)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=20,
)


@given(json_values)
def test_every_document_written_is_strict_json(value: object) -> None:
    text = dumps(value)

    def refuse(name: str) -> object:
        raise AssertionError(f"{name} written")

    json.loads(text, parse_constant=refuse)
