"""How a save is made atomic and durable, step by step, for one file and for a whole folder.

The kill tests in test_atomic.py show the promise as a whole (and are slow); these
check each part of it on its own: where the temporary goes and what it is called, which
temporaries a later save clears (and which it must never touch), the order of the fsyncs and
renames, and that a folder is never missing while it is being replaced.
"""

from __future__ import annotations

import ctypes.util
import errno
import io
import json
import os
import re
import shutil
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from gpukit.checkpoint import atomic
from gpukit.checkpoint.atomic import TMP_SUFFIX, atomic_folder, atomic_write, write_durable
from gpukit.errors import CheckpointError
from tests.conftest import NOBODY, as_root


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _writes(data: bytes) -> Callable[[BinaryIO, Path], None]:
    def write(handle: BinaryIO, _: Path) -> None:
        handle.write(data)

    return write


def _fill(files: dict[str, bytes]) -> Callable[[Path], None]:
    def fill(folder: Path) -> None:
        for name, data in files.items():
            (folder / name).write_bytes(data)

    return fill


@pytest.fixture
def names_taken_first(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the random part of temporary names "0badc0de", then "feedf00d", "c0ffee00"..."""
    handed: list[str] = []
    tokens = iter(["0badc0de", "feedf00d", "c0ffee00", "decaf000"])

    def token_hex(nbytes: int | None = None) -> str:
        handed.append(next(tokens))
        return handed[-1]

    monkeypatch.setattr(atomic.secrets, "token_hex", token_hex)
    return handed


# --- one file ---


def test_a_save_into_a_missing_folder_is_refused_naming_the_folder(tmp_path: Path):
    target = tmp_path / "run" / "m.pt"
    with pytest.raises(CheckpointError) as caught:
        atomic_write(target, _writes(b"data"))
    assert caught.value.message == (
        f"Cannot save {target}: the folder {tmp_path / 'run'} does not exist."
    )
    assert caught.value.hint == "Create it first, for example with Path(...).mkdir(parents=True)."
    assert _names(tmp_path) == []


def test_the_temporary_file_sits_beside_the_target_named_after_it_and_this_process(
    tmp_path: Path,
):
    seen: list[Path] = []

    def write(handle: BinaryIO, path: Path) -> None:
        seen.append(path)
        assert _names(tmp_path) == [path.name]  # nothing at the target's name yet
        handle.write(b"new")

    atomic_write(tmp_path / "m.pt", write)
    assert seen[0].parent == tmp_path
    assert re.fullmatch(rf"\.m\.pt\.{os.getpid()}\.[0-9a-f]+\.gpukit-tmp", seen[0].name)
    assert _names(tmp_path) == ["m.pt"]
    assert (tmp_path / "m.pt").read_bytes() == b"new"


def test_a_writer_that_writes_through_the_file_descriptor_is_saved_whole(tmp_path: Path):
    def write(handle: BinaryIO, _: Path) -> None:
        os.write(handle.fileno(), b"through the fd")

    atomic_write(tmp_path / "m.bin", write)
    assert (tmp_path / "m.bin").read_bytes() == b"through the fd"


@pytest.fixture(params=[True, False], ids=["linux", "without-posix_fadvise"])
def fadvise(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run the test as on Linux, and as on macOS, which has no os.posix_fadvise."""
    if not request.param:
        monkeypatch.delattr(os, "posix_fadvise", raising=False)
    return bool(request.param)


def test_a_writer_that_opens_the_temporary_path_itself_is_saved_whole(
    tmp_path: Path, fadvise: bool
):
    def write(handle: BinaryIO, path: Path) -> None:
        path.write_bytes(b"written by path")

    atomic_write(tmp_path / "m.bin", write)
    assert (tmp_path / "m.bin").read_bytes() == b"written by path"


def test_a_writer_may_write_text_through_a_text_wrapper(tmp_path: Path, fadvise: bool):
    def write(handle: BinaryIO, _: Path) -> None:
        text = io.TextIOWrapper(handle, encoding="utf-8")  # checks that handle is writable
        json.dump({"step": 3}, text)
        text.flush()
        text.detach()

    atomic_write(tmp_path / "state.json", write)
    assert json.loads((tmp_path / "state.json").read_text()) == {"step": 3}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_saved_file_gets_the_permissions_of_any_new_file(tmp_path: Path, umask: int):
    previous = os.umask(umask)
    try:
        atomic_write(tmp_path / "m.pt", _writes(b"x"))
        write_durable(tmp_path / "shard", lambda handle: handle.write(b"x"))
    finally:
        os.umask(previous)
    expected = {0o022: 0o644, 0o077: 0o600}[umask]
    assert stat.S_IMODE((tmp_path / "m.pt").stat().st_mode) == expected
    assert stat.S_IMODE((tmp_path / "shard").stat().st_mode) == expected


def test_ctrl_c_during_a_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path):
    target = tmp_path / "m.pt"
    target.write_bytes(b"old")

    def interrupted(handle: BinaryIO, _: Path) -> None:
        handle.write(b"half of the new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, interrupted)
    assert target.read_bytes() == b"old"
    assert _names(tmp_path) == ["m.pt"]


def test_a_writer_that_removed_its_temporary_still_reports_its_own_error(tmp_path: Path):
    def write(handle: BinaryIO, path: Path) -> None:
        path.unlink()
        raise ValueError("the writer's own failure")

    with pytest.raises(ValueError, match="the writer's own failure"):
        atomic_write(tmp_path / "m.pt", write)
    assert _names(tmp_path) == []


def test_a_temporary_name_already_taken_is_skipped_and_left_alone(
    tmp_path: Path, names_taken_first: list[str]
):
    taken = tmp_path / f".m.pt.{os.getpid()}.0badc0de{TMP_SUFFIX}"
    taken.write_bytes(b"another save of this process")
    atomic_write(tmp_path / "m.pt", _writes(b"new"))
    assert names_taken_first == ["0badc0de", "feedf00d"]
    assert taken.read_bytes() == b"another save of this process"
    assert (tmp_path / "m.pt").read_bytes() == b"new"


# --- temporaries that killed saves left behind ---


def _temporary(folder: Path, target: str, pid: int, token: str = "0badc0de") -> Path:
    return folder / f".{target}.{pid}.{token}{TMP_SUFFIX}"


def test_a_save_removes_temporary_files_and_folders_its_dead_savers_left(tmp_path: Path):
    dead = _dead_pid()
    stale_file = _temporary(tmp_path, "m.pt", dead)
    stale_file.write_bytes(b"half a checkpoint")
    stale_folder = _temporary(tmp_path, "m.pt", dead, "feedf00d")
    (stale_folder / "inner").mkdir(parents=True)
    (stale_folder / "inner" / "shard").write_bytes(b"half a shard")
    atomic_write(tmp_path / "m.pt", _writes(b"new"))
    assert _names(tmp_path) == ["m.pt"]


@pytest.mark.parametrize(
    "name",
    [
        ".m.pt.{pid}.0badc0de.gpukit-tmp.bak",  # not ending in the suffix
        "x.m.pt.{pid}.0badc0de.gpukit-tmp",  # not starting with the dot
        ".m.pt.{pid}.not-hex.gpukit-tmp",  # not gk.save's random part
        ".m.pt.{pid}..gpukit-tmp",  # no random part
        ".m.pt..0badc0de.gpukit-tmp",  # no process id
        ".m.pt.x{pid}.0badc0de.gpukit-tmp",
        ".m.pt2.{pid}.0badc0de.gpukit-tmp",  # another target's
        ".mXpt.{pid}.0badc0de.gpukit-tmp",  # the dot in the name is a dot, not any character
        ".m.pt.gpukit-tmp",
    ],
)
def test_files_that_only_look_like_this_targets_temporaries_are_kept(tmp_path: Path, name: str):
    other = tmp_path / name.format(pid=_dead_pid())
    other.write_bytes(b"someone's data")
    atomic_write(tmp_path / "m.pt", _writes(b"new"))
    assert other.read_bytes() == b"someone's data"


def test_a_stale_temporary_that_is_a_link_is_removed_without_following_it(tmp_path: Path):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "data").write_bytes(b"precious")
    link = _temporary(tmp_path, "m.pt", _dead_pid())
    link.symlink_to(kept, target_is_directory=True)
    atomic_write(tmp_path / "m.pt", _writes(b"new"))
    assert not os.path.lexists(link)
    assert (kept / "data").read_bytes() == b"precious"


def test_a_save_never_signals_the_process_whose_temporary_it_finds(tmp_path: Path):
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    child = os.fork()
    if child == 0:  # a saver still at work: it dies of any signal with a default action
        for number in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            signal.signal(number, signal.SIG_DFL)
        os.write(ready_w, b"r")
        os.read(release_r, 1)
        os._exit(0)
    os.read(ready_r, 1)
    running = _temporary(tmp_path, "m.pt", child)
    running.write_bytes(b"being written")
    try:
        atomic_write(tmp_path / "m.pt", _writes(b"new"))
    finally:
        os.write(release_w, b"go")
        _, status = os.waitpid(child, 0)
        for fd in (ready_r, ready_w, release_r, release_w):
            os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0  # not killed by a signal
    assert running.read_bytes() == b"being written"


def test_a_stale_temporary_another_save_removed_first_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Two saves of one target clear the same leftovers: the second may list one the first has
    # removed by the time it looks at it.
    dead = _dead_pid()
    gone = _temporary(tmp_path, "m.pt", dead)
    stale = _temporary(tmp_path, "m.pt", dead, "feedf00d")
    stale.write_bytes(b"half")
    real = Path.iterdir
    with monkeypatch.context() as patch:
        patch.setattr(Path, "iterdir", lambda self: iter([gone, *real(self)]))
        atomic_write(tmp_path / "m.pt", _writes(b"new"))
    assert _names(tmp_path) == ["m.pt"]


@as_root
@pytest.mark.parametrize("theirs_first", [True, False])
def test_another_users_temporary_does_not_stop_the_cleanup_of_this_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, theirs_first: bool
):
    dead = _dead_pid()
    theirs = _temporary(tmp_path, "m.pt", dead)
    theirs.write_bytes(b"their data")
    os.chown(theirs, NOBODY, NOBODY)
    mine = _temporary(tmp_path, "m.pt", dead, "feedf00d")
    mine.write_bytes(b"half")
    real = Path.iterdir
    # whatever order the folder lists them in
    listed = (lambda p: p != theirs) if theirs_first else (lambda p: p == theirs)
    with monkeypatch.context() as patch:
        patch.setattr(Path, "iterdir", lambda self: iter(sorted(real(self), key=listed)))
        atomic_write(tmp_path / "m.pt", _writes(b"new"))
    assert _names(tmp_path) == sorted(["m.pt", theirs.name])


@as_root
def test_another_users_stale_temporary_is_never_touched(tmp_path: Path):
    theirs = _temporary(tmp_path, "m.pt", _dead_pid())
    theirs.write_bytes(b"their data")
    os.chown(theirs, NOBODY, NOBODY)
    atomic_write(tmp_path / "m.pt", _writes(b"new"))
    assert theirs.read_bytes() == b"their data"


@as_root
def test_a_temporary_of_a_running_process_of_another_user_is_kept(public_tmp: Path):
    public_tmp.chmod(0o777)  # every user may write here
    # As NOBODY, a root process cannot be signalled (EPERM): it is running, so its temporary,
    # even one NOBODY owns, may still be being written.
    running = _temporary(public_tmp, "m.pt", os.getpid())
    running.write_bytes(b"being written")
    os.chown(running, NOBODY, NOBODY)
    atomic_write(public_tmp / "m.pt", _writes(b"root's"))  # root, who can signal it, keeps it
    assert running.read_bytes() == b"being written"
    child = os.fork()
    if child == 0:
        status = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            atomic_write(public_tmp / "m.pt", _writes(b"new"))
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (public_tmp / "m.pt").read_bytes() == b"new"
    assert running.read_bytes() == b"being written"


# --- durability ---


def test_write_durable_creates_the_file_fsynced_whole(tmp_path: Path, monkeypatch):
    sizes: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (sizes.append(os.fstat(fd).st_size), real(fd)))
    write_durable(tmp_path / "shard", lambda handle: handle.write(b"y" * 100))
    assert sizes == [100]
    assert (tmp_path / "shard").read_bytes() == b"y" * 100


def test_write_durable_never_replaces_a_file(tmp_path: Path):
    (tmp_path / "shard").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        write_durable(tmp_path / "shard", lambda handle: handle.write(b"new"))
    assert (tmp_path / "shard").read_bytes() == b"old"


_MiB = 1 << 20


@pytest.mark.parametrize("durable", [False, True], ids=["atomic_write", "write_durable"])
def test_writeback_is_started_every_32_mib_for_the_part_written_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
):
    calls: list[tuple[int, int, int]] = []
    inodes: set[int] = set()

    def posix_fadvise(fd: int, start: int, n: int, advice: int) -> None:
        inodes.add(os.fstat(fd).st_ino)
        calls.append((start, n, advice))

    monkeypatch.setattr(os, "posix_fadvise", posix_fadvise)
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # the data is thrown away afterwards
    chunk = bytes(32 * _MiB - 1)

    def write(handle: Any, *_: object) -> None:
        handle.write(chunk)
        assert calls == []  # one byte short of 32 MiB
        handle.write(b"x")
        assert calls == [(0, 32 * _MiB, os.POSIX_FADV_DONTNEED)]
        handle.write(chunk)
        handle.write(b"yz")
        assert calls[1:] == [(32 * _MiB, 32 * _MiB + 1, os.POSIX_FADV_DONTNEED)]

    target = tmp_path / "big.bin"
    try:
        if durable:
            write_durable(target, write)
        else:
            atomic_write(target, write)
        assert target.stat().st_size == 64 * _MiB + 1
        assert inodes == {target.stat().st_ino}  # the hints were about the file being saved
    finally:
        target.unlink(missing_ok=True)
    assert len(calls) == 2


@pytest.mark.parametrize("durable", [False, True], ids=["atomic_write", "write_durable"])
def test_without_posix_fadvise_a_big_file_is_written_without_writeback_hints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
):
    monkeypatch.delattr(os, "posix_fadvise", raising=False)  # as on macOS
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    target = tmp_path / "big.bin"
    chunk = bytes(33 * _MiB)
    try:
        if durable:
            write_durable(target, lambda handle: handle.write(chunk))
        else:
            atomic_write(target, _writes(chunk))
        assert target.stat().st_size == 33 * _MiB
    finally:
        target.unlink(missing_ok=True)


# --- a whole folder ---


def test_a_new_folder_appears_whole_under_its_name(tmp_path: Path):
    seen: list[Path] = []

    def fill(folder: Path) -> None:
        seen.append(folder)
        assert not (tmp_path / "weights").exists()
        (folder / "a").write_bytes(b"1")

    atomic_folder(tmp_path / "weights", fill)
    assert seen[0].parent == tmp_path
    assert re.fullmatch(rf"\.weights\.{os.getpid()}\.[0-9a-f]+\.gpukit-tmp", seen[0].name)
    assert _names(tmp_path) == ["weights"]
    assert _names(tmp_path / "weights") == ["a"]


def test_replacing_a_folder_swaps_it_in_one_step_and_removes_the_old_one(
    tmp_path: Path, monkeypatch
):
    target = tmp_path / "weights"
    atomic_folder(target, _fill({"old-1": b"o", "old-2": b"o"}))
    # A rename of the old folder aside would leave no folder at the target for a moment.
    moved: list[str] = []
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (moved.append(Path(a).name), real(a, b)))
    atomic_folder(target, _fill({"new": b"n"}))
    assert moved == []
    assert _names(target) == ["new"]
    assert _names(tmp_path) == ["weights"]


def test_a_folder_given_by_a_relative_path_is_replaced(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    atomic_folder(Path("weights"), _fill({"old": b"o"}))
    atomic_folder(Path("weights"), _fill({"new": b"n"}))
    assert _names(tmp_path / "weights") == ["new"]
    assert _names(tmp_path) == ["weights"]


def test_without_an_atomic_swap_the_old_folder_is_moved_aside_then_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    target = tmp_path / "weights"
    atomic_folder(target, _fill({"old": b"o"}))
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)  # no renameat2
    renames: list[tuple[str, str]] = []
    real = os.rename

    def rename(a: Path, b: Path) -> None:
        renames.append((Path(a).name, Path(b).name))
        real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    atomic_folder(target, _fill({"new": b"n"}))
    aside = re.compile(rf"\.weights\.{os.getpid()}\.[0-9a-f]+\.gpukit-tmp")
    assert len(renames) == 2
    assert renames[0][0] == "weights"
    assert aside.fullmatch(renames[0][1])  # the old folder goes aside first,
    assert aside.fullmatch(renames[1][0])  # then the new one takes its place
    assert renames[1][1] == "weights"
    assert renames[0][1] != renames[1][0]
    assert _names(target) == ["new"]
    assert _names(tmp_path) == ["weights"]


def test_ctrl_c_while_the_moved_aside_folder_is_removed_is_reported_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    target = tmp_path / "weights"
    atomic_folder(target, _fill({"old": b"o"}))
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)  # no renameat2
    real = shutil.rmtree
    interrupted: list[str] = []

    def rmtree(path: Path, ignore_errors: bool = False) -> None:
        if not interrupted and Path(path).name != "weights":
            interrupted.append(Path(path).name)
            raise KeyboardInterrupt  # while removing the old folder, moved aside
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        atomic_folder(target, _fill({"new": b"n"}))
    assert _names(target) == ["new"]  # the new folder was in place already
    assert _names(tmp_path) == sorted(["weights", interrupted[0]])  # the old one, still aside


def test_a_folder_is_fsynced_before_it_is_swapped_in_and_its_parent_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    target = tmp_path / "weights"
    atomic_folder(target, _fill({"old": b"o"}))
    old = target.stat().st_ino
    # each fsync: what it synced (its inode), and which folder was at the target then
    fsyncs: list[tuple[str, int, int]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        info = os.fstat(fd)
        kind = "folder" if stat.S_ISDIR(info.st_mode) else "file"
        fsyncs.append((kind, info.st_ino, target.stat().st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    atomic_folder(target, lambda folder: write_durable(folder / "s", lambda h: h.write(b"s")))
    new = target.stat().st_ino
    shard = (target / "s").stat().st_ino
    assert fsyncs == [
        ("file", shard, old),  # the shard's bytes,
        ("folder", new, old),  # then the new folder's entries, all before the swap;
        ("folder", tmp_path.stat().st_ino, new),  # the swap itself, after it
    ]


def test_ctrl_c_while_filling_a_folder_keeps_the_old_one_and_leaves_no_temporary(
    tmp_path: Path,
):
    target = tmp_path / "weights"
    atomic_folder(target, _fill({"old": b"o"}))

    def interrupted(folder: Path) -> None:
        (folder / "half").write_bytes(b"h")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_folder(target, interrupted)
    assert _names(target) == ["old"]
    assert _names(tmp_path) == ["weights"]


def test_a_folder_save_removes_what_dead_folder_saves_left(tmp_path: Path):
    stale = _temporary(tmp_path, "weights", _dead_pid())
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half")
    atomic_folder(tmp_path / "weights", _fill({"new": b"n"}))
    assert _names(tmp_path) == ["weights"]


def test_a_temporary_folder_name_already_taken_is_skipped_and_left_alone(
    tmp_path: Path, names_taken_first: list[str]
):
    taken = _temporary(tmp_path, "weights", os.getpid())
    taken.mkdir()
    atomic_folder(tmp_path / "weights", _fill({"new": b"n"}))
    assert names_taken_first == ["0badc0de", "feedf00d"]
    assert taken.is_dir()
    assert _names(taken) == []
    assert _names(tmp_path / "weights") == ["new"]


def test_where_the_file_system_refuses_the_swap_the_folder_is_still_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    target = tmp_path / "weights"
    atomic_folder(target, _fill({"old": b"o"}))
    # Flags the kernel does not know: renameat2 fails with EINVAL, as on a file system
    # without RENAME_EXCHANGE.
    monkeypatch.setattr(atomic, "_RENAME_EXCHANGE", 1 << 30)
    atomic_folder(target, _fill({"new": b"n"}))
    assert _names(target) == ["new"]
    assert _names(tmp_path) == ["weights"]


def test_a_swap_that_fails_otherwise_is_an_os_error_with_its_errno_and_the_target(
    tmp_path: Path,
):
    with pytest.raises(FileNotFoundError) as caught:
        atomic._exchange(tmp_path / "missing", tmp_path / "other")
    assert caught.value.errno == errno.ENOENT
    assert caught.value.strerror == "No such file or directory"
    assert caught.value.filename == str(tmp_path / "other")
