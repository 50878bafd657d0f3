"""The line of waiters: served in arrival order, and no co-user can jump ahead or jam it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gpukit.errors import LockFolderError
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.grants import Grant
from gpukit.gpus.inventory import inventory
from gpukit.sharing.claims import claim
from gpukit.sharing.policy import user_name
from gpukit.sharing.tickets import Ticket
from gpukit.sharing.waiters import TICKET_SCHEMA, read_queue
from tests.helpers import MACHINES, subprocess_env

L4 = MACHINES / "server-4xL4-idle.json"
EARLY = "00000000000000000000-1-ffffffff.ticket"


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    return folder


def _record(pid: int, **changes: object) -> dict[str, object]:
    record: dict[str, object] = {
        "schema": TICKET_SCHEMA,
        "pid": pid,
        "user": user_name(os.getuid()),
        "uid": os.getuid(),
        "n": 1,
        "criteria": "",
        "command": "forged",
        "since": 0.0,
    }
    record.update(changes)
    return record


_FORGER = """
import fcntl, json, os, sys
path, content = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
record = json.loads(content) if content else None
if isinstance(record, dict) and record.get("pid") == "self":
    record["pid"] = os.getpid()
if record is not None:
    os.write(fd, json.dumps(record).encode())
print(os.getpid(), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def forger() -> Iterator[object]:
    """Start plain Python processes that create a file, lock it and hold it, as a co-user can."""
    procs: list[subprocess.Popen[str]] = []

    def start(path: Path, record: dict[str, object] | None = None) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-c", _FORGER, str(path), json.dumps(record) if record else ""],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        return int(proc.stdout.readline())

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_ticket_with_an_early_name_made_after_yours_comes_after_yours(
    locks: Path, forger: object
) -> None:
    with Ticket(n=2, criteria=Criteria.make(max_util=10), command="python train.py") as honest:
        pid = forger(honest.queue / EARLY, _record("self"))  # type: ignore[operator]
        line = read_queue()
        assert [(w.position, w.pid, w.ticket) for w in line.waiters] == [
            (1, os.getpid(), honest.name),
            (2, pid, EARLY),
        ]
        assert honest.ahead() == 0


def test_read_line_reports_each_waiter_as_its_ticket_records_it(locks: Path) -> None:
    with Ticket(n=2, criteria=Criteria.make(max_util=10), command="python train.py") as mine:
        (waiter,) = read_queue().waiters
    assert (waiter.position, waiter.pid, waiter.uid, waiter.user) == (
        1,
        os.getpid(),
        os.getuid(),
        user_name(os.getuid()),
    )
    assert (waiter.n, waiter.criteria, waiter.command, waiter.ticket) == (
        2,
        "at most 10% busy, no process on it",
        "python train.py",
        mine.name,
    )
    assert waiter.wants == Criteria.make(max_util=10)
    assert abs(waiter.since - time.time()) < 60
    assert read_queue().waiters == ()  # closed: out of the line


def test_control_characters_in_a_ticket_reach_no_terminal(locks: Path) -> None:
    # A co-user's ticket is shown by `gpukit queue`: escape sequences in it could clear the
    # screen, retitle the terminal or recolour what follows.
    hostile = Criteria(max_util=10, exclude=("\x1b[2J\x1b]0;pwned\x07\r",))
    with Ticket(criteria=hostile, command="train\x1b[31m.py"):
        (waiter,) = read_queue().waiters
    assert (waiter.criteria, waiter.command) == (
        "at most 10% busy, no process on it, not ?[2J?]0;pwned??",
        "train?[31m.py",
    )


def test_a_later_honest_waiter_stays_behind_an_earlier_one(locks: Path) -> None:
    with Ticket() as first, Ticket() as second:
        assert (first.ahead(), second.ahead()) == (0, 1)
        assert [w.ticket for w in read_queue().waiters] == [first.name, second.name]


@pytest.mark.parametrize(
    ("record", "why"),
    [
        (None, "no valid waiter record"),
        ({"pid": "self", "schema": "other"}, "no valid waiter record"),
        ({"pid": "self", "n": "all"}, "no valid waiter record"),
        ({"pid": 1}, "not by pid 1 its record names"),
        ({"pid": "self", "uid": 4242}, "its record names uid 4242"),
        ({"pid": "self", "user": "somebody-else"}, "its record names somebody-else"),
    ],
)
def test_a_forged_ticket_in_front_is_ignored_and_reported(
    locks: Path, forger: object, record: dict[str, object] | None, why: str
) -> None:
    with Ticket() as honest:
        full = None if record is None else {**_record("self"), **record}
        forger(honest.queue / EARLY, full)  # type: ignore[operator]
        os.utime(honest.queue / EARLY, ns=(0, 0))
        line = read_queue()
        assert [w.ticket for w in line.waiters] == [honest.name]
        ((name, reason),) = [(f.name, f.why) for f in line.foreign]
        assert name == EARLY
        assert why in reason
        assert honest.ahead() == 0


def test_a_ticket_whose_waiter_died_is_ignored_and_tidied_away(locks: Path) -> None:
    with Ticket() as honest:
        dead = honest.queue / EARLY
        dead.write_text(json.dumps(_record(os.getpid())))  # well-formed, but no one locks it
        assert honest.ahead() == 0
        assert not dead.exists()


def test_links_fifos_and_folders_among_tickets_change_nothing_and_never_block(
    locks: Path, tmp_path: Path, forger: object
) -> None:
    with Ticket() as honest:
        queue = honest.queue
        # A real, locked, well-formed ticket elsewhere, reached through a link in the line.
        elsewhere = tmp_path / "elsewhere.ticket"
        forger(elsewhere, _record("self"))  # type: ignore[operator]
        (queue / "00000000000000000001-1-aaaaaaaa.ticket").symlink_to(elsewhere)
        os.link(elsewhere, queue / "00000000000000000002-1-bbbbbbbb.ticket")
        os.mkfifo(queue / "00000000000000000003-1-cccccccc.ticket")
        (queue / "00000000000000000004-1-dddddddd.ticket").mkdir()
        (queue / "notes.txt").write_text("hello")
        code = (
            "from gpukit.sharing.waiters import read_queue; line = read_queue(); "
            "print([w.pid for w in line.waiters]); "
            "print(sorted((f.name.lstrip('0'), f.why) for f in line.foreign))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=subprocess_env(GPUKIT_LOCK_DIR=str(locks)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            f"[{os.getpid()}]",
            str(
                [
                    ("1-1-aaaaaaaa.ticket", "a symbolic link"),
                    ("2-1-bbbbbbbb.ticket", "a file with 2 hard links"),
                    ("3-1-cccccccc.ticket", "a FIFO"),
                    ("4-1-dddddddd.ticket", "a folder"),
                    ("notes.txt", "not a ticket"),
                ]
            ),
        ]
        assert honest.ahead() == 0


def test_a_queue_folder_that_is_a_link_is_refused_not_followed(locks: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    with Ticket(elsewhere):
        locks.mkdir()
        (locks / "queue").symlink_to(elsewhere / "queue")
        with pytest.raises(LockFolderError, match="symbolic link") as info:
            read_queue(locks)
        assert info.value.exit_code == 5
        with pytest.raises(LockFolderError, match="symbolic link"):
            Ticket(locks)
        assert len(read_queue(elsewhere).waiters) == 1


def test_a_dead_waiter_leaves_the_line_at_once(locks: Path) -> None:
    code = (
        "from gpukit.sharing.tickets import Ticket; t = Ticket(); print('in', flush=True); input()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=subprocess_env(GPUKIT_LOCK_DIR=str(locks)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "in"
    with Ticket() as mine:
        assert [w.pid for w in read_queue().waiters] == [proc.pid, os.getpid()]
        proc.kill()
        proc.wait()
        assert mine.ahead() == 0
        assert [w.pid for w in read_queue().waiters] == [os.getpid()]


def test_claiming_with_a_forged_ticket_in_front_is_not_delayed(locks: Path, forger: object) -> None:
    from gpukit.gpus.criteria import Criteria
    from gpukit.sharing.tickets import wait_and_claim

    gpus = inventory().gpus
    queue = locks / "queue"
    with claim(gpus[1:]):
        queue.mkdir(parents=True)
        forger(queue / EARLY)  # type: ignore[operator]
        held = wait_and_claim(1, Criteria.make(), timeout=10, poll=0.01)
    with held:
        assert held.indices == [0]


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


def _finite(value: object) -> bool:
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except OverflowError:
        return False


@example(changes={"since": 10**400}, drop=set())
@given(
    changes=st.dictionaries(
        st.sampled_from(["schema", "pid", "user", "uid", "n", "criteria", "command", "since"]),
        _JSON,
        max_size=3,
    ),
    drop=st.sets(st.sampled_from(["pid", "user", "n", "since"]), max_size=2),
)
def test_a_ticket_record_is_accepted_only_with_every_field_of_the_right_type(
    changes: dict[str, object], drop: set[str]
) -> None:
    from gpukit.sharing.waiters import _record as parse

    raw = {k: v for k, v in {**_record(4242), **changes}.items() if k not in drop}
    parsed = parse(json.dumps(raw).encode())
    ids = {"pid": 1, "uid": 0, "n": 1}  # the least of each; all are 32-bit numbers
    good = (
        not drop
        and raw["schema"] == TICKET_SCHEMA
        and all(type(raw[k]) is int and low <= raw[k] < 2**32 for k, low in ids.items())  # type: ignore[operator]
        and all(type(raw[k]) is str for k in ("user", "criteria", "command"))
        and type(raw["since"]) in (int, float)
        and _finite(raw["since"])
        and abs(raw["since"]) <= 1e18  # type: ignore[arg-type]
    )
    assert isinstance(parsed, dict) == good


@given(st.binary(max_size=200))
def test_any_bytes_in_a_ticket_are_read_without_an_error(data: bytes) -> None:
    from gpukit.sharing.waiters import _record as parse

    parse(data)


def test_without_a_kernel_lock_table_a_ticket_counts_while_its_lock_is_held(
    locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpukit.sharing.waiters as waiters_module

    monkeypatch.setattr(waiters_module, "exclusive_flocks", lambda: None)  # as on macOS
    with Ticket() as honest:
        dead = honest.queue / EARLY
        dead.write_text(json.dumps(_record(os.getpid())))
        line = read_queue()
        assert [w.ticket for w in line.waiters] == [honest.name]
        assert [(f.name, f.why) for f in line.foreign] == [(EARLY, "not held by a live waiter")]


_UUIDS = [f"GPU-4a1d2e10-5b7c-4f3e-9d21-0c6e8f1a2b0{i}" for i in range(1, 4)]


@pytest.mark.parametrize(
    "criteria",
    [
        Criteria.make(min_free="20GB"),
        Criteria(min_free=1, max_processes=2),
        Criteria.make(max_util=10, exclude=[3, "GPU-4a1d2e10,x", *_UUIDS]),
        Criteria.make(exclude=",".join(_UUIDS)),
        Criteria(grant=Grant((4, 5), "CUDA_VISIBLE_DEVICES", "GPU-4a1d,5")),
    ],
    ids=["20GB", "1 byte and 2 processes", "indices and UUIDs", "UUIDs as one text", "a grant"],
)
def test_a_waiters_criteria_come_back_from_its_ticket_exactly(
    locks: Path, criteria: Criteria
) -> None:
    with Ticket(criteria=criteria):
        (waiter,) = read_queue().waiters
    assert waiter.wants == criteria
    assert waiter.criteria == criteria.describe()


_sizes = st.none() | st.integers(0, 2**100)
_counts = st.none() | st.integers(0, 2**32 - 1)


@given(
    min_free=_sizes,
    max_util=st.none() | st.integers(0, 100),
    max_processes=_counts,
    exclude=st.lists(st.integers(0, 2**32 - 1) | st.text(max_size=64), max_size=8),
    grant=st.none()
    | st.builds(
        Grant,
        st.lists(st.integers(0, 2**32 - 1), max_size=8).map(tuple),
        st.sampled_from(["CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS"]),
        st.text(max_size=64),
    ),
)
def test_criteria_written_as_json_read_back_equal(
    min_free: int | None,
    max_util: int | None,
    max_processes: int | None,
    exclude: list[int | str],
    grant: Grant | None,
) -> None:
    criteria = Criteria(min_free, max_util, max_processes, tuple(exclude), grant)
    assert Criteria.from_json(json.loads(json.dumps(criteria.to_json()))) == criteria


def test_a_waiter_excluding_thousands_of_gpus_keeps_its_place_with_criteria_unknown(
    locks: Path,
) -> None:
    criteria = Criteria(exclude=tuple(f"GPU-{i:036d}" for i in range(3000)))
    with Ticket(criteria=criteria, command="python train.py") as ticket:
        (waiter,) = read_queue().waiters
    assert (waiter.ticket, waiter.command, waiter.wants) == (ticket.name, "python train.py", None)
    assert criteria.describe().startswith(waiter.criteria)
