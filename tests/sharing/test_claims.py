"""gk.claim, the lock folder, and the line of waiters: what other gpukit users can rely on."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import getpass
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from gpukit.errors import (
    ClaimError,
    InvalidArgumentError,
    LockFolderError,
    NoGpuAvailableError,
    WaitTimeoutError,
)
from gpukit.gpus.criteria import Criteria
from gpukit.gpus.inventory import GpuProcess, Inventory, inventory
from gpukit.holders import Holder
from gpukit.sharing import claims, ledger
from gpukit.sharing.claims import _read_holder, claim, current_claims, holder_of
from gpukit.sharing.lock_folder import lock_folder
from gpukit.sharing.tickets import Ticket, wait_and_claim
from tests.helpers import MACHINES, ROOT

L4 = MACHINES / "server-4xL4-idle.json"
UUID_A = "GPU-00000000-0000-0000-0000-00000000000a"
UUID_B = "GPU-00000000-0000-0000-0000-00000000000b"


@pytest.fixture(autouse=True)
def locks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    folder = tmp_path / "locks"
    monkeypatch.setenv("GPUKIT_LOCK_DIR", str(folder))
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(L4))
    return folder


def _holder_process(uuid: str) -> subprocess.Popen[str]:
    """Another process that claims ``uuid`` and then sleeps, printing 'held' once it holds it."""
    code = (
        "import sys, time; from gpukit.sharing.claims import claim; "
        f"c = claim([{uuid!r}], command='other job'); print('held', flush=True); time.sleep(60)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_claim_records_who_holds_it_for_gpukit_list() -> None:
    with claim([UUID_A], command="python train.py"):
        holder = current_claims()[UUID_A]
    assert (holder.pid, holder.command) == (os.getpid(), "python train.py")
    assert holder.user
    assert holder.since
    assert holder.since <= time.time()


def test_a_claimed_gpu_cannot_be_claimed_again_until_released() -> None:
    first = claim([UUID_A])
    with pytest.raises(ClaimError, match=f"{UUID_A} by"):
        claim([UUID_A])
    first.release()
    assert claim([UUID_A]).held


def test_claims_are_all_or_nothing() -> None:
    with claim([UUID_B]), pytest.raises(ClaimError):
        claim([UUID_A, UUID_B])
    assert UUID_A not in current_claims()
    assert claim([UUID_A]).held


def test_released_claims_are_not_listed() -> None:
    held = claim([UUID_A, UUID_B])
    assert set(current_claims()) == {UUID_A, UUID_B}
    held.release()
    assert current_claims() == {}


def test_a_claim_held_by_another_process_names_it_in_the_error() -> None:
    other = _holder_process(UUID_A)
    try:
        with pytest.raises(ClaimError, match=f"pid {other.pid}: other job"):
            claim([UUID_A])
    finally:
        other.kill()
        other.wait()


def test_the_claim_of_a_killed_process_is_gone_at_once() -> None:
    other = _holder_process(UUID_A)
    assert current_claims()[UUID_A].pid == other.pid
    other.send_signal(signal.SIGKILL)
    other.wait()
    assert current_claims() == {}
    assert claim([UUID_A]).held


def test_a_record_left_without_a_lock_is_not_a_claim(locks: Path) -> None:
    locks.mkdir(parents=True)
    record = {"user": "ghost", "pid": 1, "host": "h", "command": "x", "since": 0}
    (locks / f"{UUID_A}.lock").write_text(json.dumps(record))
    assert holder_of(locks / f"{UUID_A}.lock") is None
    assert current_claims() == {}


def test_the_lock_folder_and_files_are_writable_by_every_user(locks: Path) -> None:
    claim([UUID_A]).release()
    folder_mode = stat.S_IMODE(lock_folder().stat().st_mode)
    assert folder_mode == 0o1777  # sticky: users cannot delete each other's files
    assert stat.S_IMODE((locks / f"{UUID_A}.lock").stat().st_mode) == 0o666


def test_a_child_process_does_not_inherit_the_claim() -> None:
    with claim([UUID_A]) as held:
        child = subprocess.Popen(["sleep", "30"], close_fds=False)
        try:
            held.release()
            assert current_claims() == {}  # the child lives on, the claim does not
        finally:
            child.kill()
            child.wait()


def test_claim_refuses_things_that_are_not_gpus() -> None:
    with pytest.raises(ValueError, match="Cannot claim"):
        claim([3])  # type: ignore[list-item]


def test_waiters_are_counted_in_arrival_order_and_a_dead_one_is_skipped() -> None:
    first = Ticket()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    code = (
        "from gpukit.sharing.tickets import Ticket; t = Ticket(); print('in', flush=True); input()"
    )
    middle = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert middle.stdout is not None
    assert middle.stdout.readline().strip() == "in"
    last = Ticket()
    assert (first.ahead(), last.ahead()) == (0, 2)
    middle.kill()
    middle.wait()
    assert last.ahead() == 1
    first.close()
    assert last.ahead() == 0
    last.close()


def test_waiting_gives_up_after_the_timeout_and_leaves_no_ticket(locks: Path) -> None:
    gpus = inventory().gpus
    with claim(gpus), pytest.raises(WaitTimeoutError) as info:
        wait_and_claim(1, Criteria.make(), timeout=0.2, poll=0.05)
    assert info.value.exit_code == 124
    assert [p for p in (locks / "queue").iterdir()] == []


def test_waiting_fails_at_once_when_no_gpu_could_ever_qualify() -> None:
    start = time.monotonic()
    with pytest.raises(NoGpuAvailableError, match="Waiting cannot help"):
        wait_and_claim(1, Criteria.make(min_free="100GiB"), timeout=30, poll=0.05)
    assert time.monotonic() - start < 5


def test_waiting_claims_only_gpus_that_stayed_free_for_settle_polls() -> None:
    idle = inventory()
    busy_gpu = replace(idle.gpus[0], processes=(GpuProcess(9, "bob", "loading", None),))
    # GPU 0 looks free on every other poll (a neighbour still loading): never settled.
    flicker = Inventory(gpus=(busy_gpu, *idle.gpus[1:]))
    readings = iter([idle, flicker, idle, flicker, idle, idle, idle, idle])
    only_gpu0 = Criteria.make(exclude=[1, 2, 3])
    polls = []

    def read() -> Inventory:
        polls.append(1)
        return next(readings)

    with wait_and_claim(1, only_gpu0, settle=3, poll=0.01, read=read) as held:
        assert held.indices == [0]
    assert len(polls) == 7  # three idle readings in a row first happen at the 7th


def test_waiting_reports_its_status() -> None:
    seen: list[str] = []
    with claim(inventory().gpus), pytest.raises(WaitTimeoutError):
        wait_and_claim(2, Criteria.make(), timeout=0.1, poll=0.05, on_status=seen.append)
    assert seen
    assert "waiting for 2 GPUs" in seen[0]
    assert "0 of 4 qualify" in seen[0]


def test_a_timeout_while_gpus_qualify_says_they_had_not_settled_yet() -> None:
    with pytest.raises(WaitTimeoutError, match=r"Only 0 qualified for 3 polls in a row"):
        wait_and_claim(1, Criteria.make(), timeout=0, settle=3, poll=0.01)


def test_why_a_timed_out_wait_missed_qualifying_gpus_is_a_line_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lost = L4.parent / "kaggle-2xT4-one-lost.json"
    monkeypatch.setenv("GPUKIT_FAKE_NVML", str(lost))
    with pytest.raises(WaitTimeoutError) as caught:
        wait_and_claim(1, Criteria.make(), timeout=0, settle=3, poll=0.01)
    lines = caught.value.message.splitlines()
    assert lines[-2:] == [
        "  GPU 1: unreadable by NVML (GPU is lost)",
        "Only 0 qualified for 3 polls in a row (--settle).",
    ]


# -- what a record says, and what the user reads, at the exact limits -----------------------------


@pytest.mark.parametrize(
    ("holder", "shown"),
    [
        (Holder("bob", 4242, "h", "python train.py", 1.0), "bob (pid 4242: python train.py)"),
        (Holder(None, None, None, None, None), "? (pid ?)"),
        (Holder("bob", 0, None, "c" * 41, None), "bob (pid 0: " + "c" * 40 + ")"),
        (Holder("bob", 7, None, None, None, problem="a FIFO"), "? (a FIFO)"),
    ],
    ids=repr,
)
def test_a_holder_is_described_in_one_short_line(holder: Holder, shown: str) -> None:
    assert holder.describe() == shown


@pytest.mark.parametrize(
    ("field", "value", "read"),
    [
        ("pid", 1, 1),
        ("pid", 0, None),
        ("pid", 2**31 - 1, 2**31 - 1),
        ("pid", 2**31, None),
        ("pid", 42.0, 42),
        ("pid", 42.5, None),
        ("since", 0, 0.0),
        ("since", -1, None),
        ("since", 1e12, 1e12),
        ("since", 1e12 + 1, None),
        ("user", "u" * 65, "u" * 64),
        ("user", "", None),
        ("host", "h" * 256, "h" * 255),
        ("command", "c" * 501, "c" * 500),
        ("command", 5, None),
    ],
    ids=repr,
)
def test_each_field_of_a_record_is_kept_only_within_its_limits(
    field: str, value: object, read: object
) -> None:
    record = {"user": "ann", "pid": 5, "host": "box", "command": "run", "since": 3.0}
    holder = _read_holder(json.dumps({**record, field: value}).encode())
    assert getattr(holder, field) == read
    others = {k: v for k, v in asdict(holder).items() if k not in (field, "problem")}
    assert others == {k: v for k, v in record.items() if k != field}


def test_a_claim_says_which_gpus_it_holds_until_released(locks: Path) -> None:
    inv = inventory()
    held = claim([inv.gpu(1), inv.gpu(3)], command="python train.py")
    assert held.uuids == [inv.gpu(1).uuid, inv.gpu(3).uuid]
    assert held.indices == [1, 3]
    assert held.held
    assert repr(held) == f"Claim({inv.gpu(1).uuid}, {inv.gpu(3).uuid}, held)"
    assert held.folder == locks
    held.release()
    held.release()  # twice is harmless
    assert not held.held
    assert held.uuids == []
    assert repr(held) == "Claim(-, released)"
    assert (locks / f"{inv.gpu(1).uuid}.lock").read_bytes() == b""  # reads as free at once
    by_uuid = claim([UUID_A, f"MIG-{UUID_A[4:]}"])
    assert by_uuid.indices == []
    by_uuid.release()


def test_the_record_names_this_user_process_host_and_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py", "--epochs", "3"])
    before = time.time()
    with claim([UUID_A]):
        holder = current_claims()[UUID_A]
    assert holder == Holder(
        getpass.getuser(), os.getpid(), socket.gethostname(), "train.py --epochs 3", holder.since
    )
    assert holder.since is not None
    assert before <= holder.since <= time.time()
    monkeypatch.setattr(sys, "argv", [])
    with claim([UUID_A]):
        assert current_claims()[UUID_A].command is None


@pytest.mark.parametrize(
    ("gpus", "message", "hint"),
    [
        (
            [3],
            "Cannot claim 3: claims need GPUs (from gk.pick() or gk.inventory()) or UUIDs.",
            "Pass gk.pick(n), or `inv.gpu(i)` for the GPU with nvidia-smi index i.",
        ),
        (
            ["GPU-a/../b"],
            "Cannot claim a GPU with UUID 'GPU-a/../b'.",
            "Claim GPUs from gk.inventory() or gk.pick(), or their GPU- UUIDs.",
        ),
        (
            [UUID_A, UUID_B, UUID_A],
            f"Cannot claim {UUID_A}, {UUID_B}, {UUID_A}: a GPU is listed twice.",
            "List each GPU once.",
        ),
    ],
    ids=["not a GPU", "a path", "twice"],
)
def test_claiming_what_is_not_a_gpu_once_is_refused_saying_what_to_pass(
    locks: Path, gpus: list[object], message: str, hint: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        claim(gpus)  # type: ignore[arg-type]
    assert (caught.value.message, caught.value.hint) == (message, hint)
    assert not locks.exists() or os.listdir(locks) == []


def test_a_refused_claim_names_each_taken_gpu_and_its_holder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with claim([UUID_B], command="python b.py"), pytest.raises(ClaimError) as caught:
        claim([UUID_A, UUID_B])
    me = f"{getpass.getuser()} (pid {os.getpid()}: python b.py)"
    assert caught.value.message == f"Cannot claim 2 GPU(s): {UUID_B} by {me} already claimed."
    assert caught.value.hint == (
        "Pick other GPUs (`gpukit pick` skips claimed ones), or wait with `gpukit run --wait`."
    )


def test_only_lock_files_in_the_folder_are_read_as_claims(locks: Path) -> None:
    assert current_claims() == {}  # no folder yet: nothing claimed
    assert holder_of(locks / f"{UUID_A}.lock") is None
    with claim([UUID_A]):
        for name in (f".{UUID_B}.lock", f"{UUID_B}.lck", f"{UUID_B}.lock.tmp"):
            fd = os.open(locks / name, os.O_RDWR | os.O_CREAT, 0o600)
            os.write(fd, b'{"user": "eve"}')
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                assert list(current_claims()) == [UUID_A]
            finally:
                os.close(fd)
        assert holder_of(locks / f"{UUID_A}.lock") == current_claims()[UUID_A]
    (locks / f"{UUID_B}.lock").write_bytes(b" \n")
    assert holder_of(locks / f"{UUID_B}.lock") is None  # blank: no holder yet


def test_a_claim_the_ledger_cannot_record_still_holds_and_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def full(*args: object, **kwargs: object) -> str:
        raise ledger.LedgerError("The ledger is full.")

    monkeypatch.setattr(ledger, "record_start", full)
    with pytest.warns(
        RuntimeWarning, match=r"^The ledger is full\. The claim is not in the ledger\.$"
    ):
        held = claim([UUID_A])
    assert held.held
    assert UUID_A in current_claims()
    held.release()


def test_the_ledger_records_each_claim_from_its_start_to_its_exit_code(locks: Path) -> None:
    inv = inventory()
    held = claim([inv.gpu(2)], command="python train.py")
    since = current_claims()[inv.gpu(2).uuid].since
    held.release(exit_code=3)
    (run,) = ledger.read_runs(locks)
    assert (run.gpus, run.indices, run.command, run.start) == (
        (inv.gpu(2).uuid,),
        (2,),
        "python train.py",
        since,
    )
    assert run.end is not None
    assert run.exit_code == 3
    assert not run.held


def test_a_claim_and_the_listing_use_the_folder_they_are_given(locks: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-locks"
    with claim([UUID_A], folder=other):
        assert list(current_claims(other)) == [UUID_A]
        assert current_claims() == {}  # the default folder holds nothing
    assert (other / f"{UUID_A}.lock").exists()


def test_a_lock_folder_swapped_after_it_was_opened_is_not_followed(
    monkeypatch: pytest.MonkeyPatch, locks: Path, tmp_path: Path
) -> None:
    # A co-user renames the checked folder away and puts another in its place: every file is
    # still opened in the folder that was checked, never by its path again.
    real = claims.opened_folder
    moved = tmp_path / "moved"

    @contextlib.contextmanager
    def swapped(path: Path, *, create: bool = False) -> Iterator[int]:
        with real(path, create=create) as fd:
            os.rename(path, moved)
            os.mkdir(path)
            try:
                yield fd
            finally:
                os.rmdir(path)
                os.rename(moved, path)

    with claim([UUID_A], command="first"):
        monkeypatch.setattr(claims, "opened_folder", swapped)
        assert holder_of(locks / f"{UUID_A}.lock") is not None
        assert list(current_claims()) == [UUID_A]
        with pytest.raises(ClaimError, match="first"):
            claim([UUID_A])
        with claim([UUID_B]):
            pass
        monkeypatch.undo()
    assert (locks / f"{UUID_B}.lock").exists()


def test_a_lock_file_that_cannot_be_opened_counts_as_held_and_says_why(
    monkeypatch: pytest.MonkeyPatch, locks: Path
) -> None:
    def refused(*args: object, **kwargs: object) -> int:
        raise LockFolderError("Its owner made it private.")

    claim([UUID_A]).release()
    monkeypatch.setattr(claims, "open_lock_file", refused)
    expected = Holder(
        None, None, None, None, None, problem="unreadable lock file: Its owner made it private."
    )
    assert holder_of(locks / f"{UUID_A}.lock") == expected
    assert current_claims() == {UUID_A: expected}


def test_a_lock_folder_that_cannot_be_listed_is_refused_saying_what_to_set(
    monkeypatch: pytest.MonkeyPatch, locks: Path
) -> None:
    claim([UUID_A]).release()

    def denied(path: object) -> list[str]:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(claims.os, "listdir", denied)
    with pytest.raises(LockFolderError) as caught:
        current_claims()
    assert (caught.value.message, caught.value.hint) == (
        f"Cannot list the lock folder {locks}: Permission denied.",
        "Set GPUKIT_LOCK_DIR to a folder every user of the GPUs can read.",
    )


def test_a_full_disk_names_the_lock_file_and_what_to_do(
    monkeypatch: pytest.MonkeyPatch, locks: Path
) -> None:
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(LockFolderError) as caught:
        claim([UUID_A])
    assert (caught.value.message, caught.value.hint) == (
        f"Cannot write the lock file {locks / (UUID_A + '.lock')}: No space left on device.",
        "Free space on its disk, or set GPUKIT_LOCK_DIR to a folder on a local disk that "
        "supports file locks.",
    )


def test_a_refused_claim_names_every_taken_gpu_and_leaves_no_file_open() -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with claim([UUID_A, UUID_B], command="job"):
        before = open_fds()
        with pytest.raises(ClaimError) as caught:
            claim([UUID_A, UUID_B])
        assert open_fds() == before
    me = f"{getpass.getuser()} (pid {os.getpid()}: job)"
    assert caught.value.message == (
        f"Cannot claim 2 GPU(s): {UUID_A} by {me}; {UUID_B} by {me} already claimed."
    )


def test_a_claim_lost_to_a_holder_that_then_died_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claims, "_lock_one", lambda *args: None)
    with pytest.raises(ClaimError) as caught:
        claim([UUID_A])
    assert caught.value.message == (
        f"Cannot claim 1 GPU(s): {UUID_A} by a process now gone already claimed."
    )


def test_a_claimer_that_meets_a_passing_reader_tries_again_and_gets_the_gpu(
    monkeypatch: pytest.MonkeyPatch, locks: Path
) -> None:
    claim([UUID_A]).release()
    reader = os.open(locks / f"{UUID_A}.lock", os.O_RDONLY)
    fcntl.flock(reader, fcntl.LOCK_SH)  # as holder_of() does for a moment
    waits: list[float] = []

    def reader_leaves(seconds: float) -> None:
        waits.append(seconds)
        os.close(reader)

    monkeypatch.setattr(claims.time, "sleep", reader_leaves)
    with claim([UUID_A]) as held:
        assert held.held
    assert len(waits) == 1
    assert 0 < waits[0] <= 0.1


def test_a_user_without_a_name_is_recorded_by_uid(
    monkeypatch: pytest.MonkeyPatch, locks: Path
) -> None:
    def nameless() -> str:
        raise KeyError("getpwuid(): uid not found")

    monkeypatch.setattr(getpass, "getuser", nameless)
    with claim([UUID_A]):
        # The record, as written; gpukit list shows the holder the kernel names instead.
        record = json.loads((locks / f"{UUID_A}.lock").read_text())
        assert record["user"] == str(os.getuid())


def test_release_gives_the_gpus_back_even_when_the_record_cannot_be_emptied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = claim([UUID_A])

    def failing(fd: int, length: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "ftruncate", failing)
    held.release()
    monkeypatch.undo()
    assert not held.held
    assert current_claims() == {}
