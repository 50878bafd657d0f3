"""The ledger: every claim's start and end, appended to per-user files in the lock folder.

>>> from gpukit.gpus.ledger import usage
>>> for user in usage(since=time.time() - 7 * 86400).users:     # doctest: +SKIP
...     print(user.user, user.gpu_seconds / 3600, user.runs)
alice 41.5 12

Records are JSON lines in ``<lock folder>/ledger/<uid>.jsonl``, one file per user, opened with
``O_APPEND`` and written with one ``write()`` each, under an exclusive ``flock``. Why not SQLite:

- a reader of a WAL database needs write access to its ``-shm`` file (or must be able to create
  it); another user who only reads the ledger (``gpukit usage``) could then fail or, worse,
  would need a file every user can write, which a hostile co-user could rewrite;
- SQLite creates ``-wal`` and ``-shm`` files beside the database, each one more name a
  co-user could plant as a link in a folder everyone can write;
- an append is the whole write: ``kill -9`` of a writer leaves at most a partial last line,
  which readers skip and the next writer ends before adding its own.

Trust: any user can write the lock folder, so a record is believed only when its ``uid`` field
is the uid of the file's owner as the kernel reports it (``fstat``); the user name shown is the
one ``/etc/passwd`` gives that uid, never the one written in the record. A writer appends only
to a regular file it owns with one link, opened without following links; when another user has
taken its file name, it takes the next one (``<uid>.1.jsonl``...). The ledger therefore never
writes to another user's file and no user can speak in another's name.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import math
import os
import stat
import time
import uuid as uuid_module
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpukit.errors import GpukitError

SCHEMA = "gpukit.ledger/1"
"""The ``schema`` field of every ledger record."""

_SUFFIX = ".jsonl"
_DIR_MODE = 0o1777  # every user adds a file; only its owner may remove or rename it
_FILE_MODE = 0o644  # others read it for `gpukit usage`; only its owner appends
_NAME_TRIES = 8
_MAX_READ = 256 * 2**20  # a ledger file larger than this is not one gpukit wrote
# Claims of this process whose end is not yet written: claim id -> ledger folder. Written at
# exit for gk.claim() on its own line, which is held until the process ends.
_OPEN: dict[str, tuple[int, Path]] = {}


class LedgerError(GpukitError, RuntimeError):
    """The ledger could not be written (its folder or this user's file cannot be used)."""


@dataclass(frozen=True)
class Run:
    """One claim as the ledger knows it."""

    claim: str
    """The claim's id in the ledger."""
    uid: int
    user: str
    """The name of ``uid`` on this machine (not what the record says)."""
    pid: int | None
    gpus: tuple[str, ...]
    """UUIDs of the GPUs held."""
    indices: tuple[int, ...]
    """Their NVML indices when the claim started (empty when claimed by UUID)."""
    command: str | None
    start: float
    end: float | None
    """When it ended; ``None`` while it is held, or when its holder died without saying."""
    exit_code: int | None
    """The command's exit status under ``gpukit run``; ``None`` for ``gk.claim`` users."""
    held: bool = False
    """Still held now (then it counts up to now)."""


def ledger_dir(lock_folder: Path) -> Path:
    """The ledger's folder inside the lock folder."""
    return lock_folder / "ledger"


def make_ledger_dir(lock_folder: Path) -> Path:
    """The ledger folder, created so that every user can add their own file to it."""
    path = ledger_dir(lock_folder)
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
        if info.st_uid == os.getuid() and stat.S_ISDIR(info.st_mode):
            os.chmod(path, _DIR_MODE, follow_symlinks=False)
    except OSError as exc:
        raise LedgerError(
            f"Cannot create the gpukit ledger folder {path} ({exc.strerror}).",
            hint="Set GPUKIT_LOCK_DIR to a folder every user of the GPUs can write.",
        ) from exc
    _check_dir(path)
    return path


def _check_dir(path: Path) -> None:
    """Refuse a ledger folder that a co-user could have planted: a link, or theirs to empty."""
    try:
        info = os.lstat(path)
        trusted = {0, os.getuid(), os.stat(path.parent).st_uid}
    except OSError as exc:
        raise LedgerError(f"Cannot read the gpukit ledger folder {path} ({exc.strerror}).") from exc
    mode = stat.S_IMODE(info.st_mode)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid not in trusted
        or (mode & 0o022 and not mode & stat.S_ISVTX)
    ):
        raise LedgerError(
            f"Refusing the gpukit ledger folder {path}: it is not a folder made by gpukit "
            f"(a link, another user's folder, or writable by others without the sticky bit).",
            hint="Ask root or the lock folder's owner to remove it; gpukit makes it again.",
        )


def _user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def _own_file(folder: Path) -> int:
    """Open this user's ledger file for appending; never another user's file, never a link."""
    uid = os.getuid()
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    refused = []
    for n in range(_NAME_TRIES):
        path = folder / (f"{uid}{_SUFFIX}" if n == 0 else f"{uid}.{n}{_SUFFIX}")
        try:
            fd = os.open(path, flags, _FILE_MODE)
        except OSError as exc:
            # ELOOP: a link; EACCES/EPERM: another user's file in the sticky folder;
            # ENXIO: a FIFO nobody reads. Someone else put it there: try the next name.
            refused.append(f"{path.name} ({exc.strerror})")
            continue
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_uid == uid and info.st_nlink == 1:
            with contextlib.suppress(OSError):
                os.fchmod(fd, _FILE_MODE)  # the umask may have taken the read bits away
            return fd
        os.close(fd)
        refused.append(f"{path.name} (not a file of uid {uid})")
    raise LedgerError(
        f"Cannot write the gpukit ledger in {folder}: every name for uid {uid} is taken: "
        f"{', '.join(refused)}.",
        hint="Ask the owner of those files (or root) to remove them.",
    )


def _append(folder: Path, record: dict[str, Any]) -> None:
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    target = make_ledger_dir(folder)
    fd = _own_file(target)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a writer killed mid-line: end its line, keep ours whole
        os.write(fd, data)
    except OSError as exc:
        raise LedgerError(
            f"Cannot append to the gpukit ledger in {target} ({exc.strerror}).",
            hint="Free space in the lock folder's file system, or set GPUKIT_LOCK_DIR.",
        ) from exc
    finally:
        os.close(fd)  # also drops the flock


def record_start(
    gpus: Sequence[str],
    *,
    indices: Sequence[int] = (),
    command: str | None,
    since: float,
    folder: Path,
) -> str:
    """Append the start of a claim of ``gpus`` (UUIDs) by this process; return its ledger id.

    ``folder`` is the lock folder; ``since`` is the claim's start as its lock file records it.
    """
    claim_id = uuid_module.uuid4().hex
    base = folder
    _append(
        base,
        {
            "schema": SCHEMA,
            "event": "start",
            "claim": claim_id,
            "uid": os.getuid(),
            "pid": os.getpid(),
            "gpus": list(gpus),
            "indices": list(indices),
            "command": command,
            "time": since,
        },
    )
    _OPEN[claim_id] = (os.getpid(), base)
    return claim_id


def record_end(claim_id: str, *, exit_code: int | None = None, at: float | None = None) -> None:
    """Append the end of the claim ``claim_id``; ``exit_code`` is its command's, when known."""
    opened = _OPEN.pop(claim_id, None)
    if opened is None:
        return
    _append(
        opened[1],
        {
            "schema": SCHEMA,
            "event": "end",
            "claim": claim_id,
            "uid": os.getuid(),
            "time": time.time() if at is None else at,
            "exit_code": exit_code,
        },
    )


@atexit.register
def _end_open_claims() -> None:
    # A claim made by gk.claim() and never released ends with the process. A child forked by
    # this process inherits the dict but not the claims: only their maker records their end.
    for claim_id, (pid, _) in list(_OPEN.items()):
        if pid == os.getpid():
            with contextlib.suppress(GpukitError):
                record_end(claim_id)


def _trusted_records(path: Path) -> tuple[int, list[dict[str, Any]]] | None:
    """(owner uid, the records it wrote) of the ledger file at ``path``, or None if not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_READ:
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    owner = info.st_uid
    records = []
    for line in b"".join(chunks).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a writer killed mid-write
        if (
            isinstance(record, dict)
            and record.get("schema") == SCHEMA
            and record.get("uid") == owner
            and isinstance(record.get("claim"), str)
            and type(record.get("time")) in (int, float)
            and math.isfinite(record["time"])
        ):
            records.append(record)
    return owner, records


def _ints(value: object) -> tuple[int, ...]:
    if isinstance(value, list) and all(type(v) is int for v in value):
        return tuple(value)
    return ()


def _strs(value: object) -> tuple[str, ...]:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return ()


def _runs_of(owner: int, records: Iterable[dict[str, Any]]) -> list[Run]:
    starts: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    for record in records:
        if record.get("event") == "start":
            starts.setdefault(record["claim"], record)
        elif record.get("event") == "end":
            ends.setdefault(record["claim"], record)
    user = _user_name(owner)
    runs = []
    for claim_id, start in starts.items():
        end = ends.get(claim_id, {})
        pid, code, command = start.get("pid"), end.get("exit_code"), start.get("command")
        runs.append(
            Run(
                claim=claim_id,
                uid=owner,
                user=user,
                pid=pid if type(pid) is int else None,
                gpus=_strs(start.get("gpus")),
                indices=_ints(start.get("indices")),
                command=command if isinstance(command, str) else None,
                start=float(start["time"]),
                end=max(float(end["time"]), float(start["time"])) if end else None,
                exit_code=code if type(code) is int else None,
            )
        )
    return runs


def read_runs(folder: Path, live: Iterable[tuple[int | None, float | None]] = ()) -> list[Run]:
    """Every claim in the ledger of the lock folder ``folder``, oldest first.

    ``live`` holds (pid, since) of the claims held now (from their lock files): a run that
    matches one is ``held``.

    A claim whose holder died without recording its end (killed with SIGKILL) ends at the
    start of the next claim of one of its GPUs, the latest moment it can have ended; with no
    such claim its end stays ``None``.
    """
    target = ledger_dir(folder)
    try:
        _check_dir(target)
        names = sorted(os.listdir(target))
    except (OSError, LedgerError):
        return []
    runs: list[Run] = []
    for name in names:
        if name.endswith(_SUFFIX) and not name.startswith("."):
            found = _trusted_records(target / name)
            if found is not None:
                runs.extend(_runs_of(*found))
    runs.sort(key=lambda r: r.start)
    held = set(live)
    return [_settle(run, runs, held) for run in runs]


def _settle(run: Run, runs: Sequence[Run], live: set[tuple[int | None, float | None]]) -> Run:
    if run.end is not None:
        return run
    if (run.pid, run.start) in live:
        return replace(run, held=True)
    later = [r.start for r in runs if r.start > run.start and set(r.gpus) & set(run.gpus)]
    return replace(run, end=min(later)) if later else run
