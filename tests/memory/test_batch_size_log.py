"""What find_batch_size logs on the ``gpukit.memory`` logger: one line per try, and for a try
that ran out of memory the first line of its error, which is how a user sees why a size failed.
"""

from __future__ import annotations

import logging

import pytest
import torch

import gpukit as gk
import gpukit.memory.batch_size


@pytest.fixture(autouse=True)
def _no_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    # The collection after each out-of-memory try takes a third of a second with torch loaded,
    # and these tests only read the log.
    monkeypatch.setattr(gpukit.memory.batch_size, "_free_between_tries", lambda: None)


def _logged(caplog: pytest.LogCaptureFixture, error: BaseException, maximum: int) -> list[str]:
    """The log of a search in which every size above 2 fails with ``error``."""

    def step(batch_size: int) -> None:
        if batch_size > 2:
            raise error

    with caplog.at_level(logging.INFO, logger="gpukit.memory"):
        assert gk.find_batch_size(step, start=1, maximum=maximum) == 2
    return [record.getMessage() for record in caplog.records]


def test_each_try_is_logged_with_its_outcome_and_the_first_line_of_its_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nDetails.")
    assert _logged(caplog, error, maximum=4) == [
        "batch size 1: fits",
        "batch size 2: fits",
        "batch size 4: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.)",
        "batch size 3: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.)",
    ]


def test_an_out_of_memory_error_without_a_message_counts_and_is_logged_by_its_type(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _logged(caplog, torch.OutOfMemoryError(), maximum=3) == [
        "batch size 1: fits",
        "batch size 2: fits",
        "batch size 3: out of memory (OutOfMemoryError)",
    ]


def test_a_long_error_message_is_cut_to_200_characters_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    message = "CUDA out of memory. " + "x" * 300
    assert _logged(caplog, torch.OutOfMemoryError(message), maximum=3)[-1] == (
        f"batch size 3: out of memory ({message[:200]})"
    )


def test_a_search_that_never_runs_out_of_memory_says_it_stopped_at_maximum(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tried: list[int] = []
    with caplog.at_level(logging.INFO, logger="gpukit.memory"):
        assert gk.find_batch_size(tried.append, start=1, maximum=6) == 6
    assert tried == [1, 2, 4, 6]  # the step ran, for real, at every size tried
    assert caplog.records[-1].getMessage() == (
        "batch size 6: reached maximum=6 without running out of memory; larger sizes were not tried"
    )
