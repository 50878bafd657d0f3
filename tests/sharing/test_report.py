"""gpukit queue's view of a shared server: holders, waiters, unclaimed and idle use."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpukit.gpus.criteria import Criteria
from gpukit.gpus.grants import Grant
from gpukit.gpus.inventory import Inventory, inventory
from gpukit.sharing import tickets, waiters
from gpukit.sharing.claims import claim
from gpukit.sharing.report import sharing
from gpukit.sharing.waiters import Waiter
from tests.helpers import MACHINES

L4 = MACHINES / "server-4xL4-idle.json"
HOUR = 3600.0
UUID = "GPU-4a1d2e10-5b7c-4f3e-9d21-0c6e8f1a2b0"  # the 4xL4 server's, but for the last digit


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    return folder


@pytest.fixture
def machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[dict[int, list[dict[str, object]]]], Inventory]:
    """Read the 4xL4 server with processes on the GPUs given by index."""
    return lambda processes: _machine(tmp_path, monkeypatch, processes)


def _machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: dict[int, list[dict[str, object]]]
) -> Inventory:
    desc = json.loads(L4.read_text())
    for gpu in desc["gpus"]:
        gpu["processes"] = processes.get(gpu["index"], [])
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(desc))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(path))
    return inventory()


def _proc(pid: int, user: str = "bob") -> dict[str, object]:
    return {"pid": pid, "user": user, "name": "python train.py", "used_memory": 2**30}


def test_one_process_holding_two_gpus_is_one_holder_with_both_indices() -> None:
    inv = inventory()
    with claim([inv.gpu(3), inv.gpu(1)], command="python train.py"):
        [holder] = sharing(inv).holders
    assert (holder.gpus, holder.pid, holder.command) == ((1, 3), os.getpid(), "python train.py")


def test_a_holder_is_the_process_the_kernel_says_holds_the_lock_not_the_one_its_record_names() -> (
    None
):
    inv = inventory()
    with claim([inv.gpu(0)]) as held:
        fd = held._fds[inv.gpu(0).uuid]
        forged = {"user": "mallory", "pid": 1, "command": "innocent", "since": 1.0}
        data = json.dumps(forged).encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        [holder] = sharing(inv).holders
    assert (holder.pid, holder.user) == (os.getpid(), pwd.getpwuid(os.getuid()).pw_name)
    assert holder.command is not None
    assert "innocent" not in holder.command
    assert "python" in holder.command or "pytest" in holder.command


def test_a_child_of_the_holder_is_covered_by_its_claim_and_other_processes_are_not(
    machine: Callable[[dict[int, list[dict[str, object]]]], Inventory],
) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        inv = machine(
            {0: [_proc(child.pid), _proc(999_999_999, "eve")], 1: [_proc(child.pid)]},
        )
        with claim([inv.gpu(0)]):
            unclaimed = sharing(inv).unclaimed
    finally:
        child.kill()
        child.wait()
    assert [(u.gpu, u.pid, u.user) for u in unclaimed] == [
        (0, 999_999_999, "eve"),
        (1, child.pid, "bob"),
    ]


def test_a_process_on_a_gpu_nobody_claimed_is_unclaimed_use(
    machine: Callable[[dict[int, list[dict[str, object]]]], Inventory],
) -> None:
    inv = machine({2: [_proc(4242, "carol")]})
    [use] = sharing(inv).unclaimed
    assert (use.gpu, use.user, use.pid, use.command, use.memory) == (
        2,
        "carol",
        4242,
        "python train.py",
        2**30,
    )


def _idle_after(readings: list[Inventory], threshold: float) -> list[float]:
    """How long the claim looked idle at the last of ``readings`` ([] when not idle)."""
    result: list[float] = []
    for inv in readings:
        result = [i.idle_s for i in sharing(inv, idle_after=threshold).idle]
    return result


def test_a_claim_is_idle_once_close_readings_show_no_use_for_longer_than_the_threshold() -> None:
    inv = inventory()
    with claim([inv.gpu(0)]):
        t = inv.taken_at
        readings = [replace(inv, taken_at=t + k * 0.4 * HOUR) for k in range(4)]
        assert _idle_after(readings[:2], HOUR / 2) == []  # idle 0.4 h < 0.5 h
        assert _idle_after(readings[2:], HOUR / 2) == [pytest.approx(1.2 * HOUR)]


def test_a_gap_between_readings_longer_than_the_threshold_starts_the_count_again() -> None:
    inv = inventory()
    with claim([inv.gpu(0)]):
        t = inv.taken_at
        readings = [replace(inv, taken_at=t + h * HOUR) for h in (0, 0.4, 2.0, 2.4)]
        assert _idle_after(readings, HOUR / 2) == []


def test_a_busy_reading_starts_the_count_again(
    machine: Callable[[dict[int, list[dict[str, object]]]], Inventory],
) -> None:
    idle = inventory()
    busy = machine({0: [_proc(os.getpid())]})
    with claim([idle.gpu(0)]):
        t = idle.taken_at
        readings = [
            replace(idle, taken_at=t),
            replace(busy, taken_at=t + 0.4 * HOUR),
            replace(idle, taken_at=t + 0.8 * HOUR),
            replace(idle, taken_at=t + 1.2 * HOUR),
        ]
        assert _idle_after(readings, HOUR / 2) == []
        assert _idle_after([replace(idle, taken_at=t + 1.6 * HOUR)], HOUR / 2) == [
            pytest.approx(0.8 * HOUR)
        ]


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_idle_readings_in_a_file_another_user_planted_are_not_believed(locks: Path) -> None:
    inv = inventory()
    with claim([inv.gpu(0)]):
        sharing(inv, idle_after=60)  # keeps this user's readings
        path = locks / f"observed-{os.geteuid()}.json"
        data = json.loads(path.read_text())
        path.unlink()
        for key in data:
            data[key] = {"seen": inv.taken_at, "idle_since": inv.taken_at - 10 * HOUR}
        path.write_text(json.dumps(data))
        os.chown(path, 65534, 65534)
        later = replace(inv, taken_at=inv.taken_at + 30)
        with pytest.warns(RuntimeWarning, match="is not this user's file"):
            assert sharing(later, idle_after=60).idle == ()


_VICTIM = 65533  # an ordinary user, whom the sticky folder protects and binds


@pytest.mark.skipif(os.getuid() != 0, reason="acting as two other users needs root")
def test_a_co_user_who_takes_the_name_of_your_readings_first_cannot_hide_idle_claims(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import shutil
    import tempfile
    import warnings

    from gpukit.sharing.lockfiles import open_folder

    shared = Path(tempfile.mkdtemp(prefix="gpukit-observed-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        machine = shared / "machine.json"  # a copy the other user can read
        shutil.copy(L4, machine)
        machine.chmod(0o644)
        monkeypatch.setenv("GPUKIT_FAKE_NVML", str(machine))
        locks = shared / "locks"
        monkeypatch.setenv("GPUKIT_LOCK_DIR", str(locks))
        os.close(open_folder(locks, create=True))  # shared, 1777, as on a server
        theirs = locks / f"observed-{_VICTIM}.json"
        theirs.write_text("{}")
        os.chown(theirs, 65534, 65534)  # nobody took the name first
        inv = inventory()
        t = inv.taken_at
        readings = [replace(inv, taken_at=t + k * 0.4 * HOUR) for k in range(3)]
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the victim: claims a GPU, leaves it idle, runs gpukit queue three times
            code = 1
            try:
                os.close(read_end)
                os.setgroups([])
                os.setgid(_VICTIM)
                os.setuid(_VICTIM)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with claim([inv.gpu(0)]):
                        idle = _idle_after(readings, HOUR / 2)
                said = [str(w.message) for w in caught]
                os.write(write_end, json.dumps({"idle": idle, "warnings": said}).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            output = pipe.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        seen = json.loads(output)
        assert seen["idle"] == [pytest.approx(0.8 * HOUR)]
        assert any(f"kept in observed-{_VICTIM}.1.json" in w for w in seen["warnings"])
        assert theirs.read_text() == "{}"
        assert (locks / f"observed-{_VICTIM}.1.json").stat().st_uid == _VICTIM
    finally:
        shutil.rmtree(shared)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_every_name_of_your_readings_taken_is_said_not_hidden(locks: Path) -> None:
    inv = inventory()
    with claim([inv.gpu(0)]):
        for n in range(8):
            name = (
                f"observed-{os.geteuid()}.json" if n == 0 else f"observed-{os.geteuid()}.{n}.json"
            )
            (locks / name).write_text("{}")
            os.chown(locks / name, 65534, 65534)
        with pytest.warns(RuntimeWarning, match="every name for them is taken"):
            assert sharing(inv, idle_after=60).idle == ()


def _line(*waiters: tuple[int, int, Criteria | None]) -> object:
    """A line of waiters (uid, n, criteria) as sharing.waiters.read_queue gives it."""
    return SimpleNamespace(
        waiters=tuple(
            Waiter(
                position=i,
                pid=1000 + i,
                user=f"u{uid}",
                uid=uid,
                n=n,
                criteria="" if c is None else c.describe(),
                command="python train.py",
                since=i * 1.0,
                ticket=f"{i:020d}-{1000 + i}-0000000{i}.ticket",
                arrived_ns=i,
                wants=c,
            )
            for i, (uid, n, c) in enumerate(waiters, start=1)
        ),
        foreign=(),
        foreign_not_listed=0,
    )


def test_the_next_waiter_says_how_many_gpus_qualify_and_the_others_whom_they_are_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inv = inventory()
    line = _line((1, 2, Criteria()), (2, 1, Criteria()), (3, 1, Criteria.make(min_free="10GiB")))
    monkeypatch.setattr(waiters, "read_queue", lambda folder=None: line)
    with claim([inv.gpu(0), inv.gpu(1), inv.gpu(2)]):
        shown = sharing(inv).waiters
    assert [(w.position, w.user, w.n, w.criteria, w.reason) for w in shown] == [
        (1, "u1", 2, "no process on it", "1 of 2 GPUs qualify"),
        (2, "u2", 1, "no process on it", "behind position 1"),
        (3, "u3", 1, "at least 10 GiB free", "behind position 1"),
    ]


def test_a_waiter_held_back_by_its_user_limit_does_not_hold_up_the_next(
    monkeypatch: pytest.MonkeyPatch, locks: Path
) -> None:
    inv = inventory()
    me = os.getuid()
    line = _line((me, 1, Criteria()), (me + 4242, 1, Criteria()))
    monkeypatch.setattr(waiters, "read_queue", lambda folder=None: line)
    with claim([inv.gpu(0)]):
        policy = locks / "policy.toml"
        policy.write_text("[limits]\nmax_gpus_per_user = 1\n")
        policy.chmod(0o644)
        shown = sharing(inv).waiters
    assert [w.reason for w in shown] == [
        "user limit 1 reached",
        "its GPUs qualify: it claims them at its next poll",
    ]


def test_looking_at_a_machine_with_no_lock_folder_yet_does_not_create_one(locks: Path) -> None:
    state = sharing(inventory())
    assert (state.holders, state.waiters, state.idle) == ((), (), ())
    assert not locks.exists()


def test_what_is_in_the_queue_folder_but_is_no_waiter_is_listed_as_foreign_with_why(
    locks: Path,
) -> None:
    queue = locks / "queue"
    queue.mkdir(parents=True)
    os.mkfifo(queue / "00000000000000000001-1-aaaaaaaa.ticket")
    (queue / "00000000000000000002-1-bbbbbbbb.ticket").symlink_to(locks / "elsewhere")
    (queue / "00000000000000000003-1-cccccccc.ticket").write_text("{}")
    state = sharing(inventory())
    assert state.waiters == ()
    assert [(f.name[:20], f.why) for f in state.foreign] == [
        ("00000000000000000001", "a FIFO"),
        ("00000000000000000002", "a symbolic link"),
        ("00000000000000000003", "not held by a live waiter"),
    ]
    assert state.to_json()["foreign"][0] == {
        "name": "00000000000000000001-1-aaaaaaaa.ticket",
        "why": "a FIFO",
    }


def test_each_waiter_is_shown_with_its_command_with_no_control_character(locks: Path) -> None:
    with tickets.Ticket(command="python train.py \x1b]0;pwned\x07--lr 3"):
        (waiter,) = sharing(inventory(), observe=False).waiters
        shown = sharing(inventory(), observe=False).to_json()["waiters"][0]["command"]
    assert waiter.command == shown == "python train.py ?]0;pwned?--lr 3"


def _free_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, free: dict[int, int]) -> Inventory:
    """Read the 4xL4 server with the free memory given by GPU index."""
    desc = json.loads(L4.read_text())
    for gpu in desc["gpus"]:
        if gpu["index"] in free:
            gpu["memory_used"] = gpu["memory_total"] - gpu["memory_reserved"] - free[gpu["index"]]
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(desc))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(path))
    return inventory()


def test_a_waiter_for_20gb_is_judged_by_20_billion_bytes_not_by_the_rounded_sentence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 19.99e9 bytes free: below 20 GB, but above the 18.6 GiB the sentence rounds it to.
    inv = _free_on(tmp_path, monkeypatch, {0: 19_990_000_000, 1: 19_990_000_000})
    with tickets.Ticket(n=4, criteria=Criteria.make(min_free="20GB")):
        (waiter,) = sharing(inv, observe=False).waiters
    assert (waiter.criteria, waiter.reason) == ("at least 18.6 GiB free", "2 of 4 GPUs qualify")


@pytest.mark.parametrize(
    ("criteria", "qualify"),
    [
        (Criteria(min_free=1, max_processes=2), 4),
        (Criteria.make(exclude=[0, 2]), 2),
        (Criteria(exclude=(f"{UUID}1,GPU-x",)), 4),
        (Criteria.make(exclude=f"{UUID}1, {UUID}2, {UUID}3"), 1),
        (Criteria(grant=Grant((1, 2, 3), "CUDA_VISIBLE_DEVICES", "1,2,3"), exclude=(1,)), 2),
    ],
    ids=[
        "1 byte and 2 processes",
        "two indices",
        "an entry with a comma",
        "a list of UUIDs",
        "a grant",
    ],
)
def test_the_next_waiter_is_told_how_many_gpus_qualify_for_its_exact_criteria(
    criteria: Criteria, qualify: int
) -> None:
    with tickets.Ticket(n=8, criteria=criteria):
        (waiter,) = sharing(inventory(), observe=False).waiters
    assert waiter.reason == f"{qualify} of 8 GPUs qualify"


@pytest.mark.parametrize(
    "wants",
    [
        None,
        "at least 20 GB free",
        {
            "schema": "gpukit.criteria/1",
            "min_free": 2**101,
            "max_util": None,
            "max_processes": None,
            "exclude": [],
            "grant": None,
        },
        {
            "schema": "gpukit.criteria/1",
            "min_free": None,
            "max_util": None,
            "max_processes": None,
            "exclude": [[0]],
            "grant": None,
        },
        {
            "schema": "gpukit.criteria/1",
            "min_free": None,
            "max_util": None,
            "max_processes": None,
            "exclude": [],
            "grant": {"indices": ["4"], "variable": "CUDA_VISIBLE_DEVICES", "value": "4"},
        },
    ],
    ids=[
        "an older gpukit's ticket",
        "a sentence",
        "a size past 2**100",
        "a nested exclude",
        "a grant by text",
    ],
)
def test_a_waiter_whose_criteria_cannot_be_read_keeps_its_place_with_criteria_unknown(
    locks: Path, wants: object
) -> None:
    with tickets.Ticket(n=1) as ticket:
        record = json.loads(ticket.path.read_text())
        if wants is None:
            del record["wants"]
        else:
            record["wants"] = wants
        fd = os.open(ticket.path, os.O_WRONLY | os.O_TRUNC)
        os.write(fd, json.dumps(record).encode())
        os.close(fd)
        (waiter,) = sharing(inventory(), observe=False).waiters
    assert (waiter.position, waiter.reason) == (1, "next in line (criteria unknown)")
