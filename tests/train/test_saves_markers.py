"""What a save's marker and files must be for the save to be resumed, and what is said when not.

Each hostile or damaged save below sits beside an older intact one: the older one is chosen, and
the newer one is passed over with the reason a user reads in ``resumed.passed_over`` (and, for a
damaged one, in the log). The saves are written here file by file, as the ranks write them, and
marked with :func:`gpukit.train.saves.finish`; only the tests that read a file's content hold
``torch.save`` files. Acting as another user needs root (files are given to another uid with
``chown``); those tests skip without it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import socket
import threading
import zipfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch

from gpukit.checkpoint import digests
from gpukit.errors import CheckpointError, UntrustedCheckpointError
from gpukit.holders import user_name
from gpukit.train import saves

OTHER = 54321  # a uid with no account: another user of the machine
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
TOKEN = "5f3a0c91d2e4"
HINT = "Resume from another save in that folder, or start the run again."
CHANGED = (
    "The file changed after the save (a disk or copy error, or an edit); resume from another "
    "save in that folder, or start the run again."
)
SHARDS = ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]


def _made(root: Path, step: int, *, world: int = 1, count: int = 0, sharded: bool = False) -> Path:
    """A complete save at ``step`` by ``world`` ranks, each file holding its own name."""
    folder = root / saves.save_name(step, TOKEN, count)
    folder.mkdir(parents=True)
    names = [saves.SHARED, *(saves.rank_file(rank) for rank in range(world))]
    if sharded:
        (folder / saves.SHARDED).mkdir()
        names += SHARDS[: world + 1]
    for name in names:
        (folder / name).write_bytes(f"{name} at step {step}".encode())
    saves.finish(folder, step=step, world_size=world)
    return folder


def _marker(save: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads((save / saves.MARKER).read_text())
    return found


def _remark(save: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """Replace the marker of ``save`` with what ``change`` makes of it."""
    (save / saves.MARKER).write_text(json.dumps(change(_marker(save))))


def _passed_over_for_the_older(root: Path, newer: Path, older: Path) -> str:
    """The one line ``newest`` gives for passing ``newer`` over, once it chose ``older``."""
    info, passed = saves.newest(root)
    assert info is not None
    assert (info.path, info.step) == (older, saves.check(older).step)
    assert len(passed) == 1
    name, _, reason = passed[0].partition(": ")
    assert name == newer.name
    return reason


def _with(**fields: object) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A marker's change: ``fields`` set to new values (each a mapping merged into the old one)."""

    def change(marker: dict[str, Any]) -> dict[str, Any]:
        merged = {k: {**marker[k], **v} if type(v) is dict else v for k, v in fields.items()}
        return {**marker, **merged}

    return change


MALFORMED: list[tuple[str, Callable[[dict[str, Any]], object], str]] = [
    ("not-a-mapping", lambda marker: [marker], "marker is not a mapping"),
    ("format-1", _with(format=1), "it was written by an older gpukit, without digests"),
    ("format-3", _with(format=3), "its format is not 2"),
    (
        "format-missing",
        lambda marker: {k: v for k, v in marker.items() if k != "format"},
        "its format is not 2",
    ),
    ("step-a-string", _with(step="9"), "step is not an integer"),
    ("no-ranks", _with(world_size=0), "world is out of range (1 to 1048576)"),
    (
        "more-ranks-than-allowed",
        _with(world_size=(1 << 20) + 1),
        "world is out of range (1 to 1048576)",
    ),
    ("files-a-list", _with(files=[]), "files is not a mapping"),
    (
        "five-files-for-one-rank",
        _with(files={"rank-00001.pt": 0, "rank-00002.pt": 0, "rank-00003.pt": 0}),
        "files has more than 4 entries",
    ),
    (
        "fewer-files-than-ranks",
        _with(world_size=2),
        "its marker names fewer files than 2 ranks write",
    ),
    ("size-a-string", _with(files={"shared.pt": "20"}), "size of shared.pt is not an integer"),
    ("digests-a-list", _with(digests=[]), "digests is not a mapping"),
    (
        "more-digests-than-files",
        _with(digests={"rank-00001.pt": "0" * 32}),
        "digests has more than 2 entries",
    ),
    ("time-a-string", _with(time_ns="now"), "time is not an integer"),
    (
        "digest-too-short",
        _with(digests={"shared.pt": "0" * 31}),
        "its marker does not give one digest for each file",
    ),
]


@pytest.mark.parametrize(
    ("change", "reason"),
    [case[1:] for case in MALFORMED],
    ids=[case[0] for case in MALFORMED],
)
def test_a_malformed_marker_passes_the_save_over_to_the_older_one_saying_what_is_wrong(
    tmp_path: Path, change: Callable[[dict[str, Any]], object], reason: str
) -> None:
    older, newer = _made(tmp_path, 5), _made(tmp_path, 10)
    _remark(newer, change)
    assert _passed_over_for_the_older(tmp_path, newer, older) == reason


def test_a_save_without_its_marker_is_passed_over_as_incomplete(tmp_path: Path) -> None:
    older, newer = _made(tmp_path, 5), _made(tmp_path, 10)
    (newer / saves.MARKER).unlink()
    reason = _passed_over_for_the_older(tmp_path, newer, older)
    assert reason == "it has no marker: it is incomplete"


def test_a_marker_that_cannot_be_opened_is_passed_over_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    older, newer = _made(tmp_path, 5), _made(tmp_path, 10)
    (newer / saves.MARKER).unlink()
    monkeypatch.chdir(newer)  # a socket's path must be short: bound by its relative name
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(saves.MARKER)  # opening a socket's name fails (ENXIO)
        reason = _passed_over_for_the_older(tmp_path, newer, older)
    assert reason == "its marker cannot be read (No such device or address)"


def test_a_sharded_save_of_two_ranks_naming_every_shard_is_chosen(tmp_path: Path) -> None:
    _made(tmp_path, 5)
    newer = _made(tmp_path, 10, world=2, sharded=True)
    assert len(_marker(newer)["files"]) == 6  # each rank's file and shard, shared, .metadata
    info, passed = saves.newest(tmp_path)
    assert info is not None
    assert (info.path, info.world_size, info.sharded, passed) == (newer, 2, True, [])


def _sharded_part_named(save: Path, names: list[str]) -> Callable[[dict[str, Any]], object]:
    """A marker's change: its sharded part named as ``names``, each with its true size and
    digest, so that only which files it names is wrong."""

    def change(marker: dict[str, Any]) -> dict[str, Any]:
        kept = [name for name in marker["files"] if not name.startswith("sharded/")] + names
        return {
            **marker,
            "files": {name: (save / name).stat().st_size for name in kept},
            "digests": {name: saves.digest(save / name) for name in kept},
        }

    return change


@pytest.mark.parametrize(
    "names",
    [
        [SHARDS[0]],  # the metadata alone: the ranks' shards neither sized nor digested
        SHARDS[:2],  # rank 1's shards left out
        [*SHARDS[:2], "sharded/__2_0.distcp"],  # a rank the save does not have
        [SHARDS[0], "sharded/__0_1.distcp", SHARDS[2]],  # a second file of rank 0
    ],
    ids=["metadata-alone", "a-rank-left-out", "a-rank-too-many", "a-second-file-of-a-rank"],
)
def test_a_marker_naming_a_sharded_part_other_than_whole_passes_the_save_over(
    tmp_path: Path, names: list[str]
) -> None:
    older = _made(tmp_path, 5)
    newer = _made(tmp_path, 10, world=2, sharded=True)
    for name in names:
        if not (newer / name).exists():
            (newer / name).write_bytes(b"")
    _remark(newer, _sharded_part_named(newer, names))
    reason = _passed_over_for_the_older(tmp_path, newer, older)
    assert reason == "its marker names other files than those of a save by 2 processes"


def test_a_save_whose_rank_wrote_no_shards_cannot_be_completed(tmp_path: Path) -> None:
    folder = tmp_path / saves.save_name(10, TOKEN, 0)
    (folder / saves.SHARDED).mkdir(parents=True)
    for name in [saves.SHARED, saves.rank_file(0), saves.rank_file(1), *SHARDS[:2]]:
        (folder / name).write_bytes(b"written")
    with pytest.raises(CheckpointError) as raised:
        saves.finish(folder, step=10, world_size=2)
    assert raised.value.message == (
        f"Cannot complete the save {folder}: sharded/__1_0.distcp is missing."
    )
    assert not (folder / saves.MARKER).exists()


# --- a marker well-formed, its files not as it says --------------------------------------------


def _missing_shards(save: Path) -> None:
    for name in SHARDS[:2]:
        (save / name).unlink()
    (save / saves.SHARDED).rmdir()


def _rank_file_a_link(save: Path) -> None:
    real = save / saves.rank_file(0)
    (save.parent / "elsewhere.pt").write_bytes(real.read_bytes())
    real.unlink()
    real.symlink_to(save.parent / "elsewhere.pt")


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_missing_shards, "sharded is missing"),
        (lambda save: (save / saves.rank_file(0)).unlink(), "rank-00000.pt is missing"),
        (_rank_file_a_link, "rank-00000.pt is not a regular file"),
        (
            lambda save: (save / saves.SHARED).write_bytes(b"cut"),
            "shared.pt has 3 bytes, the marker says 20",
        ),
    ],
    ids=["no-sharded-folder", "rank-file-missing", "rank-file-a-link", "cut-short"],
)
def test_a_save_whose_files_are_not_as_its_marker_says_is_passed_over_saying_which(
    tmp_path: Path, damage: Callable[[Path], object], reason: str
) -> None:
    older, newer = _made(tmp_path, 5), _made(tmp_path, 10, sharded=True)
    damage(newer)
    line = _passed_over_for_the_older(tmp_path, newer, older)
    assert line == f"{newer} is not a complete save: {reason}. {HINT}"


def test_check_of_a_folder_that_is_gone_says_so_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as refused:
        saves.check(tmp_path / saves.save_name(5, TOKEN, 0))
    assert refused.value.message == (
        f"{tmp_path / saves.save_name(5, TOKEN, 0)} is not a complete save: the folder is missing."
    )
    assert refused.value.hint == HINT


def test_a_save_removed_while_the_folder_is_read_is_passed_over_as_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    older, newer = _made(tmp_path, 5), _made(tmp_path, 10)
    listed = saves._saves

    def pruned_meanwhile(root: Path) -> list[Path]:  # another process prunes it after the listing
        found = listed(root)
        shutil.rmtree(newer)
        return found

    monkeypatch.setattr(saves, "_saves", pruned_meanwhile)
    assert _passed_over_for_the_older(tmp_path, newer, older) == "the folder is missing"


# --- someone else's save -----------------------------------------------------------------------


def _foreign(what: str) -> str:
    return f"{what} belongs to {user_name(OTHER)}: only your own saves (or root's) are resumed"


@needs_root
def test_a_co_users_save_is_passed_over_naming_its_owner(tmp_path: Path) -> None:
    older, newer = _made(tmp_path, 5), _made(tmp_path, 10)
    os.chown(newer, OTHER, OTHER)
    assert _passed_over_for_the_older(tmp_path, newer, older) == _foreign("it")
    with pytest.raises(CheckpointError) as refused:
        saves.check(newer)
    assert str(refused.value) == f"{newer} is not a complete save: {_foreign('it')}. {HINT}"


@needs_root
def test_a_save_holding_a_co_users_file_is_passed_over_naming_the_file(tmp_path: Path) -> None:
    older, newer = _made(tmp_path, 5), _made(tmp_path, 10)
    os.chown(newer / saves.rank_file(0), OTHER, OTHER)
    line = _passed_over_for_the_older(tmp_path, newer, older)
    assert line == f"{newer} is not a complete save: {_foreign('rank-00000.pt')}. {HINT}"


# --- the digests -------------------------------------------------------------------------------


def test_a_changed_byte_passes_the_save_over_and_is_logged_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    older, newer = _made(tmp_path, 5), _made(tmp_path, 10)
    (newer / saves.SHARED).write_bytes(b"shared.pt at step 11")  # the same size
    damaged = f"{newer} is damaged: shared.pt is not what was saved (its digest differs)."
    with caplog.at_level(logging.WARNING, logger="gpukit.train"):
        line = _passed_over_for_the_older(tmp_path, newer, older)
    assert line == f"{damaged} {CHANGED}"
    assert [record.getMessage() for record in caplog.records] == [
        f"passing over the damaged save {newer}: {damaged} {CHANGED}"
    ]


def test_verify_of_a_file_gone_since_the_check_says_it_cannot_be_read(tmp_path: Path) -> None:
    save = _made(tmp_path, 5)
    info = saves.check(save)
    (save / saves.rank_file(0)).unlink()
    with pytest.raises(CheckpointError) as refused:
        saves.verify(info)
    assert str(refused.value) == (
        f"{save} is damaged: rank-00000.pt cannot be read (No such file or directory). {HINT}"
    )


def test_verify_of_a_file_replaced_by_a_link_since_the_check_refuses_to_follow_it(
    tmp_path: Path,
) -> None:
    save = _made(tmp_path, 5)
    info = saves.check(save)
    _rank_file_a_link(save)
    with pytest.raises(CheckpointError) as refused:
        saves.verify(info)
    assert str(refused.value) == (
        f"{save} is damaged: rank-00000.pt cannot be read (a symbolic link, not a file). {HINT}"
    )


def test_the_digests_are_checked_in_their_own_named_thread_while_the_save_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save = _made(tmp_path, 5)
    threads: list[str] = []

    def recorded(path: Path) -> str:
        threads.append(threading.current_thread().name)
        return digests.digest(path)

    monkeypatch.setattr(saves, "digest", recorded)
    info, passed, read = saves.newest_read(tmp_path, lambda found: threading.current_thread().name)
    assert info is not None
    assert (info.path, passed, read) == (save, [], threading.current_thread().name)
    assert len(threads) == 2
    assert all(name.startswith("gpukit-digests") for name in threads), threads


# --- reading one file of a save ----------------------------------------------------------------


def _torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_load_part_refuses_a_file_with_compressed_records_saying_what_to_do(
    tmp_path: Path,
) -> None:
    stored = zipfile.ZipFile(io.BytesIO(_torch_bytes({"w": torch.zeros(4)})))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as deflated:
        for record in stored.infolist():
            deflated.writestr(record.filename, stored.read(record))
    (tmp_path / saves.SHARED).write_bytes(buffer.getvalue())
    with pytest.raises(CheckpointError) as refused:
        saves.load_part(tmp_path, saves.SHARED)
    assert str(refused.value) == (
        f"{tmp_path / saves.SHARED} is not a training state's file: it holds a compressed "
        f"record (torch.save writes them stored): it was rewritten by another program. {HINT}"
    )


def test_load_part_never_runs_what_a_file_pickled(tmp_path: Path) -> None:
    (tmp_path / saves.SHARED).write_bytes(_torch_bytes({"lr": Fraction(1, 3)}))
    with pytest.raises(UntrustedCheckpointError, match=r"a reference to fractions\.Fraction"):
        saves.load_part(tmp_path, saves.SHARED)


def test_load_part_refuses_a_link_out_of_the_save_folder(tmp_path: Path) -> None:
    save = tmp_path / "save"
    save.mkdir()
    (tmp_path / "private.pt").write_bytes(_torch_bytes({"secret": torch.ones(2)}))
    (save / saves.SHARED).symlink_to(tmp_path / "private.pt")
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        saves.load_part(save, saves.SHARED)
    (save / saves.SHARED).unlink()
    (save / saves.SHARED).write_bytes(_torch_bytes({"w": torch.ones(2)}))
    assert torch.equal(saves.load_part(save, saves.SHARED)["w"], torch.ones(2))
