"""The training state's saves at their edges: the order of marking, fsyncing and pruning.

What a kill or a power cut between two steps of a save may leave (the newer save marked complete
before any older one is removed, and the run's folder fsynced in between), a marker that does not
name every rank's file, a link named like a save, and two saves at the same step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpukit.checkpoint.digests import digest
from gpukit.errors import CheckpointError
from gpukit.train import TrainingState, saves


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _fill(model: nn.Module, value: float) -> None:
    """Fill the first layer's weights with ``value``: a mark of which save holds them."""
    with torch.no_grad():
        next(model.parameters()).fill_(value)


def _mark(model: nn.Module) -> float:
    """The first weight of ``model``: the mark :func:`_fill` left."""
    return float(next(model.parameters())[0, 0].detach())


def _state(folder: Path, model: nn.Module, **options: Any) -> TrainingState:
    return TrainingState(folder, model=model, asynchronous=False, **options)


def _saved_at(folder: Path, steps: list[int], keep: int = 10) -> list[Path]:
    """Saves at ``steps``, each with the first layer's weights filled with its step."""
    model = _model()
    made = []
    with _state(folder, model, keep=keep) as state:
        for step in steps:
            state.step = step
            _fill(model, step)
            made.append(state.save())
    return made


def _complete(root: Path) -> set[str]:
    """The names of the saves in ``root`` that hold a marker."""
    return {path.name for path in root.iterdir() if (path / saves.MARKER).exists()}


def _resumed(root: Path) -> tuple[Any, float]:
    """What a resume from ``root`` says, and the first weight it loaded."""
    model = _model(seed=3)
    with _state(root, model) as state:
        resumed = state.resume()
    return resumed, _mark(model)


# --- marking, fsyncing, pruning: in that order ---------------------------------------------------


def test_with_keep_1_a_save_killed_at_its_marker_leaves_the_older_save_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (older,) = _saved_at(tmp_path, [5], keep=1)

    def killed(*_: object, **__: object) -> None:  # the process dies as the marker is written
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(saves, "atomic_write", killed)
    model = _model()
    with _state(tmp_path, model, keep=1) as state:
        state.step = 10
        with pytest.raises(CheckpointError):
            state.save()
    monkeypatch.undo()
    assert [path.name for path in tmp_path.iterdir()] == [older.name]
    assert saves.check(older).step == 5
    resumed, weight = _resumed(tmp_path)
    assert resumed is not None
    assert (resumed.step, weight) == (5, 5.0)


def test_the_run_folder_is_fsynced_after_the_marker_and_before_older_saves_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to name what each fsync was given")
    root = tmp_path / "run"
    (older,) = _saved_at(root, [5], keep=1)
    real = os.fsync
    seen: list[set[str]] = []  # at each fsync of the run's folder: its saves that hold a marker

    def fsync(fd: Any) -> None:
        real(fd)
        number = fd if isinstance(fd, int) else fd.fileno()
        if os.readlink(f"/proc/self/fd/{number}") == str(root.resolve()):
            seen.append(_complete(root))

    monkeypatch.setattr(os, "fsync", fsync)
    with _state(root, _model(), keep=1) as state:
        state.step = 10
        newer = state.save()
    monkeypatch.undo()
    assert _complete(root) == {newer.name}  # the older save was pruned: keep=1
    # The new save's folder entry is durable before its only fallback goes.
    assert {older.name, newer.name} in seen, f"fsyncs of the run's folder saw {seen}"


# --- what a save must be to be resumed ---------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2])
def test_a_marker_that_does_not_name_every_ranks_file_is_passed_over_for_the_save_before(
    tmp_path: Path, world: int
) -> None:
    _, newest = _saved_at(tmp_path, [5, 10])
    marker = json.loads((newest / saves.MARKER).read_text())
    last = saves.rank_file(world - 1)
    if last in marker["files"]:  # the last rank's file left on disk, but neither named nor digested
        del marker["files"][last]
        del marker["digests"][last]
    # A sharded part's metadata, so that the marker names as many files as the ranks write.
    (newest / saves.SHARDED).mkdir()
    (newest / saves.SHARDED / ".metadata").write_bytes(b"")
    marker["files"]["sharded/.metadata"] = 0
    marker["digests"]["sharded/.metadata"] = digest(newest / saves.SHARDED / ".metadata")
    marker["world_size"] = world
    (newest / saves.MARKER).write_text(json.dumps(marker))

    resumed, weight = _resumed(tmp_path)
    assert resumed is not None
    assert (resumed.step, weight) == (5, 5.0)
    assert any(newest.name in line and "names other files" in line for line in resumed.passed_over)


def test_a_link_named_like_a_save_folder_is_never_resumed(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _saved_at(root, [5])
    (elsewhere,) = _saved_at(tmp_path / "elsewhere", [99])
    (root / elsewhere.name).symlink_to(elsewhere, target_is_directory=True)
    resumed, weight = _resumed(root)
    assert resumed is not None
    assert (resumed.step, weight) == (5, 5.0)


def test_a_link_named_like_a_save_folder_is_never_pruned_through(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (elsewhere,) = _saved_at(tmp_path / "elsewhere", [99])
    root.mkdir()
    (root / elsewhere.name).symlink_to(elsewhere, target_is_directory=True)
    _saved_at(root, [5, 6], keep=1)
    assert (root / elsewhere.name).is_symlink()
    assert saves.check(elsewhere).step == 99  # its marker and files left as they were
    saves.verify(saves.check(elsewhere))


# --- two saves at the same step ----------------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True])
def test_two_saves_at_the_same_step_are_both_kept_and_the_later_one_is_resumed(
    tmp_path: Path, asynchronous: bool
) -> None:
    model = _model()
    with TrainingState(tmp_path, model=model, asynchronous=asynchronous) as state:
        state.step = 7
        _fill(model, 1.0)
        first = state.save()  # a periodic save
        state.wait()
        _fill(model, 2.0)
        second = state.save()  # preemption's, at the same step
        state.wait()
    assert first != second
    assert _complete(tmp_path) == {first.name, second.name}
    resumed, weight = _resumed(tmp_path)
    assert resumed is not None
    assert (resumed.path, resumed.step, weight) == (second, 7, 2.0)


def test_a_failing_second_save_at_the_same_step_leaves_the_first_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()

    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    with _state(tmp_path, model) as state:
        state.step = 7
        _fill(model, 1.0)
        first = state.save()
        monkeypatch.setattr(torch, "save", full)
        with pytest.raises(CheckpointError):
            state.save()
        monkeypatch.undo()
    assert _complete(tmp_path) == {first.name}
    saves.verify(saves.check(first))
    resumed, weight = _resumed(tmp_path)
    assert resumed is not None
    assert (resumed.path, resumed.step, weight) == (first, 7, 1.0)
