"""Sizes: one reader and one writer, in units that show them, and no silent bytes."""

from __future__ import annotations

import warnings

import pytest

from gpukit.cli._output import human_bytes
from gpukit.gpus.inventory import GPU, Inventory
from gpukit.gpus.select import Criteria, assess, format_size, parse_size, pick


@pytest.mark.parametrize(
    ("size", "shown"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (20 * 2**10, "20 KiB"),
        (20 * 2**10 + 512, "20.5 KiB"),
        (3 * 2**29, "1.5 GiB"),
        (60 * 2**30, "60 GiB"),
        (int(41.46 * 2**30), "41.5 GiB"),
        (5 * 2**40, "5 TiB"),
    ],
)
def test_a_size_is_written_in_the_largest_unit_it_fills(size: int, shown: str) -> None:
    assert format_size(size) == shown
    assert human_bytes(size) == shown  # the tables write sizes the same way


def test_a_small_free_memory_is_explained_in_a_unit_that_shows_it() -> None:
    gpu = GPU(index=0, uuid="GPU-a", name="T4", memory_total=2**34, memory_free=512)
    [verdict] = assess(Inventory(gpus=(gpu,)), Criteria.make(min_free="20KiB"), {})
    assert verdict.explain() == "GPU 0: 512 B free < 20 KiB"
    assert Criteria.make(min_free="20KiB").describe() == "at least 20 KiB free"


def test_a_library_size_without_a_unit_is_bytes_and_warns_when_implausibly_small() -> None:
    gpu = GPU(index=0, uuid="GPU-a", name="T4", memory_total=2**34, memory_free=2**34)
    inv = Inventory(gpus=(gpu,))
    with pytest.warns(UserWarning, match="read as 20 B; write '20GiB' if you meant gibibytes"):
        assert [g.index for g in pick(1, min_free=20, inventory=inv, claims={})] == [0]
    assert parse_size(20) == 20  # bytes, as documented, warned or not


@pytest.mark.parametrize("size", ["20GiB", "20B", 2**30, 0, "0"])
def test_a_size_with_a_unit_or_a_plausible_number_of_bytes_does_not_warn(
    size: int | str,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_size(size)
