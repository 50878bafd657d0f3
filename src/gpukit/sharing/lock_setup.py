"""An administrator's lock folder: owned by root, named in the machine's config file.

``sudo gpukit setup-locks`` calls :func:`setup_lock_dir`. With the default folder under /tmp,
whoever uses gpukit first owns it, and a hostile owner could delete lock files (letting two jobs
share a GPU) or make it unusable (denying GPUs to gpukit users). A folder root owns, whose lock
files root made in advance, leaves a co-user only what any user can do anyway: hold a GPU.

What it does, each step safe to repeat:

1. checks that every parent of the folder is root's, not writable by others (or sticky) and
   not a symbolic link, walking from ``/`` one component at a time without following links, so
   no user can swap the folder or re-point the path later; refuses a folder that exists and
   is not root's, or is a link;
2. makes the folder (and its ``queue`` subfolder for the line of waiters) root's, mode 1777:
   every user adds files, only their owners remove them;
3. creates a lock file, root's and mode 0666, for every GPU and MIG instance NVML reports,
   giving existing ones to root (``fchown`` on the opened file: a held lock stays held), so no
   user owns, and so can delete, the lock file of a GPU that exists today;
4. writes ``lock_dir = "<folder>"`` into the config file (``/etc/gpukit/config.toml``), at the
   top, keeping what else it holds; a config that names another folder is left alone, and the
   administrator is told to edit it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gpukit.errors import LockFolderError
from gpukit.holders import user_name
from gpukit.sharing.lock_folder import ADMIN_LOCK_FOLDER, config_path, read_config
from gpukit.sharing.lockfiles import (
    SHARED_FILE_MODE,
    SHARED_FOLDER_MODE,
    open_folder,
    open_lock_file,
    opened_folder,
)
from gpukit.sharing.waiters import QUEUE
from gpukit.untrusted import printable


@dataclass
class SetupReport:
    """What :func:`setup_lock_dir` found and did, for the command to print."""

    folder: Path
    config: Path | None
    lock_files: list[str] = field(default_factory=list)
    """The GPU and MIG UUIDs that have a root-owned lock file now."""
    config_written: bool = False
    """True when the config file was created or lock_dir was added to it."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _check_parent(info: os.stat_result, path: Path) -> None:
    """Refuse a parent of the lock folder that another user controls."""
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != 0 or (mode & 0o022 and not mode & stat.S_ISVTX):
        raise LockFolderError(
            f"Refused to set up a lock folder in {path}: it belongs to "
            f"{user_name(info.st_uid)} with mode {mode:04o}, so another user could replace "
            "the lock folder later.",
            hint=f"Choose a place only root controls, such as {ADMIN_LOCK_FOLDER}.",
        )


def _not_a_folder(dir_fd: int, name: str, path: Path, folder: Path) -> LockFolderError:
    """The error for a component of the path that is a link or no folder."""
    try:
        info = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        info = None
    if info is not None and stat.S_ISLNK(info.st_mode):
        try:
            target = printable(os.readlink(name, dir_fd=dir_fd)) or "?"
        except OSError:
            target = "?"
        return LockFolderError(
            f"Refused to set up the lock folder {folder}: {path} is a symbolic link (to "
            f"{target}, made by {user_name(info.st_uid)}), so the path the config names could "
            "be made to lead to another folder later.",
            hint="Name the folder by a path without links, such as "
            f"{ADMIN_LOCK_FOLDER} (`readlink -f {path}` shows where the link leads; use that "
            "place only if root owns every folder on the way).",
        )
    return LockFolderError(
        f"Refused to set up the lock folder {folder}: {path} is not a folder.",
        hint=f"Choose a path whose parents are folders, such as {ADMIN_LOCK_FOLDER}.",
    )


def _open_component(dir_fd: int, name: str, path: Path, folder: Path, create: bool) -> int | None:
    """``name`` in ``dir_fd`` opened as a folder without following a link; made (0755) when
    missing and ``create``, else None."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _not_a_folder(dir_fd, name, path, folder) from None
        raise
    made = False
    with contextlib.suppress(FileExistsError):  # made by someone else meanwhile: checked after
        os.mkdir(name, 0o700, dir_fd=dir_fd)
        made = True
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _not_a_folder(dir_fd, name, path, folder) from None
        raise
    if made and os.fstat(fd).st_uid == 0:
        os.fchmod(fd, 0o755)  # whatever the umask: every user must reach the folder
    return fd


def _walk_parents(folder: Path, *, create: bool) -> int | None:
    """The descriptor of ``folder``'s parent, reached from ``/`` one component at a time.

    No component may be a link (each is opened with ``O_NOFOLLOW``, relative to the one
    before), and each must be root's and not writable by others without the sticky bit: then
    the path the config names leads to this folder for as long as root keeps it so. A missing
    component is made, root's and 0755, with ``create``; without it, the walk stops there and
    returns None, having checked every component that exists.
    """
    fd = os.open("/", _DIR_FLAGS)
    path = Path("/")
    try:
        _check_parent(os.fstat(fd), path)
        for name in folder.parts[1:-1]:
            path = path / name
            child = _open_component(fd, name, path, folder, create)
            os.close(fd)
            if child is None:
                return None
            fd = child
            _check_parent(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_root_folder(folder: Path) -> None:
    """Make ``folder`` (and missing parents, 0755) root's and shared (1777)."""
    parent_fd = _walk_parents(folder, create=True)
    assert parent_fd is not None
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder.name, 0o700, dir_fd=parent_fd)  # not shared until root's and sticky
        try:
            fd = os.open(folder.name, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _not_a_folder(parent_fd, folder.name, folder, folder) from None
            raise
    finally:
        os.close(parent_fd)
    try:
        owner = os.fstat(fd).st_uid
        if owner != 0:
            raise LockFolderError(
                f"Refused to take over {folder}: it belongs to {user_name(owner)}, who may have "
                "put anything in it.",
                hint="Remove it (or choose another path) and run `gpukit setup-locks` again.",
            )
        os.fchmod(fd, SHARED_FOLDER_MODE)
    finally:
        os.close(fd)


def _own_lock_file(folder: Path, dir_fd: int, uuid: str) -> None:
    fd = open_lock_file(folder, f"{uuid}.lock", dir_fd=dir_fd, write=True, create=True)
    try:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, SHARED_FILE_MODE)
    finally:
        os.close(fd)


def _config_is_set(path: Path, folder: Path) -> bool:
    """True when the config already names ``folder``; raises when it names another."""
    current = read_config(path).get("lock_dir")
    if current is None:
        return False
    if Path(str(current)) == folder:
        return True
    raise LockFolderError(
        f"{path} already sets lock_dir = {json.dumps(str(current))}; nothing was changed.",
        hint=f"Edit it to say lock_dir = {json.dumps(str(folder))}, or run setup-locks "
        "with --no-config.",
    )


def _write_config(path: Path, folder: Path) -> None:
    old = path.read_bytes() if path.exists() else b""
    # At the top: a key added at the end could land inside a [table] of the file.
    line = (
        "# the lock folder of every gpukit user (gpukit setup-locks)\n"
        f"lock_dir = {json.dumps(str(folder))}\n"  # a JSON string is a TOML basic string
    )
    if not path.parent.exists():
        path.parent.mkdir(parents=True)
        path.parent.chmod(0o755)  # every user reads the config
    temp = path.with_name(f".{path.name}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(line.encode() + old)
        os.fchmod(file.fileno(), 0o644)
    os.replace(temp, path)


def setup_lock_dir(
    folder: Path = ADMIN_LOCK_FOLDER,
    *,
    uuids: Iterable[str] = (),
    config: Path | None = None,
    write_config: bool = True,
) -> SetupReport:
    """Set up ``folder`` as the machine's root-owned lock folder (see the module docstring).

    ``uuids`` are the GPUs (and MIG instances) to make lock files for; ``config`` is the config
    file (default :func:`~gpukit.sharing.lock_folder.config_path`). Must run as root. Raises
    LockFolderError, having changed nothing unsafe, when a step is refused.
    """
    if os.geteuid() != 0:
        raise LockFolderError(
            "Setting up the machine's lock folder needs root: it must belong to root so that no "
            "user can delete or replace lock files.",
            hint="Run it as `sudo gpukit setup-locks`.",
        )
    if not folder.is_absolute():
        raise LockFolderError(
            f"{folder} is not an absolute path.", hint=f"Use e.g. {ADMIN_LOCK_FOLDER}."
        )
    folder = Path(os.path.normpath(folder))
    if folder == Path("/"):
        raise LockFolderError("/ cannot be the lock folder.", hint=f"Use e.g. {ADMIN_LOCK_FOLDER}.")
    config = config_path() if config is None else config
    report = SetupReport(folder, config if write_config else None)
    try:
        checked = _walk_parents(folder, create=False)  # refuse before changing anything
    except OSError as exc:
        raise LockFolderError(
            f"Cannot set up the lock folder {folder}: {exc.strerror or exc}.",
            hint="Check the path and run it again.",
        ) from exc
    if checked is not None:
        os.close(checked)
    config_done = _config_is_set(config, folder) if write_config else True
    try:
        _make_root_folder(folder)
        with opened_folder(folder) as dir_fd:
            if not os.path.lexists(folder / QUEUE):
                os.mkdir(QUEUE, 0o700, dir_fd=dir_fd)
        queue_fd = open_folder(folder / QUEUE)
        try:
            if os.fstat(queue_fd).st_uid != 0:
                raise LockFolderError(
                    f"Refused {folder / QUEUE}: it belongs to "
                    f"{user_name(os.fstat(queue_fd).st_uid)}.",
                    hint="Remove it and run `gpukit setup-locks` again.",
                )
            os.fchmod(queue_fd, SHARED_FOLDER_MODE)
        finally:
            os.close(queue_fd)
        with opened_folder(folder) as dir_fd:
            for uuid in uuids:
                _own_lock_file(folder, dir_fd, uuid)
                report.lock_files.append(uuid)
        if not config_done:
            _write_config(config, folder)
            report.config_written = True
    except LockFolderError:
        raise
    except OSError as exc:
        raise LockFolderError(
            f"Cannot set up the lock folder {folder}: {exc.strerror or exc} "
            f"({exc.filename or folder}).",
            hint="Check the path and the disk, and run it again.",
        ) from exc
    return report
