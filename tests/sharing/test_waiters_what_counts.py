"""What counts as a waiter in the line, and what every other entry of the queue folder reads as.

Each test plants in the queue folder what a co-user (or a race with one) can put there and
states, word for word, what ``read_queue`` reports: the waiters in ``waiters``, everything else
in ``foreign`` with the reason ``gpukit queue`` shows.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pwd
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import gpukit.sharing.waiters as waiters_module
from gpukit.errors import UnsafeLockFileError
from gpukit.sharing.tickets import Ticket
from gpukit.sharing.waiters import TICKET_SCHEMA, read_queue
from tests.helpers import NOBODY, as_root

EARLY = "00000000000000000001-1-aaaaaaaa.ticket"
LATER = "00000000000000000002-1-bbbbbbbb.ticket"
ME = pwd.getpwuid(os.getuid()).pw_name
Hold = Callable[..., int]


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    return folder


@pytest.fixture
def queue(locks: Path) -> Path:
    path = locks / "queue"
    path.mkdir(parents=True)
    return path


def _record(**changes: object) -> dict[str, object]:
    record: dict[str, object] = {
        "schema": TICKET_SCHEMA,
        "pid": os.getpid(),
        "user": ME,
        "uid": os.getuid(),
        "n": 1,
        "criteria": "",
        "command": "python train.py",
        "since": 1700000000.0,
    }
    record.update(changes)
    return record


@pytest.fixture
def hold() -> Iterator[Hold]:
    """Write a record into a file and hold its lock from this process, as a waiter does."""
    fds: list[int] = []

    def hold(path: Path, record: dict[str, object] | bytes | None = None) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        fds.append(fd)
        data = json.dumps(_record()).encode() if record is None else record
        os.write(fd, data if isinstance(data, bytes) else json.dumps(data).encode())
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    yield hold
    for fd in fds:
        os.close(fd)


def _foreign(folder: Path | None = None) -> list[tuple[str, str]]:
    return [(f.name, f.why) for f in read_queue(folder).foreign]


def test_a_waiters_json_holds_every_field_of_its_ticket(queue: Path, hold: Hold) -> None:
    hold(queue / EARLY, _record(n=2, criteria="at most 10% busy", since=1700000000.5))
    (waiter,) = read_queue().waiters
    assert waiter.to_json() == {
        "position": 1,
        "pid": os.getpid(),
        "user": ME,
        "uid": os.getuid(),
        "n": 2,
        "criteria": "at most 10% busy",
        "command": "python train.py",
        "since": 1700000000.5,
        "ticket": EARLY,
        "arrived_ns": os.stat(queue / EARLY).st_ctime_ns,
        "wants": None,
    }


def test_looking_at_the_line_removes_nothing_not_even_your_own_abandoned_ticket(
    queue: Path,
) -> None:
    # `gpukit queue` only looks; a waiter tidies its own user's dead tickets as it waits.
    (queue / EARLY).write_text(json.dumps(_record()))
    assert _foreign() == [(EARLY, "not held by a live waiter")]
    assert (queue / EARLY).exists()
    with Ticket() as waiter:
        assert waiter.ahead() == 0
    assert not (queue / EARLY).exists()


def test_a_ticket_still_being_written_under_a_hidden_name_is_neither_waiter_nor_foreign(
    queue: Path, hold: Hold
) -> None:
    # A ticket is made as ".<name>", locked and written, then renamed: until then it is no one's
    # place in line, and nothing to report either.
    hold(queue / f".{EARLY}")
    (queue / ".notes").write_text("")
    assert read_queue() == waiters_module.Queue()


def test_a_stray_file_named_before_every_ticket_hides_none_of_them(queue: Path, hold: Hold) -> None:
    (queue / "00-read-me.txt").write_text("")  # "-" sorts before every digit
    hold(queue / EARLY)
    line = read_queue()
    assert [w.ticket for w in line.waiters] == [EARLY]
    assert [(f.name, f.why) for f in line.foreign] == [("00-read-me.txt", "not a ticket")]


def test_a_socket_named_like_a_ticket_is_reported_as_a_socket(
    queue: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(queue)  # a socket's path is limited to 108 bytes: bind a short one
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(EARLY)
        assert _foreign() == [(EARLY, "a socket")]


def test_a_device_named_like_a_ticket_is_not_a_regular_file(queue: Path) -> None:
    try:
        os.mknod(queue / EARLY, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
    except PermissionError:
        pytest.skip("cannot make a device node here (needs CAP_MKNOD)")
    assert _foreign() == [(EARLY, "not a regular file")]


@pytest.mark.usefixtures("alarm")
def test_a_fifo_or_folder_a_co_user_holds_a_lock_on_is_reported_by_its_kind_without_blocking(
    queue: Path,
) -> None:
    os.mkfifo(queue / EARLY)
    (queue / LATER).mkdir()
    fds = [os.open(queue / name, os.O_RDONLY | os.O_NONBLOCK) for name in (EARLY, LATER)]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX)  # now the kernel's lock table lists both
        assert _foreign() == [(EARLY, "a FIFO"), (LATER, "a folder")]
    finally:
        for fd in fds:
            os.close(fd)


def test_a_ticket_that_disappears_between_listing_and_reading_is_gone(
    queue: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (queue / EARLY).write_text(json.dumps(_record()))  # no one holds it: its waiter died
    real = waiters_module.exclusive_flocks

    def removed_meanwhile() -> dict[int, frozenset[int]] | None:
        (queue / EARLY).unlink(missing_ok=True)
        return real()

    monkeypatch.setattr(waiters_module, "exclusive_flocks", removed_meanwhile)
    assert _foreign() == [(EARLY, "gone")]
    with Ticket() as waiter:  # a waiter's own look, which tidies, meets the same race
        (queue / EARLY).write_text(json.dumps(_record()))
        assert [(f.name, f.why) for f in waiter.read_queue().foreign] == [(EARLY, "gone")]


def test_a_held_ticket_renamed_over_another_while_the_line_is_read_counts_for_neither(
    queue: Path, hold: Hold, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold(queue / EARLY)
    hold(queue / LATER)
    real = waiters_module.exclusive_flocks

    def renamed_meanwhile() -> dict[int, frozenset[int]] | None:
        os.rename(queue / LATER, queue / EARLY)  # both stay locked by their open descriptors
        return real()

    monkeypatch.setattr(waiters_module, "exclusive_flocks", renamed_meanwhile)
    line = read_queue()
    assert line.waiters == ()
    assert [(f.name, f.why) for f in line.foreign] == [
        (EARLY, "replaced while read"),
        (LATER, "gone"),
    ]


@pytest.mark.usefixtures("alarm")
def test_an_unsafe_entry_removed_while_it_is_refused_is_gone(
    queue: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.mkfifo(queue / EARLY)
    fd = os.open(queue / EARLY, os.O_RDONLY | os.O_NONBLOCK)
    fcntl.flock(fd, fcntl.LOCK_EX)
    real = waiters_module.open_lock_file

    def refused_then_removed(folder: Path, name: str, **kwargs: object) -> int:
        try:
            return real(folder, name, **kwargs)  # type: ignore[arg-type]
        except UnsafeLockFileError:
            (queue / name).unlink()
            raise

    monkeypatch.setattr(waiters_module, "open_lock_file", refused_then_removed)
    try:
        assert _foreign() == [(EARLY, "gone")]
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "changes",
    [{"n": 0}, {"n": -2}, {"since": math.inf}, {"since": -math.inf}, {"since": math.nan}],
    ids=["n=0", "n=-2", "since=inf", "since=-inf", "since=nan"],
)
def test_a_ticket_for_no_gpus_or_from_no_time_is_no_valid_record(
    queue: Path, hold: Hold, changes: dict[str, object]
) -> None:
    hold(queue / EARLY, _record(**changes))
    line = read_queue()
    assert line.waiters == ()
    assert [(f.name, f.why.partition(":")[0]) for f in line.foreign] == [
        (EARLY, "no valid waiter record")
    ]


def _command_for_a_record_of(size: int) -> str:
    """The command that makes a ticket's JSON record exactly ``size`` bytes long."""
    command = "x" * (size - len(json.dumps(_record(command="")).encode()))
    assert len(json.dumps(_record(command=command)).encode()) == size
    return command


def test_a_record_of_exactly_64_kib_counts_and_one_byte_more_does_not(
    queue: Path, hold: Hold
) -> None:
    longest = _command_for_a_record_of(64 * 1024)
    hold(queue / EARLY, _record(command=longest))
    hold(queue / LATER, _record(command=_command_for_a_record_of(64 * 1024 + 1)))
    line = read_queue()
    assert [(w.ticket, w.command) for w in line.waiters] == [(EARLY, longest)]
    assert [(f.name, f.why) for f in line.foreign] == [
        (LATER, "no valid waiter record: larger than 65536 bytes")
    ]


def test_a_ticket_held_by_another_process_than_its_record_names_says_which(
    queue: Path, hold: Hold
) -> None:
    hold(queue / EARLY, _record(pid=1))
    assert _foreign() == [(EARLY, f"held by pid {os.getpid()}, not by pid 1 its record names")]


def test_every_process_the_lock_table_names_for_a_ticket_is_listed_in_order(
    queue: Path, hold: Hold, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The table is keyed by inode number alone, so files of two file systems can share one.
    hold(queue / EARLY, _record(pid=1))
    inode = os.stat(queue / EARLY).st_ino
    monkeypatch.setattr(
        waiters_module, "exclusive_flocks", lambda: {inode: frozenset({4242, 17, 300})}
    )
    assert _foreign() == [(EARLY, "held by pid 17, 300, 4242, not by pid 1 its record names")]


@as_root
def test_a_ticket_held_by_a_process_of_another_user_than_its_owner_is_refused(
    queue: Path, hold: Hold
) -> None:
    # The ticket file, its record and its user all say "nobody"; the process holding it is root's.
    hold(queue / EARLY, _record(uid=NOBODY, user="nobody"))
    os.chown(queue / EARLY, NOBODY, NOBODY)
    line = read_queue()
    assert line.waiters == ()
    assert [(f.name, f.why) for f in line.foreign] == [
        (EARLY, f"its process {os.getpid()} runs as root, not as nobody")
    ]


def test_the_line_is_read_in_the_queue_folder_that_was_opened_not_one_put_in_its_place(
    locks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = waiters_module.open_folder
    moved = tmp_path / "moved"

    def swapped(path: Path, *, create: bool = False) -> int:
        fd = real(path, create=create)
        os.rename(path, moved)  # a co-user swaps the checked folder for another
        os.mkdir(path)
        return fd

    with Ticket() as waiter:
        with monkeypatch.context() as patch:
            patch.setattr(waiters_module, "open_folder", swapped)
            line = read_queue()
        os.rmdir(waiter.queue)
        os.rename(moved, waiter.queue)
    assert [w.ticket for w in line.waiters] == [waiter.name]


def test_a_waiter_tidies_its_abandoned_tickets_in_the_folder_it_joined_not_a_new_one(
    locks: Path, tmp_path: Path
) -> None:
    with Ticket() as waiter:
        (waiter.queue / EARLY).write_text(json.dumps(_record()))  # its waiter died
        moved = tmp_path / "moved"
        os.rename(waiter.queue, moved)
        os.mkdir(waiter.queue)
        assert [(f.name, f.why) for f in waiter.read_queue().foreign] == [
            (EARLY, "not held by a live waiter")
        ]
        assert sorted(os.listdir(moved)) == [waiter.name]
        os.rmdir(waiter.queue)
        os.rename(moved, waiter.queue)


def test_junk_in_the_queue_folder_is_counted_past_the_first_few_and_hides_no_waiter(
    queue: Path, hold: Hold
) -> None:
    for i in range(300):
        (queue / f"junk-{i:04d}").touch()
        (queue / f"{i:020d}-1-cccccccc.ticket").touch()  # named before every real ticket
    with Ticket() as honest:
        line = read_queue()
        assert [w.ticket for w in line.waiters] == [honest.name]
        assert len(line.foreign) == waiters_module.MOST_FOREIGN
        assert [f.name for f in line.foreign] == sorted(f.name for f in line.foreign)
        assert line.foreign[0] == waiters_module.Foreign(
            f"{0:020d}-1-cccccccc.ticket", "not held by a live waiter"
        )
        assert line.foreign_not_listed == 600 - waiters_module.MOST_FOREIGN
