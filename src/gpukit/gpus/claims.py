"""Claims: advisory locks that hold GPUs for one process, shared by every user of a machine.

>>> import gpukit as gk
>>> with gk.claim(gk.pick(2)) as held:        # doctest: +SKIP
...     held.indices
[2, 4]

One lock file per GPU UUID in a folder every user can write (``GPUKIT_LOCK_DIR``, default
``<tmp>/gpukit-locks``), locked with ``fcntl.flock``. The kernel drops a flock when the last
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
import getpass
import json
import os
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from gpukit.errors import ClaimError, InvalidArgumentError
from gpukit.gpus import ledger

if TYPE_CHECKING:
    from gpukit.gpus.inventory import GPU

_T = TypeVar("_T")
LOCK_DIR_VAR = "GPUKIT_LOCK_DIR"
_SHARED_DIR_MODE = 0o1777  # world-writable with the sticky bit, like /tmp
_SHARED_FILE_MODE = 0o666  # another user must be able to open the file to lock it later
# A reader probing a lock holds it (shared) for microseconds; a claimer that meets such a probe
# tries again before concluding that the GPU is taken.
_CLAIM_TRIES = 5
_CLAIM_RETRY_S = 0.01


@dataclass(frozen=True)
class Holder:
    """Who holds a claim, as recorded in its lock file."""

    user: str | None
    pid: int | None
    host: str | None
    command: str | None
    since: float | None
    """Unix time the claim was taken."""

    def describe(self) -> str:
        """``'bob (pid 4242: python train.py)'``: for tables and error messages."""
        who = self.user or "?"
        command = f": {self.command[:40]}" if self.command else ""
        return f"{who} (pid {self.pid if self.pid is not None else '?'}{command})"

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)


def lock_dir() -> Path:
    """The lock folder: ``GPUKIT_LOCK_DIR``, or ``gpukit-locks`` under the system temp dir."""
    configured = os.environ.get(LOCK_DIR_VAR)
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "gpukit-locks"


def shared_dir(path: Path) -> Path:
    """Create ``path`` (if missing) so that every user can add files to it; return it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ClaimError(
            f"Cannot create the gpukit lock folder {path} ({exc.strerror}).",
            hint=f"Set {LOCK_DIR_VAR} to a folder every user of the GPUs can write.",
        ) from exc
    with contextlib.suppress(OSError):  # only its owner may chmod; then it is already set up
        if path.stat().st_uid == os.getuid():
            path.chmod(_SHARED_DIR_MODE)
    return path


def _open_shared(path: Path) -> int:
    """Open (creating if needed) a lock file every user can lock, and return its descriptor.

    An existing file is opened without O_CREAT: with ``fs.protected_regular`` Linux refuses
    O_CREAT on another user's file in a sticky folder, even one that is world-writable.
    """
    flags = os.O_RDWR | os.O_CLOEXEC
    while True:
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, _SHARED_FILE_MODE)
        except FileExistsError:
            continue  # another process created it between the two calls: open theirs
        os.fchmod(fd, _SHARED_FILE_MODE)  # the umask took some bits away
        return fd


def _lock_path(folder: Path, uuid: str) -> Path:
    if not uuid or "/" in uuid or uuid.startswith("."):
        raise InvalidArgumentError(
            f"Cannot claim a GPU with UUID {uuid!r}.",
            hint="Claim GPUs from gk.inventory() or gk.pick(), or their GPU- UUIDs.",
        )
    return folder / f"{uuid}.lock"


def _read_holder(data: bytes) -> Holder:
    try:
        raw = json.loads(data.decode())
        return Holder(**{k: raw.get(k) for k in Holder.__dataclass_fields__})
    except (ValueError, TypeError, AttributeError):
        # Half-written by a holder that is locking it right now, or not ours: held, by someone.
        return Holder(None, None, None, None, None)


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def holder_of(path: Path) -> Holder | None:
    """Who holds the lock file at ``path``, or ``None`` when nobody does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 64 * 1024)
        if not data.strip():
            return None  # a holder writes its record before anyone could see the lock matter
        # A shared lock is granted only when no claim (exclusive lock) is held.
        if _try_lock(fd, fcntl.LOCK_SH):
            return None  # its holder died: the kernel dropped the lock, the record stayed
        return _read_holder(data)
    finally:
        os.close(fd)  # also drops a shared lock taken above


def current_claims(folder: Path | None = None) -> dict[str, Holder]:
    """GPU UUID -> holder, for every GPU whose claim is held right now (for ``gpukit list``)."""
    folder = lock_dir() if folder is None else folder
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return {}
    claims = {}
    for name in names:
        if name.endswith(".lock") and not name.startswith("."):
            holder = holder_of(folder / name)
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
                os.ftruncate(fd, 0)  # an empty file reads as free without probing the lock
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


def _acquire(path: Path, record: bytes) -> int | None:
    fd = _open_shared(path)
    for attempt in range(_CLAIM_TRIES):
        if _try_lock(fd, fcntl.LOCK_EX):
            # Record first, then trim: a reader sees the old record or the new one, never "".
            os.pwrite(fd, record, 0)
            os.ftruncate(fd, len(record))
            return fd
        if attempt + 1 < _CLAIM_TRIES and holder_of(path) is not None:
            break  # a real holder, not a passing probe
        time.sleep(_CLAIM_RETRY_S)
    os.close(fd)
    return None


def claim(
    gpus: Iterable[GPU | str], *, command: str | None = None, folder: Path | None = None
) -> Claim:
    """Hold ``gpus`` (GPUs or UUIDs) for this process, or raise ClaimError naming their holders.

    All or nothing: when one GPU is held by another process, none is claimed. ``command`` is
    recorded for ``gpukit list`` (default: this process's command line).
    """
    items = tuple(gpus)
    uuids = [_uuid_of(g) for g in items]
    if len(set(uuids)) != len(uuids):
        raise InvalidArgumentError(
            f"Cannot claim {', '.join(uuids)}: a GPU is listed twice.", hint="List each GPU once."
        )
    folder = shared_dir(lock_dir() if folder is None else folder)
    record = _record(command)
    fds: dict[str, int] = {}
    taken: list[str] = []
    for uuid in uuids:
        path = _lock_path(folder, uuid)
        fd = _acquire(path, record)
        if fd is None:
            holder = holder_of(path)
            taken.append(f"{uuid} by {holder.describe() if holder else 'a process now gone'}")
        else:
            fds[uuid] = fd
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
