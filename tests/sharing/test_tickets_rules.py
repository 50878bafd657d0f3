"""Waiting in line for GPUs: the ticket a waiter holds, and how it polls, waits its turn, gives up.

``wait_and_claim`` runs here against a clock of its own (``Clock``): each poll's sleep is
recorded and moves the clock on, so timeouts are exact and no test sleeps.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import os
import pwd
import re
import stat
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

import gpukit.sharing.tickets as tickets
from gpukit.errors import LockFolderError, NoGpuAvailableError, UserLimitError, WaitTimeoutError
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.sharing.claims import Claim, claim, current_claims
from gpukit.sharing.policy import Limits, Policy
from gpukit.sharing.tickets import Ticket, wait_and_claim
from gpukit.sharing.waiters import Queue, read_queue
from tests.helpers import MACHINES

L4 = MACHINES / "server-4xL4-idle.json"
ME = pwd.getpwuid(os.getuid()).pw_name
POLICY = Policy(Limits(max_gpus_per_user=1), path=Path("/etc/gpukit/policy.toml"))
IDLE = Criteria.make()  # an idle GPU: "no process on it"
GAVE_UP = "Wait longer (--timeout), ask for fewer GPUs, or relax the criteria."


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    return folder


@pytest.fixture
def other(tmp_path: Path) -> Path:
    """A lock folder passed explicitly, other than the one GPUKIT_LOCK_DIR names."""
    return tmp_path / "other"


class Clock:
    """Stands in for the ``time`` module of gpukit.sharing.tickets: sleeping takes no real time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if len(self.sleeps) >= 1000:  # fail, rather than hang, if it would wait for ever
            raise AssertionError(f"still waiting after 1000 polls: {self.sleeps[:5]}...")
        self.sleeps.append(seconds)
        self.now += seconds or 0.001  # a poll takes a moment even after a sleep of 0

    def time(self) -> float:
        return time.time()

    def time_ns(self) -> int:
        return time.time_ns()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(tickets, "time", fake)
    return fake


def _polls(
    actions: dict[int, Callable[[], object]] | None = None,
) -> tuple[list[int], Callable[[], Inventory]]:
    """A ``read`` for wait_and_claim that counts its polls and runs ``actions[k]`` at poll k."""
    count: list[int] = []

    def read() -> Inventory:
        count.append(1)
        action = (actions or {}).get(len(count))
        if action is not None:
            action()
        return inventory()

    return count, read


def _open_fds() -> set[str]:
    """This process's open descriptors, after the collector closed what earlier tests dropped."""
    gc.collect()
    return set(os.listdir("/proc/self/fd"))


def _claimed_by_me(*indices: int) -> str:
    """The lines no_gpu_error gives GPUs this process claimed with command 'python eval.py'."""
    return "".join(
        f"\n  GPU {i}: claimed by {ME} (pid {os.getpid()}: python eval.py)" for i in indices
    )


# The ticket


def test_a_ticket_without_details_waits_for_one_gpu_of_any_kind_for_this_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py", "--epochs", "3"])
    with Ticket():
        (waiter,) = read_queue().waiters
    assert (waiter.n, waiter.criteria, waiter.command) == (
        1,
        "no process on it",
        "train.py --epochs 3",
    )
    assert waiter.wants == Criteria()


def test_a_tickets_name_is_its_time_pid_and_8_hex_digits_and_its_path_holds_its_record(
    locks: Path,
) -> None:
    before = time.time_ns()
    with Ticket(n=3, criteria=Criteria.make(max_util=10), command="python train.py") as ticket:
        after = time.time_ns()
        match = re.fullmatch(rf"(\d{{20}})-{os.getpid()}-[0-9a-f]{{8}}\.ticket", ticket.name)
        assert match is not None, ticket.name
        assert before <= int(match[1]) <= after
        assert ticket.path == locks / "queue" / ticket.name
        record = json.loads(ticket.path.read_text())
    assert {k: v for k, v in record.items() if k != "since"} == {
        "schema": "gpukit.ticket/1",
        "pid": os.getpid(),
        "user": ME,
        "uid": os.getuid(),
        "n": 3,
        "criteria": "at most 10% busy, no process on it",
        "wants": {
            "schema": "gpukit.criteria/1",
            "min_free": None,
            "max_util": 10,
            "max_processes": None,
            "exclude": [],
            "grant": None,
        },
        "command": "python train.py",
    }


def test_a_ticket_is_private_until_it_is_locked_then_readable_by_everyone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Were it readable before its lock, a co-user could take a shared lock on it first and keep
    # its waiter from ever locking it.
    modes: list[int] = []
    real = fcntl.flock

    def flock(fd: int, operation: int) -> None:
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real(fd, operation)

    monkeypatch.setattr(tickets.fcntl, "flock", flock)
    with Ticket() as ticket:
        assert stat.S_IMODE(ticket.path.stat().st_mode) == 0o644
    assert modes[0] == 0o600


def test_a_file_planted_under_a_tickets_hidden_name_is_neither_used_nor_changed(
    monkeypatch: pytest.MonkeyPatch, locks: Path, clock: Clock
) -> None:
    monkeypatch.setattr(clock, "time_ns", lambda: 1234)
    monkeypatch.setattr(
        tickets.uuid_module, "uuid4", lambda: uuid.UUID("abcdef12-0000-4000-8000-000000000000")
    )
    queue = locks / "queue"
    queue.mkdir(parents=True)
    planted = queue / f".00000000000000001234-{os.getpid()}-abcdef12.ticket"
    planted.write_text("planted")
    with pytest.raises(FileExistsError):
        Ticket()
    assert planted.read_text() == "planted"
    assert os.listdir(queue) == [planted.name]


def test_a_ticket_is_made_in_the_queue_folder_that_was_checked_not_one_put_in_its_place(
    monkeypatch: pytest.MonkeyPatch, locks: Path, tmp_path: Path
) -> None:
    real = tickets.open_folder
    moved = tmp_path / "moved"

    def swapped(path: Path, *, create: bool = False) -> int:
        fd = real(path, create=create)
        os.rename(path, moved)  # the checked folder goes, another takes its name
        os.mkdir(path)
        return fd

    monkeypatch.setattr(tickets, "open_folder", swapped)
    with Ticket() as ticket:
        assert os.listdir(moved) == [ticket.name]
        assert os.listdir(locks / "queue") == []


def test_a_full_disk_while_writing_a_ticket_is_a_lock_folder_error_that_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, locks: Path
) -> None:
    real = os.write

    def write(fd: int, data: bytes) -> int:
        if data.startswith(b'{"schema": "gpukit.ticket/1"'):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(tickets.os, "write", write)
    before = _open_fds()
    with pytest.raises(LockFolderError) as caught:
        Ticket()
    assert (caught.value.message, caught.value.hint, caught.value.exit_code) == (
        f"Cannot write a ticket in {locks / 'queue'}: No space left on device.",
        "Free space on its disk, or set GPUKIT_LOCK_DIR to a folder on a local disk every user "
        "of the GPUs can write.",
        5,
    )
    assert os.listdir(locks / "queue") == []
    assert _open_fds() <= before


def test_a_ticket_that_cannot_be_created_raises_the_lock_folders_error_and_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refusal = LockFolderError("Cannot open the ticket: refused.")

    def refused(*args: object, **kwargs: object) -> int:
        raise refusal

    monkeypatch.setattr(tickets, "open_lock_file", refused)
    before = _open_fds()
    with pytest.raises(LockFolderError) as caught:
        Ticket()
    assert caught.value is refusal
    assert _open_fds() <= before


def test_closing_a_ticket_twice_is_harmless_and_a_closed_ticket_sees_no_line() -> None:
    before = _open_fds()
    with Ticket() as still_waiting:
        ticket = Ticket()
        ticket.close()
        ticket.close()
        assert not ticket.path.exists()
        assert ticket.read_queue() == Queue()
        assert [w.ticket for w in still_waiting.read_queue().waiters] == [still_waiting.name]
    assert _open_fds() <= before


def test_closing_a_ticket_someone_already_removed_is_harmless() -> None:
    ticket = Ticket()
    ticket.path.unlink()  # the folder's owner tidied up
    ticket.close()
    assert read_queue().waiters == ()


def test_a_waiter_with_a_very_long_command_keeps_its_place_in_line() -> None:
    # The line reads at most 64 KiB of a ticket; the command is cut to fit, never the place.
    for command in ("x" * 70_000, "é" * 20_000, "😀" * 10_000):
        with Ticket(command=command) as ticket:
            (waiter,) = read_queue().waiters
        assert (waiter.ticket, waiter.command) == (ticket.name, command[:4096])


# Waiting and claiming


def test_by_default_the_qualifying_gpus_with_most_free_memory_are_claimed(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    # Free memory: GPU 2 and 4 ~84.9 GB, 7 ~82.9 GB, 5 ~72.4 GB, 3 ~44.0 GB; the rest < 40 GB.
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(MACHINES / "server-8xA100-shared.json"))
    at_least_40 = Criteria.make(min_free="40GB")
    with wait_and_claim(3, at_least_40, timeout=600) as held:
        assert sorted(held.indices) == [2, 4, 7]
    with wait_and_claim(3, at_least_40, order="index", timeout=600) as held:
        assert sorted(held.indices) == [2, 3, 4]


def test_by_default_a_waiter_polls_every_2_s_and_claims_once_a_gpu_qualifies(
    clock: Clock,
) -> None:
    gpus = inventory().gpus
    with claim(gpus[1:]):
        blocker = claim(gpus[:1])
        polls, read = _polls({2: blocker.release})
        with wait_and_claim(1, IDLE, timeout=600, read=read) as held:
            assert held.indices == [0]
    assert (len(polls), clock.sleeps) == (2, [2.0])


def test_a_waiter_queues_and_claims_in_the_lock_folder_it_is_given(
    locks: Path, other: Path, clock: Clock
) -> None:
    gpus = inventory().gpus
    seen: list[tuple[str, tuple[tuple[int, str, str], ...], int]] = []

    def status(text: str) -> None:
        waiters = tuple((w.n, w.criteria, w.command) for w in read_queue(other).waiters)
        seen.append((text, waiters, len(read_queue(locks).waiters)))

    at_most_half_busy = Criteria.make(max_util=50)
    with claim(gpus[:2], command="python eval.py"), claim(gpus[2:], folder=other):
        first_two = claim(gpus[:2], folder=other)
        _, read = _polls({2: first_two.release})
        with wait_and_claim(
            2,
            at_most_half_busy,
            timeout=600,
            command="python train.py",
            folder=other,
            read=read,
            on_status=status,
        ) as held:
            assert held.indices == [0, 1]
            assert {current_claims(other)[g.uuid].command for g in gpus[:2]} == {"python train.py"}
            assert set(current_claims(locks)) == {gpus[0].uuid, gpus[1].uuid}
    assert seen == [
        (
            "waiting for 2 GPUs (at most 50% busy, no process on it): 0 of 4 qualify",
            ((2, "at most 50% busy, no process on it", "python train.py"),),
            0,
        )
    ]


def test_asking_for_every_gpu_of_the_machine_is_waited_for_not_refused(clock: Clock) -> None:
    with wait_and_claim(4, IDLE, timeout=600) as held:
        assert held.indices == [0, 1, 2, 3]


def test_too_few_gpus_that_could_ever_qualify_is_refused_at_once_naming_each_gpus_state(
    monkeypatch: pytest.MonkeyPatch, other: Path, clock: Clock
) -> None:
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(MACHINES / "kaggle-2xT4-one-lost.json"))
    with (
        claim(inventory().gpus[:1], command="python eval.py", folder=other),
        pytest.raises(NoGpuAvailableError) as caught,
    ):
        wait_and_claim(2, IDLE, timeout=600, folder=other)
    assert (caught.value.message, caught.value.hint) == (
        "Asked for 2 GPUs with no process on it: 0 of 2 qualify."
        + _claimed_by_me(0)
        + "\n  GPU 1: unreadable by NVML (GPU is lost)",
        "Waiting cannot help: only 1 could ever qualify; relax the criteria.",
    )
    assert clock.sleeps == []
    assert not (other / "queue").exists()


def test_a_request_the_policy_never_allows_is_refused_at_once_naming_what_the_user_holds(
    other: Path, clock: Clock
) -> None:
    gpu0 = inventory().gpus[0]
    with claim([gpu0], folder=other), pytest.raises(UserLimitError) as caught:
        wait_and_claim(2, IDLE, policy=POLICY, folder=other)
    assert (caught.value.message, caught.value.hint) == (
        "Asked for 2 GPUs, but the policy /etc/gpukit/policy.toml allows 1 per user "
        f"(max_gpus_per_user) and {ME} already holds 1 ({gpu0.uuid}).",
        "Waiting cannot help: ask for fewer GPUs, or ask the administrator.",
    )


def test_with_settle_a_gpu_must_qualify_for_that_many_polls_in_a_row(clock: Clock) -> None:
    polls, read = _polls()
    statuses: list[str] = []
    with wait_and_claim(
        1, IDLE, settle=2, poll=5, timeout=600, read=read, on_status=statuses.append
    ) as held:
        assert held.indices == [0]
    assert (len(polls), clock.sleeps) == (2, [5])
    assert statuses == [
        "waiting for 1 GPU (no process on it): 4 of 4 qualify, 0 for 2 polls in a row"
    ]


@pytest.mark.parametrize(("earlier", "ahead"), [(1, "1 waiter"), (2, "2 waiters")])
def test_a_waiter_waits_behind_earlier_waiters_says_how_many_and_gives_up_naming_them(
    clock: Clock, earlier: int, ahead: str
) -> None:
    statuses: list[str] = []
    with contextlib.ExitStack() as stack:
        for _ in range(earlier):
            stack.enter_context(Ticket())
        with pytest.raises(WaitTimeoutError) as caught:
            wait_and_claim(1, IDLE, timeout=3, poll=2, on_status=statuses.append)
    assert statuses == [f"waiting for 1 GPU (no process on it): 4 of 4 qualify; {ahead} ahead"] * 3
    assert clock.sleeps == [2, 1]
    assert (caught.value.message, caught.value.hint) == (
        "Waited 3 s for GPUs, in vain. Asked for 1 GPU with no process on it: 4 of 4 qualify.\n"
        f"{ahead.replace('waiter', 'earlier waiter')} still in line.",
        GAVE_UP,
    )
    assert current_claims() == {}


def test_a_waiter_at_its_users_limit_is_not_waited_for_and_gives_up_naming_the_limit(
    other: Path, clock: Clock
) -> None:
    gpu0 = inventory().gpus[0]
    statuses: list[str] = []
    with (
        claim([gpu0], command="python eval.py", folder=other),
        Ticket(other),  # an earlier waiter of the same user, as held back by the limit
        pytest.raises(WaitTimeoutError) as caught,
    ):
        wait_and_claim(
            1, IDLE, timeout=3, poll=2, policy=POLICY, folder=other, on_status=statuses.append
        )
    limited = "waiting for 1 GPU (no process on it): 3 of 4 qualify; user limit 1 reached"
    assert statuses == [limited] * 3
    assert caught.value.message == (
        "Waited 3 s for GPUs, in vain. Asked for 1 GPU with no process on it: 3 of 4 qualify."
        + _claimed_by_me(0)
        + "\nAsked for 1 GPU, but the policy /etc/gpukit/policy.toml allows 1 per user "
        f"(max_gpus_per_user) and {ME} already holds 1 ({gpu0.uuid})."
    )


def test_a_claim_that_would_put_the_user_past_the_limit_after_all_is_given_back(
    monkeypatch: pytest.MonkeyPatch, other: Path, clock: Clock
) -> None:
    gpus = inventory().gpus
    real = tickets.claim
    raced: list[Claim] = []

    def claim_while_another_process_of_the_user_claims(gpus_: list[object], **kw: object) -> Claim:
        got = real(gpus_, **kw)  # type: ignore[arg-type]
        if not raced:
            raced.append(real([gpus[3]], folder=other))
        return got

    monkeypatch.setattr(tickets, "claim", claim_while_another_process_of_the_user_claims)
    with pytest.raises(WaitTimeoutError):
        wait_and_claim(1, IDLE, timeout=3, poll=2, policy=POLICY, folder=other)
    assert list(current_claims(other)) == [gpus[3].uuid]
    raced[0].release()


def test_giving_up_while_too_few_qualify_explains_each_gpu_and_waits_no_longer_than_asked(
    clock: Clock,
) -> None:
    with (
        claim(inventory().gpus, command="python eval.py"),
        pytest.raises(WaitTimeoutError) as caught,
    ):
        wait_and_claim(1, IDLE, timeout=4.5, poll=2)
    assert clock.sleeps == [2, 2, 0.5]
    assert (caught.value.message, caught.value.hint, caught.value.exit_code) == (
        "Waited 4.5 s for GPUs, in vain. Asked for 1 GPU with no process on it: 0 of 4 qualify."
        + _claimed_by_me(0, 1, 2, 3),
        GAVE_UP,
        124,
    )


def test_giving_up_while_enough_qualify_but_not_for_settle_polls_says_so(clock: Clock) -> None:
    with pytest.raises(WaitTimeoutError) as caught:
        wait_and_claim(4, IDLE, settle=3, timeout=1, poll=1)
    assert clock.sleeps == [1]
    assert caught.value.message == (
        "Waited 1 s for GPUs, in vain. Asked for 4 GPUs with no process on it: 4 of 4 qualify.\n"
        "Only 0 qualified for 3 polls in a row (--settle)."
    )
