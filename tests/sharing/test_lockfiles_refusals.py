"""What a hostile co-user can plant in or around the lock folder, and each refusal word for word.

The lock folder is writable by every user of the GPUs: any of them can put a link, a hard link,
a FIFO, a socket, a device or a folder where a lock file belongs, or arrange for the folder to be
something else. Each test states what gpukit answers: the typed error, its message and its hint
(what the user can do), and that nothing outside the lock folder was touched.
"""

from __future__ import annotations

import errno
import gc
import os
import pwd
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

import gpukit.sharing.lockfiles as lockfiles
from gpukit.errors import GpukitError, LockFolderError
from gpukit.sharing.lockfiles import check_folder, open_folder, open_lock_file, opened_folder
from tests.helpers import NOBODY, as_root
from tests.helpers.other_user import as_nobody

ME = pwd.getpwuid(os.geteuid()).pw_name
REMOVE_IT = (
    "Ask its owner or an administrator to remove it; an administrator can give the machine a "
    "folder only root controls: `sudo gpukit setup-locks`."
)
CHECK_THE_PATH = (
    "Check the disk and the path (GPUKIT_LOCK_DIR, /etc/gpukit/config.toml), or set "
    "GPUKIT_LOCK_DIR to a folder on a local disk every user of the GPUs can write."
)
CANNOT_WRITE = (
    "Set GPUKIT_LOCK_DIR to a folder you can write, or ask an administrator to set up one for "
    "every user with `sudo gpukit setup-locks`."
)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "locks"
    path.mkdir()
    path.chmod(0o1777)
    return path


def _refusal(call: Callable[[], object]) -> tuple[str, str, str | None]:
    """The type, message and hint of the GpukitError ``call`` raises."""
    with pytest.raises(GpukitError) as caught:
        call()
    return type(caught.value).__name__, caught.value.message, caught.value.hint


def _open_fds() -> set[str]:
    """This process's open descriptors, after the collector closed what earlier tests dropped."""
    gc.collect()
    return set(os.listdir("/proc/self/fd"))


# What is planted where a lock file belongs


def test_a_symlink_planted_as_a_lock_file_is_refused_saying_what_to_do(
    folder: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "thesis.tex"
    victim.write_text("four years of work")
    (folder / "GPU-a.lock").symlink_to(victim)
    assert _refusal(lambda: open_lock_file(folder, "GPU-a.lock", write=True, create=True)) == (
        "UnsafeLockFileError",
        f"Refused to open {folder / 'GPU-a.lock'}: it is a symbolic link, which gpukit never "
        "follows in the lock folder (it could point at one of your files).",
        REMOVE_IT,
    )
    assert victim.read_text() == "four years of work"


@pytest.mark.usefixtures("alarm")
def test_a_fifo_planted_as_a_lock_file_is_refused_naming_it_and_its_owner(folder: Path) -> None:
    os.mkfifo(folder / "GPU-a.lock")
    refused = (
        "UnsafeLockFileError",
        f"Refused to use {folder / 'GPU-a.lock'}: it is a FIFO (named pipe) (owned by {ME}), "
        "not a lock file.",
        REMOVE_IT,
    )
    assert _refusal(lambda: open_lock_file(folder, "GPU-a.lock", write=True)) == refused
    with opened_folder(folder) as dir_fd:
        assert _refusal(lambda: open_lock_file(folder, "GPU-a.lock", dir_fd=dir_fd)) == refused


def test_a_hard_link_planted_as_a_lock_file_is_refused_naming_its_links(
    folder: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "thesis.tex"
    victim.write_text("four years of work")
    os.link(victim, folder / "GPU-a.lock")
    assert _refusal(lambda: open_lock_file(folder, "GPU-a.lock", write=True, create=True)) == (
        "UnsafeLockFileError",
        f"Refused to use {folder / 'GPU-a.lock'}: it has 2 hard links, so it is also another "
        f"file somewhere (owned by {ME}), perhaps one of yours.",
        REMOVE_IT,
    )
    assert victim.read_text() == "four years of work"


def test_a_folder_planted_as_a_lock_file_is_refused_as_a_folder(folder: Path) -> None:
    (folder / "GPU-a.lock").mkdir()
    assert _refusal(lambda: open_lock_file(folder, "GPU-a.lock")) == (
        "UnsafeLockFileError",
        f"Refused to use {folder / 'GPU-a.lock'}: it is a folder (owned by {ME}), not a lock file.",
        REMOVE_IT,
    )


def test_a_device_planted_as_a_lock_file_is_refused_as_a_device(folder: Path) -> None:
    try:
        os.mknod(folder / "GPU-a.lock", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null
    except PermissionError:
        pytest.skip("cannot make a device node here (needs CAP_MKNOD)")
    assert _refusal(lambda: open_lock_file(folder, "GPU-a.lock", write=True)) == (
        "UnsafeLockFileError",
        f"Refused to use {folder / 'GPU-a.lock'}: it is a character device (owned by {ME}), "
        "not a lock file.",
        REMOVE_IT,
    )


def test_a_socket_planted_as_a_lock_file_cannot_be_opened_and_says_why(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(folder)  # a socket's path is limited to 108 bytes: bind a short one
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("GPU-a.lock")
        assert _refusal(lambda: open_lock_file(folder, "GPU-a.lock", write=True)) == (
            "LockFolderError",
            f"Cannot open {folder / 'GPU-a.lock'}: No such device or address.",
            CHECK_THE_PATH,
        )


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../GPU-a.lock", "a\0b"])
def test_a_name_that_is_not_a_plain_file_name_is_a_callers_mistake(folder: Path, name: str) -> None:
    (folder / "a").mkdir()
    (folder / "a" / "b").write_text("")
    with pytest.raises(ValueError, match="is not a plain file name") as caught:
        open_lock_file(folder, name, write=True, create=True)
    assert str(caught.value) == f"{name!r} is not a plain file name"


# The lock folder itself


def _plant(kind: str, path: Path) -> None:
    if kind == "a FIFO (named pipe)":
        os.mkfifo(path)
    elif kind == "a socket":
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(path.name)
    elif kind == "a symbolic link":
        path.symlink_to(path.parent)
    elif kind == "a regular file":
        path.write_text("")
    else:
        device = stat.S_IFCHR if kind == "a character device" else stat.S_IFBLK
        try:
            os.mknod(path, device | 0o600, os.makedev(1 if device == stat.S_IFCHR else 7, 3))
        except PermissionError:
            pytest.skip("cannot make a device node here (needs CAP_MKNOD)")


@pytest.mark.parametrize(
    "kind",
    [
        "a FIFO (named pipe)",
        "a socket",
        "a symbolic link",
        "a character device",
        "a block device",
        "a regular file",
    ],
)
def test_check_folder_refuses_anything_but_a_folder_naming_what_it_is(
    folder: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.chdir(folder)
    path = folder / "locks"
    _plant(kind, path)
    assert _refusal(lambda: check_folder(os.lstat(path), path)) == (
        "LockFolderError",
        f"The lock folder {path} is {kind}, not a folder.",
        REMOVE_IT,
    )


def test_a_lock_folder_that_is_a_symlink_is_refused_saying_where_to_point_instead(
    tmp_path: Path,
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "locks").symlink_to(tmp_path / "real")
    assert _refusal(lambda: open_folder(tmp_path / "locks", create=True)) == (
        "LockFolderError",
        f"Refused the lock folder {tmp_path / 'locks'}: it is a symbolic link, and gpukit never "
        "follows a link in a place other users can write.",
        "Point GPUKIT_LOCK_DIR (or lock_dir in /etc/gpukit/config.toml) at the real folder; an "
        "administrator can give the machine a folder only root controls: "
        "`sudo gpukit setup-locks`.",
    )


def test_a_lock_folder_that_is_a_file_cannot_be_opened_and_says_it_is_no_folder(
    tmp_path: Path,
) -> None:
    (tmp_path / "locks").write_text("")
    assert _refusal(lambda: open_folder(tmp_path / "locks")) == (
        "LockFolderError",
        f"Cannot open the lock folder {tmp_path / 'locks'}: Not a directory.",
        CHECK_THE_PATH,
    )


def test_a_missing_lock_folder_is_reported_and_made_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "locks"
    assert _refusal(lambda: open_folder(path)) == (
        "LockFolderError",
        f"Cannot open the lock folder {path}: No such file or directory.",
        CHECK_THE_PATH,
    )
    assert not path.exists()


def test_a_lock_folder_under_a_file_names_the_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "sub" / "locks"
    assert _refusal(lambda: open_folder(path, create=True)) == (
        "LockFolderError",
        f"Cannot create the lock folder {path}: {tmp_path / 'file'} is not a folder.",
        "Set GPUKIT_LOCK_DIR (or lock_dir in /etc/gpukit/config.toml) to a path whose parents "
        "are folders.",
    )


def test_missing_parents_of_a_new_lock_folder_are_made_and_existing_ones_kept(
    tmp_path: Path,
) -> None:
    os.close(open_folder(tmp_path / "a" / "b" / "locks", create=True))
    os.close(open_folder(tmp_path / "a" / "b" / "more-locks", create=True))
    assert sorted(os.listdir(tmp_path / "a" / "b")) == ["locks", "more-locks"]
    assert stat.S_IMODE((tmp_path / "a" / "b" / "locks").stat().st_mode) == 0o1777


def test_a_lock_folder_swapped_for_a_link_as_it_is_made_leaves_the_links_target_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    path = tmp_path / "locks"
    real = os.mkdir

    def made_then_swapped(target: object, mode: int = 0o777, **kwargs: object) -> None:
        real(target, mode, **kwargs)  # type: ignore[arg-type]
        if Path(str(target)) == path:  # a co-user puts a link in its place at once
            os.rename(path, tmp_path / "made")
            path.symlink_to(private)

    monkeypatch.setattr(lockfiles.os, "mkdir", made_then_swapped)
    kind, message, _ = _refusal(lambda: open_folder(path, create=True))
    assert (kind, message) == (
        "LockFolderError",
        f"Refused the lock folder {path}: it is a symbolic link, and gpukit never follows a "
        "link in a place other users can write.",
    )
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


def test_a_lock_folder_removed_as_soon_as_it_is_made_is_reported_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "locks"
    real = os.mkdir

    def made_then_removed(target: object, mode: int = 0o777, **kwargs: object) -> None:
        real(target, mode, **kwargs)  # type: ignore[arg-type]
        if Path(str(target)) == path:  # whoever may write its parent removes it at once
            os.rmdir(path)

    monkeypatch.setattr(lockfiles.os, "mkdir", made_then_removed)
    assert _refusal(lambda: open_folder(path, create=True)) == (
        "LockFolderError",
        f"Cannot open the lock folder {path}: No such file or directory.",
        CHECK_THE_PATH,
    )


def test_a_lock_folder_that_may_not_be_created_names_no_owner_as_there_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a user without write permission on its parent meets it (root never does).
    def denied(target: object, mode: int = 0o777, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(lockfiles.os, "mkdir", denied)
    path = tmp_path / "locks"
    assert _refusal(lambda: open_folder(path, create=True)) == (
        "LockFolderError",
        f"Cannot create the lock folder {path}: permission denied.",
        CANNOT_WRITE,
    )


@pytest.mark.parametrize("mode", [0o755, 0o711, 0o700])
def test_your_own_folder_only_you_can_write_is_left_as_it_is(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "locks"
    path.mkdir()
    path.chmod(mode)
    os.close(open_folder(path))
    assert stat.S_IMODE(path.stat().st_mode) == mode


@as_root
@pytest.mark.parametrize("mode", [0o755, 0o775, 0o777])
def test_another_users_folder_not_shared_the_gpukit_way_is_refused_naming_owner_and_mode(
    tmp_path: Path, mode: int
) -> None:
    path = tmp_path / "locks"
    path.mkdir()
    os.chown(path, NOBODY, NOBODY)
    path.chmod(mode)
    assert _refusal(lambda: open_lock_file(path, "GPU-a.lock", write=True, create=True)) == (
        "LockFolderError",
        f"Refused the lock folder {path}: it belongs to nobody with mode {mode:04o}, not shared "
        "the way gpukit shares it (1777: everyone may add files, only their owners may remove "
        "them).",
        "Set GPUKIT_LOCK_DIR to a folder of your own, or ask its owner to fix it; an "
        "administrator can give the machine a folder only root controls: "
        "`sudo gpukit setup-locks`.",
    )
    assert os.listdir(path) == []


@as_root
@pytest.mark.parametrize(
    ("mode", "seen_by_others"),
    [
        (0o755, "ok"),
        (0o1777, "ok"),
        (0o1775, "ok"),
        (0o777, "mode 0777"),
        (0o775, "mode 0775"),
        (0o757, "mode 0757"),
    ],
)
def test_a_root_folder_others_may_write_without_the_sticky_bit_is_refused_to_them(
    public_tmp: Path, mode: int, seen_by_others: str
) -> None:
    path = public_tmp / "locks"
    path.mkdir()
    path.chmod(mode)
    answer = as_nobody(lambda: os.close(open_folder(path)))
    if seen_by_others == "ok":
        assert answer == ["ok", "None"]
    else:
        assert answer == [
            "LockFolderError",
            f"Refused the lock folder {path}: it is writable by other users ({seen_by_others}) "
            "without the sticky bit, so anyone could replace its lock files.",
            "An administrator can fix it with `sudo chmod +t` on it, or with "
            "`sudo gpukit setup-locks`.",
        ]
    # Root, its owner, may use it: writable by others, it gets the sticky bit on the way.
    os.close(open_folder(path))
    assert stat.S_IMODE(path.stat().st_mode) == (mode | 0o1000 if mode & 0o022 else mode)


@as_root
def test_a_user_who_may_not_write_where_the_lock_folder_goes_is_told_permission_denied(
    public_tmp: Path,
) -> None:
    path = public_tmp / "locks"
    assert as_nobody(lambda: open_folder(path, create=True)) == [
        "LockFolderError",
        f"Cannot create the lock folder {path}: permission denied.",
        CANNOT_WRITE,
    ]
    assert not path.exists()
    os.close(open_folder(path, create=True))  # root may
    assert stat.S_IMODE(path.stat().st_mode) == 0o1777


@as_root
def test_a_lock_file_another_user_keeps_private_is_refused_after_ten_short_waits(
    public_tmp: Path,
) -> None:
    folder = public_tmp / "locks"
    folder.mkdir()
    folder.chmod(0o1777)
    path = folder / "GPU-a.lock"
    path.write_text("")
    path.chmod(0o600)

    def open_it_counting_waits() -> object:
        waits: list[float] = []

        class Clock:
            sleep = waits.append

        lockfiles.time = Clock  # type: ignore[assignment]  # in the child process only
        try:
            open_lock_file(folder, "GPU-a.lock", write=True, create=True)
        except LockFolderError as exc:
            raise LockFolderError(f"{exc.message} {waits}", hint=exc.hint) from exc
        return waits

    assert as_nobody(open_it_counting_waits) == [
        "LockFolderError",
        f"Cannot open {path} (owned by root): permission denied. {[0.005] * 10}",
        CANNOT_WRITE,
    ]
    os.close(open_lock_file(folder, "GPU-a.lock", write=True))  # its owner may


# How a lock file is opened


def test_a_lock_file_is_opened_read_only_unless_write_is_asked(folder: Path) -> None:
    (folder / "GPU-a.lock").write_text("")
    with opened_folder(folder) as dir_fd:
        for through in ({}, {"dir_fd": dir_fd}):
            fd = open_lock_file(folder, "GPU-a.lock", **through)  # type: ignore[arg-type]
            with pytest.raises(OSError, match="Bad file descriptor") as caught:
                os.write(fd, b"x")
            os.close(fd)
            assert caught.value.errno == errno.EBADF
            fd = open_lock_file(folder, "GPU-a.lock", write=True, **through)  # type: ignore[arg-type]
            assert os.write(fd, b"x") == 1
            os.close(fd)


def test_an_exclusive_create_through_the_folders_descriptor_refuses_an_existing_file(
    folder: Path,
) -> None:
    (folder / "t").write_text("theirs")
    with opened_folder(folder) as dir_fd, pytest.raises(FileExistsError):
        open_lock_file(folder, "t", dir_fd=dir_fd, write=True, create=True, exclusive=True)
    assert (folder / "t").read_text() == "theirs"


def test_creating_a_lock_file_in_a_missing_folder_makes_the_folder_shared(tmp_path: Path) -> None:
    os.close(open_lock_file(tmp_path / "locks", "GPU-a.lock", write=True, create=True))
    assert stat.S_IMODE((tmp_path / "locks").stat().st_mode) == 0o1777
    assert stat.S_IMODE((tmp_path / "locks" / "GPU-a.lock").stat().st_mode) == 0o666


@pytest.mark.parametrize("mode", [0o600, 0o644])
def test_a_new_lock_file_is_never_more_open_than_asked_even_before_its_mode_is_set(
    folder: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    # A ticket is made private (0600) so that no co-user can open it before it is locked.
    created_as: list[int] = []
    real = os.fchmod

    def fchmod(fd: int, new_mode: int) -> None:
        created_as.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real(fd, new_mode)

    monkeypatch.setattr(lockfiles.os, "fchmod", fchmod)
    os.close(open_lock_file(folder, "t", write=True, create=True, exclusive=True, mode=mode))
    umask = os.umask(0)
    os.umask(umask)
    assert created_as == [mode & ~umask]
    assert stat.S_IMODE((folder / "t").stat().st_mode) == mode


def test_a_lock_file_another_process_creates_between_our_look_and_our_create_is_opened(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.open

    def created_meanwhile(name: str, flags: int, *args: object, **kwargs: object) -> int:
        if name == "GPU-a.lock" and flags & os.O_CREAT:  # the other process is faster
            (folder / "GPU-a.lock").write_text("theirs")
            monkeypatch.setattr(lockfiles.os, "open", real)
        return real(name, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lockfiles.os, "open", created_meanwhile)
    fd = open_lock_file(folder, "GPU-a.lock", write=True, create=True)
    try:
        assert os.pread(fd, 100, 0) == b"theirs"
    finally:
        os.close(fd)


def test_a_lock_file_that_keeps_appearing_and_disappearing_is_refused_after_100_tries(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.open
    creates: list[int] = []

    def flickering(name: str, flags: int, *args: object, **kwargs: object) -> int:
        if name != "GPU-a.lock":
            return real(name, flags, *args, **kwargs)  # type: ignore[arg-type]
        if flags & os.O_CREAT:
            creates.append(1)
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST))
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))

    monkeypatch.setattr(lockfiles.os, "open", flickering)
    assert _refusal(lambda: open_lock_file(folder, "GPU-a.lock", write=True, create=True)) == (
        "LockFolderError",
        f"Cannot open {folder / 'GPU-a.lock'}: it keeps appearing and disappearing.",
        REMOVE_IT,
    )
    assert len(creates) == 100


def test_a_file_system_that_refuses_chmod_is_a_lock_folder_error_that_leaks_nothing(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(fd: int, mode: int) -> None:
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(lockfiles.os, "fchmod", refused)
    before = _open_fds()
    assert _refusal(lambda: open_lock_file(folder, "GPU-a.lock", write=True, create=True)) == (
        "LockFolderError",
        f"Cannot open {folder / 'GPU-a.lock'} (owned by {ME}): permission denied.",
        CANNOT_WRITE,
    )
    assert _open_fds() <= before
