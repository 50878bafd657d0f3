"""Who uses a GPU: the one spelling of a user, and the holder of a claim as its record says.

Both the machine's side (:mod:`gpukit.gpus`: processes NVML reports, other hosts' claims) and
the sharing side (:mod:`gpukit.sharing`: lock files, tickets, the ledger) name people, so the
names live here, below both: ``'alice'`` for a uid with an account, ``'uid 54321'`` for one
without, everywhere gpukit shows a user.

Nothing here imports torch or any other part of gpukit.
"""

from __future__ import annotations

import pwd
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["UNREADABLE", "Holder", "user_name"]

UNREADABLE = "record unreadable"
"""The ``problem`` of a claim that is held, with a record gpukit cannot use."""


def user_name(uid: int) -> str:
    """``'alice'`` for a uid with an account, ``'uid 1234'`` otherwise.

    Args:
        uid: the numeric user id.
    """
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


@dataclass(frozen=True)
class Holder:
    """Who holds a claim, as recorded in its lock file.

    Args:
        user: the holder's user name; None: unknown.
        pid: the holding process's id; None: unknown.
        host: the host the claim was taken on; None: unknown.
        command: the holding process's command line; None: unknown.
        since: when the claim was taken, in Unix seconds; None: unknown.
        problem: why the lock file could not be read; None: it was read.
    """

    user: str | None
    pid: int | None
    host: str | None
    command: str | None
    since: float | None
    """Unix time the claim was taken."""
    problem: str | None = None
    """Why the lock file could not be read (a link, a FIFO...): the GPU counts as taken."""

    def describe(self) -> str:
        """``'bob (pid 4242: python train.py)'``: for tables and error messages.

        A lock held with a record that cannot be read names the holder the kernel reports:
        ``'bob (pid 4242: python train.py), record unreadable'``.
        """
        known = self.problem == UNREADABLE and (self.user, self.pid) != (None, None)
        if self.problem and not known:
            return f"? ({self.problem})"
        who = self.user or "?"
        command = f": {self.command[:40]}" if self.command else ""
        text = f"{who} (pid {self.pid if self.pid is not None else '?'}{command})"
        return f"{text}, {self.problem}" if self.problem else text

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return asdict(self)
