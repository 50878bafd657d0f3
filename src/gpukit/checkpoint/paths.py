"""Checking checkpoint paths before any work, and turning filesystem errors into typed errors.

Every checkpoint input and output goes through here first, so that a path mistake (a missing
or read-only folder, a folder where a file is wanted, a FIFO that would block a read forever)
is one :class:`~gpukit.errors.CheckpointError` that names the path, found before anything is
read or written.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

from gpukit import untrusted
from gpukit.errors import CheckpointError

__all__ = [
    "check_input",
    "check_inside",
    "check_output_file",
    "check_output_folder",
    "fd_path",
    "fs_error",
    "kind_of",
    "make_parents",
    "open_content",
    "parents_to_make",
]

_KINDS = (
    (stat.S_ISDIR, "folder"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISLNK, "symbolic link"),
)


def _access(path: Path, mode: int) -> bool:
    # The effective user's rights: those the open() that follows will be judged by.
    if os.access in os.supports_effective_ids:
        return os.access(path, mode, effective_ids=True)
    return os.access(path, mode)


def kind_of(mode: int) -> str:
    """``"file"``, ``"folder"``, ``"FIFO (named pipe)"``... for an ``st_mode``."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "file" if stat.S_ISREG(mode) else "special file"


def fs_error(path: Path, exc: OSError, doing: str) -> CheckpointError:
    """A CheckpointError for an OSError met while ``doing`` (``"read"``...) to ``path``."""
    reasons = {
        errno.ENOENT: (
            "does not exist",
            "Check the path (relative paths start from the current folder).",
        ),
        errno.EACCES: (
            "permission denied",
            "Check the permissions (ls -l), or use a path you can access.",
        ),
        errno.EPERM: (
            "operation not permitted",
            "Check the permissions (ls -l), or use a path you can access.",
        ),
        errno.EROFS: ("read-only file system", "Write somewhere else."),
        errno.ENOSPC: (
            "no space left on the device",
            "Free some space (df -h), or write somewhere else.",
        ),
        errno.EDQUOT: ("disk quota exceeded", "Free some space, or write somewhere else."),
        errno.ENOTDIR: ("a part of the path is a file, not a folder", "Check the path."),
        errno.EISDIR: ("it is a folder", "Pass a file path."),
        errno.ENAMETOOLONG: ("the name is too long", "Use a shorter path."),
        errno.ELOOP: ("too many symbolic links", "Check the path."),
    }
    reason, hint = reasons.get(
        exc.errno or 0, (exc.strerror or type(exc).__name__, "Check the path and the disk.")
    )
    return CheckpointError(f"Cannot {doing} {path}: {reason}.", hint=hint)


def check_input(path: Path) -> os.stat_result:
    """The ``stat`` of an existing, readable checkpoint file or folder; anything else refused.

    A FIFO, socket or device is refused without being opened (reading a FIFO with no writer
    blocks forever), and a file is opened once, non-blocking, to prove it can be read.
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        raise CheckpointError(
            f"No checkpoint at {path}: the file does not exist.",
            hint="Check the path (relative paths start from the current folder).",
        ) from None
    except OSError as exc:
        raise fs_error(path, exc, "read") from None
    if stat.S_ISDIR(info.st_mode):
        if not _access(path, os.R_OK | os.X_OK):
            raise fs_error(path, PermissionError(errno.EACCES, "denied"), "read the folder")
        return info
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(
            f"{path} is a {kind_of(info.st_mode)}, not a checkpoint file.",
            hint="Pass a checkpoint file (*.pt, *.safetensors, ...) or a checkpoint folder.",
        )
    try:
        # O_NONBLOCK: should the path have become a FIFO since the stat, opening cannot hang.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise fs_error(path, exc, "read") from None
    try:
        opened = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(opened.st_mode):
        raise CheckpointError(
            f"{path} is a {kind_of(opened.st_mode)}, not a checkpoint file.",
            hint="Pass a checkpoint file (*.pt, *.safetensors, ...) or a checkpoint folder.",
        )
    return opened


def _check_parent(path: Path) -> None:
    folder = path.parent
    try:
        info = folder.stat()
    except FileNotFoundError:
        raise CheckpointError(
            f"Cannot save {path}: the folder {folder} does not exist.",
            hint="Create it first, for example with Path(...).mkdir(parents=True).",
        ) from None
    except OSError as exc:
        raise fs_error(folder, exc, "write to") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointError(
            f"Cannot save {path}: {folder} is a {kind_of(info.st_mode)}, not a folder.",
            hint="Check the path.",
        )
    if not _access(folder, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"Cannot save {path}: the folder {folder} is not writable by this user.",
            hint="Save somewhere you can write, or fix the folder's permissions.",
        )


def check_output_file(path: Path) -> None:
    """Refuse, before any work, a single-file save that cannot succeed."""
    _check_parent(path)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise fs_error(path, exc, "write to") from None
    if stat.S_ISDIR(info.st_mode):
        raise CheckpointError(
            f"Cannot save {path}: a folder of that name exists, and the suffix "
            f"{path.suffix or '(none)'} asks for a single file.",
            hint="Pick another file name, or save a sharded folder under a name without a suffix.",
        )
    if not stat.S_ISREG(info.st_mode) and not stat.S_ISLNK(info.st_mode):
        raise CheckpointError(
            f"Cannot save {path}: it is a {kind_of(info.st_mode)}, not a file.",
            hint="Pick another file name.",
        )


def check_output_folder(path: Path, replaceable: Callable[[str], bool]) -> None:
    """Refuse, before any work, a folder save that cannot succeed or would delete other files.

    An existing folder is replaced as a whole, so it may hold only names in ``replaceable``
    (the files a checkpoint layout writes) that ``replaceable`` accepts.
    """
    _check_parent(path)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise fs_error(path, exc, "write to") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointError(
            f"Cannot save a checkpoint folder at {path}: a {kind_of(info.st_mode)} of that name "
            "exists.",
            hint="Pick another name, or give the path a suffix (.safetensors, .pt) for one file.",
        )
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise fs_error(path, exc, "read the folder") from None
    others = [name for name in names if not replaceable(name)]
    if others:
        shown = ", ".join(others[:6]) + (" ..." if len(others) > 6 else "")
        raise CheckpointError(
            f"Cannot save a checkpoint folder at {path}: the folder exists and holds other files "
            f"({shown}), which replacing it would delete.",
            hint="Save into a new folder, or move those files away first.",
        )


def parents_to_make(path: Path) -> bool:
    """Whether ``path``'s parent folder is missing and can be made (``mkdir -p``), checked now.

    False when the parent exists (:func:`check_output_file` and :func:`check_output_folder`
    judge it). When it is missing, the nearest existing folder above it must be a folder this
    user can write; a file in the way or a read-only folder is refused before any work.
    """
    try:
        path.parent.lstat()
    except (FileNotFoundError, NotADirectoryError):  # the file in the way is named below
        pass
    except OSError as exc:
        raise fs_error(path.parent, exc, "write to") from None
    else:
        return False
    anchor = path.parent.parent
    while True:
        try:
            info = anchor.stat()
            break
        except (FileNotFoundError, NotADirectoryError):
            anchor = anchor.parent
        except OSError as exc:
            raise fs_error(anchor, exc, "write to") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CheckpointError(
            f"Cannot save {path}: {anchor} is a {kind_of(info.st_mode)}, not a folder, so "
            f"{path.parent} cannot be created.",
            hint="Check the path.",
        )
    if not _access(anchor, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"Cannot save {path}: {path.parent} does not exist, and the folder {anchor} is not "
            "writable by this user to create it.",
            hint="Save somewhere you can write, or create the folder first.",
        )
    return True


def make_parents(path: Path) -> None:
    """Create ``path``'s missing parent folders, as ``mkdir -p`` does."""
    try:
        os.makedirs(path.parent, exist_ok=True)
    except OSError as exc:
        raise fs_error(path.parent, exc, "create the folder") from None


# Hugging Face's cache: <cache>/models--org--name/snapshots/<revision>/<file> is a link into
# <cache>/models--org--name/blobs/.
_HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def _link_roots(folder: Path) -> list[str]:
    """Where links inside ``folder`` may lead: the folder itself and, for a Hugging Face cache
    snapshot, its repository's ``blobs/``."""
    real = os.path.realpath(folder)
    roots = [real]
    parts = Path(real).parts
    for i in range(len(parts) - 1):
        if parts[i].startswith(_HF_REPO_PREFIXES) and parts[i + 1] == "snapshots":
            roots.append(os.path.join(*parts[: i + 1], "blobs"))
    return roots


def _opened_at(fd: int, path: Path) -> str:
    # The kernel's name of what was opened: no second lookup that a swapped link could change.
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # pragma: no cover - no /proc (not Linux)
        return os.path.realpath(path)


def _inside(target: str, root: str) -> bool:
    return target == root or target.startswith(root.rstrip(os.sep) + os.sep)


def open_content(path: Path, *, folder: Path | None = None) -> int:
    """A read-only descriptor of the checkpoint file ``path``: a regular file, opened without
    blocking; anything else is a :class:`~gpukit.errors.CheckpointError` naming it.

    ``folder`` is the checkpoint folder that holds ``path`` (None for a path the user named,
    whose links are the user's own choice). A link inside the folder is followed only to a file
    inside the same folder or, in a Hugging Face cache snapshot, into its repository's
    ``blobs/``: a stranger's folder cannot make gpukit read another file of the user's.
    The caller closes the descriptor.
    """
    try:
        fd = untrusted.open_regular(path, follow=True)
    except untrusted.InvalidInput as exc:
        raise CheckpointError(
            f"{path} is {exc}: refused as part of a checkpoint.",
            hint="A checkpoint is made of regular files; replace it with the real file.",
        ) from None
    except OSError as exc:
        raise fs_error(path, exc, "read") from None
    if folder is None:
        return fd
    try:
        check_inside(fd, path, folder)
    except CheckpointError:
        os.close(fd)
        raise
    return fd


def check_inside(fd: int, path: Path, folder: Path) -> None:
    """Refuse ``fd`` (opened from ``path``) unless it is a file inside the checkpoint ``folder``
    (or, in a Hugging Face cache snapshot, in its repository's ``blobs/``); see
    :func:`open_content`. The caller closes the descriptor either way."""
    target = _opened_at(fd, path)
    if not any(_inside(target, root) for root in _link_roots(folder)):
        raise CheckpointError(
            f"{path} is a link to {target}, outside the checkpoint folder {folder}: refused.",
            hint="A checkpoint folder's links may point only inside it (or, in a Hugging Face "
            "cache, into its blobs/). Copy the file into the folder, or pass that file itself.",
        )


def fd_path(fd: int, path: Path) -> str:
    """A name that opens the very file behind ``fd`` (``/proc/self/fd/N``), for readers that
    take only a name (safetensors, memory-mapped torch.load); ``path`` where there is no /proc."""
    name = f"/proc/self/fd/{fd}"
    return name if os.path.exists(name) else str(path)
