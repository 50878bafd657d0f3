"""Rule: structure read from others is checked by exact type and by value."""

from __future__ import annotations

import math
from pathlib import PurePosixPath

import pytest

from gpukit.untrusted import InvalidInput, as_dict, as_float, as_int, as_list, as_str


class _Lying(str):
    """A str subclass such as an unpickler can build: it prints as one thing, joins as another."""

    def __fspath__(self) -> str:
        return "/etc/shadow"


def test_only_a_real_str_is_a_string() -> None:
    assert as_str("__0_0.distcp") == "__0_0.distcp"
    for value in (_Lying("__0_0.distcp"), PurePosixPath("__0_0.distcp"), b"x", 1, None):
        with pytest.raises(InvalidInput, match="not a string"):
            as_str(value)


def test_a_string_past_its_limit_is_refused() -> None:
    with pytest.raises(InvalidInput, match="longer than 3"):
        as_str("abcd", limit=3, what="a user")


def test_a_bool_is_not_an_integer() -> None:
    assert as_int(7) == 7
    for value in (True, 7.0, "7", None):
        with pytest.raises(InvalidInput, match="not an integer"):
            as_int(value)


@pytest.mark.parametrize("value", [-1, 2**64, 10**340])
def test_integers_out_of_range_are_refused(value: int) -> None:
    with pytest.raises(InvalidInput, match="out of range"):
        as_int(value, low=0, high=2**63 - 1, what="a pid")


def test_a_number_is_finite_and_in_range() -> None:
    assert as_float(3) == 3.0
    assert as_float(0.5, low=0, high=1) == 0.5
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(InvalidInput, match="not finite"):
            as_float(value)
    with pytest.raises(InvalidInput, match="out of range"):
        as_float(10**340, high=1e300)  # compared before float() could overflow
    with pytest.raises(InvalidInput, match="too large"):
        as_float(10**400)  # no bound given: still never an OverflowError
    for value in (True, "1.5", None):
        with pytest.raises(InvalidInput, match="not a number"):
            as_float(value)


def test_lists_and_mappings_are_exact_types_with_bounded_sizes() -> None:
    assert as_list([1, 2]) == [1, 2]
    assert as_dict({"a": 1}) == {"a": 1}
    with pytest.raises(InvalidInput, match="not a list"):
        as_list((1, 2))
    with pytest.raises(InvalidInput, match="more than 2 items"):
        as_list([1, 2, 3], limit=2)
    with pytest.raises(InvalidInput, match="not a mapping"):
        as_dict([("a", 1)])
    with pytest.raises(InvalidInput, match="more than 1 entries"):
        as_dict({"a": 1, "b": 2}, limit=1)
    with pytest.raises(InvalidInput, match="key that is not a string"):
        as_dict({1: "a"})
