"""The line is ordered by arrival, never by pid: waiters that join in an order no pid order gives.

Arrival is the kernel's change time of each ticket (set when it takes its name), then the name.
Pids say nothing about it: a child process can join before its parent, and pids wrap around. Here
three waiters (this process and two children) join one after the other, each only once the one
before holds its ticket, in the order middle pid, lowest pid, highest pid: neither ascending nor
descending, whatever pids the system hands out, so no order by pid can pass for the arrival order.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpukit.sharing.tickets import Ticket
from gpukit.sharing.waiters import read_queue
from tests.helpers import subprocess_env

# A waiter in its own process: joins the line on "join", says how many are ahead on "ahead".
_WAITER = """
import sys
from gpukit.sharing.tickets import Ticket
ticket = None
for line in sys.stdin:
    if line.strip() == "join":
        ticket = Ticket(command="child")
        print("in", flush=True)
    elif line.strip() == "ahead":
        assert ticket is not None
        print(ticket.ahead(), flush=True)
"""


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    return folder


class _Child:
    """A child process that joins the line when told to and answers what it sees."""

    def __init__(self, locks: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WAITER],
            env=subprocess_env(GPUKIT_LOCK_DIR=str(locks)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid

    def ask(self, what: str) -> str:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


@pytest.fixture
def children(locks: Path) -> Iterator[list[_Child]]:
    started = [_Child(locks) for _ in range(2)]
    yield started
    for child in started:  # end of input: each leaves the line and ends, both at once
        assert child.proc.stdin is not None
        child.proc.stdin.close()
    for child in started:
        child.proc.wait(timeout=60)


def test_waiters_are_served_in_the_order_they_joined_whatever_their_pids(
    children: list[_Child],
) -> None:
    pids = {child.pid: child for child in children}
    low, middle, high = sorted([os.getpid(), *pids])
    joining = [middle, low, high]  # neither pid order: a child may join before its parent
    with contextlib.ExitStack() as stack:
        mine: Ticket | None = None
        for pid in joining:
            if pid == os.getpid():
                mine = stack.enter_context(Ticket(command="parent"))
            else:
                assert pids[pid].ask("join") == "in"  # its ticket is named before the next
        assert mine is not None
        line = read_queue().waiters
        assert [(w.position, w.pid) for w in line] == [(1, middle), (2, low), (3, high)]
        assert mine.ahead() == joining.index(os.getpid())
        for pid, child in pids.items():
            assert child.ask("ahead") == str(joining.index(pid))
