"""Which process holds which file lock, as the kernel reports it (``/proc/locks``).

A lock file's *content* is written by whoever holds it, so it can say anything; the kernel's
table of locks cannot be forged. The line of waiters uses it to count a ticket only while the
process its record names really holds it, and the per-user limits use it to count a user's
claims by the user who runs the holding process, not by what a record says.

``/proc/locks`` lists one lock a line::

    1: FLOCK  ADVISORY  WRITE 4242 fd:01:1835021 0 EOF

(kind, mode, pid, ``major:minor:inode`` of the locked file). Lines with ``->`` are processes
blocked waiting for a lock, not holders, and are skipped. The pids are those of this process's
pid namespace (0 for a holder outside it). Only Linux has this table: elsewhere
:func:`exclusive_flocks` returns ``None`` and callers fall back to probing the lock.

Nothing here imports torch.
"""

from __future__ import annotations

_PROC_LOCKS = "/proc/locks"


def exclusive_flocks() -> dict[int, frozenset[int]] | None:
    """``inode -> pids`` holding an exclusive ``flock`` on a file with that inode number now.

    Keyed by inode number alone: on overlay file systems (containers) ``fstat`` and the lock
    table name different devices for one file. A number shared by files of two file systems
    can only add a pid that then has to match the record, the owner and the user of the
    ticket or claim as well. ``None`` where the kernel publishes no lock table (not Linux,
    ``/proc`` not mounted).
    """
    try:
        # Read as bytes: decoding ascii then needs no codec module, which a process that has
        # switched user may no longer be able to import.
        with open(_PROC_LOCKS, "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    held: dict[int, set[int]] = {}
    for line in text.splitlines():
        fields = line.split()
        # id: FLOCK ADVISORY WRITE pid dev:dev:inode start end
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue
        try:
            pid = int(fields[4])
            inode = int(fields[5].rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        held.setdefault(inode, set()).add(pid)
    return {key: frozenset(pids) for key, pids in held.items()}


def process_uid(pid: int) -> int | None:
    """The real uid that runs process ``pid``, or ``None`` when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
