"""The training state's save folder: whom it trusts, what a save's marker holds, what is pruned.

The run's folder refused when someone else owns it or it cannot be used (each refusal with what
to do), the files each rank digests, the marker's digests as the ranks computed them, and which
old saves a prune removes, reports and leaves. Saves are built here from their parts
(:func:`gpukit.train.saves.write_part` and :func:`~gpukit.train.saves.finish`), as rank 0 of a
run builds them. Acting as another user needs root (``chown``, or a child process that drops to
``nobody``); those tests skip without it.
"""

from __future__ import annotations

import ast
import errno
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from gpukit.checkpoint.digests import digest
from gpukit.errors import CheckpointError
from gpukit.train import saves
from tests.helpers import NOBODY
from tests.helpers.other_user import as_nobody

OTHER = 54321  # a uid with no account: another user of the machine
TOKEN = "5f3a0c91d2e4"  # the token that names this run's saves
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
RESUME_ELSEWHERE = "Resume from another save in that folder, or start the run again."


def _written(root: Path, step: int, count: int, *, token: str = TOKEN, world: int = 1) -> Path:
    """A save's folder with every rank's files written, not yet marked complete."""
    folder = root / saves.save_name(step, token, count)
    folder.mkdir(parents=True)
    saves.write_part(folder, saves.SHARED, lambda handle: handle.write(b"shared %d" % step))
    for rank in range(world):
        saves.write_part(
            folder, saves.rank_file(rank), _content(b"rank %d of step %d" % (rank, step))
        )
    return folder


def _content(data: bytes) -> Callable[[BinaryIO], object]:
    return lambda handle: handle.write(data)


def _complete(root: Path, step: int, count: int, *, token: str = TOKEN) -> Path:
    folder = _written(root, step, count, token=token)
    saves.finish(folder, step=step, world_size=1)
    return folder


def _marker(folder: Path) -> dict[str, Any]:
    marker: dict[str, Any] = json.loads((folder / saves.MARKER).read_text())
    return marker


def _chown_tree(path: Path, uid: int) -> None:
    for root, folders, files in os.walk(path):
        for name in [*folders, *files]:
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)
    os.chown(path, uid, uid)


@pytest.fixture
def nobodys_home() -> Iterator[Path]:
    """A folder of nobody's, reachable by nobody (pytest's own folders are root's, 0700)."""
    home = Path(tempfile.mkdtemp(prefix="gpukit-nobody-", dir="/tmp"))
    try:
        os.chown(home, NOBODY, NOBODY)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _with_warnings(call: Callable[[], object]) -> Callable[[], tuple[object, list[str]]]:
    """``call``, and the warnings it logged: what a child acting as another user hands back."""

    def run() -> tuple[object, list[str]]:
        seen: list[str] = []

        class Seen(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                seen.append(record.getMessage())

        handler = Seen(logging.WARNING)
        logger = logging.getLogger("gpukit.train")
        logger.addHandler(handler)
        try:
            return call(), seen
        finally:
            logger.removeHandler(handler)

    return run


def _as_nobody_with_warnings(call: Callable[[], object]) -> tuple[object, list[str]]:
    """What ``call`` returned as another user (uid 65534), and the warnings it logged."""
    answer = as_nobody(_with_warnings(call))
    assert answer[0] == "ok", answer
    result, warnings = ast.literal_eval(answer[1] or "")
    return result, warnings


# --- the run's folder -------------------------------------------------------------------------


def test_a_save_folder_that_cannot_be_looked_up_is_refused_saying_why(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.symlink_to(root)  # a link to itself: it exists, but never leads to a folder
    with pytest.raises(CheckpointError) as refused:
        saves.check_root(root)
    assert refused.value.message == f"Cannot use {root} for saves: {os.strerror(errno.ELOOP)}."
    assert refused.value.hint == "Pass a folder this process can read and write."


def test_a_file_given_as_the_save_folder_is_refused_saying_to_pass_a_folder(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    root.write_bytes(b"not a folder")
    with pytest.raises(CheckpointError) as refused:
        saves.check_root(root)
    assert refused.value.message == f"Cannot use {root} for saves: it is not a folder."
    assert refused.value.hint == "Pass a folder (it is made if it does not exist)."


@needs_root
def test_a_save_folder_a_co_user_owns_is_refused_naming_the_folder_and_its_owner(
    tmp_path: Path,
) -> None:
    root = tmp_path / "run"
    root.mkdir(mode=0o755)
    os.chown(root, OTHER, OTHER)
    with pytest.raises(CheckpointError) as refused:
        saves.check_root(root)
    assert refused.value.message == (
        f"Refused the save folder {root}: the folder belongs to uid {OTHER}, "
        "who could replace or plant saves in it."
    )
    assert refused.value.hint == (
        "Save into a folder of your own (under your home, or a new one in a shared scratch "
        f"space), or ask uid {OTHER} to remove {root}."
    )


@needs_root
def test_a_link_of_ones_own_to_a_folder_a_co_user_owns_is_refused_naming_the_folder(
    tmp_path: Path,
) -> None:
    target = tmp_path / "hers"
    target.mkdir(mode=0o755)
    os.chown(target, OTHER, OTHER)
    link = tmp_path / "checkpoints"
    link.symlink_to(target)
    with pytest.raises(CheckpointError) as refused:
        saves.check_root(link)
    assert refused.value.message == (
        f"Refused the save folder {link}: the folder belongs to uid {OTHER}, "
        "who could replace or plant saves in it."
    )


@needs_root
def test_only_root_and_this_user_are_trusted_not_uid_1(tmp_path: Path) -> None:
    root = tmp_path / "run"
    save = _complete(root, 5, 0)
    os.chown(root, 1, 1)  # uid 1 (a system account) is not root
    with pytest.raises(CheckpointError, match="the folder belongs to"):
        saves.check_root(root)
    os.chown(root, 0, 0)
    _chown_tree(save, 1)
    with pytest.raises(CheckpointError, match="it belongs to"):
        saves.check(save)


@needs_root
def test_a_save_a_co_user_owns_is_refused_saying_only_your_own_or_roots_are_resumed(
    tmp_path: Path,
) -> None:
    save = _complete(tmp_path, 5, 0)
    _chown_tree(save, OTHER)
    with pytest.raises(CheckpointError) as refused:
        saves.check(save)
    assert refused.value.message == (
        f"{save} is not a complete save: it belongs to uid {OTHER}: only your own saves "
        "(or root's) are resumed."
    )
    assert refused.value.hint == RESUME_ELSEWHERE


def test_a_save_folder_only_its_owner_can_write_is_accepted_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    root.chmod(0o755)  # others may enter and read it: that is no risk to the saves
    with caplog.at_level(logging.WARNING, logger="gpukit.train"):
        saves.check_root(root)
    assert caplog.records == []


def test_the_warning_for_a_folder_its_group_can_write_names_it_and_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    root.mkdir()
    root.chmod(0o775)
    with caplog.at_level(logging.WARNING, logger="gpukit.train"):
        saves.check_root(root)
    assert [record.getMessage() for record in caplog.records] == [
        f"the save folder {root} can be written by its group (mode 0775): a member could "
        f"replace its saves; `chmod g-w {root}` if that group is not only you"
    ]


@needs_root
def test_a_save_folder_this_user_cannot_list_is_refused_saying_why(nobodys_home: Path) -> None:
    root = nobodys_home / "run"
    root.mkdir(mode=0o700)  # root's, as a run under sudo leaves it: nobody may not list it
    assert saves.newest(root) == (None, [])  # root may
    assert as_nobody(lambda: saves.newest(root)) == [
        "CheckpointError",
        f"Cannot list the saves in {root}: {os.strerror(errno.EACCES)}.",
        "Pass a folder this process can read.",
    ]


# --- a save's files and its marker ------------------------------------------------------------


def test_a_step_no_save_name_can_hold_is_refused_saying_the_range(tmp_path: Path) -> None:
    for step in (-1, 1 << 63, 1.5):
        expected = f"step {step!r} is not a whole number from 0 to {(1 << 63) - 1}"
        with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
            saves.save_name(step, TOKEN, 0)  # type: ignore[arg-type]
    assert saves.save_name((1 << 63) - 1, TOKEN, 3) == f"step-{(1 << 63) - 1}-{TOKEN}-3"


def test_each_rank_digests_the_files_it_wrote_and_only_those(tmp_path: Path) -> None:
    folder = _written(tmp_path, 5, 0, world=2)
    sharded = folder / saves.SHARDED
    sharded.mkdir()
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        saves.write_part(sharded, name, lambda handle: handle.write(b"dcp"))
    assert sorted(saves.own_files(folder, 0)) == sorted(
        ["shared.pt", "rank-00000.pt", "sharded/.metadata", "sharded/__0_0.distcp"]
    )
    assert saves.own_files(folder, 1) == ["rank-00001.pt", "sharded/__1_0.distcp"]
    assert saves.own_files(folder, 2) == ["rank-00002.pt"]  # a rank without shards


def test_a_save_marked_without_digests_given_is_digested_when_marked(tmp_path: Path) -> None:
    folder = _written(tmp_path, 5, 0, world=2)
    saves.finish(folder, step=5, world_size=2)
    names = [saves.SHARED, saves.rank_file(0), saves.rank_file(1)]
    assert _marker(folder)["digests"] == {name: digest(folder / name) for name in names}
    saves.verify(saves.check(folder))


def test_a_file_changed_after_its_rank_digested_it_is_caught_at_resume(tmp_path: Path) -> None:
    folder = _written(tmp_path, 5, 0)
    written = digest(folder / saves.SHARED)  # as rank 0 digests it, after its fsync
    (folder / saves.SHARED).write_bytes(b"shared 6")  # changed before the marker: same size
    saves.finish(folder, step=5, world_size=1, digests={saves.SHARED: written})
    digests = _marker(folder)["digests"]
    assert digests == {saves.SHARED: written, saves.rank_file(0): digest(folder / "rank-00000.pt")}
    with pytest.raises(CheckpointError, match=r"shared\.pt is not what was saved"):
        saves.verify(saves.check(folder))


def test_the_marker_names_the_algorithm_of_its_digests(tmp_path: Path) -> None:
    folder = _complete(tmp_path, 5, 0)
    assert _marker(folder)["digest"] == "xxh3-128"


def test_marking_a_save_a_rank_did_not_write_says_which_file_is_missing(tmp_path: Path) -> None:
    folder = _written(tmp_path, 5, 0, world=1)
    with pytest.raises(CheckpointError) as refused:
        saves.finish(folder, step=5, world_size=2)
    assert refused.value.message == f"Cannot complete the save {folder}: rank-00001.pt is missing."
    assert refused.value.hint == (
        "Every rank must call save() at the same step; the save was left incomplete and the "
        "previous complete save is still the one resumed."
    )
    assert not (folder / saves.MARKER).exists()


def test_a_save_with_a_file_gone_is_refused_naming_the_file(tmp_path: Path) -> None:
    folder = _complete(tmp_path, 5, 0)
    (folder / saves.SHARED).unlink()
    with pytest.raises(CheckpointError) as refused:
        saves.check(folder)
    assert refused.value.message == f"{folder} is not a complete save: shared.pt is missing."
    assert refused.value.hint == RESUME_ELSEWHERE


# --- pruning ----------------------------------------------------------------------------------


def test_prune_removes_older_and_dead_saves_keeps_the_newest_and_returns_what_it_removed(
    tmp_path: Path,
) -> None:
    oldest, older, old, current = (_complete(tmp_path, step, step - 1) for step in (1, 2, 3, 4))
    being_written = _written(tmp_path, 5, 4)  # this run's next save: another rank writes it
    dead = _written(tmp_path, 9, 7, token="0123456789ab")  # an earlier run's, its process died
    removed = saves.prune(tmp_path, keep=2, current=current)
    assert sorted(removed) == sorted([oldest, older, dead])
    assert sorted(tmp_path.iterdir()) == sorted([old, current, being_written])


def test_a_save_another_process_removes_during_a_prune_is_not_counted_as_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    older = _complete(tmp_path, 1, 0)
    current = _complete(tmp_path, 2, 1)
    listed = saves._saves

    def listed_then_removed(root: Path) -> list[Path]:
        found = listed(root)
        shutil.rmtree(older)  # a second run in the same folder pruned it meanwhile
        return found

    monkeypatch.setattr(saves, "_saves", listed_then_removed)
    assert saves.prune(tmp_path, keep=1, current=current) == []
    assert sorted(tmp_path.iterdir()) == [current]


def test_removing_a_save_says_it_is_gone(tmp_path: Path) -> None:
    save = _complete(tmp_path, 5, 0)
    assert saves.remove(save) is True
    assert not save.exists()


@needs_root
def test_a_save_root_left_is_not_removed_and_the_reason_is_logged(nobodys_home: Path) -> None:
    save = _complete(nobodys_home, 5, 0)  # root's, in nobody's folder: a run under sudo
    gone, warnings = _as_nobody_with_warnings(lambda: saves.remove(save))
    assert (gone, warnings) == (
        False,
        [f"cannot remove the old save {save}: {os.strerror(errno.EACCES)}"],
    )
    saves.verify(saves.check(save))  # its marker and files left as they were
    assert saves.remove(save) is True  # for root, who can


@needs_root
def test_a_save_only_partly_removable_is_logged_and_never_raises(nobodys_home: Path) -> None:
    save = _complete(nobodys_home, 5, 0)
    _chown_tree(save, NOBODY)
    stuck = save / saves.SHARDED
    stuck.mkdir()  # root's: nobody cannot remove what is in it
    (stuck / ".metadata").write_bytes(b"dcp")
    gone, warnings = _as_nobody_with_warnings(lambda: saves.remove(save))
    assert (gone, warnings) == (
        False,
        [f"the old save {save} is only partly removed (permissions?)"],
    )
    assert not (save / saves.MARKER).exists()  # never taken as complete again
    assert saves.remove(save) is True  # the rest, for root, who can
    assert list(nobodys_home.iterdir()) == []
