"""The one safe way to open the lock folder: what a hostile co-user can put there, refused."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from gpukit.errors import ExitCode, LockFolderError, UnsafeLockFileError
from gpukit.sharing.lockfiles import open_folder, open_lock_file, opened_folder
from tests.helpers import NOBODY, as_root


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "locks"
    path.mkdir(mode=0o1777)
    path.chmod(0o1777)
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the user's own, outside the lock folder, that an attacker wants destroyed."""
    path = tmp_path / "home" / "thesis.tex"
    path.parent.mkdir()
    path.write_text("four years of work")
    return path


def test_a_new_lock_file_is_created_shared_with_every_user(folder: Path) -> None:
    fd = open_lock_file(folder, "GPU-a.lock", write=True, create=True)
    os.close(fd)
    assert stat.S_IMODE((folder / "GPU-a.lock").stat().st_mode) == 0o666


def test_a_symlink_to_your_file_is_refused_and_the_file_is_untouched(
    folder: Path, victim: Path
) -> None:
    (folder / "GPU-a.lock").symlink_to(victim)
    with pytest.raises(UnsafeLockFileError, match="symbolic link") as caught:
        open_lock_file(folder, "GPU-a.lock", write=True, create=True)
    assert caught.value.exit_code == ExitCode.LOCK_FOLDER == 5
    assert victim.read_text() == "four years of work"


def test_a_hard_link_to_your_file_is_refused(folder: Path, victim: Path) -> None:
    os.link(victim, folder / "GPU-a.lock")
    with pytest.raises(UnsafeLockFileError, match="2 hard links"):
        open_lock_file(folder, "GPU-a.lock", write=True, create=True)
    assert victim.read_text() == "four years of work"


@pytest.mark.usefixtures("alarm")
@pytest.mark.parametrize("write", [False, True])
def test_a_fifo_is_refused_without_blocking(folder: Path, write: bool) -> None:
    os.mkfifo(folder / "GPU-a.lock")
    with pytest.raises(UnsafeLockFileError, match="FIFO"):
        open_lock_file(folder, "GPU-a.lock", write=write)


def test_a_folder_in_place_of_a_lock_file_is_refused(folder: Path) -> None:
    (folder / "GPU-a.lock").mkdir()
    with pytest.raises(LockFolderError):
        open_lock_file(folder, "GPU-a.lock", write=True, create=True)


def test_a_symlink_in_place_of_the_lock_folder_is_refused(tmp_path: Path, victim: Path) -> None:
    (tmp_path / "locks").symlink_to(victim.parent)
    with pytest.raises(LockFolderError, match="symbolic link"):
        open_lock_file(tmp_path / "locks", "thesis.tex", write=True, create=True)
    assert victim.read_text() == "four years of work"


def test_a_missing_lock_folder_is_created_shared_with_the_sticky_bit(tmp_path: Path) -> None:
    os.close(open_folder(tmp_path / "a" / "locks", create=True))
    assert stat.S_IMODE((tmp_path / "a" / "locks").stat().st_mode) == 0o1777


def test_a_lock_folder_under_a_file_is_a_lock_folder_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(LockFolderError, match="Cannot create the lock folder") as caught:
        open_folder(tmp_path / "file" / "locks", create=True)
    assert caught.value.exit_code == 5


def test_an_exclusive_create_fails_when_the_file_exists(folder: Path) -> None:
    os.close(open_lock_file(folder, "t", write=True, create=True, exclusive=True, mode=0o644))
    assert stat.S_IMODE((folder / "t").stat().st_mode) == 0o644
    with pytest.raises(FileExistsError):
        open_lock_file(folder, "t", write=True, create=True, exclusive=True)


def test_a_missing_file_is_not_created_unless_asked(folder: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_lock_file(folder, "GPU-a.lock", write=True)
    assert not (folder / "GPU-a.lock").exists()


def test_a_descriptor_of_the_folder_can_open_many_files(folder: Path) -> None:
    with opened_folder(folder) as dir_fd:
        for name in ("a", "b"):
            os.close(open_lock_file(folder, name, dir_fd=dir_fd, write=True, create=True))
    assert sorted(os.listdir(folder)) == ["a", "b"]


def test_your_own_folder_writable_by_others_gets_the_sticky_bit(tmp_path: Path) -> None:
    path = tmp_path / "locks"
    path.mkdir()
    path.chmod(0o777)
    os.close(open_folder(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o1777


@as_root
@pytest.mark.parametrize("mode", [0o777, 0o775, 0o755])
def test_another_users_folder_not_shared_with_the_sticky_bit_is_refused(
    tmp_path: Path, mode: int
) -> None:
    path = tmp_path / "locks"
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    path.chmod(mode)
    with pytest.raises(LockFolderError, match=f"mode {mode:04o}"):
        open_lock_file(path, "GPU-a.lock", write=True, create=True)
    assert os.listdir(path) == []


@as_root
def test_another_users_folder_shared_with_the_sticky_bit_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "locks"
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    path.chmod(0o1777)
    os.close(open_lock_file(path, "GPU-a.lock", write=True, create=True))


@as_root
def test_a_root_folder_writable_by_all_without_the_sticky_bit_is_refused(
    public_tmp: Path,
) -> None:
    path = public_tmp / "locks"
    path.mkdir()
    path.chmod(0o777)
    pid = os.fork()
    if pid == 0:  # another user, facing root's badly set up folder
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            open_folder(path)
        except LockFolderError as exc:
            code = 0 if "without the sticky bit" in str(exc) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@as_root
def test_another_users_lock_file_is_used_when_it_is_shared(folder: Path) -> None:
    path = folder / "GPU-a.lock"
    path.write_text("")
    os.chown(path, NOBODY, NOBODY)
    path.chmod(0o666)
    fd = open_lock_file(folder, "GPU-a.lock", write=True, create=True)
    os.close(fd)
    assert path.stat().st_uid == NOBODY


@as_root
def test_a_lock_file_another_user_is_still_widening_is_opened_once_it_is_shared(
    public_tmp: Path,
) -> None:
    folder = public_tmp / "locks"
    folder.mkdir()
    folder.chmod(0o1777)
    path = folder / "GPU-a.lock"
    path.write_text("")
    path.chmod(0o600)  # as its creator's umask left it, before the creator's fchmod
    pid = os.fork()
    if pid == 0:  # another user opens it while the creator is about to widen it
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.close(open_lock_file(folder, "GPU-a.lock", write=True, create=True))
            code = 0
        finally:
            os._exit(code)
    time.sleep(0.01)
    path.chmod(0o666)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@as_root
def test_a_lock_file_another_user_keeps_private_is_refused_soon(public_tmp: Path) -> None:
    folder = public_tmp / "locks"
    folder.mkdir()
    folder.chmod(0o1777)
    (folder / "GPU-a.lock").write_text("")
    (folder / "GPU-a.lock").chmod(0o600)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            started = time.monotonic()
            open_lock_file(folder, "GPU-a.lock", write=True, create=True)
        except LockFolderError:
            code = 0 if time.monotonic() - started < 5 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
