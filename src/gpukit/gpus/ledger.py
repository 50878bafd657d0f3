"""The ledger: every claim's start and end, appended to per-user files in the lock folder.

>>> from gpukit.gpus.ledger import read_runs
>>> [(r.user, r.gpus, r.exit_code) for r in read_runs(lock_dir())]    # doctest: +SKIP
[('alice', ('GPU-8d11...',), 0)]

Records are JSON lines (schema ``gpukit.ledger/1``) in ``<lock folder>/ledger-<uid>.jsonl``, one
file per user. A record is written whole with one ``write()`` at the end of the file, under an
exclusive ``flock`` that every writer of that file takes. Why not SQLite:

- a reader of a WAL database needs write access to its ``-shm`` file (or must be able to create
  it); another user who only reads the ledger (``gpukit usage``) could not;
- SQLite creates ``-wal`` and ``-shm`` files beside the database, each one more name a co-user
  could plant as a link in a folder everyone can write;
- an append is the whole write: ``kill -9`` of a writer leaves at most a partial last line,
  which readers skip and the next writer ends before adding its own.

Trust: any user can write the lock folder, so a record is believed only when its ``uid`` field
is the uid of the file's owner as the kernel reports it (``fstat``); the user name shown is the
one the system gives that uid, never one written in a record. Files are opened through
:mod:`.lockfiles` (no links, no FIFOs, one hard link), and a writer appends only to a file it
owns; when another user has taken its file's name, it takes the next (``ledger-<uid>.1.jsonl``).
The ledger therefore never writes to another user's file, and no user can speak in another's
name.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import math
import os
import time
import uuid as uuid_module
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpukit.errors import GpukitError, LockFolderError
from gpukit.gpus.lockfiles import open_lock_file, opened_folder, owner_name

SCHEMA = "gpukit.ledger/1"
"""The ``schema`` field of every ledger record."""

_PREFIX = "ledger-"
_SUFFIX = ".jsonl"
_FILE_MODE = 0o644  # others read it for `gpukit usage`; only its owner appends
_NAME_TRIES = 8
# This user's writers hold a ledger file's lock for one write: longer means someone else holds it.
_LOCK_WAIT_S = 2.0
_MAX_READ = 256 * 2**20  # a ledger file larger than this is not one gpukit wrote
# Claims of this process whose end is not yet written: claim id -> (pid, lock folder). Written at
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


def ledger_name(uid: int, n: int = 0) -> str:
    """``ledger-<uid>.jsonl``, or ``ledger-<uid>.<n>.jsonl`` when another user took that name."""
    return f"{_PREFIX}{uid}{_SUFFIX}" if n == 0 else f"{_PREFIX}{uid}.{n}{_SUFFIX}"


def _own_file(folder: Path, dir_fd: int) -> int:
    """Open this user's ledger file; never another user's file, a link, or a FIFO."""
    uid = os.geteuid()
    refused = []
    for n in range(_NAME_TRIES):
        name = ledger_name(uid, n)
        try:
            fd = open_lock_file(
                folder, name, dir_fd=dir_fd, write=True, create=True, mode=_FILE_MODE
            )
        except (OSError, LockFolderError) as exc:
            # A link, a FIFO, another user's file we may not open: someone else put it
            # there. Try the next name.
            refused.append(f"{name} ({getattr(exc, 'message', None) or exc})")
            continue
        if os.fstat(fd).st_uid == uid:
            return fd
        os.close(fd)
        refused.append(f"{name} (a file of another user)")
    raise LedgerError(
        f"Cannot write the gpukit ledger in {folder}: every name for uid {uid} is taken: "
        f"{'; '.join(refused)}.",
        hint="Ask the owner of those files (or root) to remove them.",
    )


def _lock(fd: int, folder: Path) -> None:
    """Lock this user's ledger file, or raise LedgerError after :data:`_LOCK_WAIT_S`.

    Never waits for ever: flock needs only read access, so any user who can read the file (all
    can, for ``gpukit usage``) can hold it locked, where this user's own writers hold it for
    the moment of one write.
    """
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LedgerError(
                    f"Cannot append to the gpukit ledger in {folder}: another process has kept "
                    f"this user's ledger file locked for {_LOCK_WAIT_S:g} s.",
                    hint="Any user who can read the file can lock it: ask an administrator to "
                    "find the process holding it (/proc/locks).",
                ) from None
            time.sleep(0.005)


def _append(folder: Path, record: dict[str, Any]) -> None:
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    try:
        # The files sit in the lock folder itself, held to its trust model, not in a folder of
        # their own: whoever made that folder could delete everyone's records in it.
        with opened_folder(folder, create=True) as dir_fd:
            fd = _own_file(folder, dir_fd)
    except LockFolderError as exc:
        raise LedgerError(exc.message, hint=exc.hint) from exc
    try:
        # Only this user's processes write this file, and each holds the flock while it
        # appends: the end of the file cannot move under us.
        _lock(fd, folder)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a writer killed mid-line: end its line, keep ours whole
        if os.pwrite(fd, data, size) != len(data):
            raise OSError(errno.ENOSPC, "short write")
    except OSError as exc:
        raise LedgerError(
            f"Cannot append to the gpukit ledger in {folder} ({exc.strerror}).",
            hint="Free space in the lock folder's file system.",
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
    _append(
        folder,
        {
            "schema": SCHEMA,
            "event": "start",
            "claim": claim_id,
            "uid": os.geteuid(),
            "pid": os.getpid(),
            "gpus": list(gpus),
            "indices": list(indices),
            "command": command,
            "time": since,
        },
    )
    _OPEN[claim_id] = (os.getpid(), folder)
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
            "uid": os.geteuid(),
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


def _trusted_records(folder: Path, name: str, dir_fd: int) -> tuple[int, list[dict[str, Any]]]:
    """(owner uid, the records it wrote) of the ledger file ``name``."""
    fd = open_lock_file(folder, name, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if info.st_size > _MAX_READ:
            return info.st_uid, []
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
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
    user = owner_name(owner)
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
    start of the next claim of one of its GPUs, the latest moment it can have ended, once its
    own user has claimed one of them again (another user's records could say anything); until
    then its end stays ``None``.
    """
    runs: list[Run] = []
    if not os.path.lexists(folder):
        return []  # no claim was ever made here
    with opened_folder(folder) as dir_fd:
        for name in sorted(os.listdir(dir_fd)):
            if name.startswith(_PREFIX) and name.endswith(_SUFFIX):
                with contextlib.suppress(OSError, GpukitError):
                    runs.extend(_runs_of(*_trusted_records(folder, name, dir_fd)))
    runs.sort(key=lambda r: r.start)
    held = set(live)
    return [_settle(run, runs, held) for run in runs]


def _settle(run: Run, runs: Sequence[Run], live: set[tuple[int | None, float | None]]) -> Run:
    if run.end is not None:
        return run
    if (run.pid, run.start) in live:
        return replace(run, held=True)
    later = [r for r in runs if r.start > run.start and set(r.gpus) & set(run.gpus)]
    # Any user can append a start of any GPU to their own file, at any time they like: another
    # user's records may only shorten this user's run, so one of its own must bound it first.
    if not any(r.uid == run.uid for r in later):
        return run
    return replace(run, end=min(r.start for r in later))
