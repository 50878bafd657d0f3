"""GPU time per user from the ledger, for ``gpukit usage``.

>>> from gpukit.sharing.usage import usage
>>> for user in usage(since=time.time() - 7 * 86400).users:     # doctest: +SKIP
...     print(user.user, round(user.gpu_seconds / 3600, 1), user.runs)
alice 41.5 12

A user can edit or erase the records in their own ledger file (it is theirs), but not anyone
else's: these figures are accounting among colleagues, not proof against the user they describe.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpukit.sharing.claims import current_claims
from gpukit.sharing.ledger import Ledger, Run, read_ledger
from gpukit.sharing.lock_folder import lock_folder

SCHEMA = "gpukit.usage/1"
"""The ``schema`` field of :meth:`Usage.to_json`."""


@dataclass(frozen=True)
class UserUsage:
    """What one user used in a period."""

    user: str
    uid: int
    gpu_seconds: float
    """Seconds of GPU time: each run's seconds inside the period times its number of GPUs."""
    runs: int
    """Claims that overlap the period."""
    longest_run_s: float
    """The longest run's seconds inside the period."""
    held_now: int
    """Claims still held (counted up to now)."""
    unknown_end: int
    """Claims whose holder died without recording an end and that no later claim bounds
    (not counted in ``gpu_seconds``)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return {
            "user": self.user,
            "uid": self.uid,
            "gpu_seconds": round(self.gpu_seconds, 3),
            "gpu_hours": round(self.gpu_seconds / 3600, 3),
            "runs": self.runs,
            "longest_run_s": round(self.longest_run_s, 3),
            "held_now": self.held_now,
            "unknown_end": self.unknown_end,
        }


@dataclass(frozen=True)
class Usage:
    """Use per user from ``since`` to ``until``, most GPU time first."""

    since: float | None
    until: float
    users: tuple[UserUsage, ...] = field(default_factory=tuple)
    skipped_lines: int = 0
    """Ledger lines left out: no record of their file's owner (:attr:`Ledger.skipped`)."""
    notes: tuple[str, ...] = ()
    """What the figures leave out and why (lines skipped, files not read whole), one sentence
    each."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict with a ``schema`` field; every number in it is finite."""
        return {
            "schema": SCHEMA,
            "since": self.since,
            "until": self.until,
            "users": [u.to_json() for u in self.users],
            "skipped_lines": self.skipped_lines,
            "notes": list(self.notes),
        }


def _owner_of_process(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def held_ledger(folder: Path | None = None) -> Ledger:
    """The ledger (:func:`.read_ledger`) with ``held`` set for the claims held now.

    A claim counts as held when a lock file names its pid and start, and that pid is alive and
    belongs to the claim's user: lock records are written by whoever holds the lock, so a
    record alone cannot keep another user's finished run counting.
    """
    base = lock_folder() if folder is None else folder
    live = {(h.pid, h.since) for h in current_claims(base).values() if h.pid is not None}
    ledger = read_ledger(base, live)
    runs = tuple(
        replace(r, held=False) if r.held and _owner_of_process(r.pid or -1) != r.uid else r
        for r in ledger.runs
    )
    return replace(ledger, runs=runs)


def held_runs(folder: Path | None = None) -> list[Run]:
    """Every claim in the ledger, oldest first, with ``held`` set for those held now."""
    return list(held_ledger(folder).runs)


def usage(
    since: float | None = None, *, until: float | None = None, folder: Path | None = None
) -> Usage:
    """GPU time, runs and longest run per user from ``since`` (Unix time; None: all) to now.

    A claim still held counts up to ``until`` (default now).
    """
    now = time.time() if until is None else until
    start = float("-inf") if since is None else since
    totals: dict[int, dict[str, Any]] = {}
    ledger = held_ledger(folder)
    for run in ledger.runs:
        end = now if run.held else run.end
        if run.start > now or (end is not None and end < start):
            continue
        if end is None and run.start < start:
            continue  # lost before the period began: it would haunt every later period
        entry = totals.setdefault(
            run.uid,
            {"user": run.user, "seconds": 0.0, "runs": 0, "longest": 0.0, "held": 0, "unknown": 0},
        )
        entry["runs"] += 1
        entry["held"] += run.held
        if end is None:
            entry["unknown"] += 1
            continue
        inside = max(0.0, min(end, now) - max(run.start, start))
        entry["seconds"] += inside * len(run.gpus)
        entry["longest"] = max(entry["longest"], inside)
    users = [
        UserUsage(
            user=e["user"],
            uid=uid,
            gpu_seconds=e["seconds"],
            runs=e["runs"],
            longest_run_s=e["longest"],
            held_now=e["held"],
            unknown_end=e["unknown"],
        )
        for uid, e in totals.items()
    ]
    users.sort(key=lambda u: (-u.gpu_seconds, u.user))
    return Usage(
        since=since,
        until=now,
        users=tuple(users),
        skipped_lines=ledger.skipped,
        notes=ledger.notes,
    )
