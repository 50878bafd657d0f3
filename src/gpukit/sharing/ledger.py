"""The ledger: every claim's start and end, appended to per-user files in the lock folder.

>>> from gpukit.sharing.ledger import read_runs
>>> [(r.user, r.gpus, r.exit_code) for r in read_runs(lock_folder())]    # doctest: +SKIP
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
name. Nor can anyone's file stop the others' ``gpukit usage``: reading is bounded (bytes per
owner and in all, files, bytes a line), each line is parsed by :mod:`gpukit.untrusted` and
checked by type and range (times finite, from 1970 to 2106), lines that are no record are
skipped and counted, and runs are settled in one walk (:func:`read_ledger`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
import time
import uuid as uuid_module
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpukit.errors import GpukitError, LockFolderError
from gpukit.holders import user_name
from gpukit.output import dumps
from gpukit.sharing.lockfiles import open_lock_file, opened_folder
from gpukit.untrusted import (
    InvalidInput,
    as_dict,
    as_float,
    as_int,
    as_list,
    as_str,
    parse_json,
)

SCHEMA = "gpukit.ledger/1"
"""The ``schema`` field of every ledger record."""

_PREFIX = "ledger-"
_SUFFIX = ".jsonl"
_FILE_MODE = 0o644  # others read it for `gpukit usage`; only its owner appends
_NAME_TRIES = 8
# This user's writers hold a ledger file's lock for one write: longer means someone else holds it.
_LOCK_WAIT_S = 2.0
# Bounds on reading, since every user can add ledger files: bytes of one owner's files (about
# 20,000 claims; of a larger file its last lines), bytes and files in all, bytes a line. At
# most a few seconds and about 150 MB for `gpukit usage`, whatever the folder holds.
_MAX_PER_OWNER = 8 * 2**20
_MAX_TOTAL = 32 * 2**20
_MAX_FILES = 1024
_MAX_LINE = 64 * 1024
_MAX_COMMAND = 4096  # characters of a command kept in a record: a line stays under _MAX_LINE
_MAX_GPUS = 1024
_LATEST = float(2**32)  # a time past 2106 is no clock's: refused, as a time before 1970
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
    data = (dumps(record, separators=(",", ":")) + "\n").encode()  # finite numbers only
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
            "command": None if command is None else command[:_MAX_COMMAND],
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


@dataclass(frozen=True)
class Ledger:
    """What :func:`read_ledger` read: the runs, and what it left out and why."""

    runs: tuple[Run, ...]
    """Every claim read, oldest first."""
    skipped: int = 0
    """Lines that are no record of their file's owner (malformed, too long, of the wrong type or
    range, naming another uid, cut short by a killed writer): left out."""
    unread: tuple[str, ...] = ()
    """Files, or their older parts, not read because of the bounds on reading (one sentence
    each)."""

    @property
    def notes(self) -> tuple[str, ...]:
        """What a reader of the figures should know: lines skipped, files not read whole."""
        lines = self.skipped
        skipped = (
            (
                f"skipped {lines} ledger line{'s' if lines != 1 else ''} that are no record "
                "of their file's owner (malformed, cut short, of the wrong type or range, or in "
                "another user's name)",
            )
            if lines
            else ()
        )
        return (*skipped, *self.unread)


class _Budget:
    """How many more bytes of ledger files may be read: per owner, and in all."""

    def __init__(self) -> None:
        self.total = _MAX_TOTAL
        self.files = _MAX_FILES
        self.per_owner: dict[int, int] = {}

    def left(self, owner: int) -> int:
        return min(self.total, self.per_owner.get(owner, _MAX_PER_OWNER))

    def spend(self, owner: int, n: int) -> None:
        self.total -= n
        self.per_owner[owner] = self.per_owner.get(owner, _MAX_PER_OWNER) - n


def _read_at_most(fd: int, offset: int, n: int) -> bytes:
    """Up to ``n`` bytes of ``fd`` from ``offset`` (fewer at its end), never more."""
    chunks = []
    while n > 0 and (chunk := os.pread(fd, min(n, 1 << 20), offset)):
        chunks.append(chunk)
        offset += len(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _file_lines(
    folder: Path, name: str, dir_fd: int, budget: _Budget
) -> tuple[int, list[bytes], str | None]:
    """(owner uid, the lines to parse, why part of it was not read) of the ledger file ``name``.

    Read within ``budget``: a file larger than what is left of it is read from its end, whole
    lines only, so that the most recent claims count.
    """
    fd = open_lock_file(folder, name, dir_fd=dir_fd)  # no link, no FIFO, one hard link
    try:
        info = os.fstat(fd)
        owner, size = info.st_uid, info.st_size
        left = budget.left(owner)
        if left <= 0:
            return owner, [], f"{name} ({user_name(owner)}) not read: past the bound of reading"
        offset = max(0, size - left)
        data = _read_at_most(fd, offset, min(size, left))
    finally:
        os.close(fd)
    budget.spend(owner, len(data))
    note = None
    if offset:
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""  # from a whole line on
        note = (
            f"{name} ({user_name(owner)}) is {size} bytes: only its last {len(data)} were read, "
            "so its older claims are not counted"
        )
    return owner, data.split(b"\n"), note


def _valid(line: bytes, owner: int) -> dict[str, Any]:
    """The record on ``line`` if it is one of the file owner's; else :class:`InvalidInput`."""
    record = as_dict(parse_json(line, limit=_MAX_LINE), limit=32, what="a record")
    if record.get("schema") != SCHEMA:
        raise InvalidInput("not a gpukit.ledger/1 record")
    if as_int(record.get("uid"), what="uid") != owner:
        raise InvalidInput("a record in another user's name")  # only its own file's owner's
    if record.get("event") not in ("start", "end"):
        raise InvalidInput("an event that is neither start nor end")
    as_str(record.get("claim"), limit=128, what="claim")
    record["time"] = as_float(record.get("time"), low=0.0, high=_LATEST, what="time")
    return record


def _optional(check: Callable[..., Any], value: object, **limits: Any) -> Any:
    """``check(value)``, or None when the value is absent or not what it should be."""
    try:
        return check(value, **limits)
    except InvalidInput:
        return None


def _start_run(record: dict[str, Any], owner: int, user: str) -> Run:
    gpus = as_list(record.get("gpus"), limit=_MAX_GPUS, what="gpus")
    return Run(
        claim=record["claim"],
        uid=owner,
        user=user,
        pid=_optional(as_int, record.get("pid")),
        gpus=tuple(dict.fromkeys(as_str(g, limit=128, what="a GPU") for g in gpus)),
        indices=_indices(record.get("indices")),
        command=_optional(as_str, record.get("command"), limit=_MAX_COMMAND),
        start=record["time"],
        end=None,
        exit_code=None,
    )


def _indices(value: object) -> tuple[int, ...]:
    try:
        return tuple(as_int(i, high=1 << 16) for i in as_list(value, limit=_MAX_GPUS))
    except InvalidInput:
        return ()


def _runs_of(owner: int, lines: Iterable[bytes]) -> tuple[list[Run], int]:
    """The runs that the lines of one file of ``owner`` hold, and how many lines were skipped."""
    user = user_name(owner)
    starts: dict[str, Run] = {}
    ends: dict[str, tuple[float, int | None]] = {}
    skipped = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = _valid(line, owner)
            if record["event"] == "start":
                if record["claim"] not in starts:
                    starts[record["claim"]] = _start_run(record, owner, user)
            elif record["claim"] not in ends:
                code = _optional(as_int, record.get("exit_code"), low=-(1 << 31), high=1 << 31)
                ends[record["claim"]] = (record["time"], code)
        except InvalidInput:
            skipped += 1  # malformed, another uid's, or cut short by a writer killed mid-line
    runs = []
    for claim_id, run in starts.items():
        if claim_id in ends:
            end, code = ends[claim_id]
            run = replace(run, end=max(end, run.start), exit_code=code)
        runs.append(run)
    return runs, skipped


def read_ledger(folder: Path, live: Iterable[tuple[int | None, float | None]] = ()) -> Ledger:
    """Every claim in the ledger of the lock folder ``folder``, and what was left out.

    ``live`` holds (pid, since) of the claims held now (from their lock files): a run that
    matches one is ``held``.

    Every user can add files here, so reading is bounded: at most :data:`_MAX_PER_OWNER` bytes of
    one owner's files (the most recent lines of a larger file), :data:`_MAX_TOTAL` bytes and
    :data:`_MAX_FILES` files in all, :data:`_MAX_LINE` bytes a line; each line is parsed by
    :mod:`gpukit.untrusted` and checked by type and range, and one that is no record of its
    file's owner is skipped and counted (:attr:`Ledger.skipped`).

    A claim whose holder died without recording its end (killed with SIGKILL) ends at the
    start of the next claim of one of its GPUs, the latest moment it can have ended, once its
    own user has claimed one of them again (another user's records could say anything); until
    then its end stays ``None``.
    """
    if not os.path.lexists(folder):
        return Ledger(runs=())  # no claim was ever made here
    runs: list[Run] = []
    skipped = 0
    unread: list[str] = []
    budget = _Budget()
    with opened_folder(folder) as dir_fd:
        names = [n for n in os.listdir(dir_fd) if n.startswith(_PREFIX) and n.endswith(_SUFFIX)]
        for name in sorted(names):
            if budget.files == 0:
                unread.append(f"{len(names) - _MAX_FILES} more ledger files not read")
                break
            budget.files -= 1
            try:
                owner, lines, note = _file_lines(folder, name, dir_fd, budget)
            except (OSError, GpukitError):
                continue  # a link, a FIFO, a hard link, gone: nobody's records
            found, bad = _runs_of(owner, lines)
            runs.extend(found)
            skipped += bad
            if note:
                unread.append(note)
    runs.sort(key=lambda r: r.start)
    return Ledger(runs=tuple(_settle(runs, set(live))), skipped=skipped, unread=tuple(unread))


def read_runs(folder: Path, live: Iterable[tuple[int | None, float | None]] = ()) -> list[Run]:
    """Every claim in the ledger of the lock folder ``folder``, oldest first
    (:func:`read_ledger`'s runs)."""
    return list(read_ledger(folder, live).runs)


def _settle(runs: Sequence[Run], live: set[tuple[int | None, float | None]]) -> list[Run]:
    """``runs`` (sorted by start) with the held ones marked and the lost ones bounded.

    One walk from the latest start back, keeping per GPU the earliest start seen so far (the
    next claim of it) and the users who claimed it later: each run is looked at a fixed number
    of times, so a ledger of many unended claims costs no more than its sort.
    """
    settled = list(runs)
    next_start: dict[str, float] = {}
    later_users: dict[str, set[int]] = {}
    i = len(runs)
    while i > 0:
        j = i - 1
        start = runs[j].start
        while j > 0 and runs[j - 1].start == start:
            j -= 1  # claims that start together do not bound one another
        for k in range(j, i):
            run = runs[k]
            if run.end is not None:
                continue
            if (run.pid, run.start) in live:
                settled[k] = replace(run, held=True)
                continue
            gpus = run.gpus
            # Any user can append a start of any GPU to their own file, at any time they like:
            # another user's records may only shorten this user's run, so one of its own must
            # bound it first.
            if any(run.uid in later_users.get(g, ()) for g in gpus):
                settled[k] = replace(run, end=min(next_start[g] for g in gpus if g in next_start))
        for k in range(j, i):
            for g in runs[k].gpus:
                next_start[g] = start  # the walk goes back in time: the earliest so far
                later_users.setdefault(g, set()).add(runs[k].uid)
        i = j
    return settled
