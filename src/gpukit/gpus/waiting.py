"""Waiting for GPUs: a first-come first-served line of waiters that no co-user can jump or jam.

How the line is read, and why no co-user can jump or jam it: :mod:`gpukit.gpus.line`.

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
from gpukit.gpus.claims import Claim, claim, current_claims, lock_dir, shared_dir
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.gpus.line import (
    _SUFFIX,
    _TICKET_MODE,
    QUEUE,
    TICKET_SCHEMA,
    Foreign,
    Line,
    Waiter,
    _read,
    read_line,
)
from gpukit.gpus.lockfiles import open_folder, open_lock_file
from gpukit.gpus.lockfiles import owner_name as user_name
from gpukit.gpus.policy import Limits, Policy, holdings
from gpukit.gpus.select import Criteria, Verdict, assess, best_first, no_gpu_error

__all__ = ["TICKET_SCHEMA", "Foreign", "Line", "Ticket", "Waiter", "read_line", "wait_and_claim"]

# The line ignores a ticket whose record is over 64 KiB: a long command is cut, so that its
# waiter keeps its place (JSON writes a character in up to 12 bytes: 4096 of them fit).
_MAX_COMMAND = 4096


class Ticket:
    """This process's place in the line of waiters; :meth:`close` leaves the line.

    ``n``, ``criteria`` and ``command`` are recorded in the ticket for ``gpukit queue``.
    """

    def __init__(
        self,
        folder: Path | None = None,
        *,
        n: int = 1,
        criteria: str = "",
        command: str | None = None,
    ) -> None:
        self.queue = shared_dir(shared_dir(lock_dir() if folder is None else Path(folder)) / QUEUE)
        self._dir: int | None = open_folder(self.queue)
        name = f"{time.time_ns():020d}-{os.getpid()}-{uuid_module.uuid4().hex[:8]}{_SUFFIX}"
        uid = os.getuid()
        record = {
            "schema": TICKET_SCHEMA,
            "pid": os.getpid(),
            "user": user_name(uid),
            "uid": uid,
            "n": n,
            "criteria": criteria,
            "command": (command if command is not None else " ".join(sys.argv))[:_MAX_COMMAND],
            "since": time.time(),
        }
        # Locked and written before it gets its visible name, so that no one ever sees it
        # unlocked or empty and takes it for an abandoned or forged ticket. Created private:
        # a co-user who opened it first could hold a shared lock on it and block ours forever.
        hidden = f".{name}"
        self._fd: int | None = None
        try:
            self._fd = open_lock_file(
                self.queue,
                hidden,
                dir_fd=self._dir,
                write=True,
                create=True,
                exclusive=True,
                mode=0o600,
            )
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.write(self._fd, json.dumps(record).encode())
                os.fchmod(self._fd, _TICKET_MODE)
                os.rename(hidden, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
            except OSError as exc:  # a full disk, a quota
                raise LockFolderError(
                    f"Cannot write a ticket in {self.queue}: {exc.strerror or exc}.",
                    hint="Free space on its disk, or set GPUKIT_LOCK_DIR to a folder on a local "
                    "disk every user of the GPUs can write.",
                ) from exc
        except BaseException:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.unlink(hidden, dir_fd=self._dir)
            self.close()
            raise
        self.name = name
        self.path = self.queue / name
        # The key others order this ticket by, read once it has its name (the rename set it).
        self.arrived_ns = os.fstat(self._fd).st_ctime_ns

    def line(self) -> Line:
        """The line as it stands now; tidies away this user's tickets whose waiters died."""
        if self._dir is None:
            return Line()
        return _read(self._dir, self.queue, tidy=True)

    def waiters_ahead(self, line: Line) -> list[Waiter]:
        """The waiters of ``line`` that arrived before this one."""
        mine = (self.arrived_ns, self.name)
        return [w for w in line.waiters if (w.arrived_ns, w.ticket) < mine]

    def ahead(self) -> int:
        """How many live waiters arrived before this one."""
        return len(self.waiters_ahead(self.line()))

    def close(self) -> None:
        """Leave the line. Safe to call twice."""
        if self._fd is not None:
            if self._dir is not None and hasattr(self, "name"):
                with contextlib.suppress(OSError):
                    os.unlink(self.name, dir_fd=self._dir)
            os.close(self._fd)
            self._fd = None
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None

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
    folder = lock_dir() if folder is None else Path(folder)
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
    with Ticket(folder, n=n, criteria=criteria.describe(), command=command) as ticket:
        while True:
            verdicts = assess(inv, criteria, current_claims(folder))
            streak = {v.gpu.uuid: streak.get(v.gpu.uuid, 0) + 1 for v in verdicts if v.ok}
            ready = best_first(
                (v.gpu for v in verdicts if v.ok and streak[v.gpu.uuid] >= settle), order
            )
            held = holdings(folder) if limits else {}
            ahead = sum(
                policy.refusal(w.uid, w.n, held) is None
                for w in ticket.waiters_ahead(ticket.line())
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
