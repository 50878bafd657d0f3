"""The one safe way to open the lock folder and the files in it, which other users can write.

Every user of the machine's GPUs adds files to the lock folder, so any of them can also put
something hostile there: a symbolic link named ``<GPU-UUID>.lock`` that points at one of *your*
files, a hard link to it, a FIFO that blocks whoever opens it. Code that opens anything in the
lock folder (claims, the line of waiters) goes through this module, which guarantees:

- the folder itself is opened once, without following a link (``O_NOFOLLOW | O_DIRECTORY``),
  and checked against the trust model (:func:`check_folder`); files are then opened *relative
  to that descriptor* (``dir_fd``), so a folder swapped for a link halfway is never followed;
- files are opened with ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY``: a link is refused
  by the kernel, a FIFO cannot block the open, the descriptor never leaks into a child;
- before the caller reads, writes, locks or truncates anything, ``fstat`` confirms that the
  descriptor is a regular file with exactly one link; anything else is closed at once and
  reported as :class:`~gpukit.errors.UnsafeLockFileError` (what was found, what to do).

The trust model (README, "Security"). A lock folder is accepted when it is a real folder (not a
link) and either

- owned by root or by you, and not writable by others unless it has the sticky bit (as ``/tmp``
  and the folder ``gpukit setup-locks`` makes: only a file's owner may delete or rename it); a
  folder of yours that others could write without the sticky bit gets it added; or
- owned by another user and shared exactly the way gpukit shares the folder it creates on first
  use: world-writable *with* the sticky bit.

Anything else (another user's folder without the sticky bit, a link) is refused with
:class:`~gpukit.errors.LockFolderError`. Lock files themselves may belong to anyone: they are
shared by design (mode 0666, so that the next user can lock them), and gpukit only ever writes
a holder record into a file that passed the checks above. Whoever owns the folder or a lock
file can therefore at worst make GPUs look claimed or free (deny GPUs, or let two jobs share
one, which they could do anyway by using the GPU directly); they can never make gpukit follow a
link, write to, truncate or hang on anything else.

>>> from gpukit.sharing.lockfiles import open_lock_file
>>> fd = open_lock_file(folder, "GPU-....lock", write=True, create=True)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from gpukit.errors import LockFolderError, UnsafeLockFileError
from gpukit.holders import user_name

SHARED_FOLDER_MODE = 0o1777
"""World-writable with the sticky bit, like /tmp: everyone adds files, only owners remove them."""
SHARED_FILE_MODE = 0o666
"""Lock files: another user must be able to open a lock file to lock it later."""

_SETUP = (
    "an administrator can give the machine a folder only root controls: `sudo gpukit setup-locks`."
)
_HELP = "Ask its owner or an administrator to remove it; " + _SETUP
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A hostile user who creates and deletes a lock file in a loop must not keep us looping.
_CREATE_TRIES = 100
# A new lock file is private until its creator widens its mode: how long to wait for that.
_WIDEN_TRIES = 10
_WIDEN_WAIT_S = 0.005


def _kind(mode: int) -> str:
    kinds = {
        stat.S_ISREG: "a regular file",
        stat.S_ISDIR: "a folder",
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISLNK: "a symbolic link",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def _refused(path: Path, exc: OSError, doing: str) -> LockFolderError:
    """The typed error for an OSError met while ``doing`` something with ``path``."""
    if exc.errno == errno.ELOOP:
        return UnsafeLockFileError(
            f"Refused to open {path}: it is a symbolic link, which gpukit never follows in the "
            "lock folder (it could point at one of your files).",
            hint=_HELP,
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        owner = ""
        with contextlib.suppress(OSError):
            owner = f" (owned by {user_name(os.lstat(path).st_uid)})"
        return LockFolderError(
            f"Cannot {doing} {path}{owner}: permission denied.",
            hint="Set GPUKIT_LOCK_DIR to a folder you can write, or ask an administrator to "
            "set up one for every user with `sudo gpukit setup-locks`.",
        )
    return LockFolderError(
        f"Cannot {doing} {path}: {exc.strerror or exc}.",
        hint="Check the disk and the path (GPUKIT_LOCK_DIR, /etc/gpukit/config.toml), or set "
        "GPUKIT_LOCK_DIR to a folder on a local disk every user of the GPUs can write.",
    )


def check_folder(info: os.stat_result, path: Path) -> None:
    """Raise LockFolderError unless a folder with this ``fstat`` fits the trust model.

    See the module's docstring for the rules; ``path`` only names the folder in the message.
    """
    if not stat.S_ISDIR(info.st_mode):
        raise LockFolderError(
            f"The lock folder {path} is {_kind(info.st_mode)}, not a folder.", hint=_HELP
        )
    mode = stat.S_IMODE(info.st_mode)
    others_write = bool(mode & (stat.S_IWGRP | stat.S_IWOTH))
    sticky = bool(mode & stat.S_ISVTX)
    if info.st_uid in (0, os.geteuid()):
        if others_write and not sticky and info.st_uid != os.geteuid():
            raise LockFolderError(
                f"Refused the lock folder {path}: it is writable by other users (mode "
                f"{mode:04o}) without the sticky bit, so anyone could replace its lock files.",
                hint="An administrator can fix it with `sudo chmod +t` on it, or with "
                "`sudo gpukit setup-locks`.",
            )
        return
    if mode & SHARED_FOLDER_MODE != SHARED_FOLDER_MODE:
        raise LockFolderError(
            f"Refused the lock folder {path}: it belongs to {user_name(info.st_uid)} with mode "
            f"{mode:04o}, not shared the way gpukit shares it (1777: everyone may add files, "
            "only their owners may remove them).",
            hint="Set GPUKIT_LOCK_DIR to a folder of your own, or ask its owner to fix it; "
            + _SETUP,
        )


def _create_folder(path: Path) -> None:
    blocker = next((p for p in path.parents if os.path.lexists(p) and not p.is_dir()), None)
    if blocker is not None:
        raise LockFolderError(
            f"Cannot create the lock folder {path}: {blocker} is not a folder.",
            hint="Set GPUKIT_LOCK_DIR (or lock_dir in /etc/gpukit/config.toml) to a path whose "
            "parents are folders.",
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, SHARED_FOLDER_MODE)
        except FileExistsError:
            return  # made by someone else meanwhile, or a link: the checks on open decide
    except OSError as exc:
        raise _refused(path, exc, "create the lock folder") from exc
    # The umask took some bits away; we own it. NotImplementedError: it is a link now (Linux
    # cannot chmod a link itself), put there since: the checks on open refuse it.
    with contextlib.suppress(OSError, NotImplementedError):
        os.chmod(path, SHARED_FOLDER_MODE, follow_symlinks=False)


def open_folder(path: Path, *, create: bool = False) -> int:
    """Open the lock folder ``path`` without following a link, check it, return its descriptor.

    ``create`` makes it (and its parents) first when missing, shared with every user
    (:data:`SHARED_FOLDER_MODE`). Raises LockFolderError when it is missing (without ``create``),
    cannot be made or opened, or does not fit the trust model. The caller closes the descriptor.
    """
    path = Path(path)
    if create and not os.path.lexists(path):
        _create_folder(path)
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise LockFolderError(
                f"Refused the lock folder {path}: it is a symbolic link, and gpukit never "
                "follows a link in a place other users can write.",
                hint="Point GPUKIT_LOCK_DIR (or lock_dir in /etc/gpukit/config.toml) at the "
                "real folder; " + _SETUP,
            ) from exc
        raise _refused(path, exc, "open the lock folder") from exc
    try:
        info = os.fstat(fd)
        check_folder(info, path)
        mode = stat.S_IMODE(info.st_mode)
        if info.st_uid == os.geteuid() and mode & 0o022 and not mode & stat.S_ISVTX:
            os.fchmod(fd, mode | stat.S_ISVTX)  # ours, writable by others: stop them deleting
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def opened_folder(path: Path, *, create: bool = False) -> Iterator[int]:
    """:func:`open_folder` as a context manager: ``with opened_folder(p) as dir_fd: ...``."""
    fd = open_folder(path, create=create)
    try:
        yield fd
    finally:
        os.close(fd)


def _check_file(fd: int, path: Path) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeLockFileError(
            f"Refused to use {path}: it is {_kind(info.st_mode)} (owned by "
            f"{user_name(info.st_uid)}), not a lock file.",
            hint=_HELP,
        )
    if info.st_nlink != 1:
        raise UnsafeLockFileError(
            f"Refused to use {path}: it has {info.st_nlink} hard links, so it is also another "
            f"file somewhere (owned by {user_name(info.st_uid)}), perhaps one of yours.",
            hint=_HELP,
        )


def _check_name(name: str) -> None:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain file name")  # a bug in the caller


def open_lock_file(
    folder: Path,
    name: str,
    *,
    dir_fd: int | None = None,
    write: bool = False,
    create: bool = False,
    exclusive: bool = False,
    mode: int = SHARED_FILE_MODE,
) -> int:
    """Open the file ``name`` in the lock folder safely and return its descriptor.

    ``folder`` is the lock folder (opened and checked by :func:`open_folder`); when ``dir_fd``
    is given, it is that folder's descriptor from :func:`open_folder`, used instead (faster for
    many files; it stays open) and ``folder`` only names it in messages. ``name`` is a
    plain file name, never a path. ``write`` opens read-write; ``create`` creates the file when
    missing with ``mode`` (exact: the umask is undone); ``exclusive`` (with ``create``) fails
    with FileExistsError when it exists. An existing file is opened without ``O_CREAT``, as
    Linux's ``fs.protected_regular`` refuses that on another user's file in a sticky folder.

    The descriptor is close-on-exec and non-blocking, and is a regular file with one link.
    Raises FileNotFoundError when the file is missing and ``create`` is false, FileExistsError
    for ``exclusive``, UnsafeLockFileError for a link, FIFO or other non-file (never written,
    truncated or waited on), and LockFolderError when the folder or file cannot be used.
    """
    _check_name(name)
    if dir_fd is not None:
        return _open_in(dir_fd, Path(folder) / name, name, write, create, exclusive, mode)
    with opened_folder(Path(folder), create=create) as dir_fd:
        return _open_in(dir_fd, Path(folder) / name, name, write, create, exclusive, mode)


def _open_in(
    dir_fd: int, path: Path, name: str, write: bool, create: bool, exclusive: bool, mode: int
) -> int:
    flags = _FILE_FLAGS | (os.O_RDWR if write else os.O_RDONLY)
    denied = 0
    for _ in range(_CREATE_TRIES):
        try:
            if not exclusive:
                try:
                    fd = os.open(name, flags, dir_fd=dir_fd)
                    break
                except FileNotFoundError:
                    if not create:
                        raise
                except PermissionError:
                    # A file another user has just created keeps its umask's mode until its
                    # fchmod below: look again a moment later before calling it refused.
                    denied += 1
                    if denied > _WIDEN_TRIES:
                        raise
                    time.sleep(_WIDEN_WAIT_S)
                    continue
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=dir_fd)
            try:
                os.fchmod(fd, mode)  # the umask took some bits away
            except BaseException:
                os.close(fd)
                raise
            break
        except FileExistsError:
            if exclusive:
                raise
            continue  # another process created it between the two calls: open theirs
        except (FileNotFoundError, UnsafeLockFileError):
            raise
        except OSError as exc:
            raise _refused(path, exc, "open") from exc
    else:
        raise LockFolderError(
            f"Cannot open {path}: it keeps appearing and disappearing.", hint=_HELP
        )
    try:
        _check_file(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd
