"""A ticket counts from when it became a live waiter, not from when it was named.

A co-user can name a well-formed ticket long before anyone waits, leave it unlocked (listed as
foreign), and lock it later: locking does not change its change time, which orders the line.
These tests play that co-user with a process that names its ticket, sleeps, and locks it when
told, and check that it never gets ahead of a waiter that found it dormant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import gpukit.sharing.tickets as tickets_module
from gpukit.sharing.policy import user_name
from gpukit.sharing.tickets import Ticket
from gpukit.sharing.waiters import TICKET_SCHEMA, read_queue

DORMANT = "00000000000000000001-1-dddddddd.ticket"

_SLEEPER = """
import fcntl, json, os, sys
path = sys.argv[1]
record = json.loads(sys.argv[2])
record["pid"] = os.getpid()
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
os.write(fd, json.dumps(record).encode())
print("named", flush=True)
for line in sys.stdin:  # each line: try to lock it now
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("locked", flush=True)
    except BlockingIOError:
        print("refused", flush=True)
"""


class Sleeper:
    """A co-user's process whose ticket is named now and locked only when :meth:`lock` says."""

    def __init__(self, path: Path) -> None:
        record = {
            "schema": TICKET_SCHEMA,
            "user": user_name(os.getuid()),
            "uid": os.getuid(),
            "n": 1,
            "criteria": "",
            "command": "sleeping",
            "since": 0.0,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SLEEPER, str(path), json.dumps(record)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._answer() == "named"

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def lock(self) -> str:
        """``'locked'``, or ``'refused'`` when someone holds a lock on the ticket."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("lock\n")
        self.proc.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    (folder / "queue").mkdir(parents=True)
    return folder


@pytest.fixture
def sleeper(locks: Path) -> Iterator[Callable[[], Sleeper]]:
    started: list[Sleeper] = []

    def start() -> Sleeper:
        started.append(Sleeper(locks / "queue" / DORMANT))
        return started[-1]

    yield start
    for one in started:
        one.stop()


def test_a_ticket_named_before_a_waiter_joined_but_locked_after_does_not_get_ahead_of_it(
    sleeper: Callable[[], Sleeper],
) -> None:
    dormant = sleeper()
    with Ticket(command="honest") as honest:
        dormant.lock()
        assert [w.ticket for w in read_queue().waiters] == [honest.name]
        assert honest.waiters_ahead(read_queue()) == []


def test_a_waiter_keeps_a_dormant_ticket_from_coming_alive_while_it_waits_and_no_longer(
    sleeper: Callable[[], Sleeper],
) -> None:
    dormant = sleeper()
    with Ticket():
        assert dormant.lock() == "refused"
    assert dormant.lock() == "locked"  # the line was empty again: it is a waiter from now on
    with Ticket() as later:
        assert [w.command for w in later.waiters_ahead(read_queue())] == ["sleeping"]


def test_a_ticket_that_came_alive_after_a_waiter_joined_is_never_ahead_of_that_waiter(
    sleeper: Callable[[], Sleeper], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the number of tickets a waiter pins (or in a race with its joining), the dormant
    # ticket comes alive with its old change time, first in the kernel's order; the waiter
    # that found it dormant still does not wait for it, and one that joins later does.
    monkeypatch.setattr(tickets_module, "_MOST_PINS", 0, raising=False)
    dormant = sleeper()
    with Ticket(command="first") as first:
        assert dormant.lock() == "locked"
        line = read_queue()
        assert [w.command for w in line.waiters] == ["sleeping", "first"]
        assert first.waiters_ahead(line) == []
        with Ticket(command="second") as second:
            ahead = second.waiters_ahead(read_queue())
            assert [w.command for w in ahead] == ["sleeping", "first"]
            assert first.waiters_ahead(read_queue()) == []


def test_two_honest_waiters_agree_on_who_is_first() -> None:
    with Ticket() as first, Ticket() as second:
        line = read_queue()
        assert (first.waiters_ahead(line), [w.ticket for w in second.waiters_ahead(line)]) == (
            [],
            [first.name],
        )
