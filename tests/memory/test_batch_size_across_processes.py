"""find_batch_size under torch.distributed: every process returns the smallest size any found.

The test process is rank 0 of a real two-process gloo group (see ``two_processes``); in each
test the other rank runs its own search at the same time, with its own memory limit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import gpukit as gk
import gpukit.memory.batch_size
from gpukit.errors import MemoryProbeError
from tests.helpers.two_processes import OtherRank, two_processes

SETTINGS = {"start": 1, "maximum": 1024}


class Step:
    """A training step that runs out of memory above ``limit`` samples."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, batch_size: int) -> None:
        if batch_size > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried {batch_size} (simulated).")


def _no_collection() -> None:
    """Stands in for the garbage collection after each out-of-memory try (a third of a second
    with torch loaded), which these tests do not look at."""


def search(rank: int, limit: int, settings: dict[str, int]) -> int | str:
    """Rank 1's side: the size its search returns, or the message of the error it raises."""
    gpukit.memory.batch_size._free_between_tries = _no_collection
    try:
        return gk.find_batch_size(Step(limit), **settings)
    except MemoryProbeError as exc:
        return exc.message


@pytest.fixture(scope="module")
def other_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


@pytest.fixture(autouse=True)
def _no_collection_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpukit.memory.batch_size, "_free_between_tries", _no_collection)


@pytest.mark.parametrize(("here", "there"), [(300, 123), (123, 300)])
def test_every_process_returns_the_smallest_size_any_process_found(
    other_rank: OtherRank, here: int, there: int
) -> None:
    other_rank.run(search, there, SETTINGS)
    found_here = gk.find_batch_size(Step(here), **SETTINGS)
    assert (found_here, other_rank.result()) == (123, 123)


def test_a_process_whose_size_was_lowered_logs_its_own_size_and_the_agreed_one(
    other_rank: OtherRank, caplog: pytest.LogCaptureFixture
) -> None:
    other_rank.run(search, 123, SETTINGS)
    with caplog.at_level(logging.INFO, logger="gpukit.memory"):
        gk.find_batch_size(Step(300), **SETTINGS)
    assert other_rank.result() == 123
    assert "batch size 300 here, 123 agreed across processes" in caplog.messages


def test_a_process_whose_size_was_agreed_logs_no_agreement_line(
    other_rank: OtherRank, caplog: pytest.LogCaptureFixture
) -> None:
    other_rank.run(search, 300, SETTINGS)
    with caplog.at_level(logging.INFO, logger="gpukit.memory"):
        gk.find_batch_size(Step(123), **SETTINGS)
    assert other_rank.result() == 123
    assert not any("agreed" in record.getMessage() for record in caplog.records)


def test_when_another_process_fits_nothing_every_process_raises_listing_its_own_tries(
    other_rank: OtherRank,
) -> None:
    other_rank.run(search, 0, {"start": 4, "maximum": 64})
    with pytest.raises(MemoryProbeError) as caught:
        gk.find_batch_size(Step(5), start=4, maximum=64)
    # 4 fits, 8 does not, then the bisection between them: 6 does not, 5 does.
    assert caught.value.message == (
        "No batch size from 1 to 64 fits in memory on every process; "
        "tried 4 (fits), 8 (out of memory), 6 (out of memory), 5 (fits)."
    )
    assert other_rank.result() == (
        "No batch size from 1 to 64 fits in memory; "
        "tried 4 (out of memory), 2 (out of memory), 1 (out of memory)."
    )
