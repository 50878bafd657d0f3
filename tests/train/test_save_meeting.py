"""Two ranks saving a training state: every rank's digests in the marker, every rank's ``wait()``
returning only once the marker is on disk, a marker that cannot be written failing every rank."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpukit.checkpoint.digests import digest
from gpukit.train import TrainingState, saves
from tests.helpers.two_processes import OtherRank, two_processes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def other_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OtherRank]:
    with two_processes(tmp_path_factory.mktemp("group") / "store") as other:
        yield other


def _both(other: OtherRank, fn: Any, *args: Any) -> tuple[Any, Any]:
    other.run(fn, *args)
    mine = fn(0, *args)
    return mine, other.result()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(64, 64)


def saves_then_sees_the_marker(rank: int, folder: str, count: int) -> list[bool]:
    """Save ``count`` times (asynchronously); after each ``wait()``, is the marker there?"""
    seen = []
    with TrainingState(folder, model=_model(), keep=count) as state:
        for step in range(1, count + 1):
            state.step = step
            made = state.save()
            state.wait()
            seen.append((made / saves.MARKER).exists())
    return seen


def save_with_a_marker_that_fails_on_rank_0(rank: int, folder: str) -> str:
    import gpukit.train.saves as module

    real = module.atomic_write

    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    if rank == 0:
        module.atomic_write = full  # type: ignore[assignment]
    try:
        with TrainingState(folder, model=_model(), asynchronous=False) as state:
            state.step = 1
            try:
                state.save()
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
            return "saved"
    finally:
        module.atomic_write = real


def test_every_rank_returns_from_wait_only_once_the_save_is_marked_complete(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    mine, theirs = _both(other_rank, saves_then_sees_the_marker, str(tmp_path / "run"), 8)
    assert mine == [True] * 8
    assert theirs == [True] * 8


def test_the_marker_holds_every_ranks_digest_computed_where_the_file_was_written(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    _both(other_rank, saves_then_sees_the_marker, str(tmp_path / "run"), 1)
    (save,) = (tmp_path / "run").iterdir()
    marker = json.loads((save / saves.MARKER).read_text())
    assert set(marker["digests"]) == {saves.SHARED, saves.rank_file(0), saves.rank_file(1)}
    for name, value in marker["digests"].items():
        assert value == digest(save / name)


def test_a_marker_that_cannot_be_written_fails_the_save_on_every_rank_and_leaves_nothing(
    other_rank: OtherRank, tmp_path: Path
) -> None:
    folder = tmp_path / "run"
    mine, theirs = _both(other_rank, save_with_a_marker_that_fails_on_rank_0, str(folder))
    assert mine.startswith("CheckpointError: Cannot write the save")
    assert "no space left on the device" in mine
    assert theirs.startswith("CheckpointError: The save")
    assert "failed on another rank" in theirs
    assert os.listdir(folder) == []
