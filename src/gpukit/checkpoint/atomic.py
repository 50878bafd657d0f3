"""Atomic writes: a checkpoint file or folder is the old one or the new one, never half of one.

A save goes to a temporary file next to the target, is flushed and fsynced, renamed over the
target, and the folder is fsynced, so a crash at any moment leaves the old file or the new one.
A folder is built the same way beside its target and swapped in as a whole. A process killed
mid-save leaves its temporary file or folder behind, named ``.<target>.<pid>.<random>.gpukit-tmp``;
the next save of the same target removes those whose process is gone (and that belong to this
user).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import io
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from gpukit.checkpoint.paths import kind_of
from gpukit.errors import CheckpointError

__all__ = ["TMP_SUFFIX", "atomic_folder", "atomic_write", "fsync_folder", "write_durable"]

TMP_SUFFIX = ".gpukit-tmp"


def fsync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` durable: the files created and renamed into it.

    A rename or a new file is durable only once its folder is fsynced: every checkpoint and
    training-state write of gpukit ends with this call. Nothing is done where a folder cannot
    be fsynced (Windows, which needs no such step).

    Args:
        folder: the folder whose entries changed.

    Raises:
        OSError: the folder cannot be opened or synced (callers turn it into a typed error).
    """
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _remove_stale(target: Path) -> None:
    """Remove temporary files and folders of earlier saves of ``target`` whose process died."""
    pattern = re.compile(rf"^\.{re.escape(target.name)}\.(\d+)\.[0-9a-f]+{re.escape(TMP_SUFFIX)}$")
    for entry in target.parent.iterdir():
        match = pattern.match(entry.name)
        if not match or _process_alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            info = entry.lstat()
            if info.st_uid != os.geteuid():  # another user's: never touched
                continue
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(entry, ignore_errors=True)  # does not follow links inside
            else:
                entry.unlink()


def _create_temp(target: Path) -> tuple[Path, int]:
    while True:
        name = f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        tmp = target.parent / name
        try:
            # 0o666 minus the umask: the file gets the permissions torch.save would give it.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        return tmp, fd


class _WriteBehind(io.RawIOBase):
    """A file wrapper that starts the disk writing while the serializer is still producing.

    Without it the whole checkpoint sits in the page cache until the final fsync, which then
    waits for all of it; asking the kernel to start writeback every few dozen MiB overlaps the
    disk with serialization, so the fsync that makes the save durable waits only for the tail.
    """

    _EVERY = 32 << 20

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__()
        self._handle = handle
        self._fd = handle.fileno()
        self._written = 0
        self._started = 0

    def writable(self) -> bool:
        return True

    error: OSError | None = None
    """The error the file raised, kept: serializers (torch.save) report it as their own."""

    def write(self, data: Any) -> int:
        try:
            n: int = self._handle.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self._written += n
        if self._written - self._started >= self._EVERY:
            self._handle.flush()
            # POSIX_FADV_DONTNEED on dirty pages starts their writeback without waiting for it.
            os.posix_fadvise(self._fd, self._started, self._written - self._started, _DONTNEED)
            self._started = self._written
        return n

    def flush(self) -> None:
        self._handle.flush()

    def fileno(self) -> int:
        return self._fd


_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 4)


def _write_through(handle: BinaryIO, write: Callable[[BinaryIO], object]) -> None:
    """Run ``write`` on ``handle`` (through :class:`_WriteBehind` where the system has it).

    An ``OSError`` of the file (a full disk, a quota) that the serializer turned into its own
    error (torch.save's ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``)
    is raised as the ``OSError`` it was, so that callers can say what happened.
    """
    if not hasattr(os, "posix_fadvise"):
        write(handle)
        return
    behind = _WriteBehind(handle)
    try:
        write(behind)  # type: ignore[arg-type]
    except OSError:
        raise
    except Exception as exc:
        if behind.error is None:
            raise
        raise behind.error from exc


def atomic_write(target: Path, write: Callable[[BinaryIO, Path], None]) -> None:
    """Run ``write`` on a temporary file next to ``target``, then put it in place atomically.

    ``write`` gets the open file and its path (for writers that open the path themselves; the
    fsync through the open handle covers what they wrote, as it is the same file).
    """
    folder = target.parent
    if not folder.is_dir():
        raise CheckpointError(
            f"Cannot save {target}: the folder {folder} does not exist.",
            hint="Create it first, for example with Path(...).mkdir(parents=True).",
        )
    _remove_stale(target)
    tmp, fd = _create_temp(target)
    try:
        with os.fdopen(fd, "wb") as handle:
            _write_through(handle, lambda out: write(out, tmp))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_folder(folder)


def write_durable(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Create ``path`` (which must not exist), write it with ``write`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as handle:
        _write_through(handle, write)
        handle.flush()
        os.fsync(handle.fileno())


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2 with ``flags``; False where unsupported (other systems, old kernels)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (
        errno.ENOSYS,
        errno.EINVAL,
        errno.ENOTSUP,
    ):  # an old kernel, or a file system without it
        return False
    raise OSError(code, os.strerror(code), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _changed(target: Path, info: os.stat_result | None) -> CheckpointError:
    what = "something" if info is None else f"a {kind_of(info.st_mode)}"
    return CheckpointError(
        f"Cannot save {target}: {what} was put at that path while the checkpoint was being "
        "written; it was left as it is and nothing of this save was kept.",
        hint="Save into a folder that only you can write, or remove what is there and save again.",
    )


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:
        return None


def _move_in(tmp: Path, target: Path) -> None:
    """Put the new folder ``tmp`` at ``target``, which was free: never over anything else."""
    try:
        if not _renameat2(tmp, target, _RENAME_NOREPLACE):
            if _lstat(target) is not None:
                raise _changed(target, _lstat(target))
            os.rename(tmp, target)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY):
            raise _changed(target, _lstat(target)) from None
        raise


def _swap_in(tmp: Path, target: Path, before: os.stat_result) -> None:
    """Swap the new folder ``tmp`` with the old folder at ``target``, then remove the old one.

    Only a real folder (the one checked, by inode) is ever removed: should a link or anything
    else have taken its place, it is swapped back untouched and the save refused.
    """
    parent = target.parent
    if _exchange(tmp, target):
        old = tmp
    else:
        old = parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        os.rename(target, old)
        os.rename(tmp, target)
    found = _lstat(old)
    if found is None or not stat.S_ISDIR(found.st_mode) or found.st_ino != before.st_ino:
        if old == tmp:
            _exchange(tmp, target)
        else:
            os.rename(target, tmp)
            os.rename(old, target)
        raise _changed(target, found)
    shutil.rmtree(old)


def atomic_folder(target: Path, fill: Callable[[Path], None]) -> None:
    """Build a folder with ``fill`` next to ``target``, then put it in place as a whole.

    ``fill`` gets an empty folder to write into. An existing ``target`` is swapped with the new
    folder in one step (Linux ``renameat2``), then removed, so a crash at any moment leaves the
    old folder or the new one. Where the swap is not supported, the old folder is moved aside
    first; a crash between the two renames then leaves it under a ``.gpukit-tmp`` name. A link
    or file put at ``target`` while the folder is built (in a folder others can write) is never
    followed, replaced or removed: the save is refused and its temporary folder removed.
    """
    parent = target.parent
    _remove_stale(target)
    while True:
        tmp = parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            tmp.mkdir()
        except FileExistsError:
            continue
        break
    try:
        fill(tmp)
        fsync_folder(tmp)
        before = _lstat(target)
        if before is None:
            _move_in(tmp, target)
        elif stat.S_ISDIR(before.st_mode):
            _swap_in(tmp, target, before)
        else:
            raise _changed(target, before)
    except BaseException:
        if (found := _lstat(tmp)) is not None and stat.S_ISDIR(found.st_mode):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_folder(parent)
