"""One save's writing, rank by rank: the sharded part, the ranks' meeting, the marker, the log.

The meeting of two ranks runs here in two threads of this process: the saves' collectives
(``gathered``, ``from_rank_0``) are replaced by an exchange between the threads, through the
group object each rank's save is given, so that every rank's side of a save is seen in one
process. The real two-process meeting is in ``test_save_meeting.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import gpukit.train._sharded_part as sharded_part
import gpukit.train._writing as writing
from gpukit.checkpoint.dcp import open_dcp
from gpukit.errors import CheckpointError
from gpukit.train import saves
from gpukit.train._writing import SaveJob

NAME = saves.save_name(7, "0123456789ab", 0)


class _Meeting:
    """Where the ranks' threads meet: each exchange returns once every rank has given its value.

    ``first`` runs once, when every rank has reached the first exchange (the digests' gather),
    before any is answered: what happens on disk while the ranks wait for each other.
    """

    def __init__(self, world: int, first: Callable[[], None] | None = None) -> None:
        self._values: list[Any] = [None] * world
        self._arrived = threading.Barrier(world, timeout=30)
        self._read = threading.Barrier(world, timeout=30)
        self._first = first

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self._values[rank] = value
        if self._arrived.wait() == 0 and self._first is not None:
            self._first()
            self._first = None
        answer = list(self._values)
        self._read.wait()
        return answer


class _Group:
    """One rank's handle on the meeting: what the save is given as its saves' group."""

    def __init__(self, meeting: _Meeting, rank: int) -> None:
        self.meeting = meeting
        self.rank = rank


def _gathered(value: Any, group: _Group) -> list[Any]:
    return group.meeting.exchange(group.rank, value)


def _from_rank_0(value: Any, group: _Group) -> Any:
    return group.meeting.exchange(group.rank, value)[0]


@pytest.fixture
def meet_in_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writing, "gathered", _gathered)
    monkeypatch.setattr(writing, "from_rank_0", _from_rank_0)


def _job(folder: Path, rank: int, world: int, group: Any = None, **options: Any) -> SaveJob:
    shared = {"step": 7, "weights": torch.arange(6.0)} if rank == 0 else None
    own = {"rank": rank, "noise": torch.full((4,), float(rank))}
    return SaveJob(folder, 7, rank, world, 2, group, shared, own, **options)


def _outcome(future: Future[Path]) -> Path | str:
    """What a rank's save returned, or its error as ``Type: message``."""
    try:
        return future.result(timeout=60)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _two_ranks(folder: Path, meeting: _Meeting) -> tuple[Path | str, Path | str]:
    """Rank 0's and rank 1's save of ``folder``, run at the same time."""
    folder.mkdir(parents=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = [pool.submit(_job(folder, r, 2, _Group(meeting, r)).run) for r in (0, 1)]
        return _outcome(runs[0]), _outcome(runs[1])


def _full_disk_for(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing the save's file ``name`` meets a full disk; the others are written."""
    real = saves.write_part

    def write_part(folder: Path, file: str, write: Any) -> None:
        if file == name:
            raise OSError(28, "No space left on device")
        real(folder, file, write)

    monkeypatch.setattr(saves, "write_part", write_part)


# --- two ranks -------------------------------------------------------------------------------


@pytest.mark.usefixtures("meet_in_threads")
def test_a_save_of_two_ranks_is_marked_complete_naming_both_ranks_files(tmp_path: Path) -> None:
    folder = tmp_path / NAME
    assert _two_ranks(folder, _Meeting(2)) == (folder, folder)
    info = saves.check(folder)
    assert (info.step, info.world_size) == (7, 2)
    assert {saves.SHARED, saves.rank_file(0), saves.rank_file(1)} <= set(info.files)
    saves.verify(info)


@pytest.mark.usefixtures("meet_in_threads")
def test_a_ranks_file_changed_after_that_rank_wrote_it_fails_the_saves_check(
    tmp_path: Path,
) -> None:
    folder = tmp_path / NAME

    def changed_while_the_ranks_meet() -> None:
        path = folder / saves.rank_file(1)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    assert _two_ranks(folder, _Meeting(2, changed_while_the_ranks_meet)) == (folder, folder)
    with pytest.raises(CheckpointError, match=saves.rank_file(1)):
        saves.verify(saves.check(folder))


@pytest.mark.usefixtures("meet_in_threads")
@pytest.mark.parametrize("failing", [0, 1])
def test_a_rank_whose_write_fails_raises_its_error_and_the_other_says_where_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    folder = tmp_path / NAME
    _full_disk_for(saves.rank_file(failing), monkeypatch)
    outcomes = _two_ranks(folder, _Meeting(2))
    assert outcomes[failing] == (
        f"CheckpointError: Cannot write the save {folder}: no space left on the device. "
        "Free some space (df -h), or write somewhere else."
    )
    assert outcomes[1 - failing] == (
        f"CheckpointError: The save {folder} failed on another rank. See that rank's error; "
        "the previous complete save is still there."
    )
    assert not folder.exists()  # rank 0 removed what was written


# --- the sharded part ------------------------------------------------------------------------


# DCP says it writes in a single process: this one, without a process group.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_part_is_written_into_the_saves_sharded_folder_and_marked(
    tmp_path: Path,
) -> None:
    folder = tmp_path / NAME
    folder.mkdir()
    shards = {"model": {"w": torch.arange(4.0)}}
    assert _job(folder, 0, 1, sharded=shards).run() == folder
    info = saves.check(folder)
    assert info.sharded
    saves.verify(info)
    read = {"model": {"w": torch.zeros(4)}}
    open_dcp(folder / saves.SHARDED).load(read)
    assert torch.equal(read["model"]["w"], torch.arange(4.0))


def test_a_sharded_part_that_cannot_be_written_fails_the_save_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / NAME
    folder.mkdir()

    def full(folder: Path, *_: object) -> None:
        raise CheckpointError(f"Cannot write the DCP checkpoint {folder}: no space left.")

    monkeypatch.setattr(sharded_part, "write", full)
    shards = {"model": {"w": torch.arange(4.0)}}
    with pytest.raises(CheckpointError, match="Cannot write the DCP checkpoint"):
        _job(folder, 0, 1, sharded=shards).run()
    assert not folder.exists()


# --- after the marker ------------------------------------------------------------------------


def test_a_complete_save_whose_older_saves_cannot_be_removed_is_kept_and_the_log_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / NAME
    folder.mkdir()

    def read_only(*_: object, **__: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(saves, "prune", read_only)
    with caplog.at_level(logging.WARNING, logger="gpukit.train"):
        assert _job(folder, 0, 1).run() == folder
    saves.verify(saves.check(folder))
    assert [r.getMessage() for r in caplog.records] == [
        f"could not remove the saves older than {folder}: [Errno 30] Read-only file system"
    ]
