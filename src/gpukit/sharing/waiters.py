"""The queue as read from its folder: which waiters hold tickets, in what order, what is ignored.

Each waiter (``gpukit run --wait``, ``gk.acquire(wait=True)``) holds a *ticket* in
``<lock folder>/queue`` for as long as it waits: a file it creates, locks (``flock``) and names
``<time_ns>-<pid>-<hex>.ticket``, holding one JSON record (schema ``gpukit.ticket/1``: pid,
user, uid, how many GPUs, the criteria, the command, since when). Only the first waiter in line
whose request the server's policy allows may claim GPUs, so waiters are served in arrival order.

The criteria are recorded twice: as the sentence :meth:`~gpukit.gpus.criteria.Criteria.describe`
says (``criteria``, for display) and as data (``wants``: the fields of
:meth:`~gpukit.gpus.criteria.Criteria.to_json`, with a schema of their own), so that ``gpukit
queue`` can judge the GPUs for a waiter exactly, without reading the sentence back. ``wants``
was added to the record without changing its schema, so that an older gpukit on the same
machine still counts the waiter (it reads only the fields it knows); a ticket without it (from
an older gpukit) or with one that is refused is still a waiter, whose criteria are unknown.

Why the queue cannot be jumped. Every user can add files to the queue folder, and a file's name
and content are whatever its creator wrote. Arrival order therefore comes from a time the
kernel sets, the ticket's inode change time (``st_ctime_ns``, set when the ticket takes its
name; ``utime`` can set a file's other times back, never this one), with the name only as a
tie-break between tickets of the same clock tick. A ticket made after yours comes after yours,
whatever its name says. Locking a file does not change that time, so a ticket named long ago
and locked only later would take a place from when it was named; a ticket counts from when it
became a live waiter instead (:class:`gpukit.sharing.tickets.Ticket`): a waiter holds a shared
lock on each ticket no one holds when it joins, for as long as it waits, and never waits for
an earlier-named ticket it did not find live on joining.

Why it cannot be jammed. Entries are opened without following links and without blocking
(``O_NOFOLLOW | O_NONBLOCK``) and checked with ``fstat``: a regular file with one link. A ticket
counts only while the process its record names holds its lock (the kernel's lock table,
:mod:`gpukit.sharing.flocks`, says who holds it), the file belongs to the record's uid and user,
and that process runs as the same user. Anything else in the folder (a link, a FIFO, a folder,
a forged or abandoned ticket) is ignored, and :func:`read_queue` reports it in
:attr:`Queue.foreign` (the first :data:`MOST_FOREIGN` by name; the rest are counted). Nothing
here waits on a file, so ``--timeout`` always holds. A waiter that dies (even by SIGKILL) loses
its lock with its life: a dead waiter never blocks the queue.

The kernel's lock table names processes as this process's pid namespace sees them, so waiters
in containers with pid namespaces of their own that share one lock folder do not see each
other's tickets as live; give each such container its own GPUs, or share the pid namespace.

What a co-user can still do: queue honestly (a live process of theirs holding a well-formed
ticket is a waiter, shown with its user, pid and command) and hold real claims.

Nothing here imports torch.
"""

from __future__ import annotations

import fcntl
import heapq
import os
import stat
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from gpukit.errors import LockFolderError, UnsafeLockFileError
from gpukit.gpus.criteria import Criteria
from gpukit.holders import user_name
from gpukit.sharing.flocks import exclusive_flocks, process_uid
from gpukit.sharing.lock_folder import lock_folder
from gpukit.sharing.lockfiles import open_folder, open_lock_file
from gpukit.untrusted import (
    InvalidInput,
    as_dict,
    as_float,
    as_int,
    as_str,
    parse_json,
    printable,
    read_bounded,
)

__all__ = [
    "MOST_FOREIGN",
    "QUEUE",
    "TICKET_MODE",
    "TICKET_SCHEMA",
    "TICKET_SUFFIX",
    "Foreign",
    "Queue",
    "Waiter",
    "read_queue",
    "read_queue_in",
]

TICKET_SCHEMA = "gpukit.ticket/1"
QUEUE = "queue"
"""The queue's folder in the lock folder: ``<lock folder>/queue``."""
TICKET_SUFFIX = ".ticket"
"""How a ticket's name ends: ``<time_ns>-<pid>-<hex>.ticket``."""
_MAX_RECORD = 64 * 1024
MOST_FOREIGN = 20
"""How many entries that are no waiter's ticket :func:`read_queue` lists (the rest are counted)."""
_INVALID = "no valid waiter record"
_MOST_ID = 2**32 - 1  # pids and uids are 32-bit numbers
_MOST_TIME = 1e18  # seconds: bounded, so that a 400-digit integer is refused, not converted
TICKET_MODE = 0o644
"""A ticket's mode: others read it (and lock it shared, to probe); only its owner writes it."""


@dataclass(frozen=True)
class Waiter:
    """One live waiter, as its ticket describes it."""

    position: int
    """Place in line: 1 is served next."""
    pid: int
    user: str
    uid: int
    n: int
    """How many GPUs it waits for."""
    criteria: str
    """What the GPUs must satisfy, as :meth:`Criteria.describe` says it ('' for any idle GPU)."""
    command: str
    since: float
    """Unix time it joined the line, as its record says."""
    ticket: str
    """The ticket's file name in the queue folder."""
    arrived_ns: int
    """The kernel's change time of the ticket (ns): what orders the line."""
    wants: Criteria | None = None
    """The criteria as data, exactly as the waiter gave them; ``None`` when unknown (a ticket
    of an older gpukit, or one whose ``wants`` is refused)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``wants`` as :meth:`Criteria.to_json` writes it, or ``None``)."""
        return {**asdict(self), "wants": None if self.wants is None else self.wants.to_json()}


@dataclass(frozen=True)
class Foreign:
    """An entry of the queue folder that is not a live waiter's ticket, and why."""

    name: str
    why: str


@dataclass(frozen=True)
class Queue:
    """The waiters in service order, and what else the queue folder holds."""

    waiters: tuple[Waiter, ...] = ()
    foreign: tuple[Foreign, ...] = ()
    """The first :data:`MOST_FOREIGN` of them by name: a co-user can fill the folder with junk."""
    foreign_not_listed: int = 0
    """How many more entries are no waiter's ticket, beyond those in ``foreign``."""


def _queue_of(folder: Path | None) -> Path:
    return (lock_folder() if folder is None else Path(folder)) / QUEUE


def read_queue(folder: Path | None = None) -> Queue:
    """The queue of the lock folder ``folder`` (default: the machine's): its waiters in order.

    Never blocks, never follows a link; what does not count as a waiter is in ``foreign``.
    Raises LockFolderError when the queue folder is refused (a link, another user's folder
    that others could write without the sticky bit).

    >>> [(w.position, w.user, w.n) for w in read_queue().waiters]   # doctest: +SKIP
    [(1, 'alice', 2), (2, 'bob', 1)]
    """
    queue = _queue_of(folder)
    if not os.path.lexists(queue):
        return Queue()  # no one has waited here yet
    dir_fd = open_folder(queue)
    try:
        return read_queue_in(dir_fd, queue)
    finally:
        os.close(dir_fd)


def read_queue_in(dir_fd: int, queue: Path, *, tidy: bool = False) -> Queue:
    """The queue of the folder ``queue``, already opened as ``dir_fd`` (as :func:`read_queue`).

    ``tidy`` also removes this user's own tickets whose waiters died: a waiter tidies the
    queue it reads, a reader who only looks never changes it.
    """
    # Every entry named like a ticket is looked at (skipping some would let junk hide a
    # waiter); of the others only the first few names are kept, to be shown.
    others: list[str] = []
    other_count = 0
    with os.scandir(dir_fd) as entries:
        listed = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.name.endswith(TICKET_SUFFIX):
                listed.append((entry.name, entry.inode()))
                continue
            other_count += 1
            others.append(entry.name)
            if len(others) > 2 * MOST_FOREIGN:
                others = heapq.nsmallest(MOST_FOREIGN, others)
    listed.sort()
    # Read after the folder: a ticket is locked before its name appears, so every live ticket
    # listed above is in this table.
    table = exclusive_flocks()
    found: list[Waiter] = []
    foreign = [Foreign(name, "not a ticket") for name in heapq.nsmallest(MOST_FOREIGN, others)]
    foreign_count = other_count
    for name, inode in listed:
        if len(foreign) > 2 * MOST_FOREIGN:
            foreign = heapq.nsmallest(MOST_FOREIGN, foreign, key=lambda f: f.name)
        if table is not None and not table.get(inode):
            try:  # lstat: opens nothing, never blocks
                info: os.stat_result | None = os.lstat(name, dir_fd=dir_fd)
            except OSError:
                info = None
            foreign.append(Foreign(name, _unheld(info)))
            foreign_count += 1
            mine = info is not None and info.st_uid == os.getuid()
            if tidy and mine and info is not None and stat.S_ISREG(info.st_mode):
                _remove_if_abandoned(dir_fd, queue, name)
            continue
        waiter = _waiter(dir_fd, queue, name, inode, table)
        if isinstance(waiter, str):
            foreign.append(Foreign(name, waiter))
            foreign_count += 1
        else:
            found.append(waiter)
    found.sort(key=lambda w: (w.arrived_ns, w.ticket))
    shown = heapq.nsmallest(MOST_FOREIGN, foreign, key=lambda f: f.name)
    return Queue(
        tuple(replace(w, position=i + 1) for i, w in enumerate(found)),
        tuple(shown),
        foreign_count - len(shown),
    )


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _unheld(info: os.stat_result | None) -> str:
    """Why an entry no process locks (``info``: its ``lstat``, if still there) is no ticket."""
    if info is None:
        return "gone"
    return "not held by a live waiter" if stat.S_ISREG(info.st_mode) else _kind(info.st_mode)


def _open_entry(dir_fd: int, queue: Path, name: str) -> int | str:
    """The entry ``name`` opened read-only through :mod:`.lockfiles`, or why it is not a ticket.

    Never follows a link, never blocks (a FIFO), never keeps anything but a regular file with
    one link.
    """
    try:
        return open_lock_file(queue, name, dir_fd=dir_fd)
    except FileNotFoundError:
        return "gone"
    except UnsafeLockFileError:
        try:
            info = os.lstat(name, dir_fd=dir_fd)
        except OSError:
            return "gone"
        if stat.S_ISREG(info.st_mode):
            return f"a file with {info.st_nlink} hard links"
        return _kind(info.st_mode)
    except LockFolderError as exc:
        return f"cannot be opened ({exc.message})"


def _record(data: bytes) -> dict[str, Any] | str:
    """The waiter record in ``data``, or why it is none (every field checked by exact type).

    A co-user writes this: whatever it holds (deep nesting, huge numbers, wrong types) is a
    reason, never an exception.
    """
    try:
        raw = as_dict(parse_json(data, limit=_MAX_RECORD), what="the record")
        if raw.get("schema") != TICKET_SCHEMA:
            raise InvalidInput(f"not a {TICKET_SCHEMA} record")
        return {
            "pid": as_int(raw.get("pid"), low=1, high=_MOST_ID, what="pid"),
            "user": as_str(raw.get("user"), what="user"),
            "uid": as_int(raw.get("uid"), high=_MOST_ID, what="uid"),
            "n": as_int(raw.get("n"), low=1, high=_MOST_ID, what="n"),
            "criteria": as_str(raw.get("criteria"), limit=_MAX_RECORD, what="criteria"),
            "command": as_str(raw.get("command"), limit=_MAX_RECORD, what="command"),
            "since": as_float(raw.get("since"), low=-_MOST_TIME, high=_MOST_TIME, what="since"),
            "wants": _wants(raw.get("wants")),
        }
    except InvalidInput as exc:
        return f"{_INVALID}: {exc}"


def _wants(raw: object) -> Criteria | None:
    """The criteria a record holds as data, or None when it holds none or none that is valid.

    Criteria that are refused make them unknown, not the ticket foreign: the waiter still
    holds its place in line.
    """
    if raw is None:
        return None
    try:
        return Criteria.from_json(raw)
    except InvalidInput:
        return None


def _waiter(
    dir_fd: int, queue: Path, name: str, inode: int, table: dict[int, frozenset[int]] | None
) -> Waiter | str:
    fd = _open_entry(dir_fd, queue, name)
    if isinstance(fd, str):
        return fd
    try:
        info = os.fstat(fd)
        if info.st_ino != inode:
            return "replaced while read"
        try:
            record = _record(read_bounded(fd, _MAX_RECORD))
        except InvalidInput as exc:
            record = f"{_INVALID}: {exc}"
        if isinstance(record, str):
            return record
        pid = record["pid"]
        if table is None:  # no kernel lock table: the lock itself says whether anyone holds it
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return "not held by a live waiter"
            except BlockingIOError:
                pass
        elif pid not in table.get(inode, ()):
            held_by = ", ".join(map(str, sorted(table.get(inode, ()))))
            return f"held by pid {held_by}, not by pid {pid} its record names"
        if info.st_uid != record["uid"]:
            return f"belongs to uid {info.st_uid}, but its record names uid {record['uid']}"
        if record["user"] != user_name(info.st_uid):
            return f"belongs to {user_name(info.st_uid)}, but its record names {record['user']}"
        runner = process_uid(pid)
        if runner is not None and runner != info.st_uid:
            return f"its process {pid} runs as {user_name(runner)}, not as {record['user']}"
    finally:
        os.close(fd)
    return Waiter(
        position=0,
        pid=pid,
        user=record["user"],
        uid=record["uid"],
        n=record["n"],
        # A co-user's ticket reaches terminals: no control character passes.
        criteria=printable(record["criteria"], limit=_MAX_RECORD) or "",
        command=printable(record["command"], limit=_MAX_RECORD) or "",
        since=record["since"],
        ticket=name,
        arrived_ns=info.st_ctime_ns,
        wants=record["wants"],
    )


def _remove_if_abandoned(dir_fd: int, queue: Path, name: str) -> None:
    """Remove a ticket of this user whose waiter died (killed before it could tidy up)."""
    fd = _open_entry(dir_fd, queue, name)
    if isinstance(fd, str):
        return
    try:
        if os.fstat(fd).st_uid != os.getuid():
            return  # the sticky folder lets only its owner remove it
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # granted: no waiter holds it
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
    finally:
        os.close(fd)
