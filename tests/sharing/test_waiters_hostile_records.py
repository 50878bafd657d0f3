"""What a co-user writes into a ticket or a holder record cannot crash anyone's reading of it.

Each test plants a held file whose content is hostile (nesting deeper than any parser should
follow, huge numbers, wrong types) and checks that the readers every user runs (the line of
waiters, waiting itself, `gpukit queue`) report it and go on.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpukit.sharing.tickets import Ticket
from gpukit.sharing.waiters import read_queue
from tests.helpers import MACHINES, NOBODY, subprocess_env

L4 = MACHINES / "server-4xL4-idle.json"
EARLY = "00000000000000000001-1-aaaaaaaa.ticket"
DEEP = b"[" * 60000
Hold = Callable[[Path, bytes], int]


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    return folder


@pytest.fixture
def hold() -> Iterator[Hold]:
    """Write ``data`` into a new file and hold its lock from this process, as a co-user can."""
    fds: list[int] = []

    def hold(path: Path, data: bytes) -> int:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fds.append(fd)
        os.write(fd, data)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    yield hold
    for fd in fds:
        os.close(fd)


def _setup_locks_folder(locks: Path) -> None:
    """The lock folder as `gpukit setup-locks` makes it: root's, with a 1777 queue folder."""
    (locks / "queue").mkdir(parents=True)
    for folder in (locks, locks / "queue"):
        os.chown(folder, 0, 0)
        folder.chmod(0o1777)


@pytest.mark.parametrize("folder", ["default", "setup-locks"])
def test_a_held_ticket_nested_60000_deep_is_foreign_with_why_and_hides_no_waiter(
    locks: Path, hold: Hold, folder: str
) -> None:
    if folder == "setup-locks":
        if os.geteuid() != 0:
            pytest.skip("needs root to make a folder root owns and a co-user's ticket in it")
        _setup_locks_folder(locks)
    with Ticket(command="python train.py") as honest:
        hold(honest.queue / EARLY, DEEP)
        if folder == "setup-locks":
            os.chown(honest.queue / EARLY, NOBODY, NOBODY)
        line = read_queue()
        assert [w.ticket for w in line.waiters] == [honest.name]
        assert [(f.name, f.why) for f in line.foreign] == [
            (EARLY, "no valid waiter record: not valid JSON: nested more than 32 deep")
        ]
        assert honest.ahead() == 0


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"schema": "gpukit.ticket/1", "pid": 1e999}', "not valid JSON"),
        (b'{"schema": "gpukit.ticket/1", "pid": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'{"schema": "gpukit.ticket/1", "pid": 4294967296}', "pid is out of range"),
        (b'{"schema": "gpukit.ticket/1", "pid": true}', "pid is not an integer"),
        (b"[]", "the record is not a mapping"),
        (b"\xff\xfe", "not UTF-8"),
    ],
    ids=["overflowing-float", "5000-digit-int", "pid-past-32-bits", "bool-pid", "list", "binary"],
)
def test_a_held_ticket_with_a_malformed_record_says_what_is_wrong_with_it(
    locks: Path, hold: Hold, content: bytes, why: str
) -> None:
    hold(locks / "queue" / EARLY, content)
    line = read_queue()
    assert line.waiters == ()
    ((name, reason),) = [(f.name, f.why) for f in line.foreign]
    assert name == EARLY
    assert reason.startswith("no valid waiter record: ")
    assert why in reason


def test_acquire_with_wait_beside_a_deeply_nested_ticket_claims_as_usual(
    locks: Path, hold: Hold
) -> None:
    import gpukit as gk

    hold(locks / "queue" / EARLY, DEEP)
    with gk.acquire(1, wait=True, timeout=30, poll=0.01, settle=1) as got:
        assert len(got.uuids) == 1


def test_gpukit_run_wait_beside_a_deeply_nested_ticket_runs_its_command(
    locks: Path, hold: Hold
) -> None:
    hold(locks / "queue" / EARLY, DEEP)
    env = subprocess_env(GPUKIT_FAKE_NVML=str(L4), GPUKIT_LOCK_DIR=str(locks))
    result = subprocess.run(
        [sys.executable, "-m", "gpukit", "run", "--wait", "--timeout", "30", "--poll", "0.05",
         "--settle", "1", "--", sys.executable, "-c", "print('ran')"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout.strip()) == (0, "ran"), result.stderr


def test_gpukit_queue_lists_a_deeply_nested_ticket_as_foreign_and_exits_0(
    locks: Path, hold: Hold
) -> None:
    hold(locks / "queue" / EARLY, DEEP)
    env = subprocess_env(GPUKIT_FAKE_NVML=str(L4), GPUKIT_LOCK_DIR=str(locks))
    outputs = {}
    for args in (("queue", "--json"), ("queue",)):
        result = subprocess.run(
            [sys.executable, "-m", "gpukit", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        outputs[args] = result.stdout
    ((name, why),) = [
        (f["name"], f["why"]) for f in json.loads(outputs["queue", "--json"])["foreign"]
    ]
    assert (name, why.startswith("no valid waiter record: ")) == (EARLY, True)
    assert EARLY in outputs[("queue",)]
