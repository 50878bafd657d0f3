"""Joining the queue for GPUs with a ticket: first come, first served, and no co-user can jump or
jam it.

How the queue is read, and why no co-user can jump or jam it: :mod:`gpukit.sharing.waiters`.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
import uuid as uuid_module
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from gpukit.errors import (
    ClaimError,
    LockFolderError,
    NoGpuAvailableError,
    UserLimitError,
    WaitTimeoutError,
)
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.gpus.select import Verdict, assess, best_first, no_gpu_error
from gpukit.holders import user_name
from gpukit.sharing.claims import Claim, claim, current_claims, shared_folder
from gpukit.sharing.lock_folder import lock_folder
from gpukit.sharing.lockfiles import open_folder, open_lock_file
from gpukit.sharing.policy import Limits, Policy, gpu_uuids, holdings
from gpukit.sharing.waiters import (
    QUEUE,
    TICKET_MODE,
    TICKET_SCHEMA,
    TICKET_SUFFIX,
    Queue,
    Waiter,
    read_queue_in,
)
from gpukit.untrusted import InvalidInput, open_regular

__all__ = ["Ticket", "wait_and_claim"]

# The line ignores a ticket whose record is over 64 KiB: a long command is cut, so that its
# waiter keeps its place (JSON writes a character in up to 12 bytes: 4096 of them fit).
_MAX_COMMAND = 4096
# A record that would be past the bound all the same (an exclude list of thousands) keeps
# its place without its criteria as data, and with its sentence cut to this many characters.
_MOST_RECORD = 64 * 1024
_MAX_CRITERIA = 1024
# How many tickets no live waiter holds a waiter keeps from coming alive (one descriptor each).
_MOST_PINS = 64


class Ticket:
    """This process's ticket: its place in the queue; :meth:`close` leaves the queue.

    ``n``, ``criteria`` (default: any idle GPU) and ``command`` are recorded in the ticket for
    ``gpukit queue``: the criteria as a sentence and as data (:mod:`gpukit.sharing.waiters`).

    A ticket counts from when it became a live waiter, not from when it was named. A file can
    be named long before its creator locks it (which leaves its change time as it was), so on
    joining, this waiter holds a shared lock on every ticket-named file no live waiter holds,
    for as long as it waits: none of them can come alive in front of it. And it remembers the
    waiters it found live when it joined: an earlier-named ticket it did not find live then
    never counts as ahead of it (:meth:`waiters_ahead`), however it came alive since.
    """

    def __init__(
        self,
        folder: Path | None = None,
        *,
        n: int = 1,
        criteria: Criteria | None = None,
        command: str | None = None,
    ) -> None:
        self.queue = shared_folder(
            shared_folder(lock_folder() if folder is None else Path(folder)) / QUEUE
        )
        self._folder_fd: int | None = open_folder(self.queue)
        name = f"{time.time_ns():020d}-{os.getpid()}-{uuid_module.uuid4().hex[:8]}{TICKET_SUFFIX}"
        uid = os.getuid()
        criteria = Criteria() if criteria is None else criteria
        record = {
            "schema": TICKET_SCHEMA,
            "pid": os.getpid(),
            "user": user_name(uid),
            "uid": uid,
            "n": n,
            "criteria": criteria.describe(),
            "wants": criteria.to_json(),
            "command": (command if command is not None else " ".join(sys.argv))[:_MAX_COMMAND],
            "since": time.time(),
        }
        data = json.dumps(record).encode()
        if len(data) > _MOST_RECORD:
            record.update(wants=None, criteria=criteria.describe()[:_MAX_CRITERIA])
            data = json.dumps(record).encode()
        # Locked and written before it gets its visible name, so that no one ever sees it
        # unlocked or empty and takes it for an abandoned or forged ticket. Created private:
        # a co-user who opened it first could hold a shared lock on it and block ours forever.
        hidden = f".{name}"
        self._fd: int | None = None
        self._pins: dict[int, int] = {}  # inode -> descriptor holding a shared lock on it
        self._joined: frozenset[tuple[str, int]] = frozenset()
        try:
            self._fd = open_lock_file(
                self.queue,
                hidden,
                dir_fd=self._folder_fd,
                write=True,
                create=True,
                exclusive=True,
                mode=0o600,
            )
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(self._fd, data)
                os.fchmod(self._fd, TICKET_MODE)
                self._pin_dormant()  # before the name appears: a watcher cannot race it
                os.rename(hidden, name, src_dir_fd=self._folder_fd, dst_dir_fd=self._folder_fd)
            except OSError as exc:  # a full disk, a quota
                raise LockFolderError(
                    f"Cannot write a ticket in {self.queue}: {exc.strerror or exc}.",
                    hint="Free space on its disk, or set GPUKIT_LOCK_DIR to a folder on a local "
                    "disk every user of the GPUs can write.",
                ) from exc
        except BaseException:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(hidden, dir_fd=self._folder_fd)
            self.close()
            raise
        self.name = name
        self.path = self.queue / name
        # The key others order this ticket by, read once it has its name (the rename set it).
        try:
            self.arrived_ns = os.fstat(self._fd).st_ctime_ns
            self._pin_dormant()  # those named while this one took its name
            first = read_queue_in(self._folder_fd, self.queue)
        except BaseException:
            self.close()
            raise
        self._joined = frozenset((w.ticket, w.arrived_ns) for w in first.waiters)

    def _pin_dormant(self) -> None:
        """Hold a shared lock on each ticket-named file that no process holds exclusively.

        An honest waiter locks its ticket before naming it, so this never stands in its way;
        what it stops is a file named earlier, unlocked, being locked later to take the
        place its name and change time would give it. At most ``_MOST_PINS`` are held; past
        that, :meth:`waiters_ahead` alone keeps them behind this waiter.
        """
        assert self._folder_fd is not None
        try:
            with os.scandir(self._folder_fd) as entries:
                names = sorted(
                    (e.name, e.inode())
                    for e in entries
                    if e.name.endswith(TICKET_SUFFIX) and not e.name.startswith(".")
                )
        except OSError:
            return
        for name, inode in names:
            if len(self._pins) >= _MOST_PINS:
                return
            if inode in self._pins:
                continue
            try:  # no retry on a file it may not read: each try must cost one open
                fd = open_regular(name, dir_fd=self._folder_fd, nlink=True)
            except (OSError, InvalidInput):
                continue  # gone, unreadable, a link, a FIFO...: no ticket, now or later
            try:
                # Granted only when nobody holds it exclusively: no live waiter.
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                self._pins[os.fstat(fd).st_ino] = fd
            except OSError:
                os.close(fd)

    def read_queue(self) -> Queue:
        """The queue as it stands now; tidies away this user's tickets whose waiters died."""
        if self._folder_fd is None:
            return Queue()
        return read_queue_in(self._folder_fd, self.queue, tidy=True)

    def waiters_ahead(self, queue: Queue) -> list[Waiter]:
        """The waiters of ``queue`` that were live waiters before this one joined.

        Ordered by the kernel's change time (then the name), as everyone orders the line; but
        a ticket changed before this one took its name counts only if this waiter found it
        live on joining. Two honest waiters agree: each one's ticket is live from the moment
        it is named, so the later always finds the earlier live, and the earlier's key is
        smaller; tickets named in the same clock tick are ordered by name, by both.
        """
        mine = (self.arrived_ns, self.name)
        return [
            w
            for w in queue.waiters
            if (w.arrived_ns, w.ticket) < mine
            and (w.arrived_ns >= self.arrived_ns or (w.ticket, w.arrived_ns) in self._joined)
        ]

    def ahead(self) -> int:
        """How many live waiters arrived before this one."""
        return len(self.waiters_ahead(self.read_queue()))

    def close(self) -> None:
        """Leave the queue. Safe to call twice."""
        while self._pins:
            os.close(self._pins.popitem()[1])
        if self._fd is not None:
            if self._folder_fd is not None and hasattr(self, "name"):
                with contextlib.suppress(OSError):
                    os.unlink(self.name, dir_fd=self._folder_fd)
            os.close(self._fd)
            self._fd = None
        if self._folder_fd is not None:
            os.close(self._folder_fd)
            self._folder_fd = None

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def wait_and_claim(
    n: int,
    criteria: Criteria,
    *,
    order: str = "free",
    timeout: float | None = None,
    settle: int = 1,
    poll: float = 2.0,
    command: str | None = None,
    policy: Policy | None = None,
    folder: Path | None = None,
    on_status: Callable[[str], None] = lambda text: None,
    read: Callable[[], Inventory] = inventory,
) -> Claim:
    """Wait in line until ``n`` GPUs qualify for ``settle`` polls in a row, then claim them.

    Raises NoGpuAvailableError at once when fewer than ``n`` GPUs could ever qualify (waiting
    would be forever), UserLimitError when ``policy`` never lets one user hold ``n``, and
    WaitTimeoutError after ``timeout`` seconds. Waiters ahead that ``policy`` does not let
    claim now (their user is at the limit) do not hold this one up; nor does it hold up others
    while its own user is at the limit.
    """
    policy = policy or Policy()
    folder = lock_folder() if folder is None else Path(folder)
    inv = read()
    if sum(criteria.could_ever_qualify(g) for g in inv.gpus) < n:
        raise no_gpu_error(inv, n, criteria, assess(inv, criteria, current_claims(folder)))
    uid = os.getuid()
    if not policy.could_ever_allow(n):
        raise UserLimitError(
            policy.explain(uid, n, holdings(folder)),
            hint="Waiting cannot help: ask for fewer GPUs, or ask the administrator.",
        )
    limits = policy.limits != Limits()
    start = time.monotonic()
    streak: dict[str, int] = {}
    with Ticket(folder, n=n, criteria=criteria, command=command) as ticket:
        while True:
            verdicts = assess(inv, criteria, current_claims(folder))
            streak = {v.gpu.uuid: streak.get(v.gpu.uuid, 0) + 1 for v in verdicts if v.ok}
            ready = best_first(
                (v.gpu for v in verdicts if v.ok and streak[v.gpu.uuid] >= settle), order
            )
            held = holdings(folder, gpus=gpu_uuids(inv)) if limits else {}
            ahead = sum(
                policy.refusal(w.uid, w.n, held) is None
                for w in ticket.waiters_ahead(ticket.read_queue())
            )
            limited = policy.refusal(uid, n, held)
            if ahead == 0 and limited is None and len(ready) >= n:
                try:
                    got = claim(ready[:n], command=command, folder=folder)
                except ClaimError:  # claimed by someone outside the line since: poll again
                    streak.clear()
                else:
                    # Another process of this user may have claimed meanwhile: never past
                    # the limit, even for a moment's race.
                    if not limits or policy.refusal(uid, 0, holdings(folder)) is None:
                        return got
                    got.release()
            qualify = sum(v.ok for v in verdicts)
            line = f"; {ahead} waiter{'s' if ahead != 1 else ''} ahead" if ahead else ""
            on_status(
                f"waiting for {n} GPU{'s' if n != 1 else ''} ({criteria.describe() or 'any'}): "
                f"{qualify} of {len(inv.gpus)} qualify"
                + (f", {len(ready)} for {settle} polls in a row" if settle > 1 else "")
                + line
                + (f"; {limited}" if limited else "")
            )
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                # A line of its own: the message above may end with a list of GPUs.
                late = ""
                if limited:
                    late = f"\n{policy.explain(uid, n, held)}"
                elif qualify >= n:  # they qualify now: say what kept this waiter from them
                    late = (
                        f"\n{ahead} earlier waiter{'s' if ahead != 1 else ''} still in line."
                        if ahead
                        else f"\nOnly {len(ready)} qualified for {settle} polls in a row "
                        "(--settle)."
                    )
                raise _timeout(n, criteria, timeout, inv, verdicts, late)
            left = None if timeout is None else timeout - waited
            time.sleep(poll if left is None else max(0.0, min(poll, left)))
            inv = read()


def _timeout(
    n: int,
    criteria: Criteria,
    timeout: float,
    inv: Inventory,
    verdicts: list[Verdict],
    late: str = "",
) -> WaitTimeoutError:
    why: NoGpuAvailableError = no_gpu_error(inv, n, criteria, verdicts)
    return WaitTimeoutError(
        f"Waited {timeout:g} s for GPUs, in vain. {why.message}{late}",
        hint="Wait longer (--timeout), ask for fewer GPUs, or relax the criteria.",
    )
