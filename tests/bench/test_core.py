"""gpukit.bench.core: the timers refuse counts they cannot time with."""

from __future__ import annotations

import pytest

from gpukit.bench.core import compare, time_call
from gpukit.errors import InvalidArgumentError


@pytest.mark.parametrize("number", [0, -1, 1.5, True, "3"])
def test_time_call_refuses_a_number_of_calls_it_cannot_average_over(number: object) -> None:
    with pytest.raises(InvalidArgumentError, match="number="):
        time_call(lambda: None, number=number)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value"), [("repeat", 0), ("number", 0), ("warmup", -1), ("repeat", 2.0)]
)
def test_compare_refuses_counts_it_cannot_measure_with(option: str, value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{option}="):
        compare({"a": lambda: None}, **{option: value})  # type: ignore[arg-type]


def test_compare_times_each_candidate() -> None:
    assert set(compare({"a": lambda: None, "b": lambda: None}, repeat=3, warmup=0)) == {"a", "b"}
    assert time_call(lambda: None, number=2) >= 0
