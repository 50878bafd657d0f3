"""How the GPUs of this machine are shared right now: holders, waiters, unclaimed and idle use.

>>> from gpukit.sharing.report import sharing
>>> now = sharing()                                             # doctest: +SKIP
>>> [(w.position, w.user, w.reason) for w in now.waiters]       # doctest: +SKIP
[(1, 'bob', '1 of 2 GPUs qualify'), (2, 'carol', 'behind position 1')]

What ``gpukit queue`` shows. Never imports torch.

- Holders come from the claims' lock files as :func:`~gpukit.sharing.claims.current_claims`
  reads them, checked against the kernel's lock table (``/proc/locks``): where another process
  than the record names holds a lock, that process is shown. The user shown is the owner of the
  holder's process as the kernel reports it, named as everywhere in gpukit (``'uid 54321'`` for
  a uid without an account).
- Waiters come from the queue (:func:`~gpukit.sharing.waiters.read_queue`), in service order,
  each with why it is not served yet.
- Unclaimed use: a process NVML sees on a GPU that no claim of that GPU covers. A claim covers
  its holder and the holder's descendants (``/proc/<pid>/stat`` parents), since ``gpukit run``
  holds the claim while the command it starts uses the GPU.
- Idle claims: every GPU of the claim showed no process and 0% utilisation at every reading
  since ``idle_since``. Readings are this user's own, kept in ``<lock folder>/observed-<uid>
  .json`` (``observed-<uid>.<n>.json``, with a warning, when another user took that name) by
  each ``sharing(observe=True)`` call (each ``gpukit queue``); a reading
  further apart from the previous one than the threshold starts the count again, so a claim is
  called idle only after readings at most one threshold apart, for longer than the threshold.
  Keep ``gpukit queue --watch`` (or a cron job running ``gpukit queue --json``) going to see it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid as uuid_module
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpukit.errors import GpukitError
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.gpus.select import assess
from gpukit.holders import Holder, user_name
from gpukit.output import dumps
from gpukit.sharing import waiters
from gpukit.sharing.claims import current_claims
from gpukit.sharing.lock_folder import lock_folder
from gpukit.sharing.lockfiles import open_lock_file, opened_folder
from gpukit.sharing.policy import holdings, load_policy
from gpukit.sharing.waiters import Foreign, Waiter
from gpukit.untrusted import InvalidInput, as_dict, parse_json, read_bounded

SCHEMA = "gpukit.queue/1"
"""The ``schema`` field of :meth:`Sharing.to_json`."""
IDLE_AFTER_S = 30 * 60.0
"""A claim is idle after this many seconds with no process and 0% utilisation on its GPUs."""
_ANCESTRY_DEPTH = 64


@dataclass(frozen=True)
class HeldClaim:
    """One claim held now: the GPUs one process holds."""

    gpus: tuple[int | None, ...]
    """NVML indices (``None`` for a GPU this machine's NVML does not list)."""
    uuids: tuple[str, ...]
    user: str | None
    pid: int | None
    command: str | None
    since: float | None


@dataclass(frozen=True)
class Waiting:
    """One waiter in the queue, in service order."""

    position: int
    """1 = served next."""
    user: str | None
    pid: int | None
    n: int | None
    """GPUs asked for (``None`` when the waiter's ticket does not say)."""
    criteria: str | None
    since: float | None
    reason: str
    """Why it is not served now, e.g. ``'1 of 2 GPUs qualify'`` or ``'behind position 1'``."""
    command: str | None = None
    """The command that waits, as its ticket records it, control characters shown as ``?``."""


@dataclass(frozen=True)
class UnclaimedUse:
    """A process on a GPU that no claim of that GPU covers."""

    gpu: int
    user: str | None
    pid: int
    command: str | None
    memory: int | None
    """Bytes of GPU memory it holds."""


@dataclass(frozen=True)
class IdleClaim:
    """A claim whose GPUs have been unused for longer than the threshold."""

    gpus: tuple[int | None, ...]
    user: str | None
    pid: int | None
    command: str | None
    idle_since: float
    idle_s: float


@dataclass(frozen=True)
class Sharing:
    """The machine's sharing state at ``taken_at``."""

    taken_at: float
    holders: tuple[HeldClaim, ...]
    waiters: tuple[Waiting, ...]
    unclaimed: tuple[UnclaimedUse, ...]
    idle: tuple[IdleClaim, ...]
    idle_after_s: float
    source: str
    """Where the GPU readings came from (``'nvml'`` or ``'fake:<file>'``)."""
    foreign: tuple[Foreign, ...] = ()
    """Entries of the queue folder that are no live waiter's ticket, and why (links, FIFOs,
    forged or abandoned tickets): what a co-user may have planted there. The first
    :data:`~gpukit.sharing.waiters.MOST_FOREIGN` by name."""
    foreign_not_listed: int = 0
    """How many more such entries the queue folder holds, beyond those in ``foreign``."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict with a ``schema`` field (``gpukit queue --json``)."""
        return {"schema": SCHEMA, **asdict(self)}


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        # "pid (comm) state ppid ...": comm may itself hold ") ", so split at the last one.
        return int(data.rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent... up to init, from ``/proc`` (empty when unknown)."""
    found: list[int] = []
    current: int | None = pid
    while len(found) < _ANCESTRY_DEPTH:
        current = _parent(current) if current is not None else None
        if current is None or current <= 0 or current in found:
            break
        found.append(current)
    return found


def _holders(claims: dict[str, Holder], inv: Inventory) -> list[HeldClaim]:
    """The claims held now, one per holder; ``claims`` as :func:`current_claims` reads them,
    so each holder is already the one the kernel's lock table says."""
    index = {g.uuid: g.index for g in inv.gpus}
    groups: dict[tuple[int | None, float | None, str | None, str | None], list[str]] = {}
    records: dict[tuple[int | None, float | None, str | None, str | None], Holder] = {}
    for uuid, holder in claims.items():
        key = (holder.pid, holder.since, holder.user, holder.command)
        groups.setdefault(key, []).append(uuid)
        records[key] = holder
    held = []
    for key, uuids in groups.items():
        holder = records[key]
        uuids.sort(key=lambda u: (index.get(u) is None, index.get(u) or 0, u))
        held.append(
            HeldClaim(
                gpus=tuple(index.get(u) for u in uuids),
                uuids=tuple(uuids),
                user=holder.user,
                pid=holder.pid,
                command=holder.command,
                since=holder.since,
            )
        )
    held.sort(key=lambda h: (h.since or 0.0, h.pid or 0))
    return held


def _unclaimed(inv: Inventory, held: Sequence[HeldClaim]) -> list[UnclaimedUse]:
    holders_of: dict[int, set[int]] = {}
    for claim in held:
        for index in claim.gpus:
            if index is not None and claim.pid is not None:
                holders_of.setdefault(index, set()).add(claim.pid)
    found = []
    for gpu in inv.gpus:
        pids = holders_of.get(gpu.index, set())
        for proc in gpu.processes:
            if proc.pid in pids or pids.intersection(ancestors(proc.pid)):
                continue
            found.append(
                UnclaimedUse(gpu.index, proc.user, proc.pid, proc.command, proc.used_memory)
            )
    return found


def _refusals(folder: Path) -> Callable[[int | None, int | None], str | None]:
    """``refusal(uid, n)``: why the server's policy keeps that waiter from claiming now."""
    try:
        rules = load_policy(folder)
        held = holdings(folder)
    except GpukitError:  # a policy file that is refused is no limit (gpukit run says why)
        return lambda uid, n: None
    return lambda uid, n: None if uid is None or n is None else rules.refusal(uid, n, held)


def _reasons(
    line: Sequence[Waiter],
    inv: Inventory,
    claims: dict[str, Holder],
    refusal: Callable[[int | None, int | None], str | None],
) -> list[str]:
    """Why each waiter is not served now, with the line's rule: the first waiter whose user
    the policy lets claim is served as soon as enough GPUs qualify."""
    reasons = []
    first_allowed: int | None = None
    for waiter in line:
        n = waiter.n
        refused = refusal(waiter.uid, n)
        if refused:
            reasons.append(refused)
            continue
        if first_allowed is not None:
            reasons.append(f"behind position {first_allowed}")
            continue
        first_allowed = waiter.position
        if waiter.wants is None:
            reasons.append("next in line (criteria unknown)")
            continue
        ok = sum(v.ok for v in assess(inv, waiter.wants, claims))
        reasons.append(
            f"{ok} of {n} GPU{'s' if n != 1 else ''} qualify"
            if ok < n
            else "its GPUs qualify: it claims them at its next poll"
        )
    return reasons


def _waiters(
    line: Sequence[Waiter], inv: Inventory, claims: dict[str, Holder], folder: Path
) -> list[Waiting]:
    if not line:
        return []
    reasons = _reasons(line, inv, claims, _refusals(folder))
    return [
        Waiting(
            position=waiter.position,
            user=waiter.user,
            pid=waiter.pid,
            n=waiter.n,
            criteria=waiter.criteria or "any",
            since=waiter.since,
            reason=reason,
            command=waiter.command or None,
        )
        for waiter, reason in zip(line, reasons, strict=True)
    ]


def _idle_now(claim: HeldClaim, inv: Inventory) -> bool:
    gpus = {g.index: g for g in inv.gpus}
    mine = [gpus.get(i) for i in claim.gpus if i is not None]
    return bool(mine) and all(
        g is not None and not g.processes and g.utilization_gpu == 0 for g in mine
    )


def _claim_key(claim: HeldClaim) -> str:
    return f"{claim.pid}:{claim.since!r}:{','.join(claim.uuids)}"


_OBSERVED_NAMES = 8  # as many names as the ledger tries
_MAX_OBSERVED = 4 * 2**20


def _observations_name(folder: Path, dir_fd: int) -> str | None:
    """The name of this user's readings: ``observed-<uid>.json``, or, when another user has
    taken it (any user can add files to the lock folder), the first of ``observed-<uid>.<n>
    .json`` that is missing or this user's own file, with a warning; None when all are taken.
    """
    uid = os.geteuid()
    taken = []
    for n in range(_OBSERVED_NAMES):
        name = f"observed-{uid}.json" if n == 0 else f"observed-{uid}.{n}.json"
        try:
            info = os.lstat(name, dir_fd=dir_fd)
        except FileNotFoundError:
            break
        except OSError:
            taken.append(name)
            continue
        if stat.S_ISREG(info.st_mode) and info.st_uid == uid and info.st_nlink == 1:
            break
        taken.append(f"{name} ({user_name(info.st_uid)}'s)")
    else:
        warnings.warn(
            f"Cannot keep this user's readings of idle claims in {folder}: every name for them is "
            f"taken ({', '.join(taken)}), so no claim is reported idle. Ask the owner of those "
            "files (or root) to remove them.",
            RuntimeWarning,
            stacklevel=1,  # one place: said once, however often it is read and written
        )
        return None
    if taken:
        warnings.warn(
            f"{folder / f'observed-{uid}.json'} is not this user's file: readings of idle "
            f"claims are kept in {name} instead.",
            RuntimeWarning,
            stacklevel=1,
        )
    return name


def _read_observations(folder: Path) -> dict[str, Any]:
    try:
        with opened_folder(folder) as dir_fd:
            name = _observations_name(folder, dir_fd)
            if name is None:
                return {}
            fd = open_lock_file(folder, name, dir_fd=dir_fd)
    except (OSError, GpukitError):
        return {}
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return {}  # not ours: a co-user cannot tell us what we saw
        return as_dict(parse_json(read_bounded(fd, _MAX_OBSERVED), limit=_MAX_OBSERVED))
    except (OSError, InvalidInput):
        return {}
    finally:
        os.close(fd)


def _write_observations(folder: Path, data: dict[str, Any]) -> None:
    with contextlib.suppress(OSError, GpukitError), opened_folder(folder) as dir_fd:
        name = _observations_name(folder, dir_fd)
        if name is None:
            return
        hidden = f".{name}.{uuid_module.uuid4().hex[:8]}"
        fd = open_lock_file(
            folder, hidden, dir_fd=dir_fd, write=True, create=True, exclusive=True, mode=0o600
        )
        try:
            os.write(fd, dumps(data).encode())
        finally:
            os.close(fd)
        try:
            # In the sticky folder a rename never replaces another user's file.
            os.rename(hidden, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            os.unlink(hidden, dir_fd=dir_fd)


def _idle(
    folder: Path, held: Sequence[HeldClaim], inv: Inventory, idle_after: float, observe: bool
) -> list[IdleClaim]:
    now = inv.taken_at
    before = _read_observations(folder)
    seen: dict[str, dict[str, float | None]] = {}
    for claim in held:
        key = _claim_key(claim)
        last = before.get(key) if isinstance(before.get(key), dict) else None
        idle_since: float | None = None
        if _idle_now(claim, inv):
            idle_since = now
            if last is not None:
                prev_seen, prev_since = last.get("seen"), last.get("idle_since")
                if (
                    isinstance(prev_seen, (int, float))
                    and isinstance(prev_since, (int, float))
                    and 0 <= now - prev_seen <= idle_after
                ):
                    idle_since = min(float(prev_since), now)
        seen[key] = {"seen": now, "idle_since": idle_since}
    if observe and (seen or before):
        # Only with claims to observe: then the lock folder exists, and this never makes it.
        _write_observations(folder, seen)
    return [
        IdleClaim(c.gpus, c.user, c.pid, c.command, since, now - since)
        for c in held
        if (since := seen[_claim_key(c)]["idle_since"]) is not None and now - since > idle_after
    ]


def sharing(
    inv: Inventory | None = None,
    *,
    folder: Path | None = None,
    idle_after: float = IDLE_AFTER_S,
    observe: bool = True,
) -> Sharing:
    """Who holds which GPU, who waits and why, unclaimed use and idle claims, right now.

    ``observe`` records this reading of which claims are idle, so that a later call can tell
    how long they have been (see the module's notes).
    """
    base = lock_folder() if folder is None else folder
    inv = inventory() if inv is None else inv
    # The line first, then the claims: a waiter leaves the line only once it holds its claim,
    # so read in this order, each process that waits or holds shows in one list at least.
    read = waiters.read_queue(base)
    claims = current_claims(base)
    held = _holders(claims, inv)
    return Sharing(
        taken_at=inv.taken_at,
        holders=tuple(held),
        waiters=tuple(_waiters(read.waiters, inv, claims, base)),
        unclaimed=tuple(_unclaimed(inv, held)),
        idle=tuple(_idle(base, held, inv, idle_after, observe)),
        idle_after_s=idle_after,
        source=inv.source,
        foreign=read.foreign,
        foreign_not_listed=read.foreign_not_listed,
    )
