"""Waiting for GPUs: a first-come first-served line of waiters, and the poll loop.

Each waiter holds a ticket in ``<lock folder>/queue``: a file named by its arrival time and
locked (flock) for as long as the waiter lives. Only the first live ticket may claim GPUs, so
waiters are served in arrival order. A waiter that dies (even by SIGKILL) loses its lock with
its life, and the others skip its ticket at once: a dead waiter never blocks the line.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid as uuid_module
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from gpukit.errors import ClaimError, NoGpuAvailableError, WaitTimeoutError
from gpukit.gpus.claims import Claim, claim, current_claims, lock_dir, shared_dir
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.gpus.select import Criteria, Verdict, assess, best_first, no_gpu_error

_TICKET = ".ticket"


def _alive(path: Path) -> bool:
    """True while the waiter that made the ticket at ``path`` lives (holds its lock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):  # only its owner may remove it from the sticky folder
        path.unlink()
    return False


class Ticket:
    """This process's place in the line of waiters; :meth:`close` leaves the line."""

    def __init__(self, folder: Path | None = None) -> None:
        self.queue = shared_dir(shared_dir(lock_dir() if folder is None else folder) / "queue")
        name = f"{time.time_ns():020d}-{os.getpid()}-{uuid_module.uuid4().hex[:8]}{_TICKET}"
        # Locked before it gets its visible name, so that no one ever sees it unlocked and
        # takes it for the ticket of a dead waiter.
        hidden = self.queue / f".{name}"
        self._fd: int | None = os.open(
            hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
        )
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self.path = self.queue / name
        os.rename(hidden, self.path)

    def ahead(self) -> int:
        """How many live waiters arrived before this one."""
        try:
            names = os.listdir(self.queue)
        except OSError:
            return 0
        earlier = sorted(
            n for n in names if n.endswith(_TICKET) and not n.startswith(".") and n < self.path.name
        )
        return sum(_alive(self.queue / n) for n in earlier)

    def close(self) -> None:
        """Leave the line. Safe to call twice."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = None

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
    on_status: Callable[[str], None] = lambda text: None,
    read: Callable[[], Inventory] = inventory,
) -> Claim:
    """Wait in line until ``n`` GPUs qualify for ``settle`` polls in a row, then claim them.

    Raises NoGpuAvailableError at once when fewer than ``n`` GPUs could ever qualify (waiting
    would be forever), and WaitTimeoutError after ``timeout`` seconds.
    """
    inv = read()
    if sum(criteria.could_ever_qualify(g) for g in inv.gpus) < n:
        raise no_gpu_error(inv, n, criteria, assess(inv, criteria, current_claims()))
    start = time.monotonic()
    streak: dict[str, int] = {}
    with Ticket() as ticket:
        while True:
            verdicts = assess(inv, criteria, current_claims())
            streak = {v.gpu.uuid: streak.get(v.gpu.uuid, 0) + 1 for v in verdicts if v.ok}
            ready = best_first(
                (v.gpu for v in verdicts if v.ok and streak[v.gpu.uuid] >= settle), order
            )
            ahead = ticket.ahead()
            if ahead == 0 and len(ready) >= n:
                try:
                    return claim(ready[:n], command=command)
                except ClaimError:  # claimed by someone outside the line since: poll again
                    streak.clear()
            qualify = sum(v.ok for v in verdicts)
            line = f"; {ahead} waiter{'s' if ahead != 1 else ''} ahead" if ahead else ""
            on_status(
                f"waiting for {n} GPU{'s' if n != 1 else ''} ({criteria.describe() or 'any'}): "
                f"{qualify} of {len(inv.gpus)} qualify"
                + (f", {len(ready)} for {settle} polls in a row" if settle > 1 else "")
                + line
            )
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                late = ""
                if qualify >= n:  # they qualify now: say what kept this waiter from them
                    late = (
                        f" {ahead} earlier waiter{'s' if ahead != 1 else ''} still in line."
                        if ahead
                        else f" Only {len(ready)} qualified for {settle} polls in a row (--settle)."
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
