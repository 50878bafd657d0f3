"""Claims: advisory locks that hold GPUs for one process, shared by every user of a machine.

>>> import gpukit as gk
>>> with gk.claim(gk.pick(2)) as held:        # doctest: +SKIP
...     held.indices
[2, 4]

One lock file per GPU UUID in the machine's lock folder (:mod:`.lock_folder`: ``GPUKIT_LOCK_DIR``,
``lock_folder`` in ``/etc/gpukit/config.toml``, or ``/tmp/gpukit-locks``), locked with
``fcntl.flock``. Every user can write that folder, so every file in it is opened through
:mod:`.lockfiles` (no links, no FIFOs, one link only) and every record read from it is
untrusted data, checked field by field. The kernel drops a flock when the last
file descriptor of its holder closes, so a process that crashes or is killed (even with
SIGKILL) never leaves a GPU claimed. The lock file records who holds it as JSON (user, pid,
host, command, since) so that ``gpukit list`` can say who claimed a GPU.

Lock files are never deleted: a flock belongs to an inode, and deleting a file that another
process has just opened would let two processes each lock "the" file for one GPU.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import getpass
import json
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from gpukit.errors import (
    ClaimError,
    InvalidArgumentError,
    LockFolderError,
    UnsafeLockFileError,
)
from gpukit.holders import UNREADABLE, Holder, user_name
from gpukit.sharing import ledger
from gpukit.sharing.flocks import exclusive_flocks, process_uid
from gpukit.sharing.lock_folder import LOCK_FOLDER_VAR, lock_folder
from gpukit.sharing.lockfiles import open_folder, open_lock_file, opened_folder
from gpukit.untrusted import (
    InvalidInput,
    as_dict,
    as_float,
    parse_json,
    printable,
    read_bounded,
)

if TYPE_CHECKING:
    from gpukit.gpus.inventory import GPU

__all__ = ["Claim", "claim", "current_claims", "holder_of", "shared_folder"]

_T = TypeVar("_T")
# A reader probing a lock holds it (shared) for microseconds; a claimer that meets such a probe
# tries again before concluding that the GPU is taken.
_LOCK_TRIES = 5
_LOCK_RETRY_S = 0.01


def shared_folder(path: Path) -> Path:
    """Create ``path`` (if missing) so that every user can add files to it; return it.

    Raises LockFolderError when it cannot be created or does not fit the trust model.
    """
    os.close(open_folder(path, create=True))
    return path


def _lock_path(folder: Path, uuid: str) -> Path:
    if not uuid or "/" in uuid or uuid.startswith("."):
        raise InvalidArgumentError(
            f"Cannot claim a GPU with UUID {uuid!r}.",
            hint="Claim GPUs from gk.inventory() or gk.pick(), or their GPU- UUIDs.",
        )
    return folder / f"{uuid}.lock"


# Held, by someone whose record says nothing gpukit can use: empty, half-written, not ours.
_NOBODY = Holder(None, None, None, None, None, problem=UNREADABLE)
_MAX_HOLDER = 64 * 1024
# Lengths past which a field is cut: a record is shown in one table cell or one message.
_TEXT_LIMITS = {"user": 64, "host": 255, "command": 500}


def _text(value: object, limit: int) -> str | None:
    """A printable string from an untrusted field; None for anything that is not a string."""
    # Control characters could move the cursor or recolour the terminal of `gpukit list`.
    return printable(value, limit=limit)


def _number(value: object, low: float, high: float) -> float | None:
    """A finite number within ``[low, high]`` from an untrusted field; None for anything else."""
    try:
        return as_float(value, low=low, high=high)
    except InvalidInput:
        return None


def _read_holder(data: bytes) -> Holder:
    """The holder a lock file records. Any user can write that file: trust no field of it."""
    try:
        raw = as_dict(parse_json(data, limit=_MAX_HOLDER))
    except InvalidInput:
        # Empty, half-written, emptied by a co-user, or not ours: held, by someone.
        return _NOBODY
    pid = _number(raw.get("pid"), 1, 2**31 - 1)
    return Holder(
        user=_text(raw.get("user"), _TEXT_LIMITS["user"]),
        pid=int(pid) if pid is not None and pid.is_integer() else None,
        host=_text(raw.get("host"), _TEXT_LIMITS["host"]),
        command=_text(raw.get("command"), _TEXT_LIMITS["command"]),
        since=_number(raw.get("since"), 0, 1e12),
    )


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _as_the_kernel_says(
    holder: Holder, inode: int, table: dict[int, frozenset[int]] | None
) -> Holder:
    """``holder`` as its record says, corrected by the kernel's table of locks.

    Whoever holds a lock writes its record, so a record could name root or a colleague: the
    pid the kernel says holds the lock, and the user who runs it, win. Without a table (not
    Linux) or with a holder outside this pid namespace (pid 0), the record is all there is.
    """
    pids = (table or {}).get(inode, frozenset()) - {0}
    if not pids:
        return holder
    if holder.pid in pids:
        uid = process_uid(holder.pid)  # None where /proc hides other users' processes
        return holder if uid is None else replace(holder, user=user_name(uid))
    pid = min(pids)
    uid = process_uid(pid)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = _text(f.read().replace(b"\0", b" ").decode(errors="replace").strip(), 500)
    except OSError:
        command = None
    who = user_name(uid) if uid is not None else None
    return Holder(who, pid, None, command, None, problem=holder.problem)


def _holder_in(
    folder: Path,
    name: str,
    dir_fd: int,
    locks: Callable[[], dict[int, frozenset[int]] | None] = exclusive_flocks,
) -> Holder | None:
    try:
        fd = open_lock_file(folder, name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except UnsafeLockFileError as exc:
        return Holder(None, None, None, None, None, problem=f"unsafe lock file: {exc.message}")
    except LockFolderError as exc:
        return Holder(None, None, None, None, None, problem=f"unreadable lock file: {exc.message}")
    try:
        try:
            data = read_bounded(fd, _MAX_HOLDER)
        except InvalidInput:
            data = b""  # too large to be a record of gpukit's: unreadable
        # Free or held is the lock's word alone, never the content's (anyone can empty a lock
        # file): a shared lock is granted only when no claim (exclusive lock) is held.
        if _try_lock(fd, fcntl.LOCK_SH):
            return None  # free; or its holder died and the kernel dropped the lock
        return _as_the_kernel_says(_read_holder(data), os.fstat(fd).st_ino, locks())
    except OSError:
        return _NOBODY  # cannot tell: count it as taken rather than hand the GPU out twice
    finally:
        os.close(fd)  # also drops a shared lock taken above


def holder_of(path: Path) -> Holder | None:
    """Who holds the lock file at ``path``, or ``None`` when nobody does.

    A lock file that is not safe to open (a link, a FIFO) or cannot be read counts as held, by
    a :class:`Holder` whose ``problem`` says why. Raises LockFolderError when the folder is
    refused.
    """
    path = Path(path)
    if not os.path.lexists(path.parent):
        return None
    with opened_folder(path.parent) as dir_fd:
        return _holder_in(path.parent, path.name, dir_fd)


def current_claims(folder: Path | None = None) -> dict[str, Holder]:
    """GPU UUID -> holder, for every GPU whose claim is held right now (for ``gpukit list``).

    A missing lock folder holds no claims. Raises LockFolderError when the folder is refused
    (a link, another user's folder without the sticky bit): its claims cannot be trusted.
    """
    folder = lock_folder() if folder is None else folder
    if not os.path.lexists(folder):
        return {}
    with opened_folder(folder) as dir_fd:
        try:
            names = sorted(os.listdir(dir_fd))
        except OSError as exc:
            raise LockFolderError(
                f"Cannot list the lock folder {folder}: {exc.strerror}.",
                hint=f"Set {LOCK_FOLDER_VAR} to a folder every user of the GPUs can read.",
            ) from exc
        claims = {}
        table = functools.cache(exclusive_flocks)  # read once, and only if a lock is held
        for name in names:
            if name.endswith(".lock") and not name.startswith("."):
                holder = _holder_in(folder, name, dir_fd, table)
                if holder is not None:
                    claims[name.removesuffix(".lock")] = holder
    return claims


def _uuid_of(gpu: object) -> str:
    uuid = getattr(gpu, "uuid", gpu)
    if isinstance(uuid, str) and uuid.startswith(("GPU-", "MIG-")):
        return uuid
    raise InvalidArgumentError(
        f"Cannot claim {gpu!r}: claims need GPUs (from gk.pick() or gk.inventory()) or UUIDs.",
        hint="Pass gk.pick(n), or `inv.gpu(i)` for the GPU with nvidia-smi index i.",
    )


def _record(command: str | None) -> bytes:
    try:
        user: str | None = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    holder = Holder(
        user=user,
        pid=os.getpid(),
        host=socket.gethostname(),
        command=command if command is not None else " ".join(sys.argv) or None,
        since=time.time(),
    )
    return json.dumps(holder.to_json()).encode()


class Claim:
    """GPUs held by this process until :meth:`release`, the end of a ``with`` block, or exit.

    Dropping the object does not release the GPUs: ``gk.claim(gpus)`` on its own line holds
    them for the rest of the process, as a reader of that line expects.

    The lock descriptors are close-on-exec: a child process does not inherit the claim, so the
    claim ends when this process ends, even if a child lives on.
    """

    def __init__(self, gpus: tuple[GPU | str, ...], fds: dict[str, int], folder: Path) -> None:
        self.gpus = gpus
        self.folder = folder
        self._fds = fds
        self._ledger_id: str | None = None

    @property
    def uuids(self) -> list[str]:
        """The UUIDs held."""
        return list(self._fds)

    @property
    def indices(self) -> list[int]:
        """The NVML (nvidia-smi) indices held, for claims made from GPU objects."""
        return [g.index for g in self.gpus if not isinstance(g, str)]

    @property
    def held(self) -> bool:
        """True until released."""
        return bool(self._fds)

    def release(self, exit_code: int | None = None) -> None:
        """Give the GPUs back. Safe to call twice.

        ``exit_code``: the status of what ran on them, for the ledger (``gpukit usage``).
        """
        if self._ledger_id is not None:
            claim_id, self._ledger_id = self._ledger_id, None
            _ledger_call(ledger.record_end, claim_id, exit_code=exit_code)
        while self._fds:
            _, fd = self._fds.popitem()
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # no record of a claim that has ended stays behind
            os.close(fd)

    def __enter__(self) -> Claim:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        return f"Claim({', '.join(self.uuids) or '-'}, {state})"


def _lock_one(folder: Path, dir_fd: int, name: str, record: bytes) -> int | None:
    fd = open_lock_file(folder, name, dir_fd=dir_fd, write=True, create=True)
    try:
        for attempt in range(_LOCK_TRIES):
            if _try_lock(fd, fcntl.LOCK_EX):
                # Record first, then trim: a reader sees the old record or the new one, never "".
                os.pwrite(fd, record, 0)
                os.ftruncate(fd, len(record))
                return fd
            if attempt + 1 < _LOCK_TRIES and _holder_in(folder, name, dir_fd) is not None:
                break  # a real holder, not a passing probe
            time.sleep(_LOCK_RETRY_S)
    except OSError as exc:
        os.close(fd)
        raise LockFolderError(
            f"Cannot write the lock file {folder / name}: {exc.strerror or exc}.",
            hint="Free space on its disk, or set GPUKIT_LOCK_DIR to a folder on a local disk "
            "that supports file locks.",
        ) from exc
    os.close(fd)
    return None


def claim(
    gpus: Iterable[GPU | str], *, command: str | None = None, folder: Path | None = None
) -> Claim:
    """Hold ``gpus`` (GPUs or UUIDs) for this process, or raise ClaimError naming their holders.

    All or nothing: when one GPU is held by another process, none is claimed. ``command`` is
    recorded for ``gpukit list`` (default: this process's command line).

    Args:
        gpus: the GPUs to hold, or their UUIDs.
        command: what the claim records as its command; None: this process's command line.
        folder: the lock folder; None: :func:`.lock_folder`'s (``$GPUKIT_LOCK_DIR``, the
            configured one, or the default).

    Raises:
        ClaimError: another process holds one of the GPUs (the message names each holder);
            nothing is claimed.
        InvalidArgumentError: an item is no GPU or GPU-/MIG- UUID, or a GPU is listed twice.
        LockFolderError: the lock folder or a lock file in it cannot be used or is refused
            (:mod:`.lockfiles`; exit 5); nothing is claimed then either.
    """
    items = tuple(gpus)
    uuids = [_uuid_of(g) for g in items]
    if len(set(uuids)) != len(uuids):
        raise InvalidArgumentError(
            f"Cannot claim {', '.join(uuids)}: a GPU is listed twice.", hint="List each GPU once."
        )
    folder = lock_folder() if folder is None else Path(folder)
    record = _record(command)
    fds: dict[str, int] = {}
    taken: list[str] = []
    with opened_folder(folder, create=True) as dir_fd:
        try:
            for uuid in uuids:
                name = _lock_path(folder, uuid).name
                fd = _lock_one(folder, dir_fd, name, record)
                if fd is None:
                    holder = _holder_in(folder, name, dir_fd)
                    who = holder.describe() if holder else "a process now gone"
                    taken.append(f"{uuid} by {who}")
                else:
                    fds[uuid] = fd
        except BaseException:
            Claim(items, fds, folder).release()
            raise
    if taken:
        Claim(items, fds, folder).release()
        raise ClaimError(
            f"Cannot claim {len(uuids)} GPU(s): {'; '.join(taken)} already claimed.",
            hint="Pick other GPUs (`gpukit pick` skips claimed ones), or wait with "
            "`gpukit run --wait`.",
        )
    held = Claim(items, fds, folder)
    facts = json.loads(record)
    held._ledger_id = _ledger_call(
        ledger.record_start,
        uuids,
        indices=held.indices,
        command=facts["command"],
        since=facts["since"],
        folder=folder,
    )
    return held


def _ledger_call(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T | None:
    # The ledger is accounting: a claim holds even when it cannot be recorded (a full disk, a
    # co-user squatting this user's ledger names), and says so.
    try:
        return fn(*args, **kwargs)
    except ledger.LedgerError as exc:
        warnings.warn(f"{exc} The claim is not in the ledger.", RuntimeWarning, stacklevel=3)
        return None
